"""The extraction pipeline: records -> conversations -> tokens + loss mask -> one prefill
pass per sample -> atomic WebDataset shards + index + manifest.

Stages are iterators (:mod:`stages`); :func:`run_extract` wires them. The rank's progress
(resume, skips, notes) is :class:`~eagle_data.extract.rank_state.RankState`; signals are
:mod:`~eagle_data.extract.signals`.

Reliability contract (see also :mod:`eagle_data.extract.sink`, :mod:`eagle_data.extract.resume` and :mod:`eagle_data.extract.manifest`):

* work split: rank ``r`` of ``w`` takes source rows ``row % w == r``; keys are ``TAG_ROW``,
  so ranks need no coordination and their keys are disjoint;
* a shard is listed in ``progress-{rank}.json`` only after it and its index part are durable;
  on resume, whatever is not listed (temporaries, renamed-but-unrecorded shards) is deleted
  and its samples are redone; finished shards are skipped by key without being read;
* SIGTERM/SIGINT: the shard in progress is discarded (never half-published). Signals take
  effect at once while the tokenizer or model loads, inside data loading and the forward
  pass, else after the sample being
  written (one arriving after the last shard lets the run and the merge complete). Then a
  SIGTERM whose previous handler was the default kills the process as usual; otherwise
  :class:`ExtractionInterrupted` is raised;
* a full disk (``ENOSPC``/``EDQUOT``) stops the run with an ``OSError`` saying so; published
  shards stay valid and rerunning the command resumes;
* a run that fails before its rank published or skipped anything leaves nothing of it behind
  (its progress file, skip log, and the lock file and folders when nothing else is left: no
  ``--out`` that holds only a lock); one that produced no sample at all writes no manifest or
  index (:class:`~eagle_data.extract.manifest.NoSamples`, raised).
"""

from __future__ import annotations

import errno
import logging
import os
import pickle
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

from tqdm.auto import tqdm

from eagle_data.extract.async_sink import AsyncShardWriter
from eagle_data.engines.base import Backend
from eagle_data.background import background, timed
from eagle_data.extract.chat import ChatRenderer, TokenizedSample
from eagle_data.extract.config import (ExtractConfig, check_paths, front_in_process, model_dir, rows_to_read,
                                       stored_dtypes)
from eagle_data.extract.front_process import FrontProcess
from eagle_data.extract.fault import ErrorPolicy
from eagle_data.extract.resume import load_progress, open_out, out_path
from eagle_data.extract.rank_state import RankState, refuse_foreign
from eagle_data.extract.rerun import finished_result, merged_result, run_config
from eagle_data.extract.signals import ExtractionInterrupted, Signals, interruptible_iter
from eagle_data.extract.sink import ShardSink
from eagle_data.extract.sources import RowSource, resolve
from eagle_data.extract.stages import Batching, capture, front, to_samples
from eagle_data.format.schema import sample_key, storage_dtype_of
from eagle_data.format.layout import INDEX_DIR, LOCK_NAME, progress_path, rank_shard_prefix, skip_log_name

log = logging.getLogger(__name__)


