"""eagle_train: draft vocab, TTT loss masks, teacher logits, loss regression, attention, configs."""

import glob
import re
from pathlib import Path

import pytest
import torch

from eagle_train.options import DrafterOptions
from train_tiny import TINY_AUX, ListLoader, tiny_batch, tiny_module, tiny_target

ROOT = Path(__file__).resolve().parents[1]


def test_vocab_example():
    from eagle_train.vocab import select_vocab

    d2t, t2d = select_vocab({7: 5, 2: 3, 9: 1}, vocab_size=12, size=4)
    ids = torch.arange(4) + d2t
    assert {2, 7, 9} <= set(ids.tolist())
    assert ids.tolist() == [0, 2, 7, 9]  # fill-up with the lowest unused id (0)
    assert bool((ids[1:] > ids[:-1]).all())
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == ids.tolist()


def test_vocab_ties_and_truncation():
    from eagle_train.vocab import select_vocab

    d2t, t2d = select_vocab({5: 2, 3: 2, 8: 2, 1: 9}, vocab_size=10, size=3)
    assert (torch.arange(3) + d2t).tolist() == [1, 3, 5]  # tie 3/5/8 -> lower ids win


def _vocab_dataset(d, **manifest):
    """index.parquet of two samples + a minimal manifest (V=12, one shard) in ``d``."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from eagle_data.format.schema import FINAL_STATE_NORM, LAYER_ID_CONVENTION, SCHEMA_VERSION

    pq.write_table(pa.table({"key": ["a", "b"], "loss_token_ids": [[2, 7], [7, 9]],
                             "loss_token_counts": [[3, 4], [1, 1]]}), d / "index.parquet")
    m = {"schema_version": SCHEMA_VERSION, "layer_id_convention": LAYER_ID_CONVENTION,
         "final_state_norm": FINAL_STATE_NORM, "vocab_size": 12, "config_hash": "c0", "num_samples": 2,
         "shards": [{"name": "00000-000000.tar", "sha256": "ab" * 32}]}
    (d / "manifest.json").write_text(json.dumps({**m, **manifest}))
    return d


def test_vocab_from_index_and_reuse(tmp_path):
    from eagle_train.vocab import build_vocab, vocab_provenance

    _vocab_dataset(tmp_path)
    d2t, t2d, p = build_vocab(tmp_path, 4, out=tmp_path / "draft_vocab_4.safetensors")
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 7, 9]
    assert vocab_provenance(p)["num_excluded"] == 0 and vocab_provenance(p)["vocab_size"] == 12
    d2t2, _, p2 = build_vocab(tmp_path, 4, out=tmp_path / "draft_vocab_4.safetensors")  # same inputs: reused
    assert p2 == p and torch.equal(d2t, d2t2)
    d2t3, _, _ = build_vocab(tmp_path, 4, out=tmp_path / "draft_vocab_4.safetensors", exclude_keys=["b"], rebuild=True)
    assert (torch.arange(4) + d2t3).tolist() == [0, 1, 2, 7]
    assert torch.equal(build_vocab(tmp_path, 4, out=tmp_path / "draft_vocab_4.safetensors", exclude_keys=["b"])[0], d2t3)  # reused with the same keys


def test_vocab_file_built_from_other_inputs_is_refused_not_reused(tmp_path):
    """A held-out list (or the dataset) that changed must not reuse a vocabulary that counted
    the held-out samples; a file without the record (older eagle-data) is refused too."""
    from eagle_train.vocab import build_vocab, save_vocab, select_vocab

    _vocab_dataset(tmp_path)
    p = build_vocab(tmp_path, 4, out=tmp_path / "draft_vocab_4.safetensors")[2]
    with pytest.raises(ValueError, match=r"built from other inputs: exclude_keys_sha256 .*num_excluded 0 \(now 1\);"
                                         r" rebuild it .*--rebuild true` plus the same --exclude_keys"):
        build_vocab(tmp_path, 4, out=tmp_path / "draft_vocab_4.safetensors", exclude_keys=["b"])
    _vocab_dataset(tmp_path, shards=[{"name": "00000-000000.tar", "sha256": "cd" * 32}], num_samples=3)
    with pytest.raises(ValueError, match=r"dataset_sha256 .*num_samples 2 \(now 3\)"):
        build_vocab(tmp_path, 4, out=tmp_path / "draft_vocab_4.safetensors")
    save_vocab(p, *select_vocab({1: 1}, 12, 4))  # no built_from record
    with pytest.raises(ValueError, match="does not record what it was built from"):
        build_vocab(tmp_path, 4, out=tmp_path / "draft_vocab_4.safetensors")
    assert (torch.arange(4) + build_vocab(tmp_path, 4, out=tmp_path / "draft_vocab_4.safetensors", rebuild=True)[0]).tolist() == [0, 2, 7, 9]
    p.write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="draft_vocab_4.safetensors: not a draft vocabulary file"):
        build_vocab(tmp_path, 4, out=tmp_path / "draft_vocab_4.safetensors")


@pytest.mark.parametrize("exclude,msg", [(["b", "bb", "zz"], r"exclude_keys: 2 of 3 key\(s\) are not in the index "
                                                            r".*\['bb', 'zz'\]"),
                                         (["a", 3], r"exclude_keys: sample keys must be strings, got \[3\]"),
                                         (["a", "b"], r"no supervised token to count \(2 sample\(s\), 2 excluded\)")])
def test_vocab_exclude_keys_are_checked_against_the_index(tmp_path, exclude, msg):
    from eagle_train.vocab import build_vocab

    _vocab_dataset(tmp_path)
    with pytest.raises(ValueError, match=msg):
        build_vocab(tmp_path, 4, exclude_keys=exclude)
    assert not (tmp_path / "draft_vocab_4.safetensors").exists()


@pytest.mark.parametrize("manifest,msg", [({"schema_version": 99}, r"schema_version 99; this eagle_data reads schema_version 3 only"),
                                          ({"layer_id_convention": "x"}, "layer_id_convention 'x'"),
                                          ({"vocab_size": None}, "vocab_size must be an integer >= 1, got None"),
                                          ({"shards": None}, "no shards list")])
def test_vocab_checks_the_manifest(tmp_path, manifest, msg):
    import json

    from eagle_train.vocab import build_vocab

    _vocab_dataset(tmp_path, **manifest)
    with pytest.raises(ValueError, match=msg):
        build_vocab(tmp_path, 4)
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="manifest.json: schema_version None"):
        build_vocab(tmp_path, 4)
    _vocab_dataset(tmp_path)
    m = json.loads((tmp_path / "manifest.json").read_text())
    del m["vocab_size"]
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="manifest.json: no vocab_size field"):
        build_vocab(tmp_path, 4)


@pytest.mark.parametrize("content,msg", [(None, r"--exclude_keys: .*missing.json does not exist \(give a JSON file "
                                                r"holding a list of sample keys\)"),
                                         ('{"a": 1}', r"holds a JSON dict, expected a list of sample keys"),
                                         ('["a", null]', r"sample keys must be strings, got \[None\]"),
                                         ("a\nb", r"is not a JSON file holding a list of sample keys"),
                                         ('["a", "typo"]', r"1 of 2 key\(s\) are not in the index .*\['typo'\]")])
def test_cli_vocab_exclude_keys_file_errors(tmp_path, capsys, monkeypatch, content, msg):
    from eagle_data.cli import main as cli

    _vocab_dataset(tmp_path)
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")  # the default output lands in the current directory
    f = tmp_path / ("missing.json" if content is None else "keys.json")
    if content is not None:
        f.write_text(content)
    with pytest.raises(SystemExit) as e:
        cli.main(["vocab", str(tmp_path), "--size", "4", "--exclude_keys", str(f)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: " in err and "Traceback" not in err
    assert re.search(msg, err), err
    f.write_text('["b"]')
    cli.main(["vocab", str(tmp_path), "--size", "4", "--exclude_keys", str(f)])
    from eagle_train.vocab import load_vocab

    out = capsys.readouterr().out.strip()
    assert out == "draft_vocab_4.safetensors" and (tmp_path / "run" / out).is_file()
    assert (torch.arange(4) + load_vocab(out)[0]).tolist() == [0, 1, 2, 7]


def test_module_vocab_built_from_the_dataset_leaves_its_held_out_keys_out(tmp_path):
    from eagle_train.module import EagleDrafterModule
    from train_tiny import tiny_target_dir

    _vocab_dataset(tmp_path, vocab_size=256)
    (tmp_path / "held.json").write_text('["b"]')
    mod = EagleDrafterModule(target_model_path=str(tiny_target_dir(tmp_path)), dataset_dir=str(tmp_path),
                             draft_vocab_size=4, drafter=DrafterOptions(aux_layer_ids=TINY_AUX),
                             exclude_keys=str(tmp_path / "held.json"))
    assert (torch.arange(4) + mod.drafter.d2t).tolist() == [0, 1, 2, 7]  # 9 is only in "b"
    assert mod.held_out.keys == {"b"}
    vf = tmp_path / "v4.safetensors"  # a file built with "b" counted is not reused once "b" is held out
    EagleDrafterModule(target_model_path=str(tiny_target_dir(tmp_path)), dataset_dir=str(tmp_path),
                       draft_vocab=str(vf), draft_vocab_size=4, drafter=DrafterOptions(aux_layer_ids=TINY_AUX))
    with pytest.raises(ValueError, match=r"v4.safetensors was built from other inputs: exclude"):
        EagleDrafterModule(target_model_path=str(tiny_target_dir(tmp_path)), dataset_dir=str(tmp_path),
                           draft_vocab=str(vf), draft_vocab_size=4, drafter=DrafterOptions(aux_layer_ids=TINY_AUX),
                           exclude_keys=str(tmp_path / "held.json"))
    again = EagleDrafterModule(target_model_path=str(tiny_target_dir(tmp_path)), dataset_dir=str(tmp_path),
                               draft_vocab=str(vf), draft_vocab_size=4,
                               drafter=DrafterOptions(aux_layer_ids=TINY_AUX))  # same inputs: reused
    assert 9 in (torch.arange(4) + again.drafter.d2t).tolist()


@pytest.mark.parametrize("args,msg", [(["--minutes", "-1"], "minutes must be a number > 0"),
                                      (["--minutes", "0"], "minutes must be a number > 0"),
                                      (["--draft_vocab_size", "0"], "draft_vocab_size must be >= 1, got 0"),
                                      (["--eval_samples", "0"], "eval_samples must be >= 1, got 0")])
def test_cli_demo_refuses_bad_numbers_before_running(tmp_path, capsys, args, msg):
    """`eagle-data demo --minutes -1` used to run to the end and exit 0."""
    from eagle_data.cli import main as cli

    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", str(tmp_path / "no-dataset"), "--out", str(out), *args])
    assert e.value.code == 2 and f"error: {msg}" in capsys.readouterr().err
    assert not out.exists()
    from eagle_train.pipeline import demo

    with pytest.raises(ValueError, match="minutes must be a number > 0"):
        demo(str(tmp_path / "no-dataset"), str(out), minutes=float("inf"))
    with pytest.raises(ValueError, match=r"heldout_fraction must be in \(0, 1\), got 1.0"):
        demo(str(tmp_path / "no-dataset"), str(out), heldout_fraction=1.0)


def test_loss_mask_shift_example():
    from eagle_train.loss import step_loss_masks

    m = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1]])
    valid = torch.ones_like(m, dtype=torch.bool)
    s = step_loss_masks(m, valid, 3)
    assert [set(s[k, 0].nonzero().flatten().tolist()) for k in range(3)] == [{5, 6, 7, 8}, {4, 5, 6, 7}, {3, 4, 5, 6}]
    # padding: the same sample right-padded to 12 with the last two targets marked invalid
    m2 = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    v2 = torch.tensor([[True] * 10 + [False] * 2])
    assert torch.equal(step_loss_masks(m2, v2, 3)[:, :, :10], s)
    assert not step_loss_masks(m2, v2, 3)[:, :, 9:].any()


def test_teacher_logits_match_target():
    from eagle_data.engines.hf import HFBackend
    from eagle_train.loss import teacher_logits

    target = tiny_target()
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    be = HFBackend(model=target, model_path="tiny", dtype="float32", aux_layer_ids=TINY_AUX)
    (cap,) = be.capture([("a", ids)])
    with torch.no_grad():
        ref = target(ids[None]).logits[0].float()
    head = target.lm_head.weight.detach().clone()
    fin = cap.hidden_states.clone()
    t2d = torch.ones(256, dtype=torch.bool)
    got = teacher_logits(fin.bfloat16()[None], head, t2d)[0]
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
    assert kl.sum(-1).max() < 1e-3
    # restricted teacher = the target distribution renormalised over the draft vocab
    sub = torch.zeros(256, dtype=torch.bool)
    sub[::3] = True
    r = teacher_logits(fin[None], head, sub)[0].softmax(-1)
    p = ref.softmax(-1)[:, sub]
    torch.testing.assert_close(r, p / p.sum(-1, keepdim=True), rtol=1e-4, atol=1e-6)


def test_ttt_attention_mask():
    """Step k, row t sees step-0 keys <= t and the step-j (1<=j<=k) keys of row t only."""
    from eagle_train.model import ttt_attention, ttt_attention_reference

    torch.manual_seed(0)
    B, h, T, d = 1, 1, 5, 4
    q = torch.randn(B, h, T, d)
    ks = [torch.randn(B, h, T, d) for _ in range(3)]
    vs = [torch.randn(B, h, T, d) for _ in range(3)]
    mask0 = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    out = ttt_attention_reference(q, ks[0], vs[0], mask0, ks[1:], vs[1:])
    new = ttt_attention(q, ks[0], vs[0], torch.ones(B, T, dtype=torch.bool), ks[1:], vs[1:], chunk=2)
    for t in range(T):  # explicit reference: keys = step-0 rows <= t, then row t of steps 1, 2
        K = torch.cat([ks[0][0, 0, : t + 1], ks[1][0, 0, t: t + 1], ks[2][0, 0, t: t + 1]])
        V = torch.cat([vs[0][0, 0, : t + 1], vs[1][0, 0, t: t + 1], vs[2][0, 0, t: t + 1]])
        w = torch.softmax(q[0, 0, t] @ K.T / d ** 0.5, -1)
        torch.testing.assert_close(out[0, t], w @ V)
        torch.testing.assert_close(new[0, t], w @ V)


def test_chain_matches_ttt_first_step(tmp_path):
    """propose_chain's step-0 drafting equals the TTT forward at the same row (same token)."""
    mod = tiny_module(tmp_path)
    b = tiny_batch(tiny_target(), n=1, t=20)
    ids, aux = b["input_ids"][0], b["aux_hidden_states"][0].float()
    rows = torch.cat([ids[1:], ids.new_zeros(1)])
    d = mod.drafter
    with torch.no_grad():
        hs = d.ttt_forward(rows[None], aux[None], torch.ones(1, 20, dtype=torch.bool), steps=1)
    r = 9
    prop = d.propose_chain(rows, aux, [r], [int(rows[r])], steps=1)
    assert prop[0, 0] == d.target_ids()[d.logits(hs[0])[0, r].argmax()]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_chain_step_is_what_the_ttt_loss_trains_where_the_data_are_the_drafts(tmp_path, seed, monkeypatch):
    """The training/serving contract of every step, through :func:`ttt_loss` itself: where a sample
    continues with the very tokens the served chain drafted from row ``r``, TTT step ``k`` at row
    ``r`` holds the chain's own pre-norm state of step ``k`` (same token, rope position, keys;
    compared as numbers, not argmaxes) and is taught by the final state at position ``r + k + 1``
    (each position's greedy token made distinct here, so a teacher off by any number of steps is
    seen). A padded second sample shares the batch. Any step reading another row's state, token, position or
    teacher would train the drafter for a chain it never runs."""
    from eagle_train import loss as L

    mod = tiny_module(tmp_path / str(seed), seed=seed, exclude_oov=False)
    d, tids = mod.drafter, mod.drafter.target_ids()
    gen = torch.Generator().manual_seed(seed)
    head = torch.nn.functional.normalize(torch.randn(256, 64, generator=gen), dim=-1)  # argmax(head @ c*head[i]) = i
    base = tiny_batch(tiny_target(), n=2, t=24, seed=seed)
    for steps, r in ((3, 0), (7, 4), (7, 13)):
        batch = {k: v.clone() if torch.is_tensor(v) else v for k, v in base.items()}
        batch["aux_hidden_states"] = batch["aux_hidden_states"].float()
        batch["hidden_states"] = batch["hidden_states"].float()
        ids, aux = batch["input_ids"][0], batch["aux_hidden_states"][0]
        rows = torch.cat([ids[1:], ids.new_zeros(1)])
        chain_states = []
        with monkeypatch.context() as mp:
            mp.setattr(d, "logits", lambda h, f=d.logits: (chain_states.append(h.reshape(-1)), f(h))[1])
            drafts = d.propose_chain(rows, aux, [r], [int(rows[r])], steps=steps)[0]
        batch["input_ids"][0, r + 2: r + steps + 1] = drafts[: steps - 1]  # step k reads x[r+k+1]: draft k-1
        greedy = tids[torch.arange(steps) * 5 + 1]  # distinct draft-vocabulary tokens, one per position
        batch["hidden_states"][0, r + 1: r + steps + 1] = 50.0 * head[greedy]  # the target's greedy tokens
        batch["loss_mask"][:] = False
        batch["loss_mask"][0, r + 2: r + steps + 2] = True  # each step k supervises row r (and a few others)
        seen = []
        with monkeypatch.context() as mp:
            mp.setattr(L, "_step_ce", lambda dr, h, teach, arg, ts, n, f=L._step_ce: (seen.append((h, arg[ts])),
                                                                                    f(dr, h, teach, arg, ts, n))[1])
            sup = L.supervised_rows(d, head, batch, steps, False)
            with torch.no_grad():
                L.ttt_loss(d, head, batch, steps=steps, exclude_oov=False)
        assert len(seen) == steps
        for k, (h, teach_arg) in enumerate(seen):
            i = int(sup[k, 0, :r].sum())  # row r's place among step k's supervised rows (sample 0 first)
            torch.testing.assert_close(h[i], chain_states[k], rtol=1e-4, atol=1e-5)
            assert int(tids[teach_arg[i]]) == int(greedy[k]), (steps, r, k)
            assert int(tids[d.logits(h[i]).argmax()]) == int(drafts[k])


