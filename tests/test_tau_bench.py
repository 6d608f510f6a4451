"""``python -m benchmarks tau`` refuses what it would otherwise skip unsaid: a misspelt phase, minutes
that are not increasing numbers; minutes written another way (0.050, 1e-1) name the checkpoints the
training writes ({m:g}); an eval with no checkpoint at all fails instead of printing an empty table.
Its small decisions (the tune's winner from the CSV logs, the table, the training command) are
checked on plain values; the tune phase on fake runs. The CPU smoke test of the whole benchmark
(minutes) is the command in :mod:`benchmarks.tau`'s docstring, not part of the suite."""

import json
import math
import re
import shutil

import pytest

from benchmarks.__main__ import main
from benchmarks.tau import eval_targets, regen, serve, tune, tune_variants
from benchmarks.tau_commands import serve_command, train_command
from benchmarks.tau_config import TauConfig, TauPhaseFailed
from benchmarks.tau_results import EvalResult, TuneRun, choose_tune, minute_names, read_tune, table


def _run(tmp_path, capsys, *args):
    with pytest.raises(SystemExit) as e:
        main(["tau", "--out", str(tmp_path / "tau"), *args])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.parametrize("args,msg", [(["--phases", "[evl]"], "phases: unknown phase 'evl'"),
                                      (["--phases", "[eval]", "--minutes", "[2, 1]"], "minutes: numbers > 0, increasing"),
                                      (["--phases", "[eval]", "--minutes", "[1, 1]"], "minutes: numbers > 0, increasing"),
                                      (["--phases", "[eval]", "--minutes", "[0, 1]"], "minutes: numbers > 0, increasing"),
                                      (["--phases", "[eval]", "--minutes", "[two]"], "--minutes two: expected float"),
                                      (["--phases", "[eval]", "--minutes", "[0.1, 0.10000001]"],
                                       "each once to 6 significant"),
                                      (["--phases", "[]"], "phases: empty"),
                                      (["--phases", "[' ', '\t\n']"], "phases: empty"),
                                      (["--phases", "train,evl"], "phases: unknown phase 'evl'"),
                                      (["--device", "gpuu"], "device must be cpu, cuda or cuda:N, got 'gpuu'"),
                                      (["--accelerator", "gpuu"], "accelerator must be one of cpu, gpu"),
                                      (["--storage_dtype", "fp8"], "storage_dtype must be one of"),
                                      (["--final_rows", "some"], "final_rows must be one of all, taught"),
                                      (["--num_heldout", "0"], "num_heldout must be an integer >= 1, got 0"),
                                      (["--lrs", "[1e-3, 0]"], "lrs must be > 0, got 0"),
                                      (["--serve_speed_batches", "[1, 0]"], "serve_speed_batches must be an integer >= 1, got 0"),
                                      (["--regen_ranks", "0"], "regen_ranks must be an integer >= 1, got 0"),
                                      (["--phases", "serv"], "phases: unknown phase 'serv'")])
def test_bad_phases_and_minutes_are_refused(tmp_path, capsys, args, msg):
    """``--device gpuu`` failed with exit 1 after the data prep: every setting is refused before any work."""
    code, out, err = _run(tmp_path, capsys, *args)
    assert code == 2 and msg in err, (code, out, err)
    assert not (tmp_path / "tau").exists()


def test_phases_may_be_given_as_words():
    """``--phases train`` (a bare word) was refused: a list was required."""
    assert TauConfig(phases="train").phases == ["train"]
    assert TauConfig(phases="extract, tune eval").phases == ["extract", "tune", "eval"]


def test_phases_given_as_a_word_on_the_command_line_run_like_a_list(tmp_path, capsys):
    (tmp_path / "tau" / "heldout").mkdir(parents=True)
    code, out, err = _run(tmp_path, capsys, "--phases", "eval", "--device", "cpu", "--minutes", "[1]")
    assert code == 1 and "at_1min.ckpt" in out and "no checkpoint to evaluate" in err, (code, out, err)


