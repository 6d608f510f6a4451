"""Argument checks shared by extraction, the loader, verify and evaluation (one message each)."""

from __future__ import annotations

import numbers


def check_positive(**args: int | None) -> None:
    """Refuse an integer argument below 1 (``None`` means "not given" and passes).

    Raises:
        ValueError: naming the first argument that is not an integer >= 1.
    """
    for name, v in args.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1):
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


def check_device(value: str, field: str = "device", usable: bool = True) -> str:
    """``value`` if it names a torch device and (``usable``) torch can run on it here; a config
    may name a GPU the machine writing it lacks, so parsing one checks the name only.

    Raises:
        ValueError: not a torch device name, or (``usable``) "cuda" without a visible GPU or a
            CUDA index that does not exist; names ``field``.
    """
    import torch

    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{field} must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {value!r}") from None
    if not usable:
        return value
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{field} {value!r}: no CUDA GPU is visible to torch on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{field} {value!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    if dev.type not in ("cpu", "cuda"):  # mps, xla, meta, ...: usable only if torch can place a tensor there
        try:
            torch.empty(1, device=dev) + 0
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/NotImplementedError/... per backend
            raise ValueError(f"{field} {value!r} is not usable here ({type(e).__name__}: {str(e)[:120]})") from None
    return value