def run_extract(cfg: ExtractConfig, backend: Backend | None = None, tokenizer=None) -> dict[str, Any]:
    """Run (or resume) an extraction. Returns the manifest if this run completed the dataset,
    else ``{"progress": <this rank's progress record>, "run_stats": ...}``, with ``"merge_error"``
    when every rank has finished but the merge refused ranks that read another source than this
    one (:class:`~eagle_data.extract.manifest.RanksDisagree`, logged: rerun them, the last merges).

    ``backend``/``tokenizer`` may be given pre-built (tests); otherwise they are made from
    ``cfg.model`` (``"smollm2"`` = the embedded default, or a local HF folder). The backend
    is closed on return.

    Raises:
        ValueError: bad settings; an existing output written with another configuration;
            the rank is already being extracted by another live process;
            :class:`~eagle_data.extract.manifest.NoSamples`: every rank finished and none extracted a
            sample (every row skipped, or no rows): no manifest or index is written.
        OSError: the file system failed; for a full disk the message says so and that
            rerunning resumes.
        ExtractionInterrupted: SIGINT (or a SIGTERM with a non-default previous handler);
            a SIGTERM with the default handler terminates the process after cleanup.
    """
    aux_dtype, final_dtype = stored_dtypes(cfg.dtype, cfg.storage_dtype, cfg.final_storage_dtype)
    # resolved, as recorded and run: "m/n/.." is m (checked, written and reported as m), the rows, the dtypes
    cfg = replace(cfg, out=str(out_path(cfg.out)), num_samples=rows_to_read(cfg.num_samples, cfg.data),
                  storage_dtype=aux_dtype, final_storage_dtype=final_dtype)
    check_paths(cfg)
    refuse_foreign(Path(cfg.out))
    created = _missing_folders(Path(cfg.out))  # the folders this run creates
    out, lock = open_out(cfg.out, cfg.rank)
    # from here a signal is remembered (raised at once while loading or computing, never while a
    # shard is written): the cleanup below runs first, a default SIGTERM then ends the process
    with Signals() as sigs:
        try:
            return _run(cfg, out, backend, tokenizer, sigs)
        except BaseException as e:
            if lock is not None:  # failed before this rank recorded anything: nothing of it left behind
                _remove_unrecorded(out, cfg.rank, lock, created)
            if isinstance(e, ExtractionInterrupted):
                sigs.redeliver(e.signum)  # a default SIGTERM ends the process here (its lock goes with it)
            raise
        finally:
            if lock is not None:
                os.close(lock)


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and its ancestors that do not exist yet, highest first."""
    p = path.absolute()
    return [d for d in reversed([p, *p.parents]) if not d.exists()]


def _remove_unrecorded(out: Path, rank: int, lock: int, created: list[Path]) -> None:
    """After a failed run: when rank ``rank``'s progress records nothing (no shard, no skip, not
    finished: a resume would start over) and no file of its shard series is on disk, remove its
    progress file and skip log; then, when ``out`` holds nothing but the lock file (and an empty
    ``index/``) and no other process holds a lock in it, remove those, ``out`` itself if this run
    created it, and the folders of ``created`` (those it created, highest first) left empty. A
    failed run leaves no ``--out`` that holds only a lock file, or a progress file of nothing."""
    import fcntl

    pre = rank_shard_prefix(rank)
    try:
        prog = load_progress(out, rank)
        if (prog is not None and (prog["shards"] or prog["skipped"] or prog.get("finished"))) or \
                any(out.glob(f"{pre}*")) or any((out / INDEX_DIR).glob(f"{pre}*")):
            return
        for f in (progress_path(out, rank), out / skip_log_name(rank)):
            f.unlink(missing_ok=True)
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the whole file: fails while another process holds a byte
        left = sorted(c.name for c in out.iterdir())
        if left not in ([LOCK_NAME], sorted([LOCK_NAME, INDEX_DIR])):
            return
        if INDEX_DIR in left:
            (out / INDEX_DIR).rmdir()  # not empty (another rank's part appeared): kept
        (out / LOCK_NAME).unlink()
    except (OSError, ValueError):  # a progress file damaged by hand, a lock held, a folder not empty: kept
        return
    for d in reversed(created):
        try:
            d.rmdir()  # not empty (something else was put there) or a name like "x/..": kept
        except OSError:
            pass


def row_source(cfg: ExtractConfig) -> RowSource:
    """The source rows this rank of ``cfg`` reads."""
    return RowSource(cfg.data, cfg.split, cfg.rank, cfg.world_size, rows_to_read(cfg.num_samples, cfg.data))


def batching(cfg: ExtractConfig) -> Batching:
    """How ``cfg``'s front cuts and batches its samples."""
    return Batching(cfg.max_length, cfg.batch_tokens, cfg.max_batch_size, cfg.sort_window)


def load_tokenizer(model_path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"model {model_path}: its tokenizer cannot be loaded (tokenizer.json / "
                         f"tokenizer_config.json missing or unreadable?): {first}") from e


def _run(cfg: ExtractConfig, out: Path, backend: Backend | None, tokenizer, sigs: Signals) -> dict[str, Any]:
    model_path = model_dir(cfg.model)
    with sigs.interruptible():
        tokenizer = tokenizer or load_tokenizer(model_path, cfg.trust_remote_code)
    renderer = ChatRenderer.from_path(tokenizer, cfg.chat_template, date=cfg.template_date,
                                      variables=cfg.template_vars)
    tag = cfg.dataset_tag or resolve(cfg.data)[2]
    sample_key(tag, 0)  # validates the tag (ValueError) before any work
    if backend is None and (done := finished_result(cfg, out, renderer, model_path, tag)) is not None:
        return done  # a rerun with nothing to do: the model is not loaded
    # started now, its start-up (imports, tokenizer) overlaps the model's loading
    front_proc = _start_front(cfg, renderer, tag)
    try:
        return _run_with(cfg, out, backend, renderer, model_path, tag, front_proc, sigs)
    finally:
        if front_proc is not None:
            front_proc.close()