def test_a_device_this_machine_lacks_is_refused_before_any_phase(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = _run(tmp_path, capsys, "--phases", "[prep, eval]", "--device", "cuda")
    assert code == 2 and "device 'cuda': no CUDA GPU is visible" in err and not (tmp_path / "tau").exists()


def test_minutes_name_the_checkpoints_as_training_writes_them_and_no_checkpoint_fails(tmp_path, capsys):
    (tmp_path / "tau" / "heldout").mkdir(parents=True)
    code, out, err = _run(tmp_path, capsys, "--phases", "[eval]", "--device", "cpu", "--minutes", "[0.050, 1e-1]")
    assert code == 1 and "eval: no checkpoint to evaluate" in err
    assert "at_0.05min.ckpt" in out and "at_0.1min.ckpt" in out and "0.050" not in out
    code, out, err = _run(tmp_path, capsys, "--phases", "[\teval\n]", "--device", "cpu",
                          "--minutes", "[1]")  # white space: eval runs
    assert code == 1 and "at_1min.ckpt" in out and "no checkpoint to evaluate" in err


def test_minute_names_are_the_checkpoint_names():
    assert minute_names([2, 4, 8]) == ["2", "4", "8"] and minute_names([0.050, 1e-1]) == ["0.05", "0.1"]
    for bad in ([], [math.inf], [-1, 2], [2, 2], ["x"], [0.1, 0.10000001]):
        with pytest.raises(ValueError, match="minutes: numbers > 0"):
            minute_names(bad)


def test_the_tune_chooses_the_lowest_loss_of_the_last_fifth_and_says_what_it_left_out():
    runs = [TuneRun("v1", "--model.lr 1e-3", False, [9.0] * 8 + [3.0, 3.0], 100),  # tail mean 3.0
            TuneRun("v2", "--model.lr 3e-3", False, [1.0] * 8 + [4.0, 4.0], 100),  # low early, high at the end
            TuneRun("v3", "--model.lr 1", False, [1.0] * 9 + [math.nan], 100),
            TuneRun("v4", "--model.zero_features true", False, [0.1] * 10, 100),  # a control: never chosen
            TuneRun("v5", "--model.zero_features=true", True),
            TuneRun("v6", "--model.lr 2e-3", False)]
    c = choose_tune(runs, "OUT/tune")
    assert c["best"] == "--model.lr 1e-3" and set(c["runs"]) == {"--model.lr 1e-3", "--model.lr 3e-3"}
    assert c["runs"]["--model.lr 1e-3"] == {"loss": 3.0, "steps": 100}
    assert c["left_out"] == ["'--model.lr 1' diverged (non-finite loss) (see OUT/tune/v3.log)",
                             "'--model.zero_features=true' failed (see OUT/tune/v5.log)",
                             "'--model.lr 2e-3' logged no training loss (see OUT/tune/v6.log)"]
    assert choose_tune(runs[3:], "OUT/tune")["best"] is None


def test_read_tune_orders_the_variants_by_number_and_reads_every_csv(tmp_path):
    for i, losses in ((1, []), (2, [5.0, 4.0]), (10, [3.0])):
        d = tmp_path / f"v{i}"
        (d / "lightning_logs" / "version_0").mkdir(parents=True)
        (d / "args.txt").write_text(f"--model.lr {i}e-4\n")
        rows = "".join(f"{s},{x},\n,,0.5\n" for s, x in enumerate(losses, 1))  # a row without a loss is skipped
        (d / "lightning_logs" / "version_0" / "metrics.csv").write_text("step,train/loss_step,other\n" + rows)
    (tmp_path / "v1" / "failed").write_text("failed\n")
    runs = read_tune(tmp_path)
    assert [(r.name, r.args, r.failed, r.losses, r.steps) for r in runs] == [
        ("v1", "--model.lr 1e-4", True, [], 0), ("v2", "--model.lr 2e-4", False, [5.0, 4.0], 2),
        ("v10", "--model.lr 10e-4", False, [3.0], 1)]


def test_the_table_shows_each_drafter_and_the_baselines_once():
    r = {"tau": 1.5, "tau_ci95": [1.4, 1.6], "num_chains": 32, "accept_at_least": [0.4, 0.1]}
    acc = {"trained": r, "untrained": {**r, "tau": 1.1, "tau_ci95": None}, "prompt_lookup": {**r, "tau": 1.2},
           "steps": 7}
    lines = table([EvalResult("2min", "OUT/eval_2min.log", 10, acc), EvalResult("4min", "OUT/eval_4min.log"),
                   EvalResult("zero_2min", "OUT/eval_zero_2min.log", "?", {**acc, "trained": {**r, "tau": 1.0}})])
    assert lines[2:] == ["| trained 2min | 10 | 1.500 | [1.4, 1.6] | 32 | 0.400 |",
                         "| untrained | - | 1.100 | [-, -] | 32 | 0.400 |",
                         "| prompt lookup | - | 1.200 | [1.4, 1.6] | 32 | 0.400 |",
                         "| trained 4min | - | failed (see OUT/eval_4min.log) | - | - | - |",
                         "| trained zero_2min | ? | 1.000 | [1.4, 1.6] | 32 | 0.400 |"]


def test_a_training_run_takes_the_extra_options_after_its_own_and_an_explicit_lr_last(tmp_path):
    cfg = TauConfig(out=str(tmp_path), minutes=[0.5, 1])
    cmd = train_command(cfg, tmp_path / "run", ["0.5", "1"], 3e-4, True, ["--model.lr", "1e-3", "--x", "y"])
    assert cmd[-6:] == ["--model.lr", "1e-3", "--x", "y", "--model.lr", "0.0003"]
    opt = dict(zip(cmd[4::2], cmd[5::2]))
    assert opt["--config"] == "configs/train/tau_bench_gpu.yaml" and opt["--model.zero_features"] == "true"
    assert opt["--model.lr_schedule_minutes"] == "1" and json.loads(opt["--trainer.max_time"]) == {"seconds": 660}
    assert json.loads(opt["--trainer.callbacks"])[0]["init_args"] == {"minutes": [0.5, 1.0], "stop_after_last": True}
    assert "--model.lr" not in train_command(cfg, tmp_path, ["1"], None, False, [])
    assert tune_variants(TauConfig(lrs=[3e-4, 1.2e-3])) == [["--model.lr", "0.0003"], ["--model.lr", "0.0012"]]
    assert tune_variants(TauConfig(lrs=[1.0], variants=[[], ["--a", "1"]])) == [["--a", "1"]]


def test_regen_runs_one_process_per_rank_and_names_a_failed_one(tmp_path, monkeypatch, capsys):
    import benchmarks.tau as tau

    jobs = []
    progress = tmp_path / "regen" / "progress-00001.json"
    progress.parent.mkdir()
    progress.write_text(json.dumps({"parts": [{"tokens": 5}]}))  # from an earlier run: not this one's

    def run_all(js):
        jobs.extend(js)
        progress.write_text(json.dumps({"parts": [{"tokens": 5}, {"tokens": 1000}]}))
        (tmp_path / "regen" / "progress-00000.json").write_text(json.dumps({"parts": [{"tokens": 234}]}))
        js[1][1].write_text("INFO x\nerror: data: rows changed since\n")  # what the CLI prints on a refusal
        return [0, 3, 0]

    monkeypatch.setattr(tau, "_run_all", run_all)
    cfg = TauConfig(out=str(tmp_path), regenerate=True, regen_ranks=3, regen_args=["--backend", "sglang"])
    with pytest.raises(TauPhaseFailed, match=rf"regen: regen_1 failed: data: rows changed since \(see {tmp_path}/regen_1.log\)"):
        regen(cfg)
    assert re.match(r"regen: 1,234 new tokens in [0-9.]+ s with 3 rank\(s\) = ", capsys.readouterr().out)
    assert [log.name for _, log in jobs] == ["regen_0.log", "regen_1.log", "regen_2.log"]
    for r, (cmd, _) in enumerate(jobs):
        assert cmd[-6:] == ["--backend", "sglang", "--rank", str(r), "--world_size", "3"]
    jobs.clear()
    monkeypatch.setattr(tau, "_run_all", lambda js: jobs.extend(js) or [0])
    regen(TauConfig(out=str(tmp_path), regenerate=True))  # the engine's own number of requests in flight unless given
    assert "--rank" not in jobs[0][0] and "--batch_size" not in jobs[0][0] and jobs[0][0][3] == "regenerate"
    regen(TauConfig(out=str(tmp_path), regenerate=True, regen_batch_size=64))
    assert jobs[1][0][jobs[1][0].index("--batch_size") + 1] == "64"
    batches = []
    monkeypatch.setattr(tau, "_run_all", lambda js: batches.append(js) or [0] * len(js))
    regen(TauConfig(out=str(tmp_path), regenerate=True, own_heldout=True, regen_ranks=2))  # all at once
    assert [[log.name for _, log in b] for b in batches] == [["regen_0.log", "regen_1.log", "regen_heldout.log"]]
    assert [dict(zip(c[4::2], c[5::2]))["--out"] for c, _ in batches[0]] == [
        f"{tmp_path}/regen", f"{tmp_path}/regen", f"{tmp_path}/regen_heldout"]


def test_serve_exports_the_last_mark_and_runs_a_serve_check_the_cli_accepts(tmp_path, monkeypatch, capsys):
    import benchmarks.tau as tau
    from eagle_data.cli.main import main

    cfg = TauConfig(out=str(tmp_path), minutes=[1, 2], serve_prompts=50, serve_speed_batches=[1, 8],
                    serve_args=["--attention_backend", "triton"])
    with pytest.raises(TauPhaseFailed, match="serve: no checkpoint .*at_2min.ckpt"):
        serve(cfg, "2")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "at_2min.ckpt").write_text("x")
    ran = []
    monkeypatch.setattr(tau, "_check", lambda phase, cmd: ran.append(cmd))
    serve(cfg, "2")
    assert ran[0][3:] == ["export", str(tmp_path / "run" / "at_2min.ckpt"), str(tmp_path / "drafter"), "--overwrite", "true"]
    assert ran[1] == serve_command(cfg)
    with pytest.raises(SystemExit) as e:  # every option is one serve-check knows, with a valid value
        main([*ran[1][3:], "--print_config"])
    printed = capsys.readouterr().out
    assert e.value.code == 0 and "prompt_turn: first" in printed and "num_prompts: 50" in printed
    assert "heldout_fraction: 1.0" in printed and "ngram: true" in printed and "attention_backend: triton" in printed
    assert "- 8" in printed and "max_new_tokens: 256" in printed and "dtype: bfloat16" in printed


