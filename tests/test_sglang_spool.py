"""SGLang hand-off without an engine: stitcher, spool files, spool lifetime, the scheduler hook.

Pure python (no sglang import): runs everywhere.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from enum import Enum
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from eagle_data.engines.sglang_hook import hook_specs, make_capture_hook, make_layer_hook
from eagle_data.engines.sglang_spool import (HOOK_STATS, SPOOL_PREFIX, Piece, Spool, SpoolListing, StitchError,
                                              list_spool, read_error, read_hook_stats, read_piece, remove_stale_spools,
                                              stitch, write_error, write_piece)

H, K = 4, 3


def _rows(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (t,), generator=g), torch.randn(t, K * H, generator=g), torch.randn(t, H, generator=g)


def _pieces(ids, aux, fin, cuts):
    """Split rows at ``cuts`` into Pieces with increasing seq."""
    bounds = [0, *cuts, ids.shape[0]]
    return [Piece(a, ids[a:b], aux[a:b], fin[a:b], seq=i) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]


# ----------------------------------------------------------------------------- stitcher

def test_stitch_in_order_and_any_arrival_order():
    ids, aux, fin = _rows(300)
    ps = _pieces(ids, aux, fin, [128, 256])
    for order in (ps, ps[::-1], [ps[1], ps[0], ps[2]]):
        got = stitch("s", ids, order)
        assert torch.equal(got["aux"], aux) and torch.equal(got["final"], fin) and sorted(got) == ["aux", "final"]


def test_stitch_single_piece():
    ids, aux, fin = _rows(5)
    got = stitch("s", ids, _pieces(ids, aux, fin, []))
    assert torch.equal(got["aux"], aux) and torch.equal(got["final"], fin)


def test_stitch_joins_the_per_row_extras_and_checks_their_rows():
    ids, aux, fin = _rows(300)
    scale, ok = torch.rand(300, K), torch.rand(300) > 0.5
    ps = _pieces(ids, aux, fin, [128, 256])
    for p in ps:
        p.extra = {"aux_scale": scale[p.offset:p.offset + p.input_ids.shape[0]],
                   "ok": ok[p.offset:p.offset + p.input_ids.shape[0]]}
    got = stitch("s", ids, ps[::-1])
    assert torch.equal(got["aux_scale"], scale) and torch.equal(got["ok"], ok)
    ps[1].extra["ok"] = ps[1].extra["ok"][:-1]
    with pytest.raises(StitchError, match="chunk at offset 128 has 128 ids.*'ok': \\(127,\\)"):
        stitch("s", ids, ps)
    ps[1].extra = {"aux_scale": ps[1].extra["aux_scale"]}
    with pytest.raises(StitchError, match="width/dtype"):  # a chunk without a field the others have
        stitch("s", ids, ps)


@pytest.mark.parametrize("case, pattern", [
    ("empty", "no hidden-state rows"),
    ("cached_prefix", r"rows \[0, 128\) of 300 missing .*radix"),
    ("gap", r"gap: rows \[128, 256\) of 300 missing"),
    ("tail", r"rows \[256, 300\) of 300 missing"),
    ("duplicate", "duplicate chunk at offset 128"),
    ("overlap", "chunk at offset 100 overlaps rows up to 128"),
    ("out_of_order", "produced before the chunk at offset 0"),
    ("foreign_rows", "token ids of the chunk at offset 128 differ"),
    ("row_mismatch", "chunk at offset 0 has 128 ids, 127 aux rows"),
    ("past_end", "past T=300"),
    ("width", "width/dtype"),
])
def test_stitch_errors_name_the_sample(case, pattern):
    ids, aux, fin = _rows(300)
    p0, p1, p2 = _pieces(ids, aux, fin, [128, 256])
    bad = {
        "empty": [],
        "cached_prefix": [p1, p2],
        "gap": [p0, p2],
        "tail": [p0, p1],
        "duplicate": [p0, p1, Piece(128, p1.input_ids, p1.aux, p1.final, seq=5), p2],
        "overlap": [p0, Piece(100, ids[100:256], aux[100:256], fin[100:256], 1), p2],
        "out_of_order": [Piece(0, p0.input_ids, p0.aux, p0.final, 9), p1, p2],
        "foreign_rows": [p0, Piece(128, p1.input_ids + 1, p1.aux, p1.final, 1), p2],
        "row_mismatch": [Piece(0, p0.input_ids, p0.aux[:-1], p0.final, 0), p1, p2],
        "past_end": [p0, p1, Piece(256, ids[250:300].repeat(2)[:60], aux[:60], fin[:60], 2)],
        "width": [p0, Piece(128, p1.input_ids, p1.aux[:, :H], p1.final, 1), p2],
    }[case]
    with pytest.raises(StitchError, match=pattern) as ei:
        stitch("sample_000000042", ids, bad)
    assert "sample_000000042" in str(ei.value)


# ----------------------------------------------------------------------------- spool files

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_piece_files_round_trip_bit_exact(tmp_path, dtype):
    ids, aux, fin = _rows(10)
    aux, fin = aux.to(dtype), fin.to(dtype)
    write_piece(tmp_path, "ed1-7", 128, 3, ids, aux, fin)
    (tmp_path / "ed1-7@0000000000@0000000009.safetensors.tmp").write_bytes(b"partial")  # ignored
    files = list_spool(tmp_path)
    assert list(files) == ["ed1-7"] and files["ed1-7"][0][0] == "chunk"
    p = read_piece(files["ed1-7"][0][1])
    assert (p.offset, p.seq) == (128, 3)
    assert torch.equal(p.input_ids, ids) and torch.equal(p.aux, aux) and torch.equal(p.final, fin)
    assert p.aux.dtype == dtype and p.extra == {}


def test_piece_files_round_trip_fp8_scales_and_flags(tmp_path):
    from eagle_data.format.fp8 import quantize
    ids, aux, fin = _rows(10)
    (q, s), ok = quantize(aux, K), torch.tensor([True, False] * 5)
    write_piece(tmp_path, "ed1-7", 0, 1, ids, q, fin.bfloat16(), {"aux_scale": s, "ok": ok})
    p = read_piece(list_spool(tmp_path)["ed1-7"][0][1])
    assert p.aux.dtype == torch.float8_e4m3fn and torch.equal(p.aux.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(p.extra["aux_scale"], s) and torch.equal(p.extra["ok"], ok) and p.final.dtype == torch.bfloat16


def test_stale_spool_of_dead_pid_is_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{SPOOL_PREFIX}{dead.pid}-abc"
    stale.mkdir()
    (stale / "x").write_text("1")
    alive = tmp_path / f"{SPOOL_PREFIX}{os.getppid()}-abc"
    alive.mkdir()
    assert remove_stale_spools(tmp_path) == [stale]
    assert not stale.exists() and alive.exists()
    sp = Spool(tmp_path)
    assert sp.path.is_dir() and sp.path.name.startswith(f"{SPOOL_PREFIX}{os.getpid()}-")
    sp.close()
    assert not sp.path.exists()


@pytest.mark.parametrize("how", ["exit", "sigterm", "keyboardinterrupt"])
def test_spool_removed_on_exit_sigterm_ctrl_c(tmp_path, how):
    code = textwrap.dedent(f"""
        import os, signal, sys
        from eagle_data.engines.sglang_spool import Spool
        sp = Spool({str(tmp_path)!r}); Spool.install_signal_handlers()
        (sp.path / "chunk").write_bytes(b"x")
        print(sp.path, flush=True)
        if {how!r} == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif {how!r} == "keyboardinterrupt":
            os.kill(os.getpid(), signal.SIGINT)
        import time; time.sleep(1)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    path = r.stdout.strip().splitlines()[0]
    assert path.startswith(str(tmp_path))
    assert not os.path.exists(path), (how, r.returncode, r.stderr[-500:])
    if how == "sigterm":
        assert r.returncode == -signal.SIGTERM


