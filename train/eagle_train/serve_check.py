"""Serve an exported drafter with SGLang's own EAGLE-3 speculative decoding and check it against
the project's offline reference (``eagle-data serve-check``).

Three runs over the same prompts, greedy:

1. **plain**: the target alone in an SGLang engine (the reference output);
2. **speculative**: the same engine with the exported drafter, chain drafting (``topk=1``: ``K``
   proposals per verify step); SGLang reports per request its verify steps, accepted drafts and
   their histogram, so the **engine's tau** = 1 + accepted / verify steps;
3. **offline replay**: the folder read back (:func:`eagle_train.export.load_exported_drafter`),
   the target's aux states of prompt + speculative output from HF transformers (float32), and the
   same chains replayed with :meth:`eagle_train.model.Eagle3Drafter.propose_chain`
   (:func:`replay_chains`): the **offline tau** of the same drafter on the same text.

If the engine runs the exported weights, ``d2t`` and aux layer ids as the project's reference
does, the replay finds the same verify steps and accepted counts; the last chain of a request may
differ (the engine may accept drafts past ``max_new_tokens`` that the output no longer shows).
With float32 the speculative output equals the plain output token for token; in bfloat16 the
verify pass (K + 1 tokens per forward) rounds differently from one-token decode, so outputs may
part after a near-tie.

On CPU the engine runs sglang 0.5.23 with eagle-data's stand-in ``sgl_kernel`` and its
``intel_amx`` attention backend (:func:`eagle_data.engines.sglang_engine.start_engine`);
on a GPU, stock SGLang.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

log = logging.getLogger(__name__)

#: serve-check's results so far, while it runs (:func:`engines_so_far`; ``serve_check.json`` at the end)
SERVE_PARTIAL = "serve_check.partial.json"


def replay_chains(drafter, aux: torch.Tensor, seq: Sequence[int], prompt_len: int, steps: int) -> list[int]:
    """Accepted drafts of each verify step of greedy chain drafting over a finished generation.

    The first generated token ``seq[P]`` comes from the prefill; a chain starting after
    ``seq[t + 1]`` proposes ``K`` tokens from row ``t`` (``fc(aux[t])`` paired with ``seq[t + 1]``),
    ``a`` = how many equal ``seq[t + 2 : t + 2 + K]``, and the next chain starts after
    ``seq[t + a + 2]`` (the verify pass adds the target's own token). Steps run while the
    generation has tokens left, as the engine's did.

    Args:
        drafter: :class:`eagle_train.model.Eagle3Drafter`; aux: [T, 3*Ht] the target's aux states of
            ``seq`` (T tokens: prompt + output); prompt_len: P >= 1; steps: K.

    Returns:
        accepted draft count of each verify step, in order.
    """
    t_len = len(seq)
    if not 1 <= prompt_len < t_len:
        raise ValueError(f"prompt_len must be in [1, {t_len - 1}] for a sequence of {t_len} tokens, got {prompt_len}")
    ids = torch.tensor(list(seq), dtype=torch.int64)
    rows = list(range(prompt_len - 1, t_len - 2))
    out: list[int] = []
    if not rows:
        return out
    dev = next(drafter.parameters()).device
    row_ids = torch.cat([ids[1:], ids.new_zeros(1)]).to(dev)  # row r holds x[r+1]
    drafts = drafter.propose_chain(row_ids, aux.float().to(dev), rows, [int(seq[r + 1]) for r in rows], steps).tolist()
    proposal = dict(zip(rows, drafts))
    t = prompt_len - 1
    while t + 2 < t_len:
        d, a = proposal[t], 0
        while a < steps and t + 2 + a < t_len and seq[t + 2 + a] == d[a]:
            a += 1
        out.append(a)
        t += a + 1
    return out


def engine_generate(engine, prompts: list[list[int]], max_new_tokens: int) -> list[dict[str, Any]]:
    """Greedy generation of every prompt in one batch: per prompt ``output_ids``, ``finish`` and,
    with speculation, ``verify_steps``, ``accepted`` and ``histogram`` (``[i]`` = steps with ``i``
    accepted drafts) as SGLang's ``meta_info`` reports them."""
    outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": max_new_tokens})
    res = []
    for o in outs:
        m = o["meta_info"]
        r = {"output_ids": [int(t) for t in o["output_ids"]], "finish": (m.get("finish_reason") or {}).get("type")}
        if "spec_verify_ct" in m:
            r.update(verify_steps=int(m["spec_verify_ct"]), accepted=int(m.get("spec_num_correct_drafts", 0)),
                     histogram=[int(c) for c in m.get("spec_correct_drafts_histogram") or []])
        res.append(r)
    return res


def decode_speed(engine, prompts: list[list[int]], max_new_tokens: int, batch: int) -> dict[str, float]:
    """Generated tokens/s at ``batch``: 1 -> the first 8 prompts one at a time; b -> the first b
    prompts together (after one untimed warm-up request)."""
    engine_generate(engine, prompts[:1], 8)
    groups = [[p] for p in prompts[:8]] if batch == 1 else [prompts[:batch]]
    t0, new = time.perf_counter(), 0
    for g in groups:
        new += sum(len(r["output_ids"]) for r in engine_generate(engine, g, max_new_tokens))
    dt = time.perf_counter() - t0
    return {"batch": batch, "prompts": sum(len(g) for g in groups), "new_tokens": new, "seconds": round(dt, 3),
            "tokens_per_s": round(new / dt, 1)}


def _engine_run(kw: dict[str, Any], prompts: list[list[int]], max_new_tokens: int,
                speed_batches: Sequence[int] = (), generate: bool = True) -> tuple[list[dict], float, float, list[dict]]:
    """Start an engine, generate (unless not ``generate``), time ``speed_batches``
    (:func:`decode_speed`), shut it down: ``(results, start seconds, generate seconds, speeds)``."""
    from eagle_data.engines.sglang_engine import start_engine

    t0 = time.perf_counter()
    engine = start_engine(kw)
    started = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        res = engine_generate(engine, prompts, max_new_tokens) if generate else []
        took = time.perf_counter() - t0
        return res, started, took, [decode_speed(engine, prompts, max_new_tokens, b) for b in speed_batches]
    finally:
        engine.shutdown()


def run_engine_apart(kw: dict[str, Any], prompts: list[list[int]], max_new_tokens: int,
                     speed_batches: Sequence[int] = (), generate: bool = True) -> tuple[list[dict], float, float, list[dict]]:
    """:func:`_engine_run` in a fresh (spawned) process. SGLang's shutdown kills every child of
    the process that started the engine, this process's multiprocessing resource tracker included;
    a later semaphore (tqdm's lock while loading the HF target) then unregisters with a new tracker,
    which prints a ``KeyError`` traceback at exit. Apart, the engine's process tree is its own."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(_engine_run, kw, prompts, max_new_tokens, tuple(speed_batches), generate).result()


def acceptance_summary(accepted_per_step: list[int], steps: int) -> dict[str, Any]:
    """tau = 1 + mean accepted per verify step; ``accept_at_least[i - 1]`` = P(a >= i), i = 1..K
    (:func:`eagle_train.evaluate.accept_stats`)."""
    from eagle_train.evaluate import accept_stats

    st = accept_stats(accepted_per_step, steps)
    return {"tau": st["tau"], "verify_steps": len(accepted_per_step), "accepted": int(sum(accepted_per_step)),
            "accept_at_least": st["accept_at_least"]}


def histogram_steps(histogram: list[int]) -> list[int]:
    """SGLang's accepted-count histogram expanded to one entry per verify step (order lost)."""
    return [a for a, c in enumerate(histogram) for _ in range(c)]


def engine_acceptance(plain: list[dict], spec: list[dict], steps: int) -> dict[str, Any]:
    """An engine's speculation over the prompts: :func:`acceptance_summary` of its counters, the
    95 % interval of its tau over prompts (:func:`eagle_train.evaluate.cluster_tau_interval`) and
    how many outputs equal the plain ones."""
    from eagle_train.evaluate import cluster_tau_interval

    accepted, verify = [s["accepted"] for s in spec], [s["verify_steps"] for s in spec]
    by_position = acceptance_summary([a for s in spec for a in histogram_steps(s["histogram"])], steps)
    return {"tau": 1 + sum(accepted) / max(1, sum(verify)), "verify_steps": sum(verify), "accepted": sum(accepted),
            "accept_at_least": by_position["accept_at_least"], "interval": cluster_tau_interval(accepted, verify),
            "equal_to_plain": sum(p["output_ids"] == s["output_ids"] for p, s in zip(plain, spec))}


def engines_so_far(runs: dict[str, list[dict]], seconds: dict[str, float], speeds: dict[str, list[dict]],
                   path: Optional[Path], settings: dict[str, Any]) -> dict[str, Any]:
    """What the engines run so far tell (each speculative one's :func:`engine_acceptance` once the
    plain run is there, start and generation seconds, decode speeds) and the run's ``settings``,
    written to ``path`` when given: a serve-check cut short (a device's time limit) keeps its
    engines' figures."""
    known: dict[str, Any] = {"engines_done": list(runs), "seconds": {k: round(v, 2) for k, v in seconds.items()},
                             "speed": {k: v for k, v in speeds.items() if v}, **settings}
    for name, key in (("speculative", "engine"), ("ngram", "ngram")):
        if "plain" in runs and runs.get(name):
            known[key] = engine_acceptance(runs["plain"], runs[name], settings["steps"])
    if path is not None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(known, indent=1))
        tmp.replace(path)
    return known


