"""Engine settings shared by :class:`~eagle_data.engines.sglang.SGLangBackend` and the benchmark, and
the backend's knobs (:class:`SGLangOptions`).

No sglang import here: :func:`prepare_cpu_environment` must run before sglang is imported.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

log = logging.getLogger(__name__)


CPU_KERNEL_DIR = Path(__file__).resolve().parent / "cpu_sgl_kernel"


@dataclass(frozen=True)
class SGLangOptions:
    """The knobs of :class:`~eagle_data.engines.sglang.SGLangBackend` (an extraction's ``backend_kwargs``, by name)."""

    tp_size: int = 1
    """tensor parallel size (only TP rank 0 writes chunks)"""
    chunked_prefill_size: Optional[int] = None
    """engine memory knob (None: SGLang's default)"""
    mem_fraction_static: Optional[float] = None
    """engine memory knob (None: SGLang's default; CPU: 0.3)"""
    max_total_tokens: Optional[int] = None
    """engine memory knob (None: SGLang's default; CPU: 32768)"""
    spool_dir: Optional[Union[str, Path]] = None
    """parent dir of the per-run spool (default ``/dev/shm``)"""
    max_inflight: int = 4096
    """most requests in flight at once"""
    max_inflight_bytes: int = 2 << 30
    """most bytes of stored rows in flight (their prompt tokens times the bytes a token's rows take:
    bounds the spool, in ``/dev/shm`` by default; at most half its free space); a longer single
    sample still runs alone. (A count of 65,536 tokens made the engine wait for each batch's rows to
    be collected before it could start the next.)"""
    attention_backend: Optional[str] = None
    """default ``"torch_native"`` on CPU, SGLang's choice on GPU"""
    collect_timeout_s: float = 30.0
    """how long a finished request waits for its chunk files while the spool sees no change (the
    scheduler's writer thread may lag behind the engine under load: any file it adds restarts the wait)"""
    cpu_kernel: str = "standin"
    """``"standin"`` (default: our pure-torch ``sgl_kernel``) or ``"installed"`` (SGLang's own CPU kernel build)"""
    log_level: str = "error"
    """SGLang log level"""
    engine_kwargs: Optional[dict[str, Any]] = None
    """extra ``sglang.Engine`` kwargs (not the ones the backend owns)"""

    def __post_init__(self) -> None:
        """Raises: ValueError naming a bound that is not positive."""
        from eagle_data.checks import check_positive

        check_positive(tp_size=self.tp_size, max_inflight=self.max_inflight, max_inflight_bytes=self.max_inflight_bytes)
        if not self.collect_timeout_s > 0:
            raise ValueError(f"collect_timeout_s must be > 0, got {self.collect_timeout_s}")


def prepare_cpu_environment(use_standin: bool = True) -> None:
    """Set ``SGLANG_USE_CPU_ENGINE=1`` and put the stand-in ``sgl_kernel`` first on the path.

    Must run before ``sglang`` is imported in this process (sglang reads the variable and
    imports ``sgl_kernel`` at import time); ``os.environ`` is inherited by the scheduler.

    Raises:
        RuntimeError: a CUDA ``sgl_kernel`` is already imported in this process (warns if sglang is).
    """
    if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1" and "sglang" in sys.modules:
        # The spawned scheduler starts clean and inherits the environment, which is what
        # matters; this process only runs the tokenizer manager (seen to work), but sglang
        # modules evaluated is_cpu() at import time without the variable.
        log.warning("sglang was imported before SGLANG_USE_CPU_ENGINE=1 was set; build the SGLang "
                    "backend (device='cpu') before importing sglang")
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    if not use_standin:
        return
    d = str(CPU_KERNEL_DIR)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != d]
    os.environ["PYTHONPATH"] = os.pathsep.join([d, *parts])
    if d in sys.path:
        sys.path.remove(d)
    sys.path.insert(0, d)
    mod = sys.modules.get("sgl_kernel")
    if mod is not None and not getattr(mod, "EAGLE_DATA_CPU_STANDIN", False):
        raise RuntimeError("a CUDA sgl_kernel is already imported in this process; build the SGLang "
                           "backend (device='cpu') before anything imports sglang or sgl_kernel")


#: warnings sglang emits on every start that do not apply here (CPU: no AWQ/GGUF kernels, no Triton:
#: neither is used): (message prefix without commas or colons, module), also for the spawned scheduler
SGLANG_HARMLESS = (("Only CUDA", "sglang.srt.layers.quantization.awq.awq"),
                   ("Only CUDA", "sglang.srt.layers.quantization.gguf"),
                   ("Triton is not supported on current platform", "sglang.kernels.ops.attention.fla.utils"),
                   # the engine's processes leave one semaphore to the tracker, which cleans it up
                   ("resource_tracker", "multiprocessing.resource_tracker"))
