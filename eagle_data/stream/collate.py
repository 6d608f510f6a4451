"""Building an EAGLE-3 batch: padded tensors from decoded samples, in reused memory.

* :func:`collate` copies each sample once into its padded row (hidden states still in a local
  shard are read there with ``preadv``), several samples in parallel threads;
* :class:`BufferPool` hands out batch memory again once nothing references it;
* :func:`empty_shared` allocates in shared memory (DataLoader workers).

Which samples form a batch is :mod:`eagle_data.stream.plan`'s business.
"""

from __future__ import annotations

import math
from typing import Any, Sequence, TypedDict

import torch

from eagle_data.format.fp8 import dequantize, scale_name

#: the key of a filler row: when every sample of a batch was skipped (``on_error="skip"``) the
#: batch holds one 2-token row of zeros with no supervised token instead of being empty, so every
#: rank still takes the same number of steps and the loss sees a well-formed batch
FILLER_KEY = ""


class Batch(TypedDict, total=False):
    """The batch contract: what :class:`~eagle_data.stream.dataset.EagleShardDataset`, the loader
    and the DataModule yield and the drafter training consumes (declared here only)."""
    input_ids: torch.Tensor          #: [B, T] int64, 0 on padding
    attention_mask: torch.Tensor     #: [B, T] bool, True on the sample's tokens
    loss_mask: torch.Tensor          #: [B, T] bool, True on supervised (assistant) tokens, False on padding
    aux_hidden_states: torch.Tensor  #: [B, T, 3H] stored dtype (bit-exact; fp8 dequantised to bf16), aux layers low -> high
    hidden_states: torch.Tensor      #: [B, T, H] as aux; final post-norm state; zeros on padding
    keys: list[str]                  #: sample keys, row order (:data:`FILLER_KEY` for a filler row)
    skipped: int                     #: samples of this slot skipped (on_error="skip") since the previous
    #: batch; present only when > 0, taken out by :class:`~eagle_data.stream.loader.EagleDataLoader`


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor):
    """The bits of ``t`` as a numpy array (no copy). The big copies of the collate go through
    numpy: a single-threaded memcpy, where torch would split each copy over its intra-op
    threads (an OpenMP team that costs several times the copy itself when the cores are busy,
    e.g. with the trainer and the loader workers on the same CPUs)."""
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()


