"""Attention of the training-time test (TTT) in memory linear in the sequence length.

The TTT attention (SpecForge's ``cache_hidden`` scheme, :func:`ttt_attention_reference`): query
row ``t`` of step ``k`` attends to the step-0 keys at rows ``<= t`` that are valid, plus the key
of the SAME row ``t`` at steps ``1..k`` (the "diagonal extras"), in one joint fp32 softmax.

:func:`ttt_attention` computes exactly that without any ``T x T`` tensor:

1. the step-0 part is causal attention that also returns the row log-sum-exp
   ``lse0`` [B, h, T] (differentiable in both outputs): :class:`_ChunkedCausal` (flash-style
   forward/backward over query chunks with plain matmuls; saves q, k, v, o, lse only) everywhere,
   or compiled ``flex_attention`` on CUDA (:func:`_flex_causal`);
2. the extras are merged with the lse identity: with ``se_j = q . k_j * scale``,
   ``out = softmax([lse0, se_1..se_k]) . [o0, v_1..v_k]`` (:func:`_merge_extras`).

GQA: keys/values keep their ``nkv`` heads; query head ``i`` reads key head ``i // (nh // nkv)``
(what ``repeat_interleave`` gives). A query row with no visible key at all (a fully padded
sequence at step 0) gets output 0 here; the reference gives NaN there.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch

log = logging.getLogger(__name__)

#: elements of one fp32 score chunk [B, h, rows, T] of :class:`_ChunkedCausal` at most (128 MiB)
SCORE_CHUNK_ELEMS = 2 ** 25
#: query rows of one chunk at most (smaller chunks skip more of the causal upper triangle; on CPU
#: 128 rows ran 2.7x faster than one 2048-row chunk at T = 2048)
CHUNK_ROWS = 128
IMPLS = ("auto", "chunked", "flex", "flex_eager")
_flex_state: dict = {"broken": False, "compiled": None}


def ttt_attention_reference(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, mask0: torch.Tensor,
                            extra_k: list[torch.Tensor], extra_v: list[torch.Tensor]) -> torch.Tensor:
    """Attention of the training-time test, dense (materialises [B, h, Tq, Tk + k] scores).

    Row ``t`` of the query attends to the step-0 keys allowed by ``mask0`` (causal: ``<= t``)
    and to ``extra_k[j][..., t, :]`` (the key of the SAME row at later step ``j + 1``).

    Args:
        q: [B, h, Tq, d]; k0, v0: [B, h, Tk, d]; mask0: bool broadcastable to [B, h, Tq, Tk]
            (True = visible); extra_k/extra_v: lists of [B, h, Tq, d].

    Returns:
        [B, Tq, h * d].
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    s0 = torch.matmul(q, k0.transpose(-1, -2)) * scale
    s0 = s0.masked_fill(~mask0, float("-inf"))
    se = [(q * k).sum(-1, keepdim=True) * scale for k in extra_k]
    p = torch.softmax(torch.cat([s0, *se], dim=-1).float(), dim=-1).to(q.dtype)
    tk = k0.shape[-2]
    out = torch.matmul(p[..., :tk], v0)
    for j, v in enumerate(extra_v):
        out = out + p[..., tk + j: tk + j + 1] * v
    b, h, tq, d = out.shape
    return out.transpose(1, 2).reshape(b, tq, h * d)


def ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, key_valid: torch.Tensor,
                  extra_k: list[torch.Tensor], extra_v: list[torch.Tensor], *, impl: str = "auto",
                  chunk: Optional[int] = None, cache: Optional[dict] = None) -> torch.Tensor:
    """TTT attention, memory linear in T; same values as :func:`ttt_attention_reference` with
    ``mask0 = causal & key_valid`` (row ``t`` sees valid step-0 keys ``<= t``, then its extras).

    Args:
        q: [B, nh, T, d]; k0, v0: [B, nkv, T, d] (``nh % nkv == 0``); key_valid: bool [B, T].
        extra_k, extra_v: lists (length k, same length) of [B, nkv, T, d].
        impl: "auto" (compiled flex_attention on CUDA, else "chunked"), "chunked", "flex"
            (compiled), "flex_eager" (uncompiled flex: dense, for tests).
        chunk: query rows per chunk of "chunked" (default: :data:`CHUNK_ROWS`, fewer where a
            chunk of scores would exceed :data:`SCORE_CHUNK_ELEMS`).
        cache: a dict kept by the caller across the steps of one batch (holds the flex block mask).

    Returns:
        [B, T, nh * d] in q's dtype.
    """
    if len(extra_k) != len(extra_v):
        raise ValueError(f"{len(extra_k)} extra keys but {len(extra_v)} extra values")
    for e in (*extra_k, *extra_v):
        if e.shape != k0.shape:
            raise ValueError(f"extra key/value shape {tuple(e.shape)} != k0 shape {tuple(k0.shape)}")
    o0, lse0 = causal_attention_lse(q, k0, v0, key_valid, impl=impl, chunk=chunk, cache=cache)
    out = _merge_extras(o0, lse0, q, extra_k, extra_v)
    b, h, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


