"""Generation engines for :mod:`eagle_data.regen`: HF ``generate`` (reference: batched,
left-padded) and SGLang's offline ``Engine`` (production: each request in flight on its own,
``input_ids`` in, radix cache on). Both stop at the same token ids and give the same
:class:`~eagle_data.regen.plan.Reply`; greedy output of the two is equal token for token in
float32 (tested on the tiny Llama on CPU).

Heavy imports (transformers, sglang) happen inside the engine that needs them.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any, Protocol, Sequence

import torch

from eagle_data.regen.plan import Reply

log = logging.getLogger(__name__)


class Generator(Protocol):
    """What :class:`eagle_data.regen.regenerator.Regenerator` needs from an engine: requests in,
    replies out as they are ready."""

    def submit(self, tag: int, prompt: list[int], budget: int, seed: int) -> None:
        """Ask for one reply to ``prompt``: at most ``budget`` new tokens (>= 1), stopping at the
        engine's stop ids; ``seed`` seeds sampling where the engine can seed per request."""
        ...

    def collect(self, timeout: float | None = None) -> list[tuple[int, Reply]]:
        """Wait until at least one asked reply is ready, or ``timeout`` seconds (None: no limit);
        ``(tag, reply)`` of every ready one (none after a timeout)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Manifest entry: engine name, version, dtype, device."""
        ...

    def close(self) -> None:
        ...


class BatchedGenerator:
    """:class:`Generator`'s ``submit``/``collect`` over a ``generate`` that answers a list of prompts
    at once: ``collect`` generates every request asked since the last one."""

    def __init__(self) -> None:
        self._asked: list[tuple[int, list[int], int, int]] = []

    def generate(self, prompts: Sequence[list[int]], budgets: Sequence[int], seeds: Sequence[int]) -> list[Reply]:
        raise NotImplementedError

    def submit(self, tag: int, prompt: list[int], budget: int, seed: int) -> None:
        self._asked.append((tag, prompt, budget, seed))

    def collect(self, timeout: float | None = None) -> list[tuple[int, Reply]]:
        """Generates every request asked since the last call (``timeout`` does not apply: it returns
        when they are done)."""
        asked, self._asked = self._asked, []
        if not asked:
            return []
        tags, prompts, budgets, seeds = zip(*asked)
        replies = self.generate(prompts, budgets, seeds)
        assert len(replies) == len(asked), "the engine answers every prompt"
        return list(zip(tags, replies))


def finish_of(generated: list[int], stop_ids: frozenset[int], budget: int) -> Reply:
    """The :class:`Reply` of raw generated tokens: cut at the first stop id (``"stop"``) if it
    lies within ``budget`` tokens, else the first ``budget`` tokens (``"length"``)."""
    for k, t in enumerate(generated[:budget]):
        if t in stop_ids:
            return Reply(list(generated[:k]), "stop", k + 1)
    kept = list(generated[:budget])
    return Reply(kept, "length", len(kept))