def test_the_tune_writes_the_winner_and_marks_failed_variants(tmp_path, monkeypatch, capsys):
    """The tune phase on fake runs: each 'trains' by writing a CSV log whose loss is its lr."""
    def fake_runs(jobs):
        codes = []
        for cmd, log in jobs:
            d = cmd[cmd.index("--trainer.default_root_dir") + 1]
            lr = float(cmd[len(cmd) - 1 - cmd[::-1].index("--model.lr") + 1])
            (tmp_path / d / "at_1min.ckpt").write_text("")
            (tmp_path / d / "metrics.csv").write_text(f"step,train/loss_step\n10,{lr}\n")
            log.write_text("log\n")
            codes.append(1 if lr > 1 else 0)
        return codes

    monkeypatch.setattr("benchmarks.tau._run_all", fake_runs)
    cfg = TauConfig(out=str(tmp_path / "tau"), lr=0.5, variants=[["--model.lr", "3"], ["--model.lr", "2e-3"], [],
                                                                  ["--model.lr", "0.1", "--model.zero_features", "true"]])
    (tmp_path / "tau").mkdir()
    (tmp_path / "tau" / "lr.txt").write_text("0.7")  # an earlier tune's choice: removed
    tune(cfg, tune_variants(cfg))
    out = tmp_path / "tau"
    assert (out / "train_args.txt").read_text() == "--model.lr 2e-3" and not (out / "lr.txt").exists()
    assert (out / "tune" / "v1" / "failed").exists() and not (out / "tune" / "v2" / "failed").exists()
    assert json.loads((out / "tune.json").read_text())["runs"] == {"--model.lr 2e-3": {"loss": 0.002, "steps": 10}}
    assert "tune: left out: '--model.lr 3' failed" in capsys.readouterr().out
    cfg.phases, cfg.eval_tune = ["eval"], ["all"]  # the tune's checkpoints can be scored, the control's too
    assert [e[1] for e in eval_targets(cfg, ["1"])] == ["eval_tune_v1", "eval_tune_v2", "eval_tune_v3"]
    with pytest.raises(TauPhaseFailed, match="tune: no candidate"):
        tune(cfg, [["--model.lr", "5"]])


