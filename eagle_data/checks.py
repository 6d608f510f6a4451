"""Argument checks shared by extraction, the loader, verify and evaluation (one message each)."""

from __future__ import annotations

import numbers
import re


#: the capture backends' options an extraction sets from its own flags (``{option: flag}``): never
#: through ``backend_kwargs`` (:class:`~eagle_data.extract.config.ExtractConfig` refuses them before
#: anything loads; :func:`~eagle_data.engines.make_backend` leaves them out of what it lists)
BACKEND_OPTIONS_SET_BY_RUN = {"model_path": "--model", "model": "--model", "dtype": "--dtype", "device": "--device",
                              "aux_layer_ids": "--aux_layer_ids", "trust_remote_code": "--trust_remote_code",
                              "out_dtype": "--storage_dtype", "final_out_dtype": "--final_storage_dtype"}


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


#: strings that read as a boolean to a person but are true to a Jinja ``if`` (a non-empty string)
_BOOL_WORDS = {"true", "false", "yes", "no", "on", "off"}
#: what the renderer passes a chat template itself (HF's arguments, our pinned date helpers)
RENDER_ARGS = frozenset({"messages", "add_generation_prompt", "tools", "documents", "continue_final_message",
                         "strftime_now", "date_string", "raise_exception", "bos_token", "eos_token", "unk_token",
                         "pad_token"})


def check_template_vars(template: str, variables: dict, name: str) -> None:
    """Refuse ``--template_vars`` the chat template ``template`` would misread: a name it never
    reads from outside (a typo renders the default silently; what the renderer passes, and names
    the template sets itself unless it tests ``is defined`` first, are not the user's), a boolean
    written as a string (``"false"`` is true to Jinja), and a non-boolean where the template tests
    ``is true``/``is false`` (``0`` is not false there). A template Jinja cannot parse here
    (custom tags) is only checked for strings and the renderer's names.

    Raises:
        ValueError: names the variable, what the template reads, and a near name.
    """
    import difflib

    import jinja2
    from jinja2 import meta, nodes

    for k, v in variables.items():
        if isinstance(v, str) and v.strip().lower() in _BOOL_WORDS:
            raise ValueError(f"template_vars.{k} = {v!r} is a string, which the template reads as true; "
                             f"write {str(v.strip().lower() in ('true', 'yes', 'on')).lower()} (unquoted) for a boolean")
    if passed := sorted(set(variables) & RENDER_ARGS):
        raise ValueError(f"template_vars {passed}: set by eagle-data itself when it renders (the conversation, "
                         "its tools, the generation prompt, the pinned date, the tokenizer's special tokens), not a "
                         "template option")
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:
        return
    tests = [t for t in tree.find_all(nodes.Test) if isinstance(t.node, nodes.Name)]
    defaulted = {t.node.name for t in tests if t.name in ("defined", "undefined")}  # `if x is not defined: set x`
    own = {n.name for n in tree.find_all(nodes.Name) if n.ctx in ("store", "param")} - defaulted
    reads = meta.find_undeclared_variables(tree) - own - RENDER_ARGS
    unknown = sorted(set(variables) - reads)
    if unknown:
        near = difflib.get_close_matches(unknown[0], sorted(reads), n=1)
        raise ValueError(f"template_vars {unknown} are not read by {name}"
                         + (f" (did you mean {near[0]!r}?)" if near else "")
                         + f"; it reads: {', '.join(sorted(reads)) or 'no variable of yours'}")
    tested = {t.node.name for t in tests if t.name in ("true", "false", "sameas")}
    if wrong := sorted(k for k in set(variables) & tested if not isinstance(variables[k], bool)):
        raise ValueError(f"template_vars.{wrong[0]} = {variables[wrong[0]]!r}: {name} tests it with `is true`/"
                         "`is false`, which only a boolean passes; write true or false")


def check_aux_layer_ids(ids: object) -> list[int]:
    """Three distinct non-negative layer ids, low -> high (what the model's depth does not decide).

    Raises:
        ValueError: naming the problem (count, type, duplicates, order, a negative id).
    """
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"aux_layer_ids must be a list of 3 layer numbers, got {ids!r}")
    ids = list(ids)
    if len(ids) != 3:
        raise ValueError(f"aux_layer_ids needs exactly 3 ids (low, mid, high), got {ids}")
    if len(set(ids)) != 3:
        raise ValueError(f"aux_layer_ids {ids} has duplicates")
    if ids != sorted(ids):
        raise ValueError(f"aux_layer_ids {ids} must be sorted low -> high")
    if ids[0] < 0:
        raise ValueError(f"aux_layer_ids {ids} out of range: layer ids count from 0")
    return ids
