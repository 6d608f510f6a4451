"""The JSON records of a dataset directory, typed: what each key means, in one place.

``progress-{rank}.json`` holds a :class:`RankProgress` (one per rank, rewritten atomically after
every published shard); ``manifest.json`` a :class:`Manifest` (written by the merge once every
rank has finished). Both list :class:`ShardRecord` s. They are plain JSON objects on disk;
these ``TypedDict`` s only declare the keys (no conversion, no cost).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypedDict

from eagle_data.format.layout import MANIFEST_NAME, parse_progress_name, parse_shard_name


class ShardRecord(TypedDict, total=False):
    """One published shard."""
    name: str             #: shard file name (:func:`eagle_data.format.layout.shard_name`)
    num_samples: int
    num_tokens: int
    bytes: int            #: file size
    sha256: str           #: of the whole file, computed while writing
    keys: list[str]       #: sample keys in file order (progress files only; dropped from the manifest)
    source_digest: str    #: fingerprint of the source rows it holds (reruns refuse a changed source)


class RankProgress(TypedDict, total=False):
    """``progress-{rank}.json``: the only truth about what one rank has published."""
    config: dict[str, Any]        #: the run configuration (ExtractConfig + resolved facts)
    config_hash: str              #: hash of the fields a resume must agree on
    rank: int
    world_size: int
    model: dict[str, Any]         #: model facts (hidden_size, num_layers, aux_layer_ids, dtype...)
    shards: list[ShardRecord]
    skipped: dict[str, str]       #: str(source row) -> reason
    notes: dict[str, list[str]]   #: str(source row) -> reasons (kept but changed); one str in older files
    finished: bool


class Manifest(TypedDict, total=False):
    """``manifest.json``: the dataset as a whole (model facts are top-level keys too)."""
    schema_version: int
    layer_id_convention: str
    final_state_norm: str
    created: str
    config: dict[str, Any]
    config_hash: str
    model_path: str
    backend: str                  #: "hf" | "sglang"
    hidden_size: int
    num_layers: int
    vocab_size: int
    aux_layer_ids: list[int]
    dtype: str                    #: storage dtype of the hidden states
    compute_dtype: str            #: dtype of the forward pass
    backend_extra: dict[str, Any]
    world_size: int
    shards: list[ShardRecord]
    num_samples: int
    num_tokens: int
    total_bytes: int
    skip_counts: dict[str, int]
    num_skipped: int
    note_counts: dict[str, int]
    packages: dict[str, str]
    complete: bool


def read_manifest(path: str | Path) -> Manifest:
    """Read ``manifest.json`` from a dataset dir or file path.

    Raises:
        ValueError: missing or unreadable manifest.
    """
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p} does not exist")
    given_dir = p.is_dir()
    if given_dir:
        p = p / MANIFEST_NAME
    if not p.exists():
        if given_dir and not any(parse_shard_name(c.name) or parse_progress_name(c.name) is not None
                                 for c in p.parent.iterdir()):
            raise ValueError(f"{p.parent} is not an eagle-data dataset (no manifest.json, no shards or progress "
                             "files of `eagle-data extract`)")
        raise ValueError(f"{p}: no manifest; run `eagle-data merge` on the output directory first")
    if not p.is_file():
        raise ValueError(f"{p}: not a manifest.json (not a file)")
    try:
        m = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        hint = "it was damaged; `eagle-data merge DIR` writes it again" if given_dir else "give the dataset directory"
        raise ValueError(f"{p}: not a manifest.json (not JSON text: {e}); {hint}") from e
    if not isinstance(m, dict):
        raise ValueError(f"{p}: not a manifest.json (a JSON {type(m).__name__}, not an object)")
    return m


def note_reasons(value: Any) -> list[str]:
    """The note reasons of one row of :attr:`RankProgress.notes`: a list, or one string (files
    written before a row kept several notes), or none."""
    return [] if value is None else [value] if isinstance(value, str) else list(value)
