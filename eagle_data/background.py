"""``background``: run an iterator ``depth`` items ahead in a daemon thread (a bounded queue).

Shared by the extraction (the read -> chat -> tokens -> batches front runs beside the capture and
the writers) and the training loader (``num_workers=0`` prefetch), which must not import each other.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Iterator

_END = object()


def timed(it: Iterable[Any], seconds: dict[str, float], name: str) -> Iterator[Any]:
    """Yield ``it``'s items, adding the time spent waiting for each (and for its end) to
    ``seconds[name]``: where a pipeline's consumer waits says which stage bounds it."""
    it = iter(it)
    while True:
        t0 = time.perf_counter()
        try:
            x = next(it)
        except StopIteration:
            return
        finally:
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
        yield x


def background(it: Iterator[Any], depth: int) -> Iterator[Any]:
    """Run ``it`` in a daemon thread, ``depth`` items ahead of the consumer (a bounded queue).

    The producer's exception is re-raised in the consumer; closing the consumer (``break``,
    garbage collection) stops the producer after its current item and waits for it; an
    exception in the consumer (e.g. ``KeyboardInterrupt``) does not wait for it.
    """
    import queue
    import threading

    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            while not stop.is_set():
                x = next(it, _END)
                if not put((x, None)) or x is _END:
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            put((_END, e))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    th = threading.Thread(target=produce, name="eagle-prefetch", daemon=True)
    th.start()
    failed = True
    try:
        while True:
            x, err = q.get()
            if x is _END:
                if err is not None:
                    try:
                        raise err
                    finally:  # no frame -> exception -> traceback -> frame cycle keeping shards open
                        err = None
                failed = False
                return
            yield x
    except GeneratorExit:  # closed by the caller: stopping normally
        failed = False
        raise
    finally:  # unblock the producer; it stops after the item it is building
        stop.set()
        _release(q, th, wait=not failed)


def _release(q, th, wait: bool) -> None:
    """Empty the queue ``q`` of a stopped producer thread ``th`` until it ends (``wait``), or once
    (the consumer is unwinding an error: no waiting)."""
    import queue

    while wait and th.is_alive():
        try:
            q.get_nowait()
        except queue.Empty:
            th.join(0.005)
    if not wait:
        while not q.empty():
            q.get_nowait()
