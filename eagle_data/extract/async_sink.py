"""Background shard writing: a bounded queue in front of one or more :class:`ShardSink`.

The capture loop hands samples over and goes on with the next forward; writer threads
encode (safetensors), hash and write. The queue bound keeps host memory flat however long
the run. An exception in a writer is re-raised in the producer at the next ``put``/``close``.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from eagle_data.extract.sink import ShardSink

_STOP = object()


class AsyncShardWriter:
    """``put(key, tensors, meta)`` from the capture loop; ``close()`` drains and publishes.

    Args:
        sinks: one :class:`ShardSink` per writer thread (each its own shard series).
        max_queue: samples waiting at most (back-pressure on the producer beyond that).
    """

    def __init__(self, sinks: list[ShardSink], max_queue: int = 64):
        self.sinks = sinks
        self.q: queue.Queue = queue.Queue(maxsize=max_queue)
        self.error: BaseException | None = None
        self.threads = [threading.Thread(target=self._run, args=(s,), daemon=True, name=f"shard-writer-{i}")
                        for i, s in enumerate(sinks)]
        for t in self.threads:
            t.start()

    def _run(self, sink: ShardSink) -> None:
        while True:
            item = self.q.get()
            if item is _STOP:
                return
            if self.error is not None:
                continue  # drain without writing after a failure
            try:
                sink.write(*item)
            except BaseException as e:  # re-raised in the producer
                self.error = e

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self._check()
        self.q.put((key, tensors, meta))

    def close(self) -> None:
        """Wait for all queued samples, publish the last shards. Raises a writer's error."""
        for _ in self.threads:
            self.q.put(_STOP)
        for t in self.threads:
            t.join()
        self._check()
        for s in self.sinks:
            s.close()

    def abort(self) -> None:
        """Drop queued samples and the shards in progress (redone on resume)."""
        self.error = self.error or RuntimeError("aborted")
        for _ in self.threads:
            self.q.put(_STOP)
        for t in self.threads:
            t.join()
        for s in self.sinks:
            s.abort()

    @property
    def bytes_written(self) -> int:
        return sum(s.bytes_written + s.pending_bytes for s in self.sinks)
