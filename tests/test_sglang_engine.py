"""``start_engine`` around ``sglang.Engine`` (a fake engine: what is tested is what happens around its
start): GPU engines start one at a time per set of GPUs, and the KV pool each got is logged."""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest

sglang = pytest.importorskip("sglang")

from eagle_data.engines import sglang_engine as se  # noqa: E402


def _locks(folder) -> dict[str, bool]:
    """Each start lock file in ``folder`` -> whether someone holds it."""
    out = {}
    for p in sorted(folder.glob("eagle-data-sglang-start-*.lock")):
        fd = os.open(p, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            out[p.name] = False
        except BlockingIOError:
            out[p.name] = True
        finally:
            os.close(fd)
    return out


@pytest.fixture
def fake_engine(monkeypatch, tmp_path):
    """``sglang.Engine`` replaced: each construction records the start locks it sees held."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen: list[dict[str, bool]] = []

    class Engine:
        def __init__(self, **kw):
            seen.append(_locks(tmp_path))
            self.server_args = SimpleNamespace(attention_backend=kw.get("attention_backend"))

        def get_server_info(self):
            return {"max_total_num_tokens": 12345}

    monkeypatch.setattr(sglang, "Engine", Engine)
    return seen


def test_a_gpu_engine_starts_under_its_gpus_lock_and_a_cpu_engine_takes_none(fake_engine, monkeypatch, caplog):
    """Three regeneration engines started side by side on one H100 (2026-12-07, mem_fraction_static
    0.25 each) held 23 GB together: each sized its KV pool from the same free memory, so the later
    ones got almost none (BENCHMARKS.md)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with caplog.at_level("INFO", logger="eagle_data.engines.sglang_engine"):
        se.start_engine({"model_path": "m", "device": "cuda"})
        se.start_engine({"model_path": "m", "device": "cuda", "base_gpu_id": 1})
        se.start_engine({"model_path": "m", "device": "cpu"})
    a, b = "eagle-data-sglang-start-2,3-0.lock", "eagle-data-sglang-start-2,3-1.lock"
    assert fake_engine == [{a: True}, {a: False, b: True}, {a: False, b: False}]
    assert caplog.text.count("SGLang engine started: KV pool 12345 tokens") == 3


def test_a_start_waits_while_another_engine_starts_on_the_same_gpu(fake_engine, monkeypatch, tmp_path, caplog):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "eagle-data-sglang-start-all-0.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another engine is starting
    with caplog.at_level("INFO", logger="eagle_data.engines.sglang_engine"):
        t = threading.Thread(target=se.start_engine, args=({"model_path": "m", "device": "cuda"},))
        t.start()
        time.sleep(0.5)
        assert fake_engine == [] and t.is_alive()
        os.close(fd)  # its start ended
        t.join(10)
    assert fake_engine == [{path.name: True}]
    assert f"waiting for another SGLang engine to finish starting on the same GPU(s) (lock {path})" in caplog.text


def test_kv_pool_tokens_is_none_where_the_engine_does_not_say():
    class Old:
        def get_server_info(self):
            raise RuntimeError("no such request")

    assert se.kv_pool_tokens(Old()) is None
    assert se.kv_pool_tokens(SimpleNamespace(get_server_info=lambda: {})) is None
