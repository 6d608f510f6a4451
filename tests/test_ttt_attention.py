"""Memory-linear TTT attention and loss == the dense references (values and gradients); memory
grows linearly in T (and the dense reference's quadratically, so the measurement can fail)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from eagle_train.attention import causal_attention_lse, ttt_attention, ttt_attention_reference
from train_tiny import tiny_batch, tiny_module, tiny_target

TOL = dict(rtol=1e-4, atol=2e-5)


# ---------------------------------------------------------------- references and helpers
def reference(q, k0, v0, key_valid, extra_k, extra_v):
    """The dense reference on [B, nkv, T, d] keys: repeat kv heads, mask0 = causal & key_valid."""
    rep = q.shape[1] // k0.shape[1]
    r = (lambda x: x.repeat_interleave(rep, dim=1))
    t = q.shape[2]
    mask0 = (torch.ones(t, t, dtype=torch.bool).tril()[None] & key_valid[:, None, :])[:, None]
    return ttt_attention_reference(q, r(k0), r(v0), mask0, [r(x) for x in extra_k], [r(x) for x in extra_v])


def make_inputs(b, nh, nkv, t, d, steps, seed=0, dtype=torch.float32):
    """q [B, nh, T, d]; k0, v0 and (steps - 1) extras [B, nkv, T, d], all requiring grad."""
    g = torch.Generator().manual_seed(seed)

    def mk(h):
        return torch.randn(b, h, t, d, generator=g, dtype=dtype).requires_grad_()

    return mk(nh), mk(nkv), mk(nkv), [mk(nkv) for _ in range(steps - 1)], [mk(nkv) for _ in range(steps - 1)]


def padding(kind, b, t):
    """bool [B, T] key_valid: "none", "tails" (right padding, lengths t, t-5, ...), "holes"."""
    kv = torch.ones(b, t, dtype=torch.bool)
    if kind == "tails":
        for i in range(b):
            kv[i, max(1, t - 5 * i):] = False
    elif kind == "holes":
        kv[:, 1::3] = False
    return kv


def leaves(q, k0, v0, ek, ev):
    return [q, k0, v0, *ek, *ev]


def compare(q, k0, v0, ek, ev, kv, **kw):
    """Forward and backward (random cotangent) of ttt_attention vs the reference."""
    out = ttt_attention(q, k0, v0, kv, ek, ev, **kw)
    ref = reference(q, k0, v0, kv, ek, ev)
    torch.testing.assert_close(out, ref, **TOL)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * cot).sum(), leaves(q, k0, v0, ek, ev))
    want = torch.autograd.grad((ref * cot).sum(), leaves(q, k0, v0, ek, ev))
    for name, a, b in zip(["q", "k0", "v0"] + [f"extra{i}" for i in range(2 * len(ek))], got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"grad {name}: {m}")


# ---------------------------------------------------------------- attention: exactness
@pytest.mark.parametrize("steps", [1, 3, 7])
@pytest.mark.parametrize("t", [1, 17, 70])
@pytest.mark.parametrize("pad", ["none", "tails", "holes"])
def test_attention_matches_reference(steps, t, pad):
    q, k0, v0, ek, ev = make_inputs(3, 4, 2, t, 8, steps, seed=t + steps)
    compare(q, k0, v0, ek, ev, padding(pad, 3, t), impl="chunked", chunk=16)  # 70 = 4*16 + 6


@pytest.mark.parametrize("nh,nkv", [(2, 2), (6, 3), (4, 1)])
@pytest.mark.parametrize("chunk", [1, 7, None])
def test_attention_gqa_and_chunks(nh, nkv, chunk):
    q, k0, v0, ek, ev = make_inputs(2, nh, nkv, 23, 4, 3)
    compare(q, k0, v0, ek, ev, padding("tails", 2, 23), impl="chunked", chunk=chunk)


@pytest.mark.parametrize("steps", [2, 4])
def test_attention_fully_padded_sequence_with_extras(steps):
    """A sequence with no valid key: from step 1 on every row still sees its extras (finite
    reference); the new attention must match it, gradients included."""
    q, k0, v0, ek, ev = make_inputs(2, 4, 2, 9, 8, steps)
    kv = padding("tails", 2, 9)
    kv[1] = False
    compare(q, k0, v0, ek, ev, kv, impl="chunked", chunk=4)


def test_attention_fully_padded_sequence_step0():
    """Step 0 of a sequence with no valid key: the reference gives NaN (0/0), the new attention 0
    and finite gradients; the other sequence is unaffected."""
    q, k0, v0, _, _ = make_inputs(2, 4, 2, 9, 8, 1)
    kv = torch.ones(2, 9, dtype=torch.bool)
    kv[1] = False
    out = ttt_attention(q, k0, v0, kv, [], [], chunk=4)
    assert torch.isnan(reference(q, k0, v0, kv, [], [])[1]).all()
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[:1], reference(q[:1], k0[:1], v0[:1], kv[:1], [], []), **TOL)
    grads = torch.autograd.grad(out.square().sum(), [q, k0, v0])
    assert all(torch.isfinite(g).all() for g in grads)
    assert all(not g[1].any() for g in grads)  # nothing flows into the padded sequence


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_attention_matches_reference_property(data):
    """Random shapes, GQA groups, chunk sizes and key masks (a row with no visible step-0 key only
    where it has extras, so that the reference is finite)."""
    b, nkv, grp = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    t, d, steps = data.draw(st.integers(1, 40)), data.draw(st.sampled_from([4, 8])), data.draw(st.integers(1, 7))
    chunk = data.draw(st.one_of(st.none(), st.integers(1, 45)))
    bits = data.draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    kv = torch.tensor(bits, dtype=torch.bool).view(b, t)
    if steps == 1:
        kv[:, 0] = True
    q, k0, v0, ek, ev = make_inputs(b, nkv * grp, nkv, t, d, steps, seed=data.draw(st.integers(0, 2 ** 16)))
    compare(q, k0, v0, ek, ev, kv, impl="chunked", chunk=chunk)


def test_causal_lse_gradcheck():
    """The chunked Function's own backward, lse gradient included (fp64 gradcheck), GQA + padding."""
    q, k, v, _, _ = make_inputs(2, 4, 2, 6, 3, 1, dtype=torch.float64)
    kv = torch.tensor([[True] * 6, [False, True, True, False, True, False]])

    def f(q, k, v):
        o, lse = causal_attention_lse(q, k, v, kv, impl="chunked", chunk=4)
        return o, lse.masked_fill(lse.isinf(), 0.0)  # the fully padded row 0 of sequence 1

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_causal_lse_values():
    """lse = log sum exp of the visible scores (natural log); o = softmax . v."""
    q, k, v, _, _ = make_inputs(1, 2, 1, 5, 4, 1)
    kv = torch.tensor([[True, False, True, True, True]])
    o, lse = causal_attention_lse(q, k, v, kv, impl="chunked", chunk=2)
    s = (q @ k.transpose(-1, -2)) / 2.0
    s = s.masked_fill(~(torch.ones(5, 5, dtype=torch.bool).tril() & kv[0]), float("-inf"))
    torch.testing.assert_close(lse, s.logsumexp(-1))
    torch.testing.assert_close(o, s.softmax(-1) @ v)


