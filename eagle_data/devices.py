"""One check of a device setting, used by extraction, verify and evaluation."""

from __future__ import annotations


def check_device(value: str, field: str = "device") -> str:
    """``value`` if torch can run on it here.

    Raises:
        ValueError: not a torch device name, "cuda" without a visible GPU, or a CUDA index that
            does not exist; names ``field``.
    """
    import torch

    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{field} must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {value!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{field} {value!r}: no CUDA GPU is visible to torch on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"{field} {value!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return value
