"""``eagle-data regenerate`` accounting, over generated input: every source row ends in exactly one
outcome (regenerated / failed / skipped) with the reason the row was built to have, the counts
sum to the input, and a regenerated record is the source record with only the regenerated turns
replaced. The engine is scripted (its reply depends on a marker in the prompt's last user
message), so the outcomes are known in advance; the real engines are tested in
test_regenerate.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_data.regen.config import RegenerateConfig
from eagle_data.regen.engines import BatchedGenerator, finish_of
from eagle_data.regen.plan import Reply, split_reply
from eagle_data.regen.run import run_regenerate
from eagle_data.format.regen_layout import DATA_DIR, MANIFEST, REJECTS_DIR

MAX_LENGTH = 400
LONG = "lorem " * 450  # > MAX_LENGTH tokens on its own


class Scripted(BatchedGenerator):
    """A :class:`~eagle_data.regen.engines.Generator` whose reply is set by the last user message:
    ``ERR`` -> engine error, ``EMPTY`` -> blank reply, ``SPECIAL`` -> a special token's text,
    ``VERBOSE`` -> 30 words, else ``"reply N"`` (N = prompt length), ended by the end-of-turn token."""

    def __init__(self, tok):
        super().__init__()
        self.tok, self.eot = tok, tok.convert_tokens_to_ids("<|im_end|>")
        self.calls = 0

    def generate(self, prompts, budgets, seeds):
        self.calls += 1
        out = []
        for p, b in zip(prompts, budgets):
            assert 1 <= b <= MAX_LENGTH - len(p)
            last = self.tok.decode(p).rsplit("<|im_start|>user", 1)[-1]
            if "ERR" in last:
                out.append(Reply([], "", 0, "scripted engine error"))
                continue
            text = ("" if "EMPTY" in last else "a<|im_start|>b" if "SPECIAL" in last else "word " * 30
                    if "VERBOSE" in last else f"reply {len(p)}")
            out.append(finish_of(self.tok.encode(text, add_special_tokens=False) + [self.eot],
                                 frozenset([self.eot]), b))
        return out

    def describe(self):
        return {"engine": "scripted"}

    def close(self):
        pass


class Unordered(Scripted):
    """:class:`Scripted` answering as a streaming engine does: each ``collect`` returns a random
    non-empty subset of the requests in flight, in random order."""

    def __init__(self, tok, seed: int):
        super().__init__(tok)
        self.rng, self.held = random.Random(seed), []

    def collect(self, timeout=None):
        self.held += super().collect(timeout)
        self.rng.shuffle(self.held)
        k = self.rng.randint(1, len(self.held)) if self.held else 0
        out, self.held = self.held[:k], self.held[k:]
        return out


FEATURES = ["plain", "ERR", "EMPTY", "SPECIAL", "LONG", "TYPED"]


def user_text(feature: str, i: int) -> str:
    return {"plain": f"question {i}", "ERR": f"ERR {i}", "EMPTY": f"EMPTY {i}", "SPECIAL": f"SPECIAL {i}",
            "LONG": LONG, "TYPED": f"see <|im_end|> {i}"}[feature]


def expect_all(features: list[str]) -> tuple[str, str | None, int]:
    """(outcome, reason, regenerated turns) of a ShareGPT row in mode "all"."""
    for k, f in enumerate(features):
        if f == "TYPED":
            return "skipped", "special_token_in_text", 0
        if f == "LONG":
            return ("regenerated", None, k) if k else ("skipped", "context_too_long", 0)
        if f in ("ERR", "EMPTY", "SPECIAL"):
            return "failed", {"ERR": "engine_error", "EMPTY": "empty_reply", "SPECIAL": "special_token_in_reply"}[f], 0
    return "regenerated", None, len(features)


def expect_last(features: list[str]) -> tuple[str, str | None, int]:
    if "TYPED" in features:
        return "skipped", "special_token_in_text", 0
    if "LONG" in features:
        return "skipped", "context_too_long", 0
    f = features[-1]
    if f in ("ERR", "EMPTY", "SPECIAL"):
        return "failed", {"ERR": "engine_error", "EMPTY": "empty_reply", "SPECIAL": "special_token_in_reply"}[f], 0
    return "regenerated", None, 1


BAD = {"not_an_object": "[1, 2]", "unreadable_record": "{not json",
       "no_assistant_turn": json.dumps({"conversations": [{"from": "human", "value": "hi"}]})}
TOOL_ONLY = {"messages": [{"role": "user", "content": "weather?"},
                          {"role": "assistant", "content": None,
                           "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": "{}"}}]}]}

row_spec = st.one_of(
    st.lists(st.sampled_from(FEATURES), min_size=1, max_size=4).map(lambda f: ("chat", f)),
    st.sampled_from(sorted(BAD)).map(lambda b: ("bad", b)),
    st.just(("tool", None)))


def _write(path: Path, specs) -> list[str]:
    lines = []
    for i, (kind, x) in enumerate(specs):
        if kind == "bad":
            lines.append(BAD[x])
        elif kind == "tool":
            lines.append(json.dumps(TOOL_ONLY))
        else:
            turns = []
            for k, f in enumerate(x):
                turns += [{"from": "human", "value": user_text(f, k)}, {"from": "gpt", "value": f"old answer {k}"}]
            lines.append(json.dumps({"id": f"r{i}", "keep": {"nested": [i]}, "conversations": turns}))
    path.write_text("\n".join(lines) + "\n")
    return lines


def _read(out: Path, sub: str) -> list[dict]:
    return [json.loads(line) for f in sorted((out / sub).glob("part-*.jsonl")) for line in f.read_text().splitlines()]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(row_spec, min_size=1, max_size=12), mode=st.sampled_from(["all", "last"]),
       per_part=st.integers(1, 5), in_flight=st.integers(1, 6), order=st.none() | st.integers(0, 2**16))
def test_every_row_has_exactly_its_outcome(tmp_path_factory, tiny, specs, mode, per_part, in_flight, order):
    """Each row's outcome and record are the ones it was built to have, in source order, whatever the
    bound on requests in flight and the order the engine answers in (``order``: a seed of
    :class:`Unordered`; None: every request at once, as HF)."""
    from transformers import AutoTokenizer

    model, _ = tiny
    tok = AutoTokenizer.from_pretrained(model)
    work = tmp_path_factory.mktemp("acct")
    src = work / "chats.jsonl"
    lines = _write(src, specs)
    cfg = RegenerateConfig(out=str(work / "out"), model=str(model), data=str(src), mode=mode, max_new_tokens=8,
                           max_length=MAX_LENGTH, rows_per_part=per_part, batch_size=in_flight, progress=False)
    man = run_regenerate(cfg, generator=Scripted(tok) if order is None else Unordered(tok, order), tokenizer=tok)
    data, rejects = _read(work / "out", DATA_DIR), _read(work / "out", REJECTS_DIR)

    assert man["complete"] and man["input_rows"] == len(specs)
    assert man["regenerated"] + man["failed"] + man["skipped"] == len(specs)
    rows = [d["regeneration"]["row"] for d in data] + [r["row"] for r in rejects]
    assert sorted(rows) == list(range(len(specs)))  # each row exactly once
    assert [d["regeneration"]["row"] for d in data] == sorted(d["regeneration"]["row"] for d in data)
    by_row = {d["regeneration"]["row"]: d for d in data}
    rej = {r["row"]: r for r in rejects}
    for i, (kind, x) in enumerate(specs):
        if kind == "bad":
            want = ("skipped", x, 0)
        elif kind == "tool":
            want = ("skipped", "tool_call_turn" if mode == "last" else "no_regenerable_turn", 0)
        else:
            want = (expect_all if mode == "all" else expect_last)(x)
        if want[0] != "regenerated":
            assert (rej[i]["outcome"], rej[i]["reason"]) == want[:2], (i, x, rej[i])
            continue
        rec, src_rec = dict(by_row[i]), json.loads(lines[i])
        meta = rec.pop("regeneration")
        n = want[2]
        turns = [2 * k + 1 for k in range(n)] if mode == "all" else [2 * len(x) - 1]
        assert meta["turns"] == turns and meta["finish"] == ["stop"] * len(turns)
        assert meta.get("cut_at_max_length", False) == (mode == "all" and "LONG" in x)
        assert rec["id"] == f"r{i}" and rec["keep"] == {"nested": [i]}
        kept = src_rec["conversations"][:2 * n] if meta.get("cut_at_max_length") else src_rec["conversations"]
        assert len(rec["conversations"]) == len(kept)
        for j, (new, old) in enumerate(zip(rec["conversations"], kept)):
            if j in turns:
                assert new["value"] == f"reply {meta['prompt_tokens'][turns.index(j)]}"
            else:
                assert new == old
    assert sum(man["reasons"].values()) == man["failed"] + man["skipped"]
    assert man["finish"].get("stop", 0) == sum(len(d["regeneration"]["turns"]) for d in data)


@given(gen=st.lists(st.integers(0, 9), max_size=30), stops=st.frozensets(st.integers(0, 9), max_size=3),
       budget=st.integers(1, 40))
def test_finish_of(gen, stops, budget):
    r = finish_of(gen, stops, budget)
    first = next((k for k, t in enumerate(gen) if t in stops), None)
    if first is not None and first < budget:
        assert (r.finish, r.token_ids, r.num_generated) == ("stop", gen[:first], first + 1)
    else:
        assert r.finish == "length" and r.token_ids == gen[:budget] and not set(r.token_ids) & stops


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@given(reasoning=text.filter(lambda s: "</think>" not in s and s.strip("\n") == s and s.strip()),
       content=text.filter(lambda s: "</think>" not in s and s.lstrip("\n") == s))
def test_split_reply_inverts_the_think_block(reasoning, content):
    """The reply ``<think>\\nR\\n</think>\\n\\nC`` that a thinking template renders back from
    ``reasoning_content=R, content=C`` splits into exactly R and C."""
    out = split_reply(f"<think>\n{reasoning}\n</think>\n\n{content}", True)
    assert out == {"reasoning_content": reasoning, "content": content}
    assert split_reply(content, True) == {"content": content}
    assert split_reply(f"x</think>{content}", False) == {"content": f"x</think>{content}"}


def test_incomplete_regeneration_is_refused_by_extract(tiny, tmp_path):
    from transformers import AutoTokenizer

    from eagle_data.extract.sources import resolve

    model, data = tiny
    tok = AutoTokenizer.from_pretrained(model)
    out = tmp_path / "out"
    run_regenerate(RegenerateConfig(out=str(out), model=str(model), data=str(data), rows_per_part=4,
                                    max_length=MAX_LENGTH, world_size=2, rank=0, progress=False), generator=Scripted(tok), tokenizer=tok)
    assert not (out / MANIFEST).exists()
    with pytest.raises(ValueError, match="in progress"):
        resolve(str(out))
    man = run_regenerate(RegenerateConfig(out=str(out), model=str(model), data=str(data), rows_per_part=4,
                                          max_length=MAX_LENGTH, world_size=2, rank=1, progress=False), generator=Scripted(tok), tokenizer=tok)
    assert man["complete"] and man["input_rows"] == 26 and man["regenerated"] == 24
    files = resolve(str(out))[1]["data_files"]
    assert files == sorted(files) and len(files) == 7  # parts of both ranks, in source order


class Thinking(Scripted):
    """Replies like a thinking model: ``<think>\\nwhy N\\n</think>\\n\\nanswer N``."""

    def generate(self, prompts, budgets, seeds):
        return [finish_of(self.tok.encode(f"<think>\nwhy {len(p)}\n</think>\n\nanswer {len(p)}",
                                          add_special_tokens=False) + [self.eot], frozenset([self.eot]), b)
                for p, b in zip(prompts, budgets)]


def test_thinking_replies_round_trip_through_a_thinking_template(tmp_path):
    """Qwen3's template: a regenerated ``<think>`` reply is stored as reasoning_content + content,
    the next turn's prompt drops the earlier reasoning (as the template does when serving), and
    extraction supervises exactly what the model wrote in the last turn (reasoning included) and
    the content of the earlier one."""
    from templates import TEMPLATES_DIR, family_tokenizer
    from tiny import tiny_llama

    from eagle_data.extract.config import ExtractConfig
    from eagle_data.extract.run import run_extract
    from eagle_data.format.schema import sample_key
    from eagle_data.tools.read_samples import read_samples

    model = tmp_path / "model"
    tok = family_tokenizer(TEMPLATES_DIR / "qwen3.jinja")
    tiny_llama(vocab=len(tok)).save_pretrained(model)
    tok.save_pretrained(model)
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "q one"},
                                            {"role": "assistant", "content": "old one", "reasoning_content": "old"},
                                            {"role": "user", "content": "q two"},
                                            {"role": "assistant", "content": "old two"}]}) + "\n")
    gen = Thinking(tok)
    gen.eot = tok.convert_tokens_to_ids("<|im_end|>")
    man = run_regenerate(RegenerateConfig(out=str(tmp_path / "r"), model=str(model), data=str(src), progress=False),
                         generator=gen, tokenizer=tok)
    assert man["regenerated"] == 1
    rec = _read(tmp_path / "r", DATA_DIR)[0]
    (p1, p2) = rec["regeneration"]["prompt_tokens"]
    m = rec["messages"]
    assert (m[1]["reasoning_content"], m[1]["content"]) == (f"why {p1}", f"answer {p1}")
    assert (m[3]["reasoning_content"], m[3]["content"]) == (f"why {p2}", f"answer {p2}")
    run_extract(ExtractConfig(out=str(tmp_path / "ds"), model=str(model), data=str(tmp_path / "r"), dtype="float32",
                              aux_layer_ids=[1, 3, 5], dataset_tag="t", progress=False))
    s = read_samples(tmp_path / "ds", [sample_key("t", 0)])[sample_key("t", 0)]
    ids, mask = s["input_ids"].tolist(), s["loss_mask"].tolist()
    runs, cur = [], []
    for t, on in zip(ids + [None], mask + [0]):
        if on:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    assert runs == [f"answer {p1}<|im_end|>", f"<think>\nwhy {p2}\n</think>\n\nanswer {p2}<|im_end|>"]
    fed = tok.apply_chat_template(m[:3], tokenize=False, add_generation_prompt=True)  # turn 2's prompt
    assert "why" not in fed and f"answer {p1}" in fed and len(tok(fed, add_special_tokens=False)["input_ids"]) == p2


def _run(tiny, out, data=None, gen=None, **kw):
    from transformers import AutoTokenizer

    model, default = tiny
    tok = AutoTokenizer.from_pretrained(model)
    c = RegenerateConfig(out=str(out), model=str(model), data=str(data or default), max_length=MAX_LENGTH,
                         rows_per_part=5, progress=False, **kw)
    return run_regenerate(c, generator=gen or Scripted(tok), tokenizer=tok)


def _listing(out: Path) -> dict[str, bytes]:
    return {str(f.relative_to(out)): f.read_bytes() for f in sorted(out.rglob("*")) if f.is_file()}


def test_every_rank_must_use_the_same_settings(tiny, tmp_path):
    out = tmp_path / "o"
    _run(tiny, out, world_size=2, rank=0, max_new_tokens=16)
    with pytest.raises(ValueError, match="rank 0 ran there with other settings .*max_new_tokens"):
        _run(tiny, out, world_size=2, rank=1, max_new_tokens=4)
    done = tmp_path / "done"
    _run(tiny, done)
    before = _listing(done)
    with pytest.raises(ValueError, match="world_size"):  # would re-own rank 0's parts
        _run(tiny, done, world_size=2, rank=1)
    assert _listing(done) == before


def test_parts_that_no_progress_file_lists_are_never_deleted(tiny, tmp_path):
    import shutil

    src = tmp_path / "src"
    _run(tiny, src)
    for name, why in (("copy", "published copy"), ("parts_only", "no progress file lists")):
        dst = tmp_path / name
        shutil.copytree(src, dst)
        for f in dst.glob("progress-*.json"):
            f.unlink()
        if name == "parts_only":
            (dst / MANIFEST).unlink()
        before = _listing(dst)
        with pytest.raises(ValueError, match=why):
            _run(tiny, dst)
        assert _listing(dst) == before


@pytest.mark.parametrize("change", ["delete", "edit", "cut", "add"])
def test_extract_refuses_parts_changed_by_hand(tiny, tmp_path, change):
    from eagle_data.extract.sources import resolve

    out = tmp_path / "o"
    _run(tiny, out)
    part = sorted((out / DATA_DIR).iterdir())[1]
    if change == "delete":
        part.unlink()
    elif change == "edit":
        part.write_text(part.read_text().replace("reply", "Reply", 1))
    elif change == "cut":
        part.write_bytes(part.read_bytes()[:-30])
    else:
        (out / DATA_DIR / "part-000000099-000000100.jsonl").write_text(part.read_text())
    with pytest.raises(ValueError, match="changed by hand"):
        resolve(str(out))


def test_a_changed_source_is_refused_before_any_new_work(tiny, tmp_path):
    model, data = tiny
    src = tmp_path / "c.jsonl"
    lines = data.read_text().splitlines()
    src.write_text("\n".join(lines[:10]) + "\n")
    out = tmp_path / "o"
    _run(tiny, out, data=src)
    before = _listing(out)
    src.write_text("\n".join([lines[0].replace("c0", "c0-edited")] + lines[1:]) + "\n")
    from transformers import AutoTokenizer

    gen = Scripted(AutoTokenizer.from_pretrained(model))
    with pytest.raises(ValueError, match=r"changed since rows \[0, 5\)"):
        _run(tiny, out, data=src, gen=gen)
    assert gen.calls == 0 and _listing(out) == before


def test_out_inside_the_data_folder_is_refused(tiny, tmp_path):
    (tmp_path / "chats").mkdir()
    (tmp_path / "chats" / "a.jsonl").write_text(tiny[1].read_text())
    for out in (tmp_path / "chats", tmp_path / "chats" / "regen"):
        with pytest.raises(ValueError, match="overlap"):
            _run(tiny, out, data=tmp_path / "chats")


def test_length_replies_reject(tiny, tmp_path):
    """A reply that ran out of tokens fails the row (or, after a regenerated turn in mode "all",
    cuts the record before it) instead of being kept."""
    src = tmp_path / "c.jsonl"
    two = {"conversations": [{"from": "human", "value": "short"}, {"from": "gpt", "value": "a"},
                             {"from": "human", "value": "VERBOSE"}, {"from": "gpt", "value": "b"}]}
    one = {"conversations": [{"from": "human", "value": "VERBOSE"}, {"from": "gpt", "value": "b"}]}
    src.write_text(json.dumps(two) + "\n" + json.dumps(one) + "\n")
    keep = _run(tiny, tmp_path / "keep", data=src, max_new_tokens=8)
    assert keep["finish"] == {"length": 2, "stop": 1} and keep["regenerated"] == 2
    rej = _run(tiny, tmp_path / "rej", data=src, max_new_tokens=8, length_replies="reject")
    assert (rej["regenerated"], rej["failed"], rej["reasons"]) == (1, 1, {"reply_at_length": 1})
    assert rej["notes"] == {"cut_at_length": 1} and rej["finish"] == {"stop": 1}
    rec = _read(tmp_path / "rej", DATA_DIR)[0]
    assert len(rec["conversations"]) == 2 and rec["regeneration"]["turns"] == [1]
    assert _read(tmp_path / "rej", REJECTS_DIR)[0]["row"] == 1


def test_a_row_extraction_would_skip_is_skipped_with_its_reason(tiny, tmp_path):
    """The tiny model's template (SmolLM2's) does not render tool calls: a regenerated
    conversation holding one is skipped here as extraction would (tool_calls_not_rendered)."""
    src = tmp_path / "c.jsonl"
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    src.write_text(json.dumps({"messages": [
        {"role": "user", "content": "weather in Paris?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "name": "get_weather"},
        {"role": "assistant", "content": "It is sunny."}]}) + "\n")
    man = _run(tiny, tmp_path / "o", data=src)
    assert (man["regenerated"], man["skipped"], man["reasons"]) == (0, 1, {"tool_calls_not_rendered": 1})
    assert _read(tmp_path / "o", REJECTS_DIR)[0]["detail"].startswith("extraction would skip it")


@pytest.mark.parametrize("mode", ["all", "last"])
def test_a_row_with_no_trained_turn_is_skipped_as_extraction_would(tiny, tmp_path, mode):
    """Such rows were regenerated, then skipped by extraction (no_loss_tokens): the two disagreed."""
    from eagle_data.extract.config import ExtractConfig
    from eagle_data.extract.run import run_extract

    def rec(w1, w2):
        return {"conversations": [{"from": "human", "value": "question 1"}, {"from": "gpt", "value": "a", "weight": w1},
                                  {"from": "human", "value": "question 2"}, {"from": "gpt", "value": "b", "weight": w2}]}

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(rec(*w)) + "\n" for w in [(0, 0), (0, 1), (1, 0)]))
    man = _run(tiny, tmp_path / "o", data=src, mode=mode)
    assert (man["regenerated"], man["skipped"], man["reasons"]) == (2, 1, {"no_loss_tokens": 1})
    assert _read(tmp_path / "o", REJECTS_DIR)[0]["row"] == 0
    m = run_extract(ExtractConfig(model=str(tiny[0]), data=str(tmp_path / "o"), out=str(tmp_path / "x"),
                                  dtype="float32", progress=False))
    assert m["num_samples"] == 2 and m["skip_counts"] == {}


def test_cli_errors_for_an_empty_source_and_an_extract_into_a_regeneration(tiny, tmp_path, capsys):
    from eagle_data.cli import main as cli

    model, data = tiny
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit) as e:
        cli.main(["regenerate", "--out", str(tmp_path / "e"), "--model", str(model), "--data", str(empty),
                  "--progress", "false"])
    assert e.value.code == 2 and "has no rows" in " ".join(capsys.readouterr().err.split())
    out = tmp_path / "o"
    _run(tiny, out)
    with pytest.raises(SystemExit) as e:
        cli.main(["extract", "--out", str(out), "--model", str(model), "--data", str(data)])
    assert e.value.code == 2 and "output of `eagle-data regenerate`" in " ".join(capsys.readouterr().err.split())


def test_a_rerun_deletes_only_the_part_it_was_writing(tiny, tmp_path):
    """A crash between writing a part and listing it leaves that one part: a rerun removes it and
    redoes it. Any other unlisted part file (added by hand) is refused, and nothing is deleted."""
    out = tmp_path / "o"
    _run(tiny, out, num_samples=10)  # parts [0, 5), [5, 10)
    prog = json.loads((out / "progress-00000.json").read_text())
    last = prog["parts"].pop()
    (out / "progress-00000.json").write_text(json.dumps(prog))  # as if killed before listing [5, 10)
    man = _run(tiny, out, num_samples=10)
    assert man["complete"] and man["run_stats"]["rows"] == 5 and man["input_rows"] == 10
    for stray in ("part-000000013-000000014.jsonl", "part-000000020-000000025.jsonl"):
        (out / DATA_DIR / stray).write_text("{}\n")
        before = _listing(out)
        with pytest.raises(ValueError, match="not the part this rank was writing"):
            _run(tiny, out, num_samples=10)
        assert _listing(out) == before
        (out / DATA_DIR / stray).unlink()
    assert last["end"] == 10


def test_refused_settings_write_nothing(tiny, tmp_path):
    with pytest.raises(ValueError, match="stop_tokens"):
        _run(tiny, tmp_path / "o", stop_tokens=["hello world, not a token"])
    assert not (tmp_path / "o").exists()


def test_requests_in_flight_default_per_engine_and_are_checked(tmp_path):
    """HF's left-padded batches stay small by default; SGLang's continuous batching gets enough to
    fill a GPU (with 32 it idled)."""
    mk = lambda **kw: RegenerateConfig(out=str(tmp_path / "o"), data=str(tmp_path / "d.jsonl"), **kw)  # noqa: E731
    assert (mk().batch_size, mk(backend="sglang").batch_size, mk(backend="sglang", batch_size=8).batch_size) == (32, 1024, 8)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        mk(batch_size=0)


def test_extract_warns_on_another_template_or_a_shorter_max_length(tiny, tmp_path, caplog):
    from eagle_data.extract.config import ExtractConfig
    from eagle_data.extract.run import run_extract

    model, _ = tiny
    out = tmp_path / "o"
    _run(tiny, out)
    with caplog.at_level("WARNING"):
        run_extract(ExtractConfig(out=str(tmp_path / "ds"), model=str(model), data=str(out), dtype="float32",
                                  aux_layer_ids=[1, 3, 5], max_length=MAX_LENGTH - 1, chat_template="qwen2_5",
                                  progress=False))
    text = caplog.text
    assert "another chat template" in text and "truncates at 399" in text and "another model" not in text


def test_a_parquet_source_with_date_and_bytes_columns_is_kept_whole(tiny, tmp_path):
    """A timestamp column crashed the part's write after generation (datetime is not JSON), and a
    rerun crashed again; such values are written as ISO / base64 text, the chat untouched."""
    import datetime as dt

    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "c.parquet"
    when = dt.datetime(2026, 12, 3, 10, 0, 0)
    pq.write_table(pa.Table.from_pylist([{"id": "a", "created": when, "blob": b"\x00\xff", "conversations": [
        {"from": "human", "value": "question 1"}, {"from": "gpt", "value": "old"}]}]), src)
    man = _run(tiny, tmp_path / "o", data=src)
    assert (man["regenerated"], man["failed"], man["skipped"]) == (1, 0, 0)
    rec = _read(tmp_path / "o", DATA_DIR)[0]
    assert rec["created"] == "2026-12-03T10:00:00" and rec["blob"] == "AP8="
    assert rec["conversations"][0] == {"from": "human", "value": "question 1"}
    assert rec["conversations"][1]["value"].startswith("reply ")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.sampled_from(list("ab é€😀\n")), min_size=1, max_size=12), data=st.data())
def test_a_reply_is_the_text_the_model_wrote_or_fails_named(tiny, text, data):
    """A reply cut by the budget mid-character used to be stored with U+FFFD, which extraction
    re-tokenises into other tokens: the cut now loses only that character (the text is a prefix
    of the whole reply's); U+FFFD otherwise, or an id with no text, fails the row with its reason."""
    from transformers import AutoTokenizer

    from eagle_data.regen.regenerator import reply_text

    tok = AutoTokenizer.from_pretrained(tiny[0])
    ids = tok.encode(text, add_special_tokens=False)
    k = data.draw(st.integers(1, len(ids)))
    got_ids, got, why = reply_text(tok, Reply(ids[:k], "length", k))
    assert why is None and "\ufffd" not in got and text.startswith(got) and got_ids == ids[:len(got_ids)]
    assert k - len(got_ids) <= 3
    _, got, why = reply_text(tok, Reply(ids[:k], "stop", k + 1))
    assert (why is None and got == tok.decode(ids[:k])) or (why[0] == "invalid_utf8_reply" and "\ufffd" in got)
    assert (why is None) is text.startswith(got)
    assert reply_text(tok, Reply(ids + [len(tok)], "stop", k))[2][0] == "token_id_out_of_range"
    real = tok.encode(text + "\ufffd", add_special_tokens=False)  # the model's own U+FFFD character is text
    assert reply_text(tok, Reply(real, "stop", len(real))) == (real, text + "\ufffd", None)


def test_a_reply_is_written_back_under_the_turns_own_text_key(tiny, tmp_path):
    """A {"role", "content"} turn under "conversations" is read with its own keys; its reply must
    replace its "content" (a "value" beside it would leave extraction reading the old text)."""
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"conversations": [{"role": "user", "content": "question 1"},
                                                 {"role": "assistant", "content": "old"}]}) + "\n"
                   + json.dumps({"conversations": [{"from": "human", "value": "question 2"},  # both keys, one meaning
                                                   {"from": "gpt", "role": "assistant", "value": "old", "content": "old"}]})
                   + "\n")
    assert _run(tiny, tmp_path / "o", data=src)["regenerated"] == 2
    a, b = (r["conversations"][1] for r in _read(tmp_path / "o", DATA_DIR))
    assert set(a) == {"role", "content"} and a["content"].startswith("reply ")
    assert b["value"] == b["content"] and b["value"].startswith("reply ")  # no stale copy left beside it


