"""The spool's shared-memory ring (:mod:`eagle_data.engines.sglang_arena`): chunks come back bit-exact
whatever the order they are read and freed in, the writer never overwrites a region not yet freed,
a chunk that does not fit goes to a file, and the reader's frees reach a writer in another process."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

import eagle_data.engines.sglang_arena as arena_mod
from eagle_data.engines.sglang_arena import ArenaWriter
from eagle_data.engines.sglang_spool import Spool, list_spool, piece_name


def _chunk(n: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows as the hook stores them: ids int64, fp8 aux with float32 scales, bf16 final, bool ok."""
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 1 << 40, (n,), generator=g),
            "aux": (torch.randn(n, 12, generator=g) * 50).to(torch.float8_e4m3fn),
            "final": torch.randn(n, 4, generator=g).to(torch.bfloat16),
            "aux_scale": torch.rand(n, 3, generator=g), "ok": torch.rand(n, generator=g) > 0.3}


def _same(piece, want: dict[str, torch.Tensor]) -> bool:
    got = {"input_ids": piece.input_ids, "aux": piece.aux, "final": piece.final, **piece.extra}
    return got.keys() == want.keys() and all(
        got[k].dtype == w.dtype and got[k].shape == w.shape
        and torch.equal(got[k].reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)) for k, w in want.items())


@pytest.fixture
def spool(tmp_path):
    s = Spool(tmp_path)
    yield s
    s.close()


def _put(w: ArenaWriter, rid: int, rows: dict[str, torch.Tensor]):
    return w.put(piece_name(f"ed1-{rid}", 0, rid, "arena"), {"rid": f"ed1-{rid}", "offset": 0, "seq": rid}, rows)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("put"), st.integers(1, 40)), st.tuples(st.just("take"), st.integers(0, 99))),
                min_size=1, max_size=60))
