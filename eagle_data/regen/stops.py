"""The token ids that end a regenerated reply: the template's end-of-turn token, the model's
end-of-sequence tokens (tokenizer, ``config.json``, ``generation_config.json``) and the user's
``stop_tokens`` (each a token of the vocabulary as written there, e.g.
``Ġfox``, or text that encodes as one token)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable


def _ids(value: Any) -> Iterable[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _one_token(tokenizer: Any, text: str, what: str) -> int:
    """The id of ``text``: a token of the vocabulary as written there, or text that encodes as one token."""
    vocab = tokenizer.get_vocab()
    if text in vocab:
        return int(vocab[text])
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{what} {text!r} is {len(ids)} tokens of this tokenizer, not one")
    return ids[0]


def stop_token_ids(tokenizer: Any, renderer: Any, model_path: str, extra: list[str]) -> frozenset[int]:
    """See the module docstring.

    Raises:
        ValueError: a ``stop_tokens`` entry that is not exactly one token.
    """
    ids = {_one_token(tokenizer, eot, "the template's end-of-turn marker") for eot in renderer.markers.eot}
    ids.update(_ids(tokenizer.eos_token_id))
    for name in ("config.json", "generation_config.json"):
        f = Path(model_path) / name
        if f.is_file():
            cfg = json.loads(f.read_text(encoding="utf-8"))
            ids.update(_ids(cfg.get("eos_token_id")))
            ids.update(_ids((cfg.get("text_config") or {}).get("eos_token_id")))
    ids.update(_one_token(tokenizer, s, "stop_tokens entry") for s in extra)
    return frozenset(ids)
