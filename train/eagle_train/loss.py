"""Teacher, loss masks and the unrolled training-time-test (TTT) loss of EAGLE-3.

Frames. A stored sample has tokens ``x[0..T-1]``, aux states ``g[t]`` (target layers after
reading ``x[<=t]``), final post-norm states ``f[t]`` (``lm_head(f[t])`` = the target's
logits for ``x[t+1]``) and ``loss_mask m[t]`` (1 iff ``x[t]`` is assistant text).

* "position" ``p`` (used by :func:`step_loss_masks` and the tests) = the position of the
  token whose embedding enters step 0. Step ``k`` at position ``p`` predicts ``x[p+k+1]``;
  its teacher is ``softmax(lm_head(f[p+k]))``; it is supervised iff ``m[p+k+1] == 1`` and
  ``p+k+1`` is a real (non-padded) token. I.e. the loss mask is shifted left by ``k+1`` with
  zero fill at step ``k``: ``m = [0,0,0,0,0,0,1,1,1,1]`` supervises ``{5,6,7,8}`` at step 0,
  ``{4,5,6,7}`` at step 1, ``{3,4,5,6}`` at step 2, never a padded target.
* "row" ``r = p - 1`` is what the drafter computes on (SGLang's draft-extend layout, same as
  SpecForge's ``padding(input_ids, left=False)``): row ``r`` pairs ``embed(x[r+1])`` with
  ``fc(g[r])`` at rope position ``r``. Position 0 has no ``g[-1]`` and is never computed.

Teacher (written down): ``p_T = softmax(lm_head(f) restricted to the draft vocab)``, i.e. the
target distribution renormalised over the ``N`` draft tokens (SpecForge: ``target[..., t2d]``
then softmax). With ``exclude_oov=True`` (SpecForge's ``position_mask``), positions whose
full-vocabulary target argmax is outside the draft vocabulary are not supervised.

Loss: ``sum_k w^k * mean_{supervised rows}( -sum_v p_T(v) log q_k(v) )`` with ``w = 0.8``
(EAGLE-3 / SpecForge); ``acc_k`` = share of supervised rows where ``argmax q_k`` equals the
teacher's argmax (within the draft vocabulary).
"""

from __future__ import annotations

from typing import Any

import torch

from eagle_train.soft_ce import linear_soft_ce


def shift_left(x: torch.Tensor, n: int, fill: Any = 0) -> torch.Tensor:
    """``y[..., t] = x[..., t + n]`` along dim 1 (the time dim of [B, T, ...]), ``fill`` beyond the end."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


def step_loss_masks(loss_mask: torch.Tensor, valid: torch.Tensor, steps: int) -> torch.Tensor:
    """Supervised positions per TTT step (position frame, see module doc).

    Args:
        loss_mask: [B, T] (any int/bool dtype); valid: [B, T] bool (False at padding).
        steps: K.

    Returns:
        bool [K, B, T]: ``out[k, b, p] = m[b, p+k+1] & valid[b, p+k+1]`` (False past the end).
    """
    m = loss_mask.bool() & valid.bool()
    return torch.stack([shift_left(m, k + 1, False) for k in range(steps)])


def teacher_logits(final: torch.Tensor, lm_head: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Target logits restricted to the draft vocabulary (fp32).

    Args:
        final: [B, T, H] stored final post-norm target states (bf16/fp32).
        lm_head: [V, H] target lm_head weight; t2d: bool [V].

    Returns:
        [B, T, N] fp32 logits; ``softmax`` of them is the renormalised teacher.
    """
    return final.float() @ lm_head[t2d].float().T


@torch.no_grad()
def target_argmax_in_vocab(final: torch.Tensor, lm_head: torch.Tensor, t2d: torch.Tensor,
                           chunk: int = 4096) -> torch.Tensor:
    """bool [B, T]: the full-vocabulary target argmax lies in the draft vocabulary."""
    flat = final.reshape(-1, final.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.bool, device=final.device)
    w = lm_head.to(final.dtype)
    for i in range(0, flat.shape[0], chunk):
        out[i:i + chunk] = t2d[(flat[i:i + chunk] @ w.T).argmax(-1)]
    return out.view(final.shape[:-1])


#: elements of one row chunk of draft logits [rows, N] in :func:`ttt_loss` (32 Mi: ~1k rows at N = 32k)
LOSS_CHUNK_ELEMS = 2 ** 25


