"""The ``eagle-data`` command lines the τ benchmark runs (:mod:`benchmarks.tau` runs them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from benchmarks.tau_config import TauConfig


def train_sets(cfg: TauConfig) -> list[str]:
    """The extracted training sets: ``OUT/train``, and with ``mix`` ``OUT/train_regen``."""
    return [f"{cfg.out}/train", *([f"{cfg.out}/train_regen"] if cfg.mix else [])]


def train_command(cfg: TauConfig, run_dir: Path, marks: list[str], lr: Optional[float], zero: bool,
                  extra: list[str]) -> list[str]:
    """One ``eagle-data train`` run with a checkpoint ``RUN_DIR/at_{m}min.ckpt`` per mark, the lr
    cosine over the last; ``extra`` options after ours, and ``lr`` (when given) last, so an explicit
    lr wins over them (e.g. over the tune's choice)."""
    end = marks[-1]
    callback = {"class_path": "eagle_train.callbacks.TimedCheckpoints",
                "init_args": {"minutes": [float(m) for m in marks], "stop_after_last": True}}
    return eagle_data_cmd(
        "train", "--config", cfg.train_config, "--model.dataset_dir", train_sets(cfg)[-1],  # the vocabulary's
        "--model.draft_vocab", str(vocab_path(cfg)), "--model.draft_vocab_size", str(cfg.vocab_size),
        "--model.zero_features", str(zero).lower(), "--model.lr_schedule_minutes", end,
        "--data.train", json.dumps(train_sets(cfg)), "--trainer.accelerator", cfg.accelerator,
        "--trainer.precision", cfg.precision, "--trainer.max_time", json.dumps({"seconds": int(float(end) * 60 + 600)}),
        "--trainer.default_root_dir", str(run_dir), "--trainer.callbacks", json.dumps([callback]),
        *extra, *(["--model.lr", repr(lr)] if lr is not None else []))


def serve_command(cfg: TauConfig) -> list[str]:
    """``eagle-data serve-check`` of ``OUT/drafter`` on the held-out set (bf16 on a GPU, fp32 on CPU)."""
    return eagle_data_cmd("serve-check", f"{cfg.out}/drafter", f"{cfg.out}/heldout", "--heldout_fraction", "1.0",
                          "--prompt_turn", "first", "--ngram", "true", "--num_prompts", str(cfg.serve_prompts),
                          "--max_prompt_tokens", "1024", "--max_new_tokens", str(cfg.serve_new_tokens),
                          "--steps", "7", "--device", "cpu" if cfg.device == "cpu" else "cuda",
                          "--dtype", "float32" if cfg.device == "cpu" else "bfloat16",
                          "--speed_batches", json.dumps(cfg.serve_speed_batches), "--out", f"{cfg.out}/serve",
                          *cfg.serve_args)


def regenerate_command(cfg: TauConfig, data: Path, out: Path, max_new_tokens: int) -> list[str]:
    return eagle_data_cmd("regenerate", "--out", str(out), "--data", str(data),
                          "--device", cfg.device, "--dtype", "bfloat16", "--mode", "all",
                          "--max_new_tokens", str(max_new_tokens), "--max_length", "2048",
                          *(["--batch_size", str(cfg.regen_batch_size)] if cfg.regen_batch_size else []),
                          "--rows_per_part", str(cfg.regen_rows_per_part), "--progress", "false", *cfg.regen_args)


def extract_command(cfg: TauConfig, part: str) -> list[str]:
    """``part``: "train" (from ``OUT/regen`` with ``regenerate`` and no ``mix``), "train_regen" (from
    ``OUT/regen``), both stored as ``storage_dtype``; or "heldout", "heldout_own" (from
    ``OUT/regen_heldout``), as served: bf16."""
    regen = part == "train_regen" or (part == "train" and cfg.regenerate and not cfg.mix)
    src = {"heldout_own": f"{cfg.out}/regen_heldout"}.get(part, f"{cfg.out}/regen" if regen else f"{cfg.out}/{part}.jsonl")
    store = ["--storage_dtype", cfg.storage_dtype, "--final_rows", cfg.final_rows] if part.startswith("train") else []
    if cfg.cuda_graphs:
        store += ["--backend_kwargs", '{"cuda_graphs": true}']
    return eagle_data_cmd("extract", "--out", f"{cfg.out}/{part}", "--data", src, "--dataset_tag", part,
                          "--device", cfg.device, "--dtype", "bfloat16", "--max_length", "2048",
                          "--batch_tokens", "65536", "--progress", "false", *store, *cfg.extract_args)


def eagle_data_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "eagle_data.cli.main", *args]


def vocab_path(cfg: TauConfig) -> Path:
    return Path(cfg.out) / f"draft_vocab_{cfg.vocab_size}.safetensors"