#: sglang loggers whose INFO lines describe its own start-up (plugins, the full server_args)
SGLANG_CHATTY = ("sglang.srt.plugins", "sglang.srt.entrypoints.engine", "sglang.srt.utils.common")


def quiet_sglang() -> None:
    """Silence :data:`SGLANG_HARMLESS` (here, and in the scheduler processes through
    ``PYTHONWARNINGS``, whose entries match a message prefix in one named module) and keep
    :data:`SGLANG_CHATTY` to warnings and errors."""
    import warnings

    entries = [f"ignore:{m}:UserWarning:{mod}" for m, mod in SGLANG_HARMLESS]
    have = [e for e in os.environ.get("PYTHONWARNINGS", "").split(",") if e]
    os.environ["PYTHONWARNINGS"] = ",".join(have + [e for e in entries if e not in have])
    for m, mod in SGLANG_HARMLESS:
        warnings.filterwarnings("ignore", message=re.escape(m), category=UserWarning, module=re.escape(mod) + "$")
    for name in SGLANG_CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING)


#: sglang's attention backend that runs EAGLE speculative decoding on CPU (its draft backends
#: exist only for it, ``sglang/srt/speculative/draft_utils.py``); the stand-in implements its ops
CPU_SPEC_ATTENTION = "intel_amx"


def start_engine(kw: dict[str, Any]):
    """``sglang.Engine(**kw)``, keeping this process's logging as it was: the engine calls
    ``logging.basicConfig(level=log_level, force=True)`` in the calling process, which would
    raise the root level to ``log_level`` (``"error"`` here) and silence eagle-data's own
    warnings (skipped rows, notes) for the rest of the run.

    CPU with ``attention_backend="intel_amx"`` (:func:`spec_engine_kwargs`): sglang 0.5.23 would
    switch it back to ``torch_native`` on a CPU without AMX (``arg_groups/overrides.py``), where no
    speculative decoding exists, so the engine is built under
    ``sglang.srt.runtime_context.override_platform(has_amx=True)`` (an internal API of the pinned
    version; only that server-args decision reads it: the layers still see no AMX and run native
    torch). The backend the engine resolved is checked after start.

    Raises:
        ValueError: an option whose type sglang declares bool/int/float/str given another type
            (``"yes"`` for a bool would silently be true).
        RuntimeError: the engine resolved another attention backend than the one asked for.
    """
    import sglang
    from sglang.srt.server_args import ServerArgs

    from eagle_data.checks import check_option_types
    from eagle_data.engines.start_lock import gpu_start_lock

    check_option_types("sglang.Engine", kw, {k: p.annotation for k, p in inspect.signature(ServerArgs).parameters.items()})
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    amx = kw.get("device") == "cpu" and kw.get("attention_backend") == CPU_SPEC_ATTENTION
    caller_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        if amx:
            from sglang.srt.runtime_context import override_platform
            ctx = override_platform(has_amx=True)
        else:
            ctx = contextlib.nullcontext()
        with ctx, gpu_start_lock(kw):
            engine = sglang.Engine(**kw)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    log.info("SGLang engine started: KV pool %s tokens", kv_pool_tokens(engine))
    _reclaim_sigterm(engine, caller_sigterm)
    want, got = kw.get("attention_backend"), getattr(engine.server_args, "attention_backend", None)
    if want is not None and got != want:
        engine.shutdown()
        raise RuntimeError(f"sglang resolved attention_backend={got!r}, not the {want!r} asked for (sglang "
                           f"{sglang.__version__})")
    return engine


def _reclaim_sigterm(engine, handler) -> None:
    """Give SIGTERM back to ``handler``, the caller's. SGLang's engine answers it as a server does:
    an asyncio handler (made with the engine's event loop, at its first request) drains the requests
    in flight and then kills the process tree, while a client submitting more never drains: an
    extraction went on to its end, or failed on its deleted spool. A batch job stops at its own safe
    point instead (extraction's :class:`~eagle_data.extract.signals.Signals`; by default, the
    process ends). Main thread only (elsewhere SGLang adds no handler)."""
    if threading.current_thread() is not threading.main_thread() or handler is None:
        return
    tm = engine.tokenizer_manager
    tm.auto_create_handle_loop()  # no-op when the loop is there; else it would add the handler later
    tm.event_loop.remove_signal_handler(signal.SIGTERM)
    signal.signal(signal.SIGTERM, handler)