def _start_front(cfg: ExtractConfig, renderer: ChatRenderer, tag: str) -> FrontProcess | None:
    """The front's child process (None: the front runs in a thread, logged when it was asked for)."""
    if not front_in_process(cfg.front, cfg.device):
        return None
    try:
        return FrontProcess(row_source(cfg), batching(cfg), cfg.on_bad_sample, renderer, tag, FRONT_AHEAD)
    except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:  # no process, or a tokenizer that does not pickle
        log.warning("the extraction front process could not be started (%s: %s); the front runs in a thread",
                    type(e).__name__, e)
        return None


def _run_with(cfg: ExtractConfig, out: Path, backend: Backend | None, renderer: ChatRenderer, model_path: str,
              tag: str, front_proc: FrontProcess | None, sigs: Signals) -> dict[str, Any]:
    from eagle_data.engines import make_backend
    from eagle_data.engines.base import compute_dtype

    if backend is None:
        extra = {"trust_remote_code": True} if cfg.trust_remote_code and cfg.backend == "hf" else {}
        # cast / quantise on the device (SGLang: in its scheduler): less to copy, nothing to do on the host
        extra.update(out_dtype=cfg.storage_dtype, final_out_dtype=cfg.final_storage_dtype)
        with sigs.interruptible():  # minutes for a large target; nothing written yet
            backend = make_backend(cfg.backend, model_path=model_path, aux_layer_ids=cfg.aux_layer_ids,
                                   dtype=compute_dtype(cfg.dtype, cfg.device), device=cfg.device,
                                   **{**extra, **cfg.backend_kwargs})
    try:
        run_cfg, facts = _run_facts(cfg, backend, renderer, model_path, tag)
        with RankState(row_source(cfg), out, run_cfg, facts, tag) as state:
            stats = _extract(cfg, out, backend, renderer, tag, state, sigs, front_proc)
    finally:
        backend.close()
    result = merged_result(out, cfg.rank, {"progress": state.state, "run_stats": stats})  # the last rank merges
    if sigs.sig is not None:  # arrived after the last shard: the run is complete, now obey it
        log.error("signal %d received after rank %d completed; stopping", sigs.sig, cfg.rank)
        raise ExtractionInterrupted(sigs.sig)
    return result


