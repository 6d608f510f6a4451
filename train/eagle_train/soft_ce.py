"""Fused linear + soft cross-entropy of one TTT step: ``sum_rows -sum_v p(v) log softmax(x W^T)(v)``.

Why: for a small drafter the draft head's logits ``[rows, N]`` dwarf everything else (N = 16-32k
draft tokens against H = 576 for SmolLM2), and the plain autograd path (``log_softmax``, the
teacher gather, the product, their backward, plus the recompute of a checkpoint) streams each
logit through memory ~30 times. With ``sum_v p = 1`` (the teacher is a softmax):

    CE(row) = logsumexp(z) - sum_v p(v) z(v),        dCE/dz = softmax(z) - p,        z = x W^T

so the forward keeps only ``logsumexp`` per row and the backward recomputes ``z`` chunk by chunk;
no ``[rows, N]`` tensor outlives its chunk (memory linear in the rows). On CUDA the two
elementwise + reduction parts are compiled (one fused kernel each; eager elsewhere, and eager
again if compilation fails). Shapes: ``x`` [n, H], ``w`` [N, H], ``teach`` [n_teacher, N] fp32,
``tc`` int64 [n] (teacher row of each row of ``x``).
"""

from __future__ import annotations

import torch

from eagle_train.compiled import compiled


def _stats(z: torch.Tensor, teach: torch.Tensor, tc: torch.Tensor):
    """Per row: ``logsumexp(z)``, ``sum_v p z``, ``argmax z`` (fp32 math) of a chunk ``z`` [c, N]."""
    zf = z.float()
    return torch.logsumexp(zf, -1), (teach[tc] * zf).sum(-1), zf.argmax(-1)


def _grad(z: torch.Tensor, lse: torch.Tensor, teach: torch.Tensor, tc: torch.Tensor, g: torch.Tensor):
    """``(softmax(z) - p) * g`` in ``z``'s dtype: the gradient of the chunk's summed CE w.r.t. ``z``."""
    return ((torch.exp(z.float() - lse[:, None]) - teach[tc]) * g).to(z.dtype)


def chunks(n: int, rows: int) -> list[tuple[int, int]]:
    """``[start, end)`` bounds of ``n`` rows in chunks of ``rows``, a last chunk of one row merged into
    the one before it: torch.compile specialises a size of 0 or 1 and would compile the two kernels
    again mid-training for it (seen on the H200 after the warm-up); one chunk of ``rows + 1`` is just
    another dynamic size."""
    bounds = [(i, min(i + rows, n)) for i in range(0, n, rows)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds


def _fn(name: str, device: torch.device):
    return compiled(f"soft_ce.{name}", {"stats": _stats, "grad": _grad}[name], device)


class _LinearSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, teach, tc, rows: int):
        n = x.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        arg = torch.empty(n, dtype=torch.int64, device=x.device)
        ce = torch.zeros((), dtype=torch.float32, device=x.device)
        stats = _fn("stats", x.device)
        for i, j in chunks(n, rows):
            lse_c, pz_c, arg_c = stats(x[i:j] @ w.T, teach, tc[i:j])
            lse[i:j], arg[i:j] = lse_c, arg_c
            ce = ce + (lse_c - pz_c).sum()
        ctx.save_for_backward(x, w, teach, tc, lse)
        ctx.rows = rows
        ctx.mark_non_differentiable(arg)
        return ce, arg

    @staticmethod
    def backward(ctx, g, _garg):
        x, w, teach, tc, lse = ctx.saved_tensors
        rows, n = ctx.rows, x.shape[0]
        gx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
        grad = _fn("grad", x.device)
        for i, j in chunks(n, rows):
            xc = x[i:j]
            gz = grad(xc @ w.T, lse[i:j], teach, tc[i:j], g.float())
            if gx is not None:
                gx[i:j] = gz @ w
            if gw is not None:
                gw += (gz.T @ xc).float()
        return gx, (gw.to(w.dtype) if gw is not None else None), None, None, None


def linear_soft_ce(x: torch.Tensor, w: torch.Tensor, teach: torch.Tensor, tc: torch.Tensor,
                   rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ce, argmax)``: fp32 scalar ``sum_rows -sum_v teach[tc] log softmax(x @ w.T)`` and int64 [n]
    ``argmax(x @ w.T)`` per row, in chunks of ``rows`` rows. Under autocast the matmuls run in the
    autocast dtype (as ``nn.Linear`` would); the softmax math is fp32.

    Args:
        x: [n, H] normed drafter states; w: [N, H] draft head weight.
        teach: [n_teacher, N] fp32 teacher probabilities (rows sum to 1); tc: int64 [n].
        rows: rows per chunk (>= 1; a last chunk of one row joins the one before, :func:`chunks`).
    """
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    from eagle_train.layers import cast_for_autocast

    x, w = cast_for_autocast(x), cast_for_autocast(w)
    if x.dtype != w.dtype:
        x = x.to(w.dtype)
    return _LinearSoftCE.apply(x, w, teach, tc, rows)
