"""Training refuses what no extraction writes: damaged samples are dropped and named, a broken
drafter is not evaluated or exported, and data of another model is refused up front."""

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle_data.stream.shards import check_compat
from eagle_train.guard import bad_rows
from eagle_train.loss import ttt_loss
from train_tiny import ListLoader, tiny_batch, tiny_module, tiny_target

_BASE = tiny_batch(tiny_target(), n=4, t=20, seed=1)


def _damage(batch, row, how, where):
    b = {k: (v.clone() if torch.is_tensor(v) else list(v)) for k, v in batch.items()}
    n = int(b["attention_mask"][row].sum())
    t = where % n
    if how == "nan_aux":
        b["aux_hidden_states"][row, t, where % b["aux_hidden_states"].shape[-1]] = float("nan")
    elif how == "inf_final":
        b["hidden_states"][row, t, where % b["hidden_states"].shape[-1]] = float("-inf")
    elif how == "id_high":
        b["input_ids"][row, t] = 256 + where
    else:
        b["input_ids"][row, t] = -1 - where
    return b


@settings(max_examples=25, deadline=None)
@given(damaged=st.dictionaries(st.integers(0, 3), st.tuples(
    st.sampled_from(["nan_aux", "inf_final", "id_high", "id_negative"]), st.integers(0, 10**4)), max_size=4))
def test_bad_rows_flags_exactly_the_damaged_samples(damaged):
    b = _BASE
    for row, (how, where) in damaged.items():
        b = _damage(b, row, how, where)
    assert bad_rows(b, 256).tolist() == [i in damaged for i in range(4)]


def test_a_damaged_sample_is_dropped_named_and_counted_and_the_rest_trains_as_without_it(tmp_path, caplog):
    mod = tiny_module(tmp_path, ttt_steps=2, exclude_oov=False)
    bad = _damage(_BASE, 1, "nan_aux", 7)
    with caplog.at_level(logging.ERROR, logger="eagle_train.module"):
        kept, supervised = mod._filter(bad)
    assert kept["keys"] == ["k0", "k2", "k3"] and mod.bad_samples == 1
    assert supervised == int(_BASE["loss_mask"][[0, 2, 3]].sum())
    assert any("k1" in r.getMessage() and "verify" in r.getMessage() for r in caplog.records)
    clean = {k: (v[[0, 2, 3]] if torch.is_tensor(v) else [v[i] for i in (0, 2, 3)]) for k, v in _BASE.items()}
    got = ttt_loss(mod.drafter, mod.target_lm_head, kept, 2)["loss"]
    want = ttt_loss(mod.drafter, mod.target_lm_head, clean, 2)["loss"]
    assert torch.isfinite(got) and torch.equal(got, want)
    everything_bad = _damage(_damage(_damage(_damage(_BASE, 0, "id_high", 1), 1, "id_negative", 2), 2, "inf_final", 3),
                             3, "nan_aux", 4)
    assert mod._filter(everything_bad) == (None, 0) and mod.bad_samples == 5
    step = mod.training_step(everything_bad, 0)  # a zero loss: DDP ranks stay in step
    assert float(step.detach()) == 0.0 and step.requires_grad


def test_fit_on_a_batch_with_a_nan_sample_keeps_the_weights_finite(tmp_path):
    import lightning.pytorch as pl

    mod = tiny_module(tmp_path, ttt_steps=2)
    batches = [_damage(tiny_batch(tiny_target(), n=2, t=16, seed=s), 0, "nan_aux", s) for s in range(3)]
    pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
               default_root_dir=str(tmp_path), enable_checkpointing=False).fit(mod, train_dataloaders=ListLoader(batches))
    assert mod.bad_samples == 3
    assert all(torch.isfinite(p).all() for p in mod.drafter.parameters())


def test_a_checkpoint_with_non_finite_weights_is_refused_by_eval_and_export(tmp_path):
    import lightning.pytorch as pl

    from eagle_train.export import export_checkpoint
    from eagle_train.module import EagleDrafterModule

    mod = tiny_module(tmp_path, ttt_steps=2)
    tr = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
    tr.fit(mod, train_dataloaders=ListLoader([tiny_batch(tiny_target(), n=2, t=12)]))
    with torch.no_grad():
        mod.drafter.fc.weight[0, 0] = float("nan")
    tr.save_checkpoint(str(tmp_path / "nan.ckpt"))
    with pytest.raises(ValueError, match=r"nan.ckpt: the drafter's weights are not finite \(fc.weight"):
        EagleDrafterModule.load_from_checkpoint(str(tmp_path / "nan.ckpt"))
    with pytest.raises(ValueError, match="not finite"):
        export_checkpoint(str(tmp_path / "nan.ckpt"), str(tmp_path / "export"), dtype="float32")


def _manifest(**kw):
    m = {"schema_version": 3, "layer_id_convention": "output_of_decoder_layer_k", "final_state_norm": "post",
         "hidden_size": 64, "aux_layer_ids": [1, 3, 5], "dtype": "bfloat16", "final_dtype": "bfloat16",
         "vocab_size": 256, "config": {"weights_fingerprint": "aaaa"}}
    for k, v in kw.items():
        if k == "fp":
            m["config"] = {} if v is None else {"weights_fingerprint": v}
        else:
            m[k] = v
    return m


