"""Write-behind of shard files (:mod:`eagle_data.extract.writeback`): the disk write of each full
chunk starts while the shard is written; the bytes and their hash are unchanged, failures of the
write are errors, files that do not support it are written as before."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import itertools
import os
from unittest import mock
from itertools import accumulate

import pytest
from hypothesis import given, settings, strategies as st

import eagle_data.extract.writeback as wb
from eagle_data.extract.config import ExtractConfig  # noqa: F401  (import order as the pipeline)
from eagle_data.extract.resume import load_progress
from eagle_data.extract.run import run_extract
from eagle_data.extract.sink import _HashingFile


class Recorder:
    """Stands in for libc's sync_file_range: records (offset, nbytes, flags) and the file size
    the OS had at the call."""

    def __init__(self, fail: int | None = None, fail_at: int = 0):
        self.calls: list[tuple[int, int, int, int]] = []
        self.fail, self.fail_at = fail, fail_at

    def __call__(self, fd, offset, nbytes, flags):
        if self.fail is not None and len(self.calls) >= self.fail_at:
            ctypes.set_errno(self.fail)
            return -1
        self.calls.append((offset, nbytes, flags, os.fstat(fd).st_size))
        return 0


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(st.lists(st.integers(0, 5000), max_size=4), max_size=20), chunk=st.integers(1, 6000))
def test_started_ranges_tile_the_file_and_waits_follow(tmp_path_factory, groups, chunk):
    """Ranges started are contiguous from byte 0, each at least a chunk, never past what the OS
    has (the Python buffer is flushed first); the waits are for the oldest ranges, in order,
    leaving IN_FLIGHT started;
    the file and its sha256 are exactly the bytes written."""
    rec = Recorder()
    path = tmp_path_factory.mktemp("wb") / "f.tar"
    old = (wb._sync_file_range, wb.CHUNK_BYTES)
    wb._sync_file_range, wb.CHUNK_BYTES = rec, chunk
    try:
        f = _HashingFile(str(path))
        data = [[os.urandom(n) for n in g] for g in groups]
        for bufs in data:  # one write per sample, of several buffers
            f.write(bufs)
        f.close()
    finally:
        wb._sync_file_range, wb.CHUNK_BYTES = old
    sizes = [sum(g) for g in groups]
    blob = b"".join(b for bufs in data for b in bufs)
    assert path.read_bytes() == blob and f.hexdigest() == hashlib.sha256(blob).hexdigest() and f.n == len(blob)
    starts = [c for c in rec.calls if c[2] == wb.SYNC_FILE_RANGE_WRITE]
    waits = [c for c in rec.calls if c[2] != wb.SYNC_FILE_RANGE_WRITE]
    assert [c[0] for c in starts] == list(accumulate([0] + [n for _, n, _, _ in starts]))[:len(starts)]
    assert all(n >= chunk and a + n <= size for a, n, _, size in starts)
    assert len(blob) - sum(n for _, n, _, _ in starts) < chunk + max(sizes, default=0)
    assert [(a, n) for a, n, _, _ in waits] == [(a, n) for a, n, _, _ in starts[:max(0, len(starts) - wb.IN_FLIGHT)]]
    assert all(fl == wb.SYNC_FILE_RANGE_WAIT_BEFORE | wb.SYNC_FILE_RANGE_WRITE | wb.SYNC_FILE_RANGE_WAIT_AFTER
               for _, _, fl, _ in waits)


def test_real_call_on_a_local_file(tmp_path, monkeypatch):
    """On Linux the libc call is found and used (the file stays byte-exact); on a pipe, which
    does not support it, write-behind switches itself off and nothing fails."""
    if wb._sync_file_range is None:
        pytest.skip("no sync_file_range in this libc")
    monkeypatch.setattr(wb, "CHUNK_BYTES", 1 << 16)
    f = _HashingFile(str(tmp_path / "a.tar"))
    blob = os.urandom(5 << 16)
    for i in range(0, len(blob), 10_000):
        f.write([blob[i:i + 10_000]])
    f.close()
    assert (tmp_path / "a.tar").read_bytes() == blob and f.behind.enabled and f.behind.started >= 4 << 16
    r, w = os.pipe()
    try:
        b = wb.WriteBehind(w, chunk=1)
        b.written(10)
        assert not b.enabled and b.started == 0
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_a_failed_write_is_an_oserror(tmp_path, monkeypatch, err):
    monkeypatch.setattr(wb, "_sync_file_range", Recorder(fail=err))
    monkeypatch.setattr(wb, "CHUNK_BYTES", 100)
    f = _HashingFile(str(tmp_path / "a.tar"))
    with pytest.raises(OSError) as ei:
        f.write([b"x" * 150])
    assert ei.value.errno == err
    f.discard()


def test_full_disk_seen_by_write_behind_stops_extraction_then_resumes(tmp_path, monkeypatch, kr, tiny, reference):
    """ENOSPC reported by the started write (not by write() itself) in the middle of a run: the
    run stops with the full-disk message, nothing partial is listed, and the rerun completes
    with the reference's samples."""
    monkeypatch.setattr(wb, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(wb, "_sync_file_range", Recorder(fail=errno.ENOSPC, fail_at=6))
    out = tmp_path / "ds"
    with pytest.raises(OSError, match="no space left.*rerun the same command to resume"):
        run_extract(kr.config(out, *tiny, shard_max_samples=3))
    prog = load_progress(out, 0)  # None when the disk filled before the first shard was published
    listed = prog["shards"] if prog is not None else []
    assert len(listed) < 8 and all((out / s["name"]).stat().st_size == s["bytes"] for s in listed)
    monkeypatch.setattr(wb, "_sync_file_range", Recorder())
    run_extract(kr.config(out, *tiny, shard_max_samples=3))
    assert kr.compare(reference, out) == [] and kr.leftovers(out) == []


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), max_size=12), cuts=st.lists(st.integers(1, 4000), min_size=1, max_size=8))
def test_writev_all_finishes_short_writes(tmp_path_factory, sizes, cuts):
    """A short ``writev`` (the OS took a prefix) continues where it stopped, also inside a buffer,
    until every byte is written in order."""
    import eagle_data.extract.sink as sink

    real, calls = os.writev, itertools.cycle(cuts)

    def short(fd, bufs):  # writes at most the next cut's bytes of what it is given
        take, out = next(calls), []
        for b in bufs:
            out.append(bytes(b[:take - sum(map(len, out))]))
        return real(fd, [b"".join(out)])
    path = tmp_path_factory.mktemp("wv") / "f"
    data = [os.urandom(n) for n in sizes]
    with mock.patch.object(sink.os, "writev", short), open(path, "wb", buffering=0) as f:
        n = sink._writev_all(f.fileno(), [memoryview(d) for d in data if d])
    assert n == sum(sizes) and path.read_bytes() == b"".join(data)


