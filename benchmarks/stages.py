"""``python -m benchmarks stages``: what bounds extraction with a real model on real data.

Each stage of ``eagle-data extract`` alone, then the whole pipeline, then the disk, in one run,
on the same rows (the target loaded once, excluded from every figure):

(f) the front alone: records -> conversations -> chat template + tokens + loss mask -> batches
    (:func:`eagle_data.extract.stages.front`), in this thread;
(a) the plain prefill forward of those batches (padded as the backend pads them), no capture;
(b) capture to host memory: hooks, cast/quantise on the device, device-to-host copy, the
    per-sample split and finiteness (:func:`~eagle_data.extract.stages.capture` +
    :func:`~eagle_data.extract.stages.to_samples`), nothing written;
(w) the shard writers alone: samples already in host memory (b's first batches, cycled under
    new keys to the bytes of the whole run) through :class:`AsyncShardWriter` to the disk,
    published (fsync) at the end;
(c) ``run_extract`` end to end (front process or thread, capture, writers) into a fresh folder on the disk;
(d) the disk's raw write rate (fsync'd files of shard size; 1 and ``writers`` threads).

The pipeline is as fast as its slowest stage when the stages overlap: (c) far below
min(f, a, b, w) says they interfere; (c)'s waits (``c_waits_s``: front, capture, writers, close;
see ``run_extract``'s run stats) say where its capture loop waited. (c)'s bytes/s against (d) is
the issue's "GB/s vs the disk" figure. ``pipeline_only`` runs (c) and (d) alone (a minute less).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from itertools import cycle
from pathlib import Path
from typing import Any, Callable, Iterator


def bench_stages(model: str = "smollm2", data: str = "sharegpt", num_samples: int | None = 1000,
                 device: str = "cuda", dtype: str = "bfloat16", storage_dtype: str | None = None,
                 max_length: int = 2048, batch_tokens: int = 65536, writers: int = 2, write_queue_gib: float = 2.0,
                 out: str | None = None, keep_gib: float = 2.0, switch_interval: float | None = None,
                 write_behind_chunks: int | None = None, pipeline_only: bool = False, front: str = "auto",
                 cuda_graphs: bool = False, padding_mask: bool = False, json_out: str | None = None) -> dict[str, Any]:
    """Tokens/s of each extraction stage alone and of the whole pipeline, and the disk's rate:
    (f) front, (a) plain forward, (b) capture to host, (w) the shard writers alone, (c) the whole
    pipeline (``run_extract``; ``c_waits_s``: where its capture loop waited), (d) the raw disk.

    Args:
        model: "smollm2" (the embedded default, from PyPI) or a local HF model folder.
        data: as ``eagle-data extract --data``.
        num_samples: source rows (None: all).
        device: "cuda" or "cpu".
        dtype: compute dtype.
        storage_dtype: stored dtype (default: ``dtype``), e.g. ``float8_e4m3fn``.
        max_length: tokens per sample at most.
        batch_tokens: padded tokens per forward (as ``extract --batch_tokens``).
        writers: shard-writer threads (as ``extract --writers``).
        write_queue_gib: GiB waiting for the writers at most (as ``extract --write_queue_gib``).
        out: a folder on the disk to measure (default: a temporary folder).
        keep_gib: host memory of captured samples kept for (w).
        switch_interval: ``sys.setswitchinterval`` for (w) and (c) (default: Python's, 5 ms): how
            long a thread back from a GIL-free call (a torch op, hashing, a write) may wait for the GIL.
        write_behind_chunks: chunks of 32 MiB each writer keeps on their way to the disk in (w)
            and (c) (default: :data:`eagle_data.extract.writeback.IN_FLIGHT`): deeper queues may
            suit a network disk.
        pipeline_only: only (c) and (d) (after a warm-up capture of the first batches).
        front: where (c) runs its front (as ``extract --front``: "auto", "process", "thread").
        cuda_graphs: (b) and (c) run the prefill through CUDA graphs (as ``extract --backend_kwargs
            '{"cuda_graphs": true}'``); (a) stays the eager forward, and ``graph_max_abs_diff`` is
            the largest difference of the graphed states from the eager ones on the first batches.
        padding_mask: the eager forward always gets the padding mask (what every batch got before
            the backend found causal models' padding invisible): the A/B of that change.
        json_out: also write the figures to this JSON file.
    """
    from eagle_data.extract.config import ExtractConfig, check_paths
    from benchmarks.scratch import check_outputs, scratch

    # every setting checked before any work or any file (the extraction's own through check_paths)
    unused = Path(tempfile.gettempdir()) / f"eagle-stages-check-{uuid.uuid4().hex}"  # replaced by the scratch folder
    cfg = ExtractConfig(out=str(unused), model=model, data=data, num_samples=num_samples, device=device, dtype=dtype,
                        storage_dtype=storage_dtype, max_length=max_length, batch_tokens=batch_tokens,
                        writers=writers, write_queue_gib=write_queue_gib, front=front, progress=False)
    check_paths(cfg)
    check_outputs(out, json_out)
    _check_settings(device, write_behind_chunks, switch_interval, keep_gib, cuda_graphs, padding_mask)
    be, tok = _load_target(cfg, cuda_graphs, padding_mask)
    res = _header(cfg, be, cuda_graphs)
    with scratch(out, "eagle-stages-") as root:
        cfg = replace(cfg, out=str(root / "c"))
        with _tuned(write_behind_chunks, switch_interval) as tuned:
            res.update(tuned)
            stats = _stages_then_pipeline(cfg, be, tok, root, keep_gib, pipeline_only, res)
        res.update(_pipeline_figures(stats, cfg, root))
    _finish(res, pipeline_only, json_out)
    return res


def _check_settings(device: str, write_behind_chunks: int | None, switch_interval: float | None, keep_gib: float,
                    cuda_graphs: bool, padding_mask: bool) -> None:
    """The benchmark's own settings (the extraction's are :func:`check_paths`'), else a ValueError."""
    if write_behind_chunks is not None and write_behind_chunks < 1:
        raise ValueError(f"write_behind_chunks must be >= 1, got {write_behind_chunks}")
    if switch_interval is not None and not 0 < switch_interval <= 1:
        raise ValueError(f"switch_interval must be in (0, 1] seconds, got {switch_interval}")
    if not keep_gib > 0:
        raise ValueError(f"keep_gib must be > 0, got {keep_gib}")
    if cuda_graphs and not device.startswith("cuda"):
        raise ValueError(f"cuda_graphs: CUDA graphs need a CUDA device, got device {device}")
    if cuda_graphs and padding_mask:
        raise ValueError("padding_mask: the graphs take no mask; give cuda_graphs or padding_mask, not both")


def _load_target(cfg, cuda_graphs: bool, padding_mask: bool):
    """``cfg``'s tokenizer and HF backend (loaded once, outside every figure)."""
    from eagle_data.engines import make_backend
    from eagle_data.extract.config import model_dir
    from eagle_data.extract.run import load_tokenizer

    path = model_dir(cfg.model)
    tok = load_tokenizer(path, False)
    be = make_backend("hf", model_path=path, aux_layer_ids=None, dtype=cfg.dtype, device=cfg.device,
                      out_dtype=_stored(cfg)[0], final_out_dtype=_stored(cfg)[1], cuda_graphs=cuda_graphs)
    be.mask_padding = be.mask_padding or padding_mask
    return be, tok


def _header(cfg, be, cuda_graphs: bool) -> dict[str, Any]:
    """The settings the figures were measured with."""
    import torch

    return {"model": cfg.model, "data": cfg.data, "device": torch.cuda.get_device_name() if cfg.device.startswith("cuda")
            else "cpu", "dtype": cfg.dtype, "storage_dtype": _stored(cfg)[0], "batch_tokens": cfg.batch_tokens,
            "writers": cfg.writers, "front": cfg.front, "cuda_graphs": cuda_graphs, "padding_mask": be.mask_padding}


@contextmanager
def _tuned(write_behind_chunks: int | None, switch_interval: float | None) -> Iterator[dict[str, Any]]:
    """Write-behind depth and GIL switch interval set as asked (restored after); yields those in force."""
    import sys

    import eagle_data.extract.writeback as wb

    old = wb.IN_FLIGHT, sys.getswitchinterval()
    try:
        if write_behind_chunks is not None:
            wb.IN_FLIGHT = write_behind_chunks
        if switch_interval is not None:
            sys.setswitchinterval(switch_interval)
        yield {"write_behind_chunks": wb.IN_FLIGHT, "switch_interval": sys.getswitchinterval()}
    finally:
        wb.IN_FLIGHT = old[0]
        sys.setswitchinterval(old[1])


def _stages_then_pipeline(cfg, be, tok, root: Path, keep_gib: float, pipeline_only: bool,
                          res: dict[str, Any]) -> dict[str, Any]:
    """The stages alone (or a warm-up), then (c) ``run_extract``; their figures into ``res``, (c)'s run stats returned."""
    from eagle_data.extract.manifest import NoSamples
    from eagle_data.extract.run import run_extract

    if not pipeline_only:
        res.update(_stages_alone(cfg, be, tok, root, keep_gib))
    else:  # the kernels' first launches (and the pinned pool) are no part of the pipeline's rate
        _warm_up(cfg, be, tok)
    _settle()
    try:
        stats = run_extract(cfg, backend=be, tokenizer=tok)["run_stats"]
    except NoSamples as e:
        raise ValueError(f"{e}: nothing to measure") from None
    if be._graphs is not None:  # buckets captured in (b) and (c), batches past max_graphs
        res.update(graphs=len(be._graphs.graphs), graph_eager_batches=be._graphs.eager_batches)
    return stats


def _pipeline_figures(stats: dict[str, Any], cfg, root: Path) -> dict[str, Any]:
    """(c)'s figures from its run stats and the shards it wrote (then deleted), and (d) for the same bytes."""
    from benchmarks.extract import disk_write_rate

    written = sum(p.stat().st_size for p in Path(cfg.out).glob("*.tar"))
    if not written:
        raise ValueError(f"no sample of data {cfg.data!r} was extracted (see the skips above): nothing to measure")
    shutil.rmtree(cfg.out, ignore_errors=True)
    _settle()
    c_gb_s = written / stats["seconds"] / 1e9
    res = dict(c_pipeline_tok_s=round(stats["tokens_per_s"]), c_tokens=stats["new_tokens"],
               c_seconds=stats["seconds"], c_GB_s=_sig(c_gb_s), c_waits_s=stats["waits_s"],
               c_front=stats["front"], c_front_start_s=stats["front_start_s"])
    # (d) the same bytes as (c) wrote, as fsync'd files of shard size
    res["d_disk_GB_s_1"] = _sig(disk_write_rate(root, written, int(cfg.shard_max_bytes), 1))
    res[f"d_disk_GB_s_{cfg.writers}"] = _sig(disk_write_rate(root, written, int(cfg.shard_max_bytes), cfg.writers))
    res["c_over_disk"] = round(c_gb_s / max(res["d_disk_GB_s_1"], res[f"d_disk_GB_s_{cfg.writers}"]), 3)
    return res


def _finish(res: dict[str, Any], pipeline_only: bool, json_out: str | None) -> None:
    """Add (c) against (a) and the bounding stage to ``res``; print it; also to ``json_out`` if given."""
    if not pipeline_only:
        res["c_over_a"] = round(res["c_pipeline_tok_s"] / res["a_plain_tok_s"], 3)
        res["bound"] = min(("f_front_tok_s", "a_plain_tok_s", "b_capture_tok_s", "w_writers_tok_s"), key=res.get)
    for k, v in res.items():
        print(f"{k:>18}: {v}")
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant figures: a small run's GB/s is not rounded to 0."""
    return float(f"{x:.{digits}g}")


def _settle(seconds: float = 2.0) -> None:
    """Let the disk finish what the last stage left (writeback, the discards of deleted files)
    before the next one is timed."""
    import os

    os.sync()
    time.sleep(seconds)


def _stored(cfg) -> tuple[str, str]:
    """The dtypes ``cfg`` stores the aux and the final hidden states in."""
    from eagle_data.extract.config import stored_dtypes

    return stored_dtypes(cfg.dtype, cfg.storage_dtype, cfg.final_storage_dtype)


def _front(cfg, be, tok, policy):
    """The batches of ``cfg``'s rows as ``run_extract`` builds them (:func:`eagle_data.extract.stages.front`)."""
    from eagle_data.extract.chat import ChatRenderer
    from eagle_data.extract.config import rows_to_read
    from eagle_data.extract.run import batching
    from eagle_data.extract.sources import iter_records
    from eagle_data.extract.stages import front

    return front(iter_records(cfg.data, num_samples=rows_to_read(cfg.num_samples, cfg.data)),
                 ChatRenderer.from_path(tok, None), "x", be.info.vocab_size, batching(cfg), policy)


def _warm_up(cfg, be, tok, num_batches: int = 8) -> None:
    """Capture the first ``num_batches`` batches of ``cfg``'s rows, nothing written."""
    from itertools import islice

    from eagle_data.extract.fault import ErrorPolicy
    from eagle_data.extract.signals import Signals
    from eagle_data.extract.stages import capture

    batches = islice(_front(cfg, be, tok, ErrorPolicy("skip")), num_batches)
    quiet = logging.getLogger("eagle_data.extract.fault")  # the run logs these rows' skips itself
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        for _ in capture(batches, be, Signals()):
            pass
    finally:
        quiet.setLevel(level)


def _graph_vs_eager(be, batches) -> float:
    """The largest |graphed - eager| of any state of any real token of ``batches`` (bf16: kernel
    rounding, as between two batch compositions)."""
    import torch

    worst = 0.0
    for b in batches:
        seqs = [s.input_ids for s in b]
        with torch.inference_mode():
            eager = be.forward_padded(seqs)[0]
            graphed = be._graphs(seqs)
        for name, x in eager.items():
            for i, s in enumerate(seqs):
                n = s.shape[0]
                worst = max(worst, (x[i, :n].float() - graphed[name][i, :n].float()).abs().max().item())
    return worst


def _stages_alone(cfg, be, tok, root: Path, keep_gib: float) -> dict[str, Any]:
    """(f), (a), (b) and (w) of the module doc on ``cfg``'s rows, one after the other."""
    from eagle_data.extract.fault import ErrorPolicy

    t0 = time.perf_counter()
    policy = ErrorPolicy("skip")
    batches = list(_front(cfg, be, tok, policy))
    tokens = sum(s.num_tokens for b in batches for s in b)
    if not tokens:
        raise ValueError(f"no sample of data {cfg.data!r} can be extracted (see the skips above): nothing to measure")
    res: dict[str, Any] = dict(samples=sum(map(len, batches)), tokens=tokens,
                               f_front_tok_s=round(tokens / (time.perf_counter() - t0)))
    kept = _forward_alone(cfg, be, batches, policy, keep_gib, res)
    res["w_writers_tok_s"] = _writers_alone(cfg, kept, root / "w", tokens)
    return res


def _syncer(device: str) -> Callable[[], None]:
    """What waits for ``device``'s queued work (nothing off CUDA)."""
    import torch

    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def _plain(be, batches, sync: Callable[[], None]) -> None:
    """(a): the plain forward of ``batches`` (padded as the backend pads them), no capture."""
    import torch

    with torch.inference_mode():
        for b in batches:
            be.forward_padded([s.input_ids for s in b])
    sync()


def _captured(be, batches, storage, data: str, policy, sync: Callable[[], None], keep_bytes: float = 0) -> list:
    """(b): ``batches`` captured to host samples, nothing written; the first samples up to
    ``keep_bytes`` of tensors returned."""
    from eagle_data.extract.signals import Signals
    from eagle_data.extract.stages import capture, to_samples

    kept = []
    for out_batch in to_samples(capture(iter(batches), be, Signals()), storage, data, "x", policy):
        for s in out_batch if keep_bytes > 0 else ():
            kept.append(s)
            keep_bytes -= sum(t.nbytes for t in s.tensors.values())
    sync()
    return kept


def _forward_alone(cfg, be, batches, policy, keep_gib: float, res: dict[str, Any]) -> list:
    """(a) and (b) on ``batches`` (after a warm-up), timed into ``res`` with the bytes per token; returns
    the samples of one more capture, ``keep_gib`` of them, for (w)."""
    from eagle_data.format.schema import storage_dtype_of

    sync = _syncer(cfg.device)
    storage = tuple(storage_dtype_of(d) for d in _stored(cfg))
    _plain(be, batches, sync)  # warm-up: kernels, allocator
    if be._graphs is not None:
        res["graph_max_abs_diff"] = _graph_vs_eager(be, batches[:4])
    for name, fn in (("a_plain_tok_s", partial(_plain, be, batches, sync)),
                     ("b_capture_tok_s", partial(_captured, be, batches, storage, cfg.data, policy, sync))):
        t0 = time.perf_counter()
        fn()
        res[name] = round(res["tokens"] / (time.perf_counter() - t0))
    kept = _captured(be, batches, storage, cfg.data, policy, sync, keep_gib * 2**30)
    res["bytes_per_token"] = round(sum(t.nbytes for t in kept[0].tensors.values()) / kept[0].meta["num_tokens"], 1)
    return kept


def _writers_alone(cfg, kept: list, d: Path, tokens: int) -> int:
    """(w): tokens/s of ``cfg``'s shard writers writing ``kept`` (cycled under new keys) into ``d``
    until ``tokens`` tokens, published at the end; ``d`` deleted after."""
    from eagle_data.extract.async_sink import AsyncShardWriter
    from eagle_data.extract.sink import ShardSink

    shutil.rmtree(d, ignore_errors=True)
    sinks = [ShardSink(d, 0, w, cfg.shard_max_samples, cfg.shard_max_bytes, shard_step=cfg.writers)
             for w in range(cfg.writers)]
    t0, n = time.perf_counter(), 0
    with AsyncShardWriter(sinks, max_bytes=int(cfg.write_queue_gib * 2**30)) as w:  # Ctrl-C: aborted
        for i, s in enumerate(cycle(kept)):
            if n >= tokens:
                break
            w.put(f"x_{i}", s.tensors, s.meta)
            n += s.meta["num_tokens"]
    rate = round(n / (time.perf_counter() - t0))
    shutil.rmtree(d, ignore_errors=True)
    return rate
