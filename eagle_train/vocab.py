"""Draft vocabulary: the ``N`` most frequent supervised target tokens, as SGLang's ``d2t``/``t2d``.

Counts come from the dataset index (``loss_token_ids`` / ``loss_token_counts``: a sparse
histogram of the token ids under ``loss_mask == 1`` per sample, see
:data:`eagle_data.format.schema.INDEX_COLUMNS`), so building the vocabulary never reads a shard.

Selection rule (deterministic):

1. tokens are ranked by count, higher first; ties go to the lower token id;
2. the first ``N`` with a count > 0 are chosen;
3. if fewer than ``N`` distinct tokens were seen, the rest is filled with the lowest
   unused token ids (0, 1, 2, ... skipping chosen ones);
4. draft ids are assigned in ascending target-id order, so ``i + d2t[i]`` is ascending.

Saved tensors (safetensors, the layout SGLang's ``LlamaForCausalLMEagle3.load_weights`` reads
and SpecForge writes):

* ``d2t``: int64 ``[N]``, offsets: ``target_id = draft_id + d2t[draft_id]``;
* ``t2d``: bool ``[V]``, ``True`` exactly at the chosen target ids.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable, Mapping

import torch

log = logging.getLogger(__name__)

VOCAB_RULE = "count desc, then token id asc; fill with lowest unused ids; draft ids in target-id order"


def vocab_file(dataset_dir: str | Path, size: int) -> Path:
    """Default location of the mapping: ``DIR/draft_vocab_{size}.safetensors``."""
    return Path(dataset_dir) / f"draft_vocab_{size}.safetensors"


def count_loss_tokens(dataset_dir: str | Path, vocab_size: int, keys: Iterable[str] | None = None,
                      exclude_keys: Iterable[str] | None = None) -> torch.Tensor:
    """Histogram of supervised token ids from the index (no shard pass).

    Args:
        dataset_dir: dataset directory with ``index.parquet`` (or ``index/*.parquet``).
        vocab_size: ``V`` of the target.
        keys: only count these sample keys (``None``: all).
        exclude_keys: never count these (e.g. a held-out split).

    Returns:
        int64 ``[V]`` counts.
    """
    from eagle_data.stream.index import load_index

    ds = load_index(dataset_dir)
    keep = set(keys) if keys is not None else None
    drop = set(exclude_keys or ())
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    cols = ds.select_columns(["key", "loss_token_ids", "loss_token_counts"])
    for row in cols:
        if (keep is not None and row["key"] not in keep) or row["key"] in drop:
            continue
        ids = torch.as_tensor(row["loss_token_ids"], dtype=torch.int64)
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"{dataset_dir}: sample {row['key']} has token id {int(ids.max())} >= V={vocab_size}")
        counts.index_add_(0, ids, torch.as_tensor(row["loss_token_counts"], dtype=torch.int64))
    return counts


def select_vocab(counts: torch.Tensor | Mapping[int, int], vocab_size: int, size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the module's selection rule.

    Args:
        counts: int ``[V]`` histogram, or a sparse ``{token_id: count}``.
        vocab_size: ``V`` (target vocabulary size).
        size: ``N`` (draft vocabulary size), ``1 <= N <= V``.

    Returns:
        ``(d2t int64 [N], t2d bool [V])``.
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocab size {size} must be in [1, V={vocab_size}]")
    if isinstance(counts, Mapping):
        dense = torch.zeros(vocab_size, dtype=torch.int64)
        for k, v in counts.items():
            dense[int(k)] += int(v)
        counts = dense
    counts = counts.to(torch.int64)
    if counts.shape != (vocab_size,):
        raise ValueError(f"counts shape {tuple(counts.shape)} != ({vocab_size},)")
    # stable sort on -count keeps ascending id order among equal counts
    order = torch.sort(-counts, stable=True).indices
    seen = order[counts[order] > 0][:size]
    chosen = torch.zeros(vocab_size, dtype=torch.bool)
    chosen[seen] = True
    missing = size - int(seen.numel())
    if missing:
        chosen[(~chosen).nonzero().flatten()[:missing]] = True
    target_ids = chosen.nonzero().flatten()  # ascending
    d2t = target_ids - torch.arange(size, dtype=torch.int64)
    return d2t, chosen


def save_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, meta: dict | None = None) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    md = {"rule": VOCAB_RULE, "draft_vocab_size": str(d2t.numel()), "vocab_size": str(t2d.numel())}
    md.update({k: json.dumps(v) for k, v in (meta or {}).items()})
    save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp), metadata=md)
    tmp.replace(path)
    return path


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``(d2t int64 [N], t2d bool [V])`` from a safetensors file."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    return t["d2t"].to(torch.int64), t["t2d"].to(torch.bool)


def build_vocab(dataset_dir: str | Path, size: int, out: str | Path | None = None, rebuild: bool = False,
                vocab_size: int | None = None, exclude_keys: Iterable[str] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, Path]:
    """Build (or reuse) the draft vocabulary of a dataset.

    Args:
        dataset_dir: dataset directory (manifest.json gives ``vocab_size``).
        size: ``N``.
        out: output file (default :func:`vocab_file`).
        rebuild: recompute even if ``out`` exists.
        vocab_size: override ``V`` (default from the manifest).
        exclude_keys: sample keys not to count (held-out split).

    Returns:
        ``(d2t, t2d, path)``.
    """
    from eagle_data.format.records import read_manifest

    path = Path(out) if out else vocab_file(dataset_dir, size)
    V = int(vocab_size or read_manifest(dataset_dir)["vocab_size"])
    if path.exists() and not rebuild:
        d2t, t2d = load_vocab(path)
        if d2t.numel() == size and t2d.numel() == V:
            log.info("reusing draft vocab %s", path)
            return d2t, t2d, path
        log.warning("%s has N=%d V=%d, wanted N=%d V=%d: rebuilding", path, d2t.numel(), t2d.numel(), size, V)
    counts = count_loss_tokens(dataset_dir, V, exclude_keys=exclude_keys)
    d2t, t2d = select_vocab(counts, V, size)
    total = int(counts.sum())
    covered = int(counts[t2d].sum())
    meta = {"loss_tokens": total, "covered_loss_tokens": covered, "distinct_tokens": int((counts > 0).sum())}
    save_vocab(path, d2t, t2d, meta)
    log.info("draft vocab N=%d covers %.2f%% of %d supervised tokens -> %s",
             size, 100.0 * covered / max(total, 1), total, path)
    return d2t, t2d, path
