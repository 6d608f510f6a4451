"""The turns of a regeneration, streamed through the engine: every row advances on its own (its
next turn is asked for as soon as its last reply is back), and parts are published in source
order as their last row ends. A round per part (every row's turn *j* in one call) left the GPU
waiting on each round's longest reply (BENCHMARKS.md, "SGLang on the GPU").

At most ``batch_size`` requests are in flight (HF generates them as left-padded batches, SGLang
schedules them itself: :mod:`eagle_data.regen.engines`), and parts open while the open ones hold
fewer than ``4 * batch_size`` rows. The outcome of each row is decided here
(module :mod:`eagle_data.regen.run` lists them).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from eagle_data.extract.chat import ChatRenderer
from eagle_data.extract.conversations import normalize_record
from eagle_data.extract.fault import BadRecord, DropCounter, Skip
from eagle_data.extract.mask import MaskError
from eagle_data.regen.config import RegenerateConfig
from eagle_data.regen.engines import Generator
from eagle_data.regen.plan import Job, apply_reply, output_record, plan, split_reply, turn_seed

log = logging.getLogger(__name__)

#: seconds between progress lines in the log (a stalled run shows as lines that do not move)
REPORT_EVERY_S = 60.0


@dataclass
class Part:
    """One part's rows ``[start, end)`` while they are regenerated, and their outcomes."""
    start: int
    end: int
    rows: list[tuple[int, Any]]
    jobs: list[Job] = field(default_factory=list)
    live: int = 0                       # jobs not finished yet
    rejects: dict[int, dict[str, Any]] = field(default_factory=dict)
    notes: Counter = field(default_factory=Counter)
    tokens: int = 0
    seconds: float = 0.0                # its share of the time spent waiting on the engine


@dataclass
class Done:
    """A finished part: its records, reject records and outcomes."""
    part: Part
    data: list[dict[str, Any]]
    rejects: list[dict[str, Any]]


