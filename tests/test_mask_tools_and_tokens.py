"""Loss masks where tool results, tokenizer flags and record fields meet the template (found by
breaking passes): a tool call after a tool result, added tokens that take in whitespace, role
markers that are not special tokens, tool schemas, reasoning with no place in the template."""

import pytest
from tokenizers import AddedToken, Tokenizer
from transformers import PreTrainedTokenizerFast

from eagle_data.extract.chat import ChatRenderer
from eagle_data.extract.stages import tokenize
from eagle_data.extract.conversations import Conversation, normalize_record
from eagle_data.extract.fault import ErrorPolicy
from eagle_data.extract.mask import NotRendered, SpecialTokenInText, ToolCallsNotRendered

import templates
from templates import TEMPLATES_DIR, family_tokenizer
from test_chat_templates import masked_runs

U = {"role": "user", "content": "q"}


def call(name, cid):
    return {"type": "function", "id": cid, "function": {"name": name, "arguments": {"x": 1}}}


CHAIN = [U, {"role": "assistant", "content": "", "tool_calls": [call("f", "abcdefghi")]},
         {"role": "tool", "content": "r1", "tool_call_id": "abcdefghi"},
         {"role": "assistant", "content": "", "tool_calls": [call("g", "bcdefghij")]},
         {"role": "tool", "content": "r2", "tool_call_id": "bcdefghij"},
         {"role": "assistant", "content": "Done.", "reasoning_content": "because"}]


def renderer(stem, **kw):
    return ChatRenderer(family_tokenizer(TEMPLATES_DIR / f"{stem}.jinja"), name=stem, **kw)


def runs(r, msgs, tools=None):
    e = r.encode(msgs, tools)
    return masked_runs(r.tokenizer, e.input_ids, e.loss_mask)


@pytest.mark.parametrize("stem,want", [
    # Mistral writes no [/INST] before a turn that follows a tool result: the turn's tool-call
    # opener and think tag are still the model's output
    ("mistral_v3_instruct", ['[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}, "id": "abcdefghi"}]</s>',
                             '[TOOL_CALLS] [{"name": "g", "arguments": {"x": 1}, "id": "bcdefghij"}]</s>',
                             ' <think>\nbecause\n</think>\n\nDone.</s>']),
    ("mistral_small_3_1_instruct_2503", ['[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}, "id": "abcdefghi"}]</s>',
                                         '[TOOL_CALLS] [{"name": "g", "arguments": {"x": 1}, "id": "bcdefghij"}]</s>',
                                         '<think>\nbecause\n</think>\n\nDone.</s>']),
    ("deepseek_v3_1", ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"x\": 1}<｜tool▁call▁end｜>"
                       "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
                       "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>g<｜tool▁sep｜>{\"x\": 1}<｜tool▁call▁end｜>"
                       "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>",
                       "<think>\nbecause\n</think>\n\nDone.<｜end▁of▁sentence｜>"]),
])
def test_a_tool_call_after_a_tool_result_supervises_its_opener(stem, want):
    assert runs(renderer(stem), CHAIN) == want


@pytest.mark.parametrize("stem,noted", [("deepseek_r1", True), ("deepseek_v3", True), ("trl_deepseekv3_training", True),
                                        ("deepseek_v3_1", False), ("mistral_v3_instruct", False), ("qwen3", False)])
def test_a_turn_whose_start_the_template_leaves_open_is_noted(stem, noted):
    """DeepSeek-V3/R1 write a second call after a tool result with no header, and the prompt they
    render for that turn is not a prefix of the conversation: supervised from the call's name,
    with a note, not silently."""
    chain = [{**m, "content": None} if m.get("tool_calls") else m for m in CHAIN[:5]] + \
        [{"role": "assistant", "content": "Done."}]
    assert ("turn_start_at_first_field" in renderer(stem).encode(chain).notes) == noted


def _phi3_tokenizer(**flags):
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(templates._base_tokenizer_json()),
                                  bos_token="<s>", eos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": [AddedToken(t, normalized=False, special=True, **flags)
                                                          for t in ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]]})
    tok.chat_template = (TEMPLATES_DIR / "phi3_mini.jinja").read_text()
    return tok


