"""Property test of the loss mask over every chat template in tests/chat_templates.

Generated multi-turn conversations (edge whitespace, very short answers, answers quoted in
later user turns and user text quoted in answers, role words, unicode, think blocks,
``reasoning_content``, tool calls) are tokenised by :class:`ChatRenderer`; an oracle that
shares nothing with :mod:`eagle_data.extract.mask` locates every message field in the render by a
*render diff*: the field's core is wrapped in two marker characters, the conversation is
rendered again, and the common prefix/suffix of the two renders bound the field. Properties:

(a) no token whose characters lie entirely inside a system/user/tool field is masked;
(b) every character of every rendered assistant field (content, reasoning, tool-call name) is
    masked, and so is the end-of-turn special token right after a plain answer;
(c) the masked tokens form exactly one run per assistant turn, which ends with the answer,
    whitespace and at most one special token, and starts at the answer or at template text
    of the turn itself (a think block, a channel header, a tool-call opener);
(d) nothing is skipped (the generated data is valid for every template), except tool calls on
    templates that cannot render them, which must be skipped with that named reason, and a
    tool-call turn's reasoning that the template drops;
(e) where the template has a generation prompt and the render of the messages before an
    assistant turn plus that prompt (what a server sends) is a prefix of the render, the turn's
    masked run starts with the token at the prompt's end: everything the model generates for
    the turn is supervised (a second tool call after a tool result included).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_data.extract.chat import ChatRenderer
from eagle_data.extract.mask import MaskError, NotRendered, ToolCallsNotRendered

from templates import family_tokenizer, template_files

TEMPLATES = template_files()
PER_TEMPLATE = int(os.environ.get("EAGLE_MASK_EXAMPLES", 70))  # 31 x 70 = 2170 conversations per run
RUN: dict[str, int] = {}
L, R = "\u2045", "\u2046"  # marker characters of the oracle (not special, not whitespace)

WORDS = ["a", "OK", "Sure", "ok", "assistant", "user", "system", "model", "You", "end", "im", "t", "id", "header",
         "Hello world", "The answer is 42.", "Café", "日本語のテキスト", "Ελληνικά", "🙂", "naïve", "x = 1", "def f():",
         "think", "tool", "json", "{\"a\": 1}", "Yes.", "No", "\\n", "'quoted'", "\"dq\"", "a\tb"]
WS = ["", "", "", " ", "\n", "\n\n", "  \n", "\t", " \n "]


@lru_cache(maxsize=None)
def renderer(stem: str) -> tuple[ChatRenderer, bool, bool]:
    """(renderer, template accepts a system message, template renders tool calls)."""
    path = next(p for p in TEMPLATES if p.stem == stem)
    r = ChatRenderer(family_tokenizer(path), name=stem)
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    try:
        system = "SYSPROBE" in r.render([{"role": "system", "content": "SYSPROBE"}, *base])
    except Exception:
        system = False
    try:
        call = {"type": "function", "function": {"name": "toolprobe", "arguments": {"q": "x"}}, "id": "call00009"}
        text = r.render([base[0], {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": "RESULTPROBE", "name": "toolprobe", "tool_call_id": "call00009"},
                         base[1]])
        tools = "toolprobe" in text and "RESULTPROBE" in text
    except Exception:
        tools = False
    return r, system, tools


@st.composite
def conversations(draw, system_ok: bool, tools_ok: bool):
    """Messages plus, per message, ``{field: (prefix, core, suffix)}`` with field == prefix+core+suffix."""
    said: list[str] = []

    def text():
        kind = draw(st.sampled_from(["word", "words", "quote", "quote+"]))
        if kind.startswith("quote") and said:
            core = draw(st.sampled_from(said))
            return core + (" " + draw(st.sampled_from(WORDS)) if kind == "quote+" else "")
        n = 1 if kind == "word" else draw(st.integers(1, 5))
        sep = draw(st.sampled_from([" ", "\n", ", ", "\n\n"]))
        return sep.join(draw(st.sampled_from(WORDS)) for _ in range(n))

    def field(core=None):
        core = (core or text()).strip() or "x"
        said.append(core)
        return (draw(st.sampled_from(WS)), core, draw(st.sampled_from(WS)))

    msgs, parts = [], []

    def add(role, **fields):
        m = {"role": role}
        for k, (a, c, b) in fields.items():
            m[k] = a + c + b
        msgs.append(m)
        parts.append(fields)

    if system_ok and draw(st.booleans()):
        add("system", content=field())
    def maybe_blank():  # blank user/tool text: the template's headers with nothing between them
        return (draw(st.sampled_from(WS)), "", "") if draw(st.integers(0, 6)) == 0 else field()

    for turn in range(draw(st.integers(1, 3))):
        add("user", content=maybe_blank())
        for chained in range(draw(st.integers(1, 2)) if tools_ok and draw(st.integers(0, 3)) == 0 else 0):
            name = draw(st.sampled_from(["get_weather", "search_web"]))
            cid = f"call{turn}{chained}000"
            call = {"type": "function", "function": {"name": name, "arguments": {"query": text()}}, "id": cid}
            if draw(st.integers(0, 3)) == 0:  # reasoning before the call
                add("assistant", content=("", "", ""), reasoning_content=field())
            else:
                add("assistant", content=("", "", ""))
            msgs[-1]["tool_calls"] = [call]
            parts[-1]["tool_name"] = ("", name, "")
            parts[-1]["tool_id"] = ("", cid, "")
            add("tool", content=maybe_blank())
            msgs[-1].update(name=name, tool_call_id=cid)
        style = draw(st.sampled_from(["plain", "plain", "reasoning_content", "inline_think", "reasoning_only"]))
        answer = field(draw(st.sampled_from(WORDS)) if draw(st.booleans()) else None)
        if style == "reasoning_only":  # no answer text: the turn ends in the template's </think> (if rendered)
            add("assistant", reasoning_content=field())
            msgs[-1]["content"] = ""
        elif style == "reasoning_content":
            add("assistant", content=answer, reasoning_content=field())
        elif style == "inline_think":
            a, c, b = field()
            head = f"<think>{a}{c}{b}</think>{draw(st.sampled_from(['', chr(10), chr(10) * 2]))}"
            add("assistant", content=(head + answer[0], answer[1], answer[2]))
            parts[-1]["reasoning_inline"] = (f"<think>{a}", c, f"{b}</think>")
        else:
            add("assistant", content=answer)
    return msgs, parts


def parts_of(msgs) -> list[dict]:
    """The oracle's field split for hand-written messages (content, reasoning_content)."""
    out = []
    for m in msgs:
        out.append({})
        for k in ("content", "reasoning_content"):
            if m.get(k, "").strip():
                v = m[k]
                core = v.strip()
                lead = v[:len(v) - len(v.lstrip())]
                out[-1][k] = (lead, core, v[len(lead) + len(core):])
    return out


