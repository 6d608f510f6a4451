"""``eagle-data regenerate`` accounting, over generated input: every source row ends in exactly one
outcome (regenerated / failed / skipped) with the reason the row was built to have, the counts
sum to the input, and a regenerated record is the source record with only the regenerated turns
replaced. The engine is scripted (its reply depends on a marker in the prompt's last user
message), so the outcomes are known in advance; the real engines are tested in
test_regenerate.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_data.regen.config import RegenerateConfig
from eagle_data.regen.engines import finish_of
from eagle_data.regen.plan import Reply, split_reply
from eagle_data.regen.run import run_regenerate
from eagle_data.format.regen_layout import DATA_DIR, MANIFEST, REJECTS_DIR

MAX_LENGTH = 400
LONG = "lorem " * 450  # > MAX_LENGTH tokens on its own


class Scripted:
    """A :class:`~eagle_data.regen.engines.Generator` whose reply is set by the last user message:
    ``ERR`` -> engine error, ``EMPTY`` -> blank reply, ``SPECIAL`` -> a special token's text,
    else ``"reply N"`` (N = prompt length), ended by the end-of-turn token."""

    def __init__(self, tok):
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
            text = "" if "EMPTY" in last else "a<|im_start|>b" if "SPECIAL" in last else f"reply {len(p)}"
            out.append(finish_of(self.tok.encode(text, add_special_tokens=False) + [self.eot],
                                 frozenset([self.eot]), b))
        return out

    def describe(self):
        return {"engine": "scripted"}

    def close(self):
        pass


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
       per_part=st.integers(1, 5))
def test_every_row_has_exactly_its_outcome(tmp_path_factory, tiny, specs, mode, per_part):
    from transformers import AutoTokenizer

    model, _ = tiny
    tok = AutoTokenizer.from_pretrained(model)
    work = tmp_path_factory.mktemp("acct")
    src = work / "chats.jsonl"
    lines = _write(src, specs)
    cfg = RegenerateConfig(out=str(work / "out"), model=str(model), data=str(src), mode=mode, max_new_tokens=8,
                           max_length=MAX_LENGTH, rows_per_part=per_part, progress=False)
    man = run_regenerate(cfg, generator=Scripted(tok), tokenizer=tok)
    data, rejects = _read(work / "out", DATA_DIR), _read(work / "out", REJECTS_DIR)

    assert man["complete"] and man["input_rows"] == len(specs)
    assert man["regenerated"] + man["failed"] + man["skipped"] == len(specs)
    rows = [d["regeneration"]["row"] for d in data] + [r["row"] for r in rejects]
    assert sorted(rows) == list(range(len(specs)))  # each row exactly once
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
