"""AdamW with linear warm-up and a cosine decay over steps or over wall-clock training time.

The cosine runs from ``lr`` down to ``min_lr_ratio * lr`` over ``trainer.max_steps`` (or the
estimated stepping batches), or, with ``lr_schedule_minutes``, over that much training time as
the :class:`TrainingClock` measures it (from the first training batch; a resumed run continues
the clock its checkpoint saved): for fixed-time budgets (``TimedCheckpoints``). With neither
steps nor minutes known (``max_time`` only) the lr stays constant after the warm-up.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Optional

import torch

from eagle_train.options import OptimOptions


class TrainingClock:
    """Wall-clock training time of this process since :meth:`start` (the first training batch),
    plus :attr:`before`: a resumed run's seconds from its checkpoint."""

    def __init__(self) -> None:
        self.before = 0.0
        self._t0: Optional[float] = None

    def start(self) -> None:
        """Start the clock (once; later calls keep the first start)."""
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def seconds(self) -> float:
        """Training seconds so far, across resumes."""
        return self.before + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)


def schedule_progress(clock: TrainingClock, minutes: Optional[float], total_steps: float,
                      warmup_steps: int) -> Callable[[int], float]:
    """``step -> [0, 1]``: the share of the run done, by training time (``minutes``) or by steps
    after the warm-up (``total_steps``: ``max_steps`` or the estimated stepping batches);
    neither known (an infinite ``total_steps``): 0."""
    if minutes:
        span = 60.0 * float(minutes)
        return lambda step: min(1.0, clock.seconds() / span)
    if not math.isfinite(total_steps):  # max_time only
        return lambda step: 0.0
    total = max(int(total_steps), 1)
    return lambda step: min(1.0, (step - warmup_steps) / max(total - warmup_steps, 1))


def lr_factor(step: int, warmup_steps: int, min_lr_ratio: float, progress: Callable[[int], float]) -> float:
    """The lr multiplier at ``step``: linear warm-up, then the cosine from 1 to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / max(warmup_steps, 1)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress(step)))


def adamw_with_schedule(params: Iterable[torch.nn.Parameter], lr: float, options: OptimOptions,
                        progress: Callable[[int], float]) -> dict:
    """Lightning's ``configure_optimizers`` answer: AdamW over ``params`` and a per-step
    :func:`lr_factor` schedule."""
    opt = torch.optim.AdamW(list(params), lr=lr, weight_decay=options.weight_decay, betas=tuple(options.betas))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda step: lr_factor(step, options.warmup_steps, options.min_lr_ratio, progress))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def check_schedule_minutes(minutes: Optional[float]) -> None:
    """Raises ValueError unless ``minutes`` is None or > 0."""
    if minutes is not None and not minutes > 0:
        raise ValueError(f"lr_schedule_minutes must be > 0, got {minutes!r}")
