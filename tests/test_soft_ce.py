"""The fused draft head + soft cross-entropy (eagle_train.soft_ce) equals the plain autograd
formula -sum p log_softmax(x W^T): loss, argmax and both gradients, for any chunking."""

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from eagle_train.soft_ce import chunks, linear_soft_ce


def _inputs(n, h, v, n_teacher, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, h, generator=g) * 2).to(dtype).requires_grad_()
    w = torch.randn(v, h, generator=g).to(dtype).requires_grad_()
    teach = torch.softmax(torch.randn(n_teacher, v, generator=g) * 3, -1).to(dtype)
    tc = torch.randint(0, n_teacher, (n,), generator=g)
    return x, w, teach, tc


def _reference(x, w, teach, tc):
    logits = x @ w.T
    return -(teach[tc] * F.log_softmax(logits, -1)).sum(), logits.argmax(-1)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 40), h=st.integers(1, 9), v=st.integers(1, 30), n_teacher=st.integers(1, 12),
       rows=st.integers(1, 50), seed=st.integers(0, 10**6))
def test_equals_autograd_formula(n, h, v, n_teacher, rows, seed):
    x, w, teach, tc = _inputs(n, h, v, n_teacher, seed)
    ce, arg = linear_soft_ce(x, w, teach, tc, rows)
    want, want_arg = _reference(x, w, teach, tc)
    torch.testing.assert_close(ce.double(), want, rtol=1e-5, atol=1e-5)  # fp32 softmax math inside
    assert torch.equal(arg, want_arg)
    got = torch.autograd.grad(ce, (x, w), allow_unused=True)
    exp = torch.autograd.grad(want, (x, w), allow_unused=True)
    for a, b in zip(got, exp):
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@given(n=st.integers(0, 300), rows=st.integers(1, 64))
def test_chunks_cover_every_row_once_and_none_has_one_row_unless_all_do(n, rows):
    """A chunk of 1 row among larger ones makes torch.compile specialise and recompile mid-training
    (with ``rows`` = 1 every chunk has one row: one shape, nothing to recompile)."""
    b = chunks(n, rows)
    assert [r for i, j in b for r in range(i, j)] == list(range(n))
    assert all(j - i <= rows + 1 for i, j in b)
    assert n == 1 or rows == 1 or all(j - i != 1 for i, j in b)


def test_empty_rows_keep_a_graph():
    x, w, teach, tc = _inputs(0, 4, 6, 3, 0, torch.float32)
    ce, arg = linear_soft_ce(x, w, teach, tc, 8)
    assert float(ce) == 0.0 and arg.numel() == 0
    ce.backward()
    assert w.grad is not None and float(w.grad.abs().sum()) == 0.0


def test_bf16_autocast_close_to_linear_path():
    """Under bf16 autocast the matmuls run in bf16 as nn.Linear's would: loss within bf16 rounding
    of the fp32 formula on the same bf16-rounded inputs, gradients reach fp32 parameters."""
    x, w, teach, tc = _inputs(64, 16, 40, 20, 1, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce, _ = linear_soft_ce(x, w, teach, tc, 7)
    want, _ = _reference(x.bfloat16().float(), w.bfloat16().float(), teach, tc)
    torch.testing.assert_close(ce, want, rtol=2e-2, atol=0)
    gx, gw = torch.autograd.grad(ce, (x, w))
    assert gx.dtype == gw.dtype == torch.float32
    rx, rw = torch.autograd.grad(_reference(x, w, teach, tc)[0], (x, w))
    assert F.cosine_similarity(gw.flatten(), rw.flatten(), 0) > 0.99
    assert F.cosine_similarity(gx.flatten(), rx.flatten(), 0) > 0.99


def test_rows_must_be_positive():
    import pytest

    x, w, teach, tc = _inputs(3, 4, 6, 3, 0)
    with pytest.raises(ValueError, match="rows"):
        linear_soft_ce(x, w, teach, tc, 0)
