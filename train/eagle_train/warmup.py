"""The compile warm-up before the training clock (``--model.drafter.compile_warmup``).

torch.compile's first compiles (flex attention, the fused loss, the decoder layer) take tens of
seconds; run on synthetic batches at ``on_train_start`` they no longer eat the first timed
minute of a fixed-time run. Nothing is learnt from them.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from eagle_train.module import EagleDrafterModule

log = logging.getLogger(__name__)


def unsharded(strategy: Any) -> bool:
    """One device or DDP: parameters are whole outside the strategy's forward (FSDP and DeepSpeed
    gather them in their own forward only, which the compile warm-up and a compiled layer bypass)."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    return type(strategy) in (SingleDeviceStrategy, DDPStrategy)


def warm_up_shapes(max_length: int, max_tokens: Optional[int]) -> list[tuple[int, int]]:
    """``[(B, T)]`` of :func:`warm_up_compiles`: three small shapes (static, dynamic, ``B = 1``)
    and, when ``max_tokens`` is known and larger, one batch at that token budget."""
    shapes = [(2, max(2, min(max_length, 384))), (5, max(2, min(max_length, 1000))), (1, max(2, min(max_length, 640)))]
    if max_tokens:
        t = max(2, min(max_length, 2048))
        b = max(2, max_tokens // t)
        if b * t > 5 * 1000:
            shapes.append((b, t))
    return shapes


def synthetic_batch(b: int, t: int, hidden: int, n_aux: int, vocab: int, dtype: torch.dtype,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Random tokens [B, T] and states (``aux_hidden_states`` [B, T, n_aux*H], ``hidden_states``
    [B, T, H] in ``dtype``), every position supervised; for ``B > 1`` the last row half padded."""
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    if b > 1:
        mask[-1, t // 2:] = False  # a padded row
    return {"input_ids": torch.randint(0, vocab, (b, t), device=device), "attention_mask": mask,
            "loss_mask": mask.clone(), "aux_hidden_states": torch.randn(b, t, n_aux * hidden, device=device).to(dtype),
            "hidden_states": torch.randn(b, t, hidden, device=device).to(dtype)}


def warm_up_compiles(mod: "EagleDrafterModule") -> float:
    """Loss forward + backward on synthetic batches (random tokens and states, the training
    data's batch dtype, under the trainer's precision) of shapes ``[2, t1]``, ``[5, t2]``,
    ``[1, t3]`` (t <= the data's ``max_length``): the static compile, the one dynamic in
    ``B`` and ``T``, and ``B = 1``; then ``[B4, t4]`` at the data's token budget
    (``max_tokens``): inductor specialises fusion decisions on the number of rows (seen on the
    H200: a recompile at ~9k rows for SmolLM2's drafter), and real batches are that large.
    A compiled layer that fails (forward or backward) is turned off and the batch rerun eagerly.
    Gradients are dropped; parameters, optimizer state and the global RNG are untouched.
    Returns the seconds spent (logged)."""
    t0 = time.perf_counter()
    data = getattr(getattr(mod.trainer, "train_dataloader", None), "dataset", None)
    dtype = getattr(data, "dtype", torch.bfloat16)
    longest = getattr(data, "max_length", None) or 2048
    sizes = dict(hidden=int(mod.target_config["hidden_size"]), n_aux=len(mod.aux_layer_ids or [0, 0, 0]),
                 vocab=int(mod.target_lm_head.shape[0]), dtype=dtype, device=mod.device)
    on_gpu = mod.device.type == "cuda"
    with torch.random.fork_rng(devices=[mod.device] if on_gpu else []):
        for b, t in warm_up_shapes(longest, getattr(data, "max_tokens", None)):
            batch = synthetic_batch(b, t, **sizes)
            try:
                _step(mod, batch)
            except Exception as e:  # noqa: BLE001 - inductor failures of any kind, also in the backward
                if not mod.drafter.compile_layer:
                    raise
                mod.drafter.compile_layer = False  # the eager layer: same math; a failure there is real
                log.warning("compiled decoder layer failed in the warm-up (%s: %s); training runs it eagerly",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                _step(mod, batch)
    mod.drafter.zero_grad(set_to_none=True)
    if on_gpu:
        torch.cuda.synchronize(mod.device)
    seconds = time.perf_counter() - t0
    log.info("compile warm-up: %.1f s before the training clock", seconds)
    return seconds


def _step(mod: "EagleDrafterModule", batch: dict[str, Any]) -> None:
    with mod.trainer.precision_plugin.forward_context():
        loss = mod.ttt_loss(batch)["loss"]
    loss.backward()
