"""``eagle-data regenerate``: chats -> the target's own replies, part by part, with strict accounting.

Per part (see :mod:`eagle_data.regen.store`): every source row is read and validated as
extraction does (:func:`~eagle_data.extract.conversations.normalize_record`), planned
(:func:`~eagle_data.regen.plan.plan`), then generated turn by turn, each row on its own
(:mod:`eagle_data.regen.regenerator`: a row's next turn is asked for as soon as its reply is
back; parts are published in source order). Each row ends with exactly one outcome:

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
import itertools
import json
import logging
import os
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from tqdm.auto import tqdm

from eagle_data.engines.base import compute_dtype
from eagle_data.extract.chat import ChatRenderer
from eagle_data.extract.config import model_dir, rows_to_read
from eagle_data.extract.fault import DropCounter
from eagle_data.extract.manifest import package_versions
from eagle_data.extract.resume import open_out, out_path
from eagle_data.format.fingerprint import weights_fingerprint
from eagle_data.extract.run import load_tokenizer
from eagle_data.extract.sources import combine, iter_records, record_fingerprint
from eagle_data.regen.config import RESUME_FIELDS, RegenerateConfig, check_paths
from eagle_data.regen.engines import Generator, make_generator
from eagle_data.regen.regenerator import Part, Regenerator
from eagle_data.format.regen_layout import MANIFEST
from eagle_data.regen.store import PartRecord, RankProgress, summarize
from eagle_data.regen.stops import stop_token_ids

log = logging.getLogger(__name__)


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


def _warn_small_pool(engine: dict[str, Any], batch_size: int, max_length: int) -> None:
    """Warn when the engine's KV pool (its description's ``kv_pool_tokens``) holds under half of what
    ``batch_size`` requests of up to ``max_length`` tokens may hold: the engine then queues or
    retracts requests. Not on CPU, where the pool is the fixed ``max_total_tokens``, not a share of
    the memory that other engines may have taken."""
    pool = engine.get("kv_pool_tokens")
    if pool is not None and engine.get("device") != "cpu" and pool < batch_size * max_length // 2:
        log.warning("the engine's KV pool holds %d tokens, under half of the %d that --batch_size %d requests of up "
                    "to --max_length %d tokens may hold: it will queue or retract requests (give it more memory: "
                    "backend_kwargs mem_fraction_static or max_total_tokens; or lower --batch_size)",
                    pool, batch_size * max_length, batch_size, max_length)


def _part_record(part: Part, data: list[dict[str, Any]], rejects: list[dict[str, Any]]) -> PartRecord:
    outcome = Counter(r["outcome"] for r in rejects)
    return PartRecord(part.start, part.end, combine(record_fingerprint(r, x) for r, x in part.rows),
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
    own = generator is None
    _check_source(cfg, progress)
    try:
        work = _work(cfg, progress, cfg.num_samples, rows_read)
        first = next(work, None)
        if first is not None:  # there is work: the run is not complete until it ends
            (out / MANIFEST).unlink(missing_ok=True)
            generator = generator or _engine(cfg, model_path, tokenizer, stops)
            engine = generator.describe()
            progress.begin(engine)
            _warn_small_pool(engine, cfg.batch_size, cfg.max_length)
            regen = Regenerator(cfg, renderer, generator, settings_id, counter)
            for done in regen.stream(itertools.chain([first], work)):
                p = done.part
                progress.publish(_part_record(p, done.data, done.rejects), done.data, done.rejects)
                rows_done, tokens, gen_s = rows_done + len(p.rows), tokens + p.tokens, gen_s + p.seconds
                bar.update(len(p.rows))
                bar.set_postfix(tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.0f}",
                                rejected=sum(counter.counts.values()))
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