@pytest.mark.parametrize("mix", [False, True])
def test_regenerated_training_data_alone_or_mixed_with_the_originals(tmp_path, monkeypatch, mix):
    import benchmarks.tau as tau

    with pytest.raises(ValueError, match="mix needs regenerate: true"):
        TauConfig(mix=True)
    cfg = TauConfig(out=str(tmp_path), regenerate=True, mix=mix, phases="extract", device="cpu")
    with pytest.raises(ValueError, match=f"phases extract: {tmp_path}/regen missing .*add that phase"):
        tau.run_tau(cfg)  # refused before anything is extracted
    (tmp_path / "regen").mkdir()
    ran = []
    monkeypatch.setattr(tau, "_last_line", lambda phase, cmd: ran.append(cmd))
    monkeypatch.setattr(tau, "_check", lambda phase, cmd: ran.append(cmd))
    tau.run_tau(cfg)
    extracts = [dict(zip(c[4::2], c[5::2])) for c in ran if c[3] == "extract"]
    t = str(tmp_path)
    want = ([(f"{t}/train.jsonl", f"{t}/train"), (f"{t}/regen", f"{t}/train_regen")] if mix else
            [(f"{t}/regen", f"{t}/train")]) + [(f"{t}/heldout.jsonl", f"{t}/heldout")]
    assert [(o["--data"], o["--out"]) for o in extracts] == want
    assert ["--storage_dtype" in o for o in extracts] == [True] * (len(want) - 1) + [False]
    vocab = [c for c in ran if c[3] == "vocab"]
    assert len(vocab) == 1 and vocab[0][4] == want[-2][1]  # the vocabulary counts the regenerated answers
    opt = dict(zip(*[iter(train_command(cfg, tmp_path / "run", ["1"], None, False, [])[4:])] * 2))
    assert json.loads(opt["--data.train"]) == [o for _, o in want[:-1]]
    assert opt["--model.dataset_dir"] == vocab[0][4]  # the vocabulary's set (train checks it built the file)


