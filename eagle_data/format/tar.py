"""The tar framing of a shard, both ways.

Writing: :func:`tar_member_header` (one member's USTAR header, as webdataset's ``TarWriter``
writes it), :func:`member_padding` and :func:`archive_end`; the writer itself is
:class:`eagle_data.extract.sink.ShardSink`.

Reading: :class:`TarWalk`, the one member walk of every reader (the loader, ``verify``,
``inspect``, :func:`eagle_data.tools.read_samples.read_samples`). Headers are parsed by Python's
:mod:`tarfile` (ustar with prefix paths, pax ``x``/``g``, GNU ``L``/``K``, base-256 numbers);
the walk yields each member's name, data offset and size and never reads data itself. On a
seekable file the caller reads ``offset``/``size`` when it wants them (its own ``pread``, or
:meth:`TarWalk.read`); on a stream (``pipe:``, http, fsspec) it reads the current member with
:meth:`TarWalk.read` or leaves it, and the walk skips it. tarfile rather than a hand-written
parser: its header walk costs a few per cent of the loader's time per sample at typical sample
sizes (``python -m benchmarks tar_walk``, figures in BENCHMARKS.md).

Errors of a truncated or corrupt archive are :class:`CorruptTar` (a ``ValueError``) naming the
archive and the byte offset; ``tarfile``'s own errors never leak out, and a corrupt header in the
middle of an archive is an error (``tarfile`` itself would end the archive there silently).
"""

from __future__ import annotations

import re
import tarfile
from typing import IO, Iterator, NamedTuple

import numpy as np

BLOCK = 512
RECORD = 20 * BLOCK  # tarfile's RECORDSIZE: archives are padded to a multiple of it

_DATA_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
_META = re.compile(r"__[^/]*__($|/)")
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext


# ---- writing -------------------------------------------------------------------------------------

def tar_member_header(name: str, size: int) -> bytes:
    """USTAR header (512 bytes) of one regular-file member, as webdataset's TarWriter writes it
    (mode 0444, owner ``bigdata``, mtime 0 for reproducible shards).

    Raises:
        ValueError: the name does not fit a USTAR header.
    """
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.uname, ti.gname = size, 0, 0o444, "bigdata", "bigdata"
    return ti.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")


def member_padding(size: int) -> bytes:
    """The zero bytes that follow ``size`` bytes of member data (to a 512-byte block)."""
    return bytes(-size % BLOCK)


def archive_end(written: int) -> bytes:
    """The end of an archive of ``written`` bytes so far: two zero blocks, then zeros up to a
    multiple of :data:`RECORD` (as ``tarfile`` ends its archives)."""
    n = written + 2 * BLOCK
    return bytes(2 * BLOCK + -n % RECORD)


# ---- reading -------------------------------------------------------------------------------------

class CorruptTar(ValueError):
    """A truncated or corrupt tar archive; the message names it and the byte offset."""


def split_key(name: str) -> tuple[str, str] | tuple[None, None]:
    """webdataset's key/extension split of a member name (``base_plus_ext``): the key is the name
    up to the first dot of its last path component, ``"d/k.a.b"`` -> ``("d/k", "a.b")``;
    ``(None, None)`` for a name without an extension."""
    m = _KEY_EXT.match(name)
    return (m.group(1), m.group(2)) if m else (None, None)


def is_meta(name: str) -> bool:
    """A webdataset meta member (``__key__``-like names, or under a ``__...__/`` folder): skipped."""
    return ("/" not in name and name.startswith("__") and name.endswith("__")) or bool(_META.match(name))


class Member(NamedTuple):
    """One member of a tar archive.

    ``name``; ``offset``/``size``: the byte range of its data in the archive; ``key``/``ext``:
    :func:`split_key` of the name; ``sample``: a regular file that is not a meta member (what
    webdataset groups into samples)."""
    name: str
    offset: int
    size: int
    key: str | None
    ext: str | None
    sample: bool


