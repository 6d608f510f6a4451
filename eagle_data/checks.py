"""Argument checks shared by extraction, the loader, verify and evaluation (one message each)."""

from __future__ import annotations

import numbers
import re


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
    may name a GPU the machine writing it lacks, so parsing one checks the form only (``TYPE`` or
    ``TYPE:INDEX``, without loading torch: a mistyped command answers at once).

    Raises:
        ValueError: not a torch device name, or (``usable``) "cuda" without a visible GPU or a
            CUDA index that does not exist; names ``field``.
    """
    bad = f"{field} must be a torch device such as 'cpu', 'cuda' or 'cuda:1', got {value!r}"
    if not isinstance(value, str) or not re.fullmatch(r"[a-z][a-z0-9_]*(:[0-9]+)?", value):
        raise ValueError(bad)
    if not usable:
        return value
    import torch

    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(bad) from None
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


_SCALARS = {"bool": bool, "int": int, "float": float, "str": str}


def _scalar_type(hint: object) -> tuple[type | None, bool]:
    """``(scalar type or None, None allowed)`` of a declared type: ``bool``, ``Optional[int]``,
    ``Annotated[float | None, ...]``, or those as strings (postponed annotations)."""
    import typing

    if isinstance(hint, str):
        text = hint.replace(" ", "")
        optional = text.startswith("Optional[") or "|None" in text or "None|" in text
        text = text.removeprefix("Optional[").removesuffix("]") if text.startswith("Optional[") else text
        text = text.replace("|None", "").replace("None|", "")
        return _SCALARS.get(text), optional
    if typing.get_origin(hint) is typing.Annotated:
        return _scalar_type(typing.get_args(hint)[0])
    args = typing.get_args(hint)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (_scalar_type(rest[0])[0] if len(rest) == 1 else None), True
    return (hint if hint in _SCALARS.values() else None), False


def check_option_types(where: str, values: dict, hints: dict) -> None:
    """Refuse an option whose declared type (``hints[name]``) is bool, int, float or str and whose
    value is not one: ``"yes"`` for a bool (truthy, so it would silently mean ``True``), ``True``
    for an int, ``"8"`` for a number. Options without a scalar declared type pass.

    Raises:
        ValueError: naming ``where``, the option, the type expected and the value given.
    """
    for name, value in values.items():
        want, optional = _scalar_type(hints.get(name))
        if want is None or (value is None and optional):
            continue
        ok = (isinstance(value, bool) if want is bool else
              isinstance(value, want) and not isinstance(value, bool) if want is int else
              isinstance(value, (int, float)) and not isinstance(value, bool) if want is float else
              isinstance(value, str))
        if not ok:
            raise ValueError(f"{where}: option {name} must be {want.__name__}{' or null' if optional else ''}, "
                             f"got {value!r}" + (" (write true or false, unquoted)" if want is bool else ""))
