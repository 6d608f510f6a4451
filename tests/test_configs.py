"""Every extraction YAML in configs/ parses with the CLI's own parser (typed, no unknown keys)."""

from pathlib import Path

import pytest
from jsonargparse import capture_parser

from eagle_data.cli import main as cli

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("extract_*.yaml"))


def test_there_are_configs():
    assert len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_extract_config_parses(path):
    parser = capture_parser(lambda: cli.main(["extract", "--config", str(path)]))
    ns = parser.parse_args(["extract", "--config", str(path)])
    assert ns.extract.out and ns.extract.backend in ("hf", "sglang")
    assert ns.extract.dtype in ("bfloat16", "float32")


REGEN_CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("regenerate_*.yaml"))


@pytest.mark.parametrize("path", REGEN_CONFIGS, ids=lambda p: p.name)
def test_regenerate_config_parses(path):
    parser = capture_parser(lambda: cli.main(["regenerate", "--config", str(path)]))
    ns = parser.parse_args(["regenerate", "--config", str(path)])
    assert ns.regenerate.out and ns.regenerate.mode in ("all", "last")
    assert ns.regenerate.backend in ("hf", "sglang")


def test_there_are_regenerate_configs():
    assert len(REGEN_CONFIGS) >= 2


def test_unknown_key_is_rejected(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("out: x\nmax_lenght: 5\n")
    with pytest.raises(SystemExit) as e:
        cli.main(["extract", "--config", str(bad)])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "error: eagle-data extract: Subcommand 'extract' does not accept option 'max_lenght' "
        "(eagle-data extract --help lists the options)\n")


def test_cli_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for name in ("extract", "inspect", "merge"):
        assert name in out


def test_cli_help_shows_each_command_summary_whole(capsys):
    """jsonargparse shows only a docstring's first line: it must be the whole summary sentence
    (verify's used to stop at "(sha256, size, sample count),", eval's at "beside")."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = "".join(capsys.readouterr().out.split())  # help wraps lines (also at hyphens)
    for name, fn in cli.COMMANDS.items():
        lines = fn.__doc__.strip().splitlines()
        assert lines[0].endswith("."), (name, lines[0])
        assert len(lines) == 1 or not lines[1].strip(), f"{name}: the summary continues on a second line"
        assert "".join(lines[0].split()) in out, name
    assert "Exits1onfailure." in out


def test_cli_reports_bad_settings_without_traceback(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["extract", "--out", str(tmp_path / "o"), "--max_length", "1"])
    assert e.value.code == 2
    assert "error: max_length must be >= 2" in capsys.readouterr().err


def test_core_dependencies_keep_the_machines_torch():
    """The base package has lower bounds only for torch/transformers (pip keeps an installed
    CUDA build that satisfies them); the sglang extra is the tested range of sglang releases, no
    exact pin (each release pins its own torch: a GPU box keeps the one matching its torch), and it
    names the same range as the backend's version check."""
    import re
    import tomllib
    from pathlib import Path

    proj = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    base = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0]: d for d in proj["dependencies"]}
    assert not any("==" in d for d in proj["dependencies"]), proj["dependencies"]
    assert base["torch"].startswith("torch>=") and base["transformers"].startswith("transformers>=")
    from eagle_data.engines.sglang_engine import SUPPORTED

    lo, hi = (".".join(map(str, v)) for v in SUPPORTED)
    assert proj["optional-dependencies"]["sglang"] == [f"sglang>={lo},<={hi}"]


