"""``eagle-data bench train``: does drafter training wait on data?

Two loops over the same drafter, optimizer and batch shapes, measured in one run:

(1) batches streamed by :class:`eagle_data.stream.datamodule.EagleDataModule` (``num_workers``
    workers, pinned memory, non-blocking host-to-device copy);
(2) the very same batches, kept in device memory during (1), replayed (no data path at all).

Reported: median step time of each, their ratio, and the data-wait fraction of (1) =
time blocked in ``next(loader)`` / total wall time. Steps are synchronised at the end of
each step so step times are exact (this removes only the overlap of step i's tail with
batch i+1's copy, which (1) and (2) lose alike).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def bench_train(dataset_dir: str, target_model_path: str, max_tokens: int = 16384, max_length: int = 2048,
                steps: int = 40, warmup: int = 5, num_workers: int = 4, draft_vocab_size: int = 32000,
                device: str = "cuda", precision: str = "bf16", ttt_steps: int = 7,
                json_out: str | None = None) -> dict[str, Any]:
    """Drafter step time with the DataModule vs the same batch held on the device; data-wait fraction.

    Runs both loops and prints the figures (see module docstring).

    Args:
        dataset_dir: dataset directory (shards + manifest + index).
        target_model_path: target HF folder (embed_tokens / lm_head are read from it).
        max_tokens: token budget per batch.
        max_length: truncate samples to this many tokens.
        steps: timed steps (after warm-up) per loop.
        warmup: untimed steps first.
        num_workers: DataLoader workers.
        draft_vocab_size: N.
        device: "cuda" or "cpu".
        precision: "bf16" (autocast) or "fp32".
        ttt_steps: test-time-training steps of the loss.
        json_out: also write the figures to this JSON file.
    """
    from eagle_data.stream.datamodule import EagleDataModule

    from eagle_train.module import EagleDrafterModule
    from eagle_train.options import LossOptions

    dev = torch.device(device)
    mod = EagleDrafterModule(target_model_path, dataset_dir=dataset_dir, draft_vocab_size=draft_vocab_size,
                             loss=LossOptions(ttt_steps=ttt_steps)).to(dev)
    step = _step_fn(mod, dev, precision, ttt_steps)
    dm = EagleDataModule(train=dataset_dir, max_tokens=max_tokens, max_length=max_length, num_workers=num_workers,
                         pin_memory=dev.type == "cuda")
    loop = _loader_loop(dm.train_dataloader(), step, dev, warmup, steps)
    held = _held_times(step, loop.pop("kept"))
    res = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "num_workers": num_workers, "max_tokens": max_tokens, "steps": steps,
        **_figures(loop["times"], held, loop["waits"], loop["tokens"], loop["wall"]),
    }
    for k, v in res.items():
        print(f"{k:>24}: {v}")
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1, default=str))
    return res


def _step_fn(mod, dev: torch.device, precision: str, ttt_steps: int) -> Callable[[dict[str, Any]], int]:
    """One synchronised optimizer step (TTT loss, backward, AdamW) of ``mod``'s drafter on a batch;
    returns the batch's tokens."""
    from eagle_train.loss import ttt_loss

    opt = torch.optim.AdamW([p for p in mod.drafter.parameters() if p.requires_grad], lr=1e-4)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step(batch):
        with amp:
            out = ttt_loss(mod.drafter, mod.target_lm_head, batch, ttt_steps)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        opt.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return int(batch["attention_mask"].sum())

    return step


def _loader_loop(loader, step, dev: torch.device, warmup: int, steps: int) -> dict[str, Any]:
    """(1): ``warmup`` + ``steps`` steps on batches from ``loader`` (cycled); of the timed steps: step
    times, waits in ``next(loader)``, tokens, wall time, and the batches (on the device) as ``kept``."""
    def batches():
        while True:
            yield from loader

    it = batches()
    kept = []
    times, waits, toks = [], [], 0
    t_start = None
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        b = next(it)
        t1 = time.perf_counter()
        b = _to(b, dev)
        n = step(b)
        t2 = time.perf_counter()
        if i == warmup:
            t_start = t0
        if i >= warmup:
            waits.append(t1 - t0)
            times.append(t2 - t0)
            toks += n
            kept.append(b)
    wall = time.perf_counter() - t_start
    return {"times": times, "waits": waits, "tokens": toks, "wall": wall, "kept": kept}


def _held_times(step, kept: list[dict[str, Any]]) -> list[float]:
    """(2): the step time of each batch of ``kept``, replayed from device memory."""
    held = []
    for b in kept:
        t0 = time.perf_counter()
        step(b)
        held.append(time.perf_counter() - t0)
    return held


def _figures(times: list[float], held: list[float], waits: list[float], toks: int, wall: float) -> dict[str, Any]:
    """Medians, totals and ratios of (1)'s and (2)'s step times, and (1)'s waits for data."""
    return {
        "step_s_loader_median": round(statistics.median(times), 4),
        "step_s_held_median": round(statistics.median(held), 4),
        "ratio_loader_over_held": round(statistics.median(times) / statistics.median(held), 4),
        "data_wait_fraction": round(sum(waits) / wall, 4),
        "data_wait_s_median": round(statistics.median(waits), 5),
        "data_wait_s_max": round(max(waits), 4),
        "step_s_loader_total": round(sum(times), 3), "step_s_held_total": round(sum(held), 3),
        "ratio_total_loader_over_held": round(sum(times) / sum(held), 4),
        "tokens_per_s_loader": round(toks / wall, 1),
    }
