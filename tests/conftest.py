"""Shared fixtures: a tiny model folder with SmolLM2's chat template (``model_dir``); for the
reliability tests a tiny model folder, chat data, and the helpers of ``tests/kill_resume.py``
(fixture data, comparison of two datasets, leftover detection)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama (:func:`tiny.tiny_llama`) with a tokenizer carrying SmolLM2's chat template."""
    from templates import TEMPLATES_DIR, family_tokenizer
    from tiny import tiny_llama

    d = tmp_path_factory.mktemp("tiny")
    tiny_llama().save_pretrained(d)
    family_tokenizer(TEMPLATES_DIR / "smollm2.jinja").save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def kr():
    """``tests/kill_resume.py`` (make_fixture, config, compare, leftovers, read_dataset)."""
    import kill_resume

    return kill_resume


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, kr):
    """``(model_dir, data_file)``: tiny random Llama + 24 chats with 2 bad rows interleaved."""
    return kr.make_fixture(tmp_path_factory.mktemp("tiny"), samples=24)


@pytest.fixture(scope="session")
def reference(tmp_path_factory, kr, tiny):
    """An uninterrupted single-process extraction of ``tiny`` (3 samples per shard, each sample
    captured alone, float32): the ground truth resumed/multi-rank runs must equal bit for bit."""
    from eagle_data.extract.run import run_extract

    out = tmp_path_factory.mktemp("ref") / "ds"
    m = run_extract(kr.config(out, *tiny, shard_max_samples=3))
    assert m["num_samples"] == 24 and len(m["shards"]) >= 8  # 2 writer threads may leave 2 partial shards
    return out
