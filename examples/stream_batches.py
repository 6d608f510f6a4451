"""Stream EAGLE-3 batches into a plain PyTorch loop (one import); DDP-correct under torchrun.

    python examples/stream_batches.py out/smollm2-sharegpt
    torchrun --nproc_per_node 2 examples/stream_batches.py out/smollm2-sharegpt

The default directory is what the README's main job writes (``SKIP_TRAIN=1 bash scripts/main.sh``);
any eagle-data dataset works, e.g. a synthetic one:
``python -c "from eagle_data.tools.synthetic import write_synthetic; write_synthetic('/tmp/syn', [20, 20])"``.

The reader takes its rank and world size from ``torch.distributed`` once a process group is
initialised (Lightning does it; here the script does, when torchrun started it: ``WORLD_SIZE`` is
set). Then each rank reads its own disjoint part, every sample exactly once per epoch across the
ranks, and every rank gets as many batches. Without a process group every process reads it all.
"""

import os
import sys

import torch.distributed as dist

from eagle_data.stream.datamodule import EagleDataModule

if "WORLD_SIZE" in os.environ and not dist.is_initialized():  # torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT
    dist.init_process_group("gloo")  # the batches stay on the CPU here; a GPU loop would use "nccl"
rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

dm = EagleDataModule(train=sys.argv[1] if len(sys.argv) > 1 else "out/smollm2-sharegpt",
                     max_tokens=8192, num_workers=2, dtype="bfloat16", pin_memory=False)
loader = dm.train_dataloader()  # each epoch starts by reading rank and world size from torch.distributed
for epoch in range(2):
    n_tok, n_samples, n_batches = 0, 0, 0
    for batch in loader:  # each iteration over the loader is the next epoch (new shard order)
        # input_ids [B, T] int64, attention_mask [B, T] bool, loss_mask [B, T] bool,
        # aux_hidden_states [B, T, 3H] bf16, hidden_states [B, T, H] bf16, keys list[str]
        n_tok += int(batch["attention_mask"].sum())
        n_samples += len(batch["keys"])
        n_batches += 1
    print(f"rank {rank}/{world} epoch {epoch}: {n_batches} batches, {n_samples} samples, {n_tok} tokens", flush=True)
if dist.is_initialized():
    dist.destroy_process_group()
