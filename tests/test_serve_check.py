"""serve-check: SGLang's own EAGLE-3 speculative decoding of an exported drafter (on CPU: the
stand-in kernels + the ``intel_amx`` backend) against plain greedy and the offline replay."""

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle_train.serve_check import acceptance_summary, histogram_steps, replay_chains

from train_tiny import TINY_AUX, tiny_module, tiny_target, tiny_target_dir


class _Scripted(torch.nn.Module):
    """A drafter whose chain from row t is ``propose(t)`` (the replay's only use of a drafter)."""

    def __init__(self, propose):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.propose = propose

    def propose_chain(self, input_ids, aux, rows, first_tokens, steps, first_token_id=None):
        return torch.tensor([self.propose(r, steps) for r in rows], dtype=torch.int64).view(len(rows), steps)


seqs = st.lists(st.integers(0, 5), min_size=3, max_size=60)


@settings(max_examples=200, deadline=None)
@given(seqs, st.integers(1, 8), st.data())
def test_replay_covers_the_output_exactly(seq, steps, data):
    """Whatever is proposed: every verify step starts before the output's end, the steps together
    produce at least all output tokens (the first comes from the prefill), each accepts <= K."""
    P = data.draw(st.integers(1, len(seq) - 1))
    table = data.draw(st.lists(st.lists(st.integers(0, 5), min_size=steps, max_size=steps),
                               min_size=len(seq), max_size=len(seq)))
    acc = replay_chains(_Scripted(lambda r, k: table[r]), torch.zeros(len(seq), 3), seq, P, steps)
    M = len(seq) - P
    produced = 1 + sum(a + 1 for a in acc)
    assert all(0 <= a <= steps for a in acc)
    assert produced >= M
    assert not acc or produced - (acc[-1] + 1) < M  # the last step started with tokens still to produce