class TarWalk:
    """The members of one tar archive in archive order; :mod:`tarfile` parses the headers.

    Args:
        f: a binary file object at the archive's start. Seekable (``f.seekable()``, a local file):
            headers are read with ``seek`` + ``read``, data never. Otherwise a stream with ``read``
            (``readinto`` used when present): the data of a member the caller did not
            :meth:`read` is read and dropped on the way to the next header.
        where: names the archive in errors (a path or URL).
    """

    def __init__(self, f: IO[bytes], where: str = "tar"):
        self.where, self.seekable = where, _seekable(f)
        self._end: int | None = None  # the file's size (seekable only)
        if self.seekable:
            start = f.tell()
            self._f, self._end = f, f.seek(0, 2)
            f.seek(start)
        else:
            self._f = _Forward(f)
        self._tf: tarfile.TarFile | None = None
        self._current: Member | None = None

    def members(self, everything: bool = False) -> Iterator[Member]:
        """Yield the regular, non-meta members (``Member.sample``); with ``everything`` every
        member (directories, links, meta members too).

        Raises:
            CorruptTar: a corrupt or truncated header, or a member's data running past the end
                of the file (seekable) or of the stream (when it is skipped or read).
        """
        info = self._first()
        while info is not None:
            key, ext = split_key(info.name)
            sample = info.type in _DATA_TYPES and info.sparse is None and not is_meta(info.name)
            if everything or sample:
                self._current = Member(info.name, info.offset_data, info.size, key, ext, sample)
                yield self._current
                self._current = None
            info = self._next()

    def read(self, m: Member) -> np.ndarray:
        """The data of member ``m``: a new writable uint8 array ``[m.size]``. On a stream only
        the member just yielded, once.

        Raises:
            CorruptTar: the archive ends inside the data.
            ValueError: on a stream, ``m`` is not the current, unread member.
        """
        if self.seekable:
            self._f.seek(m.offset)
        elif m is not self._current or self._f.tell() != m.offset:
            raise ValueError(f"{self.where}: a stream's member can only be read while it is the current one, once")
        buf = np.empty(m.size, dtype=np.uint8)
        if _fill(self._f, buf) < m.size:
            raise CorruptTar(f"unexpected end of tar data in member {m.name!r} ({m.size} bytes at byte {m.offset}) "
                             f"of {self.where}")
        return buf

    def _first(self) -> tarfile.TarInfo | None:
        """Open the archive: its first member (None: no members)."""
        start = self._f.tell()
        try:
            self._tf = tarfile.TarFile(fileobj=self._f, mode="r", encoding="utf-8", errors="surrogateescape")
            info = self._tf.next()
        except (tarfile.TarError, ValueError) as e:
            raise CorruptTar(f"corrupt tar header at byte {start} of {self.where}: {e}") from None
        return self._checked(info)

    def _next(self) -> tarfile.TarInfo | None:
        """The member after the current one (None at the end-of-archive block or at EOF on a
        header boundary, which ``tarfile`` tolerates too)."""
        off = self._tf.offset  # tarfile's position of the next header
        if self._f.seek(off) != off:
            raise CorruptTar(f"unexpected end of tar data before byte {off} of {self.where}")
        try:
            info = tarfile.TarInfo.fromtarfile(self._tf)
        except (tarfile.EOFHeaderError, tarfile.EmptyHeaderError):
            return None
        except (tarfile.TarError, ValueError) as e:  # TarFile.next() would end the archive silently here
            raise CorruptTar(f"corrupt tar header at byte {off} of {self.where}: {e}") from None
        return self._checked(info)

    def _checked(self, info: tarfile.TarInfo | None) -> tarfile.TarInfo | None:
        if info is None:
            return None
        if info.size < 0:
            raise CorruptTar(f"corrupt tar header at byte {info.offset} of {self.where}: negative size {info.size}")
        if self._end is not None and info.type in _DATA_TYPES and info.offset_data + info.size > self._end:
            raise CorruptTar(f"unexpected end of tar data in member {info.name!r} ({info.size} bytes at byte "
                             f"{info.offset_data}) of {self.where}: the file ends at byte {self._end}")
        return info


def _seekable(f) -> bool:
    try:
        return bool(f.seekable())
    except (AttributeError, OSError, ValueError):
        return False


def _fill(f, buf) -> int:
    """Read into ``buf`` (a writable buffer) until it is full or ``f`` ends; the bytes read."""
    mv, got = memoryview(buf).cast("B"), 0
    readinto = getattr(f, "readinto", None)
    while got < len(mv):
        if readinto is not None:
            n = readinto(mv[got:])
        else:
            chunk = f.read(len(mv) - got)
            n = len(chunk)
            mv[got:got + n] = chunk
        if not n:
            break
        got += n
    return got


class _Forward:
    """A stream as tarfile's reader of a seekable archive uses it: ``read``, ``tell``, and
    ``seek`` forward only (reads and drops the bytes in between; returns the position reached,
    short of the target where the stream ends)."""

    def __init__(self, f):
        self.f, self.pos, self._scratch = f, 0, None

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:
        n = _fill(self.f, buf)
        self.pos += n
        return n

    def read(self, n: int) -> bytes:
        buf = bytearray(n)
        return bytes(buf[:self.readinto(buf)])

    def seek(self, pos: int, whence: int = 0) -> int:
        assert whence == 0 and pos >= self.pos, ("a stream only skips forward", pos, self.pos, whence)
        if self._scratch is None and pos > self.pos:
            self._scratch = memoryview(bytearray(1 << 20))
        while self.pos < pos:
            if not self.readinto(self._scratch[:min(pos - self.pos, len(self._scratch))]):
                break
        return self.pos