def test_loss_regression(tmp_path):
    """Fixed init + fixed batch: loss after 8 AdamW steps equals the recorded value; it decreases."""
    torch.manual_seed(0)
    mod = tiny_module(tmp_path, exclude_oov=False)
    batch = tiny_batch(tiny_target(), n=2, t=24)
    from eagle_train.loss import ttt_loss

    opt = torch.optim.AdamW(mod.drafter.parameters(), lr=1e-3)
    losses = []
    for _ in range(8):
        out = ttt_loss(mod.drafter, mod.target_lm_head, batch, steps=3)
        losses.append(float(out["loss"]))
        out["loss"].backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0] - 0.05 and all(b <= a + 1e-6 for a, b in zip(losses, losses[1:]))
    assert len(out["acc_k"]) == 3 and all(0 <= float(a) <= 1 for a in out["acc_k"])
    print("losses", losses)
    assert losses[0] == pytest.approx(RECORDED[0], rel=1e-3)
    assert losses[-1] == pytest.approx(RECORDED[1], rel=1e-3)


RECORDED = (9.487086, 9.413103)  # recorded on CPU, torch 2.14.1


def test_lightning_fit_and_resume(tmp_path):
    """Two Trainer.fit runs: 3 steps, then resume from the checkpoint to 5 steps."""
    import lightning.pytorch as pl

    mod = tiny_module(tmp_path, exclude_oov=True, ttt_steps=2, exclude_keys=None)
    batches = [tiny_batch(tiny_target(), n=2, t=16, seed=s) for s in range(3)]

    def mk(steps):
        return pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)

    tr = mk(3)
    tr.fit(mod, train_dataloaders=ListLoader(batches))
    ck = tmp_path / "a.ckpt"
    tr.save_checkpoint(str(ck))
    mod2 = tiny_module(tmp_path, exclude_oov=True, ttt_steps=2)
    tr2 = mk(5)
    tr2.fit(mod2, train_dataloaders=ListLoader(batches), ckpt_path=str(ck))
    assert tr2.global_step == 5
    from eagle_train.module import EagleDrafterModule

    back = EagleDrafterModule.load_from_checkpoint(str(ck), map_location="cpu")
    torch.testing.assert_close(back.drafter.fc.weight, mod.drafter.fc.weight)


