"""Deterministic shuffling and batch plans with equal batch counts on every rank.

Batch ``j`` of a rank comes from DataLoader worker ``j % num_workers`` (the DataLoader's
round-robin), and every rank yields the same number of batches per epoch, so DDP collectives
never wait for a rank that ran out of data.

* fixed batch size ``B``: the plan is made per rank, then dealt to its workers: every rank
  yields ``ceil(max_rank_samples / B)`` batches of the sizes :func:`rank_fixed_sizes` gives
  (full batches first; a rank with one sample less ends with a batch one smaller), whatever
  the number of workers; worker ``w`` takes batches ``w, w + k, ...`` and reads exactly their
  samples. No sample is dropped or repeated, except when ``B == 1`` and ``N % ranks != 0``:
  then the last ``N % ranks`` positions of the epoch's permuted stream are dropped (warned;
  they differ each epoch).
* token budget: batches are planned per rank from per-sample lengths (``index.parquet``
  ``num_tokens``, read once) by :func:`token_plan`; ranks with fewer batches than the largest
  split their largest batches (never exceeding the budget) until counts are equal; then they
  are dealt to the rank's workers like fixed-size batches. So the batches (count, sizes and
  samples) do not depend on the number of workers; each worker reads its rank's part of the
  stream and keeps the samples of its batches (a local shard's other samples cost a header
  read; a streamed shard is read by each worker).
"""

from __future__ import annotations

import math
import random
from typing import Any, Iterable, Iterator, Sequence

from eagle_data.packing import pack_window


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
    """Split the batch with the most padded tokens in two until ``len(plan) == target``; when every
    batch holds one sample, empty batches are added at the end (the dataset yields a filler row
    for them, see :data:`eagle_data.stream.collate.FILLER_KEY`), so every slot keeps the step count."""
    plan = [list(b) for b in plan]
    while len(plan) < target:
        cands = [(len(b) * max(lengths[i] for i in b), -k) for k, b in enumerate(plan) if len(b) > 1]
        if not cands:
            plan += [[] for _ in range(target - len(plan))]
            break
        k = -max(cands)[1]
        b = plan[k]
        plan[k:k + 1] = [b[:len(b) // 2], b[len(b) // 2:]]
    return plan


def rank_fixed_sizes(rank_samples: Sequence[int], batch_size: int) -> list[list[int]]:
    """Fixed-size mode: the batch sizes of each rank, as many batches on every rank
    (``ceil(max(rank_samples) / batch_size)``), independent of the number of workers.

    Raises:
        ValueError: a rank has fewer samples than batches (only possible with ``batch_size=1``
            and unequal ranks: drop ``N % ranks`` samples first).
    """
    nb = math.ceil(max(rank_samples) / batch_size)
    return [fixed_sizes(n, nb, batch_size) for n in rank_samples]


def deal(sizes: Sequence[int], num_workers: int, worker: int) -> list[int]:
    """The batches (their sizes) worker ``worker`` of ``num_workers`` serves: ``j % num_workers == worker``."""
    return list(sizes[worker::num_workers])