def test_datasets_of_different_models_are_not_mixed():
    from eagle_data.format.schema import LAYER_ID_CONVENTION, SCHEMA_VERSION

    base = dict(schema_version=SCHEMA_VERSION, layer_id_convention=LAYER_ID_CONVENTION)
    assert check_compat([("a", _manifest(**base)), ("b", _manifest(**base))], {})["vocab_size"] == 256
    with pytest.raises(ValueError, match="b: vocab_size is 300 but a has 256.*different models"):
        check_compat([("a", _manifest(**base)), ("b", _manifest(vocab_size=300, **base))], {})
    # other weights of one shape: the loader reads them; training compares each with its target (check_target)
    check_compat([("a", _manifest(**base)), ("b", _manifest(fp="bbbb", **base))], {})


def test_training_data_of_another_target_is_refused(tmp_path):
    from eagle_data.format.fingerprint import weights_fingerprint
    from train_tiny import tiny_target_dir

    mod = tiny_module(tmp_path, ttt_steps=2)
    mine = weights_fingerprint(tiny_target_dir(tmp_path))
    mod.target_check({"vocab_size": 256, "weights_fingerprint": mine}, "ds")
    mod.target_check({"vocab_size": 256, "weights_fingerprint": None}, "ds")
    with pytest.raises(ValueError, match=r"ds: extracted by a model with vocab_size 300, the target .* has 256"):
        mod.target_check({"vocab_size": 300, "weights_fingerprint": mine}, "ds")
    with pytest.raises(ValueError, match=r"ds: extracted from other weights than the target .*check_target false"):
        mod.target_check({"vocab_size": 256, "weights_fingerprint": "0" * 16}, "ds")
    tiny_module(tmp_path, ttt_steps=2, check_target=False).target_check(
        {"vocab_size": 256, "weights_fingerprint": "0" * 16}, "ds")


def test_a_draft_vocabulary_of_another_target_vocabulary_is_refused(tmp_path):
    from eagle_train.module import EagleDrafterModule
    from eagle_train.options import DrafterOptions
    from eagle_train.vocab import save_vocab, select_vocab
    from train_tiny import tiny_target_dir

    d2t, t2d = select_vocab(torch.arange(600), 600, 48)
    vf = save_vocab(tmp_path / "v600.safetensors", d2t, t2d)
    with pytest.raises(ValueError, match=r"maps a target vocabulary of 600 tokens; the target .* has 256"):
        EagleDrafterModule(target_model_path=str(tiny_target_dir(tmp_path)), draft_vocab=str(vf),
                           draft_vocab_size=48, drafter=DrafterOptions(aux_layer_ids=[1, 3, 5]))


