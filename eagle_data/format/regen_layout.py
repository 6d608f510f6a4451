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

import hashlib
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


#: path -> ((size, mtime_ns), sha256) of part files hashed in this process: ``extract`` resolves
#: its source several times (checks, the tag, each pass over the rows); a part is hashed again
#: only when its size or modification time changed
_HASHED: dict[str, tuple[tuple[int, int], str]] = {}


def _sha256(path: Path) -> str:
    st = path.stat()
    key, hit = (st.st_size, st.st_mtime_ns), _HASHED.get(str(path))
    if hit is None or hit[0] != key:
        hit = (key, hashlib.sha256(path.read_bytes()).hexdigest())
        _HASHED[str(path)] = hit
    return hit[1]


def data_files(folder: Path) -> list[Path]:
    """The regenerated JSONL parts of a complete run, in source order.

    Raises:
        ValueError: the run is not complete (a rank has rows left, or never ran), holds no
            regenerated row, or its part files are not exactly those the manifest lists with their
            sha256 (a part deleted, added, cut or edited by hand).
    """
    folder = Path(folder)
    man = folder / MANIFEST
    if not man.is_file():
        raise ValueError(f"data: {folder} is a regeneration in progress (no {MANIFEST} yet): finish it "
                         "(rerun `eagle-data regenerate` with the same options on every rank) before extracting")
    m = json.loads(man.read_text(encoding="utf-8"))
    if not m.get("complete"):
        raise ValueError(f"data: {folder}: the regeneration is not complete (ranks not finished: "
                         f"{m.get('ranks_unfinished')}, rows missing: {m.get('missing_rows')}); rerun "
                         "`eagle-data regenerate` on every rank first")
    if not m.get("regenerated"):
        raise ValueError(f"data: {folder}: the regeneration holds no regenerated row ({m.get('input_rows')} "
                         f"input rows: {m.get('reasons')}); see {folder / REJECTS_DIR}")
    listed = {p["name"]: p for p in m.get("parts", [])}
    on_disk = {f.name for f in (folder / DATA_DIR).iterdir()}
    if on_disk != set(listed):
        extra, gone = sorted(on_disk - set(listed)), sorted(set(listed) - on_disk)
        raise ValueError(f"data: {folder}/{DATA_DIR} does not hold the parts {MANIFEST} lists "
                         f"(not listed: {extra[:3]}, missing: {gone[:3]}): the output was changed by hand")
    files = [folder / DATA_DIR / n for n in sorted(listed)]
    for f in files:
        if _sha256(f) != listed[f.name]["sha256"]:
            raise ValueError(f"data: {f} differs from what `eagle-data regenerate` wrote (sha256 in {MANIFEST}): "
                             "the output was changed by hand")
    return files
