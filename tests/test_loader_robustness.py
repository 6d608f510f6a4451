"""Regressions from trying to break the loader: hidden states read late (after the tar walk)
obey the error policy and name the sample; crafted tar headers raise instead of looping;
argument and header checks; no descriptors kept alive by a caught error."""

import os
import signal
import tarfile
import time
from contextlib import contextmanager

import pytest

from eagle_data.stream.collate import FILLER_KEY
from eagle_data.stream.dataset import EagleShardDataset
from eagle_data.stream.loader import EagleDataLoader, background
from eagle_data.tools.synthetic import write_synthetic


@contextmanager
def deadline(seconds: int):
    """Fail instead of hanging the suite."""
    def boom(*_):
        raise TimeoutError(f"no result within {seconds} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_shard_truncated_after_its_walk(tmp_path, on_error):
    """The whole shard is walked into the shuffle buffer before the first batch; truncating it
    then makes the later preadv of the remaining samples fail."""
    write_synthetic(tmp_path, [10], hidden_size=16, length=lambda g: 40)
    shard = next(tmp_path.glob("*.tar"))
    ds = EagleShardDataset(tmp_path, batch_size=2, shuffle_buffer=10, shuffle_initial=10, on_error=on_error)
    dl = EagleDataLoader(ds, prefetch_batches=0)
    it = iter(dl)
    first = next(it)["keys"]
    os.truncate(shard, 1024)
    if on_error == "raise":
        with pytest.raises(ValueError, match=rf"{shard}:syn_\d+.*(end of file|changed)"):
            next(it)
        return
    batches = [b["keys"] for b in it]
    rest = [k for b in batches for k in b if k != FILLER_KEY]
    assert len(first) == 2 and not set(first) & set(rest)
    assert len(first) + len(rest) + dl.num_skipped == 10 and dl.num_skipped >= 6
    assert len(batches) == 4 and all(b == [FILLER_KEY] for b in batches if FILLER_KEY in b)  # never empty


def test_io_error_on_hidden_states_is_a_named_skip(tmp_path, monkeypatch):
    from eagle_data.format import payload

    write_synthetic(tmp_path, [6], hidden_size=16, length=lambda g: 40)
    real = payload.LocalFile.pread_into
    big = 40 * 16 * 2  # hidden_states bytes of one sample: a read this large is a hidden-state fill
    state = {"n": 0}

    def flaky(self, buf, offset):
        if len(buf) >= big:
            state["n"] += 1
            if state["n"] == 3:
                raise OSError(5, "Input/output error")
        return real(self, buf, offset)
    monkeypatch.setattr(payload.LocalFile, "pread_into", flaky)
    with pytest.raises(ValueError, match=r"sample .*00000-000000.tar:syn_\d+.*Input/output error"):
        list(EagleDataLoader(EagleShardDataset(tmp_path, batch_size=3, read_threads=1), prefetch_batches=0))
    state["n"] = 0
    dl = EagleDataLoader(EagleShardDataset(tmp_path, batch_size=3, on_error="skip", read_threads=2))
    keys = [k for b in dl for k in b["keys"]]
    assert len(keys) == 5 == len(set(keys)) and dl.num_skipped == 1


def _prepend(shard, blob):
    data = shard.read_bytes()
    shard.write_bytes(blob + data)


def _member(name, data, typ=tarfile.REGTYPE):
    ti = tarfile.TarInfo(name)
    ti.size, ti.type = len(data), typ
    return ti.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape") + data + bytes(-len(data) % 512)


@pytest.mark.parametrize("stream", [False, True], ids=["local", "pipe"])
@pytest.mark.parametrize("kind", ["negative-size", "pax-length-0"])
def test_crafted_tar_headers_raise_instead_of_looping(tmp_path, stream, kind):
    write_synthetic(tmp_path, [3])
    shard = next(tmp_path.glob("*.tar"))
    if kind == "negative-size":
        h = bytearray(_member("README", b"")[:512])
        h[124:136] = b"\xff" + (256 ** 11 - 512).to_bytes(11, "big")  # GNU base-256: -512
        h[148:156] = b" " * 8
        h[148:156] = b"%06o\0 " % sum(h)
        blob = bytes(h)
    else:
        blob = _member("././@PaxHeader", b"0 path=x\n", tarfile.XHDTYPE) + _member("README", b"hi")
    _prepend(shard, blob)
    src = [f"pipe:cat {shard}"] if stream else tmp_path
    ds = EagleShardDataset(src, manifest=str(tmp_path / "manifest.json") if stream else None, batch_size=2)
    with deadline(30), pytest.raises(ValueError, match="corrupt (tar|pax)"):
        list(EagleDataLoader(ds))


def _payload(header: dict, body: bytes) -> bytes:
    import json

    h = json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h + body


@pytest.mark.parametrize("bad", ["float-shape", "string-offset", "metadata-list", "bool-shape"])
def test_header_types_checked_like_safetensors(tmp_path, bad):
    """Entries the safetensors library rejects are rejected by the loader too (not read as ints)."""
    import json

    from eagle_data.format.payload import view_tensors

    write_synthetic(tmp_path, [1])
    with tarfile.open(next(tmp_path.glob("*.tar"))) as t:
        data = t.extractfile("syn_000000000.safetensors").read()
    n = int.from_bytes(data[:8], "little")
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    assert view_tensors(_payload(header, body))["hidden_states"].shape == tuple(header["hidden_states"]["shape"])
    h = header["hidden_states"]
    if bad == "float-shape":
        h["shape"] = [float(h["shape"][0]) + 0.5, h["shape"][1]]
    elif bad == "string-offset":
        h["data_offsets"] = [str(h["data_offsets"][0]), h["data_offsets"][1]]
    elif bad == "metadata-list":
        header["__metadata__"] = ["x"]
    else:
        h["shape"] = [True, h["shape"][1]] if h["shape"][0] == 1 else [h["shape"][0], True]
    with pytest.raises(ValueError, match="syn"):
        view_tensors(_payload(header, body), where="syn")


def test_max_length_must_be_positive(tmp_path):
    write_synthetic(tmp_path, [4])
    for bad in (0, -1):
        with pytest.raises(ValueError, match="max_length"):
            EagleShardDataset(tmp_path, batch_size=2, max_length=bad)


def test_set_epoch_is_in_the_state_before_the_first_batch(tmp_path):
    write_synthetic(tmp_path, [5, 5])
    a = EagleDataLoader(EagleShardDataset(tmp_path, batch_size=2, seed=5))
    a.set_epoch(3)
    b = EagleDataLoader(EagleShardDataset(tmp_path, batch_size=2, seed=5))
    b.load_state_dict(a.state_dict())
    ref = EagleDataLoader(EagleShardDataset(tmp_path, batch_size=2, seed=5))
    ref.set_epoch(3)
    assert [x["keys"] for x in b] == [x["keys"] for x in ref] and b.epoch == 3


@pytest.mark.parametrize("persistent", [True, False])
def test_a_plain_dataloader_reads_the_epoch_set_in_the_main_process(tmp_path, persistent):
    """A plain torch DataLoader (as Lightning or a user's own loop builds it) with persistent workers
    keeps the copies of the dataset it forked once; set_epoch in the main process must still reach
    them: each epoch's keys are that epoch's plan, as a fresh dataset of that epoch reads them."""
    import torch

    write_synthetic(tmp_path, [6, 6, 6], hidden_size=16)
    ds = EagleShardDataset(tmp_path, batch_size=2, seed=3)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)
    seen = []
    with deadline(120):
        for epoch in range(3):
            ds.set_epoch(epoch)
            seen.append(sorted(k for b in dl for k in b["keys"]))
            ref = EagleShardDataset(tmp_path, batch_size=2, seed=3)
            ref.set_epoch(epoch)
            want = torch.utils.data.DataLoader(ref, batch_size=None, num_workers=2)
            assert [b["keys"] for b in dl] == [b["keys"] for b in want], epoch
    assert all(s == seen[0] and len(s) == 18 for s in seen)  # every sample once per epoch