@pytest.mark.parametrize("flags", [{"rstrip": True}, {"lstrip": True}, {"lstrip": True, "rstrip": True}, {}])
@pytest.mark.parametrize("answer", ["\n Sure.", "Sure.", "  \n\nSure.\n ", "Sure. "])
def test_added_tokens_that_take_in_whitespace_are_masked_by_their_own_text(flags, answer):
    """Phi-3's tokenizer declares its role tokens with ``rstrip``: ``<|assistant|>`` takes in the
    answer's leading whitespace, so its offsets reach into the answer. It is never supervised;
    the answer's text and the ``<|end|>`` after it are."""
    tok = _phi3_tokenizer(**flags)
    r = ChatRenderer(tok, name="phi3_mini")
    e = r.encode([{"role": "system", "content": "s"}, U, {"role": "assistant", "content": answer}])
    toks = tok.convert_ids_to_tokens(e.input_ids.tolist())
    masked = [t for t, m in zip(toks, e.loss_mask.tolist()) if m]
    assert not {"<|system|>", "<|user|>", "<|assistant|>"} & set(masked)
    assert masked[-1] == "<|end|>" and "Sure" in tok.convert_tokens_to_string(masked)
    assert toks.count("<|end|>") == 3 and sum(m for t, m in zip(toks, e.loss_mask.tolist()) if t == "<|end|>") == 1


def _r1_distill_tokenizer():
    """DeepSeek-R1-Distill declares its role markers as added tokens that are NOT special."""
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(templates._base_tokenizer_json()),
                                  bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>")
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<｜User｜>", "<｜Assistant｜>", "<think>",
                                                                              "</think>")])
    tok.chat_template = (TEMPLATES_DIR / "deepseek_r1.jinja").read_text()
    return tok


@pytest.mark.parametrize("role,text", [("assistant", "Sure.<｜User｜>fake q<｜Assistant｜>fake a"),
                                       ("user", "q <｜Assistant｜> a"), ("system", "<｜User｜>")])
def test_a_role_marker_that_is_not_a_special_token_is_refused_in_text(role, text):
    r = ChatRenderer(_r1_distill_tokenizer(), name="deepseek_r1")
    msgs = [U, {"role": "assistant", "content": "a"}]
    msgs = [{"role": "system", "content": text}, *msgs] if role == "system" else \
        [{**m, "content": text} if m["role"] == role else m for m in msgs]
    with pytest.raises(SpecialTokenInText, match="<｜(User|Assistant)｜>"):
        r.encode(msgs)


def test_inline_think_tags_stay_allowed_when_they_are_non_special_tokens():
    r = ChatRenderer(_r1_distill_tokenizer(), name="deepseek_r1")
    e = r.encode([U, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nok"}])
    assert masked_runs(r.tokenizer, e.input_ids, e.loss_mask)[-1].endswith("ok<｜end▁of▁sentence｜>")


def test_a_tool_call_without_id_on_a_template_that_writes_only_ids_is_a_named_skip():
    r = renderer("kimi_k2_thinking")
    assert r.call_anchor == "id"
    nameless = [U, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "get_weather", "arguments": {"x": 1}}}]}, {"role": "tool", "content": "r"},
                {"role": "assistant", "content": "A"}]
    with pytest.raises(ToolCallsNotRendered, match="without an 'id'"):
        r.encode(nameless)
    nameless[1]["tool_calls"][0]["id"] = "functions.get_weather:0"
    assert "get_weather" in r.tokenizer.decode(r.encode(nameless).input_ids)


@pytest.mark.parametrize("stem", ["llama3_1_instruct", "llama3_2_instruct", "mistral_small_3_1_instruct_2503", "deepseek_v3"])
def test_reasoning_of_a_tool_call_turn_with_no_place_in_the_template_is_a_named_skip(stem):
    """Templates that read no reasoning field get it inline in the content; where a tool-call
    turn's content is not rendered with its calls, the reasoning would vanish: skipped."""
    r = renderer(stem)
    rec = {"messages": [U, {"role": "assistant", "content": "", "reasoning_content": "SECRET",
                            "tool_calls": [call("get_weather", "abcdefghi")]},
                        {"role": "tool", "content": "sunny", "tool_call_id": "abcdefghi"},
                        {"role": "assistant", "content": "It is sunny."}]}
    pol = ErrorPolicy()
    assert list(tokenize([normalize_record(0, rec)], r, "t", 4096, pol)) == []
    assert pol.counter.as_dict() == {"message_not_rendered": 1}
    with pytest.raises(NotRendered, match="message 1 \\(assistant reasoning\\)"):
        r.encode(rec["messages"])


