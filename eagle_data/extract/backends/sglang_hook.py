"""Capture hook that runs INSIDE the SGLang scheduler process (sglang 0.5.23).

Registered through the ``forward_hooks`` server argument (see
``sglang/srt/model_executor/hook_manager.py``)::

    {"name": "eagle_data_capture", "target_modules": ["logits_processor"],
     "hook_factory": "eagle_data.extract.backends.sglang_hook:make_capture_hook",
     "config": {"spool_dir": "...", "rid_prefix": "..."}}

``register_forward_hooks`` calls :func:`make_capture_hook` with ``config`` once per
scheduler (TP rank) and registers the returned function as a forward hook on the model's
``logits_processor``. Llama-family models call it as
``logits_processor(input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states)``:

* ``input_ids``: [N] the tokens of this forward pass, requests concatenated;
* ``hidden_states``: [N, H] final hidden state AFTER the final norm (what ``lm_head`` eats);
* ``aux_hidden_states``: a list of K [N, H] tensors or one packed [N, K*H] tensor, the
  inputs of layers ``k + 1`` for ``k`` in ``return_aux_hidden_state_layer_ids`` (= outputs of
  decoder layers ``k`` = HF ``hidden_states[k + 1]``; ``set_eagle3_layers_to_capture``).
  With aux capture on, SGLang's own return path carries the aux states *instead of* the
  final state; the hook gets both from its arguments.

What it writes: for every request whose rid starts with ``rid_prefix`` in a plain
``ForwardMode.EXTEND`` pass, one chunk file (:func:`eagle_data.extract.backends.sglang_spool.write_piece`)
with that request's rows ``[extend_prefix_len, extend_prefix_len + extend_seq_len)``.
Rows are located with ``forward_batch.rids``, ``extend_seq_lens_cpu`` and
``extend_prefix_lens_cpu``. DECODE and IDLE passes are ignored (with ``max_new_tokens=0`` they
do not occur). Any other extend-like mode that contains one of our requests (MIXED,
SPLIT_PREFILL, TARGET_VERIFY, DRAFT_EXTEND, DLLM_EXTEND, ...) or an inconsistent batch
writes an error file for each of our rids, which the backend raises as an error naming
the sample: rows are never dropped silently.

Tensor parallel: every TP rank holds the full (all-reduced) hidden states; only TP rank 0
writes. Pipeline parallel and attention-DP are refused by the backend at start-up.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading

import torch

from eagle_data.extract.backends.sglang_spool import write_error, write_piece

log = logging.getLogger(__name__)


def _tp_rank() -> int:
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (unit use outside a scheduler)
        return 0


def _pack_aux(aux) -> torch.Tensor | None:
    if aux is None:
        return None
    if isinstance(aux, torch.Tensor):
        return aux
    aux = list(aux)
    return torch.cat(aux, dim=-1) if aux else None


def make_capture_hook(config: dict):
    """Hook factory (``forward_hooks[].hook_factory``).

    Args:
        config: ``{"spool_dir": str, "rid_prefix": str}``; ``rid_prefix`` selects the
            requests to capture (others, e.g. warm-up requests, are skipped).

    Returns:
        ``hook(module, args, output)``, or ``None`` on TP ranks other than 0 (SGLang then
        registers nothing on that rank).
    """
    spool = config["spool_dir"]
    prefix = config.get("rid_prefix", "")
    if _tp_rank() != 0:
        return None
    seq = itertools.count()
    lock = threading.Lock()

    def next_seq() -> int:
        with lock:
            return next(seq)

    def hook(module, args, output):
        try:
            return _capture(args)
        except Exception as e:  # e.g. spool full: report it per request instead of killing the scheduler
            rids = getattr(args[3], "rids", None) if len(args) > 3 else None
            ours = [r for r in (rids or []) if isinstance(r, str) and r.startswith(prefix)]
            try:
                for r in ours:
                    write_error(spool, r, next_seq(), f"capture hook failed: {e!r}")
            except Exception:
                raise e
            log.exception("eagle-data capture hook failed")
            return None

    def _capture(args):
        if len(args) < 4:
            return None
        input_ids, hidden, fb = args[0], args[1], args[3]
        aux = args[4] if len(args) > 4 else None
        rids = list(getattr(fb, "rids", None) or [])
        ours = [r for r in rids if isinstance(r, str) and r.startswith(prefix)]
        if not ours:
            return None
        mode = fb.forward_mode
        if mode.is_decode() or mode.is_idle():
            return None

        def refuse(msg: str):
            for r in ours:
                write_error(spool, r, next_seq(), msg)

        if mode.name != "EXTEND":
            return refuse(f"forward mode {mode.name} is not a plain prefill (EXTEND); "
                          f"mixed chunking / speculative modes are not supported")
        aux_t = _pack_aux(aux)
        if aux_t is None:
            return refuse("no aux hidden states reached the logits processor "
                          "(enable_return_aux_hidden_states is off or the model does not support it)")
        seqs, pres = fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        n_tok = int(hidden.shape[0])
        if (seqs is None or pres is None or len(seqs) != len(rids) or len(pres) != len(rids)
                or sum(int(s) for s in seqs) != n_tok or aux_t.shape[0] != n_tok
                or input_ids.shape[0] != n_tok):
            return refuse(f"inconsistent batch: {len(rids)} rids, extend_seq_lens {seqs}, "
                          f"prefix_lens {pres}, {n_tok} hidden rows, {aux_t.shape[0]} aux rows, "
                          f"{input_ids.shape[0]} input ids")
        if hidden.device.type != "cpu":  # one device->host copy per tensor for the whole pass
            input_ids, hidden, aux_t = input_ids.cpu(), hidden.cpu(), aux_t.cpu()
        start = 0
        for rid, n, off in zip(rids, seqs, pres):
            n, off = int(n), int(off)
            if isinstance(rid, str) and rid.startswith(prefix) and n > 0:
                sl = slice(start, start + n)
                write_piece(spool, rid, off, next_seq(), input_ids[sl], aux_t[sl], hidden[sl])
            start += n
        return None

    log.info("eagle-data capture hook active in pid %d, spool %s", os.getpid(), spool)
    return hook
