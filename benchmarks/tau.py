"""``python -m benchmarks tau``: τ on real data after fixed training time (issue 14), end to end on
one machine, each phase through the project's own commands (``eagle-data extract/vocab/train/eval/
regenerate``, as child processes):

* ``prep``: ShareGPT rows [0, N) -> ``OUT/train.jsonl``, rows [17000, 17000 + HELD) ->
  ``OUT/heldout.jsonl`` (kept when both exist already, e.g. carried to a machine without network);
* ``regen`` (with ``--regenerate true``): SmolLM2 writes every assistant turn of the training rows
  itself (greedy) -> ``OUT/regen``, which extraction then reads instead of ``OUT/train.jsonl``
  (``regen_ranks`` processes at once, logs ``OUT/regen_R.log``); with ``--own_heldout true`` also
  those of the held-out rows (``serve_new_tokens`` per turn, one more process at the same time) ->
  ``OUT/regen_heldout``;
* ``extract``: both sets with SmolLM2 (the training set stored as ``storage_dtype``, the held-out
  one as served; with ``mix`` the originals in ``OUT/train`` and the regenerated answers in
  ``OUT/train_regen``; with ``own_heldout`` the held-out rows' own answers in ``OUT/heldout_own``),
  then the draft vocabulary of the training set (the regenerated one);
* ``tune`` (with ``variants`` or ``lrs``): a short run per variant side by side, cosine over
  ``sweep_seconds``; the lowest training loss (last fifth of the logged steps) ->
  ``OUT/train_args.txt`` and ``OUT/tune.json``, the options of the two phases below unless
  ``train_args`` are given. Training data only;
* ``train``: ``train_config``, a checkpoint ``OUT/run/at_{m}min.ckpt`` at each mark of ``minutes``
  of training time (the lr cosine spans the last mark; training stops there);
* ``control``: the same training with the target's features zeroed, up to the first mark
  (``OUT/run_zero``);
* ``eval``: τ of each checkpoint on the first ``eval_samples`` held-out keys, 16 positions each,
  K=7, beside the untrained drafter and prompt lookup (95 % intervals), all at once; then a table
  (with ``own_heldout`` a second one: the same on the target's own answers, ``OUT/eval_own_*``);
* ``serve``: the last mark's checkpoint exported (``OUT/drafter``) and served by SGLang
  (``eagle-data serve-check``): EAGLE-3 with it vs SGLang's own NGRAM speculation vs plain decoding
  on the opening user turns of ``serve_prompts`` held-out conversations, K=7 chains, greedy: engine
  accept length (95 % intervals over prompts), the offline replay of the same drafts, decode
  tokens/s at ``serve_speed_batches`` -> ``OUT/serve/serve_check.json``.

GPU: ``python -m benchmarks tau --out out/tau --num_train 8769 --lrs '[3e-4, 6e-4, 1.2e-3]'``.
CPU smoke test (~7 min on 2 cores; the GPU config's 65,536-token batches and 8 workers alone take
~10 GB and minutes per step there)::

    python -m benchmarks tau --out /tmp/tau --num_train 12 --num_heldout 4 --minutes '[0.3, 0.6]' \\
        --device cpu --accelerator cpu --precision 32-true --eval_samples 2 \\
        --train_args '["--data.max_tokens", "4096", "--data.num_workers", "1"]'

Every phase but the tune and the control, regeneration by SGLang's CPU engine in two ranks included:
add ``--regenerate true --regen_ranks 2 --regen_max_new_tokens 48 --regen_args '["--backend",
"sglang"]' --phases prep,regen,extract,train,eval,serve --serve_prompts 3 --serve_new_tokens 24
--serve_speed_batches '[]'``. The held-out rows' own answers: the first command with ``--own_heldout
true --serve_new_tokens 24 --phases prep,regen,extract,train,eval`` (HF generates them; ~6 min).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional

from benchmarks.tau_commands import (eagle_data_cmd, extract_command, regenerate_command, serve_command,
                                     train_command, train_sets, vocab_path)
from benchmarks.tau_config import TauConfig, TauPhaseFailed
from benchmarks.tau_results import choose_tune, minute_names, read_eval, read_tune, table
from eagle_data.checks import check_device

#: the held-out rows start here in ShareGPT (far from any training row)
HELDOUT_START = 17000


def run_tau(cfg: TauConfig) -> None:
    """Run the phases of ``cfg`` in their order (the command ``python -m benchmarks tau``).

    Raises:
        ValueError: (before any phase) ``cfg.device`` is not usable here while a phase runs a model on it.
    """
    if {"regen", "extract", "eval"} & set(cfg.phases):  # "cuda" without a GPU: refused now, not after the prep
        check_device(cfg.device)
    names = minute_names(cfg.minutes)
    out = Path(cfg.out)
    _check_inputs(cfg, out)
    out.mkdir(parents=True, exist_ok=True)
    if "prep" in cfg.phases and not (_nonempty(out / "train.jsonl") and _nonempty(out / "heldout.jsonl")):
        prep(out, cfg.num_train, cfg.num_heldout)
    if "regen" in cfg.phases and (cfg.regenerate or cfg.own_heldout):
        regen(cfg)
    if "extract" in cfg.phases:
        for part in ("train", *(["train_regen"] if cfg.mix else []), "heldout", *(["heldout_own"] * cfg.own_heldout)):
            _last_line("extract", extract_command(cfg, part))
        _check("vocab", eagle_data_cmd("vocab", train_sets(cfg)[-1], "--size", str(cfg.vocab_size),
                                    "--out", str(vocab_path(cfg)), "--rebuild", "true"))
    variants = tune_variants(cfg)
    if "tune" in cfg.phases and variants:
        tune(cfg, variants)
    lr = cfg.lr if cfg.lr is not None else _read_float(out / "lr.txt")
    train_args = cfg.train_args or _read_words(out / "train_args.txt")
    if "train" in cfg.phases:
        _check("train", train_command(cfg, out / "run", names, lr, False, train_args))
    if "control" in cfg.phases:
        _check("control", train_command(cfg, out / "run_zero", names[:1], lr, True, train_args))
    if "eval" in cfg.phases:
        evaluate(cfg, names)
    if "serve" in cfg.phases:
        serve(cfg, names[-1])


def _check_inputs(cfg: TauConfig, out: Path) -> None:
    """Refuse now what a later phase would fail on: a folder it reads that no phase of this run makes;
    kept rows (``train.jsonl``, ``heldout.jsonl``) of another ``num_train`` or ``num_heldout``.

    Raises:
        ValueError: naming the folders and the phase that makes them, or the file and the setting.
    """
    need = []
    if "extract" in cfg.phases and "regen" not in cfg.phases:
        need += [("regen", cfg.regenerate), ("regen_heldout", cfg.own_heldout)]
    if "eval" in cfg.phases and "extract" not in cfg.phases:
        need += [("heldout", True), ("heldout_own", cfg.own_heldout)]
    missing = [str(out / d) for d, used in need if used and not (out / d).is_dir()]
    if missing:
        raise ValueError(f"phases {','.join(cfg.phases)}: {', '.join(missing)} missing (the regen phase makes "
                         "regen*, the extract phase the held-out sets): add that phase")
    kept = [("train.jsonl", cfg.num_train, "num_train"), ("heldout.jsonl", cfg.num_heldout, "num_heldout")]
    if {"regen", "extract"} & set(cfg.phases) and all(_nonempty(out / name) for name, _, _ in kept):
        for name, want, flag in kept:  # the prep keeps them: another run's rows would be read unsaid
            if (have := _count_lines(out / name)) != want:
                raise ValueError(f"{out / name} holds {have} rows, {flag} is {want}: pass --{flag} {have}, "
                                 "or remove it and run the prep phase")


def prep(out: Path, num_train: int, num_heldout: int) -> None:
    """ShareGPT rows [0, num_train) -> ``train.jsonl``, [17000, 17000 + num_heldout) -> ``heldout.jsonl``."""
    from eagle_data.extract.sources import iter_records

    with open(out / "train.jsonl", "w") as tr, open(out / "heldout.jsonl", "w") as ho:
        for row, rec in iter_records("sharegpt", num_samples=HELDOUT_START + num_heldout):
            if row < num_train or row >= HELDOUT_START:
                (tr if row < num_train else ho).write(json.dumps(rec, ensure_ascii=False) + "\n")


def tune_variants(cfg: TauConfig) -> list[list[str]]:
    """The tune's variants: ``variants`` (empty ones dropped), else one per lr of ``lrs``."""
    if cfg.variants:
        return [v for v in cfg.variants if any(w.strip() for w in v)]
    return [["--model.lr", f"{lr:g}"] for lr in cfg.lrs]


