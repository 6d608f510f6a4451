"""The extraction front (:func:`~eagle_data.extract.stages.front`: rows -> chat template -> tokens +
loss mask -> batches) in a child process, beside the capture loop without sharing its GIL.

Why a process: the HF forward of a small target is thousands of short torch calls, each of which
releases and retakes the GIL, and a front *thread* running Python beside it (the chat template, the
masks) makes the capture loop wait for the GIL at every call. Measured on the H200 with SmolLM2
(BENCHMARKS.md, issue 16): the capture stage took 6.9 s with the front in a thread and 4.8 s with the
front's work done beforehand, for the same 2 M tokens, the GPU never idle between forwards.

Protocol: the child reads the rank's rows not extracted yet itself
(:func:`~eagle_data.extract.rank_state.fresh_rows`) and sends, in order, what the parent must
know: each row's fingerprint, each skip and note (counted, logged and recorded by the parent's
:class:`~eagle_data.extract.fault.ErrorPolicy`, exactly as with the thread) and the batches. An
error in the child is raised in the parent (the child's traceback as a note). The child ignores
SIGINT/SIGTERM (the parent handles them and stops it) and exits when the parent goes away.

The child is started with ``spawn`` (CUDA is initialised in the parent): like a
``DataLoader`` worker, it imports the parent's main script, which must keep its work under
``if __name__ == "__main__":``. A child that cannot start makes :meth:`FrontProcess.ready`
false and the caller runs the front in a thread instead (logged).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
import traceback
from typing import Any, Callable, Iterator

import numpy as np
import torch

from eagle_data.extract.chat import ChatRenderer, TokenizedSample
from eagle_data.extract.config import ExtractConfig
from eagle_data.extract.fault import ErrorPolicy, Skip

log = logging.getLogger(__name__)

#: seconds :meth:`FrontProcess.ready` waits for the child to start (imports, tokenizer)
START_TIMEOUT_S = 300.0
_POLL_S = 0.1


class FrontProcess:
    """The front of one rank in a child process, started at once (its start-up overlaps the
    model's loading); :meth:`batches` hands out what it builds. Always :meth:`close` it.

    Args:
        cfg: the run's settings (rows, batching, ``on_bad_sample``).
        renderer: the chat renderer (pickled to the child with its tokenizer).
        tag: the dataset tag of the sample keys.
        ahead: batches the child builds ahead of the consumer.
    """

    def __init__(self, cfg: ExtractConfig, renderer: ChatRenderer, tag: str, ahead: int):
        ctx = mp.get_context("spawn")
        self._out: Any = ctx.Queue(maxsize=ahead)
        self._ctrl: Any = ctx.Queue()
        self._stop = ctx.Event()
        self._ready: bool | None = None
        self._closed = False
        self.proc = ctx.Process(target=_child, args=(cfg, renderer, tag, self._ctrl, self._out, self._stop),
                                name="eagle-front", daemon=True)
        try:
            self.proc.start()
        except BaseException:  # e.g. a renderer that does not pickle
            for q in (self._ctrl, self._out):
                q.close()
            raise

    def ready(self, timeout: float = START_TIMEOUT_S) -> bool:
        """Whether the child started (waits for it); False: it exited or hung while starting."""
        if self._ready is None:
            msg = self._get(timeout, starting=True)
            self._ready = msg is not None and msg[1] == "ready"
            if not self._ready:
                log.warning("the extraction front process did not start (exit code %s; a script calling "
                            "run_extract must keep its work under `if __name__ == \"__main__\":`); the front "
                            "runs in a thread instead", self.proc.exitcode)
                self.close()
        return self._ready

    def batches(self, done: set[str], vocab_size: int, fingerprint: Callable[[str, int], None],
                policy: ErrorPolicy) -> Iterator[list[TokenizedSample]]:
        """The batches of the rows whose key is not in ``done``, in the thread front's order;
        ``fingerprint(key, fp)`` is called for each row read, ``policy`` for each skip and note,
        in the order the child met them. Needs :meth:`ready`.

        Raises:
            the child's error (e.g. :class:`~eagle_data.extract.fault.RowError` under
            ``on_bad_sample: raise``, an unreadable source); RuntimeError if it died.
        """
        assert self._ready, "FrontProcess.batches before ready()"
        self._ctrl.put((done, vocab_size))
        while True:
            events, payload = self._get(None)
            for kind, arg, fp in events:
                if kind == "fp":
                    fingerprint(arg, fp)
                elif kind == "note":
                    policy.note(arg)
                else:
                    policy.handle(arg)
            if payload == "end":
                return
            if isinstance(payload, _Failure):
                raise payload.error()
            yield _unpack(payload)

    def _get(self, timeout: float | None, starting: bool = False):
        """The child's next message; None when ``starting`` and it exited or ``timeout`` passed."""
        t_end = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._out.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            if not self.proc.is_alive():
                try:  # what it sent before exiting
                    return self._out.get(timeout=1.0)
                except queue.Empty:
                    if starting:
                        return None
                    raise RuntimeError(f"the extraction front process died (exit code {self.proc.exitcode})") from None
            if t_end is not None and time.monotonic() > t_end:
                return None

    def close(self) -> None:
        """Stop the child (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._ready is False or self.proc.exitcode is None:
            self._ctrl.put(None)  # a child still waiting for its rows stops
        self.proc.join(2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        for q in (self._ctrl, self._out):
            q.cancel_join_thread()
            q.close()


class _Failure:
    """An exception raised in the child, pickled (or described when it cannot be)."""

    def __init__(self, e: BaseException):
        e.add_note("raised in the extraction front process:\n" + "".join(traceback.format_exception(e)).rstrip())
        try:
            self.data = pickle.dumps(e)
            pickle.loads(self.data)
        except Exception:  # noqa: BLE001 - an exception type that does not round-trip
            self.data = pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}\n{e.__notes__[-1]}"))

    def error(self) -> BaseException:
        return pickle.loads(self.data)  # from our own child process, never from a file


def _pack(batch: list[TokenizedSample]) -> tuple[list[tuple[Any, ...]], list[int], np.ndarray, np.ndarray]:
    """A batch as (sample facts, lengths, concatenated ids [sum T] int64, masks [sum T] uint8)."""
    meta = [(s.key, s.row, s.source_id, s.num_turns, s.truncated) for s in batch]
    return (meta, [s.num_tokens for s in batch], torch.cat([s.input_ids for s in batch]).numpy(),
            torch.cat([s.loss_mask for s in batch]).numpy())


def _unpack(payload) -> list[TokenizedSample]:
    meta, lens, ids, mask = payload
    ids, mask = torch.from_numpy(ids).split(lens), torch.from_numpy(mask).split(lens)
    return [TokenizedSample(key, row, sid, turns, i, m, trunc)
            for (key, row, sid, turns, trunc), i, m in zip(meta, ids, mask)]


class _Relay:
    """The child's skip counter: hands every skip and note to the parent (which counts and logs)."""

    def __init__(self, events: list):
        self.events = events

    def add(self, skip: Skip, note: bool = False) -> None:
        self.events.append(("note" if note else "skip", skip, None))


