"""Loss masks on every real chat template in tests/chat_templates (decode and compare)."""

import re

import pytest
import torch

from eagle_data.extract.chat import ChatRenderer
from eagle_data.extract.stages import tokenize
from eagle_data.extract.conversations import Conversation
from eagle_data.extract.fault import ErrorPolicy, RowError
from eagle_data.extract.mask import SpecialTokenInText

from templates import TEMPLATES_DIR, family_tokenizer, template_files
from test_mask_property import check, parts_of

TEMPLATES = template_files()
if len(TEMPLATES) < 31:  # never pass vacuously
    pytest.fail(f"expected the 31 chat templates in {TEMPLATES_DIR}, found {len(TEMPLATES)}", pytrace=False)

SYSTEM = {"role": "system", "content": "You are terse."}
CHAT = [
    {"role": "user", "content": "Say hello world."},
    {"role": "assistant", "content": "hello world"},
    {"role": "user", "content": "Again, and add: Café 🙂 (hello world)"},
    {"role": "assistant", "content": "Hello world again. Café 🙂"},
]
THINK = re.compile(r"^(<think>.*</think>\s*)?", re.DOTALL)


def masked_runs(tok, ids, mask):
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def render_any(r, with_system=True):
    """With a system prompt if the template renders one (Gemma-2 raises; Mistral-v3 renders it
    only when the conversation ends with a user turn: such a sample is skipped as
    ``message_not_rendered``, see test_unrendered_system_prompt_is_a_named_skip)."""
    msgs = [SYSTEM, *CHAT] if with_system else CHAT
    try:
        return msgs if SYSTEM["content"] in r.render(msgs) else CHAT
    except Exception:
        return CHAT


def test_unrendered_system_prompt_is_a_named_skip():
    path = next(p for p in TEMPLATES if p.stem == "mistral_v3_instruct")
    r = ChatRenderer(family_tokenizer(path))
    pol = ErrorPolicy()
    assert list(tokenize([Conversation(0, "x", [SYSTEM, *CHAT])], r, "t", 1000, pol)) == []
    assert pol.counter.as_dict() == {"message_not_rendered": 1}


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_mask_is_exactly_assistant_output_and_end_of_turn(path):
    r = ChatRenderer(family_tokenizer(path))
    msgs = render_any(r)
    ids, mask = r.tokenize(msgs)
    # input_ids is ONE tokenisation of the full render
    assert ids.tolist() == r.tokenizer(r.render(msgs), add_special_tokens=False)["input_ids"]
    check(path.stem, msgs, parts_of(msgs))


# The example: a trimmed answer ("Sure " -> "Sure") that a later user message quotes.
SURE = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Sure "},
        {"role": "user", "content": "Sure thing, now B?"}, {"role": "assistant", "content": "B"}]


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_trimmed_answer_quoted_by_the_user_is_masked_in_its_own_turn(path):
    r = ChatRenderer(family_tokenizer(path))
    check(path.stem, SURE, parts_of(SURE))
    ids, mask = r.tokenize(SURE)
    runs = masked_runs(r.tokenizer, ids, mask)
    assert len(runs) == 2 and "Sure" in runs[0] and "thing" not in "".join(runs), runs


def qwen3_reasoning_chat(ws_a: str, ws_b: str) -> list[dict]:
    return [
        {"role": "user", "content": f"{ws_a}2+2?{ws_b}"},
        {"role": "assistant", "content": f"<think>{ws_a}Add them.{ws_b}</think>{ws_b}4{ws_a}"},
        {"role": "user", "content": "times 3? (4)"},
        {"role": "assistant", "content": f"{ws_b}12{ws_b}", "reasoning_content": f"{ws_a}Multiply 4 by 3.{ws_a}"},
    ]


@pytest.mark.parametrize("ws_a,ws_b", [("", ""), ("\n", "\n\n"), (" ", "\n"), ("\n\n", " "), ("\t", "")])
@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_multiturn_reasoning_with_whitespace_on_every_template(path, ws_a, ws_b):
    msgs = qwen3_reasoning_chat(ws_a, ws_b)
    parts = parts_of(msgs)
    parts[1] = {"content": (f"<think>{ws_a}Add them.{ws_b}</think>{ws_b}", "4", ws_a)}
    check(path.stem, msgs, parts)