def kv_pool_tokens(engine) -> Optional[int]:
    """The started engine's KV pool size in tokens (``get_server_info()["max_total_num_tokens"]``),
    None where this sglang does not say."""
    try:
        n = engine.get_server_info().get("max_total_num_tokens")
    except Exception as e:  # only reported: a version without it must not stop a run
        log.debug("get_server_info failed: %s", e)
        return None
    return int(n) if n is not None else None


def spec_engine_kwargs(model_path: str, draft_model_path: str, dtype: str, device: str, *, steps: int,
                       topk: int = 1, draft_tokens: Optional[int] = None, **base: Any) -> dict[str, Any]:
    """``sglang.Engine`` kwargs for EAGLE-3 speculative decoding with an exported drafter.

    Chain drafting by default (``topk=1``: ``steps`` proposals, ``steps + 1`` tokens verified per
    step). The rest is :func:`base_engine_kwargs` (``input_ids`` in, radix cache off); on CPU the
    attention backend is :data:`CPU_SPEC_ATTENTION` (start with :func:`start_engine`). On a GPU
    nothing here is CPU-specific: stock SGLang serves the same folder.
    """
    from eagle_data.checks import check_positive

    check_positive(steps=steps, topk=topk)
    draft_tokens = steps + 1 if draft_tokens is None else draft_tokens
    if topk == 1 and draft_tokens != steps + 1:
        raise ValueError(f"chain drafting (topk=1) verifies steps + 1 = {steps + 1} tokens, got draft_tokens="
                         f"{draft_tokens}")
    if device == "cpu":
        base.setdefault("attention_backend", CPU_SPEC_ATTENTION)
    kw = base_engine_kwargs(model_path, dtype, device, **base)
    kw.update(speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft_model_path),
              speculative_num_steps=int(steps), speculative_eagle_topk=int(topk),
              speculative_num_draft_tokens=int(draft_tokens))
    return kw


def ngram_engine_kwargs(model_path: str, dtype: str, device: str, *, draft_tokens: int, breadth: int = 1,
                        **base: Any) -> dict[str, Any]:
    """``sglang.Engine`` kwargs for SGLang's own NGRAM speculative decoding (no drafter: drafts from
    a trie of the text it has seen, prompts and outputs), ``draft_tokens`` verified per step (a
    chain when ``breadth`` is 1, as :func:`spec_engine_kwargs`'s ``steps + 1``). The trie learns
    from every request: compare on a fresh engine."""
    from eagle_data.checks import check_positive

    check_positive(draft_tokens=draft_tokens, breadth=breadth)
    if device == "cpu":
        base.setdefault("attention_backend", CPU_SPEC_ATTENTION)
    kw = base_engine_kwargs(model_path, dtype, device, **base)
    kw.update(speculative_algorithm="NGRAM", speculative_num_draft_tokens=int(draft_tokens),
              speculative_ngram_min_bfs_breadth=1, speculative_ngram_max_bfs_breadth=int(breadth))
    return kw


def base_engine_kwargs(model_path: str, dtype: str, device: str, *, tp_size: int = 1,
                       chunked_prefill_size: int | None = None, mem_fraction_static: float | None = None,
                       max_total_tokens: int | None = None, attention_backend: str | None = None,
                       cpu_kernel: str = "standin", log_level: str = "error") -> dict[str, Any]:
    """``sglang.Engine`` kwargs shared by the backend and the benchmark (no capture settings).

    ``input_ids`` in, no tokenizer, radix cache off; CPU: prepares the environment
    (:func:`prepare_cpu_environment`), ``torch_native`` attention, ``mem_fraction_static=0.3``,
    ``max_total_tokens=32768`` unless given; GPU: prefill CUDA graphs disabled.
    """
    kw: dict[str, Any] = dict(model_path=model_path, dtype=dtype, device=device, tp_size=int(tp_size),
                              skip_tokenizer_init=True, disable_radix_cache=True, log_level=log_level)
    quiet_sglang()
    if device == "cpu":
        prepare_cpu_environment(cpu_kernel == "standin")
        if int(tp_size) > 1:
            # Tried here with gloo: sglang 0.5.23's init_model_parallel_group builds a
            # PyNcclCommunicator for CPU groups too -> "Expected a cuda device, but got: cpu".
            raise ValueError("tp_size > 1 on CPU does not work in sglang 0.5.23 (it builds a NCCL "
                             "communicator for CPU groups); use tp_size=1 on CPU")
        # the KV pool is capped by max_total_tokens; the fraction only has to leave room for the
        # weights (SGLang checks weights vs. *available* host RAM, shared with other processes)
        mem_fraction_static = 0.3 if mem_fraction_static is None else mem_fraction_static
        max_total_tokens = 32768 if max_total_tokens is None else max_total_tokens
        attention_backend = attention_backend or "torch_native"
    else:
        kw["cuda_graph_backend_prefill"] = "disabled"
    for k, v in (("chunked_prefill_size", chunked_prefill_size), ("mem_fraction_static", mem_fraction_static),
                 ("max_total_tokens", max_total_tokens), ("attention_backend", attention_backend)):
        if v is not None:
            kw[k] = v
    return kw