# ----------------------------------------------------------------------------- hook with a fake batch

class Mode(Enum):  # the subset of sglang's ForwardMode the hook uses
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4

    def is_decode(self):
        return self is Mode.DECODE

    def is_idle(self):
        return self is Mode.IDLE


def _fake_pass(mode, rids, seqs, pres, packed=False, seed=0):
    n = sum(seqs)
    ids, aux, fin = _rows(n, seed)
    auxarg = aux if packed else list(aux.split(H, dim=1))
    fb = SimpleNamespace(forward_mode=mode, rids=rids, extend_seq_lens_cpu=seqs, extend_prefix_lens_cpu=pres)
    return (ids, fin, None, fb, auxarg), (ids, aux, fin)


def _engine_aux_hook(tmp_path):
    return make_capture_hook({"spool_dir": str(tmp_path), "rid_prefix": "ed1-"})


@pytest.mark.parametrize("packed", [False, True])
def test_hook_splits_a_pass_by_rid_and_prefix(tmp_path, packed):
    hook = _engine_aux_hook(tmp_path)
    args, (ids, aux, fin) = _fake_pass(Mode.EXTEND, ["ed1-1", "warmup", "ed1-2"], [5, 7, 123], [0, 0, 128], packed)
    hook(None, args, None)
    hook.drain()
    files = list_spool(tmp_path)
    assert sorted(files) == ["ed1-1", "ed1-2"]  # foreign rid skipped
    p1, p2 = read_piece(files["ed1-1"][0][1]), read_piece(files["ed1-2"][0][1])
    assert p1.offset == 0 and torch.equal(p1.aux, aux[:5]) and torch.equal(p1.final, fin[:5])
    assert p2.offset == 128 and torch.equal(p2.input_ids, ids[12:]) and torch.equal(p2.aux, aux[12:])
    assert p2.seq > p1.seq
    st = read_hook_stats(tmp_path)  # one pass, two pieces, all of the pass's rows (the foreign ones too)
    assert (st["passes"], st["pieces"], st["bytes"]) == (1, 2, sum(x.nbytes for x in (ids, aux, fin)) + 135)
    assert st["put_s"] > 0 and st["write_s"] > 0 and st["pin_s"] == 0  # (pinned buffers only on a GPU)


