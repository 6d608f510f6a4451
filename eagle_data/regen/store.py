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

import base64
import bisect
import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle_data.extract.sink import atomic_write_bytes, atomic_write_json
from eagle_data.format.regen_layout import (DATA_DIR, FORMAT, MANIFEST, PART_RE, REJECTS_DIR, VERSION, part_name,
                                            progress_path)

log = logging.getLogger(__name__)

#: the three outcomes of a source row
OUTCOMES = ("regenerated", "failed", "skipped")


def json_value(x: Any) -> Any:
    """The JSON form of a source column value JSON has no type for (parquet/hub columns: dates and
    times as ISO text, bytes as base64 text, arrays as lists; anything else as its ``str``): the
    record is kept whole, and such a column never holds chat text."""
    if hasattr(x, "isoformat"):
        return x.isoformat()
    if isinstance(x, (bytes, bytearray)):
        return base64.b64encode(bytes(x)).decode("ascii")
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


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
    seconds: float                  # its share of the time spent waiting on the engine (parts overlap)
    sha256: dict[str, str] = field(default_factory=dict)  # DATA_DIR / REJECTS_DIR -> sha256 of its file


class RankProgress:
    """The rank's progress file: settings, finished parts; checks the folder and repairs it on open.

    Raises:
        ValueError: the folder holds something else (an extraction, a published copy, parts no
            progress file lists), a run of any rank with other settings (names the first
            difference), a damaged progress file, or a finished part changed on disk.
    """

    def __init__(self, out: Path, rank: int, settings: dict[str, Any]):
        self.out, self.rank, self.path = out, rank, progress_path(out, rank)
        self.state: dict[str, Any] = {"format": FORMAT, "version": VERSION, "rank": rank,
                                      "settings": settings, "parts": [], "finished": False, "num_rows": 0}
        others = _check_folder(out, settings)
        if rank in others:
            self.state["parts"] = others[rank]["parts"]
            self.state["engine"] = others[rank].get("engine")
        self._spans = sorted((p["start"], p["end"]) for p in self.state["parts"])  # finished, by start
        (out / DATA_DIR).mkdir(parents=True, exist_ok=True)
        (out / REJECTS_DIR).mkdir(exist_ok=True)
        self._repair(settings["rows_per_part"], settings["world_size"], rank in others)

    def _repair(self, per_part: int, world: int, have_progress: bool) -> None:
        listed = {part_name(p["start"], p["end"]): p for p in self.state["parts"]}
        for d in (DATA_DIR, REJECTS_DIR):
            for f in sorted((self.out / d).iterdir()):
                m = PART_RE.match(f.name.removesuffix(".tmp"))
                if m is None:
                    raise ValueError(f"{f}: not a part file of a regeneration; {self.out / d} holds only "
                                     "part-*.jsonl files written by `eagle-data regenerate`")
                start, end = int(m.group(1)), int(m.group(2))
                if (start // per_part) % world != self.rank or f.name in listed:
                    continue
                if not f.name.endswith(".tmp") and not (have_progress and self._next_part(start, end, per_part, world)):
                    raise ValueError(f"{f}: a part of rank {self.rank} that no progress file lists and that is not "
                                     "the part this rank was writing (a copied or hand-made file?); nothing is "
                                     "deleted: remove it yourself or use another --out")
                log.info("removing %s (written but not recorded as finished: redone)", f)
                f.unlink()
        for name, p in listed.items():
            for d in (DATA_DIR, REJECTS_DIR):
                f = self.out / d / name
                if not f.is_file() or (p.get("sha256", {}).get(d) not in (None, _sha256(f))):
                    raise ValueError(f"{f} (listed in {self.path}) is {'changed' if f.is_file() else 'missing'}: "
                                     "the output was edited by hand; restore it or use another --out")

    def _next_part(self, start: int, end: int, per_part: int, world: int) -> bool:
        """Whether ``[start, end)`` is the part this rank would have written next: right after its
        last listed part (the rest of that window), or at the start of its next window. A crash
        between writing a part and listing it leaves exactly such a file."""
        last = max((p["end"] for p in self.state["parts"]), default=0)
        window = -(-last // per_part)
        while window % world != self.rank:
            window += 1
        starts = {window * per_part} | ({last} if last % per_part else set())
        return start in starts and start < end <= (start // per_part + 1) * per_part

    def finished_span(self, row: int) -> tuple[int, int] | None:
        """``(start, end)`` of this rank's finished part holding source row ``row``, else None."""
        k = bisect.bisect_right(self._spans, (row, float("inf"))) - 1
        return self._spans[k] if k >= 0 and row < self._spans[k][1] else None

    def fingerprints(self) -> dict[tuple[int, int], str]:
        return {(p["start"], p["end"]): p["fingerprint"] for p in self.state["parts"]}

    def publish(self, rec: PartRecord, data: list[dict[str, Any]], rejects: list[dict[str, Any]]) -> None:
        """Write the part's files, then list it (the commit point)."""
        assert sum(rec.counts.values()) == rec.end - rec.start, (rec.counts, rec.start, rec.end)
        name = part_name(rec.start, rec.end)
        for d, rows in ((DATA_DIR, data), (REJECTS_DIR, rejects)):
            blob = "".join(json.dumps(r, ensure_ascii=False, default=json_value) + "\n" for r in rows).encode("utf-8")
            atomic_write_bytes(self.out / d / name, blob)
            rec.sha256[d] = hashlib.sha256(blob).hexdigest()
        self.state["parts"].append(asdict(rec))
        bisect.insort(self._spans, (rec.start, rec.end))
        atomic_write_json(self.path, self.state)

    def finish(self, num_rows: int) -> None:
        self.state.update(finished=True, num_rows=num_rows)
        atomic_write_json(self.path, self.state)

    def begin(self, engine: dict[str, Any]) -> None:
        """The rank has work again (not finished), done by ``engine`` (its description)."""
        self.state.update(finished=False, engine=engine)
        atomic_write_json(self.path, self.state)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_folder(out: Path, settings: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Every rank's progress record in ``out`` (rank -> record), after checking that ``out`` is a
    regeneration with these settings (or new).

    Raises:
        ValueError: see :class:`RankProgress`.
    """
    if any(out.glob("*.tar")) or (out / "index").is_dir() or (out / "manifest.json").exists():
        raise ValueError(f"out {out}: holds an extracted dataset (shards/index); use another --out")
    found: dict[int, dict[str, Any]] = {}
    for f in sorted(out.glob("progress-*.json")):
        rec = _read_json(f)
        if rec.get("format") != FORMAT or rec.get("version") != VERSION or not isinstance(rec.get("rank"), int):
            raise ValueError(f"{f}: not the progress file of a regeneration (version {VERSION}); is {out} an "
                             "extraction in progress? Use another --out")
        for k in sorted(set(settings) | set(rec["settings"])):
            if k != "num_samples" and settings.get(k) != rec["settings"].get(k):
                raise ValueError(f"{out}: rank {rec['rank']} ran there with other settings ({k}: "
                                 f"{rec['settings'].get(k)!r} there, {settings.get(k)!r} now); every rank of a "
                                 "regeneration uses the same settings: use another --out")
        found[rec["rank"]] = rec
    if not found and (out / MANIFEST).exists():
        raise ValueError(f"out {out}: a finished regeneration without its progress files (a published copy?) "
                         "cannot be resumed or extended; use another --out")
    return found


def _read_json(p: Path) -> dict[str, Any]:
    try:
        v = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: damaged ({type(e).__name__}: {e}); remove the folder or restore the file") from None
    if not isinstance(v, dict) or not isinstance(v.get("parts"), list) or not isinstance(v.get("settings"), dict):
        raise ValueError(f"{p}: damaged (not a progress record)")
    return v


def _totals(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts summed over ``parts`` (outcomes, reasons, finish reasons, notes, tokens, seconds)."""
    counts = {k: 0 for k in OUTCOMES}
    sums: dict[str, dict[str, int]] = {"reasons": {}, "finish": {}, "notes": {}}
    for part in parts:
        for k, v in part["counts"].items():
            counts[k] += v
        for name, dst in sums.items():
            for k, v in part[name].items():
                dst[k] = dst.get(k, 0) + v
    return {"input_rows": sum(counts.values()), **counts, **{k: dict(sorted(v.items())) for k, v in sums.items()},
            "tokens_generated": sum(p["tokens"] for p in parts),
            "generation_seconds": round(sum(p["seconds"] for p in parts), 3)}


def summarize(out: Path, world_size: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Sum every rank's progress into :data:`MANIFEST`, written when the run is complete: every
    rank has finished and the parts cover source rows ``[0, n)`` without a gap, ``n`` at least
    the rows each rank was asked for (a rerun with a smaller ``num_samples`` shrinks nothing).
    The manifest lists every part (rows, sha256 of its data file), which ``extract`` checks.
    Returned either way, with ``missing``: the first rows no finished part covers, and the ranks
    that have not finished."""
    ranks = [_read_json(progress_path(out, r)) if progress_path(out, r).exists() else None for r in range(world_size)]
    done = [p for p in ranks if p is not None and p["finished"]]
    parts = sorted((part for p in ranks if p for part in p["parts"]), key=lambda x: x["start"])
    asked = max((p["num_rows"] for p in done), default=0)
    covered, gap = 0, None
    for part in parts:  # parts never overlap; a gap is a part some rank still has to do
        if part["start"] != covered:
            gap = [covered, part["start"]]
            break
        covered = part["end"]
    if gap is None and covered < asked:
        gap = [covered, asked]
    complete = len(done) == world_size and gap is None
    man = {"format": FORMAT, "version": VERSION, "complete": complete, "world_size": world_size,
           "ranks_finished": len(done), "ranks_unfinished": [r for r, p in enumerate(ranks) if p not in done],
           "missing_rows": gap, "settings": next((p["settings"] for p in ranks if p), {}),
           "engine": next((p["engine"] for p in ranks if p and p.get("engine")), None),
           "kv_pool_tokens": [((p or {}).get("engine") or {}).get("kv_pool_tokens") for p in ranks], **_totals(parts),
           "parts": [{"name": part_name(p["start"], p["end"]), "regenerated": p["counts"]["regenerated"],
                      "sha256": p.get("sha256", {}).get(DATA_DIR)} for p in parts], **extra}
    if complete:
        assert man["input_rows"] == covered, "every source row has exactly one outcome"
        atomic_write_json(out / MANIFEST, man)
    return man
