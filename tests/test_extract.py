"""End-to-end extraction with a tiny random Llama on local JSONL (ShareGPT + OpenAI + bad records)."""

import json
import tarfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import webdataset as wds

import eagle_data
from eagle_data.extract.config import ExtractConfig
from eagle_data.extract.run import run_extract
from eagle_data.format.layout import progress_path
from eagle_data.format.records import read_manifest
from eagle_data.format.schema import SCHEMA_VERSION, check_manifest_compat, decode_tensors
from eagle_data.extract.sink import ShardSink

from templates import TEMPLATES_DIR, family_tokenizer
from tiny import AUX, tiny_llama

GOOD = [
    {"id": "s.0", "conversations": [{"from": "human", "value": "Hello there, how are you?"},
                                    {"from": "gpt", "value": "I am fine, thank you."}]},
    {"id": "o.1", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                               {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                               {"role": "assistant", "content": "6, the quick brown fox says."}]},
]
BAD = [
    {"id": "b1", "conversations": [{"from": "human", "value": "x"}]},
    {"id": "b2", "conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]},
    {"id": "b3", "conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": ""}]},
]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "chats.jsonl"
    rows = [GOOD[i % 2] for i in range(10)] + BAD
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def cfg(out, model_dir, data_file, **kw):
    base = dict(out=str(out), model=str(model_dir), data=str(data_file), num_samples=None, dtype="float32",
                aux_layer_ids=AUX, shard_max_samples=4, batch_tokens=256, progress=False, writers=1)
    return ExtractConfig(**{**base, **kw})


