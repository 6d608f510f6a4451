"""The options of the training sections (``--model.*``, ``--data.*``, ``--trainer.*``), known before
torch loads, so that ``eagle-data train`` answers a mistyped one at once, with the closest valid one.

The names are read from the sources, not listed here: the parameters of ``__init__`` (through
:mod:`ast`, nothing imported) of :class:`eagle_train.module.EagleDrafterModule`,
:class:`eagle_data.stream.datamodule.EagleDataModule` and lightning's ``Trainer``, plus the option
groups (:data:`eagle_train.options.GROUPS`, a field also by its name alone) and the fields of
:class:`eagle_data.stream.config.ReadConfig`. A section whose source cannot be read (a lightning
that moved its ``Trainer``) is left to LightningCLI, which refuses an unknown option too.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import re
from dataclasses import fields
from pathlib import Path
from typing import Optional

from eagle_train.options import GROUPS


def init_parameters(path: Optional[Path], cls: str) -> Optional[set[str]]:
    """The named parameters of ``cls.__init__`` in the Python file ``path``, without importing it
    (None: no such file, class or method)."""
    try:
        tree = ast.parse(path.read_text()) if path is not None else None
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    a = f.args
                    return {p.arg for p in (*a.posonlyargs, *a.args[1:], *a.kwonlyargs)}
    return None


def _trainer_source() -> Optional[Path]:
    spec = importlib.util.find_spec("lightning")  # a top-level package: found, not imported
    where = spec.submodule_search_locations if spec is not None else None
    return Path(list(where)[0]) / "pytorch" / "trainer" / "trainer.py" if where else None


def section_options(section: str) -> Optional[dict[str, str]]:
    """What ``--SECTION.<name>`` may name, as ``{name: the option it sets}`` (the model's group fields
    by their name alone: ``{"ttt_steps": "loss.ttt_steps"}``); None: an unknown section, or its
    source could not be read."""
    from eagle_data.stream import config

    if section == "model":
        names = init_parameters(Path(__file__).with_name("module.py"), "EagleDrafterModule")
        extra = {f.name: f"{g}.{f.name}" for g, cls in GROUPS.items() for f in fields(cls)}
    elif section == "data":
        names = init_parameters(Path(config.__file__).with_name("datamodule.py"), "EagleDataModule")
        names = names and names - {"fields"}  # **fields: ReadConfig's
        extra = {f.name: f.name for f in fields(config.ReadConfig)}
    elif section == "trainer":
        names, extra = init_parameters(_trainer_source(), "Trainer"), {}
    else:
        return None
    return None if names is None else {**extra, **{n: n for n in names if not n.startswith("_")}}


def unknown_option(option: str) -> Optional[str]:
    """``"unknown option --OPTION; did you mean --X?"`` for an option (``data.batch_sise``, without
    the dashes; ``+`` of a list append ignored) that its section does not take; None when it does, or
    when that cannot be told here."""
    section, _, rest = option.rstrip("+").partition(".")
    valid = section_options(section)
    if valid is None or not rest:
        return None
    name, _, sub = rest.partition(".")
    group = section == "model" and name in GROUPS and sub
    if group:
        valid, name = {f.name: f"{name}.{f.name}" for f in fields(GROUPS[name])}, sub
    if name in valid:
        return None
    near = difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.6)
    hint = f"; did you mean --{section}.{valid[near[0]]}?" if near else ""
    takes = f" (--{section}.{rest.partition('.')[0]} takes {', '.join(sorted(valid))})" if group else ""
    return f"unknown option --{option}{hint}{takes}"


def did_you_mean(message: str) -> str:
    """jsonargparse's ``Group 'data' does not accept option 'batch_sise'`` said our way, with the
    closest valid option (a config file's mistake, which :func:`unknown_option` never saw); other
    messages as they are."""
    m = re.search(r"Group '([\w.]+)' does not accept option '([^']+)'", message)
    return (unknown_option(f"{m.group(1)}.{m.group(2)}") if m else None) or message
