"""The num_workers=0 background prefetch: same batches and resume state as building each batch
on demand; errors surface in the consumer; an abandoned epoch stops its thread."""

import threading
import time

import pytest
import torch

from eagle_data.stream.dataset import EagleShardDataset
from eagle_data.stream.loader import EagleDataLoader, background
from eagle_data.tools.synthetic import write_synthetic


def test_background_order_errors_and_early_close():
    assert list(background(iter(range(50)), 3)) == list(range(50))

    def failing():
        yield 1
        raise ValueError("shard x: bad sample k")
    it = background(failing(), 2)
    assert next(it) == 1
    with pytest.raises(ValueError, match="bad sample k"):
        next(it)

    produced = []

    def slow():
        for i in range(10_000):
            produced.append(i)
            yield i
    it = background(slow(), 2)
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    it.close()  # joins the producer
    n = len(produced)
    time.sleep(0.2)
    assert len(produced) == n <= 5 + 2 + 2  # stopped: at most the queue plus one in hand
    assert not any(t.name == "eagle-prefetch" for t in threading.enumerate())


def test_timed_adds_the_wait_for_each_item_and_the_end():
    from eagle_data.background import timed

    def slow():
        for i in range(4):
            time.sleep(0.03)
            yield i
        time.sleep(0.03)  # the end is waited for too

    seconds = {"other": 1.0}
    assert list(timed(slow(), seconds, "front")) == [0, 1, 2, 3]
    assert 0.15 <= seconds["front"] < 1.5 and seconds["other"] == 1.0
    assert list(timed(iter(range(3)), seconds, "fast")) == [0, 1, 2] and seconds["fast"] < 0.05


@pytest.mark.parametrize("mode", [{"batch_size": 3}, {"max_tokens": 20}])
def test_prefetch_same_batches_and_resume_state(tmp_path, mode):
    write_synthetic(tmp_path, [7, 6, 8])

    def loader(prefetch):
        return EagleDataLoader(EagleShardDataset(tmp_path, seed=5, **mode), prefetch_batches=prefetch)
    a, b = loader(0), loader(2)
    for _ in range(2):  # two epochs
        assert [x["keys"] for x in a] == [x["keys"] for x in b]
    it = iter(b)
    first = [next(it)["keys"] for _ in range(2)]
    state = b.state_dict()
    assert state["batches"] == 2  # delivered batches, not the ones built ahead
    c = loader(2)
    c.load_state_dict(state)
    rest = [x["keys"] for x in c]
    d = loader(0)
    d.set_epoch(state["epoch"])
    assert first + rest == [x["keys"] for x in d]


def test_buffer_pool_never_hands_out_memory_still_referenced():
    import pickle

    import torch

    from eagle_data.stream.collate import BufferPool

    pool = BufferPool(keep=2)
    a = pool.empty((4, 8), torch.bfloat16)
    a.fill_(1)
    view = a[1:]
    del a
    b = pool.empty((4, 8), torch.bfloat16)  # a's memory is still referenced by ``view``
    assert b.data_ptr() != view.data_ptr() - view.storage_offset() * 2
    ptr_b = b.untyped_storage().data_ptr()
    del b
    c = pool.empty((2, 8), torch.bfloat16)  # b's storage is free and large enough: reused
    assert c.untyped_storage().data_ptr() == ptr_b and c.shape == (2, 8)
    assert (view == 1).all()
    assert pickle.loads(pickle.dumps(pool)).bufs == []


def test_prefetched_batches_stay_intact_while_held(tmp_path):
    """Batches built ahead in the background thread into pooled memory: holding every batch of
    an epoch (no reuse possible) gives the same bits as building them on demand."""
    write_synthetic(tmp_path, [9, 9], hidden_size=8, length=lambda g: 3 + g % 7)
    held = list(EagleDataLoader(EagleShardDataset(tmp_path, batch_size=4, seed=1), prefetch_batches=2))
    ref = list(EagleDataLoader(EagleShardDataset(tmp_path, batch_size=4, seed=1), prefetch_batches=0))
    assert [b["keys"] for b in held] == [b["keys"] for b in ref]
    for x, y in zip(held, ref):
        for k in ("hidden_states", "aux_hidden_states", "input_ids", "loss_mask", "attention_mask"):
            assert torch.equal(x[k], y[k])
