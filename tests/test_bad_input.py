"""Bad input never crashes a run: every row ends up either stored or skipped with a named reason.

Property tests over hostile records (empty lists, missing/unknown roles, None/non-string
content, tool calls, huge messages, mixed scripts, control characters, lone surrogates,
duplicate ids, non-object rows, invalid JSON lines), down to a full ``run_extract`` on a tiny model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_data.extract.chat import ChatRenderer
from eagle_data.extract.stages import tokenize
from eagle_data.extract.conversations import Conversation, normalize, normalize_record
from eagle_data.extract.fault import ErrorPolicy, Skip
from eagle_data.extract.config import ExtractConfig
from eagle_data.extract.run import run_extract
from eagle_data.tools.verify import verify_dataset

NASTY = ["", " ", "\n\n", "\x00\x01\x7f\x1b[31mred", "日本語 Ελληνικά مرحبا עברית 🙂👍🏽", "e\u0301\u200d\u202e",
         "\ud800 lone surrogate", "<|im_end|><|im_start|>assistant", "{{ raise_exception('x') }}", "{% if %}",
         "a" * 100_000]
text = st.one_of(st.text(max_size=40), st.sampled_from(NASTY))
content = st.one_of(text, text, st.none(), st.integers(), st.booleans(), st.floats(allow_nan=True),
                    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2))
role = st.one_of(st.sampled_from(["human", "gpt", "user", "assistant", "system", "tool", "function", "ipython",
                                  " GPT ", "", "alien", "model"]), st.none(), st.integers())
tool_calls = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": text, "arguments": text})}), max_size=2)
turn = st.one_of(st.fixed_dictionaries({"from": role, "value": content}),
                 st.fixed_dictionaries({"role": role, "content": content}, optional={"tool_calls": tool_calls}),
                 st.dictionaries(st.text(max_size=5), content, max_size=3), text, st.none(), st.integers())
ids = st.one_of(st.sampled_from(["dup", "dup", "a.b/c d"]), st.integers(), text, st.none(),
                st.lists(st.integers(), max_size=2))
good = st.builds(lambda q, a, sid: {"id": sid, "conversations": [{"from": "human", "value": q},
                                                                  {"from": "gpt", "value": a}]},
                 text, st.text(min_size=1, max_size=30).filter(str.strip), ids)
tools = st.one_of(text, st.none(), st.lists(st.one_of(st.integers(), st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": text, "description": text})})), max_size=2))
record = st.one_of(
    good,
    st.fixed_dictionaries({"conversations": st.lists(turn, max_size=5)}, optional={"id": ids, "system": content}),
    st.fixed_dictionaries({"messages": st.lists(turn, max_size=5)}, optional={"id": ids, "system": content,
                                                                                "tools": tools}),
    st.one_of(st.integers(), st.lists(st.integers(), max_size=3), text, st.none()),  # not an object
)
line = st.one_of(record.map(json.dumps), record.map(json.dumps),
                 st.sampled_from(["{oops", "[1, 2", '"unterminated', "NaN-ish }", "\\u0000"]))
REASONS = {"no_messages", "unknown_role", "non_string_content", "empty_assistant", "no_assistant_turn",
           "broken_alternation", "misplaced_system", "bad_turn", "not_an_object", "invalid_unicode",
           "unreadable_record", "template_error", "no_loss_tokens", "token_id_out_of_range",
           "non_finite_hidden_states", "non_text_content", "bad_tool_call", "mask_unaligned",
           "message_not_rendered", "tool_calls_not_rendered", "special_token_in_text", "ambiguous_record", "bad_tools",
           "ambiguous_turn"}


@settings(max_examples=300, deadline=None)
@given(st.lists(record, max_size=5))
def test_normalize_never_raises_and_names_a_reason(records):
    pol = ErrorPolicy()
    out = list(normalize(enumerate(records), pol))
    assert all(isinstance(c, Conversation) for c in out)
    assert len(out) + sum(pol.counter.counts.values()) == len(records)
    assert set(pol.counter.counts) <= REASONS
    for r, rec in enumerate(records):
        res = normalize_record(r, rec)
        if isinstance(res, Conversation):
            assert all(isinstance(m["content"], str) for m in res.messages)
            assert res.messages[-1]["role"] == "assistant"


@pytest.fixture(scope="module")
def tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny[0])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(record, max_size=4))
def test_tokenize_stage_never_raises(tok, records):
    pol = ErrorPolicy()
    samples = list(tokenize(normalize(enumerate(records), pol), ChatRenderer(tok), "t", 64, pol))
    assert len(samples) + sum(pol.counter.counts.values()) == len(records)
    assert set(pol.counter.counts) <= REASONS
    for s in samples:
        assert s.input_ids.shape == s.loss_mask.shape and 0 < s.num_tokens <= 64 and int(s.loss_mask.sum()) > 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(line, min_size=1, max_size=8))
def test_run_extract_end_to_end_on_hostile_jsonl(tiny, tok, lines):
    from eagle_data.engines.hf import HFBackend
    from tiny import AUX, tiny_llama

    work = Path(tempfile.mkdtemp(prefix="bad_input_"))
    try:
        lines = lines + [json.dumps({"id": "ok", "conversations": [{"from": "human", "value": "hi"},
                                                                   {"from": "gpt", "value": "hello there"}]})]
        data = work / "hostile.jsonl"
        data.write_text("\n".join(lines) + "\n", encoding="utf-8")
        cfg = ExtractConfig(out=str(work / "out"), model=str(tiny[0]), data=str(data), num_samples=None,
                            dtype="float32", aux_layer_ids=AUX, max_length=160, shard_max_samples=3,
                            progress=False)
        be = HFBackend(tiny[0], AUX, dtype="float32", model=_MODEL.setdefault("m", tiny_llama()))
        m = run_extract(cfg, backend=be, tokenizer=tok)
        assert m["num_samples"] >= 1 and m["num_samples"] + m["num_skipped"] == len(lines)
        assert set(m["skip_counts"]) <= REASONS
        prog = json.loads((work / "out" / "progress-00000.json").read_text())
        stored = {int(k.rsplit("_", 1)[1]) for s in prog["shards"] for k in s["keys"]}
        skipped = {int(r) for r in prog["skipped"]}
        assert not stored & skipped and stored | skipped == set(range(len(lines)))
        # every note of a stored row counted once in the manifest and this run's stats; a skipped
        # row's notes nowhere
        from collections import Counter

        log = [json.loads(x) for x in (work / "out" / "skips-00000.jsonl").read_text().split("\n") if x]  # (not
        # splitlines: JSON text may hold U+0085 / U+2028, which it splits on)
        want = Counter(x["reason"] for x in log if x["kind"] == "note" and x["row"] in stored)
        assert m["note_counts"] == dict(want) == m["run_stats"]["note_counts"]
        rep = verify_dataset(work / "out")
        assert rep.ok, rep.problems
    finally:
        shutil.rmtree(work, ignore_errors=True)


_MODEL: dict = {}


def test_unreadable_lines_and_json_array_files(tmp_path):
    from eagle_data.extract.sources import iter_records

    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a": 1}\n{broken\n\n\xff\xfe\n[1]\n')
    recs = list(iter_records(str(p)))
    assert [r for r, _ in recs] == [0, 1, 2, 3]
    assert isinstance(recs[1][1], Skip) and recs[1][1].reason == "unreadable_record" and recs[1][1].row == 1
    assert recs[1][1].detail == "line 2: not JSON: Expecting property name enclosed in double quotes at character 2 of the line"
    assert isinstance(recs[2][1], Skip) and recs[3][1] == [1]
    a = tmp_path / "arr.json"
    a.write_text(json.dumps([{"id": 1}, {"id": 2}]))
    assert [rec["id"] for _, rec in iter_records(str(a), rank=1, world_size=2)] == [2]
    assert len(list(iter_records(str(tmp_path / "*.jsonl")))) == 4  # absolute glob


@pytest.mark.parametrize("kw,message", [
    ({"out": ""}, "out must be a non-empty string"),
    ({"dataset_tag": ""}, "dataset_tag must be non-empty"),
    ({"device": "cuda:x"}, "device must be a torch device"),  # the form; a type torch lacks: at check_paths
    ({"world_size": 0}, "world_size must be an integer >= 1"),
    ({"rank": 2, "world_size": 2}, r"rank 2 must be in \[0, world_size=2\)"),
    ({"template_date": "yesterday"}, "template_date must be a date YYYY-MM-DD"),
    ({"split": " "}, "split must be a non-empty string"),
])
def test_bad_settings_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        ExtractConfig(**kw)


def test_folder_sources_read_every_data_file_and_refuse_other_files(tmp_path, caplog):
    """A data folder: files in subfolders and upper-case extensions are read (sorted by path),
    hidden entries ignored; a file that is not data is an error, not silently left out."""
    from eagle_data.extract.sources import iter_records, resolve

    rec = lambda i: json.dumps({"id": str(i), "conversations": [{"from": "human", "value": "q"},  # noqa: E731
                                                                {"from": "gpt", "value": f"a{i}"}]})
    d = tmp_path / "data"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_text(rec(0) + "\n")
    (d / "B.JSONL").write_text(rec(1) + "\n")
    (d / "sub" / "c.jsonl").write_text(rec(2) + "\n")
    (d / ".hidden.txt").write_text("ignored")
    assert [r["id"] for _, r in iter_records(str(d))] == ["1", "0", "2"]  # B.JSONL, a.jsonl, sub/c.jsonl
    assert "1 hidden file(s) not read" in caplog.text and ".hidden.txt" in caplog.text  # said, not silent
    (d / "notes.txt").write_text("not data")
    with pytest.raises(ValueError, match=r"not \.json/\.jsonl/\.parquet: \['notes.txt'\]"):
        resolve(str(d))


def test_glob_sources_span_folders_and_refuse_files_that_are_not_data(tmp_path):
    """``*`` used to drop a .jsonl.gz, a notes file and a subfolder unsaid; ``**`` missed the top level."""
    from eagle_data.extract.sources import resolve

    d = tmp_path / "g"
    (d / "sub" / "deeper").mkdir(parents=True)
    for f in ("a.jsonl", "sub/c.jsonl", "sub/deeper/d.JSON"):
        (d / f).write_text("{}\n")
    assert resolve(f"{d}/*")[1]["data_files"] == [str(d / f) for f in ("a.jsonl", "sub/c.jsonl", "sub/deeper/d.JSON")]
    assert resolve(f"{d}/**/*.jsonl")[1]["data_files"] == [str(d / "a.jsonl"), str(d / "sub/c.jsonl")]
    assert resolve(f"{d}/*.jsonl")[1]["data_files"] == [str(d / "a.jsonl")]
    (d / "b.jsonl.gz").write_bytes(b"")
    with pytest.raises(ValueError, match=r"the glob .*/\* matches files that are not \.json/\.jsonl/\.parquet: .*b\.jsonl\.gz"):
        resolve(f"{d}/*")
    assert resolve(f"{d}/*.jsonl")[1]["data_files"] == [str(d / "a.jsonl")]  # a narrower glob is the way out
    (d / "a[1].jsonl").write_text("{}\n")  # an existing file whose name looks like a glob is that file
    (d / "a1.jsonl").write_text("{}\n")
    assert resolve(str(d / "a[1].jsonl"))[1]["data_files"] == [str(d / "a[1].jsonl")]


def test_parquet_sources_keep_each_records_own_keys_and_files_may_differ(tmp_path):
    """Arrow pads a struct column with the other rows' keys ({"a": 1} next to {"b": "x"} read back
    as {"a": 1, "b": None}, rendered and supervised); `datasets` cast every file to the first one's
    schema and crashed mid-run on a file with one more field."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle_data.extract.conversations import normalize_record
    from eagle_data.extract.sources import iter_records

    def rec(i, args, **turn):
        return {"id": f"p{i}", "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, **turn,
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": args}}]},
            {"role": "tool", "content": "r"}, {"role": "assistant", "content": "done"}]}

    d = tmp_path / "pq"
    d.mkdir()
    pq.write_table(pa.Table.from_pylist([rec(0, {"a": 1}), rec(1, {"b": "x"})]), d / "a.parquet")
    pq.write_table(pa.Table.from_pylist([rec(2, {"a": 2}, weight=0)]), d / "b.parquet")  # one more field
    got = [normalize_record(r, x) for r, x in iter_records(str(d))]
    assert [c.messages[1]["tool_calls"][0]["function"]["arguments"] for c in got] == [{"a": 1}, {"b": "x"}, {"a": 2}]
    assert [c.messages[1].get("train", True) for c in got] == [True, True, False]
    m = tmp_path / "map.parquet"  # a map column reads as an object, not as (key, value) pairs
    pq.write_table(pa.Table.from_pylist([{**rec(3, {"a": 3}), "meta": [("k", "v")]}], schema=pa.Table.from_pylist(
        [rec(3, {"a": 3})]).schema.append(pa.field("meta", pa.map_(pa.string(), pa.string())))), m)
    assert [r["meta"] for _, r in iter_records(str(m))] == [{"k": "v"}]
    (d / "c.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"c\.parquet is not a readable parquet file"):
        list(iter_records(str(d)))


def test_split_of_local_data_and_backend_options_are_checked(tiny, tmp_path):
    """--split means a hub split (local files have only 'train'); backend_kwargs the backend does
    not take, a model folder without weights: ValueError naming them, before any work."""
    model, data = tiny
    base = dict(model=str(model), data=str(data), out=str(tmp_path / "o"), dtype="float32", progress=False)
    with pytest.raises(ValueError, match="split 'validation': local files"):
        run_extract(ExtractConfig(split="validation", **base))
    with pytest.raises(ValueError, match=r"backend_kwargs: the hf backend takes no option\(s\) \['foo'\]"):
        run_extract(ExtractConfig(backend_kwargs={"foo": 1}, **base))
    for key, flag in (("out_dtype", "--storage_dtype"), ("dtype", "--dtype"), ("model_path", "--model"),
                      ("aux_layer_ids", "--aux_layer_ids")):  # set by the run's own flags: never twice
        with pytest.raises(ValueError, match=f"backend_kwargs: '{key}' is set by the run \\({flag}\\)"):
            ExtractConfig(backend_kwargs={key: "x"}, **base)
    empty = tmp_path / "noweights"
    shutil.copytree(model, empty)
    (empty / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="cannot load its weights"):
        run_extract(ExtractConfig(**{**base, "model": str(empty), "out": str(tmp_path / "o2")}))


def test_an_output_folder_holding_other_files_is_refused_untouched(tiny, tmp_path):
    """A folder with files no extraction wrote (the user's README.md, a checkpoint) is never
    written into: the dataset card would replace the README."""
    model, data = tiny
    base = dict(model=str(model), data=str(data), dtype="float32", progress=False, num_samples=2)
    for name in ("README.md", "last.ckpt", "notes", "skips-00000.jsonl", "index.parquet"):  # the last two: our names,
        # but with no progress file or manifest beside them not ours
        out = tmp_path / name.replace(".", "_")
        out.mkdir()
        (out / name).write_text("MY OWN NOTES")
        with pytest.raises(ValueError, match=f"holds files that no extraction wrote \\({name}\\)"):
            run_extract(ExtractConfig(out=str(out), **base))
        assert sorted(p.name for p in out.iterdir()) == [name] and (out / name).read_text() == "MY OWN NOTES"
    done = tmp_path / "done"
    run_extract(ExtractConfig(out=str(done), **base))  # its own files (card included): a rerun resumes
    assert (done / "README.md").is_file()
    assert run_extract(ExtractConfig(out=str(done), **base))["num_samples"] == 2


def test_merge_refuses_missing_shards_and_damaged_progress(tiny, tmp_path):
    """merge never publishes a manifest listing a shard that is gone or changed size, nor reads
    a progress file that is JSON but not a progress record."""
    from eagle_data.extract.manifest import merge

    model, data = tiny
    out = tmp_path / "ds"
    run_extract(ExtractConfig(model=str(model), data=str(data), out=str(out), dtype="float32", progress=False,
                              shard_max_samples=4))
    shards = sorted(out.glob("*.tar"))
    data_bytes = shards[1].read_bytes()
    shards[1].write_bytes(data_bytes[:-512])
    with pytest.raises(ValueError, match=rf"{shards[1].name} \(size differs"):
        merge(out)
    shards[1].unlink()
    with pytest.raises(ValueError, match=rf"{shards[1].name} \(missing\)"):
        merge(out)
    shards[1].write_bytes(data_bytes)
    merge(out)
    (out / "progress-00000.json").write_text('{"bad": 1}')
    with pytest.raises(ValueError, match="not an eagle-data progress record"):
        merge(out)


def test_cli_reports_a_missing_file_without_traceback(tiny, tmp_path, capsys):
    """A file-system failure (a shard deleted under inspect) exits 1 with the message, no traceback."""
    from eagle_data.cli.main import main

    model, data = tiny
    out = tmp_path / "ds"
    run_extract(ExtractConfig(model=str(model), data=str(data), out=str(out), dtype="float32", progress=False))
    for s in out.glob("*.tar"):
        s.unlink()
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(out), "--sample", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "error: " in err and "Traceback" not in err and ".tar" in err


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["a", "b"]), st.booleans()), max_size=30),
       st.integers(0, 6))
