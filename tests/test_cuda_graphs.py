"""CUDA graphs of the HF prefill over bucketed shapes (:mod:`eagle_data.engines.cuda_graphs`).

CI has no GPU: the graphs' replay is stood in by re-running the captured body eagerly (what the
module does on a CPU device), so these tests check everything around the graph itself: the bucket
padding (rows and length, no mask), the output buffers shared by all buckets (and their growth),
the eager fallback beyond ``max_graphs`` or after a failed capture, and that the backend's samples
equal the eager forward's, for attention with sliding windows and ALiBi too. The graph itself (same kernels, replayed) is exercised by ``python -m benchmarks stages
--cuda_graphs true`` on a GPU.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from eagle_data.engines import make_backend
from eagle_data.engines import cuda_graphs
from eagle_data.engines.cuda_graphs import GraphedPrefill, batch_bucket, bucket, graph_unsafe
from eagle_data.engines.hf import HFBackend

from tiny import AUX, tiny_family, tiny_llama


def _backends(attn: str | None, model=None, aux=AUX, **graph_kw):
    """(eager, graphed) backends of one model; ``attn`` None: the model's own attention."""
    m = model if model is not None else tiny_llama()
    if attn:
        m.config._attn_implementation = attn
    eager = HFBackend("tiny", aux_layer_ids=aux, dtype="float32", model=m)
    graphed = HFBackend("tiny", aux_layer_ids=aux, dtype="float32", model=m)
    assert not graphed.mask_padding  # what the backend requires before it graphs (no mask in the graph)
    graphed._graphs = GraphedPrefill(lambda ids: graphed._states(ids, None), "cpu", **graph_kw)
    return eager, graphed


@pytest.fixture(scope="module")
def sdpa_pair():
    return _backends("sdpa", length_step=8, batch_step=4)


def _same_samples(eager, graphed, seqs):
    batch = [(f"k{i}", s) for i, s in enumerate(seqs)]
    want, got = eager.capture(batch), graphed.capture(batch)
    for w, g, s in zip(want, got, seqs):
        assert g.key == w.key and g.finite is True and w.finite is True
        assert g.aux_hidden_states.shape == (s.shape[0], 3 * 64) and g.hidden_states.shape == (s.shape[0], 64)
        assert w.aux_hidden_states.shape == g.aux_hidden_states.shape
        torch.testing.assert_close(g.aux_hidden_states, w.aux_hidden_states, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g.hidden_states, w.hidden_states, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 21), min_size=1, max_size=6), st.integers(0, 10**6))
def test_bucketed_padded_batches_equal_the_eager_forward(sdpa_pair, lens, seed):
    """Any batch, padded to its bucket (rows and length), gives every sample the states of the eager
    padded forward: real tokens never see the bucket's padding."""
    g = torch.Generator().manual_seed(seed)
    _same_samples(*sdpa_pair, [torch.randint(0, 600, (n,), generator=g) for n in lens])


def test_eager_attention_too():
    eager, graphed = _backends("eager", length_step=8, batch_step=4)
    _same_samples(eager, graphed, [torch.randint(0, 600, (n,)) for n in (7, 3, 12)])


@pytest.mark.parametrize("family", ["mistral_window_4", "gemma3_local_global", "bloom_alibi"])
@settings(max_examples=6, deadline=None)
@given(lens=st.lists(st.integers(1, 21), min_size=1, max_size=5), seed=st.integers(0, 10**6))
def test_sliding_windows_and_alibi_are_built_inside_the_graph(family, lens, seed):
    """The model builds its own sliding-window or ALiBi bias from the bucket's shape: a real token's
    window and positions are what they are in the eager forward, so graphing these is exact too."""
    if family not in _PAIRS:
        _PAIRS[family] = _backends(None, model=tiny_family(family), aux=[1, 2, 4], length_step=8, batch_step=4)
    g = torch.Generator().manual_seed(seed)
    _same_samples(*_PAIRS[family], [torch.randint(0, 600, (n,), generator=g) for n in lens])


_PAIRS: dict = {}


def test_a_failed_capture_leaves_every_later_batch_to_the_eager_forward(monkeypatch, caplog):
    eager, graphed = _backends("sdpa", length_step=4, batch_step=1)

    def fail(*a, **k):
        raise cuda_graphs._CaptureFailed("RuntimeError: operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed._graphs, "_capture", fail)
    for lens in ((5,), (3, 2)):
        _same_samples(eager, graphed, [torch.randint(0, 600, (n,)) for n in lens])
    assert graphed._graphs.eager_batches == 2 and not graphed._graphs.graphs
    assert [r.getMessage() for r in caplog.records if "not graphed" in r.getMessage()] == [
        "cuda graphs: bucket (1, 8) not graphed (a capture failed (RuntimeError: operation not permitted when "
        "stream is capturing)); such batches run without a graph"]


def test_buffers_grow_and_the_old_graphs_are_dropped():
    eager, graphed = _backends("sdpa", length_step=4, batch_step=1)
    gp = graphed._graphs
    _same_samples(eager, graphed, [torch.randint(0, 600, (3,))])
    assert set(gp.graphs) == {(1, 4)} and gp.out["final"].shape[0] == 4
    _same_samples(eager, graphed, [torch.randint(0, 600, (n,)) for n in (9, 2)])      # [2, 12]: 24 > 4 tokens
    assert set(gp.graphs) == {(2, 12)} and gp.out["final"].shape[0] == 24
    _same_samples(eager, graphed, [torch.randint(0, 600, (3,))])                        # [1, 4] again: fits
    assert set(gp.graphs) == {(2, 12), (1, 4)} and gp.out["final"].shape[0] == 24


def test_beyond_max_graphs_or_max_length_batches_run_the_backends_eager_forward(caplog):
    eager, graphed = _backends("sdpa", length_step=4, batch_step=1, max_graphs=1, max_length=12)
    for lens in ((5,), (3, 2), (6,), (3, 2), (13,)):
        _same_samples(eager, graphed, [torch.randint(0, 600, (n,)) for n in lens])
    assert set(graphed._graphs.graphs) == {(1, 8)} and graphed._graphs.eager_batches == 3
    assert sum("not graphed" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("make, refused", [
    (lambda T: T.LlamaConfig(), None),
    (lambda T: T.LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 8192}), None),
    (lambda T: T.MistralConfig(), None),        # windows and ALiBi are built by the model inside the graph
    (lambda T: T.Gemma3TextConfig(), None),
    (lambda T: T.BloomConfig(), None),
    (lambda T: T.Gemma3Config(), None),
    (lambda T: T.LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     "rope_type 'dynamic'"),
    (lambda T: T.Phi3Config(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 48,
                                             "long_factor": [1.0] * 48, "original_max_position_embeddings": 16}),
     "rope_type 'longrope'"),
])
def test_models_whose_rope_depends_on_the_length_are_refused(make, refused):
    """The graph's rope sees the bucket's length, not the batch's: a length-dependent rope (dynamic,
    longrope) would give other states than the eager forward, so those models are refused by name."""
    import transformers

    why = graph_unsafe(make(transformers))
    assert why is None if refused is None else refused in why


