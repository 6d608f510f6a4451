"""``eagle-data regenerate``: chats -> the target's own replies, part by part, with strict accounting.

Per part (see :mod:`eagle_data.regen.store`): every source row is read and validated as
extraction does (:func:`~eagle_data.extract.conversations.normalize_record`), planned
(:func:`~eagle_data.regen.plan.plan`), then generated in rounds: round *j* generates the
*j*-th target turn of every row that has one, all of them in one engine call. Each row ends
with exactly one outcome:

* ``regenerated``: written to ``data/`` (a record whose later turn had no room is cut there,
  note ``cut_at_max_length``);
* ``skipped`` (the input cannot be used): the record's own reasons (``no_assistant_turn``,
  ``broken_alternation``, ...), ``tool_call_turn``, ``no_regenerable_turn``, ``template_error``,
  ``special_token_in_text``, ``context_too_long``;
* ``failed`` (the generation did not give a usable reply): ``engine_error``, ``empty_reply``,
  ``special_token_in_reply``, ``token_id_out_of_range``, ``invalid_utf8_reply``,
  ``reply_at_length`` (with ``length_replies="reject"``).

A regenerated row is rendered and masked as extraction will do; one that extraction would skip
is skipped here with extraction's reason (e.g. ``tool_calls_not_rendered``).

Skipped and failed rows go to ``rejects/`` with their reason and detail, are counted per
reason, and the first ones are logged; nothing is dropped unsaid.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from tqdm.auto import tqdm

from eagle_data.engines.base import compute_dtype
from eagle_data.extract.chat import ChatRenderer
from eagle_data.extract.config import model_dir, rows_to_read
from eagle_data.extract.conversations import normalize_record
from eagle_data.extract.fault import BadRecord, DropCounter, Skip
from eagle_data.extract.manifest import package_versions
from eagle_data.extract.resume import open_out, out_path
from eagle_data.format.fingerprint import weights_fingerprint
from eagle_data.extract.mask import MaskError
from eagle_data.extract.run import load_tokenizer
from eagle_data.extract.sources import combine, iter_records, record_fingerprint
from eagle_data.regen.config import RESUME_FIELDS, RegenerateConfig, check_paths
from eagle_data.regen.engines import Generator, make_generator
from eagle_data.regen.plan import Job, apply_reply, output_record, plan, split_reply, turn_seed
from eagle_data.format.regen_layout import MANIFEST
from eagle_data.regen.store import PartRecord, RankProgress, summarize
from eagle_data.regen.stops import stop_token_ids

log = logging.getLogger(__name__)


@dataclass
class _Part:
    """Outcomes of one part's rows while it is generated."""
    rejects: dict[int, dict[str, Any]] = field(default_factory=dict)
    notes: Counter = field(default_factory=Counter)
    tokens: int = 0
    seconds: float = 0.0


