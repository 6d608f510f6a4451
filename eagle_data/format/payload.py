"""A sample's safetensors payload as tensors without an extra copy.

Two sources, one contract (the dict of :data:`~eagle_data.format.schema.TENSOR_FIELDS`, checked by
:func:`~eagle_data.format.schema.validate_tensors`):

* bytes / a uint8 array (a remote stream's member read into memory): tensors are views;
* a :class:`FileSlice` of a local shard: ``input_ids`` / ``loss_mask`` are read at once, the
  hidden states stay :class:`FileTensor` (file, offset, shape, dtype) until the collate reads
  them with ``os.preadv`` straight into the padded batch: one kernel copy from the page cache
  into their final place, no memory map and no intermediate buffer. Memory held by a shuffle
  buffer of file-backed samples is a few hundred bytes each; the data waits in the page cache,
  where the tar reader's ``POSIX_FADV_WILLNEED`` readahead put it.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from typing import Any

import numpy as np
import torch

from eagle_data.format.schema import SampleError, ST_DTYPES_BY_NAME, decode_tensors, validate_tensors

LAZY_FIELDS = ("aux_hidden_states", "hidden_states")


class ShortRead(ValueError):
    """A local shard ended before a byte range that its tar walk had seen (changed since)."""


class LocalFile:
    """An open local shard shared by the :class:`FileSlice` objects that point into it; the
    descriptor closes when the last of them is gone (or on :meth:`close`)."""

    __slots__ = ("fd", "name", "__weakref__")

    def __init__(self, fd: int, name: str):
        self.fd, self.name = fd, name

    def pread_into(self, buf: memoryview, offset: int) -> None:
        """Fill ``buf`` (writable, byte-cast) from ``offset``.

        Raises:
            ValueError: the file ends first (truncated after it was walked).
        """
        got, n = 0, len(buf)
        while got < n:
            k = os.preadv(self.fd, [buf[got:]], offset + got)
            if k <= 0:
                raise ShortRead(f"{self.name}: unexpected end of file at byte {offset + got} (shard changed "
                                "while being read?)")
            got += k

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        self.close()


class FileSlice:
    """``size`` bytes at ``offset`` of a :class:`LocalFile` (a tar member not read yet)."""

    __slots__ = ("file", "offset", "size")

    def __init__(self, file: LocalFile, offset: int, size: int):
        self.file, self.offset, self.size = file, offset, size

    def __len__(self) -> int:
        return self.size

    def read(self, start: int, n: int) -> bytes:
        """Bytes ``start .. start + n`` of the slice (clipped to its end)."""
        n = max(0, min(n, self.size - start))
        buf = bytearray(n)
        self.file.pread_into(memoryview(buf), self.offset + start)
        return bytes(buf)

    def tobytes(self) -> bytes:
        return self.read(0, self.size)


class FileTensor:
    """A C-contiguous tensor (``[T, W]`` hidden states) still in a local file; ``t[:n]`` keeps
    the first ``n`` rows (truncation); :meth:`read_into` fills a destination;
    :meth:`materialize` reads it."""

    __slots__ = ("file", "offset", "shape", "dtype")

    def __init__(self, file: LocalFile, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.file, self.offset, self.shape, self.dtype = file, offset, torch.Size(shape), dtype

    def dim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def __getitem__(self, rows: slice) -> "FileTensor":
        if not isinstance(rows, slice) or rows.start not in (None, 0) or rows.step not in (None, 1):
            raise TypeError("a FileTensor only takes leading-row prefixes t[:n]")
        n = min(self.shape[0], self.shape[0] if rows.stop is None else max(0, rows.stop))
        return FileTensor(self.file, self.offset, (n, *self.shape[1:]), self.dtype)

    def read_into(self, dst: np.ndarray) -> None:
        """Read into ``dst``: a C-contiguous array of exactly :attr:`nbytes` bytes.

        Raises:
            ValueError: the shard ends first.
        """
        assert dst.flags.c_contiguous and dst.nbytes == self.nbytes, (dst.shape, self.shape)
        if self.nbytes:
            self.file.pread_into(memoryview(dst).cast("B"), self.offset)

    def materialize(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out.view(torch.uint8).numpy() if out.numel() else np.empty(0, np.uint8))
        return out


def _is_int(x: Any) -> bool:
    return type(x) is int  # not bool, not float: as the safetensors library requires


def _checked_header(header: Any) -> dict:
    """The header's entries, with the types the safetensors format prescribes.

    Raises:
        ValueError: a non-dict header or entry, a non-string dtype, non-integer shape or
            offsets, or a ``__metadata__`` that is not a str -> str dict.
    """
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    for k, v in header.items():
        if k == "__metadata__":
            if not isinstance(v, dict) or not all(isinstance(x, str) for kv in v.items() for x in kv):
                raise ValueError("__metadata__ must map strings to strings")
            continue
        if not (isinstance(v, dict) and isinstance(v.get("dtype"), str) and isinstance(v.get("shape"), list)
                and all(_is_int(x) for x in v["shape"]) and isinstance(v.get("data_offsets"), list)
                and len(v["data_offsets"]) == 2 and all(_is_int(x) for x in v["data_offsets"])):
            raise ValueError(f"bad header entry for {k!r}")
    return header


def _header(data: Any) -> tuple[dict, int, int]:
    """``(header dict, body start, body length)`` of a safetensors payload."""
    size = len(data)
    head = data.read(0, 8) if isinstance(data, FileSlice) else bytes(data[:8])
    if len(head) < 8:
        raise ValueError("short header")
    n = int.from_bytes(head, "little")
    if size < 8 + n:
        raise ValueError("short header")
    raw = data.read(8, n) if isinstance(data, FileSlice) else bytes(data[8:8 + n])
    return _checked_header(json.loads(raw)), 8 + n, size - 8 - n


def view_tensors(data: bytes | np.ndarray | FileSlice, where: str = "?") -> dict[str, Any]:
    """The four tensors of a ``.safetensors`` payload without copying them: views into ``data``
    (bytes: read-only views; a writable uint8 array: writable views), or for a
    :class:`FileSlice` small tensors read now and :class:`FileTensor` hidden states. The JSON
    header is checked (dtype, shape x item size == byte range, the ranges tile the payload as
    the safetensors format requires), then
    :func:`~eagle_data.format.schema.validate_tensors`. Anything unusual falls back to
    :func:`~eagle_data.format.schema.decode_tensors` (same errors).

    Returns:
        ``input_ids`` [T] int64, ``loss_mask`` [T] uint8, ``aux_hidden_states`` [T, 3H] and
        ``hidden_states`` [T, H] (tensors or FileTensors) in the stored dtype.

    Raises:
        ValueError: as :func:`~eagle_data.format.schema.decode_tensors`, naming ``where``.
    """
    lazy = isinstance(data, FileSlice)
    try:
        header, body, body_len = _header(data)
        u8 = None
        if not lazy:
            if isinstance(data, np.ndarray):
                u8 = torch.from_numpy(data)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "non-writable buffer": the views are only read
                    u8 = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        out: dict[str, Any] = {}
        spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
        if [a for a, _ in spans] != [0] + [b for _, b in spans[:-1]] or (spans and spans[-1][1] != body_len):
            raise ValueError("data_offsets do not tile the payload")  # safetensors' own rule
        for k, v in header.items():
            if k == "__metadata__":
                continue
            dt = ST_DTYPES_BY_NAME[v["dtype"]]
            shape = list(v["shape"])
            a, b = v["data_offsets"]
            if not (0 <= a <= b <= body_len) or b - a != math.prod(shape) * dt.itemsize or min(shape, default=0) < 0:
                raise ValueError("bad data_offsets")
            if lazy:  # hidden states stay in the file; the small fields are read now
                t = FileTensor(data.file, data.offset + body + a, tuple(shape), dt)
                out[k] = t if k in LAZY_FIELDS and len(shape) == 2 else t.materialize()
            else:
                piece = u8[body + a:body + b]
                if (body + a) % dt.itemsize:
                    piece = piece.clone()
                out[k] = piece.view(dt).view(shape)
    except (OSError, ShortRead) as e:  # the shard itself, not its contents
        raise SampleError(where, f"cannot read its payload: {e}") from e
    except Exception:
        try:
            raw = data.tobytes() if lazy else (bytes(data) if isinstance(data, np.ndarray) else data)
        except (OSError, ShortRead) as e:
            raise SampleError(where, f"cannot read its payload: {e}") from e
        return decode_tensors(raw, where=where)
    validate_tensors(out, where=where)
    return out
