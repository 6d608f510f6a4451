"""torch.compile with an eager fallback, for the training step's elementwise-heavy pieces.

The drafter is small (SmolLM2's: H = 576), so an eager step is a long train of small kernels
(norms, rope, SiLU, residual adds, casts) the GPU waits on; compiling a piece fuses them. A
piece is compiled once per process (``dynamic=True``: real batches vary in ``B`` and ``T``) and
only on CUDA (CPU runs and tests stay eager unless ``force``). If inductor fails on a machine,
the piece falls back to eager for the rest of the process with one warning: the math is the
same, only slower. This covers the forward call; a compiled region's backward is compiled when
it first runs, outside that call: training's compile warm-up runs the backward and turns the
compiled layer off when it fails there (``EagleDrafterModule.warm_up_compiles``).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)
_cache: dict[str, Callable] = {}
_broken: set[str] = set()


def compiled(name: str, eager: Callable, device: torch.device, force: bool = False) -> Callable:
    """``eager`` compiled (``torch.compile(eager, dynamic=True)``, cached under ``name``) when
    ``device`` is CUDA (or ``force``), else ``eager`` itself; a compiled call that raises marks
    ``name`` broken and reruns eagerly (that call and every later one)."""
    if (device.type != "cuda" and not force) or name in _broken:
        return eager
    if name not in _cache:
        _cache[name] = torch.compile(eager, dynamic=True)
    fn = _cache[name]

    def run(*args):
        if name in _broken:
            return eager(*args)
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - inductor failures of any kind: fall back
            _broken.add(name)
            log.warning("compiled %s failed (%s: %s); using eager", name, type(e).__name__, e)
            return eager(*args)
    return run