def causal_attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor, *,
                         impl: str = "auto", chunk: Optional[int] = None,
                         cache: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention over valid keys with its row log-sum-exp, both differentiable.

    Args:
        q: [B, nh, T, d]; k, v: [B, nkv, T, d]; key_valid: bool [B, T]; impl, chunk, cache: see
            :func:`ttt_attention`.

    Returns:
        ``(o, lse)``: o [B, nh, T, d] (q's dtype, 0 where a row sees no key), lse [B, nh, T]
        fp32 (fp64 for fp64 q; natural log of the sum of ``exp(q . k * scale)``; ``-inf`` where
        no key).
    """
    _check(q, k, v, key_valid)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "flex" if q.is_cuda and not _flex_state["broken"] else "chunked"
    if impl.startswith("flex"):
        try:
            return _flex_causal(q, k, v, key_valid, compiled=impl == "flex", cache=cache)
        except Exception as e:  # noqa: BLE001 - flex/inductor failures of any kind: fall back
            if impl != "flex" or not q.is_cuda:
                raise
            _flex_state["broken"] = True
            log.warning("compiled flex_attention failed (%s: %s); using the chunked attention", type(e).__name__, e)
    if chunk is not None and chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    b, nh, t, _ = q.shape
    rows = chunk or max(1, min(CHUNK_ROWS, SCORE_CHUNK_ELEMS // max(1, b * nh * t)))
    return _ChunkedCausal.apply(q, k, v, key_valid, rows)


def _acc(x: torch.Tensor) -> torch.dtype:
    """Softmax/lse dtype: fp32, or fp64 for fp64 inputs (exactness tests)."""
    return torch.promote_types(x.dtype, torch.float32)


def _check(q, k, v, key_valid) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"q [B, nh, T, d], k/v [B, nkv, T, d] expected, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, nh, t, d = q.shape
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != d or nh % k.shape[1]:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit q {tuple(q.shape)} (same B, T, d; nh % nkv == 0)")
    if key_valid.shape != (b, t) or key_valid.dtype != torch.bool:
        raise ValueError(f"key_valid must be bool [B, T] = {(b, t)}, got {key_valid.dtype} {tuple(key_valid.shape)}")


def _merge_extras(o0: torch.Tensor, lse0: torch.Tensor, q: torch.Tensor, extra_k: list[torch.Tensor],
                  extra_v: list[torch.Tensor]) -> torch.Tensor:
    """Joint softmax of the causal part (``o0`` [B, nh, T, d], ``lse0`` [B, nh, T]) with the
    diagonal extras ([B, nkv, T, d] each): ``softmax([lse0, se_1..]) . [o0, v_1..]`` -> [B, nh, T, d].

    Only [B, nh, T]-sized fp32 weights are new tensors kept for backward.
    """
    if not extra_k:
        return o0
    b, nh, t, d = q.shape
    nkv = extra_k[0].shape[1]
    g = nh // nkv
    qg = q.reshape(b, nkv, g, t, d)
    scale = 1.0 / math.sqrt(d)
    se = [(qg * kj[:, :, None]).sum(-1, dtype=lse0.dtype) * scale for kj in extra_k]  # [B, nkv, g, T]
    a = torch.softmax(torch.stack([lse0.reshape(b, nkv, g, t), *se], -1), -1).to(q.dtype)  # [.., T, k+1]
    out = a[..., 0, None] * o0.reshape(b, nkv, g, t, d)
    for j, vj in enumerate(extra_v):
        out = out + a[..., j + 1, None] * vj[:, :, None]
    return out.reshape(b, nh, t, d)



def _scores(q: torch.Tensor, k: torch.Tensor, key_valid: torch.Tensor, i0: int, i1: int):
    """Scores of query rows ``i0..i1`` against keys ``0..i1`` (the causal prefix).

    Args:
        q: [B, nh, T, d]; k: [B, nkv, T, d]; key_valid: bool [B, T].

    Returns:
        ``(s, qc)``: s [B, nkv, g, c, i1] fp32 (fp64 for fp64 q; ``-inf`` where key ``j > i`` or invalid),
        qc [B, nkv, g*c, d] the query rows grouped by key head.
    """
    b, nh, _, d = q.shape
    nkv, c = k.shape[1], i1 - i0
    qc = q[:, :, i0:i1].reshape(b, nkv, (nh // nkv) * c, d)
    s = torch.matmul(qc, k[:, :, :i1].transpose(-1, -2)).to(_acc(q)).mul_(1.0 / math.sqrt(d))
    rows = torch.arange(i0, i1, device=q.device)[:, None]
    vis = (torch.arange(i1, device=q.device)[None] <= rows)[None] & key_valid[:, None, :i1]  # [B, c, i1]
    return s.view(b, nkv, -1, c, i1).masked_fill_(~vis[:, None, None], float("-inf")), qc


class _ChunkedCausal(torch.autograd.Function):
    """Flash-style causal attention with lse over query chunks, plain matmuls (any device).

    Forward/backward hold one chunk of scores [B, nh, rows, T] at a time; saved for backward:
    q, k, v, key_valid, o, lse (linear in T). Backward includes the lse gradient:
    ``ds = p * (dp - rowsum(do * o) + dlse)``.
    """

    @staticmethod
    def forward(ctx, q, k, v, key_valid, rows: int):
        b, nh, t, d = q.shape
        nkv = k.shape[1]
        o = q.new_empty(b, nh, t, d)
        lse = q.new_empty(b, nh, t, dtype=_acc(q))
        for i0 in range(0, t, rows):
            i1 = min(t, i0 + rows)
            s, _ = _scores(q, k, key_valid, i0, i1)
            m = s.amax(-1, keepdim=True)
            m = m.masked_fill_(m == float("-inf"), 0.0)
            p = s.sub_(m).exp_()
            l = p.sum(-1, keepdim=True)
            p = p.div_(l.masked_fill(l == 0, 1.0))
            oc = torch.matmul(p.to(v.dtype).view(b, nkv, -1, i1), v[:, :, :i1])  # [B, nkv, g*c, d]
            o[:, :, i0:i1] = oc.view(b, nh, i1 - i0, d)
            lse[:, :, i0:i1] = (m + l.log()).view(b, nh, i1 - i0)
        ctx.save_for_backward(q, k, v, key_valid, o, lse)
        ctx.rows = rows
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, key_valid, o, lse = ctx.saved_tensors
        b, nh, t, d = q.shape
        nkv = k.shape[1]
        delta = (do.to(lse.dtype) * o.to(lse.dtype)).sum(-1) - dlse  # [B, nh, T]
        lse = lse.masked_fill(lse == float("-inf"), 0.0)  # rows with no key: p = exp(-inf) = 0
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=lse.dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=lse.dtype, device=v.device)
        for i0 in range(0, t, ctx.rows):
            i1 = min(t, i0 + ctx.rows)
            c = i1 - i0
            s, qc = _scores(q, k, key_valid, i0, i1)
            p = s.sub_(lse[:, :, i0:i1].reshape(b, nkv, -1, c, 1)).exp_()
            doc = do[:, :, i0:i1].reshape(b, nkv, -1, d).to(v.dtype)
            dp = torch.matmul(doc, v[:, :, :i1].transpose(-1, -2)).to(p.dtype).view_as(p)
            ds = dp.sub_(delta[:, :, i0:i1].reshape(b, nkv, -1, c, 1)).mul_(p).mul_(1.0 / math.sqrt(d))
            ds = ds.to(q.dtype).view(b, nkv, -1, i1)
            dq[:, :, i0:i1] = torch.matmul(ds, k[:, :, :i1]).view(b, nh, c, d)
            dk[:, :, :i1] += torch.matmul(ds.transpose(-1, -2), qc)
            dv[:, :, :i1] += torch.matmul(p.to(v.dtype).view(b, nkv, -1, i1).transpose(-1, -2), doc)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def _compiled_flex():
    if _flex_state["compiled"] is None:
        from torch.nn.attention.flex_attention import flex_attention

        _flex_state["compiled"] = torch.compile(flex_attention)
    return _flex_state["compiled"]


def _flex_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor, *,
                 compiled: bool, cache: Optional[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_attention_lse` through ``flex_attention`` (block-sparse causal mask; the block
    mask is kept in ``cache`` for the steps of one batch). Shapes as there."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    b, nh, t, _ = q.shape
    hit = cache.get("flex_block_mask") if cache is not None else None
    if hit is not None and hit[0] is key_valid and hit[1] == compiled:
        bm = hit[2]
    else:
        def visible(bi, hi, qi, ki):
            return (ki <= qi) & key_valid[bi, ki]

        bm = create_block_mask(visible, b, None, t, t, device=q.device, _compile=compiled)
        if cache is not None:
            cache["flex_block_mask"] = (key_valid, compiled, bm)
    fn = _compiled_flex() if compiled else flex_attention
    o, aux = fn(q, k, v, block_mask=bm, enable_gqa=k.shape[1] != nh, return_aux=AuxRequest(lse=True))
    return o, aux.lse.to(_acc(q))