def test_extract_end_to_end(tmp_path, model_dir, data_file):
    out = tmp_path / "ds"
    m = run_extract(cfg(out, model_dir, data_file))
    check_manifest_compat(m, {"hidden_size": 64, "aux_layer_ids": AUX, "dtype": "float32"})
    assert m["schema_version"] == SCHEMA_VERSION and m["num_samples"] == 10
    assert m["skip_counts"] == {"empty_assistant": 1, "no_assistant_turn": 1, "unknown_role": 1}
    log = [json.loads(x) for x in (out / "skips-00000.jsonl").read_text().splitlines()]
    assert sorted((x["row"], x["id"], x["reason"]) for x in log) == [
        (10, "b1", "no_assistant_turn"), (11, "b2", "unknown_role"), (12, "b3", "empty_assistant")]
    assert "turn 0 (0-based) field 'from' = 'alien'" in next(x["detail"] for x in log if x["id"] == "b2")
    assert [s["num_samples"] for s in m["shards"]] == [4, 4, 2]
    assert read_manifest(out)["num_samples"] == 10
    assert m["backend_extra"]["padding_mask"] is False and m["backend_extra"]["cuda_graphs"] is False  # the probe's call
    import datasets

    idx = eagle_data.load_index(out)
    assert not datasets.are_progress_bars_disabled()  # silenced for the load only
    assert len(idx) == 10 and sorted(idx["source_row"]) == list(range(10))
    assert all("." not in k for k in idx["key"]) and set(idx["source_id"]) == {"s.0", "o.1"}
    (out / "index.parquet").rename(tmp_path / "index.parquet")  # without it: every part of the manifest's shards
    assert sorted(eagle_data.load_index(out)["source_row"]) == list(range(10))
    (out / "index" / "00000-000001.parquet").unlink()
    with pytest.raises(ValueError, match=r"lacks the index of 1 of the manifest's 3 shard\(s\) \(index/00000-000001"):
        eagle_data.load_index(out)
    (tmp_path / "index.parquet").rename(out / "index.parquet")
    # stock webdataset groups KEY.safetensors + KEY.json into one sample
    shards = [str(out / s["name"]) for s in m["shards"]]
    samples = list(wds.WebDataset(shards, shardshuffle=False))
    assert len(samples) == 10 and all(set(s) >= {"__key__", "safetensors", "json"} for s in samples)
    ref = tiny_llama()
    for s in samples:
        t = decode_tensors(s["safetensors"], s["__key__"])
        meta = json.loads(s["json"])
        row = idx[idx["key"].index(s["__key__"])]
        assert meta["num_tokens"] == row["num_tokens"] == t["input_ids"].shape[0]
        assert int(t["loss_mask"].sum()) == row["num_loss_tokens"] == sum(row["loss_token_counts"])
        with torch.no_grad():
            hs = ref(t["input_ids"][None], output_hidden_states=True).hidden_states
        torch.testing.assert_close(t["aux_hidden_states"][:, 64:128], hs[AUX[1] + 1][0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(t["hidden_states"], hs[-1][0], rtol=1e-4, atol=1e-5)


def test_parallel_writers_fill_one_rank_series(tmp_path, model_dir, data_file):
    m = run_extract(cfg(tmp_path / "ds", model_dir, data_file, writers=3, shard_max_samples=2))
    assert m["num_samples"] == 10 and sum(s["num_samples"] for s in m["shards"]) == 10
    names = [s["name"] for s in m["shards"]]
    assert len(set(names)) == len(names) and all(n.startswith("00000-") for n in names)
    assert all(s["num_samples"] <= 2 for s in m["shards"])


def test_hf_datasets_loads_shards(tmp_path, model_dir, data_file):
    import datasets

    out = tmp_path / "ds"
    m = run_extract(cfg(out, model_dir, data_file, num_samples=4))
    ds = datasets.load_dataset("webdataset", data_files=[str(out / s["name"]) for s in m["shards"]], split="train")
    assert len(ds) == m["num_samples"]
    t = decode_tensors(ds[0]["safetensors"], ds[0]["__key__"])
    assert t["hidden_states"].shape[1] == 64


def test_hf_datasets_loads_the_folder_one_row_per_sample(tmp_path, model_dir, data_file):
    """datasets.load_dataset(DIR) reads index.parquet only (the card's default config), not the
    index parts as well; the card's snippet for the shards gives one row per sample too."""
    import datasets

    from eagle_data.stream.dataset import decode_hf_example

    out = tmp_path / "ds"
    m = run_extract(cfg(out, model_dir, data_file, num_samples=6, shard_max_samples=2))
    assert len(list((out / "index").glob("*.parquet"))) >= 2
    idx = datasets.load_dataset(str(out), split="train", cache_dir=str(tmp_path / "hf"))
    assert len(idx) == m["num_samples"] and len(set(idx["key"])) == m["num_samples"]
    from eagle_data.format.layout import SHARD_GLOB

    assert f'data_files="DIR/{SHARD_GLOB}"' in (out / "README.md").read_text()
    rows = datasets.load_dataset("webdataset", data_files=str(out / SHARD_GLOB), split="train",
                                 cache_dir=str(tmp_path / "hf"))
    assert sorted(rows["__key__"]) == sorted(idx["key"])
    t = decode_hf_example(rows[0])
    assert t["hidden_states"].shape[1] == 64 and t["key"] in set(idx["key"])


def test_rerun_resumes_and_config_change_refused(tmp_path, model_dir, data_file):
    out = tmp_path / "ds"
    first = run_extract(cfg(out, model_dir, data_file))
    again = run_extract(cfg(out, model_dir, data_file))
    assert again["run_stats"]["new_samples"] == 0 and again["num_samples"] == first["num_samples"]
    with pytest.raises(ValueError, match=r"max_length"):
        run_extract(cfg(out, model_dir, data_file, max_length=64))
    with pytest.raises(ValueError) as e:  # a template record differs: only the differing entry is shown
        run_extract(cfg(out, model_dir, data_file, template_date="2025-06-01"))
    assert "template.date: existing '2026-01-01' != this run '2025-06-01'" in str(e.value)
    assert "template_sha256" not in str(e.value)


def test_resume_with_other_batching_is_logged(tmp_path, model_dir, data_file, caplog):
    """Batching settings may change on a resume (they do not change what is stored), but not
    silently: the warning names each one with its old and new value."""
    out = tmp_path / "ds"
    run_extract(cfg(out, model_dir, data_file, num_samples=4))
    with caplog.at_level("WARNING", logger="eagle_data.extract.resume"):
        res = run_extract(cfg(out, model_dir, data_file, num_samples=8, batch_tokens=512))
    assert res["num_samples"] == 8
    (msg,) = [r.getMessage() for r in caplog.records if "batching" in r.getMessage()]
    assert "batch_tokens 256 -> 512" in msg and "max_batch_size" not in msg
    caplog.clear()
    with caplog.at_level("WARNING", logger="eagle_data.extract.resume"):
        run_extract(cfg(out, model_dir, data_file, num_samples=8, batch_tokens=256))  # the first value again
    assert [r for r in caplog.records if "batching" in r.getMessage()] == []


def test_bf16_roundtrip_bit_exact_through_a_shard(tmp_path):
    vals = torch.tensor([1.5, 70144.0, -0.0078125], dtype=torch.bfloat16)
    aux = vals.repeat(2, 2)  # [T=2, 3*H=6]
    fin = vals[:2].repeat(2, 1)  # [T=2, H=2]
    tensors = {"input_ids": torch.tensor([5, 7]), "loss_mask": torch.tensor([0, 1], dtype=torch.uint8),
               "aux_hidden_states": aux, "hidden_states": fin}
    sink = ShardSink(tmp_path, rank=0)
    sink.write("k_0", tensors, {"source_id": "x", "source_row": 0, "num_turns": 2, "truncated": False})
    sink.close()
    (rec,) = sink.published
    with tarfile.open(tmp_path / rec["name"]) as tf:
        assert sorted(tf.getnames()) == ["k_0.json", "k_0.safetensors"]
        back = decode_tensors(tf.extractfile("k_0.safetensors").read())
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k].view(torch.uint8) if v.is_floating_point() else back[k],
                                                        v.view(torch.uint8) if v.is_floating_point() else v)
    assert back["aux_hidden_states"][0].tolist() == [1.5, 70144.0, -0.0078125] * 2


