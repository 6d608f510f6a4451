"""``EagleDataLoader``: a ``torch.utils.data.DataLoader`` over :class:`EagleShardDataset` that
owns epochs, mid-epoch resume and skip counts.

Resume is exact for any ``num_workers`` because every worker yields the same number of batches
per epoch (see :mod:`eagle_data.stream.plan`), so the DataLoader's in-order round-robin is regular:
rank batch ``j`` is batch ``j // K`` of worker ``j % K``. Counting delivered batches in the main
process therefore tells every worker how many of its batches to skip. ``state_dict`` /
``load_state_dict`` make it a Lightning "stateful" loader (saved in checkpoints).
"""

from __future__ import annotations

from typing import Any, Iterator

from torch.utils.data import DataLoader

from eagle_data.background import background  # noqa: F401 (also re-exported: tests, callers)
from eagle_data.stream.dataset import WORKER_ERROR, EagleShardDataset


def _identity(x):
    return x


_MALLOC_TUNED = False


def tune_malloc() -> bool:
    """Keep freed large blocks in this process's glibc heap for reuse (``M_MMAP_THRESHOLD`` and
    ``M_TRIM_THRESHOLD`` = 1 GiB) instead of unmapping them on ``free``: every batch and every
    member buffer is tens of MB, and faulting in fresh pages costs more than the copy that fills
    them. The heap then stays at its peak size (a few batches; plus ``shuffle_buffer`` samples
    for remote streams). No-op (False) where glibc's ``mallopt`` is unavailable."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return True
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        _MALLOC_TUNED = bool(libc.mallopt(-3, 1 << 30)) & bool(libc.mallopt(-1, 1 << 30))  # MMAP, TRIM
    except (OSError, AttributeError):
        return False
    return _MALLOC_TUNED


class _WorkerInit:
    def __init__(self, tune: bool, user: Any = None):
        self.tune, self.user = tune, user

    def __call__(self, worker_id: int) -> None:
        if self.tune:
            tune_malloc()
        if self.user is not None:
            self.user(worker_id)


class EagleDataLoader(DataLoader):
    """DataLoader for :class:`EagleShardDataset` (the dataset already batches).

    Each ``iter()`` is one epoch: the epoch given by :meth:`set_epoch`, else the one restored by
    :meth:`load_state_dict` (continuing mid-epoch), else the previous epoch + 1 (first: 0).
    With ``num_workers > 0`` the workers are persistent (no restart cost at epoch boundaries);
    each epoch's selection reaches them through a shared-memory cell of the dataset.

    Args:
        dataset: the batches' source; what it reads and how it batches is its
            :class:`~eagle_data.stream.config.ReadConfig` (``dataset.read``: the seed and batching
            a resume checks come from there).
        num_workers: DataLoader worker processes (0: read in the main process).
        pin_memory: pin batch tensors (``keys`` stays a list).
        prefetch_factor: batches prefetched per worker (default 2 when ``num_workers > 0``).
        timeout, multiprocessing_context, worker_init_fn: as in ``DataLoader``.
        tune_malloc: call :func:`tune_malloc` in the workers (and, with ``num_workers=0``, in
            this process when iterating): large buffers are then reused instead of being
            unmapped and faulted in again (about 2x faster collation on VMs).
        prefetch_batches: with ``num_workers=0``, batches built ahead by a background thread
            (reading overlaps the training step without moving batches between processes);
            0: build each batch when it is asked for.
    """

    def __init__(self, dataset: EagleShardDataset, num_workers: int = 0, pin_memory: bool = False,
                 prefetch_factor: int | None = None, timeout: float = 0, multiprocessing_context: Any = None,
                 worker_init_fn: Any = None, tune_malloc: bool = True, prefetch_batches: int = 2):
        super().__init__(dataset, batch_size=None, collate_fn=_identity, num_workers=num_workers,
                         pin_memory=pin_memory, prefetch_factor=prefetch_factor if num_workers else None,
                         timeout=timeout, multiprocessing_context=multiprocessing_context,
                         worker_init_fn=_WorkerInit(tune_malloc, worker_init_fn),
                         persistent_workers=num_workers > 0)
        self.tune_malloc = tune_malloc
        if prefetch_batches < 0:
            raise ValueError(f"prefetch_batches must be >= 0, got {prefetch_batches}")
        self.prefetch_batches = prefetch_batches
        dataset.set_topology(num_workers=num_workers)
        self.epoch = -1            # epoch of the current / last iteration
        self.batches = 0           # batches delivered in ``epoch``
        self.num_skipped = 0       # samples skipped by on_error="skip" (all epochs)
        self._next: tuple[int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run ``epoch`` from its start (unless a restored state is
        pending for the same epoch, which wins)."""
        if self._next is None or self._next[0] != epoch:
            self._next = (epoch, 0)

    def __len__(self) -> int:
        """Batches per rank in the whole upcoming epoch (identical on every rank), counting
        those a restored state will skip."""
        ep = self._next[0] if self._next is not None else self.epoch + 1
        return self.dataset.batches_per_rank(epoch=ep)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        ds: EagleShardDataset = self.dataset
        epoch, skip = self._next if self._next is not None else (self.epoch + 1, 0)
        self._next = None
        total = ds.batches_per_rank(epoch=epoch)
        if skip >= total:
            epoch, skip = epoch + 1, 0
        # Freeze topology in the main process (workers may not see torch.distributed).
        ds.set_topology(freeze_rank=True)
        ds.set_epoch(epoch, skip)
        if self.tune_malloc and self.num_workers == 0:
            tune_malloc()
        self.epoch, self.batches = epoch, skip
        src = super().__iter__()
        if self.num_workers == 0 and self.prefetch_batches:
            src = background(src, self.prefetch_batches)
        for batch in src:
            if WORKER_ERROR in batch:  # a worker's data error, raised here as it is
                raise batch[WORKER_ERROR]
            self.num_skipped += batch.pop("skipped", 0)
            self.batches += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "batches", "seed", "num_workers", "world_size", "num_skipped", "plan"}`` of this
        rank (``batches``: delivered in ``epoch``; ``num_skipped``: samples skipped so far; ``plan``:
        :meth:`~eagle_data.stream.dataset.EagleShardDataset.plan_facts`)."""
        epoch, batches = self._next if self._next is not None else (self.epoch, self.batches)
        return {"epoch": epoch, "batches": batches, "seed": self.dataset.read.seed,
                "num_workers": self.num_workers, "world_size": self.dataset.rank_world()[1],
                "num_skipped": self.num_skipped, "plan": self.dataset.plan_facts()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after ``state["batches"]`` batches of ``state["epoch"]`` (next ``iter()``).

        Raises:
            ValueError: seed, world size, (fixed ``batch_size``) worker count or a plan fact (batching,
                shuffling, the shards) differ: the plan would differ (with ``max_tokens`` the batches do
                not depend on the workers).
        """
        checked = [("seed", self.dataset.read.seed), ("world_size", self.dataset.rank_world()[1])]
        if self.dataset.batch_size is not None:  # fixed mode: a worker's samples depend on the worker count
            checked.append(("num_workers", self.num_workers))
        planned = {"num_workers": lambda v: max(1, int(v))}  # 0 workers plan as 1
        for k, now in checked:
            same = planned.get(k, lambda v: v)
            if k in state and same(state[k]) != same(now):
                raise ValueError(f"cannot resume: saved {k}={state[k]}, now {now} (the epoch plan would differ)")
        saved, now = state.get("plan") or {}, self.dataset.plan_facts()  # states written before: not checked
        for k in sorted(saved):
            if saved[k] != now.get(k):
                raise ValueError(f"cannot resume: saved {k}={saved[k]!r}, now {now.get(k)!r} (the epoch plan would "
                                 "differ and samples would be skipped or repeated; resume with the saved settings "
                                 "and data)")
        self.num_skipped = int(state.get("num_skipped", 0))
        if state["epoch"] < 0:
            self._next = None
            return
        self._next = (int(state["epoch"]), int(state["batches"]))