def tune(cfg: TauConfig, variants: list[list[str]]) -> None:
    """Train every variant side by side for ``sweep_seconds`` (``OUT/tune/vI``, log ``vI.log``), then
    write the winner's options to ``OUT/train_args.txt`` and every score to ``OUT/tune.json``.

    Raises:
        TauPhaseFailed: no candidate (every variant failed, diverged or is a features-zeroed control).
    """
    out, tune_dir = Path(cfg.out), Path(cfg.out) / "tune"
    shutil.rmtree(tune_dir, ignore_errors=True)
    for old in ("lr.txt", "train_args.txt", "tune.json"):
        (out / old).unlink(missing_ok=True)
    base = ["--model.lr", repr(cfg.lr)] if cfg.lr is not None else []  # before a variant's own: its lr wins
    jobs = []
    for i, v in enumerate(variants, 1):
        d = tune_dir / f"v{i}"
        d.mkdir(parents=True)
        (d / "args.txt").write_text(" ".join(v) + "\n")
        logger = {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(d)}}
        cmd = train_command(cfg, d, [f"{cfg.sweep_seconds / 60:g}"], None, False,
                            ["--data.num_workers", str(cfg.tune_workers), "--trainer.logger", json.dumps(logger),
                             "--trainer.log_every_n_steps", "10", *base, *v])
        jobs.append((cmd, tune_dir / f"v{i}.log"))
    for (_, log), rc in zip(jobs, _run_all(jobs)):
        if rc != 0:  # e.g. out of memory late in its run: not a candidate
            (log.with_suffix("") / "failed").write_text("failed\n")
    choice = choose_tune(read_tune(tune_dir), str(tune_dir))
    for why in choice["left_out"]:
        print("tune: left out:", why)
    if choice["best"] is None:
        raise TauPhaseFailed("tune: no candidate (every variant failed, diverged or is a features-zeroed control): "
                             "nothing chosen, OUT/train_args.txt not written")
    (out / "tune.json").write_text(json.dumps(choice, indent=1))
    (out / "train_args.txt").write_text(choice["best"])
    print("tune (training loss, last fifth of logged steps):",
          "; ".join(f"{k}: {v['loss']:.4f} ({v['steps']} steps)" for k, v in choice["runs"].items()),
          "-> best:", choice["best"])


