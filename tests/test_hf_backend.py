"""HF reference backend: layer convention, final state, logits, batch independence."""

import pytest
import torch

from eagle_data.extract.backends import default_aux_layer_ids, validate_aux_layer_ids
from eagle_data.extract.backends.hf import HFBackend

from tiny import AUX, tiny_llama

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
    with pytest.raises(ValueError, match="duplicates"):
        default_aux_layer_ids(4)
    for bad, msg in (([1, 1, 2], "duplicates"), ([3, 2, 1], "sorted"), ([0, 1, 7], "out of range"),
                     ([1, 2], "exactly 3"), ([-1, 2, 3], "out of range")):
        with pytest.raises(ValueError, match=msg):
            validate_aux_layer_ids(bad, 8)


@pytest.mark.parametrize("lens", [(5, 5), (5, 3)])
def test_a_model_returning_too_few_positions_is_named(lens):
    """States with fewer positions than the batch: one clear error naming the shapes and keys,
    for a padded batch too (not a torch broadcasting error from the finiteness check)."""
    m = tiny_llama()
    m.model.norm.register_forward_hook(lambda _m, _i, out: out[:, :-1])  # before the backend's own hook
    be = HFBackend("tiny", aux_layer_ids=AUX, dtype="float32", model=m)
    with pytest.raises(RuntimeError, match=r"the model returned states .* for a \[2, 5\] batch \(keys \['a', 'b'\]\)"):
        be.capture([("a", torch.randint(0, 600, (lens[0],))), ("b", torch.randint(0, 600, (lens[1],)))])
