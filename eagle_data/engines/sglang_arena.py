"""The spool's shared-memory ring: the capture hook copies a request's rows into it, the backend
copies them out (:class:`~eagle_data.engines.sglang_spool.Spool` holds the reading end).

A file per chunk in ``/dev/shm`` costs the kernel a page allocation per 4 KiB on every write and
a free on every unlink: ~1.3 GB/s per core each way, about the rate of fp8 rows SmolLM2's prefill
makes on an H100 (BENCHMARKS.md, "SGLang backend on CPU"). The ring's pages are allocated once and
reused, so a chunk costs two ``memcpy`` s. Its layout, one file ``ARENA`` in the spool dir::

    [0, 8)          int64 tail: bytes of the ring freed so far (written by the reader only)
    [64, 64 + N)    the ring: chunk regions at positions head mod N, 64-byte aligned

The writer (one thread of the scheduler process, TP rank 0) keeps ``head`` (bytes handed out so
far) and takes a region only once the reader has freed the bytes of the previous lap it covers; a
region never wraps (the bytes to the ring's end are skipped and freed with it). It copies the
chunk's tensors in, then writes a small JSON record ``<rid>@<offset>@<seq>.arena`` (tmp + rename, after the copy) naming the region
and each tensor's dtype, shape and place. The reader copies the tensors out and frees the region
when the record is removed; the tail moves over regions freed in any order once they are
contiguous. A chunk larger than the ring, or a ring still full after ``WAIT_S``, goes to a file
instead (:func:`~eagle_data.engines.sglang_spool.write_piece`): never a wait without end (and after
a wait in vain none until the ring has room at once). The ring's bytes are reserved when it is
made (``posix_fallocate``): a ``/dev/shm`` too small fails there, and the spool goes on with files.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from pathlib import Path

import torch

from eagle_data.engines.sglang_spool import publish_json

#: the ring's file in the spool dir
ARENA = "arena.bin"
#: header bytes before the ring; regions are aligned to this too
_HEAD = 64
#: how long the writer waits for room before it writes the chunk to a file instead
WAIT_S = 0.5

_DTYPES = {str(d): d for d in (torch.bfloat16, torch.float32, torch.float16, torch.int64, torch.float8_e4m3fn,
                               torch.bool, torch.uint8)}


class _Ring:
    """The mapped file: ``data`` [N] uint8 (the ring) and ``tail`` [1] int64 (shared)."""

    def __init__(self, path: Path, size: int | None = None):
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0), 0o600)
        try:
            if size is not None:  # reserved now: a full /dev/shm fails here, not as a SIGBUS in the scheduler
                try:
                    os.posix_fallocate(fd, 0, _HEAD + size)
                except OSError:
                    os.unlink(path)
                    raise
            self._mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        whole = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.data, self.tail = whole[_HEAD:], whole[:8].view(torch.int64)
        self.size = int(self.data.numel())


class ArenaReader(_Ring):
    """The backend's end: creates the ring (``size`` bytes, reserved), reads records, frees regions."""

    def __init__(self, spool: Path, size: int):
        super().__init__(Path(spool) / ARENA, max(_HEAD, size // _HEAD * _HEAD))
        self._freed: dict[int, int] = {}
        self._lock = threading.Lock()

    def read(self, record: Path) -> tuple[dict[str, torch.Tensor], dict]:
        """The tensors of ``record`` (copied out of the ring) and its metadata (``rid``, ``offset``, ``seq``)."""
        r = json.loads(record.read_text())
        out = {}
        for name, (dtype, shape, at, n) in r["tensors"].items():
            out[name] = self.data[r["pos"] + at:r["pos"] + at + n].clone().view(_DTYPES[dtype]).reshape(shape)
        return out, r

    def free(self, record: Path) -> None:
        """Give ``record``'s region back (call once, when the record is removed)."""
        r = json.loads(record.read_text())
        with self._lock:
            self._freed[r["start"]] = r["end"]
            tail = int(self.tail[0])
            while tail in self._freed:
                tail = self._freed.pop(tail)
            self.tail[0] = tail


class ArenaWriter(_Ring):
    """The hook's end (one thread): :meth:`put` copies a chunk in and writes its record."""

    def __init__(self, spool: Path):
        super().__init__(Path(spool) / ARENA)
        self.spool, self.head = Path(spool), 0
        self.patient = True  # wait for room; after a wait in vain, not again until room comes at once

    @classmethod
    def open(cls, spool: str | os.PathLike) -> "ArenaWriter | None":
        """The ring of ``spool``, or None when the backend made none (chunks then go to files)."""
        return cls(Path(spool)) if (Path(spool) / ARENA).is_file() else None

    def put(self, name: str, meta: dict, tensors: dict[str, torch.Tensor]) -> Path | None:
        """Copy ``tensors`` (host, contiguous) into a region and write record ``name``; None (nothing
        written) when the chunk is larger than the ring or no room came within :data:`WAIT_S`."""
        places, n = {}, 0
        for k, t in tensors.items():
            places[k] = (str(t.dtype), list(t.shape), n, t.numel() * t.element_size())
            n += -(-places[k][3] // 8) * 8
        need = -(-n // _HEAD) * _HEAD
        pos = self.head % self.size
        skip = self.size - pos if pos + need > self.size else 0
        # the bytes of the previous lap the region overwrites must be freed: those before
        # head + skip + need - N, or (wrapping a region longer than the room left) all before head
        if need > self.size or not self._freed_up_to(min(self.head + skip + need - self.size, self.head)):
            return None
        start, pos = self.head, (pos + skip) % self.size
        self.head += need + skip
        try:
            for k, t in tensors.items():
                _, _, at, nb = places[k]
                self.data[pos + at:pos + at + nb].copy_(t.reshape(-1).view(torch.uint8))
            record = {**meta, "start": start, "end": self.head, "pos": pos, "tensors": places}
            path = publish_json(self.spool / name, record)
        except BaseException:  # no record names the region: take it back, or nobody would ever free it
            self.head = start
            raise
        return path

    def _freed_up_to(self, pos: int) -> bool:
        """Whether the reader has freed every byte before ``pos``, waiting up to :data:`WAIT_S` for it
        unless the last wait was in vain (a ring held by regions nobody frees soon costs one wait)."""
        if int(self.tail[0]) >= pos:
            self.patient = True
            return True
        deadline = time.monotonic() + (WAIT_S if self.patient else 0.0)
        while int(self.tail[0]) < pos:
            if time.monotonic() > deadline:
                self.patient = False
                return False
            time.sleep(0.0002)
        return True
