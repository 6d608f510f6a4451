"""The option groups of :class:`eagle_train.module.EagleDrafterModule` (``--model.<group>.<field>``).

LightningCLI (jsonargparse) turns each dataclass below into a nested group of the ``model:``
section: ``--model.loss.ttt_steps 7`` on the command line, or in a config::

    model:
      lr: 0.0003                   # the most used options stay flat (--model.lr)
      loss: {ttt_steps: 7, step_weight: 0.8, exclude_oov: false}
      optim: {warmup_steps: 20, min_lr_ratio: 0.1}

Checkpoints record each group as a plain dict (``hparams["loss"]``), so they load with
``torch.load(weights_only=True)``; :func:`nest_groups` reads the flat hyper-parameters of
checkpoints written before the groups existed.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, TypeVar


@dataclass(frozen=True)
class DrafterOptions:
    """How the drafter is built and run (:func:`eagle_train.factory.make_drafter`).

    Args:
        aux_layer_ids: the target aux layer ids the drafter reads (default: from ``dataset_dir``'s
            manifest, else from the training data at setup).
        seed: seed of the drafter's initialisation.
        init_lm_head_from_target: initialise ``lm_head`` with the target head's draft-vocab rows and
            ``norm`` with the target's final norm (a warm start; off: ``nn.Linear`` init, norm = 1).
        check_target: refuse training data extracted from other weights than ``target_model_path``
            (the manifests' ``weights_fingerprint``; the vocabulary size is always checked).
        compile_layer: on CUDA, the drafter's decoder layer runs through ``torch.compile``
            (:attr:`eagle_train.model.Eagle3Drafter.compile_layer`: fewer, fused kernels per TTT
            step; eager again if inductor fails). CPU runs are eager either way, and so are
            sharded strategies (FSDP, DeepSpeed).
        compile_warmup: on CUDA, one device or DDP, before the training clock starts (the first
            batch), run the loss forward and backward on synthetic batches of
            :func:`eagle_train.warmup.warm_up_shapes`, so that torch.compile's first compiles (flex
            attention, the fused loss, the layer) do not eat the first timed minute of a
            fixed-time run. Nothing is learnt from them. (``trainer.max_time`` counts it:
            Lightning's timer starts before it.) A compiled layer that fails there (forward or
            backward) is turned off: training runs it eagerly.
    """

    aux_layer_ids: Optional[list[int]] = None
    seed: int = 0
    init_lm_head_from_target: bool = True
    check_target: bool = True
    compile_layer: bool = True
    compile_warmup: bool = True


@dataclass(frozen=True)
class LossOptions:
    """The unrolled TTT loss (:func:`eagle_train.loss.ttt_loss`).

    Args:
        ttt_steps: K, unrolled drafter steps (EAGLE-3: 7).
        step_weight: loss weight ``w^k`` of step ``k`` (0.8).
        exclude_oov: do not supervise rows whose target argmax is outside the draft vocab.
    """

    ttt_steps: int = 7
    step_weight: float = 0.8
    exclude_oov: bool = True


@dataclass(frozen=True)
class OptimOptions:
    """AdamW and its schedule besides ``lr`` and ``lr_schedule_minutes`` (:mod:`eagle_train.schedule`):
    linear warm-up, then a cosine from ``lr`` down to ``min_lr_ratio * lr``.

    Args:
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up steps.
        min_lr_ratio: the cosine's floor, a fraction of ``lr``.
        betas: AdamW betas.
    """

    weight_decay: float = 0.0
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))  # a list from a checkpoint or a config


#: the groups by their ``--model.<group>`` name
GROUPS = {"drafter": DrafterOptions, "loss": LossOptions, "optim": OptimOptions}

T = TypeVar("T")


def as_options(cls: type[T], value: T | Mapping[str, Any] | None) -> T:
    """``value`` as a ``cls``: itself, built from a mapping (a checkpoint's hparams), or the defaults for None."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    return cls(**dict(value))


def nest_groups(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """Flat option names (``ttt_steps=2``, as checkpoints before the groups recorded them) moved
    into their group (``loss={"ttt_steps": 2}``); grouped ones and the flat options stay."""
    out = dict(hparams)
    for group, cls in GROUPS.items():
        moved = {f.name: out.pop(f.name) for f in fields(cls) if f.name in out}
        if moved:
            out[group] = {**dict(out.get(group) or {}), **moved}
    return out
