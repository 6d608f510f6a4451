"""``eagle-data bench loader DIR``: streaming loader throughput vs raw tar reads vs a
one-``torch.save``-file-per-sample map-style layout, and start-up time vs manifest size."""

from __future__ import annotations

import json
import os
import shutil
import statistics
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


def _touch(batch: dict[str, Any]) -> None:
    """Read one element per 4 KiB page of the hidden-state tensors, as a consumer copying them
    to the GPU would (the pages of a worker's shared-memory batch are mapped on first touch)."""
    for k in ("hidden_states", "aux_hidden_states"):
        t = batch[k]
        if t.numel():
            t.reshape(-1)[:: max(1, 4096 // t.element_size())].float().sum()


def _cpu_s() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(make, cold: bool, repeats: int, touch: bool) -> dict[str, float]:
    """Median wall time (and CPU time incl. exited workers) of ``repeats`` full passes over
    ``make()``, each after dropping the page cache when ``cold``."""
    runs = []
    for _ in range(repeats):
        it = make()
        if cold:
            drop_caches()
        c0, t0, n, nbytes = _cpu_s(), time.perf_counter(), 0, 0
        for b in it:
            n += len(b["keys"])
            nbytes += _hidden_bytes(b)
            if touch:
                _touch(b)
        runs.append((time.perf_counter() - t0, _cpu_s() - c0))
    dt = statistics.median(r[0] for r in runs)
    cpu = statistics.median(r[1] for r in runs)
    return {"samples_s": n / dt, "GB_s": nbytes / dt / 1e9, "samples": n, "seconds": dt, "cpu_s": cpu,
            "GB_per_cpu_s": nbytes / cpu / 1e9 if cpu else float("nan"), "all_s": [r[0] for r in runs]}


def raw_read(files: list[Path], cold: bool, repeats: int = 1) -> dict[str, float]:
    """Sequential read of the tar files (1 MiB chunks into one reused buffer): the I/O ceiling.
    Median of ``repeats``; ``GB_s`` counts all tar bytes (headers and json included)."""
    buf = bytearray(1 << 20)
    runs = []
    for _ in range(repeats):
        if cold:
            drop_caches()
        t0, total = time.perf_counter(), 0
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(buf):
                    total += n
        runs.append(time.perf_counter() - t0)
    dt = statistics.median(runs)
    return {"GB_s": total / dt / 1e9, "bytes": total, "seconds": dt, "all_s": runs}


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
                 synth_samples: int = 128, synth_hidden: int = 1024, repeats: int = 3, touch: bool = True,
                 pin_memory: bool = False) -> dict[str, Any]:
    """Benchmark the streaming loader against raw reads and a per-sample-file layout.

    Every reader runs over the same data (the shards of ``path``; the per-sample files hold the
    same samples), under the same cache state (dropped before each pass when ``cold``), and its
    rate counts the hidden-state bytes delivered (``attention_mask`` tokens x (H + 3H) x
    itemsize) in both layouts. Ratios compare times for the same samples: "vs raw" is
    ``raw read time / loader time`` (raw reads every tar byte), "vs per-sample" is
    ``per-sample time / loader time`` at the same worker count.

    Args:
        path: dataset directory (manifest.json + shards); None: synthesize one in a temp dir.
        batch_size: samples per batch.
        workers: DataLoader worker counts to measure.
        per_sample_baseline: also measure one torch.save file per sample (map-style Dataset + DataLoader).
        startup: measure dataset construction + first batch for 1k vs 100k-sample manifests.
        cold: drop the page cache before each measurement (root only; else reads are warm).
        synth_samples: samples of the synthetic dataset (when path is None).
        synth_hidden: H of the synthetic dataset (aux is 3H, bf16, T in 256..767).
        repeats: passes per reader; the median is reported.
        touch: the consumer reads every page of the hidden-state tensors (as a copy to the GPU
            would); False: only counts tokens (leaves a worker's shared-memory pages unmapped).
        pin_memory: pin batches in both layouts (adds a copy per batch in the main process).
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
        res: dict[str, Any] = {"cache": "cold (dropped before each pass)" if cold else "warm", "rows": {},
                               "path": str(path), "batch_size": batch_size, "repeats": repeats, "touch": touch,
                               "pin_memory": pin_memory}
        files = sorted(Path(path).glob("*.tar"))
        pt_files = _export_per_sample(path, tmp) if per_sample_baseline else []
        res["rows"]["raw sequential tar read"] = raw = raw_read(files, cold, repeats)
        for w in workers:
            loader = res["rows"][f"EagleShardDataset workers={w}"] = _timed(
                lambda: EagleDataLoader(EagleShardDataset(path, batch_size=batch_size), num_workers=w,
                                        pin_memory=pin_memory), cold, repeats, touch)
            loader["vs_raw"] = raw["seconds"] / loader["seconds"]
            if pt_files:
                ps = res["rows"][f"per-sample torch.save files workers={w}"] = _timed(
                    lambda: DataLoader(_PerSampleFiles(pt_files), batch_size=batch_size, shuffle=True,
                                       num_workers=w, collate_fn=_collate_per_sample, pin_memory=pin_memory),
                    cold, repeats, touch)
                ps["vs_raw"] = raw["seconds"] / ps["seconds"]
                loader["vs_per_sample"] = ps["seconds"] / loader["seconds"]
        if startup:
            sets = _make_startup_sets(tmp)
            res["startup_s"] = {n: min(_startup(d, n, batch_size) for _ in range(3)) for n, d in sets.items()}
        _print(res)
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _print(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"loader throughput: {res['path']}, B={res['batch_size']}, {res['cache']} page cache, "
                    f"median of {res['repeats']}, touch={res['touch']}, pin_memory={res['pin_memory']}")
    for c in ("reader", "samples/s", "GB/s", "GB per CPU-s", "vs raw read", "vs per-sample files"):
        t.add_column(c)
    for name, r in res["rows"].items():
        t.add_row(name, f"{r['samples_s']:.1f}" if "samples_s" in r else "-", f"{r['GB_s']:.3f}",
                  f"{r['GB_per_cpu_s']:.3f}" if "GB_per_cpu_s" in r else "-",
                  f"{r['vs_raw']:.2f}" if "vs_raw" in r else "1.00",
                  f"{r['vs_per_sample']:.2f}" if "vs_per_sample" in r else "-")
    con = Console(width=200)
    con.print(t)
    con.print("GB/s: hidden-state bytes delivered (raw read: all tar bytes); ratios compare the times "
              "for the same samples")
    if "startup_s" in res:
        con.print("start-up (construct + first batch): " +
                  ", ".join(f"{n} samples: {s * 1e3:.1f} ms" for n, s in res["startup_s"].items()))
