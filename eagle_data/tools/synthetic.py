"""Synthetic eagle-data datasets (real shards, manifest and index) for tests and benchmarks.

Samples identify themselves: sample ``g`` (global number) has key ``syn_{g:09d}``,
``input_ids`` filled with ``g``, and hidden states filled with a bf16-exact value derived from
``g`` (see :func:`sample_value`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch

from eagle_data.extract.manifest import merge
from eagle_data.extract.resume import config_hash
from eagle_data.format.layout import progress_path
from eagle_data.extract.sink import ShardSink, atomic_write_json


def sample_value(g: int) -> float:
    """A bf16-representable value unique for small ``g`` (multiples of 1/128 up to 2^8)."""
    return (g % 32768) / 128.0


def write_synthetic(out: str | Path, shard_sizes: Sequence[int], hidden_size: int = 8,
                    length: Callable[[int], int] = lambda g: 4 + g % 5, dtype: str = "bfloat16",
                    aux_layer_ids: Sequence[int] = (1, 3, 5), values: Callable[[int], torch.Tensor] | None = None,
                    rank: int = 0, world_size: int = 1, merge_manifest: bool = True, tag: str = "syn") -> dict:
    """Write shards of ``shard_sizes[i]`` samples each (+ progress file; + manifest/index).

    Args:
        out: dataset directory.
        shard_sizes: samples per shard, in shard order.
        hidden_size: H (aux width is ``len(aux_layer_ids) * H``).
        length: tokens of sample ``g``.
        dtype: stored hidden dtype name.
        values: optional ``g -> [T, H]`` hidden_states (aux is the same repeated); default filled
            with :func:`sample_value`.
        rank, world_size: written as that extraction rank (several calls with ranks 0..W-1 +
            ``merge_manifest`` on the last one make a multi-rank dataset).
        tag: the dataset tag (keys ``{tag}_{g:09d}``; datasets mixed in one loader need their own).

    Returns:
        the manifest (or the progress record when ``merge_manifest`` is False).
    """
    from eagle_data.format.schema import HIDDEN_DTYPES

    out = Path(out)
    dt = HIDDEN_DTYPES[dtype]
    naux = len(aux_layer_ids)
    cfg = {"world_size": world_size, "dtype": dtype, "storage_dtype": dtype, "final_storage_dtype": dtype,
           "final_rows": "all", "aux_layer_ids": list(aux_layer_ids), "data": "synthetic", "dataset_tag": tag,
           "model_path": "synthetic"}
    state = {"config": cfg, "config_hash": config_hash(cfg), "rank": rank, "world_size": world_size,
             "model": {"model_path": "synthetic", "backend": "synthetic", "hidden_size": hidden_size,
                       "num_layers": max(aux_layer_ids) + 2, "vocab_size": 1 << 20,
                       "aux_layer_ids": list(aux_layer_ids), "dtype": dtype, "final_dtype": dtype, "final_rows": "all",
                       "compute_dtype": dtype},
             "shards": [], "skipped": {}, "finished": False}
    g0 = rank * 10**6
    sink = ShardSink(out, rank=rank, max_samples=1 << 30, max_bytes=1e15,
                     on_publish=lambda rec: state["shards"].append(rec))
    g = g0
    for n in shard_sizes:
        for _ in range(n):
            t = length(g)
            h = values(g) if values is not None else torch.full((t, hidden_size), sample_value(g))
            h = h.to(dt)
            tensors = {"input_ids": torch.full((t,), g, dtype=torch.int64),
                       "loss_mask": (torch.arange(t) % 2).to(torch.uint8),
                       "aux_hidden_states": h.repeat(1, naux), "hidden_states": h}
            meta = {"source_id": str(g), "source_row": g, "num_tokens": t, "num_turns": 2, "truncated": False}
            sink.write(f"{tag}_{g:09d}", tensors, meta)
            g += 1
        sink.end_shard()  # publish this shard; the next write opens a new one
    sink.close()
    state["finished"] = True
    atomic_write_json(progress_path(out, rank), state)
    return merge(out) if merge_manifest else state
