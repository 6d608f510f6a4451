"""Atomic shard writing: USTAR shards readable by stock webdataset / HF datasets.

Each shard is written as ``{rank:05d}-{shard:06d}.tar.tmp`` through a hashing file
wrapper (sha256 + bytes computed while writing, no re-read), fsync'd, renamed to ``.tar``,
and only then recorded: its index rows go to ``index/{shard}.parquet`` and the rank's
progress file ``progress-{rank:05d}.json`` is rewritten atomically (tmp + fsync + rename).
So a listed shard is never partial; a ``.tmp`` left by a crash is deleted on resume and
its samples are redone. A shard (or index part) renamed but not yet listed when the process
died is not listed either: resume deletes it (see :func:`eagle_data.extract.resume.repair_rank`).

Every temporary file is named ``NAME.<pid>.tmp`` (or ``.tar.tmp`` for shards, whose name is
already unique per rank), so concurrent writers of the same file (several ranks merging the
manifest at once) never share a temporary, and every write path removes its temporary when
it fails (``ENOSPC``...). Errors are ``OSError`` as raised by the OS.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from eagle_data.extract.writeback import WriteBehind
from eagle_data.format.layout import INDEX_DIR, index_part, shard_name
from eagle_data.format.records import ShardRecord
from eagle_data.format.schema import INDEX_SCHEMA, encode_sample_parts
from eagle_data.format.tar import archive_end, member_padding, tar_member_header


def tmp_name(path: Path) -> Path:
    """The temporary next to ``path`` used by this process: ``NAME.<pid>.tmp``."""
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


@contextmanager
def _atomic(path: Path):
    """Yield the temporary of ``path``; on success fsync it, rename it over ``path`` and fsync
    the directory; on any error remove the temporary and re-raise (``path`` unchanged)."""
    path = Path(path)
    tmp = tmp_name(path)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via tmp + fsync + rename (readers see old or new, never partial).

    Raises:
        OSError: the write failed (e.g. ``ENOSPC``); ``path`` is unchanged and the temporary removed.
    """
    with _atomic(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode("utf-8"))


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _HashingFile:
    """Write-only file computing sha256 and byte count on the fly; the disk write of each full
    chunk starts while the shard is still being filled (:class:`WriteBehind`).

    :meth:`write` takes a sample's buffers at once and hands them to the OS in one ``writev``
    (unbuffered) while a thread of its own hashes them: a writer's time per sample is the longer of
    the two, not their sum (sha256 runs at 1.1–1.3 GB/s per core on the H200's host, about what one
    writer's share of the disk is; ``python -m benchmarks writers``, BENCHMARKS.md). Hashing and
    the write release the GIL, so a writer thread takes it back a few times per sample, not once
    per buffer (the thread launching the forward shares it).
    """

    def __init__(self, path: str):
        self.f = open(path, "wb", buffering=0)
        self._h = hashlib.sha256()
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="shard-hash")
        self._hashing: Future | None = None  # the last sample's hash, at most one at a time
        self.n = 0
        self.discarded = False
        self.behind = WriteBehind(self.f.fileno())

    def _hash(self, views: list[memoryview]) -> None:
        for v in views:
            self._h.update(v)

    def _hashed(self) -> None:
        if self._hashing is not None:
            self._hashing.result()
            self._hashing = None

    def write(self, bufs: list) -> int:
        """Append ``bufs`` (bytes-like, C-contiguous) in order; returns the bytes written. The
        buffers are read (hashed) until the next call or :meth:`hexdigest`: they must not change.

        Raises:
            OSError: the write failed (``ENOSPC``...).
        """
        views = [memoryview(b).cast("B") for b in bufs]
        self._hashed()
        self._hashing = self._hasher.submit(self._hash, views)
        k = _writev_all(self.f.fileno(), [v for v in views if v.nbytes])
        self.n += k
        self.behind.written(self.n)
        return k

    def hexdigest(self) -> str:
        """The sha256 of every byte written."""
        self._hashed()
        return self._h.hexdigest()

    def discard(self) -> None:
        """Close without fsync, ignoring errors (a full disk fails again)."""
        self.discarded = True
        self._hasher.shutdown(wait=True, cancel_futures=True)
        try:
            self.f.close()
        except OSError:
            pass

    def close(self):
        if not self.discarded and not self.f.closed:
            self._hashed()
            self._hasher.shutdown()
            os.fsync(self.f.fileno())
            self.f.close()