def test_hook_ignores_decode_and_refuses_mixed_and_bad_batches(tmp_path):
    hook = _engine_aux_hook(tmp_path)
    hook(None, _fake_pass(Mode.DECODE, ["ed1-1"], [1], [9])[0], None)
    hook.drain()
    assert list_spool(tmp_path) == {}
    hook(None, _fake_pass(Mode.MIXED, ["ed1-1", "ed1-2"], [4, 1], [0, 9])[0], None)
    files = list_spool(tmp_path)
    assert {k for k, _ in files["ed1-1"]} == {"error"}
    assert "MIXED" in read_error(files["ed1-2"][0][1])
    args, _ = _fake_pass(Mode.EXTEND, ["ed1-3"], [6], [0])
    args[3].extend_seq_lens_cpu = [5]  # rows do not add up
    hook(None, args, None)
    assert "inconsistent batch" in read_error(list_spool(tmp_path)["ed1-3"][0][1])
    args, _ = _fake_pass(Mode.EXTEND, ["ed1-4"], [6], [0])
    hook(None, args[:4] + (None,), None)  # aux capture off
    assert "no aux hidden states" in read_error(list_spool(tmp_path)["ed1-4"][0][1])


@pytest.mark.parametrize("final_dtype", [None, "bfloat16", "float8_e4m3fn"])
def test_hook_stores_fp8_as_quantize_does_and_flags_non_finite_rows(tmp_path, final_dtype):
    """out_dtype fp8: the chunk holds exactly ``quantize`` of the rows (values and scales), the final
    rows in their own dtype; ``ok`` is False on the one row holding a NaN, True elsewhere."""
    from eagle_data.format.fp8 import quantize
    hook = make_capture_hook({"spool_dir": str(tmp_path), "rid_prefix": "ed1-", "out_dtype": "float8_e4m3fn",
                              "final_out_dtype": final_dtype})
    args, (ids, aux, fin) = _fake_pass(Mode.EXTEND, ["ed1-1", "ed1-2"], [5, 4], [0, 0], packed=True)
    args[4][6, 1] = float("nan")  # row 1 of ed1-2, aux layer 0
    hook(None, args, None)
    hook.drain()
    p1, p2 = (read_piece(list_spool(tmp_path)[r][0][1]) for r in ("ed1-1", "ed1-2"))
    q, sc = quantize(aux[:5], K)
    assert p1.aux.dtype == torch.float8_e4m3fn and torch.equal(p1.aux.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(p1.extra["aux_scale"], sc) and p1.extra["ok"].tolist() == [True] * 5
    assert p2.extra["ok"].tolist() == [True, False, True, True] and p2.extra["aux_scale"][1].isnan().any()
    if final_dtype == "float8_e4m3fn":
        fq, fs = quantize(fin[:5], 1)
        assert torch.equal(p1.final.view(torch.uint8), fq.view(torch.uint8)) and torch.equal(p1.extra["final_scale"], fs)
    else:
        assert "final_scale" not in p1.extra
        assert torch.equal(p1.final, fin[:5].to(torch.bfloat16 if final_dtype else torch.float32))


@pytest.fixture
def layer_hooks(tmp_path):
    specs = hook_specs(str(tmp_path), "ed1-", [1, 3, 5])
    assert [s["target_modules"][0] for s in specs[:3]] == [  # aux id k: the input norm of layer k + 1
        "model.layers.2.input_layernorm", "model.layers.4.input_layernorm", "model.layers.6.input_layernorm"]
    assert specs[0]["target_modules"][1] == "*.model.layers.2.input_layernorm"  # e.g. language_model.model...
    assert specs[3]["target_modules"] == ["logits_processor"]
    return [make_layer_hook(s["config"]) for s in specs[:3]], make_capture_hook(specs[3]["config"])


def _add_norm(h, r):
    """What a fused add-RMSNorm does: residual += hidden in place, returns (normed, residual)."""
    r.add_(h)
    return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6), r


