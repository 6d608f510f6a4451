"""Given samples of a local dataset directory, read from its shards (evaluation, ``inspect``)."""

from __future__ import annotations

from pathlib import Path
from typing import Collection, Iterable

import torch

from eagle_data.format.records import read_manifest
from eagle_data.format.final_rows import expand
from eagle_data.format.fp8 import dequantize_fields
from eagle_data.format.schema import META_EXT, TENSOR_EXT, decode_tensors
from eagle_data.format.tar import TarWalk


def shard_payloads(shard: str | Path, keys: Collection[str],
                   exts: tuple[str, ...] = (TENSOR_EXT, META_EXT)) -> dict[str, dict[str, bytes]]:
    """The data of the members ``KEY.EXT`` of one local shard with ``KEY`` in ``keys`` and
    ``EXT`` in ``exts``: ``{key: {ext: bytes}}`` (one walk of the headers, stopping once all
    are found; no other member's data is read).

    Raises:
        ValueError: a corrupt or truncated tar (:class:`~eagle_data.format.tar.CorruptTar`).
        OSError: the file cannot be read.
    """
    out: dict[str, dict[str, bytes]] = {}
    left = len(keys) * len(exts)
    with open(shard, "rb") as f:
        walk = TarWalk(f, str(shard))
        for m in walk.members():
            if m.key in keys and m.ext in exts:
                got = out.setdefault(m.key, {})
                left -= m.ext not in got
                got[m.ext] = walk.read(m).tobytes()
                if not left:
                    break
    return out


def read_samples(dataset_dir: str | Path, keys: Iterable[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Decode the given samples from a local dataset's shards (those of ``manifest.json``, in
    order, until every key is found).

    Returns:
        ``{key: tensors}``: ``input_ids`` [T] int64, ``loss_mask`` [T] uint8,
        ``aux_hidden_states`` [T, A*H] and ``hidden_states`` [T, H] in the stored dtype (fp8:
        dequantised to bfloat16, scales dropped; ``final_rows="taught"``: zeros where the next
        token is not supervised).

    Raises:
        ValueError: a key is in no shard (up to 5 named), or a sample or shard is unreadable.
    """
    want = set(keys)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for sh in read_manifest(dataset_dir)["shards"]:
        if len(out) == len(want):
            break
        found = shard_payloads(Path(dataset_dir) / sh["name"], want - set(out), (TENSOR_EXT,))
        for key, payload in found.items():
            out[key] = dequantize_fields(expand(decode_tensors(payload[TENSOR_EXT], where=f"{sh['name']}:{key}")))
    missing = want - set(out)
    if missing:
        raise ValueError(f"{dataset_dir}: samples not found: {sorted(missing)[:5]}")
    return out
