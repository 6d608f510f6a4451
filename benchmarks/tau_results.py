"""The τ benchmark's small decisions, apart from the commands it runs (:mod:`benchmarks.tau`):
the checkpoint names of the minute marks, the tune's winner from the runs' CSV logs, the result
table from the evaluations' ``acceptance.json``. The pure parts take plain values and are unit
tested (``tests/test_tau_bench.py``); the readers beside them only gather those values."""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

#: a variant with this option is a features-zeroed control: scored when asked, never chosen
ZERO_FEATURES = re.compile(r"--model\.zero_features(=|\s+)true\b")
LOSS = "train/loss_step"


def minute_names(minutes: Sequence[float]) -> list[str]:
    """The marks as the checkpoints name them (``{m:g}``: 0.050 -> ``"0.05"``, 1e-1 -> ``"0.1"``).

    Raises:
        ValueError: not numbers > 0, not increasing, or two marks sharing one name (equal to 6
            significant digits): a checkpoint would be missed or overwritten unsaid.
    """
    try:
        m = [float(x) for x in minutes]
    except (TypeError, ValueError):
        m = []
    names = [f"{x:g}" for x in m]
    if not m or not all(0 < x < math.inf for x in m) or m != sorted(set(m)) or len(set(names)) < len(m):
        raise ValueError("minutes: numbers > 0, increasing, each once to 6 significant digits "
                         f"(got {' '.join(map(str, minutes))!r})")
    return names


@dataclass
class TuneRun:
    """One variant of the tune, as its folder ``OUT/tune/vI`` left it."""

    name: str
    """``vI``"""
    args: str
    """its extra ``eagle-data train`` options, as one line"""
    failed: bool
    """its training exited non-zero"""
    losses: list[float] = field(default_factory=list)
    """the logged training losses (``train/loss_step``), in order"""
    steps: int = 0
    """the step of the last logged loss"""


def choose_tune(runs: Sequence[TuneRun], log_dir: str) -> dict[str, Any]:
    """The variant with the lowest mean training loss over the last fifth of its logged steps.

    A failed variant, one that logged no loss or a non-finite one in that fifth is left out (and
    said, with its log ``LOG_DIR/vI.log``); a features-zeroed control is no candidate. Returns
    ``{"runs": {args: {"loss", "steps"}}, "left_out": [why...], "best": args or None}``.
    """
    res: dict[str, dict[str, Any]] = {}
    left: list[str] = []
    for r in runs:
        log = f"{log_dir}/{r.name}.log"
        if r.failed:  # a control too: said, though never a candidate
            left.append(f"{r.args!r} failed (see {log})")
            continue
        if ZERO_FEATURES.search(r.args):
            continue
        tail = r.losses[-max(1, len(r.losses) // 5):]
        if not r.losses or not all(map(math.isfinite, tail)):
            why = "diverged (non-finite loss)" if r.losses else "logged no training loss"
            left.append(f"{r.args!r} {why} (see {log})")
            continue
        res[r.args] = {"loss": statistics.fmean(tail), "steps": r.steps}
    best = min(res, key=lambda k: res[k]["loss"]) if res else None
    return {"runs": res, "left_out": left, "best": best}


def read_tune(tune_dir: Path) -> list[TuneRun]:
    """The variants under ``tune_dir`` in their order (v1, v2, ..., v10), with their CSV logs."""
    runs = []
    for d in sorted(tune_dir.glob("v*/"), key=lambda p: int(p.name[1:])):
        rows = [r for p in sorted(d.rglob("metrics.csv")) for r in csv.DictReader(p.open()) if r.get(LOSS)]
        runs.append(TuneRun(d.name, (d / "args.txt").read_text().strip(), (d / "failed").exists(),
                            [float(r[LOSS]) for r in rows], int(rows[-1]["step"]) if rows else 0))
    return runs


@dataclass
class EvalResult:
    """One evaluation of the eval phase: what the table shows of it."""

    label: str
    """the drafter's name in the table (``4min``, ``zero_2min``, ``tune_v3 (--model.lr 6e-4)``)"""
    log: str
    """the evaluation's log file"""
    steps: Any = None
    """the checkpoint's ``global_step`` ("?" when it has none)"""
    acceptance: Optional[dict[str, Any]] = None
    """its ``acceptance.json``; ``None``: the evaluation failed"""


def table(results: Sequence[EvalResult]) -> list[str]:
    """The result table (Markdown lines): each trained drafter, and the untrained drafter and prompt
    lookup once (every evaluation scores them on the same positions)."""
    lines = ["| drafter | train steps | tau | 95 % interval | chains | P(accept >= 1) |", "|---|---|---|---|---|---|"]
    seen: set[str] = set()
    for e in results:
        if e.acceptance is None:
            lines.append(f"| trained {e.label} | - | failed (see {e.log}) | - | - | - |")
            continue
        for who, r in e.acceptance.items():
            if not isinstance(r, dict) or "tau" not in r or (who != "trained" and who in seen):
                continue
            seen.add(who)
            label = {"trained": f"trained {e.label}", "untrained": "untrained", "prompt_lookup": "prompt lookup"}[who]
            lo, hi = r["tau_ci95"] or ("-", "-")
            lines.append(f"| {label} | {e.steps if who == 'trained' else '-'} | {r['tau']:.3f} | [{lo}, {hi}] | "
                         f"{r['num_chains']} | {r['accept_at_least'][0]:.3f} |")
    return lines


def read_eval(out: Path, name: str, prefix: str = "eval_") -> EvalResult:
    """The evaluation ``OUT/NAME`` (``eval_4min``, ``eval_tune_v3``, ``eval_own_4min`` with prefix
    ``eval_own_``...): its checkpoint's steps and its acceptance, or a failure when it wrote no
    ``checkpoint.txt``."""
    label = name[len(prefix):]
    if label.startswith("tune_"):  # name the variant by its options
        label += f" ({(out / 'tune' / label[len('tune_'):] / 'args.txt').read_text().strip()})"
    done = out / name / "checkpoint.txt"
    if not done.exists():
        return EvalResult(label, f"{out}/{name}.log")
    import torch

    ckpt = out / done.read_text().strip()
    steps = torch.load(ckpt, map_location="cpu", weights_only=True).get("global_step", "?")
    return EvalResult(label, f"{out}/{name}.log", steps, json.loads((out / name / "acceptance.json").read_text()))
