"""Acceptance length tau of a drafter against the real target on held-out conversations.

Protocol (greedy chain, topk = 1, EAGLE-3 paper Sec. 4 "average acceptance length"):

1. For a held-out sample ``x[0..T-1]`` pick positions ``t`` with ``loss_mask[t+1] == 1`` (the
   next token is assistant text), evenly spaced, at most ``positions_per_sample``.
2. The target's greedy continuation of the prefix ``x[<=t]`` is ``y1, y2, ...``. ``y1`` is the
   token the target itself emits (the "bonus" token every verification step yields).
3. The drafter gets the target's REAL aux states ``g[<=t]`` (stored by eagle-data) and the
   prefix tokens, with ``y1`` in row ``t``; it proposes ``d2..d(K+1)`` greedily, steps ``>= 1``
   feeding its own hidden state and its own previous token (:meth:`Eagle3Drafter.propose_chain`).
4. Accepted ``a`` = length of the longest prefix with ``d(i) == y(i)``; ``tau = 1 + a``.

Exactness of ``y``: one fp32 teacher-forced forward of the target over the whole sample gives
``argmax`` at every position; ``y(i+1)`` is read from it while ``y1..y(i)`` equal the real
continuation ``x[t+1..t+i]`` (causal attention makes that the same computation). Once the greedy
path leaves the real text, and only if the draft still matches, the target continues greedily
from the KV cache of ``x[<=t]`` (cropped from the same pass) fed ``y1..y(i)`` (HF transformers,
fp32, CPU).
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch

from eagle_data.tools.read_samples import read_samples  # also this module's public name, as before
from eagle_train.guard import damaged_samples

log = logging.getLogger(__name__)


def _cache_of(out):
    """The KV cache of a transformers output: ``cache`` (transformers >= 5.2x), else ``past_key_values``."""
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values


def _cache_kwarg(target) -> str:
    """The name the target's forward takes its KV cache by (``past_key_values`` is deprecated
    for ``cache`` from transformers 5.2x and goes in 5.40)."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


class GreedyOracle:
    """The target's exact greedy continuation of ``x[<=t]`` (see module doc)."""

    def __init__(self, target, ids: torch.Tensor):
        self.target, self.ids = target, ids
        self.device = next(target.parameters()).device
        self.kv = _cache_kwarg(target)
        with torch.no_grad():
            out = target(ids[None].to(self.device), use_cache=True)
        self.tf = out.logits[0].argmax(-1).cpu()  # tf[t]: greedy next token after x[<=t]
        self.cache = _cache_of(out)          # KV of the whole sample; cropped copies serve prefixes

    def continuation(self, t: int, need: int, check=None) -> list[int]:
        """Up to ``need`` greedy tokens after ``x[<=t]``; ``check(i, tok) -> bool`` stops early."""
        ys: list[int] = []
        on_real = True
        past = None
        T = self.ids.shape[0]
        for i in range(need):
            if on_real and t + i < T:
                tok = int(self.tf[t + i])
            else:
                with torch.no_grad():
                    if past is None:  # first step off the real text: KV of x[<=t] (causal: exact), then ys
                        past = copy.deepcopy(self.cache)
                        if t + 1 < T:
                            past.crop(t + 1 - T)  # drop the last T - (t + 1) positions
                        out = self.target(torch.tensor([ys], device=self.device), use_cache=True, **{self.kv: past})
                    else:
                        out = self.target(torch.tensor([[ys[-1]]], device=self.device), use_cache=True,
                                          **{self.kv: past})
                past = _cache_of(out)
                tok = int(out.logits[0, -1].argmax())
            ys.append(tok)
            if on_real and (t + i + 1 >= T or tok != int(self.ids[t + i + 1])):
                on_real = False
            if check is not None and not check(i, tok):
                break
        return ys


