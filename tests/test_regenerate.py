"""``eagle-data regenerate`` with real engines on the tiny random Llama (float32, CPU): batched,
left-padded HF generation equals one unpadded ``generate`` per prompt token for token; SGLang
equals HF; a SIGKILLed run resumes with no duplicate or missing row; reruns refuse other settings
or a changed source and extend with more rows; the output extracts and its loss mask covers the
new replies."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from eagle_data.regen.config import RegenerateConfig
from eagle_data.regen.run import run_regenerate
from eagle_data.format.regen_layout import DATA_DIR, MANIFEST, REJECTS_DIR

WORDS = "the quick brown fox jumps over a lazy dog hello there how are you fine thank".split()


def chats(n: int, seed: int = 0) -> list[dict]:
    """Multi-turn ShareGPT rows (1-3 turns, varied lengths), a system field on some, and one bad row."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns += [{"from": "human", "value": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 25)))},
                      {"from": "gpt", "value": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))}]
        rec = {"id": f"c{i}", "conversations": turns}
        if i % 4 == 1:
            rec["system"] = "be brief"
        rows.append(rec)
    rows.insert(3, {"id": "bad", "conversations": [{"from": "human", "value": "no answer"}]})
    return rows


@pytest.fixture(scope="module")
def no_text_ids(tiny) -> list[int]:
    """Ids of the tiny random model that are not text: past the tokenizer (padded rows) or decoding
    alone to U+FFFD (a lone UTF-8 byte). A random model emits them often, a trained one hardly
    ever; regenerate fails such replies loudly (test_regenerate_accounting.py). These tests are
    about batching, seeds, resuming and masks, so its engines here never choose them."""
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny[0])
    n = AutoConfig.from_pretrained(tiny[0]).vocab_size
    bad = [i for i in range(n) if i >= len(tok) or "\ufffd" in tok.decode([i])]
    assert 0 < len(bad) < n - 100, len(bad)
    return bad


@pytest.fixture(autouse=True)
def text_replies_only(monkeypatch, no_text_ids):
    """The engines of these tests never choose :func:`no_text_ids` (HF: ``suppress_tokens``;
    SGLang: a ``logit_bias``); forked children inherit it."""
    from eagle_data.regen.engines import HFGenerator, SGLangGenerator

    hf_init, sg_params = HFGenerator.__init__, SGLangGenerator._params

    def init(self, *a, **k):
        hf_init(self, *a, **k)
        self.gen_cfg.suppress_tokens = no_text_ids

    def params(self, *a, **k):
        return {**sg_params(self, *a, **k), "logit_bias": {str(i): -1e9 for i in no_text_ids}}

    monkeypatch.setattr(HFGenerator, "__init__", init)
    monkeypatch.setattr(SGLangGenerator, "_params", params)


@pytest.fixture(scope="module")
def multi(tmp_path_factory, tiny):
    model, _ = tiny
    path = tmp_path_factory.mktemp("regen") / "multi.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chats(10)))
    return model, path


def cfg(out: Path, model: Path, data: Path, **kw) -> RegenerateConfig:
    base = dict(out=str(out), model=str(model), data=str(data), dtype="float32", max_new_tokens=12,
                max_length=512, rows_per_part=4, batch_size=8, progress=False)
    return RegenerateConfig(**{**base, **kw})


def read(out: Path, sub: str = DATA_DIR) -> list[dict]:
    return [json.loads(x) for f in sorted((out / sub).glob("part-*.jsonl")) for x in f.read_text().splitlines()]


def replies(records: list[dict]) -> list[list[str]]:
    return [[r["conversations"][t]["value"] for t in r["regeneration"]["turns"]] for r in records]


