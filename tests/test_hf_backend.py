"""HF reference backend: layer convention, final state, logits, batch independence."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from eagle_data.engines import default_aux_layer_ids, validate_aux_layer_ids
from eagle_data.engines.hf import HFBackend

from tiny import AUX, tiny_family, tiny_llama

H = 64


@pytest.fixture(scope="module")
def setup():
    m = tiny_llama()
    return m, HFBackend("tiny", aux_layer_ids=AUX, dtype="float32", model=m)


def test_aux_slices_are_hf_hidden_states_k_plus_1(setup):
    m, be = setup
    ids = torch.randint(0, 600, (37,))
    (cap,) = be.capture([("k", ids)])
    with torch.no_grad():
        out = m(ids[None], output_hidden_states=True)
    hs = [h[0] for h in out.hidden_states]
    assert cap.aux_hidden_states.shape == (37, 3 * H) and cap.hidden_states.shape == (37, H)
    for j, k in enumerate(AUX):
        sl = cap.aux_hidden_states[:, j * H:(j + 1) * H]
        torch.testing.assert_close(sl, hs[k + 1], rtol=1e-5, atol=1e-6)
        assert (sl - hs[k]).abs().max() > 1e-2 and (sl - hs[k + 2]).abs().max() > 1e-2
    torch.testing.assert_close(cap.hidden_states, hs[-1], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        logits = m.lm_head(cap.hidden_states)
    torch.testing.assert_close(logits, out.logits[0], rtol=1e-5, atol=1e-5)


def test_batch_of_three_lengths_equals_each_alone(setup):
    _, be = setup
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 600, (n,), generator=g) for n in (5, 61, 17)]
    together = be.capture([(str(i), s) for i, s in enumerate(seqs)])
    for i, s in enumerate(seqs):
        (alone,) = be.capture([(str(i), s)])
        assert together[i].key == str(i) and together[i].hidden_states.shape[0] == len(s)
        torch.testing.assert_close(together[i].aux_hidden_states, alone.aux_hidden_states, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together[i].hidden_states, alone.hidden_states, rtol=1e-5, atol=1e-5)


def test_bf16_capture_close_to_fp32():
    m = tiny_llama()
    ids = torch.randint(0, 600, (20,))
    (a,) = HFBackend("tiny", AUX, dtype="float32", model=tiny_llama()).capture([("k", ids)])
    (b,) = HFBackend("tiny", AUX, dtype="bfloat16", model=m).capture([("k", ids)])
    assert b.hidden_states.dtype == torch.bfloat16
    rel = (b.hidden_states.float() - a.hidden_states).norm() / a.hidden_states.norm()
    assert rel < 3e-2


def test_layer_id_defaults_and_validation():
    assert default_aux_layer_ids(30) == [1, 14, 26]
    assert default_aux_layer_ids(61) == [1, 29, 57]
    assert default_aux_layer_ids(7) == [1, 2, 3]  # the shallowest model with three distinct ids
    for shallow in (4, 6):
        with pytest.raises(ValueError, match="duplicates"):
            default_aux_layer_ids(shallow)
    for bad, msg in (([1, 1, 2], "duplicates"), ([3, 2, 1], "sorted"), ([0, 1, 7], "out of range"),
                     ([1, 2], "exactly 3"), ([-1, 2, 3], "out of range")):
        with pytest.raises(ValueError, match=msg):
            validate_aux_layer_ids(bad, 8)


def test_deepseek_v3_aux_layers_are_hf_hidden_states_k_plus_1_and_served_ids_start_at_1():
    """The seeds' family (MLA + MoE): aux id k is HF hidden_states[k + 1], the final state is the
    post-norm one; ids SGLang would serve as layer inputs (first id not 1) are refused by name,
    for DeepSeek-V3 only."""
    m = tiny_family("deepseek_v3")
    be = HFBackend("tiny_ds", [1, 2, 4], dtype="float32", model=m)
    ids = torch.randint(0, 600, (23,), generator=torch.Generator().manual_seed(3))
    (c,) = be.capture([("k", ids)])
    with torch.no_grad():
        hs = m(ids[None], output_hidden_states=True).hidden_states
    for j, k in enumerate([1, 2, 4]):
        torch.testing.assert_close(c.aux_hidden_states[:, j * 64:(j + 1) * 64], hs[k + 1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c.hidden_states, hs[-1][0], rtol=1e-5, atol=1e-5)
    assert m.config.architectures is None  # a model built in code names no architecture: nothing to check
    m.config.architectures = ["DeepseekV3ForCausalLM"]
    with pytest.raises(ValueError, match=r"aux_layer_ids \[0, 2, 4\]: SGLang serves DeepseekV3ForCausalLM .* layer inputs"):
        HFBackend("tiny_ds", [0, 2, 4], dtype="float32", model=m)
    HFBackend("tiny_ds", [1, 2, 4], dtype="float32", model=m)
    HFBackend("tiny", [0, 2, 4], dtype="float32", model=tiny_llama())  # Llama serves ids as outputs: fine


@pytest.mark.parametrize("lens", [(5, 5), (5, 3)])
def test_a_model_returning_too_few_positions_is_named(lens):
    """States with fewer positions than the batch: one clear error naming the shapes and keys,
    for a padded batch too (not a torch broadcasting error from the finiteness check)."""
    m = tiny_llama()
    m.model.norm.register_forward_hook(lambda _m, _i, out: out[:, :-1])  # before the backend's own hook
    be = HFBackend("tiny", aux_layer_ids=AUX, dtype="float32", model=m)
    with pytest.raises(RuntimeError, match=r"the model returned states .* for a \[2, 5\] batch \(keys \['a', 'b'\]\)"):
        be.capture([("a", torch.randint(0, 600, (lens[0],))), ("b", torch.randint(0, 600, (lens[1],)))])


@pytest.fixture(scope="module")
def family_backends():
    return {}


@pytest.mark.parametrize("family, sees_padding", [
    ("llama", False), ("mistral_window_4", False), ("gemma3_local_global", False), ("bloom_alibi", False),
    ("gpt2", False), ("olmoe", False), ("qwen3_moe", False), ("deepseek_v3", False), ("gemma3_bidirectional", True)])
@settings(max_examples=8, deadline=None)
@given(lens=st.lists(st.integers(1, 19), min_size=1, max_size=4), seed=st.integers(0, 10**6))
def test_right_padded_batches_equal_each_sample_alone(family_backends, family, sees_padding, lens, seed):
    """Whatever the attention (full, sliding window, local/global, ALiBi, learned positions): every
    sample of a right-padded batch gets its states alone. Batches of causal models run without a
    padding mask (the start-up probe finds the padding invisible); a bidirectional model is found
    to see its padding and gets the mask."""
    if family not in family_backends:
        family_backends[family] = HFBackend(family, aux_layer_ids=[1, 2, 4], dtype="float32", model=tiny_family(family))
    be = family_backends[family]
    assert be.mask_padding is sees_padding
    assert be.info.extra["padding_mask"] is sees_padding and be.info.extra["cuda_graphs"] is False  # -> manifest
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 600, (n,), generator=g) for n in lens]
    together = be.capture([(str(i), s) for i, s in enumerate(seqs)])
    for i, s in enumerate(seqs):
        (alone,) = be.capture([(str(i), s)])
        assert together[i].finite is True and together[i].hidden_states.shape == (len(s), 64)
        torch.testing.assert_close(together[i].aux_hidden_states, alone.aux_hidden_states, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(together[i].hidden_states, alone.hidden_states, rtol=1e-5, atol=1e-5)


def test_a_model_that_sees_its_padding_without_a_mask_is_caught():
    """The probe runs the model: a Llama whose attention modules were switched to non-causal (no
    config field says so) sees its padding, so its batches get the mask."""
    m = tiny_llama()
    for layer in m.model.layers:
        layer.self_attn.is_causal = False
    assert HFBackend("tiny", aux_layer_ids=AUX, dtype="float32", model=m).mask_padding is True
    assert HFBackend("tiny", aux_layer_ids=AUX, dtype="float32", model=tiny_llama()).mask_padding is False


@pytest.mark.parametrize("family, mask_given", [("llama", False), ("gemma3_bidirectional", True)])
def test_the_padding_mask_reaches_only_a_model_that_sees_its_padding(family, mask_given):
    """A padded batch of a causal model runs without a mask (the attention's causal kernel, as for a
    lone sample); a model that sees its padding gets it."""
    be = HFBackend(family, aux_layer_ids=[1, 2, 4], dtype="float32", model=tiny_family(family))
    seen = []
    be.base.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True)
    be.capture([("a", torch.randint(0, 600, (9,))), ("b", torch.randint(0, 600, (4,)))])
    assert len(seen) == 1 and (seen[0] is not None) is mask_given
    if mask_given:
        assert seen[0].tolist() == [[1] * 9, [1] * 4 + [0] * 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_tells_a_rows_place_from_its_padding(dtype):
    """Stand-in models: one whose kernels round a row by its place in the batch (a few ulps, no
    padding effect) sees no padding; one whose real tokens read the padding's mean (a
    bidirectional leak) sees it, in float32 even when the leak is 1e-4 of the states."""
    from eagle_data.engines.hf import padding_is_visible

    emb = torch.randn(600, 8, generator=torch.Generator().manual_seed(3))

    def place_noise(ids, _mask):
        x = emb[ids].to(dtype)
        rows = torch.arange(ids.shape[0], dtype=torch.float32)[:, None, None]
        return {"final": (x.float() * (1 + rows * torch.finfo(dtype).eps)).to(dtype)}

    def leak(scale):
        return lambda ids, _mask: {"final": (emb[ids] + scale * emb[ids].mean(1, keepdim=True)).to(dtype)}

    assert padding_is_visible(place_noise, 600, torch.device("cpu")) is False
    assert padding_is_visible(lambda ids, _m: {"final": emb[ids].to(dtype)}, 600, torch.device("cpu")) is False
    assert padding_is_visible(leak(1.0), 600, torch.device("cpu")) is True
    if dtype == torch.float32:
        assert padding_is_visible(leak(1e-4), 600, torch.device("cpu")) is True
