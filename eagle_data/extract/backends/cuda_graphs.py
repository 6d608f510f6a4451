"""CUDA graphs of the HF backend's prefill over bucketed batch shapes (``backend_kwargs``
``{"cuda_graphs": true}``).

A small target's prefill is launch-bound: SmolLM2-135M's forward is ~1,900 kernels per batch and
takes as long to launch from Python as to run on the GPU (BENCHMARKS.md, issue 16), so anything
else the process does (the writers, the loop's own torch calls) stretches it. A CUDA graph
launches the whole forward in one call.

A batch ``[b, t]`` runs as the graph of its bucket ``[b', t']`` (``b`` rounded up to a power of
two below ``batch_step``, else to a multiple of it; ``t`` to a multiple of ``length_step``),
captured the first time the bucket is seen; a batch longer than ``max_length`` or of a bucket
beyond ``max_graphs`` is not graphed (the caller runs its own eager forward). Inputs are
right-padded with token 0 and the model gets a 4D boolean mask built inside the graph from the row
lengths: ``mask[i, 0, q, k] = k <= q and k < len_i``, the eager forward's padding mask, so a real
token reads exactly the keys it reads there (values may differ by kernel rounding, as between any
two batch compositions). Padding rows get length 1 (no query row without a key: no NaN anywhere).

Only models whose every layer attends causally to all earlier tokens and whose rope does not
depend on the sequence length are graphed (:func:`graph_unsafe`: the mask built here knows no
sliding window, and the bucket's length is not the batch's).

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

#: ``forward(input_ids [B, T], attention_mask [B, 1, T, T] bool) -> {name: [B, T, H_name]}``
Forward = Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]


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
    layer that does not attend causally to every earlier token (sliding window, chunked or
    bidirectional attention), a rope whose tables depend on the sequence length, or ALiBi (built
    from the 2D mask). Some models refused here would be fine (a hybrid Mamba stack, a window the
    model ignores): refusing costs speed, a wrong mask would cost correctness."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config  # multimodal wrappers
    if getattr(config, "alibi", False) or getattr(config, "model_type", None) in ("bloom", "mpt"):
        return "ALiBi position bias (built from a 2D padding mask, which the graph does not pass)"
    types = set(getattr(config, "layer_types", None) or ())
    if types - {"full_attention"}:
        return f"layer_types {sorted(types)} (the graph's mask is full causal attention only)"
    window = getattr(config, "sliding_window", None)
    if window and not types and getattr(config, "use_sliding_window", True) is not False:
        return f"sliding_window {window} (the graph's mask is full causal attention only)"
    for name in ("attention_chunk_size", "use_bidirectional_attention"):
        if getattr(config, name, None):
            return f"{name} {getattr(config, name)!r} (the graph's mask is full causal attention only)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    for r in (rope.values() if all(isinstance(v, dict) for v in rope.values()) and rope else [rope]):
        kind = r.get("rope_type", r.get("type", "default"))
        if kind not in STATIC_ROPE:
            return f"rope_type {kind!r} (its tables depend on the sequence length, the graph's is the bucket's)"
    return None


def padded_causal_mask(lens: torch.Tensor, t: int) -> torch.Tensor:
    """``lens`` [B] int64 -> bool [B, 1, t, t]: key ``k`` visible to query ``q`` of row ``i`` iff
    ``k <= q`` and ``k < lens[i]`` (HF's causal mask with right padding)."""
    ar = torch.arange(t, device=lens.device)
    return ((ar[None, :] <= ar[:, None])[None] & (ar[None, None, :] < lens[:, None, None]))[:, None]


class _Graph:
    """One bucket: static inputs and the captured graph (``None`` = re-run eagerly on replay:
    the CPU stand-in the tests use)."""

    def __init__(self, b: int, t: int, device: torch.device):
        self.b, self.t = b, t
        self.ids = torch.zeros(b, t, dtype=torch.int64, device=device)
        self.lens = torch.ones(b, dtype=torch.int64, device=device)
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
        max_length: longest bucket graphed (longer batches are compute-bound: nothing to gain, and
            the 4D mask grows as ``t'^2``).

    Call with the batch's token ids (1-D tensors, any device): returns ``{name: [b, t, H]}``, or
    None when the batch is not graphed (counted in ``eager_batches``; the caller runs it eagerly).
    """

    def __init__(self, forward: Forward, device: torch.device | str, length_step: int = 256, batch_step: int = 8,
                 max_graphs: int = 64, max_length: int = 4096):
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

    def __call__(self, seqs: Sequence[torch.Tensor]) -> Optional[dict[str, torch.Tensor]]:
        lens = [int(s.shape[0]) for s in seqs]
        b, t = len(seqs), max(lens)
        key = (batch_bucket(b, self.batch_step), bucket(t, self.length_step))
        g = self.graphs.get(key)
        if g is None:
            if len(self.graphs) >= self.max_graphs or key[1] > self.max_length:
                return self._not_graphed(key)
            g = self._capture(*key, seqs, lens)
        self._load(g, seqs, lens)
        if g.graph is None:
            self._body(g)
        else:
            g.graph.replay()
        return {n: buf[: g.b * g.t].view(g.b, g.t, -1)[:b, :t].clone() for n, buf in self.out.items()}

    def _load(self, g: _Graph, seqs: Sequence[torch.Tensor], lens: list[int]) -> None:
        """The batch into the bucket's static inputs (padding: token 0, length 1)."""
        ids = torch.nn.utils.rnn.pad_sequence(list(seqs), batch_first=True)
        g.ids.zero_()
        g.ids[: ids.shape[0], : ids.shape[1]].copy_(ids, non_blocking=True)
        g.lens.fill_(1)
        g.lens[: len(lens)].copy_(torch.tensor(lens), non_blocking=True)

    def _body(self, g: _Graph) -> None:
        """What the graph holds: the mask from the lengths, the forward, its outputs into the shared buffers."""
        states = self.forward(g.ids, padded_causal_mask(g.lens, g.t))
        n = g.b * g.t
        for name, x in states.items():
            if x.shape[:2] != (g.b, g.t):
                raise RuntimeError(f"cuda graphs: the model returned {name} states {tuple(x.shape)} for a "
                                   f"[{g.b}, {g.t}] batch")
            self.out[name][:n].view(g.b, g.t, -1).copy_(x)

    def _capture(self, b: int, t: int, seqs, lens) -> _Graph:
        """A new bucket: a warm-up run (lazy initialisation; the first also sizes the output buffers), then the
        capture."""
        g = _Graph(b, t, self.device)
        self._load(g, seqs, lens)
        if not self.out or next(iter(self.out.values())).shape[0] < b * t:
            states = self.forward(g.ids, padded_causal_mask(g.lens, t))  # names and widths of the outputs
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
            with torch.cuda.graph(g.graph, pool=self.pool):
                self._body(g)
        self.graphs[(b, t)] = g
        log.debug("cuda graphs: captured [%d, %d] (%d graphs)", b, t, len(self.graphs))
        return g

    def _not_graphed(self, key: tuple[int, int]) -> None:
        """A batch beyond ``max_graphs`` buckets or ``max_length``: counted (logged once)."""
        if self.eager_batches == 0:
            log.warning("cuda graphs: bucket %s not graphed (%d buckets captured, max_graphs %d, max_length %d); "
                        "such batches run without a graph", key, len(self.graphs), self.max_graphs, self.max_length)
        self.eager_batches += 1
        return None
