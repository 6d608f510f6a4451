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
from typing import Any, Callable, Iterable

PLACEHOLDER = re.compile(r"EAGLEPH(\d+)HP")  # ASCII: survives tojson unchanged
_THINK_TAGS = re.compile(r"(<think>|</think>)")


class MaskError(ValueError):
    """The loss mask of a conversation cannot be derived exactly; ``reason`` names the skip,
    ``message`` the index of the message at fault in the list handed to the template (``None``:
    not one message)."""
    reason = "mask_unaligned"

    def __init__(self, text: str, message: int | None = None):
        super().__init__(text)
        self.message = message


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
        if not isinstance(call.get("id"), str) or not call["id"].strip():
            raise ToolCallsNotRendered(f"message {i} (assistant) has a tool call without an 'id': this template "
                                       f"writes a call's id, not its name, so the call would be rendered nameless", i)
        return {**call, "id": _hole(call["id"], pieces, i, "tool_call")}
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
            parts = _THINK_TAGS.split(m["content"] or "")  # None: a tool-call turn (DeepSeek-V3)
            depth = 0
            for j, part in enumerate(parts):
                if part in ("<think>", "</think>"):
                    depth = 1 if part == "<think>" else 0
                else:
                    parts[j] = _hole(part, pieces, i, "reasoning" if depth else "content")
            new["content"] = "".join(parts) if m["content"] is not None else None
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
        if j >= len(pieces):
            raise MaskError(f"the template rendered a placeholder-like string EAGLEPH{j}HP it was not given")
        p = pieces[j]
        for cand in _renderings(p.core):
            if text.startswith(cand, pos) and text.startswith(lit, pos + len(cand)):
                break
        else:
            raise MaskError(f"message {p.msg} ({messages[p.msg]['role']} {p.kind}) is not rendered verbatim "
                            f"at character {pos}: the template rewrote it or rendered it differently", p.msg)
        out.append((pos, pos + len(cand), j))
        pos += len(cand) + len(lit)
    if pos != len(text):
        raise MaskError("the template text after the last message differs between renders")
    return out


@dataclass(frozen=True)
class TurnMarkers:
    """What a template writes around an assistant turn (found once by
    :class:`~eagle_data.extract.chat.ChatRenderer`'s probe).

    Attributes:
        prompt: the generation prompt (what ``add_generation_prompt`` appends).
        prompt_cuts: lengths of the prefixes of ``prompt`` that may stand for it, longest
            first: the whole, and where the prompt ends in a thinking part, the prefix before it
            and those ending at a special token or a line end inside it (DeepSeek-R1's prompt
            ends in ``<think>\\n``, which its tool-call turns do not have).
        boundary: the template text between a user message and the answer to it, for
            templates with no generation prompt (Mistral ``[/INST] ``, Phi-4).
        eot: end-of-turn special tokens; ``call_end``: the one ending a tool-call turn when it
            is not an end-of-turn token (gpt-oss ``<|call|>``, Llama ``<|eom_id|>``).
    """
    prompt: str
    prompt_cuts: tuple[int, ...]
    boundary: str
    eot: tuple[str, ...]
    call_end: tuple[str, ...] = ()


def _output_start(text: str, before: int, first: int, mk: TurnMarkers) -> int | None:
    """Where a turn's output starts in ``text[before:first]`` (the template text before its
    first piece): after the last generation prompt (or the longest of its ``prompt_cuts``)
    there; with no generation prompt, after the user->answer boundary that ends the text
    (the turn's own leading whitespace aside), else after the last boundary in it (Mistral's
    ``[/INST]`` before ``[TOOL_CALLS]``); None when the text holds neither (a turn right
    after a tool result, in templates that write no header there)."""
    if mk.prompt:
        for n in mk.prompt_cuts:
            k = text.rfind(mk.prompt[:n], before, first)
            if k >= 0:
                return k + n
        return None
    head, bound = text[before:first], mk.boundary.rstrip()
    if bound and head.rstrip().endswith(bound):
        return before + len(head.rstrip())
    k = head.rfind(bound) if bound else -1
    return before + k + len(bound) if k >= 0 else None


