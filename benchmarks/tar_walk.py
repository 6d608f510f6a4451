"""``python -m benchmarks tar_walk``: what walking a shard's member headers costs the loader.

The walk of :class:`eagle_data.format.tar.TarWalk` (Python's ``tarfile`` parses the headers)
against the hand-written ustar/pax/GNU parser the loader had before (:func:`handwritten_walk`,
its header walk of a local file kept here as the reference), and both against the loader's own
time per sample on the same shard. Warm page cache; each round times both walks and a loader
pass, shares are taken within a round; medians over rounds.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

_BLOCK = 512


def _tar_num(field: bytes) -> int:
    if field and field[0] in (0o200, 0o377):  # GNU base-256
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if field[0] == 0o377 else n
    field = field.split(b"\0", 1)[0].strip()
    return int(field, 8) if field else 0


def _pax(data: bytes) -> dict[str, str]:
    out, i = {}, 0
    while i < len(data) and data[i:i + 1] not in (b"\0", b""):
        sp = data.index(b" ", i)
        n = int(data[i:sp])
        k, _, v = data[sp + 1:i + n - 1].partition(b"=")
        out[k.decode("utf-8", "surrogateescape")] = v.decode("utf-8", "surrogateescape")
        i += n
    return out


def handwritten_walk(fd: int) -> Iterator[tuple[str, int, int]]:
    """``(name, data offset, size)`` of the regular members of the tar file open at ``fd``: the
    loader's former hand-written parser (``_TarReader.members`` on a local file, headers read
    with ``pread``), reduced to its walk (no error checks beyond the checksum)."""
    pos, hdr, pax, glob, longname = 0, os.pread(fd, _BLOCK, 0), {}, {}, None
    while len(hdr) == _BLOCK and hdr != bytes(_BLOCK):
        if _tar_num(hdr[148:156]) != sum(hdr[:148]) + 256 + sum(hdr[156:]):
            raise ValueError("bad tar header checksum")
        pos += _BLOCK
        typ, size = hdr[156:157], _tar_num(hdr[124:136])
        padded = -(-size // _BLOCK) * _BLOCK
        if typ in (b"x", b"g", b"L", b"K"):
            data = os.pread(fd, padded + _BLOCK, pos)
            if typ == b"x":
                pax = _pax(data[:size])
            elif typ == b"g":
                glob.update(_pax(data[:size]))
            elif typ == b"L":
                longname = data[:size].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            hdr, pos = data[padded:], pos + padded
            continue
        rec = {**glob, **pax}
        if "size" in rec:
            size = int(rec["size"])
            padded = -(-size // _BLOCK) * _BLOCK
        name = rec.get("path") or longname
        if name is None:
            name = hdr[:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            prefix = hdr[345:500].split(b"\0", 1)[0]
            if hdr[257:262] == b"ustar" and prefix:
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
        pax, longname = {}, None
        if typ in (b"0", b"\0", b"7"):
            yield name, pos, size
        hdr, pos = os.pread(fd, _BLOCK, pos + padded), pos + padded


def _tarfile_walk(path: Path) -> int:
    from eagle_data.format.tar import TarWalk

    with open(path, "rb", buffering=0) as f:  # as the loader opens a local shard
        return sum(1 for _ in TarWalk(f, str(path)).members())


def _handwritten(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return sum(1 for _ in handwritten_walk(fd))
    finally:
        os.close(fd)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _loader_pass(d: Path, batch_size: int) -> float:
    """Seconds per sample of one full loader pass over dataset ``d`` (0 workers, pages touched)."""
    from benchmarks.loader import one_pass
    from eagle_data.stream.dataset import EagleShardDataset
    from eagle_data.stream.loader import EagleDataLoader

    p = one_pass(lambda: EagleDataLoader(EagleShardDataset(d, batch_size=batch_size)), cold=False, touch=True)
    return p["seconds"] / p["samples"]


def _rounds(d: Path, shard: Path, samples: int, batch_size: int, repeats: int) -> dict[str, float]:
    """Time the two walks and a loader pass in each of ``repeats`` rounds (after a warm-up
    round); shares are paired within a round (this machine's load drifts); medians."""
    members = _tarfile_walk(shard)
    assert members == _handwritten(shard) == 2 * samples, (members, _handwritten(shard))
    _loader_pass(d, batch_size)
    tf, hw, loader = [], [], []
    for _ in range(repeats):
        tf.append(_timed(lambda: _tarfile_walk(shard)) / members)
        hw.append(_timed(lambda: _handwritten(shard)) / members)
        loader.append(_loader_pass(d, batch_size))
    med, per_sample = statistics.median, members / samples
    return {"MB_per_sample": shard.stat().st_size / samples / 1e6, "members": members,
            "tarfile_us_per_member": med(tf) * 1e6, "handwritten_us_per_member": med(hw) * 1e6,
            "loader_us_per_sample": med(loader) * 1e6,
            "tarfile_share": med(t * per_sample / ld for t, ld in zip(tf, loader)),
            "handwritten_share": med(h * per_sample / ld for h, ld in zip(hw, loader))}


def bench_tar_walk(samples: int = 1000, typical_hidden: int = 1024, typical_tokens: tuple[int, int] = (256, 768),
                   repeats: int = 7, batch_size: int = 8, json_out: Optional[str] = None) -> dict[str, Any]:
    """Header walk of a synthetic shard: tarfile (TarWalk) vs the former hand-written parser, in µs per member and as a share of the loader's time per sample.

    Two one-shard datasets of ``samples`` samples (2 members each): "small" (H=8, 4-8 tokens,
    ~1 KB per sample: the walk's worst case) and "typical" (H=``typical_hidden``, tokens in
    ``typical_tokens``: the samples of ``python -m benchmarks loader synthetic``, ~4 MB; real
    8B-model samples are ~40 MB, where the walk's share is ten times smaller again). The
    loader's time is a full pass of ``EagleDataLoader(EagleShardDataset(dir))`` with 0 workers
    over the same shard, the consumer touching every page (as in the loader benchmark). Warm
    page cache; ``repeats`` rounds, each timing both walks and a loader pass (shares paired
    within a round); medians over rounds.

    Args:
        samples: samples per shard.
        typical_hidden: H of the typical samples (aux is 3H, bf16).
        typical_tokens: ``[min, max)`` tokens of the typical samples.
        repeats: timed rounds (after one warm-up).
        batch_size: the loader's batch size.
        json_out: also write the figures to this JSON file.

    Returns:
        per size: ``MB_per_sample``, ``members``, ``tarfile_us_per_member``,
        ``handwritten_us_per_member``, ``loader_us_per_sample`` and the walks' shares of it
        (``tarfile_share``, ``handwritten_share``: walk time per sample / loader time per sample).
    """
    import torch

    from eagle_data.tools.synthetic import write_synthetic

    lo, hi = typical_tokens
    if samples < 1 or repeats < 1 or not 0 < lo < hi:
        raise ValueError("samples and repeats must be >= 1, typical_tokens [min, max) with 0 < min < max")
    sizes = {"small": (8, lambda g: 4 + g % 5), "typical": (typical_hidden, lambda g: lo + (g * 97) % (hi - lo))}
    res: dict[str, Any] = {}
    for label, (h, length) in sizes.items():
        tmp = Path(tempfile.mkdtemp(prefix="eagle-tarwalk-"))
        try:
            write_synthetic(tmp, [samples], hidden_size=h, length=length,
                            values=lambda g, h=h, length=length: torch.randn(length(g), h))
            res[label] = _rounds(tmp, next(tmp.glob("*.tar")), samples, batch_size, repeats)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _print(res, samples, repeats)
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))
    return res


def _print(res: dict[str, Any], samples: int, repeats: int) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"tar header walk, one shard of {samples} samples (2 members each), warm page cache, "
                    f"median of {repeats} rounds")
    for c in ("samples", "MB/sample", "tarfile µs/member", "hand-written µs/member", "loader µs/sample",
              "tarfile walk / loader", "hand-written walk / loader"):
        t.add_column(c)
    for label, r in res.items():
        t.add_row(label, f"{r['MB_per_sample']:.4f}", f"{r['tarfile_us_per_member']:.1f}",
                  f"{r['handwritten_us_per_member']:.1f}", f"{r['loader_us_per_sample']:.0f}",
                  f"{100 * r['tarfile_share']:.1f} %", f"{100 * r['handwritten_share']:.1f} %")
    con = Console(width=200)
    con.print(t)
    con.print("walk / loader: the walk's time per sample (2 members) over the loader's time per sample "
              "(EagleShardDataset + EagleDataLoader, 0 workers, every page touched) on the same shard.")


if __name__ == "__main__":
    bench_tar_walk()
