"""FP8 storage of hidden states: ``float8_e4m3fn`` values with one float32 scale per (token, layer).

A stored fp8 field ``F`` ([T, G*H], ``G`` layer groups of width ``H``: 3 for the aux states, 1 for
the final state) comes with ``F_scale`` [T, G] float32 in the same safetensors payload. Row ``t``,
group ``g``: ``scale = max|x| / 448`` (1 when the group is all zeros; at least the smallest
normal float32, :data:`SCALE_MIN`, so tiny values never give a zero scale), ``q = x / scale`` rounded to
e4m3 with saturation at +-448; the reader computes ``q * scale``.

Error bound (:func:`error_bound`), per element, of the float32 dequantisation: e4m3 keeps 3
mantissa bits, so a value in the normal range (``|q| >= 2^-6``) is off by at most half a unit in
the last place, ``2^-4 |x|``; below it the spacing is ``2^-9``, i.e. at most ``2^-10 * scale``
absolute. The float32 division adds ``2^-23`` relative, covered by the slack below. Dequantising
to bfloat16 rounds once more: ``+ 2^-8 |x|`` (:data:`BF16_REL`), and among bfloat16's subnormals
``+ 2^-134`` absolute (:data:`BF16_SUB`).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
#: name of the scale tensor stored beside an fp8 field
SCALE_SUFFIX = "_scale"
REL = 2.0 ** -4            # half an ulp of a 3-bit mantissa, relative
SUB = 2.0 ** -10           # half the subnormal spacing 2^-9, in units of the scale
BF16_REL = 2.0 ** -8       # one more rounding to bfloat16 (8 significant bits; slack included)
BF16_SUB = 2.0 ** -134     # half the spacing of bfloat16's subnormals (2^-133)
SCALE_MIN = torch.finfo(torch.float32).tiny  # smallest scale stored (a normal float32)


def scale_name(field: str) -> str:
    return field + SCALE_SUFFIX


def quantize(x: torch.Tensor, groups: int, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [..., G*H] (any float dtype, any device) -> ``(q [..., G*H] float8_e4m3fn, scale [..., G]
    float32)``.

    Args:
        check: refuse non-finite input. ``False`` (a device that should not wait for the answer):
            a NaN/Inf in a group makes its scale NaN/Inf instead, for the caller to check there.

    Raises:
        ValueError: ``x`` holds NaN or Inf (``check``), or its width is not a multiple of ``groups``.
    """
    *lead, w = x.shape
    if groups < 1 or w % groups:
        raise ValueError(f"width {w} is not a multiple of {groups} layer groups")
    xf = x.float().reshape(-1, groups, w // groups)
    if check and not torch.isfinite(xf).all():
        raise ValueError("NaN/Inf in hidden states: not quantised (fp8 storage refuses non-finite values)")
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # a row of tiny values (max < ~6e-43) would give a scale that underflows to 0: floored at the
    # smallest normal float32 (its values then round to 0 or a subnormal step; the bound holds)
    scale = torch.where(amax == 0, torch.ones_like(amax), (amax / FP8_MAX).clamp_min(SCALE_MIN))  # NaN/Inf stay
    q = (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*lead, w), scale.view(*lead, groups)


def to_storage(x: torch.Tensor, dtype: torch.dtype, groups: int,
               check: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` [..., G*H] in a storage dtype, on its device: ``(x.to(dtype), None)``, or for fp8
    ``quantize(x, groups, check)`` (values and scales [..., G])."""
    if dtype == FP8_DTYPE:
        return quantize(x, groups, check)
    return x.to(dtype), None


def finite_rows(values: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """[...] bool of stored rows ``values`` [..., W] (``scale`` [..., G] when fp8, else None): every
    stored value of the row finite; for fp8 its scales say it (:func:`quantize` with ``check=False``
    gives a group holding NaN/Inf a non-finite scale)."""
    return (scale if scale is not None else values).isfinite().all(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` [T, G*H] fp8, ``scale`` [T, G] -> [T, G*H] in ``dtype`` (into ``out`` when given)."""
    t, w = q.shape
    g = scale.shape[1]
    x = q.view(t, g, w // g).float().mul_(scale.float().view(t, g, 1)).view(t, w)
    if out is None:
        return x.to(dtype)
    out.copy_(x)
    return out


def error_bound(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-element bound [T, G*H] on ``|x - dequantize(quantize(x))|`` (module doc), for a
    dequantisation to ``dtype`` (float32, or bfloat16: one more rounding)."""
    t, w = x.shape
    g = scale.shape[1]
    ax = x.float().abs()
    b = (ax.view(t, g, w // g) * REL + scale.float().view(t, g, 1) * SUB).view(t, w)
    if dtype != torch.float32:  # one more rounding, relative, or half a step among bf16's subnormals
        b = b * (1 + BF16_REL) + ax * BF16_REL + BF16_SUB
    return b * (1 + 2.0 ** -20)


def dequantize_fields(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A decoded sample with every fp8 field (one with a ``*_scale`` beside it) dequantised to
    ``dtype`` and the scales dropped: what readers hand out, so no caller ever sees the raw fp8
    values without their scales. Other fields are returned as they are."""
    out = {k: v for k, v in tensors.items() if not k.endswith(SCALE_SUFFIX)}
    for k in out:
        if scale_name(k) in tensors:
            out[k] = dequantize(tensors[k], tensors[scale_name(k)], dtype)
    return out
