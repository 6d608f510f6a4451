"""Benchmarks run end to end on tiny inputs and report what they promise (figures themselves are
for BENCHMARKS.md, not asserted): the loader over the same samples, extract, codec and train_step via the CLI."""

import json
import re
from pathlib import Path

import pytest

from benchmarks.loader import bench_loader
from benchmarks.__main__ import main


def test_bench_loader_reports_all_readers_over_the_same_samples(tmp_path, capsys):
    out = tmp_path / "b.json"
    res = bench_loader("synthetic", batch_size=4, workers=[0, 1], rounds=2, startup=False, cold=False,
                       synth_samples=24, synth_hidden=16, synth_tokens=(4, 12), json_out=str(out))
    rows = res["rows"]
    assert set(rows) == {"raw sequential tar read (plain)", "raw sequential tar read (hinted)",
                         "EagleShardDataset workers=0", "EagleShardDataset workers=1",
                         "per-sample torch.save files workers=0", "per-sample torch.save files workers=1"}
    saved = json.loads(out.read_text())
    for name, passes in saved["passes"].items():
        assert [p["samples"] for p in passes] == [24, 24], name  # every reader delivers every sample
        assert len({p["bytes"] for p in passes}) == 1 and passes[0]["bytes"] > 0
    assert len({p["bytes"] for ps in saved["passes"].values() for p in ps}) == 1  # same data in both layouts
    for w in (0, 1):
        r = rows[f"EagleShardDataset workers={w}"]
        assert r["GB_s"] > 0 and r["vs_raw"][1] <= r["vs_raw"][0] <= r["vs_raw"][2] and r["vs_per_sample"][0] > 0
    assert "vs per-sample files" in capsys.readouterr().out


def test_bench_loader_cli_refuses_a_directory_without_manifest(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["loader", str(tmp_path)])
    assert e.value.code == 2 and "no manifest.json" in capsys.readouterr().err


