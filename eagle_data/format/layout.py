"""Where everything lives in a dataset directory: every file name, made and parsed here only.

::

    OUT/
      {rank:05d}-{shard:06d}.tar      WebDataset shards, one series per rank (``.tar.tmp`` until published)
      index/{rank:05d}-{shard:06d}.parquet   the index rows of one shard (merged into index.parquet)
      progress-{rank:05d}.json        what rank ``r`` has published, skipped and noted (resume truth)
      skips-{rank:05d}.jsonl          every skipped or noted source row of rank ``r``, one JSON object a line
      index.parquet                   one row per sample (:data:`eagle_data.format.schema.INDEX_SCHEMA`)
      manifest.json                   run config, model facts, shards, counts (written by the merge)
      README.md                       dataset card: ``datasets.load_dataset(OUT)`` reads one row per sample
      .eagle-data.lock                one byte-range lock per rank (no two processes run one rank)
"""

from __future__ import annotations

import re
from pathlib import Path

MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.parquet"
CARD_NAME = "README.md"
INDEX_DIR = "index"
LOCK_NAME = ".eagle-data.lock"
SHARD_NAME = "{rank:05d}-{shard:06d}.tar"
SHARD_GLOB = "[0-9][0-9][0-9][0-9][0-9]-[0-9][0-9][0-9][0-9][0-9][0-9].tar"
PROGRESS_NAME = "progress-{rank:05d}.json"
PROGRESS_GLOB = "progress-*.json"
SKIP_LOG_NAME = "skips-{rank:05d}.jsonl"
SKIP_LOG_GLOB = "skips-*.jsonl"
_SHARD_RE = re.compile(r"(\d{5})-(\d{6})\.tar")
_PROGRESS_RE = re.compile(r"progress-(\d{5})\.json")


_SKIP_LOG_RE = re.compile(r"skips-(\d{5})\.jsonl")
_TMP_RE = re.compile(r"(.+)\.\d+\.tmp")  # NAME.<pid>.tmp of an atomic write


def is_own_name(name: str) -> bool:
    """Whether a directory entry's name is one an extraction writes (shards and their ``.tmp``,
    the index folder, progress files, skip logs, the manifest, index, card and lock, and the
    temporaries of atomic writes of those)."""
    name = m[1] if (m := _TMP_RE.fullmatch(name)) else name.removesuffix(".tmp")
    return bool(name in (MANIFEST_NAME, INDEX_NAME, CARD_NAME, INDEX_DIR, LOCK_NAME) or _SHARD_RE.fullmatch(name)
                or _PROGRESS_RE.fullmatch(name) or _SKIP_LOG_RE.fullmatch(name))


def shard_name(rank: int, shard: int) -> str:
    """The file name of shard ``shard`` of rank ``rank`` (:data:`SHARD_NAME`)."""
    return SHARD_NAME.format(rank=rank, shard=shard)


def parse_shard_name(name: str) -> tuple[int, int] | None:
    """``(rank, shard)`` of a :data:`SHARD_NAME` (a bare file name), or None for any other name."""
    m = _SHARD_RE.fullmatch(name)
    return (int(m[1]), int(m[2])) if m else None


def shard_rank(name: str) -> int | None:
    """The rank that wrote a shard, from its name (a path or URL is fine), or None."""
    parsed = parse_shard_name(name.rsplit("/", 1)[-1])
    return parsed[0] if parsed else None


def rank_shard_prefix(rank: int) -> str:
    """What every shard (and index part) name of rank ``rank`` starts with."""
    return f"{rank:05d}-"


def progress_path(out: str | Path, rank: int) -> Path:
    """Rank ``rank``'s progress file."""
    return Path(out) / PROGRESS_NAME.format(rank=rank)


def parse_progress_name(name: str) -> int | None:
    """The rank of a :data:`PROGRESS_NAME`, or None for any other name."""
    m = _PROGRESS_RE.fullmatch(name)
    return int(m[1]) if m else None


def skip_log_name(rank: int) -> str:
    """Rank ``rank``'s skip log (:data:`SKIP_LOG_NAME`)."""
    return SKIP_LOG_NAME.format(rank=rank)


def index_part(out: str | Path, shard: str) -> Path:
    """The index part of shard file ``shard`` (``index/{shard}.parquet``)."""
    return Path(out) / INDEX_DIR / (shard.removesuffix(".tar") + ".parquet")


def shard_of_index_part(part_name: str) -> str:
    """The shard file name an index part belongs to (inverse of :func:`index_part`)."""
    return part_name.removesuffix(".parquet") + ".tar"
