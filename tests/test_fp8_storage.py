"""FP8 storage of hidden states (``--storage_dtype float8_e4m3fn``): the quantisation bound, the
shard round trip, old shards, mixed datasets, verify."""

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle_data.format.fp8 import FP8_MAX, SCALE_MIN, dequantize, error_bound, quantize
from eagle_data.format.schema import SCHEMA_VERSION

finite_bf16 = st.floats(min_value=-3.38e38, max_value=3.38e38, allow_nan=False)  # bf16 max 3.3895e38


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 9), st.data())
def test_dequantisation_error_is_within_the_stated_bound(rows, groups, width, data):
    """Values spanning the bf16 range (random exponents), zeros, rows of one repeated value."""
    kind = data.draw(st.sampled_from(["exponents", "floats", "zeros", "equal"]))
    n = rows * groups * width
    if kind == "exponents":
        e = data.draw(st.lists(st.integers(-133, 127), min_size=n, max_size=n))
        m = data.draw(st.lists(st.floats(-2, 2, allow_nan=False), min_size=n, max_size=n))
        x = torch.tensor([a * 2.0 ** b for a, b in zip(m, e)], dtype=torch.float32)
    elif kind == "floats":
        x = torch.tensor(data.draw(st.lists(finite_bf16, min_size=n, max_size=n)), dtype=torch.float32)
    elif kind == "zeros":
        x = torch.zeros(n)
    else:
        x = torch.full((n,), data.draw(finite_bf16))
    x = x.bfloat16().view(rows, groups * width)
    assume_finite = torch.isfinite(x).all()  # a huge float rounds to inf in bf16: refused below
    if not assume_finite:
        with pytest.raises(ValueError, match="NaN/Inf"):
            quantize(x, groups)
        return
    q, scale = quantize(x, groups)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (rows, groups) and (scale > 0).all()
    for dt in (torch.float32, torch.bfloat16):
        d = dequantize(q, scale, dt).float()
        assert torch.isfinite(d).all()
        assert ((d - x.float()).abs() <= error_bound(x, scale, dt)).all()
    if kind == "zeros":
        assert (dequantize(q, scale) == 0).all() and (scale == 1).all()
    if kind == "equal" and abs(float(x[0, 0])) >= FP8_MAX * SCALE_MIN:  # below: the scale is floored
        assert (q.float().abs() == FP8_MAX).all()  # the row maximum maps to +-448


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-2, 2, allow_nan=False), st.integers(-149, -100)), min_size=1, max_size=24),
       st.sampled_from([1, 2]))
def test_float32_rows_of_tiny_values_keep_a_positive_scale_and_the_bound(vals, groups):
    """float32 capture: a row whose maximum is below ~6e-43 (448 x the smallest subnormal) once
    got a zero scale (0/0 = NaN on dequantisation); bf16 subnormals round by an absolute step."""
    x = torch.tensor([m * 2.0 ** e for m, e in vals], dtype=torch.float32)
    x = x.repeat(groups).view(1, -1)  # G groups of the same values
    q, scale = quantize(x, groups)
    assert (scale > 0).all() and torch.isfinite(scale).all()
    for dt in (torch.float32, torch.bfloat16):
        d = dequantize(q, scale, dt).float()
        assert torch.isfinite(d).all() and ((d - x).abs() <= error_bound(x, scale, dt)).all()


def test_the_bound_is_tight_and_saturation_keeps_the_maximum():
    x = torch.linspace(-1, 1, 4097).view(1, -1)
    q, s = quantize(x, 1)
    assert q.float().abs().max() == FP8_MAX
    worst = float(((dequantize(q, s, torch.float32) - x).abs() / error_bound(x, s)).max())
    assert 0.5 < worst <= 1.0  # the bound is reached within a factor 2, never exceeded


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_are_refused(bad):
    x = torch.ones(2, 8)
    x[1, 3] = bad
    with pytest.raises(ValueError, match="NaN/Inf"):
        quantize(x, 2)


def _extract(kr, tiny, out, **kw):
    from eagle_data.extract.run import run_extract

    return run_extract(dataclasses.replace(kr.config(out, *tiny, shard_max_samples=5), **kw))


def _by_key(path, batch_size=3, **kw):
    from eagle_data.stream.dataset import EagleShardDataset

    out = {}
    for b in EagleShardDataset(str(path), batch_size=batch_size, shuffle=False, **kw):
        for i, k in enumerate(b["keys"]):
            n = int(b["attention_mask"][i].sum())
            out[k] = (b["aux_hidden_states"][i, :n], b["hidden_states"][i, :n])
    return out


