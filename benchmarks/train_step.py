"""``python -m benchmarks train_step``: drafter training speed (MFU) and peak memory per sequence length.

One optimizer step = the unrolled TTT loss (K steps) forward + backward + AdamW, on a random
batch held on the device (the data path is ``python -m benchmarks train``'s subject). The drafter
has a target's shape (default Llama-3.1-8B: H=4096, 32 heads, 8 KV heads, intermediate 14336,
target vocab 128256) with a draft vocabulary of ``draft_vocab_size``; the target's frozen
``embed_tokens``/``lm_head`` are random.

MFU counts the matmul FLOPs of the model as written (2 x multiply-adds; backward = 2 x forward for
trainable weights): per token, ``fc`` once, then per TTT step q/k/v/o, the MLP, the draft
``lm_head`` and the attention (causal step-0 part: on average T/2 keys, plus k diagonal keys),
plus the teacher (target ``lm_head`` restricted to the draft vocabulary, forward only) and the
out-of-vocabulary check (full target ``lm_head``, forward only) once per batch. FLOPs the
implementation spends beyond these (recomputation) are not counted, so MFU is honest.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Literal

import torch

from benchmarks.extract import LLAMA31_8B, SMOLLM2_135M, TINY


def step_flops(cfg: dict[str, Any], t: int, steps: int, n_draft: int, exclude_oov: bool = True) -> float:
    """Matmul FLOPs of one training step on one sequence of ``t`` tokens (see module doc)."""
    h, inter, nh, nkv = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"]
    hd, v = h // nh, cfg["vocab_size"]
    per_step = 2 * (2 * h * (nh + 2 * nkv) * hd + nh * hd * h + 3 * h * inter + h * n_draft)  # weights, fwd
    fwd = t * (2 * 3 * h * h)  # fc
    for k in range(steps):
        attn = 2 * 2 * nh * hd * (t / 2 + k)  # QK^T and PV per token: T/2 causal keys on average + k extras
        fwd += t * (per_step + attn)
    frozen = t * 2 * h * n_draft + (t * 2 * h * v if exclude_oov else 0)  # teacher + OOV check, no backward
    return 3 * fwd + frozen


SHAPES = {"llama3.1-8b": LLAMA31_8B, "smollm2-135m": SMOLLM2_135M, "tiny": TINY}


def _batch(b: int, t: int, v: int, h: int, g: torch.Generator, dev: torch.device) -> dict[str, torch.Tensor]:
    """A random batch of ``b`` full sequences of ``t`` tokens (all valid, all supervised)."""
    return {"input_ids": torch.randint(0, v, (b, t), generator=g).to(dev),
            "attention_mask": torch.ones(b, t, dtype=torch.bool, device=dev),
            "loss_mask": torch.ones(b, t, dtype=torch.bool, device=dev),
            "aux_hidden_states": torch.randn(b, t, 3 * h, generator=g).to(dev, torch.bfloat16),
            "hidden_states": torch.randn(b, t, h, generator=g).to(dev, torch.bfloat16)}


def bench_train_step(shape: Literal["llama3.1-8b", "smollm2-135m", "tiny"] = "llama3.1-8b",
                     seq_lens: list[int] = [2048, 8192], batch_size: int = 1, vary_lengths: bool = False,
                     steps: int = 7, draft_vocab_size: int | None = None, iters: int = 6, warmup: int = 2,
                     device: str = "cuda", attn_impl: str = "auto", exclude_oov: bool = True,
                     peak_tflops: float = 989.0, profile: bool = False, compile_layer: bool = True,
                     json_out: str | None = None) -> dict[str, Any]:
    """Step time, tokens/s, MFU and peak memory of drafter training at each sequence length.

    Args:
        shape: target shape the drafter copies.
        seq_lens: sequence lengths to measure, one row each.
        batch_size: B sequences per step.
        vary_lengths: each step draws its length uniformly from [T/2, T] (real batches vary; a
            compiled attention must not recompile per length); the row reports the mean length.
        steps: K, TTT steps.
        draft_vocab_size: N (default: 32,000, or the shape's vocabulary if smaller).
        iters: timed steps per length (median reported).
        warmup: untimed steps first.
        device: "cuda" or "cpu".
        attn_impl: TTT attention ("auto", "flex", "chunked", see :func:`eagle_train.attention.ttt_attention`).
        exclude_oov: also run the full-vocabulary out-of-vocabulary check (as training does by default).
        peak_tflops: peak dense bf16 TFLOP/s of the device for MFU (H200: 989).
        profile: after timing each length, print the top kernels of two profiled steps.
        compile_layer: the drafter's decoder layer through ``torch.compile`` on CUDA (training's
            default; false: eager, the figures before it).
        json_out: also write the figures to this JSON file.
    """
    from eagle_data.checks import check_device

    cfg = dict(SHAPES[shape])
    n = _draft_vocab(cfg, shape, draft_vocab_size)
    _check_run(iters, warmup, batch_size, seq_lens, peak_tflops)
    dev = torch.device(check_device(device))
    g = torch.Generator().manual_seed(0)
    drafter, lm_head = _random_drafter(cfg, n, g, dev, compile_layer)
    one_step = _step_fn(drafter, lm_head, dev, steps, exclude_oov, attn_impl)
    res: dict[str, Any] = {"shape": shape, "steps": steps, "draft_vocab_size": n, "device": str(dev),
                           "batch_size": batch_size, "vary_lengths": vary_lengths, "attn_impl": attn_impl,
                           "compile_layer": compile_layer,
                           "params_M": round(sum(p.numel() for p in drafter.parameters() if p.requires_grad) / 1e6, 1),
                           "by_seq_len": {}}
    for t in seq_lens:
        lens = [int(torch.randint(t // 2, t + 1, (1,), generator=g)) if vary_lengths else t
                for _ in range(warmup + iters)]
        by_len = {tl: _batch(batch_size, tl, cfg["vocab_size"], cfg["hidden_size"], g, dev) for tl in sorted(set(lens))}
        times, loss = _timed_steps(one_step, [by_len[tl] for tl in lens], warmup, dev)
        fl = statistics.fmean([batch_size * step_flops(cfg, tl, steps, n, exclude_oov) for tl in lens[warmup:]])
        row = res["by_seq_len"][t] = _row(times, batch_size * statistics.fmean(lens[warmup:]), fl, peak_tflops, dev, loss)
        print(f"T={t:6d} B={batch_size}  step {row['step_s'] * 1e3:8.1f} ms  {row['tokens_per_s']:8d} tok/s  "
              f"{row['TFLOPs']:6.1f} TFLOP/s  MFU {row['MFU']:.3f}  peak {row['peak_GiB']} GiB", flush=True)
        if profile:
            _profile(one_step, [by_len[tl] for tl in lens[-2:]], dev)
        del by_len
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1))
    return res


def _draft_vocab(cfg: dict[str, Any], shape: str, draft_vocab_size: int | None) -> int:
    """N: ``draft_vocab_size``, by default 32,000 or the shape's vocabulary if smaller; checked."""
    draft_vocab_size = min(32000, cfg["vocab_size"]) if draft_vocab_size is None else draft_vocab_size
    if not 1 <= draft_vocab_size <= cfg["vocab_size"]:
        raise ValueError(f"draft_vocab_size must be in [1, {cfg['vocab_size']}] for shape {shape!r}, got {draft_vocab_size}")
    return draft_vocab_size