def fresh_serve_out(out: str | Path) -> Path:
    """``out``, made; an earlier run's results removed (never left beside a run cut short)."""
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    for name in ("serve_check.json", SERVE_PARTIAL):
        (o / name).unlink(missing_ok=True)
    return o


def _engine_line(name: str, run: list[dict], seconds: dict[str, float], speeds: list[dict],
                 acc: Optional[dict[str, Any]]) -> str:
    iv = (acc or {}).get("interval")
    return (f"{name} engine started in {seconds[f'{name}_start']:.1f} s, {sum(len(r['output_ids']) for r in run)} new "
            f"tokens in {seconds[f'{name}_generate']:.1f} s"
            + (f"; engine tau {acc['tau']:.3f}" + (f" [{iv[0]:.3f}, {iv[1]:.3f}]" if iv else "")
               + f", output equal to plain greedy {acc['equal_to_plain']}/{len(run)}" if acc else "")
            + "".join(f"; decode at batch {v['batch']}: {v['tokens_per_s']:.0f} tokens/s" for v in speeds))


def compare_runs(plain: list[dict], spec: list[dict], replays: list[list[int]], steps: int) -> dict[str, Any]:
    """Per request and overall: outputs equal, verify steps and accepted drafts engine vs replay."""
    per, offline_steps = [], []
    for p, s, r in zip(plain, spec, replays):
        offline_steps += r
        per.append({"equal_to_plain": p["output_ids"] == s["output_ids"], "finish": s["finish"],
                    "engine_verify_steps": s["verify_steps"], "engine_accepted": s["accepted"],
                    "offline_verify_steps": len(r), "offline_accepted": sum(r),
                    "within_one_chain": abs(s["accepted"] - sum(r)) <= steps and abs(s["verify_steps"] - len(r)) <= 1})
    return {"engine": engine_acceptance(plain, spec, steps), "offline": acceptance_summary(offline_steps, steps),
            "equal_to_plain": sum(q["equal_to_plain"] for q in per), "within_one_chain": sum(q["within_one_chain"] for q in per),
            "num_prompts": len(per), "per_prompt": per}


