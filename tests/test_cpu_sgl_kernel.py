"""The stand-in ``sgl_kernel`` ops that SGLang's EAGLE speculative decoding calls on CPU.

Golden cases are those of sgl-kernel's own tests (``sgl-kernel/tests/speculative/test_eagle_utils.py``,
``test/srt/cpu/test_spec_kernels.py``); attention is checked against
``torch.nn.functional.scaled_dot_product_attention`` on explicitly built key sets.
"""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import eagle_data.engines.cpu_sgl_kernel.sgl_kernel as sk

ops = torch.ops.sgl_kernel


def test_verify_tree_greedy_golden_case_of_sgl_kernel():
    cand = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
    ri = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
    nxt = torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
    sib = torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
    tp = torch.full((2, 6), 18)
    tp[0, 0], tp[0, 3], tp[0, 4], tp[1, 0], tp[1, 4] = 3, 4, 5, 11, 12
    predicts = torch.full((12,), -1, dtype=torch.int32)
    accept = torch.full((2, 4), -1, dtype=torch.int32)
    num = torch.zeros(2, dtype=torch.int32)
    ops.verify_tree_greedy_cpu(predicts, accept, num, cand, ri, nxt, sib, tp)
    assert predicts.tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert accept.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert num.tolist() == [3, 2]


def test_verify_tree_greedy_chain_hand_case():
    predicts = torch.full((4,), -1, dtype=torch.int32)
    accept = torch.full((1, 4), -1, dtype=torch.int32)
    num = torch.empty(1, dtype=torch.int32)
    ops.verify_tree_greedy_cpu(predicts, accept, num, torch.tensor([[10, 3, 4, 5]]), torch.arange(4)[None],
                               torch.tensor([[1, 2, 3, -1]]), torch.full((1, 4), -1), torch.tensor([[3, 4, 9, 9]]))
    assert predicts.tolist() == [3, 4, 9, -1] and accept.tolist() == [[0, 1, 2, -1]] and num.tolist() == [2]


def _build(parent_list, selected, seq_lens, topk, steps, n, mode):
    bs = len(seq_lens)
    size = bs * n * n + (int(sum(seq_lens)) * n if mode == sk.tree_ops.FULL_MASK else 0)
    mask = torch.ones(size, dtype=torch.bool)
    pos = torch.zeros(bs * n, dtype=torch.int64)
    ri, nxt, sib = torch.full((3, bs, n), -1, dtype=torch.int64)
    ops.build_tree_kernel_efficient_cpu(parent_list, selected, torch.tensor(seq_lens), mask, pos, ri, nxt, sib,
                                        topk, steps, n, mode)
    return mask, pos, ri, nxt, sib


def test_build_tree_topk2_hand_case():
    """Nodes 1 and 2 are children of the root, node 3 a child of node 1 (sgl-kernel's case)."""
    mask, pos, ri, nxt, sib = _build(torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]), [5], 2, 2, 4,
                                     sk.tree_ops.QLEN_ONLY)
    assert ri.tolist() == [[0, 1, 2, 3]] and nxt.tolist() == [[1, 3, -1, -1]] and sib.tolist() == [[-1, 2, -1, -1]]
    assert pos.tolist() == [5, 6, 6, 7]
    assert mask.view(4, 4).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    full, pos_f, *_ = _build(torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2]]), [5], 2, 2, 4,
                             sk.tree_ops.FULL_MASK)
    rows = full.view(4, 9)
    assert rows[:, :5].all() and torch.equal(rows[:, 5:], mask.view(4, 4)) and pos_f.tolist() == pos.tolist()


def test_build_tree_chain_is_causal_with_consecutive_positions():
    steps, n, lens = 3, 4, [7, 12]
    parents = torch.arange(-1, steps - 1).repeat(2, 1)
    sel = torch.arange(steps).repeat(2, 1)
    mask, pos, ri, nxt, sib = _build(parents, sel, lens, 1, steps, n, sk.tree_ops.QLEN_ONLY)
    for b, L in enumerate(lens):
        assert torch.equal(mask.view(2, n, n)[b], torch.ones(n, n, dtype=torch.bool).tril())
        assert pos[b * n:(b + 1) * n].tolist() == [L + i for i in range(n)]
        assert nxt[b].tolist() == [1, 2, 3, -1] and (sib[b] == -1).all()
    assert ri.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(RuntimeError, match="BITPACKING"):
        _build(parents, sel, lens, 1, steps, n, sk.tree_ops.QLEN_ONLY_BITPACKING)


