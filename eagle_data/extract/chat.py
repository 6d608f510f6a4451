"""Chat template rendering, ONE tokenisation, and the assistant loss mask.

Rule: ``loss_mask[t] = 1`` iff token ``t`` overlaps an assistant turn's *output* as the
template rendered it: everything after the generation prompt (the text
``add_generation_prompt`` appends, e.g. ``<|im_start|>assistant\\n``) through the turn's last
field (reasoning, content, tool-call text) and the special end-of-turn token right after it
(``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ``<end_of_turn>``...; for a tool-call turn, the
template's call-end token). So a ``<think>`` block or a channel header the template writes
inside the turn is supervised (the model generates it); system/user/tool text, role headers,
injected default system prompts and dates are 0. Positions come from an exact alignment of
the real render with a placeholder render (:mod:`eagle_data.extract.mask`), never from searching for
the answer's text; a conversation that does not align is skipped with a named reason.

Reasoning (``reasoning_content``) is given to the template under that name and as
``thinking`` (gpt-oss). A template that renders neither gets it inline in the content as
``<think>\\n...\\n</think>\\n\\n`` (recorded in the manifest as ``reasoning: "inline"``).
Templates that drop the reasoning of earlier turns (Qwen3) drop it here too: it is what the
model sees when serving.

Checks at start (``ValueError`` naming the template and the marker): the text a template
writes after an assistant message must start with a special token of the tokenizer that
encodes as one token (the end-of-turn). Per sample: message text that contains a special
token's string (``<|im_end|>`` typed in a message would become the real token) is skipped
(``special_token_in_text``).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle_data.checks import check_template_vars
from eagle_data.extract.conversations import normalize_record
from eagle_data.extract.fault import BadRecord, Skip
from eagle_data.extract.mask import (PLACEHOLDER, MaskError, NotRendered, SpecialTokenInText, align, assistant_spans,
                                     placeholder_messages)
from eagle_data.extract.template_probe import TemplateProbe

log = logging.getLogger(__name__)


@dataclass
class TokenizedSample:
    """One conversation ready for the engine.

    Attributes:
        key: sample key (see :func:`eagle_data.format.schema.sample_key`).
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
class Encoded:
    """One rendered, tokenised conversation.

    Attributes:
        input_ids: [T] int64, ONE tokenisation of the render.
        loss_mask: [T] uint8.
        notes: kept-but-changed reasons (e.g. ``final_reasoning_not_rendered``; from
            :meth:`ChatRenderer.encode` also the normalisation's, e.g. ``cut_at_blank_reply``).
    """
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    notes: list[str]