def evaluate(cfg: TauConfig, names: list[str]) -> None:
    """Evaluate every checkpoint there is at once (``OUT/eval_*``, logs ``OUT/eval_*.log``), then print
    the table; a missing checkpoint is said.

    Raises:
        FileNotFoundError: no checkpoint at all under ``OUT``.
    """
    out = Path(cfg.out)
    evals = eval_targets(cfg, names)
    if not evals:
        raise FileNotFoundError(f"eval: no checkpoint to evaluate under {out}")
    sets = [("heldout", "eval_"), *([("heldout_own", "eval_own_")] if cfg.own_heldout else [])]
    runs = [(data, ckpt, prefix + name[len("eval_"):], compare) for data, prefix in sets for ckpt, name, compare in evals]
    jobs = []
    for data, ckpt, name, compare in runs:
        shutil.rmtree(out / name, ignore_errors=True)  # no result of an earlier call is shown as this one's
        jobs.append((eagle_data_cmd(
            "eval", str(out / data), str(out / ckpt), "--out", str(out / name), "--heldout_fraction", "1.0",
            "--num_samples", str(cfg.eval_samples), "--positions_per_sample", "16", "--steps", "7",
            "--max_length", "2048", "--device", cfg.device, "--compare_untrained", str(compare).lower()),
            out / f"{name}.log"))
    for (_, ckpt, name, _), rc in zip(runs, _run_all(jobs)):
        if rc == 0:
            (out / name / "checkpoint.txt").write_text(ckpt + "\n")
    for data, prefix in sets:
        if len(sets) > 1:
            print(f"on {out / data}:")
        print("\n".join(table([read_eval(out, n, prefix) for d, _, n, _ in runs if d == data])))


def eval_targets(cfg: TauConfig, names: list[str]) -> list[tuple[str, str, bool]]:
    """``(checkpoint relative to OUT, eval folder name, compare_untrained)`` of each checkpoint to
    evaluate: the run's marks, the control's first, the tune variants of ``eval_tune``."""
    out, evals = Path(cfg.out), []
    for m in names:
        if (out / "run" / f"at_{m}min.ckpt").is_file():
            evals.append((f"run/at_{m}min.ckpt", f"eval_{m}min", m == names[0]))
        else:
            print(f"eval: no checkpoint {out}/run/at_{m}min.ckpt (not trained, or stopped before {m} minutes)")
    if (out / "run_zero" / f"at_{names[0]}min.ckpt").is_file():
        evals.append((f"run_zero/at_{names[0]}min.ckpt", f"eval_zero_{names[0]}min", False))
    elif "control" in cfg.phases or (out / "run_zero").is_dir():
        print(f"eval: no control checkpoint {out}/run_zero/at_{names[0]}min.ckpt")
    for v in cfg.eval_tune:
        ws = sorted((p.name for p in (out / "tune").glob("v*/")), key=lambda w: int(w[1:])) if v == "all" else [v]
        for w in ws:
            ckpts = sorted((out / "tune" / w).glob("at_*min.ckpt"))
            if ckpts:
                evals.append((str(ckpts[0].relative_to(out)), f"eval_tune_{w}", False))
            else:
                print(f"eval: tune variant {w} has no checkpoint")
    return evals


