"""Throughput of SGLang prefill with and without hidden-state capture (``eagle-data bench sglang``).

Same prompts (random token ids, fixed length), same engine settings
(:func:`eagle_data.engines.sglang.base_engine_kwargs`), one engine at a time:

* ``plain``: prefill only, ``max_new_tokens=0``, no capture;
* ``capture``: :class:`~eagle_data.engines.sglang.SGLangBackend` (hook + spool hand-off +
  stitching into ``Captured``), then, if :mod:`eagle_data.extract.sink` is available, writing the
  samples into WebDataset shards (``capture+write``);
* ``builtin``: SGLang's own ``return_hidden_states=True`` path (``max_new_tokens=1``: with 0
  it returns nothing; with aux capture off it returns the final state only, as Python
  lists). Rows returned per prompt are reported: with chunked prefill it keeps only the
  last chunk's rows.

tokens/s counts prompt tokens. Each engine gets one warm-up request before timing.
Run as ``python -m benchmarks.sglang MODEL [--num-prompts N] [--prompt-len T]``.
"""

from __future__ import annotations

import json
import tempfile
import time
from functools import partial
from typing import Any, Callable, Sequence

import torch


def _prompts(vocab: int, num_prompts: int, prompt_len: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (prompt_len,), generator=g) for _ in range(num_prompts)]


def _engine_run(kw: dict[str, Any], prompts: list[torch.Tensor], builtin: bool) -> dict[str, Any]:
    import sglang
    eng = sglang.Engine(**kw)
    try:
        sp = {"max_new_tokens": 1 if builtin else 0}
        extra = {"return_hidden_states": True} if builtin else {}
        eng.generate(input_ids=[[1, 2, 3]], sampling_params=sp, **extra)  # warm-up
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=[p.tolist() for p in prompts], sampling_params=sp, **extra)
        dt = time.perf_counter() - t0
        res: dict[str, Any] = {"seconds": dt}
        if builtin:
            rows = []
            for o in outs:
                hs = o["meta_info"].get("hidden_states") or []
                rows.append(sum(len(h) if h and isinstance(h[0], list) else (1 if h else 0) for h in hs))
            res["rows_returned_per_prompt"] = sorted(set(rows))
        return res
    finally:
        eng.shutdown()


def _capture_run(model_path: str, prompts, dtype, device, aux_layer_ids, common: dict, write_dir: str | None,
                 backend_kwargs: dict, batch_prompts: int, storage_dtype: str | None) -> dict[str, Any]:
    """Capture to host (``write_dir`` None) or capture + shards, as extraction runs them: batches of
    ``batch_prompts`` through :meth:`SGLangBackend.capture_iter` (the next batch already in the engine
    while this one is written), the shards by extraction's two writer threads
    (:class:`~eagle_data.extract.async_sink.AsyncShardWriter`, 2 GiB queued at most)."""
    from eagle_data.engines.sglang import SGLangBackend, SGLangOptions
    from eagle_data.format.fp8 import scale_name
    be = SGLangBackend(model_path, aux_layer_ids, dtype=dtype, device=device, out_dtype=storage_dtype,
                       options=SGLangOptions(**common, **backend_kwargs))
    sink = None
    try:
        batch = [(f"bench_{i:06d}", p) for i, p in enumerate(prompts)]
        batches = [batch[i:i + batch_prompts] for i in range(0, len(batch), batch_prompts)]
        if write_dir is not None:
            from eagle_data.extract.async_sink import AsyncShardWriter
            from eagle_data.extract.sink import ShardSink
            sink = AsyncShardWriter([ShardSink(write_dir, 0, w, max_samples=256, shard_step=2) for w in range(2)])
        t0, first = time.perf_counter(), None
        for caps, items in zip(be.capture_iter(batches, prefetch=1), batches):
            first = first or caps[0]
            if sink is not None:
                for c, (_, ids) in zip(caps, items):
                    scales = {scale_name(f): x for f, x in (("aux_hidden_states", c.aux_scale),
                                                            ("hidden_states", c.hidden_scale)) if x is not None}
                    sink.put(c.key, {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.uint8),
                                       "aux_hidden_states": c.aux_hidden_states, "hidden_states": c.hidden_states,
                                       **scales},
                               {"source_id": c.key, "source_row": 0, "num_turns": 1, "truncated": False})
        if sink is not None:
            sink.close()
            sink, written = None, sink.bytes_written
        res: dict[str, Any] = {"seconds": time.perf_counter() - t0, "startup_s": be.startup_s,
                               "bytes_per_token": first.aux_hidden_states[0].nbytes + first.hidden_states[0].nbytes,
                               "hook": be.hook_stats(), "collect": dict(be.collect_stats)}
        if write_dir is not None:
            res["shard_bytes"] = written
        return res
    finally:
        if sink is not None:
            sink.abort()
        be.close()


