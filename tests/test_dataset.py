"""EagleShardDataset / EagleDataLoader: exact-once epochs under simulated DDP x workers, resume,
bit-exact bf16, error policy, sources and compat checks, HF datasets reading."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from eagle_data.stream.dataset import EagleShardDataset, decode_hf_example
from eagle_data.stream.loader import EagleDataLoader
from eagle_data.tools.synthetic import write_synthetic


@pytest.fixture(scope="module")
def ds30(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds30")
    write_synthetic(d, [10, 10, 10])
    return d


def run_epoch(loader):
    return [b["keys"] for b in loader]


def ranks(src, world=2, workers=2, seed=0, **kw):
    kw.setdefault("batch_size", 4)
    return [EagleDataLoader(EagleShardDataset(src, rank=r, world_size=world, seed=seed, **kw), num_workers=workers)
            for r in range(world)]


MODES = [{"batch_size": 4}, {"batch_size": 3, "shuffle_buffer": 1}, {"batch_size": None, "max_tokens": 20}]


@pytest.mark.parametrize("mode", MODES)
def test_exact_once_ddp_x_workers(ds30, mode):
    loaders = ranks(ds30, **mode)
    orders = []
    for epoch in range(3):
        per_rank = [run_epoch(dl) for dl in loaders]
        assert len({len(b) for b in per_rank}) == 1, "ranks must yield equal batch counts"
        assert all(len(dl) == len(per_rank[0]) for dl in loaders)
        keys = [k for b in per_rank for batch in b for k in batch]
        assert Counter(keys) == Counter(f"syn_{g:09d}" for g in range(30))
        assert not set(sum(per_rank[0], [])) & set(sum(per_rank[1], []))
        orders.append(keys)
    assert orders[0] != orders[1] != orders[2] != orders[0]
    again = ranks(ds30, **mode)
    assert [k for dl in again for b in run_epoch(dl) for k in b] == orders[0]


@pytest.mark.parametrize("workers", [0, 2])
def test_ten_samples_two_shards_two_ranks(tmp_path, workers):
    write_synthetic(tmp_path, [5, 5])
    per_rank = [[k for b in run_epoch(dl) for k in b] for dl in ranks(tmp_path, workers=workers, batch_size=2)]
    assert [len(set(k)) for k in per_rank] == [5, 5] and [len(k) for k in per_rank] == [5, 5]
    assert set(per_rank[0]).isdisjoint(per_rank[1])


def test_batch_size_one_uneven_drops_documented_tail(tmp_path):
    write_synthetic(tmp_path, [5, 6])
    per_rank = [run_epoch(dl) for dl in ranks(tmp_path, workers=0, batch_size=1)]
    assert [len(b) for b in per_rank] == [5, 5]  # 11 % 2 = 1 position dropped this epoch


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch(ds30, mode, workers):
    full = [k for b in run_epoch(ranks(ds30, world=1, workers=workers, **mode)[0]) for k in b]
    for k in (1, 3):
        dl = ranks(ds30, world=1, workers=workers, **mode)[0]
        seen = []
        for i, b in enumerate(dl):
            seen += b["keys"]
            if i + 1 == k:
                break
        state = json.loads(json.dumps(dl.state_dict()))
        dl2 = ranks(ds30, world=1, workers=workers, **mode)[0]
        dl2.load_state_dict(state)
        rest = [k2 for b in dl2 for k2 in b["keys"]]
        assert seen + rest == full
        nxt = [k2 for b in dl2 for k2 in b["keys"]]  # then the next epoch, complete
        assert sorted(nxt) == sorted(full) and nxt != full


@pytest.mark.parametrize("change", [{"batch_size": 2}, {"batch_size": None, "max_tokens": 20}, {"max_length": 3},
                                    {"shuffle_buffer": 1}, {"shuffle": False}, "other_shards"])
def test_resume_with_another_plan_is_refused_and_a_moved_dataset_resumes(ds30, tmp_path, change):
    """A resume skips the saved number of batches of the plan it finds: with other batching,
    shuffling or shards it would skip or repeat samples, so it is refused, naming the setting. The
    same shards in another folder resume exactly."""
    import shutil

    dl = ranks(ds30, world=1, workers=0)[0]
    it = iter(dl)
    seen = [k for _ in range(2) for k in next(it)["keys"]]
    state = json.loads(json.dumps(dl.state_dict()))
    if change == "other_shards":
        other = tmp_path / "other"
        write_synthetic(other, [10, 10, 11])
        again, field = ranks(other, world=1, workers=0)[0], "shards"
    else:
        again, field = ranks(ds30, world=1, workers=0, **change)[0], sorted(change)[0]
    with pytest.raises(ValueError, match=f"cannot resume: saved {field}="):
        again.load_state_dict(state)
    moved = tmp_path / "moved"
    shutil.copytree(ds30, moved)
    back = ranks(moved, world=1, workers=0)[0]
    back.load_state_dict(state)
    full = [k for b in run_epoch(ranks(ds30, world=1, workers=0)[0]) for k in b]
    assert seen + [k for b in back for k in b["keys"]] == full


def test_resume_at_epoch_end_starts_next_epoch(ds30):
    dl = ranks(ds30, world=1, workers=0)[0]
    e0 = run_epoch(dl)
    e1 = run_epoch(dl)
    dl2 = ranks(ds30, world=1, workers=0)[0]
    dl2.load_state_dict(ranks(ds30, world=1, workers=0)[0].state_dict() | {"epoch": 0, "batches": len(e0)})
    assert run_epoch(dl2) == e1


@pytest.mark.parametrize("stream", [False, True], ids=["local-preadv", "pipe-stream"])
@pytest.mark.parametrize("batch_size,workers,max_length", [(4, 0, None), (1, 0, None), (4, 2, None), (4, 0, 4)])
def test_bf16_bit_exact_after_decode_and_collate(tmp_path, stream, batch_size, workers, max_length):
    """Local shards (hidden states read by preadv straight into the batch) and streamed shards
    (members in memory, views) give the same bits, also truncated, batched alone, in workers."""
    vals = torch.tensor([1.5, 70144.0, -0.0078125, -0.0], dtype=torch.bfloat16)
    ref = {}

    def values(g):
        h = (vals.roll(g).repeat(2)[None, :] * (1 + torch.arange(3 + g % 3)[:, None])).to(torch.bfloat16)
        ref[f"syn_{g:09d}"] = h
        return h
    write_synthetic(tmp_path, [3, 3], values=values, length=lambda g: 3 + g % 3)
    src = [f"pipe:cat {p}" for p in sorted(tmp_path.glob("*.tar"))] if stream else tmp_path
    ds = EagleShardDataset(src, manifest=str(tmp_path / "manifest.json") if stream else None,
                           batch_size=batch_size, max_length=max_length)
    dl = EagleDataLoader(ds, num_workers=workers, pin_memory=False)
    n = 0
    for b in dl:
        assert b["hidden_states"].dtype == torch.bfloat16 and b["input_ids"].dtype == torch.int64
        assert b["attention_mask"].dtype == torch.bool and b["loss_mask"].dtype == torch.bool
        for i, k in enumerate(b["keys"]):
            h = ref[k][:max_length]
            t = h.shape[0]
            assert b["hidden_states"].shape[1] >= t and b["attention_mask"][i].sum() == t
            got = b["hidden_states"][i, :t]
            assert torch.equal(got.view(torch.int16), h.view(torch.int16))
            assert torch.equal(b["aux_hidden_states"][i, :t].view(torch.int16), h.repeat(1, 3).view(torch.int16))
            assert not b["hidden_states"][i, t:].any() and not b["aux_hidden_states"][i, t:].any()
            assert not b["loss_mask"][i, t:].any() and torch.equal(b["loss_mask"][i, :t], torch.arange(t) % 2 == 1)
            assert (b["input_ids"][i, :t] == int(k[4:])).all()
            n += 1
    assert n == 6


def test_max_length_truncates(ds30):
    b = next(iter(EagleDataLoader(EagleShardDataset(ds30, batch_size=30, max_length=5))))
    assert b["input_ids"].shape == (30, 5) and b["hidden_states"].shape == (30, 5, 8)
    assert b["aux_hidden_states"].shape == (30, 5, 24)


def _truncate(path: Path, frac=0.6):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * frac)])


def test_truncated_tar_raises_with_name_and_skip_counts(tmp_path):
    """Skip mode delivers exactly the samples whose members lie wholly before the cut, once each,
    and counts the others."""
    import tarfile

    write_synthetic(tmp_path, [10, 10])
    shard = tmp_path / "00000-000001.tar"
    size = len(shard.read_bytes())
    with tarfile.open(shard) as tf:
        ends: dict[str, int] = {}
        for m in tf.getmembers():
            key = m.name.split(".")[0]
            ends[key] = max(ends.get(key, 0), m.offset_data + m.size)
    _truncate(shard)
    cut = int(size * 0.6)
    intact = {f"syn_{g:09d}" for g in range(10)} | {k for k, e in ends.items() if e <= cut}
    with pytest.raises(ValueError, match="00000-000001.tar"):
        run_epoch(EagleDataLoader(EagleShardDataset(tmp_path, batch_size=4)))
    for workers in (0, 2):
        dl = EagleDataLoader(EagleShardDataset(tmp_path, batch_size=4, on_error="skip"), num_workers=workers)
        keys = [k for b in run_epoch(dl) for k in b]
        assert len(keys) == len(set(keys)) and set(keys) == intact and dl.num_skipped == 20 - len(intact) > 0


def rewrite_members(tar_path: Path, fn) -> None:
    """Rewrite a tar in place: each member's bytes become ``fn(name, data)`` (None: dropped)."""
    import io
    import tarfile
    with tarfile.open(tar_path) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers()]
    with tarfile.open(tar_path, "w") as t:
        for m, data in members:
            data = fn(m.name, data)
            if data is not None:
                m.size = len(data)
                t.addfile(m, io.BytesIO(data))


