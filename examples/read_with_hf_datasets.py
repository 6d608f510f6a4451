"""Read an eagle-data output with HF `datasets` only: the index, then the shard samples.

    python examples/read_with_hf_datasets.py out/smollm2-sharegpt
"""

import sys
from pathlib import Path

import datasets

import eagle_data
from eagle_data.stream.dataset import decode_hf_example

root = Path(sys.argv[1] if len(sys.argv) > 1 else "out/smollm2-sharegpt")
idx = eagle_data.load_index(root)  # datasets.Dataset, one row per sample
print(idx)
print("supervised tokens:", sum(idx["num_loss_tokens"]), "of", sum(idx["num_tokens"]))

shards = sorted(str(p) for p in root.glob("*.tar"))
ds = datasets.load_dataset("webdataset", data_files=shards, split="train")
ex = decode_hf_example(ds[0])  # tensors decoded from safetensors bytes (no pickle)
print(ex["key"], {k: (tuple(v.shape), v.dtype) for k, v in ex.items() if hasattr(v, "shape")})
