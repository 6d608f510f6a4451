"""Reading a dataset for training: shard sources and the exact-once epoch plan (:mod:`shards`,
:mod:`plan`), spans read from the shards (:mod:`reader`), the ``IterableDataset``
(:mod:`dataset`), collation into a :class:`~eagle_data.stream.collate.Batch` (:mod:`collate`),
the loader and the Lightning DataModule, and the HF ``datasets`` index (:mod:`index`)."""