def test_benchmark_commands_are_one_static_table(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and all(c in out for c in ("loader", "extract", "train", "sglang"))


def test_bench_extract_runs_from_its_command_line(tmp_path):
    """The extract benchmark's options come from its signature; the figures land in --json_out."""
    out = tmp_path / "x.json"
    (tmp_path / "d" / "shards").mkdir(parents=True)  # the user's folder, with a file where ours would go
    (tmp_path / "d" / "shards" / "mine.tar").write_text("keep")
    main(["extract", "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--seq_len", "16",
          "--batch_size", "2", "--num_batches", "2", "--repeats", "1", "--out", str(tmp_path / "d"),
          "--json_out", str(out)])
    res = json.loads(out.read_text())
    assert res["repeats"]["a_plain"][0] > 0 and res["c_capture_write_tok_s"] > 0 and res["seq_len"] == 16
    assert res["e_peers_tok_s"] > 0 and res["repeats"]["e_peers"][0] > 0  # (e), the peers' method, same run
    assert res["ratio_e_over_a"] > 0 and res["ratio_c_over_e"] > 0 and res["ratio_c0_over_a"] > 0  # (c0): no write-behind
    assert [p.name for p in (tmp_path / "d").rglob("*")] == ["shards", "mine.tar"]  # its files gone, the user's kept


def test_bench_codec_runs_on_random_states_from_its_command_line(tmp_path, capsys):
    """Every codec round-trips the bytes (checked inside) and reports a size ratio and rates."""
    out = tmp_path / "c.json"
    main(["codec", "--num_tokens", "8", "--hidden_size", "16", "--repeats", "1", "--json_out", str(out)])
    res = json.loads(out.read_text())
    assert set(res["methods"]) == {"zstd-1", "zstd-3", "planes+zstd-1", "planes+zstd-3"}
    for name, row in res["methods"].items():
        assert row["ratio"] > 0 and row["ratio_aux"] > 0 and row["ratio_final"] > 0, name
        assert row["compress_GB_s"] > 0 and row["decompress_GB_s"] > 0, name
    assert res["methods"]["planes+zstd-1"]["split_GB_s"] > 0 and "planes+zstd-3" in capsys.readouterr().out


def test_bench_codec_reads_a_dataset_and_refuses_other_dtypes(tmp_path, capsys):
    """On a dataset directory: the bf16 states of the first ``max_samples`` samples of its index;
    a float32 dataset is refused, naming its dtype."""
    import torch

    from benchmarks.codec import bench_codec
    from eagle_data.tools.synthetic import write_synthetic

    g = torch.Generator().manual_seed(0)
    write_synthetic(tmp_path / "bf16", [3, 2], hidden_size=16, values=lambda i: torch.randn(4 + i, 16, generator=g))
    res = bench_codec(str(tmp_path / "bf16"), max_samples=4, repeats=1)
    assert res["tensors"] == 8 and res["raw_MB"] == round(sum(4 * 16 * 2 * (4 + i) for i in range(4)) / 1e6, 2)
    assert all(0 < row["ratio"] for row in res["methods"].values())
    write_synthetic(tmp_path / "f32", [2], hidden_size=16, dtype="float32")
    with pytest.raises(SystemExit) as e:
        main(["codec", "--path", str(tmp_path / "f32"), "--repeats", "1"])
    assert e.value.code == 2 and "float32" in capsys.readouterr().err


def test_bench_train_step_counts_flops_and_runs(tmp_path):
    """train_step on a tiny drafter: one row per length; the FLOP count grows superlinearly in T
    (attention) and at least linearly (every matmul per token)."""
    from benchmarks.extract import TINY
    from benchmarks.train_step import step_flops

    out = tmp_path / "t.json"
    main(["train_step", "--shape", "tiny", "--seq_lens", "[16, 32]", "--device", "cpu", "--draft_vocab_size", "100",
          "--iters", "1", "--warmup", "0", "--json_out", str(out)])
    rows = json.loads(out.read_text())["by_seq_len"]
    assert set(rows) == {"16", "32"} and all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in rows.values())
    f1, f2 = step_flops(TINY, 1024, 7, 100), step_flops(TINY, 2048, 7, 100)
    assert 2 < f2 / f1 < 4
    main(["train_step", "--shape", "tiny", "--seq_lens", "[16]", "--device", "cpu", "--draft_vocab_size", "100",
          "--iters", "2", "--warmup", "0", "--batch_size", "2", "--vary_lengths", "true", "--json_out", str(out)])
    row = json.loads(out.read_text())["by_seq_len"]["16"]
    assert 2 * 8 <= row["tokens_per_step"] <= 2 * 16  # two sequences of 8..16 tokens


def test_bench_train_step_default_vocab_fits_the_shape(tmp_path):
    main(["train_step", "--shape", "tiny", "--seq_lens", "[16]", "--device", "cpu", "--iters", "1", "--warmup", "0",
          "--json_out", str(tmp_path / "t.json")])
    assert json.loads((tmp_path / "t.json").read_text())["draft_vocab_size"] == 600  # the tiny shape's V


@pytest.mark.parametrize("args,msg", [(["--device", "tpu"], "device must be a torch device"),
                                      (["--device", "cpu", "--peak_tflops", "-1"], "peak_tflops must be > 0")])
def test_bench_train_step_refuses_bad_arguments(args, msg, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train_step", "--shape", "tiny", "--seq_lens", "[16]", "--draft_vocab_size", "100", *args])
    assert e.value.code == 2 and re.search(msg, capsys.readouterr().err)


def test_bench_tar_walk_times_both_walks_over_the_same_members(tmp_path, capsys):
    from benchmarks.tar_walk import bench_tar_walk

    res = bench_tar_walk(samples=20, typical_hidden=16, typical_tokens=(4, 12), repeats=1,
                         json_out=str(tmp_path / "w.json"))
    assert set(res) == {"small", "typical"} and json.loads((tmp_path / "w.json").read_text()) == res
    for r in res.values():
        assert r["members"] == 40 and r["tarfile_us_per_member"] > 0 and r["handwritten_us_per_member"] > 0
        assert 0 < r["tarfile_share"] and 0 < r["handwritten_share"] and r["loader_us_per_sample"] > 0
    assert "tarfile walk / loader" in capsys.readouterr().out


def test_bench_pipeline_runs_extraction_end_to_end(tmp_path, tiny):
    """The pipeline benchmark extracts every row of a small JSONL with a random target built around
    a tokenizer folder, and reports tokens/s per run."""
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"id": str(i), "conversations": [
        {"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer number {i}"}]})
        for i in range(3)) + "\n")
    out = tmp_path / "p.json"
    main(["pipeline", "--data", str(data), "--tokenizer_dir", str(tiny[0]), "--num_samples", "null",
          "--device", "cpu", "--dtype", "float32", "--max_length", "1024", "--repeats", "1", "--json_out", str(out)])
    (run,) = json.loads(out.read_text())["runs"]
    assert run["samples"] == 3 and run["tok_s"] > 0