@pytest.mark.parametrize("ws_a,ws_b", [("", ""), ("\n", "\n\n"), (" ", "\n")])
def test_qwen3_multiturn_reasoning_exact_runs(ws_a, ws_b):
    path = next(p for p in TEMPLATES if p.stem == "qwen3")
    r = ChatRenderer(family_tokenizer(path))
    msgs = qwen3_reasoning_chat(ws_a, ws_b)
    text = r.render(msgs)
    assert "Add them." not in text  # Qwen3 drops reasoning of turns before the last user query
    ids, mask = r.tokenize(msgs)
    # the last turn's reasoning_content is rendered by the template and supervised with its tags
    assert masked_runs(r.tokenizer, ids, mask) == [
        f"4{ws_a}<|im_end|>", f"<think>\n{ws_a.strip(chr(10))}Multiply 4 by 3.{ws_a.strip(chr(10))}\n</think>\n\n"
                              f"12{ws_b}<|im_end|>"]


@pytest.mark.parametrize("path", [p for p in TEMPLATES if "{% generation %}" in p.read_text()],
                         ids=lambda p: p.stem)
def test_mask_within_transformers_generation_blocks(path):
    """Independent oracle: templates with {% generation %} mark assistant tokens themselves.
    Our mask must lie inside theirs, and what they add is headers/whitespace only."""
    tok = family_tokenizer(path)
    r = ChatRenderer(tok)
    ids, mask = r.tokenize(CHAT)
    out = tok.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                  **r._render_vars)
    assert out["input_ids"] == ids.tolist()
    ref = torch.tensor(out["assistant_masks"], dtype=torch.bool)
    assert not (mask.bool() & ~ref).any(), "masked a token the template does not mark as assistant"
    extra = tok.decode(ids[ref & ~mask.bool()].tolist())
    for m in CHAT:
        assert m["content"] not in extra


def test_assistant_text_repeated_from_user_is_matched_in_its_own_turn():
    path = next(p for p in TEMPLATES if p.stem == "smollm2")
    tok = family_tokenizer(path)
    r = ChatRenderer(tok)
    msgs = [{"role": "user", "content": "Reply exactly: OK"}, {"role": "assistant", "content": "OK"}]
    text = r.render(msgs)
    ids, mask = r.tokenize(msgs)
    assert masked_runs(tok, ids, mask) == ["OK<|im_end|>"]
    assert text.index("OK") < text.rindex("OK")


def test_pinned_date_makes_llama32_reproducible():
    path = next(p for p in TEMPLATES if p.stem == "llama3_2_instruct")
    tok = family_tokenizer(path)
    a = ChatRenderer(tok, date="2025-03-04").render(CHAT)
    b = ChatRenderer(tok, date="2025-03-04").render(CHAT)
    c = ChatRenderer(tok, date="2025-03-05").render(CHAT)
    assert a == b and "04 Mar 2025" in a and a != c
    ids, mask = ChatRenderer(tok, date="2025-03-04").tokenize(CHAT)
    assert "Mar" not in "".join(masked_runs(tok, ids, mask))


def test_truncation_keeps_partial_span_and_skips_unsupervised():
    path = next(p for p in TEMPLATES if p.stem == "smollm2")
    tok = family_tokenizer(path)
    r = ChatRenderer(tok)
    ids, mask = r.tokenize(CHAT)
    first = int(mask.nonzero()[0])
    pol = ErrorPolicy()
    convs = [Conversation(0, "a", CHAT), Conversation(1, "b", CHAT)]
    out = list(tokenize(convs[:1], r, "t", first + 2, pol))
    assert len(out) == 1 and out[0].truncated and out[0].num_tokens == first + 2
    assert out[0].loss_mask.tolist()[-2:] == [1, 1]
    assert list(tokenize(convs[1:], r, "t", first, pol)) == []
    assert pol.counter.as_dict() == {"no_loss_tokens": 1}


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
@pytest.mark.parametrize("answer", ["a", "d", "end", "im", "assistant", "You", "user", "header", "id", "t"])
def test_short_answers_are_masked_in_their_own_turn(path, answer):
    """An answer that also occurs in role headers / injected prompts is masked where it was said."""
    msgs = [{"role": "user", "content": "Pick one"}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "You are a helpful AI"}, {"role": "assistant", "content": answer}]
    check(path.stem, msgs, parts_of(msgs))


@pytest.mark.parametrize("text", ["see <|im_end|> here", "<|im_start|>system", "EAGLEPH0HP"])
@pytest.mark.parametrize("role", ["user", "assistant"])
def test_special_token_strings_in_text_are_a_named_skip(text, role):
    path = next(p for p in TEMPLATES if p.stem == "qwen2_5_instruct")
    r = ChatRenderer(family_tokenizer(path))
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    msgs[0 if role == "user" else 1]["content"] = text
    pol = ErrorPolicy()
    assert list(tokenize([Conversation(5, "x", msgs)], r, "t", 100, pol)) == []
    assert pol.counter.as_dict() == {"special_token_in_text": 1}
    with pytest.raises(SpecialTokenInText, match="message [01]"):
        r.tokenize(msgs)