def test_layer_hooks_store_the_residual_stream_before_it_changes_in_place(tmp_path, layer_hooks):
    """aux slot i = the residual the next layer's input add-norm returns, copied when the norm returns:
    the following add-norms update that tensor in place without changing what was stored. A norm
    called on the stream alone (no residual yet) stores its input."""
    layers, logits = layer_hooks
    args, (ids, aux, fin) = _fake_pass(Mode.EXTEND, ["ed1-1", "other"], [5, 2], [0, 0])
    for i, hook in enumerate(layers):
        want = aux[:, i * H:(i + 1) * H]
        if i == 0:
            hook(None, (want.clone(),), want * 2)  # norm(stream): its input is the stream
            continue
        r = torch.randn(7, H)
        h = want - r
        out = _add_norm(h, r)
        hook(None, (h, r), out)
        _add_norm(torch.ones(7, H), out[1])  # the post-attention add-norm changes the stream in place
    logits(None, args[:4] + (None,), None)
    logits.drain()
    p = read_piece(list_spool(tmp_path)["ed1-1"][0][1])
    torch.testing.assert_close(p.aux, aux[:5], rtol=0, atol=1e-6)
    assert torch.equal(p.final, fin[:5]) and torch.equal(p.input_ids, ids[:5])


def test_layer_hooks_refuse_a_missing_or_doubled_slot(tmp_path, layer_hooks):
    layers, logits = layer_hooks
    h = torch.randn(4, H)
    for rid, slots, why in (("ed1-1", [0, 1], "did not run in this pass"),  # layer 6's norm never ran (fused)
                            ("ed1-2", [0, 1, 2, 2], "filled twice")):  # a pattern matched two modules
        args, _ = _fake_pass(Mode.EXTEND, [rid], [4], [0])
        for i in slots:
            layers[i](None, (h,), h)
        logits(None, args[:4] + (None,), None)
        assert why in read_error(list_spool(tmp_path)[rid][0][1]), rid
    # every pass starts empty: a pass that is not ours still clears the slots
    for i in range(3):
        layers[i](None, (h,), h)
    logits(None, _fake_pass(Mode.EXTEND, ["warmup"], [4], [0])[0][:4] + (None,), None)
    args, _ = _fake_pass(Mode.EXTEND, ["ed1-3"], [4], [0])
    logits(None, args[:4] + (None,), None)
    assert "did not run in this pass" in read_error(list_spool(tmp_path)["ed1-3"][0][1])