def test_a_weight_0_turn_stays_untrained_after_regeneration(tiny, tmp_path):
    """apply_reply dropped the turn's train flag: a record cut after a regenerated weight-0 turn was
    reported regenerated, then skipped by extraction (no_loss_tokens)."""
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps({"conversations": [
        {"from": "human", "value": "question 1"}, {"from": "gpt", "value": "a", "weight": 0},
        {"from": "human", "value": LONG}, {"from": "gpt", "value": "b"}]}) + "\n")
    man = _run(tiny, tmp_path / "o", data=src, mode="all")
    assert (man["regenerated"], man["skipped"]) == (0, 1) and man["reasons"] == {"no_loss_tokens": 1}


class Pooled(Scripted):
    """:class:`Scripted` that says how many tokens its KV pool holds."""

    def __init__(self, tok, pool: int, device: str = "cuda"):
        super().__init__(tok)
        self.pool, self.device = pool, device

    def describe(self):
        return {"engine": "scripted", "kv_pool_tokens": self.pool, "device": self.device}


def test_a_small_kv_pool_and_the_progress_are_in_the_log(tiny, tmp_path, caplog, monkeypatch):
    """2026-12-07: two of three SGLang engines on one GPU got almost no KV pool and their ranks ran
    for minutes without a line in their logs (BENCHMARKS.md)."""
    import re

    import eagle_data.regen.regenerator as rg
    from transformers import AutoTokenizer

    monkeypatch.setattr(rg, "REPORT_EVERY_S", 0.0)
    tok = AutoTokenizer.from_pretrained(tiny[0])
    with caplog.at_level("INFO"):
        man = _run(tiny, tmp_path / "a", gen=Pooled(tok, 4 * MAX_LENGTH - 1), batch_size=8)
    assert ("the engine's KV pool holds 1599 tokens, under half of the 3200 that --batch_size 8 requests of up to "
            f"--max_length {MAX_LENGTH} tokens may hold") in caplog.text
    assert man["progress"]["engine"]["kv_pool_tokens"] == 1599
    lines = [re.fullmatch(r"rank 0: (\d+) part\(s\) published, (\d+) open.*, (\d+) request\(s\) in flight; "
                          r"(\d+) new tokens in .*", r.getMessage()) for r in caplog.records
             if "part(s) published" in r.getMessage()]
    assert lines and all(lines)
    published, tokens = [int(m[1]) for m in lines], [int(m[4]) for m in lines]
    assert published == sorted(published) and tokens == sorted(tokens)
    assert published[0] == 0 and tokens[-1] == man["run_stats"]["tokens_generated"] > 0
    assert published[-1] == len(man["progress"]["parts"]) and " 0 open, 0 request(s) in flight" in lines[-1][0]
    assert all(int(m[3]) <= 8 for m in lines)
    caplog.clear()
    with caplog.at_level("INFO"):
        _run(tiny, tmp_path / "b", gen=Pooled(tok, 4 * MAX_LENGTH), batch_size=8)
        _run(tiny, tmp_path / "c", gen=Pooled(tok, 10, device="cpu"), batch_size=8)  # CPU: a fixed pool
    assert "KV pool" not in caplog.text
    for r, pool in ((1, 20), (0, 10)):  # each rank's pool in the manifest, not only the first's
        man = _run(tiny, tmp_path / "d", gen=Pooled(tok, pool), rank=r, world_size=2)
    assert man["complete"] and man["kv_pool_tokens"] == [10, 20]


