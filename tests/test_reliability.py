"""Crash safety, resume, multi-rank extraction (issue 6).

Bit-identity note: the HF backend pads batches, and a padded sample's fp32 states differ from
the same sample run alone by ~1e-6; after a resume the batches hold other samples. So these
tests capture each sample alone (``max_batch_size=1``, see ``kill_resume.config``).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from eagle_data.cli import main as cli
from eagle_data.extract.config import ExtractConfig
from eagle_data.extract.run import run_extract
from eagle_data.extract.manifest import merge
from eagle_data.extract.resume import load_progress
from eagle_data.tools.verify import verify_dataset
from eagle_data.extract.sink import _HashingFile

from conftest import REPO


def _listed_shards_intact(out):
    """Every tar on disk is listed with its recorded size/sha256; no temporaries."""
    import hashlib

    prog = load_progress(out, 0)
    rec = {s["name"]: s for s in prog["shards"]}
    for p in out.glob("*.tar"):
        assert p.name in rec, f"unlisted shard {p.name}"
        assert hashlib.sha256(p.read_bytes()).hexdigest() == rec[p.name]["sha256"]
    assert not list(out.rglob("*.tmp"))


def test_kill_resume_script(tmp_path):
    """>= 10 SIGKILLs (+ a SIGTERM and a SIGINT) across >= 50 samples / >= 5 shards, resumed each
    time: same keys, bit-identical tensors, no duplicates, no leftovers, verify passes."""
    r = subprocess.run([sys.executable, str(REPO / "tests" / "kill_resume.py"), "--kills", "10", "--samples",
                        "50", "--work", str(tmp_path)], capture_output=True, text=True, timeout=400)
    assert r.stdout, r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert s["ok"] and r.returncode == 0, json.dumps(s) + "\n" + r.stderr[-3000:]  # a string: shown whole
    assert s["kills"] >= 10 and s["interruptions"] == 2 and s["samples"] >= 50 and s["shards"] >= 5


def test_resume_repairs_crash_leftovers(tmp_path, kr, tiny, reference):
    """A crash after the rename but before the progress write leaves tars/index parts that are
    not listed; temporaries; a listed shard deleted by hand: resume cleans all of it up."""
    import shutil

    out = tmp_path / "ds"
    shutil.copytree(reference, out)
    (out / "manifest.json").unlink()
    prog = load_progress(out, 0)
    # shards 5..7 stay on disk, unlisted (+ their index parts); by name: 2 writers publish in any order
    prog["shards"] = [s for s in prog["shards"] if s["name"] < "00000-000005.tar"]
    assert len(prog["shards"]) == 5
    prog["finished"] = False
    prog["skipped"] = {}
    (out / "progress-00000.json").write_text(json.dumps(prog))
    (out / "00000-000003.tar").unlink()  # listed but gone -> forgotten, redone
    (out / "00000-000099.tar").write_bytes(b"stray")
    (out / "index" / "00000-000099.parquet").write_bytes(b"stray")
    for junk in ("00000-000005.tar.tmp", "progress-00000.json.777.tmp", "index/00000-000005.parquet.777.tmp"):
        (out / junk).write_bytes(b"partial")
    m = run_extract(kr.config(out, *tiny, shard_max_samples=3))
    assert m["num_samples"] == 24 and m["run_stats"]["new_samples"] == 12
    assert kr.compare(reference, out) == [] and kr.leftovers(out) == []
    assert verify_dataset(out).ok


@pytest.mark.parametrize("fraction", [0.3, 0.75])
def test_enospc_stops_cleanly_then_resumes(tmp_path, monkeypatch, kr, tiny, reference, fraction):
    """The disk fills up after ``fraction`` of the dataset's bytes: a clear OSError(ENOSPC), no
    partial shard published, and after space is freed the same command ends with the reference
    keys/tensors."""
    out = tmp_path / "ds"
    budget = int(fraction * json.loads((reference / "manifest.json").read_text())["total_bytes"])
    written = {"n": 0}
    real_write = _HashingFile.write

    def full_disk(self, bufs):
        if self.discarded:
            return real_write(self, bufs)
        written["n"] += sum(memoryview(b).nbytes for b in bufs)
        if written["n"] > budget:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, bufs)

    monkeypatch.setattr(_HashingFile, "write", full_disk)
    with pytest.raises(OSError, match="no space left.*rerun the same command to resume") as ei:
        run_extract(kr.config(out, *tiny, shard_max_samples=3))
    assert ei.value.errno == errno.ENOSPC
    _listed_shards_intact(out)
    assert 0 < len(load_progress(out, 0)["shards"]) < 8
    monkeypatch.setattr(_HashingFile, "write", real_write)  # space freed
    m = run_extract(kr.config(out, *tiny, shard_max_samples=3))
    assert m["num_samples"] == 24 and kr.compare(reference, out) == [] and kr.leftovers(out) == []


def test_enospc_in_progress_write_unpublishes_shard(tmp_path, monkeypatch, kr, tiny, reference):
    """ENOSPC while recording shard 3 in the progress file: shard 3 is removed again (never
    listed, never left on disk), the error is clear, resume completes identically."""
    import eagle_data.extract.rank_state as ex

    out = tmp_path / "ds"
    real = ex.atomic_write_json
    calls = {"n": 0}

    def flaky(path, obj):
        calls["n"] += 1
        if len(obj.get("shards", [])) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj)

    monkeypatch.setattr(ex, "atomic_write_json", flaky)
    with pytest.raises(OSError, match="no space left"):
        run_extract(kr.config(out, *tiny, shard_max_samples=3))
    listed = sorted(s["name"] for s in load_progress(out, 0)["shards"])  # 2 writer threads: any 2 shards
    assert len(listed) == 2 and sorted(p.name for p in out.glob("*.tar")) == listed
    _listed_shards_intact(out)
    assert sorted(p.name for p in (out / "index").iterdir()) == [n.replace(".tar", ".parquet") for n in listed]
    monkeypatch.setattr(ex, "atomic_write_json", real)
    run_extract(kr.config(out, *tiny, shard_max_samples=3))
    assert kr.compare(reference, out) == [] and kr.leftovers(out) == []


def test_two_ranks_disjoint_union_merge_verify(tmp_path, kr, tiny, reference):
    out = tmp_path / "ds"
    cfg0 = kr.config(out, *tiny, shard_max_samples=3)
    cfg0.rank, cfg0.world_size = 0, 2
    r0 = run_extract(cfg0)
    assert "progress" in r0 and not (out / "manifest.json").exists()  # rank 1 not done yet
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] have not finished|ranks 0..1"):
        merge(out)
    cfg1 = kr.config(out, *tiny, shard_max_samples=3)
    cfg1.rank, cfg1.world_size = 1, 2
    m = run_extract(cfg1)  # the last rank to finish merges
    keys = [{k for s in load_progress(out, r)["shards"] for k in s["keys"]} for r in (0, 1)]
    assert keys[0] and keys[1] and not keys[0] & keys[1]
    assert all(int(k.rsplit("_", 1)[1]) % 2 == r for r in (0, 1) for k in keys[r])
    assert {s["name"][:5] for s in m["shards"]} == {"00000", "00001"}
    cli.main(["merge", str(out)])  # `eagle-data merge` is idempotent
    m2 = merge(out)
    assert m2["num_samples"] == 24 and m2["skip_counts"] == json.loads((reference / "manifest.json").read_text())["skip_counts"]
    assert kr.compare(reference, out) == []  # union == single-process set, bit-identical
    assert verify_dataset(out).ok


def test_config_mismatch_refused_with_clear_message(tmp_path, kr, tiny):
    out = tmp_path / "ds"
    base = kr.config(out, *tiny, shard_max_samples=3)
    base.num_samples = 4
    run_extract(base)
    for change, field in ((dict(aux_layer_ids=[1, 2, 5]), "aux_layer_ids"), (dict(max_length=64), "max_length"),
                          (dict(template_date="2025-06-01"), "template"), (dict(dtype="bfloat16"), "dtype"),
                          (dict(world_size=2), "world_size")):
        cfg = kr.config(out, *tiny, shard_max_samples=3)
        cfg.num_samples = 4
        for k, v in change.items():
            setattr(cfg, k, v)
        with pytest.raises(ValueError, match=rf"different run configuration; refusing to mix:\n.*{field}"):
            run_extract(cfg)
    with pytest.raises(ValueError, match="rank 2 must be in"):
        run_extract(ExtractConfig(out=str(out), rank=2, world_size=2))


def test_same_rank_twice_at_once_refused(tmp_path, kr, tiny):
    out = tmp_path / "ds"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(out / '.eagle-data.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0); print('locked', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match="rank 0 is being extracted by another process"):
            run_extract(kr.config(out, *tiny, shard_max_samples=3))
    finally:
        holder.kill()
        holder.wait()


def test_sigterm_real_cli_process_discards_shard_cleanly(tmp_path, kr, tiny):
    """`eagle-data extract` in a real process, SIGTERM after its first shard: it exits by
    SIGTERM, logs that the shard in progress was discarded, and leaves a clean directory."""
    out = tmp_path / "ds"
    model, data = kr.make_fixture(tmp_path, samples=40, seed=1)
    cmd = [sys.executable, "-m", "eagle_data.cli.main", "extract", "--out", str(out), "--model", str(model),
           "--data", str(data), "--num_samples", "null", "--dtype", "float32", "--aux_layer_ids", "[1, 3, 5]",
           "--shard_max_samples", "2", "--max_batch_size", "1", "--progress", "false"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    t_end = time.monotonic() + 120
    while not list(out.glob("*.tar")) and p.poll() is None and time.monotonic() < t_end:
        time.sleep(0.01)
    time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGTERM, err[-3000:]
    assert "interrupted by signal 15: the shard(s) in progress were discarded" in err
    assert kr.leftovers(out) == [] and not (out / "manifest.json").exists()
    m = run_extract(kr.config(out, model, data, shard_max_samples=2))  # resumes
    assert m["num_samples"] == 40 and verify_dataset(out).ok


def test_sigterm_while_the_model_loads_leaves_no_out_folder(tmp_path, kr):
    """A SIGTERM while the target loads (minutes for a large one) used to end the process before
    any cleanup: an ``--out`` holding only the lock file. Now the run ends by SIGTERM and leaves
    no folder; the same command then extracts everything."""
    out = tmp_path / "deep" / "ds"
    model, data = kr.make_fixture(tmp_path, samples=6, seed=2)
    loading = tmp_path / "loading"
    args = ["extract", "--out", str(out), "--model", str(model), "--data", str(data), "--num_samples", "null",
            "--dtype", "float32", "--aux_layer_ids", "[1, 3, 5]", "--progress", "false"]
    code = ("import pathlib, sys, time\n"
            "import eagle_data.engines as b\n"
            f"b.make_backend = lambda *a, **k: (pathlib.Path({str(loading)!r}).touch(), time.sleep(60))\n"
            "from eagle_data.cli.main import main\n"
            f"main({args!r})\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t_end = time.monotonic() + 120
    while not loading.exists() and p.poll() is None and time.monotonic() < t_end:
        time.sleep(0.01)
    assert out.exists()  # the lock was taken before the load
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == -signal.SIGTERM, err[-3000:]
    assert not (tmp_path / "deep").exists()
    assert run_extract(kr.config(out, model, data, shard_max_samples=2))["num_samples"] == 6


def test_no_sample_leaves_no_dataset_and_every_reader_says_why(tmp_path, kr, tiny, capsys):
    """Issue 39: an extraction whose every row is skipped writes no manifest, index or card (an
    older one's are removed by the merge); the extraction, the merge and every reader say it
    produced no samples; the same command after the source is fixed resumes into a dataset."""
    import eagle_data
    from eagle_data.extract.manifest import NoSamples
    from eagle_data.format.records import read_manifest
    from eagle_data.stream.dataset import EagleShardDataset

    model, _ = tiny
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"id": "q", "conversations": [{"from": "human", "value": "only a question"}]}) + "\n")
    out = tmp_path / "ds"
    says = (r"ds: the extraction produced no samples: every source row was skipped \(by reason: "
            r"\{'no_assistant_turn': 1\}; each row with its reason is in skips-\*.jsonl\). It is no dataset")
    with pytest.raises(NoSamples, match=says):
        run_extract(kr.config(out, model, data, shard_max_samples=3))
    assert sorted(p.name for p in out.iterdir()) == [".eagle-data.lock", "progress-00000.json", "skips-00000.jsonl"]
    for name in ("manifest.json", "index.parquet", "README.md"):  # as an earlier version wrote them
        (out / name).write_text("{}")
    with pytest.raises(NoSamples, match=says):
        merge(out)
    assert not any((out / n).exists() for n in ("manifest.json", "index.parquet", "README.md"))
    for open_it in (lambda: EagleShardDataset(str(out), batch_size=1), lambda: eagle_data.load_index(out),
                    lambda: read_manifest(out)):
        with pytest.raises(ValueError, match=says):
            open_it()
    (prob,) = verify_dataset(out).problems
    assert prob[:2] == ("manifest", "manifest.json") and "produced no samples" in prob[2]
    with pytest.raises(SystemExit) as e:
        cli.main(["extract", "--out", str(out), "--model", str(model), "--data", str(data), "--num_samples", "null",
                  "--dtype", "float32", "--aux_layer_ids", "[1, 3, 5]", "--progress", "false"])
    assert e.value.code == 2 and "produced no samples" in " ".join(capsys.readouterr().err.split())
    with open(data, "a") as f:  # the source fixed: a row with an answer
        f.write(json.dumps({"id": "a", "conversations": [{"from": "human", "value": "hi"},
                                                         {"from": "gpt", "value": "hello"}]}) + "\n")
    m = run_extract(kr.config(out, model, data, shard_max_samples=3))
    assert m["num_samples"] == 1 and m["skip_counts"] == {"no_assistant_turn": 1} and verify_dataset(out).ok


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.parametrize("when", ["before_progress", "after_progress"])
def test_a_failed_run_leaves_no_folder_that_looks_like_output(tmp_path, monkeypatch, kr, tiny, existing, when):
    """A run that fails before its rank recorded anything leaves no lock-only (or progress-of-nothing)
    ``--out``: a folder it created is removed, an existing one is left empty; the corrected command
    then runs."""
    import eagle_data.extract.run as R

    model, good = tiny
    out = tmp_path / "new" / "ds"
    if existing:
        out.mkdir(parents=True)
    data = tmp_path / "first_bad.jsonl"
    data.write_text(json.dumps({"id": "q", "conversations": [{"from": "human", "value": "only a question"}]}) + "\n"
                    + good.read_text())
    cfg = kr.config(out, model, data, shard_max_samples=3)
    if when == "before_progress":  # e.g. a backend option refused once the model is loaded
        real = R._run_facts

        def refused(*a, **kw):
            raise ValueError("refused by the backend")

        monkeypatch.setattr(R, "_run_facts", refused)
        with pytest.raises(ValueError, match="refused by the backend"):
            run_extract(cfg)
        monkeypatch.setattr(R, "_run_facts", real)
    else:  # the progress file is written, then the first row fails the run
        cfg.on_bad_sample = "raise"
        with pytest.raises(ValueError, match="no_assistant_turn"):
            run_extract(cfg)
        cfg.on_bad_sample = "skip"
    if existing:
        assert list(out.iterdir()) == []
    else:
        assert not (tmp_path / "new").exists()
    m = run_extract(cfg)
    assert m["num_samples"] == 24 and m["skip_counts"] == {"no_assistant_turn": 3} and verify_dataset(out).ok


def test_a_lock_file_removed_before_it_is_locked_is_opened_again(tmp_path, monkeypatch):
    """A failed run removes the lock file nobody holds; a run that opened it just before locks the
    file that is there now, not the removed one (two runs of one rank would both hold a lock)."""
    import fcntl

    from eagle_data.extract.resume import lock_rank

    real, calls = fcntl.lockf, []

    def racing(fd, *a):
        if not calls:
            (tmp_path / ".eagle-data.lock").unlink()  # removed between our open and our lock
        calls.append(fd)
        return real(fd, *a)

    monkeypatch.setattr(fcntl, "lockf", racing)
    fd = lock_rank(tmp_path, 0)
    try:
        assert len(calls) == 2 and os.path.samestat(os.fstat(fd), os.stat(tmp_path / ".eagle-data.lock"))
    finally:
        os.close(fd)
