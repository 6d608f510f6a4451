"""The extraction stages from conversations on, each an iterator in and an iterator out.

``Conversation -> tokenize -> check_vocab -> token_budget_batches -> capture -> to_samples -> sink``
(records -> conversations are :mod:`sources`, :mod:`conversations`; the render, tokens and mask of
one conversation are :mod:`chat`; :func:`front` chains them up to the batches). A stage that drops an item reports it
to the :class:`ErrorPolicy` (counted by reason, logged, recorded in the skip log); nothing is
dropped silently.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from eagle_data.engines.base import Backend, Captured
from eagle_data.extract.chat import ChatRenderer, Encoded, TokenizedSample
from eagle_data.extract.conversations import Conversation, normalize
from eagle_data.extract.fault import ErrorPolicy, Skip
from eagle_data.extract.mask import MaskError
from eagle_data.extract.signals import Signals
from eagle_data.format.final_rows import select as select_taught
from eagle_data.format.fp8 import FP8_DTYPE, scale_name, to_storage
from eagle_data.format.schema import sample_key
from eagle_data.packing import pack_window


@dataclass(frozen=True)
class Batching:
    """How :func:`front` cuts and batches samples: the settings of the same names of
    :class:`~eagle_data.extract.config.ExtractConfig` (documented there)."""

    max_length: int
    batch_tokens: int
    max_batch_size: int
    sort_window: int


def front(records: Iterable[tuple[int, Any]], renderer: ChatRenderer, tag: str, vocab_size: int, batching: Batching,
          policy: ErrorPolicy) -> Iterator[list[TokenizedSample]]:
    """Source rows ``(row, record)`` -> batches for the engine: normalise, render + tokenise + mask
    (:func:`tokenize`), :func:`check_vocab`, :func:`token_budget_batches`."""
    b = batching
    samples = check_vocab(tokenize(normalize(records, policy), renderer, tag, b.max_length, policy), vocab_size, policy)
    return token_budget_batches(samples, b.batch_tokens, b.max_batch_size, b.sort_window)


#: conversations rendered, then tokenised in one call, at a time by :func:`tokenize`
ENCODE_GROUP = 64
#: kept-but-changed reasons of :meth:`ChatRenderer.encode` and what each means
NOTES = {"final_reasoning_not_rendered": "the template does not render the last turn's reasoning",
         "tools_not_rendered": "the record's tool schemas ('tools') are not rendered by the template",
         "turn_start_at_first_field": "a turn after a tool result has no header and no prompt of the template's "
                                      "own that leads to it: supervised from its first field (template text the "
                                      "turn writes before it, e.g. a call opener, is not)"}


def tokenize(convs: Iterable[Conversation], renderer: ChatRenderer, dataset_tag: str,
             max_length: int, policy: ErrorPolicy) -> Iterator[TokenizedSample]:
    """Stage: conversations -> :class:`TokenizedSample` (truncated to ``max_length``), in source
    order; :data:`ENCODE_GROUP` conversations share one tokenizer call (:meth:`ChatRenderer.encode_batch`).

    Skips (counted in ``policy``): ``template_error`` (the template raised), the
    :class:`~eagle_data.extract.mask.MaskError` reasons (``mask_unaligned``, ``message_not_rendered``,
    ``tool_calls_not_rendered``, ``special_token_in_text``), ``no_loss_tokens`` (nothing
    supervised after truncation). Notes (:data:`NOTES`): ``final_reasoning_not_rendered``,
    ``tools_not_rendered``, ``turn_start_at_first_field``, ``truncated``.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    it = iter(convs)
    while group := list(islice(it, ENCODE_GROUP)):
        for c, enc in zip(group, renderer.encode_batch([c.messages for c in group], [c.tools for c in group])):
            if isinstance(enc, MaskError):
                policy.handle(Skip(c.row, c.source_id, enc.reason, str(enc) + _in_record(c, enc.message)))
                continue
            if isinstance(enc, Exception):  # jinja2 TemplateError / raise_exception from the template
                policy.handle(Skip(c.row, c.source_id, "template_error", f"{type(enc).__name__}: {enc}"))
                continue
            if (s := _sample(c, enc, dataset_tag, max_length, policy)) is not None:
                yield s


