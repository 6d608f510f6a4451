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

The file's metadata ``built_from`` records the inputs (dataset shards, ``N``, ``V``, rule,
excluded keys); :func:`build_vocab` reuses an existing file only when they are the same, and
refuses otherwise (also for files without the record) until asked to rebuild.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Iterable, Mapping, Optional

import torch

log = logging.getLogger(__name__)

VOCAB_RULE = "count desc, then token id asc; fill with lowest unused ids; draft ids in target-id order"


def vocab_file_name(size: int) -> str:
    """Default file name of the mapping (``eagle-data vocab`` writes it into the current directory,
    never into the dataset directory, which may be read-only or shared)."""
    return f"draft_vocab_{size}.safetensors"


def read_key_list(path: str | Path, what: str = "exclude_keys") -> list[str]:
    """Read a JSON file holding a list of sample keys (e.g. a held-out split).

    Raises:
        ValueError: the file is missing or unreadable, not JSON, not a list, or holds a
            non-string entry; names ``what`` and the file.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{what}: {p} does not exist (give a JSON file holding a list of sample keys)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what}: {p} is not a JSON file holding a list of sample keys: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"{what}: {p} holds a JSON {type(data).__name__}, expected a list of sample keys")
    return sorted(key_set(data, f"{what} ({p})"))


def key_set(keys: Iterable[str], what: str) -> set[str]:
    """``keys`` as a set, refusing entries that are not strings (naming ``what``)."""
    keys = list(keys)
    bad = [k for k in keys if not isinstance(k, str)]
    if bad:
        raise ValueError(f"{what}: sample keys must be strings, got {bad[:3]!r}")
    return set(keys)


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

    Raises:
        ValueError: a key in ``keys`` / ``exclude_keys`` is not in the index (a typo would
            silently count a held-out sample), or a token id ``>= V``.
    """
    from eagle_data.stream.index import load_index

    cols = load_index(dataset_dir).select_columns(["key", "loss_token_ids", "loss_token_counts"])
    keep = key_set(keys, "keys") if keys is not None else None
    drop = key_set(exclude_keys or (), "exclude_keys")
    _check_known(dataset_dir, set(cols["key"]), {"keys": keep or set(), "exclude_keys": drop})
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for row in cols:
        if (keep is not None and row["key"] not in keep) or row["key"] in drop:
            continue
        ids = torch.as_tensor(row["loss_token_ids"], dtype=torch.int64)
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"{dataset_dir}: sample {row['key']} has token id {int(ids.max())} >= V={vocab_size}")
        counts.index_add_(0, ids, torch.as_tensor(row["loss_token_counts"], dtype=torch.int64))
    return counts


def _check_known(dataset_dir: str | Path, known: set[str], given: dict[str, set[str]]) -> None:
    for what, ks in given.items():
        unknown = sorted(ks - known)
        if unknown:
            raise ValueError(f"{what}: {len(unknown)} of {len(ks)} key(s) are not in the index of {dataset_dir}, "
                             f"e.g. {unknown[:5]}")


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
    from safetensors.torch import save

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    md = {"rule": VOCAB_RULE, "draft_vocab_size": str(d2t.numel()), "vocab_size": str(t2d.numel())}
    md.update({k: json.dumps(v) for k, v in (meta or {}).items()})
    # written with open() (mode 0666 & ~umask, like the shards), not save_file (always 0600)
    tmp.write_bytes(save({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, metadata=md))
    tmp.replace(path)
    return path


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``(d2t int64 [N], t2d bool [V])`` from a safetensors file.

    Raises:
        ValueError: the file is missing, not safetensors, or has no ``d2t``/``t2d``; names it.
    """
    from safetensors.torch import load_file

    try:
        t = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"{path}: not a draft vocabulary file ({type(e).__name__}: {e})") from e
    if "d2t" not in t or "t2d" not in t:
        raise ValueError(f"{path}: not a draft vocabulary file (tensors {sorted(t)}, expected d2t and t2d)")
    return t["d2t"].to(torch.int64), t["t2d"].to(torch.bool)


def vocab_provenance(path: str | Path) -> dict | None:
    """What a vocab file was built from (``built_from`` metadata, see :func:`build_vocab`), or
    None for a file written without it (an older eagle-data, or :func:`save_vocab` alone)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            md = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types
        raise ValueError(f"{path}: not a draft vocabulary file ({type(e).__name__}: {e})") from e
    return json.loads(md["built_from"]) if "built_from" in md else None


def dataset_facts(dataset_dir: str | Path, vocab_size: int | None = None) -> tuple[int, dict]:
    """``(V, identity)`` of a dataset from its manifest (checked with
    :func:`eagle_data.format.schema.check_manifest_compat`); ``identity`` holds a sha256 over
    the shards' names and sha256s (the exact data), ``config_hash`` and ``num_samples``.

    Raises:
        ValueError: unreadable or incompatible manifest, no usable ``vocab_size`` or ``shards``.
    """
    from eagle_data.format.records import read_manifest
    from eagle_data.format.schema import check_manifest_compat

    m = read_manifest(dataset_dir)
    where = f"{dataset_dir}/manifest.json"
    check_manifest_compat(m, where=where)
    if vocab_size is None and "vocab_size" not in m:
        raise ValueError(f"{where}: no vocab_size field (give vocab_size to set V)")
    V = m["vocab_size"] if vocab_size is None else vocab_size
    if isinstance(V, bool) or not isinstance(V, int) or V < 1:
        raise ValueError(f"{'vocab_size' if vocab_size is not None else where + ': vocab_size'} must be an "
                         f"integer >= 1, got {V!r}")
    try:
        shards = [[s["name"], s["sha256"]] for s in m["shards"]]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where}: no shards list of {{name, sha256}} entries ({type(e).__name__}: {e})") from e
    digest = hashlib.sha256(json.dumps(shards).encode()).hexdigest()
    return V, {"dataset_sha256": digest, "config_hash": m.get("config_hash"), "num_samples": m.get("num_samples")}