def test_drop_counter_counts_kept_rows_notes_and_says_once_that_the_rest_go_to_debug(events, log_first):
    """Any order of notes and skips: ``notes`` counts the notes no later skip of their row took back, ``counts``
    every skip, and each event is logged once: the first ``log_first`` as warnings, then one line
    saying the rest go to debug (once, however the counts move when a noted row is skipped)."""
    import logging

    from eagle_data.extract.fault import DropCounter

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("eagle_data.extract.fault")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        c = DropCounter(log_first=log_first, kept_in="the run keeps them in X.jsonl")
        for row, reason, note in events:
            c.add(Skip(row, f"id{row}", reason), note=note)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    want_notes = {}  # a row's notes come before its skip in the pipeline: a skip takes back the notes before it
    for i, (row, reason, note) in enumerate(events):
        if note and not any(r == row and not n for r, _, n in events[i + 1:]):
            want_notes[reason] = want_notes.get(reason, 0) + 1
    assert dict(c.notes) == want_notes
    assert c.as_dict() == {r: n for r in ("a", "b") if (n := sum(1 for _, x, nt in events if x == r and not nt))}
    more = [r for r in records if "logged at debug level" in r.getMessage()]
    assert len(more) == (1 if len(events) > log_first else 0)
    assert all(r.getMessage().endswith("(the run keeps them in X.jsonl)") for r in more)  # where, as the run says
    per_event = [r for r in records if "logged at debug level" not in r.getMessage()]
    assert len(per_event) == len(events)
    assert [r.levelno for r in per_event] == [logging.WARNING] * min(log_first, len(events)) + \
        [logging.DEBUG] * max(0, len(events) - log_first)


