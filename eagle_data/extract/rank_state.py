"""What one rank has published, skipped and noted: its progress file, kept true while it runs.

:class:`RankState` owns ``progress-{rank}.json`` and ``skips-{rank}.jsonl`` of one extraction
run. On open it makes the directory agree with the progress file (resume), then

* :meth:`RankState.remember` (the :class:`ErrorPolicy` listener) records every skip and note
  with its detail in the skip log;
* :meth:`RankState.on_publish` (called by the shard writer thread) commits a published shard
  together with the skips and notes seen so far, in one atomic write;
* :meth:`RankState.fresh_records` yields the source rows not extracted yet, fingerprinted for
  their shard's ``source_digest`` (a front in another process reads :func:`fresh_rows` itself and
  reports the fingerprints through :meth:`RankState.fingerprint`).

Each run records the source it reads (``source``, :func:`source_record`): the merge refuses ranks
whose sources differ (a rank rerun after the source changed beside ranks that were not).
"""

from __future__ import annotations

import json
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from eagle_data.extract.fault import Skip
from eagle_data.extract.resume import check_resume, config_hash, load_progress, repair_rank
from eagle_data.format.records import note_reasons
from eagle_data.extract.sink import atomic_write_bytes, atomic_write_json
from eagle_data.extract.sources import RowSource, check_unchanged, combine, record_fingerprint, resolve
from eagle_data.format.fingerprint import files_fingerprint
from eagle_data.format.layout import (CARD_NAME, LOCK_NAME, MANIFEST_NAME, PROGRESS_GLOB, is_own_name,
                                      parse_progress_name, parse_shard_name, progress_path, rank_shard_prefix,
                                      skip_log_name)
from eagle_data.format.schema import sample_key


