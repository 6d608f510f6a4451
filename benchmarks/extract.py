"""``eagle-data bench extract``: extraction throughput against the plain forward, in one run.

Measured side by side on the same model and prompts (random token ids, equal length, so
batches carry no padding):

(a) plain prefill forward of the base model, no capture;
(b) capture to host memory: hooks + aux/final cast + pinned device-to-host copy on a side
    stream, one batch in flight (:meth:`HFBackend.capture_async`);
(c) (b) + shard writing to local disk by background writer threads (safetensors + tar +
    sha256 + fsync + rename, the production :class:`ShardSink`);
(c0) (c) with write-behind off (:mod:`eagle_data.extract.writeback`: the page cache then holds
    the output until the closing fsync), with ``compare_write_behind``;
(d) the disk's raw write rate for the same bytes (files of shard size, fsync'd), same run;
(e) the peers' method (NVIDIA ModelOpt's ``compute_hidden_states_hf.py``, the EAGLE repo's
    ``ge_data`` scripts): the base forward with ``output_hidden_states=True`` (no hooks of its
    own), the same states picked from HF's tuple (aux ``hidden_states[k + 1]``; final
    ``hidden_states[-1]``, which transformers ties to the post-norm ``last_hidden_state``, as
    we store), a synchronous ``.cpu()`` per sample and one ``torch.save`` file per sample on
    the disk of (c), no fsync. Same batches as (a) (the peers' scripts run one conversation
    per forward).

MFU uses forward FLOPs = 2·P_nonembed + 2·L·H·T per token (causal attention: QKᵀ and AV
average T/2 keys) against ``peak_tflops`` (default 989, H200 dense bf16 spec).
"""

from __future__ import annotations

import os
import json
import math
import shutil
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

LLAMA31_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0)
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=600)
#: the shapes ``bench extract --shape`` builds
SHAPES = {"llama3.1-8b": LLAMA31_8B, "tiny": TINY}


