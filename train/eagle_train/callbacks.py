"""Training callbacks: checkpoints at fixed training-time marks (tau after 2, 4, 8 minutes)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl


class TimedCheckpoints(pl.Callback):
    """Save ``DIR/at_{m}min.ckpt`` when the training time first reaches ``m`` minutes, for each mark.

    Training time is wall time since the first training batch (start-up and compilation before
    it are not counted), checked after every step; under DDP rank 0's clock decides for all.

    Args:
        minutes: the marks, e.g. ``[2, 4, 8]``.
        dirpath: where to save (default: ``trainer.default_root_dir``).
        stop_after_last: end training once the last mark is saved (a fixed-time budget).
    """

    def __init__(self, minutes: list[float], dirpath: Optional[str] = None, stop_after_last: bool = False):
        if not minutes or any(m <= 0 for m in minutes):
            raise ValueError(f"minutes must be a non-empty list of positive marks, got {minutes!r}")
        self.marks = sorted(float(m) for m in minutes)
        self.dirpath = dirpath
        self.stop_after_last = stop_after_last
        self._t0: Optional[float] = None
        self.saved: list[str] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        elapsed = (time.perf_counter() - self._t0) / 60 if self._t0 is not None else 0.0
        elapsed = trainer.strategy.broadcast(elapsed, src=0)  # every rank decides alike (DDP: a collective)
        while self.marks and elapsed >= self.marks[0]:
            m = self.marks.pop(0)
            path = Path(self.dirpath or trainer.default_root_dir) / f"at_{m:g}min.ckpt"
            trainer.save_checkpoint(str(path), weights_only=False)  # full (resumable); says so
            self.saved.append(str(path))
            if not self.marks and self.stop_after_last:
                trainer.should_stop = True
