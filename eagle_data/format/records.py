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

from eagle_data.format.layout import (INDEX_NAME, MANIFEST_NAME, PROGRESS_GLOB, SKIP_LOG_GLOB, parse_progress_name,
                                      parse_shard_name)


class ShardRecord(TypedDict, total=False):
    """One published shard."""
    name: str             #: shard file name (:func:`eagle_data.format.layout.shard_name`)
    num_samples: int
    num_tokens: int
    bytes: int            #: file size
    sha256: str           #: of the whole file, computed while writing
    keys: list[str]       #: sample keys in file order (progress files only; dropped from the manifest)
    source_digest: str    #: fingerprint of the source rows it holds (reruns refuse a changed source)


class SourceRecord(TypedDict, total=False):
    """The source a rank read (its last run), as :func:`eagle_data.format.fingerprint.files_fingerprint`
    identifies local files; the merge refuses ranks whose sources differ."""
    fingerprint: str | None       #: sha256 of the files' names, sizes and contents; None: not local (a hub name)
    files: int
    bytes: int
    read_at: str                  #: when the run read it (UTC, ISO 8601)


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
    source: SourceRecord          #: the source this rank's last run read (absent in files of older versions)


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
    source: SourceRecord          #: the source every rank read (when the ranks recorded it)


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
        if given_dir and (why := unmerged_reason(p.parent)):
            raise ValueError(why)
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


def no_samples_message(folder: str | Path, skip_counts: dict[str, int]) -> str:
    """What an extraction that produced no sample says, the extraction and every reader of its
    folder alike (no ``manifest.json`` or ``index.parquet`` is written for it)."""
    why = (f"every source row was skipped (by reason: {dict(sorted(skip_counts.items()))}; each row with its reason "
           f"is in {SKIP_LOG_GLOB})" if skip_counts else "the source has no rows")
    return (f"{folder}: the extraction produced no samples: {why}. It is no dataset (no {MANIFEST_NAME} or "
            f"{INDEX_NAME} was written). Check --data, the record layout and --chat_template, then rerun the "
            "same command.")


def unmerged_reason(folder: str | Path) -> str | None:
    """Why ``folder``, an extraction's output directory, holds no ``manifest.json``: the extraction
    produced no samples, some ranks have not run or finished, or every rank finished with samples
    and the merge was refused or not run (``eagle-data merge`` writes the manifest, or says why it
    cannot). None when it holds no progress file, or one is unreadable."""
    from collections import Counter

    folder = Path(folder)
    recs = []
    for p in sorted(folder.glob(PROGRESS_GLOB)):
        try:
            rec = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not isinstance(rec, dict):
            return None
        recs.append(rec)
    if not recs:
        return None
    world = recs[0].get("world_size")
    absent = sorted(set(range(world)) - {r.get("rank") for r in recs}) if isinstance(world, int) else []
    unfinished = sorted(r.get("rank") for r in recs if not r.get("finished"))
    if absent or unfinished:
        return (f"{folder}: the extraction has not finished: rank(s) {sorted(absent + unfinished)} of "
                f"{world} {'have not run or finished' if absent else 'have not finished'} (or failed); run them "
                "(the same command resumes), and the last rank to finish writes the manifest")
    if any(r.get("shards") for r in recs):
        return (f"{folder}: every rank finished, but no merged manifest.json is there: the merge was refused "
                f"(the ranks read different sources) or not run; `eagle-data merge {folder}` writes it, or names "
                "the ranks to rerun")
    return no_samples_message(folder, dict(Counter(v for r in recs for v in (r.get("skipped") or {}).values())))
