"""Where a benchmark writes: checks of ``--out`` / ``--json_out`` before any work, and a private
scratch folder on the measured disk that is removed whatever happens (the user's own files in
``--out`` are never touched, and a leftover of an interrupted run is never read as this run's)."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def _missing(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist, deepest first."""
    out = []
    for p in (path, *path.parents):
        if p.exists():
            break
        out.append(p)
    return out


def check_outputs(out: str | None, json_out: str | None) -> None:
    """Refuse an ``out`` that is not a folder or cannot be made, and a ``json_out`` that cannot be written.

    Raises:
        ValueError: naming the setting.
    """
    if out is not None:
        p = Path(out).absolute()
        made = _missing(p)
        top = made[-1].parent if made else p
        if not top.is_dir():
            raise ValueError(f"out {out!r} is not a folder (the benchmark writes its files in a folder on the disk)")
        if not os.access(top, os.W_OK | os.X_OK):
            raise ValueError(f"out {out!r}: {top} is not writable")
    if json_out is not None:
        p = Path(json_out).absolute()
        if p.is_dir():
            raise ValueError(f"json_out {json_out!r} is a folder; give a file name")
        if not p.parent.is_dir():
            raise ValueError(f"json_out {json_out!r}: its folder does not exist")
        if not os.access(p.parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
            raise ValueError(f"json_out {json_out!r} is not writable")


@contextmanager
def scratch(out: str | None, prefix: str) -> Iterator[Path]:
    """A fresh folder inside ``out`` (created if missing; default: the system's temp folder),
    removed on exit, and the folders on the way to it that this created, when left empty."""
    made = _missing(Path(out).absolute()) if out is not None else []
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
    try:
        root = Path(tempfile.mkdtemp(prefix=prefix, dir=out))
        try:
            yield root
        finally:
            shutil.rmtree(root, ignore_errors=True)
    finally:
        for p in made:  # deepest first
            try:
                p.rmdir()
            except OSError:
                break
