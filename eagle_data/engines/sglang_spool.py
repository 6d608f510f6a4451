"""Binary hand-off between the SGLang scheduler hook and :class:`SGLangBackend`, and the stitcher.

Pure python + torch + safetensors: imported by the hook inside the scheduler process and
by the backend in the parent; never imports sglang.

Spool layout (one directory per backend instance, default under ``/dev/shm``)::

    eagle-data-sglang-<pid>-<hex>/
        <rid>@<offset:010d>@<seq:010d>.arena         one prefill chunk of one request, in the ring
        <rid>@<offset:010d>@<seq:010d>.safetensors   the same in a file (no ring, or no room in it)
        <rid>@ERROR@<seq:010d>.json                   the hook refused a forward pass
        arena.bin                                      the ring (:mod:`eagle_data.engines.sglang_arena`)
        hook-stats.json                                the hook's timings so far (:data:`HOOK_STATS`)

A chunk file holds ``input_ids`` [n] int64, ``aux`` [n, K*H] and ``final`` [n, H] in their
storage dtypes (the model dtype, bit-exact, or fp8 quantised on the device), and per-row extras:
with fp8, ``aux_scale`` [n, K] / ``final_scale`` [n, 1] float32; ``ok`` [n] bool, every stored value
of the row finite (checked on the device); rows ``offset .. offset+n`` of the request. ``seq``
is the hook's write counter (per scheduler process), so a re-run chunk never overwrites an
earlier one silently and the production order can be checked. Files are written to a
``.tmp`` name and renamed, so a reader never sees a partial file.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file

from eagle_data.host import pid_alive

log = logging.getLogger(__name__)

SPOOL_PREFIX = "eagle-data-sglang-"
#: the capture hook's running timings (seconds and counts, rewritten after each pass; diagnostics only)
HOOK_STATS = "hook-stats.json"
_PIECE_RE = re.compile(r"^(?P<rid>.+)@(?P<off>\d{10}|ERROR)@(?P<seq>\d{10})\.(?P<ext>safetensors|arena|json)$")


class StitchError(RuntimeError):
    """Captured rows of one sample do not tile ``[0, T)`` exactly. The message names the sample."""


class RowsMissing(StitchError):
    """Rows of the sample are missing (a gap, a skipped prefix, an incomplete prefill): while
    the engine's pieces are still arriving this may resolve itself."""


@dataclass
class Piece:
    """One prefill chunk of one request.

    Attributes:
        offset: position of the first row in the request (= SGLang ``extend_prefix_len``).
        input_ids: [n] int64, the token ids the engine ran for these rows.
        aux: [n, K*H], aux layers concatenated low -> high.
        final: [n, H], final post-norm hidden state.
        seq: the hook's write counter (production order), ``-1`` if unknown.
        extra: per-row tensors beside them (``aux_scale`` [n, K], ``final_scale`` [n, 1], ``ok`` [n]).
    """
    offset: int
    input_ids: torch.Tensor
    aux: torch.Tensor
    final: torch.Tensor
    seq: int = -1
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