def test_bad_key_and_row_mismatch_refused(tmp_path):
    sink = ShardSink(tmp_path)
    good = {"input_ids": torch.tensor([1, 2]), "loss_mask": torch.tensor([0, 1], dtype=torch.uint8),
            "aux_hidden_states": torch.zeros(2, 6), "hidden_states": torch.zeros(2, 2)}
    with pytest.raises(ValueError, match="must not contain"):
        sink.write("a.b", good, {})
    with pytest.raises(ValueError, match="hidden_states has 3 rows"):
        sink.write("ab", {**good, "hidden_states": torch.zeros(3, 2)}, {})
    with pytest.raises(ValueError, match="row mismatch"):
        sink.write("ab", {**good, "aux_hidden_states": torch.zeros(3, 6)}, {})
    sink.close()
    assert sink.published == [] and not list(tmp_path.glob("*.tar*"))


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_shard_bytes_equal_tarfile_ustar_and_safetensors_save(tmp_path, layout):
    """The zero-copy writer produces exactly tarfile's USTAR archive of safetensors.torch.save payloads,
    also from views: a non-contiguous one, and a "contiguous" [T, 1] one whose last stride is not 1."""
    import io

    from safetensors.torch import save

    from eagle_data.format.schema import SCHEMA_VERSION

    t = {"input_ids": torch.arange(7), "loss_mask": torch.tensor([0, 1, 1, 0, 1, 1, 1], dtype=torch.uint8),
         "aux_hidden_states": torch.randn(7, 6).bfloat16(), "hidden_states": torch.randn(7, 2).bfloat16()}
    if layout == "strided":
        t["aux_hidden_states"] = torch.randn(7, 12).bfloat16()[:, ::4]  # [7, 3], strides (12, 4)
        t["hidden_states"] = torch.randn(2, 7).bfloat16().t()[:, :1]  # [7, 1], strides (1, 7)
        assert t["hidden_states"].is_contiguous() and t["hidden_states"].stride(-1) != 1
    ours_t, t = t, {k: v.contiguous() for k, v in t.items()}  # the reference is written from copies
    meta = {"source_id": "x", "source_row": 3, "num_turns": 2, "truncated": False}
    sink = ShardSink(tmp_path)
    for k in ("k_1", "k_2"):
        sink.write(k, ours_t, meta)
    sink.close()
    ours = (tmp_path / sink.published[0]["name"]).read_bytes()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        for k in ("k_1", "k_2"):
            payloads = {"json": json.dumps(meta, sort_keys=True).encode(),
                        "safetensors": save(t, metadata={"schema_version": str(SCHEMA_VERSION)})}
            for ext in ("json", "safetensors"):
                ti = tarfile.TarInfo(f"{k}.{ext}")
                ti.size, ti.mtime, ti.mode, ti.uname, ti.gname = len(payloads[ext]), 0, 0o444, "bigdata", "bigdata"
                tf.addfile(ti, io.BytesIO(payloads[ext]))
    assert ours == buf.getvalue()


def test_outdir_safety_and_early_validation(tmp_path, model_dir, data_file):
    """A published dataset without progress files is never resumed into (it would lose shards);
    a bad setting fails before anything is written, and the corrected command then runs."""
    out = tmp_path / "ds"
    run_extract(cfg(out, model_dir, data_file, num_samples=4))
    for p in out.glob("progress-*.json"):
        p.unlink()
    with pytest.raises(ValueError, match="already holds a dataset"):
        run_extract(cfg(out, model_dir, data_file, num_samples=4))
    fresh = tmp_path / "fresh"
    with pytest.raises(ValueError, match="max_length"):
        run_extract(cfg(fresh, model_dir, data_file, max_length=1))
    with pytest.raises(ValueError, match="num_samples"):
        run_extract(cfg(fresh, model_dir, data_file, num_samples=-5))
    assert run_extract(cfg(fresh, model_dir, data_file, num_samples=4))["num_samples"] > 0
    with pytest.raises(ValueError, match="world_size"):  # another rank count than the existing rank 0
        run_extract(cfg(fresh, model_dir, data_file, num_samples=4, rank=1, world_size=2))
    assert not list(fresh.glob("00001-*"))


def test_bom_and_empty_dataset(tmp_path, model_dir):
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD[0]).encode() + b"\n")
    m = run_extract(cfg(tmp_path / "b", model_dir, bom))
    assert m["num_samples"] == 1 and m["skip_counts"] == {}
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps(BAD[0]) + "\n")
    with pytest.raises(ValueError, match=r"produced no samples: every source row was skipped \(by reason: "
                                         r"\{'no_assistant_turn': 1\}"):  # no dataset is written (issue 39)
        run_extract(cfg(tmp_path / "e", model_dir, empty))
    with pytest.raises(ValueError, match="produced no samples"):
        eagle_data.load_index(tmp_path / "e")


USER_FORMATS = [
    {"id": "reasoning", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."}]},
    {"id": "tools", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."}]},
    {"id": "blank", "conversations": [
        {"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
        {"from": "human", "value": "Bye"}, {"from": "gpt", "value": "   "},
        {"from": "human", "value": "Again"}, {"from": "gpt", "value": "lost"}]},
]


def _masked_runs(tok, t):
    ids, mask = t["input_ids"].tolist(), t["loss_mask"].tolist()
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs, cur = runs + [tok.decode(cur)], []
    return runs + ([tok.decode(cur)] if cur else [])


def test_user_formats_extract_with_expected_masks(tmp_path):
    """reasoning_content, list-of-parts content, tool calls and a blank reply, end to end (Qwen3 template)."""
    model = tmp_path / "m"
    tiny_llama(vocab=1024).save_pretrained(model)
    tok = family_tokenizer(TEMPLATES_DIR / "qwen3.jinja")
    tok.save_pretrained(model)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in USER_FORMATS))
    m = run_extract(cfg(tmp_path / "ds", model, data, shard_max_samples=8))
    assert m["num_samples"] == 3 and m["skip_counts"] == {} and m["note_counts"] == {"cut_at_blank_reply": 1}
    shards = sorted(str(p) for p in (tmp_path / "ds").glob("*.tar"))
    got = {s["__key__"].split("_")[-1]: _masked_runs(tok, decode_tensors(s["safetensors"], s["__key__"]))
           for s in wds.WebDataset(shards, shardshuffle=False)}
    assert got == {
        "000000000": ["<think>\nAdd them.\n</think>\n\n4<|im_end|>"],
        "000000001": ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
                      "<think>\n\n</think>\n\nSunny.<|im_end|>"],
        "000000002": ["<think>\n\n</think>\n\nHello!<|im_end|>"],
    }


