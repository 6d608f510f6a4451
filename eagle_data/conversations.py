"""Normalise ShareGPT / OpenAI chat records into validated message lists.

Stages take and return iterators (webdataset/datatrove style). A record that cannot be
used is never dropped silently: it becomes a :class:`Skip` with a named reason, which
:class:`DropCounter` counts and logs, and which the manifest stores.

Accepted record layouts (one row of an HF ``datasets.Dataset``):

* ShareGPT: ``{"id": ..., "conversations": [{"from": "human"|"gpt"|..., "value": str}]}``
* OpenAI:   ``{"id": ..., "messages": [{"role": "user"|"assistant"|..., "content": str}]}``

Optionally a top-level ``"system"`` string. Roles are normalised with :data:`ROLE_MAP`.
Rules: optional leading system message, then strictly alternating user/assistant turns
starting with user (leading assistant turns are dropped, as FastChat/SpecForge do for
ShareGPT continuations); a trailing user turn is dropped; at least one non-empty assistant message; every content a string.
A record that is not a JSON object is skipped (``not_an_object``); text that cannot be
encoded as UTF-8 (lone surrogates, e.g. from a ``"\\ud800"`` escape) is skipped
(``invalid_unicode``), since shards, metadata and the index store UTF-8.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

log = logging.getLogger(__name__)

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system",
}


@dataclass
class Conversation:
    """A validated conversation.

    Attributes:
        row: row number in the source dataset (stable sample identity).
        source_id: the record's own id (kept verbatim in metadata, may contain '.').
        messages: ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``.
    """
    row: int
    source_id: str
    messages: list[dict[str, str]]


@dataclass
class Skip:
    """A record that was not used: ``reason`` is a short stable name, ``detail`` says where."""
    row: int
    source_id: str
    reason: str
    detail: str = ""


class DropCounter:
    """Counts skipped samples per reason and logs each one (first ``log_first`` in full)."""

    def __init__(self, log_first: int = 20):
        self.counts: Counter[str] = Counter()
        self.log_first = log_first

    def add(self, skip: Skip) -> None:
        self.counts[skip.reason] += 1
        n = sum(self.counts.values())
        msg = "skip row %d (id %s): %s%s" % (skip.row, skip.source_id, skip.reason,
                                              f": {skip.detail[:300]}" if skip.detail else "")
        if n <= self.log_first:
            log.warning(msg)
        else:
            log.debug(msg)

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))


@dataclass
class ErrorPolicy:
    """What to do with a bad record: ``"skip"`` (count + log, default for data) or ``"raise"``."""
    mode: str = "skip"
    counter: DropCounter = field(default_factory=DropCounter)

    def __post_init__(self):
        if self.mode not in ("skip", "raise"):
            raise ValueError(f"error policy must be 'skip' or 'raise', got {self.mode!r}")

    def handle(self, skip: Skip) -> None:
        if self.mode == "raise":
            raise ValueError(f"row {skip.row} (id {skip.source_id}): {skip.reason}: {skip.detail}")
        self.counter.add(skip)


def _utf8_ok(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def normalize_record(row: int, record: Any) -> Conversation | Skip:
    """Validate one raw record. Returns a :class:`Conversation` or a :class:`Skip`.

    ``record`` may already be a :class:`Skip` (a source row that could not be read); it is returned.
    """
    if isinstance(record, Skip):
        return record
    if not isinstance(record, dict):
        return Skip(row, str(row), "not_an_object", f"record is {type(record).__name__}, not a JSON object")
    sid = record.get("id")
    sid = str(sid) if sid is not None else str(row)
    if not _utf8_ok(sid):
        return Skip(row, sid.encode("utf-8", "backslashreplace").decode(), "invalid_unicode", "field 'id'")
    if isinstance(record.get("conversations"), list):
        turns, rkey, ckey = record["conversations"], "from", "value"
    elif isinstance(record.get("messages"), list):
        turns, rkey, ckey = record["messages"], "role", "content"
    else:
        return Skip(row, sid, "no_messages", "neither 'conversations' nor 'messages' is a list")
    messages: list[dict[str, str]] = []
    system = record.get("system")
    if system is not None:
        if not isinstance(system, str):
            return Skip(row, sid, "non_string_content", f"field 'system' is {type(system).__name__}")
        if not _utf8_ok(system):
            return Skip(row, sid, "invalid_unicode", "field 'system' is not encodable as UTF-8")
        if system.strip():
            messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return Skip(row, sid, "bad_turn", f"turn {i} is {type(turn).__name__}, not an object")
        raw_role = turn.get(rkey)
        role = ROLE_MAP.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
        if role is None:
            return Skip(row, sid, "unknown_role", f"turn {i} field '{rkey}' = {raw_role!r}")
        content = turn.get(ckey)
        if not isinstance(content, str):
            return Skip(row, sid, "non_string_content",
                        f"turn {i} field '{ckey}' is {type(content).__name__}")
        if not _utf8_ok(content):
            return Skip(row, sid, "invalid_unicode", f"turn {i} field '{ckey}' is not encodable as UTF-8")
        if role == "system":
            if messages:
                return Skip(row, sid, "misplaced_system", f"turn {i} is a system message after other turns")
            if content.strip():
                messages.append({"role": "system", "content": content})
            continue
        if role == "assistant" and not content.strip():
            return Skip(row, sid, "empty_assistant", f"turn {i} has empty content")
        messages.append({"role": role, "content": content})
    # ShareGPT V3 splits long chats into pieces that start with a "gpt" turn; like FastChat
    # and SpecForge, drop leading assistant turns (they have no prompt in this record).
    system = [m for m in messages if m["role"] == "system"]
    chat = [m for m in messages if m["role"] != "system"]
    lead = 0
    while lead < len(chat) and chat[lead]["role"] == "assistant":
        lead += 1
    chat = chat[lead:]
    messages = system + chat
    if not any(m["role"] == "assistant" for m in chat):
        return Skip(row, sid, "no_assistant_turn", f"{len(chat)} non-system turn(s), none from the assistant")
    for i, m in enumerate(chat):
        want = "user" if i % 2 == 0 else "assistant"
        if m["role"] != want:
            return Skip(row, sid, "broken_alternation", f"message {i} is {m['role']}, expected {want}")
    # A trailing user turn has no supervised answer: drop it (not the sample).
    if chat[-1]["role"] == "user":
        messages = messages[:-1]
    return Conversation(row, sid, messages)


def normalize(records: Iterable[tuple[int, dict[str, Any]]], policy: ErrorPolicy) -> Iterator[Conversation]:
    """Stage: ``(row, record)`` pairs -> valid :class:`Conversation` objects; skips go to ``policy``."""
    for row, rec in records:
        out = normalize_record(row, rec)
        if isinstance(out, Skip):
            policy.handle(out)
        else:
            yield out
