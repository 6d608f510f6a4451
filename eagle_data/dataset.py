"""Streaming EAGLE-3 batches from eagle-data WebDataset shards, exact-once under DDP x workers.

Pipeline (webdataset stages; each worker runs it on its own slot, see :mod:`eagle_data.shards`)::

    shard list (manifests) -> (seed, epoch) permutation -> split by node -> split by worker
    -> tar (own reader, webdataset member/key semantics, per span) -> shuffle (raw buffers)
    -> batch plan -> decode (zero-copy views after the safetensors header checks, no pickle)
    + truncate -> pad/collate (one copy per sample, straight into shared memory in workers)

Use it through :class:`eagle_data.loader.EagleDataLoader` (epochs, resume, skip counts) or
:class:`eagle_data.datamodule.EagleDataModule`. See :mod:`eagle_data.batching` for the
equal-batch-count rule.
"""

from __future__ import annotations

import functools
import io
import mmap
import logging
import math
import random
import re
from collections import Counter
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from . import batching as B
from .schema import HIDDEN_DTYPES, decode_tensors, validate_tensors
from .shards import Span, check_compat, epoch_shard_order, resolve_sources, slot_sizes, slot_spans

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


class EagleShardDataset(IterableDataset):
    """Padded EAGLE-3 batches from eagle-data shards; every sample exactly once per epoch
    across ``world_size`` ranks x ``num_workers`` workers, equal batch counts on all ranks.

    Each item is a batch dict: ``input_ids`` [B, T] int64, ``attention_mask`` [B, T] bool,
    ``loss_mask`` [B, T] bool, ``aux_hidden_states`` [B, T, 3H] and ``hidden_states`` [B, T, H]
    in the stored dtype (bf16, bit-exact), ``keys`` list[str] (+ ``_skipped`` int, only with
    ``on_error="skip"``; :class:`~eagle_data.loader.EagleDataLoader` pops it).

    Args:
        sources: dataset dir(s)/URL(s) with ``manifest.json``, manifest file(s), or shard
            URLs / brace patterns (``s3://``, ``gs://``, ``https://``, ``pipe:``...).
        manifest: manifest for shard-URL sources (default: the one next to each shard).
        batch_size: samples per batch (fixed-size batching).
        max_tokens: token budget ``B * max(T)`` per batch (length-bucketed); give exactly one
            of ``batch_size`` / ``max_tokens``. Needs ``index.parquet`` (``num_tokens`` is read
            once, 4 bytes per sample).
        max_length: truncate samples to this many tokens (None: keep all).
        shuffle: permute shards per epoch and shuffle samples (buffer ``shuffle_buffer``).
        seed: base seed; the order is a function of ``(seed, epoch, slot)`` only.
        shuffle_buffer: raw samples held per worker for shuffling (memory: this x sample size).
        bucket_window: token mode: samples sorted by length within windows of this many.
        max_batch_size: token mode: samples per batch at most.
        hidden_size, aux_layer_ids, dtype: expected model facts; the manifests must match.
        on_error: ``"raise"`` (default) or ``"skip"`` (count unreadable samples, keep going).
        rank, world_size: override ``torch.distributed`` (simulation, tests).

    Raises:
        ValueError: bad arguments, missing/incompatible manifests, fewer samples than slots.
    """

    def __init__(self, sources: str | Sequence[str], *, manifest: str | None = None,
                 batch_size: int | None = None, max_tokens: int | None = None, max_length: int | None = None,
                 shuffle: bool = True, seed: int = 0, shuffle_buffer: int = 64, bucket_window: int = 256,
                 max_batch_size: int = 256, hidden_size: int | None = None,
                 aux_layer_ids: Sequence[int] | None = None, dtype: str | None = None, on_error: str = "raise",
                 rank: int | None = None, world_size: int | None = None):
        if (batch_size is None) == (max_tokens is None):
            raise ValueError("give exactly one of batch_size or max_tokens")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        self.shards, manifests = resolve_sources(sources, manifest)
        self.facts = check_compat(manifests, {"hidden_size": hidden_size, "aux_layer_ids": aux_layer_ids,
                                              "dtype": dtype})
        self.manifests = [u for u, _ in manifests]
        self.batch_size, self.max_tokens, self.max_length = batch_size, max_tokens, max_length
        self.shuffle, self.seed, self.shuffle_buffer = shuffle, seed, shuffle_buffer
        self.bucket_window, self.max_batch_size, self.on_error = bucket_window, max_batch_size, on_error
        self.rank, self.world_size = rank, world_size
        self.num_samples = sum(s.num_samples for s in self.shards)
        self.hidden_size = int(self.facts["hidden_size"])
        self.aux_width = len(self.facts["aux_layer_ids"]) * self.hidden_size
        self.dtype = HIDDEN_DTYPES[self.facts["dtype"]]
        self.epoch = 0
        self.num_workers = 1      # set by EagleDataLoader (used by __len__; workers read get_worker_info)
        self.skip_batches = 0     # rank-level batches of ``epoch`` already consumed (resume)
        self._epoch_cell: torch.Tensor | None = None  # shared [epoch, skip] for persistent workers
        self.skipped: Counter = Counter()
        self._yielded = 0

    # ---- topology and plan ------------------------------------------------------------------
    def rank_world(self) -> tuple[int, int]:
        """``(rank, world_size)``: constructor args, else ``torch.distributed``, else ``(0, 1)``."""
        if self.world_size is not None:
            return self.rank or 0, self.world_size
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Select the epoch (order = f(seed, epoch)) and how many of this rank's batches to skip.

        Also written to a shared-memory cell that persistent DataLoader workers (forked once,
        holding their own copy of this object) read at the start of every epoch."""
        self.epoch, self.skip_batches, self._yielded = epoch, skip_batches, skip_batches
        if self._epoch_cell is not None:
            self._epoch_cell[0], self._epoch_cell[1] = epoch, skip_batches

    def share_epoch(self) -> None:
        """Put the epoch selection in shared memory (before persistent workers are started)."""
        if self._epoch_cell is None:
            self._epoch_cell = torch.tensor([self.epoch, self.skip_batches], dtype=torch.int64).share_memory_()

    def _sizes(self, world: int, workers: int) -> list[int]:
        n, num_slots = self.num_samples, world * workers
        if n < num_slots:
            raise ValueError(f"{n} samples cannot feed {num_slots} rank x worker slots; use fewer workers")
        if self.batch_size == 1 and n % num_slots:
            log.warning("batch_size=1: dropping the last %d positions of epoch's permuted stream so all "
                        "%d slots have equal batch counts", n % num_slots, num_slots)
            n -= n % num_slots
        # ranks get n // world or one more; each rank's part is split evenly over its workers
        return [m for r in slot_sizes(n, world) for m in slot_sizes(r, workers)]

    @functools.cache
    def _lengths(self) -> dict[tuple[str, str], list[int]]:
        import pyarrow.parquet as pq

        from .shards import _dir_of, _join

        out: dict[tuple[str, str], list[int]] = {}
        for murl in self.manifests:
            base = _dir_of(murl)
            try:
                t = pq.read_table(_join(base, "index.parquet"), columns=["shard", "num_tokens"])
            except Exception as e:
                raise ValueError(f"max_tokens batching needs {base}/index.parquet: {e}") from e
            for name, n in zip(t.column("shard").to_pylist(), t.column("num_tokens").to_pylist()):
                out.setdefault((murl, name), []).append(min(n, self.max_length or n))
        return out

    def _rng(self, epoch: int, slot: int) -> random.Random:
        return random.Random(f"{self.seed}:{epoch}:{slot}")

    def plan(self, epoch: int, world: int, workers: int, slot: int):
        """``(spans, batches)`` of one slot: ``batches`` is a list of batch sizes (fixed mode)
        or of lists of slot-local positions (token mode); equal length for every slot."""
        sizes = self._sizes(world, workers)
        order = epoch_shard_order(self.shards, self.seed, epoch, self.shuffle)
        spans = slot_spans(order, sizes, slot)
        if self.batch_size is not None:
            nb = B.num_fixed_batches(sizes, self.batch_size)
            return spans, B.fixed_sizes(sizes[slot], nb, self.batch_size)
        plans = []
        for s in range(len(sizes)):
            lens = [n for sp in slot_spans(order, sizes, s)
                    for n in self._lengths()[(sp.shard.manifest, sp.shard.name)][sp.start:sp.stop]]
            plans.append((lens, B.token_plan(lens, self._buf(), self._rng(epoch, s), self.bucket_window,
                                             self.max_tokens, self.max_batch_size)))
        target = max(len(p) for _, p in plans)
        return spans, B.split_to(plans[slot][1], target, plans[slot][0])

    def _buf(self) -> int:
        return self.shuffle_buffer if self.shuffle else 0

    def batches_per_rank(self, num_workers: int | None = None, epoch: int | None = None) -> int:
        """Batches each rank yields in ``epoch`` (same on every rank)."""
        k = max(1, num_workers if num_workers is not None else self.num_workers)
        _, world = self.rank_world()
        return k * len(self.plan(self.epoch if epoch is None else epoch, world, k, 0)[1])

    def __len__(self) -> int:
        return self.batches_per_rank()

    # ---- iteration -----------------------------------------------------------------------------
    def _decode(self, raw: dict[str, Any]) -> dict[str, torch.Tensor]:
        where = f"{raw['__url__']}:{raw['__key__']}"
        t = view_tensors(raw["safetensors"], where=where)
        h = t["hidden_states"]
        if h.shape[1] != self.hidden_size or t["aux_hidden_states"].shape[1] != self.aux_width \
                or h.dtype != self.dtype:
            raise ValueError(f"sample {where}: hidden {tuple(h.shape)} {h.dtype} / aux "
                             f"{tuple(t['aux_hidden_states'].shape)} disagree with the manifest "
                             f"(H={self.hidden_size}, {self.dtype})")
        if self.max_length is not None:
            t = {k: v[:self.max_length] for k, v in t.items()}
        return t

    def _collate(self, raws: list[dict[str, Any] | None]) -> dict[str, Any]:
        samples, keys, holes = [], [], 0
        for r in raws:
            if r is not None:
                try:
                    samples.append(self._decode(r))
                    keys.append(r["__key__"])
                    continue
                except ValueError:
                    if self.on_error == "raise":
                        raise
                    self.skipped["undecodable"] += 1
                    log.warning("skipping undecodable sample %s", r["__key__"])
            holes += 1
        # in a DataLoader worker the batch is built in shared memory, so torch does not copy it
        # again to send it to the main process
        return B.collate(samples, keys, self.hidden_size, self.aux_width, self.dtype, holes,
                         shared=get_worker_info() is not None)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._epoch_cell is not None and get_worker_info() is not None:  # persistent worker
            self.epoch, self.skip_batches = int(self._epoch_cell[0]), int(self._epoch_cell[1])
        rank, world = self.rank_world()
        wi = get_worker_info()
        k, w = (wi.num_workers, wi.id) if wi is not None else (1, 0)
        # After resuming at rank batch s, DataLoader worker 0 must serve logical worker s % k
        # (the DataLoader's round-robin always starts at worker 0).
        w = (w + self.skip_batches) % k
        slot = rank * k + w
        spans, batches = self.plan(self.epoch, world, k, slot)
        skip = max(0, math.ceil((self.skip_batches - w) / k))  # this worker's batches among those consumed
        raw = (r for sp in spans for r in read_span(sp, self.on_error, self.skipped))
        if self.batch_size is not None:
            stream = B.shuffle_stream(raw, self._buf(), self._rng(self.epoch, slot))
            for j, size in enumerate(batches):
                group = [next(stream) for _ in range(size)]
                if j >= skip:
                    self._yielded += 1
                    yield self._collate(group)
            return
        drop = {i for b in batches[:skip] for i in b}
        pending: dict[int, Any] = {}
        pos = enumerate(raw)
        for b in batches[skip:]:
            while any(i not in pending for i in b):
                i, r = next(pos)
                if i not in drop:
                    pending[i] = r
            self._yielded += 1
            yield self._collate([pending.pop(i) for i in b])

    # ---- in-process resume (num_workers=0); EagleDataLoader does it for any num_workers -------
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batches": self._yielded, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this dataset has {self.seed}")
        self.set_epoch(int(state["epoch"]), int(state["batches"]))


def decode_hf_example(example: dict[str, Any]) -> dict[str, Any]:
    """Decode one row of ``datasets.load_dataset("webdataset", data_files=..., split="train")``.

    HF's webdataset builder yields ``{"__key__", "__url__", "safetensors": bytes, "json": dict}``
    (it decodes nothing else; no pickle). Returns ``{"key", "input_ids" [T] int64,
    "loss_mask" [T] uint8, "aux_hidden_states" [T, 3H], "hidden_states" [T, H], "meta"}``.

    Raises:
        ValueError: missing or undecodable ``safetensors`` member.
    """
    data = example.get("safetensors")
    if data is None:
        raise ValueError(f"sample {example.get('__key__')}: no safetensors member")
    t = decode_tensors(bytes(data), where=str(example.get("__key__")))
    return {"key": example.get("__key__"), **t, "meta": example.get("json")}
