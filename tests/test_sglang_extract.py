"""`eagle-data extract --backend sglang` end to end: same shards as the HF reference backend."""

import importlib.util
import json

import pytest
import torch
import webdataset as wds

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs the sglang extra (pip install eagle-data[sglang])", allow_module_level=True)

from eagle_data.extract.config import ExtractConfig
from eagle_data.extract.run import run_extract  # noqa: E402
from eagle_data.format.fp8 import dequantize, error_bound, scale_name  # noqa: E402
from eagle_data.format.schema import decode_tensors  # noqa: E402

from templates import TEMPLATES_DIR, family_tokenizer  # noqa: E402
from tiny import AUX, tiny_llama  # noqa: E402

pytestmark = pytest.mark.sglang

LONG = "The quick brown fox jumps over the lazy dog. " * 12
ROWS = [
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there."}]},
    {"conversations": [{"from": "human", "value": LONG}, {"from": "gpt", "value": LONG + " Done."}]},
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there."}]},  # duplicate
    {"conversations": [{"from": "human", "value": "x"}]},  # skipped: no assistant turn
]


def _read(out):
    m = json.loads((out / "manifest.json").read_text())
    got = {}
    for s in wds.WebDataset([str(out / sh["name"]) for sh in m["shards"]], shardshuffle=False):
        got[s["__key__"]] = decode_tensors(s["safetensors"], s["__key__"])
    return m, got


def test_sglang_shards_equal_hf_shards(tmp_path):
    d = tmp_path / "model"
    tiny_llama().save_pretrained(d)
    family_tokenizer(TEMPLATES_DIR / "smollm2.jinja").save_pretrained(d)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    base = dict(model=str(d), data=str(data), num_samples=None, dtype="float32", aux_layer_ids=AUX,
                progress=False, max_length=512)
    mh, hf = _read_run(tmp_path / "hf", base, "hf", {})
    ms, sg = _read_run(tmp_path / "sg", base, "sglang", {"chunked_prefill_size": 128})
    assert mh["skip_counts"] == ms["skip_counts"] == {"no_assistant_turn": 1}
    assert sorted(hf) == sorted(sg) and len(hf) == 4
    assert max(t["input_ids"].numel() for t in hf.values()) > 128  # one sample spans several chunks
    for k in hf:
        assert torch.equal(hf[k]["input_ids"], sg[k]["input_ids"]) and torch.equal(hf[k]["loss_mask"], sg[k]["loss_mask"])
        for f in ("aux_hidden_states", "hidden_states"):
            a, b = sg[k][f], hf[k][f]
            assert ((a - b).abs().max() / b.abs().max()) < 1e-4, (k, f)
    assert ms["backend"] == "sglang" and ms["aux_layer_ids"] == AUX
    # fp8 storage, quantised in the scheduler: the shards hold a quantisation of the same states, within
    # fp8's bound (bit-exactness against quantize() is the hook's test; two engine runs may batch the
    # requests otherwise and round the last bit of fp32 otherwise)
    m8, sg8 = _read_run(tmp_path / "sg8", {**base, "storage_dtype": "float8_e4m3fn"}, "sglang",
                        {"chunked_prefill_size": 128})
    assert sorted(sg8) == sorted(sg) and m8["skip_counts"] == ms["skip_counts"]
    for k in sg:
        assert torch.equal(sg8[k]["input_ids"], sg[k]["input_ids"])
        for f in ("aux_hidden_states", "hidden_states"):
            x, q, scale = sg[k][f], sg8[k][f], sg8[k][scale_name(f)]
            assert q.dtype == torch.float8_e4m3fn and scale.shape == (x.shape[0], 3 if f == "aux_hidden_states" else 1), (k, f)
            err = (dequantize(q, scale, torch.float32) - x).abs()
            assert (err <= error_bound(x, scale) + 1e-6 * x.abs().amax()).all(), (k, f, err.max())


def _read_run(out, base, backend, kw):
    run_extract(ExtractConfig(out=str(out), backend=backend, backend_kwargs=kw, **base))
    return _read(out)


def test_sigterm_stops_at_a_safe_point_and_the_rerun_completes(tmp_path, kr):
    """SGLang's engine took SIGTERM over (an asyncio handler draining requests, as a server does),
    and the spool's handler deleted the spool under the running extraction: it failed with
    "No such file or directory" on the spool (or went on to its end). Now the extraction stops as
    without the engine (the shard in progress discarded, then the signal re-raised), and the rerun completes."""
    import signal
    import subprocess
    import sys
    import time

    model, data = kr.make_fixture(tmp_path, samples=2000)
    out, spool = tmp_path / "out", tmp_path / "spool"
    spool.mkdir()
    cmd = [sys.executable, "-m", "eagle_data.cli.main", "extract", "--model", str(model), "--data", str(data),
           "--out", str(out), "--backend", "sglang", "--device", "cpu", "--dtype", "float32", "--progress", "false",
           "--batch_tokens", "256", "--shard_max_samples", "50",  # the first of 40 shards: the signal comes early
           "--backend_kwargs", json.dumps({"spool_dir": str(spool)})]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not list(out.glob("*.tar")) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    assert p.returncode == -signal.SIGTERM, (p.returncode, err[-2000:])  # re-raised once cleaned up
    assert "interrupted by signal 15" in err and "No such file" not in err, err[-2000:]
    assert list(spool.iterdir()) == [] and kr.leftovers(out) == []
    assert not (out / "manifest.json").exists()  # stopped before its end
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    samples, rows, m = kr.read_dataset(out)
    assert len(samples) == len(rows) == m["num_samples"] == 2000 and m["skip_counts"]  # every good row once
