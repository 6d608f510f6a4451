"""``python -m benchmarks codec``: does a lossless codec pay on bf16 hidden states?

Shards store the EAGLE-3 aux hidden states [T, 3H] and final states [T, H] as raw bf16 bits.
This measures, on the same bytes, four lossless codecs: zstd level 1 and 3 on the raw bytes,
and the same after a byte-plane split (each little-endian bf16 is a low byte of 7 mantissa
bits + the exponent's last bit, and a high byte of sign + 7 exponent bits; the planes are
compressed separately, so zstd sees the well-structured high bytes apart from the nearly random
low ones). Per method: compressed/raw size, compress and decompress GB/s of raw bytes on one
thread (split and merge included, and also timed alone), medians over repeats; every
decompression is checked bit-exact.

The bytes are random-normal tensors (``path="random"``) or the samples of a dataset written by
``eagle-data extract``. Random-normal states, and states of a random-weight model, may compress
differently from a real model's states on real text (exponent spread, outlier channels, rows
that repeat): decide on real data.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _random_items(num_tokens: int, hidden_size: int, scale: float) -> list[tuple[str, np.ndarray]]:
    """One random-normal aux [T, 3H] and final [T, H] bf16 tensor, as (field, raw bytes)."""
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(num_tokens, 3 * hidden_size, generator=g) * scale
    fin = torch.randn(num_tokens, hidden_size, generator=g) * scale
    return [("aux", _bytes(aux.to(torch.bfloat16))), ("final", _bytes(fin.to(torch.bfloat16)))]


def _dataset_items(path: str, max_samples: int) -> list[tuple[str, np.ndarray]]:
    """The aux and final states of the first ``max_samples`` samples of a dataset (bf16 only).

    Raises:
        ValueError: not a dataset directory, or its hidden states are not bf16.
    """
    import pyarrow.parquet as pq

    from eagle_data.format.layout import INDEX_NAME
    from eagle_data.format.records import read_manifest
    from eagle_data.tools.read_samples import read_samples

    dtype = read_manifest(path).get("dtype")
    if dtype != "bfloat16":
        raise ValueError(f"{path}: hidden states are {dtype}; the codec benchmark takes bfloat16 only")
    keys = pq.read_table(Path(path) / INDEX_NAME, columns=["key"]).column("key").to_pylist()[:max_samples]
    items = []
    for key, t in read_samples(path, keys).items():
        for field, name in (("aux", "aux_hidden_states"), ("final", "hidden_states")):
            if t[name].dtype != torch.bfloat16:
                raise ValueError(f"{path}:{key}: {name} is {t[name].dtype}; the codec benchmark takes bfloat16 only")
            items.append((field, _bytes(t[name])))
    return items


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _split(raw: np.ndarray) -> list[np.ndarray]:
    """[low bytes, high bytes] of little-endian 16-bit values (two contiguous planes)."""
    planes = raw.reshape(-1, 2).T.copy()
    return [planes[0], planes[1]]


def _merge(planes: list[bytes]) -> np.ndarray:
    lo, hi = (np.frombuffer(p, dtype=np.uint8) for p in planes)
    return np.stack([lo, hi], axis=1).reshape(-1)


def _one_pass(items, cctx, dctx, split: bool) -> dict[str, Any]:
    """Compress and decompress every item once: seconds per step, compressed bytes per field."""
    t = dict.fromkeys(("split", "compress", "decompress", "merge"), 0.0)
    sizes: dict[str, int] = {}
    for field, raw in items:
        t0 = time.perf_counter()
        parts = _split(raw) if split else [raw]
        t1 = time.perf_counter()
        blobs = [cctx.compress(p) for p in parts]
        t2 = time.perf_counter()
        outs = [dctx.decompress(b) for b in blobs]
        t3 = time.perf_counter()
        back = _merge(outs) if split else np.frombuffer(outs[0], dtype=np.uint8)
        t4 = time.perf_counter()
        assert np.array_equal(back, raw), f"codec round trip changed the bytes ({field})"
        for k, dt in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            t[k] += dt
        sizes[field] = sizes.get(field, 0) + sum(len(b) for b in blobs)
    return {"seconds": t, "sizes": sizes}


def _method(items, level: int, split: bool, repeats: int) -> dict[str, Any]:
    """Figures of one codec over ``items`` (medians over ``repeats`` passes, one thread)."""
    import zstandard

    cctx, dctx = zstandard.ZstdCompressor(level=level, threads=0), zstandard.ZstdDecompressor()
    passes = [_one_pass(items, cctx, dctx, split) for _ in range(repeats)]
    med = {k: statistics.median(p["seconds"][k] for p in passes) for k in passes[0]["seconds"]}
    raw = {f: sum(r.nbytes for g, r in items if g == f) for f, _ in items}
    row = {"ratio": round(sum(passes[0]["sizes"].values()) / max(sum(raw.values()), 1), 4),
           **{f"ratio_{f}": round(passes[0]["sizes"][f] / max(raw[f], 1), 4) for f in raw},
           "compress_GB_s": _rate(raw, med["split"] + med["compress"]),
           "decompress_GB_s": _rate(raw, med["decompress"] + med["merge"])}
    if split:
        row.update(split_GB_s=_rate(raw, med["split"]), merge_GB_s=_rate(raw, med["merge"]),
                   split_merge_share=round((med["split"] + med["merge"]) / max(sum(med.values()), 1e-12), 3))
    return row


def _rate(raw: dict[str, int], seconds: float) -> float:
    return float(f"{sum(raw.values()) / max(seconds, 1e-12) / 1e9:.4g}")  # 4 significant digits: tiny inputs stay > 0


def bench_codec(path: str = "random", num_tokens: int = 2048, hidden_size: int = 4096, scale: float = 1.0,
                max_samples: int = 8, repeats: int = 3, json_out: str | None = None) -> dict[str, Any]:
    """Lossless codecs on bf16 hidden states: size ratio and one-thread GB/s of zstd 1/3, raw and byte-plane split.

    Prints a table; returns the figures (medians over ``repeats``; every round trip checked bit-exact).

    Args:
        path: ``random`` (random-normal bf16 states of ``num_tokens`` x ``hidden_size``) or a
            dataset directory written by ``eagle-data extract`` (bf16 hidden states).
        num_tokens: T of the random states.
        hidden_size: H of the random states (aux is [T, 3H], final [T, H]).
        scale: standard deviation of the random states.
        max_samples: samples read from a dataset directory (the first of its index).
        repeats: passes per method; medians are reported.
        json_out: also write the figures to this JSON file.

    Raises:
        ValueError: bad sizes, a dataset that is not bf16, or ``zstandard`` missing.
    """
    if min(num_tokens, hidden_size, max_samples, repeats) < 1:
        raise ValueError("num_tokens, hidden_size, max_samples and repeats must be >= 1")
    try:
        import zstandard
    except ImportError as e:
        raise ValueError("the codec benchmark needs zstandard: pip install zstandard") from e
    items = _random_items(num_tokens, hidden_size, scale) if path == "random" else _dataset_items(path, max_samples)
    methods = {f"{'planes+' if split else ''}zstd-{lvl}": _method(items, lvl, split, repeats)
               for split in (False, True) for lvl in (1, 3)}
    out = {"path": path, "tensors": len(items), "raw_MB": round(sum(r.nbytes for _, r in items) / 1e6, 2),
           "zstandard": zstandard.__version__, "repeats": repeats, "methods": methods}
    _print(out)
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=1))
    return out


def _print(out: dict[str, Any]) -> None:
    print(f"{out['path']}: {out['tensors']} tensors, {out['raw_MB']} MB raw bf16, zstandard {out['zstandard']}, "
          f"one thread, medians of {out['repeats']}")
    cols = ["ratio", "ratio_aux", "ratio_final", "compress_GB_s", "decompress_GB_s", "split_GB_s", "merge_GB_s",
            "split_merge_share"]
    print(f"{'method':>13} " + " ".join(f"{c:>{max(len(c), 7)}}" for c in cols))
    for name, row in out["methods"].items():
        print(f"{name:>13} " + " ".join(f"{row.get(c, '-'):>{max(len(c), 7)}}" for c in cols))