class Regenerator:
    """Regenerates the rows of one part (see the module docstring) with a renderer and an engine."""

    def __init__(self, cfg: RegenerateConfig, renderer: ChatRenderer, generator: Generator, settings_id: str,
                 counter: DropCounter):
        self.cfg, self.renderer, self.gen, self.settings_id = cfg, renderer, generator, settings_id
        self.tok, self.counter = renderer.tokenizer, counter

    def _reject(self, part: _Part, row: int, sid: str, outcome: str, reason: str, detail: str) -> None:
        part.rejects[row] = {"row": row, "source_id": sid, "outcome": outcome, "reason": reason, "detail": detail}
        self.counter.add(Skip(row, sid, reason, detail))

    def _jobs(self, rows: list[tuple[int, Any]], part: _Part) -> list[Job]:
        jobs = []
        for row, rec in rows:
            conv = normalize_record(row, rec)
            if isinstance(conv, Skip):
                self._reject(part, row, conv.source_id, "skipped", conv.reason, conv.detail)
                continue
            for reason, _ in conv.notes:
                part.notes[reason] += 1
            try:
                jobs.append(plan(conv, rec, self.cfg.mode))
            except BadRecord as e:
                self._reject(part, row, conv.source_id, "skipped", e.reason, str(e))
        return jobs

    def _prompt(self, job: Job, part: _Part) -> list[int] | None:
        """Token ids of the next target's prompt, or None (the row was rejected or cut)."""
        msgs = job.conv.messages[:job.pending]
        try:
            self.renderer.check_text(msgs, job.conv.tools)
            text = self.renderer.render(msgs, add_generation_prompt=True, tools=job.conv.tools)
        except MaskError as e:
            self._reject(part, job.row, job.source_id, "skipped", e.reason, str(e))
            return None
        except Exception as e:  # jinja2 TemplateError / raise_exception from the template
            self._reject(part, job.row, job.source_id, "skipped", "template_error", f"{type(e).__name__}: {e}")
            return None
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if len(ids) < self.cfg.max_length:
            return ids
        self._end_early(job, part, "cut_at_max_length", "skipped", "context_too_long",
                        f"message {job.pending}: the prompt has {len(ids)} tokens, max_length is {self.cfg.max_length}")
        return None

    def _end_early(self, job: Job, part: _Part, note: str, outcome: str, reason: str, detail: str) -> None:
        """The job's next turn cannot be regenerated: in mode "all" after a regenerated turn the
        record ends before it (``note``), else the row is rejected."""
        if self.cfg.mode == "all" and job.done:
            job.cut = True
            part.notes[note] += 1
        else:
            self._reject(part, job.row, job.source_id, outcome, reason, detail)

    def _take(self, job: Job, prompt: list[int], reply, part: _Part) -> None:
        part.tokens += reply.num_generated
        if reply.error is not None:
            self._reject(part, job.row, job.source_id, "failed", "engine_error", reply.error)
            return
        ids, text, why = reply_text(self.tok, reply)
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

    def _check_extractable(self, job: Job, part: _Part) -> None:
        """Reject (with extraction's own reason) a regenerated row that extraction would skip."""
        msgs = job.conv.messages[:job.done[-1].message + 1] if job.cut else job.conv.messages
        try:
            enc = self.renderer.encode_normalized(msgs, job.conv.tools)
            if not bool(enc.loss_mask[:self.cfg.max_length].any()):  # e.g. cut after its only trained turn
                self._reject(part, job.row, job.source_id, "skipped", "no_loss_tokens",
                             f"extraction would skip it: nothing supervised within max_length {self.cfg.max_length}")
        except MaskError as e:
            self._reject(part, job.row, job.source_id, "skipped", e.reason, f"extraction would skip it: {e}")
        except Exception as e:  # the template raised on the whole conversation
            self._reject(part, job.row, job.source_id, "skipped", "template_error",
                         f"extraction would skip it: {type(e).__name__}: {e}")

    def part(self, rows: list[tuple[int, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], _Part]:
        """``(regenerated records, reject records, outcomes)`` of a part's ``(row, record)`` pairs."""
        part = _Part()
        jobs = self._jobs(rows, part)
        while True:
            live = [j for j in jobs if j.row not in part.rejects and j.pending is not None]
            todo = [(j, p) for j in live if (p := self._prompt(j, part)) is not None]
            if not todo:
                break
            budgets = [min(self.cfg.max_new_tokens, self.cfg.max_length - len(p)) for _, p in todo]
            seeds = [turn_seed(self.cfg.seed, j.row, j.pending) for j, _ in todo]
            t0 = time.perf_counter()
            replies = self.gen.generate([p for _, p in todo], budgets, seeds)
            part.seconds += time.perf_counter() - t0
            assert len(replies) == len(todo), "the engine answers every prompt"
            for (j, p), r in zip(todo, replies):
                self._take(j, p, r, part)
        for j in jobs:
            if j.row not in part.rejects:
                self._check_extractable(j, part)
        data = [output_record(j, self.settings_id) for j in jobs if j.row not in part.rejects]
        return data, [part.rejects[r] for r in sorted(part.rejects)], part


def reply_text(tok: Any, reply: Any) -> tuple[list[int], str, tuple[str, str] | None]:
    """``(token ids, text, failure)`` of a reply: its text is what extraction will tokenise, so it
    must be what the model wrote. A reply cut by the token budget in the middle of a character
    loses that partial character (up to 3 trailing tokens; decoded alone it is U+FFFD, which
    re-tokenises into other tokens). Failure ``(reason, detail)``, else None:
    ``token_id_out_of_range`` (an id past the tokenizer's vocabulary, i.e. a padded embedding row:
    it decodes to nothing), ``invalid_utf8_reply`` (U+FFFD left that is not the model's own character
    U+FFFD, i.e. the text does not tokenise back to its tokens: bytes that are not UTF-8)."""
    ids, n_ids = list(reply.token_ids), len(tok)  # (len of a tokenizer is not free: once per reply)
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


def _settings(cfg: RegenerateConfig, model_path: str, renderer: ChatRenderer, stops: frozenset[int]) -> dict[str, Any]:
    tok_json = Path(model_path) / "tokenizer.json"
    s = {k: getattr(cfg, k) for k in RESUME_FIELDS}
    local = Path(cfg.data)
    s.update(data=str(local.resolve()) if local.exists() else cfg.data, model=model_path, weights_fingerprint=weights_fingerprint(model_path),
             tokenizer_sha256=hashlib.sha256(tok_json.read_bytes()).hexdigest() if tok_json.exists() else None,
             template=renderer.describe(), stop_token_ids=sorted(stops))
    return s


def _check_source(cfg: RegenerateConfig, progress: RankProgress) -> None:
    """Before any work: the source rows of this rank's finished parts are still the same.

    Raises:
        ValueError: a finished row was edited, or rows were removed or inserted before it.
    """
    fps = progress.fingerprints()
    if not fps:
        return
    seen: dict[tuple[int, int], list[int]] = {r: [] for r in fps}
    for row, rec in iter_records(cfg.data, cfg.split, 0, 1, max(e for _, e in fps)):
        if (span := progress.finished_span(row)) is not None:
            seen[span].append(record_fingerprint(row, rec))
    for (s, e), fp in fps.items():
        if len(seen[(s, e)]) != e - s or combine(seen[(s, e)]) != fp:
            raise ValueError(f"data: {cfg.data} changed since rows [{s}, {e}) were regenerated into {cfg.out} "
                             f"({len(seen[(s, e)])} of {e - s} rows still there, contents differ or rows moved); "
                             "restore the source or use another --out")


def _work(cfg: RegenerateConfig, progress: RankProgress, n_rows: int | None,
          rows_read: list[int]) -> Iterator[tuple[int, int, list]]:
    """``(start, end, [(row, record)])`` of each part this rank still has to do, in source
    order. ``rows_read[0]`` ends as the number of source rows asked for that exist."""
    per = cfg.rows_per_part
    buf: list[tuple[int, Any]] = []
    for row, rec in iter_records(cfg.data, cfg.split, 0, 1, n_rows):
        rows_read[0] = row + 1
        if (row // per) % cfg.world_size != cfg.rank or progress.finished_span(row) is not None:
            continue  # another rank's row, or a finished one
        if buf and row // per != buf[0][0] // per:
            yield buf[0][0], buf[-1][0] + 1, buf
            buf = []
        buf.append((row, rec))
    if buf:
        yield buf[0][0], buf[-1][0] + 1, buf


def run_regenerate(cfg: RegenerateConfig, generator: Generator | None = None, tokenizer=None) -> dict[str, Any]:
    """Run (or resume) a regeneration. Returns the summary of every rank's progress (the content
    of ``regeneration.json`` once ``complete``) plus ``run_stats`` (this run) and ``progress``
    (this rank's record).

    Raises:
        ValueError: bad settings (checked before anything is written), another run's output in
            ``out``, the source changed under a finished part, or the rank is being run by another
            live process.
    """
    cfg = replace(cfg, out=str(out_path(cfg.out)))  # "m/n/.." is m: checked, written and reported as m
    check_paths(cfg)
    cfg = replace(cfg, num_samples=rows_to_read(cfg.num_samples, cfg.data))
    model_path = model_dir(cfg.model)
    tokenizer = tokenizer or load_tokenizer(model_path, cfg.trust_remote_code)
    renderer = ChatRenderer.from_path(tokenizer, cfg.chat_template, date=cfg.template_date,
                                      variables=cfg.template_vars)
    stops = stop_token_ids(tokenizer, renderer, model_path, cfg.stop_tokens)
    out, lock = open_out(cfg.out, cfg.rank, "regenerated")
    try:
        return _run(cfg, out, generator, renderer, model_path, stops)
    finally:
        if lock is not None:
            os.close(lock)


def _engine(cfg: RegenerateConfig, model_path: str, tokenizer, stops: frozenset[int]) -> Generator:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops)
    return make_generator(cfg.backend, model_path, stops, pad, dtype=compute_dtype(cfg.dtype, cfg.device),
                          device=cfg.device,
                          batch_size=cfg.batch_size, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          trust_remote_code=cfg.trust_remote_code, backend_kwargs=dict(cfg.backend_kwargs))


def _part_record(start: int, end: int, rows: list[tuple[int, Any]], data: list[dict[str, Any]],
                 rejects: list[dict[str, Any]], part: _Part) -> PartRecord:
    outcome = Counter(r["outcome"] for r in rejects)
    return PartRecord(start, end, combine(record_fingerprint(r, x) for r, x in rows),
                      {"regenerated": len(data), "failed": outcome["failed"], "skipped": outcome["skipped"]},
                      dict(Counter(r["reason"] for r in rejects)),
                      dict(Counter(f for d in data for f in d["regeneration"]["finish"])),
                      dict(part.notes), part.tokens, round(part.seconds, 3))


def _run(cfg: RegenerateConfig, out: Path, generator: Generator | None, renderer: ChatRenderer, model_path: str,
         stops: frozenset[int]) -> dict[str, Any]:
    tokenizer = renderer.tokenizer
    settings = _settings(cfg, model_path, renderer, stops)
    settings_id = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    progress = RankProgress(out, cfg.rank, settings)
    counter = DropCounter(kept_in="regenerate writes every one, with its detail, to rejects/part-*.jsonl in its "
                                  "output directory")
    rows_read = [0]
    bar = tqdm(total=cfg.num_samples, desc=f"regenerate rank {cfg.rank}", unit="row", disable=not cfg.progress,
               dynamic_ncols=True)
    t0, rows_done, tokens, gen_s = time.perf_counter(), 0, 0, 0.0
    regen, own = None, generator is None
    _check_source(cfg, progress)
    try:
        for start, end, rows in _work(cfg, progress, cfg.num_samples, rows_read):
            if regen is None:  # there is work: the run is not complete until it ends
                (out / MANIFEST).unlink(missing_ok=True)
                generator = generator or _engine(cfg, model_path, tokenizer, stops)
                progress.begin(generator.describe())
                regen = Regenerator(cfg, renderer, generator, settings_id, counter)
            data, rejects, part = regen.part(rows)
            progress.publish(_part_record(start, end, rows, data, rejects, part), data, rejects)
            rows_done, tokens, gen_s = rows_done + len(rows), tokens + part.tokens, gen_s + part.seconds
            bar.update(len(rows))
            bar.set_postfix(tok_s=f"{tokens / max(gen_s, 1e-9):.0f}", rejected=sum(counter.counts.values()))
        progress.finish(rows_read[0])
    finally:
        bar.close()
        if own and generator is not None:
            generator.close()
    elapsed = time.perf_counter() - t0
    stats = {"rows": rows_done, "tokens_generated": tokens, "generation_seconds": round(gen_s, 3),
             "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / gen_s, 1) if gen_s > 0 else None,
             "rejects": counter.as_dict()}
    log.info("rank %d finished: %s", cfg.rank, stats)
    man = summarize(out, cfg.world_size, {"packages": package_versions()})
    return {**man, "progress": progress.state, "run_stats": stats}