def _wrap(msgs, i, key, parts):
    pre, core, suf = parts[i][key]
    m = dict(msgs[i])
    if key == "tool_name":
        m["tool_calls"] = [{**m["tool_calls"][0], "function": {**m["tool_calls"][0]["function"],
                                                               "name": L + core + R}}]
    elif key == "tool_id":
        m["tool_calls"] = [{**m["tool_calls"][0], "id": L + core + R}]
    elif key == "reasoning_inline":
        m["content"] = m["content"].replace(pre + core + suf, pre + L + core + R + suf, 1)
    else:
        m[key] = pre + L + core + R + suf
    return [*msgs[:i], m, *msgs[i + 1:]]


def locate(r: ChatRenderer, msgs, i, key, parts, base: str) -> list[tuple[int, int]]:
    """Oracle: every place where the field's core is rendered in ``base`` (render diff: each
    occurrence in the marked render is the core between the two markers; [] if not rendered)."""
    try:
        alt = r.render(_wrap(msgs, i, key, parts))
    except Exception:
        if key != "tool_id":
            raise
        return []  # Mistral checks ids (9 alphanumerics): the name locates those calls
    core = parts[i][key][1]
    out, shift, a = [], 0, alt.find(L)
    while a >= 0:
        b = alt.index(R, a)
        assert alt[a + 1:b] in (core, json.dumps(core, ensure_ascii=False)[1:-1]), (msgs[i], key, alt[a:b])
        out.append((a - shift, b - 1 - shift))
        shift += 2
        a = alt.find(L, b)
    assert len(alt) - shift == len(base) and all(base[x:y] == alt[x + 1 + 2 * k:y + 1 + 2 * k]
                                                 for k, (x, y) in enumerate(out))
    return out