def _check_reuse(path: Path, want: dict, dataset_dir: str | Path) -> None:
    """Refuse to reuse ``path`` unless it was built from exactly ``want``."""
    got = vocab_provenance(path)
    if got == want:
        return
    how = (f"rebuild it (`eagle-data vocab {dataset_dir} --size {want['draft_vocab_size']} --out {path} "
           f"--rebuild true` plus the same --exclude_keys FILE you gave, or rebuild=True in Python), "
           "or write to another file (--out)")
    if got is None:
        raise ValueError(f"{path} exists but does not record what it was built from (written by an older "
                         f"eagle-data or by hand), so it may count held-out samples; {how}")

    def short(v):
        return f"{v[:12]}..." if isinstance(v, str) and len(v) > 16 else repr(v)

    diff = [f"{k} {short(got.get(k))} (now {short(want.get(k))})" for k in sorted(want.keys() | got.keys())
            if got.get(k) != want.get(k)]
    raise ValueError(f"{path} was built from other inputs: {'; '.join(diff)}; {how}")


def build_vocab(dataset_dir: str | Path, size: int, out: str | Path | None = None, rebuild: bool = False,
                vocab_size: int | None = None, exclude_keys: Iterable[str] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, Optional[Path]]:
    """Build (or reuse) the draft vocabulary of a dataset.

    The file's metadata records what it was built from (``built_from``: the dataset's shard
    digests, ``config_hash`` and sample count, ``N``, ``V``, the selection rule and a sha256 of
    the sorted excluded keys). An existing ``out`` is reused only if that record equals this
    call's; otherwise (including a file without the record) this raises instead of overwriting
    a file something else may use or reusing one that may have counted held-out samples.

    Args:
        dataset_dir: dataset directory (manifest.json gives ``vocab_size`` and the identity).
        size: ``N``.
        out: output file; None: built in memory only (nothing is written; the dataset directory
            is only read).
        rebuild: recompute and overwrite even if ``out`` exists.
        vocab_size: override ``V`` (default from the manifest).
        exclude_keys: sample keys not to count (held-out split); each must be in the index.

    Returns:
        ``(d2t, t2d, path)`` (``path`` None when ``out`` is None).

    Raises:
        ValueError: bad manifest, unknown/non-string exclude keys, no supervised token left to
            count, or ``out`` exists and was built from other inputs (pass ``rebuild``).
    """
    path = Path(out) if out else None
    if path is not None and path.is_dir():
        raise ValueError(f"out {path} is a folder; give the vocabulary file's path (e.g. {path}/draft_vocab_{size}.safetensors)")
    V, ident = dataset_facts(dataset_dir, vocab_size)
    excluded = sorted(key_set(exclude_keys or (), "exclude_keys"))
    want = {**ident, "draft_vocab_size": size, "vocab_size": V, "rule": VOCAB_RULE, "num_excluded": len(excluded),
            "exclude_keys_sha256": hashlib.sha256("\n".join(excluded).encode()).hexdigest()}
    if path is not None and path.exists() and not rebuild:
        _check_reuse(path, want, dataset_dir)
        log.info("reusing draft vocab %s", path)
        d2t, t2d = load_vocab(path)
        return d2t, t2d, path
    counts = count_loss_tokens(dataset_dir, V, exclude_keys=excluded)
    total = int(counts.sum())
    if total == 0:
        raise ValueError(f"{dataset_dir}: no supervised token to count ({ident['num_samples']} sample(s), "
                         f"{len(excluded)} excluded); a draft vocabulary needs data")
    d2t, t2d = select_vocab(counts, V, size)
    covered = int(counts[t2d].sum())
    meta = {"loss_tokens": total, "covered_loss_tokens": covered, "distinct_tokens": int((counts > 0).sum()),
            "built_from": want}
    if path is not None:
        save_vocab(path, d2t, t2d, meta)
    log.info("draft vocab N=%d covers %.2f%% of %d supervised tokens -> %s",
             size, 100.0 * covered / max(total, 1), total, path or "memory (not saved)")
    return d2t, t2d, path
