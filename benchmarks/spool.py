"""``python -m benchmarks spool``: the capture spool's hand-off alone, per chunk: a file per chunk
(:func:`~eagle_data.engines.sglang_spool.write_piece`, read back and unlinked) vs the shared-memory
ring (:class:`~eagle_data.engines.sglang_arena.ArenaWriter`, read back and freed), both through the
spool the backend reads with. One process, one thread: what each side costs a core."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from eagle_data.engines.sglang_arena import ArenaWriter
from eagle_data.engines.sglang_spool import Spool, piece_name, write_piece

#: chunk shapes: (rows, aux layers, hidden), a prefill chunk of one request
SHAPES = {"smollm2": (512, 3, 576), "llama3.1-8b": (1024, 3, 4096)}


def _rows(n: int, k: int, h: int) -> dict[str, torch.Tensor]:
    """A chunk as the hook stores it with fp8: ids, fp8 aux and final with float32 scales, ok flags."""
    return {"input_ids": torch.randint(0, 1 << 16, (n,)), "aux": torch.randn(n, k * h).to(torch.float8_e4m3fn),
            "final": torch.randn(n, h).to(torch.float8_e4m3fn), "aux_scale": torch.rand(n, k),
            "final_scale": torch.rand(n, 1), "ok": torch.ones(n, dtype=torch.bool)}


def bench_spool(shapes: tuple[str, ...] = ("smollm2", "llama3.1-8b"), chunks: int = 200, spool_dir: str | None = None,
                json_out: str | None = None) -> dict[str, Any]:
    """Median write and read (+ removal) seconds per chunk, file vs ring, and the GB/s they carry.

    Args:
        shapes: chunk shapes of :data:`SHAPES`.
        chunks: chunks timed per shape and route (after 20 untimed: the ring holds 8).
        spool_dir: where the spool goes (default ``/dev/shm``, as the backend's).
        json_out: also write the figures to this JSON file.
    """
    import json

    res: dict[str, Any] = {}
    for shape in shapes:
        rows = _rows(*SHAPES[shape])
        nbytes = sum(t.nbytes for t in rows.values())
        spool = Spool(spool_dir)
        try:
            spool.open_arena(8 * nbytes + 512)  # 8 chunks: the warm-up laps fault its pages in, as a long run does
            ring = ArenaWriter.open(spool.path)
            if ring is None:
                raise ValueError(f"spool_dir: no room for a ring of 8 {shape} chunks ({8 * nbytes / 1e6:.0f} MB) in "
                                 f"{spool.path.parent}")

            def by_file(i):
                return write_piece(spool.path, f"r{i}", 0, i, rows["input_ids"], rows["aux"], rows["final"],
                                   {k: v for k, v in rows.items() if k not in ("input_ids", "aux", "final")})

            def by_ring(i):
                return ring.put(piece_name(f"r{i}", 0, i, "arena"), {"rid": f"r{i}", "offset": 0, "seq": i}, rows)

            out = {}
            for route, put in (("file", by_file), ("ring", by_ring)):
                w, r = [], []
                for i in range(chunks + 20):
                    t0 = time.perf_counter()
                    path = put(i)
                    t1 = time.perf_counter()
                    spool.read(path)
                    spool.remove([path])
                    if i >= 20:
                        w.append(t1 - t0)
                        r.append(time.perf_counter() - t1)
                out[route] = {"write_ms": 1e3 * statistics.median(w), "read_ms": 1e3 * statistics.median(r),
                              "write_gb_s": nbytes / statistics.median(w) / 1e9,
                              "read_gb_s": nbytes / statistics.median(r) / 1e9}
            res[shape] = {"chunk_mb": nbytes / 1e6, **out}
            f, g = out["file"], out["ring"]
            print(f"{shape}: chunk {nbytes / 1e6:.2f} MB | file: write {f['write_ms']:.3f} ms ({f['write_gb_s']:.2f} GB/s), "
                  f"read {f['read_ms']:.3f} ms ({f['read_gb_s']:.2f} GB/s) | ring: write {g['write_ms']:.3f} ms "
                  f"({g['write_gb_s']:.2f} GB/s), read {g['read_ms']:.3f} ms ({g['read_gb_s']:.2f} GB/s) | ring / file: "
                  f"write {f['write_ms'] / g['write_ms']:.1f}x, read {f['read_ms'] / g['read_ms']:.1f}x faster")
        finally:
            spool.close()
    if json_out:
        with open(json_out, "w") as fh:
            json.dump(res, fh, indent=1)
    return res
