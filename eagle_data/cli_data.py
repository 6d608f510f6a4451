"""Data-loading subcommands: ``eagle-data bench loader DIR`` (see :mod:`eagle_data.cli`).

The benchmark function itself is the command (its signature and docstring make the CLI);
:mod:`eagle_data.bench_loader` imports nothing heavy at module level.
"""

from __future__ import annotations

from .bench_loader import bench_loader

COMMANDS = {"bench": {"loader": bench_loader}}
