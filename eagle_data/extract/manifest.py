"""Run configuration, per-rank progress files, and the merged ``manifest.json``.

* ``progress-{rank:05d}.json`` (one per rank, rewritten atomically after every published
  shard): the run config + its hash, published shards (name, samples, bytes, sha256, keys),
  skipped source rows with their reasons, noted rows (kept but changed, e.g. a conversation
  cut before a blank reply) with theirs, and ``finished``.
* ``manifest.json`` (written by :func:`merge` once every rank has finished): schema
  version, config, model facts, all shards, skip and note counts by reason, totals, package
  versions; plus ``index.parquet`` consolidated from ``index/*.parquet``. The merge refuses
  ranks that read different sources (:class:`RanksDisagree`: a rank rerun after the source
  changed beside ranks that were not), and writes nothing for an extraction of no sample
  (:class:`NoSamples`).

Crash safety: a rank's progress file is the only truth about what it has published. A
shard or index part on disk that the progress file does not list (the process died between
the rename and the progress write), or any temporary, is deleted by :func:`repair_rank`
before a rank resumes; a listed shard whose file is gone or has the wrong size is forgotten
and its samples are redone. :func:`lock_rank` keeps two processes from running one rank.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import platform
import time
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_data.format.layout import (CARD_NAME, INDEX_DIR, INDEX_NAME, LOCK_NAME, MANIFEST_NAME, PROGRESS_GLOB,
                                      PROGRESS_NAME, index_part, progress_path, rank_shard_prefix, shard_of_index_part)
from eagle_data.format.card import dataset_card
from eagle_data.format.records import Manifest, RankProgress, no_samples_message, note_reasons
from eagle_data.format.schema import FINAL_STATE_NORM, INDEX_SCHEMA, LAYER_ID_CONVENTION, SCHEMA_VERSION
from eagle_data.host import pid_alive
from eagle_data.extract.sink import atomic_write_bytes, atomic_write_json, write_parquet_atomic

log = logging.getLogger(__name__)

#: config fields that must be equal for a resume or a merge to mix outputs (``num_samples`` is
#: not one: rerunning with more rows of the same source extends a finished run)
RESUME_KEYS = ("model_path", "weights_fingerprint", "tokenizer_sha256", "template", "dtype", "storage_dtype",
               "final_storage_dtype", "final_rows", "aux_layer_ids", "max_length", "data", "dataset_tag", "split", "world_size")


#: config fields a resume may change: how samples are batched (not what is stored); a change is logged
BATCHING_KEYS = ("batch_tokens", "max_batch_size", "sort_window", "backend", "backend_kwargs")


def config_hash(cfg: dict[str, Any]) -> str:
    sub = {k: cfg.get(k) for k in RESUME_KEYS}
    return hashlib.sha256(json.dumps(sub, sort_keys=True).encode()).hexdigest()[:16]


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("eagle-data", "torch", "transformers", "webdataset", "datasets", "safetensors", "sglang"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def load_progress(out_dir: Path, rank: int) -> RankProgress | None:
    """This rank's progress record, or ``None`` if the rank has not started.

    Raises:
        ValueError: the file is not valid JSON or lacks a progress record's fields (it is written
            atomically, so only by hand).
    """
    p = progress_path(out_dir, rank)
    return read_progress(p) if p.exists() else None


#: the fields every progress file has (:class:`eagle_data.format.records.RankProgress`)
_PROGRESS_FIELDS = {"config": dict, "rank": int, "world_size": int, "model": dict, "shards": list, "skipped": dict}


def read_progress(p: Path) -> RankProgress:
    """One progress file, checked for the fields and types of a :class:`RankProgress`.

    Raises:
        ValueError: naming the file and what is wrong.
    """
    try:
        rec = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not valid JSON ({e}); it is only ever replaced atomically, so it "
                         "was edited or damaged outside eagle-data") from e
    bad = [k for k, t in _PROGRESS_FIELDS.items() if not isinstance(rec, dict) or not isinstance(rec.get(k), t)]
    if bad:
        raise ValueError(f"{p}: not an eagle-data progress record (missing or mistyped: {bad}); it was edited "
                         "or damaged outside eagle-data")
    for s in rec["shards"]:
        if not (isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("bytes"), int)
                and isinstance(s.get("keys"), list) and isinstance(s.get("num_tokens"), int)):
            raise ValueError(f"{p}: a shard record is damaged: {str(s)[:120]}")
    return rec


def out_path(out: str) -> Path:
    """``out`` as a path; one with a ``..`` component resolved first (``m/n/..`` is ``m``: the
    missing ``m/n`` is neither created nor left behind), so that every check sees the folder really
    written, and the path printed and recorded exists.

    Raises:
        ValueError: ``..`` follows an existing file (``afile/..``, which the OS refuses too).
    """
    path = Path(out)
    if ".." not in path.parts:
        return path
    here = Path(path.anchor)
    for part in path.parts[1 if path.anchor else 0:]:
        if part == ".." and here.exists() and not here.is_dir():
            raise ValueError(f"out {out!r}: {str(here)!r} is not a directory")
        here = here / part
    return Path(os.path.realpath(out))


def open_out(out: str, rank: int, doing: str = "extracted") -> tuple[Path, int | None]:
    """Create the output directory ``out`` (already resolved by the caller: :func:`out_path`) and lock
    ``rank`` in it (:func:`lock_rank`).

    Raises:
        ValueError: the directory cannot be created, or the rank is locked by a live process.
    """
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"out {out!r}: cannot create the directory ({e.strerror or e})") from e
    return path, lock_rank(path, rank, doing)


def lock_rank(out_dir: Path, rank: int, doing: str = "extracted") -> int | None:
    """Take an exclusive lock on byte ``rank`` of ``OUT/.eagle-data.lock`` (released by the OS
    when the process exits, also on SIGKILL). Returns the fd to keep open (``None`` where the
    file system has no locks). A lock file removed between its opening and the lock (a failed run
    removes the lock file that nobody holds, :func:`eagle_data.extract.run.run_extract`) is
    opened again: the lock is always on the file the path names.

    Raises:
        ValueError: another live process is running this rank on this output directory.
    """
    import fcntl

    path = Path(out_dir) / LOCK_NAME
    while True:
        Path(out_dir).mkdir(parents=True, exist_ok=True)  # (removed with it when it held only the lock)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise ValueError(f"{out_dir}: rank {rank} is being {doing} by another process right now; "
                                 "wait for it or stop it before resuming") from e
            log.warning("%s: file locks unsupported (%s); not guarding against concurrent runs", out_dir, e)
            return None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # locked a file that was removed meanwhile: again


def repair_rank(out_dir: Path, rank: int, state: dict[str, Any]) -> list[str]:
    """Make the directory agree with ``state`` (this rank's progress record) before resuming.

    Deletes this rank's temporaries, shards/index parts not listed in ``state`` (a crash after a
    rename but before the progress write) and forgets listed shards whose file is missing or
    has another size than recorded (their samples are redone). Listed shards are only
    ``stat``-ed, never read. Mutates ``state["shards"]``; returns what was done, one line each.
    Only call it while holding :func:`lock_rank`.
    """
    out, pre = Path(out_dir), rank_shard_prefix(rank)
    actions: list[str] = []

    def rm(p: Path, why: str) -> None:
        p.unlink(missing_ok=True)
        actions.append(f"deleted {p.relative_to(out)} ({why})")

    for p in [*out.glob(f"{pre}*.tmp"), *out.glob(PROGRESS_NAME.format(rank=rank) + "*.tmp"),
              *(out / INDEX_DIR).glob(f"{pre}*.tmp")]:
        rm(p, "temporary of an interrupted write")
    kept = []
    for s in state["shards"]:
        f, part = out / s["name"], index_part(out, s["name"])
        size = f.stat().st_size if f.exists() else None
        if size == s["bytes"] and part.exists():
            kept.append(s)
            continue
        actions.append(f"forgot listed shard {s['name']} ({'missing' if size is None else 'size differs' if size != s['bytes'] else 'index part missing'}); its samples are redone")
    state["shards"] = kept
    listed = {s["name"] for s in kept}
    for p in out.glob(f"{pre}*.tar"):
        if p.name not in listed:
            rm(p, "not listed in the progress file: written but never recorded")
    for p in (out / INDEX_DIR).glob(f"{pre}*.parquet"):
        if shard_of_index_part(p.name) not in listed:
            rm(p, "index part of an unlisted shard")
    for a in actions:
        log.warning("rank %d resume: %s", rank, a)
    return actions


def _remove_stale_tmps(out: Path, names: tuple[str, ...]) -> None:
    """Remove ``NAME.<pid>.tmp`` left by dead processes on this host (live ones are merging)."""
    for name in names:
        for p in out.glob(f"{name}.*.tmp"):
            pid = p.name[len(name) + 1:-4]
            if not pid.isdigit() or not pid_alive(int(pid)):
                p.unlink(missing_ok=True)


def check_resume(prev: dict[str, Any], cfg: dict[str, Any], where: str) -> None:
    """Refuse to mix outputs of different runs.

    Raises:
        ValueError: names every config field that differs.
    """
    old = prev.get("config", {})
    diff = [k for k in RESUME_KEYS if not _same(k, old.get(k), cfg.get(k))]
    if diff:
        lines = "\n".join(_describe_diff(k, old.get(k), cfg.get(k)) for k in diff)
        raise ValueError(f"{where} was written by a different run configuration; refusing to mix:\n{lines}\n"
                         "Use a new --out directory (or the original settings to resume).")
    moved = [k for k in BATCHING_KEYS if k in old and old[k] != cfg.get(k)]
    if moved:
        log.warning("%s: resuming with other batching settings (%s); the samples of this run are batched "
                    "otherwise than the earlier ones (float rounding of other kernel shapes, ~1e-6 relative in "
                    "float32); the manifest keeps the first run's values", where,
                    ", ".join(f"{k} {old[k]!r} -> {cfg.get(k)!r}" for k in moved))


def _same(key: str, old: Any, new: Any) -> bool:
    """Equal, or (``data``, ``model_path``) two spellings of one existing local file or folder
    (relative vs absolute, a symlink): resuming from another working directory is the same run."""
    if old == new:
        return True
    if key in ("data", "model_path") and isinstance(old, str) and isinstance(new, str):
        try:
            return os.path.samefile(old, new)
        except (OSError, ValueError):
            return False
    return False


def _describe_diff(key: str, old: Any, new: Any) -> str:
    """One line per differing setting; for mappings (the template record) only the entries that differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        return "\n".join(f"  {key}.{k}: existing {old.get(k)!r} != this run {new.get(k)!r}" for k in keys)
    return f"  {key}: existing {old!r} != this run {new!r}"


