"""One turn of a chat record as a validated message (role, text, reasoning, tool calls, weight),
and the record's tool schemas; :mod:`eagle_data.extract.conversations` builds conversations of them.

Roles are normalised with :data:`ROLE_MAP`.

Message fields (OpenAI style, as HF chat templates take them):

* ``content``: a string, or a list of parts; ``{"type": "text", "text": str}`` parts are
  joined with ``"\\n"`` (as vLLM does for text-only models); any other part type is skipped
  (``non_text_content``). ``None`` is allowed on an assistant turn with tool calls.
* ``reasoning_content`` (aliases ``reasoning``, ``thinking``) on an assistant turn: a string,
  handed to the template (see :mod:`eagle_data.extract.chat`). A blank one beside another is
  ignored; two non-blank ones with different text are skipped (``ambiguous_turn``).
* ``tool_calls`` on an assistant turn: ``[{"type": "function", "function": {"name": str,
  "arguments": dict | JSON string}}]`` (a JSON-string ``arguments`` is parsed, as vLLM does;
  OpenAI's legacy ``function_call`` field is one such call; on any other role: skipped; the list
  may be JSON text; a call whose ``type`` is not ``"function"``, or that gives both ``arguments``
  and ``parameters``, is skipped: ``bad_tool_call``); ShareGPT ``function_call`` turns hold one
  such call (``{"name", "arguments"}``) or a list of them as JSON text, and take ``weight`` /
  ``train`` and reasoning like any assistant turn.
* ``tool`` messages (ShareGPT ``tool``/``observation``/``function``): the tool's result;
  ``tool_call_id`` and ``name`` are kept.
* ``weight`` (0 or 1, axolotl's ShareGPT) or ``train`` (bool) on an assistant turn: ``0`` /
  ``false`` keeps the turn in the conversation (context) but out of the loss mask (an internal
  ``"train": False`` that the template never sees), a blank one too (it cuts nothing, see below).
  Only assistant turns are ever supervised, so these fields on other roles change nothing.

A top-level ``"tools"`` (OpenAI tool schemas: a list of objects, or that list as JSON text) is
handed to the template as its ``tools`` variable (template text: never supervised); a template
that does not render it gets the note ``tools_not_rendered``. OpenAI's legacy top-level
``"functions"`` (the schemas alone) is read as ``tools`` of type ``function``.
"""

from __future__ import annotations

import json
from typing import Any

from eagle_data.extract.fault import BadRecord

