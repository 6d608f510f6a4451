"""The drafter's decoder layer and its pieces (:class:`DraftDecoderLayer`, exported as ``midlayer``).

Memory-lean autograd functions (:class:`RMSNorm`, the MLP's ``silu(gate) * up``) and the
autocast helpers that keep one cast copy of the activations and weights per forward; the
drafter around them is :class:`eagle_train.model.Eagle3Drafter`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from eagle_train.model import DraftConfig


def cast_for_autocast(x: torch.Tensor) -> torch.Tensor:
    """Under autocast, ``x`` cast once to the autocast dtype (same values autocast would give each
    projection), so that the projections reading ``x`` share ONE copy saved for backward instead
    of each casting and saving its own."""
    dev = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(dev):
        return x.to(torch.get_autocast_dtype(dev))
    return x


def autocast_matrices(layer: nn.Module) -> Optional[dict[str, torch.Tensor]]:
    """Under autocast: the layer's projection weights cast once to the autocast dtype, keyed by
    the ``nn.Linear``'s name (``q_proj`` ... ``down_proj``); else None. Eager autocast caches these
    casts for a whole forward, but a compiled region casts (and saves for backward) its own copy at
    each call, i.e. K copies per TTT forward (+2.6 GiB at T = 8192 for an 8B-shaped drafter on the
    H200); passing the one cast in keeps a single copy."""
    dev = next(layer.parameters()).device.type
    if not torch.is_autocast_enabled(dev):
        return None
    dt = torch.get_autocast_dtype(dev)
    return {name.split(".")[-2]: p.to(dt) for name, p in layer.named_parameters() if p.ndim == 2}


def _proj(linear: nn.Linear, x: torch.Tensor, weights: Optional[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    """``linear(x)``, with ``weights[name]`` (the same weight, already cast) in place of its own when given."""
    return linear(x) if weights is None else F.linear(x, weights[name])


class _SiluMul(torch.autograd.Function):
    """``silu(gate) * up`` saving only ``gate`` and ``up`` (autograd would also keep ``silu(gate)``);
    the backward recomputes the sigmoid (fp32)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        gate, up = ctx.saved_tensors
        x, gf = gate.float(), g.float()
        sig = torch.sigmoid(x)
        d_up = gf * x * sig
        d_gate = gf * up.float() * sig * (1 + x * (1 - sig))
        return d_gate.to(gate.dtype), d_up.to(up.dtype)


class RMSNorm(nn.Module):
    """Llama RMSNorm (fp32 statistics), same math as HF ``LlamaRMSNorm`` / SGLang ``forward_native``."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


class _RMSNormFn(torch.autograd.Function):
    """``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)`` saving only ``x`` and the
    rsqrt [..., 1] (autograd would keep an fp32 copy of ``x`` and the normalised ``x`` too)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # .float(); fp64 stays fp64 (tests)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return weight * (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        xn = x.to(r.dtype) * r                                    # [..., H] fp32
        gw = (gy * xn.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        g = (gy * weight).to(x.dtype).to(r.dtype)                 # grad of the rounded xn
        gx = r * (g - xn * (g * xn).mean(-1, keepdim=True))
        return gx.to(x.dtype), gw, None


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, repeat_kv: bool = True,
            weights: Optional[dict[str, torch.Tensor]] = None):
        """``x`` [B, T, 2H] -> q [B, nh, T, hd], k/v [B, nh, T, hd] (kv heads repeated; with
        ``repeat_kv=False`` [B, nkv, T, hd]), roped. ``weights``: :func:`autocast_matrices`."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, t, _ = x.shape
        x = cast_for_autocast(x)
        q = _proj(self.q_proj, x, weights, "q_proj").view(b, t, self.nh, self.hd).transpose(1, 2)
        k = _proj(self.k_proj, x, weights, "k_proj").view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = _proj(self.v_proj, x, weights, "v_proj").view(b, t, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if not repeat_kv:
            return q, k, v
        rep = self.nh // self.nkv
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, weights: Optional[dict[str, torch.Tensor]] = None):
        x = cast_for_autocast(x)
        act = _SiluMul.apply(_proj(self.gate_proj, x, weights, "gate_proj"), _proj(self.up_proj, x, weights, "up_proj"))
        return _proj(self.down_proj, act, weights, "down_proj")


class DraftDecoderLayer(nn.Module):
    """SGLang's Eagle3 ``LlamaDecoderLayer`` with ``is_input_layer`` (exported as ``midlayer``)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def qkv(self, embeds, hidden, cos, sin, repeat_kv: bool = True, weights: Optional[dict[str, torch.Tensor]] = None):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        return self.self_attn.qkv(x, cos, sin, repeat_kv, weights)

    def finish(self, attn: torch.Tensor, hidden: torch.Tensor,
               weights: Optional[dict[str, torch.Tensor]] = None) -> torch.Tensor:
        """``attn`` [B, T, h*d], ``hidden`` = the residual (layer input) -> pre-norm output [B, T, H];
        ``weights``: :func:`autocast_matrices` (None: the modules' own)."""
        h = _proj(self.self_attn.o_proj, attn, weights, "o_proj") + hidden
        return self.mlp(self.post_attention_layernorm(h), weights) + h


def layer_qkv(layer: "DraftDecoderLayer", weights, embeds, hidden, cos, sin):
    return layer.qkv(embeds, hidden, cos, sin, repeat_kv=False, weights=weights)


def layer_finish(layer: "DraftDecoderLayer", weights, attn, hidden):
    return layer.finish(attn, hidden, weights)
