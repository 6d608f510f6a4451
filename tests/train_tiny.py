"""Tiny fixtures for the eagle_train tests: a random Llama target saved to disk + its drafter."""

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

TINY_AUX = [1, 3, 5]


def tiny_target(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def tiny_target_dir(tmp_path: Path, seed: int = 0) -> Path:
    d = Path(tmp_path) / "tiny_target"
    if not (d / "config.json").exists():
        tiny_target(seed).save_pretrained(d, safe_serialization=True)
    return d


def tiny_module(tmp_path: Path, draft_vocab_size: int = 48, seed: int = 0, **kw):
    """EagleDrafterModule over the tiny target; draft vocab from a fixed synthetic histogram.
    ``kw``: module options, grouped ones by their field name (``ttt_steps=2``: ``loss.ttt_steps``)."""
    from eagle_train.module import EagleDrafterModule
    from eagle_train.options import nest_groups
    from eagle_train.vocab import save_vocab, select_vocab

    g = torch.Generator().manual_seed(123)
    counts = torch.randint(0, 50, (256,), generator=g)
    d2t, t2d = select_vocab(counts, 256, draft_vocab_size)
    vf = save_vocab(Path(tmp_path) / f"vocab_{draft_vocab_size}.safetensors", d2t, t2d)
    return EagleDrafterModule(**nest_groups(dict(target_model_path=str(tiny_target_dir(tmp_path)), draft_vocab=str(vf),
                                                 draft_vocab_size=draft_vocab_size, aux_layer_ids=TINY_AUX, seed=seed,
                                                 **kw)))


def tiny_batch(target, n: int = 2, t: int = 24, seed: int = 0):
    """A right-padded batch in the EagleDataModule layout from the tiny target's real states."""
    from eagle_data.engines.hf import HFBackend

    g = torch.Generator().manual_seed(seed)
    be = HFBackend(model=target, model_path="tiny", dtype="float32", aux_layer_ids=TINY_AUX)
    lens = [t - 3 * i for i in range(n)]
    seqs = [torch.randint(0, 256, (L,), generator=g) for L in lens]
    caps = be.capture([(f"k{i}", s) for i, s in enumerate(seqs)])
    B, T = n, max(lens)
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.long), "attention_mask": torch.zeros(B, T, dtype=torch.bool),
             "loss_mask": torch.zeros(B, T, dtype=torch.bool),
             "aux_hidden_states": torch.zeros(B, T, 3 * 64, dtype=torch.bfloat16),
             "hidden_states": torch.zeros(B, T, 64, dtype=torch.bfloat16), "keys": [f"k{i}" for i in range(n)]}
    for i, (s, c) in enumerate(zip(seqs, caps)):
        L = len(s)
        batch["input_ids"][i, :L] = s
        batch["attention_mask"][i, :L] = True
        batch["loss_mask"][i, L // 3: L] = True
        batch["aux_hidden_states"][i, :L] = c.aux_hidden_states.bfloat16()
        batch["hidden_states"][i, :L] = c.hidden_states.bfloat16()
    return batch


class ListLoader:
    """Batches given as a list, as Lightning's ``train_dataloaders`` (a plain list of dicts would
    be taken for several loaders)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)
