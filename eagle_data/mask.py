"""Where each message lies in a chat-template render: exact alignment, never a text search.

The conversation is rendered twice with the same template: once as it is (``text``) and once
with the *core* of every text field (content, reasoning, tool-call name) replaced by a unique
placeholder that keeps the field's leading and trailing whitespace (``ptext``). Whitespace
trimming, ``</think>`` splitting, dropping of old reasoning, role headers and injected system
prompts therefore act on both renders alike, and ``ptext`` is the template's own text with
holes where the messages go. :func:`align` walks ``ptext`` and ``text`` together: every piece
of template text must match exactly, and every hole must hold exactly that field's core (or
its JSON-escaped form, for templates that ``tojson`` a field). So each field's characters in
``text`` are *known*, not searched for: an answer that also occurs in a user message, a role
header or an earlier turn cannot be taken from there. Anything that does not align is a
:class:`MaskError` naming the message, skipped by the caller with its ``reason``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

PLACEHOLDER = re.compile(r"EAGLEPH(\d+)HP")  # ASCII: survives tojson unchanged
_THINK_TAGS = re.compile(r"(<think>|</think>)")


class MaskError(ValueError):
    """The loss mask of a conversation cannot be derived exactly; ``reason`` names the skip."""
    reason = "mask_unaligned"


class NotRendered(MaskError):
    """The template did not render a message's text (it would be silently lost)."""
    reason = "message_not_rendered"


class ToolCallsNotRendered(MaskError):
    """An assistant turn has tool calls the template does not render."""
    reason = "tool_calls_not_rendered"


class SpecialTokenInText(MaskError):
    """Message text contains a special token's string (it would become that token)."""
    reason = "special_token_in_text"


@dataclass(frozen=True)
class Piece:
    """One text field of one message: ``kind`` is ``content``, ``reasoning`` or ``tool_call``
    (a tool call's function name, or its id);
    ``core`` is the text without its edge whitespace."""
    msg: int
    kind: str
    core: str


def _hole(text: str, pieces: list[Piece], msg: int, kind: str) -> str:
    core = text.strip()
    if not core:
        return text
    pieces.append(Piece(msg, kind, core))
    lead = text[:len(text) - len(text.lstrip())]
    return f"{lead}EAGLEPH{len(pieces) - 1}HP{text[len(lead) + len(core):]}"


def _call_holes(call: dict[str, Any], pieces: list[Piece], i: int, anchor: str) -> dict[str, Any]:
    if anchor == "id":
        return {**call, "id": _hole(call["id"], pieces, i, "tool_call")} if isinstance(call.get("id"), str) else call
    return {**call, "function": {**call["function"], "name": _hole(call["function"]["name"], pieces, i, "tool_call")}}


def placeholder_messages(messages: list[dict[str, Any]], call_anchor: str = "name"
                         ) -> tuple[list[dict[str, Any]], list[Piece]]:
    """``messages`` with every text core replaced by a placeholder, and the pieces (index = id).

    A tool call gets a placeholder for its function name, or with ``call_anchor="id"`` (for a
    template that writes only the call's id) for its id.

    Assistant content is split at ``<think>``/``</think>`` tags first (the tags stay), so a
    template that cuts an inline think block sees the same tags in both renders.
    """
    pieces: list[Piece] = []
    out = []
    for i, m in enumerate(messages):
        new = dict(m)
        if m["role"] == "assistant":
            parts = _THINK_TAGS.split(m["content"])
            depth = 0
            for j, part in enumerate(parts):
                if part in ("<think>", "</think>"):
                    depth = 1 if part == "<think>" else 0
                else:
                    parts[j] = _hole(part, pieces, i, "reasoning" if depth else "content")
            new["content"] = "".join(parts)
            if "reasoning_content" in m:  # "thinking" (gpt-oss's name) is the same text: one piece
                hole = _hole(m["reasoning_content"], pieces, i, "reasoning")
                new.update({k: hole for k in ("reasoning_content", "thinking") if k in m})
            if m.get("tool_calls"):
                new["tool_calls"] = [_call_holes(c, pieces, i, call_anchor) for c in m["tool_calls"]]
        else:
            new["content"] = _hole(m["content"], pieces, i, "content")
        out.append(new)
    return out, pieces


def _renderings(core: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys((core, json.dumps(core, ensure_ascii=False)[1:-1], json.dumps(core)[1:-1])))