def test_checkpoint_is_self_contained_without_the_vocab_file(tmp_path):
    """load_from_checkpoint and the SGLang export work after the draft-vocab file (and the dataset)
    are gone: d2t/t2d come from the checkpoint, and equal the trained ones."""
    import lightning.pytorch as pl

    from eagle_train.export import export_checkpoint
    from eagle_train.module import EagleDrafterModule

    mod = tiny_module(tmp_path, draft_vocab_size=40, ttt_steps=2)
    tr = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
    tr.fit(mod, train_dataloaders=ListLoader([tiny_batch(tiny_target(), n=2, t=12)]))
    ck = tmp_path / "a.ckpt"
    tr.save_checkpoint(str(ck))
    Path(mod.hparams.draft_vocab).unlink()
    back = EagleDrafterModule.load_from_checkpoint(str(ck), map_location="cpu")
    assert torch.equal(back.drafter.d2t, mod.drafter.d2t) and torch.equal(back.drafter.t2d, mod.drafter.t2d)
    torch.testing.assert_close(back.drafter.lm_head.weight, mod.drafter.lm_head.weight)
    out = export_checkpoint(str(ck), str(tmp_path / "export"), dtype="float32", aux_layer_ids=[1, 3, 5])
    assert (Path(out) / "config.json").exists()
    cli_style = torch.load(ck, weights_only=True)  # what `eagle-data train` (LightningCLI) writes
    cli_style["hyper_parameters"].update({"_class_path": "eagle_train.module.EagleDrafterModule",
                                          "_instantiator": "lightning.pytorch.cli.instantiate_module"})
    torch.save(cli_style, tmp_path / "cli.ckpt")
    back2 = EagleDrafterModule.load_from_checkpoint(str(tmp_path / "cli.ckpt"))
    torch.testing.assert_close(back2.drafter.fc.weight, mod.drafter.fc.weight)
    with pytest.raises(ValueError, match="not an EagleDrafterModule checkpoint"):
        torch.save({"state_dict": {}}, tmp_path / "other.ckpt")
        EagleDrafterModule.load_from_checkpoint(str(tmp_path / "other.ckpt"))


