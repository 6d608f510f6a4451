"""Record normalisation: accepted layouts, role mapping, and named skip reasons."""

import pytest

from eagle_data.conversations import Conversation, ErrorPolicy, normalize, normalize_record

OK_SHAREGPT = {"id": "a.1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}


def test_sharegpt_and_openai_layouts_with_system():
    c = normalize_record(0, OK_SHAREGPT)
    assert isinstance(c, Conversation) and c.source_id == "a.1"
    assert c.messages == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    o = normalize_record(1, {"system": "be nice", "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]})
    assert [m["role"] for m in o.messages] == ["system", "user", "assistant"]  # trailing user dropped
    for r in ("chatgpt", "bing", "bard", "model", "GPT"):
        assert isinstance(normalize_record(2, {"conversations": [{"from": "user", "value": "x"},
                                                                  {"from": r, "value": "y"}]}), Conversation)


def test_leading_assistant_turn_dropped_like_fastchat():
    c = normalize_record(0, {"conversations": [{"from": "gpt", "value": "cont."}, {"from": "human", "value": "q"},
                                               {"from": "gpt", "value": "a"}]})
    assert [m["content"] for m in c.messages] == ["q", "a"]


@pytest.mark.parametrize("rec,reason", [
    ({"id": 1}, "no_messages"),
    ({"conversations": "text"}, "no_messages"),
    ({"conversations": [{"from": "tool", "value": "x"}, {"from": "gpt", "value": "y"}]}, "unknown_role"),
    ({"conversations": [{"from": None, "value": "x"}]}, "unknown_role"),
    ({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "y"}]}, "non_string_content"),
    ({"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "y"}]}, "non_string_content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "non_string_content"),
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