def test_loader_benchmark_leaves_the_page_cache_alone_by_default():
    """Dropping the page cache drops the whole machine's as root: opt-in only."""
    import inspect

    from benchmarks.loader import bench_loader

    assert inspect.signature(bench_loader).parameters["cold"].default is False


def test_bench_stages_measures_every_stage_on_the_same_rows(tmp_path, tiny):
    """Each stage alone, the whole pipeline and the disk, on the same rows: the end-to-end run
    extracts exactly the tokens the front produced, and the figures are all there."""
    import eagle_data.extract.writeback as wb

    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"id": str(i), "conversations": [
        {"from": "human", "value": f"question {i} " * (i + 1)}, {"from": "gpt", "value": f"answer number {i}"}]})
        for i in range(6)) + "\n")
    out = tmp_path / "s.json"
    (tmp_path / "disk" / "c").mkdir(parents=True)  # the user's folder: a file of theirs, a leftover named like ours
    (tmp_path / "disk" / "mine.txt").write_text("keep")
    main(["stages", "--model", str(tiny[0]), "--data", str(data), "--num_samples", "null", "--device", "cpu",
          "--dtype", "float32", "--max_length", "1024", "--batch_tokens", "256", "--out", str(tmp_path / "disk"),
          "--write_behind_chunks", "7", "--json_out", str(out)])
    r = json.loads(out.read_text())
    assert r["samples"] == 6 and r["c_tokens"] == r["tokens"] > 0
    assert r["write_behind_chunks"] == 7 and wb.IN_FLIGHT == 4  # applied to (w) and (c), restored after
    assert set(r["c_waits_s"]) == {"front", "capture", "writers", "close"}
    assert sum(r["c_waits_s"].values()) <= r["c_seconds"] + 0.01
    main(["stages", "--model", str(tiny[0]), "--data", str(data), "--num_samples", "null", "--device", "cpu",
          "--dtype", "float32", "--max_length", "1024", "--batch_tokens", "256", "--pipeline_only", "true",
          "--json_out", str(out)])
    q = json.loads(out.read_text())
    assert q["c_tokens"] == r["tokens"] and "a_plain_tok_s" not in q and q["d_disk_GB_s_2"] > 0
    assert all(r[k] > 0 for k in ("f_front_tok_s", "a_plain_tok_s", "b_capture_tok_s", "w_writers_tok_s",
                                  "c_pipeline_tok_s", "c_GB_s", "d_disk_GB_s_1", "d_disk_GB_s_2"))
    assert r["bytes_per_token"] == 4 * 64 * 4 + 8 + 1  # 3 + 1 states of H=64 in float32, int64 id, uint8 mask
    assert r["bound"] in ("f_front_tok_s", "a_plain_tok_s", "b_capture_tok_s", "w_writers_tok_s")
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["c", "mine.txt"]  # only the user's things
    assert not any((tmp_path / "disk" / "c").iterdir())