def test_writer_bounds_the_bytes_in_flight(tmp_path, monkeypatch):
    """The hook waits only when the passes waiting to be written exceed max_pending_bytes."""
    import eagle_data.engines.sglang_hook as hk
    gate, seen = threading.Event(), []
    real = hk.write_piece

    def slow_write(*a, **kw):
        gate.wait(5)
        return real(*a, **kw)

    monkeypatch.setattr(hk, "write_piece", slow_write)
    nbytes = 3 * ((K + 1) * H * 4 + 8 + 1)  # one 3-row pass: fp32 rows + int64 ids + the ok flags
    hook = make_capture_hook({"spool_dir": str(tmp_path), "rid_prefix": "ed1-", "max_pending_bytes": 2 * nbytes})

    def run():
        for j in range(3):
            hook(None, _fake_pass(Mode.EXTEND, [f"ed1-{j}"], [3], [0])[0], None)
            seen.append(j)

    t = threading.Thread(target=run)
    t.start()
    t.join(0.5)
    assert seen == [0, 1]  # the third pass waits for room
    gate.set()
    t.join(5)
    hook.drain()
    assert seen == [0, 1, 2] and sorted(list_spool(tmp_path)) == ["ed1-0", "ed1-1", "ed1-2"]


def test_hook_only_tp_rank_0_writes(tmp_path, monkeypatch):
    import eagle_data.engines.sglang_hook as hk
    monkeypatch.setattr(hk, "_tp_rank", lambda: 1)
    assert make_capture_hook({"spool_dir": str(tmp_path), "rid_prefix": "ed1-"}) is None  # sglang registers nothing
    assert make_layer_hook({"spool_dir": str(tmp_path), "slot": 0, "n_aux": 3}) is None
    monkeypatch.setattr(hk, "_tp_rank", lambda: 0)
    assert callable(make_capture_hook({"spool_dir": str(tmp_path), "rid_prefix": "ed1-"}))


def test_hook_failure_is_reported_per_request(tmp_path):
    hook = _engine_aux_hook(tmp_path)
    args, _ = _fake_pass(Mode.EXTEND, ["ed1-1"], [4], [0])
    args = (args[0], args[1], None, args[3], [torch.zeros(4, H), "not a tensor"])  # torch.cat fails
    hook(None, args, None)
    assert "capture hook failed" in read_error(list_spool(tmp_path)["ed1-1"][0][1])


# ----------------------------------------------------------------------------- collecting a finished request

def _collector(tmp_path, timeout):
    """An SGLangBackend with no engine: enough for ``_collect`` (spool dir, timeout)."""
    from eagle_data.engines.sglang import SGLangBackend
    be = SGLangBackend.__new__(SGLangBackend)
    be.spool = Spool.__new__(Spool)  # the files of tmp_path, no ring
    be.spool.path, be.spool._listing, be.spool.arena = tmp_path, SpoolListing(tmp_path), None
    be.collect_timeout_s, be._chunks = timeout, {}
    be.collect_stats = Counter()
    return be


def _collect(be, ids):
    import asyncio
    return asyncio.run(be._collect("sample_7", ids, "ed1-7", {"meta_info": {"prompt_tokens": ids.shape[0]}}))


def test_collect_reads_each_chunk_once_while_waiting_for_the_rest(tmp_path, monkeypatch):
    """Rows [0, 4) arrive first, [4, 6) after many polls: each chunk file is read once, and the
    joined rows are the writer's."""
    import eagle_data.engines.sglang_spool as spool_mod

    ids, aux, fin = _rows(6)
    reads = []
    monkeypatch.setattr(spool_mod, "read_piece", lambda p: reads.append(p.name) or read_piece(p))
    write_piece(tmp_path, "ed1-7", 0, 1, ids[:4], aux[:4], fin[:4])

    def late_writer():
        threading.Event().wait(0.3)  # ~30 polls of 10 ms
        write_piece(tmp_path, "ed1-7", 4, 2, ids[4:], aux[4:], fin[4:])

    t = threading.Thread(target=late_writer)
    t.start()
    be = _collector(tmp_path, 5.0)
    got = _collect(be, ids)
    t.join()
    assert torch.equal(got.aux_hidden_states, aux) and torch.equal(got.hidden_states, fin)
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 2
    assert be.collect_stats["files_read"] == 2 and be.collect_stats["polls"] > 2


