"""Record normalisation: accepted layouts, role mapping, and named skip reasons."""

import json

import pytest
from hypothesis import given, settings, strategies as st

from eagle_data.extract.conversations import Conversation, normalize, normalize_record
from eagle_data.extract.fault import ErrorPolicy, Skip

OK_SHAREGPT = {"id": "a.1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}


def test_sharegpt_and_openai_layouts_with_system():
    c = normalize_record(0, OK_SHAREGPT)
    assert isinstance(c, Conversation) and c.source_id == "a.1"
    assert c.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    o = normalize_record(1, {"system": "be nice", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]})
    assert [m["role"] for m in o.messages] == ["system", "user", "assistant"]  # trailing user dropped
    assert normalize_record(3, {"messages": [{"role": "developer", "content": "be"}, {"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]}).messages[0]["role"] == "system"
    for r in ("chatgpt", "bing", "bard", "model", "GPT"):
        assert isinstance(normalize_record(2, {"conversations": [{"from": "user", "value": "x"},
                                                                  {"from": r, "value": "y"}]}), Conversation)


def test_leading_assistant_turn_dropped_like_fastchat():
    c = normalize_record(0, {"conversations": [{"from": "gpt", "value": "cont."}, {"from": "human", "value": "q"},
                                               {"from": "gpt", "value": "a"}]})
    assert [m["content"] for m in c.messages] == ["q", "a"]
    assert c.notes == [("leading_turns_dropped", "1 turn(s) before the first user turn dropped (no prompt in this record)")]


@pytest.mark.parametrize("rec,reason", [
    ({"id": 1}, "no_messages"),
    ({"conversations": "text"}, "no_messages"),
    ({"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]}, "unknown_role"),
    ({"conversations": [{"from": "tool", "value": "x"}, {"from": "gpt", "value": "y"}]}, "no_assistant_turn"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                   {"role": "assistant", "content": "y"}]}, "non_text_content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]},
                   {"role": "assistant", "content": "y"}]}, "non_string_content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                                                       "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "bad_tool_call"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{not json"}}]}]}, "bad_tool_call"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "r"},
                   {"role": "assistant", "content": "y"}]}, "broken_alternation"),
    ({"conversations": [{"from": None, "value": "x"}]}, "unknown_role"),
    ({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "y"}]}, "non_string_content"),
    ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "y"}]}, "non_string_content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "non_string_content"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "  "},
                        {"from": "human", "value": "x2"}, {"from": "gpt", "value": "z"}]}, "empty_assistant"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "  "}]}, "empty_assistant"),
    ({"conversations": [{"from": "human", "value": "x"}]}, "no_assistant_turn"),
    ({"conversations": []}, "no_assistant_turn"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "human", "value": "y"},
                        {"from": "gpt", "value": "z"}]}, "broken_alternation"),
    ({"conversations": [{"from": "human", "value": "x"}, {"from": "system", "value": "s"},
                        {"from": "gpt", "value": "z"}]}, "misplaced_system"),
    ({"conversations": ["hello"]}, "bad_turn"),
    ({"system": 5, "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "z"}]},
     "non_string_content"),
])
def test_malformed_records_are_skipped_with_reason(rec, reason):
    pol = ErrorPolicy()
    out = list(normalize([(7, rec), (8, OK_SHAREGPT)], pol))
    assert [c.row for c in out] == [8]
    assert pol.counter.as_dict() == {reason: 1}