class Regenerator:
    """Regenerates parts of rows (see the module docstring) with a renderer and an engine."""

    def __init__(self, cfg: RegenerateConfig, renderer: ChatRenderer, generator: Generator, settings_id: str,
                 counter: DropCounter):
        self.cfg, self.renderer, self.gen, self.settings_id = cfg, renderer, generator, settings_id
        self.tok, self.counter = renderer.tokenizer, counter
        self.n_ids = len(self.tok)  # once: not free in transformers 5 (per reply it bounded a GPU run)
        self.t0 = self.reported = time.perf_counter()
        self.tokens = self.published = 0

    def stream(self, parts: Iterable[tuple[int, int, list[tuple[int, Any]]]]) -> Iterator[Done]:
        """Each ``(start, end, [(row, record)])`` of ``parts`` as a :class:`Done`, in the same order."""
        parts, open_parts, waiting, more = iter(parts), deque(), deque(), True
        asked: dict[int, tuple[Part, Job, list[int]]] = {}  # request tag -> (part, job, prompt)
        while True:
            while len(asked) < self.cfg.batch_size:  # fill: rows of open parts first, then a new part
                if waiting:
                    n = min(len(waiting), self.cfg.batch_size - len(asked))
                    self._advance([waiting.popleft() for _ in range(n)], asked)
                elif more and self._may_open(open_parts):
                    if (nxt := next(parts, None)) is None:
                        more = False
                        continue
                    p = self._open(*nxt)
                    open_parts.append(p)
                    waiting.extend((p, j) for j in p.jobs)
                else:
                    break
            while open_parts and open_parts[0].live == 0:
                self.published += 1
                yield self._close(open_parts.popleft())
            self._report(open_parts, len(asked))
            if not asked:  # every open part ended (the bound may have stopped the fill: fill again)
                assert not open_parts and not waiting, "an open part with nothing asked"
                if not more:
                    return
                continue
            t0 = time.perf_counter()
            answers = self.gen.collect(REPORT_EVERY_S)  # back at least this often: a silent engine is reported
            share = (time.perf_counter() - t0) / len(open_parts)
            for p in open_parts:
                p.seconds += share
            after = []
            for tag, reply in answers:
                p, job, prompt = asked.pop(tag)
                self._take(job, prompt, reply, p)
                after.append((p, job))
            self._advance(after, asked)

    def _report(self, open_parts: deque, in_flight: int) -> None:
        """A progress line every :data:`REPORT_EVERY_S` seconds."""
        now = time.perf_counter()
        if now - self.reported < REPORT_EVERY_S:
            return
        self.reported, dt = now, now - self.t0
        first = open_parts[0] if open_parts else None
        log.info("rank %d: %d part(s) published, %d open%s, %d request(s) in flight; %d new tokens in %.0f s "
                 "(%.1f tokens/s)", self.cfg.rank, self.published, len(open_parts),
                 f" (the first, rows [{first.start}, {first.end}), waits on {first.live} row(s))" if first else "",
                 in_flight, self.tokens, dt, self.tokens / max(dt, 1e-9))

    def _may_open(self, open_parts: deque) -> bool:
        """Another part may open while the open ones hold fewer than ``4 * batch_size`` rows: a
        long conversation holds back the publication of the parts after it, and what they finished
        is kept in memory (and lost to a kill) until it ends."""
        return sum(len(p.rows) for p in open_parts) < 4 * self.cfg.batch_size

    def _open(self, start: int, end: int, rows: list[tuple[int, Any]]) -> Part:
        p = Part(start, end, rows)
        for row, rec in rows:
            conv = normalize_record(row, rec)
            if isinstance(conv, Skip):
                self._reject(p, row, conv.source_id, "skipped", conv.reason, conv.detail)
                continue
            for reason, _ in conv.notes:
                p.notes[reason] += 1
            try:
                p.jobs.append(plan(conv, rec, self.cfg.mode))
            except BadRecord as e:
                self._reject(p, row, conv.source_id, "skipped", e.reason, str(e))
        p.live = len(p.jobs)
        return p

    def _advance(self, items: list[tuple[Part, Job]], asked: dict[int, tuple[Part, Job, list[int]]]) -> None:
        """Ask for each job's next turn, or count the job finished (its prompts tokenised at once)."""
        texts = [self._prompt_text(job, p) if job.row not in p.rejects and job.pending is not None else None
                 for p, job in items]
        todo = [i for i, t in enumerate(texts) if t is not None]
        encoded = self.tok([texts[i] for i in todo], add_special_tokens=False)["input_ids"] if todo else []
        prompts = dict(zip(todo, encoded))
        for i, (p, job) in enumerate(items):
            prompt = prompts.get(i)
            if prompt is not None and len(prompt) >= self.cfg.max_length:
                self._end_early(job, p, "cut_at_max_length", "skipped", "context_too_long",
                                f"message {job.pending}: the prompt has {len(prompt)} tokens, max_length is "
                                f"{self.cfg.max_length}")
                prompt = None
            if prompt is None:
                p.live -= 1
                continue
            asked[id(job)] = (p, job, prompt)
            self.gen.submit(id(job), prompt, min(self.cfg.max_new_tokens, self.cfg.max_length - len(prompt)),
                            turn_seed(self.cfg.seed, job.row, job.pending))

    def _close(self, p: Part) -> Done:
        self._check_extractable([j for j in p.jobs if j.row not in p.rejects], p)
        data = [output_record(j, self.settings_id) for j in p.jobs if j.row not in p.rejects]
        return Done(p, data, [p.rejects[r] for r in sorted(p.rejects)])

    def _reject(self, part: Part, row: int, sid: str, outcome: str, reason: str, detail: str) -> None:
        part.rejects[row] = {"row": row, "source_id": sid, "outcome": outcome, "reason": reason, "detail": detail}
        self.counter.add(Skip(row, sid, reason, detail))

    def _prompt_text(self, job: Job, part: Part) -> str | None:
        """The text of the next target's prompt, or None (the row was rejected)."""
        msgs = job.conv.messages[:job.pending]
        try:
            self.renderer.check_text(msgs, job.conv.tools)
            return self.renderer.render(msgs, add_generation_prompt=True, tools=job.conv.tools)
        except MaskError as e:
            self._reject(part, job.row, job.source_id, "skipped", e.reason, str(e))
        except Exception as e:  # jinja2 TemplateError / raise_exception from the template
            self._reject(part, job.row, job.source_id, "skipped", "template_error", f"{type(e).__name__}: {e}")
        return None

    def _end_early(self, job: Job, part: Part, note: str, outcome: str, reason: str, detail: str) -> None:
        """The job's next turn cannot be regenerated: in mode "all" after a regenerated turn the
        record ends before it (``note``), else the row is rejected."""
        if self.cfg.mode == "all" and job.done:
            job.cut = True
            part.notes[note] += 1
        else:
            self._reject(part, job.row, job.source_id, outcome, reason, detail)

    def _take(self, job: Job, prompt: list[int], reply, part: Part) -> None:
        part.tokens += reply.num_generated
        self.tokens += reply.num_generated
        if reply.error is not None:
            self._reject(part, job.row, job.source_id, "failed", "engine_error", reply.error)
            return
        ids, text, why = reply_text(self.tok, reply, self.n_ids)
        fields = split_reply(text, self.cfg.split_reasoning)
        if why is not None:
            self._reject(part, job.row, job.source_id, "failed", why[0], f"message {job.pending}: {why[1]}")
        elif not any(v.strip() for v in fields.values()):
            self._reject(part, job.row, job.source_id, "failed", "empty_reply",
                         f"message {job.pending}: {len(reply.token_ids)} token(s), blank text ({reply.finish})")
        elif (hit := self.renderer.find_special(text)) is not None:
            self._reject(part, job.row, job.source_id, "failed", "special_token_in_reply",
                         f"message {job.pending}: the reply holds {hit!r}, which extraction refuses")
        elif reply.finish == "length" and self.cfg.length_replies == "reject":
            self._end_early(job, part, "cut_at_length", "failed", "reply_at_length",
                            f"message {job.pending}: the reply ran out of tokens ({len(reply.token_ids)})")
        else:
            apply_reply(job, job.pending, fields, reply.finish, len(prompt), len(ids))

    def _check_extractable(self, jobs: list[Job], part: Part) -> None:
        """Reject (with extraction's own reason) each regenerated row that extraction would skip
        (the rows rendered and masked at once, as extraction does)."""
        msgs = [j.conv.messages[:j.done[-1].message + 1] if j.cut else j.conv.messages for j in jobs]
        for job, enc in zip(jobs, self.renderer.encode_batch(msgs, [j.conv.tools for j in jobs])):
            if isinstance(enc, MaskError):
                self._reject(part, job.row, job.source_id, "skipped", enc.reason, f"extraction would skip it: {enc}")
            elif isinstance(enc, Exception):  # the template raised on the whole conversation
                self._reject(part, job.row, job.source_id, "skipped", "template_error",
                             f"extraction would skip it: {type(enc).__name__}: {enc}")
            elif not bool(enc.loss_mask[:self.cfg.max_length].any()):  # e.g. cut after its only trained turn
                self._reject(part, job.row, job.source_id, "skipped", "no_loss_tokens",
                             f"extraction would skip it: nothing supervised within max_length {self.cfg.max_length}")