class HFGenerator(BatchedGenerator):
    """``transformers`` ``generate`` over left-padded batches of ``batch_size`` prompts
    (sorted by length), with a generation config built here: the model's own
    ``generation_config.json`` is not merged in (transformers would fill every unset field from
    it: a repetition penalty, a minimum length, top-k 50...); greedy unless ``temperature > 0``.

    Args:
        model_path: local HF model folder.
        stop_ids: token ids that end a reply.
        pad_id: id used for left padding (masked out).
        dtype, device: compute dtype and device.
        batch_size: prompts per ``generate`` call.
        temperature, top_p, top_k: sampling (``temperature == 0``: greedy; ``top_k == -1``: off).
        trust_remote_code: allow model code from the folder.
    """

    def __init__(self, model_path: str, stop_ids: frozenset[int], pad_id: int, *, dtype: str = "bfloat16",
                 device: str = "cpu", batch_size: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = -1, trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM, GenerationConfig

        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype),
                                                          trust_remote_code=trust_remote_code).to(device).eval()
        self.stop_ids, self.pad_id, self.batch_size = stop_ids, int(pad_id), int(batch_size)
        self.device, self.dtype = torch.device(device), dtype
        sample = temperature > 0
        self.gen_cfg = GenerationConfig(do_sample=sample, temperature=temperature if sample else None,
                                        top_p=top_p if sample else None, top_k=max(top_k, 0) if sample else None, num_beams=1,
                                        repetition_penalty=1.0, eos_token_id=sorted(stop_ids),
                                        pad_token_id=self.pad_id)
        self.model.generation_config = GenerationConfig()  # nothing of the model's file is merged in

    def describe(self) -> dict[str, Any]:
        import transformers

        return {"engine": "hf", "transformers": transformers.__version__, "dtype": self.dtype,
                "device": str(self.device), "batch_size": self.batch_size, "seeded": True}

    @torch.inference_mode()
    def _batch(self, prompts: list[list[int]], budgets: list[int], seed: int) -> list[Reply]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for j, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            ids[j, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[j, width - len(p):] = 1
        if self.gen_cfg.do_sample:
            torch.manual_seed(seed)
        gen_cfg = copy.copy(self.gen_cfg)
        gen_cfg.max_new_tokens = max(budgets)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  generation_config=gen_cfg)
        new = out[:, width:].cpu().tolist()
        return [finish_of(g, self.stop_ids, b) for g, b in zip(new, budgets)]

    def generate(self, prompts: Sequence[list[int]], budgets: Sequence[int], seeds: Sequence[int]) -> list[Reply]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out: list[Reply | None] = [None] * len(prompts)
        for s in range(0, len(order), self.batch_size):
            idx = order[s:s + self.batch_size]
            try:
                replies = self._batch([prompts[i] for i in idx], [budgets[i] for i in idx], seeds[idx[0]])
            except (RuntimeError, ValueError, IndexError) as e:  # e.g. out of memory: isolate the prompt(s)
                if len(idx) > 1:
                    log.warning("generate failed on a batch of %d (%s: %s); retrying one by one", len(idx),
                                type(e).__name__, str(e)[:200])
                replies = []
                for i in idx:
                    try:
                        replies += self._batch([prompts[i]], [budgets[i]], seeds[i])
                    except (RuntimeError, ValueError, IndexError) as e1:
                        replies.append(Reply([], "", 0, f"{type(e1).__name__}: {str(e1)[:300]}"))
            for i, r in zip(idx, replies):
                out[i] = r
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self.model = None