def test_raise_policy_names_row_and_reason():
    with pytest.raises(ValueError, match=r"row 3 .*empty_assistant"):
        list(normalize([(3, {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": ""}]})],
                       ErrorPolicy("raise")))


def test_openai_formats_users_have():
    c = normalize_record(0, {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "be"}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "need a tool",
         "tool_calls": [{"id": "call1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call1", "name": "get_weather"},
        {"role": "assistant", "content": "Sunny.", "reasoning": "the tool said so"},
        {"role": "user", "content": "thanks"}]})
    assert c.messages == [
        {"role": "system", "content": "be\nbrief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "need a tool", "tool_calls": [
            {"type": "function", "id": "call1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call1", "name": "get_weather"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "the tool said so"}]
    assert c.notes == [("trailing_turns_dropped", "1 turn(s) after the last answer dropped")]


def test_sharegpt_function_call_and_observation():
    c = normalize_record(0, {"conversations": [
        {"from": "human", "value": "w?"}, {"from": "function_call", "value": '{"name": "f", "arguments": {"a": 1}}'},
        {"from": "observation", "value": "r"}, {"from": "gpt", "value": "done"}]})
    assert [m["role"] for m in c.messages] == ["user", "assistant", "tool", "assistant"]
    assert c.messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]


def test_blank_reply_cuts_the_conversation_before_its_question_and_is_noted():
    rec = {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                             {"from": "human", "value": "q2"}, {"from": "gpt", "value": " \n"},
                             {"from": "human", "value": "q3"}, {"from": "gpt", "value": "a3"}]}
    pol = ErrorPolicy()
    (c,) = normalize([(4, rec)], pol)
    assert [m["content"] for m in c.messages] == ["q1", "a1"]
    assert c.notes == [("cut_at_blank_reply", "assistant turn 3 (0-based) is blank: the conversation is cut before "
                                              "turn 2, the user turn it answers (4 turn(s) dropped)")]
    assert pol.counter.notes == {"cut_at_blank_reply": 1} and pol.counter.as_dict() == {}


@pytest.mark.parametrize("calls,field", [
    ([{"function": {"name": "f", "arguments": {"a": float("nan")}}}], "tool_calls"),
    ([{"function": {"name": "f", "arguments": {"a": b"x"}}}], "tool_calls"),
    ([{"function": {"name": "f", "arguments": {"a": {1, 2}}}}], "tool_calls"),
])
def test_tool_arguments_that_are_not_json_are_a_named_skip(calls, field):
    rec = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, field: calls}]}
    out = normalize_record(0, rec)
    assert out.reason == "bad_tool_call" and "arguments" in out.detail


def test_legacy_function_call_field_and_tool_calls_on_a_user_turn():
    c = normalize_record(0, {"messages": [{"role": "user", "content": "x"}, {
        "role": "assistant", "content": None, "function_call": {"name": "f", "arguments": '{"a": 1}'}}]})
    assert c.messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    bad = normalize_record(1, {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"function": {"name": "f", "arguments": {}}}]}, {"role": "assistant", "content": "y"}]})
    assert bad.reason == "bad_tool_call" and "turn 0 (0-based) is a user message" in bad.detail


def test_a_record_with_both_conversations_and_messages_is_skipped_not_guessed():
    from eagle_data.extract.conversations import normalize_record

    rec = {"id": "x", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
           "messages": [{"role": "user", "content": "other"}, {"role": "assistant", "content": "b"}]}
    out = normalize_record(0, rec)
    assert out.reason == "ambiguous_record" and "both 'conversations' and 'messages'" in out.detail


_FLAGS = st.sampled_from([{}, {"weight": 0}, {"weight": 1}, {"train": False}, {"train": True}, {"weight": 0.5},
                          {"train": "no"}, {"weight": 0, "train": True}])
_CALL = st.fixed_dictionaries({"name": st.sampled_from(["f", "get_weather"]),
                               "arguments": st.dictionaries(st.sampled_from("abc"), st.integers(-3, 3), max_size=2)})


@settings(max_examples=60, deadline=None)
@given(flags=_FLAGS, calls=st.lists(_CALL, min_size=1, max_size=3), reasoning=st.sampled_from([None, "", "think"]),
       as_list=st.booleans())
