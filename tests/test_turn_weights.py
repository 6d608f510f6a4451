"""Per-turn "do not train" flags (axolotl's ``"weight": 0``, ``"train": false``): the turn stays
in the conversation as context and leaves the loss mask; nothing else changes, on every template."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_data.extract.chat import ChatRenderer
from eagle_data.extract.messages import normalize_message
from eagle_data.extract.fault import BadRecord

from templates import family_tokenizer, template_files

TEMPLATES = template_files()


@lru_cache(maxsize=None)
def renderer(stem: str) -> ChatRenderer:
    path = next(p for p in TEMPLATES if p.stem == stem)
    return ChatRenderer(family_tokenizer(path), name=stem)


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    m = mask.tolist() + [0]
    out, start = [], None
    for i, v in enumerate(m):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.parametrize("stem", [p.stem for p in TEMPLATES])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_an_untrained_turn_is_context_only(stem, data):
    """The render and its tokens are unchanged by the flags; the mask is the unflagged mask less
    exactly the masked run of each flagged turn (one run per assistant turn)."""
    r = renderer(stem)
    n = data.draw(st.integers(1, 4))
    words = st.sampled_from(["Sure.", "The answer is 42.", "Café", "x = 1", "No", "Hello world", "日本語"])
    turns = []
    for _ in range(n):
        turns += [{"role": "user", "content": data.draw(words)}, {"role": "assistant", "content": data.draw(words)}]
    flags = data.draw(st.lists(st.sampled_from([None, {"weight": 0}, {"train": False}, {"weight": 1},
                                                {"train": True}]), min_size=n, max_size=n))
    flagged = [dict(m, **(flags[i // 2] or {})) if m["role"] == "assistant" else m for i, m in enumerate(turns)]
    try:
        plain = r.encode(turns)
    except Exception as e:  # a template that cannot take this conversation: the flags change nothing there
        with pytest.raises(type(e)):
            r.encode(flagged)
        return
    out = r.encode(flagged)
    assert torch.equal(out.input_ids, plain.input_ids)
    runs = _runs(plain.loss_mask)
    assert len(runs) == n
    want = torch.zeros_like(plain.loss_mask)
    for (s, e), f in zip(runs, flags):
        if not f or (f.get("weight", 1) != 0 and f.get("train", True)):
            want[s:e] = 1
    assert torch.equal(out.loss_mask, want)


@pytest.mark.parametrize("turn, says", [({"weight": 0.5}, "field 'weight' = 0.5"), ({"weight": "0"}, "field 'weight' = '0'"),
                                        ({"weight": True}, "field 'weight' = True"), ({"train": "no"}, "field 'train' = 'no'"),
                                        ({"weight": 0, "train": True}, "fields 'weight' = 0 and 'train' = True disagree")])
def test_an_unsupported_flag_value_is_refused_naming_the_turn(turn, says):
    with pytest.raises(BadRecord, match=f"turn 3 \\(0-based\\) {says}") as e:
        normalize_message(3, {"role": "assistant", "content": "a", **turn})
    assert e.value.reason == "bad_turn"


def test_flags_on_other_roles_are_ignored_and_never_reach_the_template():
    assert normalize_message(0, {"role": "user", "content": "q", "weight": 0}) == {"role": "user", "content": "q"}
    assert normalize_message(1, {"from": "gpt", "value": "a", "weight": 0}, "from", "value") == {
        "role": "assistant", "content": "a", "train": False}
    r = renderer(TEMPLATES[0].stem)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "train": False}]
    assert "train" not in r.render(msgs) and r.render(msgs) == r.render([msgs[0], {"role": "assistant", "content": "a"}])


def test_a_record_whose_every_answer_is_untrained_is_skipped_saying_so():
    from eagle_data.extract.stages import tokenize
    from eagle_data.extract.conversations import normalize
    from eagle_data.extract.fault import ErrorPolicy

    rec = {"id": "x", "messages": [{"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a", "weight": 0}]}
    seen = []
    policy = ErrorPolicy("skip", listener=lambda skip, is_note: seen.append(skip))
    convs = list(normalize(iter([(0, rec)]), policy))
    assert list(tokenize(convs, renderer(TEMPLATES[0].stem), "t", 64, policy)) == []
    (skip,) = [s for s in seen if s.reason == "no_loss_tokens"]
    assert "every assistant turn is marked not to train" in skip.detail


@pytest.mark.parametrize("stem", [p.stem for p in TEMPLATES])
def test_a_blank_untrained_reply_is_context_on_every_template(stem):
    """Issue 39 item 5: a blank ``"weight": 0`` reply in the middle cut the conversation before
    its question (the later, trained turn was lost). It is context: rendered as the template
    renders an empty turn, never supervised, and the later turns are kept and masked as when the
    untrained reply had text."""
    from eagle_data.extract.conversations import normalize_record

    r = renderer(stem)
    blank = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "", "weight": 0},
             {"role": "user", "content": "Café"}, {"role": "assistant", "content": "The answer is 42."}]
    conv = normalize_record(0, {"messages": blank})
    assert [m["content"] for m in conv.messages] == ["Hello world", "", "Café", "The answer is 42."] and conv.notes == []
    filled = [blank[0], {**blank[1], "content": "Sure."}, *blank[2:]]
    want = r.encode(filled)
    # with reasoning too, which thinking templates drop from old turns (nothing of the turn rendered)
    thought = [blank[0], {**blank[1], "reasoning_content": "Let me think."}, *blank[2:]]
    for out in (r.encode(blank), r.encode(thought)):
        text = r.tokenizer.decode(out.input_ids)
        assert "Hello world" in text and "Café" in text and "Sure." not in text
        got_runs = _runs(out.loss_mask)
        assert len(got_runs) == 1 == len(_runs(want.loss_mask))
        (s, e), ((ws, we),) = got_runs[0], _runs(want.loss_mask)
        assert out.input_ids[s:e].tolist() == want.input_ids[ws:we].tolist()  # the same supervised tokens
        assert out.notes == want.notes


@pytest.mark.parametrize("stem", [p.stem for p in TEMPLATES])
def test_encode_of_raw_messages_cuts_at_a_blank_reply_as_the_pipeline_does(stem):
    """Issue 39 item 8: ``ChatRenderer.encode`` on raw messages did not cut at a blank reply (it
    rendered every turn and failed on the blank one) while ``normalize_record`` cuts the record
    before the question it answers. encode now normalises as the pipeline does and says so."""
    from eagle_data.extract.stages import tokenize
    from eagle_data.extract.conversations import normalize_record
    from eagle_data.extract.fault import ErrorPolicy

    r = renderer(stem)
    raw = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "Sure."},
           {"role": "user", "content": "Café"}, {"role": "assistant", "content": " \n"},
           {"role": "user", "content": "x = 1"}, {"role": "assistant", "content": "The answer is 42."}]
    conv = normalize_record(0, {"messages": raw})
    assert len(conv.messages) == 2 and [n for n, _ in conv.notes] == ["cut_at_blank_reply"]
    (stored,) = tokenize([conv], r, "t", 100_000, ErrorPolicy())
    out = r.encode(raw)
    assert torch.equal(out.input_ids, stored.input_ids) and torch.equal(out.loss_mask, stored.loss_mask)
    assert out.notes == ["cut_at_blank_reply"] + r.encode_normalized(conv.messages).notes
    with pytest.raises(BadRecord, match=r"\(empty_assistant\): assistant turn 1 \(0-based\)") as e:
        r.encode([raw[0], raw[3]])
    assert e.value.reason == "empty_assistant"
