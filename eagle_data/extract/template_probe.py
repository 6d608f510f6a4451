"""What a chat template writes around an assistant turn, found once when a
:class:`~eagle_data.extract.chat.ChatRenderer` is built (the *probe*): the generation prompt and
its admissible cuts, the user->answer boundary, the end-of-turn and call-end special tokens,
whether the template reads a reasoning field, how it takes tool-call arguments, a call-only
turn's content and a call's anchor (name or id), whether it renders a tool-call turn's text with
its calls and a record's ``tools``, and which non-special added tokens it writes as role
markers. Each probe renders placeholder conversations; nothing here reads user data.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace

from eagle_data.extract.mask import PLACEHOLDER, TurnMarkers, first_marker

_READS_REASONING = re.compile(r"reasoning_content|message\s*\.\s*thinking|\[\s*['\"]thinking['\"]\s*\]|"
                              r"['\"]thinking['\"]\s+in\s+message")


def _ph(j: int) -> str:
    return f"EAGLEPH{j}HP"


class TemplateProbe:
    """Mixin of :class:`~eagle_data.extract.chat.ChatRenderer`: the probes (it provides
    ``render``, ``tokenizer``, ``template``, ``name``, ``_specials`` and ``_use_specials``; the
    probes set ``markers``, ``reasoning_rendered``, ``args_as_json``, ``call_content_none``,
    ``call_anchor``, ``call_content_rendered``, ``tools_rendered``, and add to the specials)."""

    def _leading_special(self, text: str) -> str | None:
        body = text.lstrip()
        return next((s for s in self._specials if body.startswith(s)), None)

    def _probe(self) -> None:
        msgs = [{"role": "user", "content": _ph(0)}, {"role": "assistant", "content": _ph(1)},
                {"role": "user", "content": _ph(2)}, {"role": "assistant", "content": _ph(3)}]
        try:
            one = self.render(msgs[:1])
            gen = self.render(msgs[:1], add_generation_prompt=True)
            text = self.render(msgs)
        except Exception as e:
            raise ValueError(f"{self.name} cannot render a plain user/assistant conversation: "
                             f"{type(e).__name__}: {e}") from e
        if any(_ph(j) not in text for j in range(4)):
            raise ValueError(f"{self.name} does not render every message of a plain user/assistant conversation")
        # what add_generation_prompt appends (some templates end a conversation with a marker
        # that the generation prompt replaces, e.g. Phi-3's <|endoftext|>)
        cut = len(os.path.commonprefix([one, gen]))
        while 0 < cut < len(one) and not any(one.startswith(s, cut) for s in self._specials):
            cut -= 1  # never split a special token
        prompt = gen[cut:]
        boundary = text[text.index(_ph(0)) + len(_ph(0)):text.index(_ph(1))]
        mid = text[text.index(_ph(1)) + len(_ph(1)):text.index(_ph(2))]
        last = text[text.index(_ph(3)) + len(_ph(3)):]
        eot = self._leading_special(mid)
        if eot is None:
            raise ValueError(f"{self.name}: the text after an assistant message, {mid[:40]!r}, does not start "
                             "with a special token of the tokenizer, so the end of a turn cannot be supervised. "
                             "Use a tokenizer that declares the template's end-of-turn marker as a special token.")
        if len(self.tokenizer.encode(eot, add_special_tokens=False)) != 1:
            raise ValueError(f"{self.name}: the end-of-turn marker {eot!r} does not encode as one token")
        eots = tuple(dict.fromkeys(x for x in (eot, self._leading_special(last)) if x))
        think = [msgs[0], {"role": "assistant", "content": _ph(1), "reasoning_content": _ph(2)}]
        try:
            self.reasoning_rendered = _ph(2) in self.render(think)
        except Exception:
            self.reasoning_rendered = False
        # a template may render reasoning only in some positions (Kimi-K2-Thinking: inside a
        # tool-call sequence): if it reads the field at all, it decides
        code = re.sub(r"\{#.*?#\}", "", self.template, flags=re.DOTALL)
        self.reasoning_rendered |= bool(_READS_REASONING.search(code))
        self.markers = TurnMarkers(prompt, self._prompt_cuts(prompt), boundary, eots)
        self.markers = replace(self.markers, call_end=self._probe_tool_call(msgs))
        schema = [{"type": "function", "function": {"name": _ph(6), "description": "", "parameters": {}}}]
        try:
            self.tools_rendered = _ph(6) in self.render(msgs, tools=schema)
        except Exception:
            self.tools_rendered = False

    def _prompt_cuts(self, prompt: str) -> tuple[int, ...]:
        """See :class:`~eagle_data.extract.mask.TurnMarkers`: ``prompt_cuts``."""
        think = [k for k in (prompt.find("<think>"), prompt.find("</think>")) if k >= 0]
        least = min(think, default=len(prompt))  # only a thinking part may be missing from a turn
        ends = {i + len(x) for x in self._specials for i in range(len(prompt)) if prompt.startswith(x, i)}
        ends |= {i + 1 for i, c in enumerate(prompt) if c == "\n"} | {least, len(prompt)}
        return tuple(sorted((n for n in ends if n >= least), reverse=True))

    def _probe_tool_call(self, msgs) -> tuple[str, ...]:
        """How the template takes tool-call arguments (``self.args_as_json``: a JSON string, as
        DeepSeek's templates concatenate them, instead of a dict) and the special token that
        ends a tool-call turn when it is not the end-of-turn marker."""
        if "tool_calls" not in self.template:
            return ()
        for as_json, none in ((False, False), (True, False), (False, True), (True, True)):
            args = {"city": _ph(1)}
            call = {"type": "function", "id": "call00001",
                    "function": {"name": _ph(4), "arguments": json.dumps(args) if as_json else args}}
            conv = [msgs[0], {"role": "assistant", "content": None if none else "", "tool_calls": [call]},
                    {"role": "tool", "content": _ph(2), "name": "get_weather", "tool_call_id": "call00001"},
                    {"role": "assistant", "content": _ph(3)}]
            try:
                text = self.render(conv)
            except Exception:
                continue
            if _ph(1) in text and _ph(2) in text:
                # DeepSeek-V3 renders calls only when content is None (HF's convention for a
                # turn that is only tool calls)
                self.args_as_json, self.call_content_none = as_json, none
                # the call's name anchors its position, else its id (Kimi-K2 writes only the id)
                self.call_anchor = "name" if _ph(4) in text else "id"
                # whether a tool-call turn's own text is rendered with its calls (Llama-3.1 drops
                # the text, DeepSeek-V3 the calls)
                with_text = [conv[0], {**conv[1], "content": _ph(5)}, *conv[2:]]
                try:
                    out = self.render(with_text)
                    self.call_content_rendered = _ph(5) in out and _ph(1) in out
                except Exception:
                    self.call_content_rendered = False
                tail = text[text.index(_ph(1)) + len(_ph(1)):text.index(_ph(2))]
                if any(m in tail for m in self.markers.eot):
                    return ()
                hit = first_marker(tail, self._specials)
                return (hit[1],) if hit else ()
        return ()

    def _refuse_structural_tokens(self) -> None:
        """Message text is refused (:meth:`check_text`) when it holds a special token's string,
        or the string of a NON-special added token that the template itself writes around the
        messages (DeepSeek-R1-Distill's ``<｜User｜>``/``<｜Assistant｜>`` are not special): typed
        into a message, it would become that role marker. ``<think>``/``</think>`` stay
        allowed (inline reasoning is content)."""
        msgs = [{"role": "user", "content": _ph(0)}, {"role": "assistant", "content": _ph(1)},
                {"role": "user", "content": _ph(2)}]
        frame = PLACEHOLDER.sub("\x00", self.render(msgs, add_generation_prompt=True) + self.markers.boundary)
        extra = {t.content for t in self.tokenizer.added_tokens_decoder.values()
                 if not t.special and t.content and t.content.strip() and t.content in frame
                 and t.content not in ("<think>", "</think>")}
        if extra - set(self._specials):
            self._use_specials(set(self._specials) | extra)