ROLE_MAP = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant", "function_call": "assistant",
    "tool": "tool", "observation": "tool", "function": "tool",
    "system": "system", "developer": "system",  # OpenAI's newer name for the system role
}
#: message fields holding the assistant's reasoning (the non-blank ones must agree)
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def text_field(value: Any, where: str, allow_none: bool = False) -> str | None:
    """A message text field: str, or a list of text parts (joined with newlines)."""
    if value is None and allow_none:
        return None
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise BadRecord("non_text_content", f"{where} part {j} is {kind!r}, not a text part")
            if not isinstance(part.get("text"), str):
                raise BadRecord("non_string_content", f"{where} part {j} field 'text' is "
                                                      f"{type(part.get('text')).__name__}")
            parts.append(part["text"])
        value = "\n".join(parts)
    if not isinstance(value, str):
        raise BadRecord("non_string_content", f"{where} is {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRecord("invalid_unicode", f"{where} is not encodable as UTF-8") from None
    return value


def _json_text(value: Any, where: str, reason: str, failure: str) -> None:
    """``value`` must be JSON (no bytes, sets, NaN) whose text is UTF-8: else
    :class:`BadRecord` ``reason`` with ``failure: <why>`` (or ``invalid_unicode`` naming ``where``)."""
    try:
        text_field(json.dumps(value, ensure_ascii=False, allow_nan=False), where)
    except (TypeError, ValueError) as e:  # a BadRecord is a ValueError too
        if isinstance(e, BadRecord):
            raise
        raise BadRecord(reason, f"{failure}: {e}") from None


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` -> ``[{"type": "function", "function": {"name", "arguments": dict}}]``."""
    if isinstance(calls, str):  # one call or a list of calls, as JSON text
        try:
            calls = json.loads(calls)
        except json.JSONDecodeError as e:
            raise BadRecord("bad_tool_call", f"{where} is not JSON: {e}") from None
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise BadRecord("bad_tool_call", f"{where} is not a non-empty list")
    out = []
    for j, call in enumerate(calls):
        if isinstance(call, str):
            try:
                call = json.loads(call)
            except json.JSONDecodeError as e:
                raise BadRecord("bad_tool_call", f"{where}[{j}] is not JSON: {e}") from None
        if not isinstance(call, dict):
            raise BadRecord("bad_tool_call", f"{where}[{j}] is {type(call).__name__}, not an object")
        if call.get("type", "function") != "function":
            raise BadRecord("bad_tool_call", f"{where}[{j}] field 'type' = {call['type']!r}: only 'function' calls "
                                             f"are supported")
        fn = call.get("function", call)
        if fn is not call and ({"arguments", "parameters"} & set(call)) and not ({"arguments", "parameters"} & set(fn)):
            raise BadRecord("bad_tool_call", f"{where}[{j}] has its arguments beside 'function', not in it")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise BadRecord("bad_tool_call", f"{where}[{j}] has no function name")
        if fn.get("arguments") is not None and fn.get("parameters") is not None:
            raise BadRecord("bad_tool_call", f"{where}[{j}] gives both 'arguments' and 'parameters'; keep one")
        args = fn.get("arguments") if fn.get("arguments") is not None else fn.get("parameters", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise BadRecord("bad_tool_call", f"{where}[{j}] arguments are not JSON: {e}") from None
        if not isinstance(args, dict):
            raise BadRecord("bad_tool_call", f"{where}[{j}] arguments are {type(args).__name__}, not an object")
        _json_text(args, f"{where}[{j}] arguments", "bad_tool_call", f"{where}[{j}] arguments are not JSON")
        text_field(fn["name"], f"{where}[{j}] name")
        new = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), (str, int)) and not isinstance(call["id"], bool):  # templates render it
            new["id"] = str(call["id"])
        out.append(new)
    return out


def _meaning(value: Any, is_role: bool) -> Any:
    """A role key's value as the role it names ("human" and "user" agree), a text key's as is."""
    return ROLE_MAP.get(value.strip().lower(), value) if is_role and isinstance(value, str) else value


def turn_keys(turn: dict[str, Any], rkey: str, ckey: str) -> tuple[str, str]:
    """The turn's own ``(role key, text key)``: each is the layout's (``rkey``, ``ckey``) unless the
    turn has only the other layout's (``{"role", "content"}`` turns under ``"conversations"`` are
    common, and the reverse; also mixed, e.g. ``{"from", "content"}``).

    Raises:
        BadRecord: ``ambiguous_turn``, both layouts' role keys or text keys with different values."""
    out = []
    for mine, other in ((rkey, {"from": "role", "role": "from"}[rkey]),
                        (ckey, {"value": "content", "content": "value"}[ckey])):
        if mine in turn and other in turn and _meaning(turn[mine], mine == rkey) != _meaning(turn[other], mine == rkey):
            raise BadRecord("ambiguous_turn", f"fields '{mine}' = {turn[mine]!r:.60} and '{other}' = "
                                              f"{turn[other]!r:.60} disagree; keep one")
        out.append(other if mine not in turn and other in turn else mine)
    return out[0], out[1]


def normalize_message(i: int, turn: Any, rkey: str = "role", ckey: str = "content") -> dict[str, Any]:
    """One turn (OpenAI fields by default) -> ``{"role", "content": str, ...}`` as described in
    the module docstring. Raises :class:`BadRecord` (a ValueError) naming the turn and field."""
    if not isinstance(turn, dict):
        raise BadRecord("bad_turn", f"turn {i} (0-based) is {type(turn).__name__}, not an object")
    try:
        rkey, ckey = turn_keys(turn, rkey, ckey)
    except BadRecord as e:
        raise BadRecord(e.reason, f"turn {i} (0-based) {e}") from None
    raw_role = turn.get(rkey)
    role = ROLE_MAP.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
    if role is None:
        raise BadRecord("unknown_role", f"turn {i} (0-based) field '{rkey}' = {raw_role!r}")
    msg: dict[str, Any] = {"role": role}
    calls_at = "tool_calls"
    if raw_role.strip().lower() == "function_call":  # ShareGPT tool call: the value is the call's (calls') JSON
        calls, calls_at, content = text_field(turn.get(ckey), f"turn {i} (0-based) field '{ckey}'"), ckey, ""
    else:
        calls = turn.get("tool_calls")
        if calls == [] or (isinstance(calls, str) and not calls.strip()):  # [] as vLLM's responses carry: none
            calls = None
        if calls is None and turn.get("function_call") is not None:  # OpenAI's legacy single call
            calls, calls_at = [turn["function_call"]], "function_call"
        if calls is not None and role != "assistant":
            raise BadRecord("bad_tool_call", f"turn {i} (0-based) is a {role} message with tool calls")
        content = text_field(turn.get(ckey), f"turn {i} (0-based) field '{ckey}'", allow_none=calls is not None)
    msg["content"] = content or ""
    if role == "assistant":
        if not _trained(turn, i):
            msg["train"] = False
        if (reasoning := _reasoning(turn, i)) is not None:
            msg["reasoning_content"] = reasoning
        if calls is not None:
            msg["tool_calls"] = _tool_calls(calls, f"turn {i} (0-based) field '{calls_at}'")
    if role == "tool":
        for k in ("tool_call_id", "name"):
            if isinstance(turn.get(k), int) and not isinstance(turn[k], bool):  # an integer id: templates render it
                msg[k] = str(turn[k])
            elif isinstance(turn.get(k), str):
                msg[k] = text_field(turn[k], f"turn {i} (0-based) field '{k}'")
    return msg


def _reasoning(turn: dict[str, Any], i: int) -> str | None:
    """An assistant turn's reasoning: the text of its non-blank :data:`REASONING_KEYS` fields
    ("" next to the real one is common), None if none. Raises :class:`BadRecord`
    (``ambiguous_turn``) when two of them hold different text (not only in the whitespace around
    it, which templates strip): neither is picked unsaid."""
    given = [(k, text_field(turn[k], f"turn {i} (0-based) field '{k}'")) for k in REASONING_KEYS if turn.get(k) is not None]
    given = [(k, v) for k, v in given if v.strip()]
    for k, other in given[1:]:
        if other.strip() != given[0][1].strip():
            raise BadRecord("ambiguous_turn", f"turn {i} (0-based) fields '{given[0][0]}' = {given[0][1]!r:.60} and '{k}' = "
                                              f"{other!r:.60} disagree; keep one")
    return given[0][1] if given else None


def _trained(turn: dict[str, Any], i: int) -> bool:
    """Whether an assistant turn is supervised: not when it says ``"weight": 0`` (axolotl's
    ShareGPT) or ``"train": false``. Raises :class:`BadRecord` (``bad_turn``) for another value."""
    w, t = turn.get("weight"), turn.get("train")
    if w is not None and (isinstance(w, bool) or w not in (0, 1)):
        raise BadRecord("bad_turn", f"turn {i} (0-based) field 'weight' = {w!r}: 0 (not trained on) or 1 are supported")
    if t is not None and not isinstance(t, bool):
        raise BadRecord("bad_turn", f"turn {i} (0-based) field 'train' = {t!r}: true or false")
    if w is not None and t is not None and (w != 0) != t:
        raise BadRecord("bad_turn", f"turn {i} (0-based) fields 'weight' = {w!r} and 'train' = {t!r} disagree")
    return w != 0 and t is not False


def normalize_tools(tools: Any, where: str = "field 'tools'") -> list[dict[str, Any]] | None:
    """A record's tool schemas (OpenAI ``tools``: a list of objects, or that list as JSON text)
    -> the list, None when absent or empty. Raises :class:`BadRecord` (``bad_tools``)."""
    if isinstance(tools, str):
        if not tools.strip():
            return None
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise BadRecord("bad_tools", f"{where} is not JSON: {e}") from None
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRecord("bad_tools", f"{where} is not a list of objects")
    _json_text(tools, where, "bad_tools", f"{where} is not JSON-serialisable")
    return tools


def record_tools(record: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The record's tool schemas: ``tools``, or OpenAI's legacy ``functions`` read as tools of type
    ``function``; None if none.

    Raises:
        BadRecord: ``bad_tools`` (both given, or not a list of objects).
    """
    tools = normalize_tools(record.get("tools"))
    if record.get("functions") not in (None, [], ""):  # OpenAI's legacy schemas (beside legacy function_call)
        if tools is not None:
            raise BadRecord("bad_tools", "both 'tools' and the legacy 'functions' are given; keep one")
        funcs = normalize_tools(record["functions"], "field 'functions'")
        tools = [f if f.get("type") == "function" and isinstance(f.get("function"), dict)  # already a tool
                 else {"type": "function", "function": f} for f in funcs] if funcs else None
    return tools
