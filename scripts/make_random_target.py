"""Save a random-weight Llama of a named shape with a given tokenizer folder: a stand-in target
for GPU benchmarks on machines that cannot download real weights.

    python scripts/make_random_target.py OUT_DIR --tokenizer TOK_DIR [--shape llama3.1-8b]
"""

import argparse
import shutil
from pathlib import Path

import torch

from benchmarks.extract import build_model

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--tokenizer", required=True)
p.add_argument("--shape", default="llama3.1-8b")
p.add_argument("--device", default="cuda")
a = p.parse_args()
from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained(a.tokenizer)
model = build_model(a.shape, torch.bfloat16, a.device, vocab_size=len(tok))
model.save_pretrained(a.out)
for f in Path(a.tokenizer).iterdir():
    shutil.copy(f, Path(a.out) / f.name)
print(a.out, sum(p.numel() for p in model.parameters()) / 1e9, "B params")