@pytest.mark.parametrize("fail", ["archive_end", "hash"])
def test_a_shard_whose_ending_fails_leaves_no_thread_file_or_handle(tmp_path, monkeypatch, fail):
    """ENOSPC while ending a shard, or an error of its hashing thread: the error reaches the caller,
    and after abort() no hashing thread, no open handle and no temporary file remain."""
    import threading

    import torch

    import eagle_data.extract.sink as sink

    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    t = {"input_ids": torch.arange(5), "loss_mask": torch.ones(5, dtype=torch.uint8),
         "aux_hidden_states": torch.randn(5, 6).bfloat16(), "hidden_states": torch.randn(5, 2).bfloat16()}
    s = sink.ShardSink(tmp_path)
    s.write("k_1", t, {"source_id": "x", "source_row": 1, "num_turns": 2, "truncated": False})
    real_writev, real_hash = sink._writev_all, sink._HashingFile._hash

    def no_space(fd, views):
        raise OSError(errno.ENOSPC, "No space left on device")

    def bad_hash(self, views):
        raise RuntimeError("hash failed")
    if fail == "archive_end":
        monkeypatch.setattr(sink, "_writev_all", no_space)
    else:
        monkeypatch.setattr(sink._HashingFile, "_hash", bad_hash)
        s.write("k_2", t, {"source_id": "x", "source_row": 2, "num_turns": 2, "truncated": False})
    with pytest.raises((OSError, RuntimeError), match="No space left|hash failed"):
        s.close()
    s.abort()
    monkeypatch.setattr(sink, "_writev_all", real_writev)
    monkeypatch.setattr(sink._HashingFile, "_hash", real_hash)
    assert not [th for th in threading.enumerate() if th.name.startswith("shard-hash")]
    assert [p.name for p in tmp_path.iterdir()] == ["index"] and list((tmp_path / "index").iterdir()) == []
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds
