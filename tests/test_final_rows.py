"""Final hidden states only where they teach (``--final_rows taught``, :mod:`eagle_data.format.final_rows`).

The property that makes the layout safe is checked on the real loss, not restated: whatever the
rows that are not stored hold, the TTT loss, its gradients and its accuracies are the same.
Then the whole path: extraction stores exactly the taught rows of the full run, every reader
scatters them back, verify (incl. --recompute) passes, and the bytes shrink.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings, strategies as st

from eagle_data.format import final_rows as fr
from eagle_data.format.fp8 import quantize
from eagle_data.format.schema import SampleError, validate_tensors

from train_tiny import tiny_batch, tiny_module, tiny_target


def _sample(mask: list[int], h: int = 4, fp8: bool = False) -> dict[str, torch.Tensor]:
    t = len(mask)
    g = torch.Generator().manual_seed(t)
    x = {"input_ids": torch.arange(t, dtype=torch.int64), "loss_mask": torch.tensor(mask, dtype=torch.uint8),
         "aux_hidden_states": torch.randn(t, 3 * h, generator=g).bfloat16(),
         "hidden_states": torch.randn(t, h, generator=g).bfloat16()}
    if fp8:
        for k, groups in (("aux_hidden_states", 3), ("hidden_states", 1)):
            x[k], x[k + "_scale"] = quantize(x[k].float(), groups)
    return x


@settings(max_examples=200, deadline=None)
@given(mask=st.lists(st.integers(0, 1), min_size=1, max_size=40), fp8=st.booleans())
def test_select_then_expand_keeps_the_taught_rows_and_zeros_the_rest(mask, fp8):
    full = _sample(mask, fp8=fp8)
    small = fr.select(full)
    taught = [t for t in range(len(mask) - 1) if mask[t + 1]]
    assert fr.taught(full["loss_mask"]).nonzero().flatten().tolist() == taught
    assert small["hidden_states"].shape[0] == len(taught) < len(mask)
    validate_tensors(small, "s")  # a valid sample in the taught layout
    assert fr.layout(small["hidden_states"].shape[0], full["loss_mask"]) == "taught"
    assert fr.layout(len(mask), full["loss_mask"]) == "all"
    back = fr.expand(small)
    for k in ("hidden_states", "hidden_states_scale") if fp8 else ("hidden_states",):
        assert back[k].shape == full[k].shape and back[k].dtype == full[k].dtype
        assert torch.equal(back[k][taught].view(torch.uint8), full[k][taught].view(torch.uint8))
        rest = [t for t in range(len(mask)) if t not in taught]
        fill = 1.0 if k.endswith("_scale") else 0.0
        assert (back[k][rest].float() == fill).all()
    assert fr.expand(full) is full  # every row stored: nothing to do, no copy
    for other in {len(mask) + 1, len(mask) - 1} - {len(taught), len(mask)} - {-1}:
        bad = dict(full, hidden_states=torch.zeros(other, 4, dtype=torch.bfloat16))
        bad.pop("hidden_states_scale", None)
        if fp8:
            bad["hidden_states"], bad["hidden_states_scale"] = quantize(torch.zeros(other, 4), 1)
        with pytest.raises(SampleError, match="hidden_states has .* rows"):
            validate_tensors(bad, "s")


@pytest.mark.parametrize("exclude_oov", [False, True])
@pytest.mark.parametrize("steps", [1, 3, 7])
def test_the_loss_never_reads_a_row_that_is_not_stored(tmp_path, exclude_oov, steps):
    """TTT loss, per-step accuracies and every gradient are bit-identical whether the rows that
    teach nothing hold the real states, zeros (what readers put there) or garbage."""
    from eagle_train.loss import ttt_loss

    torch.manual_seed(0)
    mod = tiny_module(tmp_path, exclude_oov=exclude_oov)
    batch = tiny_batch(tiny_target(), n=3, t=30)
    for i in range(3):  # several supervised runs, gaps of various lengths
        batch["loss_mask"][i] = False
        for a, b in ((2 + i, 6 + i), (10, 11), (14 + i, 22)):
            batch["loss_mask"][i, a:b] = batch["attention_mask"][i, a:b]
    keep = torch.stack([fr.taught(m) for m in batch["loss_mask"]])
    runs = []
    for fill in ("real", "zeros", "garbage"):
        b = dict(batch, hidden_states=batch["hidden_states"].clone())
        if fill != "real":
            noise = torch.randn_like(b["hidden_states"].float()).mul(50).bfloat16() if fill == "garbage" else 0
            b["hidden_states"][~keep] = noise[~keep] if fill == "garbage" else 0
        mod.drafter.zero_grad()
        out = ttt_loss(mod.drafter, mod.target_lm_head, b, steps=steps, exclude_oov=exclude_oov)
        out["loss"].backward()
        runs.append((out, {n: p.grad.clone() for n, p in mod.drafter.named_parameters() if p.grad is not None}))
    (ref, gref), *others = runs
    assert sum(int(n) for n in ref["n_k"]) > 0
    for out, g in others:
        assert torch.equal(out["loss"], ref["loss"])
        assert all(torch.equal(a, b) for a, b in zip(out["acc_k"], ref["acc_k"]))
        assert g.keys() == gref.keys() and all(torch.equal(g[n], gref[n]) for n in g)


def _extract(kr, tiny, out, **kw):
    from eagle_data.extract.run import run_extract

    return run_extract(dataclasses.replace(kr.config(out, *tiny, shard_max_samples=5), **kw))


@pytest.fixture(scope="module")
def pair(tmp_path_factory, kr, tiny):
    root = tmp_path_factory.mktemp("final_rows")
    return root, {name: _extract(kr, tiny, root / name, **kw) for name, kw in (
        ("all", {}), ("taught", {"final_rows": "taught"}),
        ("taught8", {"final_rows": "taught", "storage_dtype": "float8_e4m3fn"}),
        ("all8", {"storage_dtype": "float8_e4m3fn"}))}


def test_extraction_stores_exactly_the_taught_rows_and_every_reader_restores_them(pair, kr):
    from eagle_data.stream.dataset import EagleShardDataset, decode_hf_example
    from eagle_data.tools.read_samples import read_samples

    root, ms = pair
    assert ms["taught"]["final_rows"] == "taught" and ms["all"]["final_rows"] == "all"
    # the dataset card says so to whoever reads the shards with stock tools
    assert "final_rows: taught" in (root / "taught" / "README.md").read_text()
    assert "final_rows" not in (root / "all" / "README.md").read_text()
    assert ms["taught"]["num_samples"] == ms["all"]["num_samples"] > 0
    full, _, _ = kr.read_dataset(root / "all")
    part, _, _ = kr.read_dataset(root / "taught")
    taught_rows = sum(int(fr.taught(t["loss_mask"]).sum()) for t, _ in full.values())
    tokens = sum(t["input_ids"].shape[0] for t, _ in full.values())
    for k, (t, _) in full.items():
        p = part[k][0]
        rows = fr.taught(t["loss_mask"])
        assert torch.equal(p["hidden_states"], t["hidden_states"][rows])  # bit-exact, only those rows
        assert all(torch.equal(p[f], t[f]) for f in ("input_ids", "loss_mask", "aux_hidden_states"))
    h = 64 * 4  # tiny model, float32 final states
    stored = {name: sum(v.nbytes for t, _ in d.values() for v in t.values()) for name, d in (("all", full), ("taught", part))}
    assert stored["all"] - stored["taught"] == (tokens - taught_rows) * h > 0  # exactly the untaught rows
    assert ms["taught"]["total_bytes"] < ms["all"]["total_bytes"]  # (shard bytes add tar padding)
    # the streaming reader, read_samples and the HF datasets decoder all scatter the rows back
    rs = read_samples(root / "taught", list(full))
    batches = [b for b in EagleShardDataset(str(root / "taught"), batch_size=3, shuffle=False)]
    for b in batches:
        for i, k in enumerate(b["keys"]):
            t = full[k][0]
            n = t["input_ids"].shape[0]
            want = torch.where(fr.taught(t["loss_mask"])[:, None], t["hidden_states"], 0)
            assert torch.equal(b["hidden_states"][i, :n], want) and torch.equal(rs[k]["hidden_states"], want)
            assert torch.equal(b["aux_hidden_states"][i, :n], t["aux_hidden_states"])
    raw = next(iter(part.values()))
    k0 = next(iter(part))
    from safetensors.torch import save
    ex = decode_hf_example({"__key__": k0, "safetensors": save(raw[0])})
    assert torch.equal(ex["hidden_states"], torch.where(fr.taught(full[k0][0]["loss_mask"])[:, None],
                                                        full[k0][0]["hidden_states"], 0))


def test_fp8_taught_rows_dequantise_like_the_full_fp8_run_and_truncation_keeps_positions(pair):
    from eagle_data.stream.dataset import EagleShardDataset

    root, _ = pair

    def by_key(name, **kw):
        out = {}
        for b in EagleShardDataset(str(root / name), batch_size=2, shuffle=False, **kw):
            for i, k in enumerate(b["keys"]):
                n = int(b["attention_mask"][i].sum())
                out[k] = (b["loss_mask"][i, :n], b["hidden_states"][i, :n])
        return out

    full = by_key("all8")
    for kw in ({}, {"max_length": 9}):
        a, t = by_key("all8", **kw), by_key("taught8", **kw)
        assert a.keys() == t.keys() == full.keys()
        for k, (_, fin) in a.items():
            rows = fr.taught(full[k][0])[:fin.shape[0]]  # taught by the whole sample, then cut
            assert torch.equal(t[k][1][rows], fin[rows]) and (t[k][1][~rows] == 0).all()
        assert kw or sum(int(fr.taught(m).sum()) for m, _ in full.values()) > 0


def test_verify_checks_the_layout_and_recomputes_only_stored_rows(pair, tmp_path):
    import shutil

    from eagle_data.tools.verify import verify_dataset

    root, _ = pair
    for name in ("taught", "taught8"):
        rep = verify_dataset(str(root / name), recompute=3)
        assert rep.ok, rep.problems
    lie = tmp_path / "lie"
    shutil.copytree(root / "taught", lie)
    m = json.loads((lie / "manifest.json").read_text())
    m["final_rows"] = "all"
    (lie / "manifest.json").write_text(json.dumps(m))
    rep = verify_dataset(str(lie))
    assert not rep.ok and any("final_rows 'all'" in what for _, _, what in rep.problems)


def test_resume_with_another_final_rows_is_refused(pair, kr, tiny):
    root, _ = pair
    with pytest.raises(ValueError, match="final_rows"):
        _extract(kr, tiny, root / "all", final_rows="taught")
    with pytest.raises(ValueError, match="final_rows must be one of"):
        _extract(kr, tiny, root / "x", final_rows="some")


@pytest.mark.parametrize("storage,name", [("bfloat16", "bf16"), ("float8_e4m3fn", "fp8")])
def test_bytes_benchmark_formula_equals_what_extraction_stores(tmp_path, kr, tiny, storage, name):
    """``python -m benchmarks final_rows`` computes bytes/token from the schema without a model;
    they equal the tensor bytes an extraction of the same rows stores, for both layouts."""
    from benchmarks.final_rows import bench_final_rows

    res = bench_final_rows(model=str(tiny[0]), data=str(tiny[1]), num_samples=None, max_length=4096)
    for layout in ("all", "taught"):
        m = _extract(kr, tiny, tmp_path / layout, storage_dtype=storage, final_rows=layout)
        got, _, _ = kr.read_dataset(tmp_path / layout)
        stored = sum(v.nbytes for t, _ in got.values() for v in t.values())
        assert m["num_tokens"] == res["tokens"]
        assert stored / m["num_tokens"] == pytest.approx(res[f"{name}_{layout}_bytes_per_token"], abs=0.06)


def test_verify_names_an_undecodable_sample_once_and_not_again_in_the_index(pair, tmp_path):
    """A stored sample whose hidden_states has a row count of neither layout: one problem naming
    shard:key (not twice), and its index row is not reported as a sample that does not exist."""
    import io
    import shutil
    import tarfile

    from safetensors.torch import load, save

    from eagle_data.tools.verify import verify_dataset

    root, _ = pair
    bad = tmp_path / "bad"
    shutil.copytree(root / "taught", bad)
    shard = sorted(bad.glob("*.tar"))[0]
    with tarfile.open(shard) as tf:
        members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
    name = next(m.name for m, _ in members if m.name.endswith(".safetensors"))
    key = name.split(".")[0]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tf:
        for m, data in members:
            if m.name == name:
                t = load(data)
                t["hidden_states"] = t["hidden_states"][:-1] if t["hidden_states"].shape[0] else torch.zeros(5, 64)
                data = save(t)
                m.size = len(data)
            tf.addfile(m, io.BytesIO(data))
    rep = verify_dataset(str(bad))
    mine = [(c, w, what) for c, w, what in rep.problems if key in w or key in what]
    assert [(c, w) for c, w, _ in mine] == [("samples", f"{shard.name}:{key}")], rep.problems
    assert "hidden_states has" in mine[0][2] and not mine[0][2].startswith("sample ")
