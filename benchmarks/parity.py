"""Parity of captured states between backends, beside the noise floor.

``python -m benchmarks parity A B [--noise C]``: two extracted datasets of the same rows (e.g.
``--backend sglang`` and ``--backend hf``): token ids and loss masks must be identical; the states
are compared row by row (relative error ``|x - y| / |y|`` and cosine per token, aux and final
separately), beside ``C`` vs ``B`` when given (``C``: the same backend as ``B`` with another batch
composition, e.g. another ``--batch_tokens``: the noise floor of that dtype).

``python -m benchmarks sglang_parity``: tiny random targets (Llama, DeepSeek-V3, Qwen3-MoE) through
SGLang and HF on one device, per dtype, against HF fp32 and HF of the same dtype.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch


def _row_stats(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    x, y = x.float(), y.float()
    rel = (x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-30)
    cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
    return {"rel": rel, "cos": cos}


def _summary(rows: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    rel, cos = torch.cat(rows["rel"]), torch.cat(rows["cos"])
    return {"rel_median": rel.median().item(), "rel_p99": rel.quantile(0.99).item() if rel.numel() < 2**24 else
            rel.max().item(), "rel_max": rel.max().item(), "cos_min": cos.min().item(),
            "cos_median": cos.median().item(), "rows": rel.numel()}


def compare_datasets(a: str, b: str) -> dict[str, Any]:
    """Every sample of ``b`` looked up in ``a`` by key: ids/masks equal, state statistics."""
    import pyarrow.parquet as pq

    from eagle_data.format.layout import INDEX_NAME
    from eagle_data.tools.read_samples import read_samples

    keys = sorted(pq.read_table(Path(b) / INDEX_NAME, columns=["key"]).column("key").to_pylist())
    ka = set(pq.read_table(Path(a) / INDEX_NAME, columns=["key"]).column("key").to_pylist())
    common = [k for k in keys if k in ka]
    acc = {f: {"rel": [], "cos": []} for f in ("aux_hidden_states", "hidden_states")}
    same_ids = same_mask = 0
    for i in range(0, len(common), 64):
        chunk = common[i:i + 64]
        sa, sb = read_samples(a, chunk), read_samples(b, chunk)
        for k in chunk:
            same_ids += torch.equal(sa[k]["input_ids"], sb[k]["input_ids"])
            same_mask += torch.equal(sa[k]["loss_mask"], sb[k]["loss_mask"])
            for f, st in acc.items():
                for name, v in _row_stats(sa[k][f], sb[k][f]).items():
                    st[name].append(v)
    return {"samples": len(common), "only_in_b": len(keys) - len(common), "only_in_a": len(ka) - len(common),
            "ids_identical": same_ids, "masks_identical": same_mask,
            **{f: _summary(st) for f, st in acc.items() if st["rel"]}}


def bench_parity(a: str, b: str, noise: str | None = None, json_out: str | None = None) -> dict[str, Any]:
    """Dataset ``a`` vs dataset ``b`` (the reference), and ``noise`` vs ``b`` when given.

    Args:
        a: dataset directory (e.g. ``--backend sglang``).
        b: the reference dataset of the same rows (e.g. ``--backend hf``).
        noise: the reference's backend again with another batch composition (the noise floor).
        json_out: also write the figures to this JSON file.
    """
    out = {"a_vs_b": compare_datasets(a, b)}
    if noise:
        out["noise_vs_b"] = compare_datasets(noise, b)
    for name, r in out.items():
        print(f"{name}: {r['samples']} samples, ids identical {r['ids_identical']}, masks identical "
              f"{r['masks_identical']}")
        for f in ("aux_hidden_states", "hidden_states"):
            if f in r:
                s = r[f]
                print(f"  {f:18s} rel median {s['rel_median']:.2e} p99 {s['rel_p99']:.2e} max {s['rel_max']:.2e}"
                      f"  cos min {s['cos_min']:.6f}  ({s['rows']} rows)")
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=1))
    return out


def bench_sglang_parity(kinds: Sequence[str] = ("llama", "deepseek_v3", "qwen3_moe"),
                        dtypes: Sequence[str] = ("float32", "bfloat16"), device: str = "cuda",
                        attention_backend: str | None = "triton", lengths: Sequence[int] = (5, 300, 17, 1000),
                        chunked_prefill_size: int = 256, max_total_tokens: int | None = None,
                        mem_fraction_static: float | None = None, json_out: str | None = None) -> dict[str, Any]:
    """Tiny random targets through SGLang vs HF: relative error of each dtype's SGLang capture vs HF
    fp32 beside HF of that dtype vs HF fp32 (the noise floor), per target and field.

    Args:
        kinds: tiny targets (:func:`benchmarks.tiny_targets.save_tiny_target`).
        dtypes: engine dtypes.
        device: "cuda" or "cpu" (on CPU MLA needs ``attention_backend="intel_amx"``).
        attention_backend: SGLang attention backend (None: SGLang's choice).
        lengths: prompt lengths, one batch (longer than ``chunked_prefill_size``: several chunks).
        chunked_prefill_size: SGLang chunked prefill size.
        max_total_tokens: the engines' KV pool in tokens (None: SGLang's own; on a GPU other
            processes share, e.g. ``8192``).
        mem_fraction_static: the engines' memory fraction (None: SGLang's own; shared GPU: e.g. ``0.95``).
        json_out: also write the figures to this JSON file.
    """
    from benchmarks.tiny_targets import save_tiny_target
    from eagle_data.engines import make_backend
    from eagle_data.engines.hf import HFBackend

    aux, res = [1, 3, 5], {}
    g = torch.Generator().manual_seed(0)
    batch = [(f"p{i}", torch.randint(0, 256, (n,), generator=g)) for i, n in enumerate(lengths)]
    with tempfile.TemporaryDirectory(prefix="eagle-parity-") as d:
        for kind in kinds:
            path = save_tiny_target(kind, Path(d) / kind)
            ref32 = HFBackend(path, aux, dtype="float32", device=device).capture(batch)
            for dtype in dtypes:
                hf = HFBackend(path, aux, dtype=dtype, device=device).capture(batch)
                kw = {k: v for k, v in (("attention_backend", attention_backend), ("max_total_tokens", max_total_tokens),
                                        ("mem_fraction_static", mem_fraction_static)) if v is not None}
                sg = make_backend("sglang", model_path=path, aux_layer_ids=aux, dtype=dtype, device=device,
                                  chunked_prefill_size=chunked_prefill_size, **kw)
                try:
                    got = sg.capture(batch)
                finally:
                    sg.close()
                row: dict[str, Any] = {}
                for f in ("aux_hidden_states", "hidden_states"):
                    def rel(xs):
                        return max(((getattr(x, f).float() - getattr(r, f).float()).abs().max()
                                    / getattr(r, f).float().abs().max()).item() for x, r in zip(xs, ref32))
                    row[f] = {"sglang_vs_hf32": rel(got), "hf_vs_hf32": rel(hf)}
                row["ids_shapes_equal"] = all(x.aux_hidden_states.shape == r.aux_hidden_states.shape
                                              for x, r in zip(got, ref32))
                res[f"{kind}/{dtype}"] = row
                print(f"{kind:12s} {dtype:9s} aux: sglang {row['aux_hidden_states']['sglang_vs_hf32']:.2e} "
                      f"(hf {row['aux_hidden_states']['hf_vs_hf32']:.2e})  final: sglang "
                      f"{row['hidden_states']['sglang_vs_hf32']:.2e} (hf {row['hidden_states']['hf_vs_hf32']:.2e})"
                      f"  vs HF fp32, max relative", flush=True)
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))
    return res
