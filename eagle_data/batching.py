"""Deterministic shuffling, batch plans with equal counts per slot, and EAGLE-3 collation.

Every rank x worker *slot* yields exactly the same number of batches per epoch, so the
DataLoader's round-robin over workers is regular (batch ``j`` of a rank comes from worker
``j % num_workers``) and DDP collectives never wait for a rank that ran out of data.

* fixed batch size ``B``: every slot yields ``ceil(max_slot_samples / B)`` batches; a slot with
  one sample less ends with a batch one smaller (sizes from :func:`fixed_sizes`). No sample is
  dropped or repeated, except when ``B == 1`` and ``N % slots != 0``: then the last
  ``N % slots`` positions of the epoch's permuted stream are dropped (warned; they differ
  each epoch).
* token budget: batches are planned from per-sample lengths (``index.parquet``
  ``num_tokens``, read once) by :func:`token_plan`; slots with fewer batches than the
  largest split their largest batches (never exceeding the budget) until counts are equal.
"""

from __future__ import annotations

import math
import random
from typing import Any, Iterable, Iterator, Sequence

import torch


def shuffle_stream(src: Iterable[Any], bufsize: int, rng: random.Random, initial: int | None = None
                   ) -> Iterator[Any]:
    """Buffered shuffle with webdataset's ``shuffle(bufsize, initial)`` schedule: nothing is
    yielded until ``initial`` items are buffered (None: ``bufsize``); while the buffer is below
    ``bufsize`` two items are taken per item yielded, so reading runs ahead of the consumer
    from the first batch on; at the end the buffer drains in random order.

    The decisions depend only on ``rng`` and the stream length, so the same order can be
    replayed on positions (``shuffle_stream(range(n), ...)``, used by the token-budget plan).
    """
    if bufsize <= 1:
        yield from src
        return
    initial = bufsize if initial is None else max(1, min(initial, bufsize))
    it = iter(src)
    buf: list[Any] = []

    def pick() -> Any:
        i = rng.randrange(len(buf))
        buf[i], buf[-1] = buf[-1], buf[i]
        return buf.pop()

    for x in it:
        buf.append(x)
        if len(buf) < bufsize:
            for y in it:
                buf.append(y)
                break
        if len(buf) >= initial:
            yield pick()
    while buf:
        yield pick()


def fixed_sizes(num_samples: int, num_batches: int, batch_size: int) -> list[int]:
    """Split ``num_samples`` into exactly ``num_batches`` batches of at most ``batch_size``
    (full batches first, every batch non-empty).

    Raises:
        ValueError: impossible (``num_samples < num_batches`` or ``> num_batches * batch_size``).
    """
    if not num_batches <= num_samples <= num_batches * batch_size:
        raise ValueError(f"cannot split {num_samples} samples into {num_batches} batches of <= {batch_size}")
    out, left = [], num_samples
    for i in range(num_batches):
        s = min(batch_size, left - (num_batches - i - 1))
        out.append(s)
        left -= s
    return out


def pack_window(idx: Sequence[int], lengths: Sequence[int], max_tokens: int, max_batch_size: int
                ) -> list[list[int]]:
    """Sort one window by length and greedily cut batches with ``B * max(T) <= max_tokens``
    (a sample longer than the budget forms a batch alone)."""
    order = sorted(idx, key=lambda i: lengths[i])
    out: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for i in order:
        t = lengths[i]
        if batch and (max(longest, t) * (len(batch) + 1) > max_tokens or len(batch) >= max_batch_size):
            out.append(batch)
            batch, longest = [], 0
        batch.append(i)
        longest = max(longest, t)
    if batch:
        out.append(batch)
    return out


def token_plan(lengths: Sequence[int], bufsize: int, rng: random.Random, window: int, max_tokens: int,
               max_batch_size: int, initial: int | None = None) -> list[list[int]]:
    """Batches (lists of slot-local positions) of one slot: shuffle replayed on positions,
    then :func:`pack_window` over consecutive windows of ``window`` shuffled positions."""
    order = list(shuffle_stream(range(len(lengths)), bufsize, rng, initial))
    out: list[list[int]] = []
    for a in range(0, len(order), window):
        out += pack_window(order[a:a + window], lengths, max_tokens, max_batch_size)
    return out


