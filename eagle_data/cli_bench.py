"""``eagle-data bench extract|sglang``: throughput benchmarks that print numbers."""

from __future__ import annotations

import json
from typing import Optional


def bench_extract(shape: str = "llama3.1-8b", device: str = "cuda", dtype: str = "bfloat16", seq_len: int = 2048,
                  batch_size: int = 4, num_batches: int = 12, repeats: int = 3, writers: int = 2,
                  out_dir: Optional[str] = None, peak_tflops: float = 989.0, json_out: Optional[str] = None,
                  queue: Optional[int] = None) -> None:
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
        queue: samples waiting for the writers at most in (c) (default 2 x batch_size).
    """
    from .bench_extract import bench_extract as run

    res = run(shape, device, dtype, seq_len, batch_size, num_batches, repeats, writers, out_dir, peak_tflops, queue)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f, indent=1)


def bench_train(path: str, target_model: str, max_tokens: int = 16384, max_length: int = 2048, steps: int = 40,
                warmup: int = 5, num_workers: int = 4, draft_vocab_size: int = 32000, device: str = "cuda",
                precision: str = "bf16", json_out: Optional[str] = None) -> None:
    """Drafter step time with the DataModule vs the same batch held on the device; data-wait fraction.

    Args:
        path: dataset directory (shards + manifest + index).
        target_model: target HF folder (embed_tokens / lm_head are read from it).
        max_tokens: token budget per batch.
        max_length: truncate samples to this many tokens.
        steps: timed steps (after warm-up) per loop.
        warmup: untimed steps first.
        num_workers: DataLoader workers.
        draft_vocab_size: N.
        device: "cuda" or "cpu".
        precision: "bf16" (autocast) or "fp32".
        json_out: also write the figures to this JSON file.
    """
    from eagle_train.bench import bench_train as run

    res = run(path, target_model, max_tokens, max_length, steps, warmup, num_workers, draft_vocab_size, device,
              precision)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f, indent=1)


def bench_sglang(model: str = "smollm2", num_prompts: int = 32, prompt_len: int = 512,
                 chunked_prefill_size: int = 256, dtype: str = "float32", device: str = "cpu") -> None:
    """SGLang extraction tokens/s: plain prefill vs capture vs capture + shards vs SGLang's return_hidden_states.

    Args:
        model: "smollm2" (embedded default) or a local HF model folder.
        num_prompts: prompts sent together.
        prompt_len: tokens per prompt.
        chunked_prefill_size: SGLang chunked prefill size.
        dtype: "float32" or "bfloat16".
        device: "cpu" or "cuda".
    """
    from .bench_sglang import bench_sglang as run

    if model == "smollm2":
        from .assets import smollm2_model_dir
        model = str(smollm2_model_dir())
    run(model, num_prompts=num_prompts, prompt_len=prompt_len, chunked_prefill_size=chunked_prefill_size,
        dtype=dtype, device=device)


COMMANDS = {"bench": {"extract": bench_extract, "train": bench_train, "sglang": bench_sglang}}