def _run_facts(cfg: ExtractConfig, backend: Backend, renderer: ChatRenderer, model_path: str, tag: str
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run configuration recorded in the progress file (what a resume must match) and the
    model facts of the manifest."""
    info = backend.info
    run_cfg = run_config(cfg, info.aux_layer_ids, renderer, model_path, tag)
    _check_regenerator(cfg.data, run_cfg)
    facts = {"model_path": model_path, "backend": info.name, "hidden_size": info.hidden_size,
             "num_layers": info.num_layers, "vocab_size": info.vocab_size,
             "aux_layer_ids": list(info.aux_layer_ids), "dtype": cfg.storage_dtype,
             "final_dtype": cfg.final_storage_dtype,
             "final_rows": cfg.final_rows,
             "compute_dtype": info.dtype,
             "backend_extra": info.extra}
    return run_cfg, facts


def _check_regenerator(data: str, run_cfg: dict[str, Any]) -> None:
    """Warn when ``data`` is a regeneration made with another model, chat template or a longer
    ``max_length`` than this extraction uses: the replies are then not this model's own, the
    conversation is rendered otherwise than it was generated, or replies get truncated."""
    from eagle_data.format.regen_layout import MANIFEST, is_regeneration

    p = Path(data)
    if not (p.is_dir() and is_regeneration(p) and (p / MANIFEST).is_file()):
        return
    import json

    made = json.loads((p / MANIFEST).read_text(encoding="utf-8")).get("settings", {})
    if made.get("weights_fingerprint") not in (None, run_cfg["weights_fingerprint"]):
        log.warning("data %s was regenerated by another model (%s) than the one extracting now: the replies "
                    "are not this model's own", data, made.get("model"))
    if (made.get("template") or {}).get("template_sha256") not in (None, run_cfg["template"]["template_sha256"]):
        log.warning("data %s was regenerated with another chat template than this extraction renders with", data)
    if made.get("max_length", 0) > run_cfg["max_length"]:
        log.warning("data %s was regenerated for max_length %d; this extraction truncates at %d: later replies "
                    "are cut or lost", data, made["max_length"], run_cfg["max_length"])


#: batches the front (:func:`_extract`) builds ahead of the capture
FRONT_AHEAD = 4


def _front(cfg: ExtractConfig, renderer: ChatRenderer, tag: str, vocab_size: int, state: RankState,
           policy: ErrorPolicy, front_proc: FrontProcess | None) -> Iterator[list[TokenizedSample]]:
    """The batches of the rows not extracted yet, built beside the capture and the writers: in a
    child process (:mod:`~eagle_data.extract.front_process`) or, without one, in a thread."""
    if front_proc is not None and front_proc.ready():
        return front_proc.batches(state.done, vocab_size, state.fingerprint, policy)
    return background(front(state.fresh_records(), renderer, tag, vocab_size, batching(cfg), policy), FRONT_AHEAD)


def _extract(cfg: ExtractConfig, out: Path, backend: Backend, renderer: ChatRenderer, tag: str,
             state: RankState, sigs: Signals, front_proc: FrontProcess | None = None) -> dict[str, Any]:
    """The pipeline of one rank: source rows not extracted yet -> shards; returns the run stats."""
    policy = ErrorPolicy(cfg.on_bad_sample, listener=state.remember)
    waits: dict[str, float] = {}  # seconds the capture loop waited for each stage (see the run stats)
    t_start = time.perf_counter()
    source = _front(cfg, renderer, tag, backend.info.vocab_size, state, policy, front_proc)
    front_start = time.perf_counter() - t_start  # waiting for the front process to start (overlaps the model's load)
    batches = interruptible_iter(timed(source, waits, "front"), sigs)
    extracted = timed(to_samples(capture(batches, backend, sigs), (storage_dtype_of(cfg.storage_dtype),
                                                                   storage_dtype_of(cfg.final_storage_dtype)),
                                 cfg.data, tag, policy, cfg.final_rows), waits, "capture")
    # Writer w of W fills shards next_shard + w, + W, ... of this rank's series; the next batch's
    # forward runs while writer threads hash and write (bounded queue).
    writer = AsyncShardWriter([ShardSink(out, cfg.rank, state.next_shard + w, cfg.shard_max_samples,
                                         cfg.shard_max_bytes, state.on_publish, shard_step=cfg.writers)
                               for w in range(cfg.writers)], max_bytes=int(cfg.write_queue_gib * 2**30))
    bar = tqdm(desc=f"extract rank {cfg.rank}", unit="sample", disable=not cfg.progress, dynamic_ncols=True)
    t0, n_tok, n_new = time.perf_counter(), 0, 0
    try:
        for batch in extracted:
            for s in batch:
                writer.put(s.key, s.tensors, s.meta)
                n_tok, n_new = n_tok + s.meta["num_tokens"], n_new + 1
                sigs.check()
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{n_tok / (time.perf_counter() - t0):.0f}", skipped=state.num_skipped,
                            written=f"{writer.bytes_written / 2**20:.0f}MiB")
        t_close = time.perf_counter()
        writer.close()
        waits["close"] = time.perf_counter() - t_close
        state.finish()
    except BaseException as e:
        writer.abort()
        _explain(e, out, cfg.rank, len(state.state["shards"]))
        raise
    finally:
        bar.close()
    elapsed = time.perf_counter() - t0
    stats = {"new_samples": n_new, "new_tokens": n_tok, "seconds": round(elapsed, 3),
             "tokens_per_s": round(n_tok / elapsed, 1) if elapsed > 0 else None,
             "total_tokens": state.published_tokens, "waits_s": _waits(waits, writer.wait_s),
             "front": "process" if front_proc is not None and front_proc.ready() else "thread",
             "front_start_s": round(front_start, 3),
             "skip_counts": dict(sorted(policy.counter.as_dict().items())),
             "note_counts": dict(sorted(policy.counter.notes.items()))}
    log.info("rank %d finished: %s", cfg.rank, stats)
    return stats


def _waits(w: dict[str, float], writers: float) -> dict[str, float]:
    """Where the capture loop's time went (seconds): waiting for the front's batches (``front``);
    in the capture stage besides that (``capture``: launching the forward, waiting for the GPU and
    the device-to-host copy, splitting into samples); waiting for room in the writers' queue
    (``writers``); at the end, for the writers to drain their queue and publish the last shards
    (``close``: large when the disk is slower than the capture). The largest names the bound."""
    return {"front": round(w.get("front", 0.0), 3), "capture": round(w.get("capture", 0.0) - w.get("front", 0.0), 3),
            "writers": round(writers, 3), "close": round(w.get("close", 0.0), 3)}


def _explain(e: BaseException, out: Path, rank: int, num_shards: int) -> None:
    """Log what an interrupted run left; a full disk becomes an ``OSError`` that says so."""
    if isinstance(e, ExtractionInterrupted):
        log.error("interrupted by signal %d: the shard(s) in progress were discarded (%d shard(s) of rank %d "
                  "are complete); rerun the same command to resume", e.signum, num_shards, rank)
    elif isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        raise OSError(e.errno, f"no space left on the device of {out} ({e.strerror}); the shard(s) in "
                      f"progress were discarded, {num_shards} shard(s) of rank {rank} are "
                      "complete and valid. Free space and rerun the same command to resume.") from e
