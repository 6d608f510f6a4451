"""``python -m benchmarks ddp``: drafter training throughput with Lightning DDP on N devices, and
which samples each rank saw.

Every rank records the keys of its batches; rank 0 prints and writes the throughput (steady-state
tokens/s over all ranks, the first ``warmup`` steps excluded), the per-rank key counts, whether the
ranks' first epochs were disjoint and together the dataset, and whether every rank ran the same
number of steps. With ``devices`` > 1 Lightning starts the other ranks by running this same
command again (``python -m benchmarks ddp ...``)::

    python -m benchmarks ddp DATASET_DIR TARGET_DIR --devices 2 --steps 40 --out ddp_2.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch


def _meter(warmup: int):
    """A Lightning callback recording the keys of each batch, and the tokens and time after ``warmup`` steps."""
    import lightning.pytorch as pl

    class Meter(pl.Callback):
        def __init__(self):
            self.keys, self.tokens, self.steps, self.t0, self.elapsed = [], 0, 0, None, 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.steps == warmup:
                _sync()
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.keys += [(trainer.current_epoch, k) for k in batch["keys"]]
            if self.steps >= warmup:
                self.tokens += int(batch["attention_mask"].sum())
            self.steps += 1

        def on_train_end(self, trainer, pl_module):
            _sync()
            self.elapsed = time.perf_counter() - self.t0

    return Meter()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench_ddp(dataset_dir: str, target_model_path: str, devices: int = 1, steps: int = 40, warmup: int = 5,
              max_tokens: int = 16384, num_workers: int = 4, draft_vocab_size: int = 32000,
              out: str = "ddp_scaling.json") -> dict[str, Any] | None:
    """Drafter training tokens/s on ``devices`` GPUs (CPU processes without a GPU) and the keys each rank saw.

    Args:
        dataset_dir: dataset directory; its draft vocabulary ``draft_vocab_{draft_vocab_size}.safetensors``
            inside it (``eagle-data vocab DIR --out DIR/draft_vocab_N.safetensors``).
        target_model_path: the target HF folder (embed_tokens / lm_head are read from it).
        devices: Lightning devices (DDP when > 1).
        steps: timed steps per rank (after ``warmup``).
        warmup: untimed steps first.
        max_tokens: token budget per batch.
        num_workers: DataLoader workers per rank.
        draft_vocab_size: N.
        out: the figures as JSON (written by rank 0).

    Returns:
        The figures on rank 0, ``None`` on the others.
    """
    import lightning.pytorch as pl
    import torch.distributed as dist

    from eagle_data.stream.datamodule import EagleDataModule
    from eagle_train.module import EagleDrafterModule

    gpu = torch.cuda.is_available()
    model = EagleDrafterModule(target_model_path, dataset_dir=dataset_dir, draft_vocab_size=draft_vocab_size,
                               draft_vocab=str(Path(dataset_dir) / f"draft_vocab_{draft_vocab_size}.safetensors"))
    dm = EagleDataModule(train=dataset_dir, max_tokens=max_tokens, num_workers=num_workers, pin_memory=gpu)
    meter = _meter(warmup)
    trainer = pl.Trainer(accelerator="gpu" if gpu else "cpu", devices=devices,
                         strategy="ddp" if devices > 1 else "auto", precision="bf16-mixed" if gpu else "32-true",
                         max_steps=steps + warmup, max_epochs=1000, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[meter], use_distributed_sampler=False)
    trainer.fit(model, datamodule=dm)
    mine = {"keys": meter.keys, "tokens": meter.tokens, "steps": meter.steps, "elapsed": meter.elapsed}
    gathered = [None] * trainer.world_size
    if trainer.world_size > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if trainer.global_rank != 0:
        return None
    res = _figures(gathered, steps, len(dm.train_dataloader()), dataset_dir)
    print(json.dumps(res))
    Path(out).write_text(json.dumps(res, indent=1))
    return res


def _figures(gathered: list[dict[str, Any]], steps: int, batches_per_epoch: int, dataset_dir: str) -> dict[str, Any]:
    """The figures from every rank's record (``keys`` as (epoch, key), ``tokens``, ``steps``, ``elapsed``)."""
    from eagle_data import load_index

    epoch0 = [{k for e, k in g["keys"] if e == 0} for g in gathered]
    elapsed = max(g["elapsed"] for g in gathered)
    return {"devices": len(gathered), "steps_per_rank": [g["steps"] for g in gathered],
            "tokens_per_s": round(sum(g["tokens"] for g in gathered) / elapsed, 1),
            "step_s": round(elapsed / steps, 4), "batches_per_epoch_per_rank": batches_per_epoch,
            "keys_per_rank": [len(g["keys"]) for g in gathered],
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "epoch0_keys_per_rank": [len(x) for x in epoch0],
            "epoch0_ranks_disjoint": sum(len(x) for x in epoch0) == len(set().union(*epoch0)),
            "epoch0_union_is_dataset": len(set().union(*epoch0)) == len(load_index(dataset_dir))}