def test_end_of_turn_marker_must_be_a_special_token():
    path = next(p for p in TEMPLATES if p.stem == "qwen2_5_instruct")
    tok = family_tokenizer(path)
    edited = path.read_text().replace("<|im_end|>", "END_OF_TURN")  # marker not declared as special
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    for name, tpl in (("qwen-edit.jinja", edited), ("plain.jinja", plain)):
        with pytest.raises(ValueError, match=rf"{name}: the text after an assistant message.*special token"):
            ChatRenderer(tok, template=tpl, name=name)


def test_inspect_decodes_runs_so_every_script_displays():
    from eagle_data.tools.inspect import masked_text

    path = next(p for p in TEMPLATES if p.stem == "smollm2")
    r = ChatRenderer(family_tokenizer(path))
    msgs = [{"role": "user", "content": "Ελληνικά 🦜?"}, {"role": "assistant", "content": "日本語 🦜 καλά"}]
    ids, mask = r.tokenize(msgs)
    assert any(r.tokenizer.decode([t]) == "\ufffd" for t in ids.tolist())  # byte tokens split characters
    out = masked_text(r.tokenizer, ids, mask, 10_000, brackets=True).plain
    assert "\ufffd" not in out and "Ελληνικά 🦜?" in out and "⟦日本語 🦜 καλά<|im_end|>⟧" in out
    assert masked_text(r.tokenizer, ids, mask, 12).plain.endswith(" …[cut]")
    long = [{"role": "user", "content": "x " * 2000}, {"role": "assistant", "content": "the answer"}]
    ids, mask = r.tokenize(long)
    out = masked_text(r.tokenizer, ids, mask, 1500, brackets=True).plain  # a long prompt hid every answer
    assert "⟦the answer<|im_end|>⟧" in out and "chars]…" in out and len(out) < 1500


def _runs(stem, msgs, **kw):
    r = ChatRenderer(family_tokenizer(next(p for p in TEMPLATES if p.stem == stem)), **kw)
    ids, mask = r.tokenize(msgs)
    return masked_runs(r.tokenizer, ids, mask)


U = {"role": "user", "content": "q"}
CALL = {"type": "function", "id": "call00001", "function": {"name": "get_weather", "arguments": {"city": "x"}}}
TOOL_CHAT = [U, {"role": "assistant", "content": "", "tool_calls": [CALL]},
             {"role": "tool", "content": "r", "name": "get_weather", "tool_call_id": "call00001"},
             {"role": "assistant", "content": "A"}]


@pytest.mark.parametrize("stem,msg,run", [
    ("qwen3", {"role": "assistant", "content": "", "reasoning_content": "Let me think."},
     "<think>\nLet me think.\n</think>\n\n<|im_end|>"),
    ("smollm2", {"role": "assistant", "content": "<think>Let me think.</think>"}, "<think>Let me think.</think><|im_end|>"),
    ("qwen2_5_instruct", {"role": "assistant", "content": "Close it with </think>"},
     "Close it with </think><|im_end|>"),
])
def test_turn_ending_in_template_text_keeps_its_end_of_turn(stem, msg, run):
    """A reasoning-only answer: the template's closing </think> and the end-of-turn are supervised."""
    assert _runs(stem, [U, msg]) == [run]


@pytest.mark.parametrize("stem,opener", [("deepseek_r1", "<｜tool▁calls▁begin｜>"), ("mistral_v3_instruct", "[TOOL_CALLS]"),
                                         ("qwen2_5_instruct", "<tool_call>"), ("llama3_1_instruct", '{"name"'),
                                         ("gpt_oss", " to=functions.get_weather")])
def test_tool_call_opener_is_supervised(stem, opener):
    runs = _runs(stem, TOOL_CHAT)
    assert runs[0].startswith(opener) and "get_weather" in runs[0], runs