def first_marker(text: str, markers: Iterable[str]) -> tuple[int, str] | None:
    """``(position, marker)`` of the earliest of ``markers`` in ``text``, or None."""
    return min(((text.find(m), m) for m in markers if m in text), default=None)


def _output_end(tail: str, mk: TurnMarkers, tool_call: bool, last: bool) -> int:
    """How much of ``tail`` (template text after a turn's last piece, up to the next message's
    first piece) the turn emits: through its first end-of-turn marker (after e.g. a closing
    ``</think>`` the template writes); for a tool-call turn through its first end-of-turn or
    call-end marker; the last turn of a template that does not close it (GLM) emits the rest
    of the text but trailing whitespace."""
    markers = mk.eot + mk.call_end if tool_call else mk.eot
    if hit := first_marker(tail, markers):
        return hit[0] + len(hit[1])
    if tool_call:
        raise MaskError(f"the end of a tool call is not marked by any of {list(markers)} before the next message")
    return len(tail.rstrip()) if last else 0


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
                    where: list[tuple[int, int, int]], mk: TurnMarkers,
                    prompt_end: Callable[[int], int | None] = lambda i: None,
                    unsure: list[int] | None = None) -> list[tuple[int, int]]:
    """``[start, end)`` of every assistant turn's output in ``text``, in message order: from
    :func:`_output_start` (so a ``<think>`` tag, a channel header or a tool-call opener the
    template writes inside the turn is supervised, as the model generates it) to
    :func:`_output_end`. Where the template text before a turn holds no generation prompt or
    boundary, the turn starts at ``prompt_end(i)`` (the length of the prompt the template
    renders for message ``i``, when ``text`` starts with it and it ends between the previous
    piece and the turn's first), else at its first piece (its index then goes to ``unsure``:
    DeepSeek-V3/R1 write a second call after a tool result with no header, and the prompt they
    render for it is not a prefix of the render). A turn followed by a tool result is
    ended like a tool-call turn (GLM writes ``<|observation|>`` there). A turn with no text
    marked not to train (``"train": False``: a blank reply kept as context, also when the template
    drops its old reasoning) has the empty span ``(0, 0)``.

    Raises:
        NotRendered / ToolCallsNotRendered: a content or tool-call piece is not rendered
            (reasoning may be: templates drop old reasoning by design); MaskError.
    """
    rendered = {j for _, _, j in where}
    for j, p in enumerate(pieces):
        if p.kind != "reasoning" and j not in rendered:
            kind = ToolCallsNotRendered if p.kind == "tool_call" else NotRendered
            raise kind(f"message {p.msg} ({messages[p.msg]['role']} {p.kind}) is not rendered by the template", p.msg)
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for s, e, j in where:
        seen.setdefault(pieces[j].msg, []).append((s, e, j))
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        mine = _own_turn(seen.get(i, []), where, pieces, i)
        if not mine and m.get("train", True) is False:  # its content and calls were checked above:
            spans.append((0, 0))  # a blank turn (its reasoning dropped) kept as context: nothing supervised
            continue
        if not mine:
            raise NotRendered(f"message {i} (assistant) is not rendered by the template"
                              + ("" if any(p.msg == i for p in pieces) else ": it has no text"), i)
        first, last = mine[0][0], mine[-1][1]
        before = max((e for s, e, _ in where if e <= first), default=0)
        nxt = min((s for s, e, _ in where if s >= last), default=len(text))
        calls = bool(m.get("tool_calls")) or (i + 1 < len(messages) and messages[i + 1]["role"] == "tool")
        end = last + _output_end(text[last:nxt], mk, calls, nxt == len(text))
        start = _output_start(text, before, first, mk)
        if start is None:
            p = prompt_end(i)
            found = p is not None and before <= p <= first
            start = p if found else first
            if not found and text[before:first].strip() and unsure is not None:
                unsure.append(i)
        spans.append((start, end))
    return spans