@pytest.mark.parametrize("content,msg", [(None, r"checkpoint .*missing.ckpt does not exist"),
                                         ("dir", r"checkpoint .*missing.ckpt is not a file"),
                                         (b"it is text, not a checkpoint\n", r"missing.ckpt: not a checkpoint file"),
                                         (b"", r"missing.ckpt: not a checkpoint file"),
                                         (bytes(range(256)) * 4, r"missing.ckpt: not a checkpoint file")])
def test_load_from_checkpoint_names_a_missing_or_foreign_file(tmp_path, capsys, content, msg):
    """Used to be FileNotFoundError / `KeyError: 105` / unpickling errors; export and eval say it."""
    from eagle_data.cli import main as cli
    from eagle_train.module import EagleDrafterModule

    p = tmp_path / "missing.ckpt"
    if content == "dir":
        p.mkdir()
    elif content is not None:
        p.write_bytes(content)
    with pytest.raises(ValueError, match=msg):
        EagleDrafterModule.load_from_checkpoint(str(p))
    with pytest.raises(SystemExit) as e:
        cli.main(["export", str(p), str(tmp_path / "export")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: " in err and re.search(msg, err) and "Traceback" not in err, err


@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "configs" / "train" / "*.yaml"))))
def test_train_configs_parse(path):
    from eagle_train.cli import make_cli

    cli = make_cli(args=["--config", path], run=False, parse_only=True)
    cfg = cli.config
    assert cfg.model.target_model_path and cfg.model.loss.ttt_steps >= 1
    assert cfg.trainer.precision in ("32-true", "bf16-mixed")


def test_configs_exist():
    assert len(glob.glob(str(ROOT / "configs" / "train" / "*.yaml"))) >= 2