def test_glm_turn_before_a_tool_result_ends_with_its_observation_marker():
    r = renderer("glm4_5")
    msgs = [U, {"role": "assistant", "content": "let me look"}, {"role": "tool", "content": "r"},
            {"role": "assistant", "content": "A"}]
    got = runs(r, msgs)
    assert got[0].rstrip().endswith("let me look<|observation|>"), got


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("stem", ["qwen3", "qwen2_5_instruct", "llama3_1_instruct", "mistral_small_3_1_instruct_2503"])
def test_record_tool_schemas_reach_the_template_and_are_never_supervised(stem):
    r = renderer(stem)
    msgs = [U, {"role": "assistant", "content": "", "tool_calls": [call("get_weather", "abcdefghi")]},
            {"role": "tool", "content": "sunny", "tool_call_id": "abcdefghi"}, {"role": "assistant", "content": "Sunny."}]
    conv = normalize_record(0, {"messages": msgs, "tools": TOOLS})
    assert conv.tools == TOOLS
    pol = ErrorPolicy()
    [s] = tokenize([conv], r, "t", 8192, pol)
    text = r.tokenizer.decode(s.input_ids)
    assert r.tools_rendered and "Weather of a city" in text and pol.counter.notes == {}
    assert not any("Weather" in run for run in masked_runs(r.tokenizer, s.input_ids, s.loss_mask))
    without = r.encode(msgs)
    assert masked_runs(r.tokenizer, without.input_ids, without.loss_mask) == \
        masked_runs(r.tokenizer, s.input_ids, s.loss_mask)


def test_tool_schemas_a_template_cannot_render_are_noted_and_bad_ones_skipped():
    r = renderer("smollm2")
    assert not r.tools_rendered
    pol = ErrorPolicy()
    conv = normalize_record(0, {"messages": [U, {"role": "assistant", "content": "a"}], "tools": TOOLS})
    assert len(list(tokenize([conv], r, "t", 4096, pol))) == 1
    assert pol.counter.notes == {"tools_not_rendered": 1}
    for bad in ({"name": "x"}, "[1, 2]", "{not json", [1]):
        s = normalize_record(3, {"messages": [U, {"role": "assistant", "content": "a"}], "tools": bad})
        assert s.reason == "bad_tools" and "field 'tools'" in s.detail
    assert normalize_record(0, {"messages": [U, {"role": "assistant", "content": "a"}], "tools": []}).tools is None
    special = [{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}]
    conv = normalize_record(0, {"messages": [U, {"role": "assistant", "content": "a"}], "tools": special})
    pol = ErrorPolicy()
    assert list(tokenize([conv], r, "t", 4096, pol)) == [] and pol.counter.as_dict() == {"special_token_in_text": 1}


def test_a_blank_reasoning_field_does_not_hide_the_real_one():
    c = normalize_record(0, {"messages": [U, {"role": "assistant", "content": "a", "reasoning_content": "",
                                              "reasoning": "REAL"}]})
    assert c.messages[-1]["reasoning_content"] == "REAL"
    c = normalize_record(0, {"messages": [U, {"role": "assistant", "content": "a", "reasoning_content": " \n",
                                              "thinking": "REAL2"}]})
    assert c.messages[-1]["reasoning_content"] == "REAL2"


def test_dropped_turns_and_truncation_are_noted():
    pol = ErrorPolicy()
    from eagle_data.extract.conversations import normalize
    recs = [(0, {"conversations": [{"from": "gpt", "value": "cont."}, {"from": "human", "value": "q"},
                                   {"from": "gpt", "value": "a"}, {"from": "human", "value": "more?"}]})]
    [c] = normalize(iter(recs), pol)
    assert pol.counter.notes == {"leading_turns_dropped": 1, "trailing_turns_dropped": 1}
    r = renderer("smollm2")
    long = Conversation(1, "x", [U, {"role": "assistant", "content": " ".join(["word"] * 200)}])
    [s] = tokenize([long], r, "t", 200, pol)
    assert s.truncated and pol.counter.notes["truncated"] == 1


def test_a_second_system_message_is_named_for_what_it_is():
    s = normalize_record(0, {"system": "a", "messages": [{"role": "system", "content": "b"}, U,
                                                         {"role": "assistant", "content": "x"}]})
    assert s.reason == "misplaced_system" and "'system' field already gives one" in s.detail
    s = normalize_record(0, {"messages": [U, {"role": "system", "content": "b"}, {"role": "assistant", "content": "x"}]})
    assert "after other turns" in s.detail
