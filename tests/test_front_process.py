"""The extraction front in a child process (``--front process``) gives the dataset the thread front
gives (samples, skips, notes, fingerprints), raises the child's errors in the parent with their
type, stops its child, and falls back to the thread when the child cannot start."""

import json
import logging
import os
import signal
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import webdataset as wds

from eagle_data.extract.chat import ChatRenderer
from eagle_data.extract.config import ExtractConfig
from eagle_data.extract.fault import BadRecord, ErrorPolicy, RowError, Skip
from eagle_data.extract.front_process import FrontProcess
from eagle_data.extract.run import batching, load_tokenizer, row_source, run_extract
from eagle_data.format.schema import decode_tensors

from tiny import AUX

GOOD = [
    {"id": "s", "conversations": [{"from": "human", "value": "Hello there, how are you?"},
                                  {"from": "gpt", "value": "I am fine, thank you."}]},
    {"id": "o", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                             {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6, says the fox."}]},
]
CUT = {"id": "cut", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"},
                                      {"from": "human", "value": "more"}, {"from": "gpt", "value": " "}]}
BAD = [{"id": "b1", "conversations": [{"from": "human", "value": "x"}]},
       {"id": "b2", "conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]},
       {"id": "b3", "conversations": [{"from": "human", "value": "<|im_end|> x"}, {"from": "gpt", "value": "y"}]}]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """Good rows, a row kept but cut (a note), bad rows of three kinds and an unreadable line."""
    p = tmp_path_factory.mktemp("data") / "chats.jsonl"
    rows = [json.dumps({**GOOD[i % 2], "id": f"g{i}"}) for i in range(9)]
    rows[3:3] = [json.dumps(CUT), "{not json"]
    rows += [json.dumps(b) for b in BAD]
    p.write_text("\n".join(rows) + "\n")
    return p


def cfg(out, model_dir, data_file, **kw):
    base = dict(out=str(out), model=str(model_dir), data=str(data_file), num_samples=None, dtype="float32",
                aux_layer_ids=AUX, shard_max_samples=3, batch_tokens=128, max_batch_size=2, progress=False, writers=1)
    return ExtractConfig(**{**base, **kw})


def front_process(c, renderer, tag, ahead):
    """The front process of config ``c``'s rows and batching."""
    return FrontProcess(row_source(c), batching(c), c.on_bad_sample, renderer, tag, ahead)


def _dataset(out):
    """Everything a run leaves that must not depend on where its front ran."""
    prog = json.loads((out / "progress-00000.json").read_text())
    man = json.loads((out / "manifest.json").read_text())
    samples = {s["__key__"]: (decode_tensors(s["safetensors"], s["__key__"]), json.loads(s["json"]))
               for s in wds.WebDataset(sorted(str(p) for p in out.glob("*.tar")), shardshuffle=False)}
    shards = [{k: s[k] for k in ("name", "keys", "sha256", "source_digest", "num_tokens")} for s in prog["shards"]]
    return (shards, prog["skipped"], prog.get("notes"), man["skip_counts"], man["note_counts"],
            (out / "skips-00000.jsonl").read_text(), samples)


def test_process_front_gives_the_thread_fronts_dataset(tmp_path, model_dir, data_file):
    runs = {}
    for front in ("thread", "process"):
        res = run_extract(cfg(tmp_path / front, model_dir, data_file, front=front))
        assert res["run_stats"]["front"] == front
        runs[front] = _dataset(tmp_path / front)
    shards, skipped, notes, skip_counts, note_counts, log, samples = runs["process"]
    assert skip_counts == {"no_assistant_turn": 1, "special_token_in_text": 1, "unknown_role": 1,
                           "unreadable_record": 1}
    assert note_counts == {"cut_at_blank_reply": 1} and len(samples) == 10
    assert len(log.splitlines()) == 5 and {s["source_digest"] for s in shards} != {None}
    t_shards, *t_rest, t_samples = runs["thread"]
    assert shards == t_shards and [skipped, notes, skip_counts, note_counts, log] == t_rest
    assert samples.keys() == t_samples.keys()
    for k, (tensors, meta) in samples.items():
        assert meta == t_samples[k][1]
        assert all(torch.equal(v, t_samples[k][0][n]) for n, v in tensors.items())


def test_process_front_resumes_where_the_thread_front_stopped(tmp_path, model_dir, data_file):
    out = tmp_path / "ds"
    run_extract(cfg(out, model_dir, data_file, front="thread", num_samples=5))
    m = run_extract(cfg(out, model_dir, data_file, front="process"))
    run_extract(cfg(tmp_path / "once", model_dir, data_file, front="thread"))
    assert m["num_samples"] == 10
    again, once = _dataset(out), _dataset(tmp_path / "once")
    assert again[6].keys() == once[6].keys() and again[1:5] == once[1:5]
    assert sum(s["num_tokens"] for s in again[0]) == sum(s["num_tokens"] for s in once[0])


def test_process_front_raises_the_childs_error_with_its_type(tmp_path, model_dir, data_file):
    with pytest.raises(RowError) as e:
        run_extract(cfg(tmp_path / "r", model_dir, data_file, front="process", on_bad_sample="raise"))
    assert e.value.skip.row == 4 and e.value.skip.reason == "unreadable_record"
    assert any("extraction front process" in n for n in e.value.__notes__)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"id": 1,')
    errs = []
    for front in ("thread", "process"):
        with pytest.raises(ValueError) as e:
            run_extract(cfg(tmp_path / front, model_dir, broken, front=front))
        errs.append(str(e.value))
    assert errs[0] == errs[1] and "broken.json" in errs[0]


def test_bad_record_and_row_error_survive_pickling():
    import pickle

    e = pickle.loads(pickle.dumps(RowError(Skip(3, "x", "unknown_role", "turn 0"))))
    assert (e.skip.row, e.skip.reason, str(e)) == (3, "unknown_role", "row 3 (id x): unknown_role: turn 0")
    b = pickle.loads(pickle.dumps(BadRecord("bad_json", "line 4")))
    assert (b.reason, str(b)) == ("bad_json", "line 4")


def _renderer(model_dir):
    return ChatRenderer.from_path(load_tokenizer(str(model_dir), False), None)


def test_child_ignores_sigint_and_close_stops_it(tmp_path, model_dir, data_file):
    c = cfg(tmp_path / "x", model_dir, data_file, max_batch_size=1)
    fp = front_process(c, _renderer(model_dir), "t", ahead=1)
    try:
        assert fp.ready(timeout=120)
        os.kill(fp.proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group; the parent handles it
        got = []
        it = fp.batches(set(), 10**6, lambda k, f: got.append(k), ErrorPolicy("skip"))
        first = next(it)
        assert [s.key for s in first] == ["t_000000003"] and fp.proc.poll() is None  # the shortest of the window
        assert got == [f"t_{r:09d}" for r in range(14)]  # the window's rows, read before its first batch
        assert first[0].input_ids.dtype == torch.int64 and first[0].loss_mask.dtype == torch.uint8
    finally:
        t0 = time.monotonic()
        fp.close()
    assert fp.proc.returncode is not None and time.monotonic() - t0 < 10
    fp.close()  # idempotent


class _Dies(ChatRenderer):
    """A renderer whose child dies (exit code 3) while rendering."""

    def encode_batch(self, conversations, tools=None):
        os._exit(3)


class _Poison:
    """Unpickling it ends the process (exit code 7): a child that cannot start."""

    def __reduce__(self):
        return os._exit, (7,)


def test_a_child_that_dies_is_an_error_naming_its_exit_code(tmp_path, model_dir, data_file):
    base = _renderer(model_dir)
    fp = front_process(cfg(tmp_path / "x", model_dir, data_file), _Dies(base.tokenizer, base.template), "t", ahead=2)
    try:
        assert fp.ready(timeout=120)
        with pytest.raises(RuntimeError, match=r"front process died \(exit code 3\)"):
            list(fp.batches(set(), 10**6, lambda k, f: None, ErrorPolicy("skip")))
    finally:
        fp.close()


@pytest.mark.parametrize("renderer, says", [(_Poison(), "did not start (exit code 7"),
                                             (lambda: 0, "could not be started (")])
def test_a_child_that_cannot_start_leaves_the_front_to_a_thread(tmp_path, model_dir, data_file, monkeypatch, caplog,
                                                               renderer, says):
    """A child that dies while starting, or a renderer that does not pickle: the run goes on with a thread."""
    import eagle_data.extract.run as run

    monkeypatch.setattr(run, "FrontProcess", lambda rows, b, bad, r, tag, ahead: FrontProcess(rows, b, bad, renderer, tag,
                                                                                             ahead))
    with caplog.at_level(logging.WARNING):
        m = run_extract(cfg(tmp_path / "ds", model_dir, data_file, front="process"))
    assert m["run_stats"]["front"] == "thread" and m["num_samples"] == 10
    assert any(says in r.getMessage() for r in caplog.records)


def test_front_setting_is_checked():
    with pytest.raises(ValueError, match="front must be one of"):
        ExtractConfig(front="processes")


UNGUARDED = """
import sys
from pathlib import Path
sys.path[:0] = {paths!r}
with open({count!r}, "a") as f:  # top-level code: must run once, never again in the front's child
    f.write("x")
from eagle_data.extract.config import ExtractConfig
from eagle_data.extract.run import run_extract
import os
os.chdir({cwd!r})  # after the imports: '' and relative PYTHONPATH entries now name another folder
res = run_extract(ExtractConfig(out={out!r}, model={model!r}, data={data!r}, num_samples=None, dtype="float32",
                                aux_layer_ids={aux!r}, batch_tokens=128, progress=False, writers=1, front="process"))
print("FRONT", res["run_stats"]["front"], res["num_samples"])
"""


def test_a_script_without_a_main_guard_runs_once(tmp_path, model_dir, data_file):
    """The child is a fresh interpreter: the caller's script is not run again (multiprocessing's
    spawn would re-run it: a second extraction, or worse, whatever the script does first); after a
    chdir, with a relative PYTHONPATH, it still imports what the caller imported."""
    import subprocess
    import sys

    count = tmp_path / "count"
    script = tmp_path / "noguard.py"
    decoy = tmp_path / "decoy"  # what a child importing from the working directory would run
    decoy.mkdir()
    (decoy / "json.py").write_text("raise ImportError('decoy json')\n")
    (decoy / "eagle_data").mkdir()
    (decoy / "eagle_data" / "__init__.py").write_text("raise ImportError('decoy eagle_data')\n")
    script.write_text(UNGUARDED.format(paths=sys.path, count=str(count), out=str(tmp_path / "ds"), cwd=str(decoy),
                                       model=str(model_dir), data=str(data_file), aux=AUX))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": "."})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "FRONT process 10" in r.stdout and count.read_text() == "x"


PARENT = """
import sys, time
sys.path[:0] = {paths!r}
from eagle_data.extract.run import batching, load_tokenizer, row_source
from eagle_data.extract.chat import ChatRenderer
from eagle_data.extract.config import ExtractConfig
from eagle_data.extract.front_process import FrontProcess
r = ChatRenderer.from_path(load_tokenizer({model!r}, False), None)
if {busy!r}:  # the child renders forever: it touches no pipe when its parent dies
    from test_front_process import _Slow
    r = _Slow(r.tokenizer, r.template)
c = ExtractConfig(out={out!r}, model={model!r}, data={data!r})
fp = FrontProcess(row_source(c), batching(c), c.on_bad_sample, r, "t", 2)
assert fp.ready(120)
if {busy!r}:
    import threading
    from eagle_data.extract.fault import ErrorPolicy
    it = fp.batches(set(), 10**6, lambda k, f: None, ErrorPolicy("skip"))
    threading.Thread(target=lambda: next(it), daemon=True).start()
    time.sleep(2)
print(fp.proc.pid, flush=True)
time.sleep(600)
"""


class _Slow(ChatRenderer):
    """A renderer that never finishes its first conversations."""

    def encode_batch(self, conversations, tools=None):
        time.sleep(3600)


@pytest.mark.parametrize("busy", [False, True])
def test_the_child_ends_when_its_parent_is_killed(tmp_path, model_dir, data_file, busy):
    """SIGKILL ends the parent at once: the child, waiting for its rows (its pipe ends) or busy
    rendering (its watcher sees the parent gone), ends too instead of lingering as an orphan."""
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(paths=sys.path, model=str(model_dir), out=str(tmp_path / "o"), data=str(data_file),
                                    busy=busy))
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(p.stdout.readline())
        os.kill(child, 0)  # alive
        p.kill()
        p.wait()
        t_end = time.monotonic() + 20
        while time.monotonic() < t_end and _alive(child):
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        p.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


def test_the_childs_import_path_is_absolute_and_starts_with_this_eagle_data(tmp_path, monkeypatch):
    """After a chdir, '' and relative entries would name another folder in the child: they are made
    absolute, and the child imports eagle_data from where this process did."""
    import sys
    from pathlib import Path

    import eagle_data
    from eagle_data.extract.front_process import _import_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", "rel", *sys.path])
    p = _import_path()
    assert p[0] == str(Path(eagle_data.__file__).resolve().parents[1])
    assert all(os.path.isabs(x) for x in p) and p[1:3] == [str(tmp_path), str(tmp_path / "rel")]


def _front_in_this_process(c, renderer, tag):
    """What the thread front hands out: batches, fingerprints and (kind, row, reason) of skips/notes."""
    from eagle_data.extract.rank_state import fresh_rows
    from eagle_data.extract.stages import front

    fps, events = [], []
    policy = ErrorPolicy(c.on_bad_sample, listener=lambda s, note: events.append(("note" if note else "skip",
                                                                                   s.row, s.reason)))

    def rows():
        for r, rec, key, fp in fresh_rows(row_source(c), tag, set()):
            fps.append((key, fp))
            yield r, rec
    batches = list(front(rows(), renderer, tag, 10**6, batching(c), policy))
    return batches, fps, events


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.sampled_from(["good", "cut", "broken", "b1", "b2", "b3"]), min_size=1, max_size=12),
       st.integers(1, 4))