def test_a_sharegpt_function_call_turn_is_the_openai_tool_call_turn_with_its_flags(flags, calls, reasoning, as_list):
    """A ShareGPT ``function_call`` turn takes ``weight`` / ``train`` and reasoning like any assistant
    turn (its flags were ignored: a weight-0 call was supervised), and one call or a list of calls."""
    extra = {**flags, **({} if reasoning is None else {"reasoning_content": reasoning})}
    value = json.dumps(calls if as_list or len(calls) > 1 else calls[0])
    share = normalize_record(0, {"conversations": [
        {"from": "human", "value": "q"}, {"from": "function_call", "value": value, **extra},
        {"from": "observation", "value": "r"}, {"from": "gpt", "value": "done"}]})
    oa = normalize_record(0, {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": c} for c in calls], **extra},
        {"role": "tool", "content": "r"}, {"role": "assistant", "content": "done"}]})
    if isinstance(oa, Skip):
        assert isinstance(share, Skip) and share.reason == oa.reason == "bad_turn"
        return
    assert share.messages == oa.messages
    assert share.messages[1].get("train", True) is (flags.get("weight", 1) != 0 and flags.get("train") is not False)
    assert ("reasoning_content" in share.messages[1]) is (reasoning == "think")


@pytest.mark.parametrize("calls,detail", [
    ('[{"name": "f", "arguments": {}}, 3]', "[1] is int, not an object"),
    ([{"type": "code_interpreter", "function": {"name": "f", "arguments": {}}}], "field 'type' = 'code_interpreter'"),
    ([{"function": {"name": "f", "arguments": {"a": 1}, "parameters": {"p": 1}}}], "both 'arguments' and 'parameters'"),
    ({}, "[0] has no function name"),
])
def test_tool_calls_that_cannot_be_rendered_as_given_are_a_named_skip(calls, detail):
    out = normalize_record(0, {"messages": [{"role": "user", "content": "x"},
                                            {"role": "assistant", "content": None, "tool_calls": calls}]})
    assert isinstance(out, Skip) and out.reason == "bad_tool_call" and detail in out.detail, out


def test_the_legacy_functions_field_is_the_records_tools():
    """OpenAI's legacy top-level ``functions`` was ignored unsaid while its ``function_call`` was used."""
    schema = {"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    c = normalize_record(0, {"functions": [schema], "messages": turns})
    assert c.tools == [{"type": "function", "function": schema}]
    assert c.tools == normalize_record(0, {"tools": [{"type": "function", "function": schema}], "messages": turns}).tools
    both = normalize_record(0, {"functions": [schema], "tools": [{"type": "function", "function": schema}],
                                "messages": turns})
    assert isinstance(both, Skip) and both.reason == "bad_tools" and "legacy 'functions'" in both.detail
    bad = normalize_record(0, {"functions": {"x": 1}, "messages": turns})
    assert isinstance(bad, Skip) and bad.reason == "bad_tools" and "field 'functions'" in bad.detail


def test_turns_in_the_other_layouts_keys_are_read_with_those_keys():
    """``{"role", "content"}`` turns under ``conversations`` were skipped as ``unknown_role: turn 0
    field 'from' = None``; each turn is now read with its own keys (the reverse too)."""
    oa = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0},
          {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]
    sg = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "weight": 0},
          {"from": "human", "value": "q2"}, {"from": "gpt", "value": "b"}]
    want = normalize_record(0, {"messages": oa}).messages
    assert normalize_record(0, {"conversations": oa}).messages == want
    assert normalize_record(0, {"messages": sg}).messages == want
    assert normalize_record(0, {"conversations": [sg[0], oa[1], sg[2], oa[3]]}).messages == want
    bad = normalize_record(0, {"conversations": [{"speaker": "human", "text": "q"}]})
    assert isinstance(bad, Skip) and bad.reason == "unknown_role" and "field 'from' = None" in bad.detail


@pytest.mark.parametrize("sid,want", [({"x": 1}, '{"x": 1}'), ([1, "a"], '[1, "a"]'), (7, "7"), (True, "true"),
                                      ("plain", "plain"), (None, "5")])