def test_cli_registered():
    from eagle_data.cli.main import COMMANDS

    assert {"vocab", "train", "eval", "export"} <= set(COMMANDS)


def test_greedy_oracle_matches_generate():
    """Teacher-forced shortcut + KV continuation == HF greedy generate from the prefix."""
    from eagle_train.evaluate import GreedyOracle

    target = tiny_target()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (30,), generator=g)
    o = GreedyOracle(target, ids)
    for t in (5, 17, 27):
        ref = target.generate(ids[None, : t + 1], max_new_tokens=6, do_sample=False, min_new_tokens=6,
                              attention_mask=torch.ones(1, t + 1, dtype=torch.long), pad_token_id=0)[0, t + 1:]
        assert o.continuation(t, 6) == ref.tolist()
    # a sequence that IS the greedy path: the teacher-forced branch is taken for every token
    path = target.generate(ids[None, :4], max_new_tokens=10, do_sample=False, min_new_tokens=10,
                           attention_mask=torch.ones(1, 4, dtype=torch.long), pad_token_id=0)[0]
    o2 = GreedyOracle(target, path)
    assert o2.continuation(3, 5) == path[4:9].tolist()


def test_acceptance_runs_and_plot(tmp_path):
    from eagle_train.evaluate import acceptance, plot_acceptance

    mod = tiny_module(tmp_path)
    b = tiny_batch(tiny_target(), n=1, t=24)
    s = {"k": {"input_ids": b["input_ids"][0], "loss_mask": b["loss_mask"][0],
               "aux_hidden_states": b["aux_hidden_states"][0]}}
    r = acceptance(mod.drafter, tiny_target(), s, steps=3, positions_per_sample=4)
    assert r["num_chains"] == 4 and 1.0 <= r["tau"] <= 4.0 and len(r["accept_at_least"]) == 3
    p = plot_acceptance({"untrained": r}, tmp_path / "a.png")
    assert p.stat().st_size > 1000
    for bad in (0, 1):  # `eagle-data eval --max_length 0` used to mean "no truncation"
        with pytest.raises(ValueError, match="max_length"):
            acceptance(mod.drafter, tiny_target(), s, steps=3, positions_per_sample=4, max_length=bad)


def test_ttt_loss_on_samples_shorter_than_the_steps(tmp_path):
    """Samples of T <= K tokens (a 4- and a 1-token sample, K=7) train: finite loss and gradients;
    steps that would predict past the end supervise nothing."""
    from eagle_train.loss import ttt_loss

    mod = tiny_module(tmp_path, exclude_oov=False)
    batch = tiny_batch(tiny_target(), n=2, t=4)
    batch["loss_mask"][:, :] = batch["attention_mask"]
    out = ttt_loss(mod.drafter, mod.target_lm_head, batch, steps=7, exclude_oov=False)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and float(out["loss"]) > 0
    assert [int(n) for n in out["n_k"]] == [2, 1, 0, 0, 0, 0, 0]  # rows 0, 1 predict x2, x3 at step 0
    assert all(torch.isfinite(p.grad).all() for p in mod.drafter.parameters() if p.grad is not None)


def test_prompt_lookup_scored_on_the_same_positions_with_an_interval(tmp_path):
    """A target that loops (its own greedy text, stored as the sample) is predicted by prompt
    lookup; chains and positions are those the drafter gets; the 95 % interval brackets tau."""
    from eagle_train.evaluate import acceptance, tau_interval
    from eagle_train.ngram import PromptLookupDrafter

    target = tiny_target()
    with torch.no_grad():
        ids = target.generate(torch.tensor([[5, 9, 5, 9]]), max_new_tokens=60, do_sample=False)[0]
    b = tiny_batch(target, n=1, t=24)
    loss_mask = torch.zeros_like(ids, dtype=torch.uint8)
    loss_mask[4:] = 1
    s = {"loop": {"input_ids": ids, "loss_mask": loss_mask,
                  "aux_hidden_states": torch.zeros(len(ids), b["aux_hidden_states"].shape[-1])}}
    pl = acceptance(PromptLookupDrafter(), target, s, steps=5, positions_per_sample=8)
    dr = acceptance(tiny_module(tmp_path).drafter, target, s, steps=5, positions_per_sample=8)
    assert pl["num_chains"] == dr["num_chains"] == 8 and pl["chain_keys"] == ["loop"] * 8
    assert pl["tau"] > 2.0 and pl["tau"] > dr["tau"], (pl, dr)  # the loops are what prompt lookup predicts
    assert pl["tau_ci95"] is None  # one conversation: no spread to estimate
    two = acceptance(PromptLookupDrafter(), target, {"a": s["loop"], "b": s["loop"]}, steps=5, positions_per_sample=8)
    lo, hi = two["tau_ci95"]
    assert lo <= two["tau"] <= hi and two["tau"] == pl["tau"]
    assert tau_interval([0, 0, 6, 6], ["a", "a", "b", "b"]) == [1.0, 7.0]  # two clusters: all-a to all-b


def test_timed_checkpoints_save_once_per_mark(tmp_path):
    """Checkpoints at training-time marks: one file per mark once it is passed, loadable."""
    import lightning.pytorch as pl

    from eagle_train.callbacks import TimedCheckpoints
    from eagle_train.module import EagleDrafterModule

    mod = tiny_module(tmp_path, ttt_steps=1)
    cb = TimedCheckpoints(minutes=[1e-6, 2e-6, 1e6], dirpath=str(tmp_path / "ck"))
    tr = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_progress_bar=False, callbacks=[cb],
                    enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
    tr.fit(mod, train_dataloaders=ListLoader([tiny_batch(tiny_target(), n=1, t=12, seed=s) for s in range(3)]))
    assert [Path(p).name for p in cb.saved] == ["at_1e-06min.ckpt", "at_2e-06min.ckpt"]  # the 1e6 mark never
    back = EagleDrafterModule.load_from_checkpoint(cb.saved[0])
    assert back.hparams.loss["ttt_steps"] == 1
    with pytest.raises(ValueError, match="positive marks"):
        TimedCheckpoints(minutes=[0])


