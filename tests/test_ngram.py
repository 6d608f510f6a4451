"""Prompt-lookup speculation (the n-gram baseline of the tau evaluation), checked against its
definition by brute force over generated contexts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle_train.ngram import NO_TOKEN, PromptLookupDrafter, prompt_lookup


def _occurs_before_end(ctx, n):
    """Earliest j with ctx[j:j+n] == ctx[-n:], j < len - n (not the suffix itself), or None."""
    suf = ctx[len(ctx) - n:]
    return next((j for j in range(len(ctx) - n) if ctx[j:j + n] == suf), None)


@settings(max_examples=300, deadline=None)
@given(ctx=st.lists(st.integers(0, 3), max_size=30), k=st.integers(0, 8), max_n=st.integers(1, 5),
       min_n=st.integers(1, 5))
def test_proposal_follows_the_earliest_occurrence_of_the_longest_suffix_ngram(ctx, k, max_n, min_n):
    if min_n > max_n:
        with pytest.raises(ValueError):
            prompt_lookup(ctx, k, max_n, min_n)
        return
    prop = prompt_lookup(ctx, k, max_n, min_n)
    found = [(n, j) for n in range(min_n, max_n + 1) if n < len(ctx)
             if (j := _occurs_before_end(ctx, n)) is not None]
    if not found:
        assert prop == []
        return
    n, j = max(found)  # longest n; for it the earliest j
    assert prop == ctx[j + n:j + n + k]
    assert len(prop) == min(k, len(ctx) - j - n)


def test_examples_of_the_rule():
    assert prompt_lookup([1, 2, 3, 4, 2, 3], 4, max_n=3, min_n=2) == [4, 2, 3]  # vLLM's docstring example
    assert prompt_lookup([5, 6, 7, 5, 6, 7, 5], 3) == [6, 7, 5]  # periodic text is predicted
    assert prompt_lookup([1, 2, 3], 3) == []
    assert prompt_lookup([9, 1, 9, 2, 9], 2, max_n=1) == [1, 9]  # earliest occurrence of '9'


def test_drafter_interface_pads_and_sees_the_first_token():
    """Rows use x[<=r] + the target's token; x[0] comes from first_token_id (rows are shifted)."""
    x = torch.tensor([7, 8, 9, 7, 8, 1, 2])
    rows_ids = torch.cat([x[1:], x.new_zeros(1)])
    d = PromptLookupDrafter(max_n=2)
    out = d.propose_chain(rows_ids, None, rows=[3, 5], first_tokens=[8, 9], steps=3, first_token_id=7)
    # row 3: context 7 8 9 7 | 8 -> "7 8" occurred at 0 -> 9 7 8 ; row 5: context 7 8 9 7 8 1 | 9 -> "9" at 2 -> 7 8 1
    assert out.tolist() == [[9, 7, 8], [7, 8, 1]]
    none = d.propose_chain(rows_ids, None, rows=[1], first_tokens=[5], steps=3, first_token_id=7)
    assert none.tolist() == [[NO_TOKEN] * 3]