def test_a_record_id_is_kept_as_its_json_text(sid, want):
    """A non-string id used to be stored as Python's repr ("{'x': 1}")."""
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert normalize_record(5, {"id": sid, "messages": turns}).source_id == want


def test_mixed_layout_keys_keep_their_text_and_disagreeing_keys_are_a_named_skip():
    """{"from", "content"} with tool calls lost its text (the layout's 'value' was absent and a
    tool-call turn may have none); both layouts' keys with other values were read as one of them."""
    call = [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    for rec in ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "content": "I call", "tool_calls": call},
                                   {"from": "observation", "value": "r"}, {"from": "gpt", "value": "done"}]},
                {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "value": "I call", "tool_calls": call},
                              {"role": "tool", "content": "r"}, {"role": "assistant", "content": "done"}]}):
        c = normalize_record(0, rec)
        assert c.messages[1]["content"] == "I call" and c.messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    same = normalize_record(0, {"messages": [{"role": "user", "from": "human", "content": "q", "value": "q"},
                                             {"role": "assistant", "content": "a"}]})
    assert [m["content"] for m in same.messages] == ["q", "a"]  # both keys, same meaning: fine
    for turn in ({"from": "human", "role": "assistant", "value": "q"}, {"from": "human", "value": "q", "content": "zz"}):
        out = normalize_record(0, {"conversations": [turn, {"from": "gpt", "value": "a"}]})
        assert isinstance(out, Skip) and out.reason == "ambiguous_turn" and "disagree" in out.detail, out


def test_a_legacy_function_call_beside_empty_tool_calls_is_kept_and_tool_form_functions_are_not_wrapped_twice():
    fc = {"name": "f", "arguments": '{"a": 1}'}
    for empty in ([], ""):
        c = normalize_record(0, {"messages": [{"role": "user", "content": "q"}, {
            "role": "assistant", "content": "Calling", "tool_calls": empty, "function_call": fc}]})
        assert c.messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert normalize_record(0, {"functions": [tool], "messages": turns}).tools == [tool]


def test_ids_of_other_types_are_clean_text():
    import datetime as dt

    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert normalize_record(0, {"id": b"\xff\x00", "messages": turns}).source_id == "ff00"
    assert normalize_record(0, {"id": dt.datetime(2024, 1, 1), "messages": turns}).source_id == "2024-01-01T00:00:00"


def test_integer_call_ids_are_kept_and_arguments_beside_function_are_a_named_skip():
    """An integer call id / tool_call_id was dropped unsaid (templates such as Kimi K2's render it);
    arguments given beside "function" instead of in it became {} unsaid."""
    c = normalize_record(0, {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": 7, "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "r", "tool_call_id": 7}, {"role": "assistant", "content": "done"}]})
    assert c.messages[1]["tool_calls"][0]["id"] == "7" and c.messages[2]["tool_call_id"] == "7"
    out = normalize_record(0, {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}, "arguments": {"a": 1}}]}]})
    assert isinstance(out, Skip) and out.reason == "bad_tool_call" and "beside 'function'" in out.detail


SYS = {"role": "system", "content": "be brief"}


def _u(text):
    return {"role": "user", "content": text}


def _a(text, **kw):
    return {"role": "assistant", "content": text, **kw}


@pytest.mark.parametrize("other", ["thinking", "reasoning"])
def test_conflicting_reasoning_fields_are_a_named_skip(other):
    """Issue 39 item 3: of 'reasoning_content' and 'thinking' (or 'reasoning') with different text
    the first non-blank one was used unsaid; now the sample is skipped naming the turn."""
    rec = {"id": "r7", "messages": [SYS, _u("q"), _a("a", reasoning_content="because A", **{other: "because B"})]}
    pol = ErrorPolicy()
    assert list(normalize([(5, rec)], pol)) == []
    assert pol.counter.as_dict() == {"ambiguous_turn": 1}
    out = normalize_record(5, rec)
    assert (out.row, out.source_id, out.reason) == (5, "r7", "ambiguous_turn")
    assert out.detail == (f"turn 2 (0-based) fields 'reasoning_content' = 'because A' and '{other}' = 'because B' "
                          f"disagree; keep one")
    for same in ({"reasoning_content": "because A", other: "because A"},  # equal: fine
                 {"reasoning_content": "", other: "because A"}, {"reasoning_content": "because A", other: " "},
                 {"reasoning_content": "because A", other: "\nbecause A\n"}):  # only the whitespace templates strip
        c = normalize_record(5, {"messages": [_u("q"), _a("a", **same)]})
        assert c.messages[1]["reasoning_content"] == "because A", same