def test_attention_bad_inputs():
    q, k0, v0, ek, ev = make_inputs(1, 4, 2, 5, 8, 2)
    kv = torch.ones(1, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="key_valid"):
        ttt_attention(q, k0, v0, kv.long(), ek, ev)
    with pytest.raises(ValueError, match="nkv"):
        ttt_attention(q, k0[:, :1].expand(1, 3, 5, 8), v0[:, :1].expand(1, 3, 5, 8), kv, [], [])
    with pytest.raises(ValueError, match="extra"):
        ttt_attention(q, k0, v0, kv, ek, [])
    with pytest.raises(ValueError, match="impl"):
        ttt_attention(q, k0, v0, kv, ek, ev, impl="fast")
    with pytest.raises(ValueError, match="chunk"):
        ttt_attention(q, k0, v0, kv, ek, ev, chunk=0)


def test_flex_forward_matches_chunked():
    """The flex_attention path (uncompiled: CPU has no flex backward) gives the same o and lse,
    GQA, padding and a fully padded sequence included. Its backward is tested on CUDA below."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v, ek, ev = [[y.detach() for y in x] if isinstance(x, list) else x.detach()
                       for x in make_inputs(3, 4, 2, 37, 16, 3)]  # CPU flex has no backward
    kv = padding("tails", 3, 37)
    kv[2] = False
    with torch.no_grad():
        o1, l1 = causal_attention_lse(q, k, v, kv, impl="chunked", chunk=8)
        o2, l2 = causal_attention_lse(q, k, v, kv, impl="flex_eager")
        torch.testing.assert_close(o2, o1, **TOL)
        torch.testing.assert_close(l2, l1, **TOL)
        cache = {}
        out = ttt_attention(q, k, v, kv, ek, ev, impl="flex_eager", cache=cache)
        ttt_attention(q, k, v, kv, ek[:1], ev[:1], impl="flex_eager", cache=cache)
        assert "flex_block_mask" in cache
        torch.testing.assert_close(out[:2], reference(q, k, v, kv, ek, ev)[:2], **TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (compiled flex_attention)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_compiled_cuda_matches_reference(dtype):
    q, k0, v0, ek, ev = [x.cuda().to(dtype).detach().requires_grad_() if torch.is_tensor(x) else
                         [y.cuda().to(dtype).detach().requires_grad_() for y in x]
                         for x in make_inputs(2, 8, 2, 300, 64, 4)]
    kv = padding("tails", 2, 300).cuda()
    out = ttt_attention(q, k0, v0, kv, ek, ev, impl="flex")
    ref = reference(q, k0, v0, kv, ek, ev)
    tol = TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    cot = torch.randn_like(out)
    got = torch.autograd.grad((out * cot).sum(), leaves(q, k0, v0, ek, ev))
    want = torch.autograd.grad((ref * cot).sum(), leaves(q, k0, v0, ek, ev))
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), **tol)


# ---------------------------------------------------------------- memory: linear in T
class _Largest(TorchDispatchMode):
    """Largest storage any op (forward or backward) produces, in bytes."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in tree_flatten(out)[0]:
            if isinstance(x, torch.Tensor):
                self.bytes = max(self.bytes, x.untyped_storage().nbytes())
        return out