def stitch(key: str, input_ids: torch.Tensor, pieces: Iterable[Piece]) -> dict[str, torch.Tensor]:
    """Join the chunks of one request into ``{"aux": [T, K*H], "final": [T, H], **extra}`` (the
    per-row extras of the pieces, e.g. ``aux_scale`` [T, K], ``ok`` [T]).

    Pieces may be given in any order (files are listed in directory order); they are
    sorted by ``offset``. They must tile ``[0, T)`` exactly, carry the sample's own token
    ids, and (when ``seq`` is known) have been produced in offset order.

    Args:
        key: sample key, used in error messages.
        input_ids: [T] int64, what the caller sent.
        pieces: the captured chunks.

    Raises:
        StitchError: no rows; rows ``[0, x)`` missing (a cached prefix was skipped);
            gap; overlap or duplicate offset; chunks produced out of order; row-count or
            width mismatch inside a chunk; token ids differ (rows belong to another
            request); rows do not end at ``T``. Every message names ``key``.
    """
    t = int(input_ids.shape[0])
    ps = sorted(pieces, key=lambda p: (p.offset, p.seq))
    if not ps:
        raise RowsMissing(f"sample {key!r}: no hidden-state rows captured for {t} tokens")
    if ps[0].offset != 0:
        raise RowsMissing(f"sample {key!r}: rows [0, {ps[0].offset}) of {t} missing (a cached prefix was "
                          f"skipped: the radix cache must be disabled)")
    end, width = 0, None
    for i, p in enumerate(ps):
        n = int(p.input_ids.shape[0])
        if p.aux.shape[0] != n or p.final.shape[0] != n or n == 0 or any(x.shape[0] != n for x in p.extra.values()):
            raise StitchError(f"sample {key!r}: chunk at offset {p.offset} has {n} ids, {p.aux.shape[0]} aux "
                              f"rows, {p.final.shape[0]} final rows, extras {_shapes(p.extra)}")
        w = (p.aux.shape[1], p.final.shape[1], p.aux.dtype, p.final.dtype,
             sorted((k, x.shape[1:], x.dtype) for k, x in p.extra.items()))
        if width is not None and w != width:
            raise StitchError(f"sample {key!r}: chunk at offset {p.offset} has width/dtype {w}, earlier {width}")
        width = w
        if i and p.offset == ps[i - 1].offset:
            raise StitchError(f"sample {key!r}: duplicate chunk at offset {p.offset} (a prefill ran twice)")
        if p.offset < end:
            raise StitchError(f"sample {key!r}: chunk at offset {p.offset} overlaps rows up to {end}")
        if p.offset > end:
            raise RowsMissing(f"sample {key!r}: gap: rows [{end}, {p.offset}) of {t} missing")
        if i and p.seq >= 0 and ps[i - 1].seq >= 0 and p.seq < ps[i - 1].seq:
            raise StitchError(f"sample {key!r}: chunk at offset {p.offset} was produced before the chunk at "
                              f"offset {ps[i - 1].offset} (out of order)")
        if p.offset + n > t:
            raise StitchError(f"sample {key!r}: chunk at offset {p.offset} has {n} rows, past T={t}")
        if not torch.equal(p.input_ids.to(torch.int64), input_ids[p.offset:p.offset + n].to(torch.int64)):
            raise StitchError(f"sample {key!r}: token ids of the chunk at offset {p.offset} differ from the "
                              f"sample's (rows belong to another request)")
        end = p.offset + n
    if end != t:
        raise RowsMissing(f"sample {key!r}: rows [{end}, {t}) of {t} missing (incomplete prefill)")
    fields = [{"aux": p.aux, "final": p.final, **p.extra} for p in ps]
    if len(ps) == 1:
        return fields[0]
    return {k: torch.cat([f[k] for f in fields]) for k in fields[0]}


def _shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(x.shape) for k, x in tensors.items()}


# ----------------------------------------------------------------------------- files

def piece_name(rid: str, offset: int, seq: int, ext: str = "safetensors") -> str:
    return f"{rid}@{offset:010d}@{seq:010d}.{ext}"


_ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.int64: "I64",
              torch.float8_e4m3fn: "F8_E4M3", torch.bool: "BOOL"}


