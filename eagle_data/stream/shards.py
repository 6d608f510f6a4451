"""Shard sources, manifest compatibility, and the per-epoch exact-once plan.

Everything here is O(number of shards): sample counts come from ``manifest.json``, never
from reading shards or the index, so opening a dataset costs the same for 1k or 10M samples.

Plan (identical on every rank and worker, computed from ``(seed, epoch)`` and the manifests):

1. the shard list is permuted with ``random.Random(f"{seed}:{epoch}")``;
2. the permuted shards form one global stream of ``N`` sample positions;
3. the stream is cut into ``world_size`` contiguous rank parts whose sizes differ by at most
   one, each cut into ``num_workers`` contiguous *slots* likewise (slot
   ``rank * num_workers + worker``); a slot is a list of :class:`Span`
   (shard, first sample, end sample), so each rank reads about ``1/world_size`` of the bytes
   (a shard cut between two slots is read by both up to the cut).
"""

from __future__ import annotations

import json
import posixpath
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import braceexpand

from eagle_data.format.layout import MANIFEST_NAME
from eagle_data.format.records import unmerged_reason
from eagle_data.format.schema import check_manifest_compat

#: manifest facts that must agree between all sources (and with the caller's expectations)
COMPAT_KEYS = ("layer_id_convention", "final_state_norm", "hidden_size", "aux_layer_ids", "dtype",
               "final_dtype", "vocab_size")


def manifest_fact(m: dict[str, Any], key: str) -> Any:
    """``m[key]``; a schema-1 manifest (no ``final_dtype``) stores its final states in ``dtype``;
    ``weights_fingerprint`` (the target's weights) is in the run configuration."""
    if key == "weights_fingerprint":
        return (m.get("config") or {}).get(key)
    return m.get("final_dtype") or m.get("dtype") if key == "final_dtype" else m.get(key)


@dataclass(frozen=True)
class ShardInfo:
    url: str          # what the reader opens (local path, fsspec URL or ``pipe:`` command)
    name: str         # ``00000-000000.tar``
    num_samples: int
    num_tokens: int = 0
    manifest: str = ""  # the manifest.json URL that lists it


@dataclass(frozen=True)
class Span:
    shard: ShardInfo
    start: int        # first sample ordinal inside the shard (0-based)
    stop: int         # one past the last


