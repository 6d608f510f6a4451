"""Chat templates shipped with eagle-data: ``--chat_template NAME`` (``eagle-data templates`` lists them).

Each ``NAME.jinja`` is a byte-exact copy of a model family's template (sources, commits and
licenses: ``SOURCES.md`` beside it); every one is covered by the loss-mask property test.
:data:`ALIASES` maps the family names other tools use (SpecForge's ``--chat-template llama3``,
``qwen``, ``deepseek-v3``, ...) to a file. Only exact names count: a file stem or alias as
written, or with ``-`` for ``_`` (``deepseek-v3``, ``gpt-oss``); a near miss (``qwen-3``,
``Llama3``) is an error that suggests the name, never another family's template. A bare name
(no path separator, no ``.jinja``) means a shipped template even if a file of that name is in
the current folder; give ``./NAME`` for the file.
"""

from __future__ import annotations

import difflib
import logging
from pathlib import Path

log = logging.getLogger(__name__)
DIR = Path(__file__).resolve().parent

#: family names used by other tools -> the file stem they mean
ALIASES = {
    "llama3": "llama3_1_instruct", "llama3_1": "llama3_1_instruct", "llama3_3": "llama3_1_instruct",
    "llama3_2": "llama3_2_instruct", "qwen": "qwen2_5_instruct", "qwen2_5": "qwen2_5_instruct",
    "qwen3_2507": "qwen3_instruct_2507", "deepseek_v3": "deepseek_v3", "deepseek_r1": "deepseek_r1",
    "gemma": "gemma2_it", "gemma2": "gemma2_it", "gemma3": "gemma3_it", "glm4": "glm4_5", "glm4_5": "glm4_5",
    "gpt_oss": "gpt_oss", "gptoss": "gpt_oss", "kimi_k2": "kimi_k2_instruct", "phi3": "phi3_mini",
    "phi3_5": "phi3_5_mini", "phi4": "phi4", "mistral": "mistral_v3_instruct",
    "mistral_small": "mistral_small_3_1_instruct_2503", "smollm2": "smollm2", "smollm3": "smollm3", "lfm2": "lfm2_5",
}


def names() -> list[str]:
    """The shipped template names (file stems), sorted."""
    return sorted(p.stem for p in DIR.glob("*.jinja"))


def _exact_names() -> dict[str, str]:
    """Every accepted spelling -> file stem: stems and aliases, also with ``-`` for ``_``."""
    out = {n: n for n in names()} | dict(ALIASES)
    return out | {k.replace("_", "-"): v for k, v in out.items()}


def resolve(name_or_path: str) -> Path:
    """The template file for a shipped name or alias (see module doc), or a file path.

    Raises:
        ValueError: neither a file nor a known name; lists the names and aliases.
    """
    looks_like_path = any(c in name_or_path for c in "/\\")
    if not looks_like_path:  # "qwen3" or "qwen3.jinja" (a shipped file name)
        bare = name_or_path[:-len(".jinja")] if name_or_path.endswith(".jinja") else name_or_path
        stem = _exact_names().get(bare)
        if stem is not None and (DIR / f"{stem}.jinja").is_file():
            if Path(name_or_path).is_file():
                log.warning("chat_template %r: using the shipped template %s; a file of that name is in this "
                            "folder too (give ./%s to use it)", name_or_path, stem, name_or_path)
            return DIR / f"{stem}.jinja"
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    near = difflib.get_close_matches(name_or_path.lower(), list(_exact_names()), n=1, cutoff=0.6)
    raise ValueError(f"chat_template {name_or_path!r} is " + ("not a file" if looks_like_path else
                     "neither a file nor a shipped template name") +
                     (f"; did you mean {near[0]!r}?" if near and not looks_like_path else "") +
                     f"; names (eagle-data templates): {', '.join(names())}; also: "
                     f"{', '.join(sorted(a for a in ALIASES if a not in names()))}")
