"""``EagleDataModule``: Lightning wiring of :class:`~eagle_data.stream.dataset.EagleShardDataset`.

Plain script::

    from eagle_data.stream.datamodule import EagleDataModule
    dm = EagleDataModule(train="out/ds-train", val="out/ds-val", batch_size=8, num_workers=2)
    trainer.fit(model, datamodule=dm)

YAML (the ``data`` section of ``LightningCLI``): ``configs/datamodule.yaml`` holds these
arguments; ``python -m eagle_train.cli fit --config configs/train/smollm2_cpu.yaml --data
configs/datamodule.yaml`` (or ``eagle-data train ... --data configs/datamodule.yaml``).

Epochs: the train loader is created once and each ``iter()`` is the next epoch (Lightning
iterates it once per epoch); its ``state_dict`` (epoch, batches delivered) is saved in Lightning
checkpoints, so ``trainer.fit(..., ckpt_path=...)`` continues mid-epoch without repeating or
skipping samples. Under DDP each rank reads its own disjoint part (rank/world from
``torch.distributed``); every rank gets the same number of batches.

Batches: :class:`eagle_data.stream.collate.Batch`.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import numpy as np
import torch

from lightning.pytorch import LightningDataModule

from eagle_data.checks import check_positive
from eagle_data.stream.dataset import EagleShardDataset
from eagle_data.stream.loader import EagleDataLoader


class EagleDataModule(LightningDataModule):
    """Train/val EAGLE-3 batches streamed from eagle-data shards.

    Args:
        train: training data: dataset dir(s)/URL(s) with manifest.json, or shard URLs/brace patterns.
        val: validation data (same forms), or None for no validation.
        batch_size: samples per batch; set None to batch by ``max_tokens`` instead.
        max_tokens: token budget per batch (``B * max(T)``), length-bucketed (needs index.parquet).
        max_length: truncate samples to this many tokens (None: as stored).
        num_workers: DataLoader workers per rank (None: ``min(4, CPUs - 1)``, so 1 on a 2-core machine;
            resuming needs the same count, so give it explicitly when machines differ).
        seed: shuffling seed (order = f(seed, epoch)).
        shuffle_buffer: raw samples buffered per worker for shuffling.
        shuffle_initial: samples buffered before the first is drawn (the buffer then grows).
        bucket_window: token-budget mode: samples sorted by length within windows of this many.
        max_batch_size: token-budget mode: samples per batch at most.
        pin_memory: pin batch tensors for faster host-to-GPU copies (None: when CUDA is available).
        hidden_size: expected H of the target model (checked against the manifests; None: any).
        aux_layer_ids: expected aux layer ids (checked; None: any).
        dtype: expected stored dtype, e.g. "bfloat16" (checked; None: any).
        on_error: "raise" on a corrupt shard/sample, or "skip" to count and continue.
        read_threads: threads per loader process reading samples into a batch (None: min(4, CPUs)).
        val_batch_size: validation batch size (default: batch_size); val is never shuffled.

    Raises:
        ValueError: ``batch_size``, ``max_tokens``, ``bucket_window``, ``max_batch_size`` or
            ``val_batch_size`` below 1, ``num_workers`` below 0 (checked here, before any data is read).
    """

    def __init__(self, train: Union[str, list[str]], val: Optional[Union[str, list[str]]] = None,
                 batch_size: Optional[int] = 8, max_tokens: Optional[int] = None,
                 max_length: Optional[int] = None, num_workers: Optional[int] = None, seed: int = 0, shuffle_buffer: int = 64,
                 shuffle_initial: int = 16, bucket_window: int = 256, max_batch_size: int = 256,
                 pin_memory: Optional[bool] = None,
                 hidden_size: Optional[int] = None, aux_layer_ids: Optional[list[int]] = None,
                 dtype: Optional[str] = None, on_error: str = "raise", val_batch_size: Optional[int] = None,
                 read_threads: Optional[int] = None):
        super().__init__()
        check_positive(batch_size=batch_size, max_tokens=max_tokens, bucket_window=bucket_window,
                       max_batch_size=max_batch_size, val_batch_size=val_batch_size)
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.save_hyperparameters()
        if num_workers is None:
            num_workers = min(4, max(0, (os.cpu_count() or 1) - 1))
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if max_tokens is not None:
            batch_size = None
        self.cfg = dict(batch_size=batch_size, max_tokens=max_tokens, max_length=max_length, seed=seed,
                        shuffle_buffer=shuffle_buffer, shuffle_initial=shuffle_initial, bucket_window=bucket_window, max_batch_size=max_batch_size,
                        hidden_size=hidden_size, aux_layer_ids=aux_layer_ids, dtype=dtype, on_error=on_error,
                        read_threads=read_threads)
        self.train_sources, self.val_sources = train, val
        self.num_workers, self.pin_memory, self.val_batch_size = num_workers, pin_memory, val_batch_size
        self._train: Optional[EagleDataLoader] = None
        self._val: Optional[EagleDataLoader] = None

    def _loader(self, sources, **over: Any) -> EagleDataLoader:
        ds = EagleShardDataset(sources, **{**self.cfg, **over})
        return EagleDataLoader(ds, num_workers=self.num_workers, pin_memory=self.pin_memory)

    def hold_to(self, hidden_size: int, aux_layer_ids: Optional[list[int]]) -> list[int]:
        """Expect these model facts from every source (the drafter's; loaders built before are
        dropped so that none escapes the check); ``aux_layer_ids`` None: take the training
        data's and expect them from the validation data. Returns the aux layer ids.

        Raises:
            ValueError: this module was given other facts, or a manifest differs (names it)."""
        for name, mine in (("hidden_size", hidden_size), ("aux_layer_ids", aux_layer_ids)):
            theirs = self.cfg.get(name)
            if mine is not None and theirs is not None and [int(v) for v in np.atleast_1d(theirs)] != \
                    [int(v) for v in np.atleast_1d(mine)]:
                raise ValueError(f"data.{name} is {theirs}, the drafter's is {mine}")
            if mine is not None:
                self.cfg[name] = mine
        self._train = self._val = None
        if aux_layer_ids is None:
            self.cfg["aux_layer_ids"] = list(self.train_dataloader().dataset.facts["aux_layer_ids"])
        return list(self.cfg["aux_layer_ids"])

    def train_dataloader(self) -> EagleDataLoader:
        """The (cached) training loader; each iteration is the next epoch."""
        if self._train is None:
            self._train = self._loader(self.train_sources)
        return self._train

    def val_dataloader(self) -> Any:
        """Validation loader (no shuffling), or ``[]`` when ``val`` is None."""
        if self.val_sources is None:
            return []
        if self._val is None:
            over: dict[str, Any] = {"shuffle": False}
            if self.val_batch_size is not None:
                over.update(batch_size=self.val_batch_size, max_tokens=None)
            self._val = self._loader(self.val_sources, **over)
        return self._val

    def set_epoch(self, epoch: int) -> None:
        """Force the next training epoch's index (normally automatic)."""
        self.train_dataloader().set_epoch(epoch)
