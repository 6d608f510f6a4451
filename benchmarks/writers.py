"""``python -m benchmarks writers``: what bounds the shard writers against the disk.

The writers of ``eagle-data extract`` (:class:`~eagle_data.extract.async_sink.AsyncShardWriter`
over :class:`~eagle_data.extract.sink.ShardSink`) alone, on synthetic samples of a target's shape
already in host memory, against the disk's raw rate measured right after each variant (the rate of
a shared virtual disk moves by tens of per cent within a minute, so each variant has its own):

* ``shipped``: the writers as they are (sha256 in a thread of each shard file, beside its write);
* ``inline_hash``: each writer hashes a sample, then writes it (how the writers were before);
* ``no_hash``: nothing hashed, the ceiling of what hashing can cost;
* the disk: fsync'd files of shard size written by as many threads
  (:func:`benchmarks.extract.disk_write_rate`).

Also sha256's rate on one core of this machine. Medians over ``repeats`` rounds of every variant.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

VARIANTS = ("shipped", "inline_hash", "no_hash")


class _NoHash:
    def update(self, _b) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 64


@contextmanager
def _variant(name: str) -> Iterator[None]:
    """Patch the sink for one variant (restored on exit)."""
    import eagle_data.extract.sink as sink

    saved = (sink.hashlib.sha256, sink._HashingFile.write)

    def inline_write(self, bufs):  # the writer before: hash, then write
        views = [memoryview(b).cast("B") for b in bufs]
        self._hash(views)
        k = sink._writev_all(self.f.fileno(), [v for v in views if v.nbytes])
        self.n += k
        self.behind.written(self.n)
        return k
    try:
        if name == "no_hash":
            sink.hashlib.sha256 = _NoHash
        elif name == "inline_hash":
            sink._HashingFile.write = inline_write
        yield
    finally:
        sink.hashlib.sha256, sink._HashingFile.write = saved


def _say(line: str) -> None:
    """Print ``line``; a reader that went away (``| head``) ends the printing, not the run."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _samples(tokens: int, hidden_size: int, n: int = 32) -> list[dict[str, Any]]:
    import torch

    g = torch.Generator().manual_seed(0)
    pin = (lambda x: x.pin_memory()) if torch.cuda.is_available() else (lambda x: x)  # as the capture hands them
    out = []
    for _ in range(n):
        ids = torch.randint(0, 49_152, (tokens,), generator=g)
        out.append({"input_ids": ids, "loss_mask": (ids % 4 != 0).to(torch.uint8),
                    "aux_hidden_states": pin(torch.randn(tokens, 3 * hidden_size, generator=g).bfloat16()),
                    "hidden_states": pin(torch.randn(tokens, hidden_size, generator=g).bfloat16())})
    return out


def _write(root: Path, samples: list[dict[str, Any]], total: int, writers: int) -> float:
    """GB/s of the writers putting ``total`` bytes of ``samples`` (cycled) into fresh shards, published."""
    from eagle_data.extract.async_sink import AsyncShardWriter
    from eagle_data.extract.sink import ShardSink

    per = sum(t.nbytes for t in samples[0].values())
    meta = {"source_dataset": "bench", "dataset_tag": "b", "source_id": "x", "source_row": 0, "num_turns": 2,
            "num_tokens": int(samples[0]["input_ids"].shape[0]), "num_loss_tokens": 0, "truncated": False}
    n = max(1, total // per)
    t0 = time.perf_counter()
    with AsyncShardWriter([ShardSink(root, 0, i, 1000, 3e9, shard_step=writers) for i in range(writers)]) as w:
        for i in range(n):
            w.put(f"b_{i:09d}", samples[i % len(samples)], meta)
    return n * per / (time.perf_counter() - t0) / 1e9


def bench_writers(gib: float = 8.0, writers: int = 4, tokens: int = 1360, hidden_size: int = 576,
                  repeats: int = 2, out: str | None = None, json_out: str | None = None) -> dict[str, Any]:
    """GB/s of the shard writers alone in three variants (``shipped``: sha256 in a thread beside
    each write; ``inline_hash``: hash, then write; ``no_hash``) and of the raw disk right after
    each, with as many threads; medians over ``repeats`` rounds.

    Args:
        gib: GiB written per variant and per disk measurement (at least one sample per writer).
        writers: writer threads (as ``extract --writers``) and raw-disk threads.
        tokens: tokens per sample (SmolLM2 on ShareGPT: ~1,360).
        hidden_size: H (the sample holds [T, 3H] + [T, H] bf16 states); SmolLM2: 576.
        repeats: rounds of every variant (medians are reported).
        out: a folder on the disk to measure (default: a temporary folder).
        json_out: also write the figures to this JSON file.
    """
    import shutil

    from benchmarks.extract import disk_write_rate
    from benchmarks.scratch import check_outputs, scratch

    for name, v in (("gib", gib), ("writers", writers), ("tokens", tokens), ("hidden_size", hidden_size),
                    ("repeats", repeats)):
        if not 0 < v < math.inf:
            raise ValueError(f"{name} must be > 0 and finite, got {v}")
    total, per = int(gib * 2**30), tokens * (8 + 1 + 8 * hidden_size)  # ids int64, mask, [T, 4H] bf16
    if total < writers * per:
        raise ValueError(f"gib {gib} is less than one sample ({per} bytes) per writer: give at least "
                         f"{writers * per / 2**30:.2g}")
    check_outputs(out, json_out)
    buf = os.urandom(1 << 28)
    t0 = time.perf_counter()
    hashlib.sha256(buf).digest()
    res: dict[str, Any] = {"sha256_GB_s_one_core": round(len(buf) / (time.perf_counter() - t0) / 1e9, 3),
                           "writers": writers, "gib": gib, "tokens": tokens, "hidden_size": hidden_size}
    samples = _samples(tokens, hidden_size)
    rounds: dict[str, list[float]] = {k: [] for k in (*VARIANTS, *(f"{v}_over_disk" for v in VARIANTS))}
    with scratch(out, "eagle-bench-writers-") as root:
        (root / "warm-up").mkdir()
        _write(root / "warm-up", samples, min(total, 1 << 30), writers)  # imports, page faults, threads: untimed
        shutil.rmtree(root / "warm-up")
        for r in range(repeats):
            for name in VARIANTS:
                d = root / f"{name}-{r}"
                d.mkdir()
                with _variant(name):
                    rate = _write(d, samples, total, writers)
                shutil.rmtree(d)
                disk = disk_write_rate(root, total, int(3e9), writers)
                rounds[name].append(rate)
                rounds[f"{name}_over_disk"].append(rate / disk)
                _say(f"round {r} {name:12s} {rate:6.3f} GB/s   raw disk right after {disk:6.3f} GB/s   "
                     f"ratio {rate / disk:5.3f}")
    res.update({f"{k}{'' if k.endswith('disk') else '_GB_s'}": round(statistics.median(v), 3) for k, v in rounds.items()})
    res["rounds"] = {k: [round(x, 3) for x in v] for k, v in rounds.items()}
    if json_out:  # before printing: a closed stdout (``| head``) must not lose the figures
        Path(json_out).write_text(json.dumps(res, indent=1))
    _say(json.dumps({k: v for k, v in res.items() if k != "rounds"}, indent=1))
    return res