@pytest.mark.parametrize("args, says", [
    (["--json_out", "{tmp}"], "is a folder"),
    (["--out", "{tmp}/afile"], "is not a folder"),
    (["--switch_interval", "0"], "switch_interval must be in (0, 1]"),
    (["--keep_gib", "0"], "keep_gib must be > 0"),
    (["--write_behind_chunks", "0"], "write_behind_chunks must be >= 1"),
    (["--cuda_graphs", "true"], "CUDA graphs need a CUDA device, got device cpu"),
    (["--data", "{tmp}/bad.jsonl", "--pipeline_only", "true"], "nothing to measure"),
    (["--data", "{tmp}/bad.jsonl"], "nothing to measure"),
])
def test_bench_stages_refuses_bad_settings_in_one_line_and_leaves_nothing(tmp_path, tiny, capsys, args, says):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "ok.jsonl").write_text(json.dumps({"conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}) + "\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"conversations": [{"from": "human", "value": "only q"}]}) + "\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    base = ["stages", "--model", str(tiny[0]), "--data", str(tmp_path / "ok.jsonl"), "--num_samples", "null",
            "--device", "cpu", "--dtype", "float32", "--max_length", "256", "--batch_tokens", "256"]
    if "--out" not in args:
        base += ["--out", str(tmp_path / "disk")]
    with pytest.raises(SystemExit) as e:
        main(base + args)
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no --out folder left, nothing written


def test_disk_rate_deletes_its_files_and_raises_a_writers_error(tmp_path, monkeypatch):
    import os

    from benchmarks.extract import disk_write_rate

    assert disk_write_rate(tmp_path, 3 << 20, 1 << 20, 2) > 0 and list(tmp_path.iterdir()) == []
    real, calls = os.fsync, []

    def full(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        disk_write_rate(tmp_path, 4 << 20, 1 << 20, 1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, says", [(["--repeats", "0"], "repeats must be"), (["--num_batches", "0"], "num_batches"),
                                        (["--writers", "0"], "writers must be"),
                                        (["--json_out", "/nonexistent/x.json"], "its folder does not exist")])
def test_bench_extract_refuses_bad_settings_before_any_work(tmp_path, capsys, args, says):
    with pytest.raises(SystemExit) as e:
        main(["extract", "--shape", "tiny", "--device", "cpu", "--out", str(tmp_path / "o")] + args)
    assert e.value.code == 2 and says in capsys.readouterr().err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, says", [(["--shape", "foo"], "shape must be one of"),
                                        (["--device", "bogus"], "device must be a torch device"),
                                        (["--peak_tflops", "0"], "peak_tflops must be a finite number > 0"),
                                        (["--write_queue_gib", "-1"], "write_queue_gib must be a finite number > 0"),
                                        (["--storage_dtype", "foo"], "storage_dtype"),
                                        (["--out", "{tmp}/afile/sub"], "is not a folder")])
def test_bench_extract_refuses_more_bad_settings_and_leaves_no_folders(tmp_path, capsys, args, says):
    (tmp_path / "afile").write_text("x")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "deep" / "a" / "b")]
    with pytest.raises(SystemExit) as e:
        main(["extract", "--device", "cpu", "--shape", "tiny", "--dtype", "float32"] + out + args)
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_scratch_removes_the_folders_it_made_and_keeps_the_users(tmp_path):
    from benchmarks.scratch import scratch

    with scratch(str(tmp_path / "x" / "y"), "t-") as root:
        (root / "f").write_text("data")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()
    with pytest.raises(RuntimeError):
        with scratch(str(tmp_path / "mine"), "t-") as root:
            raise RuntimeError("interrupted")
    assert [p.name for p in tmp_path.rglob("*")] == ["mine"]


