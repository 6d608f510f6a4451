"""Capture hooks that run INSIDE the SGLang scheduler process (sglang 0.5.17 - 0.5.23).

Registered through the ``forward_hooks`` server argument (``sglang/srt/model_executor/hook_manager.py``,
the same in both versions), one spec per aux layer and one on the logits processor::

    {"name": "eagle_data_aux_0", "target_modules": ["model.layers.1"],
     "hook_factory": "eagle_data.engines.sglang_hook:make_layer_hook",
     "config": {"spool_dir": "...", "slot": 0, "n_aux": 3}}
    ...
    {"name": "eagle_data_capture", "target_modules": ["logits_processor"],
     "hook_factory": "eagle_data.engines.sglang_hook:make_capture_hook",
     "config": {"spool_dir": "...", "rid_prefix": "...", "n_aux": 3, "out_dtype": "float8_e4m3fn"}}

(:func:`hook_specs` builds the list.) Every pass runs the layers in order, then the logits processor:

* **aux layer ``k``** (our id ``k`` = HF ``hidden_states[k + 1]``, the residual stream after decoder
  layer ``k``): the hook sits on ``model.layers.<k+1>.input_layernorm``. Every supported release
  defers the residual add of layer ``k`` into that norm (0.5.17: ``input_layernorm(hidden, residual)``
  in the layer or its communicator; 0.5.23: the layer boundary's add-norm read), which returns
  ``(normed, residual)`` with ``residual`` = the stream after layer ``k`` (a norm called on the
  stream alone gets it as its input). On a GPU the fused kernel updates ``residual`` in place and
  the next add-norm will again, so the hook clones it at once: exactly what SGLang's own EAGLE-3
  capture stores as the input of layer ``k + 1`` (``layers_to_capture = [k + 1]``). A norm fused
  with a TP all-reduce or a quantisation is another call, so its hook does not run: that pass is
  refused, never stored.
* **logits processor** ``(input_ids, hidden_states, lm_head, forward_batch, ...)``: ``hidden_states``
  [N, H] is the final post-norm state (what ``lm_head`` eats). The hook takes the aux slots of
  this pass ([N, K*H] after concatenation), and for every request whose rid starts with
  ``rid_prefix`` in a plain ``ForwardMode.EXTEND`` pass hands rows
  ``[extend_prefix_len, extend_prefix_len + extend_seq_len)`` to the :class:`_Writer`, which
  copies each request's chunk into the spool's shared-memory ring and writes its record
  (:mod:`eagle_data.engines.sglang_arena`; a file, :func:`eagle_data.engines.sglang_spool.write_piece`,
  when there is no ring or no room in it).

The rows leave in their storage dtypes (``out_dtype`` / ``final_out_dtype``: the model dtype, or fp8
with per-(token, layer) scales, :func:`eagle_data.format.fp8.quantize`, on the device, as the HF
backend does), with ``ok`` [N]: every stored value of the row finite, checked on the device.
Nothing stalls the scheduler on a GPU: the pass's rows are cast into fresh device tensors, copied
to pinned host memory on a side stream, and a writer thread waits for that copy's event and
writes the chunks; the bytes in flight are bounded (``max_pending_bytes``; the hook waits only
when the bound is reached). DECODE and IDLE passes are ignored; any other extend-like mode holding
one of our requests (MIXED, SPLIT_PREFILL, TARGET_VERIFY, ...), a missing or doubled aux slot or an
inconsistent batch writes an error file for each of our rids, which the backend raises naming the
sample: rows are never dropped silently.

Tensor parallel: every TP rank holds the full (all-reduced) hidden states; only TP rank 0 writes
(the factories return no hook on other ranks). Pipeline parallel and attention-DP are refused by
the backend at start-up.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections import Counter
from typing import Any

import torch

from eagle_data.engines.sglang_arena import ArenaWriter
from eagle_data.engines.sglang_spool import piece_name, write_error, write_hook_stats, write_piece
from eagle_data.format.fp8 import finite_rows, to_storage
from eagle_data.format.schema import storage_dtype_of

log = logging.getLogger(__name__)

LAYER_HOOK = "eagle_data.engines.sglang_hook:make_layer_hook"
CAPTURE_HOOK = "eagle_data.engines.sglang_hook:make_capture_hook"

#: aux slots of the pass in progress, per spool dir: [slot] = the stream [N, H], or an error text
_SLOTS: dict[str, list[Any]] = {}


def hook_specs(spool_dir: str, rid_prefix: str, aux_layer_ids: list[int] | None,
               max_pending_bytes: int = 1 << 30, out_dtype: str | None = None,
               final_out_dtype: str | None = None) -> list[dict[str, Any]]:
    """The ``forward_hooks`` server arg. ``aux_layer_ids=None``: no layer hooks, the aux states come
    from the engine's own EAGLE-3 capture (the logits processor's 5th argument; sglang >= 0.5.23).
    ``out_dtype`` / ``final_out_dtype``: storage dtype names of the aux / final rows (None: as computed)."""
    n_aux = 0 if aux_layer_ids is None else len(aux_layer_ids)
    specs = [{"name": f"eagle_data_aux_{i}",
              "target_modules": [f"model.layers.{k + 1}.input_layernorm", f"*.model.layers.{k + 1}.input_layernorm"],
              "hook_factory": LAYER_HOOK, "config": {"spool_dir": spool_dir, "slot": i, "n_aux": n_aux}}
             for i, k in enumerate(aux_layer_ids or [])]
    return specs + [{"name": "eagle_data_capture", "target_modules": ["logits_processor"], "hook_factory": CAPTURE_HOOK,
                     "config": {"spool_dir": spool_dir, "rid_prefix": rid_prefix, "n_aux": n_aux,
                                "max_pending_bytes": int(max_pending_bytes), "out_dtype": out_dtype,
                                "final_out_dtype": final_out_dtype}}]


def _tp_rank() -> int:
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (unit use outside a scheduler)
        return 0


def _slots(spool: str, n_aux: int) -> list[Any]:
    slots = _SLOTS.setdefault(spool, [None] * n_aux)
    assert len(slots) == n_aux, (spool, len(slots), n_aux)
    return slots


def make_layer_hook(config: dict):
    """Hook factory for aux slot ``config["slot"]`` on the input norm of the layer after it: stores
    the residual stream it returns (or, called on the stream alone, its input) for the
    logits-processor hook of the same pass. ``None`` on TP ranks other than 0."""
    if _tp_rank() != 0:
        return None
    slots, slot = _slots(config["spool_dir"], int(config["n_aux"])), int(config["slot"])

    def hook(module, args, output):
        stream = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else args[0]
        if slots[slot] is not None:
            slots[slot] = (f"aux slot {slot} was filled twice before the logits processor ran (the hook "
                           f"patterns matched several modules, or a pass ran without the logits processor)")
        else:
            slots[slot] = stream.clone()  # the next fused add-norm updates the stream in place
        return None

    return hook


def make_capture_hook(config: dict):
    """Hook factory for the logits processor.

    Args:
        config: ``{"spool_dir": str, "rid_prefix": str, "n_aux": int, "max_pending_bytes": int,
            "out_dtype": str | None, "final_out_dtype": str | None}``; ``rid_prefix`` selects the
            requests to capture (others, e.g. warm-up requests, are skipped); ``n_aux = 0``: aux
            states from the engine (5th argument); the dtypes: see :func:`stored_rows`.

    Returns:
        ``hook(module, args, output)`` with ``hook.drain()`` (wait until every chunk is written),
        or ``None`` on TP ranks other than 0 (SGLang then registers nothing on that rank).
    """
    spool, prefix, n_aux = config["spool_dir"], config.get("rid_prefix", ""), int(config.get("n_aux", 0))
    if _tp_rank() != 0:
        return None
    slots = _slots(spool, n_aux) if n_aux else None
    dtypes = tuple(None if config.get(k) is None else storage_dtype_of(config[k], k)
                   for k in ("out_dtype", "final_out_dtype"))
    writer = _Writer(spool, int(config.get("max_pending_bytes", 1 << 30)), dtypes)

    def hook(module, args, output):
        taken = list(slots) if slots else None
        if slots:
            slots[:] = [None] * n_aux  # every pass starts empty, ours or not
        try:
            return _capture(args, taken, prefix, spool, writer)
        except Exception as e:  # e.g. spool full: report it per request instead of killing the scheduler
            ours = [r for r in (getattr(args[3], "rids", None) or [] if len(args) > 3 else [])
                    if isinstance(r, str) and r.startswith(prefix)]
            try:
                for r in ours:
                    write_error(spool, r, writer.next_seq(), f"capture hook failed: {e!r}")
            except Exception:
                raise e
            log.exception("eagle-data capture hook failed")
            return None

    hook.drain = writer.drain
    log.info("eagle-data capture hook active in pid %d, spool %s", os.getpid(), spool)
    return hook


def _capture(args, taken: list | None, prefix: str, spool: str, writer: "_Writer") -> None:
    """One pass of the logits processor (``args``: input ids, hidden [N, H], ..., forward batch[, engine
    aux]): hand our requests' rows to ``writer``, or write an error file for each of them when the pass
    is not a plain prefill or its batch is inconsistent. ``taken``: the layer hooks' slots of this pass."""
    if len(args) < 4:
        return None
    input_ids, hidden, fb = args[0], args[1], args[3]
    rids = list(getattr(fb, "rids", None) or [])
    ours = [r for r in rids if isinstance(r, str) and r.startswith(prefix)]
    if not ours:
        return None
    mode = fb.forward_mode
    if mode.is_decode() or mode.is_idle():
        return None

    def refuse(msg: str):
        for r in ours:
            write_error(spool, r, writer.next_seq(), msg)

    if mode.name != "EXTEND":
        return refuse(f"forward mode {mode.name} is not a plain prefill (EXTEND); "
                      f"mixed chunking / speculative modes are not supported")
    aux_t, problem = _aux_of_pass(taken, args[4] if len(args) > 4 else None)
    if problem:
        return refuse(problem)
    seqs, pres = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
    n_tok = int(hidden.shape[0])
    if (seqs is None or pres is None or len(seqs) != len(rids) or len(pres) != len(rids)
            or sum(int(s) for s in seqs) != n_tok or aux_t.shape[0] != n_tok
            or input_ids.shape[0] != n_tok):
        return refuse(f"inconsistent batch: {len(rids)} rids, extend_seq_lens {seqs}, "
                      f"prefix_lens {pres}, {n_tok} hidden rows, {aux_t.shape[0]} aux rows, "
                      f"{input_ids.shape[0]} input ids")
    rows, start = [], 0
    for rid, n, off in zip(rids, seqs, pres):
        n, off = int(n), int(off)
        if isinstance(rid, str) and rid.startswith(prefix) and n > 0:
            rows.append((rid, off, writer.next_seq(), start, n))
        start += n
    writer.put(input_ids, aux_t, hidden, rows)
    return None