def test_all_rows_of_user_data_by_default_and_more_rows_extend_a_finished_run(tmp_path, model_dir):
    data = tmp_path / "seventy.jsonl"
    data.write_text("".join(json.dumps({**GOOD[i % 2], "id": f"r{i}"}) + "\n" for i in range(70)))
    out = tmp_path / "ds"
    m = run_extract(cfg(out, model_dir, data, num_samples=None, batch_tokens=4096))
    assert m["num_samples"] == 70 and m["skip_counts"] == {}
    ext = tmp_path / "ext"
    assert run_extract(cfg(ext, model_dir, data, num_samples=20, batch_tokens=4096))["num_samples"] == 20
    m2 = run_extract(cfg(ext, model_dir, data, num_samples=None, batch_tokens=4096))
    assert m2["num_samples"] == 70 and m2["run_stats"]["new_samples"] == 50
    assert m2["config"]["num_samples"] is None


def test_missing_data_path_is_a_clear_error_before_any_work(tmp_path, model_dir, data_file):
    for data in (tmp_path / "nope.jsonl", f"{tmp_path}/missing_dir/"):
        with pytest.raises(ValueError, match="does not exist"):
            run_extract(cfg(tmp_path / "ds", model_dir, data))
    assert not (tmp_path / "ds").exists()
    from eagle_data.tools.inspect import inspect_dataset

    run_extract(cfg(tmp_path / "ok", model_dir, data_file))
    with pytest.raises(ValueError, match=r"--sample 99 is out of range: .* holds 10 samples"):
        inspect_dataset(str(tmp_path / "ok"), sample=99)
    with pytest.raises(ValueError, match=r"--key 'nope': no such sample"):
        inspect_dataset(str(tmp_path / "ok"), key="nope")
    with pytest.raises(ValueError, match="not both"):
        inspect_dataset(str(tmp_path / "ok"), sample=0, key="x")


def test_inspect_shows_the_sample_of_a_key(tmp_path, model_dir, data_file, capsys):
    from eagle_data.stream.index import load_index
    from eagle_data.tools.inspect import inspect_dataset

    run_extract(cfg(tmp_path / "ok", model_dir, data_file))
    keys = sorted(load_index(tmp_path / "ok")["key"])
    for k in (keys[-1], keys[0]):
        capsys.readouterr()
        inspect_dataset(str(tmp_path / "ok"), key=k)
        assert f"sample {k} from" in capsys.readouterr().out


def test_rerun_extracts_a_row_fixed_in_the_source(tmp_path, model_dir):
    data = tmp_path / "chats.jsonl"
    rows = [json.dumps({**GOOD[i % 2], "id": f"r{i}"}) for i in range(6)]
    data.write_text("\n".join(["{broken", *rows[1:]]) + "\n")
    out = tmp_path / "ds"
    m = run_extract(cfg(out, model_dir, data))
    assert m["num_samples"] == 5 and m["skip_counts"] == {"unreadable_record": 1}
    data.write_text("\n".join(rows) + "\n")  # row 0 fixed
    m2 = run_extract(cfg(out, model_dir, data))
    assert m2["num_samples"] == 6 and m2["skip_counts"] == {} and m2["run_stats"]["new_samples"] == 1


@pytest.mark.parametrize("change,match", [
    (dict(model="/nonexistent/model"), "is not a model folder"),
    (dict(model="./nomodel"), "is not a model folder"),
    (dict(out="FILE"), "exists and is not a directory"),
])
def test_user_mistakes_are_clear_errors(tmp_path, model_dir, data_file, change, match):
    (tmp_path / "f.txt").write_text("x")
    kw = {k: (str(tmp_path / "f.txt") if v == "FILE" else v) for k, v in change.items()}
    with pytest.raises(ValueError, match=match):
        run_extract(cfg(kw.pop("out", tmp_path / "ds"), model_dir, data_file, **kw))


@pytest.mark.parametrize("text,match", [
    ('[\n {"messages": []},\n]\n', r"not valid JSON \(line 3, column 1\)"),
    ('{"data": [{"messages": []}]}', r"one JSON object with keys \['data'\]"),
])
def test_broken_json_file_is_one_clear_error(tmp_path, text, match):
    from eagle_data.extract.sources import iter_records

    p = tmp_path / "d.json"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        list(iter_records(str(p)))
    p.write_text('{\n "messages": [{"role": "user", "content": "q"}]\n}\n')  # one pretty-printed record
    assert [r for _, r in iter_records(str(p))] == [{"messages": [{"role": "user", "content": "q"}]}]


def test_unreachable_hub_name_is_a_value_error(monkeypatch):
    from eagle_data.extract.sources import iter_records

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # CI has no hub either; offline fails at once
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")

    with pytest.raises(ValueError, match="not a local .* hub name failed"):
        list(iter_records("surely-not-a-local-dataset-name-xyz"))