def ttt_loss(drafter, target_lm_head: torch.Tensor, batch: dict[str, Any], steps: int = 7,
             step_weight: float = 0.8, exclude_oov: bool = True, chunk_rows: int | None = None,
             attn_impl: str = "auto") -> dict[str, Any]:
    """Unrolled TTT loss of one batch (definition: module docstring), memory linear in T.

    The teacher is computed once, only at the rows some step supervises (``[n_teacher, N]`` fp32);
    each step's draft head and soft cross-entropy run fused over row chunks of ``chunk_rows``
    (:mod:`eagle_train.soft_ce`), so no ``[rows, N]`` tensor of a step outlives its chunk.

    Args:
        drafter: :class:`eagle_train.model.Eagle3Drafter`.
        target_lm_head: [V, H] frozen target head.
        batch: a :class:`eagle_data.stream.collate.Batch` (``input_ids`` [B, T],
            ``aux_hidden_states`` [B, T, 3H], ``hidden_states`` [B, T, H], masks [B, T]).
        steps: K; step_weight: ``w`` of ``w^k``.
        chunk_rows: rows per loss chunk (default: :data:`LOSS_CHUNK_ELEMS` / N).
        attn_impl: the TTT attention (:func:`eagle_train.attention.ttt_attention`'s ``impl``).

    Returns:
        ``{"loss": scalar, "loss_k": [K] tensors, "acc_k": [K], "n_k": [K] supervised rows}``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    ids, valid = batch["input_ids"], batch["attention_mask"].bool()
    sup = supervised_rows(drafter, target_lm_head, batch, steps, exclude_oov)   # [K, B, T-1]
    slot, teach = row_teacher(batch["hidden_states"][:, 1:], target_lm_head, drafter.t2d, sup)
    teach_arg = teach.argmax(-1)
    hiddens = drafter.ttt_forward(ids[:, 1:], batch["aux_hidden_states"][:, :-1], valid[:, 1:], steps,
                                   attn_impl=attn_impl)
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    chunk = chunk_rows or max(1, LOSS_CHUNK_ELEMS // teach.shape[-1])
    total = 0.0
    loss_k, acc_k, n_k = [], [], []
    for k, h in enumerate(hiddens):
        m = sup[k]
        n = m.sum()
        ce, hit = _step_ce(drafter, h[m], teach, teach_arg, shift_left(slot, k, -1)[m], chunk)
        lk = ce / n.clamp(min=1)
        total = total + (step_weight ** k) * lk
        loss_k.append(lk.detach())
        acc_k.append(hit.float() / n.clamp(min=1))
        n_k.append(n)
    return {"loss": total, "loss_k": loss_k, "acc_k": acc_k, "n_k": n_k}


def supervised_rows(drafter, target_lm_head: torch.Tensor, batch: dict[str, Any], steps: int,
                    exclude_oov: bool) -> torch.Tensor:
    """bool [K, B, T-1] in the row frame (row ``r`` <- position ``r + 1``): step ``k`` of row ``r``
    is supervised (:func:`step_loss_masks`, with ``exclude_oov``: the teacher's full-vocabulary
    argmax at ``f[r+k+1]`` lies in the draft vocabulary)."""
    valid, final = batch["attention_mask"].bool(), batch["hidden_states"]
    sup = step_loss_masks(batch["loss_mask"], valid, steps)[:, :, 1:]
    if exclude_oov:
        ok = target_argmax_in_vocab(final[:, 1:], target_lm_head, drafter.t2d)  # row r: f[r+1]
        sup = sup & torch.stack([shift_left(ok, k, False) for k in range(steps)])
    return sup


@torch.no_grad()
def row_teacher(final: torch.Tensor, lm_head: torch.Tensor, t2d: torch.Tensor, sup: torch.Tensor,
                chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher distribution at the rows some step needs (step ``k`` of row ``r`` reads row ``r + k``).

    Args:
        final: [B, R, H] final states in the row frame; lm_head: [V, H]; t2d: bool [V];
        sup: bool [K, B, R] supervised steps (:func:`supervised_rows`).

    Returns:
        ``(slot, probs)``: slot int64 [B, R] (index into probs, -1 where not needed), probs
        [n_teacher, N] fp32 = ``softmax(teacher_logits)`` at those rows.
    """
    need = torch.zeros_like(sup[0])
    for k in range(min(sup.shape[0], sup.shape[2])):  # a step k >= R reads no row
        need[:, k:] |= sup[k, :, :sup.shape[2] - k]
    slot = torch.cumsum(need.flatten(), 0).sub_(1).view_as(need).masked_fill_(~need, -1)
    rows = final[need]
    w = lm_head[t2d].float()
    probs = torch.empty(rows.shape[0], w.shape[0], dtype=torch.float32, device=final.device)
    for i in range(0, rows.shape[0], chunk):
        probs[i:i + chunk] = torch.softmax(rows[i:i + chunk].float() @ w.T, -1)
    return slot, probs


def _step_ce(drafter, h: torch.Tensor, teach: torch.Tensor, teach_arg: torch.Tensor, ts: torch.Tensor,
             rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's soft cross-entropy, summed over the supervised rows, in chunks of ``rows``.

    Args:
        h: [n, H] pre-norm drafter states; teach: [n_teacher, N] teacher probabilities,
            teach_arg: [n_teacher] their argmax; ts: int64 [n] teacher row of each row of ``h``.

    Returns:
        ``(ce, hits)``: scalar fp32 sum of ``-sum_v p_T log q``; int64 count of rows whose draft
        argmax equals the teacher's. Fused head + loss (:func:`eagle_train.soft_ce.linear_soft_ce`):
        no [rows, N] tensor outlives its chunk (the backward recomputes the chunk's logits).
    """
    ce, arg = linear_soft_ce(drafter.norm(h), drafter.lm_head.weight, teach, ts, rows)
    return ce, (arg == teach_arg[ts]).sum()
