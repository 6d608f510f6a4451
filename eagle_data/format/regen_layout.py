"""Where everything lives in the output folder of ``eagle-data regenerate``, declared once (the
writer is :mod:`eagle_data.regen.store`; ``extract`` reads the folder as a source)::

    OUT/data/part-SSSSSSSSS-EEEEEEEEE.jsonl     regenerated records of source rows [S, E)
    OUT/rejects/part-SSSSSSSSS-EEEEEEEEE.jsonl  rows of [S, E) not regenerated: row, id, outcome, reason, detail
    OUT/progress-RRRRR.json                     rank R: settings + one entry per finished part
    OUT/regeneration.json                       settings + summed counts of every rank (written when complete)
    OUT/.eagle-data.lock                        one byte-range lock per rank

Part file names sort in source order.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

#: on-disk format name and version of a regeneration output
FORMAT, VERSION = "eagle-data-regeneration", 1
DATA_DIR, REJECTS_DIR, MANIFEST = "data", "rejects", "regeneration.json"
PART_RE = re.compile(r"^part-(\d{9})-(\d{9})\.jsonl$")


def part_name(start: int, end: int) -> str:
    """The file name of the part holding source rows ``[start, end)``."""
    return f"part-{start:09d}-{end:09d}.jsonl"


def progress_path(out: Path, rank: int) -> Path:
    return Path(out) / f"progress-{rank:05d}.json"


def is_regeneration(folder: Path) -> bool:
    """Whether ``folder`` is (or is becoming) the output of ``eagle-data regenerate``."""
    folder = Path(folder)
    return (folder / MANIFEST).is_file() or (any(folder.glob("progress-*.json")) and (folder / DATA_DIR).is_dir())


def data_files(folder: Path) -> list[Path]:
    """The regenerated JSONL parts of a complete run, in source order.

    Raises:
        ValueError: the run is not complete (a rank has rows left, or never ran), or is empty.
    """
    folder = Path(folder)
    man = folder / MANIFEST
    if not man.is_file():
        raise ValueError(f"data: {folder} is a regeneration in progress (no {MANIFEST} yet): finish it "
                         "(rerun `eagle-data regenerate` with the same options on every rank) before extracting")
    m = json.loads(man.read_text(encoding="utf-8"))
    if not m.get("complete"):
        raise ValueError(f"data: {folder}: the regeneration is not complete; rerun `eagle-data regenerate` "
                         "on every rank first")
    files = sorted(f for f in (folder / DATA_DIR).iterdir() if PART_RE.match(f.name))
    if not m.get("regenerated"):
        raise ValueError(f"data: {folder}: the regeneration holds no regenerated row ({m.get('input_rows')} "
                         f"input rows: {m.get('reasons')}); see {folder / REJECTS_DIR}")
    return files
