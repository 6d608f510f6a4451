"""Crash-safe progress of a regeneration run (file names: :mod:`eagle_data.format.regen_layout`).

Source rows are cut into parts of ``rows_per_part``: part ``p`` holds rows
``[p * rows_per_part, (p + 1) * rows_per_part)`` and belongs to rank ``p % world_size``. A
part's two files are written (tmp + fsync + rename) before the part enters its rank's progress
file (atomic rewrite); on resume a rank deletes its part files that are not listed and redoes
those rows, so a kill at any moment loses at most the part in progress and never duplicates a
row. Rerunning with a larger ``num_samples`` adds parts for the new rows only (a part
``[S, E)`` may then be followed by ``[E, E')`` of the same ``p``). File names sort in source
order, so ``extract --data OUT`` reads the rows in the order of the source.

Every part's counts satisfy ``regenerated + failed + skipped == rows``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle_data.extract.sink import atomic_write_bytes, atomic_write_json
from eagle_data.format.regen_layout import (DATA_DIR, FORMAT, MANIFEST, PART_RE, REJECTS_DIR, VERSION, part_name,
                                            progress_path)

log = logging.getLogger(__name__)

#: the three outcomes of a source row
OUTCOMES = ("regenerated", "failed", "skipped")


@dataclass
class PartRecord:
    """One finished part in a rank's progress file."""
    start: int
    end: int
    fingerprint: str
    counts: dict[str, int]          # outcome -> rows
    reasons: dict[str, int]         # failed/skipped reason -> rows
    finish: dict[str, int]          # finish reason ("stop"/"length") -> regenerated turns
    notes: dict[str, int]           # kept-but-changed reason (e.g. "cut_at_max_length") -> rows
    tokens: int                     # tokens generated (of regenerated rows and of failed ones)
    seconds: float                  # time spent generating