def test_fill_ops_and_cache_locs():
    acc = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]], dtype=torch.int32)
    bonus = torch.empty(2, dtype=torch.int32)
    ops.fill_bonus_tokens_cpu(acc, torch.tensor([1, 3], dtype=torch.int32), bonus, 4)
    assert bonus.tolist() == [5, 11]
    ai = torch.tensor([[0, 1, -1, -1], [16, 18, 21, -1], [32, -1, -1, -1]], dtype=torch.int32)
    ocl = torch.randperm(4096)[:48]
    out = torch.zeros(12, dtype=torch.int64)
    sk.fill_accept_out_cache_loc_cpu(ai, ocl, out)  # sglang 0.5.23 passes no size
    assert out[:6].tolist() == ocl[[0, 1, 16, 18, 21, 32]].tolist() and (out[6:] == 0).all()

    rtt = torch.randint(0, 10000, (5, 32), dtype=torch.int32)
    rpi, lens = torch.tensor([4, 0, 2]), torch.tensor([5, 0, 17])
    locs = torch.empty(3 * 2 * 3, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous_cpu(rpi, rtt, lens, locs, 32, 2, 3)
    assert locs.tolist() == [int(v) for i, r in enumerate([4, 0, 2]) for v in rtt[r, lens[i]:lens[i] + 6]]
    for bad in ((rpi, rtt.long(), lens, locs), (rpi, rtt, lens, locs[:-1])):
        with pytest.raises(RuntimeError):
            ops.assign_draft_cache_locs_contiguous_cpu(*bad, 32, 2, 3)

    start, end = torch.tensor([4, 0, 11]), torch.tensor([9, 7, 12])
    got = torch.empty(13, dtype=torch.int64)
    ops.assign_extend_cache_locs_cpu(torch.tensor([1, 3, 0]), rtt, start, end, got, 32)
    assert got.tolist() == rtt[1, 4:9].tolist() + rtt[3, 0:7].tolist() + rtt[0, 11:12].tolist()

    table = torch.zeros(5, 32, dtype=torch.int32)
    new = torch.randperm(4096)[:13]
    ops.assign_req_to_token_pool_cpu(torch.tensor([2, 4, 1]), table, torch.tensor([0, 3, 8]),
                                     torch.tensor([6, 3, 15]), new, 32)
    assert table[2, :6].tolist() == new[:6].tolist() and table[1, 8:15].tolist() == new[6:13].tolist()
    assert int(table.count_nonzero()) == int(new.count_nonzero())


def test_build_draft_decode_metadata_rows_are_prefix_then_candidate_slots():
    rtt = torch.arange(2 * 40, dtype=torch.int32).view(2, 40)
    out = ops.build_draft_decode_metadata_cpu(rtt, torch.tensor([1, 0]), torch.tensor([3, 5]), 2, 3, 40)
    assert out.shape == (4, 40) and out.dtype == torch.int32
    assert out[0, :6].tolist() == [40, 41, 42, 43, 44, 45]          # request 1, candidate 0: slots 3..5
    assert out[1, :6].tolist() == [40, 41, 42, 46, 47, 48]          # candidate 1: slots 6..8
    assert out[3, :8].tolist() == [0, 1, 2, 3, 4, 8, 9, 10]         # request 0 (len 5), candidate 1


def test_copy_all_layer_kv_cache_reads_every_source_before_writing():
    bufs = [torch.arange(6 * 4, dtype=torch.float32).view(6, 4), torch.arange(6 * 2, dtype=torch.int64).view(6, 2)]
    before = [b.clone() for b in bufs]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs], dtype=torch.int64)
    ops.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([1, 2]), torch.tensor([2, 1]))  # a swap
    for b, o in zip(bufs, before):
        assert torch.equal(b[1], o[2]) and torch.equal(b[2], o[1]) and torch.equal(b[[0, 3, 4, 5]], o[[0, 3, 4, 5]])


