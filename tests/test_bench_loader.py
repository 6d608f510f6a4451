"""`eagle-data bench loader` and `python -m benchmarks tar_walk`: run end to end on tiny synthetic
datasets and report every reader over the same samples (figures themselves are for BENCHMARKS.md,
not asserted)."""

import json

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


def test_bench_tar_walk_times_both_walks_over_the_same_members(tmp_path, capsys):
    from benchmarks.tar_walk import bench_tar_walk

    res = bench_tar_walk(samples=20, typical_hidden=16, typical_tokens=(4, 12), repeats=1,
                         json_out=str(tmp_path / "w.json"))
    assert set(res) == {"small", "typical"} and json.loads((tmp_path / "w.json").read_text()) == res
    for r in res.values():
        assert r["members"] == 40 and r["tarfile_us_per_member"] > 0 and r["handwritten_us_per_member"] > 0
        assert 0 < r["tarfile_share"] and 0 < r["handwritten_share"] and r["loader_us_per_sample"] > 0
    assert "tarfile walk / loader" in capsys.readouterr().out
