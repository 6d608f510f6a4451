"""Signals during extraction: SIGTERM/SIGINT never interrupt a shard being written.

:class:`Signals` remembers a signal; it raises :class:`ExtractionInterrupted` at once only
inside :meth:`Signals.interruptible` blocks (data loading, the forward pass), elsewhere at the
next :meth:`Signals.check` (after the sample being written).
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterable, Iterator


class ExtractionInterrupted(KeyboardInterrupt):
    """SIGTERM/SIGINT stopped :func:`run_extract`; the shard in progress was discarded and
    rerunning the same command resumes. ``signum`` is the signal."""

    def __init__(self, signum: int):
        super().__init__(f"extraction interrupted by signal {signum}")
        self.signum = signum


class Signals:
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
        self.restore()

    def restore(self) -> None:
        """Put the previous handlers back (idempotent)."""
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
        """After cleanup: a SIGTERM nobody handled before terminates the process as usual
        (the previous handlers are restored first)."""
        self.restore()
        if self.old.get(sig) is signal.SIG_DFL:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)


def interruptible_iter(it: Iterable, sigs: Signals) -> Iterator:
    it = iter(it)
    while True:
        with sigs.interruptible():
            try:
                x = next(it)
            except StopIteration:
                return
        yield x