def test_process_front_hands_out_what_the_thread_front_does(tmp_path_factory, model_dir, kinds, max_batch_size):
    """Over generated mixes of good, cut, unreadable and bad rows: the same batches (keys, ids,
    masks, order), the same fingerprints and the same skips and notes, row by row."""
    rows = {"good": json.dumps(GOOD[0]), "cut": json.dumps(CUT), "broken": "{not json",
            **{f"b{i + 1}": json.dumps(b) for i, b in enumerate(BAD)}}
    data = tmp_path_factory.mktemp("gen") / "rows.jsonl"
    data.write_text("\n".join(rows[k] for k in kinds) + "\n")
    c = cfg(data.parent / "o", model_dir, data, max_batch_size=max_batch_size, sort_window=3)
    renderer = _renderer(model_dir)
    want_batches, want_fps, want_events = _front_in_this_process(c, renderer, "t")
    fps, events = [], []
    policy = ErrorPolicy("skip", listener=lambda s, note: events.append(("note" if note else "skip", s.row, s.reason)))
    fp = front_process(c, renderer, "t", ahead=2)
    try:
        assert fp.ready(timeout=120)
        got = list(fp.batches(set(), 10**6, lambda k, f: fps.append((k, f)), policy))
    finally:
        fp.close()
    assert fps == want_fps and events == want_events
    assert [[s.key for s in b] for b in got] == [[s.key for s in b] for b in want_batches]
    for b, w in zip(got, want_batches):
        for s, t in zip(b, w):
            assert torch.equal(s.input_ids, t.input_ids) and torch.equal(s.loss_mask, t.loss_mask)
            assert (s.row, s.source_id, s.num_turns, s.truncated) == (t.row, t.source_id, t.num_turns, t.truncated)