def test_source_changed_under_extracted_rows_is_refused(tmp_path, model_dir):
    rows = [json.dumps({**GOOD[i % 2], "id": f"r{i}"}) for i in range(6)]
    bad = json.dumps({"id": "bad", "conversations": [{"from": "alien", "value": "x"}]})
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join([*rows[:2], bad, *rows[2:]]) + "\n")
    out = tmp_path / "ds"
    assert run_extract(cfg(out, model_dir, data))["num_samples"] == 6
    data.write_text("\n".join(rows) + "\n")  # the bad row deleted: every later row shifts
    with pytest.raises(ValueError, match="changed since the earlier run"):
        run_extract(cfg(out, model_dir, data))
    folder = tmp_path / "fold"
    folder.mkdir()
    (folder / "b.jsonl").write_text("\n".join(rows[:3]) + "\n")
    assert run_extract(cfg(tmp_path / "f", model_dir, folder))["num_samples"] == 3
    (folder / "a.jsonl").write_text("\n".join(rows[3:]) + "\n")  # sorts first: shifts b.jsonl's rows
    with pytest.raises(ValueError, match="changed since the earlier run"):
        run_extract(cfg(tmp_path / "f", model_dir, folder))
    (folder / "a.jsonl").unlink()
    (folder / "c.jsonl").write_text("\n".join(rows[3:]) + "\n")  # sorts last: extends the run
    assert run_extract(cfg(tmp_path / "f", model_dir, folder))["num_samples"] == 6


def test_skip_log_holds_the_current_state_after_a_rerun(tmp_path, model_dir):
    rows = [json.dumps({**GOOD[i % 2], "id": f"r{i}"}) for i in range(4)]
    bad = json.dumps({"id": "bad", "conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]})
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join([bad, bad, *rows]) + "\n")
    out = tmp_path / "ds"
    run_extract(cfg(out, model_dir, data))
    data.write_text("\n".join([rows[0], bad, *rows]) + "\n")  # row 0 fixed in place
    m = run_extract(cfg(out, model_dir, data))
    log = [json.loads(x) for x in (out / "skips-00000.jsonl").read_text().splitlines()]
    assert m["skip_counts"] == {"unknown_role": 1} and [(x["row"], x["reason"]) for x in log] == [(1, "unknown_role")]


def test_skip_log_keeps_earlier_lines_holding_line_separators(tmp_path, model_dir):
    """A rerun over fewer rows keeps the earlier run's skip lines of the rows it does not read; JSON
    text keeps U+2028 and U+0085 raw, so reading the log back by ``splitlines`` cut such a line
    and dropped it."""
    rows = [json.dumps({**GOOD[i % 2], "id": f"r{i}"}) for i in range(4)]
    bad = json.dumps({"id": "bad\u2028one\x85", "conversations": [{"from": "alien", "value": "x"},
                                                                   {"from": "gpt", "value": "y"}]}, ensure_ascii=False)
    data, out = tmp_path / "chats.jsonl", tmp_path / "ds"
    data.write_text("\n".join([rows[0], bad, *rows[1:]]) + "\n", encoding="utf-8")
    run_extract(cfg(out, model_dir, data))
    m = run_extract(cfg(out, model_dir, data, num_samples=1))  # row 1 is not read again
    log = [json.loads(x) for x in (out / "skips-00000.jsonl").read_text(encoding="utf-8").split("\n") if x]
    assert m["skip_counts"] == {"unknown_role": 1} and m["num_samples"] == 4
    assert [(x["row"], x["id"], x["reason"]) for x in log] == [(1, "bad\u2028one\x85", "unknown_role")]


def test_model_folder_without_tokenizer_is_a_clear_error(tmp_path, data_file):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="its tokenizer cannot be loaded"):
        run_extract(cfg(tmp_path / "ds", tmp_path / "m", data_file))


def test_fingerprint_is_stable_and_ignores_columns_added_as_none():
    from eagle_data.extract.sources import record_fingerprint

    class Img:  # like a PIL image: a repr with a memory address, bytes that are the content
        def tobytes(self):
            return b"pixels"

    a = {"messages": [{"role": "user", "content": "q"}], "image": Img()}
    assert record_fingerprint(3, a) == record_fingerprint(3, {**a, "image": Img(), "system": None})
    assert record_fingerprint(3, a) != record_fingerprint(4, a)
    assert record_fingerprint(3, a) != record_fingerprint(3, {**a, "system": "Be brief."})


def test_long_first_line_json_lines_and_empty_tool_calls(tmp_path):
    from eagle_data.extract.conversations import normalize_record
    from eagle_data.extract.sources import iter_records

    r = {"conversations": [{"from": "human", "value": "x" * 70_000}, {"from": "gpt", "value": "y"}]}
    p = tmp_path / "big.json"
    p.write_text(json.dumps(r) + "\n" + json.dumps(r) + "\n")
    assert [rec for _, rec in iter_records(str(p))] == [r, r]
    c = normalize_record(0, {"messages": [{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "hello", "tool_calls": []}]})
    assert c.messages[1] == {"role": "assistant", "content": "hello"}


