"""Shard reading for the loader: open a shard URL, walk its tar members and group them by key
with webdataset's rules (turning a payload into tensors is :mod:`eagle_data.format.payload`'s job).

One stage: ``read_span(span)`` yields the raw samples ``span.start .. span.stop - 1`` of one
shard: members of a local file are :class:`~eagle_data.format.payload.FileSlice` descriptors (read
later, straight into the batch, after asynchronous readahead), those of other streams are read
into memory member by member. Errors name the shard URL and the sample key.
"""

from __future__ import annotations

import io
import logging
import os
import re
from collections import Counter
from typing import Any, Iterator

import numpy as np

from eagle_data.format.payload import FileSlice, LocalFile
from eagle_data.stream.shards import Span

log = logging.getLogger(__name__)

REQUIRED_MEMBERS = ("safetensors", "json")


def open_url(url: str):
    """Open a shard: local path / ``file://`` unbuffered (the reader does large reads itself),
    ``pipe:`` and ``http(s)`` via ``webdataset.gopen``; every other scheme (``s3://``, ``gs://``,
    ``az://``, ...) via ``fsspec``."""
    import re

    m = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", url)
    if m is None and not url.startswith("pipe:"):
        return open(url, "rb", buffering=0)
    if m is not None and m.group(1) == "file":
        return open(url[len("file://"):], "rb", buffering=0)
    if m is None or m.group(1) in ("http", "https"):
        import webdataset as wds

        return wds.gopen(url, "rb")
    import fsspec

    return fsspec.open(url, "rb").open()


# ---- tar reading ---------------------------------------------------------------------------------
# A minimal POSIX/GNU tar reader (ustar + pax ``x``/``g`` + GNU ``L``/``K`` headers) with the
# member semantics of webdataset's ``tar_file_iterator`` + ``group_by_keys``. Each wanted member
# of a local file is a FileSlice (offset, size; readahead requested), else a uint8 numpy array
# filled by ONE ``readinto`` (data, padding and the next 512-byte header) that the decoder views
# without copying; unwanted members (before the span) are skipped without reading them.
_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_REGULAR = (b"0", b"\0", b"7")
_META = re.compile(r"__[^/]*__($|/)")
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext


def _tar_num(field: bytes) -> int:
    if field and field[0] in (0o200, 0o377):  # GNU base-256
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if field[0] == 0o377 else n
    field = field.split(b"\0", 1)[0].strip()
    return int(field, 8) if field else 0


def _pax_records(data: bytes) -> dict[str, str]:
    """Parse pax ``"%d %s=%s\n"`` records.

    Raises:
        ValueError: a record length that is not positive or runs past the data.
    """
    out, i = {}, 0
    while i < len(data) and data[i:i + 1] not in (b"\0", b""):
        sp = data.index(b" ", i)
        n = int(data[i:sp])
        if n <= sp - i or i + n > len(data):
            raise ValueError(f"corrupt pax record length {n}")
        k, _, v = data[sp + 1:i + n - 1].partition(b"=")
        out[k.decode("utf-8", "surrogateescape")] = v.decode("utf-8", "surrogateescape")
        i += n
    return out