def align(text: str, ptext: str, pieces: list[Piece], messages: list[dict[str, Any]]
          ) -> list[tuple[int, int, int]]:
    """Character ranges of the pieces in ``text``: ``[(start, end, piece id)]`` in text order.

    Raises:
        MaskError: the two renders disagree outside the pieces, or a piece's text is not
            where the template text puts it (the template rewrote it).
    """
    parts = PLACEHOLDER.split(ptext)
    lits, ids = parts[0::2], [int(j) for j in parts[1::2]]
    if not text.startswith(lits[0]):
        raise MaskError("the template text before the first message differs between renders")
    pos, out = len(lits[0]), []
    for j, lit in zip(ids, lits[1:]):
        p = pieces[j]
        for cand in _renderings(p.core):
            if text.startswith(cand, pos) and text.startswith(lit, pos + len(cand)):
                break
        else:
            raise MaskError(f"message {p.msg} ({messages[p.msg]['role']} {p.kind}) is not rendered verbatim "
                            f"at character {pos}: the template rewrote it or rendered it differently")
        out.append((pos, pos + len(cand), j))
        pos += len(cand) + len(lit)
    if pos != len(text):
        raise MaskError("the template text after the last message differs between renders")
    return out


def _tail_end(tail: str, eot: tuple[str, ...], call_end: tuple[str, ...], tool_call: bool) -> int:
    """How much of ``tail`` (template text after an assistant's last piece) the assistant emits:
    whitespace + the end-of-turn marker right after it; for a tool-call turn, through the first
    end-of-turn (else tool-call-end) marker."""
    ws = len(tail) - len(tail.lstrip())
    for m in eot:
        if tail.startswith(m, ws):
            return ws + len(m)
    if not tool_call:
        return 0
    for markers in (eot, call_end):
        hits = [(tail.find(m), m) for m in markers if m in tail]
        if hits:
            p, m = min(hits)
            return p + len(m)
    raise MaskError(f"the end of a tool call is not marked by any of {list(eot + call_end)} before the next message")


def _own_turn(mine: list[tuple[int, int, int]], where: list[tuple[int, int, int]], pieces: list[Piece],
              i: int) -> list[tuple[int, int, int]]:
    """Message ``i``'s occurrences up to the first piece of another message that follows its
    first one, or the first repeat of one of its pieces: a repeat is an echo in another
    message's template text (gpt-oss repeats the tool name in the header of the tool's result)."""
    if not mine:
        return mine
    stop = min((s for s, _, j in where if s > mine[0][0] and pieces[j].msg != i), default=None)
    out, ids = [], set()
    for o in mine:
        if (stop is not None and o[0] >= stop) or o[2] in ids:
            break
        out.append(o)
        ids.add(o[2])
    return out


def assistant_spans(text: str, messages: list[dict[str, Any]], pieces: list[Piece],
                    where: list[tuple[int, int, int]], gen_prompt: str, eot: tuple[str, ...],
                    call_end: tuple[str, ...]) -> list[tuple[int, int]]:
    """``[start, end)`` of every assistant turn's output in ``text``, in message order.

    A turn's output starts right after the last generation prompt (``gen_prompt``, the text
    ``add_generation_prompt`` appends) in the template text before its first piece (so a
    ``<think>`` tag or a channel header the template writes there is supervised, as the model
    generates it), else at its first piece; it ends after its last piece plus the
    whitespace and end-of-turn marker that follow (see :func:`_tail_end`).

    Raises:
        NotRendered / ToolCallsNotRendered / MaskError.
    """
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for s, e, j in where:
        seen.setdefault(pieces[j].msg, []).append((s, e, j))
    for i, m in enumerate(messages):
        if m["role"] != "assistant" and i not in seen and m["content"].strip():
            raise NotRendered(f"message {i} ({m['role']}) is not rendered by the template")
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        mine = _own_turn(seen.get(i, []), where, pieces, i)
        if m.get("tool_calls") and not any(pieces[j].kind == "tool_call" for _, _, j in mine):
            raise ToolCallsNotRendered(f"message {i} (assistant) has tool calls the template does not render")
        if not mine:
            raise NotRendered(f"message {i} (assistant) is not rendered by the template")
        first, last = mine[0][0], mine[-1][1]
        before = max((e for s, e, _ in where if e <= first), default=0)
        k = text.rfind(gen_prompt, before, first) if gen_prompt else -1
        start = k + len(gen_prompt) if k >= 0 else first
        nxt = min((s for s, e, _ in where if s >= last), default=len(text))
        end = last + _tail_end(text[last:nxt], eot, call_end, bool(m.get("tool_calls")))
        spans.append((start, end))
    return spans
