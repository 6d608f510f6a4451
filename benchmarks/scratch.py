"""Where a benchmark writes: checks of ``--out`` / ``--json_out`` before any work, and a private
scratch folder on the measured disk that is removed whatever happens (the user's own files in
``--out`` are never touched, and a leftover of an interrupted run is never read as this run's)."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def check_outputs(out: str | None, json_out: str | None) -> None:
    """Refuse an ``out`` that is not a folder and a ``json_out`` that cannot be written.

    Raises:
        ValueError: naming the setting.
    """
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise ValueError(f"out {out!r} is not a folder (the benchmark writes its files in a folder on the disk)")
    if json_out is not None:
        p = Path(json_out)
        if p.is_dir():
            raise ValueError(f"json_out {json_out!r} is a folder; give a file name")
        if not p.resolve().parent.is_dir():
            raise ValueError(f"json_out {json_out!r}: its folder does not exist")


@contextmanager
def scratch(out: str | None, prefix: str) -> Iterator[Path]:
    """A fresh folder inside ``out`` (created if missing; default: the system's temp folder),
    removed on exit, and ``out`` too when this created it and it is left empty."""
    made = out is not None and not Path(out).exists()
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=prefix, dir=out))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if made:
            try:
                Path(out).rmdir()
            except OSError:
                pass