@pytest.fixture(scope="module")
def stop_token(multi, no_text_ids):
    """A token the tiny model emits inside some greedy replies, used as an extra stop token so that
    both finish reasons occur."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_data.extract.chat import ChatRenderer

    model, data = multi
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    outs = []
    for line in data.read_text().splitlines():
        text = ChatRenderer(tok).render([{"role": "user", "content": json.loads(line)["conversations"][0]["value"]}],
                                        True)
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        outs.append(lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                suppress_tokens=no_text_ids)[0, ids.shape[1]:].tolist())
    first = {o[0] for o in outs}  # never a reply's first token (that reply would be empty)
    later = [t for o in outs for t in set(o[1:]) if t not in first and t not in tok.all_special_ids]
    later = [t for t in later if later.count(t) < len(outs)]  # some replies never meet it: they run to the budget
    assert later, outs
    pick = max(set(later), key=later.count)
    return tok.convert_ids_to_tokens(pick)


def reference_turn(lm, tok, prompt_text: str, budget: int, stops: set[int], no_text: list[int]) -> tuple[str, str]:
    """One prompt, unpadded, plain ``generate``: the reply text and finish reason."""
    ids = torch.tensor([tok(prompt_text, add_special_tokens=False)["input_ids"]])
    out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=budget, do_sample=False,
                      eos_token_id=None, pad_token_id=0, suppress_tokens=no_text)[0, ids.shape[1]:].tolist()
    for k, t in enumerate(out):
        if t in stops:
            return tok.decode(out[:k], skip_special_tokens=False), "stop"
    return tok.decode(out, skip_special_tokens=False), "length"


def test_hf_batched_equals_single_unpadded_generate(tmp_path, multi, stop_token, no_text_ids):
    """Every turn (mode "all": each reply is the next turn's context) equals a plain, unpadded,
    one-prompt greedy ``generate`` on the conversation as regenerated so far."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_data.extract.chat import ChatRenderer
    from eagle_data.extract.conversations import normalize_record

    model, data = multi
    man = run_regenerate(cfg(tmp_path / "o", model, data, stop_tokens=[stop_token]))
    assert man["complete"] and (man["regenerated"], man["skipped"]) == (10, 1)
    assert man["finish"].get("stop", 0) > 0 and man["finish"].get("length", 0) > 0
    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    renderer = ChatRenderer(tok)
    stops = set(man["settings"]["stop_token_ids"])
    assert tok.convert_tokens_to_ids(stop_token) in stops and tok.convert_tokens_to_ids("<|im_end|>") in stops
    for rec in read(tmp_path / "o"):
        meta = rec["regeneration"]
        msgs = normalize_record(meta["row"], rec).messages  # the regenerated conversation
        for j, (t, fin) in enumerate(zip(meta["turns"], meta["finish"])):
            m = next(i for i, x in enumerate(msgs) if x["role"] == "assistant" and sum(
                y["role"] == "assistant" for y in msgs[:i]) == j)
            text = renderer.render(msgs[:m], add_generation_prompt=True)
            assert len(tok(text, add_special_tokens=False)["input_ids"]) == meta["prompt_tokens"][j]
            want = reference_turn(lm, tok, text, 12, stops, no_text_ids)
            assert (msgs[m]["content"], fin) == want, (meta["row"], j)


@pytest.mark.sglang
def test_sglang_equals_hf(tmp_path, multi, stop_token):
    pytest.importorskip("sglang")
    model, data = multi
    a = run_regenerate(cfg(tmp_path / "hf", model, data, stop_tokens=[stop_token]))
    b = run_regenerate(cfg(tmp_path / "sg", model, data, stop_tokens=[stop_token], backend="sglang"))
    assert b["engine"]["engine"] == "sglang" and a["engine"]["engine"] == "hf"
    assert 0 < b["engine"]["kv_pool_tokens"] <= 32768  # the CPU engine's max_total_tokens
    ra, rb = read(tmp_path / "hf"), read(tmp_path / "sg")
    for x in ra + rb:
        x["regeneration"].pop("settings")
    assert ra == rb and a["finish"] == b["finish"] and a["tokens_generated"] == b["tokens_generated"]
    assert read(tmp_path / "hf", REJECTS_DIR) == read(tmp_path / "sg", REJECTS_DIR)


def _child(c: RegenerateConfig) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        run_regenerate(c)
    finally:
        os._exit(0)


def test_sigkill_at_random_moments_resumes_without_duplicates(tmp_path, multi):
    model, data = multi
    ref = tmp_path / "ref"
    run_regenerate(cfg(ref, model, data, rows_per_part=2, batch_size=2))
    run = tmp_path / "run"
    rng = random.Random(1)
    kills, span = 0, 2.5
    for _ in range(30):  # until 4 kills landed mid-run (a run that finished first makes the window shorter)
        pid = os.fork()
        if pid == 0:
            _child(cfg(run, model, data, rows_per_part=2, batch_size=2))
        time.sleep(rng.uniform(0.05, span))
        os.kill(pid, signal.SIGKILL)
        landed = os.waitpid(pid, 0)[1] == signal.SIGKILL
        kills += landed
        span = span if landed else span / 2
        if kills == 4:
            break
        if not landed:  # it finished: start over so that the next kills land in a run with work left
            shutil.rmtree(run)
    assert kills == 4
    man = run_regenerate(cfg(run, model, data, rows_per_part=2, batch_size=2))
    assert man["complete"] and man["input_rows"] == 11
    assert read(run) == read(ref) and read(run, REJECTS_DIR) == read(ref, REJECTS_DIR)
    assert not list(run.rglob("*.tmp"))
    assert sorted(p.name for p in (run / DATA_DIR).iterdir()) == sorted(p.name for p in (ref / DATA_DIR).iterdir())


def test_rerun_refuses_other_settings_and_a_changed_source_and_extends(tmp_path, multi):
    model, data = multi
    out = tmp_path / "o"
    first = run_regenerate(cfg(out, model, data, num_samples=6))
    assert first["input_rows"] == 6 and first["complete"]
    with pytest.raises(ValueError, match="max_new_tokens"):
        run_regenerate(cfg(out, model, data, num_samples=6, max_new_tokens=13))
    again = run_regenerate(cfg(out, model, data, num_samples=6))
    assert again["run_stats"]["rows"] == 0 and again["input_rows"] == 6
    smaller = run_regenerate(cfg(out, model, data, num_samples=3))
    assert smaller["complete"] and smaller["input_rows"] == 6  # nothing shrinks
    grown = run_regenerate(cfg(out, model, data))
    assert grown["run_stats"]["rows"] == 5 and grown["input_rows"] == 11
    assert [r["regeneration"]["row"] for r in read(out)] == [0, 1, 2, 4, 5, 6, 7, 8, 9, 10]
    names = sorted(p.name for p in (out / DATA_DIR).iterdir())
    assert names == ["part-000000000-000000004.jsonl", "part-000000004-000000006.jsonl",  # the first run
                     "part-000000006-000000008.jsonl", "part-000000008-000000011.jsonl"]  # the new rows
    edited = tmp_path / "edited.jsonl"
    lines = data.read_text().splitlines()
    lines[1] = lines[1].replace("c1", "c1-edited")
    edited.write_text("\n".join(lines) + "\n")
    bad = cfg(out, model, edited)
    with pytest.raises(ValueError, match="settings"):  # another data path is another setting
        run_regenerate(bad)
    data_backup = data.read_text()
    try:
        data.write_text("\n".join(lines) + "\n")
        with pytest.raises(ValueError, match="changed since rows"):
            run_regenerate(cfg(out, model, data))
    finally:
        data.write_text(data_backup)


def test_regenerated_output_extracts_with_masks_on_the_new_replies(tmp_path, multi):
    """``extract --data OUT`` reads the regenerated rows in source order, and every supervised
    token lies in a regenerated reply or its end-of-turn token: the loss-masked text of each
    sample is exactly its replies, each followed by ``<|im_end|>``."""
    from transformers import AutoTokenizer

    from eagle_data.extract.config import ExtractConfig
    from eagle_data.extract.run import run_extract
    from eagle_data.format.schema import sample_key
    from eagle_data.tools.read_samples import read_samples

    model, data = multi
    out = tmp_path / "regen"
    run_regenerate(cfg(out, model, data))
    m = run_extract(ExtractConfig(out=str(tmp_path / "ds"), model=str(model), data=str(out), dtype="float32",
                                  aux_layer_ids=[1, 3, 5], dataset_tag="rg", progress=False))
    recs = read(out)
    assert m["num_samples"] == len(recs) == 10 and not m["skip_counts"]
    tok = AutoTokenizer.from_pretrained(model)
    samples = read_samples(tmp_path / "ds", [sample_key("rg", i) for i in range(10)])
    for i, rec in enumerate(recs):
        s = samples[sample_key("rg", i)]
        ids, mask = s["input_ids"], s["loss_mask"].bool()
        runs, cur = [], []
        for t, on in zip(ids.tolist(), mask.tolist()):
            if on:
                cur.append(t)
            elif cur:
                runs.append(tok.decode(cur, skip_special_tokens=False))
                cur = []
        if cur:
            runs.append(tok.decode(cur, skip_special_tokens=False))
        assert runs == [r + "<|im_end|>" for r in replies([rec])[0]], i


def test_extract_refuses_a_regeneration_that_is_not_finished(tmp_path, multi):
    from eagle_data.extract.sources import resolve

    model, data = multi
    out = tmp_path / "o"
    run_regenerate(cfg(out, model, data, world_size=2, rank=1))
    with pytest.raises(ValueError, match="in progress"):
        resolve(str(out))
    run_regenerate(cfg(out, model, data, world_size=2, rank=0))
    assert json.loads((out / MANIFEST).read_text())["complete"]
    assert len(resolve(str(out))[1]["data_files"]) == 3


def _with_generation_config(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    gc = json.loads((dst / "generation_config.json").read_text())
    gc.update(do_sample=True, temperature=0.3, top_k=3, repetition_penalty=4.0, min_new_tokens=11, no_repeat_ngram_size=2)
    (dst / "generation_config.json").write_text(json.dumps(gc))
    return dst


@pytest.mark.parametrize("backend", ["hf", pytest.param("sglang", marks=pytest.mark.sglang)])
def test_the_models_generation_config_is_not_applied(tmp_path, multi, backend):
    """A model folder whose generation_config.json asks for sampling, a repetition penalty and a
    minimum length regenerates exactly as the same weights without them: the options decide."""
    if backend == "sglang":
        pytest.importorskip("sglang")
    model, data = multi
    other = _with_generation_config(model, tmp_path / "model_gc")
    run_regenerate(cfg(tmp_path / "a", model, data, num_samples=5, backend=backend))
    run_regenerate(cfg(tmp_path / "b", other, data, num_samples=5, backend=backend))
    assert replies(read(tmp_path / "a")) == replies(read(tmp_path / "b"))


def test_sampling_is_seeded(tmp_path, multi, backend="hf"):
    """Same seed, same replies (HF: one seed per batch; SGLang on a GPU: per row and turn); another
    seed or greedy decoding gives other replies."""
    model, data = multi
    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        run_regenerate(cfg(tmp_path / name, model, data, num_samples=6, temperature=1.5, top_k=50, seed=seed,
                           backend=backend))
        runs[name] = replies(read(tmp_path / name))
    greedy = tmp_path / "g"
    run_regenerate(cfg(greedy, model, data, num_samples=6, backend=backend))
    assert runs["a"] == runs["b"]
    assert runs["a"] != runs["c"] and runs["a"] != replies(read(greedy))


@pytest.mark.sglang
def test_sglang_cpu_sampling_says_it_is_not_seeded(tmp_path, multi, caplog):
    """Also: starting the engine leaves this process's logging as it was (SGLang forces the root
    level to its own log level, which silenced eagle-data's warnings for the rest of the run)."""
    import logging

    pytest.importorskip("sglang")
    model, data = multi
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    man = run_regenerate(cfg(tmp_path / "s", model, data, num_samples=4, temperature=1.5, backend="sglang"))
    # unseeded sampling may draw a blank reply or a special token (a failed row): only the sum is fixed
    assert man["engine"]["seeded"] is False and man["input_rows"] == 4 and man["regenerated"] + man["failed"] == 3
    assert (root.level, root.handlers) == (level, handlers)
    assert "skip row 3 (id bad): no_assistant_turn" in caplog.text  # logged after the engine started