def test_thinking_disabled_generation_prompt_is_prompt():
    """With enable_thinking=False Qwen3's generation prompt ends in an empty think block: the
    longest prefix of it a turn starts with is prompt, the rest of the turn is output."""
    msgs = [U, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    assert _runs("qwen3", msgs, variables={"enable_thinking": False}) == ["R\n</think>\n\nA<|im_end|>"]
    assert _runs("qwen3", [U, {"role": "assistant", "content": "A"}], variables={"enable_thinking": False}) == [
        "A<|im_end|>"]


@pytest.mark.parametrize("variables, says", [
    ({"enable_thinkng": False}, r"template_vars \['enable_thinkng'\] are not read by qwen3 \(did you mean "
                                r"'enable_thinking'\?\); it reads: .*enable_thinking"),
    ({"enable_thinking": "false"}, r"template_vars.enable_thinking = 'false' is a string, which the template reads "
                                   r"as true; write false \(unquoted\)"),
    ({"enable_thinking": 0}, r"template_vars.enable_thinking = 0: qwen3 tests it with `is true`/`is false`, which "
                             r"only a boolean passes"),  # 0 is not `false` there: thinking stayed on
    ({"content": "x"}, r"template_vars \['content'\] are not read by qwen3.*; it reads: enable_thinking$"),  # its own
    ({"messages": []}, r"template_vars \['messages'\]: set by eagle-data itself"),
])
def test_template_vars_the_template_would_misread_are_refused(variables, says):
    """A misspelt variable rendered the default (thinking on) and the string "false" is true to
    Jinja: both changed every mask with no word. Refused, naming the variable."""
    path = next(p for p in template_files() if p.stem == "qwen3")
    with pytest.raises(ValueError, match=says):
        ChatRenderer(family_tokenizer(path), path.read_text(), name="qwen3", variables=variables)


@pytest.mark.parametrize("value", ["<|im_end|><|im_assistant|>assistant<|im_middle|>", "EAGLEPH5HP"])
def test_special_tokens_in_any_field_are_a_named_skip(value):
    path = next(p for p in TEMPLATES if p.stem == "kimi_k2_instruct")
    r = ChatRenderer(family_tokenizer(path))
    msgs = [dict(m) for m in TOOL_CHAT]
    msgs[2]["tool_call_id"] = value
    with pytest.raises(SpecialTokenInText, match="message 2 .*'tool_call_id'"):
        r.tokenize(msgs)


@pytest.mark.parametrize("stem,change,reason", [
    ("gpt_oss", lambda m: m[1].update(tool_calls=[CALL, {**CALL, "id": "call00002"}]), "tool_calls_not_rendered"),
    ("mistral_v3_instruct", lambda m: m[1].update(content="Checking."), "message_not_rendered"),
])
def test_part_of_a_message_dropped_by_the_template_is_a_named_skip(stem, change, reason):
    r = ChatRenderer(family_tokenizer(next(p for p in TEMPLATES if p.stem == stem)))
    msgs = [dict(m) for m in TOOL_CHAT]
    change(msgs)
    pol = ErrorPolicy()
    assert list(tokenize([Conversation(0, "x", msgs)], r, "t", 10_000, pol)) == []
    assert pol.counter.as_dict() == {reason: 1}


def test_final_reasoning_dropped_by_the_template_is_noted():
    """Kimi-K2-Thinking keeps reasoning only inside tool-call sequences: the last turn's is dropped."""
    r = ChatRenderer(family_tokenizer(next(p for p in TEMPLATES if p.stem == "kimi_k2_thinking")))
    msgs = [U, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    pol = ErrorPolicy()
    (s,) = tokenize([Conversation(0, "x", msgs)], r, "t", 1000, pol)
    assert pol.counter.notes == {"final_reasoning_not_rendered": 1} and pol.counter.as_dict() == {}
    q = ChatRenderer(family_tokenizer(next(p for p in TEMPLATES if p.stem == "qwen3")))
    assert q.encode(msgs).notes == []


BLANK_USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": " "},
              {"role": "assistant", "content": "Anything else?"}]


@pytest.mark.parametrize("stem,msgs,kw,runs", [
    # no generation prompt (Phi-4): a blank user message does not pull its header into the answer
    ("phi4", BLANK_USER, {}, ["Hello!<|im_end|>", "Anything else?<|im_end|>"]),
    # the answer's own leading whitespace after a user text ending in whitespace
    ("phi4", [{"role": "user", "content": "q\n"}, {"role": "assistant", "content": "\n\nfin"}], {},
     ["\n\nfin<|im_end|>"]),
    ("mistral_small_3_1_instruct_2503", [{"role": "user", "content": "q\n"}, {"role": "assistant", "content": "\n\nfin"}],
     {}, ["\n\nfin</s>"]),
    # a tool call ends at its call-end token even when a blank tool result follows
    ("llama3_1_instruct", [U, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                           {"role": "tool", "content": "", "tool_call_id": "call00001"}, {"role": "assistant", "content": "fin"}],
     {"builtin_tools": ["brave_search"]}, None),
    ("gpt_oss", [U, {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "user", "content": ""},
                 {"role": "assistant", "content": "fin"}], {}, None),
    # GLM does not close the last turn: its reasoning-only answer keeps the closing </think>
    ("glm4_5", [U, {"role": "assistant", "content": "", "reasoning_content": "rsn"}], {}, ["\n<think>rsn</think>"]),
    # a prefix of the generation prompt is taken only at a token/line boundary (DeepSeek-V3.1 thinking)
    ("deepseek_v3_1", [U, {"role": "assistant", "content": "ans"}, U, {"role": "assistant", "content": "two"}],
     {"thinking": True}, ["</think>ans<｜end▁of▁sentence｜>", "</think>two<｜end▁of▁sentence｜>"]),
    # DeepSeek-V3 renders a turn's tool calls only when its content is None
    ("deepseek_v3", TOOL_CHAT, {}, [
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "x"}\n```<｜tool▁call▁end｜>',
        "A<｜end▁of▁sentence｜>"]),
])
def test_turn_boundaries_from_breaking_passes(stem, msgs, kw, runs):
    got = _runs(stem, msgs, variables=kw)
    if runs is None:  # tool-call turns: the run ends at the call-end token, the next turn is separate
        assert len(got) == 2 and got[0].endswith(("<|eom_id|>", "<|call|>")) and got[1].startswith(
            ("fin", "<|channel|>final<|message|>fin")), got
    else:
        assert got == runs


@pytest.mark.parametrize("msgs,match", [
    ([], "no_assistant_turn"), ([U], "no_assistant_turn"), ("text", "must be a list"),
    ([U, {"role": "assistant", "content": None}], "turn 1 (0-based) field 'content' is NoneType"),
    ([U, {"role": "assistant"}], "turn 1 (0-based) field 'content' is NoneType"),
    ([U, {"role": "assistant", "content": [{"type": "text"}]}], "turn 1 (0-based) field 'content' part 0 field 'text'"),
    ([U, {"role": "alien", "content": "a"}], "turn 1 (0-based) field 'role' = 'alien'"),
])
def test_unusable_messages_are_a_clear_value_error(msgs, match):
    r = ChatRenderer(family_tokenizer(next(p for p in TEMPLATES if p.stem == "qwen3")))
    with pytest.raises(ValueError, match=re.escape(match)):
        r.encode(msgs)


def test_raw_openai_messages_are_normalised_by_the_renderer():
    r = ChatRenderer(family_tokenizer(next(p for p in TEMPLATES if p.stem == "qwen3")))
    raw = [{"role": "user", "content": [{"type": "text", "text": "weather?"}]},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}]},
           {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
           {"role": "assistant", "content": "Sunny.", "reasoning": "the tool said so"}]
    ids, mask = r.tokenize(raw)
    assert masked_runs(r.tokenizer, ids, mask) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "x"}}\n</tool_call><|im_end|>',
        "<think>\nthe tool said so\n</think>\n\nSunny.<|im_end|>"]


def test_template_stage_skips_name_the_records_own_turn():
    """A skip of the template stage named the message in the list handed to the template, which
    leaves out dropped turns and may start with a top-level system field: not the user's numbering."""
    from eagle_data.extract.conversations import normalize_record

    r = ChatRenderer(family_tokenizer(next(p for p in TEMPLATES if p.stem == "qwen2_5_instruct")))
    a, q, bad = {"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}, "see <|im_end|> here"
    for record, where in (
            ({"messages": [a, {"role": "user", "content": bad}, a]},  # the leading answer is dropped
             "message 0 (user) field 'content' contains '<|im_end|>' (message 0 of the conversation handed to the "
             "template is the record's turn 1, 0-based)"),
            ({"system": "S", "messages": [a, q, a, q, {"role": "assistant", "content": bad}]},
             "message 4 (assistant) field 'content' contains '<|im_end|>' (message 4 of the conversation handed to "
             "the template is the record's turn 4, 0-based)"),
            ({"system": bad, "messages": [q, a]}, "message 0 (system) field 'content' contains '<|im_end|>' (message "
                                                  "0 is the record's top-level 'system' field)")):
        conv = normalize_record(3, record)
        with pytest.raises(RowError) as e:
            list(tokenize([conv], r, "t", 100, ErrorPolicy(mode="raise")))
        assert e.value.skip.reason == "special_token_in_text" and e.value.skip.detail == where
