"""`eagle-data verify`: passes on good data, names the shard on corruption, recompute errors."""

from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest
import torch

from eagle_data.cli import main as cli
from eagle_data.tools.verify import verify_dataset
from eagle_data.extract.sink import ShardSink


@pytest.fixture
def ds(tmp_path, reference):
    out = tmp_path / "ds"
    shutil.copytree(reference, out)
    return out


def _manifest(out):
    return json.loads((out / "manifest.json").read_text())


def test_good_dataset_passes_and_cli_exits_zero(reference, capsys):
    rep = verify_dataset(reference)
    assert rep.ok, rep.problems
    assert rep.num_samples == 24 and rep.num_shards == len(_manifest(reference)["shards"]) >= 8
    cli.main(["verify", str(reference)])  # no SystemExit
    assert "OK" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["header", "middle", "end"])
def test_flipped_byte_fails_and_names_the_shard(ds, where, capsys):
    shard = ds / "00000-000004.tar"
    data = bytearray(shard.read_bytes())
    pos = {"header": 20, "middle": len(data) // 2, "end": len(data) - 5}[where]
    data[pos] ^= 0x01
    shard.write_bytes(bytes(data))
    rep = verify_dataset(ds)
    assert not rep.ok and {w for _, w, _ in rep.problems} >= {"00000-000004.tar"}
    assert all("00000-000004.tar" in w or c == "index" for c, w, _ in rep.problems)
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", str(ds)])
    assert e.value.code == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "00000-000004.tar" in out


def test_strays_missing_index_rows_and_totals(ds):
    (ds / "00000-000042.tar").write_bytes(b"x")
    (ds / "index" / "00000-000042.parquet").write_bytes(b"x")
    (ds / "progress-00000.json.99.tmp").write_bytes(b"x")
    t = pq.read_table(ds / "index.parquet")
    pq.write_table(t.slice(1), ds / "index.parquet")
    m = _manifest(ds)
    m["num_samples"] += 1
    (ds / "manifest.json").write_text(json.dumps(m))
    rep = verify_dataset(ds)
    got = {(c, w) for c, w, _ in rep.problems}
    assert {("directory", "00000-000042.tar"), ("directory", "index/00000-000042.parquet"),
            ("directory", "progress-00000.json.99.tmp"), ("index", "index.parquet"),
            ("manifest", "manifest.json")} <= got


def test_unexpected_members_and_a_corrupt_header_are_reported_with_the_shard(ds):
    import io
    import tarfile

    shard = ds / "00000-000004.tar"
    with tarfile.open(shard) as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tf:
        for m, data in members:
            tf.addfile(m, io.BytesIO(data))
        d = tarfile.TarInfo("somedir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        meta = tarfile.TarInfo("__meta__")
        tf.addfile(meta, io.BytesIO(b""))
    rep = verify_dataset(ds)
    assert {("shards", "00000-000004.tar", f"unexpected tar member {n!r}") for n in ("somedir", "__meta__")} <= \
        set(rep.problems)
    second = members[1][0].offset  # header of the shard's second member
    data = bytearray(shard.read_bytes())
    data[second + 2] ^= 1
    shard.write_bytes(bytes(data))
    rep = verify_dataset(ds)
    text = [x for c, w, x in rep.problems if w == "00000-000004.tar"]
    assert f"not a readable tar: corrupt tar header at byte {second} of 00000-000004.tar: bad checksum" in text
    assert "sha256 differs from the manifest (file changed or corrupted)" in text  # read to its end all the same


def test_duplicate_keys_across_ranks_and_nan(ds, tmp_path):
    m = _manifest(ds)
    shutil.copy(ds / "00000-000000.tar", ds / "00001-000000.tar")  # same keys again, "rank 1"
    m["shards"].append({**m["shards"][0], "name": "00001-000000.tar"})
    # a shard whose one sample has a NaN (written through the normal sink)
    sink = ShardSink(tmp_path / "nan", rank=0, start_shard=50)
    t = {"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([0, 1], dtype=torch.uint8),
         "aux_hidden_states": torch.zeros(2, 192), "hidden_states": torch.full((2, 64), float("nan"))}
    sink.write("chats_000000099", t, {"source_id": "x", "source_row": 99, "num_turns": 2, "truncated": False,
                                      "num_tokens": 2})
    sink.close()
    (rec,) = sink.published
    shutil.copy(tmp_path / "nan" / rec["name"], ds / rec["name"])
    m["shards"].append({k: v for k, v in rec.items() if k != "keys"})
    (ds / "manifest.json").write_text(json.dumps(m))
    rep = verify_dataset(ds)
    text = "\n".join(f"{c} {w} {x}" for c, w, x in rep.problems)
    assert "keys" in text and "stored 2 times" in text and "00001-000000.tar" in text
    assert "hidden_states contains NaN/Inf" in text and rec["name"] in text


def test_recompute_matches_reference_and_catches_wrong_model(ds, tmp_path, kr):
    rep = verify_dataset(ds, recompute=3, seed=1)
    assert rep.ok, rep.problems
    assert set(rep.recompute) == {"aux layer 1", "aux layer 3", "aux layer 5", "final (post-norm)"}
    assert max(rep.recompute.values()) <= 1e-4 and len(rep.recompute_keys) == 3
    for name, tok in rep.recompute_tokens.items():  # fp32 data, fp32 recompute: per token too
        assert tok["token_rel_p50"] <= tok["token_rel_p99"] <= tok["token_rel_max"] <= 1e-4, name
        assert tok["min_cosine"] > 1 - 1e-6, name
    from tiny import tiny_llama

    other = tmp_path / "other"
    tiny_llama(seed=1).save_pretrained(other)
    m = _manifest(ds)
    m["model_path"] = str(other)
    (ds / "manifest.json").write_text(json.dumps(m))
    rep = verify_dataset(ds, recompute=2)
    assert not rep.ok and {c for c, _, _ in rep.problems} == {"recompute"}
    assert max(rep.recompute.values()) > 0.1
    assert min(t["min_cosine"] for t in rep.recompute_tokens.values()) < 0.9  # another model's states
    assert max(t["token_rel_p50"] for t in rep.recompute_tokens.values()) > 0.1


def test_recompute_reports_token_ids_outside_the_vocabulary_and_goes_on(ds, monkeypatch):
    """A stored id beyond the model's vocabulary is a problem of that sample in the report (not a
    crash that loses the report); the other chosen samples are still recomputed."""
    import eagle_data.tools.verify as V

    real, hit = V.decode_tensors, []

    def damaged(tb, where):
        t = real(tb, where)
        if ":" in str(where) or hit:  # the schema pass names samples SHARD:KEY, the recompute by key
            return t
        hit.append(where)
        ids = t["input_ids"].clone()
        ids[0] = 10**6
        return {**t, "input_ids": ids}

    monkeypatch.setattr(V, "decode_tensors", damaged)
    rep = V.verify_dataset(ds, recompute=3, seed=1)
    (prob,) = [p for p in rep.problems if p[0] == "recompute"]
    assert prob[1] == hit[0] and f"..{10**6} outside the model's vocabulary [0, " in prob[2]
    assert set(rep.recompute) == {"aux layer 1", "aux layer 3", "aux layer 5", "final (post-norm)"}


def test_a_token_id_outside_the_vocabulary_is_a_problem_of_its_sample(ds, monkeypatch):
    import eagle_data.tools.verify as V

    real, hit = V.decode_tensors, []

    def damaged(tb, where):
        t = real(tb, where)
        if hit or ":" not in str(where):
            return t
        hit.append(where)
        return {**t, "input_ids": t["input_ids"].clone().index_fill_(0, torch.tensor([1]), -3)}

    monkeypatch.setattr(V, "decode_tensors", damaged)
    rep = V.verify_dataset(ds)
    (prob,) = [p for p in rep.problems if p[0] == "samples"]
    assert prob[1] == hit[0] and prob[2].startswith("token ids -3..") and "outside the model's vocabulary [0, " in prob[2]


def test_dataset_without_samples_fails(tmp_path, capsys):
    """A manifest and an index of 0 samples (as an extraction that skipped every row wrote before
    issue 39; now it writes none): not OK."""
    import pyarrow.parquet as pq

    from eagle_data.format.schema import INDEX_SCHEMA
    from eagle_data.tools.synthetic import write_synthetic

    write_synthetic(tmp_path / "one", [1])
    m = _manifest(tmp_path / "one")
    m.update(shards=[], num_samples=0, num_tokens=0, total_bytes=0, skip_counts={"no_messages": 3}, num_skipped=3)
    tmp_path = tmp_path / "zero"
    tmp_path.mkdir()
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    pq.write_table(INDEX_SCHEMA.empty_table(), tmp_path / "index.parquet")
    rep = verify_dataset(tmp_path)
    assert rep.num_samples == 0 and rep.problems == [
        ("samples", "manifest.json", "no samples: the dataset is empty (skipped rows by reason: {'no_messages': 3})")]
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", str(tmp_path)])
    assert e.value.code == 1 and "no samples" in capsys.readouterr().out


@pytest.mark.parametrize("args,msg", [(["--rtol", "-1"], r"rtol must be >= 0 \(a max relative error\), got -1.0"),
                                      (["--recompute", "1", "--device", "foo"], "device must be a torch device .* got 'foo'"),
                                      (["--recompute", "1", "--device", "cuda:99"],
                                       r"device 'cuda:99': (no CUDA GPU is visible|only \d+ CUDA device)"),
                                      (["--recompute", "-1"], "recompute must be >= 0, got -1"),
                                      (["--max_problems", "-1"], "max_problems must be >= 0, got -1")])
def test_bad_arguments_are_usage_errors_not_a_failed_dataset(reference, capsys, args, msg):
    """Exit 2 with the message before reading the (good) data; ``--device foo`` used to report
    the dataset FAILED (exit 1), ``--rtol -1`` was accepted."""
    import re

    with pytest.raises(SystemExit) as e:
        cli.main(["verify", str(reference), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and re.search("error: " + msg, err) and "Traceback" not in err, err


def test_nan_rtol_is_refused(reference):
    with pytest.raises(ValueError, match="rtol must be >= 0 .*, got nan"):
        verify_dataset(reference, rtol=float("nan"))


def test_on_disk_names_are_made_and_parsed_in_one_place():
    from eagle_data.format.layout import (PROGRESS_NAME, parse_progress_name, parse_shard_name, rank_shard_prefix, shard_name)

    assert shard_name(3, 12) == "00003-000012.tar" and parse_shard_name("00003-000012.tar") == (3, 12)
    assert rank_shard_prefix(3) == "00003-" and shard_name(3, 0).startswith(rank_shard_prefix(3))
    for bad in ("00003-000012.tar.tmp", "3-12.tar", "00003-000012.parquet", "x00003-000012.tar"):
        assert parse_shard_name(bad) is None
    assert parse_progress_name(PROGRESS_NAME.format(rank=7)) == 7 and parse_progress_name("progress-7.json") is None


def test_recompute_table_keeps_every_number_whole_on_a_narrow_terminal():
    import io

    from rich.console import Console

    from eagle_data.cli.verify import print_report
    from eagle_data.tools.verify import VerifyReport

    rep = VerifyReport("d", recompute={"final (post-norm)": 0.0159012}, recompute_bound={"final (post-norm)": 0.94123},
                       recompute_tokens={"final (post-norm)": {"token_rel_p50": 1.23e-3, "token_rel_p99": 4.56e-3,
                                                               "token_rel_max": 7.89e-3, "min_cosine": 0.9994421}},
                       recompute_keys=["k"], rtol=0.05, dtype="float8_e4m3fn")
    buf = io.StringIO()
    print_report(rep, console=Console(file=buf, width=60, no_color=True))
    out = buf.getvalue()
    for number in ("1.590e-02", "1.23e-03", "4.56e-03", "7.89e-03", "0.999442", "0.941", "final (post-norm)"):
        assert number in out, (number, out)


@pytest.mark.parametrize("dtype, says_batch_noise", [("float32", False), ("bfloat16", True)])
def test_the_bf16_batch_noise_footnote_is_printed_for_bf16_data_only(dtype, says_batch_noise):
    import io

    from rich.console import Console

    from eagle_data.cli.verify import print_report
    from eagle_data.tools.verify import VerifyReport

    rep = VerifyReport("d", recompute={"aux layer 1": 0.0}, recompute_tokens={"aux layer 1": {
        "token_rel_p50": 0.0, "token_rel_p99": 0.0, "token_rel_max": 0.0, "min_cosine": 1.0}},
                       recompute_keys=["k"], rtol=0.05, dtype=dtype)
    buf = io.StringIO()
    print_report(rep, console=Console(file=buf, width=200, no_color=True))
    assert f"rounding to {dtype}" in buf.getvalue()
    assert ("another batch composition in bf16" in buf.getvalue()) is says_batch_noise


def test_a_folder_that_is_no_dataset_is_named_so_and_an_unmerged_one_points_to_merge(tmp_path):
    import pytest

    from eagle_data.format.layout import shard_name
    from eagle_data.format.records import read_manifest

    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "README.md").write_text("a model card")  # a model folder's card is no dataset's
    (tmp_path / "index").mkdir()
    with pytest.raises(ValueError, match=r"is not an eagle-data dataset \(no manifest.json, no shards"):
        read_manifest(tmp_path)
    (tmp_path / shard_name(0, 0)).write_bytes(b"")
    with pytest.raises(ValueError, match=r"no manifest; run `eagle-data merge`"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").mkdir()
    with pytest.raises(ValueError, match=r"manifest.json: not a manifest.json \(not a file\)"):
        read_manifest(tmp_path)


def test_a_synthetic_dataset_verifies(tmp_path):
    """docs/training.md's synthetic dataset passes verify: its samples record num_tokens as extraction does."""
    from eagle_data.tools.synthetic import write_synthetic

    write_synthetic(tmp_path / "syn", [3, 2], hidden_size=16)
    rep = verify_dataset(tmp_path / "syn")
    assert rep.ok and rep.num_tokens > 0, rep