def bench_sglang(model_path: str = "smollm2", num_prompts: int = 32, prompt_len: int = 512, *,
                 dtype: str = "float32", device: str = "cpu", chunked_prefill_size: int | None = 256,
                 aux_layer_ids: Sequence[int] | None = None,
                 modes: Sequence[str] = ("plain", "capture", "capture+write", "builtin"), batch_prompts: int = 64,
                 load_format: str | None = None, attention_backend: str | None = None, seed: int = 0,
                 json_out: str | None = None, backend_kwargs: dict[str, Any] | None = None,
                 storage_dtype: str | None = None) -> dict[str, Any]:
    """SGLang extraction tokens/s: plain prefill (a) vs capture to host (b) vs capture + shards (c) vs
    SGLang's return_hidden_states.

    Args:
        model_path: "smollm2" (embedded default) or a local HF model folder.
        num_prompts: prompts (random ids, all ``prompt_len`` long), sent together.
        prompt_len: tokens per prompt.
        dtype: "float32" or "bfloat16" (shared by all modes).
        device: "cpu" or "cuda".
        chunked_prefill_size: SGLang chunked prefill size.
        aux_layer_ids: for the capture mode (default: EAGLE-3 defaults).
        modes: subset of ``("plain", "capture", "capture+write", "builtin")``; ``capture+write`` also
            writes the samples into WebDataset shards in a temp dir (deleted afterwards) by
            extraction's writer threads, overlapped with the next batch's capture as extraction does.
        batch_prompts: prompts per capture batch (``capture_iter``, one batch ahead).
        load_format: SGLang ``load_format`` (``"dummy"``: random weights from ``config.json`` alone,
            e.g. an 8B-shaped target without 16 GB of files), for every mode.
        attention_backend: SGLang attention backend (a GPU without FA3 needs "triton" or "flashinfer").
        seed: seed of the random prompts.
        json_out: also write the result to this JSON file.
        backend_kwargs: extra :class:`SGLangBackend` kwargs (``max_inflight``, ...).
        storage_dtype: what the capture modes return and write (default: ``dtype``);
            ``"float8_e4m3fn"``: quantised in the scheduler, as ``extract --storage_dtype``.

    Returns:
        ``{"config": {...}, "results": {mode: {"tokens_per_s", "seconds", ...}}}``; also printed.
    """
    from eagle_data.engines.sglang import base_engine_kwargs, model_facts

    backend_kwargs = dict(backend_kwargs or {})
    if model_path == "smollm2":
        from eagle_data.assets import smollm2_model_dir
        model_path = str(smollm2_model_dir())
    _, _, vocab, _ = model_facts(model_path)
    prompts = _prompts(vocab, num_prompts, prompt_len, seed)
    common = dict(chunked_prefill_size=chunked_prefill_size,
                  mem_fraction_static=backend_kwargs.pop("mem_fraction_static", None),
                  max_total_tokens=backend_kwargs.pop("max_total_tokens", None), attention_backend=attention_backend)
    kw = base_engine_kwargs(str(model_path), dtype, torch.device(device).type, **common)
    if load_format:
        kw["load_format"] = load_format
        backend_kwargs["engine_kwargs"] = {**backend_kwargs.get("engine_kwargs", {}), "load_format": load_format}
    capture = partial(_capture_run, str(model_path), prompts, dtype, device, aux_layer_ids, common,
                      backend_kwargs=backend_kwargs, batch_prompts=batch_prompts, storage_dtype=storage_dtype)
    results = _run_modes(modes, kw, prompts, capture, num_prompts * prompt_len)
    out = {"config": {"model_path": str(model_path), "num_prompts": num_prompts, "prompt_len": prompt_len,
                      "batch_prompts": batch_prompts, "storage_dtype": storage_dtype or dtype,
                      "dtype": dtype, "device": device, "chunked_prefill_size": chunked_prefill_size,
                      "engine_kwargs": {k: v for k, v in kw.items() if k != "model_path"}},
           "results": results}
    _report(out, json_out)
    return out


def _run_modes(modes: Sequence[str], kw: dict[str, Any], prompts: list[torch.Tensor],
               capture: Callable[..., dict[str, Any]], n_tok: int) -> dict[str, dict[str, Any]]:
    """Each mode's run (engine kwargs ``kw``; ``capture(write_dir=...)`` for the capture modes) and its
    tokens/s over ``n_tok`` prompt tokens, by mode."""
    results: dict[str, dict[str, Any]] = {}
    for mode in modes:
        if mode == "plain":
            r = _engine_run(kw, prompts, builtin=False)
        elif mode == "builtin":
            r = _engine_run({**kw, "enable_return_hidden_states": True}, prompts, builtin=True)
        elif mode in ("capture", "capture+write"):
            with tempfile.TemporaryDirectory(prefix="eagle-bench-") as d:
                r = capture(write_dir=d if mode == "capture+write" else None)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        r["tokens_per_s"] = n_tok / r["seconds"]
        results[mode] = r
    return results


def _report(out: dict[str, Any], json_out: str | None) -> None:
    """Print the results of ``out`` (against plain prefill, if run); also write ``out`` to ``json_out`` if given."""
    c, results = out["config"], out["results"]
    print(f"bench sglang: {c['num_prompts']} prompts x {c['prompt_len']} tokens, {c['dtype']} on {c['device']}, "
          f"chunked_prefill_size={c['chunked_prefill_size']}")
    base = results.get("plain", {}).get("tokens_per_s")
    for mode, r in results.items():
        rel = f"  ({r['tokens_per_s'] / base:.2f}x plain)" if base else ""
        notes = {k: v for k, v in r.items() if k not in ("tokens_per_s", "seconds")}
        print(f"  {mode:14s} {r['tokens_per_s']:10.0f} tok/s  {r['seconds']:7.2f} s{rel}  {notes if notes else ''}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump(out, f, indent=1, default=str)