def memory(fn):
    """``(saved, largest)``: bytes of the distinct storages autograd saves for backward during
    ``fn()`` (which returns a scalar loss), and of the largest storage made in forward + backward."""
    seen = {}

    def pack(x):
        seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        return x

    with _Largest() as big:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            loss = fn()
        loss.backward()
    return sum(seen.values()), big.bytes


def _attention_memory(t, new, steps=7):
    q, k0, v0, ek, ev = make_inputs(1, 4, 2, t, 8, steps)
    kv = padding("tails", 1, t)
    if new:
        return memory(lambda: ttt_attention(q, k0, v0, kv, ek, ev, chunk=32).sum())
    return memory(lambda: reference(q, k0, v0, kv, ek, ev).sum())


def test_attention_memory_linear_in_t():
    """T -> 4T: saved bytes and the largest tensor grow 4x (new) vs ~16x (dense reference)."""
    (s1, b1), (s4, b4) = _attention_memory(128, True), _attention_memory(512, True)
    assert s4 / s1 <= 4.5 and b4 / b1 <= 4.5, (s1, s4, b1, b4)
    (r1, c1), (r4, c4) = _attention_memory(128, False), _attention_memory(512, False)
    assert r4 / r1 >= 9 and c4 / c1 >= 12, (r1, r4, c1, c4)  # measured: 10.2 and 15.5