@pytest.mark.parametrize("kw,message", [({"num_samples": 0}, "num_samples must be"),
                                        ({"positions": 0}, "positions_per_sample must be"),
                                        ({"steps": 0}, "steps must be"), ({"fraction": 1.5}, "heldout_fraction"),
                                        ({"fraction": 0.0}, "heldout_fraction"), ({"device": "foo"}, "device must be"),
                                        ({"steps": 65}, "steps must be <= 64")])
def test_eval_arguments_are_checked_up_front(kw, message):
    from eagle_train.evaluate import _check_eval_args

    args = {"device": "cpu", "num_samples": 2, "positions": 2, "steps": 3, "fraction": 0.1, **kw}
    with pytest.raises(ValueError, match=message):
        _check_eval_args(args["device"], args["num_samples"], args["positions"], args["steps"], args["fraction"])


def test_timed_checkpoints_can_end_the_run_at_the_last_mark(tmp_path):
    import lightning.pytorch as pl

    from eagle_train.callbacks import TimedCheckpoints

    mod = tiny_module(tmp_path, ttt_steps=1)
    cb = TimedCheckpoints(minutes=[1e-6, 2e-6], dirpath=str(tmp_path / "ck"), stop_after_last=True)
    tr = pl.Trainer(accelerator="cpu", max_steps=10, logger=False, enable_progress_bar=False, callbacks=[cb],
                    enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
    tr.fit(mod, train_dataloaders=ListLoader([tiny_batch(tiny_target(), n=1, t=12, seed=s) for s in range(10)]))
    assert len(cb.saved) == 2 and tr.global_step < 10


@pytest.mark.parametrize("minutes,ratio", [(1e-7, 0.1), (1e7, 1.0)])
def test_lr_cosine_over_training_time(tmp_path, minutes, ratio):
    """lr_schedule_minutes: the cosine runs over wall-clock training time: a span already over
    leaves min_lr_ratio * lr after a step, a span far away leaves the full lr."""
    import lightning.pytorch as pl

    mod = tiny_module(tmp_path, ttt_steps=1, lr=1e-3, warmup_steps=0, min_lr_ratio=0.1,
                      lr_schedule_minutes=minutes)
    tr = pl.Trainer(accelerator="cpu", max_time={"seconds": 600}, max_steps=-1, max_epochs=1, logger=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                    enable_checkpointing=False)
    tr.fit(mod, train_dataloaders=ListLoader([tiny_batch(tiny_target(), n=1, t=12, seed=s) for s in range(2)]))
    assert tr.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 * ratio, rel=1e-6)
    with pytest.raises(ValueError, match="lr_schedule_minutes"):
        tiny_module(tmp_path, lr_schedule_minutes=0)


def test_zero_features_control_ignores_the_target_states(tmp_path):
    """zero_features: drafting and training see no aux state (any aux gives the same output), the
    flag survives the checkpoint, and export refuses such a drafter."""
    import lightning.pytorch as pl

    from eagle_train.export import export_checkpoint
    from eagle_train.module import EagleDrafterModule

    mod = tiny_module(tmp_path, ttt_steps=2, zero_features=True)
    b = tiny_batch(tiny_target(), n=1, t=16)
    ids, aux = b["input_ids"][0], b["aux_hidden_states"][0].float()
    rows, valid = torch.cat([ids[1:], ids.new_zeros(1)]), torch.ones(1, 16, dtype=torch.bool)
    d = mod.drafter
    with torch.no_grad():
        a = d.ttt_forward(rows[None], aux[None], valid, steps=2)
        z = d.ttt_forward(rows[None], torch.randn_like(aux)[None] * 5, valid, steps=2)
        d.zero_features = False
        real = d.ttt_forward(rows[None], aux[None], valid, steps=2)
        d.zero_features = True
    assert all(torch.equal(x, y) for x, y in zip(a, z)) and not torch.equal(a[0], real[0])
    assert torch.equal(d.propose_chain(rows, aux, [5, 9], [1, 2], steps=3),
                       d.propose_chain(rows, -aux, [5, 9], [1, 2], steps=3))
    tr = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
    tr.fit(mod, train_dataloaders=ListLoader([b]))
    tr.save_checkpoint(str(tmp_path / "z.ckpt"))
    assert EagleDrafterModule.load_from_checkpoint(str(tmp_path / "z.ckpt")).drafter.zero_features
    with pytest.raises(ValueError, match="zero_features"):
        export_checkpoint(str(tmp_path / "z.ckpt"), str(tmp_path / "out"))


