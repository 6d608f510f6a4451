"""``index.parquet`` access through HF ``datasets``."""

from __future__ import annotations

import os
from pathlib import Path

from eagle_data.format.layout import INDEX_DIR, INDEX_NAME, MANIFEST_NAME, index_part
from eagle_data.format.records import read_manifest, unmerged_reason


def index_files(path: str | Path) -> list[str]:
    """The index parquet file(s) of a dataset dir: ``index.parquet``, else ``index/*.parquet``
    (with a manifest: the parts of its shards).

    Raises:
        ValueError: none found, a shard of the manifest has no index part, or an extraction's
            folder holds no manifest (unfinished, merge refused, no samples: it says which).
    """
    p = Path(path)
    if p.is_file():
        return [str(p)]
    if (p / INDEX_NAME).exists():
        return [str(p / INDEX_NAME)]
    parts = sorted((p / INDEX_DIR).glob("*.parquet"))
    if not (p / MANIFEST_NAME).is_file() and (why := unmerged_reason(p)):  # the parts are no dataset yet
        raise ValueError(why)
    if not parts:
        raise ValueError(f"{p}: no {INDEX_NAME} or {INDEX_DIR}/*.parquet")
    if (p / MANIFEST_NAME).is_file():  # the parts must be the manifest's shards, every one
        shards = [s["name"] for s in read_manifest(p).get("shards", [])]
        missing = [str(index_part(p, s).relative_to(p)) for s in shards if not index_part(p, s).is_file()]
        if missing:
            raise ValueError(f"{p}: no {INDEX_NAME}, and {INDEX_DIR}/ lacks the index of {len(missing)} of the "
                             f"manifest's {len(shards)} shard(s) ({', '.join(missing[:4])}); the samples of those "
                             "shards would be left out: restore the files, or rerun the extraction (same command)")
        return [str(index_part(p, s)) for s in shards]
    return [str(x) for x in parts]


def load_index(path: str | Path):
    """Load the sample index as a ``datasets.Dataset`` (one row per sample; columns in
    :data:`eagle_data.format.schema.INDEX_COLUMNS`). Same as
    ``datasets.load_dataset("parquet", data_files=index_files(path), split="train")``, without its
    progress bars (a few seconds at most: noise in the output of inspect, vocab and eval)."""
    import datasets
    import pyarrow.parquet as pq

    files = index_files(path)
    if sum(pq.ParquetFile(f).metadata.num_rows for f in files) == 0:  # the parquet builder rejects 0 rows
        return datasets.Dataset(pq.read_table(files[0]))
    # the user's HF_DATASETS_DISABLE_PROGRESS_BARS wins (datasets warns at each override attempt)
    bars = not datasets.are_progress_bars_disabled() and "HF_DATASETS_DISABLE_PROGRESS_BARS" not in os.environ
    if bars:
        datasets.disable_progress_bars()
    try:
        return datasets.load_dataset("parquet", data_files=files, split="train")
    finally:
        if bars:
            datasets.enable_progress_bars()
