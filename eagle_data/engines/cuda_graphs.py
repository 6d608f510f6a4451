"""CUDA graphs of the HF backend's prefill over bucketed batch shapes (``backend_kwargs``
``{"cuda_graphs": true}``).

A small target's prefill is launch-bound: SmolLM2-135M's forward is ~1,900 kernels per batch and
takes as long to launch from Python as to run on the GPU (BENCHMARKS.md, issue 16), so anything
else the process does (the writers, the loop's own torch calls) stretches it. A CUDA graph
launches the whole forward in one call.

A batch ``[b, t]`` runs as the graph of its bucket ``[b', t']`` (``b`` rounded up to a power of
two below ``batch_step``, else to a multiple of it; ``t`` to a multiple of ``length_step``),
captured the first time the bucket is seen; a batch longer than ``max_length`` or of a bucket
beyond ``max_graphs`` is not graphed (the caller runs its own eager forward), and so is every batch
after a capture that failed (logged once). Inputs are right-padded with token 0 (rows and length)
and the model gets no mask: the backend graphs only models whose real tokens do not see the padding
after them (:func:`eagle_data.engines.hf.padding_is_visible`), so a real token computes
what it computes in the eager forward (values may differ by kernel rounding, as between any two
batch compositions); a sliding window, chunked attention or ALiBi is built by the model inside the
graph as it is outside. Models whose rope depends on the sequence length are not graphed
(:func:`graph_unsafe`: the bucket's length is not the batch's).

Each graph copies the hook outputs into output buffers shared by all graphs (allocated outside the
graphs' memory pool, which the graphs share too: replays are sequential on one stream), so memory
does not grow with the number of graphs; the caller gets fresh copies of its rows, safe to hand to
another stream while the next batch runs.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

log = logging.getLogger(__name__)

#: ``forward(input_ids [B, T]) -> {name: [B, T, H_name]}`` (no mask: right padding is invisible to the model)
Forward = Callable[[torch.Tensor], dict[str, torch.Tensor]]


#: longest bucket graphed by default (longer batches are compute-bound: nothing to gain)
MAX_LENGTH = 4096

#: rope types whose tables depend on the config alone (not on the sequence length)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def bucket(n: int, step: int) -> int:
    """``n`` rounded up to a multiple of ``step``."""
    return -(-n // step) * step


def batch_bucket(b: int, step: int) -> int:
    """``b`` rows rounded up to a power of two below ``step`` (a lone long row stays one row),
    else to a multiple of ``step``."""
    return 1 << (b - 1).bit_length() if b < step else bucket(b, step)


def graph_unsafe(config) -> str | None:
    """Why the HF ``config``'s model cannot run through :class:`GraphedPrefill` (None: it can): a
    rope whose tables depend on the sequence length (dynamic, longrope): the graph's length is the
    bucket's, not the batch's. Whether the model sees its padding is checked by running it
    (:func:`eagle_data.engines.hf.padding_is_visible`), not here."""
    kinds = [kind for kind in _rope_types(config) if kind not in STATIC_ROPE]
    if kinds:
        return f"rope_type {kinds[0]!r} (its tables depend on the sequence length, the graph's is the bucket's)"
    return None


def _rope_types(config) -> list[str]:
    """The rope type of each rope parameter set of the HF ``config`` (several: per layer type)."""
    return [r.get("rope_type", r.get("type", "default")) for r in _rope_parameters(_text_config(config))]


def _rope_parameters(config) -> list[dict]:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_type = rope and all(isinstance(v, dict) or v is None for v in rope.values()) \
        and any(isinstance(v, dict) for v in rope.values())
    return [v for v in rope.values() if isinstance(v, dict)] if per_type else [rope]


def rope_length_limit(config) -> int | None:
    """For a rope whose tables depend on the sequence length (any type outside :data:`STATIC_ROPE`:
    dynamic NTK, longrope): the length beyond which they may change — the smallest of the
    ``original_max_position_embeddings`` of its parameters or the config and the config's
    ``max_position_embeddings`` (implementations read one or the other; splitting at a shorter
    length than needed costs speed, not exactness); 0 when none is given; None for a static rope.
    HF picks the tables from the batch's padded length, so a short row batched with one longer
    than this gets other positions' encodings than alone."""
    config = _text_config(config)
    limits = []
    for r in _rope_parameters(config):
        if r.get("rope_type", r.get("type", "default")) not in STATIC_ROPE:
            given = [r.get("original_max_position_embeddings"), getattr(config, "original_max_position_embeddings", None),
                     getattr(config, "max_position_embeddings", None)]
            limits.append(min((int(n) for n in given if isinstance(n, int) and n > 0), default=0))
    return min(limits) if limits else None


def graph_max_length(config) -> int:
    """The longest bucket for the HF ``config``'s model: :data:`MAX_LENGTH`, within its
    ``max_position_embeddings`` (a learned position table cannot be indexed past it)."""
    positions = getattr(_text_config(config), "max_position_embeddings", None) or MAX_LENGTH
    return min(MAX_LENGTH, int(positions))


def _text_config(config):
    """The text model's config (a multimodal wrapper's ``get_text_config()``), else ``config``."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class _CaptureFailed(Exception):
    """A bucket's forward ran but could not be captured into a CUDA graph."""


class _Graph:
    """One bucket: its static input and the captured graph (``None`` = re-run eagerly on replay:
    the CPU stand-in the tests use)."""

    def __init__(self, b: int, t: int, device: torch.device):
        self.b, self.t = b, t
        self.ids = torch.zeros(b, t, dtype=torch.int64, device=device)
        self.graph: Optional[torch.cuda.CUDAGraph] = None