def _aux_of_pass(taken: list | None, engine_aux) -> tuple[torch.Tensor | None, str | None]:
    """``(aux [N, K*H], None)`` or ``(None, why not)``: from the layer hooks' slots of this pass,
    else (no layer hooks) from the engine's own capture (a list of [N, H] or one packed tensor)."""
    if taken is None:
        if engine_aux is None or (isinstance(engine_aux, (list, tuple)) and not engine_aux):
            return None, ("no aux hidden states reached the logits processor "
                          "(enable_return_aux_hidden_states is off or the model does not support it)")
        return (engine_aux if isinstance(engine_aux, torch.Tensor) else torch.cat(list(engine_aux), dim=-1)), None
    for i, s in enumerate(taken):
        if s is None:
            return None, (f"aux slot {i}: the hook on the next layer's input_layernorm did not run in this pass "
                          f"(no such module, a norm fused with an all-reduce or quantisation, or a CUDA graph)")
        if isinstance(s, str):
            return None, s
    return torch.cat(taken, dim=-1), None


def stored_rows(input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
                dtypes: tuple[torch.dtype | None, torch.dtype | None]) -> dict[str, torch.Tensor]:
    """A pass's rows as they will be stored, in fresh tensors on their device (the engine refills its
    own buffers in place): ``input_ids`` [N] int64, ``aux`` [N, K*H] and ``final`` [N, H] in
    ``dtypes`` (None: as computed; fp8: + ``aux_scale`` [N, K] / ``final_scale`` [N, 1] float32,
    :func:`eagle_data.format.fp8.to_storage`, as the HF backend stores), and ``ok`` [N] bool: every
    stored value of the row finite (fp8: its scales, which a NaN/Inf makes non-finite)."""
    k = aux.shape[1] // max(1, final.shape[1])
    a, a_s = to_storage(aux, dtypes[0] or aux.dtype, k, check=False)
    f, f_s = to_storage(final, dtypes[1] or final.dtype, 1, check=False)
    out = {"input_ids": input_ids.to(torch.int64, copy=True), "aux": a.clone() if a is aux else a,
           "final": f.clone() if f is final else f}
    out.update({name: x for name, x in (("aux_scale", a_s), ("final_scale", f_s)) if x is not None})
    out["ok"] = finite_rows(a, a_s) & finite_rows(f, f_s)
    return out


