"""The writers' queue (:class:`AsyncShardWriter`) is bounded in bytes: never more queued than the
bound (a larger sample alone), every sample written exactly once, a writer's error reaches the
producer without a hang."""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext

import pytest
import torch
from hypothesis import given, settings, strategies as st

from eagle_data.extract.async_sink import AsyncShardWriter


class SlowSink:
    def __init__(self, writer_ref, fail_at=None):
        self.got, self.ref, self.fail_at = [], writer_ref, fail_at

    def write(self, key, tensors, meta):
        w = self.ref[0]
        with w.cv:  # what is queued while this sample is being written
            self.ref[1].append((w.queued, len(w.q)))
        if self.fail_at is not None and key == self.fail_at:
            raise OSError(28, "No space left on device")
        time.sleep(0.0005)
        self.got.append(key)

    def close(self):
        pass

    def abort(self):
        pass


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=40), bound=st.integers(1, 8000),
       writers=st.integers(1, 3))
def test_queue_bounded_in_bytes_and_every_sample_written_once(sizes, bound, writers):
    ref: list = [None, []]
    sinks = [SlowSink(ref) for _ in range(writers)]
    w = AsyncShardWriter(sinks, max_bytes=bound)
    ref[0] = w
    for i, n in enumerate(sizes):
        w.put(f"k{i}", {"x": torch.zeros(n, dtype=torch.uint8)}, {})
        with w.cv:
            assert w.queued <= bound or len(w.q) == 1  # over the bound only a single sample, alone
    w.close()
    assert sorted(k for s in sinks for k in s.got) == sorted(f"k{i}" for i in range(len(sizes)))
    assert all(q <= bound or n <= 1 for q, n in ref[1])


def test_a_writer_error_reaches_the_producer_without_a_hang():
    ref: list = [None, []]
    sinks = [SlowSink(ref, fail_at="k3"), SlowSink(ref, fail_at="k3")]
    w = AsyncShardWriter(sinks, max_bytes=100)
    ref[0] = w
    done = threading.Event()

    def produce():
        try:
            for i in range(200):
                w.put(f"k{i}", {"x": torch.zeros(60, dtype=torch.uint8)}, {})
            w.close()
        except OSError:
            done.set()

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    t.join(20)
    assert done.is_set()
    w.abort()  # after an error: drops what is queued, never hangs
    with pytest.raises(OSError):
        w.close()


class ClosingSink(SlowSink):
    def __init__(self, ref, fail_close=False):
        super().__init__(ref)
        self.closed_in, self.fail_close, self.aborted = [], fail_close, 0

    def close(self):
        self.closed_in.append(threading.current_thread().name)
        if self.fail_close:
            raise OSError(28, "No space left on device")

    def abort(self):
        self.aborted += 1


def test_each_writer_publishes_its_last_shard_in_its_own_thread_and_a_failure_reaches_close():
    ref: list = [None, []]
    sinks = [ClosingSink(ref) for _ in range(3)]
    w = AsyncShardWriter(sinks, max_bytes=1000)
    ref[0] = w
    for i in range(12):
        w.put(f"k{i}", {"x": torch.zeros(10, dtype=torch.uint8)}, {})
    w.close()
    assert [len(s.closed_in) for s in sinks] == [1, 1, 1]  # once each, each by a writer thread
    assert sorted(n for s in sinks for n in s.closed_in) == [f"shard-writer-{i}" for i in range(3)]
    assert sorted(k for s in sinks for k in s.got) == sorted(f"k{i}" for i in range(12))

    sinks = [ClosingSink(ref), ClosingSink(ref, fail_close=True)]
    w = AsyncShardWriter(sinks, max_bytes=1000)
    ref[0] = w
    w.put("a", {"x": torch.zeros(10, dtype=torch.uint8)}, {})
    with pytest.raises(OSError):
        w.close()
    w.abort()  # what the pipeline does next: every sink told, no hang
    assert [s.aborted for s in sinks] == [1, 1]


def test_put_counts_the_time_it_waits_for_the_writers():
    class Slow(SlowSink):
        def write(self, key, tensors, meta):
            time.sleep(0.02)

    w = AsyncShardWriter([Slow([None, []])], max_bytes=10)  # room for one 10-byte sample
    for i in range(10):
        w.put(f"k{i}", {"x": torch.zeros(10, dtype=torch.uint8)}, {})
    w.close()
    assert 0.1 < w.wait_s < 2.0  # ~8 writes of 20 ms waited for

    class Fast(SlowSink):
        def write(self, key, tensors, meta):
            pass

    w = AsyncShardWriter([Fast([None, []])], max_bytes=10**6)
    for i in range(10):
        w.put(f"k{i}", {"x": torch.zeros(10, dtype=torch.uint8)}, {})
    w.close()
    assert w.wait_s < 0.05  # never full: no waiting


def test_as_a_context_it_closes_after_the_block_and_aborts_when_the_block_raised():
    """``with AsyncShardWriter(...)``: every sample written and the sinks closed after a normal
    block; after an exception (e.g. KeyboardInterrupt) the sinks are aborted, no writer thread
    outlives the block, and the exception propagates."""
    class Recording(SlowSink):
        def __init__(self, ref):
            super().__init__(ref)
            self.ended = None

        def close(self):
            self.ended = "close"

        def abort(self):
            self.ended = "abort"

    for raised in (None, KeyboardInterrupt):
        ref: list = [None, []]
        sinks = [Recording(ref), Recording(ref)]
        with pytest.raises(KeyboardInterrupt) if raised else nullcontext():
            with AsyncShardWriter(sinks, max_bytes=10_000) as w:
                ref[0] = w
                for i in range(20):
                    w.put(f"k{i}", {"x": torch.zeros(10, dtype=torch.uint8)}, {})
                if raised:
                    raise raised
        assert not any(t.is_alive() for t in w.threads)
        assert [s.ended for s in sinks] == ["abort" if raised else "close"] * 2
        if not raised:
            assert sorted(k for s in sinks for k in s.got) == sorted(f"k{i}" for i in range(20))
