"""Chat template rendering, ONE tokenisation, and the assistant loss mask.

The loss mask is computed from character offsets in the single full render, never from
lengths of partial renders (templates such as Qwen3 drop earlier ``<think>`` blocks, so a
partial render is not a prefix of the full one).

Rule: ``loss_mask[t] = 1`` iff token ``t`` overlaps the characters of an assistant
message's content as the template rendered it (including a ``<think>...</think>`` block
the template rendered right before the answer) or the special end-of-turn token that
immediately follows it (``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ``<end_of_turn>`` ...).
Everything else (system/user text, role headers, default system prompts, injected dates)
is 0. Each assistant content is searched only after its own role header, which is found by
matching the template text of a second render with placeholders in place of the assistant
contents (see :meth:`ChatRenderer.assistant_spans`): a short answer ("a", "assistant") never
matches inside a header, a user message or an injected system prompt.
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

        Anchoring: the conversation is rendered a second time with each assistant content
        replaced by a unique placeholder. Up to the first assistant content both renders are
        identical, and between two assistant contents both carry the same template text
        (end-of-turn, user turn, role header). So for assistant message ``i`` the text of the
        placeholder render between the previous placeholder and placeholder ``i`` is matched
        character by character at the current position of the real render; the content is
        searched only after that header (and after the rendered ``</think>`` when the message
        has reasoning), never inside headers, user text or injected system prompts.

        Raises:
            SpanError: an assistant message's content is not in the render.
        """
        ph = [f"@@EAGLE_PLACEHOLDER_{i}@@" for i in range(len(messages))]
        pmsgs = [{**m, "content": ph[i]} if m["role"] == "assistant" else m for i, m in enumerate(messages)]
        ptext = self.render(pmsgs)
        spans, r, p = [], 0, 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            pi = ptext.find(ph[i], p)
            if pi < 0:
                raise SpanError(f"assistant message {i} is not rendered by the template")
            seg = ptext[p:pi]
            common = 0
            for a, b in zip(text[r:r + len(seg)], seg):
                if a != b:
                    break
                common += 1
            search = r + common
            # A reasoning block the template rendered from this message (absent or empty in the
            # placeholder render) is open at ``search``: the answer comes after its end.
            tb = text.rfind("<think>", r, search + len("<think>"))
            if tb >= 0:
                te = text.find("</think>", tb)
                if te >= 0 and te + len("</think>") > search:
                    search = te + len("</think>")
            answer = m["content"].rsplit("</think>", 1)[-1]
            found = -1
            for cand in dict.fromkeys((answer, answer.strip())):
                if cand and (found := text.find(cand, search)) >= 0:
                    break
            if found < 0:
                raise SpanError(f"assistant message {i} not found in the rendered text")
            start, end = found, found + len(cand)
            head = text[r:start]
            t = head.rfind("<think>")
            if t >= 0 and _THINK_BLOCK.fullmatch(head[t:]):
                start = r + t
            p = pi + len(ph[i])
            for sp in self._specials:
                if text.startswith(sp, end):
                    end += len(sp)
                    if ptext.startswith(sp, p):
                        p += len(sp)
                    break
            spans.append((start, end))
            r = end
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