# ---------------------------------------------------------------- loss: new == old
def ttt_forward_reference(d, input_ids, aux, key_valid, steps):
    """``Eagle3Drafter.ttt_forward`` before the memory-linear attention (dense mask, repeated kv)."""
    b, t = input_ids.shape
    positions = torch.arange(t).expand(b, t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    mask0 = (causal[None] & key_valid[:, None, :])[:, None]
    hidden = d.fc(aux.to(d.fc.weight.dtype))
    outs, extra_k, extra_v = [], [], []
    for k in range(steps):
        ids = F.pad(input_ids[:, k:], (0, k))
        cos, sin = d.rope(positions + k, hidden)
        q, kk, vv = d.midlayer.qkv(d.embed(ids), hidden, cos, sin)
        if k == 0:
            k0, v0 = kk, vv
        else:
            extra_k.append(kk)
            extra_v.append(vv)
        hidden = d.midlayer.finish(ttt_attention_reference(q, k0, v0, mask0, extra_k, extra_v), hidden)
        outs.append(hidden)
    return outs


def ttt_loss_reference(drafter, target_lm_head, batch, steps=7, step_weight=0.8, exclude_oov=True):
    """``eagle_train.loss.ttt_loss`` before the chunked loss (dense teacher, per-step [n, N] tensors)."""
    from eagle_train.loss import shift_left, step_loss_masks, target_argmax_in_vocab, teacher_logits

    ids, valid = batch["input_ids"], batch["attention_mask"].bool()
    aux, final = batch["aux_hidden_states"], batch["hidden_states"]
    sup = step_loss_masks(batch["loss_mask"], valid, steps)[:, :, 1:]
    if exclude_oov:
        ok = target_argmax_in_vocab(final[:, 1:], target_lm_head, drafter.t2d)
        sup = sup & torch.stack([shift_left(ok, k, False) for k in range(steps)])
    with torch.no_grad():
        teach = torch.softmax(teacher_logits(final[:, 1:], target_lm_head, drafter.t2d), -1)
    hiddens = ttt_forward_reference(drafter, ids[:, 1:], aux[:, :-1], valid[:, 1:], steps)
    total, loss_k, acc_k, n_k = 0.0, [], [], []
    for k, h in enumerate(hiddens):
        m = sup[k]
        n = m.sum()
        tp = shift_left(teach, k, 0.0)[m]
        logp = F.log_softmax(drafter.logits(h[m]).float(), -1)
        lk = -(tp * logp).sum(-1).sum() / n.clamp(min=1)
        acc = (logp.argmax(-1) == tp.argmax(-1)).float().sum() / n.clamp(min=1)
        total = total + (step_weight ** k) * lk
        loss_k.append(lk.detach())
        acc_k.append(acc.detach())
        n_k.append(n)
    return {"loss": total, "loss_k": loss_k, "acc_k": acc_k, "n_k": n_k}


def _grads(mod, loss):
    params = [p for p in mod.drafter.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("exclude_oov", [False, True])
@pytest.mark.parametrize("chunk_rows", [5, None])
def test_ttt_loss_matches_reference(tmp_path, exclude_oov, chunk_rows):
    from eagle_train.loss import ttt_loss

    mod = tiny_module(tmp_path, exclude_oov=exclude_oov)
    batch = tiny_batch(tiny_target(), n=3, t=26)
    new = ttt_loss(mod.drafter, mod.target_lm_head, batch, steps=4, exclude_oov=exclude_oov, chunk_rows=chunk_rows)
    old = ttt_loss_reference(mod.drafter, mod.target_lm_head, batch, steps=4, exclude_oov=exclude_oov)
    assert [int(n) for n in new["n_k"]] == [int(n) for n in old["n_k"]] and int(old["n_k"][0]) > 10
    torch.testing.assert_close(new["loss"], old["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(new["loss_k"]), torch.stack(old["loss_k"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(new["acc_k"]), torch.stack(old["acc_k"]))
    for a, b in zip(_grads(mod, new["loss"]), _grads(mod, old["loss"])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_ttt_loss_no_supervised_rows(tmp_path):
    """A batch that supervises nothing still gives a zero loss with a graph (Lightning steps on it)."""
    from eagle_train.loss import ttt_loss

    mod = tiny_module(tmp_path)
    batch = tiny_batch(tiny_target(), n=1, t=12)
    batch["loss_mask"][:] = False
    out = ttt_loss(mod.drafter, mod.target_lm_head, batch, steps=2)
    assert float(out["loss"].detach()) == 0.0 and all(int(n) == 0 for n in out["n_k"])
    out["loss"].backward()
    assert all(float(a) == 0.0 for a in out["acc_k"])


def _synthetic_batch(t, b=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 256, (b, t), generator=g),
            "attention_mask": torch.ones(b, t, dtype=torch.bool), "loss_mask": torch.ones(b, t, dtype=torch.bool),
            "aux_hidden_states": torch.randn(b, t, 3 * 64, generator=g).bfloat16(),
            "hidden_states": torch.randn(b, t, 64, generator=g).bfloat16()}


def test_ttt_loss_memory(tmp_path):
    """Bytes saved for backward by the whole loss (drafter forward + loss), T -> 4T: 4x for the new
    loss, more for the reference (its T x T attention). And no per-step [rows, N] tensor is kept:
    draft vocab 48 -> 192 adds at most one [T, 144] fp32 tensor to the new loss's saved bytes (the
    teacher, computed once without grad and shared by the K steps' fused loss) and the head's 144
    more rows of weights [144, H=64], and K times
    [rows, N] fp32 (probabilities and log-probabilities) to the reference's."""
    from eagle_train.loss import ttt_loss

    steps = 4
    small, big = tiny_module(tmp_path, draft_vocab_size=48), tiny_module(tmp_path, draft_vocab_size=192)

    def saved(mod, t, new):
        fn = ttt_loss if new else ttt_loss_reference
        b = _synthetic_batch(t)
        return memory(lambda: fn(mod.drafter, mod.target_lm_head, b, steps=steps, exclude_oov=False)["loss"])[0]

    n1, n4 = saved(small, 128, True), saved(small, 512, True)
    r1, r4 = saved(small, 128, False), saved(small, 512, False)
    assert n4 / n1 <= 4.2 and r4 / r1 >= 6, (n1, n4, r1, r4)  # measured 3.85 and 6.8
    rows = sum(512 - 2 - k for k in range(steps))  # supervised rows over the steps
    assert 0 <= saved(big, 512, True) - n4 <= (512 + 64) * (192 - 48) * 4
    assert saved(big, 512, False) - r4 >= 2 * rows * (192 - 48) * 4


# ---------------------------------------------------------------- memory-lean layer pieces
def test_silu_mul_matches_autograd():
    from eagle_train.layers import _SiluMul

    g = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    u = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_SiluMul.apply, (g, u))
    out = _SiluMul.apply(g, u)
    torch.testing.assert_close(out, F.silu(g) * u, rtol=0, atol=0)
    cot = torch.randn_like(out)
    got = torch.autograd.grad((out * cot).sum(), (g, u))
    want = torch.autograd.grad(((F.silu(g) * u) * cot).sum(), (g, u))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_cast_once_under_autocast_same_values(tmp_path):
    """The layer under bf16 autocast gives bit-identical outputs with the single cast of the
    projections' input (autocast would cast the same values for each projection)."""
    from eagle_train.layers import DraftMLP, cast_for_autocast

    mod = tiny_module(tmp_path)
    mlp: DraftMLP = mod.drafter.midlayer.mlp
    x = torch.randn(2, 5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cast_for_autocast(x).dtype == torch.bfloat16
        got = mlp(x)
        want = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert cast_for_autocast(x) is x  # no autocast: untouched
    assert torch.equal(got, want)


def _rmsnorm_autograd(x, w, eps):
    """RMSNorm as plain autograd ops (the formula of ``eagle_train.layers.RMSNorm``)."""
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_function_matches_autograd(dtype):
    from eagle_train.layers import _RMSNormFn

    x64 = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    w64 = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormFn.apply(x, w, 1e-6), (x64, w64))
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=g) * 3).to(dtype).requires_grad_()
    w = (1 + torch.randn(64, generator=g) * 0.1).requires_grad_()
    y = _RMSNormFn.apply(x, w, 1e-6)
    want = _rmsnorm_autograd(x, w, 1e-6)
    assert torch.equal(y, want)  # forward: bit-identical
    cot = torch.randn(y.shape, generator=g)
    for a, b in zip(torch.autograd.grad((y * cot).sum(), (x, w)), torch.autograd.grad((want * cot).sum(), (x, w))):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