def check(stem: str, msgs, parts) -> None:
    r, _, _ = renderer(stem)
    try:
        text = r.render(msgs)
    except NotRendered:  # legitimate only for a tool-call turn's reasoning that has no place in the template:
        # it reads no reasoning field and a text put in that turn's content is not rendered with the calls
        calls = [i for i, m in enumerate(msgs) if m.get("tool_calls") and m.get("reasoning_content", "").strip()]
        assert calls, "render refused messages with no reasoning on a tool-call turn"
        probe = [dict(m) for m in msgs]
        for i in calls:
            del probe[i]["reasoning_content"]
            probe[i]["content"] = L + "MARK" + R
            call = probe[i]["tool_calls"][0]
            probe[i]["tool_calls"] = [{**call, "function": {**call["function"], "name": L + "CALL" + R}}]
        for i in calls:
            out = r.render(probe[:i + 1])
            assert not (L + "MARK" + R in out and L + "CALL" + R in out)
        with pytest.raises(NotRendered):
            r.tokenize(msgs)
        return
    try:
        ids, mask = r.tokenize(msgs)
    except ToolCallsNotRendered:
        pytest.fail("tool calls are rendered by this template (probe) but were skipped")
    except NotRendered as e:  # legitimate only for a turn whose every field the template drops,
        # or a tool-call turn's reasoning the template drops (with the rest of that turn's text)
        lost = [i for i, (m, f) in enumerate(zip(msgs, parts)) if m["role"] == "assistant"
                and (not any(locate(r, msgs, i, k, parts, text) for k in f if f[k][1])
                     or ("tool_calls" in m and f.get("reasoning_content", ("", "", ""))[1]
                         and not locate(r, msgs, i, "reasoning_content", parts, text)))]
        assert lost, f"skipped as {e.reason} but the oracle finds every turn rendered: {e}"
        return
    except MaskError as e:
        pytest.fail(f"skipped as {e.reason}: {e}")
    enc = r.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert enc["input_ids"] == ids.tolist()
    off = enc["offset_mapping"]
    masked = mask.bool().tolist()
    specials = set(r.tokenizer.all_special_tokens)
    runs, cur = [], None
    for t, ((a, b), m) in enumerate(zip(off, masked)):
        if m and cur is None:
            cur = [a, b]
        elif m:
            cur[1] = b
        elif cur is not None:
            runs.append(tuple(cur))
            cur = None
    if cur is not None:
        runs.append(tuple(cur))
    turns, starts = [], []
    for i, (m, fields) in enumerate(zip(msgs, parts)):
        where = {k: locate(r, msgs, i, k, parts, text) for k in fields if fields[k][1]}
        if m["role"] != "assistant":
            for k, regs in where.items():  # (a)
                assert regs, f"{m['role']} {k} not rendered"
                for reg in regs:
                    bad = [t for t, ((a, b), mm) in enumerate(zip(off, masked)) if mm and reg[0] <= a and b <= reg[1]]
                    assert not bad, f"(a) {m['role']} text masked: {text[reg[0]:reg[1]]!r}"
            continue
        # the turn's own rendering is the first; a later one is an echo in another message (gpt-oss tool name)
        where = {k: regs[0] for k, regs in where.items() if regs}
        regs = list(where.values())
        assert regs, "assistant turn not rendered"
        for reg in regs:  # (b)
            cov = [mm for (a, b), mm in zip(off, masked) if a < reg[1] and b > reg[0]]
            assert cov and all(cov), f"(b) assistant text not masked: {text[reg[0]:reg[1]]!r}"
        turns.append((min(a for a, _ in regs), max(b for _, b in regs), where, "tool_calls" in m))
        starts.append(served_prompt_end(r, msgs[:i], text))
    assert len(runs) == len(turns), f"(c) {len(runs)} masked runs for {len(turns)} assistant turns: " + \
        repr([text[a:b] for a, b in runs])
    for (ra, _), p in zip(runs, starts):  # (e)
        if p is not None:
            first = next(a for (a, b), mm in zip(off, masked) if mm and b > p - 1 and a >= ra)
            at_p = next(a for a, b in off if b > p)
            assert first == at_p, f"(e) the run starts at {text[first:first + 30]!r}, the served prompt ends " \
                                  f"before {text[p:p + 30]!r}"
    for (ra, rb), (fa, fb, where, tool) in zip(runs, turns):  # (c)
        assert ra <= fa and fb <= rb
        head, tail = text[ra:fa], text[fb:rb]
        assert not head.strip() or any(w in head for w in ("think", "channel", "tool", "to=functions", "{", "[")), \
            f"(c) run starts in template text: {head!r}"
        if not tool:  # the run ends with the answer, [a closing </think>,] the end-of-turn token
            body = tail.strip()
            eot = next((s for s in sorted(specials, key=len, reverse=True) if body.endswith(s)), "")
            assert body[:len(body) - len(eot)].strip() in ("", "</think>"), f"(c) run ends with {tail!r}"
            nxt = text[fb:].lstrip().removeprefix("</think>").lstrip()
            after = next((s for s in sorted(specials, key=len, reverse=True) if nxt.startswith(s)), None)
            if after is not None:
                assert eot == after, f"(b) end-of-turn {after!r} after the answer is not masked"


