"""``ReadConfig``: how a dataset is read for training, declared once for
:class:`~eagle_data.stream.dataset.EagleShardDataset`, :class:`~eagle_data.stream.loader.EagleDataLoader`
(through its dataset) and :class:`~eagle_data.stream.datamodule.EagleDataModule` (``--data.<field>``).

Plain script::

    from eagle_data.stream.config import ReadConfig
    from eagle_data.stream.dataset import EagleShardDataset
    ds = EagleShardDataset("out/ds", read=ReadConfig(max_tokens=16384, max_length=2048))
    ds = EagleShardDataset("out/ds", max_tokens=16384, max_length=2048)   # the same: fields as keywords
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from eagle_data.checks import check_positive
from eagle_data.format.names import STORAGE_DTYPE_NAMES


@dataclass(frozen=True)
class ReadConfig:
    """What is read and how it is batched, shuffled and checked; every sample exactly once per
    epoch across ranks x workers, whatever these settings.

    Batching: ``max_tokens`` (a token budget) or ``batch_size`` (a fixed count). Given both, the
    token budget wins and ``batch_size`` is ignored, so a command line's ``--data.max_tokens``
    switches a config that sets ``batch_size``. Given neither: ``ReadConfig()`` and
    :class:`~eagle_data.stream.datamodule.EagleDataModule` batch 8 samples (the DataModule's
    default), while :class:`~eagle_data.stream.dataset.EagleShardDataset` built from loose fields
    (``EagleShardDataset(path)``, ``read=None`` or a dict) refuses: a plain script says how it
    batches (:meth:`of`). Both ``None``: refused.

    Args:
        batch_size: samples per batch (fixed-size batching; ignored when ``max_tokens`` is given,
            so a command line can switch a config to a token budget). With ``batch_size=1`` and a
            sample count not divisible by the ranks, the last ``N % ranks`` positions of each
            epoch's permuted stream are dropped (warned once), so every rank yields as many
            batches; every other setting sees each sample exactly once.
        max_tokens: token budget ``B * max(T)`` per batch, length-bucketed (None: fixed
            ``batch_size``). Needs ``index.parquet`` (``num_tokens`` is read once, 4 bytes per sample).
        max_length: truncate samples to this many tokens (None: as stored).
        shuffle: permute the shards per epoch and shuffle the samples (a validation loader of
            :class:`~eagle_data.stream.datamodule.EagleDataModule` never shuffles).
        seed: base seed; the order is a function of ``(seed, epoch, slot)`` only.
        shuffle_buffer: samples held per worker for shuffling (local shards: descriptors of a few
            hundred bytes, the data waits in the page cache; remote streams: the samples' bytes, so
            memory = this x sample size).
        shuffle_initial: samples buffered before the first one is drawn (webdataset's ``initial``);
            the buffer then grows to ``shuffle_buffer`` while reading runs ahead of the batches.
        bucket_window: token mode: samples sorted by length within windows of this many.
        max_batch_size: token mode: samples per batch at most.
        hidden_size: expected H of the target model (checked against the manifests; None: any).
        aux_layer_ids: expected aux layer ids (checked; None: any).
        dtype: expected stored dtype, e.g. "bfloat16" (checked; None: any; fp8 storage is handed
            out as bfloat16).
        on_error: "raise" on an unreadable shard/sample, or "skip" to count it and keep going.
        read_threads: threads per loader process that read/copy the samples' hidden states into a
            batch in parallel (``preadv`` and memory copies release the GIL); None: ``min(4, CPUs)``.

    Raises:
        ValueError: naming the field: ``batch_size`` and ``max_tokens`` both None, an integer
            below 1 (``batch_size``, ``max_tokens``, ``bucket_window``, ``max_batch_size``,
            ``max_length``, ``read_threads``, ``shuffle_initial``), ``shuffle_buffer`` below 0, an
            unknown ``dtype`` or ``on_error``.
    """

    batch_size: Optional[int] = 8
    max_tokens: Optional[int] = None
    max_length: Optional[int] = None
    shuffle: bool = True
    seed: int = 0
    shuffle_buffer: int = 64
    shuffle_initial: int = 16
    bucket_window: int = 256
    max_batch_size: int = 256
    hidden_size: Optional[int] = None
    aux_layer_ids: Optional[list[int]] = None
    dtype: Optional[str] = None
    on_error: str = "raise"
    read_threads: Optional[int] = None

    def __post_init__(self) -> None:
        if self.batch_size is None and self.max_tokens is None:
            raise ValueError("give batch_size or max_tokens (both are None)")
        check_positive(batch_size=self.batch_size, max_tokens=self.max_tokens, bucket_window=self.bucket_window,
                       max_batch_size=self.max_batch_size)
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1 (or None: keep all), got {self.max_length}")
        if self.shuffle_buffer < 0 or self.shuffle_initial < 1:
            raise ValueError(f"shuffle_buffer must be >= 0 and shuffle_initial >= 1, got {self.shuffle_buffer}, "
                             f"{self.shuffle_initial}")
        if self.dtype is not None and self.dtype not in STORAGE_DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {sorted(STORAGE_DTYPE_NAMES)} (or None: the manifest's), "
                             f"got {self.dtype!r}")
        if self.on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if self.read_threads is not None and self.read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {self.read_threads}")

    @property
    def fixed_batch_size(self) -> Optional[int]:
        """Samples per batch in fixed mode (``batch_size``); None in token mode (``max_tokens`` given)."""
        return None if self.max_tokens is not None else self.batch_size

    def replace(self, **changes: Any) -> ReadConfig:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, read: ReadConfig | dict[str, Any] | None = None, **changes: Any) -> ReadConfig:
        """``read`` (a config, or a dict of its fields as in YAML) with ``changes``: how
        :class:`~eagle_data.stream.dataset.EagleShardDataset` takes its settings. Loose fields
        (``read`` None or a dict, with ``changes``) must name ``batch_size`` or ``max_tokens``;
        a ``ReadConfig`` brings its own batching.

        Raises:
            ValueError: loose fields give neither ``batch_size`` nor ``max_tokens``.
            TypeError: a name that is no field.
        """
        if read is None or isinstance(read, dict):
            given = {**(read or {}), **changes}
            config = cls(**given)  # a name that is no field: TypeError first
            if given.get("batch_size") is None and given.get("max_tokens") is None:
                raise ValueError("give batch_size or max_tokens: the dataset has no default batching "
                                 "(read=ReadConfig() batches 8 samples, as the DataModule does)")
            return config
        return read.replace(**changes) if changes else read
