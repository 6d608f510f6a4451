"""Drafter checkpoints read safely (``weights_only=True``) and self-contained.

:func:`load_module` is :meth:`eagle_train.module.EagleDrafterModule.load_from_checkpoint`:
``d2t``/``t2d`` come from the checkpoint itself, so the draft-vocabulary file (and the dataset it
was built from) may be gone; the target folder is still read (its frozen ``embed_tokens`` and
``lm_head`` are not in the checkpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle_train.guard import check_finite_weights
from eagle_train.model import resolve_model_path
from eagle_train.options import nest_groups

if TYPE_CHECKING:
    from eagle_train.module import EagleDrafterModule


def load_checkpoint_file(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU, with a ``ValueError`` naming ``path`` for a
    missing file or one that is not a (safely loadable) torch checkpoint."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"checkpoint {p} does not exist")
    if not p.is_file():
        raise ValueError(f"checkpoint {p} is not a file (give the .ckpt file, e.g. {p}/last.ckpt)")
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle/zip/EOF errors, a KeyError from a stray byte, weights_only refusals
        first = str(e).split(". ")[0][:120]  # not torch's advice to retry with weights_only=False
        raise ValueError(f"{p}: not a checkpoint file torch can load with weights_only=True "
                         f"({type(e).__name__}: {first})") from e


def _hyper_parameters(ckpt: dict[str, Any], path: str | Path, overrides: dict[str, Any]) -> dict[str, Any]:
    """The module's arguments from the checkpoint (grouped: :func:`eagle_train.options.nest_groups`),
    with ``overrides``; without ``exclude_keys``: a loaded module filters by the keys the
    checkpoint records (:meth:`~eagle_train.module.EagleDrafterModule.on_load_checkpoint`), not by
    whatever the file holds now.

    Raises:
        ValueError: the target folder has no config.json."""
    hp = {k: v for k, v in (ckpt.get("hyper_parameters") or {}).items() if not k.startswith("_")}
    hp = nest_groups({**hp, **overrides})
    whose = "the target folder given" if "target_model_path" in overrides else "its target folder"
    if hp.get("target_model_path") and not (resolve_model_path(hp["target_model_path"]) / "config.json").is_file():
        raise ValueError(f"{path}: {whose}, {hp['target_model_path']} (target_model_path), has no "
                         "config.json (moved or deleted?): give the target's folder (--target_model)")
    hp["exclude_keys"] = None
    return hp


def load_module(cls: type["EagleDrafterModule"], checkpoint_path: str | Path, map_location: Any = None,
                **kwargs: Any) -> "EagleDrafterModule":
    """``cls`` restored from ``checkpoint_path`` (``kwargs`` override its arguments, e.g.
    ``target_model_path``), in eval mode.

    Raises:
        ValueError: the path does not exist, is not a torch checkpoint file, is not a checkpoint
            of this module (no ``drafter.d2t``/``t2d``), or its drafter does not fit the target
            or holds non-finite weights; names the path."""
    ckpt = load_checkpoint_file(checkpoint_path)
    sd = ckpt.get("state_dict", {}) if isinstance(ckpt, dict) else {}
    if "drafter.d2t" not in sd or "drafter.t2d" not in sd:
        raise ValueError(f"{checkpoint_path}: not an EagleDrafterModule checkpoint (no drafter.d2t/t2d)")
    # Built here rather than by Lightning's loader: a checkpoint written by LightningCLI carries an
    # instantiator that re-parses the arguments and would refuse the vocabulary tensors.
    hp = _hyper_parameters(ckpt, checkpoint_path, kwargs)
    mod = cls(**hp, _vocab=(sd["drafter.d2t"], sd["drafter.t2d"]))
    try:
        mod.load_state_dict(sd, strict=True)
    except RuntimeError as e:  # size mismatches: a target of another shape
        whose = "the target folder given" if "target_model_path" in kwargs else "its target folder"
        raise ValueError(f"{checkpoint_path}: its drafter does not fit {whose}, {hp.get('target_model_path')} "
                         f"({str(e).splitlines()[-1].strip()[:200]})") from None
    mod.on_load_checkpoint(ckpt)
    check_finite_weights(mod.drafter, str(checkpoint_path))
    if map_location is not None and not callable(map_location) and not isinstance(map_location, dict):
        mod.to(map_location)
    return mod.eval()