def test_missing_member_raises_with_key(tmp_path):
    write_synthetic(tmp_path, [3])
    rewrite_members(tmp_path / "00000-000000.tar", lambda name, data: None if name == "syn_000000001.json" else data)
    with pytest.raises(ValueError, match="syn_000000001"):
        run_epoch(EagleDataLoader(EagleShardDataset(tmp_path, batch_size=2)))
    dl = EagleDataLoader(EagleShardDataset(tmp_path, batch_size=2, on_error="skip"))
    assert sorted(k for b in run_epoch(dl) for k in b) == ["syn_000000000", "syn_000000002"]
    assert dl.num_skipped == 1


@pytest.mark.parametrize("bad", ["garbage", "offsets"])
@pytest.mark.parametrize("stream", [False, True], ids=["local-preadv", "pipe-stream"])
def test_undecodable_payload_raises_with_key_or_is_skipped(tmp_path, bad, stream):
    """A payload that is not safetensors, or whose header ranges overlap, raises naming the
    sample (local lazy reads and in-memory streams alike); "skip" counts it."""
    import json as _json

    def corrupt(name, data):
        if name != "syn_000000001.safetensors":
            return data
        if bad == "garbage":
            return b"\xff" * len(data)
        # hidden_states shifted by 2 bytes (same lengths): overlaps a neighbour
        n = int.from_bytes(data[:8], "little")
        a, b = _json.loads(data[8:8 + n])["hidden_states"]["data_offsets"]
        d = 2 if len(str(b + 2)) == len(str(b)) else -2
        h = data[8:8 + n].replace(f'"data_offsets":[{a},{b}]'.encode(), f'"data_offsets":[{a + d},{b + d}]'.encode())
        assert h != data[8:8 + n] and len(h) == n
        return data[:8] + h + data[8 + n:]
    write_synthetic(tmp_path, [3])
    src = tmp_path / "00000-000000.tar"
    rewrite_members(src, corrupt)
    kw = {"manifest": str(tmp_path / "manifest.json")} if stream else {}
    source = f"pipe:cat {src}" if stream else tmp_path
    with pytest.raises(ValueError, match="syn_000000001"):
        run_epoch(EagleDataLoader(EagleShardDataset(source, batch_size=2, **kw)))
    dl = EagleDataLoader(EagleShardDataset(source, batch_size=2, on_error="skip", **kw))
    assert sorted(k for b in run_epoch(dl) for k in b) == ["syn_000000000", "syn_000000002"]
    assert dl.num_skipped == 1


