"""One SGLang engine start at a time per GPU (:func:`gpu_start_lock`, used by
:func:`eagle_data.engines.sglang_engine.start_engine`).

SGLang sizes its KV pool from the memory free when it starts (``mem_fraction_static`` of that):
engines that start side by side on one GPU all count the same free memory, and the later ones to
allocate get almost none (BENCHMARKS.md, "SGLang on the GPU"). One at a time, each sees what the
earlier ones took.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)


def engine_gpus(kw: dict[str, Any]) -> list[str]:
    """The GPUs an engine with ``kw`` runs on, as ``CUDA_VISIBLE_DEVICES`` names them (an index or
    a UUID; unset: the index itself): ``tp_size * pp_size`` of them from ``base_gpu_id``, every
    ``gpu_id_step``-th; none on CPU."""
    if kw.get("device") == "cpu":
        return []
    n = int(kw.get("tp_size") or 1) * int(kw.get("pp_size") or 1)
    base, step = int(kw.get("base_gpu_id") or 0), int(kw.get("gpu_id_step") or 1)
    ids = range(base, base + n * step, step)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in ids]
    names = [v.strip() for v in visible.split(",") if v.strip()]
    return [names[i] for i in ids if i < len(names)]


@contextlib.contextmanager
def gpu_start_lock(kw: dict[str, Any]) -> Iterator[None]:
    """Held while an engine with ``kw`` starts: one start at a time per GPU (:func:`engine_gpus`;
    a lock file per GPU and user in the temp folder, freed when its process ends). Give each engine
    ``max_total_tokens`` so that the first leaves room for the others. Processes meet at the same
    lock when they run as the same user with the same temp folder and name the GPU alike (``0`` and
    its UUID are two names). CPU engines take no lock."""
    fds = []
    try:
        for path in sorted(start_lock_path(g) for g in set(engine_gpus(kw))):  # sorted: no deadlock
            fds.append(fd := os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("waiting for another SGLang engine to finish starting on the same GPU (lock %s)", path)
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        for fd in fds:
            os.close(fd)


def start_lock_path(gpu: str) -> Path:
    """The start lock of GPU ``gpu`` (as ``CUDA_VISIBLE_DEVICES`` names it) for this user."""
    digest = hashlib.sha256(gpu.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"eagle-data-sglang-start-{os.getuid()}-{digest}.lock"
