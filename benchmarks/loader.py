"""``eagle-data bench loader DIR``: streaming loader throughput vs raw tar reads vs a
one-``torch.save``-file-per-sample map-style layout, and start-up time vs dataset size.

Disks drift (a shared VM disk can vary 2-3x within a minute), so the readers are measured in
*rounds*: each round runs every reader once, bracketed by raw reads of the same tar files, and a
ratio is taken inside its round (paired); the table gives the median over rounds and its range.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional


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


def one_pass(make: Callable[[], Any], cold: bool, touch: bool) -> dict[str, float]:
    """One full pass over ``make()`` (built before the cache is dropped, so worker start-up
    counts, construction does not): seconds, seconds to the first batch, samples, hidden-state
    bytes, CPU seconds (this process + exited workers)."""
    it = make()
    if cold:
        drop_caches()
    c0, t0, first, n, nbytes = _cpu_s(), time.perf_counter(), None, 0, 0
    for b in it:
        n += len(b["keys"])
        nbytes += _hidden_bytes(b)
        if touch:
            _touch(b)
        if first is None:
            first = time.perf_counter() - t0
    dt = time.perf_counter() - t0
    del it
    return {"seconds": dt, "first_s": first or dt, "samples": n, "bytes": nbytes, "cpu_s": _cpu_s() - c0}


def raw_read(files: list[Path], cold: bool, hinted: bool = True) -> dict[str, float]:
    """Sequential read of the tar files, 1 MiB at a time into one reused buffer: the I/O
    reference. ``hinted`` also asks the kernel for readahead 16 MiB ahead
    (``POSIX_FADV_WILLNEED``, as the loader does), which on a virtual disk can be ~2x faster
    than plain reads. ``bytes`` counts every tar byte (headers and json included)."""
    buf = bytearray(1 << 20)
    mv = memoryview(buf)
    if cold:
        drop_caches()
    t0, total = time.perf_counter(), 0
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            size, pos, ahead = os.fstat(fd).st_size, 0, 0
            while pos < size:
                if hinted and ahead < min(size, pos + (16 << 20)):
                    stop = min(size, pos + (16 << 20))
                    os.posix_fadvise(fd, ahead, stop - ahead, os.POSIX_FADV_WILLNEED)
                    ahead = stop
                n = os.preadv(fd, [mv], pos)
                if not n:
                    break
                pos += n
            total += pos
        finally:
            os.close(fd)
    return {"seconds": time.perf_counter() - t0, "bytes": total}


def _raw_pair(files: list[Path], cold: bool) -> dict[str, Any]:
    """Plain and hinted raw reads; the reference is the faster of the two."""
    plain, hinted = raw_read(files, cold, hinted=False), raw_read(files, cold, hinted=True)
    return {"plain": plain, "hinted": hinted, "seconds": min(plain["seconds"], hinted["seconds"]),
            "bytes": plain["bytes"]}


class _PerSampleFiles:
    """The peers' layout: one ``torch.save`` file per sample, map-style; the file list comes
    from listing the directory at construction (as per-sample loaders do)."""

    def __init__(self, root: Path):
        self.files = sorted(root.glob("*.pt"))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int):
        import torch

        return torch.load(self.files[i], weights_only=True)


def _collate_per_sample(samples):
    from eagle_data.stream.collate import collate

    h = samples[0]["hidden_states"]
    return collate(samples, [s["key"] for s in samples], h.shape[1], samples[0]["aux_hidden_states"].shape[1], h.dtype)


def _export_per_sample(ds_dir: str, out: Path) -> int:
    """Write every sample of ``ds_dir`` as ``out/NNNNNNNN.pt`` (unpadded tensors + key)."""
    import torch

    from eagle_data.stream.dataset import EagleShardDataset
    from eagle_data.stream.loader import EagleDataLoader

    out.mkdir(parents=True, exist_ok=True)
    i = 0
    for raw in EagleDataLoader(EagleShardDataset(ds_dir, batch_size=1, shuffle=False)):
        n = int(raw["attention_mask"][0].sum())
        d = {k: raw[k][0, :n].clone() for k in ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")}
        d["key"] = raw["keys"][0]
        torch.save(d, out / f"{i:08d}.pt")
        i += 1
    return i


def _startup_sets(tmp: Path, batch_size: int, per_sample: bool) -> dict[str, dict[int, float]]:
    """Construct + first batch for 1k- and 100k-sample datasets, both layouts (best of 3).

    Shards: a 1k-sample dataset and a manifest listing 100 hard links of its shard. Per-sample
    files: 1k and 100k copies of one small ``.pt`` sample file (listing them is the cost)."""
    import torch
    from torch.utils.data import DataLoader

    from eagle_data.stream.dataset import EagleShardDataset
    from eagle_data.stream.loader import EagleDataLoader
    from eagle_data.format.layout import MANIFEST_NAME, shard_name
    from eagle_data.tools.synthetic import write_synthetic

    small = tmp / "start-1k"
    m = write_synthetic(small, [1000], hidden_size=8)
    big = tmp / "start-100k"
    big.mkdir()
    shard, shards = m["shards"][0], []
    for i in range(100):
        name = shard_name(0, i)
        os.link(small / shard["name"], big / name)
        shards.append({**shard, "name": name})
    (big / MANIFEST_NAME).write_text(json.dumps({**m, "shards": shards, "num_samples": 100 * 1000}))

    def first(make) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            it = iter(make())
            next(it)
            best = min(best, time.perf_counter() - t0)
            del it  # closing (stopping a prefetch thread) is not start-up
        return best

    out = {"shards (EagleShardDataset)": {n: first(lambda d=d: EagleDataLoader(EagleShardDataset(d, batch_size=batch_size)))
                                          for n, d in ((1000, small), (100_000, big))}}
    if per_sample:
        src = tmp / "one.pt"
        torch.save({"input_ids": torch.zeros(4, dtype=torch.int64), "loss_mask": torch.ones(4, dtype=torch.uint8),
                    "aux_hidden_states": torch.zeros(4, 24, dtype=torch.bfloat16),
                    "hidden_states": torch.zeros(4, 8, dtype=torch.bfloat16), "key": "k"}, src)
        blob, dirs = src.read_bytes(), {}
        for n in (1000, 100_000):
            d = dirs[n] = tmp / f"pt-{n}"
            d.mkdir()
            for i in range(n):
                (d / f"{i:08d}.pt").write_bytes(blob)
        out["per-sample files (map-style)"] = {
            n: first(lambda d=d: DataLoader(_PerSampleFiles(d), batch_size=batch_size, shuffle=True,
                                            collate_fn=_collate_per_sample)) for n, d in dirs.items()}
    return out


def bench_loader(path: str, batch_size: int = 8, workers: list[int] = [0, 1, 2], rounds: int = 3,
                 per_sample_baseline: bool = True, startup: bool = True, cold: bool = False,
                 synth_samples: int = 512, synth_hidden: int = 1024, synth_tokens: tuple[int, int] = (256, 768),
                 touch: bool = True, pin_memory: bool = False, json_out: Optional[str] = None) -> dict[str, Any]:
    """Loader throughput vs raw reads of the same shards and vs one torch.save file per sample (higher ratios = faster).

    Every reader runs over the same samples (the shards of ``path``; the per-sample files hold
    the same samples) under the same cache state (dropped before each pass when ``cold``); its
    rate counts the hidden-state bytes delivered (``attention_mask`` tokens x (H + 3H) x
    itemsize). Each round runs every reader once between two raw reads; "vs raw read" is
    ``raw time / reader time`` within a round (raw time: mean over the round's two ends of the
    faster of a plain and a readahead-hinted sequential read, see :func:`raw_read`; the raw
    read covers every tar byte), "vs per-sample files" is ``per-sample time / loader time`` at
    the same worker count in the same round. Medians over rounds, with the range.

    Args:
        path: dataset directory (manifest.json + shards), or ``synthetic`` to write a synthetic
            one into a temp dir (use ``./synthetic`` for a directory of that name).
        batch_size: samples per batch.
        workers: DataLoader worker counts to measure.
        rounds: measurement rounds (medians reported).
        per_sample_baseline: also measure one torch.save file per sample (map-style Dataset +
            DataLoader, shuffled, the same collate).
        startup: measure construction + first batch for 1k vs 100k samples, both layouts
            (writes ~101k small files to a temp dir, removed afterwards).
        cold: drop the page cache before each pass (opt-in: as root this drops the WHOLE
            machine's page cache, ``/proc/sys/vm/drop_caches``; without root reads stay warm).
            Off (default): passes read what the page cache holds (warm after the first read), which
            measures the loader's CPU path more than the disk.
        synth_samples: samples of the synthetic dataset (4 shards).
        synth_hidden: H of the synthetic dataset (aux is 3H, bf16).
        synth_tokens: ``[min, max)`` tokens per synthetic sample (spread evenly).
        touch: the consumer reads every page of the hidden-state tensors (as a copy to the GPU
            would); False: only counts tokens.
        pin_memory: pin batches in both layouts (adds a copy per batch in the main process).
        json_out: also write all figures (every pass) to this JSON file.

    Returns:
        the figures (also printed as a table).
    """
    if rounds < 1 or not workers:
        raise ValueError("rounds must be >= 1 and workers non-empty")
    tmp = Path(tempfile.mkdtemp(prefix="eagle-bench-"))
    try:
        path = _dataset(path, tmp, synth_samples, synth_hidden, synth_tokens)
        cold = cold and drop_caches()
        files = sorted(Path(path).glob("*.tar"))
        readers = _readers(path, tmp / "per-sample" if per_sample_baseline else None, workers, batch_size, pin_memory)
        passes, raws = _rounds(readers, files, rounds, cold, touch)
        res = _summarise(passes, raws, workers, per_sample_baseline)
        res.update(path=str(path), batch_size=batch_size, rounds=rounds, touch=touch, pin_memory=pin_memory,
                   cache="cold (dropped before each pass)" if cold else "warm",
                   dataset=_dataset_facts(passes, raws, files))
        if startup:
            res["startup_s"] = _startup_sets(tmp, batch_size, per_sample_baseline)
        _report(res, passes, raws, json_out)
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dataset(path: str, tmp: Path, synth_samples: int, synth_hidden: int, synth_tokens: tuple[int, int]) -> str:
    """The dataset folder ``path`` (checked: it has a manifest), or for ``synthetic`` a synthetic
    dataset of ``synth_samples`` samples written into ``tmp``."""
    from eagle_data.format.layout import MANIFEST_NAME

    if path == "synthetic":
        import torch

        from eagle_data.tools.synthetic import write_synthetic

        lo, hi = synth_tokens
        if not 0 < lo < hi:
            raise ValueError(f"synth_tokens must be [min, max) with 0 < min < max, got {synth_tokens}")
        length = (lambda g: lo + (g * 97) % (hi - lo))
        path = str(tmp / "data")
        write_synthetic(path, [synth_samples // 4] * 4, hidden_size=synth_hidden, length=length,
                        values=lambda g: torch.randn(length(g), synth_hidden))
    elif not (Path(path) / MANIFEST_NAME).is_file():
        raise ValueError(f"{path}: no manifest.json (give a dataset directory, or 'synthetic')")
    return path


def _readers(path: str, ps_dir: Path | None, workers: list[int], batch_size: int,
             pin_memory: bool) -> dict[str, Callable[[], Any]]:
    """The readers to measure, by name: the loader at each worker count and, with ``ps_dir`` (the
    samples of ``path`` exported there first), the per-sample files at the same counts."""
    from torch.utils.data import DataLoader

    from eagle_data.stream.dataset import EagleShardDataset
    from eagle_data.stream.loader import EagleDataLoader

    if ps_dir is not None:
        _export_per_sample(path, ps_dir)
    readers: dict[str, Callable[[], Any]] = {}
    for w in workers:
        readers[f"EagleShardDataset workers={w}"] = (
            lambda w=w: EagleDataLoader(EagleShardDataset(path, batch_size=batch_size), num_workers=w,
                                        pin_memory=pin_memory))
        if ps_dir is not None:
            readers[f"per-sample torch.save files workers={w}"] = (
                lambda w=w: DataLoader(_PerSampleFiles(ps_dir), batch_size=batch_size, shuffle=True,
                                       num_workers=w, collate_fn=_collate_per_sample, pin_memory=pin_memory))
    return readers


def _rounds(readers: dict[str, Callable[[], Any]], files: list[Path], rounds: int, cold: bool,
            touch: bool) -> tuple[dict[str, list[dict[str, float]]], list[dict[str, Any]]]:
    """``rounds`` rounds of one pass of every reader, each round between two raw reads of ``files``:
    the passes by reader, and the raw reads (``rounds + 1``)."""
    raws = [_raw_pair(files, cold)]
    passes: dict[str, list[dict[str, float]]] = {k: [] for k in readers}
    for _ in range(rounds):
        for name, make in readers.items():
            passes[name].append(one_pass(make, cold, touch))
        raws.append(_raw_pair(files, cold))
    return passes, raws


def _dataset_facts(passes: dict[str, list[dict[str, float]]], raws: list[dict[str, Any]],
                   files: list[Path]) -> dict[str, Any]:
    """Samples, tar GB and shards of the dataset read."""
    return {"samples": passes[next(iter(passes))][0]["samples"], "tar_GB": raws[0]["bytes"] / 1e9, "shards": len(files)}


def _report(res: dict[str, Any], passes: dict[str, list[dict[str, float]]], raws: list[dict[str, Any]],
            json_out: Optional[str]) -> None:
    """Print ``res`` as a table; also write it with every pass to ``json_out`` if given."""
    _print(res)
    if json_out:
        Path(json_out).write_text(json.dumps({**res, "passes": passes, "raw_passes": raws}, indent=1))


def _spread(xs) -> list[float]:
    """``[median, min, max]`` of a sequence of ratios."""
    xs = sorted(xs)
    return [statistics.median(xs), xs[0], xs[-1]]


def _summarise(passes: dict[str, list[dict[str, float]]], raws: list[dict[str, float]], workers: list[int],
               per_sample: bool) -> dict[str, Any]:
    med = statistics.median
    raw_s = [(a["seconds"] + b["seconds"]) / 2 for a, b in zip(raws, raws[1:])]  # per round
    rows: dict[str, Any] = {}
    for kind in ("plain", "hinted"):
        rows[f"raw sequential tar read ({kind})"] = {
            "GB_s": med(r[kind]["bytes"] / r[kind]["seconds"] for r in raws) / 1e9,
            "vs_raw": _spread(r["seconds"] / r[kind]["seconds"] for r in raws)}
    for name, ps in passes.items():
        rows[name] = {"samples_s": med(p["samples"] / p["seconds"] for p in ps),
                      "GB_s": med(p["bytes"] / p["seconds"] for p in ps) / 1e9,
                      "first_ms": med(p["first_s"] for p in ps) * 1e3,
                      "GB_per_cpu_s": med(p["bytes"] / p["cpu_s"] for p in ps if p["cpu_s"] > 0) / 1e9
                      if any(p["cpu_s"] > 0 for p in ps) else float("nan"),
                      "vs_raw": _spread(r / p["seconds"] for r, p in zip(raw_s, ps))}
    if per_sample:
        for w in workers:
            ours, ps = passes[f"EagleShardDataset workers={w}"], passes[f"per-sample torch.save files workers={w}"]
            rows[f"EagleShardDataset workers={w}"]["vs_per_sample"] = _spread(
                b["seconds"] / a["seconds"] for a, b in zip(ours, ps))
    return {"rows": rows}


def _fmt(r: list[float] | None) -> str:
    if r is None:
        return "-"
    return f"{r[0]:.2f}" if r[1] == r[2] else f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})"


def _print(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    d = res["dataset"]
    t = Table(title=f"loader throughput: {res['path']} ({d['samples']} samples, {d['shards']} shards, "
                    f"{d['tar_GB']:.2f} GB), B={res['batch_size']}, {res['cache']} page cache, median over "
                    f"{res['rounds']} round(s) (min-max), touch={res['touch']}, pin_memory={res['pin_memory']}")
    for c in ("reader", "samples/s", "GB/s", "first batch ms", "GB per CPU-s", "vs raw read", "vs per-sample files"):
        t.add_column(c)
    for name, r in res["rows"].items():
        t.add_row(name, f"{r['samples_s']:.1f}" if "samples_s" in r else "-", f"{r['GB_s']:.3f}",
                  f"{r['first_ms']:.0f}" if "first_ms" in r else "-",
                  f"{r['GB_per_cpu_s']:.3f}" if "GB_per_cpu_s" in r else "-",
                  _fmt(r["vs_raw"]), _fmt(r.get("vs_per_sample")))
    con = Console(width=200)
    con.print(t)
    con.print("GB/s: hidden-state bytes delivered (raw rows: all tar bytes). \"vs raw read\" = raw read time / "
              "reader time for the same shards (1.00 = as fast as just reading the bytes; the reference is the "
              "faster raw read at the two ends of each round, raw rows show each kind against it). \"vs per-sample "
              "files\" = per-sample time / loader time at the same worker count (>1: the shards are faster). "
              "Ratios are paired within a round (same disk state). \"first batch\" includes worker start-up.")
    for layout, s in res.get("startup_s", {}).items():
        con.print(f"start-up (construct + first batch), {layout}: " +
                  ", ".join(f"{n} samples: {v * 1e3:.1f} ms" for n, v in s.items()))