def test_dataset_directory_is_only_read_and_outputs_are_world_readable(tmp_path, monkeypatch):
    """Datasets may be shared or read-only: building the vocabulary in training (draft_vocab None)
    and `eagle-data vocab` write nothing into the dataset directory; the vocabulary file and the
    export are 0644 under umask 022 (safetensors' save_file would make them 0600)."""
    import os

    from eagle_data.cli import main as cli
    from eagle_train.export import export_drafter
    from eagle_train.module import EagleDrafterModule
    from train_tiny import tiny_target_dir

    data = tmp_path / "data"
    data.mkdir()
    _vocab_dataset(data, vocab_size=256)
    before = sorted(p.name for p in data.iterdir())
    target = str(tiny_target_dir(tmp_path))
    mod = EagleDrafterModule(target_model_path=target, dataset_dir=str(data), draft_vocab_size=4,
                             drafter=DrafterOptions(aux_layer_ids=TINY_AUX))
    assert (torch.arange(4) + mod.drafter.d2t).tolist() == [0, 2, 7, 9]
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    old = os.umask(0o022)
    try:
        cli.main(["vocab", str(data), "--size", "4"])
        export_drafter(mod.drafter, mod.target_config, TINY_AUX, tmp_path / "export")
    finally:
        os.umask(old)
    assert sorted(p.name for p in data.iterdir()) == before
    assert (tmp_path / "run" / "draft_vocab_4.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "export" / "model.safetensors").stat().st_mode & 0o777 == 0o644


class _Evil:
    """Unpickling this creates a file: what an untrusted checkpoint could do with weights_only=False."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_carrying_a_pickled_payload_is_refused_without_running_it(tmp_path):
    from eagle_data.cli import main as cli
    from eagle_train.module import EagleDrafterModule

    mod = tiny_module(tmp_path, ttt_steps=1)
    marker = tmp_path / "pwned"
    ck = tmp_path / "evil.ckpt"
    torch.save({"state_dict": mod.state_dict(), "hyper_parameters": dict(mod.hparams), "payload": _Evil(str(marker))},
               ck)
    with pytest.raises(ValueError, match="not a checkpoint file torch can load with weights_only=True"):
        EagleDrafterModule.load_from_checkpoint(str(ck))
    with pytest.raises(SystemExit) as e:
        cli.main(["export", str(ck), str(tmp_path / "out")])
    assert e.value.code == 2 and not marker.exists()


def test_known_lightning_noise_is_silenced_narrowly(tmp_path):
    """One line per Lightning log record (not two), the known-harmless warnings dropped, any other
    warning from the same module still shown."""
    import subprocess
    import sys

    script = tmp_path / "s.py"
    script.write_text(
        "import logging, warnings\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')\n"
        "from eagle_train.quiet import quiet_lightning\n"
        "quiet_lightning()\n"
        "import lightning.pytorch as pl\n"
        "pl.seed_everything(3)\n"
        "for msg in ('Your `IterableDataset` has `__len__` defined. In combination', 'something new'):\n"
        "    warnings.warn_explicit(msg, UserWarning, 'data.py', 1, module='lightning.pytorch.utilities.data')\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    err = r.stdout + r.stderr
    assert r.returncode == 0, err
    assert err.count("Seed set to 3") == 1, err
    assert "IterableDataset" not in err and "something new" in err


def test_lr_time_cosine_continues_after_a_resume(tmp_path):
    """The training clock is saved in checkpoints: a run resumed from a checkpoint saved at the end
    of its lr_schedule_minutes stays at min_lr_ratio * lr instead of restarting the cosine."""
    import lightning.pytorch as pl

    kw = dict(ttt_steps=1, lr=1e-3, warmup_steps=0, min_lr_ratio=0.1, lr_schedule_minutes=1.0)
    batches = [tiny_batch(tiny_target(), n=1, t=12, seed=s) for s in range(4)]

    def trainer(steps):
        return pl.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)

    tr = trainer(1)
    mod = tiny_module(tmp_path, **kw)
    tr.fit(mod, train_dataloaders=ListLoader(batches))
    assert tr.optimizers[0].param_groups[0]["lr"] > 0.99e-3  # a fraction of a second into a minute
    ck = tmp_path / "a.ckpt"
    tr.save_checkpoint(str(ck))
    state = torch.load(ck, weights_only=True)
    assert 0 < state["eagle"]["training_seconds"] < 60
    state["eagle"]["training_seconds"] = 60.0  # as if the minute had been trained
    torch.save(state, ck)
    tr2 = trainer(2)
    tr2.fit(tiny_module(tmp_path, **kw), train_dataloaders=ListLoader(batches), ckpt_path=str(ck))
    assert tr2.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-4, rel=1e-6)


def test_ckpt_path_last_finds_the_newest_run_and_unsafe_resumes_are_refused(tmp_path):
    """Every run writes its own lightning_logs/version_N: "last" means the newest last*.ckpt below
    default_root_dir (Lightning's own "last" looks only in the new run's folder and starts over);
    a resume checkpoint carrying a pickled payload is refused before Lightning touches it."""
    import os

    from eagle_train.cli import fit, last_checkpoint

    assert last_checkpoint(str(tmp_path)) is None
    paths = []
    for v in (0, 1):
        d = tmp_path / "lightning_logs" / f"version_{v}" / "checkpoints"
        d.mkdir(parents=True)
        paths.append(d / "last.ckpt")
        paths[-1].write_bytes(b"x")
        os.utime(paths[-1], (1000 + v, 1000 + v))
    assert last_checkpoint(str(tmp_path)) == str(paths[1])
    os.utime(paths[0], (5000, 5000))
    assert last_checkpoint(str(tmp_path)) == str(paths[0])
    marker = tmp_path / "pwned"
    torch.save({"state_dict": {}, "payload": _Evil(str(marker))}, tmp_path / "evil.ckpt")
    with pytest.raises(ValueError, match="weights_only=True"):
        fit({"trainer": {"default_root_dir": str(tmp_path)}}, ckpt_path=str(tmp_path / "evil.ckpt"))
    assert not marker.exists()


def test_vocab_out_folder_and_eval_flags_name_themselves(tmp_path, capsys):
    from eagle_data.cli import main as cli

    _vocab_dataset(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["vocab", str(tmp_path), "--size", "4", "--out", str(tmp_path)])
    assert e.value.code == 2 and "is a folder; give the vocabulary file's path" in capsys.readouterr().err
    from eagle_train.evaluate import evaluate

    with pytest.raises(ValueError, match="prompt_lookup_max must be an integer >= 1"):
        evaluate(dataset_dir=str(tmp_path), checkpoint=None, out_dir=str(tmp_path / "o"),
                 device="cpu", prompt_lookup_max=0)
    with pytest.raises(ValueError, match=r"^heldout_keys: .*missing.json does not exist"):
        evaluate(dataset_dir=str(tmp_path), checkpoint=None, out_dir=str(tmp_path / "o"),
                 device="cpu", heldout_keys=str(tmp_path / "missing.json"))


def test_resume_checkpoint_must_be_this_modules_with_the_configured_size(tmp_path):
    import lightning.pytorch as pl

    from eagle_train.cli import fit

    torch.save({"a": 1}, tmp_path / "plain.ckpt")
    with pytest.raises(ValueError, match="not a Lightning checkpoint of an EagleDrafterModule"):
        fit({}, ckpt_path=str(tmp_path / "plain.ckpt"))
    mod = tiny_module(tmp_path, ttt_steps=1)
    tr = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
    tr.fit(mod, train_dataloaders=ListLoader([tiny_batch(tiny_target(), n=1, t=12)]))
    tr.save_checkpoint(str(tmp_path / "a.ckpt"))
    with pytest.raises(ValueError, match=r"draft vocabulary of 48, the config says draft_vocab_size 64"):
        fit({"model": {"draft_vocab_size": 64}}, ckpt_path=str(tmp_path / "a.ckpt"))


def test_export_refuses_to_overwrite_unless_asked(tmp_path):
    from eagle_train.export import export_drafter

    mod = tiny_module(tmp_path)
    args = (mod.drafter, mod.target_config, TINY_AUX, tmp_path / "e")
    export_drafter(*args)
    with pytest.raises(ValueError, match="already holds config.json and model.safetensors"):
        export_drafter(*args, format="speculators")
    out = export_drafter(*args, format="speculators", overwrite=True)
    assert "speculators_config" in (out / "config.json").read_text()


def test_compile_warmup_learns_nothing_and_keeps_the_rng(tmp_path):
    """The warm-up before the training clock (run on CUDA at on_train_start; called directly here
    on CPU under bf16 autocast) runs the loss forward and backward on its shapes and leaves no
    trace: parameters, gradients and the global RNG stream are as before."""
    import lightning.pytorch as pl

    mod = tiny_module(tmp_path)
    mod.trainer = pl.Trainer(accelerator="cpu", precision="bf16-mixed", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False)
    before = {k: v.clone() for k, v in mod.state_dict().items()}
    torch.manual_seed(7)
    want = torch.rand(3)
    torch.manual_seed(7)
    seconds = mod.warm_up_compiles()
    assert torch.equal(torch.rand(3), want) and seconds > 0
    assert all(p.grad is None for p in mod.parameters())
    after = mod.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert mod.hparams.drafter["compile_warmup"] is True  # the default; on CPU on_train_start skips it


def test_warm_up_shapes_reach_the_token_budget():
    """The warm-up covers the static, dynamic and B = 1 compiles and, when batches are bigger than
    those, one batch of about the data's token budget (inductor specialises on the row count:
    without it, real 32k-token batches recompiled inside the timed run on the H200)."""
    from eagle_train.warmup import warm_up_shapes

    small = [(2, 384), (5, 1000), (1, 640)]
    assert warm_up_shapes(2048, None) == small
    assert warm_up_shapes(2048, 32768) == small + [(16, 2048)]
    assert warm_up_shapes(8192, 65536) == small + [(32, 2048)]
    assert warm_up_shapes(2048, 4096) == small  # no bigger than the small shapes
    assert warm_up_shapes(100, 32768) == [(2, 100), (5, 100), (1, 100), (327, 100)]
    assert warm_up_shapes(1, None) == [(2, 2), (5, 2), (1, 2)]
    assert warm_up_shapes(1, 40000) == [(2, 2), (5, 2), (1, 2), (20000, 2)]
    for length, budget in ((2048, 32768), (300, 20000), (8192, 10000), (1, 40000), (3, 9999)):
        b, t = warm_up_shapes(length, budget)[-1]
        assert t <= max(length, 2) and b * t <= budget  # at least 2 tokens: one row of the TTT frame


@pytest.mark.parametrize("args,msg", [(["--model.bogus", "3"], "train: unknown option --model.bogus"),
                                      (["--trainer.max_stepz", "3"], "train: unknown option --trainer.max_stepz; "
                                                                     "did you mean --trainer.max_steps?"),
                                      (["--model.lr", "abc"], "Got value: abc")])
def test_cli_train_bad_option_is_one_clear_error(tmp_path, capsys, args, msg):
    """An unknown or mistyped training option used to print ~70 lines of usage headed `main.py`."""
    from eagle_data.cli import main as cli

    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--trainer.default_root_dir", str(tmp_path), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and msg in err, err
    assert "usage:" not in err and "main.py" not in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_grouped_option_on_the_train_command_line_keeps_the_configs_others(monkeypatch):
    """`eagle-data train --config C --model.loss.step_weight 0.9`: the model section is a plain
    dict there, in which jsonargparse replaced C's whole loss group by the one field (ttt_steps
    and exclude_oov silently back to their defaults); the field joins C's group instead."""
    import eagle_train.cli as train_cli
    from eagle_data.cli import main as cli

    seen = {}

    def capture(args=None, **kw):
        seen.update(args)
        raise KeyboardInterrupt  # stop before anything is built

    monkeypatch.setattr(train_cli, "make_cli", capture)
    with pytest.raises(SystemExit):
        cli.main(["train", "--config", str(ROOT / "configs" / "train" / "smollm2_cpu.yaml"),
                  "--model.loss.step_weight", "0.9", "--model.optim.warmup_steps=3", "--model.ttt_steps", "5"])
    assert seen["model"]["loss"] == {"ttt_steps": 5, "step_weight": 0.9, "exclude_oov": False}
    assert seen["model"]["optim"] == {"warmup_steps": 3, "min_lr_ratio": 0.1} and seen["model"]["lr"] == 0.0003