def test_a_benchmark_stopped_by_sigterm_removes_its_scratch_folder(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "disk"
    out.mkdir()
    p = subprocess.Popen([sys.executable, "-m", "benchmarks", "extract", "--shape", "tiny", "--device", "cpu",
                          "--dtype", "float32", "--num_batches", "400", "--repeats", "3", "--peers", "false",
                          "--out", str(out)], cwd=Path(__file__).resolve().parents[1],
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not list(out.glob("eagle-bench-*")) and p.poll() is None and time.time() - t0 < 120:
        time.sleep(0.05)
    assert list(out.glob("eagle-bench-*")), p.communicate()
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    # 130 from the handler's sys.exit, or (2-3 runs in 8, also before session 11) CPython ending the
    # process by SIGINT after that same handler ran: either way a shell reports 130
    assert p.returncode in (130, -signal.SIGINT), (p.returncode, err[-3000:])
    assert err.strip().splitlines()[-1] == ("interrupted (a benchmark starts over, but for the τ benchmark's regen and "
                                            "extract phases: they resume)")
    assert list(out.iterdir()) == []


def test_bench_writers_measures_each_variant_against_the_disk_and_leaves_nothing(tmp_path, capsys):
    """Every variant writes the bytes asked for and is set beside a raw-disk rate of the same round;
    the scratch folder is removed, the sink is restored afterwards (hashing again)."""
    import hashlib

    import eagle_data.extract.sink as sink
    from benchmarks.writers import VARIANTS, bench_writers

    res = bench_writers(gib=0.004, writers=2, tokens=64, hidden_size=32, repeats=2, out=str(tmp_path / "d"),
                        json_out=str(tmp_path / "w.json"))
    assert json.loads((tmp_path / "w.json").read_text()) == res and res["sha256_GB_s_one_core"] > 0
    for v in VARIANTS:
        assert len(res["rounds"][v]) == 2 and res[f"{v}_GB_s"] > 0 and res[f"{v}_over_disk"] > 0
    assert not (tmp_path / "d").exists() and capsys.readouterr().out.count("raw disk right after") == 6
    assert sink.hashlib.sha256 is hashlib.sha256 and sink._HashingFile.write.__name__ == "write"
    for gib, says in (("0", "gib must be > 0 and finite"), ("1e-9", "less than one sample")):
        with pytest.raises(SystemExit) as e:
            main(["writers", "--gib", gib])
        assert e.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(ValueError, match="gib must be > 0 and finite"):
        bench_writers(gib=float("inf"))


def test_random_target_without_weights_is_a_config_an_engine_can_draw_weights_for(tmp_path):
    """``--weights false``: config (shape, the tokenizer's vocabulary, bf16, ``architectures`` named:
    SGLang's dummy loader picks its model class by it) and the tokenizer's files, no weights."""
    import sys

    from benchmarks.extract import SHAPES
    from benchmarks.random_target import make_random_target
    from transformers import AutoConfig, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).parent))
    from templates import TEMPLATES_DIR, family_tokenizer

    tok_dir = tmp_path / "tok"
    family_tokenizer(TEMPLATES_DIR / "smollm2.jinja").save_pretrained(tok_dir)
    out = make_random_target(str(tmp_path / "m"), str(tok_dir), shape="llama3.1-8b", weights=False)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.vocab_size == len(AutoTokenizer.from_pretrained(out))
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == tuple(
        SHAPES["llama3.1-8b"][k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size"))
    assert str(cfg.dtype).endswith("bfloat16")
    assert not list(Path(out).glob("*.safetensors")) and (Path(out) / "tokenizer.json").is_file()
    (tok_dir / "model.safetensors").write_bytes(b"x")  # a model folder as the tokenizer: its weights stay there
    out2 = make_random_target(str(tmp_path / "m2"), str(tok_dir), shape="tiny", weights=False)
    assert not list(Path(out2).glob("*.safetensors"))
    with pytest.raises(ValueError, match=r"out: .*/m exists and is not an empty folder"):
        make_random_target(out, str(tok_dir), shape="tiny", weights=False)  # its old files would stay
    with pytest.raises(ValueError, match=r"tokenizer: .* is not a folder with a tokenizer"):
        make_random_target(str(tmp_path / "m3"), str(tmp_path), shape="tiny", weights=False)


def test_bench_spool_times_both_routes_and_leaves_nothing(tmp_path, capsys):
    """``python -m benchmarks spool``: each shape's chunk through a file and through the ring, both
    read back through the spool (a wrong read would raise), and no spool left behind."""
    from benchmarks.__main__ import main

    main(["spool", "--shapes", "[smollm2]", "--chunks", "3", "--spool_dir", str(tmp_path),
          "--json_out", str(tmp_path / "r.json")])
    out = json.loads((tmp_path / "r.json").read_text())["smollm2"]
    assert out["chunk_mb"] == pytest.approx(512 * (8 + 4 * 576 + 4 * 3 + 4 + 1) / 1e6)
    assert all(out[r][k] > 0 for r in ("file", "ring") for k in ("write_ms", "read_ms"))
    assert "ring / file: write" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