class RanksDisagree(ValueError):
    """The ranks of one output directory read different sources (or different parts of it): merged,
    the rows now of a rank that was not rerun would be missing or stale."""


class NoSamples(ValueError):
    """Every rank finished and none published a sample: there is no dataset to write."""


def merge(out_dir: str | Path, allow_unfinished: bool = False) -> Manifest:
    """Combine all ranks' progress files and index parts into ``manifest.json`` + ``index.parquet``.

    Idempotent and safe to run concurrently (each writer uses its own temporary; both write
    the same content). Shards are listed in (rank, shard) order; ``index.parquet`` rows follow.

    Raises:
        RanksDisagree: the ranks read different sources (:func:`check_same_source`); an earlier
            merge's manifest, index and card are removed (they no longer describe the ranks' data).
        NoSamples: no rank published a sample (a manifest, index and card an earlier merge wrote are
            removed: the folder does not look like a dataset).
        ValueError: no progress files, ranks missing/unfinished, mixed configs, duplicate keys
            or shard names, a listed index part missing.
    """
    out = Path(out_dir)
    _remove_stale_tmps(out, (MANIFEST_NAME, INDEX_NAME, CARD_NAME))
    paths = sorted(out.glob(PROGRESS_GLOB))
    if not paths:
        raise ValueError(f"{out}: no progress-*.json files; is this an eagle-data output directory?")
    progs = [read_progress(p) for p in paths]
    world = progs[0]["config"]["world_size"]
    ranks = sorted(p["rank"] for p in progs)
    if ranks != list(range(world)):
        raise ValueError(f"{out}: expected progress files for ranks 0..{world - 1} (world_size {world}), "
                         f"found {ranks}")
    for p in progs[1:]:
        check_resume(progs[0], p["config"], str(progress_path(out, p["rank"])))
    unfinished = [p["rank"] for p in progs if not p.get("finished")]
    if unfinished and not allow_unfinished:
        raise ValueError(f"{out}: rank(s) {unfinished} have not finished; rerun them (same command) to resume")
    progs.sort(key=lambda p: p["rank"])
    try:
        check_same_source(out, progs)
    except RanksDisagree:
        _unpublish(out)  # an earlier merge's files describe a dataset the ranks no longer agree on
        raise
    shards = [s for p in progs for s in sorted(p["shards"], key=lambda s: s["name"])]
    names = [s["name"] for s in shards]
    if len(names) != len(set(names)):
        raise ValueError(f"{out}: a shard is listed twice: {[n for n, c in Counter(names).items() if c > 1][:5]}")
    keys = [k for s in shards for k in s["keys"]]
    if len(keys) != len(set(keys)):
        dup = [k for k, n in Counter(keys).items() if n > 1][:5]
        raise ValueError(f"{out}: duplicate sample keys across shards, e.g. {dup}")
    skips, notes = Counter(), Counter()
    for p in progs:
        skips.update(p["skipped"].values())
        notes.update(r for v in p.get("notes", {}).values() for r in note_reasons(v))
    if not shards:
        _unpublish(out)  # of an older version, which wrote them
        with contextlib.suppress(OSError):  # empty (every rank finished with no shard): no dataset's folder
            (out / INDEX_DIR).rmdir()
        raise NoSamples(no_samples_message(out, dict(skips)))
    damaged = [f"{s['name']} ({'missing' if not (out / s['name']).is_file() else 'size differs from the record'})"
               for s in shards if not (out / s["name"]).is_file() or (out / s["name"]).stat().st_size != s["bytes"]]
    if damaged:
        raise ValueError(f"{out}: listed shard(s) {damaged[:5]} are not as published; rerun the extraction of "
                         "their rank (a resume redoes their samples), then merge")
    parts = [index_part(out, s["name"]) for s in shards]
    missing = [str(pp.relative_to(out)) for pp in parts if not pp.exists()]
    if missing:
        raise ValueError(f"{out}: index part(s) of listed shards missing: {missing[:5]}; rerun the "
                         "extraction of that rank (resume redoes those shards)")
    tables = [pq.read_table(pp) for pp in parts]
    write_parquet_atomic(out / INDEX_NAME, pa.concat_tables(tables) if tables else INDEX_SCHEMA.empty_table())
    cfg = progs[0]["config"]
    manifest: Manifest = {
        "schema_version": SCHEMA_VERSION,
        "layer_id_convention": LAYER_ID_CONVENTION,
        "final_state_norm": FINAL_STATE_NORM,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": cfg,
        "config_hash": config_hash(cfg),
        **progs[0]["model"],
        "world_size": world,
        "shards": [{k: v for k, v in s.items() if k != "keys"} for s in shards],
        "num_samples": len(keys),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "total_bytes": sum(s["bytes"] for s in shards),
        "skip_counts": dict(sorted(skips.items())),
        "num_skipped": sum(skips.values()),
        "note_counts": dict(sorted(notes.items())),
        "packages": package_versions(),
        "complete": not unfinished,
    }
    if "source" in progs[0]:
        manifest["source"] = {k: v for k, v in progs[0]["source"].items() if k != "read_at"}
    atomic_write_json(out / MANIFEST_NAME, manifest)
    atomic_write_bytes(out / CARD_NAME, dataset_card(manifest).encode("utf-8"))
    return manifest