def _writev_all(fd: int, views: list[memoryview]) -> int:
    """``os.writev`` until every byte of ``views`` is written (a short write continues where it
    stopped; at most ``IOV_MAX`` buffers per call); returns the byte count."""
    total, i = 0, 0
    while i < len(views):
        n = os.writev(fd, views[i:i + _IOV_MAX])
        if n <= 0:
            raise OSError(f"writev wrote {n} bytes")
        total += n
        while i < len(views) and n >= views[i].nbytes:
            n -= views[i].nbytes
            i += 1
        if n:
            views[i] = views[i][n:]
    return total


def _iov_max() -> int:
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        return 1024
    return min(n, 1024) if n > 0 else 1024


_IOV_MAX = _iov_max()  # buffers per writev call (POSIX's limit; 1024 on Linux)


def index_row(key: str, shard: str, meta: dict[str, Any], input_ids: torch.Tensor,
              loss_mask: torch.Tensor) -> dict[str, Any]:
    """One ``index.parquet`` row, incl. the sparse histogram of supervised token ids (numpy: no
    torch call, see :class:`_HashingFile` on the GIL)."""
    sup = input_ids.numpy()[loss_mask.numpy() != 0]
    ids, counts = np.unique(sup, return_counts=True)  # sorted ascending
    return {"key": key, "shard": shard, "source_id": str(meta["source_id"]),
            "source_row": int(meta["source_row"]), "num_turns": int(meta["num_turns"]),
            "num_tokens": int(input_ids.shape[0]), "num_loss_tokens": int(sup.shape[0]),
            "truncated": bool(meta["truncated"]),
            "loss_token_ids": ids.astype(np.int32).tolist(), "loss_token_counts": counts.astype(np.int32).tolist()}


def write_parquet_atomic(path: Path, table: pa.Table) -> None:
    """``pq.write_table`` via tmp + fsync + rename.

    Raises:
        OSError: the write failed; ``path`` is unchanged and the temporary removed.
    """
    with _atomic(path) as tmp:
        pq.write_table(table, tmp)


