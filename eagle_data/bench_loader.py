"""``eagle-data bench loader DIR``: streaming loader throughput vs raw tar reads vs a
one-``torch.save``-file-per-sample map-style layout, and start-up time vs manifest size."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Optional


def drop_caches() -> bool:
    """Drop the OS page cache (needs root); False if impossible (then reads are warm)."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _hidden_bytes(batch: dict[str, Any]) -> int:
    n = int(batch["attention_mask"].sum())
    return n * (batch["hidden_states"].shape[-1] + batch["aux_hidden_states"].shape[-1]) * \
        batch["hidden_states"].element_size()


def _timed(it, cold: bool) -> dict[str, float]:
    if cold:
        drop_caches()
    t0, n, nbytes = time.perf_counter(), 0, 0
    for b in it:
        n += len(b["keys"])
        nbytes += _hidden_bytes(b)
    dt = time.perf_counter() - t0
    return {"samples_s": n / dt, "GB_s": nbytes / dt / 1e9, "samples": n, "seconds": dt}


def raw_read(files: list[Path], cold: bool) -> dict[str, float]:
    """Sequential read of the tar files (1 MiB chunks): the I/O ceiling."""
    if cold:
        drop_caches()
    t0, total = time.perf_counter(), 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(1 << 20):
                total += len(chunk)
    dt = time.perf_counter() - t0
    return {"GB_s": total / dt / 1e9, "bytes": total, "seconds": dt}


class _PerSampleFiles:
    """The peers' layout: one ``torch.save`` file per sample, map-style."""

    def __init__(self, files: list[Path]):
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        import torch

        d = torch.load(self.files[i], weights_only=True)
        return d


def _collate_per_sample(samples):
    from .batching import collate

    h = samples[0]["hidden_states"]
    return collate(samples, [s["key"] for s in samples], h.shape[1], samples[0]["aux_hidden_states"].shape[1], h.dtype)


def _export_per_sample(ds_dir: str, out: Path) -> list[Path]:
    import torch

    from .dataset import EagleShardDataset
    from .loader import EagleDataLoader

    files = []
    ds = EagleShardDataset(ds_dir, batch_size=1, shuffle=False)
    for i, raw in enumerate(EagleDataLoader(ds)):
        n = int(raw["attention_mask"][0].sum())
        d = {k: raw[k][0, :n].clone() for k in ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")}
        d["key"] = raw["keys"][0]
        p = out / f"{i:08d}.pt"
        torch.save(d, p)
        files.append(p)
    return files


def _startup(ds_dir: Path, big: int, batch_size: int) -> float:
    from .dataset import EagleShardDataset
    from .loader import EagleDataLoader

    t0 = time.perf_counter()
    dl = EagleDataLoader(EagleShardDataset(ds_dir, batch_size=batch_size))
    next(iter(dl))
    return time.perf_counter() - t0


def _make_startup_sets(tmp: Path) -> dict[int, Path]:
    """1k-sample dataset, and a 100k one listing 100 hard links of the same 1k-sample shard."""
    from .synthetic import write_synthetic

    small = tmp / "start-1k"
    m = write_synthetic(small, [1000], hidden_size=8)
    big = tmp / "start-100k"
    big.mkdir()
    shard = m["shards"][0]
    shards = []
    for i in range(100):
        name = f"00000-{i:06d}.tar"
        os.link(small / shard["name"], big / name)
        shards.append({**shard, "name": name})
    (big / "manifest.json").write_text(json.dumps({**m, "shards": shards, "num_samples": 100 * 1000}))
    return {1000: small, 100_000: big}


def bench_loader(path: Optional[str] = None, batch_size: int = 8, workers: list[int] = [0, 1, 2],
                 per_sample_baseline: bool = True, startup: bool = True, cold: bool = True,
                 synth_samples: int = 128, synth_hidden: int = 1024) -> dict[str, Any]:
    """Benchmark the streaming loader against raw reads and a per-sample-file layout.

    Args:
        path: dataset directory (manifest.json + shards); None: synthesize one in a temp dir.
        batch_size: samples per batch.
        workers: DataLoader worker counts to measure.
        per_sample_baseline: also measure one torch.save file per sample (map-style Dataset + DataLoader).
        startup: measure dataset construction + first batch for 1k vs 100k-sample manifests.
        cold: drop the page cache before each measurement (root only; else reads are warm).
        synth_samples: samples of the synthetic dataset (when path is None).
        synth_hidden: H of the synthetic dataset (aux is 3H, bf16, T in 256..767).
    """
    from torch.utils.data import DataLoader

    from .dataset import EagleShardDataset
    from .loader import EagleDataLoader

    tmp = Path(tempfile.mkdtemp(prefix="eagle-bench-"))
    try:
        if path is None:
            from .synthetic import write_synthetic
            import torch

            path = str(tmp / "data")
            write_synthetic(path, [synth_samples // 4] * 4, hidden_size=synth_hidden,
                            length=lambda g: 256 + (g * 97) % 512,
                            values=lambda g: torch.randn(256 + (g * 97) % 512, synth_hidden))
        cold = cold and drop_caches()
        res: dict[str, Any] = {"cache": "cold (dropped before each run)" if cold else "warm", "rows": {}}
        files = sorted(Path(path).glob("*.tar"))
        res["rows"]["raw sequential tar read"] = raw_read(files, cold)
        pt_files = _export_per_sample(path, tmp) if per_sample_baseline else []
        for w in workers:
            dl = EagleDataLoader(EagleShardDataset(path, batch_size=batch_size), num_workers=w)
            res["rows"][f"EagleShardDataset workers={w}"] = _timed(dl, cold)
            if pt_files:
                ps = DataLoader(_PerSampleFiles(pt_files), batch_size=batch_size, shuffle=True, num_workers=w,
                                collate_fn=_collate_per_sample)
                res["rows"][f"per-sample torch.save files workers={w}"] = _timed(ps, cold)
        if startup:
            sets = _make_startup_sets(tmp)
            res["startup_s"] = {n: min(_startup(d, n, batch_size) for _ in range(3)) for n, d in sets.items()}
        raw = res["rows"]["raw sequential tar read"]["GB_s"]
        _print(res, raw)
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _print(res: dict[str, Any], raw: float) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"loader throughput ({res['cache']} page cache)")
    for c in ("reader", "samples/s", "GB/s", "vs raw tar GB/s"):
        t.add_column(c)
    for name, r in res["rows"].items():
        t.add_row(name, f"{r['samples_s']:.1f}" if "samples_s" in r else "-", f"{r['GB_s']:.3f}",
                  f"{r['GB_s'] / raw:.2f}")
    con = Console()
    con.print(t)
    if "startup_s" in res:
        con.print("start-up (construct + first batch): " +
                  ", ".join(f"{n} samples: {s * 1e3:.1f} ms" for n, s in res["startup_s"].items()))
