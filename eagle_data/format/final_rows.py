"""Final hidden states only where they teach: the ``final_rows = "taught"`` layout (schema 3).

The final state ``f[t]`` is the teacher of the token ``x[t+1]`` (``lm_head(f[t])`` are the
target's logits for it). EAGLE-3's training-time test reads ``f[t]`` only where ``x[t+1]`` is
supervised: step ``k`` at position ``p`` uses the teacher ``f[p+k]`` iff ``loss_mask[p+k+1] == 1``
(:mod:`eagle_train.loss`). So a sample may store ``hidden_states`` (and its fp8 scale) only at
the *taught* rows

    ``taught[t] = loss_mask[t + 1] == 1``  (``t = 0 .. T-2``; never the last row),

in ascending order: ``[n_taught, H]`` instead of ``[T, H]``. No index is stored: the loss mask
gives the rows, and the row count tells the layouts apart (``n_taught <= T - 1 < T``).
Readers scatter the rows back (:func:`expand`) and fill the other rows with zeros (fp8: value 0,
scale 1), which no supervised loss term reads. Extraction writes it with
``--final_rows taught``; the manifest records ``final_rows``.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle_data.format.fp8 import scale_name
from eagle_data.format.names import FINAL_ROWS  # noqa: F401 (re-exported: its readers import it here)

FIELD = "hidden_states"


def taught(loss_mask: torch.Tensor) -> torch.Tensor:
    """bool [T]: the rows whose final state teaches a supervised token (``loss_mask[t + 1] == 1``).

    Args:
        loss_mask: [T] any integer or bool dtype.
    """
    out = torch.zeros(loss_mask.shape[0], dtype=torch.bool)
    out[:-1] = loss_mask[1:] != 0
    return out


def num_taught(loss_mask: torch.Tensor) -> int:
    """How many rows :func:`taught` selects."""
    return int((loss_mask[1:] != 0).sum())


def layout(num_rows: int, loss_mask: torch.Tensor) -> str | None:
    """``"all"`` (``num_rows == T``), ``"taught"`` (``num_rows`` = the taught rows of ``loss_mask``)
    or None (neither: the sample is broken)."""
    if num_rows == loss_mask.shape[0]:
        return "all"
    return "taught" if num_rows == num_taught(loss_mask) else None


def select(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A sample with every row of ``hidden_states`` (and its fp8 scale) -> only its taught rows."""
    rows = taught(tensors["loss_mask"])
    out = dict(tensors)
    for k in (FIELD, scale_name(FIELD)):
        if k in out:
            out[k] = out[k][rows]
    return out


def expand(tensors: dict[str, Any]) -> dict[str, Any]:
    """A decoded sample in either layout -> every row: the taught rows scattered back to their
    positions, zeros elsewhere (fp8: scale 1). A sample with every row is returned as it is (no
    copy); in the taught layout the rows are read (a lazy :class:`~eagle_data.format.payload.FileTensor`
    too) and the result is a new tensor ``[T, H]`` in the stored dtype.

    Assumes the layout was validated (:func:`eagle_data.format.schema.validate_tensors`).
    """
    fin, mask = tensors[FIELD], tensors["loss_mask"]
    if fin.shape[0] == mask.shape[0]:
        return tensors
    rows = taught(mask)
    out = dict(tensors)
    for k, fill in ((FIELD, 0.0), (scale_name(FIELD), 1.0)):
        if k not in out:
            continue
        src = out[k] if isinstance(out[k], torch.Tensor) else out[k].materialize()
        full = torch.full((mask.shape[0], *src.shape[1:]), fill, dtype=torch.float32).to(src.dtype)
        full[rows] = src
        out[k] = full
    return out