def test_caught_error_keeps_no_shard_open_without_gc(tmp_path):
    import gc

    write_synthetic(tmp_path, [4, 4])
    shard = sorted(tmp_path.glob("*.tar"))[1]
    shard.write_bytes(shard.read_bytes()[:3000])

    def tar_fds():
        return sum(1 for f in os.listdir("/proc/self/fd")
                   if os.path.realpath(f"/proc/self/fd/{f}").endswith(".tar"))
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            with pytest.raises(ValueError):
                list(EagleDataLoader(EagleShardDataset(tmp_path, batch_size=2), prefetch_batches=2))
        assert tar_fds() == 0
    finally:
        gc.enable()


def test_interrupted_consumer_does_not_wait_for_a_slow_producer():
    def slow():
        yield 0
        time.sleep(30)
        yield 1
    it = background(slow(), 2)
    assert next(it) == 0
    with deadline(10):
        t0 = time.perf_counter()
        signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            next(it)
        assert time.perf_counter() - t0 < 2


def test_token_mode_logs_an_unreadable_shard_once_per_rank_not_per_worker(tmp_path, monkeypatch, caplog):
    """In token mode every worker of a rank reads the rank's part; the skip is logged by one of
    them, and counted once, in the batches that held the lost samples."""
    from types import SimpleNamespace

    import eagle_data.stream.dataset as dsm

    write_synthetic(tmp_path, [4, 4], hidden_size=8, length=lambda g: 10)
    shard = sorted(tmp_path.glob("*.tar"))[1]
    os.truncate(shard, 1536)  # the second shard ends inside its first sample
    logged, delivered, skipped = [], [], 0
    for wid in range(3):
        ds = EagleShardDataset(tmp_path, max_tokens=20, shuffle=False, on_error="skip")
        monkeypatch.setattr(dsm, "get_worker_info", lambda: SimpleNamespace(num_workers=3, id=wid))
        with caplog.at_level("WARNING", logger="eagle_data.stream.reader"):
            caplog.clear()
            batches = list(ds)
        logged += [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
        delivered += [k for b in batches for k in b["keys"] if k != FILLER_KEY]
        skipped += sum(b.get("skipped", 0) for b in batches)
    assert len(logged) == 1 and "4 sample(s)" in logged[0]
    assert sorted(delivered) == [f"syn_{g:09d}" for g in range(4)] and skipped == 4


@pytest.mark.parametrize("damage", ["truncated_shard", "bad_sample"])
def test_a_workers_data_error_reaches_the_caller_as_it_is(tmp_path, damage):
    """With DataLoader workers the error is the same typed exception with the same message as
    without them (not torch's worker traceback text, not a RuntimeError)."""
    from eagle_data.format.schema import SampleError
    from eagle_data.stream.reader import ShardError

    write_synthetic(tmp_path, [6, 6], hidden_size=16, length=lambda g: 40)
    shard = sorted(tmp_path.glob("*.tar"))[1]
    data = bytearray(shard.read_bytes())
    if damage == "truncated_shard":
        shard.write_bytes(bytes(data[:3000]))
    else:  # a tensor of an unknown dtype: the sample breaks the schema
        at = data.index(b'"dtype":"', 512) + len(b'"dtype":"')
        data[at:at + 2] = b"Q9"
        shard.write_bytes(bytes(data))
    errors = {}
    for workers in (0, 2):
        dl = EagleDataLoader(EagleShardDataset(tmp_path, batch_size=2, shuffle=False), num_workers=workers)
        with deadline(120), pytest.raises((ShardError, SampleError)) as e:
            for _ in dl:
                pass
        errors[workers] = (type(e.value), str(e.value))
    assert errors[0] == errors[2] and "Traceback" not in errors[2][1]
