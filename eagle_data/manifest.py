"""Run configuration, per-rank progress files, and the merged ``manifest.json``.

* ``progress-{rank:05d}.json`` (one per rank, rewritten atomically after every published
  shard): the run config + its hash, published shards (name, samples, bytes, sha256, keys),
  skipped source rows with their reasons, and ``finished``.
* ``manifest.json`` (written by :func:`merge` once every rank has finished): schema
  version, config, model facts, all shards, skip counts by reason, totals, package
  versions; plus ``index.parquet`` consolidated from ``index/*.parquet``.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from .schema import FINAL_STATE_NORM, INDEX_NAME, LAYER_ID_CONVENTION, MANIFEST_NAME, SCHEMA_VERSION
from .writer import INDEX_DIR, atomic_write_json

#: config fields that must be equal for a resume or a merge to mix outputs
RESUME_KEYS = ("model_path", "weights_fingerprint", "tokenizer_sha256", "template", "dtype", "storage_dtype",
               "aux_layer_ids", "max_length", "data", "dataset_tag", "split", "num_samples", "world_size")


def progress_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"progress-{rank:05d}.json"


def config_hash(cfg: dict[str, Any]) -> str:
    sub = {k: cfg.get(k) for k in RESUME_KEYS}
    return hashlib.sha256(json.dumps(sub, sort_keys=True).encode()).hexdigest()[:16]


def weights_fingerprint(model_path: str | Path) -> str:
    """Cheap identity of a model folder: sha256 over names, sizes and the first/last MiB of each
    weight file (hashing a 1 TB checkpoint in full is not practical)."""
    p = Path(model_path)
    if not p.is_dir():
        return "n/a"
    h = hashlib.sha256()
    for f in sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")) + sorted(p.glob("config.json")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read(1 << 20))
    return h.hexdigest()


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("eagle-data", "torch", "transformers", "webdataset", "datasets", "safetensors", "sglang"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def load_progress(out_dir: Path, rank: int) -> dict[str, Any] | None:
    p = progress_path(out_dir, rank)
    return json.loads(p.read_text()) if p.exists() else None


def check_resume(prev: dict[str, Any], cfg: dict[str, Any], where: str) -> None:
    """Refuse to mix outputs of different runs.

    Raises:
        ValueError: names every config field that differs.
    """
    old = prev.get("config", {})
    diff = [k for k in RESUME_KEYS if old.get(k) != cfg.get(k)]
    if diff:
        lines = "\n".join(f"  {k}: existing {old.get(k)!r} != this run {cfg.get(k)!r}" for k in diff)
        raise ValueError(f"{where} was written by a different run configuration; refusing to mix:\n{lines}\n"
                         "Use a new --out directory (or the original settings to resume).")


def merge(out_dir: str | Path, allow_unfinished: bool = False) -> dict[str, Any]:
    """Combine all ranks' progress files and index parts into ``manifest.json`` + ``index.parquet``.

    Raises:
        ValueError: no progress files, ranks missing/unfinished, mixed configs, duplicate keys.
    """
    out = Path(out_dir)
    progs = [json.loads(p.read_text()) for p in sorted(out.glob("progress-*.json"))]
    if not progs:
        raise ValueError(f"{out}: no progress-*.json files; is this an eagle-data output directory?")
    world = progs[0]["config"]["world_size"]
    ranks = sorted(p["rank"] for p in progs)
    if ranks != list(range(world)):
        raise ValueError(f"{out}: expected progress files for ranks 0..{world - 1}, found {ranks}")
    for p in progs[1:]:
        check_resume(progs[0], p["config"], f"{out}/progress-{p['rank']:05d}.json")
    unfinished = [p["rank"] for p in progs if not p.get("finished")]
    if unfinished and not allow_unfinished:
        raise ValueError(f"{out}: rank(s) {unfinished} have not finished; rerun them with --resume")
    shards = [s for p in progs for s in p["shards"]]
    keys = [k for s in shards for k in s["keys"]]
    if len(keys) != len(set(keys)):
        dup = [k for k, n in Counter(keys).items() if n > 1][:5]
        raise ValueError(f"{out}: duplicate sample keys across shards, e.g. {dup}")
    skips = Counter()
    for p in progs:
        skips.update(p["skipped"].values())
    parts = [out / INDEX_DIR / (s["name"].removesuffix(".tar") + ".parquet") for s in shards]
    if parts:
        tables = [pq.read_table(pp) for pp in parts]
        import pyarrow as pa
        pq.write_table(pa.concat_tables(tables), out / (INDEX_NAME + ".tmp"))
        (out / (INDEX_NAME + ".tmp")).replace(out / INDEX_NAME)
    cfg = progs[0]["config"]
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "layer_id_convention": LAYER_ID_CONVENTION,
        "final_state_norm": FINAL_STATE_NORM,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": cfg,
        "config_hash": config_hash(cfg),
        **progs[0]["model"],
        "shards": [{k: v for k, v in s.items() if k != "keys"} for s in shards],
        "num_samples": len(keys),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "total_bytes": sum(s["bytes"] for s in shards),
        "skip_counts": dict(sorted(skips.items())),
        "num_skipped": sum(skips.values()),
        "packages": package_versions(),
        "complete": not unfinished,
    }
    atomic_write_json(out / MANIFEST_NAME, manifest)
    return manifest


def read_manifest(path: str | Path) -> dict[str, Any]:
    """Read ``manifest.json`` from a dataset dir or file path.

    Raises:
        ValueError: missing or unreadable manifest.
    """
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST_NAME
    if not p.exists():
        raise ValueError(f"{p}: no manifest; run `eagle-data merge` on the output directory first")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON: {e}") from e
