"""``eagle-data bench extract|sglang``: throughput benchmarks that print numbers."""

from __future__ import annotations

import json
from typing import Optional


def bench_extract(shape: str = "llama3.1-8b", device: str = "cuda", dtype: str = "bfloat16", seq_len: int = 2048,
                  batch_size: int = 4, num_batches: int = 12, repeats: int = 3, writers: int = 2,
                  out_dir: Optional[str] = None, peak_tflops: float = 989.0, json_out: Optional[str] = None) -> None:
    """Extraction tokens/s: (a) plain forward, (b) capture to host, (c) capture + shard writing, (d) raw disk rate.

    Args:
        shape: "llama3.1-8b" (random bf16 weights, Llama-3.1-8B config; no download) or "tiny".
        device: "cuda" or "cpu".
        dtype: "bfloat16" or "float32".
        seq_len: tokens per prompt.
        batch_size: prompts per forward.
        num_batches: forwards per repeat.
        repeats: repeats; medians are reported.
        writers: shard-writer threads in (c) and in the parallel disk-rate test.
        out_dir: directory on the disk to measure (default: a temp dir).
        peak_tflops: peak dense bf16 TFLOP/s for the MFU figure.
        json_out: also write the figures to this JSON file.
    """
    from .bench_extract import bench_extract as run

    res = run(shape, device, dtype, seq_len, batch_size, num_batches, repeats, writers, out_dir, peak_tflops)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f, indent=1)


COMMANDS = {"bench": {"extract": bench_extract}}
