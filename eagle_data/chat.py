"""Chat template rendering, ONE tokenisation, and the assistant loss mask.

The loss mask is computed from character offsets in the single full render, never from
lengths of partial renders (templates such as Qwen3 drop earlier ``<think>`` blocks, so a
partial render is not a prefix of the full one).

Rule: ``loss_mask[t] = 1`` iff token ``t`` overlaps the characters of an assistant
message's content as the template rendered it (including a ``<think>...</think>`` block
the template rendered right before the answer) or the special end-of-turn token that
immediately follows it (``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ``<end_of_turn>`` ...).
Everything else (system/user text, role headers, default system prompts, injected dates)
is 0. Messages are located in order with a moving cursor, so an assistant text that also
occurs in an earlier user message is not matched there.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from .conversations import Conversation, ErrorPolicy, Skip
from .schema import sample_key

_THINK_BLOCK = re.compile(r"<think>.*</think>\s*", re.DOTALL)


class SpanError(ValueError):
    """An assistant message could not be located in the rendered text."""


@dataclass
class TokenizedSample:
    """One conversation ready for the engine.

    Attributes:
        key: sample key (see :func:`eagle_data.schema.sample_key`).
        input_ids: [T] int64, exactly what the engine is fed.
        loss_mask: [T] uint8.
    """
    key: str
    row: int
    source_id: str
    num_turns: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    truncated: bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class ChatRenderer:
    """Renders messages with a tokenizer's chat template and computes the loss mask.

    Args:
        tokenizer: a *fast* HF tokenizer (offset mapping is required).
        template: Jinja template text; ``None`` uses ``tokenizer.chat_template``.
        date: pinned date for templates that inject today's date (``strftime_now``,
            Llama-3.2's ``date_string``), ISO ``YYYY-MM-DD``; recorded in the manifest.
        variables: extra template variables (e.g. ``{"enable_thinking": False}``).

    Raises:
        ValueError: no template, or a slow tokenizer.
    """
    tokenizer: Any
    template: str | None = None
    date: str = "2026-01-01"
    variables: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.template is None:
            self.template = getattr(self.tokenizer, "chat_template", None)
        if not self.template:
            raise ValueError("the tokenizer has no chat_template; pass one with --chat_template PATH")
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError("a fast tokenizer is required (character offsets for the loss mask)")
        pinned = _dt.datetime.strptime(self.date, "%Y-%m-%d")
        self._render_vars = {
            "strftime_now": pinned.strftime,
            "date_string": pinned.strftime("%d %b %Y"),
            **self.variables,
        }
        specials = set(self.tokenizer.all_special_tokens)
        specials.update(t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special)
        self._specials = sorted((s for s in specials if s), key=len, reverse=True)

    @classmethod
    def from_path(cls, tokenizer: Any, template_path: str | Path | None, **kw) -> "ChatRenderer":
        text = Path(template_path).read_text(encoding="utf-8") if template_path else None
        return cls(tokenizer, text, **kw)

    @property
    def template_sha256(self) -> str:
        return hashlib.sha256(self.template.encode("utf-8")).hexdigest()

    def describe(self) -> dict[str, Any]:
        """Manifest entry: template hash and rendering variables."""
        return {"template_sha256": self.template_sha256, "date": self.date,
                "variables": {k: v for k, v in self.variables.items()}}

    def render(self, messages: list[dict[str, str]]) -> str:
        """Full conversation text, ``add_generation_prompt=False``."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False, chat_template=self.template,
            **self._render_vars)

    def assistant_spans(self, text: str, messages: list[dict[str, str]]) -> list[tuple[int, int]]:
        """Character spans ``[start, end)`` of each assistant message (+ its end-of-turn token).

        Raises:
            SpanError: an assistant message's content is not in the render.
        """
        spans, cursor = [], 0
        for i, m in enumerate(messages):
            content = m["content"]
            answer = content.rsplit("</think>", 1)[-1] if m["role"] == "assistant" else content
            found = -1
            for cand in dict.fromkeys((answer, answer.strip())):
                if cand and (found := text.find(cand, cursor)) >= 0:
                    break
            if found < 0:
                if m["role"] == "assistant":
                    raise SpanError(f"assistant message {i} not found in the rendered text")
                continue  # the template rewrote a user/system text; leave the cursor
            start, end = found, found + len(cand)
            if m["role"] == "assistant":
                head = text[cursor:start]
                t = head.rfind("<think>")
                if t >= 0 and _THINK_BLOCK.fullmatch(head[t:]):
                    start = cursor + t
                for s in self._specials:
                    if text.startswith(s, end):
                        end += len(s)
                        break
                spans.append((start, end))
            cursor = end
        return spans

    def tokenize(self, messages: list[dict[str, str]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Render, tokenise once and build the loss mask.

        Returns:
            ``(input_ids [T] int64, loss_mask [T] uint8)``.

        Raises:
            SpanError: see :meth:`assistant_spans`.
        """
        text = self.render(messages)
        spans = self.assistant_spans(text, messages)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = torch.tensor(enc["input_ids"], dtype=torch.int64)
        off = torch.tensor(enc["offset_mapping"], dtype=torch.int64).reshape(-1, 2)
        mask = torch.zeros(ids.shape[0], dtype=torch.bool)
        for s, e in spans:
            mask |= (off[:, 0] < e) & (off[:, 1] > s)
        return ids, mask.to(torch.uint8)


def tokenize(convs: Iterable[Conversation], renderer: ChatRenderer, dataset_tag: str,
             max_length: int, policy: ErrorPolicy) -> Iterator[TokenizedSample]:
    """Stage: conversations -> :class:`TokenizedSample` (truncated to ``max_length``).

    Skips (counted in ``policy``): ``template_error`` (the template raised),
    ``assistant_span_not_found``, ``no_loss_tokens`` (nothing supervised after truncation).
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    for c in convs:
        try:
            ids, mask = renderer.tokenize(c.messages)
        except SpanError as e:
            policy.handle(Skip(c.row, c.source_id, "assistant_span_not_found", str(e)))
            continue
        except Exception as e:  # jinja2 TemplateError / raise_exception from the template
            policy.handle(Skip(c.row, c.source_id, "template_error", f"{type(e).__name__}: {e}"))
            continue
        truncated = ids.shape[0] > max_length
        ids, mask = ids[:max_length], mask[:max_length]
        if int(mask.sum()) == 0:
            policy.handle(Skip(c.row, c.source_id, "no_loss_tokens",
                               f"{ids.shape[0]} tokens, none supervised" + (" after truncation" if truncated else "")))
            continue
        yield TokenizedSample(sample_key(dataset_tag, c.row), c.row, c.source_id, len(c.messages),
                              ids.contiguous(), mask.contiguous(), truncated)
