"""The extraction pipeline: records -> conversations -> tokens + loss mask -> one prefill
pass per sample -> atomic WebDataset shards + index + manifest.

Stages are generators; :func:`run_extract` wires them, owns resume and signal handling.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from .chat import ChatRenderer, TokenizedSample, tokenize
from .conversations import ErrorPolicy, normalize
from .manifest import check_resume, config_hash, load_progress, merge, progress_path, weights_fingerprint
from .schema import HIDDEN_DTYPES
from .sources import iter_records, resolve
from .writer import ShardSink, atomic_write_json

log = logging.getLogger(__name__)


@dataclass
class ExtractConfig:
    """All settings of one extraction run (see :func:`eagle_data.cli.extract` for docs)."""
    out: str
    model: str = "smollm2"
    data: str = "sharegpt"
    split: str = "train"
    dataset_tag: str | None = None
    num_samples: int | None = 64
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


class _Stop(Exception):
    pass


def run_extract(cfg: ExtractConfig, backend=None, tokenizer=None) -> dict[str, Any]:
    """Run (or resume) an extraction. Returns the manifest if this run completed the dataset,
    else this rank's progress record.

    ``backend``/``tokenizer`` may be given pre-built (tests); otherwise they are made from
    ``cfg.model`` (``"smollm2"`` = the embedded default, or a local HF folder).

    Raises:
        ValueError: bad settings, or an existing output written with another configuration.
    """
    from transformers import AutoTokenizer

    from .backends import make_backend

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    storage = cfg.storage_dtype or cfg.dtype
    if storage not in HIDDEN_DTYPES:
        raise ValueError(f"storage_dtype must be one of {sorted(HIDDEN_DTYPES)}, got {storage!r}")
    if cfg.model == "smollm2":
        from .assets import smollm2_model_dir
        model_path = str(smollm2_model_dir())
    else:
        model_path = cfg.model
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.trust_remote_code)
    renderer = ChatRenderer.from_path(tokenizer, cfg.chat_template, date=cfg.template_date,
                                      variables=cfg.template_vars)
    tag = cfg.dataset_tag or resolve(cfg.data)[2]
    if backend is None:
        backend = make_backend(cfg.backend, model_path=model_path, aux_layer_ids=cfg.aux_layer_ids,
                               dtype=cfg.dtype, device=cfg.device, **cfg.backend_kwargs)
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

    # ---- resume ---------------------------------------------------------------------------
    prev = load_progress(out, cfg.rank)
    if prev is not None:
        check_resume(prev, run_cfg, str(progress_path(out, cfg.rank)))
    for stale in out.glob(f"{cfg.rank:05d}-*.tar.tmp"):
        log.warning("removing interrupted shard %s (its samples are redone)", stale.name)
        stale.unlink()
    state = prev or {"config": run_cfg, "config_hash": config_hash(run_cfg), "rank": cfg.rank,
                     "world_size": cfg.world_size, "model": model_facts, "shards": [], "skipped": {},
                     "finished": False}
    state["finished"] = False
    done = {k for s in state["shards"] for k in s["keys"]}
    skipped: dict[str, str] = state["skipped"]  # str(row) -> reason
    next_shard = 1 + max((int(s["name"][6:12]) for s in state["shards"]), default=-1)
    published_tokens = sum(s["num_tokens"] for s in state["shards"])

    policy = ErrorPolicy(cfg.on_bad_sample)
    pending_skips: dict[str, str] = {}
    _orig_handle = policy.handle

    def handle(skip):
        _orig_handle(skip)
        pending_skips[str(skip.row)] = skip.reason
    policy.handle = handle  # type: ignore[method-assign]

    def on_publish(rec):
        state["shards"].append(rec)
        state["skipped"].update(pending_skips)
        pending_skips.clear()
        atomic_write_json(progress_path(out, cfg.rank), state)

    sink = ShardSink(out, cfg.rank, next_shard, cfg.shard_max_samples, cfg.shard_max_bytes, on_publish)
    atomic_write_json(progress_path(out, cfg.rank), state)

    # ---- pipeline ---------------------------------------------------------------------------
    records = ((r, rec) for r, rec in iter_records(cfg.data, cfg.split, cfg.rank, cfg.world_size, cfg.num_samples)
               if str(r) not in skipped)
    samples = (s for s in tokenize(normalize(records, policy), renderer, tag, cfg.max_length, policy)
               if s.key not in done)
    batches = token_budget_batches(samples, cfg.batch_tokens, cfg.max_batch_size, cfg.sort_window)
    sdtype = HIDDEN_DTYPES[storage]

    stop = {"sig": None}

    def on_signal(signum, _frame):
        stop["sig"] = signum
        raise _Stop()
    old_handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    bar = tqdm(desc=f"extract rank {cfg.rank}", unit="sample", disable=not cfg.progress, dynamic_ncols=True)
    t0, n_tok, n_new = time.perf_counter(), 0, 0
    try:
        for batch in batches:
            caps = backend.capture([(s.key, s.input_ids) for s in batch])
            assert [c.key for c in caps] == [s.key for s in batch], "backend returned samples out of order"
            for s, c in zip(batch, caps):
                if c.hidden_states.shape[0] != s.num_tokens or c.aux_hidden_states.shape[0] != s.num_tokens:
                    raise RuntimeError(f"sample {s.key}: backend returned {c.hidden_states.shape[0]} rows "
                                       f"for {s.num_tokens} tokens")
                meta = {"source_dataset": cfg.data, "dataset_tag": tag, "source_id": s.source_id,
                        "source_row": s.row, "num_turns": s.num_turns, "num_tokens": s.num_tokens,
                        "num_loss_tokens": int(s.loss_mask.sum()), "truncated": s.truncated}
                sink.write(s.key, {"input_ids": s.input_ids, "loss_mask": s.loss_mask,
                                   "aux_hidden_states": c.aux_hidden_states.to(sdtype),
                                   "hidden_states": c.hidden_states.to(sdtype)}, meta)
                n_tok += s.num_tokens
                n_new += 1
            dt = time.perf_counter() - t0
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{n_tok / dt:.0f}", written=f"{(sink.bytes_written + sink.pending_bytes) / 2**20:.0f}MiB",
                            skipped=len(skipped) + len(pending_skips))
        sink.close()
        state["skipped"].update(pending_skips)
        state["finished"] = True
        atomic_write_json(progress_path(out, cfg.rank), state)
    except (_Stop, KeyboardInterrupt):
        sink.abort()
        log.error("interrupted (signal %s): the shard in progress was discarded; rerun the same command "
                  "to resume", stop["sig"])
        raise
    except BaseException:
        sink.abort()
        raise
    finally:
        bar.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
        backend.close()
    elapsed = time.perf_counter() - t0
    stats = {"new_samples": n_new, "new_tokens": n_tok, "seconds": round(elapsed, 3),
             "tokens_per_s": round(n_tok / elapsed, 1) if elapsed > 0 else None,
             "total_tokens": published_tokens + n_tok,
             "skip_counts": dict(sorted(policy.counter.as_dict().items()))}
    log.info("rank %d finished: %s", cfg.rank, stats)
    # The last rank to finish writes the merged manifest (idempotent if several race).
    if all((p := load_progress(out, r)) is not None and p.get("finished") for r in range(cfg.world_size)):
        manifest = merge(out)
        manifest["run_stats"] = stats
        return manifest
    return {"progress": state, "run_stats": stats}