def test_sglang_backend_without_the_extra_says_how_to_install(monkeypatch):
    import sys

    from eagle_data.engines import make_backend

    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` fails as if not installed
    with pytest.raises(ValueError, match=r"backend 'sglang' needs the sglang extra: pip install -e '\.\[sglang\]'"):
        make_backend("sglang", model_path="unused", aux_layer_ids=[1, 2, 3])


def test_sglang_start_up_noise_is_silenced_in_child_processes_narrowly(monkeypatch):
    """The PYTHONWARNINGS entries quiet_sglang sets parse (no 'Invalid -W option') and silence the
    named module's warning in a child process, not the same text from another module."""
    import os
    import subprocess
    import sys

    from eagle_data.engines.sglang_engine import quiet_sglang

    monkeypatch.setenv("PYTHONWARNINGS", "default::DeprecationWarning")
    quiet_sglang()
    code = ("import warnings\n"
            "warnings.warn_explicit('Only CUDA, HIP and XPU support AWQ currently.', UserWarning, 'awq.py', 53,"
            " module='sglang.srt.layers.quantization.awq.awq')\n"
            "warnings.warn_explicit('Only CUDA here', UserWarning, 'x.py', 1, module='mine')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=60)
    assert "Invalid -W option" not in r.stderr and "AWQ" not in r.stderr and "Only CUDA here" in r.stderr, r.stderr
    assert os.environ["PYTHONWARNINGS"].startswith("default::DeprecationWarning,")


def test_shipped_train_configs_write_nothing_into_the_dataset():
    """A config's draft vocabulary file lives outside its dataset folder (shared or read-only)."""
    import glob
    from pathlib import Path

    import yaml

    files = glob.glob(str(Path(__file__).resolve().parents[1] / "configs" / "train" / "*.yaml"))
    assert len(files) >= 4
    for f in files:
        m = yaml.safe_load(Path(f).read_text())["model"]
        if m.get("draft_vocab") and m.get("dataset_dir"):
            assert Path(m["dataset_dir"]) not in Path(m["draft_vocab"]).parents, f


@pytest.mark.parametrize("args,msg", [(["--write_queue_gib", "0"], "write_queue_gib must be a finite number > 0, got 0"),
                                      (["--write_queue_gib", "-2"], "write_queue_gib must be a finite number > 0, got -2"),
                                      (["--final_rows", "some"], "final_rows")])
def test_cli_refuses_bad_queue_and_final_rows_settings(capsys, tmp_path, args, msg):
    with pytest.raises(SystemExit) as e:
        cli.main(["extract", "--out", str(tmp_path / "o"), *args])
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_cli_options_are_never_abbreviations(capsys, tmp_path):
    """argparse would read the removed ``--write_queue 16`` as ``--write_queue_gib 16`` (16 GiB):
    options must be spelled out."""
    with pytest.raises(SystemExit) as e:
        cli.main(["extract", "--out", str(tmp_path / "o"), "--write_queue", "16"])
    assert e.value.code == 2 and "unknown option --write_queue; did you mean --write_queue_gib?" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["extract", "regenerate"])
def test_option_mappings_keep_quoted_strings(command):
    """The command line read '{"cuda_graphs": "yes"}' as true and '"8"' as 8 (YAML on every value)."""
    parser = capture_parser(lambda: cli.main([command, "--help"]))
    ns = getattr(parser.parse_args([command, "--backend_kwargs", '{"cuda_graphs": "yes", "n": "8", "k": 8, "on": true}',
                                    "--template_vars", '{"enable_thinking": "no"}']), command)
    assert ns.backend_kwargs == {"cuda_graphs": "yes", "n": "8", "k": 8, "on": True}
    assert ns.template_vars == {"enable_thinking": "no"}


def test_backend_options_of_another_type_are_refused(tmp_path):
    from eagle_data.checks import check_option_types
    from eagle_data.engines import make_backend

    with pytest.raises(ValueError, match="max_inflight must be int.*'8'"):
        make_backend("sglang", model_path=str(tmp_path), max_inflight="8")
    for knob, value in (("max_inflight_bytes", 0), ("max_inflight", -5), ("collect_timeout_s", 0.0)):
        with pytest.raises(ValueError, match=f"{knob} must be"):  # before any model or engine
            make_backend("sglang", model_path=str(tmp_path), **{knob: value})
    with pytest.raises(ValueError, match=r"\['max_inflight_tokens'\]; max_inflight_tokens is now max_inflight_bytes"):
        make_backend("sglang", model_path=str(tmp_path), max_inflight_tokens=1000)
    with pytest.raises(ValueError, match="cuda_graphs must be bool.*'yes'.*unquoted"):
        make_backend("hf", model_path=str(tmp_path), cuda_graphs="yes")
    hints = {"a": "bool", "b": "Optional[int]", "c": "float | None", "d": "list[int]"}
    check_option_types("x", {"a": False, "b": None, "c": 2, "d": "anything"}, hints)
    for bad in ({"a": 1}, {"b": True}, {"b": 2.0}, {"c": "0.5"}, {"a": None}):
        with pytest.raises(ValueError, match=f"x: option {next(iter(bad))} must be"):
            check_option_types("x", bad, hints)


def test_sglang_engine_options_of_another_type_are_refused():
    from eagle_data.engines.sglang_engine import start_engine

    with pytest.raises(ValueError, match="sglang.Engine: option disable_cuda_graph must be bool.*'no'"):
        start_engine({"model_path": "unused", "disable_cuda_graph": "no"})


def test_the_test_command_shows_per_file_progress_and_the_slowest_tests():
    """It printed only dots (-q) for ~14 minutes."""
    import shlex

    root = Path(__file__).resolve().parents[1]
    line = next(x for x in (root / "scripts/test.sh").read_text().splitlines() if "pytest" in x and "exec" in x)
    args = shlex.split(line)
    assert "-q" not in args and "--quiet" not in args and any(a.startswith("--durations=") for a in args)
    assert "bash scripts/test.sh" in (root / ".ci/run").read_text()


@pytest.mark.parametrize("args,message", [
    (["extract", "--dat", "x.jsonl"], "eagle-data extract: unknown option --dat; did you mean --data?"),
    (["train", "--trainr.max_steps", "3"], "eagle-data train: unknown option --trainr; did you mean --trainer?"),
    (["train", "--data.batch_sise", "4"], "eagle-data train: unknown option --data.batch_sise; did you mean "
                                          "--data.batch_size?"),
    (["train", "--model.drafter.num_layerz", "2"], "unknown option --model.drafter.num_layerz; did you mean "
     "--model.drafter.compile_layer? (--model.drafter takes aux_layer_ids, check_target, compile_layer"),
    (["train", "--model.ttt_stepz", "3"], "unknown option --model.ttt_stepz; did you mean --model.loss.ttt_steps?"),
    (["train", "--model.loss.step_weigth=0.5"], "did you mean --model.loss.step_weight?"),
    (["train", "--trainer.max_stepz", "3"], "unknown option --trainer.max_stepz; did you mean --trainer.max_steps?"),
    (["extract", "--data", "missing.jsonl"], "data: missing.jsonl does not exist"),
    (["extract", "--batch_tokens", "0"], "batch_tokens must be >= 1, got 0"),
    (["regenerate", "--data", "missing.jsonl", "--out", "o"], "data: missing.jsonl does not exist"),
    (["extract", "--backend_kwargs", '{"cuda_graphs": "yes"}', "--out", "o", "--data", "missing.jsonl"],
     "does not exist"),
    (["extract", "--aux_layer_ids", "[1, 2]"], "aux_layer_ids needs exactly 3 ids (low, mid, high), got [1, 2]"),
    (["extract", "--dtype", "bf16"], "eagle-data extract: --dtype bf16: not one of bfloat16, float32, float16 "
                                     "(eagle-data extract --help lists the options)"),
    (["extract", "--storage_dtype", "fp8"], "--storage_dtype fp8: not one of bfloat16, float32, float16, "
                                            "float8_e4m3fn (or null)"),
    (["export", "c.ckpt", "o", "--dtype", "fp16"], "--dtype fp16: not one of bfloat16, float16, float32"),
    (["regenerate", "--max_new_tokens", "q"], "eagle-data regenerate: --max_new_tokens q: expected int"),
    (["extract", "--aux_layer_ids", "1,2,3"], "--aux_layer_ids 1,2,3: expected list[int] or null"),
    (["extract", "--trust_remote_code", "yes"], "--trust_remote_code yes: write true or false"),  # YAML read it true
    (["export", "c", "o", "--overwrite=on"], "--overwrite on: write true or false"),
])
def test_mistakes_are_answered_in_one_line_before_torch_loads(tmp_path, args, message):
    """Every bad-argument error took 7-23 s (torch and transformers imported first); a typo
    printed 30 lines of usage and no suggestion. A typo inside a section of ``train``
    (``--data.batch_sise``) was still answered after torch and lightning loaded, without one."""
    import subprocess
    import sys

    code = ("import sys\nfrom eagle_data.cli.main import main\ntry:\n    main(sys.argv[1:])\n"
            "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "exit 2 False False", (r.stdout, r.stderr)
    assert message in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr


def test_a_config_files_mistyped_key_names_the_closest_option():
    """A config's typo reaches LightningCLI, which said only "Group 'data' does not accept option
    'batch_sise'"."""
    from eagle_train.cli import fit

    base = {"model": {"target_model_path": "unused"}, "data": {"train": "unused"}, "trainer": {}}
    with pytest.raises(ValueError, match=r"^train: unknown option --data\.batch_sise; did you mean "
                                         r"--data\.batch_size\? "):
        fit({**base, "data": {"train": "unused", "batch_sise": 2}})
    with pytest.raises(ValueError, match=r"--model\.loss\.ttt_stepz; did you mean --model\.loss\.ttt_steps\? "):
        fit({**base, "model": {"target_model_path": "unused", "loss": {"ttt_stepz": 2}}})


def test_print_config_shows_a_group_field_given_on_the_command_line_inside_its_group_once(capsys):
    """``--model.loss.ttt_steps 3 --print_config`` printed ``ttt_steps: 3`` flat in the model section,
    beside the config's ``loss`` group, which still said 7."""
    import yaml

    cfg = str(Path(__file__).resolve().parents[1] / "configs/train/smollm2_cpu.yaml")
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--config", cfg, "--model.loss.ttt_steps", "3", "--model.step_weight=0.5",
                  "--model.optim.warmup_steps", "4", "--print_config"])
    model = yaml.safe_load(capsys.readouterr().out)["model"]
    assert e.value.code == 0 and model["lr"] == 0.0003
    assert model["loss"] == {"ttt_steps": 3, "step_weight": 0.5, "exclude_oov": False}
    assert model["optim"] == {"warmup_steps": 4, "min_lr_ratio": 0.1}
    assert not {"ttt_steps", "step_weight", "warmup_steps"} & set(model)


def test_the_options_checked_before_torch_loads_are_lightning_clis(monkeypatch):
    """``eagle-data train`` refuses a section's unknown option before torch loads, from names read
    out of the sources (eagle_train.option_names): they are exactly those LightningCLI takes, so a
    valid option is never refused there and a typo never let through."""
    import sys

    from eagle_train.cli import make_cli
    from eagle_train.option_names import section_options

    monkeypatch.setattr(sys, "argv", sys.argv[:1])  # pytest's own arguments are not LightningCLI's
    cli = make_cli(args={"model": {"target_model_path": "unused"}, "data": {"train": "unused"}}, run=False,
                   parse_only=True)
    config = cli.config.as_dict()
    for section in ("model", "data", "trainer"):
        early = {name for name, option in section_options(section).items() if name == option}
        assert early == set(config[section]) - {"__path__"}, section


@pytest.mark.parametrize("args, says", [
    (["--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor"], "would replace the config's list"),
    (["--trainer.logger.init_args.save_dir", "x"], "would replace the config's whole 'logger'"),
    (["--data", "configs/datamodule.yaml", "--data.batch_size", "2"], "--data given whole and --data.<option> both"),
    (["--model.loss.ttt_steps.x", "3"], "unknown option --model.loss.ttt_steps.x; did you mean --model.loss.ttt_steps?"),
])
def test_train_refuses_options_that_would_drop_config_settings(args, says, capsys):
    """Each section of ``eagle-data train`` is a plain dict: these forms would replace a config's list,
    group or file without a word (a ModelCheckpoint callback, a logger, the data file's fields), so
    they are refused at once, pointing to ``python -m eagle_train.cli fit``, which merges them."""
    from eagle_data.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--config", "configs/train/smollm2_cpu.yaml", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and ("eagle_train.cli fit" in err), err