def served_prompt_end(r: ChatRenderer, head, text: str) -> int | None:
    """End of the prompt a server renders for the turn after ``head`` (``add_generation_prompt``)
    when the template has a generation prompt and ``text`` starts with that prompt; else None."""
    if not r.markers.prompt:
        return None
    try:
        p = r.render(head, add_generation_prompt=True)
    except Exception:
        return None
    return len(p) if text.startswith(p) else None


@pytest.mark.parametrize("stem", [p.stem for p in TEMPLATES])
def test_mask_properties_on_generated_conversations(stem):
    _, system_ok, tools_ok = renderer(stem)

    @settings(max_examples=PER_TEMPLATE, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(conversations(system_ok, tools_ok))
    def prop(conv):
        RUN[stem] = RUN.get(stem, 0) + 1
        check(stem, *conv)

    prop()


def test_property_run_covered_every_template_with_2000_conversations():
    if len(RUN) < len(TEMPLATES):
        pytest.skip("run together with the whole module")
    assert len(TEMPLATES) >= 31 and sum(RUN.values()) >= 2000, RUN


@pytest.mark.parametrize("stem", ["qwen3", "llama3_1_instruct", "gemma3_it", "deepseek_v3", "gpt_oss"])
def test_grouped_tokenisation_equals_one_call_per_conversation(stem, monkeypatch):
    """The pipeline's stage tokenises a group of conversations in one tokenizer call: over
    generated conversations, some with a special token typed into a user message and some cut
    by ``max_length``, it yields exactly the samples (ids, mask, truncation) and skips (reasons,
    in row order) of encoding each conversation alone."""
    import eagle_data.extract.stages as stages
    from eagle_data.extract.conversations import Conversation
    from eagle_data.extract.fault import ErrorPolicy

    if not any(p.stem == stem for p in TEMPLATES):
        pytest.skip(f"no template {stem}")
    r, system_ok, tools_ok = renderer(stem)
    special = r._specials[0]

    @settings(max_examples=12, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(st.tuples(conversations(system_ok, tools_ok), st.integers(0, 4)), min_size=1, max_size=9),
           st.integers(1, 4), st.integers(2, 60))
    def prop(items, group, max_length):
        convs = []
        for row, ((msgs, _), poison) in enumerate(items):
            if poison == 0:  # a special token's string typed by the user
                msgs = [dict(m, content=m["content"] + special) if m["role"] == "user" else m for m in msgs]
            convs.append(Conversation(row, f"id{row}", msgs))
        want_samples, want_skips = [], []
        for c in convs:
            try:
                enc = r.encode_normalized(c.messages)
            except MaskError as e:
                want_skips.append((c.row, e.reason))
                continue
            except Exception:
                want_skips.append((c.row, "template_error"))
                continue
            ids, mask = enc.input_ids[:max_length], enc.loss_mask[:max_length]
            if int(mask.sum()) == 0:
                want_skips.append((c.row, "no_loss_tokens"))
            else:
                want_samples.append((c.row, ids.tolist(), mask.tolist(), enc.input_ids.shape[0] > max_length))
        got_skips = []
        policy = ErrorPolicy("skip", listener=lambda s, note: None if note else got_skips.append((s.row, s.reason)))
        monkeypatch.setattr(stages, "ENCODE_GROUP", group)
        got = [(s.row, s.input_ids.tolist(), s.loss_mask.tolist(), s.truncated)
               for s in stages.tokenize(iter(convs), r, "t", max_length, policy)]
        assert got == want_samples and got_skips == want_skips
        assert any(p == 0 for _, p in items) <= any(k == "special_token_in_text" for _, k in got_skips)

    prop()