def _child(cfg: ExtractConfig, renderer: ChatRenderer, tag: str, ctrl, out, stop) -> None:
    from eagle_data.extract.rank_state import fresh_rows
    from eagle_data.extract.stages import front

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    parent = os.getppid()
    events: list = []

    def gone() -> bool:
        return stop.is_set() or os.getppid() != parent

    def send(payload) -> bool:
        msg, events[:] = (list(events), payload), []
        while not gone():
            try:
                out.put(msg, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        out.cancel_join_thread()  # exiting never waits for a parent that stopped reading
        return False

    def rows():
        for r, rec, key, fp in fresh_rows(cfg, tag, done):
            events.append(("fp", key, fp))
            yield r, rec

    try:
        send("ready")
        while (go := _poll(ctrl, gone)) is False:
            continue
        if go is None:
            return
        done, vocab_size = go
        policy = ErrorPolicy(cfg.on_bad_sample, counter=_Relay(events))  # type: ignore[arg-type]
        for b in front(rows(), renderer, tag, vocab_size, cfg.max_length, cfg.batch_tokens, cfg.max_batch_size,
                       cfg.sort_window, policy):
            if not send(_pack(b)):
                return
        send("end")
    except BaseException as e:  # noqa: BLE001 - raised in the parent
        send(_Failure(e))
    out.close()
    out.join_thread()  # what was sent reaches the pipe before the process exits (the parent kills a hung one)


def _poll(ctrl, gone: Callable[[], bool]):
    """The parent's go message, None (stop), or False (nothing yet, keep waiting)."""
    if gone():
        return None
    try:
        return ctrl.get(timeout=_POLL_S)
    except queue.Empty:
        return False
