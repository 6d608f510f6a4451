"""SGLang capture backend (sglang 0.5.17 - 0.5.23): prefill-only capture inside the scheduler.

How it works:

1. The engine runs plain prefills (``max_new_tokens=0``), no draft, no speculative stack.
   :mod:`eagle_data.engines.sglang_hook` is registered through the ``forward_hooks``
   server arg (the same in every supported version): one hook per aux layer on
   ``model.layers.<id>`` stores the residual stream after that layer (our id ``k`` = HF
   ``hidden_states[k + 1]``, :data:`eagle_data.format.schema.LAYER_ID_CONVENTION`; proven against
   HF in the tests), and one hook on ``logits_processor`` takes the final post-norm state and, in
   every plain EXTEND pass, writes each of our requests' rows as a safetensors chunk into a spool
   dir (:mod:`eagle_data.engines.sglang_spool`), off the scheduler's thread.
2. :meth:`SGLangBackend.capture` sends ``input_ids`` (never text) with ``max_new_tokens=0`` and
   ``rid=<run prefix><n>`` for every sample, at most ``max_inflight`` requests /
   ``max_inflight_bytes`` of stored rows in flight (bounds the spool), and when a request
   finishes reads, stitches (by prefix offset), checks and deletes its chunks.
   :meth:`SGLangBackend.capture_iter` does the same over many batches with the next batch
   already submitted, so the engine keeps computing while the caller writes shards.

Tensor parallel: every TP rank holds the full hidden states; only TP rank 0 writes (the
hook factory returns no hook on other ranks). ``tp_size > 1`` on CPU is refused: sglang
0.5.23 builds a NCCL communicator for CPU groups (tried with gloo here).

Invariants checked at start-up: radix cache off (a cached prefix would skip rows), mixed
chunking off (prefill rows would be mixed with decode rows), pp = dp = 1, and a warm-up
request whose rows must arrive. On GPU, prefill CUDA graphs are disabled
(``cuda_graph_backend_prefill="disabled"``: module hooks only fire on the eager path),
recorded in ``info.extra``.

CPU: with ``device="cpu"`` the backend sets ``SGLANG_USE_CPU_ENGINE=1`` and puts
``eagle_data/engines/cpu_sgl_kernel`` (a pure-torch ``sgl_kernel`` stand-in, see its
docstring) first on ``PYTHONPATH`` before importing sglang, so the spawned scheduler
inherits both. Scripts that build this backend need ``if __name__ == "__main__":`` (spawn).

Note: SGLang's ``Engine.shutdown()`` kills every child process of the current process;
``close()`` narrows that to the engine's own children (several engines and data-loader
workers can coexist in one process).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch

from eagle_data.format.schema import hidden_dtype, storage_dtype_of
from eagle_data.engines.base import (BackendInfo, Captured, check_served_aux_ids, default_aux_layer_ids,
                                             validate_aux_layer_ids)
from eagle_data.engines.sglang_engine import (CPU_KERNEL_DIR, SGLangOptions, base_engine_kwargs,  # noqa: F401
                                              capture_info_extra, check_capture_invariants, check_version,
                                              model_facts, prepare_cpu_environment, scoped_shutdown, start_engine)
from eagle_data.engines.sglang_hook import hook_specs
from eagle_data.engines.sglang_spool import (Piece, RowsMissing, Spool, StitchError, list_spool, read_error,
                                            read_hook_stats, stitch, stored_row_bytes)

log = logging.getLogger(__name__)

# Engine args the backend owns: overriding them would break the capture invariants.
_OWNED = {"model_path", "dtype", "device", "tp_size", "skip_tokenizer_init", "disable_radix_cache",
          "enable_mixed_chunk", "enable_return_aux_hidden_states", "speculative_algorithm",
          "return_aux_hidden_state_layer_ids", "forward_hooks", "cuda_graph_backend_prefill"}


class SGLangBackend:
    """Production capture through an in-process SGLang ``Engine``.

    Args:
        model_path: local HF model folder.
        aux_layer_ids: three ids in our convention (id ``k`` = HF ``hidden_states[k+1]``);
            ``None`` -> :func:`default_aux_layer_ids`.
        dtype: ``"bfloat16"`` or ``"float32"``: engine dtype = stored dtype.
        device: ``"cpu"`` or ``"cuda"``.
        options: the engine and in-flight knobs (default: :class:`SGLangOptions`'s defaults).
        out_dtype: dtype of the returned aux states, and of the final states unless
            ``final_out_dtype`` (default: ``dtype``), cast in the scheduler on the engine's device;
            ``"float8_e4m3fn"``: quantised there with scales (:attr:`Captured.aux_scale` /
            ``hidden_scale``), half the bytes to the host. Every :class:`Captured` says whether its
            stored values are finite (checked on the device).
        final_out_dtype: dtype of the returned final states (default: ``out_dtype``).

    Raises:
        ValueError: bad dtype/device/aux ids, or engine_kwargs that override owned args.
        RuntimeError: the engine violates an invariant or the warm-up capture fails.
    """

    #: the knobs :func:`~eagle_data.engines.make_backend` takes by name (``backend_kwargs``)
    OPTIONS = SGLangOptions

    def __init__(self, model_path: str | Path, aux_layer_ids: Sequence[int] | None = None,
                 dtype: str = "bfloat16", device: str = "cpu", options: SGLangOptions | None = None,
                 out_dtype: str | None = None, final_out_dtype: str | None = None, *,
                 _allow_radix_cache: bool = False, _engine_aux: bool = False):
        o = options or SGLangOptions()
        hidden_dtype(dtype)  # ValueError naming an unknown dtype
        #: the storage dtype names of the aux and the final rows (checked here; cast in the scheduler)
        self.stored_dtypes = (out_dtype or dtype, final_out_dtype or out_dtype or dtype)
        for name, field in zip(self.stored_dtypes, ("out_dtype", "final_out_dtype")):
            storage_dtype_of(name, field)
        dev = torch.device(device).type
        if dev not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        bad = _OWNED & set(o.engine_kwargs or {})
        if bad:
            raise ValueError(f"engine_kwargs must not set {sorted(bad)}: the backend owns them")
        self.engine = None
        model_path = str(model_path)
        n_layers, hidden, vocab, architectures = model_facts(model_path)
        ids = (validate_aux_layer_ids(aux_layer_ids, n_layers) if aux_layer_ids is not None
               else default_aux_layer_ids(n_layers))
        check_served_aux_ids(ids, architectures)
        self.row_bytes = stored_row_bytes(len(ids), hidden, *(storage_dtype_of(n) for n in self.stored_dtypes))
        self.collect_timeout_s = float(o.collect_timeout_s)
        self.spool = Spool(o.spool_dir)
        free = shutil.disk_usage(self.spool.path).free  # e.g. a container's 64 MB /dev/shm: half of it
        self.max_inflight, self.max_inflight_bytes = int(o.max_inflight), min(int(o.max_inflight_bytes), free // 2)
        self.spool.open_arena(self.max_inflight_bytes * 9 // 8)  # the rows in flight + alignment and wraps
        self._prefix = f"ed{uuid.uuid4().hex[:8]}-"
        self._counter = 0
        self.last_chunks: dict[str, int] = {}  # key -> prefill chunks stitched, last capture()
        # from the engine's answer to the rows joined: seconds summed over requests, spool polls, files read
        self.collect_stats: Counter = Counter(collect_s=0.0, polls=0, files_read=0)
        self._budget = None
        self._orphans: set[str] = set()  # rids of cancelled requests
        self._chunks: dict[str, int] = {}  # rid -> chunks stitched, until its batch is yielded
        try:
            kw = self._engine_kwargs(model_path, dtype, dev, o, ids, _allow_radix_cache, _engine_aux)
            import sglang
            check_version(sglang.__version__)
            t0 = time.perf_counter()
            self.engine = start_engine(kw)
            self.startup_s = time.perf_counter() - t0
            Spool.install_signal_handlers()
            sa = self.engine.server_args
            check_capture_invariants(sa, _allow_radix_cache)
            extra = capture_info_extra(sglang.__version__, sa, dev, o.tp_size, o.cpu_kernel, _engine_aux)
            self.info = BackendInfo("sglang", model_path, hidden, n_layers, vocab, dtype, list(ids),
                                    {**extra, "stored_dtypes": list(self.stored_dtypes)})
            self._warmup(hidden)
        except BaseException:
            self.close()
            raise

    def _engine_kwargs(self, model_path: str, dtype: str, dev: str, o: SGLangOptions, ids: list[int],
                       allow_radix: bool, engine_aux: bool) -> dict[str, Any]:
        """The ``sglang.Engine`` arguments: the base ones, the capture invariants, the hooks writing
        into this backend's spool, then ``o.engine_kwargs``."""
        kw = base_engine_kwargs(model_path, dtype, dev, tp_size=o.tp_size, chunked_prefill_size=o.chunked_prefill_size,
                                mem_fraction_static=o.mem_fraction_static, max_total_tokens=o.max_total_tokens,
                                attention_backend=o.attention_backend, cpu_kernel=o.cpu_kernel, log_level=o.log_level)
        kw.update(disable_radix_cache=not allow_radix, enable_mixed_chunk=False,
                  forward_hooks=hook_specs(str(self.spool.path), self._prefix, None if engine_aux else list(ids),
                                           out_dtype=self.stored_dtypes[0], final_out_dtype=self.stored_dtypes[1]))
        if dev == "cuda":  # prefill only (max_new_tokens=0): capturing decode graphs would only slow the start
            kw["cuda_graph_backend_decode"] = "disabled"
        if engine_aux:  # tests only (sglang >= 0.5.23): the engine's own EAGLE-3 capture, to compare routes
            kw.update(enable_return_aux_hidden_states=True, speculative_algorithm="EAGLE3",
                      return_aux_hidden_state_layer_ids=list(ids))
        kw.update(o.engine_kwargs or {})
        return kw

    def _warmup(self, hidden: int) -> None:
        got = self.capture([("__warmup__", torch.arange(3, dtype=torch.long))])[0]
        k = len(self.info.aux_layer_ids)
        if tuple(got.hidden_states.shape) != (3, hidden) or tuple(got.aux_hidden_states.shape) != (3, k * hidden):
            raise RuntimeError(f"warm-up capture has shapes {tuple(got.aux_hidden_states.shape)}, "
                               f"{tuple(got.hidden_states.shape)}; expected (3, {k * hidden}), (3, {hidden})")

    # ------------------------------------------------------------------ capture

    def capture(self, batch: Sequence[tuple[str, torch.Tensor]]) -> list[Captured]:
        """Capture ``(key, input_ids [T] int64)`` pairs; see :class:`eagle_data.engines.base.Backend`.

        Returns ``Captured`` in input order with ``aux_hidden_states`` [T, 3H] and
        ``hidden_states`` [T, H] in the storage dtypes (``out_dtype`` / ``final_out_dtype``; fp8 with
        scales), on CPU, and ``finite`` set.

        Raises:
            RuntimeError: closed backend; the engine rejected/aborted a request (e.g. longer
                than the context); a refused forward mode; rows missing, duplicated,
                overlapping or belonging to another request (:class:`StitchError`). Messages
                name the key.
            ValueError: ``input_ids`` is not a non-empty 1-D integer tensor.
        """
        return next(self.capture_iter([batch], prefetch=0))

    def capture_iter(self, batches: Iterable[Sequence[tuple[str, torch.Tensor]]],
                     prefetch: int = 1) -> Iterator[list[Captured]]:
        """Like :meth:`capture` over many batches, keeping the engine busy between them.

        At least ``prefetch`` later batches are already submitted while the caller handles the
        current one, and more while the rows of the batches submitted and not yet yielded fit in
        ``max_inflight_bytes`` (the spool and the finished rows held for their batch together): the
        scheduler keeps computing while the caller writes shards and while a batch's last rows are
        read back. Yields one list per batch, in order. Call from one thread.

        Raises: as :meth:`capture`, at the failing batch; batches already submitted are
        drained and their spool files removed before the error propagates (also on an early
        ``close()`` of the iterator). On an interrupt (``KeyboardInterrupt`` and subclasses)
        the requests in flight are cancelled instead (no waiting); late chunk files of
        theirs are removed by the next call or :meth:`close`.
        """
        if self.engine is None:
            raise RuntimeError("SGLangBackend is closed")
        if self._orphans:
            self._drop_files(self._orphans)
        loop, it, pending = self.engine.loop, iter(batches), []
        try:
            more = self._fill(it, pending, prefetch)
            while pending:
                items, task = pending[0]
                if isinstance(task, Exception):
                    pending.pop(0)
                    raise task
                results = loop.run_until_complete(task)
                pending.pop(0)
                self.last_chunks = {key: self._chunks.pop(rid, 0) for key, _, rid in items}
                errors = [r for r in results if isinstance(r, BaseException)]
                if errors:
                    self._drop_files({rid for _, _, rid in items})
                    e = errors[0]
                    if isinstance(e, (RuntimeError, KeyboardInterrupt)):
                        raise e
                    raise RuntimeError(f"capture failed: {e!r}") from e
                more = more and self._fill(it, pending, prefetch)
                yield results
        except (Exception, GeneratorExit):
            if pending:  # error or early stop: let submitted requests finish, then drop their rows
                self._finish_pending(pending, cancel=False)
            raise
        finally:
            if pending:  # interrupt (Ctrl-C / SIGTERM exception): cancel, do not wait
                self._finish_pending(pending, cancel=True)

    def _fill(self, it: Iterator[Sequence[tuple[str, torch.Tensor]]], pending: list, prefetch: int) -> bool:
        """Submit batches until ``prefetch + 1`` are pending and their rows reach ``max_inflight_bytes``
        (a batch past that bound waits for the next call); False once ``it`` is exhausted."""
        def rows_bytes() -> int:
            return sum(int(ids.shape[0]) for items, _ in pending for _, ids, _ in items) * self.row_bytes

        while len(pending) < prefetch + 1 or rows_bytes() < self.max_inflight_bytes:
            if not self._submit(it, pending):
                return False
        return True

    def _submit(self, it: Iterator[Sequence[tuple[str, torch.Tensor]]], pending: list) -> bool:
        """Submit ``it``'s next batch to the engine, appended to ``pending`` as ``(items, task)`` (a
        bad sample: ``([], its ValueError)``, raised at its turn); False when ``it`` is exhausted."""
        batch = next(it, None)
        if batch is None:
            return False
        items = []
        for key, ids in batch:
            if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point:  # raised at its turn
                pending.append(([], ValueError(f"sample {key!r}: input_ids must be a non-empty 1-D "
                                               f"integer tensor, got {tuple(ids.shape)} {ids.dtype}")))
                return True
            self._counter += 1
            items.append((key, ids.to(torch.int64).cpu(), f"{self._prefix}{self._counter}"))
        pending.append((items, self.engine.loop.create_task(self._run(items))))
        return True

    def _finish_pending(self, pending: list, cancel: bool) -> None:
        tasks = [t for _, t in pending if isinstance(t, asyncio.Future)]
        rids = {rid for items, _ in pending for _, _, rid in items}
        pending.clear()
        if self.engine is None:  # closed first (an interrupt): nothing left to wait for or cancel
            return
        if cancel:
            for t in tasks:
                t.cancel()
            self._orphans |= rids  # chunks the scheduler may still write; removed later / at close()
        if tasks:
            self.engine.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self._drop_files(rids)

    def _drop_files(self, rids: set[str]) -> None:
        self.spool.remove(p for rid, fs in list_spool(self.spool.path).items() if rid in rids for _, p in fs)

    async def _run(self, items):
        if self._budget is None:  # shared by all batches in flight: bounds the spool
            self._budget = (asyncio.Condition(), [0, 0])  # (cond, [requests, tokens] in flight)
        cond, busy = self._budget

        def fits(n: int) -> bool:
            return busy[0] == 0 or (busy[0] < self.max_inflight
                                    and (busy[1] + n) * self.row_bytes <= self.max_inflight_bytes)

        async def one(key, ids, rid):
            n = int(ids.shape[0])
            try:
                try:
                    out = await self.engine.async_generate(input_ids=ids.tolist(), rid=rid,
                                                           sampling_params={"max_new_tokens": 0})
                except Exception as e:
                    raise RuntimeError(f"sample {key!r} ({n} tokens): SGLang rejected the request: {e}") from e
                return await self._collect(key, ids, rid, out)
            finally:
                async with cond:
                    busy[0] -= 1
                    busy[1] -= n
                    cond.notify_all()

        tasks = []
        try:
            for key, ids, rid in items:  # admit in order, within the budget
                async with cond:
                    await cond.wait_for(lambda: fits(int(ids.shape[0])))
                    busy[0] += 1
                    busy[1] += int(ids.shape[0])
                tasks.append(asyncio.ensure_future(one(key, ids, rid)))
            return await asyncio.gather(*tasks, return_exceptions=True)
        except asyncio.CancelledError:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _collect(self, key: str, ids: torch.Tensor, rid: str, out: dict) -> Captured:
        meta = (out or {}).get("meta_info", {})
        fin = meta.get("finish_reason") or {}
        t = int(ids.shape[0])
        if isinstance(fin, dict) and fin.get("type") == "abort":
            raise RuntimeError(f"sample {key!r}: SGLang aborted the request: {fin.get('message', fin)}")
        if meta.get("prompt_tokens", t) != t or meta.get("cached_tokens", 0):
            raise StitchError(f"sample {key!r}: engine reports prompt_tokens={meta.get('prompt_tokens')}, "
                              f"cached_tokens={meta.get('cached_tokens')} for {t} tokens")
        deadline, seen = time.monotonic() + self.collect_timeout_s, None
        pieces: dict[Path, Piece] = {}  # each file read once, however often the rows are found incomplete

        def read_and_stitch(files: list[Path]) -> dict[str, torch.Tensor]:  # (in a worker thread)
            pieces.update((p, self.spool.read(p)) for p in files if p not in pieces)
            return stitch(key, ids, [pieces[p] for p in files])

        t0 = time.perf_counter()
        while True:
            self.collect_stats["polls"] += 1
            files = self.spool.files(rid)
            try:
                errs = [p for p in files if "@ERROR@" in p.name]
                if errs:
                    raise RuntimeError(f"sample {key!r}: capture hook refused a forward pass: {read_error(errs[0])}")
                # read and joined in a thread: the engine's event loop keeps sending and receiving meanwhile
                got = await asyncio.to_thread(read_and_stitch, files)
                self.spool.remove(files)
                self._chunks[rid] = len(files)
                self.collect_stats.update(collect_s=time.perf_counter() - t0, files_read=len(pieces))  # (loop thread)
                return Captured(key, got["aux"], got["final"], got.get("aux_scale"), got.get("final_scale"),
                                bool(got["ok"].all()) if "ok" in got else None)
            except RowsMissing as e:  # pieces may still be arriving
                changed = os.stat(self.spool.path).st_mtime_ns  # a file added, renamed or removed
                if changed != seen:
                    deadline, seen = time.monotonic() + self.collect_timeout_s, changed
                elif time.monotonic() > deadline:
                    self.spool.remove(files)
                    free = shutil.disk_usage(self.spool.path).free
                    raise RowsMissing(f"{e} (waited {self.collect_timeout_s:g} s with no change in the spool "
                                      f"{self.spool.path}, {free} bytes free there; where the hook could not write "
                                      "the rows, the engine's log says why)") from None
            except StitchError:
                self.spool.remove(files)
                raise
            await asyncio.sleep(0.01)

    def hook_stats(self) -> dict[str, float]:
        """The capture hook's timings so far (seconds per step, passes, bytes; see
        :class:`~eagle_data.engines.sglang_hook._Writer`), as it last wrote them to the spool."""
        return read_hook_stats(self.spool.path)

    def close(self) -> None:
        """Shut the engine down and delete the spool (idempotent).

        ``Engine.shutdown()`` kills *every* child process of this process
        (``kill_process_tree(os.getpid())``): other engines' schedulers, data-loader workers.
        For the duration of the call that kill is narrowed to this engine's own children
        (``Engine.get_all_child_pids()``), and the engine's atexit shutdown is unregistered.
        """
        engine, self.engine = self.engine, None
        try:
            if engine is not None:
                scoped_shutdown(engine)
        finally:
            self.spool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
