"""Normalise ShareGPT / OpenAI chat records into validated message lists.

Stages take and return iterators (webdataset/datatrove style). A record that cannot be
used is never dropped silently: it becomes a :class:`~eagle_data.extract.fault.Skip` with a
named reason, which the :class:`~eagle_data.extract.fault.ErrorPolicy` counts and logs, and
which the manifest stores. A change that keeps
the record but not all of it (a conversation cut before a blank reply) is a *note*:
counted, logged and stored the same way (``note_counts``).

Accepted record layouts (one row of an HF ``datasets.Dataset``):

* ShareGPT: ``{"id": ..., "conversations": [{"from": "human"|"gpt"|..., "value": str}]}``
* OpenAI:   ``{"id": ..., "messages": [{"role": "user"|"assistant"|..., "content": ...}]}``

A turn's role and text are read from its own keys: one that has only the other layout's
(``{"role", "content"}`` turns under ``"conversations"``, as many datasets store them; the reverse;
or mixed) is read with those; both layouts' keys with different meanings are skipped
(``ambiguous_turn``).

Optionally a top-level ``"system"`` string. Roles are normalised with
:data:`~eagle_data.extract.messages.ROLE_MAP`.

Message fields and the record's tool schemas (``tools``, legacy ``functions``): see
:mod:`eagle_data.extract.messages`.

Rules: optional leading system message, then turns starting with user (leading assistant
turns are dropped, as FastChat/SpecForge do for ShareGPT continuations: note
``leading_turns_dropped``); a user turn is followed by an assistant turn; tool results follow
an assistant turn or another tool result; trailing user/tool turns are dropped (note
``trailing_turns_dropped``). A trained assistant turn with no content, reasoning or tool
call (blank) **cuts the conversation before the user turn it answers** (the note
``cut_at_blank_reply``; later turns would refer to an exchange that is gone); if nothing is
left the record is skipped (``empty_assistant``). A blank turn marked not to train (``weight``
0 / ``train`` false) is no target, so it cuts nothing and stays as context (the template renders
its empty turn; the mask leaves it out). A record that is not a JSON object is skipped
(``not_an_object``); text that cannot be encoded as UTF-8 (lone surrogates) is skipped
(``invalid_unicode``), since shards, metadata and the index store UTF-8.

Skip and note details name a turn by its index in the record's own turn list (``"messages"`` or
``"conversations"``), counted from 0 with every turn the record has (its system message and turns
dropped here included): ``turn 4 (0-based)`` is ``record["messages"][4]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from eagle_data.extract.fault import BadRecord, ErrorPolicy, Skip
from eagle_data.extract.messages import normalize_message, record_tools, text_field


@dataclass
class Conversation:
    """A validated conversation.

    Attributes:
        row: row number in the source dataset (stable sample identity).
        source_id: the record's own id (kept verbatim in metadata, may contain '.').
        messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}]``;
            assistant turns may hold ``reasoning_content`` (str) and ``tool_calls``.
        notes: ``(reason, detail)`` of changes made to the record (e.g. ``cut_at_blank_reply``).
        turn_index: for each message, its index in the record's turn list (``None``: the
            top-level ``"system"`` field), so a message can be written back in place.
        tools: the record's tool schemas (OpenAI ``tools``), handed to the template; None if none.
    """
    row: int
    source_id: str
    messages: list[dict[str, Any]]
    notes: list[tuple[str, str]] = field(default_factory=list)
    turn_index: list[int | None] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


def _cuts(m: dict[str, Any]) -> bool:
    """A trained assistant turn with no content, reasoning or tool call (a blank target); an
    untrained one is context and cuts nothing."""
    return (m["role"] == "assistant" and m.get("train", True) and not m["content"].strip()
            and "reasoning_content" not in m and not m.get("tool_calls"))


def _order(chat: list[dict[str, Any]], at: list[int]) -> None:
    """Raise ``broken_alternation`` unless: user -> assistant, assistant -> user|tool, tool -> tool|assistant.
    ``at``: each message's index in the record's turn list (what the detail names)."""
    allowed = {"user": ("assistant",), "assistant": ("user", "tool"), "tool": ("tool", "assistant")}
    if chat and chat[0]["role"] != "user":
        raise BadRecord("broken_alternation", f"turn {at[0]} (0-based) is {chat[0]['role']}, expected user")
    for i in range(1, len(chat)):
        prev, cur = chat[i - 1]["role"], chat[i]["role"]
        if cur not in allowed[prev]:
            raise BadRecord("broken_alternation", f"turn {at[i]} (0-based) is {cur} after {prev}, expected "
                                                  f"{' or '.join(allowed[prev])}")


def _conversation(row: int, sid: str, record: dict[str, Any]) -> Conversation:
    if record.get("conversations") is not None and record.get("messages") is not None:
        raise BadRecord("ambiguous_record", "both 'conversations' and 'messages' are given; keep one")
    if isinstance(record.get("conversations"), list):
        turns, rkey, ckey = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        turns, rkey, ckey = record["messages"], "role", "content"
    else:
        raise BadRecord("no_messages", "neither 'conversations' nor 'messages' is a list")
    system: list[dict[str, Any]] = []
    system_at: list[int | None] = []
    if record.get("system") is not None:
        text = text_field(record["system"], "field 'system'")
        if text.strip():
            system.append({"role": "system", "content": text})
            system_at.append(None)
    chat: list[dict[str, Any]] = []
    at: list[int] = []  # each chat message's index in ``turns``
    for i, turn in enumerate(turns):
        m = normalize_message(i, turn, rkey, ckey)
        if m["role"] == "system":
            if system or chat:
                where = "after other turns" if chat else ("but the record's 'system' field already gives one"
                                                          if system_at == [None] else "after another system message")
                raise BadRecord("misplaced_system", f"turn {i} (0-based) is a system message {where}")
            if m["content"].strip():
                system.append(m)
                system_at.append(i)
            continue
        chat.append(m)
        at.append(i)
    # ShareGPT V3 splits long chats into pieces that start with a "gpt" turn; like FastChat
    # and SpecForge, drop leading assistant/tool turns (they have no prompt in this record).
    lead = next((i for i, m in enumerate(chat) if m["role"] == "user"), len(chat))
    chat, at = chat[lead:], at[lead:]
    if not any(m["role"] == "assistant" for m in chat):
        raise BadRecord("no_assistant_turn", f"{len(chat)} non-system turn(s), none from the assistant")
    _order(chat, at)
    notes = [("leading_turns_dropped", f"{lead} turn(s) before the first user turn dropped (no prompt in this record)")
             ] if lead else []
    blank = next((i for i, m in enumerate(chat) if _cuts(m)), None)
    if blank is not None:
        cut = max(i for i in range(blank) if chat[i]["role"] == "user")
        if not any(m["role"] == "assistant" for m in chat[:cut]):
            raise BadRecord("empty_assistant", f"assistant turn {at[blank]} (0-based), the first answer, is blank")
        notes.append(("cut_at_blank_reply", f"assistant turn {at[blank]} (0-based) is blank: the conversation is cut "
                                            f"before turn {at[cut]}, the user turn it answers ({len(chat) - cut} turn(s) "
                                            f"dropped)"))
        chat = chat[:cut]
    trail = len(chat) - 1 - max(i for i, m in enumerate(chat) if m["role"] == "assistant")
    if trail:  # a trailing user/tool turn has no supervised answer
        notes.append(("trailing_turns_dropped", f"{trail} turn(s) after the last answer dropped"))
        chat = chat[:len(chat) - trail]
    return Conversation(row, sid, system + chat, notes, system_at + at[:len(chat)], record_tools(record))


def _id_text(sid: Any, row: int) -> str:
    """A record's id as text: a string as is, a JSON value as its JSON (not Python's repr), a date as
    ISO text, bytes as hex; none: the row number."""
    if sid is None:
        return str(row)
    if isinstance(sid, str):
        return sid
    if isinstance(sid, (bytes, bytearray)):
        return bytes(sid).hex()
    if hasattr(sid, "isoformat"):
        return sid.isoformat()
    return json.dumps(sid, ensure_ascii=False, sort_keys=True, default=str)


def normalize_record(row: int, record: Any) -> Conversation | Skip:
    """Validate one raw record. Returns a :class:`Conversation` or a :class:`Skip`.

    ``record`` may already be a :class:`Skip` (a source row that could not be read); it is returned.
    """
    if isinstance(record, Skip):
        return record
    if not isinstance(record, dict):
        return Skip(row, str(row), "not_an_object", f"record is {type(record).__name__}, not a JSON object")
    sid = _id_text(record.get("id"), row)
    try:
        text_field(sid, "field 'id'")
        return _conversation(row, sid, record)
    except BadRecord as e:
        return Skip(row, sid.encode("utf-8", "backslashreplace").decode(), e.reason, str(e))


def normalize(records: Iterable[tuple[int, dict[str, Any]]], policy: ErrorPolicy) -> Iterator[Conversation]:
    """Stage: ``(row, record)`` pairs -> valid :class:`Conversation` objects; skips go to ``policy``,
    notes (a kept record that was changed) to ``policy.note``."""
    for row, rec in records:
        out = normalize_record(row, rec)
        if isinstance(out, Skip):
            policy.handle(out)
            continue
        for reason, detail in out.notes:
            policy.note(Skip(row, out.source_id, reason, detail))
        yield out
