"""The extraction pipeline: records -> conversations -> tokens + loss mask -> one prefill
pass per sample -> atomic WebDataset shards + index + manifest.

Stages are generators; :func:`run_extract` wires them, owns resume and signal handling.

Reliability contract (see also :mod:`eagle_data.writer` and :mod:`eagle_data.manifest`):

* work split: rank ``r`` of ``w`` takes source rows ``row % w == r``; keys are ``TAG_ROW``,
  so ranks need no coordination and their keys are disjoint;
* a shard is listed in ``progress-{rank}.json`` only after it and its index part are durable;
  on resume, whatever is not listed (temporaries, renamed-but-unrecorded shards) is deleted
  and its samples are redone; finished shards are skipped by key without being read;
* SIGTERM/SIGINT: the shard in progress is discarded (never half-published). Signals take
  effect at once inside data loading and the forward pass, else after the sample being
  written (one arriving after the last shard lets the run and the merge complete). Then a
  SIGTERM whose previous handler was the default kills the process as usual; otherwise
  :class:`ExtractionInterrupted` is raised;
* a full disk (``ENOSPC``/``EDQUOT``) stops the run with an ``OSError`` saying so; published
  shards stay valid and rerunning the command resumes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import signal
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from tqdm.auto import tqdm

from .chat import ChatRenderer, TokenizedSample, tokenize
from .conversations import ErrorPolicy, Skip, normalize
from .manifest import (check_resume, config_hash, load_progress, lock_rank, merge, progress_path, repair_rank,
                       weights_fingerprint)
from .schema import (HIDDEN_DTYPES, MANIFEST_NAME, PROGRESS_GLOB, SKIP_LOG_NAME, parse_progress_name,
                     parse_shard_name, rank_shard_prefix, sample_key)
from .sources import check_unchanged, combine, iter_records, record_fingerprint, resolve
from .async_sink import AsyncShardWriter
from .writer import ShardSink, atomic_write_bytes, atomic_write_json

log = logging.getLogger(__name__)


#: rows of the embedded ShareGPT demo taken when ``num_samples`` is not given
DEMO_ROWS = 64


@dataclass
class ExtractConfig:
    """All settings of one extraction run (see :func:`eagle_data.cli.extract` for docs)."""
    out: str
    model: str = "smollm2"
    data: str = "sharegpt"
    split: str = "train"
    dataset_tag: str | None = None
    num_samples: int | None = None
    max_length: int = 2048
    chat_template: str | None = None
    template_date: str = "2026-01-01"
    template_vars: dict[str, Any] = field(default_factory=dict)
    backend: str = "hf"
    device: str = "cpu"
    dtype: str = "bfloat16"
    storage_dtype: str | None = None
    aux_layer_ids: list[int] | None = None
    batch_tokens: int = 8192
    max_batch_size: int = 64
    sort_window: int = 256
    shard_max_samples: int = 1000
    shard_max_bytes: float = 2e9
    write_queue: int = 16
    writers: int = 2
    rank: int = 0
    world_size: int = 1
    on_bad_sample: str = "skip"
    trust_remote_code: bool = False
    backend_kwargs: dict[str, Any] = field(default_factory=dict)
    progress: bool = True


def token_budget_batches(samples: Iterable[TokenizedSample], batch_tokens: int, max_batch_size: int,
                         window: int) -> Iterator[list[TokenizedSample]]:
    """Stage: group samples into batches of at most ``batch_tokens`` padded tokens
    (``B * max(T_i)``), sorting by length inside windows of ``window`` samples to limit padding.
    A sample longer than ``batch_tokens`` forms a batch alone."""
    def flush(buf):
        buf.sort(key=lambda s: s.num_tokens)
        batch, longest = [], 0
        for s in buf:
            longest2 = max(longest, s.num_tokens)
            if batch and (longest2 * (len(batch) + 1) > batch_tokens or len(batch) >= max_batch_size):
                yield batch
                batch, longest2 = [], s.num_tokens
            batch.append(s)
            longest = longest2
        if batch:
            yield batch

    buf: list[TokenizedSample] = []
    for s in samples:
        buf.append(s)
        if len(buf) >= window:
            yield from flush(buf)
            buf = []
    if buf:
        yield from flush(buf)


def _file_sha256(p: Path) -> str | None:
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else None


class ExtractionInterrupted(KeyboardInterrupt):
    """SIGTERM/SIGINT stopped :func:`run_extract`; the shard in progress was discarded and
    rerunning the same command resumes. ``signum`` is the signal."""

    def __init__(self, signum: int):
        super().__init__(f"extraction interrupted by signal {signum}")
        self.signum = signum


class _Signals:
    """SIGTERM/SIGINT -> remember; raise :class:`ExtractionInterrupted` only inside
    :meth:`interruptible` blocks (forward pass, data loading), never while a shard is being
    written or published; elsewhere :meth:`check` raises at the next safe point."""

    def __init__(self):
        self.sig: int | None = None
        self.old: dict[int, Any] = {}
        self._live = False

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(s) is not signal.SIG_IGN:
                    self.old[s] = signal.signal(s, self._on)
        return self

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)

    def _on(self, signum, _frame):
        self.sig = signum
        if self._live:
            self._live = False
            raise ExtractionInterrupted(signum)

    def check(self) -> None:
        if self.sig is not None:
            raise ExtractionInterrupted(self.sig)

    @contextmanager
    def interruptible(self):
        self.check()
        self._live = True
        try:
            yield
        finally:
            self._live = False

    def redeliver(self, sig: int) -> None:
        """After cleanup: a SIGTERM nobody handled before terminates the process as usual."""
        if self.old.get(sig) is signal.SIG_DFL:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)


def _interruptible_iter(it: Iterable, sigs: _Signals) -> Iterator:
    it = iter(it)
    while True:
        with sigs.interruptible():
            try:
                x = next(it)
            except StopIteration:
                return
        yield x


def _check_vocab(samples: Iterable[TokenizedSample], vocab_size: int, policy: ErrorPolicy) -> Iterator[TokenizedSample]:
    """Stage: skip (``token_id_out_of_range``) samples the model cannot embed."""
    for s in samples:
        top = int(s.input_ids.max()) if s.num_tokens else -1
        if top >= vocab_size or (s.num_tokens and int(s.input_ids.min()) < 0):
            policy.handle(Skip(s.row, s.source_id, "token_id_out_of_range",
                               f"token id {top} outside the model's vocabulary of {vocab_size}"))
            continue
        yield s


def _check_config(cfg: ExtractConfig) -> str:
    """Returns the storage dtype. Raises ValueError naming a bad setting."""
    if not (isinstance(cfg.world_size, int) and cfg.world_size >= 1 and isinstance(cfg.rank, int)
            and 0 <= cfg.rank < cfg.world_size):
        raise ValueError(f"rank {cfg.rank!r} must be in [0, world_size={cfg.world_size!r})")
    for name in ("shard_max_samples", "batch_tokens", "max_batch_size", "sort_window", "writers", "write_queue"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)!r}")
    storage = cfg.storage_dtype or cfg.dtype
    if storage not in HIDDEN_DTYPES:
        raise ValueError(f"storage_dtype must be one of {sorted(HIDDEN_DTYPES)}, got {storage!r}")
    if cfg.max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {cfg.max_length!r}")
    if cfg.num_samples is not None and cfg.num_samples < 1:
        raise ValueError(f"num_samples must be >= 1 (or null for all rows), got {cfg.num_samples!r}")
    if cfg.on_bad_sample not in ("skip", "raise"):
        raise ValueError(f"on_bad_sample must be 'skip' or 'raise', got {cfg.on_bad_sample!r}")
    if cfg.data != "sharegpt":
        resolve(cfg.data)  # a missing local file: ValueError before any model is loaded
    if cfg.model != "smollm2" and cfg.model.startswith(("/", ".", "~")) and not Path(cfg.model).expanduser().is_dir():
        raise ValueError(f"model {cfg.model!r} is not a model folder (a local HF folder with config.json)")
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise ValueError(f"out {cfg.out!r} exists and is not a directory")
    if cfg.chat_template is not None and not Path(cfg.chat_template).is_file():
        raise ValueError(f"chat_template {cfg.chat_template!r} is not a file")
    return storage


def _check_outdir(out: Path, rank: int, run_cfg: dict[str, Any]) -> dict[str, Any] | None:
    """This rank's previous progress, after refusing to write into a directory we cannot own.

    Raises:
        ValueError: the directory holds shards or a manifest without this rank's progress file
            (a published or copied dataset: resuming would delete its shards), or another
            rank's progress file was written with a different configuration (world size...).
    """
    prev = load_progress(out, rank)
    pre = rank_shard_prefix(rank)
    if prev is None and (any(out.glob(f"{pre}*.tar")) or
                         ((out / MANIFEST_NAME).exists() and not any(out.glob(PROGRESS_GLOB)))):
        raise ValueError(f"{out} already holds a dataset ({MANIFEST_NAME} or {pre}*.tar) without "
                         f"{progress_path(out, rank).name}: refusing to write into it (a resume would delete "
                         "its shards). Use a new --out directory.")
    if prev is not None and not prev["shards"] and not prev["skipped"] and not prev.get("finished"):
        prev = None  # nothing was ever published: a corrected command simply starts over
    for other in sorted(out.glob(PROGRESS_GLOB)):
        r = parse_progress_name(other.name)
        if r is not None and r != rank and (p := load_progress(out, r)) is not None:
            check_resume(p, run_cfg, str(other))
    return prev


def run_extract(cfg: ExtractConfig, backend=None, tokenizer=None) -> dict[str, Any]:
    """Run (or resume) an extraction. Returns the manifest if this run completed the dataset,
    else ``{"progress": <this rank's progress record>, "run_stats": ...}``.

    ``backend``/``tokenizer`` may be given pre-built (tests); otherwise they are made from
    ``cfg.model`` (``"smollm2"`` = the embedded default, or a local HF folder). The backend
    is closed on return.

    Raises:
        ValueError: bad settings; an existing output written with another configuration;
            the rank is already being extracted by another live process.
        OSError: the file system failed; for a full disk the message says so and that
            rerunning resumes.
        ExtractionInterrupted: SIGINT (or a SIGTERM with a non-default previous handler);
            a SIGTERM with the default handler terminates the process after cleanup.
    """
    storage = _check_config(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_rank(out, cfg.rank)
    try:
        return _run(cfg, storage, out, backend, tokenizer)
    finally:
        if lock is not None:
            os.close(lock)


def _run(cfg: ExtractConfig, storage: str, out: Path, backend, tokenizer) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from .backends import make_backend

    if cfg.model == "smollm2":
        from .assets import smollm2_model_dir
        model_path = str(smollm2_model_dir())
    else:
        model_path = cfg.model
    if tokenizer is None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"model {model_path}: its tokenizer cannot be loaded (tokenizer.json / "
                             f"tokenizer_config.json missing or unreadable?): {first}") from e
    renderer = ChatRenderer.from_path(tokenizer, cfg.chat_template, date=cfg.template_date,
                                      variables=cfg.template_vars)
    if cfg.num_samples is None and cfg.data == "sharegpt":
        cfg = replace(cfg, num_samples=DEMO_ROWS)  # the embedded demo; a user's --data: every row
    tag = cfg.dataset_tag or resolve(cfg.data)[2]
    sample_key(tag, 0)  # validates the tag (ValueError) before any work
    if backend is None:
        backend = make_backend(cfg.backend, model_path=model_path, aux_layer_ids=cfg.aux_layer_ids,
                               dtype=cfg.dtype, device=cfg.device, **cfg.backend_kwargs)
    try:
        return _extract(cfg, storage, out, backend, renderer, model_path, tag)
    finally:
        backend.close()


def _reopen_skip_log(path: Path, state: dict[str, Any]):
    """The rank's skip log, keeping only the lines of rows an earlier run decided that this run
    does not decide again (``state`` after pruning), then open for appending."""
    kept = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                x = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash
            if str(x.get("row")) in state["notes" if x.get("kind") == "note" else "skipped"]:
                kept.append(line + "\n")
    atomic_write_bytes(path, "".join(kept).encode("utf-8"))
    return open(path, "a", encoding="utf-8", buffering=1)


def _abort(writer: AsyncShardWriter | None, sinks: list[ShardSink] | None) -> None:
    """Stop the writer threads (queued samples dropped) and discard the shards in progress."""
    if writer is not None:
        writer.abort()
    else:
        for s in sinks or []:
            s.abort()


def _extract(cfg, storage, out, backend, renderer, model_path, tag) -> dict[str, Any]:
    info = backend.info
    run_cfg = {**asdict(cfg), "model_path": model_path, "dataset_tag": tag, "storage_dtype": storage,
               "aux_layer_ids": list(info.aux_layer_ids),
               "weights_fingerprint": weights_fingerprint(model_path),
               "tokenizer_sha256": _file_sha256(Path(model_path) / "tokenizer.json"),
               "template": renderer.describe()}
    run_cfg.pop("progress")
    model_facts = {"model_path": model_path, "backend": info.name, "hidden_size": info.hidden_size,
                   "num_layers": info.num_layers, "vocab_size": info.vocab_size,
                   "aux_layer_ids": list(info.aux_layer_ids), "dtype": storage, "compute_dtype": info.dtype,
                   "backend_extra": info.extra}

    # ---- resume: the progress file is the truth; the directory is made to agree with it ------
    prog = progress_path(out, cfg.rank)
    prev = _check_outdir(out, cfg.rank, run_cfg)
    if prev is not None:
        check_resume(prev, run_cfg, str(prog))
        old = prev["config"].get("num_samples")  # more rows extend the run; fewer do not shrink it
        prev["config"]["num_samples"] = None if None in (old, cfg.num_samples) else max(old, cfg.num_samples)
    state = prev or {"config": run_cfg, "config_hash": config_hash(run_cfg), "rank": cfg.rank,
                     "world_size": cfg.world_size, "model": model_facts, "shards": [], "skipped": {},
                     "finished": False}
    if repair_rank(out, cfg.rank, state) and (out / MANIFEST_NAME).exists():
        (out / MANIFEST_NAME).unlink()  # no longer describes the directory; merged again at the end
    state["finished"] = False
    done = {k for s in state["shards"] for k in s["keys"]}
    if done and all("source_digest" in s for s in state["shards"]):  # before anything is changed
        check_unchanged(cfg.data, cfg.split, cfg.rank, cfg.world_size, done, lambda r: sample_key(tag, r),
                        combine(int(s["source_digest"], 16) for s in state["shards"]))
    # Rows an earlier run skipped or noted are decided again (a row fixed in the source since is
    # extracted), except those beyond a smaller num_samples, which this run does not read.
    beyond = (lambda r: cfg.num_samples is not None and int(r) >= cfg.num_samples)
    state["skipped"] = {r: v for r, v in state["skipped"].items() if beyond(r)}
    state["notes"] = {r: v for r, v in state.get("notes", {}).items() if beyond(r) or sample_key(tag, int(r)) in done}
    next_shard = 1 + max((parse_shard_name(s["name"])[1] for s in state["shards"]), default=-1)
    published_tokens = sum(s["num_tokens"] for s in state["shards"])
    atomic_write_json(prog, state)

    unsaved: dict[str, dict[str, str]] = {"skipped": {}, "notes": {}}  # str(row) -> reason
    lock = threading.Lock()  # on_publish runs in the shard-writer thread

    skip_log = _reopen_skip_log(out / SKIP_LOG_NAME.format(rank=cfg.rank), state)

    fps: dict[str, int] = {}  # key -> fingerprint of its source row, until published or skipped

    def remember(skip: Skip, note: bool) -> None:  # every skip/note, with its detail, in the skip log
        with lock:
            if not note:  # a skipped row is not in the dataset: no fingerprint, no note
                fps.pop(sample_key(tag, skip.row), None)
                unsaved["notes"].pop(str(skip.row), None)
                state["notes"].pop(str(skip.row), None)
            unsaved["notes" if note else "skipped"][str(skip.row)] = skip.reason
            skip_log.write(json.dumps({"row": skip.row, "id": skip.source_id, "kind": "note" if note else "skip",
                                       "reason": skip.reason, "detail": skip.detail}, ensure_ascii=False) + "\n")

    policy = ErrorPolicy(cfg.on_bad_sample, listener=remember)

    def commit(extra: dict[str, Any]) -> None:  # skips and notes seen so far, in one atomic write
        new = {**state, **extra, **{k: {**state[k], **v} for k, v in unsaved.items()}}
        atomic_write_json(prog, new)
        state.update(new)
        for v in unsaved.values():
            v.clear()

    def on_publish(rec):  # commit shard + skips/notes seen so far in one atomic progress write
        with lock:
            rec["source_digest"] = combine(fps.pop(k) for k in rec["keys"])
            commit({"shards": [*state["shards"], rec]})

    def fresh_records():  # rows not extracted yet, each fingerprinted for its shard's digest
        for r, rec in iter_records(cfg.data, cfg.split, cfg.rank, cfg.world_size, cfg.num_samples):
            if (key := sample_key(tag, r)) not in done:
                with lock:
                    fps[key] = record_fingerprint(r, rec)
                yield r, rec

    # ---- pipeline (finished rows are dropped before any tokenisation) -----------------------
    records = fresh_records()
    samples = _check_vocab(tokenize(normalize(records, policy), renderer, tag, cfg.max_length, policy),
                           info.vocab_size, policy)
    sigs = _Signals()
    batches = _interruptible_iter(token_budget_batches(samples, cfg.batch_tokens, cfg.max_batch_size,
                                                       cfg.sort_window), sigs)
    sdtype = HIDDEN_DTYPES[storage]
    bar = tqdm(desc=f"extract rank {cfg.rank}", unit="sample", disable=not cfg.progress, dynamic_ncols=True)
    t0, n_tok, n_new = time.perf_counter(), 0, 0
    sink = None
    has_async = hasattr(backend, "capture_async")

    def launch(batch):
        """Start the capture of ``batch`` (async backends return at once: forward + D2H in flight)."""
        items = [(s.key, s.input_ids) for s in batch]
        with sigs.interruptible():
            return backend.capture_async(items) if has_async else backend.capture(items)

    def consume(batch, pending):
        nonlocal n_tok, n_new
        with sigs.interruptible():
            caps = pending.result() if has_async else pending
        assert [c.key for c in caps] == [s.key for s in batch], "backend returned samples out of order"
        for s, c in zip(batch, caps):
            if c.hidden_states.shape[0] != s.num_tokens or c.aux_hidden_states.shape[0] != s.num_tokens:
                raise RuntimeError(f"sample {s.key}: backend returned {c.hidden_states.shape[0]} rows "
                                   f"for {s.num_tokens} tokens")
            aux, fin = c.aux_hidden_states.to(sdtype), c.hidden_states.to(sdtype)
            if not (torch.isfinite(aux).all() and torch.isfinite(fin).all()):
                policy.handle(Skip(s.row, s.source_id, "non_finite_hidden_states",
                                   f"NaN/Inf in the captured states of {s.key}"))
                continue
            meta = {"source_dataset": cfg.data, "dataset_tag": tag, "source_id": s.source_id,
                    "source_row": s.row, "num_turns": s.num_turns, "num_tokens": s.num_tokens,
                    "num_loss_tokens": int(s.loss_mask.sum()), "truncated": s.truncated}
            writer.put(s.key, {"input_ids": s.input_ids, "loss_mask": s.loss_mask,
                               "aux_hidden_states": aux, "hidden_states": fin}, meta)
            n_tok += s.num_tokens
            n_new += 1
            sigs.check()
        dt = time.perf_counter() - t0
        bar.update(len(batch))
        bar.set_postfix(tok_s=f"{n_tok / dt:.0f}", skipped=len(state["skipped"]) + len(unsaved["skipped"]),
                        written=f"{writer.bytes_written / 2**20:.0f}MiB")

    writer = None
    with sigs:
        try:
            # Overlap: batch i+1's forward is launched before batch i is written, and writer
            # threads hash/write (GIL released) while the next forward runs (bounded queue).
            # Writer w of W fills shards next_shard + w, + W, ... of this rank's series.
            sink = [ShardSink(out, cfg.rank, next_shard + w, cfg.shard_max_samples, cfg.shard_max_bytes,
                              on_publish, shard_step=cfg.writers) for w in range(cfg.writers)]
            writer = AsyncShardWriter(sink, max_queue=cfg.write_queue)
            if hasattr(backend, "capture_iter"):  # engine backends pipeline batches themselves
                fifo: deque = deque()

                def items():
                    for b in batches:
                        fifo.append(b)
                        yield [(s.key, s.input_ids) for s in b]
                it = backend.capture_iter(items(), prefetch=1)
                while True:
                    with sigs.interruptible():
                        caps = next(it, None)
                    if caps is None:
                        break
                    consume(fifo.popleft(), caps)
            else:
                inflight = None
                for batch in batches:
                    pending = launch(batch)
                    if inflight is not None:
                        consume(*inflight)
                    inflight = (batch, pending)
                if inflight is not None:
                    consume(*inflight)
            writer.close()
            with lock:
                commit({"finished": True})
        except ExtractionInterrupted as e:
            _abort(writer, sink)
            log.error("interrupted by signal %d: the shard in progress was discarded (%d shard(s) of rank %d "
                      "are complete); rerun the same command to resume", e.signum, len(state["shards"]), cfg.rank)
            sigs.__exit__()
            sigs.redeliver(e.signum)
            raise
        except OSError as e:
            _abort(writer, sink)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(e.errno, f"no space left on the device of {out} ({e.strerror}); the shard in "
                              f"progress was discarded, {len(state['shards'])} shard(s) of rank {cfg.rank} are "
                              "complete and valid. Free space and rerun the same command to resume.") from e
            raise
        except BaseException:
            _abort(writer, sink)
            raise
        finally:
            bar.close()
            skip_log.close()
        elapsed = time.perf_counter() - t0
        stats = {"new_samples": n_new, "new_tokens": n_tok, "seconds": round(elapsed, 3),
                 "tokens_per_s": round(n_tok / elapsed, 1) if elapsed > 0 else None,
                 "total_tokens": published_tokens + n_tok,
                 "skip_counts": dict(sorted(policy.counter.as_dict().items())),
                 "note_counts": dict(sorted(policy.counter.notes.items()))}
        log.info("rank %d finished: %s", cfg.rank, stats)
        # The last rank to finish writes the merged manifest (idempotent if several race).
        result: dict[str, Any] = {"progress": state, "run_stats": stats}
        if all((p := load_progress(out, r)) is not None and p.get("finished") for r in range(cfg.world_size)):
            result = {**merge(out), "run_stats": stats}
    if sigs.sig is not None:  # arrived after the last shard: the run is complete, now obey it
        log.error("signal %d received after rank %d completed; stopping", sigs.sig, cfg.rank)
        sigs.redeliver(sigs.sig)
        raise ExtractionInterrupted(sigs.sig)
    return result
