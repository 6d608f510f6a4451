"""The dataset card (``README.md`` in a dataset directory) that makes ``datasets.load_dataset(DIR)``
read one row per sample.

Without it, HF ``datasets`` loads every parquet file below the folder (``index.parquet`` and the
per-shard parts in ``index/``), i.e. each sample twice. The card's ``default`` config names
``index.parquet`` only (one row per sample, :data:`eagle_data.format.schema.INDEX_SCHEMA`). The
shards are read with HF's ``webdataset`` builder, named explicitly (one folder has one builder
type, so they cannot be a second config beside the parquet index):
``load_dataset("webdataset", data_files="DIR/*.tar")``, one row per sample;
:func:`eagle_data.stream.dataset.decode_hf_example` turns a row into tensors.
"""

from __future__ import annotations

from typing import Any

from eagle_data.format.layout import INDEX_NAME, SHARD_GLOB


def _final_rows_note(manifest: dict[str, Any]) -> str:
    if manifest["final_rows"] == "all":
        return ""
    return ("\nFinal states are stored only where they teach (`final_rows: taught`): `hidden_states` holds the "
            "rows t with `loss_mask[t+1] == 1`, in order, not one row per token; `decode_hf_example` scatters "
            "them back to [T, H] with zeros elsewhere.\n")


def dataset_card(manifest: dict[str, Any]) -> str:
    """The card's text for a merged dataset (YAML front matter + a short description)."""
    return f"""---
configs:
- config_name: default
  data_files: {INDEX_NAME}
tags:
- eagle-data
- eagle3
---
# EAGLE-3 training data (eagle-data)

Target `{manifest.get("model_path")}`, {manifest.get("num_samples")} samples, {manifest.get("num_tokens")} tokens,
hidden states `{manifest.get("dtype")}` (H={manifest.get("hidden_size")}, aux layers
{manifest.get("aux_layer_ids")}: {manifest.get("layer_id_convention")}). Written by eagle-data
(schema {manifest.get("schema_version")}); `manifest.json` holds the run's configuration and counts.
{_final_rows_note(manifest)}
```python
import datasets
index = datasets.load_dataset("DIR", split="train")             # one row per sample (index.parquet)
rows = datasets.load_dataset("webdataset", data_files="DIR/{SHARD_GLOB}", split="train")  # the shards
from eagle_data.stream.dataset import decode_hf_example
sample = decode_hf_example(rows[0])                             # tensors
```
"""
