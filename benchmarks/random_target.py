"""``python -m benchmarks random_target``: a stand-in target for GPU benchmarks on machines that
cannot download real weights: a random-weight Llama of a named shape, saved with a given
tokenizer (e.g. the embedded SmolLM2's; its weights, config and other files are not copied)::

    python -m benchmarks random_target OUT_DIR TOK_DIR [--shape llama3.1-8b] [--weights false]

``--weights false`` writes the config and tokenizer only (no 16 GB of random weights), for an
engine that draws its own: SGLang's ``load_format="dummy"`` (``python -m benchmarks sglang
--load_format dummy``), which needs the config's ``architectures``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from benchmarks.extract import SHAPES, build_model


def make_random_target(out: str, tokenizer: str, shape: Literal["llama3.1-8b", "tiny"] = "llama3.1-8b",
                       device: str = "cuda", weights: bool = True) -> str:
    """Save a random-weight Llama of ``shape`` with the vocabulary and files of ``tokenizer`` to ``out``.

    Args:
        out: the model folder to write.
        tokenizer: a folder with a tokenizer (saved beside the weights by transformers: the
            tokenizer's own files, nothing else of that folder).
        shape: the target shape.
        device: where the weights are drawn (bf16).
        weights: False: the config (bf16, ``architectures`` named) and tokenizer files alone.

    Returns:
        ``out``; its parameter count is printed (with weights).

    Raises:
        ValueError: ``out`` exists and is not empty (old weights would stay beside the new
            config), or ``tokenizer`` is not a folder with a tokenizer.
    """
    from transformers import AutoTokenizer, LlamaConfig

    if Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
        raise ValueError(f"out: {out} exists and is not an empty folder; give a new one")
    if not any((Path(tokenizer) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"tokenizer: {tokenizer} is not a folder with a tokenizer (tokenizer.json or "
                         "tokenizer_config.json)")
    tok = AutoTokenizer.from_pretrained(tokenizer)
    if not weights:
        LlamaConfig(**{**SHAPES[shape], "vocab_size": len(tok)}, architectures=["LlamaForCausalLM"],
                    torch_dtype="bfloat16").save_pretrained(out)
    else:
        model = build_model(shape, torch.bfloat16, device, vocab_size=len(tok))
        model.save_pretrained(out)
    tok.save_pretrained(out)  # the tokenizer's own files, nothing else of its folder
    print(out, f"{sum(p.numel() for p in model.parameters()) / 1e9} B params" if weights
          else "config only (load_format dummy)")
    return out