def regen(cfg: TauConfig) -> None:
    """With ``regenerate``, ``regen_ranks`` processes over the training rows (logs ``OUT/regen_R.log``);
    with ``own_heldout``, one more over the held-out rows (``serve_new_tokens`` per turn, log
    ``OUT/regen_heldout.log``); all at once (with SGLang, an engine starts while the others generate).

    Raises:
        TauPhaseFailed: a process failed (the others ran to their end; rerun to resume).
    """
    n, out = cfg.regen_ranks, Path(cfg.out)
    jobs = []
    if cfg.regenerate:
        cmd = regenerate_command(cfg, out / "train.jsonl", out / "regen", cfg.regen_max_new_tokens)
        jobs += [(cmd + (["--rank", str(r), "--world_size", str(n)] if n > 1 else []), out / f"regen_{r}.log")
                 for r in range(n)]
    if cfg.own_heldout:
        jobs.append((regenerate_command(cfg, out / "heldout.jsonl", out / "regen_heldout", cfg.serve_new_tokens),
                     out / "regen_heldout.log"))
    before, t0 = _regen_tokens(cfg), time.perf_counter()
    failed = [log for (_, log), rc in zip(jobs, _run_all(jobs)) if rc != 0]
    new, wall = _regen_tokens(cfg) - before, time.perf_counter() - t0
    if cfg.regenerate:
        print(f"regen: {new:,} new tokens in {wall:.1f} s with {n} rank(s) = {new / max(wall, 1e-9):,.0f} tokens/s "
              "(engine starts included; each rank's own rate is in its log)")
    if failed:
        raise TauPhaseFailed(f"regen: {', '.join(f.stem for f in failed)} failed{_why(failed[0])} (see {out}/"
                             f"{failed[0].name}); rerun to resume once its cause is mended")
    print("\n".join(str(out / d) for d, on in (("regen", cfg.regenerate), ("regen_heldout", cfg.own_heldout)) if on))


def _why(log: Path) -> str:
    """``": <reason>"`` from the last ``error:`` line a command wrote to ``log`` (``""`` when none)."""
    errs = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("error: ")] if log.is_file() else []
    return f": {errs[-1][len('error: '):]}" if errs else ""


def _regen_tokens(cfg: TauConfig) -> int:
    """New tokens of the parts every rank's progress file lists (the finished ones)."""
    from eagle_data.format.regen_layout import progress_path

    files = [progress_path(Path(cfg.out) / "regen", r) for r in range(cfg.regen_ranks)]
    return sum(p["tokens"] for f in files if f.is_file() for p in json.loads(f.read_text())["parts"])


def serve(cfg: TauConfig, mark: str) -> None:
    """Export checkpoint ``OUT/run/at_{mark}min.ckpt`` and serve-check it (see the module docstring).

    Raises:
        TauPhaseFailed: no such checkpoint, or a command failed.
    """
    out = Path(cfg.out)
    ckpt = out / "run" / f"at_{mark}min.ckpt"
    if not ckpt.is_file():
        raise TauPhaseFailed(f"serve: no checkpoint {ckpt} (train first)")
    _check("serve", eagle_data_cmd("export", str(ckpt), str(out / "drafter"), "--overwrite", "true"))
    _check("serve", serve_command(cfg))


def _check(phase: str, cmd: list[str]) -> None:
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        raise TauPhaseFailed(f"{phase}: `eagle-data {cmd[3]}` exited with {rc}")


def _last_line(phase: str, cmd: list[str]) -> None:
    """Run ``cmd`` and print the last line of its output (the dataset folder); its log goes to stderr."""
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    print(r.stdout.rstrip("\n").rsplit("\n", 1)[-1])
    if r.returncode != 0:
        raise TauPhaseFailed(f"{phase}: `eagle-data {cmd[3]}` exited with {r.returncode}")


def _run_all(jobs: list[tuple[list[str], Path]]) -> list[int]:
    """Run every ``(command, log file)`` at once; their exit codes. Stopped (Ctrl-C, SIGTERM), the
    ones still running are terminated."""
    procs = []
    try:
        for cmd, log in jobs:
            with open(log, "w") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
        return [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()


def _count_lines(p: Path) -> int:
    with open(p, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def _nonempty(p: Path) -> bool:
    return p.is_file() and p.stat().st_size > 0


def _read_float(p: Path) -> Optional[float]:
    return float(p.read_text()) if p.is_file() and p.read_text().strip() else None


def _read_words(p: Path) -> list[str]:
    return p.read_text().split() if p.is_file() else []