def offline_replays(target: str, device: str, drafter, aux_ids: list[int], prompts: list[list[int]],
                    spec: list[dict], steps: int) -> list[list[int]]:
    """:func:`replay_chains` of each prompt + its speculative output, on the target's aux states from
    HF transformers (float32)."""
    from eagle_data.engines.hf import HFBackend
    from eagle_train.evaluate import load_target

    hf = HFBackend(model=load_target(target, device), model_path=str(target), dtype="float32", aux_layer_ids=aux_ids,
                   device=device)
    replays = []
    for i, (p, s) in enumerate(zip(prompts, spec)):
        seq = list(p) + s["output_ids"]
        aux = hf.capture([(f"p{i}", torch.tensor(seq))])[0].aux_hidden_states
        replays.append(replay_chains(drafter, aux, seq, len(p), steps) if s["output_ids"] else [])
    return replays


def run_serve_check(target: str, drafter_dir: str, prompts: list[list[int]], *, steps: int = 7,
                    max_new_tokens: int = 64, dtype: str = "float32", device: str = "cpu",
                    engine_kw: Optional[dict[str, Any]] = None, exported: Optional[tuple] = None,
                    speed_batches: Sequence[int] = (), ngram: bool = False,
                    partial: Optional[Path] = None) -> dict[str, Any]:
    """Plain and speculative SGLang runs + the offline replay (module doc); returns
    :func:`compare_runs`'s summary plus ``seconds`` per phase and the settings, and ``speed`` (decode
    tokens/s plain vs speculative per batch size of ``speed_batches``). ``exported``: the
    ``(drafter, aux_layer_ids)`` of ``drafter_dir`` when the caller has read it already.
    ``ngram``: also SGLang's own NGRAM speculation (free: drafts from the text seen) with the same
    ``steps + 1`` tokens verified per step, as a chain, on a fresh engine (its speed at each batch size
    on another fresh one: its trie learns what it generates): ``out["ngram"]``, :func:`engine_acceptance`.
    After each engine: :func:`engines_so_far` (written to ``partial`` when given)."""
    from eagle_data.checks import check_positive
    from eagle_data.engines.sglang_engine import (CPU_SPEC_ATTENTION, base_engine_kwargs, ngram_engine_kwargs,
                                                  spec_engine_kwargs)
    from eagle_train.export import load_exported_drafter

    check_positive(steps=steps, max_new_tokens=max_new_tokens, num_prompts=len(prompts) or None)
    if not prompts:
        raise ValueError("serve-check needs at least one prompt")
    drafter, aux_ids = exported or load_exported_drafter(drafter_dir, target)  # checked before any engine starts
    extra = dict(engine_kw or {})
    if device == "cpu":
        extra.setdefault("attention_backend", CPU_SPEC_ATTENTION)  # plain runs the same attention as speculative
    settings = dict(steps=steps, max_new_tokens=max_new_tokens, dtype=dtype, device=device, aux_layer_ids=aux_ids,
                    target=str(target), drafter=str(drafter_dir), num_prompts=len(prompts))
    seconds: dict[str, float] = {}
    runs, speeds = {}, {}
    engines = [("plain", base_engine_kwargs(target, dtype, device, **extra)),
               ("speculative", spec_engine_kwargs(target, drafter_dir, dtype, device, steps=steps, **extra))]
    if ngram:
        engines.append(("ngram", ngram_engine_kwargs(target, dtype, device, draft_tokens=steps + 1, **extra)))
    for name, kw in engines:
        runs[name], seconds[f"{name}_start"], seconds[f"{name}_generate"], speeds[name] = run_engine_apart(
            kw, prompts, max_new_tokens, () if name == "ngram" else speed_batches)
        known = engines_so_far(runs, seconds, speeds, partial, settings)
        log.info("serve-check: %s", _engine_line(name, runs[name], seconds, speeds[name],
                                                 known.get({"speculative": "engine"}.get(name, name))))
    if ngram:  # each batch size on a fresh engine too: the trie would have seen these prompts' outputs
        speeds["ngram"] = [run_engine_apart(engines[-1][1], prompts, max_new_tokens, [b], generate=False)[3][0]
                           for b in speed_batches]
        engines_so_far(runs, seconds, speeds, partial, settings)
        log.info("serve-check: ngram decode speed (fresh engines)%s",
                 "".join(f"; batch {v['batch']}: {v['tokens_per_s']:.0f} tokens/s" for v in speeds["ngram"]))
    t0 = time.perf_counter()
    replays = offline_replays(target, device, drafter, aux_ids, prompts, runs["speculative"], steps)
    seconds["offline_replay"] = time.perf_counter() - t0
    out = compare_runs(runs["plain"], runs["speculative"], replays, steps)
    if ngram:
        out["ngram"] = engine_acceptance(runs["plain"], runs["ngram"], steps)
    if speed_batches:
        out["speed"] = [{"batch": p["batch"], "plain_tokens_per_s": p["tokens_per_s"],
                         "speculative_tokens_per_s": s["tokens_per_s"],
                         "speedup": round(s["tokens_per_s"] / p["tokens_per_s"], 3)}
                        for p, s in zip(speeds["plain"], speeds["speculative"])]
        for row, n in zip(out["speed"], speeds.get("ngram", ())):
            row.update(ngram_tokens_per_s=n["tokens_per_s"], ngram_speedup=round(n["tokens_per_s"] / row["plain_tokens_per_s"], 3))
    out.update(seconds={k: round(v, 2) for k, v in seconds.items()}, **settings)
    return out


def heldout_prompts(dataset_dir: str | Path, keys: list[str], max_prompt_tokens: int,
                    limit: int, first: bool = False) -> tuple[list[list[int]], list[str]]:
    """Up to ``limit`` prompts from held-out samples (``keys`` in sorted order, read a few at a
    time): each sample's tokens up to the start of its last assistant reply that begins within
    ``max_prompt_tokens`` (the context the target answers), or its first reply (``first``);
    samples with no such reply are passed over. Returns ``(prompts, their keys)``."""
    from eagle_data.tools.read_samples import read_samples

    prompts, used = [], []
    todo = sorted(keys)
    while todo and len(prompts) < limit:
        chunk, todo = todo[:2 * limit], todo[2 * limit:]
        samples = read_samples(dataset_dir, chunk)
        for key in chunk:
            ids, m = samples[key]["input_ids"], samples[key]["loss_mask"].bool()
            starts = [t for t in range(1, min(len(m), max_prompt_tokens + 1)) if m[t] and not m[t - 1]]
            if starts and len(prompts) < limit:
                prompts.append(ids[:starts[0 if first else -1]].tolist())
                used.append(key)
    return prompts, used
