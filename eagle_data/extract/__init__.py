"""Writing a dataset: source records -> conversations -> tokens + loss mask -> one prefill pass
per sample (:mod:`backends`) -> shards, index parts and progress (:mod:`sink`, :mod:`rank_state`)
-> the merged manifest (:mod:`manifest`). :class:`~eagle_data.extract.config.ExtractConfig` holds
every setting; :func:`~eagle_data.extract.run.run_extract` wires the stages."""