class GraphedPrefill:
    """The prefill ``forward`` run through CUDA graphs of bucketed shapes.

    Args:
        forward: the eager forward (see :data:`Forward`); its outputs' names and widths must not
            change between calls.
        device: where the model runs (CUDA; ``cpu`` replays eagerly: tests only).
        length_step: ``t`` is rounded up to a multiple of this.
        batch_step: ``b`` is rounded up to a multiple of this (a power of two below it).
        max_graphs: buckets captured at most.
        max_length: longest bucket graphed (the backend gives :func:`graph_max_length`).

    Call with the batch's token ids (1-D tensors, any device): returns ``{name: [b, t, H]}``, or
    None when the batch is not graphed (counted in ``eager_batches``; the caller runs it eagerly).
    """

    def __init__(self, forward: Forward, device: torch.device | str, length_step: int = 256, batch_step: int = 8,
                 max_graphs: int = 64, max_length: int = MAX_LENGTH):
        if length_step < 1 or batch_step < 1 or max_graphs < 0 or max_length < 1:
            raise ValueError(f"cuda graphs: length_step, batch_step, max_length must be >= 1 and max_graphs >= 0, "
                             f"got {length_step}, {batch_step}, {max_length}, {max_graphs}")
        self.forward, self.device = forward, torch.device(device)
        self.length_step, self.batch_step, self.max_graphs = length_step, batch_step, max_graphs
        self.max_length = max_length
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.out: dict[str, torch.Tensor] = {}          # name -> [capacity, H] shared by every graph
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.eager_batches = 0
        self.failed: Optional[str] = None  # why a capture failed: no batch is graphed after it

    def __call__(self, seqs: Sequence[torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
        lens = [int(s.shape[0]) for s in seqs]
        b, t = len(seqs), max(lens)
        key = (batch_bucket(b, self.batch_step), bucket(t, self.length_step))
        g = self.graphs.get(key)
        if g is None:
            if self.failed or len(self.graphs) >= self.max_graphs or key[1] > self.max_length:
                return self._not_graphed(key)
            try:
                g = self._capture(*key, seqs)
            except _CaptureFailed as e:  # e.g. an op the model runs that CUDA graphs cannot capture
                self.failed = str(e)
                return self._not_graphed(key)
        self._load(g, seqs)
        if g.graph is None:
            self._body(g)
        else:
            g.graph.replay()
        return {n: buf[: g.b * g.t].view(g.b, g.t, -1)[:b, :t].clone() for n, buf in self.out.items()}

    def _load(self, g: _Graph, seqs: Sequence[torch.Tensor]) -> None:
        """The batch into the bucket's static input (padding: token 0)."""
        ids = torch.nn.utils.rnn.pad_sequence(list(seqs), batch_first=True)
        g.ids.zero_()
        g.ids[: ids.shape[0], : ids.shape[1]].copy_(ids, non_blocking=True)

    def _body(self, g: _Graph) -> None:
        """What the graph holds: the forward, its outputs into the shared buffers."""
        states = self.forward(g.ids)
        n = g.b * g.t
        for name, x in states.items():
            if x.shape[:2] != (g.b, g.t):
                raise RuntimeError(f"cuda graphs: the model returned {name} states {tuple(x.shape)} for a "
                                   f"[{g.b}, {g.t}] batch")
            self.out[name][:n].view(g.b, g.t, -1).copy_(x)

    def _capture(self, b: int, t: int, seqs) -> _Graph:
        """A new bucket: a warm-up run (lazy initialisation; the first also sizes the output buffers), then the
        capture."""
        g = _Graph(b, t, self.device)
        self._load(g, seqs)
        if not self.out or next(iter(self.out.values())).shape[0] < b * t:
            states = self.forward(g.ids)  # names and widths of the outputs
            cap = max([b * t] + [2 * buf.shape[0] for buf in self.out.values()])
            self.out = {name: x.new_empty(cap, x.shape[-1]) for name, x in states.items()}
            del states
            if self.graphs:  # the captured graphs write to the old buffers: captured again when seen
                log.info("cuda graphs: output buffers grown to %d tokens; %d graphs dropped", cap, len(self.graphs))
                self.graphs.clear()
            if self.pool is not None:  # a pool whose graphs are gone is not captured into again
                self.pool = torch.cuda.graph_pool_handle()
        if self.device.type == "cuda":
            g.graph = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._body(g)  # warm-up on a side stream, as torch's capture needs
            torch.cuda.current_stream(self.device).wait_stream(side)
            try:
                with torch.cuda.graph(g.graph, pool=self.pool):
                    self._body(g)
            except RuntimeError as e:  # the model ran in the warm-up above: it is the capture that failed
                raise _CaptureFailed(f"{type(e).__name__}: {str(e).strip()[:200]}") from e
        self.graphs[(b, t)] = g
        log.debug("cuda graphs: captured [%d, %d] (%d graphs)", b, t, len(self.graphs))
        return g

    def _not_graphed(self, key: tuple[int, int]) -> None:
        """A batch beyond ``max_graphs`` buckets or ``max_length``, or after a failed capture: counted
        (logged once)."""
        if self.eager_batches == 0:
            why = (f"a capture failed ({self.failed})" if self.failed else
                   f"{len(self.graphs)} buckets captured, max_graphs {self.max_graphs}, max_length {self.max_length}")
            log.warning("cuda graphs: bucket %s not graphed (%s); such batches run without a graph", key, why)
        self.eager_batches += 1
        return None