def _in_record(c: Conversation, message: int | None) -> str:
    """Where the message a skip names is in the user's record: the template's messages leave out
    dropped turns and may start with a top-level ``system`` field."""
    if message is None or message >= len(c.turn_index):
        return ""
    turn = c.turn_index[message]
    return (" (message 0 is the record's top-level 'system' field)" if turn is None else
            f" (message {message} of the conversation handed to the template is the record's turn {turn}, 0-based)")


def _sample(c: Conversation, enc: Encoded, dataset_tag: str, max_length: int, policy: ErrorPolicy
            ) -> TokenizedSample | None:
    """The sample of one encoded conversation, truncated; None (skipped) when nothing is supervised."""
    ids, mask = enc.input_ids, enc.loss_mask
    for n in enc.notes:
        policy.note(Skip(c.row, c.source_id, n, NOTES[n]))
    truncated = ids.shape[0] > max_length
    ids, mask = ids[:max_length], mask[:max_length]
    if int(mask.sum()) == 0:
        why = (" after truncation" if truncated else
               ": every assistant turn is marked not to train (weight 0 / train false)"
               if all(not m.get("train", True) for m in c.messages if m["role"] == "assistant") else "")
        policy.handle(Skip(c.row, c.source_id, "no_loss_tokens", f"{ids.shape[0]} tokens, none supervised{why}"))
        return None
    if truncated:
        policy.note(Skip(c.row, c.source_id, "truncated",
                         f"{enc.input_ids.shape[0]} tokens cut to max_length {max_length}: "
                         f"{int(enc.loss_mask[max_length:].sum())} supervised tokens dropped"))
    return TokenizedSample(sample_key(dataset_tag, c.row), c.row, c.source_id, len(c.messages),
                           ids.contiguous(), mask.contiguous(), truncated)


def check_vocab(samples: Iterable[TokenizedSample], vocab_size: int, policy: ErrorPolicy
                ) -> Iterator[TokenizedSample]:
    """Skip (``token_id_out_of_range``) samples the model cannot embed."""
    for s in samples:
        top = int(s.input_ids.max()) if s.num_tokens else -1
        if top >= vocab_size or (s.num_tokens and int(s.input_ids.min()) < 0):
            policy.handle(Skip(s.row, s.source_id, "token_id_out_of_range",
                               f"token id {top} outside the model's vocabulary of {vocab_size}"))
            continue
        yield s


def token_budget_batches(samples: Iterable[TokenizedSample], batch_tokens: int, max_batch_size: int,
                         window: int) -> Iterator[list[TokenizedSample]]:
    """Batches of at most ``batch_tokens`` padded tokens (``B * max(T_i)``) and ``max_batch_size``
    samples, sorted by length inside windows of ``window`` samples to limit padding
    (:func:`eagle_data.packing.pack_window`). A sample longer than ``batch_tokens`` forms a batch alone."""
    buf: list[TokenizedSample] = []

    def flush() -> Iterator[list[TokenizedSample]]:
        for idx in pack_window(range(len(buf)), [s.num_tokens for s in buf], batch_tokens, max_batch_size):
            yield [buf[i] for i in idx]

    for s in samples:
        buf.append(s)
        if len(buf) >= window:
            yield from flush()
            buf = []
    if buf:
        yield from flush()


def capture(batches: Iterable[list[TokenizedSample]], backend: Backend, sigs: Signals
            ) -> Iterator[tuple[list[TokenizedSample], list[Captured]]]:
    """``(batch, its captured states)`` in order, through :meth:`Backend.capture_iter` (the next
    batch computes while this one is written). Interruptible while waiting for the backend."""
    fifo: deque[list[TokenizedSample]] = deque()

    def items() -> Iterator[list[tuple[str, torch.Tensor]]]:
        for b in batches:
            fifo.append(b)
            yield [(s.key, s.input_ids) for s in b]

    it = backend.capture_iter(items(), prefetch=1)
    while True:
        with sigs.interruptible():
            caps = next(it, None)
        if caps is None:
            return
        yield fifo.popleft(), caps


@dataclass
class Sample:
    """One extracted sample, ready for a shard.

    Attributes:
        key: sample key (``TAG_ROW``).
        tensors: ``input_ids`` [T] int64, ``loss_mask`` [T] uint8, ``aux_hidden_states`` [T, 3H]
            and ``hidden_states`` [T, H] in the storage dtype (fp8: plus ``*_scale`` [T, G]).
        meta: the ``KEY.json`` metadata (index columns).
    """
    key: str
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]