def _is_url(s: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", s)) or s.startswith("pipe:")


def _join(base: str, name: str) -> str:
    return posixpath.join(base, name) if _is_url(base) else str(Path(base) / name)


def read_json(url: str) -> dict[str, Any]:
    """Read a JSON file from a local path or any fsspec URL.

    Raises:
        ValueError: missing or invalid file.
    """
    import fsspec

    try:
        with fsspec.open(url, "rt") as f:
            return json.load(f)
    except FileNotFoundError as e:
        import os

        parent = os.path.dirname(url)
        if "://" not in url and parent and not os.path.isdir(parent):
            raise ValueError(f"{parent}: no such dataset directory (extract one with `eagle-data extract`, "
                             "e.g. the README's main job, or make one with eagle_data.tools.synthetic)") from e
        if "://" not in url and parent and (why := unmerged_reason(parent)):  # an extraction of no sample...
            raise ValueError(why) from e
        raise ValueError(f"{url}: not found; a dataset needs its {MANIFEST_NAME} "
                         "(run `eagle-data merge DIR` first)") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{url}: not valid JSON: {e}") from e


def _shard_name(url: str) -> str:
    m = re.findall(r"([^/\s'\"]+\.tar)\b", url)
    if not m:
        raise ValueError(f"{url}: cannot find a '*.tar' shard name in this URL")
    return m[-1]


def _dir_of(url: str) -> str:
    if url.startswith("pipe:"):
        raise ValueError(f"{url}: give manifest=... for pipe: sources (no directory to look in)")
    return posixpath.dirname(url) if _is_url(url) else str(Path(url).parent)


def _is_shard_source(src: str) -> bool:
    """Shard URL / brace pattern / ``pipe:`` command, as opposed to a dataset directory (whose
    name may well contain ``.tar``, e.g. ``data.tar.d``)."""
    if src.startswith("pipe:"):
        return True
    if not _is_url(src) and Path(src).is_dir():
        return False
    return bool(re.search(r"\.tar\}?$", src))


def resolve_sources(sources: str | Path | Sequence[str | Path], manifest: str | None = None
                    ) -> tuple[list[ShardInfo], list[tuple[str, dict[str, Any]]]]:
    """Turn sources into shards (with counts) and the manifests they come from.

    Args:
        sources: one or more of: a dataset directory / URL prefix holding ``manifest.json``;
            a ``manifest.json`` path/URL; shard URLs or brace patterns
            (``DIR/00000-{000000..000009}.tar``, ``s3://b/ds/*.tar`` is not globbed; list them),
            incl. ``pipe:CMD ... NAME.tar``. Shard URLs take their counts from ``manifest``
            or from the ``manifest.json`` next to them.
        manifest: manifest to use for shard URL sources.

    Returns:
        (shards in source order, [(manifest url, manifest dict)]).

    Raises:
        ValueError: missing manifest, a shard not listed in its manifest, or duplicate shards.
    """
    if isinstance(sources, (str, Path)):
        sources = [sources]
    manifests: dict[str, dict[str, Any]] = {}

    def load(murl: str) -> dict[str, Any]:
        if murl not in manifests:
            manifests[murl] = read_json(murl)
        return manifests[murl]

    shards: list[ShardInfo] = []
    for src in sources:
        src = str(src)
        if src.endswith(MANIFEST_NAME) or not _is_shard_source(src):
            murl = src if src.endswith(MANIFEST_NAME) else _join(src, MANIFEST_NAME)
            m = load(murl)
            base = _dir_of(murl)
            shards += [ShardInfo(_join(base, s["name"]), s["name"], int(s["num_samples"]),
                                 int(s.get("num_tokens", 0)), murl) for s in m["shards"]]
            continue
        for url in braceexpand.braceexpand(src):
            murl = manifest or _join(_dir_of(url), MANIFEST_NAME)
            by_name = {s["name"]: s for s in load(murl)["shards"]}
            name = _shard_name(url)
            if name not in by_name:
                raise ValueError(f"{url}: shard {name} is not listed in {murl}")
            s = by_name[name]
            shards.append(ShardInfo(url, name, int(s["num_samples"]), int(s.get("num_tokens", 0)), murl))
    urls = [s.url for s in shards]
    if len(set(urls)) != len(urls):
        twice = sorted({u for u in urls if urls.count(u) > 1})
        raise ValueError(f"the same shard is listed twice in the sources: {twice[:3]}")
    if not shards:
        raise ValueError(f"no shards in {list(sources)}")
    return shards, list(manifests.items())


def check_compat(manifests: list[tuple[str, dict[str, Any]]], expect: dict[str, Any]) -> dict[str, Any]:
    """Check every manifest against the schema, the caller's expectations and each other.

    Args:
        manifests: ``[(where, manifest)]``.
        expect: e.g. ``{"hidden_size": 4096, "aux_layer_ids": [1, 15, 28], "dtype": "bfloat16"}``
            (``None`` values are not checked).

    Returns:
        the facts shared by all manifests (:data:`COMPAT_KEYS`).

    Raises:
        ValueError: naming the manifest and the field that differs, or two manifests of one
            ``dataset_tag`` (their keys collide).
    """
    ref_where, ref = manifests[0]
    for where, m in manifests:
        check_manifest_compat(m, expect, where=where)
        for k in COMPAT_KEYS:
            a, b = manifest_fact(m, k), manifest_fact(ref, k)
            if (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
                raise ValueError(f"{where}: {k} is {a!r} but {ref_where} has {b!r}; refusing to mix datasets"
                                 + (" extracted from different models" if k == "vocab_size" else ""))
    tags: dict[Any, str] = {}
    for where, m in manifests:  # keys are TAG_ROW: two sources of one tag would share keys
        tag = (m.get("config") or {}).get("dataset_tag")
        if tag is not None and tag in tags:
            raise ValueError(f"{where} and {tags[tag]} have the same dataset_tag {tag!r}: their sample keys "
                             "(TAG_ROW) collide, so held-out keys and key lists would name samples of both; "
                             "extract one of them again with another --dataset_tag")
        tags[tag] = where
    return {k: manifest_fact(ref, k) for k in COMPAT_KEYS}


def epoch_shard_order(shards: Sequence[ShardInfo], seed: int, epoch: int, shuffle: bool = True) -> list[ShardInfo]:
    """Stage 1: the shard permutation of ``(seed, epoch)``; identical on all ranks."""
    out = list(shards)
    if shuffle:
        random.Random(f"{seed}:{epoch}").shuffle(out)
    return out


def slot_sizes(total: int, num_slots: int) -> list[int]:
    """Balanced split of ``total`` positions: the first ``total % num_slots`` slots get one more."""
    q, r = divmod(total, num_slots)
    return [q + (i < r) for i in range(num_slots)]


def slot_spans(order: Sequence[ShardInfo], sizes: Sequence[int], slot: int) -> list[Span]:
    """Stages 2-3 (split by node, split by worker): the spans of global positions
    ``[sum(sizes[:slot]), sum(sizes[:slot + 1]))`` of the shard stream ``order``."""
    lo = sum(sizes[:slot])
    hi = lo + sizes[slot]
    spans, pos = [], 0
    for sh in order:
        a, b = max(lo, pos), min(hi, pos + sh.num_samples)
        if a < b:
            spans.append(Span(sh, a - pos, b - pos))
        pos += sh.num_samples
        if pos >= hi:
            break
    return spans
