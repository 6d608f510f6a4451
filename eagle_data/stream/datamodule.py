"""``EagleDataModule``: Lightning wiring of :class:`~eagle_data.stream.dataset.EagleShardDataset`.

Plain script::

    from eagle_data.stream.datamodule import EagleDataModule
    dm = EagleDataModule(train="out/ds-train", val="out/ds-val", max_tokens=16384, num_workers=2)
    trainer.fit(model, datamodule=dm)

YAML (the ``data`` section of ``LightningCLI``): ``configs/datamodule.yaml`` holds these
arguments (the reading options are the fields of :class:`~eagle_data.stream.config.ReadConfig`);
``python -m eagle_train.cli fit --config configs/train/smollm2_cpu.yaml --data
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
from eagle_data.stream.config import ReadConfig
from eagle_data.stream.dataset import EagleShardDataset
from eagle_data.stream.loader import EagleDataLoader


class EagleDataModule(LightningDataModule):
    """Train/val EAGLE-3 batches streamed from eagle-data shards.

    Args:
        train: training data: dataset dir(s)/URL(s) with manifest.json, or shard URLs/brace patterns.
        val: validation data (same forms), or None for no validation.
        num_workers: DataLoader workers per rank (None: ``min(4, CPUs - 1)``, so 1 on a 2-core machine;
            resuming needs the same count, so give it explicitly when machines differ).
        pin_memory: pin batch tensors for faster host-to-GPU copies (None: when CUDA is available).
        val_batch_size: validation batch size (default: as the training data is batched); validation
            is never shuffled.
        **fields: how both are read: the fields of :class:`~eagle_data.stream.config.ReadConfig`
            (``batch_size``, ``max_tokens``, ``max_length``, ``seed``, ...; on the command line
            ``--data.max_tokens 16384``), declared and documented there.

    Raises:
        ValueError: a bad read field (names it, see :class:`~eagle_data.stream.config.ReadConfig`),
            ``val_batch_size`` below 1, ``num_workers`` below 0 (checked here, before any data is read).
    """

    def __init__(self, train: Union[str, list[str]], val: Optional[Union[str, list[str]]] = None,
                 num_workers: Optional[int] = None, pin_memory: Optional[bool] = None,
                 val_batch_size: Optional[int] = None, **fields: Any):
        super().__init__()
        #: how the training and validation data are read (the validation loader: unshuffled)
        self.read = ReadConfig(**fields)  # jsonargparse makes --data.<field> of ReadConfig's fields from this call
        check_positive(val_batch_size=val_batch_size)
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.save_hyperparameters()
        if num_workers is None:
            num_workers = min(4, max(0, (os.cpu_count() or 1) - 1))
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.train_sources, self.val_sources = train, val
        self.num_workers, self.pin_memory, self.val_batch_size = num_workers, pin_memory, val_batch_size
        self._train: Optional[EagleDataLoader] = None
        self._val: Optional[EagleDataLoader] = None

    def _loader(self, sources, read: ReadConfig) -> EagleDataLoader:
        return EagleDataLoader(EagleShardDataset(sources, read), num_workers=self.num_workers,
                               pin_memory=self.pin_memory)

    def hold_to(self, hidden_size: int, aux_layer_ids: Optional[list[int]]) -> list[int]:
        """Expect these model facts from every source (the drafter's; loaders built before are
        dropped so that none escapes the check); ``aux_layer_ids`` None: take the training
        data's and expect them from the validation data. Returns the aux layer ids.

        Raises:
            ValueError: this module was given other facts, or a manifest differs (names it)."""
        for name, mine in (("hidden_size", hidden_size), ("aux_layer_ids", aux_layer_ids)):
            theirs = getattr(self.read, name)
            if mine is not None and theirs is not None and [int(v) for v in np.atleast_1d(theirs)] != \
                    [int(v) for v in np.atleast_1d(mine)]:
                raise ValueError(f"data.{name} is {theirs}, the drafter's is {mine}")
            if mine is not None:
                self.read = self.read.replace(**{name: mine})
        self._train = self._val = None
        if aux_layer_ids is None:
            ids = self.train_dataloader().dataset.facts["aux_layer_ids"]
            self.read = self.read.replace(aux_layer_ids=list(ids))
        return list(self.read.aux_layer_ids)

    def train_dataloader(self) -> EagleDataLoader:
        """The (cached) training loader; each iteration is the next epoch."""
        if self._train is None:
            self._train = self._loader(self.train_sources, self.read)
        return self._train

    def val_dataloader(self) -> Any:
        """Validation loader (no shuffling), or ``[]`` when ``val`` is None."""
        if self.val_sources is None:
            return []
        if self._val is None:
            read = self.read.replace(shuffle=False)
            if self.val_batch_size is not None:
                read = read.replace(batch_size=self.val_batch_size, max_tokens=None)
            self._val = self._loader(self.val_sources, read)
        return self._val

    def set_epoch(self, epoch: int) -> None:
        """Force the next training epoch's index (normally automatic)."""
        self.train_dataloader().set_epoch(epoch)