def store(x: torch.Tensor, dtype: torch.dtype, groups: int, name: str) -> dict[str, torch.Tensor]:
    """``{name: x}`` cast to ``dtype``; float8_e4m3fn: the fp8 values and ``name + "_scale"``
    [T, groups] (:func:`eagle_data.format.fp8.quantize`, ``x`` known finite)."""
    values, scale = to_storage(x, dtype, groups)
    return {name: values} if scale is None else {name: values, scale_name(name): scale}


def _stored_states(c: Captured, storage: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The hidden-state tensors of a sample in the storage dtypes (fp8 with scales; a backend may
    have cast or quantised on its device already, and checked finiteness there), or None when a
    state is not finite (in the captured dtype, after the cast, or a non-finite fp8 scale)."""
    if c.finite is False:
        return None
    out: dict[str, torch.Tensor] = {}
    groups = c.aux_hidden_states.shape[1] // max(1, c.hidden_states.shape[1])
    for name, x, sc, dtype, g in (("aux_hidden_states", c.aux_hidden_states, c.aux_scale, storage[0], groups),
                                  ("hidden_states", c.hidden_states, c.hidden_scale, storage[1], 1)):
        if sc is not None:  # quantised by the backend
            if x.dtype != dtype:
                _mismatch(name, x.dtype, dtype)
            if c.finite is None and not torch.isfinite(sc).all():
                return None
            out.update({name: x, scale_name(name): sc})
            continue
        if c.finite and x.dtype == dtype:  # cast and checked on the device
            out[name] = x
            continue
        cast = x.to(dtype) if dtype != FP8_DTYPE else x
        if not (torch.isfinite(x).all() and torch.isfinite(cast).all()):
            return None
        out.update(store(cast, dtype, g, name))
    return out


def _mismatch(name: str, got: torch.dtype, want: torch.dtype):
    raise RuntimeError(f"backend returned {name} as {got}, the run stores {want}")


def to_samples(captured: Iterable[tuple[list[TokenizedSample], list[Captured]]],
               storage: tuple[torch.dtype, torch.dtype], source: str, tag: str, policy: ErrorPolicy,
               final_rows: str = "all") -> Iterator[list[Sample]]:
    """Pair each tokenized sample with its states, per batch (a list, possibly empty); the aux and
    final states are stored in ``storage = (aux dtype, final dtype)`` (fp8: with scales), the final
    states at every row or (``final_rows="taught"``) only where they teach
    (:mod:`eagle_data.format.final_rows`).

    Skips (``non_finite_hidden_states``) a sample with NaN/Inf states (in the captured dtype, and
    after the cast: a value beyond the storage dtype's range).

    Raises:
        RuntimeError: the backend returned samples out of order or a row count other than the
            sample's token count (a backend bug: never written, never skipped quietly).
    """
    for batch, caps in captured:
        if [c.key for c in caps] != [s.key for s in batch]:
            raise RuntimeError(f"backend returned samples {[c.key for c in caps][:4]} for "
                               f"{[s.key for s in batch][:4]}: out of order or missing")
        out = []
        for s, c in zip(batch, caps):
            if c.hidden_states.shape[0] != s.num_tokens or c.aux_hidden_states.shape[0] != s.num_tokens:
                raise RuntimeError(f"sample {s.key}: backend returned {c.hidden_states.shape[0]} rows "
                                   f"for {s.num_tokens} tokens")
            states = _stored_states(c, storage)
            if states is None:
                policy.handle(Skip(s.row, s.source_id, "non_finite_hidden_states",
                                   f"NaN/Inf in the captured states of {s.key}"))
                continue
            meta = {"source_dataset": source, "dataset_tag": tag, "source_id": s.source_id,
                    "source_row": s.row, "num_turns": s.num_turns, "num_tokens": s.num_tokens,
                    "num_loss_tokens": int(np.count_nonzero(s.loss_mask.numpy())), "truncated": s.truncated}
            tensors = {"input_ids": s.input_ids, "loss_mask": s.loss_mask, **states}
            out.append(Sample(s.key, tensors if final_rows == "all" else select_taught(tensors), meta))
        yield out
