"""Pure-torch stand-in for ``sgl_kernel``: eagle-data's CPU path for SGLang 0.5.23.

THIS IS NOT SGLang's KERNEL LIBRARY. It exists for machines without SGLang's CPU kernel
build (``sgl-kernel`` compiled with its ``*_cpu`` ops): the ``sglang-kernel`` wheel on PyPI
is a CUDA build (it needs ``libcuda.so.1``) and has no ``*_cpu`` ops, so
``SGLANG_USE_CPU_ENGINE=1`` cannot import it on a CPU-only host.

How it is used: :func:`eagle_data.engines.sglang_engine.prepare_cpu_environment` sets
``SGLANG_USE_CPU_ENGINE=1`` and puts the folder *containing* this package
(``eagle_data/engines/cpu_sgl_kernel``) first on ``PYTHONPATH`` before the engine spawns
its scheduler, so ``import sgl_kernel`` in the scheduler resolves here. SGLang then runs norm /
activation / rotary / linear layers in native torch (this CPU reports no AMX, so no layer takes
the packed-weight path) and calls only the ops below.

Implemented (each unit-tested against the semantics of sgl-kernel's CPU kernels and the golden
cases of their tests, ``tests/test_cpu_sgl_kernel.py``), as Python names and as
``torch.ops.sgl_kernel.*`` (the attention backend calls the latter):

* extraction and plain serving (``attention_backend="torch_native"``):
  :func:`~.cache_ops.assign_req_to_token_pool_cpu`;
* EAGLE speculative decoding (``attention_backend="intel_amx"``, see
  :func:`eagle_data.serve.engine.start_spec_engine`): the paged attention ops
  :func:`~.attention.decode_attention_cpu`, :func:`~.attention.extend_attention_cpu`; the draft tree
  :func:`~.tree_ops.build_tree_kernel_efficient_cpu`, :func:`~.tree_ops.verify_tree_greedy_cpu`; the
  KV-slot bookkeeping in :mod:`.cache_ops`;
* SGLang's NGRAM speculative decoding (same backend): the verify metadata of its draft trees,
  :func:`~.speculative.reconstruct_indices_from_tree_mask` (tested against sglang's own host-side
  reference).

Every other name SGLang imports at module level on the CPU path exists so the import succeeds;
calling it raises :class:`NotImplementedError` naming the op. Any other attribute is absent
(``ImportError`` on ``from sgl_kernel import x``), so SGLang's own try/except fallbacks keep working.
"""

from __future__ import annotations

import torch

from .attention import decode_attention_cpu, extend_attention_cpu
from .cache_ops import (assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu,
                        assign_req_to_token_pool_cpu, build_draft_decode_metadata_cpu, copy_all_layer_kv_cache_cpu,
                        fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu)
from .tree_ops import build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu

__version__ = "0.0.0+eagle-data-cpu-standin"
EAGLE_DATA_CPU_STANDIN = True

#: op name -> schema (argument order of sglang 0.5.23's call sites; ``(a!)``: written in place)
_SCHEMAS = {
    "decode_attention_cpu": (
        "(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float key_scale, float value_scale, "
        "Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, "
        "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"),
    "extend_attention_cpu": (
        "(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, Tensor k_buffer, "
        "Tensor v_buffer, float key_scale, float value_scale, Tensor req_to_token, Tensor req_pool_indices, "
        "Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, int max_len_extend, float sm_scale, "
        "float logit_cap, bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, Tensor? sinks, "
        "Tensor? tree_mask=None, bool is_causal=True) -> ()"),
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor out_cache_loc, int pool_len) -> ()"),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor(a!) out_cache_loc, int pool_len) -> ()"),
    "assign_draft_cache_locs_contiguous_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens, Tensor(a!) out_cache_loc, int pool_len, "
        "int topk, int num_steps) -> ()"),
    "build_draft_decode_metadata_cpu": (
        "(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int topk, int num_steps, "
        "int pool_len) -> Tensor"),
    "fill_bonus_tokens_cpu": "(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, int accept_stride) -> ()",
    "fill_accept_out_cache_loc_cpu": (
        "(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc, int? size=None) -> ()"),
    "copy_all_layer_kv_cache_cpu": "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
    "build_tree_kernel_efficient_cpu": (
        "(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, Tensor(a!) tree_mask, "
        "Tensor(b!) positions, Tensor(c!) retrive_index, Tensor(d!) retrive_next_token, "
        "Tensor(e!) retrive_next_sibling, int topk, int depth, int draft_token_num, int tree_mask_mode) -> ()"),
    "verify_tree_greedy_cpu": (
        "(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, Tensor candidates, "
        "Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
        "Tensor target_predict) -> ()"),
}



def _registered(name: str) -> bool:
    try:
        getattr(torch.ops.sgl_kernel, name)
    except (AttributeError, RuntimeError):
        return False
    return True


_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")
for _name, _schema in _SCHEMAS.items():
    if not _registered(_name):  # this file imported under a second module name
        _LIB.define(_name + _schema)
        _LIB.impl(_name, globals()[_name], "CPU")


def _unsupported(name: str):
    def op(*_args, **_kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented by eagle-data's pure-torch CPU stand-in "
            f"(eagle_data/engines/cpu_sgl_kernel); install SGLang's CPU kernel build to use it")
    op.__name__ = name
    op.__qualname__ = name
    return op


# Imported at module level by sglang 0.5.23 when SGLANG_USE_CPU_ENGINE=1 (see
# sglang/kernels/ops/speculative/*.py) but never called by a dense decoder with chain or tree
# EAGLE drafting: multi-layer EAGLE, paged draft slots, flashinfer indices.
_UNSUPPORTED = (
    "rotate_input_ids_cpu",
    "assign_draft_cache_locs_cpu",
    "get_target_cache_loc_cpu",
    "create_extend_after_decode_spec_info_cpu",
    "create_flashinfer_kv_indices_cpu",
)
for _name in _UNSUPPORTED:
    globals()[_name] = _unsupported(_name)
del _name

__all__ = [*_SCHEMAS, *_UNSUPPORTED]