def test_checkpoints_of_flat_options_load_and_eval_refuses_one_without_held_out_keys(tmp_path):
    """A checkpoint written before the option groups (flat ttt_steps, aux_layer_ids, ...) loads
    into its groups; one written before the held-out keys were recorded is refused by eval (its
    held-out samples are unknown), not scored on a guess."""
    import lightning.pytorch as pl

    from eagle_train.evaluate import evaluate
    from eagle_train.module import EagleDrafterModule

    mod = tiny_module(tmp_path, ttt_steps=2, warmup_steps=3)
    tr = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=str(tmp_path), enable_checkpointing=False)
    tr.fit(mod, train_dataloaders=ListLoader([tiny_batch(tiny_target(), n=1, t=12)]))
    tr.save_checkpoint(str(tmp_path / "a.ckpt"))
    state = torch.load(tmp_path / "a.ckpt", weights_only=True)
    hp = state["hyper_parameters"]
    for group in ("drafter", "loss", "optim"):
        hp.update(hp.pop(group))
    torch.save(state, tmp_path / "flat.ckpt")
    back = EagleDrafterModule.load_from_checkpoint(str(tmp_path / "flat.ckpt"))
    assert back.loss_options.ttt_steps == 2 and back.optim_options.warmup_steps == 3
    assert back.aux_layer_ids == TINY_AUX and back.excluded_keys == []
    del state["eagle"]["excluded_keys"]
    torch.save(state, tmp_path / "old.ckpt")
    with pytest.raises(ValueError, match=r"old.ckpt: the checkpoint records no held-out keys"):
        evaluate(dataset_dir=str(tmp_path), checkpoint=str(tmp_path / "old.ckpt"), out_dir=str(tmp_path / "ev"),
                 device="cpu")