class RankState:
    """The progress record of one rank (``state``: config, model facts, shards, skipped, notes,
    finished), thread-safe. Use as a context manager (closes the skip log)."""

    def __init__(self, rows: RowSource, out: Path, run_cfg: dict[str, Any], model_facts: dict[str, Any],
                 tag: str):
        """Resume or start this rank's record and make the directory agree with it.

        Args:
            rows: the source rows this rank reads (``num_rows``: the run's ``num_samples``, resolved).
            out: the output directory.
            run_cfg: the run configuration recorded (:func:`~eagle_data.extract.rerun.run_config`).
            model_facts: the model facts of the manifest.
            tag: the dataset tag of the sample keys.

        Raises:
            ValueError: the directory holds a dataset this rank does not own, another rank or an
                earlier run of this rank used another configuration, or the source rows already
                extracted changed since (see :func:`eagle_data.extract.sources.check_unchanged`).
        """
        self.rows, self.out, self.tag = rows, out, tag
        self.path = progress_path(out, rows.rank)
        self._lock = threading.Lock()
        prev = _previous(out, rows.rank, run_cfg)
        if prev is not None:
            check_resume(prev, run_cfg, str(self.path))
            old = prev["config"].get("num_samples")  # more rows extend the run; fewer do not shrink it
            prev["config"]["num_samples"] = None if None in (old, rows.num_rows) else max(old, rows.num_rows)
        self.state = prev or {"config": run_cfg, "config_hash": config_hash(run_cfg), "rank": rows.rank,
                              "world_size": rows.world_size, "model": model_facts, "shards": [], "skipped": {},
                              "finished": False}
        if repair_rank(out, rows.rank, self.state) and (out / MANIFEST_NAME).exists():
            (out / MANIFEST_NAME).unlink()  # no longer describes the directory; merged again at the end
        self.state["finished"] = False
        self.done = {k for s in self.state["shards"] for k in s["keys"]}
        self._check_source()
        self.state["source"] = source_record(rows.data)  # what this run reads: the merge compares the ranks'
        self._prune()
        atomic_write_json(self.path, self.state)
        # str(row) -> reason (skipped) or [reasons] (notes)
        self._unsaved: dict[str, dict[str, Any]] = {"skipped": {}, "notes": {}}
        self._fps: dict[str, int] = {}  # key -> fingerprint of its source row, until published or skipped
        self._log = _reopen_skip_log(out / skip_log_name(rows.rank), self.state)

    def _check_source(self) -> None:  # before anything is changed
        shards = self.state["shards"]
        if self.done and all("source_digest" in s for s in shards):
            c = self.rows
            check_unchanged(c.data, c.split, c.rank, c.world_size, self.done, lambda r: sample_key(self.tag, r),
                            combine(int(s["source_digest"], 16) for s in shards))

    def _prune(self) -> None:
        """Rows an earlier run skipped or noted are decided again (a row fixed in the source since is
        extracted), except those beyond a smaller num_samples, which this run does not read."""
        n = self.rows.num_rows
        beyond = (lambda r: n is not None and int(r) >= n)
        st = self.state
        st["skipped"] = {r: v for r, v in st["skipped"].items() if beyond(r)}
        st["notes"] = {r: v for r, v in st.get("notes", {}).items()
                       if beyond(r) or sample_key(self.tag, int(r)) in self.done}

    @property
    def next_shard(self) -> int:
        """The number of the next shard of this rank's series."""
        return 1 + max((parse_shard_name(s["name"])[1] for s in self.state["shards"]), default=-1)

    @property
    def published_tokens(self) -> int:
        return sum(s["num_tokens"] for s in self.state["shards"])

    @property
    def num_skipped(self) -> int:
        return len(self.state["skipped"]) + len(self._unsaved["skipped"])

    def remember(self, skip: Skip, note: bool) -> None:
        """Record a skip (the row is not in the dataset) or a note (kept but changed), with its detail."""
        with self._lock:
            row = str(skip.row)
            if not note:  # a skipped row is not in the dataset: no fingerprint, no note
                self._fps.pop(sample_key(self.tag, skip.row), None)
                self._unsaved["notes"].pop(row, None)
                self.state["notes"].pop(row, None)
                self._unsaved["skipped"][row] = skip.reason
            else:  # a row may have several notes (e.g. leading turns dropped, then truncated)
                had = self._unsaved["notes"].get(row) or note_reasons(self.state["notes"].get(row))
                self._unsaved["notes"][row] = [*had, skip.reason]
            self._log.write(json.dumps({"row": skip.row, "id": skip.source_id, "kind": "note" if note else "skip",
                                        "reason": skip.reason, "detail": skip.detail}, ensure_ascii=False) + "\n")

    def on_publish(self, rec: dict[str, Any]) -> None:
        """A shard is durable: list it with the skips/notes seen so far in one atomic progress write."""
        with self._lock:
            rec["source_digest"] = combine(self._fps.pop(k) for k in rec["keys"])
            self._commit({"shards": [*self.state["shards"], rec]})

    def finish(self) -> None:
        with self._lock:
            self._commit({"finished": True})

    def _commit(self, extra: dict[str, Any]) -> None:
        st = self.state
        new = {**st, **extra, **{k: {**st[k], **v} for k, v in self._unsaved.items()}}
        atomic_write_json(self.path, new)
        st.update(new)
        for v in self._unsaved.values():
            v.clear()

    def fresh_records(self) -> Iterator[tuple[int, Any]]:
        """``(row, record)`` of this rank's source rows not extracted yet (fingerprinted)."""
        for r, rec, key, fp in fresh_rows(self.rows, self.tag, self.done):
            self.fingerprint(key, fp)
            yield r, rec

    def fingerprint(self, key: str, fp: int) -> None:
        """The fingerprint of the source row of ``key`` (for its shard's ``source_digest``)."""
        with self._lock:
            self._fps[key] = fp

    def __enter__(self) -> "RankState":
        return self

    def __exit__(self, *exc) -> None:
        self._log.close()