def empty_shared(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised tensor in shared memory (what a DataLoader worker would copy it into)."""
    n = math.prod(shape) * dtype.itemsize
    st = torch.UntypedStorage._new_shared(max(n, 1))
    return torch.empty(0, dtype=dtype).set_(st, 0, tuple(shape))


class BufferPool:
    """Reusable host memory for the big batch tensors of one process (not shared memory).

    A buffer is handed out again only when nothing else references its storage (torch's
    storage use count is 1: the pool's own reference), so a batch the caller still holds, or
    any view of it, is never overwritten. Needed because a batch built in a helper thread gets
    fresh pages from glibc on every allocation (thread arenas ``mmap`` blocks this large),
    which costs as much as the copy itself.

    Args:
        keep: buffers kept at most (more in use at once are allocated without pooling).
    """

    def __init__(self, keep: int = 8):
        import threading

        self.keep, self.bufs = keep, []
        self._use_count = getattr(torch._C, "_storage_Use_Count", None)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # a copy in another process starts empty
        return {"keep": self.keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["keep"])

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        n = max(1, math.prod(shape) * dtype.itemsize)
        with self._lock:  # two iterations of one dataset may overlap (a stopping prefetch thread)
            return self._empty(n, shape, dtype)

    def _empty(self, n: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if self._use_count is not None:
            free = [st for st in self.bufs if st.nbytes() >= n and self._use_count(st._cdata) == 1]
            if free:
                st = min(free, key=lambda x: x.nbytes())
                return torch.empty(0, dtype=dtype).set_(st, 0, tuple(shape))
        t = torch.empty(shape, dtype=dtype)
        if self._use_count is not None and len(self.bufs) < self.keep:
            self.bufs.append(t.untyped_storage())
        elif self._use_count is not None:  # full: replace the smallest free buffer, if any
            free = [i for i, st in enumerate(self.bufs) if self._use_count(st._cdata) == 1]
            if free:
                self.bufs[min(free, key=lambda i: self.bufs[i].nbytes())] = t.untyped_storage()
        return t


_POOL: tuple[int, int, Any] | None = None  # (pid, threads, executor): one per process


def _pool(threads: int):
    """This process's copy threads (created lazily, again after a fork)."""
    global _POOL
    import os
    from concurrent.futures import ThreadPoolExecutor

    if _POOL is None or _POOL[0] != os.getpid() or _POOL[1] != threads:
        _POOL = (os.getpid(), threads, ThreadPoolExecutor(threads, thread_name_prefix="eagle-collate"))
    return _POOL[2]


class SampleReadError(Exception):
    """Filling some samples' rows failed; ``errors`` maps their index in the batch to the error
    (``OSError``, or ``ValueError`` for a shard that ends early)."""

    def __init__(self, errors: dict[int, BaseException]):
        super().__init__(f"{len(errors)} sample(s) unreadable: {next(iter(errors.values()))!r}")
        self.errors = errors


def _fill_rows(dst: torch.Tensor, src: Any, n: int, scale: torch.Tensor | None = None) -> BaseException | None:
    """``dst[:n] = src`` (a tensor, or a FileTensor read in place), ``dst[n:] = 0``; numpy and
    ``preadv`` release the GIL, so several fills run in parallel threads. With ``scale`` (an fp8
    field, :mod:`eagle_data.format.fp8`) the rows are dequantised into ``dst``'s dtype, and a field
    stored narrower than the batch is converted. Returns a
    read error (``OSError``, or ``ValueError`` for a shard that ends early) instead of raising it."""
    d = _bits(dst)
    try:
        if scale is not None:
            q = src if isinstance(src, torch.Tensor) else src.materialize()
            dequantize(q[:n], scale[:n], out=dst[:n])
        elif src.dtype != dst.dtype:  # aux and final stored in different dtypes: the wider one is the batch's
            dst[:n].copy_(src if isinstance(src, torch.Tensor) else src.materialize())
        elif isinstance(src, torch.Tensor):
            d[:n] = _bits(src)
        else:
            src.read_into(d[:n])
    except (OSError, ValueError) as e:
        return e
    d[n:] = 0
    return None


def collate(samples: list[dict[str, torch.Tensor]], keys: list[str], hidden_size: int, aux_width: int,
            dtype: torch.dtype, num_skipped: int = 0, shared: bool = False, threads: int = 1,
            pool: BufferPool | None = None) -> Batch:
    """Pad decoded samples to the longest one. Each sample is copied once, into one tensor per
    field; hidden states still in a local shard (:class:`~eagle_data.format.payload.FileTensor`) are
    read with ``preadv`` straight into their rows. A single in-memory sample outside ``shared``
    mode is returned as views, no copy.

    Args:
        shared: allocate the batch in shared memory (DataLoader workers: saves torch's copy).
        threads: fill the hidden-state rows of the samples in this many threads (kernel and
            memory copies run in parallel; 1: in the calling thread).
        pool: where the hidden-state tensors come from outside ``shared`` mode (reused memory).

    Returns:
        a :class:`Batch` (``skipped`` = ``num_skipped`` when > 0).
    """
    b = len(samples)
    t = max((s["input_ids"].shape[0] for s in samples), default=0)
    if b == 1 and not shared:
        s = samples[0]
        h = {k: s[k] if isinstance(s[k], torch.Tensor) else s[k].materialize()
             for k in ("aux_hidden_states", "hidden_states")}
        h = {k: dequantize(v, s[scale_name(k)], dtype) if scale_name(k) in s else v.to(dtype) for k, v in h.items()}
        out = {"input_ids": s["input_ids"][None], "attention_mask": torch.ones(1, t, dtype=torch.bool),
               "loss_mask": s["loss_mask"].bool()[None],
               "aux_hidden_states": h["aux_hidden_states"][None], "hidden_states": h["hidden_states"][None]}
    else:
        new = empty_shared if shared else (lambda shape, dt: torch.empty(shape, dtype=dt))
        big = new if shared or pool is None else pool.empty
        out = {"input_ids": new((b, t), torch.int64), "attention_mask": new((b, t), torch.bool),
               "loss_mask": new((b, t), torch.bool), "aux_hidden_states": big((b, t, aux_width), dtype),
               "hidden_states": big((b, t, hidden_size), dtype)}
        # every page of every field is written exactly once: sample rows, then the padding tail
        jobs = []
        for i, s in enumerate(samples):
            n = s["input_ids"].shape[0]
            out["input_ids"][i, :n] = s["input_ids"]
            out["input_ids"][i, n:] = 0
            out["attention_mask"][i, :n] = True
            out["attention_mask"][i, n:] = False
            out["loss_mask"][i, :n] = s["loss_mask"]
            out["loss_mask"][i, n:] = False
            jobs += [(i, (out[k][i], s[k], n, s.get(scale_name(k)))) for k in ("aux_hidden_states", "hidden_states")]
        fill = _pool(threads).map if threads > 1 and len(jobs) > 2 else map  # the pool re-raises others
        errors: dict[int, BaseException] = {}
        for (i, _), e in zip(jobs, fill(lambda j: _fill_rows(*j[1]), jobs)):
            if e is not None:
                errors.setdefault(i, e)
        if errors:
            raise SampleReadError(errors)
    out["keys"] = list(keys)
    if num_skipped:
        out["skipped"] = num_skipped
    return out