def test_a_model_that_sees_its_padding_is_refused(monkeypatch):
    """Graphs pass no mask: a model whose real tokens see the padding after them is refused (the
    CUDA-device check is lifted here: the CPU stand-in replays eagerly)."""
    import eagle_data.engines.hf as hf

    monkeypatch.setattr(hf, "_check_graph_settings", lambda *a: None)
    assert HFBackend("tiny", aux_layer_ids=AUX, dtype="float32", model=tiny_llama(), cuda_graphs=True)._graphs
    m = tiny_llama()
    for layer in m.model.layers:
        layer.self_attn.is_causal = False
    with pytest.raises(ValueError, match=r"model tiny cannot run through CUDA graphs: its real tokens' states depend "
                                         r"on the padding after them \(not causal\)"):
        HFBackend("tiny", aux_layer_ids=AUX, dtype="float32", model=m, cuda_graphs=True)


def test_buckets():
    assert [bucket(n, 8) for n in (1, 8, 9, 16, 17)] == [8, 8, 16, 16, 24]
    assert [batch_bucket(b, 8) for b in (1, 2, 3, 5, 7, 8, 9, 33)] == [1, 2, 4, 8, 8, 8, 16, 40]  # a lone row stays one


def test_settings_are_checked():
    m = tiny_llama()
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, got device cpu"):
        make_backend("hf", model_path="tiny", model=m, aux_layer_ids=AUX, dtype="float32", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs must be true or false, got 'yes'"):
        HFBackend("tiny", aux_layer_ids=AUX, dtype="float32", model=m, cuda_graphs="yes")
    for bad in (0, 2.5, True, 10**9):
        with pytest.raises(ValueError, match=rf"graph_length_step must be an integer in \[1, 65536\], got {bad!r}"):
            HFBackend("tiny", aux_layer_ids=AUX, dtype="float32", model=m, graph_length_step=bad)
    with pytest.raises(ValueError, match="length_step, batch_step, max_length must be >= 1"):
        GraphedPrefill(lambda ids: {}, "cpu", length_step=0)
    assert HFBackend("tiny", aux_layer_ids=AUX, dtype="float32", model=m)._graphs is None


def test_a_model_returning_too_few_positions_is_named():
    m = tiny_llama()
    m.model.norm.register_forward_hook(lambda _m, _i, out: out[:, :-1])  # before the backend's own hook
    be = HFBackend("tiny", aux_layer_ids=AUX, dtype="float32", model=m)
    be._graphs = GraphedPrefill(lambda ids: be._states(ids, None), "cpu", length_step=8, batch_step=4)
    with pytest.raises(RuntimeError, match=r"the model returned final states \(2, 7, 64\) for a \[2, 8\] batch"):
        be.capture([("a", torch.randint(0, 600, (5,))), ("b", torch.randint(0, 600, (3,)))])


def test_buckets_stay_within_a_learned_position_table(monkeypatch):
    """GPT-2 has 40 learned positions: a batch of 38 tokens whose bucket (48) would index past them
    runs eagerly, and its states are the eager ones."""
    import eagle_data.engines.hf as hf
    import transformers as T

    monkeypatch.setattr(hf, "_check_graph_settings", lambda *a: None)  # the CPU stand-in replays eagerly
    torch.manual_seed(0)
    m = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=600, n_embd=64, n_head=4, n_layer=4, n_positions=40)).eval()
    eager = HFBackend("gpt2", aux_layer_ids=[0, 1, 2], dtype="float32", model=m)
    graphed = HFBackend("gpt2", aux_layer_ids=[0, 1, 2], dtype="float32", model=m, cuda_graphs=True,
                        graph_length_step=16)
    assert graphed._graphs.max_length == 40
    _same_samples(eager, graphed, [torch.randint(0, 600, (n,)) for n in (38, 5)])
    _same_samples(eager, graphed, [torch.randint(0, 600, (n,)) for n in (30, 5)])  # bucket 32: graphed
    assert set(graphed._graphs.graphs) == {(2, 32)} and graphed._graphs.eager_batches == 1