def _unpublish(out: Path) -> None:
    """Remove the merged files (manifest, index, card): readers then say the folder is no dataset."""
    for name in (MANIFEST_NAME, INDEX_NAME, CARD_NAME):
        (out / name).unlink(missing_ok=True)


def check_same_source(out: Path, progs: list[RankProgress]) -> None:
    """Refuse to merge ranks that read different sources: each rank records the source its last
    run read (``source``: the fingerprint of its files); of finished ranks, each must hold a
    decision (a sample or a skip) for every row of its share up to the last row any rank read:
    rank ``r`` of ``w`` owns rows ``row % w == r``, and a rank that read a source with fewer rows,
    or fewer ``--num_samples``, misses rows the others' extent gives it. Ranks whose last runs
    had different ``--num_samples`` are refused too: a row of theirs past every rank's last row
    (the extent's end) cannot be told missing. Checked when any rank recorded its source
    (extractions of this version; not synthetic datasets).

    Raises:
        RanksDisagree: names the ranks, what differs, and to rerun them.
    """
    if not any("source" in p for p in progs):
        return
    world = progs[0]["world_size"]
    problems, stale = [], set()
    rows = {p["rank"]: {_key_row(k) for s in p["shards"] for k in s["keys"]} | {int(r) for r in p["skipped"]}
            for p in progs if p.get("finished")}
    end = 1 + max((max(r) for r in rows.values() if r), default=-1)  # rows read by the rank that read furthest
    furthest = sorted(r for r, got in rows.items() if got and max(got) == end - 1)
    for rank, got in sorted(rows.items()):
        lost = sorted(set(range(rank, end, world)) - got)
        if lost:
            stale.add(rank)
            upto = f"up to row {max(got)}" if got else "no row"
            problems.append(f"  rank {rank} holds {len(got)} source row(s) ({upto}); rank(s) {furthest} read up to "
                            f"row {end - 1}, so at least {len(lost)} row(s) of rank {rank} would be missing: "
                            f"{', '.join(map(str, lost[:5]))}{' ...' if len(lost) > 5 else ''}")
    groups: dict[tuple, list[int]] = {}  # (fingerprint, files, bytes) -> ranks; all None: not recorded
    for p in progs:
        src = p.get("source") or {}
        groups.setdefault((src.get("fingerprint"), src.get("files"), src.get("bytes")), []).append(p["rank"])
    if len(groups) > 1:
        read_at = {p["rank"]: (p.get("source") or {}).get("read_at") or "" for p in progs}

        def what(key: tuple, ranks: list[int]) -> str:
            fp, n, size = key
            when = ", ".join(sorted({read_at[r] or "?" for r in ranks}))
            return (f"rank(s) {ranks} read " + (f"{n} file(s), {size} bytes, sha256 {fp[:16]} (at {when})" if fp
                    else "a source not recorded (a hub dataset, or a run of an older eagle-data version)"))

        problems.append("  the source files differ: " + "; ".join(what(k, rs) for k, rs in groups.items()))
        if not stale:  # no row missing: the ranks that read before the latest read are stale
            latest = max(groups.values(), key=lambda rs: max(read_at[r] for r in rs))
            stale = {r for rs in groups.values() if rs is not latest for r in rs}
    nums = {p["rank"]: p["config"].get("num_samples") for p in progs}
    if len(set(nums.values())) > 1:  # rows past the furthest rank's last one may be missing unseen
        problems.append(f"  --num_samples differs: {', '.join(f'rank {r}: {n}' for r, n in sorted(nums.items()))}")
        if not stale:  # the ranks whose last run read another extent than the latest run
            at = {p["rank"]: (p.get("source") or {}).get("read_at") or "" for p in progs}
            latest = nums[max(at, key=at.get)]
            stale = {r for r, n in nums.items() if n != latest}
    if problems:
        raise RanksDisagree(f"{out}: the ranks did not read the same source; refusing to merge (the rows of rank(s) "
                            f"{sorted(stale)} would be missing or stale):\n" + "\n".join(problems) + "\n"
                            f"The source (or --num_samples) changed between the ranks' runs. Rerun rank(s) "
                            f"{sorted(stale)} with the same source and command as the others (a rerun resumes), "
                            "then merge (the last rank to finish merges by itself).")


def _key_row(key: str) -> int:
    """The source row of a sample key (``TAG_ROW``, :func:`eagle_data.format.schema.sample_key`)."""
    return int(key.rpartition("_")[2])