@pytest.fixture(scope="module")
def datasets(tmp_path_factory, kr, tiny):
    """The tiny chats extracted in float32 (reference), fp8 aux + bf16 final, fp8 both, bf16."""
    root = tmp_path_factory.mktemp("fp8")
    ms = {"f32": _extract(kr, tiny, root / "f32"),
          "f8aux": _extract(kr, tiny, root / "f8aux", storage_dtype="float8_e4m3fn", final_storage_dtype="bfloat16"),
          "f8": _extract(kr, tiny, root / "f8", storage_dtype="float8_e4m3fn"),
          "bf16": _extract(kr, tiny, root / "bf16", storage_dtype="bfloat16"),
          "bf16f32": _extract(kr, tiny, root / "bf16f32", storage_dtype="bfloat16", final_storage_dtype="float32"),
          "f8f16": _extract(kr, tiny, root / "f8f16", storage_dtype="float8_e4m3fn", final_storage_dtype="float16")}
    return root, ms


def test_fp8_shards_round_trip_within_the_bound_and_are_smaller(datasets):
    root, ms = datasets
    assert (ms["f8aux"]["dtype"], ms["f8aux"]["final_dtype"]) == ("float8_e4m3fn", "bfloat16")
    assert ms["f8"]["schema_version"] == SCHEMA_VERSION and ms["f8"]["num_samples"] == ms["f32"]["num_samples"] > 0
    ref = _by_key(root / "f32")
    for name in ("f8aux", "f8"):
        got = _by_key(root / name)
        assert set(got) == set(ref)
        for k, (aux, fin) in got.items():
            assert aux.dtype == fin.dtype == torch.bfloat16
            for x, d, groups in ((ref[k][0], aux, 3), (ref[k][1], fin, 1)):
                if name == "f8aux" and groups == 1:
                    assert torch.equal(d, x.bfloat16())  # bf16 final states: a plain cast
                    continue
                t = x.shape[0]
                amax = x.view(t, groups, -1).abs().amax(-1)
                scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # what extraction stored
                assert ((d.float() - x).abs() <= error_bound(x, scale, torch.bfloat16)).all(), k
    per_tok = {n: ms[n]["total_bytes"] / ms[n]["num_tokens"] for n in ("f8", "f8aux", "bf16")}
    h = ms["bf16"]["hidden_size"]
    assert per_tok["f8"] < per_tok["f8aux"] < per_tok["bf16"]
    assert math.isclose(per_tok["f8"], per_tok["bf16"] * (4 * h + 16) / (8 * h), rel_tol=0.15)  # values + scales


def test_verify_recompute_reports_the_error_against_the_fp8_bound(datasets):
    from eagle_data.tools.verify import verify_dataset

    root, _ = datasets
    rep = verify_dataset(str(root / "f8aux"), recompute=3)
    assert rep.ok, rep.problems
    assert set(rep.recompute_bound) == {"aux layer 1", "aux layer 3", "aux layer 5"}  # the fp8 layers only
    assert all(0 < v <= 1.0 for v in rep.recompute_bound.values())  # float32 compute: exact up to the bound
    assert rep.recompute["final (post-norm)"] == 0.0


def test_datasets_of_unreleased_schema_versions_are_refused_naming_the_file_and_both_versions(datasets, tmp_path):
    """Schema versions 1 and 2 were never released: verify and the readers refuse them, naming the
    manifest file, its version and the one this code reads."""
    import shutil

    from eagle_data.format.schema import SCHEMA_VERSION
    from eagle_data.stream.dataset import EagleShardDataset
    from eagle_data.tools.verify import verify_dataset

    root, ms = datasets
    old = tmp_path / "old"
    shutil.copytree(root / "bf16", old)
    m = json.loads((old / "manifest.json").read_text())
    m["schema_version"] = 1
    m.pop("final_dtype")
    m.pop("final_rows")
    (old / "manifest.json").write_text(json.dumps(m))
    want = f"schema_version 1; this eagle_data reads schema_version {SCHEMA_VERSION} only"
    rep = verify_dataset(str(old))
    (prob,) = rep.problems
    assert prob[0] == "manifest" and str(old / "manifest.json") in prob[2] and want in prob[2]
    with pytest.raises(ValueError, match=want) as e:
        EagleShardDataset([str(old), str(root / "bf16")], batch_size=4, shuffle=False)
    assert "manifest.json" in str(e.value)


def test_mixed_dtype_datasets_are_refused_naming_the_field(datasets, tmp_path):
    import shutil

    from eagle_data.format.schema import SampleError
    from eagle_data.stream.dataset import EagleShardDataset

    root, _ = datasets
    for a, b, field in (("bf16", "f8", "dtype"), ("f8aux", "f8", "final_dtype")):
        with pytest.raises(ValueError, match=f"{field} is .*refusing to mix"):
            EagleShardDataset([str(root / a), str(root / b)], batch_size=2)
    lie = tmp_path / "lie"  # shards in fp8 under a manifest that says bf16
    shutil.copytree(root / "f8", lie)
    m = json.loads((lie / "manifest.json").read_text())
    m["dtype"] = m["final_dtype"] = "bfloat16"
    (lie / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SampleError, match="mixed-dtype dataset is refused"):
        next(iter(EagleShardDataset(str(lie), batch_size=2)))