@pytest.mark.parametrize("flag", [{"weight": 0}, {"train": False}])
def test_a_blank_untrained_reply_is_context_not_a_cut(flag):
    """Issue 39 item 5: a blank assistant turn marked weight 0 / train false (no target) cut the
    conversation like a blank trained reply; it is kept as context and the later turns stay."""
    rec = {"messages": [SYS, _u("q1"), _a("a1"), _u("q2"), _a(" ", **flag), _u("q3"), _a("a3")]}
    c = normalize_record(0, rec)
    assert [m["content"] for m in c.messages] == ["be brief", "q1", "a1", "q2", " ", "q3", "a3"]
    assert c.messages[4] == {"role": "assistant", "content": " ", "train": False} and c.notes == []
    assert c.turn_index == [0, 1, 2, 3, 4, 5, 6]
    first = normalize_record(0, {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "", **flag},
                                                   {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]})
    assert [m["content"] for m in first.messages] == ["q1", "", "q2", "a2"] and first.notes == []
    # a blank trained reply after it still cuts, before the user turn it answers
    cut = normalize_record(0, {"messages": rec["messages"] + [_u("q4"), _a("")]})
    assert len(cut.messages) == 7 and [r for r, _ in cut.notes] == ["cut_at_blank_reply"]


@pytest.mark.parametrize("rec,reason,detail", [
    # the example of issue 39: messages 4 and 3 (0-based), not 3 and 2 (the system message was not counted)
    ({"messages": [SYS, _u("U1"), _a("A1"), _u("U2"), _a("")]}, "cut_at_blank_reply",
     "assistant turn 4 (0-based) is blank: the conversation is cut before turn 3, the user turn it answers "
     "(2 turn(s) dropped)"),
    ({"messages": [SYS, _u("U1"), _u("U2"), _a("A")]}, "broken_alternation",
     "turn 2 (0-based) is user after user, expected assistant"),
    ({"messages": [SYS, _u("U1"), _a("")]}, "empty_assistant", "assistant turn 2 (0-based), the first answer, is blank"),
    # dropped leading turns are counted too
    ({"conversations": [{"from": "gpt", "value": "cont."}, {"from": "human", "value": "q"},
                        {"from": "human", "value": "q again"}, {"from": "gpt", "value": "a"}]}, "broken_alternation",
     "turn 2 (0-based) is user after user, expected assistant"),
    ({"messages": [SYS, _a("cont."), _a("more"), _u("U1"), _a("A1"), _u("U2"), _a("\n"), _u("U3"), _a("A3")]},
     "cut_at_blank_reply", "assistant turn 6 (0-based) is blank: the conversation is cut before turn 5, the user "
                           "turn it answers (4 turn(s) dropped)"),
    ({"messages": [SYS, _u("U1"), _a("A1"), SYS]}, "misplaced_system",
     "turn 3 (0-based) is a system message after other turns"),
])
def test_skips_and_notes_name_turns_as_the_record_numbers_them(rec, reason, detail):
    """Issue 39 item 9: the index named is the turn's place in the record's own list, the system
    message and dropped leading turns counted."""
    out = normalize_record(0, rec)
    got = (out.reason, out.detail) if isinstance(out, Skip) else next((r, d) for r, d in out.notes if r == reason)
    assert got == (reason, detail)
