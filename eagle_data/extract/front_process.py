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
error in the child is raised in the parent (the child's traceback as a note).

The child is a fresh interpreter (``python -c``, importing only this package: unlike
``multiprocessing``'s spawn, the caller's main script is never run again) talking over two pipes:
it ends when the parent closes them or dies (end of file / broken pipe; a watcher thread ends a busy
child whose parent is gone); it runs in a session of its own and ignores SIGINT/SIGTERM (the parent
handles them). A child that cannot start makes
:meth:`FrontProcess.ready` false and the caller runs the front in a thread instead (logged).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch

from eagle_data.background import background
from eagle_data.extract.chat import ChatRenderer, TokenizedSample
from eagle_data.extract.fault import ErrorPolicy, Skip

if TYPE_CHECKING:
    from eagle_data.extract.sources import RowSource
    from eagle_data.extract.stages import Batching

log = logging.getLogger(__name__)

#: seconds :meth:`FrontProcess.ready` waits for the child to start (imports, tokenizer)
START_TIMEOUT_S = 300.0
_POLL_S = 0.1
#: the child's program: the parent's import path, then :func:`child_main`
_ENTRY = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
          "from eagle_data.extract.front_process import child_main; child_main(*map(int, sys.argv[2:]))")


class FrontProcess:
    """The front of one rank in a child process, started at once (its start-up overlaps the
    model's loading); :meth:`batches` hands out what it builds. Always :meth:`close` it.

    Args:
        rows: the source rows of this rank (the child reads those not extracted yet).
        batching: how the child cuts and batches the samples.
        on_bad_sample: "skip" or "raise" (the run's setting).
        renderer: the chat renderer (pickled to the child with its tokenizer).
        tag: the dataset tag of the sample keys.
        ahead: batches the child builds ahead of the consumer.

    Raises:
        pickle.PicklingError, TypeError, AttributeError: the renderer does not pickle.
        OSError: no process could be started.
    """

    def __init__(self, rows: RowSource, batching: Batching, on_bad_sample: str, renderer: ChatRenderer, tag: str,
                 ahead: int):
        setup = pickle.dumps((rows, batching, on_bad_sample, renderer, tag))
        self._ready: bool | None = None
        self._closed = False
        c_read, p_write = os.pipe()  # parent -> child: setup, go, (closing = stop)
        p_read, c_write = os.pipe()  # child -> parent: ready, batches, end or failure
        # its import path is this process's (absolute): no PYTHONPATH, nothing from the working directory
        # (-P) before it is set; a session of its own: Ctrl-C goes to the parent only
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        try:
            self.proc = subprocess.Popen([sys.executable, "-P", "-c", _ENTRY, json.dumps(_import_path()), str(c_read),
                                          str(c_write), str(ahead), str(os.getpid())], pass_fds=(c_read, c_write),
                                         start_new_session=True, env=env)
        except BaseException:
            os.close(p_write)
            os.close(p_read)
            raise
        finally:
            os.close(c_read)
            os.close(c_write)
        self._ctrl, self._out = Connection(p_write, readable=False), Connection(p_read, writable=False)
        # sent beside the model's loading; a child that dies before reading it breaks the pipe
        self._setup = threading.Thread(target=self._send, args=(setup,), name="eagle-front-setup", daemon=True)
        self._setup.start()

    def _send(self, data: bytes) -> None:
        try:
            self._ctrl.send_bytes(data)
        except (OSError, ValueError):  # the child is gone (ready() says so) or close() came first
            pass

    def ready(self, timeout: float = START_TIMEOUT_S) -> bool:
        """Whether the child started (waits for it); False: it exited or hung while starting."""
        if self._ready is None:
            msg = self._get(timeout, starting=True)
            self._ready = msg is not None and msg[1] == "ready"
            if not self._ready:
                code = self.proc.poll()
                log.warning("the extraction front process did not start (%s; its error, if any, is on stderr above); "
                            "the front runs in a thread", f"exit code {code}" if code is not None else "no answer")
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
        self._setup.join()  # the child has read the setup; one writer on the pipe at a time
        self._ctrl.send((done, vocab_size))
        while True:
            events, payload = self._get(None)
            for kind, arg, fp in events:
                if kind == "fp":
                    fingerprint(arg, fp)
                elif kind == "note":
                    policy.note(arg)
                else:
                    policy.handle(arg)
            if isinstance(payload, str) and payload == "end":
                return
            if isinstance(payload, _Failure):
                raise payload.error()
            yield _unpack(payload)

    def _get(self, timeout: float | None, starting: bool = False):
        """The child's next message; None when ``starting`` and it exited or ``timeout`` passed."""
        t_end = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if self._out.poll(_POLL_S):
                    return self._out.recv()  # from our own child, never from a file
            except (EOFError, OSError):  # it exited (or was killed mid-message)
                code = self._exit_code()
                if starting:
                    return None
                raise RuntimeError(f"the extraction front process died (exit code {code})") from None
            if t_end is not None and time.monotonic() > t_end:
                return None

    def _exit_code(self) -> int | None:
        try:
            return self.proc.wait(5.0)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """Stop the child (idempotent): closing the pipes ends it; killed if it lingers."""
        if self._closed:
            return
        self._closed = True
        for c in (self._ctrl, self._out):
            c.close()
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _import_path() -> list[str]:
    """The child's ``sys.path``: where this process's ``eagle_data`` came from, then this process's
    path with ``''`` and relative entries made absolute (they name the working directory of now)."""
    import eagle_data

    return [str(Path(eagle_data.__file__).resolve().parents[1]), *(os.path.abspath(p or os.curdir) for p in sys.path)]


