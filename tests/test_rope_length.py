"""Models whose rope tables depend on the sequence length (dynamic NTK, longrope): the HF backend's
states of a row do not depend on the batch it shares or on the batches before it, also past the
rope's original context (tiny random models: original context 16 tokens)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch

from eagle_data.engines.cuda_graphs import rope_length_limit
from eagle_data.engines.hf import HFBackend

AUX = [1, 2, 3]


def _model(kind: str):
    import transformers as T

    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=5, intermediate_size=96)
    if kind == "dynamic":
        cfg = T.LlamaConfig(**common, max_position_embeddings=16,
                            rope_parameters={"rope_type": "dynamic", "rope_theta": 100.0, "factor": 4.0})
        return T.LlamaForCausalLM(cfg).eval()
    if kind == "longrope":
        half = 64 // 4 // 2
        cfg = T.Phi3Config(**common, max_position_embeddings=128, original_max_position_embeddings=16, pad_token_id=0,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 100.0,
                                            "short_factor": [1.0] * half,
                                            "long_factor": [1.0 + i for i in range(half)],
                                            "original_max_position_embeddings": 16})
        return T.Phi3ForCausalLM(cfg).eval()
    if kind == "per_layer_dynamic":  # Gemma3-style: a rope per layer type, the global layers' dynamic
        cfg = T.Gemma3TextConfig(**common, head_dim=16, max_position_embeddings=16, sliding_window=64,
                                 layer_types=["sliding_attention", "full_attention"] * 2 + ["full_attention"],
                                 rope_parameters={"full_attention": {"rope_type": "dynamic", "rope_theta": 100.0,
                                                                     "factor": 4.0},
                                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}})
        return T.Gemma3ForCausalLM(cfg).eval()
    cfg = T.LlamaConfig(**common, max_position_embeddings=16)
    return T.LlamaForCausalLM(cfg).eval()


def _alone(kind, ids):
    """The row's states from a fresh model of the same weights, on its own."""
    be = HFBackend("tiny", AUX, dtype="float32", model=_model(kind))
    (c,) = be.capture([("k", ids)])
    return c


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "per_layer_dynamic"])
def test_rows_past_the_original_context_match_the_row_alone(kind):
    be = HFBackend("tiny", AUX, dtype="float32", model=_model(kind))
    assert be.rope_limit == 16
    g = torch.Generator().manual_seed(1)
    rows = {n: torch.randint(1, 300, (n,), generator=g) for n in (9, 16, 40, 25, 30)}
    # a long batch first (grows dynamic NTK's tables), then mixes on both sides of the limit
    for lens in ((40,), (9, 25), (30, 16, 9), (25, 40), (40, 30)):
        got = be.capture([(f"r{n}", rows[n]) for n in lens])
        for n, c in zip(lens, got):
            want = _alone(kind, rows[n])
            assert c.aux_hidden_states.shape == (n, 3 * 64)
            torch.testing.assert_close(c.aux_hidden_states, want.aux_hidden_states, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(c.hidden_states, want.hidden_states, rtol=1e-5, atol=1e-5)


def test_without_the_split_the_batch_would_change_the_short_row():
    """The property above is not vacuous: run as one padded batch, the short row's states move."""
    be = HFBackend("tiny", AUX, dtype="float32", model=_model("longrope"))
    g = torch.Generator().manual_seed(2)
    short, long = torch.randint(1, 300, (9,), generator=g), torch.randint(1, 300, (30,), generator=g)
    states, _ = be.forward_padded([short, long])
    want = _alone("longrope", short)
    assert not torch.allclose(states["final"][0, :9], want.hidden_states, atol=1e-3)


def test_static_ropes_have_no_limit():
    import transformers as T

    assert rope_length_limit(_model("default").config) is None
    assert rope_length_limit(T.LlamaConfig(rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})) is None
    assert rope_length_limit(T.LlamaConfig(max_position_embeddings=64, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})) == 64
    # HF grows dynamic tables past max_position_embeddings whatever else the parameters say
    assert rope_length_limit(T.LlamaConfig(max_position_embeddings=16, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 64})) == 16


_ALONE_CACHE: dict = {}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["dynamic", "longrope", "per_layer_dynamic"]),
       batches=st.lists(st.lists(st.integers(2, 48), min_size=1, max_size=4), min_size=1, max_size=4))
def test_any_sequence_of_batches_gives_each_row_its_states_alone(kind, batches):
    """Property: for any batches (lengths on both sides of the limit, any order), run one after
    another on one backend, every row's states equal the row alone on a fresh model."""
    be = HFBackend("tiny", AUX, dtype="float32", model=_model(kind))
    for lens in batches:
        rows = [torch.randint(1, 300, (n,), generator=torch.Generator().manual_seed(n)) for n in lens]
        for n, ids, c in zip(lens, rows, be.capture([(f"r{i}", r) for i, r in enumerate(rows)])):
            if (kind, n) not in _ALONE_CACHE:
                _ALONE_CACHE[kind, n] = _alone(kind, ids)
            want = _ALONE_CACHE[kind, n]
            torch.testing.assert_close(c.aux_hidden_states, want.aux_hidden_states, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(c.hidden_states, want.hidden_states, rtol=1e-5, atol=1e-5)
