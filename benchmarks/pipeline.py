"""``python -m benchmarks pipeline``: ``run_extract`` end to end, tokens/s of the whole pipeline.

With a small target (default: a random-weight model of SmolLM2's shape built on the fly around a
given tokenizer folder) the work around the forward pass dominates: records, conversations,
masks, batching, capture, shard writing, progress. Used to compare code versions (BENCHMARKS.md).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


def random_target(tokenizer_dir: str, out_dir: str, seed: int = 0) -> str:
    """A random-weight Llama of SmolLM2-135M's shape with the tokenizer files of ``tokenizer_dir``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    if not (out / "config.json").exists():
        torch.manual_seed(seed)
        cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192)
        LlamaForCausalLM(cfg).save_pretrained(out)
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
                shutil.copy(f, out / f.name)
    return str(out)


def bench_pipeline(data: str = "sharegpt", tokenizer_dir: str | None = None, num_samples: int | None = 300,
                   device: str = "cuda", dtype: str = "bfloat16", max_length: int = 2048, repeats: int = 2,
                   json_out: str | None = None) -> dict[str, Any]:
    """tokens/s of ``run_extract`` on a random SmolLM2-shaped target, ``repeats`` runs into fresh directories.

    Args:
        data: as ``eagle-data extract --data``.
        tokenizer_dir: folder with tokenizer.json + chat template (default: the embedded SmolLM2's).
        num_samples: source rows.
        device: "cuda" or "cpu".
        dtype: compute and storage dtype.
        max_length: tokens per sample at most.
        repeats: runs (each prints its figures).
        json_out: also write the figures to this JSON file.
    """
    from eagle_data.extract.config import ExtractConfig
    from eagle_data.extract.run import run_extract

    if tokenizer_dir is None:
        from eagle_data.assets import smollm2_model_dir
        tokenizer_dir = str(smollm2_model_dir())
    work = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    try:
        model = random_target(tokenizer_dir, str(work / "model"))
        runs = []
        for i in range(repeats):
            t0 = time.perf_counter()
            m = run_extract(ExtractConfig(out=str(work / f"out{i}"), model=model, data=data, num_samples=num_samples,
                                          device=device, dtype=dtype, max_length=max_length, progress=False))
            dt = time.perf_counter() - t0
            runs.append({"seconds": round(dt, 2), "samples": m["num_samples"], "tokens": m["num_tokens"],
                         "tok_s": round(m["num_tokens"] / dt)})
            print(json.dumps(runs[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = {"data": data, "device": device, "dtype": dtype, "runs": runs}
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))
    return res