def test_note_of_a_skipped_row_is_dropped_and_fewer_rows_do_not_shrink_the_config(tmp_path, model_dir):
    rows = [json.dumps({**GOOD[i % 2], "id": f"r{i}"}) for i in range(4)]
    cut_then_skipped = json.dumps({"id": "x", "conversations": [
        {"from": "human", "value": "<|im_end|> hi"}, {"from": "gpt", "value": "ok"},
        {"from": "human", "value": "more"}, {"from": "gpt", "value": " "}]})
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join([rows[0], cut_then_skipped, *rows[1:]]) + "\n")
    out = tmp_path / "ds"
    m = run_extract(cfg(out, model_dir, data))
    assert m["skip_counts"] == {"special_token_in_text": 1} and m["note_counts"] == {}
    m2 = run_extract(cfg(out, model_dir, data, num_samples=2))
    assert m2["num_samples"] == 4 and m2["config"]["num_samples"] is None


def test_chat_template_by_name_is_the_shipped_file(tmp_path, model_dir, data_file, capsys, caplog):
    """--chat_template qwen3 (a name) renders exactly as the file's path does; an alias too; an
    unknown name is refused before any work, listing the names."""
    import hashlib

    from eagle_data.cli import main as cli
    from eagle_data.stream.index import load_index
    from eagle_data.templates import ALIASES, names, resolve

    assert len(names()) == 31 and all(resolve(a).stem == s for a, s in ALIASES.items())
    assert resolve("deepseek-v3").stem == "deepseek_v3" and resolve("gpt-oss").stem == "gpt_oss"  # SpecForge's
    assert resolve("qwen3.jinja") == resolve("qwen3")
    for near, meant in (("qwen-3", "qwen3"), ("Llama3", "llama3"), ("Qwen2.5", "qwen2_5")):  # never a guess
        with pytest.raises(ValueError, match=f"{near!r} is neither a file nor a shipped template name; "
                                             f"did you mean {meant!r}"):
            resolve(near)
    assert all(ALIASES.get(n, n) == n for n in names())  # no alias shadows a shipped name
    spellings = [(k, v) for k, v in [(n, n) for n in names()] + list(ALIASES.items())]
    spellings += [(k.replace("_", "-"), v) for k, v in spellings]
    assert all(len({v for k2, v in spellings if k2 == k}) == 1 for k, _ in spellings)  # one stem per spelling
    (tmp_path / "qwen3").write_text("{{ not the shipped one }}")
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:  # a bare name is the shipped template (said, since a file of that name is here); ./qwen3 is the file
        with caplog.at_level("WARNING", logger="eagle_data.templates"):
            assert resolve("qwen3").parent.name == "templates"
        assert "a file of that name is in this folder too (give ./qwen3" in caplog.text
        assert resolve("./qwen3").read_text().startswith("{{ not")
    finally:
        os.chdir(cwd)
    caplog.clear()
    with caplog.at_level("WARNING", logger="eagle_data.extract.chat"):
        by_name = run_extract(cfg(tmp_path / "a", model_dir, data_file, chat_template="qwen3"))
        assert "chat_template 'qwen3' (" in caplog.text and "is NOT the model's own chat template" in caplog.text
        by_path = run_extract(cfg(tmp_path / "b", model_dir, data_file, chat_template=str(TEMPLATES_DIR / "qwen3.jinja")))
        caplog.clear()
        default = run_extract(cfg(tmp_path / "c", model_dir, data_file))
        own = run_extract(cfg(tmp_path / "own", model_dir, data_file, chat_template="smollm2"))  # the model's own text
        assert "NOT the model's own" not in caplog.text
    sha = hashlib.sha256((TEMPLATES_DIR / "qwen3.jinja").read_bytes()).hexdigest()
    assert by_name["config"]["template"]["template_sha256"] == sha == by_path["config"]["template"]["template_sha256"]
    cols = lambda d: sorted(zip(load_index(d)["key"], load_index(d)["num_tokens"], load_index(d)["loss_token_ids"]))
    assert cols(tmp_path / "a") == cols(tmp_path / "b") != cols(tmp_path / "c")
    assert default["config"]["template"]["template_sha256"] != sha
    assert own["config"]["template"]["template_sha256"] == default["config"]["template"]["template_sha256"]
    with pytest.raises(ValueError, match=r"'qwen9' is neither a file nor a shipped template name; did you mean 'qwen'\?; "
                                         r"names .*qwen3"):
        run_extract(cfg(tmp_path / "d", model_dir, data_file, chat_template="qwen9"))
    with pytest.raises(ValueError, match=r"'nope/x.jinja' is not a file"):
        run_extract(cfg(tmp_path / "d", model_dir, data_file, chat_template="nope/x.jinja"))
    assert not (tmp_path / "d").exists()
    cli.main(["templates"])
    out = capsys.readouterr().out
    assert all(n in out for n in names()) and "llama3" in out


def test_templates_are_package_data():
    import tomllib

    from eagle_data.templates import DIR

    cfg = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "eagle_data.templates" in cfg["packages"]
    assert set(cfg["package-data"]["eagle_data.templates"]) == {"*.jinja", "SOURCES.md"}
    assert DIR.name == "templates" and (DIR / "SOURCES.md").is_file()


