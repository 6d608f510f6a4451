"""``python -m benchmarks loader|extract|stages|final_rows|codec|pipeline|train|train_step|sglang|sglang_parity|spool|parity|tar_walk|writers|tau|ddp|random_target``: benchmarks that print numbers.

Run from a checkout (this folder is not installed). Each command is the benchmark function
itself: its signature and docstring make the command line (jsonargparse); ``tau`` is the
:class:`~benchmarks.tau_config.TauConfig` dataclass, run by :func:`benchmarks.tau.run_tau`.
``--help`` lists the options. Figures and how to read them: BENCHMARKS.md.
"""

from __future__ import annotations

import signal

from benchmarks.codec import bench_codec
from benchmarks.ddp import bench_ddp
from benchmarks.extract import bench_extract
from benchmarks.final_rows import bench_final_rows
from benchmarks.loader import bench_loader
from benchmarks.parity import bench_parity, bench_sglang_parity
from benchmarks.pipeline import bench_pipeline
from benchmarks.random_target import make_random_target
from benchmarks.sglang import bench_sglang
from benchmarks.spool import bench_spool
from benchmarks.stages import bench_stages
from benchmarks.tau import run_tau
from benchmarks.tau_config import TauConfig
from benchmarks.tar_walk import bench_tar_walk
from benchmarks.train import bench_train
from benchmarks.train_step import bench_train_step
from benchmarks.writers import bench_writers
from eagle_data.cli.main import run_cli

COMMANDS = {"loader": bench_loader, "extract": bench_extract, "train": bench_train, "sglang": bench_sglang,
            "train_step": bench_train_step, "tar_walk": bench_tar_walk, "spool": bench_spool,
            "pipeline": bench_pipeline, "codec": bench_codec, "stages": bench_stages, "final_rows": bench_final_rows,
            "writers": bench_writers, "parity": bench_parity, "sglang_parity": bench_sglang_parity,
            "tau": TauConfig, "ddp": bench_ddp, "random_target": make_random_target}
#: what to do with a parsed dataclass command
RUNNERS = {TauConfig: run_tau}


def main(argv: list[str] | None = None) -> None:
    """Run one benchmark; SIGTERM (``kill``, ``timeout``, a scheduler) stops it as Ctrl-C does, so
    its scratch folder is removed either way."""
    old = signal.signal(signal.SIGTERM, _interrupt)
    try:
        run_cli(COMMANDS, argv, "python -m benchmarks", RUNNERS,
                interrupted="interrupted (a benchmark starts over, but for the τ benchmark's regen and extract "
                            "phases: they resume)")
    finally:
        signal.signal(signal.SIGTERM, old)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    main()
