"""The drafter factory: draft vocabulary + target tensors -> an :class:`Eagle3Drafter` and the
frozen target head the loss reads; and the check that training data comes from that target.

:func:`load_draft_vocab` finds ``d2t``/``t2d`` (built from the dataset, or a file);
:func:`make_drafter` reads the target's ``embed_tokens``/``lm_head``/``norm`` and builds the
drafter under its own seed; :class:`TargetCheck` holds data facts to the target (vocabulary
size, weights fingerprint). The Lightning module (:mod:`eagle_train.module`) only wires them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

from eagle_train.model import DraftConfig, Eagle3Drafter, load_target_tensors, read_target_config, resolve_model_path
from eagle_train.options import DrafterOptions
from eagle_train.vocab import build_vocab, load_vocab

#: the target tensors the drafter and the loss read
TARGET_TENSORS = ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")


class DraftVocab(NamedTuple):
    """``d2t`` int64 [N], ``t2d`` bool [V] (:mod:`eagle_train.vocab`), and where they came from
    (named in errors)."""

    d2t: torch.Tensor
    t2d: torch.Tensor
    source: str


def load_draft_vocab(dataset_dir: Optional[str], path: Optional[str], size: int, exclude_keys: list[str]) -> DraftVocab:
    """The draft vocabulary: built from ``dataset_dir`` (written to ``path`` when given; an
    existing ``path`` is reused only if built from exactly that data, size and held-out keys:
    :func:`eagle_train.vocab.build_vocab`), else the existing file ``path`` as it is.

    Raises:
        ValueError: neither is given, the file holds another size, or build_vocab refuses."""
    if dataset_dir:
        d2t, t2d, _ = build_vocab(dataset_dir, size, out=path, exclude_keys=exclude_keys)
        return DraftVocab(d2t, t2d, f"the one of {dataset_dir}")
    if path and Path(path).exists():
        d2t, t2d = load_vocab(path)
        if int(d2t.numel()) != int(size):
            raise ValueError(f"draft_vocab {path} holds {d2t.numel()} tokens, draft_vocab_size is "
                             f"{size}: give the matching size or another file")
        return DraftVocab(d2t, t2d, path)
    raise ValueError("give draft_vocab (an existing d2t/t2d file) or dataset_dir to build one")


def manifest_aux_layer_ids(dataset_dir: Optional[str]) -> Optional[list[int]]:
    """The aux layer ids ``dataset_dir``'s manifest records (None without a dataset)."""
    if not dataset_dir:
        return None
    from eagle_data.format.records import read_manifest

    return list(read_manifest(dataset_dir)["aux_layer_ids"])


@dataclass
class DrafterParts:
    """What :func:`make_drafter` builds: the trainable ``drafter``, the target's frozen
    ``lm_head`` [V, H] fp32 (the loss's teacher head) and its ``config.json`` as a dict."""

    drafter: Eagle3Drafter
    target_lm_head: torch.Tensor
    target_config: dict[str, Any]


def make_drafter(target_model_path: str, vocab: DraftVocab, options: DrafterOptions,
                 zero_features: bool = False) -> DrafterParts:
    """An :class:`Eagle3Drafter` sized from the target's config, holding the target's frozen
    embedding, initialised under ``options.seed`` (the global RNG is untouched); with
    ``options.init_lm_head_from_target`` its head starts as the target head's draft-vocab rows and
    its norm as the target's final norm.

    Raises:
        ValueError: the vocabulary maps another target vocabulary size than the target's head."""
    tcfg = read_target_config(target_model_path)
    w = load_target_tensors(target_model_path, list(TARGET_TENSORS))
    head = w["lm_head.weight"]
    if int(vocab.t2d.numel()) != int(head.shape[0]):
        raise ValueError(f"draft vocabulary ({vocab.source}) maps a target vocabulary of {vocab.t2d.numel()} tokens; "
                         f"the target {target_model_path} (target_model_path) has {head.shape[0]}: the data "
                         "or the vocabulary file comes from another model")
    cfg = DraftConfig.from_target(tcfg, draft_vocab_size=int(vocab.d2t.numel()))
    with torch.random.fork_rng():
        torch.manual_seed(options.seed)
        init = head[vocab.t2d].float() if options.init_lm_head_from_target else None
        drafter = Eagle3Drafter(cfg, w["model.embed_tokens.weight"].float(), vocab.d2t, vocab.t2d, init)
        if options.init_lm_head_from_target:  # the head expects the target's final-norm scale
            with torch.no_grad():
                drafter.norm.weight.copy_(w["model.norm.weight"].float())
    drafter.zero_features = bool(zero_features)
    drafter.compile_layer = bool(options.compile_layer)
    return DrafterParts(drafter, head.float(), tcfg)


class TargetCheck:
    """Training data must come from the target: its vocabulary size, and (``fingerprint``) the
    fingerprint of its weights (:func:`eagle_data.format.fingerprint.weights_fingerprint`, read
    once): another model's final states under this target's ``lm_head`` are a wrong teacher."""

    def __init__(self, target_model_path: str, vocab_size: int, fingerprint: bool = True):
        self.target_model_path, self.vocab_size, self.fingerprint = target_model_path, int(vocab_size), fingerprint
        self._mine: Optional[str] = None

    def __call__(self, facts: dict[str, Any], where: str) -> None:
        """Hold ``facts`` (a manifest's ``vocab_size`` and ``weights_fingerprint``) of ``where`` to the target.

        Raises:
            ValueError: naming the data and both values."""
        if facts.get("vocab_size") is not None and int(facts["vocab_size"]) != self.vocab_size:
            raise ValueError(f"{where}: extracted by a model with vocab_size {facts['vocab_size']}, the target "
                             f"{self.target_model_path} (target_model_path) has {self.vocab_size}: give the target "
                             "that extracted the data")
        theirs = facts.get("weights_fingerprint")
        if not self.fingerprint or theirs in (None, "n/a"):
            return
        from eagle_data.format.fingerprint import weights_fingerprint

        if self._mine is None:  # read once (first/last MiB of each weight file)
            self._mine = weights_fingerprint(resolve_model_path(self.target_model_path))
        if self._mine != theirs:
            raise ValueError(f"{where}: extracted from other weights than the target "
                             f"{self.target_model_path} (target_model_path; weights_fingerprint {theirs} "
                             f"vs {self._mine}): this target's lm_head on those final states is a wrong teacher. "
                             "Give the target that extracted the data, or --model.drafter.check_target false when "
                             "it is the same weights in other files (the fingerprint covers the weight files and "
                             "config.json)")
