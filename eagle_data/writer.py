"""Atomic shard writing on top of ``webdataset.ShardWriter``.

Each shard is written as ``{rank:05d}-{shard:06d}.tar.tmp`` through a hashing file
wrapper (sha256 + bytes computed while writing, no re-read), fsync'd, renamed to ``.tar``,
and only then recorded: its index rows go to ``index/{shard}.parquet`` and the rank's
progress file ``progress-{rank:05d}.json`` is rewritten atomically (tmp + fsync + rename).
So a listed shard is never partial; a ``.tmp`` left by a crash is deleted on resume and
its samples are redone. A shard (or index part) renamed but not yet listed when the process
died is not listed either: resume deletes it (see :func:`eagle_data.manifest.repair_rank`).

Every temporary file is named ``NAME.<pid>.tmp`` (or ``.tar.tmp`` for shards, whose name is
already unique per rank), so concurrent writers of the same file (several ranks merging the
manifest at once) never share a temporary, and every write path removes its temporary when
it fails (``ENOSPC``...). Errors are ``OSError`` as raised by the OS.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import webdataset as wds

from .schema import encode_sample

INDEX_DIR = "index"
INDEX_SCHEMA = pa.schema([
    ("key", pa.string()), ("shard", pa.string()), ("source_id", pa.string()),
    ("source_row", pa.int64()), ("num_turns", pa.int32()), ("num_tokens", pa.int32()),
    ("num_loss_tokens", pa.int32()), ("truncated", pa.bool_()),
    ("loss_token_ids", pa.list_(pa.int32())), ("loss_token_counts", pa.list_(pa.int32())),
])


def tmp_name(path: Path) -> Path:
    """The temporary next to ``path`` used by this process: ``NAME.<pid>.tmp``."""
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via tmp + fsync + rename (readers see old or new, never partial).

    Raises:
        OSError: the write failed (e.g. ``ENOSPC``); ``path`` is unchanged and the temporary removed.
    """
    path = Path(path)
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


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
    """Write-only file wrapper computing sha256 and byte count on the fly."""

    def __init__(self, path: str):
        self.f = open(path, "wb")
        self.h = hashlib.sha256()
        self.n = 0
        self.discarded = False

    def write(self, b) -> int:
        if self.discarded:  # late writes of an abandoned tar stream (its __del__) go nowhere
            return len(b)
        self.h.update(b)
        self.n += len(b)
        return self.f.write(b)

    def discard(self) -> None:
        """Close without fsync, ignoring errors (a full disk fails again); drop later writes."""
        self.discarded = True
        try:
            self.f.close()
        except OSError:
            pass

    def flush(self):
        if not self.discarded:
            self.f.flush()

    def tell(self) -> int:
        return self.n

    def close(self):
        if not self.discarded and not self.f.closed:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()


def index_row(key: str, shard: str, meta: dict[str, Any], input_ids: torch.Tensor,
              loss_mask: torch.Tensor) -> dict[str, Any]:
    """One ``index.parquet`` row, incl. the sparse histogram of supervised token ids."""
    sup = input_ids[loss_mask.bool()]
    ids, counts = torch.unique(sup, return_counts=True)  # sorted ascending
    return {"key": key, "shard": shard, "source_id": str(meta["source_id"]),
            "source_row": int(meta["source_row"]), "num_turns": int(meta["num_turns"]),
            "num_tokens": int(input_ids.shape[0]), "num_loss_tokens": int(sup.shape[0]),
            "truncated": bool(meta["truncated"]),
            "loss_token_ids": ids.to(torch.int32).tolist(), "loss_token_counts": counts.to(torch.int32).tolist()}