def test_run_stats_say_which_stage_the_capture_loop_waited_for(tmp_path, model_dir, data_file):
    """``waits_s`` names the bound: a backend made slow shows up as ``capture``, and the waits
    never add up to more than the run's time."""
    import time as _time

    from eagle_data.engines.hf import HFBackend

    class SlowBackend(HFBackend):
        def capture_async(self, batch):
            _time.sleep(0.15)
            return super().capture_async(batch)

    be = SlowBackend(model_dir, AUX, dtype="float32")
    m = run_extract(cfg(tmp_path / "ds", model_dir, data_file, batch_tokens=64), backend=be)
    st = m["run_stats"]
    w = st["waits_s"]
    assert set(w) == {"front", "capture", "writers", "close"} and min(w.values()) >= 0
    batches = st["new_samples"]  # batch_tokens 64: one sample per forward here
    assert w["capture"] >= 0.15 * batches * 0.9 and w["capture"] == max(w.values())
    assert sum(w.values()) <= st["seconds"] + 0.01


def test_waits_add_up_when_the_writers_bound_the_run(tmp_path, model_dir, data_file, monkeypatch):
    """Writers slower than the capture, a queue smaller than one sample: the producer's waits are
    ``writers``, the drain at the end is ``close``, and nothing is counted twice."""
    import time as _time

    real = ShardSink.write

    def slow(self, *a, **k):
        _time.sleep(0.3)  # far slower than the tiny model's forward, even on a loaded machine
        return real(self, *a, **k)

    monkeypatch.setattr(ShardSink, "write", slow)
    m = run_extract(cfg(tmp_path / "ds", model_dir, data_file, write_queue_gib=1e-9))
    st = m["run_stats"]
    w = st["waits_s"]
    assert w["writers"] > 0 and w["close"] > 0
    # one writer, 0.3 s a sample: the run lasts at least that long, and the capture loop's time is
    # all in its waits (robust to a loaded machine, whose slower forwards shift time to "capture")
    assert 0.3 * st["new_samples"] * 0.9 <= sum(w.values()) <= st["seconds"] + 0.01


def test_resume_accepts_another_spelling_of_the_same_data_file_only(tmp_path, model_dir, data_file, monkeypatch):
    out = tmp_path / "ds"
    first = run_extract(cfg(out, model_dir, data_file))
    monkeypatch.chdir(data_file.parent)
    again = run_extract(cfg(out, model_dir, data_file.name))  # relative to another working directory
    assert again["run_stats"]["new_samples"] == 0 and again["num_samples"] == first["num_samples"]
    other = tmp_path / "other.jsonl"
    other.write_bytes(data_file.read_bytes())  # same rows, another file
    with pytest.raises(ValueError, match=r"data: existing"):
        run_extract(cfg(out, model_dir, other))


def test_a_row_keeps_all_its_notes_and_a_skipped_row_none(tmp_path, model_dir):
    """Notes per row are a list (a row both cut at its leading turns and truncated keeps both, in
    the progress file and the manifest); the notes of a row skipped afterwards (nothing supervised
    after truncation) count nowhere: run stats, progress and manifest agree."""
    from transformers import AutoTokenizer

    from eagle_data.extract.chat import ChatRenderer

    r = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))
    prompt = len(r.tokenizer(r.render([{"role": "user", "content": "q"}], add_generation_prompt=True),
                             add_special_tokens=False)["input_ids"])
    lead = {"from": "gpt", "value": "continued."}
    rows = [{"id": "both", "conversations": [lead, {"from": "human", "value": "q"},
                                             {"from": "gpt", "value": " ".join(["fine"] * 60)}]},
            {"id": "skipped", "conversations": [lead, {"from": "human", "value": " ".join(["why"] * 80)},
                                                {"from": "gpt", "value": "a"}]},
            {"id": "plain", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "ok"}]}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in rows))
    out = tmp_path / "ds"
    res = run_extract(cfg(out, model_dir, data, max_length=prompt + 6))
    want = {"leading_turns_dropped": 1, "truncated": 1}
    assert res["num_samples"] == 2 and res["skip_counts"] == {"no_loss_tokens": 1} and res["note_counts"] == want
    assert res["run_stats"]["note_counts"] == want
    prog = json.loads((out / "progress-00000.json").read_text())
    assert prog["notes"] == {"0": ["leading_turns_dropped", "truncated"]}


@settings(max_examples=200, deadline=None)
@given(tag=st.text(min_size=1, max_size=120).filter(lambda t: not any(c in t for c in "./ \t\n")),
       row=st.integers(0, 10**9 - 1))
def test_a_sample_key_is_refused_up_front_or_fits_a_tar_member_name(tag, row):
    """Any tag: either ``sample_key`` refuses it (before any work), or both member names of its
    samples fit a USTAR header (no late 'name is too long' from the writer)."""
    from eagle_data.format.schema import META_EXT, TENSOR_EXT, sample_key
    from eagle_data.format.tar import tar_member_header

    try:
        key = sample_key(tag, row)
    except ValueError:
        assert len(tag.encode("utf-8", "surrogatepass")) > 78
        return
    for ext in (TENSOR_EXT, META_EXT):
        assert len(tar_member_header(f"{key}.{ext}", 1)) == 512


@given(name=st.text(min_size=1, max_size=300))
def test_a_default_tag_of_any_data_name_is_a_valid_key_prefix_and_long_names_stay_distinct(name):
    from eagle_data.extract.sources import _tag
    from eagle_data.format.schema import sample_key

    sample_key(_tag(name), 0)
    if len(_tag(name)) == 78 and len(_tag(name + "x")) == 78:
        assert _tag(name) != _tag(name + "x")