class _Writer:
    """Copies a pass's rows off the device and hands each request's chunk to the spool (its ring,
    else a file) in a thread.

    GPU: the rows in their storage dtypes (:func:`stored_rows`) are copied to pinned host memory on a
    side stream; the thread waits for the copy's event, then writes. At most ``max_bytes`` of passes
    wait at once (a single larger pass waits alone); :meth:`put` blocks only at that bound.
    ``stats``: seconds spent per step (``put``: the scheduler thread's share, of which ``pin``
    allocating pinned buffers and ``bound`` waiting at the bound; ``copy_wait`` and ``write``: the
    writer thread's), passes and bytes; rewritten to the spool's
    :data:`~eagle_data.engines.sglang_spool.HOOK_STATS` after each pass's pieces.
    """

    def __init__(self, spool: str, max_bytes: int,
                 dtypes: tuple[torch.dtype | None, torch.dtype | None] = (None, None)):
        self.spool, self.max_bytes, self.dtypes = spool, max(1, max_bytes), dtypes
        self.seq, self.lock = itertools.count(), threading.Lock()
        self.busy, self.cond = 0, threading.Condition()
        self.q: queue.Queue = queue.Queue()
        self.stream = None
        self.arena = ArenaWriter.open(spool)  # the backend's ring, when it made one
        self.stats: Counter = Counter(dict.fromkeys(  # every key now: the writer thread copies it meanwhile
            ("put_s", "pin_s", "bound_s", "copy_wait_s", "write_s", "passes", "pieces", "file_pieces", "bytes"), 0))
        threading.Thread(target=self._run, name="eagle-data-spool-writer", daemon=True).start()

    def next_seq(self) -> int:
        with self.lock:
            return next(self.seq)

    def put(self, input_ids: torch.Tensor, aux: torch.Tensor, final: torch.Tensor, rows: list) -> None:
        """``rows``: ``(rid, offset, seq, start, n)`` for each of our requests in the pass."""
        if not rows:
            return
        t0 = time.perf_counter()
        fresh = stored_rows(input_ids, aux, final, self.dtypes)  # on the engine's stream
        event = None
        if aux.device.type == "cuda":
            self.stream = self.stream or torch.cuda.Stream(aux.device)
            self.stream.wait_stream(torch.cuda.current_stream(aux.device))
            t1 = time.perf_counter()
            host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in fresh.items()}
            self.stats["pin_s"] += time.perf_counter() - t1
            with torch.cuda.stream(self.stream):
                for k, t in fresh.items():
                    host[k].copy_(t, non_blocking=True)
                    t.record_stream(self.stream)
                event = torch.cuda.Event()
                event.record(self.stream)
            fresh = host
        size = sum(t.numel() * t.element_size() for t in fresh.values())
        t1 = time.perf_counter()
        with self.cond:
            self.cond.wait_for(lambda: self.busy == 0 or self.busy + size <= self.max_bytes)
            self.busy += size
        self.stats.update(bound_s=time.perf_counter() - t1, put_s=time.perf_counter() - t0, passes=1, bytes=size)
        self.q.put((fresh, event, rows, size))

    def _run(self) -> None:
        while True:
            t, event, rows, size = self.q.get()
            try:
                t0 = time.perf_counter()
                if event is not None:
                    event.synchronize()
                t1 = time.perf_counter()
                files = 0
                for rid, off, seq, start, n in rows:
                    rows_of = {k: x[start:start + n] for k, x in t.items()}
                    try:
                        if self.arena is None or self.arena.put(piece_name(rid, off, seq, "arena"), {
                                "rid": rid, "offset": off, "seq": seq}, rows_of) is None:  # no ring, or no room
                            files += 1
                            write_piece(self.spool, rid, off, seq, rows_of.pop("input_ids"), rows_of.pop("aux"),
                                        rows_of.pop("final"), rows_of)
                    except Exception as e:  # the backend raises it naming the sample
                        try:
                            write_error(self.spool, rid, seq, f"capture hook failed to write rows: {e!r}")
                        except OSError:  # e.g. a full spool: the thread goes on; the backend's wait times out
                            log.exception("eagle-data: rows of %s and their error record could not be written", rid)
                self.stats.update(copy_wait_s=t1 - t0, write_s=time.perf_counter() - t1, pieces=len(rows),
                                  file_pieces=files)
                try:
                    write_hook_stats(self.spool, dict(self.stats))
                except OSError:  # diagnostics only: a full spool is reported by the pieces' own writes
                    pass
            finally:
                with self.cond:
                    self.busy -= size
                    self.cond.notify_all()
                self.q.task_done()

    def drain(self) -> None:
        self.q.join()