@settings(max_examples=100, deadline=None)
@given(seqs, st.integers(1, 8), st.data())
def test_replay_of_perfect_and_useless_drafters(seq, steps, data):
    P = data.draw(st.integers(1, len(seq) - 1))
    M = len(seq) - P
    truth = _Scripted(lambda r, k: (list(seq[r + 2:r + 2 + k]) + [0] * k)[:k])
    acc = replay_chains(truth, torch.zeros(len(seq), 3), seq, P, steps)
    assert len(acc) == -(-(M - 1) // (steps + 1))  # ceil((M - 1) / (K + 1)) steps of K accepted + 1
    assert acc[:-1] == [steps] * (len(acc) - 1) if acc else M == 1
    wrong = _Scripted(lambda r, k: [6] * k)  # a token the text never holds
    assert replay_chains(wrong, torch.zeros(len(seq), 3), seq, P, steps) == [0] * (M - 1)


def test_replay_checks_the_prompt_length():
    with pytest.raises(ValueError, match="prompt_len"):
        replay_chains(_Scripted(lambda r, k: [0] * k), torch.zeros(4, 3), [1, 2, 3, 4], 4, 2)


def test_acceptance_summary_and_histogram():
    s = acceptance_summary(histogram_steps([2, 0, 1, 1]), 3)  # steps accepting 0, 0, 2, 3
    assert s == {"tau": 2.25, "verify_steps": 4, "accepted": 5, "accept_at_least": [0.5, 0.5, 0.25]}


def test_export_reads_back_and_refuses_other_folders(tmp_path):
    from eagle_train.export import export_drafter, load_exported_drafter

    mod = tiny_module(tmp_path)
    tgt = tiny_target_dir(tmp_path)
    for fmt in ("sglang", "speculators"):
        export_drafter(mod.drafter, mod.target_config, TINY_AUX, tmp_path / fmt, dtype="float32", format=fmt,
                       verifier="t" if fmt == "speculators" else None)
    d, ids = load_exported_drafter(tmp_path / "sglang", tgt)
    assert ids == TINY_AUX
    for k, v in mod.drafter.state_dict().items():
        assert torch.equal(d.state_dict()[k], v.float() if v.is_floating_point() else v), k
    with pytest.raises(ValueError, match="speculators"):
        load_exported_drafter(tmp_path / "speculators", tgt)
    other = Path(tiny_target_dir(tmp_path / "o"))  # another vocabulary: refused
    from safetensors.torch import load_file, save_file
    w = load_file(str(other / "model.safetensors"))
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"][:200].contiguous()
    save_file(w, str(other / "model.safetensors"))
    with pytest.raises(ValueError, match="another target"):
        load_exported_drafter(tmp_path / "sglang", other)
    import shutil

    for name, damage, msg in (("trunc", lambda d: (d / "model.safetensors").write_bytes(
                                  (d / "model.safetensors").read_bytes()[:-16]), "model.safetensors is unreadable"),
                              ("list", lambda d: (d / "config.json").write_text("[]"), "must hold a JSON object"),
                              ("bad", lambda d: (d / "config.json").write_text("{"), "config.json is not valid JSON")):
        shutil.copytree(tmp_path / "sglang", tmp_path / name)
        damage(tmp_path / name)
        with pytest.raises(ValueError, match=msg):
            load_exported_drafter(tmp_path / name, tgt)
    with pytest.raises(ValueError, match="no config.json"):
        load_exported_drafter(tmp_path / "nothing", tgt)
    cfg = json.loads((tmp_path / "sglang" / "config.json").read_text())
    cfg["draft_vocab_size"] = 7
    (tmp_path / "sglang" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not fit its config.json"):
        load_exported_drafter(tmp_path / "sglang", tgt)


def test_cli_refuses_bad_input_before_starting_anything(tmp_path, capsys):
    from eagle_data.cli.main import main
    from eagle_data.tools.synthetic import write_synthetic

    data = tmp_path / "syn"
    write_synthetic(data, [2])  # its manifest names the model "synthetic": no model folder
    bad = [(["serve-check", str(tmp_path / "none"), str(data)], "is not a model folder"),
           (["serve-check", str(tmp_path / "none"), str(data), "--target", str(tmp_path)], "is not a model folder")]
    if not torch.cuda.is_available():
        bad.append((["serve-check", "d", str(data), "--device", "cuda"], "no CUDA GPU"))
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty.json").write_text("[]")
    from eagle_train.export import export_drafter

    mod = tiny_module(tmp_path)  # a valid export + its target, to reach the key list
    exp = export_drafter(mod.drafter, mod.target_config, TINY_AUX, tmp_path / "exp", dtype="float32")
    bad += [(["serve-check", "d", str(data), "--out", str(tmp_path / "file")], "is not a directory"),
            (["serve-check", str(exp), str(data), "--target", str(tiny_target_dir(tmp_path)), "--heldout_keys",
              str(tmp_path / "empty.json")], "holds no keys")]
    for argv, msg in bad:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv
    for argv, msg in ((["serve-check", str(tmp_path / "none"), str(tmp_path / "nodata")], "does not exist"),
                      (["serve-check", "d", "x", "--steps", "0"], "steps must be an integer >= 1"),
                      (["serve-check", "d", "x", "--dtype", "float16"], "float32 or bfloat16"),
                      (["serve-check", "d", "x", "--heldout_fraction", "1.5"], "heldout_fraction must be in (0, 1], got 1.5"),
                      (["serve-check", "d", "x", "--heldout_fraction", "0"], "heldout_fraction must be in (0, 1], got 0"),
                      (["serve-check", "d", "x", "--prompt_turn", "middle"], "prompt_turn"),
                      (["serve-check", "--heldout_fraction", "1"],  # positionals, not --drafter/--data
                       "missing DRAFTER DATA: give them first, by position: eagle-data serve-check DRAFTER DATA"),
                      (["serve-check", "--drafter", "d", "--data", "x"],
                       "DRAFTER is given by position, not as --drafter: eagle-data serve-check DRAFTER DATA")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_heldout_prompts_end_before_the_first_or_the_last_reply(tmp_path):
    """Synthetic samples supervise every odd position: each is a reply start. ``first`` ends the
    prompt before the first one (position 1), else before the last one within the limit; a held-out
    fraction of 1.0 takes every key."""
    from eagle_data.stream.index import load_index
    from eagle_data.tools.read_samples import read_samples
    from eagle_data.tools.synthetic import write_synthetic
    from eagle_train.heldout import heldout_split
    from eagle_train.serve_check import heldout_prompts

    write_synthetic(tmp_path / "syn", [3, 2])
    keys = heldout_split(tmp_path / "syn", 1.0)
    assert keys == sorted(load_index(tmp_path / "syn")["key"]) and len(keys) == 5
    ids = {k: v["input_ids"].tolist() for k, v in read_samples(tmp_path / "syn", keys).items()}
    first, used = heldout_prompts(tmp_path / "syn", keys, 10, 4, first=True)
    assert used == keys[:4] and first == [ids[k][:1] for k in used]
    last, used = heldout_prompts(tmp_path / "syn", keys, 10, 4)
    assert last == [ids[k][:max(t for t in range(1, min(len(ids[k]), 11)) if t % 2)] for k in used]
    assert all(len(p) > 1 for p in last)


def _trained_drafter(tmp_path: Path, steps: int = 300) -> tuple[Path, torch.Tensor]:
    """A drafter trained on the tiny target's own greedy continuations of 16 random prompts (TTT,
    3 steps), exported in float32, and those sequences [16, 48]: prompts taken from them are
    continued as trained, so acceptance is far from zero and the engine-vs-replay checks are not
    trivial."""
    from eagle_data.engines.hf import HFBackend
    from eagle_train.export import export_drafter
    from eagle_train.loss import ttt_loss

    target = tiny_target()
    g = torch.Generator().manual_seed(1)
    n, P, M = 16, 12, 36
    prompts = torch.randint(0, 256, (n, P), generator=g)
    seq = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=M, min_new_tokens=M,
                          do_sample=False, pad_token_id=0)
    caps = HFBackend(model=target, model_path="tiny", dtype="float32", aux_layer_ids=TINY_AUX).capture(
        [(f"k{i}", s) for i, s in enumerate(seq)])
    batch = {"input_ids": seq, "attention_mask": torch.ones_like(seq, dtype=torch.bool),
             "loss_mask": torch.zeros_like(seq, dtype=torch.bool),
             "aux_hidden_states": torch.stack([c.aux_hidden_states for c in caps]),
             "hidden_states": torch.stack([c.hidden_states for c in caps]), "keys": [f"k{i}" for i in range(n)]}
    batch["loss_mask"][:, P:] = True
    torch.manual_seed(0)
    mod = tiny_module(tmp_path, draft_vocab_size=256)
    opt = torch.optim.AdamW(mod.drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        out = ttt_loss(mod.drafter, mod.target_lm_head, batch, steps=3)
        out["loss"].backward()
        opt.step()
        opt.zero_grad()
    assert float(out["acc_k"][0]) > 0.5
    return export_drafter(mod.drafter, mod.target_config, TINY_AUX, tmp_path / "drafter", dtype="float32"), seq


@pytest.mark.sglang
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs the sglang extra")
@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="sglang's speculative path torch.compiles a function: needs a C++ compiler "
                           "(.ci/run checks that CI has one)")
def test_sglang_speculative_decoding_equals_plain_greedy_and_the_offline_replay(tmp_path, caplog):
    from eagle_train.serve_check import run_serve_check

    caplog.set_level(logging.INFO, logger="eagle_train.serve_check")
    drafter, seq = _trained_drafter(tmp_path)
    prompts = [seq[i, :n].tolist() for i, n in enumerate((12, 17, 23))]  # the greedy text goes on from there
    res = run_serve_check(str(tiny_target_dir(tmp_path)), str(drafter), prompts, steps=3, max_new_tokens=32,
                          speed_batches=[1, 2], ngram=True, partial=tmp_path / "partial.json")
    print(json.dumps({k: v for k, v in res.items() if k != "per_prompt"}))
    from eagle_data.cli.train import serve_check_summary

    summary = serve_check_summary(res)  # what the command prints (the main job ended with raw JSON)
    iv = res["engine"]["interval"]
    assert (f"engine tau {res['engine']['tau']:.3f} [{iv[0]:.3f}, {iv[1]:.3f}], offline replay of the same drafts "
            f"{res['offline']['tau']:.3f}") in summary and "speculative output equal to plain greedy: 3/3" in summary
    assert summary.count("\ndecode at batch ") == 2 and "speculative" in summary.splitlines()[-1]
    assert [s["batch"] for s in res["speed"]] == [1, 2]
    assert all(s["plain_tokens_per_s"] > 0 and s["speculative_tokens_per_s"] > 0 for s in res["speed"])
    assert res["num_prompts"] == 3 and res["equal_to_plain"] == 3
    eng, off = res["engine"], res["offline"]
    assert eng["verify_steps"] > 0 and eng["accepted"] >= eng["verify_steps"]  # tau >= 2: far from trivial
    for p in res["per_prompt"]:
        assert p["engine_verify_steps"] == p["offline_verify_steps"], p
        assert p["within_one_chain"], p
    assert abs(eng["tau"] - off["tau"]) <= 3 / eng["verify_steps"] * 3  # one chain of K=3 per prompt
    # SGLang's own NGRAM on the same prompts (a fresh engine): greedy output unchanged, its own counts,
    # each tau inside its interval over the 3 prompts
    ng = res["ngram"]
    assert ng["equal_to_plain"] == 3 and 0 < ng["accepted"] <= 3 * ng["verify_steps"]  # it drafted, and was right
    for a in (eng, ng):
        assert a["interval"][0] <= a["tau"] <= a["interval"][1], a
    assert f"SGLang NGRAM, the same 4 tokens verified per step: engine tau {ng['tau']:.3f}" in summary
    assert all(s["ngram_tokens_per_s"] > 0 and "NGRAM" in line
               for s, line in zip(res["speed"], summary.splitlines()[-2:]))
    # what a run cut before its offline replay keeps: every engine's figures, the same as the result's
    known = json.loads((tmp_path / "partial.json").read_text())
    assert known["engines_done"] == ["plain", "speculative", "ngram"]
    assert {k: known[k] for k in ("drafter", "target", "steps", "max_new_tokens", "num_prompts")} == {
        "drafter": str(drafter), "target": str(tiny_target_dir(tmp_path)), "steps": 3, "max_new_tokens": 32, "num_prompts": 3}
    assert known["engine"] == json.loads(json.dumps(eng)) and known["ngram"] == json.loads(json.dumps(ng))
    assert [v["batch"] for v in known["speed"]["ngram"]] == [1, 2] == [v["batch"] for v in known["speed"]["plain"]]
    assert set(known["seconds"]) == {f"{n}_{w}" for n in ("plain", "speculative", "ngram") for w in ("start", "generate")}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serve-check: ")]
    assert [w.split()[1] for w in lines] == ["plain", "speculative", "ngram", "ngram"], lines
    assert f"engine tau {eng['tau']:.3f} [{eng['interval'][0]:.3f}, {eng['interval'][1]:.3f}], output equal to " \
           "plain greedy 3/3; decode at batch 1: " in lines[1], lines
    assert f"engine tau {ng['tau']:.3f}" in lines[2] and "decode at" not in lines[2], lines
    assert lines[3].startswith("serve-check: ngram decode speed (fresh engines); batch 1: "), lines


def test_an_earlier_serve_checks_results_never_stay_beside_a_new_run(tmp_path):
    """Before anything is read or started, the folder loses an earlier run's final and partial
    results (a run cut short would otherwise leave its partial file beside the old final one) and
    keeps everything else."""
    from eagle_train.serve_check import SERVE_PARTIAL, fresh_serve_out

    out = tmp_path / "sc"
    out.mkdir()
    for name in ("serve_check.json", SERVE_PARTIAL, "notes.txt"):
        (out / name).write_text("{}")
    assert fresh_serve_out(str(out)) == out and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert fresh_serve_out(str(tmp_path / "new" / "dir")).is_dir()
