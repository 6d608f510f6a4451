"""KV-slot bookkeeping ops of the stand-in ``sgl_kernel`` (pure torch; see the package doc).

Semantics follow sgl-kernel's CPU kernels (``csrc/cpu/spec.cpp``, ``kvcache.cpp``) and the Triton
kernels they replace in ``sglang.kernels.ops`` (0.5.23). Shapes: ``bs`` requests, ``R`` request
rows in ``req_to_token`` [R, pool_len] int32, KV slots int64. Each op checks the dtypes the real
kernel checks and raises ``RuntimeError`` (as ``TORCH_CHECK`` does) on a mismatch.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch


def _check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"{op}: {msg}")


def _rows(req_to_token: torch.Tensor, op: str) -> None:
    _check(req_to_token.dtype == torch.int32, op, f"req_to_token must be int32, got {req_to_token.dtype}")


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int, *_bs_upper: int) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[c_i : c_i + n_i]`` with
    ``n_i = end[i] - start[i]`` and ``c_i = sum(n_<i)`` (requests concatenated in batch order).

    Args:
        req_pool_indices: [bs] int; req_to_token: [R, pool_len] int32, written in place;
        start_offset, end_offset: [bs] int (end exclusive); out_cache_loc: [sum n_i] int64;
        pool_len: ``req_to_token.shape[1]``; a trailing ``bs_upper`` (Triton's) is accepted and unused.
    """
    op = "assign_req_to_token_pool_cpu"
    _rows(req_to_token, op)
    pos = 0
    for row, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = int(e) - int(s)
        if n <= 0:
            continue
        _check(e <= pool_len, op, f"end {e} > pool_len {pool_len}")
        req_to_token[row, s:e] = out_cache_loc[pos:pos + n].to(torch.int32)
        pos += n


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """The inverse gather: ``out_cache_loc[c_i : c_i + n_i] = req_to_token[req_pool_indices[i],
    start[i]:end[i]]`` (int64 out, requests concatenated in batch order)."""
    op = "assign_extend_cache_locs_cpu"
    _rows(req_to_token, op)
    _check(out_cache_loc.dtype == torch.int64, op, "out_cache_loc must be int64")
    pos = 0
    for row, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = int(e) - int(s)
        if n > 0:
            out_cache_loc[pos:pos + n] = req_to_token[row, s:e].to(torch.int64)
            pos += n


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                           seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int,
                                           topk: int, num_steps: int) -> None:
    """Read back each request's ``topk * num_steps`` draft slots reserved after its prefix:
    ``out_cache_loc[i*n : (i+1)*n] = req_to_token[req_pool_indices[i], seq_lens[i] : seq_lens[i] + n]``."""
    op = "assign_draft_cache_locs_contiguous_cpu"
    _rows(req_to_token, op)
    _check(out_cache_loc.dtype == torch.int64, op, "out_cache_loc must be int64")
    n = int(topk) * int(num_steps)
    _check(out_cache_loc.numel() == req_pool_indices.numel() * n, op,
           f"out_cache_loc has {out_cache_loc.numel()} slots, expected {req_pool_indices.numel() * n}")
    for i, (row, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * n:(i + 1) * n] = req_to_token[row, s:s + n].to(torch.int64)


def build_draft_decode_metadata_cpu(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                    seq_lens: torch.Tensor, topk: int, num_steps: int,
                                    pool_len: int) -> torch.Tensor:
    """The request table of the multi-step draft decode: row ``b * topk + c`` = request ``b``'s
    committed prefix (``seq_lens[b]`` slots) followed by candidate ``c``'s ``num_steps`` draft slots,
    which the reservation laid out at ``seq_lens[b] + c * num_steps``.

    Returns:
        [bs * topk, pool_len] int32; entries past ``seq_lens[b] + num_steps`` are zero.
    """
    op = "build_draft_decode_metadata_cpu"
    _rows(req_to_token, op)
    topk, num_steps = int(topk), int(num_steps)
    out = torch.zeros(req_pool_indices.numel() * topk, pool_len, dtype=torch.int32)
    for b, (row, sl) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        src = req_to_token[row]
        for c in range(topk):
            dst = out[b * topk + c]
            dst[:sl] = src[:sl]
            dst[sl:sl + num_steps] = src[sl + c * num_steps: sl + (c + 1) * num_steps]
    return out


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor,
                          accept_stride: int) -> None:
    """``bonus_tokens[i] = accept_tokens.flat[accept_stride * i + accept_lens[i] - 1]`` (the last
    accepted token of each request; ``accept_lens`` counts the bonus token)."""
    op = "fill_bonus_tokens_cpu"
    for t, name in ((accept_tokens, "accept_tokens"), (accept_lens, "accept_lens"), (bonus_tokens, "bonus_tokens")):
        _check(t.dtype == torch.int32, op, f"{name} must be int32, got {t.dtype}")
    flat = accept_tokens.reshape(-1)
    idx = torch.arange(accept_lens.numel(), dtype=torch.int64) * int(accept_stride) + accept_lens.to(torch.int64) - 1
    bonus_tokens.copy_(flat[idx])


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor, size: Optional[int] = None) -> None:
    """Compact the accepted tokens' KV slots: the ``j``-th entry ``>= 0`` of ``accept_index`` (flat,
    first ``size`` entries; all when ``size`` is None, as sglang 0.5.23 calls it) writes
    ``out_cache_loc[accept_index[j]]`` to ``accept_out_cache_loc[j']``, ``j'`` = entries ``>= 0`` before it."""
    op = "fill_accept_out_cache_loc_cpu"
    _check(out_cache_loc.dtype == torch.int64 and accept_out_cache_loc.dtype == torch.int64, op,
           "out_cache_loc and accept_out_cache_loc must be int64")
    flat = accept_index.reshape(-1)
    if size is not None:
        flat = flat[:int(size)]
    src = flat[flat > -1].to(torch.int64)
    accept_out_cache_loc[:src.numel()] = out_cache_loc[src]


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For every KV buffer ``b`` (base address ``data_ptrs[b]``, ``strides[b]`` bytes per slot), copy
    slot ``src_loc[j]`` to slot ``tgt_loc[j]`` for all ``j``. All sources are read before any target
    is written (the Triton kernel's tile semantics), so overlapping sets are safe.

    The buffers are addressed by raw pointer, as the real kernel does: SGLang passes only their
    addresses (``data_ptr()`` of tensors it keeps alive).
    """
    ptrs = [int(p) for p in data_ptrs.reshape(-1).tolist()]
    widths = [int(s) for s in strides.reshape(-1).tolist()]
    src = [int(s) for s in src_loc.reshape(-1).tolist()]
    tgt = [int(t) for t in tgt_loc.reshape(-1).tolist()]
    _check(len(src) == len(tgt), "copy_all_layer_kv_cache_cpu", "tgt_loc and src_loc differ in length")
    for base, width in zip(ptrs, widths):
        rows = [ctypes.string_at(base + s * width, width) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * width, row, width)
