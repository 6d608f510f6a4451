"""What happens to a bad source row: a :class:`Skip` with a stable reason, counted per reason
and logged by :class:`DropCounter`, persisted through the :class:`ErrorPolicy` listener (the
rank's skip log and progress file), or raised (:class:`RowError`) with ``on_bad_sample: raise``.
A *note* is a row kept but changed (e.g. cut before a blank reply): counted and logged alike."""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger(__name__)


@dataclass
class Skip:
    """A record that was not used: ``reason`` is a short stable name, ``detail`` says where."""
    row: int
    source_id: str
    reason: str
    detail: str = ""


class BadRecord(ValueError):
    """A record field that cannot be used; ``reason`` is the skip reason."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.reason, str(self)), self.__dict__


class RowError(ValueError):
    """A bad source row under ``on_bad_sample: raise``; ``skip`` says which row and why."""

    def __init__(self, skip: Skip):
        super().__init__(f"row {skip.row} (id {skip.source_id}): {skip.reason}: {skip.detail}")
        self.skip = skip

    def __reduce__(self):  # pickled from the front process to the parent
        return type(self), (self.skip,), self.__dict__


#: rows whose notes :class:`DropCounter` remembers (far more than the samples in flight)
NOTED_WINDOW = 1 << 16


class DropCounter:
    """Counts skipped samples (and notes) per reason and logs each one (first ``log_first`` in full).
    ``notes`` counts the notes of rows that were not skipped afterwards (a skipped row is not in
    the dataset, so its notes are not counted: the manifest's ``note_counts`` agree).
    ``kept_in`` says where the run writes every skip with its detail (named when the log goes quiet)."""

    def __init__(self, log_first: int = 20,
                 kept_in: str = "an extraction writes every one, with its detail, to skips-RANK.jsonl in its output "
                                "directory"):
        self.counts: Counter[str] = Counter()
        self.notes: Counter[str] = Counter()
        self.log_first, self.kept_in = log_first, kept_in
        # row -> its notes, for the rows still in flight (a skip follows its notes within the
        # pipeline's few batches; the oldest entries go beyond NOTED_WINDOW rows)
        self._noted: OrderedDict[int, list[str]] = OrderedDict()
        self._logged = 0  # messages so far (the counts above can go down: a noted row skipped later)

    def add(self, skip: Skip, note: bool = False) -> None:
        if note:
            self.notes[skip.reason] += 1
            self._noted.setdefault(skip.row, []).append(skip.reason)
            if len(self._noted) > NOTED_WINDOW:
                self._noted.popitem(last=False)
        else:
            self.counts[skip.reason] += 1
            for reason in self._noted.pop(skip.row, []):
                self.notes[reason] -= 1
                if not self.notes[reason]:
                    del self.notes[reason]
        self._logged += 1
        msg = "%s row %d (id %s): %s%s" % ("note" if note else "skip", skip.row, skip.source_id, skip.reason,
                                            f": {skip.detail[:300]}" if skip.detail else "")
        if self._logged <= self.log_first:
            log.warning(msg)
        else:
            if self._logged == self.log_first + 1:
                log.warning("more skipped/noted rows are logged at debug level (%s)", self.kept_in)
            log.debug(msg)

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))


@dataclass
class ErrorPolicy:
    """What to do with a bad record: ``"skip"`` (count + log, default for data) or ``"raise"``."""
    mode: str = "skip"
    counter: DropCounter = field(default_factory=DropCounter)
    #: called with ``(skip, is_note)`` for every counted skip and note (e.g. to persist them)
    listener: Callable[[Skip, bool], None] | None = None

    def __post_init__(self):
        if self.mode not in ("skip", "raise"):
            raise ValueError(f"error policy must be 'skip' or 'raise', got {self.mode!r}")
        self._lock = threading.Lock()  # the extraction's front thread and its capture loop both report

    def handle(self, skip: Skip) -> None:
        """Skip the record (counted, logged, passed to ``listener``) or, in ``"raise"`` mode, raise.

        Raises:
            RowError: in ``"raise"`` mode.
        """
        if self.mode == "raise":
            raise RowError(skip)
        with self._lock:
            self.counter.add(skip)
            if self.listener is not None:
                self.listener(skip, False)

    def note(self, skip: Skip) -> None:
        """A kept record that was changed (counted and logged; never raises)."""
        with self._lock:
            self.counter.add(skip, note=True)
            if self.listener is not None:
                self.listener(skip, True)
