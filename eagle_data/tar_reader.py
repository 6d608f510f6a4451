"""Shard reading for the loader: open a shard URL, walk its tar members, group them by key
with webdataset's rules, and view a sample's safetensors payload as tensors without copying.

One stage: ``read_span(span)`` yields the raw samples ``span.start .. span.stop - 1`` of one
shard (local files memory-mapped, remote ones read member by member); ``view_tensors`` checks
the safetensors header (dtype, shape x item size = byte range, in bounds) and returns views.
Errors name the shard URL and the sample key.
"""

from __future__ import annotations

import io
import logging
import math
import mmap
import re
from collections import Counter
from typing import Any, Iterator

import numpy as np
import torch

from .schema import decode_tensors, validate_tensors
from .shards import Span

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
# is a uint8 numpy array that the decoder views without copying: a slice of a copy-on-write mmap
# of a local file, else a buffer filled by ONE ``readinto`` (data, padding and the next 512-byte
# header); unwanted members (before the span) are skipped without reading them when possible.
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
    out, i = {}, 0
    while i < len(data) and data[i:i + 1] not in (b"\0", b""):
        sp = data.index(b" ", i)
        n = int(data[i:sp])
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

    def members(self, want) -> Iterator[tuple[str, np.ndarray | None]]:
        """Yield ``(name, data)`` for regular, non-meta members in archive order; ``data`` is
        None (skipped, not read) when ``want(name)`` is False. A local file is memory-mapped
        (copy-on-write) and ``data`` views the page cache: the collate then copies each byte
        once; other streams read each wanted member with one ``readinto``.

        Raises:
            ValueError: truncated archive or corrupt header.
        """
        mm = self._mmap()
        pos = 0
        hdr = self._read(_BLOCK) if mm is None else mm[0:_BLOCK]
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
            padded = (size + _BLOCK - 1) // _BLOCK * _BLOCK
            if typ in (b"x", b"g", b"L", b"K"):
                data = self._read(padded + _BLOCK) if mm is None else mm[pos:pos + padded + _BLOCK]
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
                if mm is None:
                    self._skip(padded)
                    hdr = self._read(_BLOCK)
                else:
                    hdr = mm[pos + padded:pos + padded + _BLOCK]
                pos += padded
                continue
            if mm is not None:
                if pos + size > len(mm):
                    raise ValueError("unexpected end of tar data")
                self._willneed(mm, pos, size)
                data = np.frombuffer(mm, dtype=np.uint8, count=size, offset=pos)
                hdr = mm[pos + padded:pos + padded + _BLOCK]
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

    def _mmap(self):
        """A private (copy-on-write) map of a local regular file, or None (then: reads)."""
        import os
        import stat

        try:
            fd = self.f.fileno()
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0 or self.f.tell() != 0:
                return None
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return None
        try:
            mm.madvise(mmap.MADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
        self._ra = 0  # readahead requested up to here
        return mm

    def _willneed(self, mm, pos: int, size: int) -> None:
        """Ask for asynchronous readahead of this member and the next ``_LOOKAHEAD`` bytes
        (cold cache: the disk works while the previous batch is collated)."""
        end = min(len(mm), pos + size + self._LOOKAHEAD)
        if end <= self._ra:
            return
        a = max(pos, self._ra) // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_WILLNEED, a, end - a)
        except (AttributeError, OSError, ValueError):
            pass
        self._ra = end


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
            raise ValueError(f"shard {sh.url}: expected {span.stop} samples, the tar ends after "
                             f"{span.start + got} (truncated?)")
    except Exception as e:
        if on_error == "raise":
            if isinstance(e, ValueError) and str(e).startswith("shard "):
                raise
            raise ValueError(f"shard {sh.url}: unreadable after sample {key!r}: {e!r}") from e
        skipped["unreadable_shard"] += want - got
        log.warning("skipping %d sample(s) of %s: %r", want - got, sh.url, e)
        yield from [None] * (want - got)
    finally:
        if stream is not None:
            stream.close()


def _checked(s: dict[str, Any], on_error: str, skipped: Counter) -> dict[str, Any] | None:
    missing = [m for m in REQUIRED_MEMBERS if m not in s]
    if not missing:
        return s
    err = ValueError(f"shard {s['__url__']}: sample {s['__key__']} lacks member(s) {missing}")
    if on_error == "raise":
        raise err
    skipped["missing_field"] += 1
    log.warning("skipping: %s", err)
    return None


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64,
              "U8": torch.uint8}


def view_tensors(data: bytes | np.ndarray, where: str = "?") -> dict[str, torch.Tensor]:
    """Zero-copy variant of :func:`eagle_data.schema.decode_tensors`: tensors are views into
    ``data`` (a writable uint8 ndarray from the tar reader, or bytes: read-only views) after the
    safetensors JSON header is checked (dtype, shape x itemsize == byte range, ranges inside the
    payload); the collate copies them into the batch. Anything unusual falls back to
    ``decode_tensors`` (same errors).

    Raises:
        ValueError: as :func:`~eagle_data.schema.decode_tensors`.
    """
    import json
    import warnings

    try:
        if isinstance(data, np.ndarray):
            u8 = torch.from_numpy(data)
            head = data[:8].tobytes()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "non-writable buffer": the views are only read
                u8 = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
            head = bytes(data[:8])
        n = int.from_bytes(head, "little")
        if len(u8) < 8 + n:
            raise ValueError("short header")
        header = json.loads(data[8:8 + n].tobytes() if isinstance(data, np.ndarray) else data[8:8 + n])
        body = len(u8) - 8 - n
        out = {}
        for k, v in header.items():
            if k == "__metadata__":
                continue
            dt = _ST_DTYPES[v["dtype"]]
            shape = [int(x) for x in v["shape"]]
            a, b = (int(x) for x in v["data_offsets"])
            if not (0 <= a <= b <= body) or b - a != math.prod(shape) * dt.itemsize or min(shape, default=0) < 0:
                raise ValueError("bad data_offsets")
            piece = u8[8 + n + a:8 + n + b]
            if (8 + n + a) % dt.itemsize:
                piece = piece.clone()
            out[k] = piece.view(dt).view(shape)
    except Exception:
        return decode_tensors(bytes(data) if isinstance(data, np.ndarray) else data, where=where)
    validate_tensors(out, where=where)
    return out