def build_model(shape: str, dtype: torch.dtype, device: str, vocab_size: int | None = None):
    """Random-weight Llama of a named shape ("llama3.1-8b" or "tiny"), built on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**SHAPES[shape],
                         **({"vocab_size": vocab_size} if vocab_size else {})})
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def _sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def disk_write_rate(directory: Path, total_bytes: int, file_bytes: int, writers: int = 1) -> float:
    """GB/s writing ``total_bytes`` as fsync'd files of ``file_bytes`` with ``writers`` threads
    (the files are deleted after the clock stops: on a disk that discards freed blocks, deleting
    gigabytes takes seconds, which is no part of writing them)."""
    import threading

    buf = os.urandom(1 << 24)
    per = total_bytes // writers
    written: list[Path] = []
    errors: list[BaseException] = []

    def work(w):
        left, i = per, 0
        try:
            while left > 0:
                p = directory / f"raw-{w}-{i}.bin"
                written.append(p)
                with open(p, "wb") as f:
                    n = min(file_bytes, left)
                    while n > 0:
                        f.write(buf[: min(n, len(buf))])
                        n -= len(buf)
                    f.flush()
                    os.fsync(f.fileno())
                left -= file_bytes
                i += 1
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller (a full disk is no rate)
            errors.append(e)

    try:
        t0 = time.perf_counter()
        ts = [threading.Thread(target=work, args=(w,)) for w in range(writers)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        rate = per * writers / (time.perf_counter() - t0) / 1e9
        if errors:
            raise errors[0]
        return rate
    finally:
        for p in written:
            p.unlink(missing_ok=True)


def peers_run(be, batches: list, directory: Path, device: str) -> None:
    """(e): the peers' extraction of ``batches`` into ``directory`` (empty), one ``torch.save``
    file per sample (HF ``output_hidden_states=True``, synchronous ``.cpu()``, no fsync)."""
    directory.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        for batch in batches:
            x = torch.stack([ids for _, ids in batch]).to(device)
            hs = be.base(input_ids=x, use_cache=False, output_hidden_states=True).hidden_states
            be._store.clear()  # our backend's hooks stay registered, as in (a); they only keep references
            aux = torch.cat([hs[k + 1] for k in be.info.aux_layer_ids], dim=-1)
            for i, (key, ids) in enumerate(batch):
                torch.save({"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.uint8),
                            "aux": aux[i].cpu(), "final": hs[-1][i].cpu()}, directory / f"{key}.pt")


def bench_extract(shape: str = "llama3.1-8b", device: str = "cuda", dtype: str = "bfloat16",
                  seq_len: int = 2048, batch_size: int = 4, num_batches: int = 12, repeats: int = 3,
                  writers: int = 2, out: str | None = None, peak_tflops: float = 989.0,
                  write_queue_gib: float = 2.0, peers: bool = True, storage_dtype: str | None = None,
                  compare_write_behind: bool = True, json_out: str | None = None) -> dict[str, Any]:
    """Extraction tokens/s: (a) plain forward, (b) capture to host, (c) capture + shard writing, (d) raw disk rate,
    (e) the peers' method (output_hidden_states + one torch.save file per sample).

    Prints a table; returns the figures (medians over ``repeats``).

    Args:
        shape: "llama3.1-8b" (random bf16 weights, Llama-3.1-8B config; no download) or "tiny".
        device: "cuda" or "cpu".
        dtype: "bfloat16" or "float32".
        seq_len: tokens per prompt.
        batch_size: prompts per forward.
        num_batches: forwards per repeat.
        repeats: repeats; medians are reported.
        writers: shard-writer threads in (c) and in the parallel disk-rate test.
        out: directory on the disk to measure (default: a temp dir; same name as ``extract --out``).
        peak_tflops: peak dense bf16 TFLOP/s for the MFU figure.
        write_queue_gib: GiB waiting for the writers at most in (c) (as ``extract --write_queue_gib``).
        storage_dtype: dtype of the stored states in (c) (default: ``dtype``); ``float8_e4m3fn``
            quantises on the device with per-(token, layer) scales, as ``extract --storage_dtype``.
        peers: also run (e), the peers' method (HF ``output_hidden_states=True``, ``.cpu()``, one
            ``torch.save`` file per sample, no fsync) on the same batches and disk as (c).
        compare_write_behind: also run (c) with write-behind off (c0).
        json_out: also write the figures to this JSON file.
    """
    from eagle_data.engines.hf import HFBackend
    from eagle_data.checks import check_device, check_positive
    from eagle_data.format.schema import hidden_dtype, storage_dtype_of

    from benchmarks.scratch import check_outputs, scratch

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    check_device(device)
    check_positive(seq_len=seq_len, batch_size=batch_size, num_batches=num_batches, repeats=repeats, writers=writers)
    _check_finite_positive(peak_tflops=peak_tflops, write_queue_gib=write_queue_gib)
    dt = hidden_dtype(dtype)
    sd = storage_dtype_of(storage_dtype or dtype)
    check_outputs(out, json_out)
    with scratch(out, "eagle-bench-") as root:
        model = build_model(shape, dt, device)
        be = HFBackend(shape, None, dtype=dtype, device=device, model=model, out_dtype=storage_dtype)
        batches = _random_batches(model.config.vocab_size, seq_len, batch_size, num_batches)
        tokens = num_batches * batch_size * seq_len
        out_bytes_tok = _bytes_per_token(model.config.hidden_size, sd)
        runs = _warmed_up_runs(be, batches, device, root, writers, write_queue_gib, compare_write_behind, peers)
        res = _timed(runs, repeats, tokens, root)
        disks = _disk_rates(root, tokens * out_bytes_tok, 64 * seq_len * out_bytes_tok, writers)
        figures = {"shape": shape, "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
                   "dtype": dtype, "storage_dtype": str(sd).replace("torch.", ""), "bytes_per_token": out_bytes_tok,
                   "seq_len": seq_len, "batch_size": batch_size, "tokens_per_repeat": tokens,
                   "writers": writers, "write_queue_gib": write_queue_gib,
                   **_rate_figures(res, _flops_per_token(model, seq_len), peak_tflops, out_bytes_tok, disks, writers)}
    _report(figures, json_out)
    return figures


def _check_finite_positive(**values: float) -> None:
    """Each of ``values`` is a finite number > 0, else a ValueError naming it."""
    for name, v in values.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {v!r}")


def _random_batches(vocab_size: int, seq_len: int, batch_size: int, num_batches: int) -> list:
    """``num_batches`` batches of ``batch_size`` (key, random token ids of ``seq_len``), seeded."""
    g = torch.Generator().manual_seed(0)
    return [[(f"s{b}_{i}", torch.randint(0, vocab_size, (seq_len,), generator=g)) for i in range(batch_size)]
            for b in range(num_batches)]


def _bytes_per_token(hidden_size: int, sd: torch.dtype) -> int:
    """Bytes stored per token: 3 aux + 1 final states (+ 4 float32 scales when fp8)."""
    return 4 * hidden_size * sd.itemsize + (4 * 4 if sd == torch.float8_e4m3fn else 0)


def _flops_per_token(model, seq_len: int) -> int:
    """Forward FLOPs per token: 2·P_nonembed + 2·L·H·T (see the module doc)."""
    cfg = model.config
    p_nonembed = sum(p.numel() for n, p in model.model.named_parameters() if "embed_tokens" not in n)
    return 2 * p_nonembed + 2 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def _plain(be, batches: list, device: str) -> None:
    """(a): the base forward of ``batches``, no capture."""
    with torch.inference_mode():
        for batch in batches:
            x = torch.stack([ids for _, ids in batch]).to(device, non_blocking=True)
            be.base(input_ids=x, use_cache=False)
            be._store.clear()
    _sync(device)


def _capture(be, batches: list, device: str, writer=None) -> None:
    """(b): capture ``batches`` to host memory, one batch in flight; (c): each sample also to ``writer``."""
    pending, pending_batch = None, None
    for batch in batches + [None]:
        nxt = be.capture_async(batch) if batch is not None else None
        if pending is not None:
            for c, (_, ids) in zip(pending.result(), pending_batch):
                if writer is not None:
                    _put(writer, c, ids)
        pending, pending_batch = nxt, batch
    _sync(device)


def _put(writer, c, ids: torch.Tensor) -> None:
    """Hand captured sample ``c`` (token ids ``ids``) to ``writer``, as extraction does."""
    scales = {} if c.aux_scale is None else {"aux_hidden_states_scale": c.aux_scale,
                                             "hidden_states_scale": c.hidden_scale}
    writer.put(c.key, {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.uint8),
                       "aux_hidden_states": c.aux_hidden_states, "hidden_states": c.hidden_states,
                       **scales},
               {"source_id": c.key, "source_row": 0, "num_turns": 2, "truncated": False})


def _write_run(be, batches: list, device: str, shards: Path, writers: int, write_queue_gib: float) -> None:
    """(c): capture + shard writing into ``shards`` by ``writers`` background writer threads."""
    from eagle_data.extract.async_sink import AsyncShardWriter
    from eagle_data.extract.sink import ShardSink

    sinks = [ShardSink(shards, 0, w, max_samples=64, max_bytes=2e9, shard_step=writers)
             for w in range(writers)]
    with AsyncShardWriter(sinks, max_bytes=int(write_queue_gib * 2**30)) as w:  # Ctrl-C: aborted
        _capture(be, batches, device, w)


def _without_write_behind(run: Callable[[], None]) -> None:
    """(c0): ``run`` with write-behind off."""
    import eagle_data.extract.writeback as wb

    real, wb._sync_file_range = wb._sync_file_range, None
    try:
        run()
    finally:
        wb._sync_file_range = real


def _warmed_up_runs(be, batches: list, device: str, root: Path, writers: int, write_queue_gib: float,
                    compare_write_behind: bool, peers: bool) -> list[tuple[str, Callable[[], None]]]:
    """The timed runs, by name, after their warm-ups (kernels, allocator, pinned pool)."""
    from eagle_data.extract import async_sink, sink, writeback  # noqa: F401 - the writers' modules, loaded before the clock

    _plain(be, batches, device)  # warm-up (kernels, allocator, pinned pool)
    _capture(be, batches, device)
    write = partial(_write_run, be, batches, device, root / "shards", writers, write_queue_gib)
    runs = [("a_plain", partial(_plain, be, batches, device)), ("b_capture_host", partial(_capture, be, batches, device)),
            ("c_capture_write", write)]
    if compare_write_behind:
        runs.append(("c0_no_write_behind", partial(_without_write_behind, write)))
    if peers:
        peers_run(be, batches[:1], root / "peers", device)  # warm-up (HF's output-capturing hooks, torch.save)
        runs.append(("e_peers", partial(peers_run, be, batches, root / "peers", device)))
    return runs


def _clean(root: Path) -> None:
    """Delete the runs' output (untimed: outside the clock, see :func:`disk_write_rate`)."""
    for d in ("shards", "peers"):
        shutil.rmtree(root / d, ignore_errors=True)