def test_one_listing_of_the_spool_serves_every_waiting_request(tmp_path, monkeypatch):
    """Each request gets its own finished files (chunks and error records, not temporaries, not
    another request's whose rid it prefixes); 100 requests asking within one interval cost one
    listing of the directory, a file written after it is seen once the interval has passed."""
    ids, aux, fin = _rows(4)
    for rid in ("ed1-7", "ed1-70"):
        write_piece(tmp_path, rid, 0, 1, ids[:2], aux[:2], fin[:2])
    write_piece(tmp_path, "ed1-7", 2, 2, ids[2:], aux[2:], fin[2:])
    write_error(tmp_path, "ed1-8", 3, "mixed batch")
    (tmp_path / "ed1-9@0000000000@0000000004.safetensors.tmp").write_bytes(b"partial")
    (tmp_path / HOOK_STATS).write_text("{}")
    lists = []
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: lists.append(p) or real(p))
    sp = SpoolListing(tmp_path)
    sp.EVERY_S = 60.0
    got = {rid: sorted(p.name for p in sp.files(rid)) for rid in ("ed1-7", "ed1-70", "ed1-8", "ed1-9")}
    assert got == {"ed1-7": ["ed1-7@0000000000@0000000001.safetensors", "ed1-7@0000000002@0000000002.safetensors"],
                   "ed1-70": ["ed1-70@0000000000@0000000001.safetensors"],
                   "ed1-8": ["ed1-8@ERROR@0000000003.json"], "ed1-9": []}
    assert all(p.parent == tmp_path for p in sp.files("ed1-7"))
    for i in range(100):
        sp.files(f"ed1-{100 + i}")
    write_piece(tmp_path, "ed1-9", 0, 4, ids, aux, fin)
    assert sp.files("ed1-9") == [] and len(lists) == 1  # the listing of this interval
    sp.EVERY_S = 0.0
    assert [p.name for p in sp.files("ed1-9")] == ["ed1-9@0000000000@0000000004.safetensors"] and len(lists) == 2


def test_collect_waits_while_the_spool_changes_and_gives_up_when_it_stops(tmp_path):
    """A lagging writer (its chunk arrives after 3 timeouts, other files keep arriving meanwhile) is
    waited for; with no change in the spool for one timeout the request fails naming the sample."""
    ids, aux, fin = _rows(6)

    def lagging_writer():
        for i in range(6):  # another request's files: the writer is alive
            threading.Event().wait(0.1)
            write_piece(tmp_path, f"ed1-{100 + i}", 0, i, ids, aux, fin)
        write_piece(tmp_path, "ed1-7", 0, 9, ids, aux, fin, {"ok": torch.ones(6, dtype=torch.bool)})

    t = threading.Thread(target=lagging_writer)
    t.start()
    got = _collect(_collector(tmp_path, 0.2), ids)
    t.join()
    assert torch.equal(got.aux_hidden_states, aux) and got.finite is True and got.aux_scale is None
    assert list_spool(tmp_path).get("ed1-7") is None  # collected files are removed
    (tmp_path / "quiet").mkdir()
    with pytest.raises(StitchError, match=r"sample_7.*no hidden-state rows.*waited 0.2 s with no change in the "
                       r"spool .*quiet, \d+ bytes free there; where the hook could not write the rows, the engine's log"):
        _collect(_collector(tmp_path / "quiet", 0.2), ids)


# ----------------------------------------------------------------------------- the in-flight budget

@pytest.mark.parametrize("dtypes", [(None, None), (torch.bfloat16, torch.bfloat16),
                                    (torch.float8_e4m3fn, torch.float8_e4m3fn), (torch.float8_e4m3fn, torch.bfloat16)])
def test_stored_row_bytes_is_what_the_hook_hands_over(dtypes):
    """The budget's bytes per token equal the bytes of the rows the hook copies off the device."""
    from eagle_data.engines.sglang_spool import stored_row_bytes
    from eagle_data.engines.sglang_hook import stored_rows

    ids, aux, fin = _rows(13)
    got = stored_rows(ids, aux, fin, dtypes)
    want = stored_row_bytes(K, H, dtypes[0] or aux.dtype, dtypes[1] or fin.dtype)
    assert sum(t.nbytes for t in got.values()) == 13 * want