def test_sources_brace_manifest_and_multiple_dirs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_synthetic(a, [4, 4, 4])
    write_synthetic(b, [2], rank=0, tag="other")
    kinds = [f"{a}/00000-{{000000..000001}}.tar", str(a / "manifest.json"), [str(a), f"file://{b}"],
             [f"pipe:cat {a}/00000-000002.tar"]]
    counts = [8, 12, 14, 4]
    for src, n in zip(kinds, counts):
        man = str(a / "manifest.json") if "pipe:" in str(src) else None
        keys = [k for bt in EagleDataLoader(EagleShardDataset(src, batch_size=3, manifest=man)) for k in bt["keys"]]
        assert len(keys) == len(set(keys)) == n
    same = tmp_path / "same"  # a second dataset of tag "syn": its keys would be a's
    write_synthetic(same, [2])
    with pytest.raises(ValueError, match="have the same dataset_tag 'syn'"):
        EagleShardDataset([str(a), str(same)], batch_size=3)
    with pytest.raises(ValueError, match="give manifest"):
        EagleShardDataset(f"pipe:cat {a}/00000-000002.tar", batch_size=2)


def test_compat_refusals(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_synthetic(a, [2])
    write_synthetic(b, [2], hidden_size=16)
    with pytest.raises(ValueError, match="hidden_size"):
        EagleShardDataset([a, b], batch_size=2)
    with pytest.raises(ValueError, match="hidden_size is 8, expected 4096"):
        EagleShardDataset(a, batch_size=2, hidden_size=4096)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        EagleShardDataset(a, batch_size=2, aux_layer_ids=[2, 3, 4])
    with pytest.raises(ValueError, match="dtype"):
        EagleShardDataset(a, batch_size=2, dtype="float32")
    m = json.loads((a / "manifest.json").read_text())
    (a / "manifest.json").write_text(json.dumps(m | {"schema_version": 99}))
    with pytest.raises(ValueError, match="schema_version"):
        EagleShardDataset(a, batch_size=2)
    with pytest.raises(ValueError, match="no such dataset directory"):
        EagleShardDataset(tmp_path / "nothing", batch_size=2)
    (tmp_path / "unmerged").mkdir()
    with pytest.raises(ValueError, match="merge"):
        EagleShardDataset(tmp_path / "unmerged", batch_size=2)
    with pytest.raises(ValueError, match="cannot feed"):
        next(iter(EagleDataLoader(EagleShardDataset(b, batch_size=2, world_size=4, rank=0))))


def test_pin_memory_and_no_pickle_decoders(ds30):
    dl = EagleDataLoader(EagleShardDataset(ds30, batch_size=5), num_workers=0, pin_memory=torch.cuda.is_available())
    b = next(iter(dl))
    assert set(b) == {"input_ids", "attention_mask", "loss_mask", "aux_hidden_states", "hidden_states", "keys"}


def test_hf_datasets_webdataset_read_and_decode(ds30):
    import datasets

    files = sorted(str(p) for p in Path(ds30).glob("*.tar"))
    hf = datasets.load_dataset("webdataset", data_files=files, split="train")
    assert len(hf) == 30
    ex = decode_hf_example(hf[7])
    g = int(ex["key"][4:])
    assert (ex["input_ids"] == g).all() and ex["hidden_states"].dtype == torch.bfloat16
    assert ex["aux_hidden_states"].shape == (ex["input_ids"].shape[0], 24) and ex["meta"]["source_row"] == g
    dec = hf.with_transform(lambda b: {"n": [decode_hf_example({"safetensors": s, "__key__": k})["input_ids"].shape[0]
                                             for s, k in zip(b["safetensors"], b["__key__"])]})
    assert dec[0]["n"] == 4 + int(hf[0]["__key__"][4:]) % 5


def test_shuffle_initial_schedule_permutation_and_replay():
    """webdataset's (bufsize, initial) schedule: the first draw after ``initial`` items, then two
    items read per item drawn until the buffer is full; a permutation; replayable on positions."""
    import random

    from eagle_data.stream.plan import shuffle_stream

    consumed: list[int] = []

    def src():
        for i in range(100):
            consumed.append(i)
            yield i

    it = shuffle_stream(src(), 16, random.Random(3), initial=4)
    out = [next(it)]
    assert len(consumed) == 4
    out += [next(it) for _ in range(5)]
    assert len(consumed) == 4 + 2 * 5  # reading runs ahead while the buffer grows
    out += list(it)
    assert sorted(out) == list(range(100)) and out != list(range(100))
    assert out == list(shuffle_stream(range(100), 16, random.Random(3), initial=4))
    assert list(shuffle_stream(range(100), 16, random.Random(3))) != out  # initial=None: full buffer first


def test_shuffle_initial_exact_once_and_validated(ds30):
    ds = EagleShardDataset(ds30, batch_size=2, shuffle_buffer=20, shuffle_initial=2)
    keys = [k for b in EagleDataLoader(ds) for k in b["keys"]]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 30
    with pytest.raises(ValueError, match="shuffle_initial"):
        EagleShardDataset(ds30, batch_size=2, shuffle_initial=0)


@pytest.mark.parametrize("kw,name", [({"batch_size": -1}, "batch_size"), ({"batch_size": 0}, "batch_size"),
                                     ({"batch_size": None, "max_tokens": 0}, "max_tokens"),
                                     ({"batch_size": None, "max_tokens": -5}, "max_tokens"),
                                     ({"batch_size": 2, "max_batch_size": 0}, "max_batch_size"),
                                     ({"batch_size": 2, "bucket_window": -1}, "bucket_window")])
def test_batching_arguments_below_one_are_refused_by_name(ds30, kw, name):
    """batch_size=-1 used to give an empty epoch, batch_size=0 a ZeroDivisionError later."""
    with pytest.raises(ValueError, match=rf"^{name} must be an integer >= 1, got {kw[name]}$"):
        EagleShardDataset(ds30, **kw)


def test_a_dataset_given_no_batching_is_refused_and_a_token_budget_wins_over_a_batch_size(ds30):
    """After ReadConfig (batch_size 8 by default) ``EagleShardDataset(path)`` batched 8 samples
    unsaid; before it the dataset refused to guess (the DataModule's default of 8 stays)."""
    from eagle_data.stream.config import ReadConfig

    for kw in ({}, {"shuffle": False}, {"read": {"seed": 1}}, {"batch_size": None}):
        with pytest.raises(ValueError, match="^give batch_size or max_tokens"):
            EagleShardDataset(ds30, **kw)
    assert EagleShardDataset(ds30, read=ReadConfig()).batch_size == 8
    both = EagleShardDataset(ds30, batch_size=4, max_tokens=20)
    assert both.batch_size is None and both.max_tokens == 20


def test_short_tar_message_counts_the_samples_the_tar_holds(tmp_path):
    """A clean tar that holds fewer samples than the manifest: the error gives the real count,
    also for a rank whose span starts after the tar's end."""
    write_synthetic(tmp_path, [10])
    rewrite_members(tmp_path / "00000-000000.tar", lambda name, data: data if int(name[4:13]) < 3 else None)
    ds = EagleShardDataset(tmp_path, batch_size=2, shuffle=False, rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"00000-000000.tar: expected 10 samples, the tar ends after 3 \(truncated"):
        run_epoch(EagleDataLoader(ds))


def test_dataset_directory_named_like_a_tar(tmp_path):
    d = tmp_path / "data.tar.d"
    write_synthetic(d, [3, 2])
    assert sorted(k for b in run_epoch(EagleDataLoader(EagleShardDataset(d, batch_size=2))) for k in b) == \
        [f"syn_{g:09d}" for g in range(5)]
    assert sum(1 for _ in EagleDataLoader(EagleShardDataset(f"{d}/00000-{{000000..000001}}.tar", batch_size=5))) == 1


@pytest.mark.parametrize("shards,world,batch_size", [([5], 1, 2), ([7, 4], 2, 3), ([3, 3, 3], 2, 4), ([6, 5], 2, 1)])
def test_batch_count_and_sizes_do_not_depend_on_workers(tmp_path, shards, world, batch_size):
    """Fixed batch size: every rank yields the same sequence of batch sizes with 0, 2 or 3 workers
    (and as many batches as every other rank), each sample once."""
    write_synthetic(tmp_path, shards)
    n = sum(shards) - (sum(shards) % world if batch_size == 1 else 0)
    seqs = {}
    for workers in (0, 2, 3):
        per_rank = [run_epoch(dl) for dl in ranks(tmp_path, world=world, workers=workers, batch_size=batch_size)]
        seqs[workers] = [[len(b) for b in r] for r in per_rank]
        assert len({len(r) for r in per_rank}) == 1
        keys = [k for r in per_rank for b in r for k in b]
        assert len(keys) == len(set(keys)) == n
        assert all(len(dl) == len(per_rank[0]) for dl in ranks(tmp_path, world=world, workers=workers,
                                                                 batch_size=batch_size))
    assert seqs[0] == seqs[2] == seqs[3], seqs
    assert all(s == sorted(s, reverse=True) for s in seqs[0][0:1])  # full batches first


@pytest.mark.parametrize("stop", [1, 2, 3])
def test_resume_when_workers_serve_unequal_batch_counts(tmp_path, stop):
    """7 samples, batch 2, 2 workers: 4 batches, worker 0 serves 2 and worker 1 serves 2; 3 workers:
    worker 0 serves 2, the others 1. A resume after ``stop`` batches continues the same order."""
    write_synthetic(tmp_path, [7])
    for workers in (2, 3):
        full = run_epoch(ranks(tmp_path, world=1, workers=workers, batch_size=2)[0])
        assert [len(b) for b in full] == [2, 2, 2, 1]
        dl = ranks(tmp_path, world=1, workers=workers, batch_size=2)[0]
        seen = []
        for i, b in enumerate(dl):
            seen.append(b["keys"])
            if i + 1 == stop:
                break
        dl2 = ranks(tmp_path, world=1, workers=workers, batch_size=2)[0]
        dl2.load_state_dict(json.loads(json.dumps(dl.state_dict())))
        assert seen + run_epoch(dl2) == full


def test_a_batch_whose_samples_were_all_skipped_is_a_filler_not_empty(tmp_path):
    """on_error="skip": a batch whose every sample is unreadable becomes one filler row (2 tokens,
    nothing supervised), so the step count stays equal on every rank and the loss runs; the skips
    are counted. The TTT loss of that batch is 0 with finite gradients."""
    import sys

    from eagle_data.stream.collate import FILLER_KEY

    write_synthetic(tmp_path, [4], hidden_size=64)
    rewrite_members(tmp_path / "00000-000000.tar",
                    lambda name, data: b"\xff" * len(data) if name.startswith(("syn_000000000.", "syn_000000001."))
                    else data)
    dl = EagleDataLoader(EagleShardDataset(tmp_path, batch_size=2, shuffle=False, on_error="skip"))
    batches = list(dl)
    assert [b["keys"] for b in batches] == [[FILLER_KEY], ["syn_000000002", "syn_000000003"]]
    assert dl.num_skipped == 2 and len(dl) == 2
    f = batches[0]
    assert f["input_ids"].shape == (1, 2) and not f["loss_mask"].any() and f["attention_mask"].all()
    sys.path.insert(0, str(Path(__file__).parent))
    from train_tiny import tiny_module

    from eagle_train.loss import ttt_loss

    mod = tiny_module(tmp_path / "m")
    out = ttt_loss(mod.drafter, mod.target_lm_head, f, steps=3)
    out["loss"].backward()
    assert float(out["loss"]) == 0.0 and all(int(n) == 0 for n in out["n_k"])
    assert all(torch.isfinite(p.grad).all() for p in mod.drafter.parameters() if p.grad is not None)


@pytest.mark.parametrize("workers,world", [(2, 1), (0, 2)])
def test_token_budget_smaller_than_two_samples_with_several_slots(tmp_path, workers, world):
    """max_tokens that fits one sample per batch with more slots than can be balanced: the slots
    short of batches get filler rows instead of the plan failing; every sample once, equal counts."""
    from eagle_data.stream.collate import FILLER_KEY

    write_synthetic(tmp_path, [7], length=lambda g: 60)
    per_rank = [run_epoch(dl) for dl in ranks(tmp_path, world=world, workers=workers, batch_size=None,
                                              max_tokens=100)]
    assert len({len(r) for r in per_rank}) == 1
    keys = [k for r in per_rank for b in r for k in b if k != FILLER_KEY]
    assert sorted(keys) == [f"syn_{g:09d}" for g in range(7)]
    assert all(len(b) == 1 for r in per_rank for b in r)


def test_the_streaming_example_splits_the_samples_between_torchrun_ranks(tmp_path):
    """examples/stream_batches.py said it was DDP-correct under torchrun but started no process
    group, so the dataset saw world size 1 and every rank read every sample."""
    import re
    import subprocess
    import sys

    write_synthetic(tmp_path, [7, 6])
    example = Path(__file__).resolve().parents[1] / "examples" / "stream_batches.py"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(example), str(tmp_path)], capture_output=True, text=True, timeout=300)
    seen = re.findall(r"rank (\d)/2 epoch (\d): \d+ batches, (\d+) samples", r.stdout)
    assert r.returncode == 0 and len(seen) == 4, (r.stdout, r.stderr[-2000:])
    for epoch in "01":
        counts = [int(n) for _, e, n in seen if e == epoch]
        assert sum(counts) == 13 and all(0 < n < 13 for n in counts), seen
