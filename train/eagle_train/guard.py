"""What training refuses to learn from: samples that no extraction writes, and drafters that are broken.

Extraction skips non-finite states and only writes token ids of the target's vocabulary, so a
sample with a NaN/Inf state or an id outside ``[0, vocab)`` is damaged (bytes changed after the
shard was written: ``eagle-data verify`` names it) or comes from another model's data. One such
sample makes every later loss NaN, and the run, its checkpoints, the export and τ (1.0, "an
untrained drafter") go on without a word; an id beyond the vocabulary fails in the embedding
lookup (on CUDA: a device-side assert that ends the process). :func:`bad_rows` finds such samples
on the batch's device; :func:`keep_rows` drops them (and held-out keys) from the step and the
training module names them in the log and counts them. :func:`check_finite_weights` refuses a
drafter whose weights are not finite. :class:`UntaughtSteps` skips the update of a step that
taught nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Container, Optional

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


def keep_rows(batch: dict[str, Any], vocab_size: int,
              held_out: Container[str] = ()) -> tuple[Optional[dict[str, Any]], int, list[str]]:
    """The batch without the rows whose ``keys`` are in ``held_out`` and without damaged rows
    (:func:`bad_rows`), None when no row is left; its supervised tokens (``loss_mask`` [B, T]
    count); and the keys (``row i`` without keys) of the damaged rows dropped. One host transfer,
    before the step's work is launched: each row's damage flag and supervised-token count."""
    keys = batch.get("keys")
    flags, supervised = torch.stack([bad_rows(batch, vocab_size).long(), batch["loss_mask"].sum(-1).long()]).tolist()
    keep = [i for i in range(len(flags)) if keys is None or keys[i] not in held_out]
    damaged = [keys[i] if keys is not None else f"row {i}" for i in keep if flags[i]]
    keep = [i for i in keep if not flags[i]]
    out = batch if len(keep) == len(flags) else select_rows(batch, keep)
    return out, sum(supervised[i] for i in keep), damaged


class UntaughtSteps:
    """The update of a step that taught nothing on any rank (batches wholly held out or with no
    supervised token) is skipped: AdamW would still move the weights by its momentum. Counts
    them in :attr:`count`; :attr:`skipped` says whether the last step was one."""

    def __init__(self) -> None:
        self.count = 0
        self.skipped = False
        self._teaches = False  # any micro-batch of the step so far taught

    def saw(self, teaches: bool) -> None:
        """A micro-batch of the current step (accumulated until :meth:`end_step`)."""
        self._teaches |= teaches

    def end_step(self, sum_over_ranks: Callable[[float], float]) -> bool:
        """True when the step ends untaught on every rank (``sum_over_ranks`` of this rank's 0/1)."""
        teaches, self._teaches = float(self._teaches), False
        self.skipped = sum_over_ranks(teaches) == 0
        self.count += self.skipped
        return self.skipped


def check_finite_weights(module: torch.nn.Module, where: str) -> None:
    """Raises ValueError naming the parameters and buffers of ``module`` that hold NaN/Inf."""
    broken = [n for n, t in list(module.named_parameters()) + list(module.named_buffers())
              if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if broken:
        raise ValueError(f"{where}: the drafter's weights are not finite ({', '.join(broken[:6])}"
                         f"{', ...' if len(broken) > 6 else ''}; {len(broken)} tensor(s)): training diverged or "
                         "was fed non-finite data; this drafter cannot be evaluated or exported")
