"""Loss masks on every real chat template in tests/chat_templates (decode and compare)."""

import re

import pytest
import torch

from eagle_data.chat import ChatRenderer, tokenize
from eagle_data.conversations import Conversation, ErrorPolicy

from templates import TEMPLATES_DIR, family_tokenizer, template_files

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
    """Render with a system prompt if the template supports one (Gemma-2 raises)."""
    msgs = [SYSTEM, *CHAT] if with_system else CHAT
    try:
        r.render(msgs)
        return msgs
    except Exception:
        return CHAT


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_mask_is_exactly_assistant_text_and_end_of_turn(path):
    tok = family_tokenizer(path)
    r = ChatRenderer(tok)
    msgs = render_any(r)
    ids, mask = r.tokenize(msgs)
    text = r.render(msgs)
    # input_ids is ONE tokenisation of the full render
    assert ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]
    runs = masked_runs(tok, ids, mask)
    answers = [m["content"] for m in msgs if m["role"] == "assistant"]
    assert len(runs) == len(answers), runs
    specials = set(tok.all_special_tokens)
    for run, ans in zip(runs, answers):
        body = THINK.sub("", run.strip(), count=1)
        # the run is the answer + at most one special end-of-turn token
        eot = body[len(ans):] if body.startswith(ans) else None
        assert eot is not None, (run, ans)
        assert eot == "" or eot in specials, (run, eot)
    # nothing of the system or user text is supervised
    sup = "".join(runs)
    for m in msgs:
        if m["role"] != "assistant":
            assert m["content"] not in sup
    assert "You are" not in sup and "user" not in sup.lower().replace("<|user|>", "")


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


def test_qwen3_multiturn_reasoning_strips_earlier_think():
    path = next(p for p in TEMPLATES if p.stem == "qwen3")
    tok = family_tokenizer(path)
    r = ChatRenderer(tok)
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
        {"role": "user", "content": "times 3?"},
        {"role": "assistant", "content": "<think>\nMultiply 4 by 3.\n</think>\n\n12"},
    ]
    text = r.render(msgs)
    assert "Add them." not in text  # Qwen3 drops reasoning of turns before the last user query
    ids, mask = r.tokenize(msgs)
    runs = masked_runs(tok, ids, mask)
    assert runs == ["4<|im_end|>", "<think>\nMultiply 4 by 3.\n</think>\n\n12<|im_end|>"]


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
    tok = family_tokenizer(path)
    r = ChatRenderer(tok)
    msgs = [{"role": "user", "content": "Pick one"}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "You are a helpful AI"}, {"role": "assistant", "content": answer}]
    ids, mask = r.tokenize(msgs)
    runs = masked_runs(tok, ids, mask)
    specials = set(tok.all_special_tokens)
    assert len(runs) == 2, runs
    for run in runs:
        body = THINK.sub("", run.strip(), count=1)
        assert body.startswith(answer) and (body[len(answer):] == "" or body[len(answer):] in specials), runs
    text = r.render(msgs)
    # the supervised characters are the LAST occurrences before each end-of-turn, not a header
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    first = min(a for (a, b), m in zip(enc["offset_mapping"], mask.tolist()) if m)
    assert text[first:].lstrip().startswith(("<think>", answer))
    assert text.index("Pick one") < first
