"""``python -m benchmarks random_target``: a stand-in target for GPU benchmarks on machines that
cannot download real weights: a random-weight Llama of a named shape, saved with a given
tokenizer folder's files (e.g. the embedded SmolLM2's; its weights and config are not copied)::

    python -m benchmarks random_target OUT_DIR TOK_DIR [--shape llama3.1-8b]
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

import torch

from benchmarks.extract import build_model


def make_random_target(out: str, tokenizer: str, shape: Literal["llama3.1-8b", "tiny"] = "llama3.1-8b",
                       device: str = "cuda") -> str:
    """Save a random-weight Llama of ``shape`` with the vocabulary and files of ``tokenizer`` to ``out``.

    Args:
        out: the model folder to write.
        tokenizer: a folder with a tokenizer (its files are copied beside the weights, but for
            those the model wrote: ``config.json``, the weights).
        shape: the target shape.
        device: where the weights are drawn (bf16).

    Returns:
        ``out``; its parameter count is printed.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    model = build_model(shape, torch.bfloat16, device, vocab_size=len(tok))
    model.save_pretrained(out)
    for f in Path(tokenizer).iterdir():
        if not (Path(out) / f.name).exists() and f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, Path(out) / f.name)
    print(out, sum(p.numel() for p in model.parameters()) / 1e9, "B params")
    return out