class SGLangGenerator:
    """SGLang's offline ``Engine`` (``input_ids`` in, no tokenizer, radix cache on: no hidden
    states are captured here, so a shared prefix may be reused). On CPU it runs with the
    project's stand-in ``sgl_kernel`` and ``sampling_backend="pytorch"``, as extraction does.

    Args:
        model_path, stop_ids, dtype, device, temperature, top_p: as :class:`HFGenerator`.
        engine_kwargs: ``tp_size``, ``mem_fraction_static``, ``max_total_tokens``,
            ``chunked_prefill_size``, ``attention_backend``, ``cpu_kernel``, ``log_level`` and
            other ``sglang.Engine`` kwargs.
    """

    def __init__(self, model_path: str, stop_ids: frozenset[int], *, dtype: str = "bfloat16", device: str = "cpu",
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = -1, **engine_kwargs: Any):
        from eagle_data.engines.sglang_engine import base_engine_kwargs, kv_pool_tokens, start_engine

        dev = torch.device(device).type
        named = {k: engine_kwargs.pop(k) for k in ("tp_size", "chunked_prefill_size", "mem_fraction_static",
                                                    "max_total_tokens", "attention_backend", "cpu_kernel",
                                                    "log_level") if k in engine_kwargs}
        kw = base_engine_kwargs(model_path, dtype, dev, **named)
        kw["disable_radix_cache"] = False
        kw["sampling_defaults"] = "openai"  # not the model's generation_config.json: the options say it all
        # SGLang honours a request's sampling_seed only in deterministic mode, which needs a GPU
        # attention backend (not CPU's torch_native): CPU sampling is not seeded (said at start and
        # in the manifest)
        self.seeded = temperature == 0 or dev != "cpu"
        if temperature > 0 and dev != "cpu":
            kw.setdefault("enable_deterministic_inference", True)
        elif not self.seeded:
            log.warning("SGLang on CPU samples without per-request seeds (its deterministic mode needs a GPU "
                        "attention backend): rerunning gives other replies; --backend hf seeds sampling")
        if dev == "cpu":
            kw.setdefault("sampling_backend", "pytorch")
        kw.update(engine_kwargs)
        try:
            self.engine = start_engine(kw)
        except TypeError as e:  # an engine option sglang does not know
            raise ValueError(f"backend_kwargs: sglang.Engine refused the options: {e}") from e
        self.stop_ids, self.dtype, self.device = stop_ids, dtype, device
        self.kv_pool_tokens = kv_pool_tokens(self.engine)
        self._asked: dict[asyncio.Task, tuple[int, int]] = {}  # in flight -> (tag, budget)
        self._ready: list[asyncio.Task] = []  # answered, not collected yet
        self._wake: asyncio.Future | None = None
        self.temperature, self.top_p, self.top_k = float(temperature), float(top_p), int(top_k)

    def describe(self) -> dict[str, Any]:
        import sglang

        return {"engine": "sglang", "sglang": sglang.__version__, "dtype": self.dtype, "device": self.device,
                "seeded": self.seeded, "kv_pool_tokens": self.kv_pool_tokens}

    def _params(self, budget: int, seed: int) -> dict[str, Any]:
        p = {"max_new_tokens": int(budget), "temperature": self.temperature, "top_p": self.top_p,
             "top_k": self.top_k, "min_p": 0.0, "repetition_penalty": 1.0,
             "stop_token_ids": sorted(self.stop_ids), "skip_special_tokens": False, "no_stop_trim": True}
        if self.temperature > 0:
            p["sampling_seed"] = int(seed)
        return p

    def _reply(self, o: dict[str, Any], budget: int) -> Reply:
        fin = (o.get("meta_info") or {}).get("finish_reason") or {}
        if fin.get("type") not in ("stop", "length"):
            return Reply([], "", 0, f"engine finish_reason {fin}")
        return finish_of(list(o.get("output_ids") or []), self.stop_ids, budget)

    def submit(self, tag: int, prompt: list[int], budget: int, seed: int) -> None:
        coro = self.engine.async_generate(input_ids=list(prompt), sampling_params=self._params(budget, seed))
        task = self.engine.loop.create_task(coro)  # sent when collect runs the loop
        task.add_done_callback(self._on_done)
        self._asked[task] = (tag, budget)

    def _on_done(self, task: asyncio.Task) -> None:
        self._ready.append(task)
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def collect(self, timeout: float | None = None) -> list[tuple[int, Reply]]:
        loop = self.engine.loop
        if self._asked and not self._ready:  # (a callback per task, not asyncio.wait over all in flight)
            self._wake = loop.create_future()
            loop.run_until_complete(asyncio.wait({self._wake}, timeout=timeout))
        loop.run_until_complete(asyncio.sleep(0))  # the replies that arrived with it
        ready, self._ready = self._ready, []
        out = []
        for task in ready:
            tag, budget = self._asked.pop(task)
            try:
                out.append((tag, self._reply(task.result(), budget)))
            except (RuntimeError, ValueError) as e:  # this request's failure (another exception: the run's)
                out.append((tag, Reply([], "", 0, f"{type(e).__name__}: {str(e)[:300]}")))
        return out

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def make_generator(backend: str, model_path: str, stop_ids: frozenset[int], pad_id: int, *, dtype: str,
                   device: str, batch_size: int, temperature: float, top_p: float, top_k: int,
                   trust_remote_code: bool, backend_kwargs: dict[str, Any]) -> Generator:
    """The engine named by ``backend`` (``"hf"`` or ``"sglang"``)."""
    if backend == "hf":
        if backend_kwargs:
            raise ValueError(f"backend_kwargs {sorted(backend_kwargs)}: the hf backend takes none")
        return HFGenerator(model_path, stop_ids, pad_id, dtype=dtype, device=device, batch_size=batch_size,
                           temperature=temperature, top_p=top_p, top_k=top_k, trust_remote_code=trust_remote_code)
    if trust_remote_code:
        raise ValueError("trust_remote_code is an hf-backend option; SGLang loads its own model classes")
    return SGLangGenerator(model_path, stop_ids, dtype=dtype, device=device, temperature=temperature, top_p=top_p,
                           top_k=top_k, **backend_kwargs)