def write_piece(spool: str | os.PathLike, rid: str, offset: int, seq: int, input_ids: torch.Tensor,
                aux: torch.Tensor, final: torch.Tensor, extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write one chunk atomically (tmp + rename) as a safetensors file (``extra``: the per-row
    tensors of :attr:`Piece.extra`). Tensors are moved to CPU, made contiguous; the bytes go out in
    one ``os.writev`` (no serialised copy, the GIL released while the kernel copies: the
    scheduler's thread keeps running beside the writer thread)."""
    path = Path(spool) / piece_name(rid, offset, seq)
    tmp = path.with_name(path.name + ".tmp")
    tensors = {"input_ids": input_ids.detach().to("cpu", torch.int64).contiguous(),
               **{k: x.detach().cpu().contiguous() for k, x in {"aux": aux, "final": final, **(extra or {})}.items()}}
    header: dict = {"__metadata__": {"rid": rid, "offset": str(offset), "seq": str(seq)}}
    views, pos = [], 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        views.append(memoryview(t.view(-1).view(torch.uint8).numpy()) if n else b"")
        pos += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    parts = [len(head).to_bytes(8, "little"), head, *views]
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while parts:  # writev may write less than asked: go on from where it stopped
            done = os.writev(fd, parts)
            while parts and done >= len(parts[0]):
                done -= len(parts[0])
                parts.pop(0)
            if parts and done:
                parts[0] = memoryview(parts[0])[done:]
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def publish_json(path: Path, obj: dict) -> Path:
    """Write ``obj`` as JSON to ``path`` whole or not at all (tmp + rename: the reader lists only
    finished names). No fsync: the spool is in memory and dies with the run."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, separators=(",", ":")))
    os.replace(tmp, path)
    return path


def write_error(spool: str | os.PathLike, rid: str, seq: int, message: str) -> Path:
    """Record that the hook refused a forward pass containing ``rid``."""
    return publish_json(Path(spool) / f"{rid}@ERROR@{seq:010d}.json", {"rid": rid, "error": message})


def stored_row_bytes(n_aux: int, hidden: int, aux_dtype: torch.dtype, final_dtype: torch.dtype) -> int:
    """Bytes the capture hands over per token: its id (int64), ``n_aux`` aux rows and the final row
    of ``hidden`` values in their storage dtypes, an fp8 row's float32 scale, the finite flag."""
    scale = lambda dt, n: 4 * n if dt.itemsize == 1 else 0  # noqa: E731 (fp8: one scale per row)
    return (8 + hidden * (n_aux * aux_dtype.itemsize + final_dtype.itemsize) + scale(aux_dtype, n_aux)
            + scale(final_dtype, 1) + 1)


def write_hook_stats(spool: str | os.PathLike, stats: dict[str, float]) -> None:
    """Replace the hook's timings file (:data:`HOOK_STATS`) with ``stats``."""
    publish_json(Path(spool) / HOOK_STATS, stats)


def read_hook_stats(spool: str | os.PathLike) -> dict[str, float]:
    """The hook's latest timings (:data:`HOOK_STATS`), ``{}`` before its first write."""
    try:
        return json.loads((Path(spool) / HOOK_STATS).read_text())
    except (OSError, ValueError):
        return {}


def list_spool(spool: str | os.PathLike) -> dict[str, list[tuple[str, Path]]]:
    """Group finished spool files by rid: ``{rid: [("chunk"|"error", path), ...]}`` (tmp files skipped)."""
    out: dict[str, list[tuple[str, Path]]] = {}
    with os.scandir(spool) as it:
        for e in it:
            m = _PIECE_RE.match(e.name)
            if m:
                kind = "error" if m["off"] == "ERROR" else "chunk"
                out.setdefault(m["rid"], []).append((kind, Path(e.path)))
    return out


def read_piece(path: Path) -> Piece:
    """Load one chunk file written by :func:`write_piece`."""
    m = _PIECE_RE.match(path.name)
    if not m or m["off"] == "ERROR":
        raise ValueError(f"not a chunk file: {path}")
    t = load_file(str(path))
    return Piece(int(m["off"]), t.pop("input_ids"), t.pop("aux"), t.pop("final"), int(m["seq"]), t)


def read_error(path: Path) -> str:
    return json.loads(path.read_text())["error"]


# ----------------------------------------------------------------------------- spool lifetime

def default_spool_base() -> Path:
    """``/dev/shm`` if it exists and is writable, else the temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def remove_stale_spools(base: str | os.PathLike) -> list[Path]:
    """Delete ``eagle-data-sglang-<pid>-*`` dirs under ``base`` whose pid is dead. Returns them."""
    removed = []
    base = Path(base)
    if not base.is_dir():
        return removed
    for d in base.glob(SPOOL_PREFIX + "*"):
        try:
            pid = int(d.name[len(SPOOL_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not pid_alive(pid):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


class SpoolListing:
    """The finished files (chunks, errors) of each request in a spool directory, from a listing taken
    at most :attr:`EVERY_S` ago: one listing serves every request waiting on its files. A glob per
    request and poll cost O(files in the spool) each, O(requests x files) per round of polls, and
    held the collector's event loop (BENCHMARKS.md, "SGLang backend on CPU"). Names are split by
    hand, as :data:`_PIECE_RE` reads them: its match per name made a listing slower (the same
    section)."""

    #: seconds one listing serves
    EVERY_S = 0.005

    def __init__(self, path: Path):
        self.path, self._at = path, -math.inf
        self._names: dict[str, list[str]] = {}

    def files(self, rid: str) -> list[Path]:
        if time.monotonic() - self._at >= self.EVERY_S:
            names: dict[str, list[str]] = {}
            for name in os.listdir(self.path):  # names alone: a Path or a regex match per file costs more
                parts = name.rsplit("@", 2)  # as _PIECE_RE reads a name: the rid is all before the last two @
                if len(parts) == 3 and name.endswith((".safetensors", ".arena", ".json")):
                    names.setdefault(parts[0], []).append(name)
            self._names, self._at = names, time.monotonic()
        return [self.path / n for n in self._names.get(rid, ())]


class Spool:
    """A unique spool directory, removed on :meth:`close`, at interpreter exit (``atexit``:
    also after Ctrl-C, whose ``KeyboardInterrupt`` unwinds normally) and on SIGTERM/SIGHUP
    (handlers from :meth:`install_signal_handlers`, which chain to the previous handler).

    A crash that skips all of these (SIGKILL, OOM kill) leaves a directory that the next
    run removes at start-up, since its name carries the dead pid.
    """

    _live: set[Path] = set()
    _atexit = False
    _signals = False

    def __init__(self, base: str | os.PathLike | None = None):
        base = Path(base) if base is not None else default_spool_base()
        base.mkdir(parents=True, exist_ok=True)
        self.stale_removed = remove_stale_spools(base)
        self.path = base / f"{SPOOL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path.mkdir(mode=0o700)
        self._listing = SpoolListing(self.path)
        self.arena = None  # no ring: chunks come as files
        Spool._live.add(self.path)
        if not Spool._atexit:
            Spool._atexit = True
            atexit.register(Spool._cleanup_all)

    def files(self, rid: str) -> list[Path]:
        """The finished files of request ``rid`` (:class:`SpoolListing`)."""
        return self._listing.files(rid)

    def open_arena(self, size: int) -> None:
        """Make the ring of ``size`` bytes the capture hook copies chunks into (before the engine
        starts); where its bytes cannot be reserved, none (the chunks come as files), said."""
        from eagle_data.engines.sglang_arena import ArenaReader
        try:
            self.arena = ArenaReader(self.path, size)
        except OSError as e:
            log.warning("spool %s: no room for a ring of %d bytes (%s); captured rows go through files", self.path,
                        size, e)

    def read(self, path: Path) -> Piece:
        """One chunk: a ring record (``.arena``) or a file (:func:`read_piece`)."""
        if path.suffix != ".arena":
            return read_piece(path)
        t, r = self.arena.read(path)
        return Piece(int(r["offset"]), t.pop("input_ids"), t.pop("aux"), t.pop("final"), int(r["seq"]), t)

    def remove(self, paths: Iterable[Path]) -> None:
        """Delete spool files; a ring record's region is given back first."""
        for p in paths:
            try:
                if p.suffix == ".arena" and self.arena is not None:
                    self.arena.free(p)
                os.unlink(p)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Delete the directory and everything in it (idempotent); the ring's mapping goes with it."""
        self.arena = None
        shutil.rmtree(self.path, ignore_errors=True)
        Spool._live.discard(self.path)

    @classmethod
    def _cleanup_all(cls) -> None:
        for p in list(cls._live):
            shutil.rmtree(p, ignore_errors=True)
            cls._live.discard(p)

    @classmethod
    def install_signal_handlers(cls) -> bool:
        """Clean all live spools on SIGTERM/SIGHUP when the signal ends the process (default
        action: the process still dies). A previous handler that takes the signal (extraction's
        :class:`~eagle_data.extract.signals.Signals`) runs instead, the spools untouched: the run
        unwinds and closes them (the engine's writer and the reader still use them until then; a
        process that ends without closing leaves them to :func:`remove_stale_spools`). Call it
        after the engine has installed its own handlers. Only possible from the main thread;
        returns whether installed."""
        import threading
        if cls._signals or threading.current_thread() is not threading.main_thread():
            return cls._signals
        cls._signals = True
        for sig in (signal.SIGTERM, signal.SIGHUP):
            prev = signal.getsignal(sig)

            def handler(signum, frame, _prev=prev):
                if callable(_prev):
                    return _prev(signum, frame)
                if _prev == signal.SIG_IGN:
                    return None
                cls._cleanup_all()
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            signal.signal(sig, handler)
        return True
