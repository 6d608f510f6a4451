"""What a rank resumes from: its progress file, its lock on the output directory, the repair of the
directory before it resumes, and the check that a rerun (or another rank) ran the same configuration.

* ``progress-{rank:05d}.json`` (one per rank, rewritten atomically after every published
  shard): the run config + its hash, published shards (name, samples, bytes, sha256, keys),
  skipped source rows with their reasons, noted rows (kept but changed, e.g. a conversation
  cut before a blank reply) with theirs, and ``finished``.

Crash safety: a rank's progress file is the only truth about what it has published. A
shard or index part on disk that the progress file does not list (the process died between
the rename and the progress write), or any temporary, is deleted by :func:`repair_rank`
before a rank resumes; a listed shard whose file is gone or has the wrong size is forgotten
and its samples are redone. :func:`lock_rank` keeps two processes from running one rank.
The merge of the ranks' progress files into ``manifest.json`` is :mod:`eagle_data.extract.manifest`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from eagle_data.format.layout import (INDEX_DIR, LOCK_NAME, PROGRESS_NAME, index_part, progress_path,
                                      rank_shard_prefix, shard_of_index_part)
from eagle_data.format.records import RankProgress

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