class RankProgress:
    """The rank's progress file: settings, finished parts; repairs the folder on open.

    Raises:
        ValueError: the folder holds a run with other settings (names the first difference),
            or a damaged progress file.
    """

    def __init__(self, out: Path, rank: int, settings: dict[str, Any]):
        self.out, self.rank, self.path = out, rank, progress_path(out, rank)
        self.state: dict[str, Any] = {"format": FORMAT, "version": VERSION, "rank": rank,
                                      "settings": settings, "parts": [], "finished": False, "num_rows": 0}
        if self.path.exists():
            prev = _read_json(self.path)
            if prev.get("format") != FORMAT or prev.get("version") != VERSION:
                raise ValueError(f"{self.path}: not a regeneration progress file of version {VERSION}")
            for k in sorted(set(settings) | set(prev["settings"])):
                if k != "num_samples" and settings.get(k) != prev["settings"].get(k):
                    raise ValueError(f"{out}: a regeneration with other settings is there ({k}: "
                                     f"{prev['settings'].get(k)!r} then, {settings.get(k)!r} now); use another --out")
            self.state["parts"] = prev["parts"]
            self.state["engine"] = prev.get("engine")
        (out / DATA_DIR).mkdir(parents=True, exist_ok=True)
        (out / REJECTS_DIR).mkdir(exist_ok=True)
        self._repair(settings["rows_per_part"], settings["world_size"])

    def _repair(self, per_part: int, world: int) -> None:
        listed = {part_name(p["start"], p["end"]) for p in self.state["parts"]}
        for d in (DATA_DIR, REJECTS_DIR):
            for f in (self.out / d).iterdir():
                m = PART_RE.match(f.name.removesuffix(".tmp") if f.name.endswith(".tmp") else f.name)
                if m is None:
                    if f.name.startswith("part-") or f.name.endswith(".tmp"):
                        raise ValueError(f"{f}: not a part file of this layout; remove it")
                    continue
                mine = (int(m.group(1)) // per_part) % world == self.rank
                if mine and (f.name.endswith(".tmp") or f.name not in listed):
                    log.info("removing %s (not recorded as finished: redone)", f)
                    f.unlink()
        for name in listed:
            for d in (DATA_DIR, REJECTS_DIR):
                if not (self.out / d / name).is_file():
                    raise ValueError(f"{self.out / d / name} is listed in {self.path} but missing: the output was "
                                     "changed by hand; restore it or use another --out")

    def fingerprints(self) -> dict[tuple[int, int], str]:
        return {(p["start"], p["end"]): p["fingerprint"] for p in self.state["parts"]}

    def publish(self, rec: PartRecord, data: list[dict[str, Any]], rejects: list[dict[str, Any]]) -> None:
        """Write the part's files, then list it (the commit point)."""
        assert sum(rec.counts.values()) == rec.end - rec.start, (rec.counts, rec.start, rec.end)
        name = part_name(rec.start, rec.end)
        for d, rows in ((DATA_DIR, data), (REJECTS_DIR, rejects)):
            atomic_write_bytes(self.out / d / name, "".join(
                json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
        self.state["parts"].append(rec.__dict__)
        atomic_write_json(self.path, self.state)

    def finish(self, num_rows: int) -> None:
        self.state.update(finished=True, num_rows=num_rows)
        atomic_write_json(self.path, self.state)

    def begin(self, engine: dict[str, Any]) -> None:
        """The rank has work again (not finished), done by ``engine`` (its description)."""
        self.state.update(finished=False, engine=engine)
        atomic_write_json(self.path, self.state)


def _read_json(p: Path) -> dict[str, Any]:
    try:
        v = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: damaged ({type(e).__name__}: {e}); remove the folder or restore the file") from None
    if not isinstance(v, dict) or not isinstance(v.get("parts"), list) or not isinstance(v.get("settings"), dict):
        raise ValueError(f"{p}: damaged (not a progress record)")
    return v


def summarize(out: Path, world_size: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Sum every rank's progress into :data:`MANIFEST`, written when the run is complete: every
    rank has finished and the parts cover source rows ``[0, n)`` without a gap, ``n`` at least
    the rows each rank was asked for (a rerun with a smaller ``num_samples`` shrinks nothing).
    Returned either way."""
    ranks = [_read_json(progress_path(out, r)) if progress_path(out, r).exists() else None for r in range(world_size)]
    done = [p for p in ranks if p is not None and p["finished"]]
    counts = {k: 0 for k in OUTCOMES}
    reasons: dict[str, int] = {}
    finish: dict[str, int] = {}
    notes: dict[str, int] = {}
    tokens, seconds = 0, 0.0
    for p in ranks:
        for part in p["parts"] if p else []:
            for src, dst in ((part["counts"], counts), (part["reasons"], reasons), (part["finish"], finish),
                             (part["notes"], notes)):
                for k, v in src.items():
                    dst[k] = dst.get(k, 0) + v
            tokens += part["tokens"]
            seconds += part["seconds"]
    spans = sorted((part["start"], part["end"]) for p in ranks if p for part in p["parts"])
    covered = 0
    for a, b in spans:  # parts never overlap; a gap is a part some rank still has to do
        if a != covered:
            covered = -1
            break
        covered = b
    asked = max((p["num_rows"] for p in done), default=0)
    complete = len(done) == world_size and covered >= asked
    man = {"format": FORMAT, "version": VERSION, "complete": complete, "world_size": world_size,
           "ranks_finished": len(done), "settings": next((p["settings"] for p in ranks if p), {}),
           "engine": next((p["engine"] for p in ranks if p and p.get("engine")), None),
           "input_rows": sum(counts.values()), **counts, "reasons": dict(sorted(reasons.items())),
           "finish": dict(sorted(finish.items())),
           "notes": dict(sorted(notes.items())), "tokens_generated": tokens,
           "generation_seconds": round(seconds, 3), **extra}
    if complete:
        assert man["input_rows"] == covered, "every source row has exactly one outcome"
        atomic_write_json(out / MANIFEST, man)
    return man
