"""What training refuses to learn from: samples that no extraction writes, and drafters that are broken.

Extraction skips non-finite states and only writes token ids of the target's vocabulary, so a
sample with a NaN/Inf state or an id outside ``[0, vocab)`` is damaged (bytes changed after the
shard was written: ``eagle-data verify`` names it) or comes from another model's data. One such
sample makes every later loss NaN, and the run, its checkpoints, the export and τ (1.0, "an
untrained drafter") go on without a word; an id beyond the vocabulary fails in the embedding
lookup (on CUDA: a device-side assert that ends the process). :func:`bad_rows` finds such samples
on the batch's device; the training module drops them from the step, names them in the log and
counts them. :func:`check_finite_weights` refuses a drafter whose weights are not finite.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

#: the stored states a sample's check reads
STATES = ("aux_hidden_states", "hidden_states")


def bad_rows(batch: dict[str, Any], vocab_size: int) -> torch.Tensor:
    """bool [B] on the batch's device: the samples with a token id outside ``[0, vocab_size)``
    or a non-finite value in ``aux_hidden_states`` [B, T, 3H] / ``hidden_states`` [B, T, H]
    (padding rows are zeros: they pass)."""
    ids = batch["input_ids"]  # [B, T]
    bad = ((ids < 0) | (ids >= vocab_size)).any(-1)
    for k in STATES:
        if k not in batch:
            continue
        x = batch[k]
        bad |= ~torch.isfinite(x.reshape(x.shape[0], -1)).all(-1)
    return bad


def damaged_samples(samples: dict[str, dict[str, torch.Tensor]], vocab_size: int) -> list[str]:
    """The keys of decoded samples (``input_ids`` [T], states [T, ...]) that :func:`bad_rows` flags."""
    return [k for k, s in samples.items()
            if bool(bad_rows({f: s[f][None] for f in ("input_ids", *STATES) if f in s}, vocab_size)[0])]


def select_rows(batch: dict[str, Any], keep: list[int]) -> Optional[dict[str, Any]]:
    """The batch restricted to rows ``keep`` (tensors along dim 0, lists by index); None when
    ``keep`` is empty."""
    if not keep:
        return None
    idx = torch.tensor(keep, device=batch["input_ids"].device)
    return {k: (v.index_select(0, idx) if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == len(batch["input_ids"])
                else [v[i] for i in keep] if isinstance(v, list) else v) for k, v in batch.items()}


def check_finite_weights(module: torch.nn.Module, where: str) -> None:
    """Raises ValueError naming the parameters and buffers of ``module`` that hold NaN/Inf."""
    broken = [n for n, t in list(module.named_parameters()) + list(module.named_buffers())
              if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if broken:
        raise ValueError(f"{where}: the drafter's weights are not finite ({', '.join(broken[:6])}"
                         f"{', ...' if len(broken) > 6 else ''}; {len(broken)} tensor(s)): training diverged or "
                         "was fed non-finite data; this drafter cannot be evaluated or exported")
