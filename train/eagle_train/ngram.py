"""Prompt-lookup (n-gram) speculation: the free baseline every drafter must beat.

The rule of vLLM's ``NgramProposer`` (``prompt_lookup_min``/``prompt_lookup_max``): find the
longest n-gram, ``min_n <= n <= max_n``, that ends the context and also occurs earlier in it
(occurrences may overlap the suffix), take its earliest occurrence, and propose the (up to)
``k`` tokens that followed it. No match: no proposal (nothing accepted).

:class:`PromptLookupDrafter` has the ``propose_chain`` interface of
:class:`eagle_train.model.Eagle3Drafter`, so :func:`eagle_train.evaluate.acceptance` scores it on
exactly the positions and target continuations the drafter is scored on.
"""

from __future__ import annotations

from typing import Sequence

import torch

#: proposal slot with no token (shorter proposals are padded with it; never equals a token id)
NO_TOKEN = -1


def prompt_lookup(context: Sequence[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Up to ``k`` tokens proposed after ``context`` (see module doc); ``[]`` when nothing matches.

    Raises:
        ValueError: ``1 <= min_n <= max_n`` or ``k >= 0`` violated.
    """
    if not 1 <= min_n <= max_n or k < 0:
        raise ValueError(f"need 1 <= min_n <= max_n and k >= 0, got min_n={min_n}, max_n={max_n}, k={k}")
    ctx = list(context)
    t = len(ctx)
    for n in range(min(max_n, t - 1), min_n - 1, -1):
        suffix = ctx[t - n:]
        for j in range(t - n):  # earliest occurrence that is not the suffix itself
            if ctx[j:j + n] == suffix:
                return ctx[j + n:j + n + k]
    return []


class PromptLookupDrafter:
    """Prompt lookup behind the drafter interface used by the tau evaluation.

    Args:
        max_n, min_n: n-gram lengths tried, longest first (vLLM's ``prompt_lookup_max``/``_min``).
    """

    def __init__(self, max_n: int = 4, min_n: int = 1):
        prompt_lookup([], 0, max_n, min_n)  # validates
        self.max_n, self.min_n = max_n, min_n

    def eval(self) -> "PromptLookupDrafter":
        return self

    def parameters(self):
        """None: it runs on the CPU (the interface of a drafter module)."""
        return iter(())

    def propose_chain(self, input_ids: torch.Tensor, aux: torch.Tensor, rows: list[int], first_tokens: list[int],
                      steps: int, first_token_id: int | None = None) -> torch.Tensor:
        """int64 [len(rows), K]: the proposals after ``x[<=r] + [first_tokens[i]]``, padded with
        :data:`NO_TOKEN`.

        Args:
            input_ids: [T] shifted tokens (row ``r`` holds ``x[r+1]``), as the drafter gets them.
            aux: unused (the interface's target states).
            rows, first_tokens, steps: as :meth:`eagle_train.model.Eagle3Drafter.propose_chain`.
            first_token_id: ``x[0]`` (the shifted rows lack it); None: matches starting at
                position 0 are not seen.
        """
        xs = input_ids.tolist()
        head = [] if first_token_id is None else [int(first_token_id)]
        out = torch.full((len(rows), steps), NO_TOKEN, dtype=torch.int64)
        for i, (r, tok) in enumerate(zip(rows, first_tokens)):
            prop = prompt_lookup(head + xs[:r] + [int(tok)], steps, self.max_n, self.min_n)
            out[i, :len(prop)] = torch.tensor(prop, dtype=torch.int64)
        return out
