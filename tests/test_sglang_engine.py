"""``start_engine`` around ``sglang.Engine`` (a fake engine: what is tested is what happens around its
start): GPU engines start one at a time per GPU, and the KV pool each got is logged."""

from __future__ import annotations

import fcntl
import os
import signal
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest

sglang = pytest.importorskip("sglang")

from eagle_data.engines import sglang_engine as se  # noqa: E402
from eagle_data.engines import start_lock as sl  # noqa: E402


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

    class Loop:  # sglang's event loop, made at the engine's first request, with its SIGTERM handler
        def remove_signal_handler(self, sig):
            signal.signal(sig, signal.SIG_DFL)  # as asyncio's does

    class Engine:
        def __init__(self, **kw):
            seen.append(_locks(tmp_path))
            self.server_args = SimpleNamespace(attention_backend=kw.get("attention_backend"))
            self.tokenizer_manager = SimpleNamespace(event_loop=None)
            self.tokenizer_manager.auto_create_handle_loop = lambda: setattr(self.tokenizer_manager, "event_loop", Loop())

        def get_server_info(self):
            return {"max_total_num_tokens": 12345}

    monkeypatch.setattr(sglang, "Engine", Engine)
    return seen


def test_a_gpu_engine_starts_under_its_gpus_locks_and_a_cpu_engine_takes_none(fake_engine, monkeypatch, caplog):
    """Three regeneration engines started side by side on one H100 (2026-12-07, mem_fraction_static
    0.25 each) held 23 GB together: each sized its KV pool from the same free memory, so the later
    ones got almost none (BENCHMARKS.md)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    mine = lambda signum, frame: None  # noqa: E731 (the caller's SIGTERM handler: it stays)
    monkeypatch.setattr(signal, "getsignal", lambda sig: mine if sig == signal.SIGTERM else signal.SIG_DFL)
    installed = {}
    monkeypatch.setattr(signal, "signal", lambda sig, h: installed.__setitem__(sig, h))
    with caplog.at_level("INFO", logger="eagle_data.engines"):
        se.start_engine({"model_path": "m", "device": "cuda"})
        se.start_engine({"model_path": "m", "device": "cuda", "base_gpu_id": 1})
        se.start_engine({"model_path": "m", "device": "cuda", "tp_size": 2})
        se.start_engine({"model_path": "m", "device": "cpu"})
    a, b = sl.start_lock_path("2").name, sl.start_lock_path("3").name
    assert fake_engine == [{a: True}, {a: False, b: True}, {a: True, b: True}, {a: False, b: False}]
    assert caplog.text.count("SGLang engine started: KV pool 12345 tokens") == 4
    assert installed == {signal.SIGTERM: mine}  # the engine's loop handler removed, the caller's back


@pytest.mark.parametrize("visible, kw, gpus", [
    (None, {}, ["0"]), ("0", {}, ["0"]), ("1,0", {"base_gpu_id": 1}, ["0"]), (" 4, 5 ,6", {"tp_size": 2}, ["4", "5"]),
    ("4,5,6,7", {"tp_size": 2, "gpu_id_step": 2, "base_gpu_id": 1}, ["5", "7"]), ("", {}, []),
    (None, {"pp_size": 2, "tp_size": 2}, ["0", "1", "2", "3"]), ("0", {"device": "cpu"}, [])])
def test_an_engines_gpus_are_named_as_cuda_visible_devices_names_them(monkeypatch, visible, kw, gpus):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert sl.engine_gpus({"device": "cuda", **kw}) == gpus


def test_start_locks_are_private_files_with_short_names_whatever_the_gpu_is_called(tmp_path, monkeypatch):
    """A 6-UUID CUDA_VISIBLE_DEVICES in the file name was too long for the file system; a lock
    file of another user (0o644 after the umask) refused every later start with EACCES."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    uuids = ",".join(f"GPU-8f3a{i}c2e-1111-2222-3333-444455556666/with slash" for i in range(6))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuids)
    with sl.gpu_start_lock({"device": "cuda", "tp_size": 6}):
        files = sorted(tmp_path.iterdir())
    assert len(files) == 6 and all(len(f.name) < 64 and str(os.getuid()) in f.name for f in files)
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in files)


def test_a_start_waits_while_another_engine_starts_on_the_same_gpu(fake_engine, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    path = sl.start_lock_path("0")
    assert path.parent == tmp_path
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another engine is starting
    with caplog.at_level("INFO", logger="eagle_data.engines"):
        t = threading.Thread(target=se.start_engine, args=({"model_path": "m", "device": "cuda", "base_gpu_id": 1},))
        t.start()
        time.sleep(0.5)
        assert fake_engine == [] and t.is_alive()
        os.close(fd)  # its start ended
        t.join(10)
    assert fake_engine == [{path.name: True}]
    assert f"waiting for another SGLang engine to finish starting on the same GPU (lock {path})" in caplog.text


def test_kv_pool_tokens_is_none_where_the_engine_does_not_say():
    class Old:
        def get_server_info(self):
            raise RuntimeError("no such request")

    assert se.kv_pool_tokens(Old()) is None
    assert se.kv_pool_tokens(SimpleNamespace(get_server_info=lambda: {})) is None
