"""The merged ``manifest.json`` (and ``index.parquet``, the dataset card) of an extraction's ranks.

``manifest.json`` (written by :func:`merge` once every rank has finished): schema version,
config, model facts, all shards, skip and note counts by reason, totals, package versions;
plus ``index.parquet`` consolidated from ``index/*.parquet``. The merge refuses ranks that read
different sources (:class:`RanksDisagree`: a rank rerun after the source changed beside ranks
that were not), and writes nothing for an extraction of no sample (:class:`NoSamples`). The
ranks' progress files it reads, and how a rank resumes, are :mod:`eagle_data.extract.resume`.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import time
from collections import Counter
from importlib import metadata
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle_data.extract.resume import check_resume, config_hash, read_progress
from eagle_data.format.layout import (CARD_NAME, INDEX_DIR, INDEX_NAME, MANIFEST_NAME, PROGRESS_GLOB, index_part,
                                      progress_path)
from eagle_data.format.card import dataset_card
from eagle_data.format.records import Manifest, RankProgress, no_samples_message, note_reasons
from eagle_data.format.schema import FINAL_STATE_NORM, INDEX_SCHEMA, LAYER_ID_CONVENTION, SCHEMA_VERSION
from eagle_data.host import pid_alive
from eagle_data.extract.sink import atomic_write_bytes, atomic_write_json, write_parquet_atomic

log = logging.getLogger(__name__)


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("eagle-data", "torch", "transformers", "webdataset", "datasets", "safetensors", "sglang"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _remove_stale_tmps(out: Path, names: tuple[str, ...]) -> None:
    """Remove ``NAME.<pid>.tmp`` left by dead processes on this host (live ones are merging)."""
    for name in names:
        for p in out.glob(f"{name}.*.tmp"):
            pid = p.name[len(name) + 1:-4]
            if not pid.isdigit() or not pid_alive(int(pid)):
                p.unlink(missing_ok=True)


class RanksDisagree(ValueError):
    """The ranks of one output directory read different sources (or different parts of it): merged,
    the rows now of a rank that was not rerun would be missing or stale."""


class NoSamples(ValueError):
    """Every rank finished and none published a sample: there is no dataset to write."""


def merge(out_dir: str | Path, allow_unfinished: bool = False) -> Manifest:
    """Combine all ranks' progress files and index parts into ``manifest.json`` + ``index.parquet``.

    Idempotent and safe to run concurrently (each writer uses its own temporary; both write
    the same content). Shards are listed in (rank, shard) order; ``index.parquet`` rows follow.

    Raises:
        RanksDisagree: the ranks read different sources (:func:`check_same_source`); an earlier
            merge's manifest, index and card are removed (they no longer describe the ranks' data).
        NoSamples: no rank published a sample (a manifest, index and card an earlier merge wrote are
            removed: the folder does not look like a dataset).
        ValueError: no progress files, ranks missing/unfinished, mixed configs, duplicate keys
            or shard names, a listed index part missing.
    """
    out = Path(out_dir)
    _remove_stale_tmps(out, (MANIFEST_NAME, INDEX_NAME, CARD_NAME))
    progs, unfinished = _ranks(out, allow_unfinished)
    shards = [s for p in progs for s in sorted(p["shards"], key=lambda s: s["name"])]
    keys = _unique_keys(out, shards)
    skips, notes = Counter(), Counter()
    for p in progs:
        skips.update(p["skipped"].values())
        notes.update(r for v in p.get("notes", {}).values() for r in note_reasons(v))
    if not shards:
        _unpublish(out)  # of an older version, which wrote them
        with contextlib.suppress(OSError):  # empty (every rank finished with no shard): no dataset's folder
            (out / INDEX_DIR).rmdir()
        raise NoSamples(no_samples_message(out, dict(skips)))
    parts = _published_parts(out, shards)
    tables = [pq.read_table(pp) for pp in parts]
    write_parquet_atomic(out / INDEX_NAME, pa.concat_tables(tables) if tables else INDEX_SCHEMA.empty_table())
    cfg = progs[0]["config"]
    manifest: Manifest = {
        "schema_version": SCHEMA_VERSION,
        "layer_id_convention": LAYER_ID_CONVENTION,
        "final_state_norm": FINAL_STATE_NORM,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": cfg,
        "config_hash": config_hash(cfg),
        **progs[0]["model"],
        "world_size": cfg["world_size"],
        "shards": [{k: v for k, v in s.items() if k != "keys"} for s in shards],
        "num_samples": len(keys),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "total_bytes": sum(s["bytes"] for s in shards),
        "skip_counts": dict(sorted(skips.items())),
        "num_skipped": sum(skips.values()),
        "note_counts": dict(sorted(notes.items())),
        "packages": package_versions(),
        "complete": not unfinished,
    }
    if "source" in progs[0]:
        manifest["source"] = {k: v for k, v in progs[0]["source"].items() if k != "read_at"}
    atomic_write_json(out / MANIFEST_NAME, manifest)
    atomic_write_bytes(out / CARD_NAME, dataset_card(manifest).encode("utf-8"))
    return manifest


def _ranks(out: Path, allow_unfinished: bool) -> tuple[list[RankProgress], list[int]]:
    """Every rank's progress record, in rank order, and the ranks not finished; checked: one per
    rank of the world size, one configuration, finished (unless ``allow_unfinished``), one source.

    Raises:
        ValueError, RanksDisagree: see :func:`merge`.
    """
    paths = sorted(out.glob(PROGRESS_GLOB))
    if not paths:
        raise ValueError(f"{out}: no progress-*.json files; is this an eagle-data output directory?")
    progs = [read_progress(p) for p in paths]
    world = progs[0]["config"]["world_size"]
    ranks = sorted(p["rank"] for p in progs)
    if ranks != list(range(world)):
        raise ValueError(f"{out}: expected progress files for ranks 0..{world - 1} (world_size {world}), "
                         f"found {ranks}")
    for p in progs[1:]:
        check_resume(progs[0], p["config"], str(progress_path(out, p["rank"])))
    unfinished = [p["rank"] for p in progs if not p.get("finished")]
    if unfinished and not allow_unfinished:
        raise ValueError(f"{out}: rank(s) {unfinished} have not finished; rerun them (same command) to resume")
    progs.sort(key=lambda p: p["rank"])
    try:
        check_same_source(out, progs)
    except RanksDisagree:
        _unpublish(out)  # an earlier merge's files describe a dataset the ranks no longer agree on
        raise
    return progs, unfinished


def _unique_keys(out: Path, shards: list[dict[str, Any]]) -> list[str]:
    """The sample keys of ``shards``, in order.

    Raises:
        ValueError: a shard listed twice, or a key in two shards.
    """
    names = [s["name"] for s in shards]
    if len(names) != len(set(names)):
        raise ValueError(f"{out}: a shard is listed twice: {[n for n, c in Counter(names).items() if c > 1][:5]}")
    keys = [k for s in shards for k in s["keys"]]
    if len(keys) != len(set(keys)):
        dup = [k for k, n in Counter(keys).items() if n > 1][:5]
        raise ValueError(f"{out}: duplicate sample keys across shards, e.g. {dup}")
    return keys


def _published_parts(out: Path, shards: list[dict[str, Any]]) -> list[Path]:
    """The index parts of ``shards``, each shard checked to be as published (present, its size).

    Raises:
        ValueError: a listed shard missing or of another size, or its index part missing.
    """
    damaged = [f"{s['name']} ({'missing' if not (out / s['name']).is_file() else 'size differs from the record'})"
               for s in shards if not (out / s["name"]).is_file() or (out / s["name"]).stat().st_size != s["bytes"]]
    if damaged:
        raise ValueError(f"{out}: listed shard(s) {damaged[:5]} are not as published; rerun the extraction of "
                         "their rank (a resume redoes their samples), then merge")
    parts = [index_part(out, s["name"]) for s in shards]
    missing = [str(pp.relative_to(out)) for pp in parts if not pp.exists()]
    if missing:
        raise ValueError(f"{out}: index part(s) of listed shards missing: {missing[:5]}; rerun the "
                         "extraction of that rank (resume redoes those shards)")
    return parts


def _unpublish(out: Path) -> None:
    """Remove the merged files (manifest, index, card): readers then say the folder is no dataset."""
    for name in (MANIFEST_NAME, INDEX_NAME, CARD_NAME):
        (out / name).unlink(missing_ok=True)


def check_same_source(out: Path, progs: list[RankProgress]) -> None:
    """Refuse to merge ranks that read different sources: each rank records the source its last
    run read (``source``: the fingerprint of its files); of finished ranks, each must hold a
    decision (a sample or a skip) for every row of its share up to the last row any rank read:
    rank ``r`` of ``w`` owns rows ``row % w == r``, and a rank that read a source with fewer rows,
    or fewer ``--num_samples``, misses rows the others' extent gives it. Ranks whose last runs
    had different ``--num_samples`` are refused too: a row of theirs past every rank's last row
    (the extent's end) cannot be told missing. Checked when any rank recorded its source
    (extractions of this version; not synthetic datasets).

    Raises:
        RanksDisagree: names the ranks, what differs, and to rerun them.
    """
    if not any("source" in p for p in progs):
        return
    world = progs[0]["world_size"]
    problems, stale = [], set()
    rows = {p["rank"]: {_key_row(k) for s in p["shards"] for k in s["keys"]} | {int(r) for r in p["skipped"]}
            for p in progs if p.get("finished")}
    end = 1 + max((max(r) for r in rows.values() if r), default=-1)  # rows read by the rank that read furthest
    furthest = sorted(r for r, got in rows.items() if got and max(got) == end - 1)
    for rank, got in sorted(rows.items()):
        lost = sorted(set(range(rank, end, world)) - got)
        if lost:
            stale.add(rank)
            upto = f"up to row {max(got)}" if got else "no row"
            problems.append(f"  rank {rank} holds {len(got)} source row(s) ({upto}); rank(s) {furthest} read up to "
                            f"row {end - 1}, so at least {len(lost)} row(s) of rank {rank} would be missing: "
                            f"{', '.join(map(str, lost[:5]))}{' ...' if len(lost) > 5 else ''}")
    groups: dict[tuple, list[int]] = {}  # (fingerprint, files, bytes) -> ranks; all None: not recorded
    for p in progs:
        src = p.get("source") or {}
        groups.setdefault((src.get("fingerprint"), src.get("files"), src.get("bytes")), []).append(p["rank"])
    if len(groups) > 1:
        read_at = {p["rank"]: (p.get("source") or {}).get("read_at") or "" for p in progs}

        def what(key: tuple, ranks: list[int]) -> str:
            fp, n, size = key
            when = ", ".join(sorted({read_at[r] or "?" for r in ranks}))
            return (f"rank(s) {ranks} read " + (f"{n} file(s), {size} bytes, sha256 {fp[:16]} (at {when})" if fp
                    else "a source not recorded (a hub dataset, or a run of an older eagle-data version)"))

        problems.append("  the source files differ: " + "; ".join(what(k, rs) for k, rs in groups.items()))
        if not stale:  # no row missing: the ranks that read before the latest read are stale
            latest = max(groups.values(), key=lambda rs: max(read_at[r] for r in rs))
            stale = {r for rs in groups.values() if rs is not latest for r in rs}
    nums = {p["rank"]: p["config"].get("num_samples") for p in progs}
    if len(set(nums.values())) > 1:  # rows past the furthest rank's last one may be missing unseen
        problems.append(f"  --num_samples differs: {', '.join(f'rank {r}: {n}' for r, n in sorted(nums.items()))}")
        if not stale:  # the ranks whose last run read another extent than the latest run
            at = {p["rank"]: (p.get("source") or {}).get("read_at") or "" for p in progs}
            latest = nums[max(at, key=at.get)]
            stale = {r for r, n in nums.items() if n != latest}
    if problems:
        raise RanksDisagree(f"{out}: the ranks did not read the same source; refusing to merge (the rows of rank(s) "
                            f"{sorted(stale)} would be missing or stale):\n" + "\n".join(problems) + "\n"
                            f"The source (or --num_samples) changed between the ranks' runs. Rerun rank(s) "
                            f"{sorted(stale)} with the same source and command as the others (a rerun resumes), "
                            "then merge (the last rank to finish merges by itself).")


def _key_row(key: str) -> int:
    """The source row of a sample key (``TAG_ROW``, :func:`eagle_data.format.schema.sample_key`)."""
    return int(key.rpartition("_")[2])