def model_facts(model_path: str) -> tuple[int, int, int, list[str]]:
    """``(num_layers, hidden_size, vocab_size, architectures)`` from the model's HF config."""
    from transformers import AutoConfig
    top = AutoConfig.from_pretrained(model_path)
    cfg = getattr(top, "text_config", None) or top
    return int(cfg.num_hidden_layers), int(cfg.hidden_size), int(cfg.vocab_size), list(top.architectures or [])


#: the sglang releases the backend is tested with (0.5.17: H200, torch 2.11; 0.5.23: CI, CPU)
SUPPORTED = ((0, 5, 17), (0, 5, 23))


def check_version(version: str) -> bool:
    """Whether sglang ``version`` is within :data:`SUPPORTED`; outside it, a warning (engine internals
    such as the decoder layers' outputs may differ: check a few samples with ``verify --recompute``)."""
    got = tuple(int(x) for x in re.findall(r"\d+", version)[:3])
    if SUPPORTED[0] <= got <= SUPPORTED[1]:
        return True
    lo, hi = (".".join(map(str, v)) for v in SUPPORTED)
    log.warning("sglang %s is outside the range eagle-data is tested with (%s - %s): check a few samples "
                "against the HF backend with `eagle-data verify --recompute`", version, lo, hi)
    return False


def scoped_shutdown(engine) -> None:
    """``engine.shutdown()`` killing only the engine's own children (see
    :meth:`~eagle_data.engines.sglang.SGLangBackend.close`); its atexit shutdown unregistered."""
    import atexit

    import sglang.srt.entrypoints.engine as em
    orig, me, mine = em.kill_process_tree, os.getpid(), list(engine.get_all_child_pids())

    def kill_own_children(parent_pid, include_parent=True, skip_pid=None, wait_timeout=60):
        if parent_pid in (None, me) and not include_parent:
            for pid in mine:  # each child with its own descendants
                orig(pid, include_parent=True, wait_timeout=wait_timeout)
            return None
        return orig(parent_pid, include_parent=include_parent, skip_pid=skip_pid, wait_timeout=wait_timeout)

    em.kill_process_tree = kill_own_children
    try:
        engine.shutdown()
    finally:
        em.kill_process_tree = orig
    atexit.unregister(engine.shutdown)


def check_capture_invariants(sa, allow_radix: bool = False) -> None:
    """A started capture engine's server args ``sa`` keep the capture invariants (radix cache and
    mixed chunking off, pp = dp = 1, no attention DP).

    Raises:
        RuntimeError: naming every violation.
    """
    problems = []
    if not getattr(sa, "disable_radix_cache", False) and not allow_radix:
        problems.append("radix cache is on (cached prefixes would skip rows)")
    if getattr(sa, "enable_mixed_chunk", False):
        problems.append("mixed chunking is on")
    for name in ("pp_size", "dp_size"):
        if int(getattr(sa, name, 1) or 1) != 1:
            problems.append(f"{name}={getattr(sa, name)} (only 1 is supported)")
    if getattr(sa, "enable_dp_attention", False):
        problems.append("attention DP is on")
    if problems:
        raise RuntimeError("SGLang engine violates capture invariants: " + "; ".join(problems))


def capture_info_extra(version: str, sa, dev: str, tp_size: int, cpu_kernel: str, engine_aux: bool) -> dict[str, Any]:
    """``BackendInfo.extra`` of a started engine (server args ``sa``): how it captures."""
    return {"sglang_version": version, "device": dev, "tp_size": int(tp_size),
            "writer_tp_rank": 0, "attention_backend": getattr(sa, "attention_backend", None),
            "chunked_prefill_size": getattr(sa, "chunked_prefill_size", None),
            "prefill_cuda_graph": "disabled" if dev == "cuda" else "n/a (cpu)",
            "decode_cuda_graph": getattr(sa, "cuda_graph_backend_decode", None) if dev == "cuda" else "n/a (cpu)",
            "radix_cache": "disabled", "mixed_chunk": "disabled", "max_new_tokens": 0,
            "capture": ("engine aux capture + forward_hook on logits_processor" if engine_aux else
                        "forward_hooks on the aux decoder layers and logits_processor, safetensors spool"),
            "cpu_sgl_kernel": ("eagle-data pure-torch stand-in" if dev == "cpu" and cpu_kernel == "standin"
                               else "installed")}
