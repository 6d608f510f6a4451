"""Length-sorted greedy packing under a padded-token budget, shared by the extraction batches
(:mod:`eagle_data.extract.stages`) and the training batch plan (:mod:`eagle_data.stream.plan`)."""

from __future__ import annotations

from typing import Sequence


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