@torch.no_grad()
def acceptance(drafter, target, samples: dict[str, dict[str, torch.Tensor]], steps: int = 7,
               positions_per_sample: int = 8, max_length: Optional[int] = None,
               oracles: Optional[dict[str, "GreedyOracle"]] = None) -> dict[str, Any]:
    """Run the protocol; returns ``tau``, ``tau_ci95`` (95 % interval, bootstrap over samples: the
    chains of one conversation are not independent), ``accept_at_least`` [K] (P(a >= i)),
    ``accept_cond`` [K] (P(d_i accepted | d_1..d_(i-1) accepted)), ``num_chains``, per-chain
    ``accepted`` and ``chain_keys`` (the sample of each chain).

    ``drafter`` has :meth:`eagle_train.model.Eagle3Drafter.propose_chain`'s interface (also
    :class:`eagle_train.ngram.PromptLookupDrafter`); it runs on the device of its parameters
    (if any), the target on its own.

    ``max_length`` truncates samples first; ``oracles`` (a dict, filled on first use) shares the
    target's teacher-forced pass between drafters evaluated on the same samples."""
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be >= 2 (a position and the token after it), got {max_length}")
    oracles = {} if oracles is None else oracles
    accepted: list[int] = []
    chain_keys: list[str] = []
    drafter.eval()
    p0 = next(iter(drafter.parameters()), None)
    dev = p0.device if p0 is not None else torch.device("cpu")
    for key in sorted(samples):
        s = {k: v[:max_length] for k, v in samples[key].items()} if max_length is not None else samples[key]
        ids, m = s["input_ids"], s["loss_mask"].bool()
        cand = [t for t in range(ids.shape[0] - 1) if m[t + 1]]
        if not cand:
            continue
        n = min(positions_per_sample, len(cand))
        pos = [cand[(j * len(cand)) // n] for j in range(n)]
        if key not in oracles:
            oracles[key] = GreedyOracle(target, ids)
        oracle = oracles[key]
        row_ids = torch.cat([ids[1:], ids.new_zeros(1)])            # row r holds x[r+1]
        first = [int(oracle.tf[t]) for t in pos]
        drafts = drafter.propose_chain(row_ids.to(dev), s["aux_hidden_states"].float().to(dev), pos, first, steps,
                                       first_token_id=int(ids[0])).cpu()
        for t, d in zip(pos, drafts.tolist()):
            # ys[0] = y1 (target's own token), ys[i] must equal d[i-1]
            ys = oracle.continuation(t, steps + 1, check=lambda i, tok: i == 0 or tok == d[i - 1])
            a = 0
            while a < steps and a + 1 < len(ys) and ys[a + 1] == d[a]:
                a += 1
            accepted.append(a)
            chain_keys.append(key)
    return {**accept_stats(accepted, steps), "tau_ci95": tau_interval(accepted, chain_keys),
            "num_chains": len(accepted), "accepted": accepted, "chain_keys": chain_keys}


def accept_stats(accepted: list[int], steps: int) -> dict[str, Any]:
    """From accepted draft counts per chain: ``tau`` = 1 + their mean (NaN for none),
    ``accept_at_least[i - 1]`` = P(a >= i) and ``accept_cond[i - 1]`` = P(a >= i | a >= i - 1), i = 1..K."""
    acc = torch.tensor(accepted, dtype=torch.float64)
    return {"tau": float(1 + acc.mean()) if len(accepted) else float("nan"),
            "accept_at_least": [float((acc >= i).double().mean()) for i in range(1, steps + 1)],
            "accept_cond": [float((acc >= i).sum() / max(int((acc >= i - 1).sum()), 1)) for i in range(1, steps + 1)]}


def tau_interval(accepted: list[int], keys: list[str], resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """95 % percentile interval of tau, resampling whole samples (clusters of chains) with
    replacement; None with fewer than 2 samples (no spread to estimate)."""
    by_key: dict[str, list[int]] = {}
    for a, k in zip(accepted, keys):
        by_key.setdefault(k, []).append(a)
    groups = list(by_key.values())
    return cluster_tau_interval([sum(g) for g in groups], [len(g) for g in groups], resamples, seed)


def cluster_tau_interval(accepted: list[int], steps: list[int], resamples: int = 2000,
                         seed: int = 0) -> list[float] | None:
    """95 % percentile interval of tau = 1 + sum(accepted) / sum(steps) over clusters (a sample's
    or a prompt's accepted drafts and verify steps), resampled whole with replacement; None with
    fewer than 2 clusters or no step."""
    if len(accepted) < 2 or sum(steps) == 0:
        return None
    sums = torch.tensor(accepted, dtype=torch.float64)
    counts = torch.tensor(steps, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(accepted), (resamples, len(accepted)), generator=gen)
    taus = 1 + sums[pick].sum(1) / counts[pick].sum(1).clamp_min(1)
    lo, hi = torch.quantile(taus, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return [round(lo, 4), round(hi, 4)]


def plot_acceptance(results: dict[str, dict[str, Any]], path: str | Path) -> Path:
    """PNG: P(accepted >= i) per draft position for each named result (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        xs = list(range(1, len(r["accept_at_least"]) + 1))
        lo, hi = r.get("tau_ci95") or [float("nan")] * 2
        ax.plot(xs, r["accept_at_least"], marker="o",
                label=f"{name}: tau {r['tau']:.3f} [{lo:.2f}, {hi:.2f}], {r['num_chains']} chains")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accepted length >= i)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("EAGLE-3 greedy chain acceptance (held-out)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


#: the longest draft chain eval scores (each further token costs a target forward per chain)
MAX_STEPS = 64


def _check_eval_args(device: Optional[str], num_samples: int, positions: int, steps: int, fraction: float) -> str:
    """The device to run on, after refusing arguments that would give no or meaningless chains.

    Raises:
        ValueError: naming the argument.
    """
    from eagle_data.checks import check_device, check_positive

    check_positive(num_samples=num_samples, positions_per_sample=positions, steps=steps)
    if steps > MAX_STEPS:
        raise ValueError(f"steps must be <= {MAX_STEPS} (draft tokens per chain; EAGLE-3 uses 7), got {steps}")
    if not 0 < fraction <= 1:
        raise ValueError(f"heldout_fraction must be in (0, 1], got {fraction!r}")
    return check_device(device or default_device())


def default_device() -> str:
    """``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_target(model_path: str | Path, device: str = "cpu"):
    """The target in fp32 on ``device`` (the greedy references are exact in fp32)."""
    from transformers import AutoModelForCausalLM

    from eagle_train.model import resolve_model_path

    return AutoModelForCausalLM.from_pretrained(str(resolve_model_path(model_path)),
                                                dtype=torch.float32).to(device).eval()


def _check_dataset(dataset_dir: str, mod) -> None:
    """The dataset must hold the states the drafter reads: the target's hidden size and the
    drafter's aux layer ids (:func:`~eagle_data.format.schema.check_manifest_compat`: ValueError
    naming the field, the manifest's value and the drafter's)."""
    from eagle_data.format.records import read_manifest
    from eagle_data.format.schema import check_manifest_compat

    check_manifest_compat(read_manifest(dataset_dir),
                          {"hidden_size": int(mod.target_config["hidden_size"]), "aux_layer_ids": mod.aux_layer_ids},
                          where=f"{dataset_dir} (evaluating the checkpoint's drafter)")


#: below this share of supervised positions where the stored final state's greedy token equals
#: the target's own, the target is not the one that produced the dataset
MIN_TARGET_AGREEMENT = 0.5


@torch.no_grad()
def check_target_matches(target, samples: dict[str, dict[str, torch.Tensor]], oracles: dict[str, "GreedyOracle"],
                         max_length: Optional[int] = None) -> Optional[float]:
    """The share of supervised positions where ``lm_head(stored final state)`` and the target's
    own teacher-forced greedy token agree (filling ``oracles``, which the protocol reuses); None
    when no position is supervised (nothing to check, nor to score).

    Raises:
        ValueError: the stored states are of another width than the target's head, or the share
            is below :data:`MIN_TARGET_AGREEMENT`: another model than the dataset's target (a
            same-shaped one would otherwise give a plausible, meaningless tau)."""
    head = target.get_output_embeddings().weight
    agree = total = 0
    for key in sorted(samples):
        s = {k: v[:max_length] for k, v in samples[key].items()} if max_length is not None else samples[key]
        if s["hidden_states"].shape[-1] != head.shape[1]:
            raise ValueError(f"the target model's hidden size is {head.shape[1]}, the dataset's states are "
                             f"{s['hidden_states'].shape[-1]} wide ({key}): give the target the dataset was extracted "
                             "with (--target_model)")
        ids, m = s["input_ids"], s["loss_mask"].bool()
        rows = torch.nonzero(m[1:]).flatten()  # taught rows (the only ones a taught layout stores)
        if rows.numel() == 0:
            continue
        if key not in oracles:
            oracles[key] = GreedyOracle(target, ids)
        stored = (s["hidden_states"][rows].to(head.device, head.dtype) @ head.T).argmax(-1).cpu()
        agree += int((stored == oracles[key].tf[rows]).sum())
        total += rows.numel()
    if not total:
        return None
    share = agree / total
    if share < MIN_TARGET_AGREEMENT:
        raise ValueError(f"the target model does not produce this dataset's states: its greedy token equals the "
                         f"stored final states' at {share:.1%} of {total} supervised positions (expected ~100 %); "
                         "give the target the dataset was extracted with (--target_model)")
    return share


def evaluate(*, dataset_dir: str, checkpoint: Optional[str], out_dir: str, heldout_keys: Optional[str] = None,
             heldout_fraction: Optional[float] = None, num_samples: int = 16, positions_per_sample: int = 8,
             steps: int = 7, compare_untrained: bool = True, target_model: Optional[str] = None,
             max_length: Optional[int] = None, device: Optional[str] = None,
             prompt_lookup_max: int = 4) -> dict[str, Any]:
    """tau of the checkpoint, of the same drafter untrained, and of prompt-lookup speculation (the
    free baseline, :mod:`eagle_train.ngram`) on the same held-out positions; writes
    ``acceptance.json`` and ``acceptance.png`` to ``out_dir``. ``device``: where the drafter and
    the target run (default: the GPU when there is one). Held-out keys
    (:func:`eagle_train.heldout.eval_keys`): ``heldout_keys``, else an index split of
    ``heldout_fraction`` when it is given, else the keys the checkpoint records as left out of
    training, else an index split of 0.1. Keyword arguments only (``eagle-data eval`` documents each).

    Raises:
        ValueError: a bad argument, a checkpoint that records no held-out keys, a dataset of other
            facts or another target, damaged held-out samples, or no position to score."""
    from eagle_data.checks import check_positive
    from eagle_train.heldout import DEFAULT_HELDOUT_FRACTION, eval_keys

    fraction = DEFAULT_HELDOUT_FRACTION if heldout_fraction is None else heldout_fraction
    dev = _check_eval_args(device, num_samples, positions_per_sample, steps, fraction)
    check_positive(prompt_lookup_max=prompt_lookup_max)
    mod = _load_checkpoint(checkpoint, dataset_dir, target_model)
    keys, source = eval_keys(dataset_dir, mod.excluded_keys if mod is not None else None, heldout_keys,
                             heldout_fraction)
    keys = sorted(keys)[:num_samples]
    if not keys:
        raise ValueError(f"no held-out keys to evaluate ({source}: {heldout_keys or dataset_dir} gives none)")
    samples = read_samples(dataset_dir, keys)
    target = load_target(target_model or (mod.hparams.target_model_path if mod else None), dev)
    _refuse_damaged(dataset_dir, samples, int(target.get_output_embeddings().weight.shape[0]))
    oracles: dict = {}
    agreement = check_target_matches(target, samples, oracles, max_length)
    results = {name: acceptance(d.float().to(dev) if isinstance(d, torch.nn.Module) else d, target, samples, steps,
                                positions_per_sample, max_length, oracles)
               for name, d in _drafters(mod, compare_untrained, prompt_lookup_max).items()}
    if results["prompt_lookup"]["num_chains"] == 0:  # every drafter scores the same positions
        raise ValueError(f"no position to score: none of the {len(keys)} held-out sample(s) has a supervised token "
                         + (f"within max_length {max_length}" if max_length is not None else "after its first") +
                         " (give a larger --max_length or other held-out samples)")
    facts = {"heldout_keys": keys, "heldout_source": source, "num_samples": len(keys), "target_agreement": agreement}
    return _write_summary(Path(out_dir), results, facts)


def _load_checkpoint(checkpoint: Optional[str], dataset_dir: str, target_model: Optional[str]):
    """The checkpoint's module (None without one), held to ``dataset_dir``'s facts.

    Raises:
        ValueError: the checkpoint records no held-out keys (written before they were recorded),
            or the dataset holds other states than the drafter reads."""
    from eagle_train.module import EagleDrafterModule

    if not checkpoint:
        return None
    over = {"target_model_path": target_model} if target_model else {}
    mod = EagleDrafterModule.load_from_checkpoint(checkpoint, map_location="cpu", **over)
    if mod.excluded_keys is None:
        raise ValueError(f"{checkpoint}: the checkpoint records no held-out keys (written before training "
                         "recorded the keys it left out), so nothing tells which samples it did not train on: "
                         "train it again with this version")
    _check_dataset(dataset_dir, mod)
    return mod


def _refuse_damaged(dataset_dir: str, samples: dict[str, dict[str, torch.Tensor]], vocab_size: int) -> None:
    """Raises ValueError naming held-out samples :func:`eagle_train.guard.damaged_samples` flags."""
    damaged = damaged_samples(samples, vocab_size)
    if damaged:
        raise ValueError(f"{dataset_dir}: held-out sample(s) {', '.join(damaged[:8])} hold token ids outside the "
                         "target's vocabulary or non-finite states (damaged shards or another model's data: run "
                         "`eagle-data verify` on the dataset); they would be scored wrongly")


def _drafters(mod, compare_untrained: bool, prompt_lookup_max: int) -> dict[str, Any]:
    """The drafters scored: the checkpoint's ("trained") and the same at initialisation
    ("untrained"), when there is a checkpoint; prompt lookup always."""
    from eagle_train.ngram import PromptLookupDrafter

    drafters: dict[str, Any] = {}
    if mod is not None:
        drafters["trained"] = mod.drafter
        if compare_untrained:
            drafters["untrained"] = mod.untrained_drafter()
    drafters["prompt_lookup"] = PromptLookupDrafter(max_n=prompt_lookup_max)
    return drafters


def _write_summary(out: Path, results: dict[str, dict[str, Any]], facts: dict[str, Any]) -> dict[str, Any]:
    """``acceptance.json`` (each result without its per-chain lists, plus ``facts``) and
    ``acceptance.png`` in ``out``; returns the summary with ``plot``."""
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {name: {k: v for k, v in r.items() if k not in ("accepted", "chain_keys")}
                               for name, r in results.items()}
    summary.update(facts)
    (out / "acceptance.json").write_text(json.dumps(summary, indent=1))
    summary["plot"] = str(plot_acceptance(results, out / "acceptance.png"))
    return summary