def test_chunks_come_back_exact_in_any_read_and_free_order(tmp_path_factory, ops):
    """A small ring (2 KiB), chunks of 1-40 rows (~50 B a row), read and freed in a generated order:
    every chunk reads back bit-exact after any later puts (so none was overwritten before its free),
    a refused put is a full ring (or a chunk larger than the ring), and at the end every byte handed
    out is freed."""
    spool, wait = Spool(tmp_path_factory.mktemp("ring")), arena_mod.WAIT_S
    arena_mod.WAIT_S = 0.0  # a full ring refuses at once (single-threaded here)
    try:
        spool.open_arena(2048)
        w, held = ArenaWriter.open(spool.path), []
        for i, (op, x) in enumerate(ops):
            if op == "put":
                rows = _chunk(x, i)
                before = (w.head, int(spool.arena.tail[0]))
                path = _put(w, i, rows)
                if path is None:  # refused: too large, or bytes still held where it would go
                    need = sum(-(-t.nbytes // 8) * 8 for t in rows.values())
                    assert w.head == before[0] and (need > 2048 or held), (need, before)
                else:
                    held.append((path, rows))
            elif held:
                path, rows = held.pop(x % len(held))
                assert _same(spool.read(path), rows)
                spool.remove([path])
        for path, rows in held:
            assert _same(spool.read(path), rows)
        spool.remove(p for p, _ in held)
        assert int(spool.arena.tail[0]) == w.head and list_spool(spool.path) == {}
    finally:
        arena_mod.WAIT_S = wait
        spool.close()


def test_a_chunk_the_ring_cannot_take_goes_to_a_file(spool):
    """Through the hook's writer: a chunk larger than the ring, and one that finds it full, are files;
    the others ring records; every one reads back exact through the spool."""
    from eagle_data.engines.sglang_hook import _Writer, stored_rows

    spool.open_arena(4096)
    w = _Writer(str(spool.path), 1 << 30, (torch.float8_e4m3fn, torch.bfloat16))
    ids, aux, fin = torch.randint(0, 1000, (210,)), torch.randn(210, 12), torch.randn(210, 4)
    stored = stored_rows(ids, aux, fin, w.dtypes)  # what the writer hands on: transport is under test here
    big, small = ({k: x[a:b] for k, x in stored.items()} for a, b in ((0, 200), (200, 210)))
    w.put(ids, aux, fin, [("ed1-1", 0, 0, 0, 200), ("ed1-2", 0, 1, 200, 10)])
    w.drain()
    files = {rid: fs[0][1] for rid, fs in list_spool(spool.path).items()}
    assert (files["ed1-1"].suffix, files["ed1-2"].suffix) == (".safetensors", ".arena")
    assert w.stats["file_pieces"] == 1 and w.stats["pieces"] == 2
    assert _same(spool.read(files["ed1-1"]), big) and _same(spool.read(files["ed1-2"]), small)
    spool.remove(files.values())
    assert list_spool(spool.path) == {} and int(spool.arena.tail[0]) == w.arena.head


def _writer_process(path: str, n: int) -> None:
    w = ArenaWriter.open(path)
    for i in range(n):
        assert _put(w, i, _chunk(30, i)) is not None, f"chunk {i}: no room within WAIT_S"


def test_frees_reach_a_writer_in_another_process(spool):
    """The writer in a spawned process puts 10x what the ring holds; it goes on only as this
    process reads and frees (the tail in shared memory), and every chunk arrives exact."""
    spool.open_arena(8 * 1024)
    n = 10 * 8 * 1024 // sum(t.nbytes for t in _chunk(30, 0).values())
    proc = multiprocessing.get_context("spawn").Process(target=_writer_process, args=(str(spool.path), n))
    proc.start()
    seen, deadline = 0, time.monotonic() + 120
    while seen < n and time.monotonic() < deadline:
        path = spool.path / piece_name(f"ed1-{seen}", 0, seen, "arena")
        if path.exists():
            assert _same(spool.read(path), _chunk(30, seen))
            spool.remove([path])
            seen += 1
        else:
            time.sleep(0.001)
    proc.join(30)
    assert (seen, proc.exitcode) == (n, 0)


def test_a_ring_held_full_costs_one_wait_then_files_at_once(spool, monkeypatch):
    """Regions nobody frees (e.g. a cancelled request's, until its records are dropped): the first
    chunk that finds no room waits ``WAIT_S`` in vain, the next ones are refused at once, and once
    room comes the writer waits again."""
    monkeypatch.setattr(arena_mod, "WAIT_S", 0.3)
    spool.open_arena(4096)
    w = ArenaWriter.open(spool.path)
    held = [_put(w, i, _chunk(30, i)) for i in range(3)]  # ~1.2 KiB each: the ring is full
    took = []
    for i in (3, 4):
        t0 = time.monotonic()
        assert _put(w, i, _chunk(30, i)) is None
        took.append(time.monotonic() - t0)
    assert took[0] >= 0.3 and took[1] < 0.1 and not w.patient
    spool.remove(held)
    assert _put(w, 5, _chunk(30, 5)) is not None and w.patient


def test_no_room_for_the_ring_means_files_said(spool, monkeypatch, caplog):
    """``/dev/shm`` without room for the ring's bytes: no ring (nothing half-made left), a warning
    naming the size, and the hook's chunks go to files that read back exact."""
    import errno
    import logging

    from eagle_data.engines.sglang_hook import _Writer, stored_rows

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(arena_mod.os, "posix_fallocate", full)
    with caplog.at_level(logging.WARNING):
        spool.open_arena(1 << 20)
    assert spool.arena is None and not (spool.path / arena_mod.ARENA).exists()
    assert "no room for a ring of 1048576 bytes" in caplog.text
    w = _Writer(str(spool.path), 1 << 30)
    ids, aux, fin = torch.arange(7), torch.randn(7, 12), torch.randn(7, 4)
    w.put(ids, aux, fin, [("ed1-1", 0, 0, 0, 7)])
    w.drain()
    (path,) = [p for _, p in list_spool(spool.path)["ed1-1"]]
    assert path.suffix == ".safetensors" and _same(spool.read(path), stored_rows(ids, aux, fin, (None, None)))


def test_a_record_that_cannot_be_written_gives_its_region_back(spool, monkeypatch):
    """The region of a chunk whose record fails to be written (e.g. a full ``/dev/shm``) is taken
    back: nothing would ever free it, and the ring would stay blocked behind it."""
    spool.open_arena(4096)
    w = ArenaWriter.open(spool.path)
    real = arena_mod.os.replace
    monkeypatch.setattr(arena_mod.os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError, match="No space left"):
        _put(w, 0, _chunk(30, 0))
    assert w.head == 0
    monkeypatch.setattr(arena_mod.os, "replace", real)
    path = _put(w, 1, _chunk(30, 1))
    assert _same(spool.read(path), _chunk(30, 1))
    spool.remove([path])
    assert int(spool.arena.tail[0]) == w.head > 0


def test_the_writer_thread_survives_a_spool_too_full_for_an_error_record(spool, monkeypatch):
    """Neither the rows nor their error record can be written (a full ``/dev/shm``): the writer
    thread logs it and goes on with the next pass, whose rows arrive."""
    import eagle_data.engines.sglang_hook as hook_mod
    from eagle_data.engines.sglang_hook import _Writer

    w = _Writer(str(spool.path), 1 << 30)
    calls = {"n": 0}
    real = hook_mod.write_piece

    def full_once(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        return real(*a, **k)

    monkeypatch.setattr(hook_mod, "write_piece", full_once)
    monkeypatch.setattr(hook_mod, "write_error", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    ids, aux, fin = torch.arange(4), torch.randn(4, 12), torch.randn(4, 4)
    w.put(ids, aux, fin, [("ed1-1", 0, 0, 0, 4)])
    w.put(ids, aux, fin, [("ed1-2", 0, 1, 0, 4)])
    import threading
    done = threading.Thread(target=w.drain, daemon=True)  # a dead writer thread would never drain
    done.start()
    done.join(20)
    assert not done.is_alive() and sorted(list_spool(spool.path)) == ["ed1-2"]
