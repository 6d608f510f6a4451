"""Paged attention ops of the stand-in ``sgl_kernel``, as SGLang 0.5.23's ``intel_amx`` backend calls
them (``sglang/srt/layers/attention/intel_amx_backend.py``): decode (one query per request, which
also writes the new K/V into the cache) and extend (new tokens over a cached prefix; causal, or a
draft-tree mask in speculative verify).

A request's keys are ``k_cache[req_to_token[req_pool_indices[i], :seq_lens[i]]]``; heads are grouped
(``Hq`` a multiple of ``Hkv``). Arithmetic is float32, the output is cast to its own dtype. Only what
a dense decoder uses is implemented: sliding windows, attention sinks, cross attention and encoder
lengths raise ``NotImplementedError``.
"""

from __future__ import annotations

from typing import Optional

import torch


def _unsupported(op: str, is_cross_attn: bool, sliding_window_size: int, encoder_lens, sinks) -> None:
    for cond, what in ((is_cross_attn, "cross attention"), (int(sliding_window_size) > 0, "sliding windows"),
                       (encoder_lens is not None, "encoder lengths"), (sinks is not None, "attention sinks")):
        if cond:
            raise NotImplementedError(f"sgl_kernel.{op} (eagle-data's pure-torch stand-in) does not implement "
                                      f"{what}; install SGLang's CPU kernel build for this model")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: Optional[torch.Tensor], sm_scale: float,
            logit_cap: float) -> torch.Tensor:
    """q: [Q, Hq, D], k: [S, Hkv, D], v: [S, Hkv, Dv], visible: [Q, S] bool or None -> [Q, Hq, Dv] float32."""
    hq, hkv = q.shape[1], k.shape[1]
    qf = q.float().transpose(0, 1)                                     # [Hq, Q, D]
    kf = k.float().transpose(0, 1).repeat_interleave(hq // hkv, 0)      # [Hq, S, D]
    vf = v.float().transpose(0, 1).repeat_interleave(hq // hkv, 0)      # [Hq, S, Dv]
    s = torch.matmul(qf, kf.transpose(1, 2)) * sm_scale                 # [Hq, Q, S]
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    if visible is not None:
        s = s.masked_fill(~visible[None], float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), vf).transpose(0, 1)   # [Q, Hq, Dv]


def decode_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, key_scale: float,
                         value_scale: float, output: torch.Tensor, key: Optional[torch.Tensor],
                         value: Optional[torch.Tensor], loc: torch.Tensor, attn_logits: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         sm_scale: float, logit_cap: float, is_cross_attn: bool, sliding_window_size: int,
                         encoder_lens: Optional[torch.Tensor], sinks: Optional[torch.Tensor]) -> None:
    """One query per request over its cached keys (the new token's included).

    Args:
        query: [B, Hq, D]; k_cache / v_cache: [slots, Hkv, D / Dv] (scaled by ``key_scale`` /
            ``value_scale`` when read); output: [B, Hq, Dv], written.
        key, value: [B, Hkv, D / Dv] new K/V written to ``loc`` [B] first (None: already cached).
        attn_logits: the real kernel's split-K scratch buffer, unused.
    """
    _unsupported("decode_attention_cpu", is_cross_attn, sliding_window_size, encoder_lens, sinks)
    if key is not None and value is not None:
        k_cache[loc] = key.to(k_cache.dtype)
        v_cache[loc] = value.to(v_cache.dtype)
    rows, lens = req_pool_indices.tolist(), seq_lens.tolist()
    for i, (row, n) in enumerate(zip(rows, lens)):
        slots = req_to_token[row, :n].long()
        o = _attend(query[i:i + 1], k_cache[slots].float() * key_scale, v_cache[slots].float() * value_scale,
                    None, sm_scale, logit_cap)
        output[i] = o[0].to(output.dtype)


def extend_attention_cpu(q_extend: torch.Tensor, k_extend: Optional[torch.Tensor], v_extend: Optional[torch.Tensor],
                         o_extend: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, key_scale: float,
                         value_scale: float, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, extend_seq_lens: torch.Tensor, extend_start_loc: torch.Tensor,
                         max_len_extend: int, sm_scale: float, logit_cap: float, is_cross_attn: bool,
                         sliding_window_size: int, encoder_lens: Optional[torch.Tensor],
                         sinks: Optional[torch.Tensor], tree_mask: Optional[torch.Tensor] = None,
                         is_causal: bool = True) -> None:
    """New tokens of each request over its cached prefix and themselves.

    Request ``i`` has ``E = extend_seq_lens[i]`` new tokens at rows ``extend_start_loc[i]:+E`` of
    ``q_extend`` [N, Hq, D] / ``k_extend``, ``v_extend`` [N, Hkv, D / Dv] (None: read from the cache,
    where the caller has written them) and a prefix of ``P = seq_lens[i] - E`` cached tokens, all of
    which every new token sees. Among the new tokens: ``tree_mask`` (bool, [E, E] per request,
    requests concatenated: QLEN_ONLY layout) when given, else causal (or all, ``is_causal=False``).
    ``o_extend`` [N, Hq, Dv] is written.
    """
    _unsupported("extend_attention_cpu", is_cross_attn, sliding_window_size, encoder_lens, sinks)
    mask_off = 0
    for row, n, e, s in zip(req_pool_indices.tolist(), seq_lens.tolist(), extend_seq_lens.tolist(),
                            extend_start_loc.tolist()):
        p = n - e
        if k_extend is not None and k_extend.shape[1:] != k_buffer.shape[1:]:
            # MLA's plain-attention prefill: per-head k/v beside a cache of latents, which a prefix
            # cannot be read back from here (SGLang picks that path for a prefill without prefix)
            if p:
                raise NotImplementedError(f"extend_attention_cpu: k/v of shape {tuple(k_extend.shape[1:])} over a "
                                          f"cached prefix of {p} tokens stored as {tuple(k_buffer.shape[1:])}")
            k, v = k_extend[s:s + e].float(), v_extend[s:s + e].float()
        else:
            slots = req_to_token[row, :n].long()
            k = k_buffer[slots].float() * key_scale
            v = v_buffer[slots].float() * value_scale
            if k_extend is not None and v_extend is not None:
                k[p:] = k_extend[s:s + e].float()
                v[p:] = v_extend[s:s + e].float()
        visible = torch.ones(e, n, dtype=torch.bool)
        if tree_mask is not None:
            visible[:, p:] = tree_mask.reshape(-1)[mask_off:mask_off + e * e].view(e, e)
            mask_off += e * e
        elif is_causal:
            visible[:, p:] = torch.ones(e, e, dtype=torch.bool).tril()
        o_extend[s:s + e] = _attend(q_extend[s:s + e], k, v, visible, sm_scale, logit_cap).to(o_extend.dtype)