def test_a_run_refused_after_it_started_leaves_no_folder_behind(tiny, tmp_path):
    """A backend option refused once the run has created and locked its folder (here: CUDA graphs on
    the CPU) leaves no lock-only folder that later commands would misread, nor the empty folders it
    created above it; a folder that existed before is left as it was."""
    model, data = tiny
    for out, existed in ((tmp_path / "new", False), (tmp_path / "old", True), (tmp_path / "a" / "b" / "c", False),
                         (tmp_path / "old" / "x" / "y", False), (tmp_path / "p" / ".." / "q" / "r", False),
                         (tmp_path / "m" / "n" / "..", False)):  # m/n/.. is m: m/n is never made
        if existed:
            out.mkdir()
        cfg = ExtractConfig(out=str(out), model=str(model), data=str(data), device="cpu", dtype="float32",
                            backend_kwargs={"cuda_graphs": True}, progress=False)
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
            run_extract(cfg)
        assert out.exists() == existed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    assert list((tmp_path / "old").iterdir()) == []  # its own run's lock file removed too (issue 39)


def test_an_out_with_dotdot_is_checked_written_and_reported_as_the_folder_it_names(tiny, tmp_path):
    """``--out`` spelled with ``..`` is the folder it names for every check, not only for mkdir:
    ``afile/..`` is refused as the OS refuses it (not written into afile's folder); ``m/nope/..``
    is refused exactly like ``m`` when m holds a user's files; ``new/sub/../ds`` writes new/ds,
    never makes new/sub, and the manifest records a path that exists."""
    import json

    model, data = tiny

    def cfg(out):
        return ExtractConfig(out=str(out), model=str(model), data=str(data), device="cpu", dtype="float32",
                             num_samples=3, progress=False)

    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        run_extract(cfg(tmp_path / "afile" / ".."))
    m = tmp_path / "m"
    m.mkdir()
    (m / "README.md").write_text("mine")
    for out in (m, m / "nope" / ".."):
        with pytest.raises(ValueError, match="holds files that no extraction wrote"):
            run_extract(cfg(out))
    assert (m / "README.md").read_text() == "mine" and sorted(p.name for p in m.iterdir()) == ["README.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "m"]
    run_extract(cfg(tmp_path / "new" / "sub" / ".." / "ds"))
    assert not (tmp_path / "new" / "sub").exists()
    recorded = json.loads((tmp_path / "new" / "ds" / "manifest.json").read_text())["config"]["out"]
    assert Path(recorded).resolve() == (tmp_path / "new" / "ds").resolve()


def test_the_cleanup_of_a_refused_run_keeps_a_folder_another_rank_has_locked(tmp_path):
    """A rank starting in the same new folder holds its byte of the lock file: the failed run's
    cleanup leaves the folder (and the lock file) to it; alone, it removes them."""
    import os
    import subprocess
    import sys

    from eagle_data.extract.resume import lock_rank
    from eagle_data.extract.run import _remove_unrecorded
    from eagle_data.format.layout import LOCK_NAME

    out = tmp_path / "new"
    out.mkdir()
    mine = lock_rank(out, 0)
    other = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.lockf(fd, fcntl.LOCK_EX, 1, 1); "
        "print('locked', flush=True); time.sleep(60)"), str(out / LOCK_NAME)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "locked"
        _remove_unrecorded(out, 0, mine, [out])
        assert (out / LOCK_NAME).exists()
    finally:
        other.kill()
        other.wait()
    _remove_unrecorded(out, 0, mine, [out])
    assert not out.exists()
    os.close(mine)
