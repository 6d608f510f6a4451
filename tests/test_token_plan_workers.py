"""Token-budget batching does not depend on the number of DataLoader workers (issue 14, item 5):
a rank's batches are planned once per rank and dealt to its workers, so the batch count, the
batch sizes and the batches themselves are the same for 0, 1, 2 or 3 workers, under DDP, every
sample once per epoch, and after a resume."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from eagle_data.stream.collate import FILLER_KEY
from eagle_data.stream.dataset import EagleShardDataset
from eagle_data.stream.loader import EagleDataLoader
from eagle_data.tools.synthetic import write_synthetic


def loader(src, rank, world, workers, **kw):
    return EagleDataLoader(EagleShardDataset(str(src), rank=rank, world_size=world, batch_size=None, **kw),
                           num_workers=workers)


def epoch(src, rank, world, workers, **kw):
    """The keys of each batch of the first epoch, and ``len()`` of the loader before it (afterwards
    ``len()`` is the next epoch's, whose shard order and so token plan may differ)."""
    dl = loader(src, rank, world, workers, **kw)
    n = len(dl)
    return [b["keys"] for b in dl], n


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shards=st.lists(st.integers(1, 9), min_size=1, max_size=4), world=st.integers(1, 2),
       max_tokens=st.integers(12, 40), seed=st.integers(0, 3), shuffle_buffer=st.sampled_from([0, 5, 100]))
def test_batches_are_the_same_for_any_number_of_workers(tmp_path_factory, shards, world, max_tokens, seed,
                                                        shuffle_buffer):
    src = tmp_path_factory.mktemp("tp")
    write_synthetic(src, shards, length=lambda g: 3 + (g * 7) % 9)
    n = sum(shards)
    if n < world:
        return
    ref = None
    for workers in (0, 1, 2, 3):
        per_rank = [epoch(src, r, world, workers, max_tokens=max_tokens, seed=seed, shuffle_buffer=shuffle_buffer)
                    for r in range(world)]
        got = [b for b, _ in per_rank]
        assert len({len(b) for b in got}) == 1  # equal step counts on every rank
        assert all(n == len(got[0]) for _, n in per_rank)  # len() announced the epoch's batch count
        keys = [k for b in got for batch in b for k in batch if k != FILLER_KEY]
        assert Counter(keys) == Counter(f"syn_{g:09d}" for g in range(n))  # every sample once
        if ref is None:
            ref = got
        assert got == ref, f"{workers} workers batch otherwise than 0"


@pytest.mark.parametrize("workers,again", [(0, 0), (2, 2), (3, 3), (2, 0), (0, 3)])
def test_resume_mid_epoch_in_token_mode_gives_the_rest_of_the_same_batches(tmp_path, workers, again):
    """Also with another number of workers after the resume: the batches do not depend on it."""
    write_synthetic(tmp_path, [7, 9, 6], length=lambda g: 3 + (g * 5) % 11)
    full, _ = epoch(tmp_path, 0, 1, 0, max_tokens=30)
    for stop in (1, 2, 5):
        dl = loader(tmp_path, 0, 1, workers, max_tokens=30)
        seen = []
        for i, b in enumerate(dl):
            seen.append(b["keys"])
            if i + 1 == stop:
                break
        state = json.loads(json.dumps(dl.state_dict()))
        dl2 = loader(tmp_path, 0, 1, again, max_tokens=30)
        dl2.load_state_dict(state)
        assert seen + [b["keys"] for b in dl2] == full


def test_fixed_batch_size_still_refuses_a_resume_with_other_workers(tmp_path):
    """With a fixed batch_size a worker reads its own contiguous slot, so the batches' samples
    depend on the worker count: a resume with another count is refused naming it."""
    write_synthetic(tmp_path, [6, 6])
    dl = EagleDataLoader(EagleShardDataset(str(tmp_path), batch_size=2), num_workers=2)
    next(iter(dl))
    state = dl.state_dict()
    with pytest.raises(ValueError, match="saved num_workers=2, now 0"):
        EagleDataLoader(EagleShardDataset(str(tmp_path), batch_size=2), num_workers=0).load_state_dict(state)


def test_fixed_mode_treats_zero_workers_as_one():
    from eagle_data.tools.synthetic import write_synthetic as ws
    import tempfile

    d = tempfile.mkdtemp()
    ws(d, [6])
    dl = EagleDataLoader(EagleShardDataset(d, batch_size=3), num_workers=0)
    first = next(iter(dl))["keys"]
    state = dl.state_dict()
    dl1 = EagleDataLoader(EagleShardDataset(d, batch_size=3), num_workers=1)
    dl1.load_state_dict(state)  # 0 workers plan as 1: accepted
    rest = [b["keys"] for b in dl1]
    assert len(rest) == 1 and sorted(first + rest[0]) == [f"syn_{g:09d}" for g in range(6)]


def test_a_sample_above_the_token_budget_is_named_in_a_warning_unless_max_length_cuts_it(tmp_path, caplog):
    write_synthetic(tmp_path, [3, 3], length=lambda g: 30 if g in (1, 4) else 6)
    with caplog.at_level("WARNING", logger="eagle_data.stream.dataset"):
        keys, _ = epoch(tmp_path, 0, 1, 0, max_tokens=20)
    msgs = [r.getMessage() for r in caplog.records if "max_tokens" in r.getMessage()]
    assert len(msgs) == 1 and "2 sample(s)" in msgs[0] and "30 tokens" in msgs[0]
    assert sorted(k for b in keys for k in b) == sorted(set(k for b in keys for k in b))  # every sample, once
    assert sum(len(b) for b in keys) == 6
    caplog.clear()
    with caplog.at_level("WARNING", logger="eagle_data.stream.dataset"):
        epoch(tmp_path, 0, 1, 0, max_tokens=20, max_length=20)
    assert not [r for r in caplog.records if "max_tokens" in r.getMessage()]