def fresh_rows(rows: RowSource, tag: str, done: set[str]) -> Iterator[tuple[int, Any, str, int]]:
    """``(row, record, key, fingerprint)`` of the rank's source rows whose key is not in ``done``."""
    for r, rec in rows.records():
        if (key := sample_key(tag, r)) not in done:
            yield r, rec, key, record_fingerprint(r, rec)


def source_record(data: str) -> dict[str, Any]:
    """The identity of the source ``data`` as a rank's progress records it (:class:`~eagle_data.format.
    records.SourceRecord`): the fingerprint of its local files (a hub dataset's: None), and when it was read.

    Raises:
        ValueError: ``data`` is no source (as :func:`~eagle_data.extract.sources.resolve` says).
        OSError: a file cannot be read.
    """
    builder, kw, _ = resolve(data)
    files = kw.get("data_files")
    rec: dict[str, Any] = (files_fingerprint([files] if isinstance(files, str) else files)
                           if files and builder in ("json", "parquet") else {"fingerprint": None})
    return {**rec, "read_at": datetime.now(timezone.utc).isoformat(timespec="milliseconds")}


def refuse_foreign(out: Path) -> None:
    """Refuse an existing output directory holding files no extraction wrote (a user's
    ``README.md`` would be replaced by the dataset card, a checkpoint folder mixed with shards).

    Raises:
        ValueError: names the directory and the first such files."""
    if not out.is_dir():
        return
    ours = (out / MANIFEST_NAME).exists() or any(out.glob(PROGRESS_GLOB))
    # before any progress file, an extraction has only its lock and a progress file being
    # written (another rank starting); shards without progress are refused by _previous, by name
    early = (lambda n: n == LOCK_NAME or n.startswith("progress-") or parse_shard_name(n.removesuffix(".tmp")))
    foreign = sorted(p.name for p in out.iterdir() if not is_own_name(p.name) or not (ours or early(p.name)))
    if foreign:
        card = f" (its {CARD_NAME} would be replaced)" if CARD_NAME in foreign else ""
        raise ValueError(f"{out} holds files that no extraction wrote ({', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}): refusing to write a dataset into it{card}. "
                         "Use a new or empty --out directory.")


def _previous(out: Path, rank: int, run_cfg: dict[str, Any]) -> dict[str, Any] | None:
    """This rank's previous progress, after refusing to write into a directory we cannot own.

    Raises:
        ValueError: the directory holds shards or a manifest without this rank's progress file
            (a published or copied dataset: resuming would delete its shards), or another
            rank's progress file was written with a different configuration (world size...).
    """
    prev = load_progress(out, rank)
    pre = rank_shard_prefix(rank)
    if prev is None and (any(out.glob(f"{pre}*.tar")) or
                         ((out / MANIFEST_NAME).exists() and not any(out.glob(PROGRESS_GLOB)))):
        raise ValueError(f"{out} already holds a dataset ({MANIFEST_NAME} or {pre}*.tar) without "
                         f"{progress_path(out, rank).name}: refusing to write into it (a resume would delete "
                         "its shards). Use a new --out directory.")
    if prev is not None and not prev["shards"] and not prev["skipped"] and not prev.get("finished"):
        prev = None  # nothing was ever published: a corrected command simply starts over
    for other in sorted(out.glob(PROGRESS_GLOB)):
        r = parse_progress_name(other.name)
        if r is not None and r != rank and (p := load_progress(out, r)) is not None:
            check_resume(p, run_cfg, str(other))
    return prev


def _reopen_skip_log(path: Path, state: dict[str, Any]):
    """The rank's skip log, keeping only the lines of rows an earlier run decided that this run
    does not decide again (``state`` after pruning), then open for appending."""
    kept = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").split("\n"):  # (not splitlines: U+2028 is in JSON text)
            if not line:
                continue
            try:
                x = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if str(x.get("row")) in state["notes" if x.get("kind") == "note" else "skipped"]:
                kept.append(line + "\n")
    atomic_write_bytes(path, "".join(kept).encode("utf-8"))
    return open(path, "a", encoding="utf-8", buffering=1)
