"""Reading a dataset for training: what is read and how (:class:`~eagle_data.stream.config.ReadConfig`,
one set of options for the dataset, the loader and the DataModule), shard sources and the exact-once
epoch plan (:mod:`shards`, :mod:`plan`), spans read from the shards (:mod:`reader`), the
``IterableDataset`` (:mod:`dataset`), collation into a :class:`~eagle_data.stream.collate.Batch`
(:mod:`collate`), the loader and the Lightning DataModule, and the HF ``datasets`` index (:mod:`index`)."""