def _timed(runs: list[tuple[str, Callable[[], None]]], repeats: int, tokens: int, root: Path) -> dict[str, list[float]]:
    """Tokens/s of each run in each of ``repeats`` rounds, the output deleted before each."""
    res: dict[str, list[float]] = {name: [] for name, _ in runs}
    for _ in range(repeats):
        for name, fn in runs:
            _clean(root)
            t0 = time.perf_counter()
            fn()
            res[name].append(tokens / (time.perf_counter() - t0))
    _clean(root)
    return res


def _disk_rates(root: Path, total: int, file_bytes: int, writers: int) -> tuple[float, float]:
    """(d): the disk's rate for ``total`` bytes with 1 and with ``writers`` threads."""
    return disk_write_rate(root, total, file_bytes, 1), disk_write_rate(root, total, file_bytes, writers)


def _rate_figures(res: dict[str, list[float]], flops_tok: int, peak_tflops: float, out_bytes_tok: int,
                  disks: tuple[float, float], writers: int) -> dict[str, Any]:
    """The medians of ``res``, the MFU of (a), the disk rates and the ratios to (a)."""
    disk1, diskw = disks
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        **{f"{k}_tok_s": round(v, 1) for k, v in med.items()},
        "mfu_a": round(med["a_plain"] * flops_tok / (peak_tflops * 1e12), 4),
        "output_GB_s_at_a": round(med["a_plain"] * out_bytes_tok / 1e9, 3),
        "disk_GB_s_1writer": round(disk1, 3), f"disk_GB_s_{writers}writers": round(diskw, 3),
        "ratio_b_over_a": round(med["b_capture_host"] / med["a_plain"], 4),
        "ratio_c_over_a": round(med["c_capture_write"] / med["a_plain"], 4),
        **({"ratio_c0_over_a": round(med["c0_no_write_behind"] / med["a_plain"], 4)} if "c0_no_write_behind" in med
           else {}),
        **({"ratio_e_over_a": round(med["e_peers"] / med["a_plain"], 4),
            "ratio_c_over_e": round(med["c_capture_write"] / med["e_peers"], 4)} if "e_peers" in med else {}),
        "bound_c_over_a": round(min(1.0, max(disk1, diskw) / (med["a_plain"] * out_bytes_tok / 1e9)), 4),
        "repeats": {k: [round(x, 1) for x in v] for k, v in res.items()},
    }


def _report(figures: dict[str, Any], json_out: str | None) -> None:
    """Print ``figures``, one a line; also to ``json_out`` if given."""
    for k, v in figures.items():
        print(f"{k:>24}: {v}")
    if json_out:
        Path(json_out).write_text(json.dumps(figures, indent=1, default=str))