def reply_text(tok: Any, reply: Any, n_ids: int | None = None) -> tuple[list[int], str, tuple[str, str] | None]:
    """``(token ids, text, failure)`` of a reply: its text is what extraction will tokenise, so it
    must be what the model wrote. A reply cut by the token budget in the middle of a character
    loses that partial character (up to 3 trailing tokens; decoded alone it is U+FFFD, which
    re-tokenises into other tokens). Failure ``(reason, detail)``, else None:
    ``token_id_out_of_range`` (an id past the tokenizer's vocabulary, i.e. a padded embedding row:
    it decodes to nothing), ``invalid_utf8_reply`` (U+FFFD left that is not the model's own character
    U+FFFD, i.e. the text does not tokenise back to its tokens: bytes that are not UTF-8)."""
    ids, n_ids = list(reply.token_ids), len(tok) if n_ids is None else n_ids  # n_ids: len(tok), given once
    bad = [t for t in ids if not 0 <= t < n_ids]
    if bad:
        return ids, "", ("token_id_out_of_range", f"the reply holds token id {bad[0]}, past the tokenizer's "
                                                  f"{n_ids} ids: it has no text")
    decode = lambda x: tok.decode(x, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    text = decode(ids)
    if reply.finish == "length":
        for _ in range(3):  # (a real U+FFFD at the very end may go too: the reply was cut there anyway)
            if not (ids and text.endswith("\ufffd")):
                break
            ids = ids[:-1]
            text = decode(ids)
    if "\ufffd" in text and tok.encode(text, add_special_tokens=False) != ids:  # (a real U+FFFD round-trips)
        return ids, text, ("invalid_utf8_reply", f"the reply decodes to U+FFFD at character {text.index(chr(0xfffd))} "
                                                 f"and that text does not tokenise back to the model's tokens: its bytes "
                                                 f"are not UTF-8 there")
    return ids, text, None