def test_data_file_with_a_long_name_extracts(tmp_path, model_dir):
    long = tmp_path / ("ultrachat_200k_train_sft_filtered_deduplicated_english_only_min3turns_max8k_2025_06_v2"
                       ".jsonl")
    long.write_text(json.dumps(GOOD[0]) + "\n")
    m = run_extract(cfg(tmp_path / "ds", model_dir, long))
    assert m["num_samples"] == 1 and len(m["config"]["dataset_tag"]) == 78
    with pytest.raises(ValueError, match="is 79 bytes .* at most 78 bytes"):
        run_extract(cfg(tmp_path / "ds2", model_dir, long, dataset_tag="t" * 79))
    assert not (tmp_path / "ds2").exists()


def test_a_damaged_parquet_row_group_is_named(tmp_path, model_dir):
    """pyarrow's own error (an OSError naming neither the file nor the rows) reached the user."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "chats.parquet"
    rows = [{"id": f"r{i}", "conversations": [{"from": "human", "value": f"q{i} " * 5},
                                              {"from": "gpt", "value": f"a{i} " * 5}]} for i in range(30)]
    pq.write_table(pa.Table.from_pylist(rows), p, row_group_size=10, compression="none")
    off = pq.ParquetFile(p).metadata.row_group(1).column(0).data_page_offset
    raw = bytearray(p.read_bytes())
    raw[off:off + 16] = b"\xff" * 16  # the second row group's first page header
    p.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=rf"data: {p}: row group 1 \(rows 10..19 of the file, 0-based\) cannot be "
                                         r"read, the file is damaged"):
        run_extract(cfg(tmp_path / "out", model_dir, p))


def test_bf16_on_a_cpu_without_native_bf16_computes_in_fp32(tmp_path, model_dir, data_file, monkeypatch, caplog):
    """An AVX2-only CPU emulates bf16 (4.8x slower than fp32): compute fp32, store what was asked, say so."""
    from eagle_data.engines import base

    assert base.cpu_has_native_bf16("processor\t: 0\nflags\t\t: fpu sse avx2 fma\n") is False
    assert base.cpu_has_native_bf16("flags\t\t: fpu avx2 avx512f avx512_bf16\n") is True
    assert base.cpu_has_native_bf16("Features\t: fp asimd bf16 i8mm\n") is True  # Arm
    for native, want in ((False, "float32"), (True, "bfloat16")):
        monkeypatch.setattr(base, "cpu_has_native_bf16", lambda native=native: native)
        caplog.clear()
        with caplog.at_level("WARNING"):
            m = run_extract(cfg(tmp_path / want, model_dir, data_file, dtype="bfloat16"))
        assert m["compute_dtype"] == want and m["dtype"] == "bfloat16" == m["final_dtype"]
        assert ("no native bf16" in caplog.text) == (not native)
    assert base.compute_dtype("bfloat16", "cuda", native_bf16=False) == "bfloat16"
    assert base.compute_dtype("float16", "cpu", native_bf16=False) == "float16"


def test_a_rerun_with_nothing_to_do_answers_without_loading_the_model(tmp_path, model_dir, monkeypatch):
    """A finished rerun loaded the model before reading its progress (51 s; minutes for a large
    target). Only a provably identical rerun is short: a skipped row, a changed source or setting
    takes the full path (which resumes or refuses as before)."""
    import eagle_data.engines as backends

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(GOOD[i % 2]) + "\n" for i in range(6)))
    out = tmp_path / "ds"
    first = run_extract(cfg(out, model_dir, data))
    real, loads = backends.make_backend, []
    monkeypatch.setattr(backends, "make_backend", lambda *a, **k: loads.append(1) or real(*a, **k))
    again = run_extract(cfg(out, model_dir, data))
    assert loads == [] and again["run_stats"]["new_samples"] == 0
    assert {k: again[k] for k in ("num_samples", "num_tokens", "shards")} == \
        {k: first[k] for k in ("num_samples", "num_tokens", "shards")}
    with pytest.raises(ValueError, match="different run configuration"):  # the full path names what differs
        run_extract(cfg(out, model_dir, data, max_length=64))
    assert loads == [1]
    data.write_text(data.read_text() + json.dumps(GOOD[0]) + "\n")  # one more row: work to do
    grown = run_extract(cfg(out, model_dir, data))
    assert loads == [1, 1] and grown["run_stats"]["new_samples"] == 1 and grown["num_samples"] == 7
    data.write_text(data.read_text() + json.dumps(BAD[0]) + "\n")
    run_extract(cfg(out, model_dir, data))
    again = run_extract(cfg(out, model_dir, data))  # a row skipped for its text is skipped again: short
    assert loads == [1, 1, 1] and again["num_samples"] == 7
    with pytest.raises(ValueError, match=r"row 7 \(id b1\)"):  # now a skipped row must fail the run: full path
        run_extract(cfg(out, model_dir, data, on_bad_sample="raise"))
    prog = progress_path(out, 0)
    rec = json.loads(prog.read_text())
    rec["skipped"] = {r: "non_finite_hidden_states" for r in rec["skipped"]}  # the numbers decided it
    prog.write_text(json.dumps(rec))
    run_extract(cfg(out, model_dir, data))  # decided again: the full path
    assert loads == [1, 1, 1, 1, 1]