def write_index_part(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write one shard's index rows (schema :data:`INDEX_SCHEMA`) atomically."""
    write_parquet_atomic(path, pa.Table.from_pylist(rows, schema=INDEX_SCHEMA))


class ShardSink:
    """Writes samples into atomic USTAR shards and reports each published shard.

    The tar framing (headers and padding from :mod:`eagle_data.format.tar`) is written here
    rather than through ``webdataset.ShardWriter``: the payload buffers (safetensors header +
    views of the tensors' own memory, see :func:`eagle_data.format.schema.safetensors_parts`) go
    to the file and to sha256 without any copy and with the GIL released, which is what lets
    extraction keep up with the GPU (webdataset's writer copies each payload several times under
    the GIL). The archives are byte-identical to what ``tarfile`` writes in USTAR format for the
    same members (``KEY.json`` then ``KEY.safetensors``; tested), so stock
    ``webdataset``/``datasets`` read them.

    Args:
        out_dir: dataset directory.
        rank: this process's rank (shard names ``{rank:05d}-{shard:06d}.tar``).
        start_shard: first shard number (resume continues after the last published one).
        shard_step: distance between this sink's shard numbers (several sinks of one rank
            interleave: sink ``w`` of ``W`` uses ``start + w, start + w + W, ...``).
        max_samples / max_bytes: a shard is closed once it holds this many samples / bytes.
        on_publish: called with the shard record
            ``{"name", "num_samples", "bytes", "sha256", "num_tokens", "keys"}`` after the shard
            and its index part are durable on disk. If it raises, the shard and its index part
            are deleted again (it was never published) and the error propagates.

    Errors of the file system (``OSError``, e.g. ``ENOSPC``) propagate from :meth:`write` and
    :meth:`close`; the caller then calls :meth:`abort`, which removes the shard in progress.
    """

    def __init__(self, out_dir: str | Path, rank: int = 0, start_shard: int = 0,
                 max_samples: int = 1000, max_bytes: float = 3e9,
                 on_publish: Callable[[dict[str, Any]], None] | None = None, shard_step: int = 1):
        self.out = Path(out_dir)
        (self.out / INDEX_DIR).mkdir(parents=True, exist_ok=True)
        self.rank, self.shard, self.step = rank, start_shard, shard_step
        self.max_samples, self.max_bytes = max_samples, max_bytes
        self.on_publish = on_publish
        self._file: _HashingFile | None = None
        self._path: Path | None = None
        self._rows: list[dict[str, Any]] = []
        self.published: list[dict[str, Any]] = []
        self.bytes_written = 0
        self._closed = False

    def _open(self) -> None:
        self._path = self.out / (shard_name(self.rank, self.shard) + ".tmp")
        self.shard += self.step
        self._file = _HashingFile(str(self._path))
        self._rows = []

    def write(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Append one sample (see :func:`eagle_data.format.schema.encode_sample_parts`).

        Raises:
            ValueError: bad key or tensors (nothing written).
            OSError: writing failed; call :meth:`abort`.
        """
        if self._closed:
            raise RuntimeError("ShardSink is closed")
        parts = encode_sample_parts(key, tensors, meta)
        if self._file is not None and (len(self._rows) >= self.max_samples or self._file.n >= self.max_bytes):
            self._finish()
        if self._file is None:
            self._open()
        small, bufs = [], []  # the members' headers, the JSON and the safetensors header go in one buffer
        for ext in sorted(parts):
            data = parts[ext]
            size = sum(memoryview(b).nbytes for b in data)
            small.append(tar_member_header(f"{key}.{ext}", size))
            for b in data:
                if isinstance(b, bytes):
                    small.append(b)
                else:
                    bufs += [b"".join(small), b]
                    small = []
            small.append(member_padding(size))
        self._file.write([*bufs, b"".join(small)])
        name = self._path.name.removesuffix(".tmp")
        self._rows.append(index_row(key, name, meta, tensors["input_ids"], tensors["loss_mask"]))

    def _finish(self) -> None:
        """End the current archive (two zero blocks + record padding) and publish it."""
        f, tmp = self._file, self._path
        self._file = None
        try:
            f.write([archive_end(f.n)])
            f.close()
        except BaseException:
            f.discard()  # its hashing thread and handle go now (abort() no longer sees this file)
            raise
        rows, self._rows = self._rows, []
        final = tmp.with_name(tmp.name.removesuffix(".tmp"))
        part = index_part(self.out, final.name)
        os.replace(tmp, final)
        try:
            _fsync_dir(final.parent)
            write_index_part(part, rows)
            rec: ShardRecord = {"name": final.name, "num_samples": len(rows), "bytes": f.n, "sha256": f.hexdigest(),
                   "num_tokens": sum(r["num_tokens"] for r in rows), "keys": [r["key"] for r in rows]}
            if self.on_publish is not None:
                self.on_publish(rec)
        except BaseException:
            # not recorded -> not published: remove what was renamed (resume would, too)
            final.unlink(missing_ok=True)
            part.unlink(missing_ok=True)
            raise
        self.bytes_written += f.n
        self.published.append(rec)

    def end_shard(self) -> None:
        """Publish the current shard now (if it holds samples); the next write opens a new one."""
        if self._file is not None:
            self._finish()

    @property
    def pending_bytes(self) -> int:
        return self._file.n if self._file is not None and not self._file.f.closed else 0

    def close(self) -> None:
        """Publish the last shard (if non-empty).

        Raises:
            OSError: writing failed; call :meth:`abort`.
        """
        if not self._closed:
            if self._file is not None:
                self._finish()
            self._closed = True

    def abort(self) -> None:
        """Drop the shard being written (its samples are redone on resume). Never raises
        ``OSError`` (closing a file on a full disk fails again; the file is deleted anyway)."""
        if self._closed:
            return
        self._closed = True
        self._rows = []
        if self._file is not None:
            self._file.discard()
            self._file = None
        if self._path is not None:
            self._path.unlink(missing_ok=True)
