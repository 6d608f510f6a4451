"""The compiled decoder layer (``Eagle3Drafter.compile_layer``) and the eager fallback of
:mod:`eagle_train.compiled`. CUDA is where training compiles; here inductor's CPU backend is
forced so the same traced graphs are checked against the eager layer."""

import logging

import pytest
import torch

import eagle_train.compiled as C
import eagle_train.model as M
from eagle_train.loss import ttt_loss
from train_tiny import tiny_batch, tiny_module, tiny_target


@pytest.fixture
def forced(monkeypatch):
    """``compiled`` as training calls it, but compiling on CPU too; fresh caches."""
    monkeypatch.setattr(C, "_cache", {})
    monkeypatch.setattr(C, "_broken", set())
    monkeypatch.setattr(M, "compiled", lambda name, eager, device, force=False: C.compiled(name, eager, device, True))


def _loss_and_grads(mod, batch, compile_layer: bool, steps: int = 4):
    mod.drafter.compile_layer = compile_layer
    out = ttt_loss(mod.drafter, mod.target_lm_head, batch, steps=steps, exclude_oov=False)
    params = [p for p in mod.drafter.parameters() if p.requires_grad]
    return out, torch.autograd.grad(out["loss"], params)


def test_compiled_layer_equals_eager(tmp_path, forced):
    """fp32: the compiled layer's loss, per-step losses and every parameter gradient equal the
    eager layer's (padding in the batch; two batch shapes through the one dynamic compile)."""
    mod = tiny_module(tmp_path, exclude_oov=False)
    for n, t in ((3, 26), (2, 41)):
        batch = tiny_batch(tiny_target(), n=n, t=t)
        batch["attention_mask"][-1, t // 2:] = False
        eager, g_eager = _loss_and_grads(mod, batch, False)
        comp, g_comp = _loss_and_grads(mod, batch, True)
        assert not C._broken and {"drafter.qkv", "drafter.finish"} <= set(C._cache)
        assert float(eager["loss"].detach()) > 1.0
        torch.testing.assert_close(comp["loss"], eager["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.stack(comp["loss_k"]), torch.stack(eager["loss_k"]), rtol=1e-5, atol=1e-6)
        for a, b in zip(g_comp, g_eager):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_compile_failure_falls_back_to_eager(monkeypatch, caplog):
    """A compiled piece that raises is run eagerly (same result), marked broken once, warned once."""
    monkeypatch.setattr(C, "_cache", {})
    monkeypatch.setattr(C, "_broken", set())
    calls = []

    def broken_compile(fn, dynamic=True):
        def run(*args):
            calls.append(1)
            raise RuntimeError("inductor: no compiler on this machine")
        return run

    monkeypatch.setattr(C.torch, "compile", broken_compile)
    x = torch.arange(6.0)
    with caplog.at_level(logging.WARNING, logger="eagle_train.compiled"):
        fn = C.compiled("piece", lambda v: v * 2, torch.device("cpu"), force=True)
        assert torch.equal(fn(x), x * 2) and torch.equal(fn(x), x * 2)
        again = C.compiled("piece", lambda v: v * 2, torch.device("cpu"), force=True)
        assert torch.equal(again(x), x * 2)
    assert calls == [1] and C._broken == {"piece"}
    assert len([r for r in caplog.records if "compiled piece failed" in r.getMessage()]) == 1


def test_cpu_stays_eager_unless_forced():
    eager = lambda v: v + 1  # noqa: E731
    assert C.compiled("cpu piece", eager, torch.device("cpu")) is eager


def _saved_bytes(mod, batch, steps=7):
    """Bytes of the distinct storages the bf16-autocast loss saves for backward."""
    seen, keep = {}, []

    def pack(x):
        seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        keep.append(x)  # no storage is freed and its address reused while counting
        return x

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        ttt_loss(mod.drafter, mod.target_lm_head, batch, steps=steps, exclude_oov=False)
    return sum(seen.values())


def test_compiled_layer_saves_no_more_than_eager(tmp_path, forced, monkeypatch):
    """Under autocast the K compiled steps share one cast of the layer's weights (eager autocast
    caches it); without :func:`autocast_matrices` each compiled call saved its own bf16 copy
    (measured on the H200: 25.5 vs 22.9 GiB at T = 8192 for the 8B-shaped drafter)."""
    mod = tiny_module(tmp_path, exclude_oov=False)
    batch = tiny_batch(tiny_target(), n=2, t=64)
    mod.drafter.compile_layer = False
    eager = _saved_bytes(mod, batch)
    mod.drafter.compile_layer = True
    comp = _saved_bytes(mod, batch)
    assert comp <= eager * 1.01, (comp, eager)
    weights = sum(p.numel() * 2 for p in mod.drafter.midlayer.parameters() if p.ndim == 2)
    monkeypatch.setattr(M, "autocast_matrices", lambda layer: None)  # each call casts its own
    assert _saved_bytes(mod, batch) >= comp + 5 * weights


def test_sharded_strategies_run_the_layer_eagerly(tmp_path):
    """FSDP gathers parameters only in its own forward, which the compiled layer would bypass:
    ``setup`` turns ``compile_layer`` off there and keeps it on one device or DDP."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    for strategy, on in ((SingleDeviceStrategy(device="cpu"), True), (DDPStrategy(), True), (FSDPStrategy(), False)):
        mod = tiny_module(tmp_path)
        assert mod.drafter.compile_layer is True  # the default
        mod._trainer = SimpleNamespace(strategy=strategy, datamodule=None)
        mod.setup("fit")
        assert mod.drafter.compile_layer is on, strategy


def test_a_backward_compile_failure_in_the_warm_up_turns_the_layer_eager(tmp_path, forced, monkeypatch, caplog):
    """A compiled region's backward is compiled when it first runs, outside ``compiled``'s own
    fallback: the warm-up (which runs forward and backward) catches it and trains eagerly."""
    import lightning.pytorch as pl
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def bw(gm, example_inputs):
        raise RuntimeError("simulated inductor backward failure")

    backend = aot_autograd(fw_compiler=lambda gm, ex: make_boxed_func(gm.forward), bw_compiler=bw)
    real = torch.compile
    monkeypatch.setattr(C.torch, "compile", lambda fn, dynamic=True: real(fn, dynamic=dynamic, backend=backend))
    mod = tiny_module(tmp_path, exclude_oov=False)
    mod.trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="eagle_train.module"):
        mod.warm_up_compiles()
    assert mod.drafter.compile_layer is False
    assert any("compiled decoder layer failed in the warm-up" in r.getMessage() for r in caplog.records)
    assert all(p.grad is None for p in mod.parameters())
    assert all(torch.equal(before[k], v) for k, v in mod.state_dict().items())
    batch = tiny_batch(tiny_target(), n=2, t=16)
    ttt_loss(mod.drafter, mod.target_lm_head, batch, steps=2, exclude_oov=False)["loss"].backward()  # eager now