def write_parquet_atomic(path: Path, table: pa.Table) -> None:
    """``pq.write_table`` via tmp + fsync + rename.

    Raises:
        OSError: the write failed; ``path`` is unchanged and the temporary removed.
    """
    tmp = tmp_name(path)
    try:
        pq.write_table(table, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_index_part(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write one shard's index rows (schema :data:`INDEX_SCHEMA`) atomically."""
    write_parquet_atomic(path, pa.Table.from_pylist(rows, schema=INDEX_SCHEMA))


class ShardSink:
    """Writes encoded samples into atomic shards and reports each published shard.

    Args:
        out_dir: dataset directory.
        rank: this process's rank (shard names ``{rank:05d}-{shard:06d}.tar``).
        start_shard: first shard number (resume continues after the last published one).
        max_samples / max_bytes: shard size limits (``webdataset.ShardWriter`` maxcount/maxsize).
        on_publish: called with the shard record
            ``{"name", "num_samples", "bytes", "sha256", "num_tokens", "keys"}`` after the shard
            and its index part are durable on disk. If it raises, the shard and its index part
            are deleted again (it was never published) and the error propagates.

    Errors of the file system (``OSError``, e.g. ``ENOSPC``) propagate from :meth:`write` and
    :meth:`close`; the caller then calls :meth:`abort`, which removes the shard in progress.
    """

    def __init__(self, out_dir: str | Path, rank: int = 0, start_shard: int = 0,
                 max_samples: int = 1000, max_bytes: float = 3e9,
                 on_publish: Callable[[dict[str, Any]], None] | None = None):
        self.out = Path(out_dir)
        (self.out / INDEX_DIR).mkdir(parents=True, exist_ok=True)
        self.on_publish = on_publish
        self._file: _HashingFile | None = None
        self._rows: list[dict[str, Any]] = []
        self.published: list[dict[str, Any]] = []
        self.bytes_written = 0
        self._writer = wds.ShardWriter(
            str(self.out / f"{rank:05d}-%06d.tar.tmp"), maxcount=max_samples, maxsize=max_bytes,
            post=self._publish, start_shard=start_shard, verbose=0, opener=self._open,
            encoder=False, mtime=0.0)

    def _open(self, fname: str) -> _HashingFile:
        self._file = _HashingFile(fname)
        return self._file

    def _fast_tar(self) -> None:
        """Give a freshly opened shard a seekable-mode tarfile ("w", 8 MiB copy buffer).

        webdataset's TarWriter opens tarfile in stream mode ("w|"), whose 10 KiB record buffer
        re-slices every payload (several copies per byte); for 10-100 MiB samples that caps
        writing far below disk speed. The swap happens before anything is written, so the
        stream-mode object holds no data; the archive is the same USTAR format.
        """
        tw = self._writer.tarstream
        if tw is not None and not getattr(tw, "_eagle_fast", False):
            tw.tarstream = tarfile.open(fileobj=tw.stream, mode="w", format=tarfile.USTAR_FORMAT,
                                        copybufsize=8 << 20)
            tw._eagle_fast = True

    def write(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Append one sample (see :func:`eagle_data.schema.encode_sample`).

        Raises:
            ValueError: bad key or tensors (nothing written).
            OSError: writing failed; call :meth:`abort`.
        """
        if self._writer is None:
            raise RuntimeError("ShardSink is closed")
        sample = encode_sample(key, tensors, meta)
        w = self._writer
        if w.tarstream is None or w.count >= w.maxcount or w.size >= w.maxsize:
            w.next_stream()  # what ShardWriter.write would do first; publishes the previous shard
        self._fast_tar()
        # ShardWriter publishes the previous shard (via _publish) before it writes into a new
        # one, so the row is appended after write() and always lands with its own shard.
        self._writer.write(sample)
        name = Path(self._writer.fname).name.removesuffix(".tmp")
        self._rows.append(index_row(key, name, meta, tensors["input_ids"], tensors["loss_mask"]))

    def _publish(self, tmp_fname: str) -> None:
        f = self._file
        assert f is not None
        f.close()
        tmp = Path(tmp_fname)
        final = tmp.with_name(tmp.name.removesuffix(".tmp"))
        rows, self._rows = self._rows, []
        if not rows:  # ShardWriter opens a stream eagerly; an empty shard is never published
            tmp.unlink(missing_ok=True)
            return
        part = self.out / INDEX_DIR / (final.name.removesuffix(".tar") + ".parquet")
        os.replace(tmp, final)
        try:
            _fsync_dir(final.parent)
            write_index_part(part, rows)
            rec = {"name": final.name, "num_samples": len(rows), "bytes": f.n, "sha256": f.h.hexdigest(),
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

    @property
    def pending_bytes(self) -> int:
        return self._file.n if self._file is not None and not self._file.f.closed else 0

    def close(self) -> None:
        """Publish the last shard (if non-empty).

        Raises:
            OSError: writing failed; call :meth:`abort`.
        """
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def abort(self) -> None:
        """Drop the shard being written (its samples are redone on resume). Never raises
        ``OSError`` (closing a file on a full disk fails again; the file is deleted anyway)."""
        if self._writer is None:
            return
        name, self._writer = self._writer.fname, None
        self._rows = []
        if self._file is not None:
            self._file.discard()
        if name:
            Path(name).unlink(missing_ok=True)
