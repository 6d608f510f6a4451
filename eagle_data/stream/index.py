"""``index.parquet`` access through HF ``datasets``."""

from __future__ import annotations

import os
from pathlib import Path

from eagle_data.format.layout import INDEX_NAME
from eagle_data.format.layout import INDEX_DIR


def index_files(path: str | Path) -> list[str]:
    """The index parquet file(s) of a dataset dir: ``index.parquet``, else ``index/*.parquet``.

    Raises:
        ValueError: none found.
    """
    p = Path(path)
    if p.is_file():
        return [str(p)]
    if (p / INDEX_NAME).exists():
        return [str(p / INDEX_NAME)]
    parts = sorted((p / INDEX_DIR).glob("*.parquet"))
    if not parts:
        raise ValueError(f"{p}: no {INDEX_NAME} or {INDEX_DIR}/*.parquet")
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