def test_own_heldout_regenerates_extracts_and_scores_the_targets_own_answers(tmp_path, monkeypatch, capsys):
    """``own_heldout``: the held-out rows' answers rewritten by the target (``serve_new_tokens`` per
    turn, one process, the training rows untouched), extracted as served, and every checkpoint scored
    there too, in a table of its own."""
    import torch

    import benchmarks.tau as tau

    jobs, ran = [], []

    def run_all(js):
        jobs.extend(js)
        for cmd, _ in js:
            if cmd[3] == "eval":  # an evaluation's result: tau = 2 on ShareGPT's held-out text, 3 on the own
                own = "heldout_own" in cmd[4]
                r = {"tau": 3.0 if own else 2.0, "tau_ci95": [1.5, 2.5], "num_chains": 7, "accept_at_least": [0.5]}
                d = tmp_path / cmd[cmd.index("--out") + 1]
                d.mkdir(parents=True)
                (d / "acceptance.json").write_text(json.dumps({"trained": r, "prompt_lookup": {**r, "tau": 1.25}}))
        return [0] * len(js)

    monkeypatch.setattr(tau, "_run_all", run_all)
    monkeypatch.setattr(tau, "_last_line", lambda phase, cmd: ran.append(cmd))
    monkeypatch.setattr(tau, "_check", lambda phase, cmd: ran.append(cmd))
    (tmp_path / "run").mkdir()
    torch.save({"global_step": 12}, tmp_path / "run" / "at_1min.ckpt")
    cfg = TauConfig(out=str(tmp_path), own_heldout=True, serve_new_tokens=99, minutes=[1], regen_max_new_tokens=7,
                    phases="regen,extract,eval", device="cpu", regen_args=["--backend", "sglang"])
    tau.run_tau(cfg)
    regen_cmd, log = jobs[0]
    opt = dict(zip(regen_cmd[4::2], regen_cmd[5::2]))
    assert regen_cmd[3] == "regenerate" and log == tmp_path / "regen_heldout.log" and "--rank" not in regen_cmd
    assert (opt["--data"], opt["--out"], opt["--max_new_tokens"], opt["--backend"]) == (
        f"{tmp_path}/heldout.jsonl", f"{tmp_path}/regen_heldout", "99", "sglang")
    extracts = [dict(zip(c[4::2], c[5::2])) for c in ran if c[3] == "extract"]
    assert [(o["--data"], o["--out"]) for o in extracts] == [
        (f"{tmp_path}/train.jsonl", f"{tmp_path}/train"), (f"{tmp_path}/heldout.jsonl", f"{tmp_path}/heldout"),
        (f"{tmp_path}/regen_heldout", f"{tmp_path}/heldout_own")]
    assert ["--storage_dtype" in o for o in extracts] == [True, False, False]  # held-out sets as served
    evals = {c[c.index("--out") + 1]: c[4] for c, _ in jobs[1:]}
    assert evals == {f"{tmp_path}/eval_1min": f"{tmp_path}/heldout", f"{tmp_path}/eval_own_1min": f"{tmp_path}/heldout_own"}
    printed = capsys.readouterr().out
    own = printed[printed.index(f"on {tmp_path}/heldout_own:"):]
    assert "| trained 1min | 12 | 3.000 |" in own and "| prompt lookup | - | 1.250 |" in own
    assert "| trained 1min | 12 | 2.000 |" in printed[printed.index(f"on {tmp_path}/heldout:"):printed.index(own)]
    jobs.clear()
    tau.run_tau(TauConfig(out=str(tmp_path), phases="regen", device="cpu"))  # neither: nothing regenerated
    assert jobs == []
    (tmp_path / "heldout").mkdir()
    for phases, folder in (("extract", "regen_heldout"), ("eval", "heldout_own")):  # what no phase of the run makes
        shutil.rmtree(tmp_path / folder, ignore_errors=True)
        with pytest.raises(ValueError, match=f"phases {phases}: {tmp_path}/{folder} missing"):
            tau.run_tau(TauConfig(out=str(tmp_path), own_heldout=True, phases=phases, device="cpu"))


def test_kept_rows_of_another_size_are_refused_before_any_phase(tmp_path, capsys):
    """Rows kept from a run with another ``num_train`` were regenerated and extracted unsaid."""
    out = tmp_path / "tau"
    out.mkdir()
    (out / "train.jsonl").write_text('{"conversations": []}\n' * 5)
    (out / "heldout.jsonl").write_text('{"conversations": []}\n' * 2)
    code, _, err = _run(tmp_path, capsys, "--phases", "prep,extract", "--device", "cpu", "--num_train", "4",
                        "--num_heldout", "2")
    assert code == 2 and "train.jsonl holds 5 rows, num_train is 4: pass --num_train 5" in err, err
    code, _, err = _run(tmp_path, capsys, "--phases", "extract", "--device", "cpu", "--num_train", "5",
                        "--num_heldout", "3")
    assert code == 2 and "heldout.jsonl holds 2 rows, num_heldout is 3" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["heldout.jsonl", "train.jsonl"]
