"""Training, eval and export hold the data to the drafter's facts (aux layers, hidden size) and
take the target from where it is now (found by a breaking pass)."""

import json
import logging
import shutil

import lightning.pytorch as pl
import pytest

from eagle_data.stream.datamodule import EagleDataModule
from eagle_train.evaluate import evaluate
from eagle_train.export import export_checkpoint
from eagle_train.module import EagleDrafterModule
from eagle_train.options import nest_groups
from eagle_train.vocab import build_vocab


def _module(model, dataset, tmp_path, **kw):
    _, _, vf = build_vocab(dataset, 32, out=tmp_path / "vocab.safetensors")
    return EagleDrafterModule(**nest_groups(dict(target_model_path=str(model), draft_vocab=str(vf), draft_vocab_size=32,
                                                 ttt_steps=2, exclude_oov=False, **kw)))  # grouped by field name


def _fit(mod, dataset, tmp_path, **dm_kw):
    dm = EagleDataModule(train=str(dataset), batch_size=2, num_workers=0, pin_memory=False, **dm_kw)
    tr = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
    tr.fit(mod, datamodule=dm)
    ck = tmp_path / "a.ckpt"
    tr.save_checkpoint(str(ck))
    return ck


def test_training_refuses_data_of_other_aux_layers_or_hidden_size(tiny, reference, tmp_path):
    model, _ = tiny
    with pytest.raises(ValueError, match=r"aux_layer_ids"):  # the data has layers [1, 3, 5]
        _fit(_module(model, reference, tmp_path, aux_layer_ids=[0, 2, 4]), reference, tmp_path)
    with pytest.raises(ValueError, match=r"data.aux_layer_ids is \[0, 2, 4\], the drafter"):
        _fit(_module(model, reference, tmp_path, aux_layer_ids=[1, 3, 5]), reference, tmp_path, aux_layer_ids=[0, 2, 4])
    with pytest.raises(ValueError, match=r"data.hidden_size is 7, the drafter"):
        _fit(_module(model, reference, tmp_path), reference, tmp_path, hidden_size=7)


@pytest.fixture(scope="module")
def other_layers(tiny, kr, tmp_path_factory):
    """A small dataset of the tiny target captured at layers [0, 2, 4] (the reference: [1, 3, 5])."""
    import dataclasses

    from eagle_data.extract.run import run_extract

    model, data = tiny
    out = tmp_path_factory.mktemp("other") / "ds"
    run_extract(dataclasses.replace(kr.config(out, model, data, shard_max_samples=8), aux_layer_ids=[0, 2, 4],
                                    num_samples=4))
    return out


def test_validation_data_and_loaders_built_early_are_held_to_the_drafter(tiny, reference, other_layers, tmp_path):
    model, _ = tiny
    with pytest.raises(ValueError, match=r"aux_layer_ids"):  # layers adopted from train, val has others
        _fit(_module(model, reference, tmp_path), reference, tmp_path, val=str(other_layers))
    mod = _module(model, reference, tmp_path, aux_layer_ids=[1, 3, 5])
    dm = EagleDataModule(train=str(other_layers), batch_size=2, num_workers=0, pin_memory=False)
    dm.train_dataloader()  # built before fit (e.g. to count steps): still checked
    tr = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"aux_layer_ids"):
        tr.fit(mod, datamodule=dm)


