"""Data-loading subcommands: ``eagle-data bench loader DIR`` (see :mod:`eagle_data.cli`)."""

from __future__ import annotations

from typing import Optional


def bench_loader(path: Optional[str] = None, batch_size: int = 8, workers: list[int] = [0, 1, 2],
                 per_sample_baseline: bool = True, startup: bool = True, cold: bool = True,
                 synth_samples: int = 128, synth_hidden: int = 1024, repeats: int = 3, touch: bool = True,
                 pin_memory: bool = False) -> None:
    """Loader throughput (samples/s, GB/s of hidden states) for 0/1/2 workers next to the raw tar read
    rate and a one-torch.save-file-per-sample layout, plus start-up time for 1k vs 100k-sample manifests.

    Args:
        path: dataset directory (manifest.json + shards); omitted: a synthetic one in a temp dir.
        batch_size: samples per batch.
        workers: DataLoader worker counts to measure.
        per_sample_baseline: also measure one torch.save file per sample (map-style Dataset + DataLoader).
        startup: measure dataset construction + first batch for 1k vs 100k-sample manifests.
        cold: drop the page cache before each measurement (root only; else reads are warm).
        synth_samples: samples of the synthetic dataset (when path is omitted).
        synth_hidden: H of the synthetic dataset (aux is 3H, bf16, T in 256..767).
        repeats: passes per reader (the median is reported).
        touch: the consumer reads every page of the hidden states (like a copy to the GPU).
        pin_memory: pin batches in both layouts.
    """
    from .bench_loader import bench_loader as run

    run(path, batch_size, workers, per_sample_baseline, startup, cold, synth_samples, synth_hidden, repeats,
        touch, pin_memory)


COMMANDS = {"bench": {"loader": bench_loader}}