def test_resume_with_another_final_storage_dtype_is_refused(datasets, kr, tiny):
    root, _ = datasets
    with pytest.raises(ValueError, match="final_storage_dtype: existing 'float8_e4m3fn' != this run 'bfloat16'"):
        _extract(kr, tiny, root / "f8", storage_dtype="float8_e4m3fn", final_storage_dtype="bfloat16")


@pytest.mark.parametrize("storage", ["float8_e4m3fn", "bfloat16"])
@pytest.mark.parametrize("token", [2, 4, 6])
def test_the_hf_backend_checks_finiteness_on_its_device_and_the_sample_is_skipped(storage, token):
    """A NaN in one sample's aux layer: that sample's ``finite`` is False (fp8: through its scale),
    the others' True, and ``to_samples`` skips exactly it as ``non_finite_hidden_states``. A NaN in
    a padding row (token 6 of the 5-token sample) of the final states skips nothing (in an aux layer
    it would reach the sample's own rows through the next layers' attention)."""
    from eagle_data.engines.hf import HFBackend
    from eagle_data.extract.chat import TokenizedSample
    from eagle_data.extract.fault import ErrorPolicy
    from eagle_data.extract.stages import to_samples
    from eagle_data.format.schema import STORAGE_DTYPES

    from tiny import AUX, tiny_llama

    model = tiny_llama()
    be = HFBackend("tiny", AUX, dtype="float32", model=model, out_dtype=storage)

    def poison(_m, _i, out):
        h = out[0] if isinstance(out, tuple) else out
        h[1, token, 5] = float("nan")  # sample 1 (5 tokens), a token or a padding row
    (model.model.norm if token >= 5 else model.model.layers[AUX[1]]).register_forward_hook(poison)
    ids = [torch.randint(0, 600, (n,)) for n in (6, 5, 7)]
    caps = be.capture([(f"k{i}", x) for i, x in enumerate(ids)])
    if token >= 5:
        assert [c.finite for c in caps] == [True] * 3 and [c.hidden_states.shape[0] for c in caps] == [6, 5, 7]
        return
    assert [c.finite for c in caps] == [True, False, True]
    batch = [TokenizedSample(key=f"k{i}", row=i, source_id=str(i), input_ids=x, loss_mask=torch.ones_like(x, dtype=torch.uint8),
                             num_turns=2, truncated=False) for i, x in enumerate(ids)]
    policy = ErrorPolicy("skip")
    (out,) = to_samples([(batch, caps)], (STORAGE_DTYPES[storage],) * 2, "src", "t", policy)
    assert [s.key for s in out] == ["k0", "k2"] and policy.counter.as_dict() == {"non_finite_hidden_states": 1}


def test_every_reader_hands_out_dequantised_states(datasets):
    """read_samples (eval, serve-check) and the HF-datasets row decoder give bf16 values equal to
    the streaming dataset's, never the raw fp8 values without their scales."""
    import datasets as hf_datasets

    from eagle_data.stream.dataset import decode_hf_example
    from eagle_data.tools.read_samples import read_samples

    root, _ = datasets
    streamed = _by_key(root / "f8")
    got = read_samples(root / "f8", sorted(streamed))
    rows = hf_datasets.load_dataset("webdataset", data_files=str(root / "f8" / "*.tar"), split="train")
    hf = {r["key"]: r for r in map(decode_hf_example, rows)}
    for k, (aux, fin) in streamed.items():
        for t in (got[k], hf[k]):
            assert not any(name.endswith("_scale") for name in t)
            assert torch.equal(t["aux_hidden_states"], aux) and torch.equal(t["hidden_states"], fin)


def test_aux_and_final_in_different_plain_dtypes_read_in_the_wider_one(datasets):
    """bf16 aux + float32 final: batches are float32, aux equal to its bf16 values, final exact;
    fp8 aux + float16 final: float32 too (float16 and bfloat16 do not hold each other)."""
    root, _ = datasets
    ref, got = _by_key(root / "f32"), _by_key(root / "bf16f32")
    assert got.keys() == ref.keys()
    for k, (aux, fin) in got.items():
        assert aux.dtype == fin.dtype == torch.float32
        assert torch.equal(aux, ref[k][0].bfloat16().float()) and torch.equal(fin, ref[k][1])
    single = _by_key(root / "bf16f32", batch_size=1)  # one sample per batch: the no-copy path
    assert all(torch.equal(single[k][0], got[k][0]) and single[k][1].dtype == torch.float32 for k in got)
    mixed = _by_key(root / "f8f16")  # fp8 (read as bf16) + float16: neither holds the other, so float32
    assert all(a.dtype == f.dtype == torch.float32 and torch.equal(f, ref[k][1].half().float())
               for k, (a, f) in mixed.items())