def _watch_parent(parent: int) -> None:
    """End this child when its parent is gone (re-parented), even while it is busy (a slow template,
    a huge row) and touches no pipe."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="eagle-front-watch").start()


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

    def __init__(self, events: deque):
        self.events = events

    def add(self, skip: Skip, note: bool = False) -> None:
        self.events.append(("note" if note else "skip", skip, None))


def child_main(ctrl_fd: int, out_fd: int, ahead: int, parent: int) -> None:
    """The child's entry point (see the module docstring): set up, say ready, wait for the rows to
    skip, build and send the batches; an error is sent to the parent. Ends quietly when the parent
    closes the pipes or dies."""
    from eagle_data.extract.rank_state import fresh_rows
    from eagle_data.extract.stages import front

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    _watch_parent(parent)
    ctrl, out = Connection(ctrl_fd, writable=False), Connection(out_fd, readable=False)
    try:
        source, batching, on_bad_sample, renderer, tag = pickle.loads(ctrl.recv_bytes())
    except (EOFError, OSError):  # the parent went away first (possibly mid-message)
        return
    events: deque = deque()  # appended by the front's thread, drained by this one (both atomic)

    def send(payload) -> None:
        try:
            out.send(([events.popleft() for _ in range(len(events))], payload))
        except OSError as e:  # broken pipe
            raise _ParentGone from e

    def receive():
        try:
            return ctrl.recv()
        except (EOFError, OSError) as e:
            raise _ParentGone from e

    def rows():
        for r, rec, key, fp in fresh_rows(source, tag, done):
            events.append(("fp", key, fp))
            yield r, rec

    try:
        send("ready")
        done, vocab_size = receive()
        policy = ErrorPolicy(on_bad_sample, counter=_Relay(events))  # type: ignore[arg-type]
        # built up to `ahead` batches ahead in a thread while this one waits for the parent to read;
        # a row's fingerprint and skips go out with the batch after them, or an earlier one
        for b in background(front(rows(), renderer, tag, vocab_size, batching, policy), ahead):
            send(_pack(b))
        send("end")
    except _ParentGone:  # the parent closed the pipes or died
        return
    except BaseException as e:  # noqa: BLE001 - raised in the parent
        try:
            send(_Failure(e))
        except _ParentGone:
            return


class _ParentGone(Exception):
    """The parent closed the pipes or died (never an error of the front itself, e.g. a truncated
    source raising EOFError, which goes to the parent)."""
