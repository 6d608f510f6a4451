"""Stream EAGLE-3 batches into a plain PyTorch loop (one import), DDP-correct when launched with torchrun.

    python examples/stream_batches.py out/smollm2-sharegpt

The default directory is what the README's main job writes (``SKIP_TRAIN=1 bash scripts/main.sh``);
any eagle-data dataset works, e.g. a synthetic one:
``python -c "from eagle_data.tools.synthetic import write_synthetic; write_synthetic('/tmp/syn', [20, 20])"``.
"""

import sys

from eagle_data.stream.datamodule import EagleDataModule

dm = EagleDataModule(train=sys.argv[1] if len(sys.argv) > 1 else "out/smollm2-sharegpt",
                     max_tokens=8192, num_workers=2, dtype="bfloat16", pin_memory=False)
loader = dm.train_dataloader()
for epoch in range(2):
    n_tok, n_batches = 0, 0
    for batch in loader:  # each iteration over the loader is the next epoch (new shard order)
        # input_ids [B, T] int64, attention_mask [B, T] bool, loss_mask [B, T] bool,
        # aux_hidden_states [B, T, 3H] bf16, hidden_states [B, T, H] bf16
        n_tok += int(batch["attention_mask"].sum())
        n_batches += 1
    print(f"epoch {epoch}: {n_batches} batches, {n_tok} tokens")
