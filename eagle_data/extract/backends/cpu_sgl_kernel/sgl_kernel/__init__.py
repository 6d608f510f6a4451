"""Pure-torch stand-in for ``sgl_kernel``: eagle-data's CPU path for SGLang 0.5.23.

THIS IS NOT SGLang's KERNEL LIBRARY. It exists for machines without SGLang's CPU kernel
build (``sgl-kernel`` compiled with its ``*_cpu`` ops): the ``sglang-kernel`` wheel on PyPI
is a CUDA build (it needs ``libcuda.so.1``) and has no ``*_cpu`` ops, so
``SGLANG_USE_CPU_ENGINE=1`` cannot import it on a CPU-only host.

How it is used: :class:`eagle_data.extract.backends.sglang.SGLangBackend` with ``device="cpu"``
sets ``SGLANG_USE_CPU_ENGINE=1`` and puts the folder *containing* this package
(``eagle_data/extract/backends/cpu_sgl_kernel``) first on ``PYTHONPATH`` before the engine spawns
its scheduler, so ``import sgl_kernel`` in the scheduler resolves here. On a CPU without
AMX, SGLang then runs norm / activation / rotary / linear layers in native torch and only
needs the names below at import time.

What is implemented (what a dense Llama-family model calls in EXTEND and DECODE with
``attention_backend="torch_native"``):

* :func:`assign_req_to_token_pool_cpu` — exact semantics of the Triton kernel
  ``sglang.srt.mem_cache.allocation.assign_req_to_token_pool``.

Every other name SGLang imports at module level on the CPU path exists so the import
succeeds; calling it raises :class:`NotImplementedError` naming the op (speculative
decoding, hierarchical-cache KV moves: features eagle-data's capture never uses).
Any other attribute is absent (``ImportError`` on ``from sgl_kernel import x``), so
SGLang's own try/except fallbacks keep working.
"""

from __future__ import annotations

import torch

__version__ = "0.0.0+eagle-data-cpu-standin"
EAGLE_DATA_CPU_STANDIN = True


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Write each request's new KV slots into its row of the request->token table.

    For request ``i`` (in batch order), ``n_i = end_offset[i] - start_offset[i]`` and
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] =
    out_cache_loc[sum(n_<i) : sum(n_<i) + n_i]``.

    Args:
        req_pool_indices: [B] int, row of each request in ``req_to_token``.
        req_to_token: [R, pool_len] int32, modified in place.
        start_offset, end_offset: [B] int, token positions (end exclusive).
        out_cache_loc: [sum n_i] int, KV-cache slot of each new token, requests concatenated.
        pool_len: ``req_to_token.shape[1]`` (kept for signature parity with the C++ op).
    """
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    pos = 0
    for row, s, e in zip(rows, starts, ends):
        n = int(e) - int(s)
        if n <= 0:
            continue
        if e > pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: end {e} > pool_len {pool_len}")
        req_to_token[row, s:e] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def _unsupported(name: str):
    def op(*_args, **_kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by eagle-data's pure-torch CPU stand-in "
            f"(eagle_data/extract/backends/cpu_sgl_kernel); install SGLang's CPU kernel build to use it")
    op.__name__ = name
    op.__qualname__ = name
    return op


# Imported at module level by sglang 0.5.23 when SGLANG_USE_CPU_ENGINE=1 (see
# sglang/kernels/ops/kvcache/cache_move.py and sglang/kernels/ops/speculative/*.py,
# spec_tree.py included: the prefill runner imports it even with speculative decoding off).
_UNSUPPORTED = (
    "copy_all_layer_kv_cache_cpu",
    "rotate_input_ids_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "assign_draft_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "get_target_cache_loc_cpu",
    "create_extend_after_decode_spec_info_cpu",
    "create_flashinfer_kv_indices_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
)
for _name in _UNSUPPORTED:
    globals()[_name] = _unsupported(_name)
del _name

__all__ = ["assign_req_to_token_pool_cpu", *_UNSUPPORTED]