def _sdpa(q, keys, values, visible, scale):
    """q [Q, Hq, D], keys/values [S, Hkv, D], visible [Q, S] -> [Q, Hq, D] (torch's own attention)."""
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                          values.transpose(0, 1)[None], attn_mask=visible, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 6)), min_size=1, max_size=3), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_extend_attention_equals_sdpa(reqs, tree, seed):
    """Random prefix / extend lengths, causal or a random ancestor-closed tree mask; the cache
    slots of a request are scattered (a permutation), the extend K/V come from their own tensors."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = 4, 2, 8
    lens = [p + e for p, e in reqs]
    slots = torch.randperm(sum(lens) + 5, generator=g)
    rtt = torch.zeros(len(reqs), max(lens), dtype=torch.int32)
    kb, vb = torch.randn(sum(lens) + 5, hkv, d, generator=g), torch.randn(sum(lens) + 5, hkv, d, generator=g)
    n_ext = sum(e for _, e in reqs)
    q, ke, ve = (torch.randn(n_ext, h, d, generator=g) for h in (hq, hkv, hkv))
    o = torch.empty(n_ext, hq, d)
    masks, start, pos = [], [], 0
    for i, ((p, e), n) in enumerate(zip(reqs, lens)):
        rtt[i, :n] = slots[pos:pos + n].int()
        pos += n
        m = torch.ones(e, e, dtype=torch.bool).tril()
        if tree:  # each node sees itself and a random subset of earlier nodes (any subset is a valid mask here)
            m &= torch.rand(e, e, generator=g) < 0.6
            m |= torch.eye(e, dtype=torch.bool)
        masks.append(m)
    for i, (p, e) in enumerate(reqs):
        start.append(sum(x for _, x in reqs[:i]))
        kb[rtt[i, p:p + e].long()] = ke[start[i]:start[i] + e]   # the backend writes the new K/V first
        vb[rtt[i, p:p + e].long()] = ve[start[i]:start[i] + e]
    tm = torch.cat([m.reshape(-1) for m in masks]) if tree else None
    ops.extend_attention_cpu(q, ke, ve, o, kb, vb, 1.0, 1.0, rtt, torch.arange(len(reqs)), torch.tensor(lens),
                             torch.tensor([e for _, e in reqs]), torch.tensor(start), max(e for _, e in reqs),
                             0.3, 0.0, False, 0, None, None, tm, True)
    for i, ((p, e), n) in enumerate(zip(reqs, lens)):
        s = rtt[i, :n].long()
        vis = torch.cat([torch.ones(e, p, dtype=torch.bool), masks[i]], 1)
        ref = _sdpa(q[start[i]:start[i] + e], kb[s], vb[s], vis, 0.3)
        torch.testing.assert_close(o[start[i]:start[i] + e], ref, rtol=1e-5, atol=1e-5)


def test_decode_attention_writes_the_new_kv_then_attends_over_the_request():
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, slots = 4, 2, 8, 30
    kb, vb = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    rtt = torch.randperm(slots, generator=g)[:20].int().view(2, 10)
    lens = torch.tensor([4, 10])
    loc = torch.stack([rtt[0, 3], rtt[1, 9]]).long()
    q, k, v = torch.randn(2, hq, d, generator=g), torch.randn(2, hkv, d, generator=g), torch.randn(2, hkv, d, generator=g)
    o = torch.empty(2, hq, d)
    ops.decode_attention_cpu(q, kb, vb, 1.0, 1.0, o, k, v, loc, torch.empty(2, hq, 8, d + 1), rtt,
                             torch.tensor([0, 1]), lens, 0.5, 0.0, False, 0, None, None)
    assert torch.equal(kb[loc], k) and torch.equal(vb[loc], v)
    for i in range(2):
        s = rtt[i, :int(lens[i])].long()
        ref = _sdpa(q[i:i + 1], kb[s], vb[s], None, 0.5)
        torch.testing.assert_close(o[i:i + 1], ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="sliding windows"):
        ops.decode_attention_cpu(q, kb, vb, 1.0, 1.0, o, None, None, loc, torch.empty(1), rtt, torch.tensor([0, 1]),
                                 lens, 0.5, 0.0, False, 4096, None, None)


def test_unused_speculative_ops_raise_naming_the_op():
    with pytest.raises(NotImplementedError, match="rotate_input_ids_cpu"):
        sk.rotate_input_ids_cpu()


def _sglang_function(path: str, name: str):
    """A function of sglang's source, compiled alone (its module imports sgl_kernel's CUDA build,
    which does not load here); the test is skipped without the sglang extra."""
    import ast
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("needs the sglang extra")
    tree = ast.parse((Path(spec.submodule_search_locations[0]) / path).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope = {"np": np, "torch": torch}
    exec(compile(ast.Module([node], []), path, "exec"), scope)
    return scope[name]


@st.composite
def _draft_trees(draw):
    """``(mask [B, n, n] bool, seq_lens [B])``: random draft trees in node order (each node's parent
    is an earlier node or none: a root), mask[b, i, j] = j is i or one of its ancestors."""
    b, n = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    mask = torch.zeros(b, n, n, dtype=torch.bool)
    for t in range(b):
        parent = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, n)]
        for i in range(n):
            j = i
            while j >= 0:
                mask[t, i, j] = True
                j = parent[j]
    return mask, torch.tensor(draw(st.lists(st.integers(0, 500), min_size=b, max_size=b)))


@settings(max_examples=60, deadline=None)
@given(_draft_trees())
def test_reconstruct_indices_from_tree_mask_equals_sglangs_host_reference(tree):
    """NGRAM's verify metadata: the links equal sglang's own host-side ``_derive_tree_links``; a
    node's position is its depth (strict ancestors) after the verified prefix; indices are flat."""
    from eagle_data.engines.cpu_sgl_kernel.sgl_kernel.speculative import reconstruct_indices_from_tree_mask

    _derive_tree_links = _sglang_function("srt/speculative/ngram_worker.py", "_derive_tree_links")

    mask, seq_lens = tree
    b, n = mask.shape[:2]
    pos, idx = torch.full((b * n,), -7, dtype=torch.int64), torch.full((b, n), -7, dtype=torch.int64)
    nxt, sib = torch.full((b, n), -7, dtype=torch.int64), torch.full((b, n), -7, dtype=torch.int64)
    reconstruct_indices_from_tree_mask(mask.flatten(), seq_lens, pos, idx, nxt, sib, b, n)
    ref_next, ref_sib = _derive_tree_links(mask.numpy(), b, n)
    assert torch.equal(nxt, ref_next) and torch.equal(sib, ref_sib)
    assert torch.equal(pos.view(b, n), mask.sum(-1) - 1 + seq_lens.view(b, 1))
    assert torch.equal(idx, torch.arange(b * n).view(b, n))
