"""``python -m benchmarks random_target``: a stand-in target for GPU benchmarks on machines that
cannot download real weights: a random-weight Llama of a named shape, saved with a given
tokenizer folder's files (e.g. the embedded SmolLM2's; its weights and config are not copied)::

    python -m benchmarks random_target OUT_DIR TOK_DIR [--shape llama3.1-8b] [--weights false]

``--weights false`` writes the config and tokenizer only (no 16 GB of random weights), for an
engine that draws its own: SGLang's ``load_format="dummy"`` (``python -m benchmarks sglang
--load_format dummy``), which needs the config's ``architectures``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

import torch

from benchmarks.extract import SHAPES, build_model


def make_random_target(out: str, tokenizer: str, shape: Literal["llama3.1-8b", "tiny"] = "llama3.1-8b",
                       device: str = "cuda", weights: bool = True) -> str:
    """Save a random-weight Llama of ``shape`` with the vocabulary and files of ``tokenizer`` to ``out``.

    Args:
        out: the model folder to write.
        tokenizer: a folder with a tokenizer (its files are copied beside the weights, but for
            those the model wrote: ``config.json``, the weights).
        shape: the target shape.
        device: where the weights are drawn (bf16).
        weights: False: the config (bf16, ``architectures`` named) and tokenizer files alone.

    Returns:
        ``out``; its parameter count is printed (with weights).
    """
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer)
    if not weights:
        cfg = LlamaConfig(**{**SHAPES[shape], "vocab_size": len(tok)}, architectures=["LlamaForCausalLM"],
                          torch_dtype="bfloat16")
        cfg.save_pretrained(out)
        _copy_tokenizer(tokenizer, out)
        print(out, "config only (load_format dummy)")
        return out
    model = build_model(shape, torch.bfloat16, device, vocab_size=len(tok))
    model.save_pretrained(out)
    _copy_tokenizer(tokenizer, out)
    print(out, sum(p.numel() for p in model.parameters()) / 1e9, "B params")
    return out


def _copy_tokenizer(tokenizer: str, out: str) -> None:
    """The tokenizer folder's files beside the model's (not its weights; nothing the model wrote)."""
    for f in Path(tokenizer).iterdir():
        if not (Path(out) / f.name).exists() and f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, Path(out) / f.name)
