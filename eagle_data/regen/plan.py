"""Which turns of a conversation are regenerated, the prompt of each, and the record written back.

A row becomes a :class:`Job`: its raw record, the validated
:class:`~eagle_data.extract.conversations.Conversation`, and the assistant messages to
regenerate (``targets``, in order). The job's messages are updated as replies arrive, so in
``mode="all"`` turn *j*'s prompt holds the regenerated replies of the turns before it.

Rules:

* targets: assistant turns without tool calls (a tool-call turn is kept as it is: the tool's
  result that follows answers that call); ``mode="last"``: only the last assistant turn, and a
  row whose last turn is a tool call is skipped (``tool_call_turn``); a row none of whose assistant
  turns is trained (``weight`` 0 / ``train`` false) is skipped as extraction would (``no_loss_tokens``);
* prompt of a target = the template's render of the messages before it with
  ``add_generation_prompt=True``, tokenised once (what a server feeds the model);
* a target whose prompt leaves no room (``len(prompt) >= max_length``): in ``mode="all"`` after
  at least one regenerated turn the record is cut after the last regenerated turn (note
  ``cut_at_max_length``: those turns would lie past ``max_length`` in extraction anyway);
  otherwise the row is skipped (``context_too_long``);
* a reply is the generated tokens before the stop token, decoded with special tokens kept; a
  reply that is blank is a failure (``empty_reply``), one holding a special token's text
  (which extraction would refuse) too (``special_token_in_reply``); with ``split_reasoning`` a
  reply holding ``</think>`` becomes ``reasoning_content`` + ``content`` (what the templates
  render back as ``<think>\\n...\\n</think>\\n\\n...``);
* the record written back is the source record with each regenerated turn's text replaced in
  place (its old reasoning removed), every other field kept, an ``id`` (the source id) if it had
  none, and a ``regeneration`` field: source row, turn indices, finish reasons, token counts.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from typing import Any

from eagle_data.extract.conversations import Conversation
from eagle_data.extract.messages import REASONING_KEYS, turn_keys
from eagle_data.extract.fault import BadRecord

#: the tag that ends a reasoning block in the replies of thinking models
THINK_END = "</think>"


@dataclass
class Reply:
    """What the engine generated for one prompt.

    Attributes:
        token_ids: generated tokens, the stop token excluded.
        finish: ``"stop"`` (a stop token ended it) or ``"length"`` (the token budget did).
        num_generated: tokens the engine generated (the stop token included).
        error: the engine's error for this prompt (then the other fields are empty).
    """
    token_ids: list[int]
    finish: str
    num_generated: int = 0
    error: str | None = None


@dataclass
class Turn:
    """One regenerated turn: message index in the conversation, raw turn index in the record."""
    message: int
    turn: int | None
    finish: str
    prompt_tokens: int
    reply_tokens: int


@dataclass
class Job:
    """One source row being regenerated (see the module docstring)."""
    row: int
    source_id: str
    record: dict[str, Any]
    conv: Conversation
    targets: list[int]
    done: list[Turn] = field(default_factory=list)
    cut: bool = False

    @property
    def pending(self) -> int | None:
        """Message index of the next turn to regenerate (``None``: finished)."""
        return None if self.cut or len(self.done) == len(self.targets) else self.targets[len(self.done)]


def plan(conv: Conversation, record: dict[str, Any], mode: str) -> Job:
    """The :class:`Job` of a validated conversation.

    Raises:
        BadRecord: ``no_loss_tokens`` (every assistant turn is marked not to train, so extraction
            would skip the row), ``tool_call_turn`` (mode "last", the last turn is a tool call) or
            ``no_regenerable_turn`` (every assistant turn is a tool call).
    """
    assistant = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
    if not any(conv.messages[i].get("train", True) for i in assistant):  # as extraction would skip it
        raise BadRecord("no_loss_tokens", f"every assistant turn ({len(assistant)}) is marked not to train "
                                          f"(weight 0 / train false): nothing would be supervised")
    if mode == "last":
        if conv.messages[assistant[-1]].get("tool_calls"):
            raise BadRecord("tool_call_turn", f"the last assistant turn (message {assistant[-1]}) is a tool call")
        targets = assistant[-1:]
    else:
        targets = [i for i in assistant if not conv.messages[i].get("tool_calls")]
        if not targets:
            raise BadRecord("no_regenerable_turn", f"all {len(assistant)} assistant turn(s) are tool calls")
    return Job(conv.row, conv.source_id, record, conv, targets)


def turn_seed(seed: int, row: int, message: int) -> int:
    """A sampling seed per (run seed, row, message): the same on every rerun and machine."""
    h = hashlib.sha256(f"{seed}:{row}:{message}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def split_reply(text: str, split_reasoning: bool) -> dict[str, str]:
    """``{"content": ..., ["reasoning_content": ...]}`` of a reply's text (see module docstring)."""
    if not split_reasoning or THINK_END not in text:
        return {"content": text}
    reasoning, content = text.split(THINK_END, 1)
    reasoning = reasoning.lstrip()
    reasoning = reasoning.removeprefix("<think>").strip("\n")
    out = {"content": content.lstrip("\n")}
    if reasoning.strip():
        out["reasoning_content"] = reasoning
    return out


def apply_reply(job: Job, message: int, fields: dict[str, str], finish: str, prompt_tokens: int,
                reply_tokens: int) -> None:
    """Put a reply into the job's conversation (the context of its later turns)."""
    old = job.conv.messages[message]
    job.conv.messages[message] = {"role": "assistant", **fields, **({"train": False} if old.get("train") is False else {})}
    job.done.append(Turn(message, job.conv.turn_index[message], finish, prompt_tokens, reply_tokens))


def output_record(job: Job, settings_id: str) -> dict[str, Any]:
    """The source record with the regenerated turns written back (see the module docstring)."""
    rec = copy.deepcopy(job.record)
    key, rkey, ckey = (("conversations", "from", "value") if isinstance(rec.get("conversations"), list)
                       else ("messages", "role", "content"))
    turns = rec[key]
    for t in job.done:
        assert t.turn is not None, "a regenerated assistant turn always comes from the turn list"
        new = job.conv.messages[t.message]
        raw = turns[t.turn]
        for k in REASONING_KEYS:
            raw.pop(k, None)
        for k in {turn_keys(raw, rkey, ckey)[1]} | ({"value", "content"} & set(raw)):  # its text key(s): no stale copy
            raw[k] = new["content"]
        if "reasoning_content" in new:
            raw["reasoning_content"] = new["reasoning_content"]
    if job.cut:
        del turns[job.done[-1].turn + 1:]
    if rec.get("id") is None:
        rec["id"] = job.source_id
    rec["regeneration"] = {"row": job.row, "source_id": job.source_id, "settings": settings_id,
                           "turns": [t.turn for t in job.done], "finish": [t.finish for t in job.done],
                           "prompt_tokens": [t.prompt_tokens for t in job.done],
                           "reply_tokens": [t.reply_tokens for t in job.done],
                           **({"cut_at_max_length": True} if job.cut else {})}
    return rec