def test_a_batch_without_supervised_tokens_does_not_pull_the_epoch_metrics_down(tmp_path, caplog):
    import lightning.pytorch as pl

    taught = tiny_batch(tiny_target(), n=2, t=16, seed=0)
    untaught = {**tiny_batch(tiny_target(), n=2, t=16, seed=1)}
    untaught["loss_mask"] = torch.zeros_like(untaught["loss_mask"])

    def epoch_loss(batches):
        mod = tiny_module(tmp_path, ttt_steps=2, lr=0.0, compile_warmup=False)
        tr = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
        tr.fit(mod, train_dataloaders=ListLoader(batches))
        return float(tr.callback_metrics["train/loss_0_epoch"])

    alone = epoch_loss([taught])
    with caplog.at_level(logging.WARNING, logger="eagle_train.module"):
        both = epoch_loss([taught, untaught])
    assert alone > 0 and both == pytest.approx(alone, rel=1e-3)
    assert any("no supervised token" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("order", ["after", "before"])
def test_a_step_that_teaches_nothing_moves_no_weight_and_is_no_step(tmp_path, order):
    """A batch with no supervised token, or wholly held out, used to be a full AdamW step: its
    zero gradient still moved the weights by the momentum (about 2/3 of a real step) and the lr
    schedule advanced. Now the weights and the schedule are those of the taught batches alone."""
    import lightning.pytorch as pl

    target = tiny_target()
    taught = [tiny_batch(target, n=2, t=16, seed=s) for s in (0, 1)]
    untaught = tiny_batch(target, n=2, t=16, seed=2)
    untaught["loss_mask"] = torch.zeros_like(untaught["loss_mask"])
    held = tiny_batch(target, n=2, t=16, seed=3)  # keys k0, k1: both held out below
    (tmp_path / "held.json").write_text('["k0", "k1"]')

    def fit(batches):
        mod = tiny_module(tmp_path, ttt_steps=2, lr=1e-2, warmup_steps=2, compile_warmup=False,
                          exclude_keys=str(tmp_path / "held.json"))
        tr = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
        tr.fit(mod, train_dataloaders=ListLoader(batches))
        return mod, tr

    for t in taught:  # the held-out keys must be out of the taught batches
        t["keys"] = ["a" + k for k in t["keys"]]
    alone, tr_alone = fit([taught[0], taught[1]])
    mixed = [taught[0], untaught, held, taught[1]] if order == "after" else [untaught, held, taught[0], taught[1]]
    mod, tr = fit(mixed)
    assert mod.skipped_steps == 2 and alone.skipped_steps == 0  # (Lightning's global_step counts batches: 4)
    assert tr.lr_scheduler_configs[0].scheduler.last_epoch == tr_alone.lr_scheduler_configs[0].scheduler.last_epoch
    for (name, a), b in zip(alone.drafter.named_parameters(), mod.drafter.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_an_accumulated_step_that_taught_in_any_micro_batch_is_an_update(tmp_path):
    """With accumulate_grad_batches the step's last micro-batch alone decided: a taught micro-batch
    followed by an untaught one was thrown away."""
    import lightning.pytorch as pl

    target = tiny_target()
    taught = tiny_batch(target, n=2, t=16, seed=0)
    untaught = tiny_batch(target, n=2, t=16, seed=2)
    untaught["loss_mask"] = torch.zeros_like(untaught["loss_mask"])
    mod = tiny_module(tmp_path, ttt_steps=2, lr=1e-2, compile_warmup=False)
    before = [p.detach().clone() for p in mod.drafter.parameters()]
    tr = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False, accumulate_grad_batches=2,
                    enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
    tr.fit(mod, train_dataloaders=ListLoader([taught, untaught, untaught, untaught]))
    assert mod.skipped_steps == 1  # the second step (two untaught micro-batches) only
    assert any(not torch.equal(a, b) for a, b in zip(before, mod.drafter.parameters()))


def test_a_resume_that_would_hold_out_other_keys_is_refused(tmp_path):
    import lightning.pytorch as pl

    def fit(mod, steps, ckpt=None):
        tr = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
        tr.fit(mod, train_dataloaders=ListLoader([tiny_batch(tiny_target(), n=2, t=12, seed=s) for s in range(3)]),
               ckpt_path=ckpt)
        return tr

    fit(tiny_module(tmp_path, ttt_steps=2, compile_warmup=False), 2).save_checkpoint(str(tmp_path / "a.ckpt"))
    (tmp_path / "held.json").write_text('["k1"]')
    with pytest.raises(ValueError, match=r"held.json holds 1 key\(s\), the checkpoint's training left out 0 others"):
        fit(tiny_module(tmp_path, ttt_steps=2, exclude_keys=str(tmp_path / "held.json")), 3, str(tmp_path / "a.ckpt"))
    assert fit(tiny_module(tmp_path, ttt_steps=2), 3, str(tmp_path / "a.ckpt")).global_step == 3  # same keys: resumes


def test_sources_of_one_dataset_tag_are_not_mixed():
    from eagle_data.format.schema import LAYER_ID_CONVENTION, SCHEMA_VERSION

    base = dict(schema_version=SCHEMA_VERSION, layer_id_convention=LAYER_ID_CONVENTION)
    a, b = _manifest(**base), _manifest(**base)
    a["config"], b["config"] = {"dataset_tag": "train"}, {"dataset_tag": "train"}
    with pytest.raises(ValueError, match=r"d2 and d1 have the same dataset_tag 'train': their sample keys"):
        check_compat([("d1", a), ("d2", b)], {})
    b["config"]["dataset_tag"] = "train2"
    check_compat([("d1", a), ("d2", b)], {})


def test_validation_batches_without_supervised_tokens_move_no_metric(tmp_path):
    """A validation batch that teaches nothing is logged with weight 0: beside a taught batch the
    metrics are the taught batch's alone; with nothing taught at all they read NaN (no data), not
    a perfect-looking 0."""
    import math

    import lightning.pytorch as pl

    taught = tiny_batch(tiny_target(), n=2, t=16, seed=0)
    untaught = tiny_batch(tiny_target(), n=2, t=16, seed=1)
    untaught["loss_mask"] = torch.zeros_like(untaught["loss_mask"])

    def val(batches):
        mod = tiny_module(tmp_path, ttt_steps=2, lr=0.0, compile_warmup=False)
        tr = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
        return tr.validate(mod, dataloaders=ListLoader(batches), verbose=False)[0]

    # masked only where no step reaches (positions 0-1): the loss scores nothing there either
    unreached = tiny_batch(tiny_target(), n=2, t=16, seed=2)
    unreached["loss_mask"] = torch.zeros_like(unreached["loss_mask"])
    unreached["loss_mask"][:, :2] = True
    # every row damaged (dropped by the guard): still logged, with weight 0 (DDP ranks log alike)
    damaged = tiny_batch(tiny_target(), n=2, t=16, seed=3)
    damaged["input_ids"][:, 3] = 10 ** 6

    alone = val([taught])
    assert alone["val/loss"] > 1.0
    for extra in (untaught, unreached, damaged):
        both, none = val([taught, extra]), val([extra])
        assert set(alone) == set(both) == set(none)
        assert all(both[k] == pytest.approx(alone[k], rel=1e-6) for k in alone)
        assert all(math.isnan(v) for v in none.values())