def test_sglang_collect_comes_back_after_its_timeout_while_no_reply_is_ready():
    """The run's progress line is written between collects: an engine that answers nothing must not
    keep the run from saying so."""
    import asyncio
    import time
    from types import SimpleNamespace

    from eagle_data.regen.engines import SGLangGenerator

    async def never(**kw):
        await asyncio.sleep(3600)

    async def soon(**kw):
        await asyncio.sleep(0.01)
        return {"output_ids": [5, 2], "meta_info": {"finish_reason": {"type": "stop"}}}

    gen = object.__new__(SGLangGenerator)  # the engine faked: only submit/collect run
    gen.engine = SimpleNamespace(loop=asyncio.new_event_loop(), async_generate=never)
    gen.stop_ids, gen.temperature, gen.top_p, gen.top_k = frozenset([2]), 0.0, 1.0, -1
    gen._asked, gen._ready, gen._wake = {}, [], None
    try:
        gen.submit(1, [1, 2, 3], 8, 0)
        t0 = time.perf_counter()
        assert gen.collect(0.2) == [] and 0.2 <= time.perf_counter() - t0 < 3
        gen.engine.async_generate = soon
        gen.submit(2, [1], 8, 0)
        (tag, reply), = gen.collect(10)
        assert tag == 2 and reply.error is None and reply.finish == "stop" and list(gen._asked.values()) == [(1, 8)]
    finally:
        for t in gen._asked:
            t.cancel()
        gen.engine.loop.run_until_complete(asyncio.sleep(0))
        gen.engine.loop.close()