class _TarReader:
    """Iterate ``(name, uint8 ndarray)`` over the regular members of a tar stream."""

    def __init__(self, f):
        self.f = f
        self._readinto = getattr(f, "readinto", None)
        try:
            self.seekable = bool(f.seekable())
        except Exception:
            self.seekable = False

    def _fill(self, buf) -> int:
        """Read into ``buf`` (writable buffer) until full or EOF; bytes read."""
        mv, got = memoryview(buf).cast("B"), 0
        while got < len(mv):
            if self._readinto is not None:
                n = self._readinto(mv[got:])
            else:
                chunk = self.f.read(len(mv) - got)
                n = len(chunk)
                mv[got:got + n] = chunk
            if not n:
                break
            got += n
        return got

    def _read(self, n: int) -> bytes:
        buf = bytearray(n)
        return bytes(buf[:self._fill(buf)])

    def _skip(self, n: int) -> None:
        if self.seekable:
            self.f.seek(n, 1)
            return
        scratch = bytearray(min(n, 1 << 20))
        while n > 0:
            got = self._fill(memoryview(scratch)[:min(n, len(scratch))])
            if not got:
                raise ValueError("unexpected end of tar data")
            n -= got

    def members(self, want) -> Iterator[tuple[str, np.ndarray | FileSlice | None]]:
        """Yield ``(name, data)`` for regular, non-meta members in archive order; ``data`` is
        None (skipped, not read) when ``want(name)`` is False. For a local file ``data`` is a
        :class:`~eagle_data.format.payload.FileSlice` (headers are read with ``pread``; the member's
        bytes plus ``_LOOKAHEAD`` are handed to the kernel's asynchronous readahead); other
        streams read each wanted member with one ``readinto``.

        Raises:
            ValueError: truncated archive or corrupt header.
        """
        lf = self._local()
        end = self._size if lf is not None else 0
        at = (lambda p, n: os.pread(lf.fd, n, p)) if lf is not None else None
        pos = 0
        hdr = self._read(_BLOCK) if lf is None else at(0, _BLOCK)
        pax: dict[str, str] = {}
        glob: dict[str, str] = {}
        longname: str | None = None
        while True:
            if not hdr:
                return  # EOF without end-of-archive blocks (tolerated, like tarfile's stream mode)
            if len(hdr) < _BLOCK:
                raise ValueError("truncated tar header")
            if hdr == _ZERO_BLOCK:
                return
            chk = _tar_num(hdr[148:156])
            if chk != sum(hdr[:148]) + 256 + sum(hdr[156:]):
                raise ValueError("bad tar header checksum")
            pos += _BLOCK
            typ = hdr[156:157]
            size = _tar_num(hdr[124:136])
            if size < 0:
                raise ValueError(f"corrupt tar header: negative size {size}")
            padded = (size + _BLOCK - 1) // _BLOCK * _BLOCK
            if typ in (b"x", b"g", b"L", b"K"):
                data = self._read(padded + _BLOCK) if lf is None else at(pos, padded + _BLOCK)
                if len(data) < size:
                    raise ValueError("unexpected end of tar data")
                if typ == b"x":
                    pax = _pax_records(data[:size])
                elif typ == b"g":
                    glob.update(_pax_records(data[:size]))
                elif typ == b"L":
                    longname = data[:size].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                hdr = data[padded:]
                pos += padded
                continue
            rec = {**glob, **pax}
            if "size" in rec:
                size = int(rec["size"])
                if size < 0:
                    raise ValueError(f"corrupt pax header: negative size {size}")
                padded = (size + _BLOCK - 1) // _BLOCK * _BLOCK
            name = rec.get("path") or longname
            if name is None:
                name = hdr[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                prefix = hdr[345:500].split(b"\0", 1)[0]
                if hdr[257:262] == b"ustar" and prefix:
                    name = prefix.decode("utf-8", "surrogateescape") + "/" + name
            pax, longname = {}, None
            ok = typ in _REGULAR and not ("/" not in name and name.startswith("__") and name.endswith("__")) \
                and not _META.match(name)
            if not ok or not want(name):
                if ok:
                    yield name, None
                if lf is None:
                    self._skip(padded)
                    hdr = self._read(_BLOCK)
                else:
                    hdr = at(pos + padded, _BLOCK)
                pos += padded
                continue
            if lf is not None:
                if pos + size > end:
                    raise ValueError("unexpected end of tar data")
                self._willneed(lf.fd, pos, size, end)
                data = FileSlice(lf, pos, size)
                hdr = at(pos + padded, _BLOCK)
            else:
                buf = np.empty(padded + _BLOCK, dtype=np.uint8)
                got = self._fill(buf)
                if got < size:
                    raise ValueError("unexpected end of tar data")
                hdr = buf[padded:got].tobytes()
                data = buf[:size]
            pos += padded
            yield name, data

    _LOOKAHEAD = 16 << 20

    def _local(self) -> LocalFile | None:
        """A :class:`~eagle_data.format.payload.LocalFile` on a duplicate of the stream's descriptor
        when it is a non-empty local regular file at offset 0 (else None: stream reads). The
        duplicate outlives the stream: samples still in a shuffle buffer point into it."""
        import stat

        try:
            fd = self.f.fileno()
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0 or self.f.tell() != 0:
                return None
            lf = LocalFile(os.dup(fd), getattr(self.f, "name", "?"))
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return None
        self._ra, self._size = 0, st.st_size  # readahead requested up to here; file size
        return lf

    def _willneed(self, fd: int, pos: int, size: int, end: int) -> None:
        """Ask for asynchronous readahead of this member and the next ``_LOOKAHEAD`` bytes (cold
        cache: the disk works while earlier batches are collated)."""
        stop = min(end, pos + size + self._LOOKAHEAD)
        if stop <= self._ra:
            return
        a = max(pos, self._ra)
        try:
            os.posix_fadvise(fd, a, stop - a, os.POSIX_FADV_WILLNEED)
        except (AttributeError, OSError):
            pass
        self._ra = stop


def read_span(span: Span, on_error: str, skipped: Counter) -> Iterator[dict[str, Any] | None]:
    """Stage "tar": the raw samples ``span.start .. span.stop - 1`` of one shard, in order
    (members grouped by key like webdataset's ``group_by_keys``; samples before the span are
    skipped without reading their data when the stream is seekable).

    With ``on_error="skip"`` an unreadable sample becomes ``None`` (a hole that keeps positions
    and batch counts stable) and is counted in ``skipped``; with ``"raise"``:

    Raises:
        ValueError: truncated/corrupt tar, missing member, or fewer samples than the manifest
            says; the message names the shard URL and the sample key.
    """
    sh, want, got, key = span.shard, span.stop - span.start, 0, None
    stream = None
    try:
        stream = open_url(sh.url)
        idx, cur = -1, None

        def wanted(name: str) -> bool:
            nonlocal idx, cur
            m = _KEY_EXT.match(name)
            if m is None:
                return False
            if m.group(1) != cur:
                idx, cur = idx + 1, m.group(1)
            return span.start <= idx < span.stop

        sample: dict[str, Any] | None = None
        for name, data in _TarReader(stream).members(wanted):
            if idx >= span.stop:
                break
            if data is None:
                continue
            m = _KEY_EXT.match(name)
            prefix, suffix = m.group(1), m.group(2).lower()
            if sample is None or prefix != sample["__key__"]:
                if sample is not None:
                    got += 1
                    yield _checked(sample, on_error, skipped)
                sample = {"__key__": prefix, "__url__": sh.url}
                key = prefix
            if suffix in sample:
                raise ValueError(f"{name}: duplicate file name in tar file {suffix}")
            sample[suffix] = data
        if sample is not None:
            got += 1
            yield _checked(sample, on_error, skipped)
        if got < want:
            raise ShardError(f"shard {sh.url}: expected {span.stop} samples, the tar ends after "
                             f"{idx + 1} (truncated?)")
    except Exception as e:
        if on_error == "raise":
            if isinstance(e, ShardError):  # already names the shard
                raise
            at = f"at sample {key!r} (or the member after it)" if key is not None else "before its first sample"
            raise ShardError(f"shard {sh.url}: unreadable {at}: {e!r}") from e
        skipped["unreadable_shard"] += want - got
        log.warning("skipping %d sample(s) of %s: %r", want - got, sh.url, e)
        yield from [None] * (want - got)
    finally:
        if stream is not None:
            stream.close()


class ShardError(ValueError):
    """A shard cannot be read; the message names the shard (and the sample where known)."""


def _checked(s: dict[str, Any], on_error: str, skipped: Counter) -> dict[str, Any] | None:
    missing = [m for m in REQUIRED_MEMBERS if m not in s]
    if not missing:
        return s
    err = ShardError(f"shard {s['__url__']}: sample {s['__key__']} lacks member(s) {missing}")
    if on_error == "raise":
        raise err
    skipped["missing_field"] += 1
    log.warning("skipping: %s", err)
    return None
