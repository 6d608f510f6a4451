"""Drafter training throughput with Lightning DDP on N devices, and which samples each rank saw.

    python scripts/ddp_scaling.py DATASET_DIR TARGET_DIR --devices 2 --steps 40 --out result.json

Every rank records the keys of its batches; rank 0 writes the throughput (steady-state
samples/s and tokens/s over all ranks, first ``--warmup`` steps excluded), the per-rank key
counts, whether ranks were disjoint, and whether every rank ran the same number of steps.
"""

import argparse
import json
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from eagle_data import load_index as eagle_index
from eagle_data.stream.datamodule import EagleDataModule
from eagle_train.module import EagleDrafterModule


class Meter(pl.Callback):
    def __init__(self, warmup: int):
        self.warmup, self.keys, self.tokens, self.steps, self.t0 = warmup, [], 0, 0, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.steps == self.warmup:
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.keys += [(trainer.current_epoch, k) for k in batch["keys"]]
        if self.steps >= self.warmup:
            self.tokens += int(batch["attention_mask"].sum())
        self.steps += 1

    def on_train_end(self, trainer, pl_module):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.elapsed = time.perf_counter() - self.t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dataset")
    p.add_argument("target")
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max_tokens", type=int, default=16384)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--out", default="ddp_scaling.json")
    a = p.parse_args()
    gpu = torch.cuda.is_available()
    model = EagleDrafterModule(a.target, dataset_dir=a.dataset, draft_vocab_size=a.vocab,
                               draft_vocab=str(Path(a.dataset) / f"draft_vocab_{a.vocab}.safetensors"))
    dm = EagleDataModule(train=a.dataset, max_tokens=a.max_tokens, num_workers=a.workers, pin_memory=gpu)
    meter = Meter(a.warmup)
    trainer = pl.Trainer(accelerator="gpu" if gpu else "cpu", devices=a.devices,
                         strategy="ddp" if a.devices > 1 else "auto", precision="bf16-mixed" if gpu else "32-true",
                         max_steps=a.steps + a.warmup, max_epochs=1000, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[meter], use_distributed_sampler=False)
    trainer.fit(model, datamodule=dm)
    rank, world = trainer.global_rank, trainer.world_size
    mine = {"keys": meter.keys, "tokens": meter.tokens, "steps": meter.steps, "elapsed": meter.elapsed}
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if rank == 0:
        n_epoch = len(dm.train_dataloader())
        epoch0 = [{k for e, k in g["keys"] if e == 0} for g in gathered]
        n_all = len(eagle_index(a.dataset))
        res = {
            "devices": world, "steps_per_rank": [g["steps"] for g in gathered],
            "tokens_per_s": round(sum(g["tokens"] for g in gathered) / max(g["elapsed"] for g in gathered), 1),
            "step_s": round(max(g["elapsed"] for g in gathered) / a.steps, 4),
            "batches_per_epoch_per_rank": n_epoch,
            "keys_per_rank": [len(g["keys"]) for g in gathered],
            "gpu": torch.cuda.get_device_name() if gpu else "cpu",
        }
        res["epoch0_keys_per_rank"] = [len(x) for x in epoch0]
        res["epoch0_ranks_disjoint"] = sum(len(x) for x in epoch0) == len(set().union(*epoch0))
        res["epoch0_union_is_dataset"] = len(set().union(*epoch0)) == n_all
        print(json.dumps(res))
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
