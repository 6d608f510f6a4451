"""Background shard writing: a queue bounded in bytes in front of one or more :class:`ShardSink`.

The capture loop hands samples over and goes on with the next forward; writer threads
encode (safetensors), hash and write. The bound is in bytes of captured states, not in samples:
a forward batch of a small target holds dozens of samples, and a queue shorter than a batch makes
the capture loop wait for the writers before it can start the next forward, so GPU and disk take
turns instead of working at once (measured: ``python -m benchmarks stages``, BENCHMARKS.md). The
bound keeps host memory flat however long the run; a sample larger than the bound goes through
alone. An exception in a writer is re-raised in the producer at the next ``put``/``close``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

from eagle_data.extract.sink import ShardSink

_STOP = object()


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors.values())


class AsyncShardWriter:
    """``put(key, tensors, meta)`` from the capture loop; ``close()`` drains and publishes.

    Args:
        sinks: one :class:`ShardSink` per writer thread (each its own shard series).
        max_bytes: bytes of queued tensors at most; ``put`` waits beyond that (back-pressure on
            the producer), except into an empty queue.
    """

    def __init__(self, sinks: list[ShardSink], max_bytes: int = 2 << 30):
        self.sinks = sinks
        self.max_bytes = max_bytes
        self.q: deque = deque()
        self.queued = 0  # bytes in self.q
        self.cv = threading.Condition()
        self.error: BaseException | None = None
        self.wait_s = 0.0  # seconds put() waited for room (the writers bound the producer)
        self.threads = [threading.Thread(target=self._run, args=(s,), daemon=True, name=f"shard-writer-{i}")
                        for i, s in enumerate(sinks)]
        for t in self.threads:
            t.start()

    def _get(self):
        with self.cv:
            while not self.q:
                self.cv.wait()
            item, n = self.q.popleft()
            self.queued -= n
            self.cv.notify_all()
            return item

    def _run(self, sink: ShardSink) -> None:
        while True:
            item = self._get()
            if self.error is not None:
                if item is _STOP:
                    return
                continue  # drain without writing after a failure
            try:
                if item is _STOP:  # publish this writer's last shard, beside the other writers' (fsyncs at once)
                    sink.close()
                    return
                sink.write(*item)
            except BaseException as e:  # re-raised in the producer
                with self.cv:
                    self.error = self.error or e
                    self.cv.notify_all()
                if item is _STOP:
                    return

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _put(self, item: Any, n: int) -> None:
        with self.cv:
            t0 = time.perf_counter()
            while self.q and self.queued + n > self.max_bytes and self.error is None:
                self.cv.wait()
            if item is not _STOP:  # the producer's own waits; close() is timed by its caller
                self.wait_s += time.perf_counter() - t0
            self.q.append((item, n))
            self.queued += n
            self.cv.notify_all()

    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self._check()
        self._put((key, tensors, meta), _nbytes(tensors))
        self._check()

    def _stop_threads(self) -> None:
        for _ in self.threads:
            self._put(_STOP, 0)
        for t in self.threads:
            t.join()

    def close(self) -> None:
        """Wait for all queued samples, publish the last shards (each writer its own, at once).
        Raises a writer's error."""
        self._stop_threads()
        self._check()

    def abort(self) -> None:
        """Drop queued samples and the shards in progress (redone on resume)."""
        self.error = self.error or RuntimeError("aborted")
        with self.cv:
            self.cv.notify_all()
        self._stop_threads()
        for s in self.sinks:
            s.abort()

    def __enter__(self) -> "AsyncShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """``close()`` after the block, ``abort()`` when it raised (Ctrl-C included): the writer
        threads never outlive it."""
        if exc_type is None:
            self.close()
        else:
            self.abort()

    @property
    def bytes_written(self) -> int:
        return sum(s.bytes_written + s.pending_bytes for s in self.sinks)