def test_a_target_of_another_shape_is_named_not_a_traceback(tiny, reference, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model, _ = tiny
    ck = _fit(_module(model, reference, tmp_path), reference, tmp_path)
    cfg = LlamaConfig.from_pretrained(model)
    cfg.hidden_size = cfg.hidden_size * 2
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    wrong = tmp_path / "wide"
    LlamaForCausalLM(cfg).save_pretrained(wrong)
    with pytest.raises(ValueError, match=r"does not fit the target folder given, .*wide"):
        EagleDrafterModule.load_from_checkpoint(str(ck), target_model_path=str(wrong))


def test_a_drafter_trained_without_dataset_dir_records_the_datas_aux_layers(tiny, reference, tmp_path):
    model, _ = tiny
    ck = _fit(_module(model, reference, tmp_path), reference, tmp_path)
    back = EagleDrafterModule.load_from_checkpoint(str(ck))
    assert back.aux_layer_ids == [1, 3, 5]
    out = export_checkpoint(str(ck), str(tmp_path / "export"), dtype="float32")
    assert json.loads((out / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    with pytest.raises(ValueError, match=r"aux_layer_ids \[0, 2, 4\]: the checkpoint's drafter was trained on"):
        export_checkpoint(str(ck), str(tmp_path / "export2"), aux_layer_ids=[0, 2, 4])


def test_eval_and_export_take_a_moved_target_and_refuse_foreign_data(tiny, reference, other_layers, tmp_path):
    model, _ = tiny
    moved = tmp_path / "target"
    shutil.copytree(model, moved)
    ck = _fit(_module(moved, reference, tmp_path), reference, tmp_path)
    shutil.rmtree(moved)
    with pytest.raises(ValueError, match=r"its target folder, .*target \(target_model_path\), has no config.json"):
        EagleDrafterModule.load_from_checkpoint(str(ck))
    kw = dict(num_samples=2, positions_per_sample=2, steps=2, compare_untrained=False, device="cpu")
    s = evaluate(dataset_dir=str(reference), checkpoint=str(ck), out_dir=str(tmp_path / "ev"),
                 target_model=str(model), **kw)
    assert s["trained"]["num_chains"] > 0 and s["target_agreement"] > 0.95
    assert (export_checkpoint(str(ck), str(tmp_path / "ex"), target_model=str(model)) / "config.json").is_file()
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match="no held-out keys"):
        evaluate(dataset_dir=str(reference), checkpoint=str(ck), out_dir=str(tmp_path / "ev2"),
                 heldout_keys=str(empty), target_model=str(model), **kw)
    with pytest.raises(ValueError, match=r"evaluating the checkpoint's drafter\): aux_layer_ids is \[0, 2, 4\], "
                                         r"expected \[1, 3, 5\]"):
        evaluate(dataset_dir=str(other_layers), checkpoint=str(ck), out_dir=str(tmp_path / "ev3"),
                 target_model=str(model), **kw)


def test_eval_refuses_a_same_shaped_target_that_did_not_make_the_data(tiny, reference, tmp_path):
    """A random model of the target's exact shape loads, runs and would report a plausible tau:
    the stored final states' greedy tokens must agree with the target's own."""
    import torch
    from transformers import LlamaForCausalLM

    model, _ = tiny
    ck = _fit(_module(model, reference, tmp_path), reference, tmp_path)
    torch.manual_seed(99)
    impostor = tmp_path / "impostor"
    LlamaForCausalLM(LlamaForCausalLM.config_class.from_pretrained(model)).save_pretrained(impostor)
    kw = dict(num_samples=2, positions_per_sample=2, steps=2, compare_untrained=False, device="cpu")
    with pytest.raises(ValueError, match=r"does not produce this dataset's states: its greedy token equals"):
        evaluate(dataset_dir=str(reference), checkpoint=str(ck), out_dir=str(tmp_path / "ev"),
                 target_model=str(impostor), **kw)
    with pytest.raises(ValueError, match=r"does not produce this dataset's states"):  # prompt lookup alone too
        evaluate(dataset_dir=str(reference), checkpoint=None, out_dir=str(tmp_path / "ev2"),
                 target_model=str(impostor), **kw)


def test_eval_names_a_target_of_another_width_and_reports_no_agreement_without_positions(tiny, reference, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model, _ = tiny
    cfg = LlamaConfig.from_pretrained(model)
    cfg.hidden_size = cfg.hidden_size * 2
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    wide = tmp_path / "wide"
    LlamaForCausalLM(cfg).save_pretrained(wide)
    kw = dict(num_samples=2, positions_per_sample=2, steps=2, compare_untrained=False, device="cpu")
    with pytest.raises(ValueError, match=r"hidden size is 128, the dataset's states are 64 wide"):
        evaluate(dataset_dir=str(reference), checkpoint=None, out_dir=str(tmp_path / "ev"),
                 target_model=str(wide), **kw)
    with pytest.raises(ValueError, match=r"no position to score: none of the 2 held-out sample\(s\) has a "
                                         r"supervised token within max_length 2"):  # not tau = NaN, exit 0
        evaluate(dataset_dir=str(reference), checkpoint=None, out_dir=str(tmp_path / "ev2"),
                 target_model=str(model), max_length=2, **kw)
    assert not (tmp_path / "ev2" / "acceptance.json").exists()


def test_eval_without_held_out_keys_warns_whatever_folder_it_reads(tiny, kr, reference, tmp_path, caplog):
    """Without held-out keys nothing proves the evaluated samples were not trained on: a folder
    extracted under another tag from the same rows holds the very samples the drafter trained on
    (found by a breaking pass), so every index split is labelled unchecked and warned about."""
    import dataclasses

    from eagle_data.extract.run import run_extract
    from eagle_data.stream.index import load_index

    model, data = tiny
    held = tmp_path / "held"
    run_extract(dataclasses.replace(kr.config(held, model, data, shard_max_samples=8), dataset_tag="held",
                                    num_samples=4))
    ck = _fit(_module(model, reference, tmp_path, dataset_dir=str(reference)), reference, tmp_path)
    kw = dict(num_samples=4, positions_per_sample=2, steps=2, compare_untrained=False, device="cpu")
    for where, fraction in ((held, 1.0), (reference, 0.1)):
        caplog.clear()
        s = evaluate(dataset_dir=str(where), checkpoint=str(ck), out_dir=str(tmp_path / "ev"),
                     heldout_fraction=fraction, **kw)
        assert s["heldout_source"] == "index split (not checked against the training data)"
        assert any("unchecked against the training data" in r.getMessage() for r in caplog.records)
        if where == held:
            assert s["heldout_keys"] == sorted(load_index(held)["key"])  # the whole folder at fraction 1.0
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(sorted(load_index(held)["key"])))
    caplog.clear()
    s = evaluate(dataset_dir=str(held), checkpoint=str(ck), out_dir=str(tmp_path / "ev2"), heldout_keys=str(keys), **kw)
    assert s["heldout_source"] == "heldout_keys" and s["heldout_keys"] == sorted(load_index(held)["key"])
    assert not any("unchecked" in r.getMessage() for r in caplog.records)


def test_held_out_keys_none_of_which_the_evaluated_folder_holds_are_named_with_their_source(tiny, kr, reference, tmp_path,
                                                                                              caplog):
    """The checkpoint's held-out keys belong to its training folder: given another folder, the error
    says where the keys came from (not a bare "samples not found")."""
    import dataclasses

    from eagle_data.extract.run import run_extract
    from eagle_data.stream.index import load_index

    model, data = tiny
    held = tmp_path / "held"
    run_extract(dataclasses.replace(kr.config(held, model, data, shard_max_samples=8), dataset_tag="held",
                                    num_samples=4))
    excl = tmp_path / "excl.json"
    excl.write_text(json.dumps(sorted(load_index(reference)["key"])[:3]))
    ck = _fit(_module(model, reference, tmp_path, exclude_keys=str(excl)), reference, tmp_path)
    kw = dict(num_samples=4, positions_per_sample=2, steps=2, compare_untrained=False, device="cpu")
    with pytest.raises(ValueError, match=r"held: none of the 3 held-out keys from the checkpoint is in this dataset.*"
                                         r"--heldout_fraction 1.0 for a set extracted apart"):
        evaluate(dataset_dir=str(held), checkpoint=str(ck), out_dir=str(tmp_path / "ev"), **kw)
    # a set extracted apart, asked for explicitly: scored whole, with the recorded keys named as unused
    with caplog.at_level(logging.WARNING, logger="eagle_train.heldout"):
        s = evaluate(dataset_dir=str(held), checkpoint=str(ck), out_dir=str(tmp_path / "ev"),
                     heldout_fraction=1.0, **kw)
    assert s["heldout_source"] == "index split (not checked against the training data)"
    assert s["heldout_keys"] == sorted(load_index(held)["key"])
    assert any("heldout_fraction given: the 3 held-out keys the checkpoint records are not used" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ValueError, match=r"give heldout_keys or heldout_fraction, not both"):
        evaluate(dataset_dir=str(held), checkpoint=str(ck), out_dir=str(tmp_path / "ev"),
                 heldout_keys=str(excl), heldout_fraction=1.0, **kw)
    with pytest.raises(ValueError, match=r"none of the 3 held-out keys from heldout_keys \(.*excl.json\)"):
        evaluate(dataset_dir=str(held), checkpoint=None, out_dir=str(tmp_path / "ev"),
                 heldout_keys=str(excl), target_model=str(model), **kw)
    s = evaluate(dataset_dir=str(reference), checkpoint=str(ck), out_dir=str(tmp_path / "ev"), **kw)
    assert s["heldout_source"] == "the checkpoint's held-out keys" and s["heldout_keys"] == json.loads(excl.read_text())
    both = tmp_path / "both.json"  # a key list spanning two folders: each folder evaluates its own keys
    both.write_text(json.dumps(json.loads(excl.read_text()) + sorted(load_index(held)["key"])[:2]))
    s = evaluate(dataset_dir=str(held), checkpoint=None, out_dir=str(tmp_path / "ev"),
                 heldout_keys=str(both), target_model=str(model), **kw)
    assert s["heldout_keys"] == sorted(load_index(held)["key"])[:2]



def test_eval_uses_the_keys_training_left_out_not_whatever_the_file_holds_now(tiny, reference, tmp_path, caplog):
    """The checkpoint records the keys its training left out: a held-out file rewritten (or a
    relative path read from another folder) after training cannot make trained-on samples look
    held out; given keys outside the recorded ones are warned about (found by a breaking pass)."""
    from eagle_data.stream.index import load_index

    model, _ = tiny
    keys = sorted(load_index(reference)["key"])
    excl = tmp_path / "excl.json"
    excl.write_text(json.dumps(keys[:3]))
    ck = _fit(_module(model, reference, tmp_path, exclude_keys=str(excl)), reference, tmp_path)
    excl.write_text(json.dumps(keys[10:13]))                      # rewritten after training: trained-on keys
    kw = dict(num_samples=4, positions_per_sample=2, steps=2, compare_untrained=False, device="cpu")
    s = evaluate(dataset_dir=str(reference), checkpoint=str(ck), out_dir=str(tmp_path / "ev"), **kw)
    assert s["heldout_source"] == "the checkpoint's held-out keys" and s["heldout_keys"] == keys[:3]
    assert EagleDrafterModule.load_from_checkpoint(str(ck)).excluded_keys == keys[:3]
    excl.write_text('{"not": "a list"}')                          # unreadable now: never read again
    assert evaluate(dataset_dir=str(reference), checkpoint=str(ck), out_dir=str(tmp_path / "ev"),
                    **kw)["heldout_keys"] == keys[:3]
    excl.unlink()                                                  # gone: the recorded keys still serve
    assert evaluate(dataset_dir=str(reference), checkpoint=str(ck), out_dir=str(tmp_path / "ev"),
                    **kw)["heldout_keys"] == keys[:3]
    given = tmp_path / "given.json"
    given.write_text(json.dumps(keys[1:5]))
    caplog.clear()
    s = evaluate(dataset_dir=str(reference), checkpoint=str(ck), out_dir=str(tmp_path / "ev"),
                 heldout_keys=str(given), **kw)
    assert s["heldout_keys"] == keys[1:5]
    assert any("2 of the 4 held-out keys given were not left out of this drafter's training" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ValueError, match="heldout_keys: an empty path"):
        evaluate(dataset_dir=str(reference), checkpoint=str(ck), out_dir=str(tmp_path / "ev"), heldout_keys="", **kw)


def test_eval_refuses_damaged_held_out_samples_naming_them(tiny, reference, tmp_path, monkeypatch):
    import eagle_train.evaluate as E

    model, _ = tiny
    real = E.read_samples

    def damaged(dataset_dir, keys):
        out = real(dataset_dir, keys)
        k = sorted(out)[-1]
        aux = out[k]["aux_hidden_states"].clone()
        aux[1, 2] = float("nan")
        out[k] = {**out[k], "aux_hidden_states": aux}
        return out

    kw = dict(num_samples=2, positions_per_sample=2, steps=2, compare_untrained=False, device="cpu")
    assert evaluate(dataset_dir=str(reference), checkpoint=None, out_dir=str(tmp_path / "ok"),
                    target_model=str(model), **kw)["num_samples"] == 2
    monkeypatch.setattr(E, "read_samples", damaged)
    with pytest.raises(ValueError, match=r"held-out sample\(s\) \S+ hold token ids outside the target's vocabulary "
                                         r"or non-finite states"):
        evaluate(dataset_dir=str(reference), checkpoint=None, out_dir=str(tmp_path / "ev"),
                 target_model=str(model), **kw)


def test_training_refuses_data_extracted_by_other_weights_of_the_same_shape(tiny, reference, tmp_path):
    from tiny import tiny_llama

    model, _ = tiny
    other = tmp_path / "other"
    tiny_llama(seed=1).save_pretrained(other)
    with pytest.raises(ValueError, match=r"manifest.json: extracted from other weights than the target .*other"):
        _fit(_module(other, reference, tmp_path), reference, tmp_path)
    assert _fit(_module(other, reference, tmp_path, check_target=False), reference, tmp_path).is_file()
    copied = tmp_path / "copied"  # the same weights in another folder: the same model
    shutil.copytree(model, copied)
    assert _fit(_module(copied, reference, tmp_path), reference, tmp_path).is_file()