def split_to(plan: list[list[int]], target: int, lengths: Sequence[int]) -> list[list[int]]:
    """Split the batch with the most padded tokens in two until ``len(plan) == target``.

    Raises:
        ValueError: no batch of 2+ samples is left to split.
    """
    plan = [list(b) for b in plan]
    while len(plan) < target:
        cands = [(len(b) * max(lengths[i] for i in b), -k) for k, b in enumerate(plan) if len(b) > 1]
        if not cands:
            raise ValueError(f"cannot make {target} batches from {sum(map(len, plan))} samples; "
                             "use fewer ranks/workers or a smaller max_tokens")
        k = -max(cands)[1]
        b = plan[k]
        plan[k:k + 1] = [b[:len(b) // 2], b[len(b) // 2:]]
    return plan


def num_fixed_batches(sizes: Sequence[int], batch_size: int) -> int:
    """Batches per slot for fixed batch size (see module doc)."""
    return math.ceil(max(sizes) / batch_size)


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


def _fill_rows(dst: torch.Tensor, src: Any, n: int) -> None:
    """``dst[:n] = src`` (a tensor, or a FileTensor read in place), ``dst[n:] = 0``; numpy and
    ``preadv`` release the GIL, so several fills run in parallel threads."""
    d = _bits(dst)
    if isinstance(src, torch.Tensor):
        d[:n] = _bits(src)
    else:
        src.read_into(d[:n])
    d[n:] = 0


def collate(samples: list[dict[str, torch.Tensor]], keys: list[str], hidden_size: int, aux_width: int,
            dtype: torch.dtype, num_skipped: int = 0, shared: bool = False, threads: int = 1,
            pool: BufferPool | None = None) -> dict[str, Any]:
    """Pad decoded samples to the longest one. Each sample is copied once, into one tensor per
    field; hidden states still in a local shard (:class:`~eagle_data.payload.FileTensor`) are
    read with ``preadv`` straight into their rows. A single in-memory sample outside ``shared``
    mode is returned as views, no copy.

    Args:
        shared: allocate the batch in shared memory (DataLoader workers: saves torch's copy).
        threads: fill the hidden-state rows of the samples in this many threads (kernel and
            memory copies run in parallel; 1: in the calling thread).
        pool: where the hidden-state tensors come from outside ``shared`` mode (reused memory).

    Returns:
        ``input_ids`` [B, T] int64 (pad 0), ``attention_mask`` [B, T] bool, ``loss_mask``
        [B, T] bool (False on padding), ``aux_hidden_states`` [B, T, 3H] and ``hidden_states``
        [B, T, H] in the stored dtype (bf16 bit-exact; zeros on padding), ``keys`` list[str].
        ``B == 0`` (``T == 0``) only when every sample of a batch was skipped by ``on_error="skip"``.
    """
    b = len(samples)
    t = max((s["input_ids"].shape[0] for s in samples), default=0)
    if b == 1 and not shared:
        s = samples[0]
        h = {k: s[k] if isinstance(s[k], torch.Tensor) else s[k].materialize()
             for k in ("aux_hidden_states", "hidden_states")}
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
            jobs += [(i, (out[k][i], s[k], n)) for k in ("aux_hidden_states", "hidden_states")]
        errors: dict[int, BaseException] = {}
        if threads > 1 and len(jobs) > 2:
            futures = [(i, _pool(threads).submit(_fill_rows, *j)) for i, j in jobs]
            for i, f in futures:
                e = f.exception()
                if e is not None:
                    errors.setdefault(i, e)
        else:
            for i, j in jobs:
                try:
                    _fill_rows(*j)
                except (OSError, ValueError) as e:
                    errors.setdefault(i, e)
        if errors:
            if not all(isinstance(e, (OSError, ValueError)) for e in errors.values()):
                raise next(e for e in errors.values() if not isinstance(e, (OSError, ValueError)))
            raise SampleReadError(errors)
    out["keys"] = list(keys)
    if num_skipped:
        out["_skipped"] = num_skipped
    return out
