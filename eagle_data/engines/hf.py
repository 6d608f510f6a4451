"""HF transformers reference backend: one prefill forward, forward hooks on decoder layers.

Capture: a forward hook on ``model.model.layers[k]`` for each aux id ``k`` (its output is
HF ``hidden_states[k + 1]``) and one on ``model.model.norm`` (the final post-norm state).
Only the base model runs (no ``lm_head``: logits are not needed and would cost
``T x V`` memory), and ``output_hidden_states`` stays off.

Batching: right padding, without an attention mask where the padding is invisible. In a causal
model a real token never attends to the padding after it, so the mask changes nothing it computes,
and without one the attention runs its causal kernel (flash on CUDA) instead of a masked one, as for
a lone unpadded sample. Whether the model is causal is not read from its config but checked at
start-up (:func:`padding_is_visible`: two rows that differ only in their padding must give their
real tokens identical states); a model that fails it (bidirectional attention, or kernels whose
results depend on the batch's other tokens) gets the padding mask. Either way results do not depend
on batch composition beyond kernel rounding. A rope whose tables depend on the sequence length
(dynamic NTK, longrope: HF picks them from the batch's padded length, and dynamic NTK from the
longest length seen so far) would break that for batches longer than its original context: there
the rows up to that length run as one batch and each longer row alone, from the original tables
(:meth:`HFBackend._forward_by_rope_length`), i.e. each row's states are those of the row alone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from eagle_data.format.fp8 import finite_rows, to_storage
from eagle_data.format.schema import hidden_dtype, storage_dtype_of
from eagle_data.engines.base import (BackendInfo, Captured, check_served_aux_ids, default_aux_layer_ids,
                                             validate_aux_layer_ids)

log = logging.getLogger(__name__)



def _decoder_parts(model):
    """(layers ModuleList, final norm) of a decoder-only HF model."""
    base = getattr(model, "model", None) or getattr(model, "transformer", None)
    layers = getattr(base, "layers", None) or getattr(base, "h", None)
    norm = getattr(base, "norm", None) or getattr(base, "ln_f", None) or getattr(base, "final_layernorm", None)
    if layers is None or norm is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers and final norm")
    return base, layers, norm


def _load(model_path: str | Path, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool):
    """The HF model of ``model_path``.

    Raises:
        ValueError: the folder's weights or config cannot be loaded (names the folder and the cause).
    """
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype, trust_remote_code=trust_remote_code,
                                                    attn_implementation=attn_implementation)
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"model {model_path}: cannot load its weights ({type(e).__name__}: {first})") from e
    except Exception as e:  # safetensors' own error type (truncated file, bad header)
        if type(e).__name__ != "SafetensorError":
            raise
        raise ValueError(f"model {model_path}: unreadable safetensors weights ({e})") from e


class HFBackend:
    """Reference capture with HF ``AutoModelForCausalLM``.

    Args:
        model_path: local HF model folder.
        aux_layer_ids: three ids in the SGLang/EAGLE-3 convention; ``None`` -> default.
        dtype: ``"bfloat16"`` (default) or ``"float32"``; also the stored dtype.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
        attn_implementation: ``"sdpa"`` (default) or ``"eager"``.
        trust_remote_code: off by default.
        model: an already-built model (tests); ``model_path`` is then only recorded.
        out_dtype: dtype of returned aux states, and of final states unless ``final_out_dtype``
            (default: ``dtype``); cast on the device, so fp32 compute with bf16 storage halves the
            device-to-host traffic. ``"float8_e4m3fn"``: quantised on the device, with scales
            (:attr:`Captured.aux_scale` / ``hidden_scale``).
        final_out_dtype: dtype of returned final states (default: ``out_dtype``).
        cuda_graphs: run the prefill through CUDA graphs of bucketed batch shapes
            (:mod:`eagle_data.engines.cuda_graphs`; CUDA; causal models whose rope does not
            depend on the sequence length): for small targets, whose forward is launch-bound.
            Default off.
        graph_length_step: with ``cuda_graphs``, batch lengths are rounded up to a multiple of this.

    On CUDA, :meth:`capture_async` overlaps: the device-to-host copy of batch ``i`` runs on a
    side stream into pinned host memory (torch's caching host allocator) while batch ``i+1``
    is being computed; :meth:`capture` is ``capture_async(...).result()``.
    """

    def __init__(self, model_path: str | Path, aux_layer_ids: Sequence[int] | None = None,
                 dtype: str = "bfloat16", device: str = "cpu", attn_implementation: str = "sdpa",
                 trust_remote_code: bool = False, model=None, out_dtype: str | None = None,
                 final_out_dtype: str | None = None, cuda_graphs: bool = False, graph_length_step: int = 256):
        compute = hidden_dtype(dtype)
        self.device = torch.device(device)
        _check_graph_settings(cuda_graphs, graph_length_step, self.device)  # before loading
        if model is None:
            model = _load(model_path, compute, attn_implementation, trust_remote_code)
        self.model = model.to(device=self.device, dtype=compute).eval()
        self.base, layers, norm = _decoder_parts(self.model)
        cfg = self.model.config
        n = len(layers)
        ids = validate_aux_layer_ids(aux_layer_ids, n) if aux_layer_ids is not None else default_aux_layer_ids(n)
        check_served_aux_ids(ids, getattr(cfg, "architectures", None))
        self.info = BackendInfo("hf", str(model_path), int(cfg.hidden_size), n, int(cfg.vocab_size),
                                dtype, ids, {"attn_implementation": attn_implementation,
                                             "device": str(self.device)})
        self.out_dtype = storage_dtype_of(out_dtype or dtype, "out_dtype")
        self.final_out_dtype = storage_dtype_of(final_out_dtype or out_dtype or dtype, "final_out_dtype")
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._store: dict[str, torch.Tensor] = {}
        self._handles = [layers[k].register_forward_hook(self._hook(f"aux{j}")) for j, k in enumerate(ids)]
        self._handles.append(norm.register_forward_hook(self._hook("final")))
        #: the model's real tokens see the right padding after them: batches pass the padding mask
        self.mask_padding = padding_is_visible(self._states, int(cfg.vocab_size), self.device)
        if self.mask_padding:
            log.info("model %s: a real token's states depend on the padding after it; batches pass the padding "
                     "mask", model_path)
        self.info.extra["padding_mask"] = self.mask_padding  # the probe's decision, in the manifest
        self._graphs = None
        if cuda_graphs:
            from eagle_data.engines.cuda_graphs import GraphedPrefill, graph_max_length, graph_unsafe

            why = graph_unsafe(cfg) or ("its real tokens' states depend on the padding after them (not causal)"
                                        if self.mask_padding else None)
            if why:
                raise ValueError(f"backend_kwargs cuda_graphs: model {model_path} cannot run through CUDA graphs: {why}")
            self._graphs = GraphedPrefill(lambda ids: self._states(ids, None), self.device, length_step=graph_length_step,
                                          max_length=graph_max_length(cfg))
        self.info.extra["cuda_graphs"] = self._graphs is not None
        from eagle_data.engines.cuda_graphs import rope_length_limit

        #: batches longer than this run split by row length (a length-dependent rope); None: never
        self.rope_limit = rope_length_limit(cfg)

    def forward_padded(self, seqs: Sequence[torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The eager forward of ``seqs`` (1-D token ids) right-padded into ``[B, T]`` -> (the hooks'
        states ``{aux0, aux1, aux2, final}`` [B, T, H], the padding mask [B, T] or None when no row
        is padded); the mask goes to the model only if it sees its padding (:attr:`mask_padding`)."""
        ids, attn = right_padded(seqs, self.device, non_blocking=self._copy_stream is not None)
        return self._states(ids, attn if self.mask_padding else None), attn

    def _forward_by_rope_length(self, seqs: Sequence[torch.Tensor], lens: list[int]
                                ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """:meth:`forward_padded` for a batch longer than :attr:`rope_limit`: the rows up to the limit
        in one forward, each longer row in its own, every forward from the rope's original tables
        (:func:`reset_length_dependent_rope`); the states scattered back into ``[B, T, H]`` (zeros
        at the padding)."""
        short = [i for i, n in enumerate(lens) if n <= self.rope_limit]
        groups = ([short] if short else []) + [[i] for i, n in enumerate(lens) if n > self.rope_limit]
        out: dict[str, torch.Tensor] = {}
        for rows in groups:
            reset_length_dependent_rope(self.model)
            states, _ = self.forward_padded([seqs[i] for i in rows])
            idx = torch.tensor(rows, device=self.device)
            for name, x in states.items():
                if name not in out:
                    out[name] = x.new_zeros((len(seqs), max(lens), x.shape[-1]))
                out[name][idx, :x.shape[1]] = x
        reset_length_dependent_rope(self.model)
        return out, padding_mask(lens, self.device, non_blocking=self._copy_stream is not None)

    def _states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """One forward of the base model -> the hooks' outputs {aux0, aux1, aux2, final} [B, T, H].

        Raises:
            RuntimeError: a hook did not fire.
        """
        self._store = {}
        self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        missing = {"aux0", "aux1", "aux2", "final"} - set(self._store)
        if missing:
            raise RuntimeError(f"forward hooks did not fire for {sorted(missing)}")
        states, self._store = self._store, {}
        return states

    def _hook(self, name: str):
        def fn(_mod, _inp, out):
            self._store[name] = out[0] if isinstance(out, tuple) else out
        return fn

    def capture(self, batch: Sequence[tuple[str, torch.Tensor]]) -> list[Captured]:
        """See :meth:`eagle_data.engines.base.Backend.capture`. One forward for the batch."""
        return self.capture_async(batch).result()

    def capture_iter(self, batches: Iterable[Sequence[tuple[str, torch.Tensor]]],
                     prefetch: int = 1) -> Iterator[list[Captured]]:
        """See :meth:`eagle_data.engines.base.Backend.capture_iter`: batch i+1's forward is
        launched (:meth:`capture_async`) before batch i's states are handed out."""
        pending: deque[PendingCapture] = deque()
        for batch in batches:
            pending.append(self.capture_async(batch))
            if len(pending) > prefetch:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    @torch.inference_mode()
    def capture_async(self, batch: Sequence[tuple[str, torch.Tensor]]) -> "PendingCapture":
        """Launch the forward of ``batch`` and the device-to-host copy of its states.

        Returns a :class:`PendingCapture`; its ``result()`` waits for the copy only.
        """
        if not batch:
            return PendingCapture([], [], None, None, None)
        lens = [int(ids.shape[0]) for _, ids in batch]
        b, t = len(batch), max(lens)
        on_gpu = self._copy_stream is not None
        seqs = [ids for _, ids in batch]
        states = self._graphs(seqs) if self._graphs is not None else None
        if states is not None:
            attn = padding_mask(lens, self.device, non_blocking=True)  # [B, T] or None: where the padding is
        elif self.rope_limit is not None and t > self.rope_limit:
            states, attn = self._forward_by_rope_length(seqs, lens)
        else:
            states, attn = self.forward_padded(seqs)
        # [B, T, 3H] and [B, T, H] in the output dtypes (fp8: + scales [B, T, 3] / [B, T, 1]), still on the device
        # (fp8 not checked by quantize: a non-finite value gives a non-finite scale, caught by `ok` below)
        aux, aux_s = to_storage(torch.cat([states["aux0"], states["aux1"], states["aux2"]], dim=-1),
                                self.out_dtype, 3, check=False)
        fin, fin_s = to_storage(states["final"], self.final_out_dtype, 1, check=False)
        del states
        if aux.shape[:2] != (b, t) or fin.shape[:2] != (b, t):
            raise RuntimeError(f"the model returned states {tuple(aux.shape)} / {tuple(fin.shape)} for a "
                               f"[{b}, {t}] batch (keys {[k for k, _ in batch][:4]})")
        # [B] every stored value of the sample's tokens finite (fp8: its scales; padding rows ignored),
        # checked here, not on the host
        ok = finite_rows(aux, aux_s) & finite_rows(fin, fin_s)  # [B, T]
        ok = (ok if attn is None else ok | (attn == 0)).all(-1)
        keys = [k for k, _ in batch]
        if not on_gpu:
            return PendingCapture(keys, lens, aux, fin, None, aux_s, fin_s, ok)
        done = torch.cuda.Event()
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            host = [_to_host(x, self._copy_stream) for x in (aux, fin, aux_s, fin_s, ok)]
            done.record(self._copy_stream)
        return PendingCapture(keys, lens, host[0], host[1], done, host[2], host[3], host[4])

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _check_graph_settings(on: Any, length_step: Any, device: torch.device) -> None:
    """The ``cuda_graphs`` / ``graph_length_step`` options, checked before the model is loaded.

    Raises:
        ValueError: a value of the wrong type, or graphs on a device other than CUDA.
    """
    if not isinstance(on, bool):
        raise ValueError(f"backend_kwargs cuda_graphs must be true or false, got {on!r}")
    if isinstance(length_step, bool) or not isinstance(length_step, int) or not 1 <= length_step <= 65536:
        raise ValueError(f"backend_kwargs graph_length_step must be an integer in [1, 65536], got {length_step!r}")
    if on and device.type != "cuda":
        raise ValueError(f"backend_kwargs cuda_graphs: CUDA graphs need a CUDA device, got device {device}")


def padding_is_visible(states: Callable[[torch.Tensor, None], dict[str, torch.Tensor]], vocab_size: int,
                       device: torch.device) -> bool:
    """Whether a model's real tokens see the right padding after them: ``states(ids [4, 16], None)``
    (no mask) of four rows with the same 8 real tokens, rows 0-1 padded alike and rows 2-3 with
    other padding. The padding is invisible when changing it moves the real tokens' states by no
    more than 16 times what moving the same row within the batch does, plus one unit of rounding of
    the states' dtype at their largest value (some kernels, e.g. grouped expert matmuls, round a row
    by its place in the batch: ~1e-6 in float32 on CPU); for most models both are exactly 0. A
    causal model passes; bidirectional attention, which moves them by orders of magnitude more,
    fails and keeps the padding mask (as does a non-finite state)."""
    g = torch.Generator().manual_seed(0)
    real = torch.randint(0, vocab_size, (8,), generator=g)
    pads = [torch.randint(0, vocab_size, (8,), generator=g) for _ in range(2)]
    ids = torch.stack([torch.cat([real, pads[i // 2]]) for i in range(4)])
    with torch.inference_mode():
        out = states(ids.to(device), None)
    for x in out.values():
        floor = torch.finfo(x.dtype).eps if x.dtype.is_floating_point else 0.0
        x = x[:, :8].float()
        if not torch.isfinite(x).all():
            return True
        place = max((x[0] - x[1]).abs().max().item(), (x[2] - x[3]).abs().max().item())
        if (x[0] - x[2]).abs().max().item() > 16 * place + floor * x.abs().max().item():
            return True
    return False


def right_padded(seqs: Sequence[torch.Tensor], device: torch.device | str, non_blocking: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(input_ids [B, T], attention_mask [B, T] or None)`` on ``device`` for sequences of lengths
    ``T_i`` (``T = max T_i``): right padding with 0, and a mask only when some sequence is shorter.
    A few torch calls per batch, none per sample: every call releases and retakes the GIL, which
    the thread launching the forward shares."""
    lens = [int(x.shape[0]) for x in seqs]
    input_ids = pad_sequence(list(seqs), batch_first=True).to(device, non_blocking=non_blocking)
    return input_ids, padding_mask(lens, device, non_blocking)


def reset_length_dependent_rope(model) -> None:
    """Put every dynamic-NTK rotary embedding of an HF ``model`` back on its original tables (HF
    grows them with the longest length seen and keeps them until a batch is shorter than the
    original context, so a forward would depend on the batches before it)."""
    for m in model.modules():
        kinds = getattr(m, "rope_type", None)
        kinds = {"": kinds} if isinstance(kinds, str) else kinds if isinstance(kinds, dict) else {}
        for layer_type, kind in kinds.items():  # "": one rope; else one per layer type ("{type}_inv_freq")
            prefix = f"{layer_type}_" if layer_type else ""
            original = getattr(m, f"{prefix}original_inv_freq", None)
            if not (isinstance(kind, str) and "dynamic" in kind and isinstance(original, torch.Tensor)):
                continue
            m.register_buffer(f"{prefix}inv_freq", original.to(getattr(m, f"{prefix}inv_freq").device),
                              persistent=False)
            setattr(m, f"{prefix}max_seq_len_cached", m.original_max_seq_len)


def padding_mask(lens: Sequence[int], device: torch.device | str, non_blocking: bool = False) -> torch.Tensor | None:
    """int64 [B, max(lens)] on ``device``: 1 at the real tokens of right-padded rows of lengths
    ``lens``; None when no row is shorter."""
    t = max(lens)
    if min(lens) == t:
        return None
    return (torch.arange(t)[None, :] < torch.tensor(lens)[:, None]).long().to(device, non_blocking=non_blocking)


def _to_host(x: torch.Tensor | None, stream) -> torch.Tensor | None:
    """Launch the copy of ``x`` into pinned host memory on ``stream`` (None stays None)."""
    if x is None:
        return None
    h = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    h.copy_(x, non_blocking=True)
    x.record_stream(stream)
    return h


class PendingCapture:
    """States of one batch on their way to host memory.

    ``result()`` waits for the copy and returns per-sample :class:`Captured` whose tensors
    are views ``[T_i, 3H]`` / ``[T_i, H]`` (scales ``[T_i, G]``) of the batch's host buffers
    (padding rows dropped).
    """

    def __init__(self, keys, lens, aux, fin, event, aux_s=None, fin_s=None, ok=None):
        self.keys, self.lens, self.aux, self.fin, self.event = keys, lens, aux, fin, event
        self.aux_s, self.fin_s, self.ok = aux_s, fin_s, ok

    def result(self) -> list[Captured]:
        if self.event is not None:
            self.event.synchronize()
        split = [_rows(x, self.lens) for x in (self.aux, self.fin, self.aux_s, self.fin_s)]
        ok = [None] * len(self.keys) if self.ok is None else self.ok.tolist()
        return [Captured(k, *(None if x is None else x[i] for x in split), ok[i]) for i, k in enumerate(self.keys)]


def _rows(x: torch.Tensor | None, lens: list[int]) -> list[torch.Tensor] | None:
    """The views ``[T_i, ...]`` of each sample's rows of a right-padded batch ``x`` [B, T, ...], in
    one torch call (the rows of all samples, padding between them, split in order)."""
    if x is None:
        return None
    b, t = x.shape[:2]
    sizes = [m for n in lens for m in (n, t - n)]
    return list(x.reshape(b * t, *x.shape[2:]).split(sizes)[::2])
