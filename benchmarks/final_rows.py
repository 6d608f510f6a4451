"""``python -m benchmarks final_rows``: bytes per token of each final-state layout on real chats
(against "raw bf16" = the four states in bf16, 4·H·2 bytes).

The front of ``eagle-data extract`` (chat template, tokens, loss mask) runs on the rows; no
model forward is needed: the stored bytes follow from the schema (:mod:`eagle_data.format.schema`)
given each sample's token count and taught rows (:mod:`eagle_data.format.final_rows`):

    per token: input_ids 8 + loss_mask 1 + aux 3·H·s (+ 3·4 fp8 scales)
               + final H·s (+ 4) on every row ("all") or on the taught rows only ("taught"),

``s`` the storage dtype's bytes. Tar and safetensors headers (~0.3 %) are left out; the
extraction's own ``total_bytes`` includes them (BENCHMARKS.md gives both).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def bench_final_rows(model: str = "smollm2", data: str = "sharegpt", num_samples: int | None = 2000,
                     max_length: int = 2048, json_out: str | None = None) -> dict[str, Any]:
    """Share of taught rows and bytes/token of bf16/fp8 storage with ``final_rows`` all vs taught.

    Args:
        model: "smollm2" (embedded default) or a local HF model folder (its tokenizer, template, config).
        data: as ``eagle-data extract --data``.
        num_samples: source rows (None: all).
        max_length: tokens per sample at most.
        json_out: also write the figures to this JSON file.
    """
    import tempfile

    from eagle_data.extract.chat import ChatRenderer
    from eagle_data.extract.config import ExtractConfig, check_paths, model_dir
    from eagle_data.extract.fault import ErrorPolicy
    from eagle_data.extract.run import load_tokenizer
    from eagle_data.extract.sources import iter_records
    from eagle_data.extract.stages import Batching, front
    from eagle_data.format.final_rows import taught

    from benchmarks.scratch import check_outputs

    check_outputs(None, json_out)
    # the settings and paths as extract checks them (a clear error naming the option, exit 2)
    check_paths(ExtractConfig(out=tempfile.gettempdir(), model=model, data=data, num_samples=num_samples,
                              max_length=max_length, progress=False))
    path = model_dir(model)
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"model {model!r} is not a model folder (a local HF folder with config.json)")
    cfg = json.loads((Path(path) / "config.json").read_text())
    h, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    renderer = ChatRenderer.from_path(load_tokenizer(path, False), None)
    samples = tokens = rows = supervised = 0
    for batch in front(iter_records(data, num_samples=num_samples), renderer, "x", vocab,
                       Batching(max_length, 1 << 20, 1 << 20, 256), ErrorPolicy("skip")):
        for s in batch:
            samples += 1
            tokens += s.num_tokens
            supervised += int(s.loss_mask.sum())
            rows += int(taught(s.loss_mask).sum())
    if not tokens:
        raise ValueError(f"no sample of {data!r} (first {num_samples} rows) has a supervised token: nothing to measure")
    share = rows / tokens
    res: dict[str, Any] = {"model": model, "data": data, "hidden_size": h, "samples": samples, "tokens": tokens,
                           "supervised_share": round(supervised / tokens, 4), "taught_share": round(share, 4)}
    for name, item, scale in (("bf16", 2, 0), ("fp8", 1, 4)):
        aux = 3 * (h * item + scale)
        for layout, fin_rows in (("all", 1.0), ("taught", share)):
            res[f"{name}_{layout}_bytes_per_token"] = round(9 + aux + fin_rows * (h * item + scale), 1)
    raw = 4 * h * 2  # the states alone in bf16, as BENCHMARKS.md states "raw bf16"
    for k in [k for k in res if k.endswith("_bytes_per_token")]:
        res[k.replace("_bytes_per_token", "_vs_raw_bf16")] = round(res[k] / raw, 4)
    for k, v in res.items():
        print(f"{k:>26}: {v}")
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))
    return res