def _check_run(iters: int, warmup: int, batch_size: int, seq_lens: list[int], peak_tflops: float) -> None:
    """The run's settings, else a ValueError."""
    if iters < 1 or warmup < 0 or batch_size < 1 or not seq_lens or min(seq_lens) < 4:
        raise ValueError(f"need iters >= 1, warmup >= 0, batch_size >= 1 and seq_lens of >= 4 tokens, got "
                         f"{iters}, {warmup}, {batch_size}, {seq_lens}")
    if not peak_tflops > 0:
        raise ValueError(f"peak_tflops must be > 0, got {peak_tflops}")


def _random_drafter(cfg: dict[str, Any], n: int, g: torch.Generator, dev: torch.device,
                    compile_layer: bool) -> tuple[torch.nn.Module, torch.Tensor]:
    """A drafter of ``cfg``'s shape with a random draft vocabulary of ``n`` tokens and random frozen
    ``embed_tokens``, and a random target ``lm_head``, on ``dev``."""
    from eagle_train.model import DraftConfig, Eagle3Drafter

    v, h = cfg["vocab_size"], cfg["hidden_size"]
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[torch.randperm(v, generator=g)[:n]] = True
    d2t = t2d.nonzero().squeeze(1) - torch.arange(n)
    dcfg = DraftConfig.from_target(cfg, draft_vocab_size=n)
    embed = torch.randn(v, h, generator=g) * 0.02
    drafter = Eagle3Drafter(dcfg, embed, d2t, t2d).to(dev)
    drafter.compile_layer = compile_layer
    lm_head = (torch.randn(v, h, generator=g) * 0.02).to(dev)
    return drafter, lm_head


def _step_fn(drafter, lm_head: torch.Tensor, dev: torch.device, steps: int, exclude_oov: bool,
             attn_impl: str) -> Callable[[dict[str, torch.Tensor]], dict[str, Any]]:
    """One optimizer step (TTT loss of ``steps`` steps under bf16 autocast, backward, AdamW) on a batch."""
    from eagle_train.loss import ttt_loss

    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4, fused=dev.type == "cuda")
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)

    def one_step(batch):
        with amp:
            out = ttt_loss(drafter, lm_head, batch, steps, exclude_oov=exclude_oov, attn_impl=attn_impl)
        opt.zero_grad(set_to_none=True)
        out["loss"].backward()
        opt.step()
        return out

    return one_step


def _timed_steps(one_step, batches: list[dict[str, torch.Tensor]], warmup: int,
                 dev: torch.device) -> tuple[list[float], float]:
    """One step per batch (peak memory counted from the first); the times of those after ``warmup``
    and the last step's loss."""
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        out = one_step(batch)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, round(float(out["loss"].detach()), 4)


def _row(times: list[float], tokens: float, fl: float, peak_tflops: float, dev: torch.device,
         loss: float) -> dict[str, Any]:
    """One length's figures from its step ``times``, mean ``tokens`` and FLOPs ``fl`` per step."""
    s = statistics.median(times)
    return {"step_s": round(s, 4), "tokens_per_step": round(tokens), "tokens_per_s": round(tokens / s),
            "TFLOPs": round(fl / s / 1e12, 1), "MFU": round(fl / s / 1e12 / peak_tflops, 3),
            "peak_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None,
            "loss": loss}


def _profile(one_step, batches: list[dict[str, torch.Tensor]], dev: torch.device, top: int = 25) -> None:
    """Print the ``top`` operators of ``batches`` by device (else CPU) time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for b in batches:
            one_step(b)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60), flush=True)
