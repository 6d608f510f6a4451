"""``eagle-data verify``: check a dataset directory end to end, optionally re-running samples.

Checks (each problem names the shard/sample/file it is about):

* manifest: readable, schema/conventions (:func:`eagle_data.format.schema.check_manifest_compat`),
  totals equal the sum over shards;
* the dataset holds at least one sample (an extraction that skipped every row fails);
* every listed shard: present, size and sha256 as recorded, a tar of ``KEY.safetensors`` +
  ``KEY.json`` pairs only, as many samples as recorded;
* every sample: the schema (:func:`eagle_data.format.schema.decode_tensors`: fields, dtypes,
  ``rows == len(input_ids) == len(loss_mask)``), stored dtype and widths as in the manifest,
  no NaN/Inf, metadata consistent (``num_tokens``, ``source_row``), key = ``TAG_ROW`` of its row
  and the row belongs to the rank that wrote the shard (``row % world_size == rank``);
* keys: unique across all shards and ranks;
* ``index.parquet``: one row per stored sample, every column equal to what the shards hold;
* directory: no temporaries, no shards or index parts the manifest does not list;
* ``recompute=N``: N random samples re-run through :class:`eagle_data.engines.hf.HFBackend`
  (model, aux ids and compute dtype from the manifest), max relative error per layer
  (``max|stored - recomputed| / max|recomputed|``) against ``rtol``; also per token
  (``||stored_t - recomputed_t|| / ||recomputed_t||``: median, p99, max) and the smallest
  per-token cosine, beside what the storage dtype alone gives
  (:data:`eagle_data.tools.recompute.EXPECTED_TOKEN_REL`). fp8
  fields are compared against their quantisation bound (:func:`eagle_data.format.fp8.error_bound`
  of the recomputed values: ``recompute_bound`` <= 1 means within it; rtol default 2^-4).

Shards are streamed (hashed and parsed in one sequential read), never loaded whole.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from eagle_data.format.records import read_manifest
from eagle_data.format.final_rows import layout as final_rows_layout
from eagle_data.format.schema import (META_EXT, STORAGE_DTYPES, TENSOR_EXT, check_manifest_compat, decode_tensors,
                                      sample_key)
from eagle_data.checks import check_device
from eagle_data.format.layout import INDEX_NAME, MANIFEST_NAME, parse_shard_name
from eagle_data.format.layout import INDEX_DIR
from eagle_data.format.tar import CorruptTar, TarWalk
from eagle_data.tools.recompute import compare, ids_outside, stored_values

CATEGORIES = ("manifest", "shards", "samples", "keys", "index", "directory", "recompute")

@dataclass
class VerifyReport:
    """Result of :func:`verify_dataset`. ``ok`` iff ``problems`` is empty."""
    path: str
    num_shards: int = 0
    num_samples: int = 0
    num_tokens: int = 0
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (category, where, what)
    recompute: dict[str, float] = field(default_factory=dict)  # layer -> max relative error
    #: fp8 layers -> max |stored - recomputed| / the quantisation bound of the recomputed values
    #: (<= 1: within the bound; a bf16 compute dtype adds its own batch-composition noise)
    recompute_bound: dict[str, float] = field(default_factory=dict)
    #: layer -> {"token_rel_p50", "token_rel_p99", "token_rel_max", "min_cosine"} over the recomputed tokens
    recompute_tokens: dict[str, dict[str, float]] = field(default_factory=dict)
    recompute_keys: list[str] = field(default_factory=list)
    #: keys of every sample found in a shard (readable or not)
    stored_keys: set[str] = field(default_factory=set)
    rtol: float | None = None
    dtype: str | None = None  # the stored hidden-state dtype (recompute)

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, category: str, where: str, what: str) -> None:
        assert category in CATEGORIES, category
        self.problems.append((category, where, what))


class _HashingReader:
    """A file read once, in order, through sha256 (a stream to :class:`TarWalk`)."""

    def __init__(self, f):
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        b = self.f.read(size)
        self.h.update(b)
        self.n += len(b)
        return b

    def readinto(self, buf) -> int:
        n = self.f.readinto(buf)
        self.h.update(memoryview(buf).cast("B")[:n])
        self.n += n
        return n

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def _iter_tar(path: Path, rep: VerifyReport, shard: str, result: dict[str, Any]) -> Iterator[tuple[str, bytes, bytes]]:
    """Yield ``(key, safetensors bytes, json bytes)`` (the shard is read once, in order, through
    sha256); report layout problems and an unreadable tar; put the file's ``bytes`` and
    ``sha256`` into ``result``.

    Raises:
        OSError: the file cannot be read.
    """
    pending: dict[str, dict[str, bytes]] = {}
    with open(path, "rb") as f:
        r = _HashingReader(f)
        walk = TarWalk(r, shard)
        try:
            for m in walk.members(everything=True):
                if not m.sample or "/" in m.name or m.ext not in (TENSOR_EXT, META_EXT):
                    rep.add("shards", shard, f"unexpected tar member {m.name!r}")
                    continue
                got = pending.setdefault(m.key, {})
                if m.ext in got:
                    rep.add("keys", shard, f"key {m.key} stored twice in the same shard")
                got[m.ext] = walk.read(m).tobytes()
                if len(got) == 2:
                    del pending[m.key]
                    yield m.key, got[TENSOR_EXT], got[META_EXT]
        except CorruptTar as e:
            rep.add("shards", shard, f"not a readable tar: {e}")
        r.drain()
    for key, got in pending.items():
        rep.add("shards", shard, f"sample {key} has only {sorted(got)}")
    result.update(bytes=r.n, sha256=r.h.hexdigest())


def _check_sample(key, tb, jb, m, shard, rank, world, rep) -> dict[str, Any] | None:
    where = f"{shard}:{key}"
    try:
        t = decode_tensors(tb, where)
    except ValueError as e:  # a SampleError names the sample already: not twice
        rep.add("samples", where, str(e).removeprefix(f"sample {where}: "))
        return None
    try:
        meta = json.loads(jb)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        rep.add("samples", where, f"metadata is not valid JSON: {e}")
        return None
    n, h = t["input_ids"].shape[0], m.get("hidden_size")
    fin, aux = t["hidden_states"], t["aux_hidden_states"]
    if aux.dtype != STORAGE_DTYPES.get(m.get("dtype")) or fin.dtype != STORAGE_DTYPES.get(m.get("final_dtype")):
        rep.add("samples", where, f"stored dtypes aux {aux.dtype} / final {fin.dtype}, manifest says "
                                  f"{m.get('dtype')} / {m.get('final_dtype')}")
    if fin.shape[1] != h or aux.shape[1] != len(m.get("aux_layer_ids", ())) * h:
        rep.add("samples", where, f"widths aux {aux.shape[1]} / final {fin.shape[1]} do not match "
                                  f"H={h} x {len(m.get('aux_layer_ids', ()))} aux layers")
    rows = final_rows_layout(fin.shape[0], t["loss_mask"])
    if rows != m.get("final_rows"):
        rep.add("samples", where, f"hidden_states holds {rows!r} rows ({fin.shape[0]} of {n} tokens), manifest "
                                  f"says final_rows {m.get('final_rows')!r}")
    for name in ("aux_hidden_states", "hidden_states"):
        if not torch.isfinite(stored_values(t, name)).all():
            rep.add("samples", where, f"{name} contains NaN/Inf")
    if m.get("vocab_size") is not None and (why := ids_outside(t["input_ids"], int(m["vocab_size"]))):
        rep.add("samples", where, why)
    if meta.get("num_tokens") != n:
        rep.add("samples", where, f"metadata num_tokens {meta.get('num_tokens')} != {n} stored tokens")
    row, tag = meta.get("source_row"), m.get("config", {}).get("dataset_tag")
    if not isinstance(row, int) or (tag and key != sample_key(tag, row)):
        rep.add("keys", where, f"key does not match dataset tag {tag!r} and source_row {row!r}")
    elif rank is not None and row % world != rank:
        rep.add("keys", where, f"source_row {row} belongs to rank {row % world}, but shard is rank {rank}'s")
    mask = t["loss_mask"].bool()
    ids, counts = torch.unique(t["input_ids"][mask], return_counts=True)
    return {"shard": shard, "num_tokens": n, "num_loss_tokens": int(mask.sum()), "source_row": row,
            "source_id": str(meta.get("source_id")), "loss_token_ids": ids.tolist(),
            "loss_token_counts": counts.tolist()}


def _check_index(out: Path, facts: dict[str, dict[str, Any]], rep: VerifyReport, stored: set[str] = frozenset()
                 ) -> None:
    """index.parquet against the readable samples' ``facts``; a row of a sample that is stored but
    unreadable (``stored``, reported under "samples") is not reported again."""
    import pyarrow.parquet as pq

    p = out / INDEX_NAME
    if not p.exists():
        rep.add("index", INDEX_NAME, "missing")
        return
    try:
        rows = pq.read_table(p).to_pylist()
    except Exception as e:  # pyarrow raises its own error types
        rep.add("index", INDEX_NAME, f"unreadable: {e}")
        return
    seen = Counter(r["key"] for r in rows)
    for k, c in seen.items():
        if c > 1:
            rep.add("index", INDEX_NAME, f"key {k} listed {c} times")
    for k in sorted(set(facts) - set(seen))[:20]:
        rep.add("index", INDEX_NAME, f"stored sample {k} ({facts[k]['shard']}) has no index row")
    for r in rows:
        f = facts.get(r["key"])
        if f is None:
            if r["key"] not in stored:
                rep.add("index", INDEX_NAME, f"row for {r['key']} (shard {r.get('shard')}) but no such stored sample")
            continue
        bad = [c for c, v in f.items() if r.get(c) != v]
        if bad:
            rep.add("index", INDEX_NAME, f"row {r['key']}: {bad} differ from shard {f['shard']}")


def _check_directory(out: Path, m: dict[str, Any], rep: VerifyReport) -> None:
    listed = {s["name"] for s in m.get("shards", [])}
    for p in sorted(out.rglob("*.tmp")):
        rep.add("directory", str(p.relative_to(out)), "temporary file left behind (interrupted write)")
    for p in sorted(out.glob("*.tar")):
        if p.name not in listed:
            rep.add("directory", p.name, "shard not listed in the manifest")
    for p in sorted((out / INDEX_DIR).glob("*.parquet")):
        if p.name.removesuffix(".parquet") + ".tar" not in listed:
            rep.add("directory", f"{INDEX_DIR}/{p.name}", "index part of a shard not listed in the manifest")


def check_args(recompute: int, device: str, rtol: float | None) -> None:
    """Usage errors of :func:`verify_dataset`, raised before any data is read.

    Raises:
        ValueError: ``recompute`` negative; ``rtol`` negative or NaN; with ``recompute``, a
            ``device`` torch does not know or cannot use here (e.g. "cuda" without a GPU).
    """
    if recompute < 0:
        raise ValueError(f"recompute must be >= 0, got {recompute}")
    if rtol is not None and not rtol >= 0:
        raise ValueError(f"rtol must be >= 0 (a max relative error), got {rtol}")
    if not recompute:
        return
    check_device(device)


def verify_dataset(path: str | Path, recompute: int = 0, seed: int = 0, device: str = "cpu",
                   rtol: float | None = None) -> VerifyReport:
    """Verify a dataset directory (see module docstring). Never raises for bad data: every
    problem goes into the returned :class:`VerifyReport`; a dataset without samples fails.

    Raises:
        ValueError: bad arguments (:func:`check_args`); ``path`` does not exist.
    """
    check_args(recompute, device, rtol)
    out = Path(path)
    if not out.is_dir():
        raise ValueError(f"{out} is not a dataset directory" + ("" if out.exists() else " (it does not exist)"))
    rep = VerifyReport(str(out))
    try:
        m = read_manifest(out)
        check_manifest_compat(m, where=str(out / MANIFEST_NAME))
    except (ValueError, KeyError) as e:
        rep.add("manifest", MANIFEST_NAME, str(e))
        return rep
    shards = m.get("shards", [])
    for k, agg in (("num_samples", "num_samples"), ("num_tokens", "num_tokens"), ("total_bytes", "bytes")):
        if m.get(k) != sum(s.get(agg, 0) for s in shards):
            rep.add("manifest", MANIFEST_NAME, f"{k} {m.get(k)} != sum over shards {sum(s.get(agg, 0) for s in shards)}")
    facts = _check_shards(out, m, shards, rep)
    if rep.num_samples == 0:
        rep.add("samples", MANIFEST_NAME, f"no samples: the dataset is empty (skipped rows by reason: "
                                          f"{m.get('skip_counts') or {}})")
    _check_index(out, facts, rep, stored=rep.stored_keys)
    _check_directory(out, m, rep)
    if recompute:
        _recompute(out, m, facts, recompute, seed, device, rtol, rep)
    return rep


def _check_shards(out: Path, m: dict[str, Any], shards: list[dict[str, Any]], rep: VerifyReport
                  ) -> dict[str, dict[str, Any]]:
    """Stream every listed shard once: file facts against the manifest, every sample, key
    uniqueness. Returns the per-sample facts (key -> :func:`_check_sample`'s result)."""
    world = int(m.get("world_size") or m.get("config", {}).get("world_size") or 1)
    facts: dict[str, dict[str, Any]] = {}
    key_shards: dict[str, list[str]] = defaultdict(list)
    for s in shards:
        name, p = s["name"], out / s["name"]
        rep.num_shards += 1
        if not p.exists():
            rep.add("shards", name, "listed in the manifest but missing")
            continue
        rank = parsed[0] if (parsed := parse_shard_name(name)) else None
        n, res = 0, {}
        try:
            for key, tb, jb in _iter_tar(p, rep, name, res):
                n += 1
                key_shards[key].append(name)
                f = _check_sample(key, tb, jb, m, name, rank, world, rep)
                if f is not None:
                    facts[key] = f
                    rep.num_tokens += f["num_tokens"]
        except OSError as e:
            rep.add("shards", name, f"not readable: {type(e).__name__}: {e}")
        size, digest = res.get("bytes", p.stat().st_size), res.get("sha256")
        if size != s.get("bytes"):
            rep.add("shards", name, f"size {size} != manifest {s.get('bytes')}")
        if digest is not None and digest != s.get("sha256"):
            rep.add("shards", name, "sha256 differs from the manifest (file changed or corrupted)")
        if n != s.get("num_samples"):
            rep.add("shards", name, f"{n} samples, manifest says {s.get('num_samples')}")
        rep.num_samples += n
    rep.stored_keys = set(key_shards)
    for k, names in key_shards.items():
        if len(names) > 1:
            rep.add("keys", k, f"stored {len(names)} times: {sorted(names)}")
    return facts


def _recompute(out: Path, m: dict[str, Any], facts: dict[str, dict[str, Any]], n: int, seed: int,
               device: str, rtol: float | None, rep: VerifyReport) -> None:
    """Re-run ``n`` random stored samples through the HF reference backend, one at a time
    (:func:`~eagle_data.tools.recompute.compare`)."""
    chosen = sorted(random.Random(seed).sample(sorted(facts), min(n, len(facts))))
    rep.recompute_keys = chosen
    want, stored = set(chosen), {}
    for shard in sorted({facts[k]["shard"] for k in chosen}):
        for key, tb, _ in _iter_tar(out / shard, VerifyReport(str(out)), shard, {}):
            if key in want:
                try:
                    stored[key] = decode_tensors(tb, key)
                except ValueError as e:  # a damaged payload: reported, the other samples recomputed
                    rep.add("recompute", key, f"cannot decode the stored sample: {e}")
    compare(stored, chosen, m, device, rtol, rep)
