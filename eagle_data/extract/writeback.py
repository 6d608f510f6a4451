"""Write-behind for shard files: start the disk write of what was just written, instead of
letting the page cache collect a whole shard for the ``fsync`` that publishes it.

Without it the kernel starts writing back only at ``vm.dirty_background_ratio`` (10 % of
memory: ~12 GB on a 128 GB machine), so a run's output waits in memory and the disk sits idle
while the GPU computes, then the closing ``fsync`` writes it all while the GPU waits (measured
on the H200: ``python -m benchmarks extract``, BENCHMARKS.md "Write-behind"). Linux's
``sync_file_range(2)`` (through libc; Python's ``os`` lacks it) starts the write of a byte
range without waiting (``SYNC_FILE_RANGE_WRITE``) and waits for an earlier range
(``WAIT_BEFORE | WRITE | WAIT_AFTER``), so each writer keeps :data:`IN_FLIGHT` chunks on their
way to the disk (enough to keep it busy, little dirty memory) and the disk works at its own pace
beside the capture. Where the call does not exist (not Linux/glibc)
or the file does not support it, nothing happens: ``fsync`` at the end still makes the shard
durable; write-behind only changes when the bytes go.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from collections import deque

SYNC_FILE_RANGE_WAIT_BEFORE, SYNC_FILE_RANGE_WRITE, SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4
#: bytes a writer lets collect before starting their write to disk
CHUNK_BYTES = 32 << 20
#: chunks started and not yet waited for, per file
IN_FLIGHT = 4


def _load():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load()


def sync_range(fd: int, offset: int, nbytes: int, flags: int) -> bool:
    """``sync_file_range(fd, offset, nbytes, flags)``; False where it is not supported (nothing done).

    Raises:
        OSError: the write failed (``EIO``, ``ENOSPC``...).
    """
    if _sync_file_range is None or nbytes <= 0:
        return False
    if _sync_file_range(fd, offset, nbytes, flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ESPIPE, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err))


class WriteBehind:
    """Tracks one file being appended to: :meth:`written` after each write (the bytes must have
    reached the OS, i.e. the Python buffer flushed) starts the disk write of every full
    :data:`CHUNK_BYTES` and waits for the oldest chunk once more than :data:`IN_FLIGHT` are started."""

    def __init__(self, fd: int, chunk: int | None = None):
        self.fd, self.chunk = fd, chunk or CHUNK_BYTES
        self.started = 0  # bytes [0, started) have had their write started
        self.inflight: deque[tuple[int, int]] = deque()  # ranges started, not waited for
        self.enabled = _sync_file_range is not None

    def due(self, size: int) -> bool:
        """Whether :meth:`written` has work at file size ``size`` (the caller flushes first)."""
        return self.enabled and size - self.started >= self.chunk

    def written(self, size: int) -> None:
        """The file now holds ``size`` bytes. Raises ``OSError`` as :func:`sync_range`."""
        if not self.due(size):
            return
        rng = (self.started, size - self.started)
        if not sync_range(self.fd, *rng, SYNC_FILE_RANGE_WRITE):
            self.enabled = False
            return
        self.inflight.append(rng)
        self.started = size
        while len(self.inflight) > IN_FLIGHT:
            sync_range(self.fd, *self.inflight.popleft(), SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE
                       | SYNC_FILE_RANGE_WAIT_AFTER)