@dataclass
class ChatRenderer(TemplateProbe):
    """Renders messages with a tokenizer's chat template and computes the loss mask.

    Args:
        tokenizer: a *fast* HF tokenizer (offset mapping is required).
        template: Jinja template text; ``None`` uses ``tokenizer.chat_template``.
        date: pinned date for templates that inject today's date (``strftime_now``,
            Llama-3.2's ``date_string``), ISO ``YYYY-MM-DD``; recorded in the manifest.
        variables: extra template variables (e.g. ``{"enable_thinking": False}``).
        name: how errors name the template (default: ``"the tokenizer's chat template"``).

    Raises:
        ValueError: no template, a slow tokenizer, or a template whose end-of-turn marker is
            not a single special token (see the module docstring).
    """
    tokenizer: Any
    template: str | None = None
    date: str = "2026-01-01"
    variables: dict[str, Any] = field(default_factory=dict)
    name: str = "the tokenizer's chat template"

    def __post_init__(self):
        if self.template is None:
            self.template = getattr(self.tokenizer, "chat_template", None)
        if not self.template:
            raise ValueError("the tokenizer has no chat_template; pass one with --chat_template PATH")
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError("a fast tokenizer is required (character offsets for the loss mask)")
        check_template_vars(self.template, self.variables, self.name)
        pinned = _dt.datetime.strptime(self.date, "%Y-%m-%d")
        self._render_vars = {
            "strftime_now": pinned.strftime,
            "date_string": pinned.strftime("%d %b %Y"),
            **self.variables,
        }
        specials = set(self.tokenizer.all_special_tokens)
        specials.update(t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special)
        self._use_specials(specials)
        # how messages are handed to the template; the probe settles each (see _for_template)
        self.reasoning_rendered, self.args_as_json, self.call_content_none, self.call_anchor = True, False, False, "name"
        self.call_content_rendered, self.tools_rendered = True, False
        self._probe()
        self._refuse_structural_tokens()
        # added tokens that take in the whitespace beside them: their offsets reach into the
        # neighbouring text, so the mask uses the position of the token's own string instead
        self._strip_tokens = {i: t.content for i, t in self.tokenizer.added_tokens_decoder.items()
                              if (t.lstrip or t.rstrip) and t.content}
        self._strip_ids = np.fromiter(self._strip_tokens, dtype=np.int64)

    def _use_specials(self, specials: set[str]) -> None:
        """The strings refused in message text (:meth:`check_text`), longest first, and their regex."""
        self._specials = sorted((s for s in specials if s), key=len, reverse=True)
        self._special_re = re.compile("|".join([PLACEHOLDER.pattern] + [re.escape(s) for s in self._specials]))

    @classmethod
    def from_path(cls, tokenizer: Any, template_path: str | Path | None, **kw) -> "ChatRenderer":
        """A renderer of the template in a file, or of a shipped one by name
        (:func:`eagle_data.templates.resolve`); None: the tokenizer's own."""
        from eagle_data.templates import resolve

        if not template_path:
            return cls(tokenizer, None, **kw)
        path = resolve(str(template_path))
        text = path.read_text(encoding="utf-8")
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, str) and own.strip() and own.strip() != text.strip():
            log.warning("chat_template %r (%s) is NOT the model's own chat template (the tokenizer has another): "
                        "the data is rendered as the model never saw it unless it was trained on this one; leave "
                        "--chat_template out to use the model's", str(template_path), path)
        return cls(tokenizer, text, name=str(template_path), **kw)

    @property
    def template_sha256(self) -> str:
        return hashlib.sha256(self.template.encode("utf-8")).hexdigest()

    def describe(self) -> dict[str, Any]:
        """Manifest entry: template hash, rendering variables, and what the probe found."""
        return {"template_sha256": self.template_sha256, "date": self.date,
                "variables": {k: v for k, v in self.variables.items()},
                "generation_prompt": self.markers.prompt, "end_of_turn": list(self.markers.eot),
                "tool_call_end": list(self.markers.call_end), "tool_call_arguments": "json" if self.args_as_json else "dict",
                "tool_call_anchor": self.call_anchor,
                "reasoning": "template" if self.reasoning_rendered else "inline"}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        """Full conversation text (reasoning handed over as described in the module docstring);
        ``tools``: the record's tool schemas (the template's ``tools`` variable)."""
        return self._apply(self._for_template(messages), add_generation_prompt, tools)

    def _apply(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The template on messages already in the form it takes (:meth:`_for_template`; the
        internal ``train`` flag is not handed to it)."""
        if any("train" in m for m in messages):
            messages = [{k: v for k, v in m.items() if k != "train"} for m in messages]
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  chat_template=self.template, **self._render_vars)

    def _for_template(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not any("reasoning_content" in m or "tool_calls" in m for m in messages):
            return messages
        out = []
        for i, m in enumerate(messages):
            if "tool_calls" in m and self.args_as_json:
                m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
                    c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]}
            if "reasoning_content" in m:
                r = m["reasoning_content"]
                if not self.reasoning_rendered and m.get("tool_calls") and not self.call_content_rendered:
                    raise NotRendered(f"message {i} (assistant reasoning) is not rendered: the template reads no "
                                      "reasoning field and does not render a tool-call turn's text with its calls "
                                      "(where the reasoning would go inline)", i)
                m = ({**m, "thinking": r} if self.reasoning_rendered else
                     {k: v for k, v in {**m, "content": f"<think>\n{r}\n</think>\n\n{m['content'] or ''}"}.items()
                      if k != "reasoning_content"})
            if "tool_calls" in m and not m["content"] and self.call_content_none:
                m = {**m, "content": None}
            out.append(m)
        return out

    # ---- per conversation ---------------------------------------------------------------------
    def assistant_spans(self, text: str, messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> list[tuple[int, int]]:
        """Character spans ``[start, end)`` of each assistant turn's output in ``text`` (the
        render of ``messages``); see :mod:`eagle_data.extract.mask`.

        Raises:
            MaskError: (a subclass naming) why the conversation cannot be masked exactly.
        """
        self.check_text(messages, tools)
        return self._locate(text, self._for_template(messages), tools)[0]

    def _locate(self, text: str, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                ) -> tuple[list[tuple[int, int]], list[str]]:
        """Spans in ``text``, the render of ``msgs`` (already in the template's form), plus notes:
        ``final_reasoning_not_rendered`` when the template drops the last turn's reasoning
        (Kimi-K2-Thinking keeps reasoning only inside tool-call sequences), ``tools_not_rendered``
        when the record has tool schemas and the template does not render them."""
        pmsgs, pieces = placeholder_messages(msgs, self.call_anchor)
        where = align(text, self._apply(pmsgs, tools=tools), pieces, msgs)
        unsure: list[int] = []
        spans = assistant_spans(text, msgs, pieces, where, self.markers,
                                lambda i: self._prompt_end(text, msgs[:i], tools), unsure)
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        spans = [sp for sp, i in zip(spans, turns) if msgs[i].get("train", True)]  # "weight": 0 turns: context only
        rendered = {j for _, _, j in where}
        last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
        dropped = any(p.kind == "reasoning" and p.msg == last and j not in rendered for j, p in enumerate(pieces))
        return spans, (["final_reasoning_not_rendered"] if dropped else []) + \
            (["tools_not_rendered"] if tools and not self.tools_rendered else []) + \
            (["turn_start_at_first_field"] if unsure else [])

    def _prompt_end(self, text: str, head: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int | None:
        """Length of the prompt the template renders for the turn after ``head`` (with, else
        without, the generation prompt) when ``text`` starts with it; else None."""
        for gen in (True, False):
            try:
                p = self._apply(head, gen, tools)
            except Exception:  # e.g. a template that insists on ending with a user turn
                continue
            if text.startswith(p):
                return len(p)
        return None

    def find_special(self, text: str) -> str | None:
        """The first special token's string (or placeholder) in ``text``, else None."""
        hit = self._special_re.search(text)
        return hit.group() if hit else None

    def check_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> None:
        """Raises :class:`SpecialTokenInText` naming the message and field (or the record's
        ``tools``) whose text holds a special token's string (it would become the real token)."""
        for i, m in enumerate(messages):
            for key, value in m.items():
                if key != "role" and (hit := self._special_re.search(str(value))):
                    raise SpecialTokenInText(f"message {i} ({m['role']}) field '{key}' contains {hit.group()!r}", i)
        if tools and (hit := self._special_re.search(json.dumps(tools, ensure_ascii=False))):
            raise SpecialTokenInText(f"field 'tools' contains {hit.group()!r}")

    def encode(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Encoded:
        """Render, tokenise once and build the loss mask (see :class:`Encoded`).

        ``messages`` may be raw OpenAI messages: they are normalised exactly as the pipeline
        normalises a record's (:func:`~eagle_data.extract.conversations.normalize_record` of
        ``{"messages": messages, "tools": tools}``: list-of-parts content, ``content: None`` on a
        tool-call turn, reasoning aliases, JSON-string tool arguments, and the same changes: leading
        assistant turns and trailing user/tool turns dropped, the conversation cut before a blank
        trained reply), so encoding raw messages gives what extraction stores. Each such change's
        reason (``cut_at_blank_reply``, ``leading_turns_dropped``, ``trailing_turns_dropped``)
        comes first in the result's ``notes``.

        Raises:
            ValueError: the messages cannot be used (a :class:`~eagle_data.extract.fault.BadRecord`
                whose ``reason`` is the pipeline's skip reason; the message names the reason, the
                turn and the field), e.g. no assistant turn.
            MaskError: see :meth:`assistant_spans`.
        """
        if not isinstance(messages, list):
            raise ValueError(f"messages must be a list, got {type(messages).__name__}")
        conv = normalize_record(0, {"messages": messages, "tools": tools})
        if isinstance(conv, Skip):
            raise BadRecord(conv.reason, f"messages cannot be used ({conv.reason}): {conv.detail}")
        enc = self.encode_normalized(conv.messages, conv.tools)
        enc.notes[:0] = [reason for reason, _ in conv.notes]
        return enc

    def encode_normalized(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Encoded:
        """:meth:`encode` of messages already normalised (the pipeline's conversations)."""
        out = self.encode_batch([messages], [tools])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def encode_batch(self, batch: list[list[dict[str, Any]]], tools: list[list[dict[str, Any]] | None] | None = None
                     ) -> list[Encoded | Exception]:
        """:meth:`encode_normalized` of several conversations, with ONE tokenizer call for all of
        them (a fast tokenizer encodes a list on all cores with the GIL released; the result is
        the same as one call per text). A conversation that cannot be rendered or masked has its
        exception in its place (:class:`MaskError`, or what the template raised). ``tools``: each
        conversation's tool schemas (or None), aligned with ``batch``."""
        prepared: list[tuple[str, list[tuple[int, int]], list[str]] | Exception] = []
        for messages, schemas in zip(batch, tools or [None] * len(batch)):
            try:
                self.check_text(messages, schemas)
                msgs = self._for_template(messages)
                text = self._apply(msgs, tools=schemas)
                prepared.append((text, *self._locate(text, msgs, schemas)))
            except Exception as e:  # handed back in place: the caller names the reason
                prepared.append(e)
        texts = [p[0] for p in prepared if not isinstance(p, Exception)]
        enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True) if texts else None
        out: list[Encoded | Exception] = []
        j = 0
        for p in prepared:
            if isinstance(p, Exception):
                out.append(p)
                continue
            ids = np.asarray(enc["input_ids"][j], dtype=np.int64)
            off = np.asarray(enc["offset_mapping"][j], dtype=np.int64).reshape(-1, 2)
            j += 1
            if self._strip_ids.size:
                self._own_offsets(p[0], ids, off)
            mask = np.zeros(ids.shape[0], dtype=bool)
            for s, e in p[1]:  # a token overlapping an assistant span is supervised
                mask |= (off[:, 0] < e) & (off[:, 1] > s)
            out.append(Encoded(torch.from_numpy(ids), torch.from_numpy(mask.view(np.uint8)), p[2]))
        return out

    def _own_offsets(self, text: str, ids: np.ndarray, off: np.ndarray) -> None:
        """In place: the offsets of each lstrip/rstrip added token narrowed to its own string
        (the tokenizer reports them with the whitespace the token took in, which may lie in an
        assistant span: Phi-3's ``<|assistant|>`` takes the answer's leading newline)."""
        for t in np.flatnonzero(np.isin(ids, self._strip_ids)):
            s, e = off[t]
            c = self._strip_tokens[int(ids[t])]
            k = text.find(c, s, e)
            if k >= 0:
                off[t] = (k, k + len(c))

    def tokenize(self, messages: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [T] int64, loss_mask [T] uint8)`` of :meth:`encode`."""
        e = self.encode(messages)
        return e.input_ids, e.loss_mask