def test_admission_keeps_the_stored_bytes_in_flight_within_the_budget():
    """Requests are admitted in order while their rows fit ``max_inflight_bytes`` (a longer one
    runs alone), every one is answered, in order."""
    import asyncio

    from eagle_data.engines.sglang import SGLangBackend

    be = SGLangBackend.__new__(SGLangBackend)
    be.max_inflight, be.max_inflight_bytes, be.row_bytes, be._budget = 100, 1000, 10, None  # 100 tokens
    live, seen = {}, []

    class Engine:
        async def async_generate(self, input_ids, rid, sampling_params):
            live[rid] = len(input_ids)
            seen.append((len(live), sum(live.values())))
            await asyncio.sleep(0.01 * (1 + len(input_ids) % 3))
            return {"rid": rid}

    async def collect(key, ids, rid, out):
        await asyncio.sleep(0.005)
        del live[rid]
        return key

    be.engine, be._collect = Engine(), collect
    lengths = [30, 50, 20, 100, 250, 40, 10, 60, 5]
    items = [(f"k{i}", torch.zeros(n, dtype=torch.long), f"r{i}") for i, n in enumerate(lengths)]
    assert asyncio.run(be._run(items)) == [k for k, _, _ in items]
    assert all(n == 1 or tokens <= 100 for n, tokens in seen) and max(n for n, _ in seen) >= 3
    assert (1, 250) in seen  # the long one ran alone


@pytest.mark.parametrize("prefetch, lengths, taken_at_first", [
    (1, [30] * 6, 5),  # while b0 is held: b1..b3 = 90 tokens under the budget of 100, so b4 too
    (1, [120] * 4, 3),  # each batch past the budget alone: the one later batch of prefetch
    (4, [30] * 8, 6),  # prefetch asks for more than the budget would take
    (1, [10] * 3, 3),  # all of them fit
])
def test_capture_iter_takes_batches_ahead_while_their_rows_fit_the_budget(prefetch, lengths, taken_at_first):
    """While the caller holds a batch, the later batches already taken from it are ``prefetch`` and
    more while their rows stay under ``max_inflight_bytes`` (one batch past it at most); every batch
    comes back, in order, each request asked once."""
    import asyncio

    from eagle_data.engines.sglang import SGLangBackend

    be = SGLangBackend.__new__(SGLangBackend)
    be.max_inflight, be.max_inflight_bytes, be.row_bytes, be._budget = 100, 1000, 10, None  # 100 tokens
    be._orphans, be._chunks, be._counter, be._prefix = set(), {}, 0, "ed0-"
    asked = []

    class Engine:
        loop = asyncio.new_event_loop()

        async def async_generate(self, input_ids, rid, sampling_params):
            asked.append(rid)
            return {"rid": rid}

    async def collect(key, ids, rid, out):
        return key

    be.engine, be._collect = Engine(), collect
    taken = []

    def batches():
        for b, n in enumerate(lengths):
            taken.append(b)
            yield [(f"b{b}", torch.zeros(n, dtype=torch.long))]

    try:
        it = be.capture_iter(batches(), prefetch=prefetch)
        first = next(it)
        assert (first, len(taken)) == (["b0"], taken_at_first)
        assert [first, *it] == [[f"b{b}"] for b in range(len(lengths))]
        assert sorted(asked) == sorted(set(asked)) and len(asked) == len(lengths)
    finally:
        it.close()
        Engine.loop.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from(["chunk", "error", "tmp"]), st.integers(0, 3)),
                max_size=40))
def test_the_listing_groups_files_by_rid_as_list_spool_does(files):
    """Over generated spools (rids that prefix one another, chunks, error records, temporaries and
    the hook's stats file): every rid's files are exactly the finished ones the pieces' regex reads
    as that rid's (:func:`list_spool`), and a rid with none gets none."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / HOOK_STATS).write_text("{}")
        for seq, (r, kind, off) in enumerate(files):
            name = f"ed1-{r}@" + ("ERROR" if kind == "error" else f"{off:010d}") + f"@{seq:010d}"
            name += ".json" if kind == "error" else ".safetensors" + (".tmp" if kind == "tmp" else "")
            (Path(d) / name).write_bytes(b"x")
        want = {rid: sorted(p.name for _, p in fs) for rid, fs in list_spool(d).items()}
        listing = SpoolListing(Path(d))
        for r in range(32):
            assert sorted(p.name for p in listing.files(f"ed1-{r}")) == want.get(f"ed1-{r}", [])
