"""Multi-rank merge after the source changed (issue 39, item 2): each rank records the source it
read; the merge refuses ranks that disagree, naming them and what differs, until they are rerun."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from eagle_data.cli import data as cli_data
from eagle_data.cli import main as cli
from eagle_data.extract.manifest import RanksDisagree, merge
from eagle_data.extract.resume import load_progress
from eagle_data.extract.run import run_extract
from eagle_data.tools.verify import verify_dataset


def _rank(kr, out, model, data, rank, **kw):
    c = kr.config(out, model, data, shard_max_samples=3)
    c.rank, c.world_size = rank, 2
    for k, v in kw.items():
        setattr(c, k, v)
    return run_extract(c)


def _append(data, n, start):
    with open(data, "a") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"id": f"new{i}", "conversations": [{"from": "human", "value": f"question {i}"},
                                                                     {"from": "gpt", "value": f"answer {i}"}]}) + "\n")


def _rows(data):
    return [json.loads(line) for line in data.read_text().splitlines()]


def _keys_exactly_once(out, data):
    """The merged dataset holds every good source row once (by key), and nothing else."""
    good = [r for r, rec in enumerate(_rows(data)) if len(rec["conversations"]) == 2]
    keys = pq.read_table(out / "index.parquet").column("key").to_pylist()
    assert sorted(int(k.rsplit("_", 1)[1]) for k in keys) == good
    return len(good)


def test_rerun_of_one_rank_after_the_source_grew_is_refused_until_every_rank_reran(tmp_path, kr, capsys):
    model, data = kr.make_fixture(tmp_path, samples=12)  # 13 rows: 12 chats + a bad one (skipped)
    out = tmp_path / "ds"
    _rank(kr, out, model, data, 0)
    assert _rank(kr, out, model, data, 1)["num_samples"] == 12 and (out / "manifest.json").exists()
    rec = load_progress(out, 1)["source"]
    assert rec["files"] == 1 and rec["bytes"] == data.stat().st_size and len(rec["fingerprint"]) == 64
    _append(data, 5, 0)  # rows 13..17: 14, 16 are rank 0's, 13, 15, 17 rank 1's
    r0 = _rank(kr, out, model, data, 0)  # finishes; its merge is refused (logged), not an error of rank 0
    assert "progress" in r0 and "rank(s) [1]" in r0["merge_error"]
    # the old merge's files go: a reader must not take the dataset before the change for the new one
    assert not any((out / n).exists() for n in ("manifest.json", "index.parquet", "README.md"))
    c0 = kr.config(out, model, data, shard_max_samples=3)
    c0.rank, c0.world_size = 0, 2
    with pytest.raises(RanksDisagree, match=r"(?s)rank\(s\) \[1\].*this rank's own extraction finished"):
        cli_data.extract(c0)  # the command fails (exit 2), though rank 0 itself is done
    with pytest.raises(RanksDisagree) as e:
        merge(out)
    msg = str(e.value)
    assert "refusing to merge (the rows of rank(s) [1] would be missing or stale)" in msg
    # (row 17, rank 1's too, is past the last row rank 0 read: only the rerun of rank 1 can tell)
    assert "rank 1 holds 6 source row(s) (up to row 11); rank(s) [0] read up to row 16, so at least 2 row(s) of " \
           "rank 1 would be missing: 13, 15" in msg
    assert "the source files differ: rank(s) [0] read 1 file(s)" in msg and "; rank(s) [1] read 1 file(s)" in msg
    assert "Rerun rank(s) [1] with the same source and command" in msg
    with pytest.raises(SystemExit) as ex:
        cli.main(["merge", str(out)])
    assert ex.value.code == 2 and "rank(s) [1]" in capsys.readouterr().err
    m = _rank(kr, out, model, data, 1)  # the last rank to finish merges
    assert m["num_samples"] == _keys_exactly_once(out, data) == 17 and m["skip_counts"] == {"no_assistant_turn": 1}
    assert m["source"] == {k: v for k, v in load_progress(out, 0)["source"].items() if k != "read_at"}
    assert merge(out)["num_samples"] == 17 and verify_dataset(out).ok


def test_a_row_of_another_rank_edited_in_place_is_refused_naming_the_rank_that_read_it_before(tmp_path, kr):
    """Same row count, other content: rank 0's rerun checks only its own rows; the merge sees the
    ranks' source fingerprints differ and names rank 1 (read before rank 0's rerun)."""
    model, data = kr.make_fixture(tmp_path, samples=8)
    out = tmp_path / "ds"
    _rank(kr, out, model, data, 0)
    _rank(kr, out, model, data, 1)
    rows = _rows(data)
    rows[1]["conversations"][1]["value"] = "an answer edited in place"  # row 1: rank 1's
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert "rank(s) [1]" in _rank(kr, out, model, data, 0)["merge_error"]
    with pytest.raises(RanksDisagree, match=r"(?s)rows of rank\(s\) \[1\] would be missing or stale.*"
                                            r"the source files differ: rank\(s\) \[0\] read .*; rank\(s\) \[1\] read"):
        merge(out)
    with pytest.raises(ValueError, match="changed since the earlier run"):  # rank 1's own check on its rerun
        _rank(kr, out, model, data, 1)


def test_ranks_with_another_num_samples_are_refused_until_rerun(tmp_path, kr):
    model, data = kr.make_fixture(tmp_path, samples=12)
    out = tmp_path / "ds"
    _rank(kr, out, model, data, 0)
    r1 = _rank(kr, out, model, data, 1, num_samples=4)  # rows 1, 3 only: rows 5..11 of rank 1 missing
    assert "merge_error" in r1 and not (out / "manifest.json").exists()
    with pytest.raises(RanksDisagree, match=r"(?s)rank 1 holds 2 source row\(s\) \(up to row 3\).*"
                                            r"--num_samples differs: rank 0: None, rank 1: 4"):
        merge(out)
    m = _rank(kr, out, model, data, 1)  # the same command as rank 0's
    assert m["num_samples"] == _keys_exactly_once(out, data) == 12


def test_another_num_samples_on_one_rank_is_refused_even_when_no_row_shows_missing(tmp_path, kr):
    """Rank 0 rerun with num_samples 8 after both ran 6: rank 0 read rows 0..6 (its last is 6),
    so rank 1's row 7 lay past every rank's last row and the merge wrote 7 samples as complete."""
    import eagle_data
    from eagle_data.format.records import read_manifest

    model, data = kr.make_fixture(tmp_path, samples=12)
    out = tmp_path / "ds"
    _rank(kr, out, model, data, 0, num_samples=6)
    assert _rank(kr, out, model, data, 1, num_samples=6)["num_samples"] == 6
    assert "rank(s) [1]" in _rank(kr, out, model, data, 0, num_samples=8)["merge_error"]
    with pytest.raises(RanksDisagree, match=r"(?s)rows of rank\(s\) \[1\] would be missing or stale.*"
                                            r"--num_samples differs: rank 0: 8, rank 1: 6"):
        merge(out)
    for read in (lambda: eagle_data.load_index(out), lambda: read_manifest(out)):  # the parts are no dataset
        with pytest.raises(ValueError, match="every rank finished, but no merged manifest.json is there: the "
                                             "merge was refused"):
            read()
    _rank(kr, out, model, data, 1, num_samples=8)
    good = [r for r, rec in enumerate(_rows(data)[:8]) if len(rec["conversations"]) == 2]
    assert sorted(pq.read_table(out / "index.parquet").column("source_row").to_pylist()) == good and len(good) >= 7
