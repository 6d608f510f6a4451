"""Lightning module of EAGLE-3 drafter training (``LightningCLI``: ``configs/train/*.yaml``).

Batches come from :class:`eagle_data.stream.datamodule.EagleDataModule`
(:class:`eagle_data.stream.collate.Batch`). Loss: :func:`eagle_train.loss.ttt_loss`.

The module wires small parts: the drafter factory (:mod:`eagle_train.factory`: vocabulary,
target tensors, the data's target check), the guards (:mod:`eagle_train.guard`: damaged rows,
untaught steps), the held-out keys (:mod:`eagle_train.heldout`), the lr schedule and training
clock (:mod:`eagle_train.schedule`), the compile warm-up (:mod:`eagle_train.warmup`) and the
checkpoint loader (:mod:`eagle_train.checkpoint`); it keeps the steps, the optimizer and the
logging.

Precision: parameters fp32; ``trainer.precision: bf16-mixed`` on GPU autocasts the matmuls
(attention softmax and the loss stay fp32). Distributed: ``trainer.strategy: ddp`` or
``fsdp`` (Lightning). Checkpoints hold the trainable drafter and ``d2t``/``t2d``; the frozen
target ``embed_tokens``/``lm_head`` are re-read from ``target_model_path`` on construction.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from eagle_train.factory import DraftVocab, TargetCheck, load_draft_vocab, make_drafter, manifest_aux_layer_ids
from eagle_train.guard import UntaughtSteps, keep_rows
from eagle_train.heldout import HeldOutKeys
from eagle_train.loss import ttt_loss
from eagle_train.options import DrafterOptions, LossOptions, OptimOptions, as_options
from eagle_train.schedule import TrainingClock, adamw_with_schedule, check_schedule_minutes, schedule_progress
from eagle_train.warmup import unsharded, warm_up_compiles

log = logging.getLogger(__name__)


class EagleDrafterModule(pl.LightningModule):
    """EAGLE-3 drafter + frozen target embedding/head, trained with the unrolled TTT loss.

    Args:
        target_model_path: HF folder of the target (config.json + safetensors).
        draft_vocab: safetensors file with ``d2t``/``t2d``; with ``dataset_dir`` it is built from
            that data and written there, or, when it exists, reused only if it records being built
            from exactly that data, size and held-out keys (else refused: see
            :func:`eagle_train.vocab.build_vocab`); without ``dataset_dir`` an existing file is
            used as it is. None: built in memory (the checkpoint keeps it; nothing is written into
            the dataset directory).
        dataset_dir: dataset directory (index histogram for the vocabulary, manifest facts).
        draft_vocab_size: N.
        exclude_keys: JSON file with a list of sample keys to drop from training batches
            (a held-out split living in the same shards); a vocabulary built here from
            ``dataset_dir`` does not count them either.
        zero_features: control run: the target's aux states are replaced by zeros (in training
            and when the checkpoint is evaluated), so the drafter sees only tokens; it measures
            what the states contribute. Such a checkpoint is refused by ``export``.
        lr: AdamW's peak learning rate (the schedule: ``optim``).
        lr_schedule_minutes: run the cosine over this much wall-clock training time (from the first
            training batch; a resumed run continues the clock of its checkpoint) instead of
            ``trainer.max_steps``: for fixed-time budgets (``TimedCheckpoints``). With neither
            steps nor this known (``max_time`` only), the lr stays constant after warm-up.
        drafter: how the drafter is built and run (aux layer ids, seed, head init, target check,
            compiles): :class:`eagle_train.options.DrafterOptions`.
        loss: the TTT loss (steps K, step weight, out-of-vocabulary rows):
            :class:`eagle_train.options.LossOptions`.
        optim: AdamW and its schedule (weight decay, warm-up, cosine floor, betas):
            :class:`eagle_train.options.OptimOptions`.
    """

    def __init__(self, target_model_path: str, draft_vocab: Optional[str] = None, dataset_dir: Optional[str] = None,
                 draft_vocab_size: int = 32000, exclude_keys: Optional[str] = None, zero_features: bool = False,
                 lr: float = 1e-4, lr_schedule_minutes: Optional[float] = None,
                 drafter: DrafterOptions = DrafterOptions(), loss: LossOptions = LossOptions(),
                 optim: OptimOptions = OptimOptions(), _vocab: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        super().__init__()
        self.save_hyperparameters(ignore=["_vocab"])
        check_schedule_minutes(lr_schedule_minutes)
        self.drafter_options = as_options(DrafterOptions, drafter)
        self.loss_options = as_options(LossOptions, loss)
        self.optim_options = as_options(OptimOptions, optim)
        self.held_out = HeldOutKeys(exclude_keys)
        vocab = (DraftVocab(*_vocab, source="the checkpoint's") if _vocab is not None  # load_from_checkpoint
                 else load_draft_vocab(dataset_dir, draft_vocab, draft_vocab_size, sorted(self.held_out.keys)))
        parts = make_drafter(target_model_path, vocab, self.drafter_options, zero_features)
        self.drafter, self.target_config = parts.drafter, parts.target_config
        self.register_buffer("target_lm_head", parts.target_lm_head, persistent=False)
        ids = self.drafter_options.aux_layer_ids
        self.aux_layer_ids = ids if ids is not None else manifest_aux_layer_ids(dataset_dir)
        for name, opts in (("drafter", self.drafter_options), ("loss", self.loss_options),
                           ("optim", self.optim_options)):  # plain dicts: checkpoints load with weights_only
            self.hparams[name] = asdict(opts)
        self.hparams["drafter"]["aux_layer_ids"] = self.aux_layer_ids  # in the checkpoint: export/eval need no dataset
        self.target_check = TargetCheck(target_model_path, int(parts.target_lm_head.shape[0]),
                                        self.drafter_options.check_target)
        self.bad_samples = 0  # damaged samples this process dropped from its batches (see _filter)
        self.untaught = UntaughtSteps()  # steps that taught nothing on any rank: no update (see optimizer_step)
        self.clock = TrainingClock()
        self._warned_unsupervised = False

    # ------------------------------------------------------------------ steps
    def ttt_loss(self, batch: dict[str, Any]) -> dict[str, Any]:
        """:func:`eagle_train.loss.ttt_loss` of ``batch`` under this module's loss options."""
        o = self.loss_options
        return ttt_loss(self.drafter, self.target_lm_head, batch, o.ttt_steps, o.step_weight, o.exclude_oov)

    def _filter(self, batch: dict[str, Any], exclude: bool = True) -> tuple[Optional[dict[str, Any]], int]:
        """The batch without held-out keys (``exclude_keys``; when ``exclude``) and without damaged
        samples (:func:`eagle_train.guard.keep_rows`: logged with their keys, counted in
        :attr:`bad_samples`), None when no row is left; and its supervised tokens."""
        vocab = int(self.target_lm_head.shape[0])
        out, supervised, named = keep_rows(batch, vocab, self.held_out if exclude else ())
        if named:
            self.bad_samples += len(named)
            log.error("skipped %d sample(s) with a token id outside the target's vocabulary (%d) or non-finite "
                      "states: %s (damaged shards or another model's data: run `eagle-data verify` on the "
                      "dataset); %d skipped so far", len(named), vocab, ", ".join(map(str, named[:8])),
                      self.bad_samples)
        return out, supervised

    def _shared(self, batch: dict[str, Any], stage: str, supervised: int):
        """The loss of a batch, logged: metrics are averaged over batches weighted by their
        supervised tokens — in training ``supervised`` (the loss-mask count read before the step,
        no extra host wait), in validation the rows each step's loss really scores (``n_k``: also
        without the positions no step reaches and, with ``exclude_oov``, the out-of-vocabulary
        teachers). A training batch that teaches nothing (samples cut by data.max_length before
        their first assistant token) is not logged; validation logs it with weight 0 (every rank
        must log each metric under sync_dist): it moves no average, and an epoch with nothing
        supervised reads NaN, not 0."""
        out = self.ttt_loss(batch)
        on_step = stage == "train"
        weights = [supervised] * len(out["n_k"]) if on_step else torch.stack(out["n_k"]).tolist()
        if weights[0] == 0:
            if not self._warned_unsupervised:
                self._warned_unsupervised = True
                log.warning("a %s batch has no supervised token (its samples were cut by data.max_length before "
                            "their first assistant token, or have none): it teaches nothing", stage)
            if on_step:
                return out["loss"]
        self._log_metrics(stage, out["loss"], out["loss_k"], out["acc_k"], weights)
        return out["loss"]

    def _log_metrics(self, stage: str, loss, loss_k: list, acc_k: list, weights: list[int]) -> None:
        """``{stage}/loss`` (weight ``weights[0]``), ``acc_k`` and ``loss_k`` (weight ``weights[k]``)."""
        on_step = stage == "train"
        self.log(f"{stage}/loss", loss, prog_bar=True, batch_size=weights[0], on_step=on_step, on_epoch=True,
                 sync_dist=not on_step)
        for k, (lk, ak) in enumerate(zip(loss_k, acc_k)):
            self.log(f"{stage}/acc_{k}", ak, prog_bar=(k == 0), batch_size=weights[k], on_step=on_step,
                     on_epoch=True, sync_dist=not on_step)
            self.log(f"{stage}/loss_{k}", lk, batch_size=weights[k], on_step=on_step, on_epoch=True,
                     sync_dist=not on_step)

    def training_step(self, batch, batch_idx):
        batch, supervised = self._filter(batch)
        self.untaught.saw(batch is not None and supervised > 0)  # over accumulated micro-batches
        if batch is None:  # whole batch held out: a zero loss keeps DDP ranks in step
            return sum(p.sum() * 0.0 for p in self.drafter.parameters())
        return self._shared(batch, "train", supervised)

    @property
    def skipped_steps(self) -> int:
        """Steps that taught nothing on any rank: no update (Lightning's ``global_step`` still counts them)."""
        return self.untaught.count

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        """The update, unless the step taught nothing on every rank (:class:`eagle_train.guard.UntaughtSteps`).
        Forward and backward run either way (DDP ranks stay in step); the lr schedule does not
        advance over a skipped step."""
        result = optimizer_closure()
        if self.untaught.end_step(self._sum_over_ranks):
            if self.untaught.count == 1:
                log.info("note: a training step had nothing to teach (its batch was held out, or no sample kept a "
                         "supervised token within data.max_length); no update, as intended (counted in skipped_steps)")
            return
        optimizer.step(closure=lambda: result)

    def _sum_over_ranks(self, value: float) -> float:
        """``value`` summed over the DDP ranks (one process: itself, a host float, no device sync)."""
        if self.trainer.world_size <= 1:
            return value
        return float(self.trainer.strategy.reduce(torch.tensor(value, device=self.device), reduce_op="sum"))

    def lr_scheduler_step(self, scheduler, metric) -> None:
        """The schedule advances with the updates, not over a step :meth:`optimizer_step` skipped."""
        if self.untaught.skipped:
            return
        scheduler.step() if metric is None else scheduler.step(metric)

    def validation_step(self, batch, batch_idx):
        batch, supervised = self._filter(batch, exclude=False)  # the held-out keys are what validation may read
        if batch is None:  # every row damaged: weight-0 metrics, so that every DDP rank logs the same ones
            zero = torch.zeros((), device=self.device)
            k = self.loss_options.ttt_steps
            self._log_metrics("val", zero, [zero] * k, [zero] * k, [0] * k)
            return None
        return self._shared(batch, "val", supervised)

    # ------------------------------------------------------------------ optim
    def configure_optimizers(self):
        tr, o = self.trainer, self.optim_options
        total = tr.max_steps if tr.max_steps and tr.max_steps > 0 else tr.estimated_stepping_batches
        progress = schedule_progress(self.clock, self.hparams.lr_schedule_minutes, total, o.warmup_steps)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        return adamw_with_schedule(params, self.hparams.lr, o, progress)

    def setup(self, stage: str) -> None:
        """Hold the data module (:meth:`~eagle_data.stream.datamodule.EagleDataModule.hold_to`)
        to this drafter's facts: every manifest must have the target's hidden size and the
        drafter's aux layer ids (the export tells the server which layers to capture), and come
        from the target (:class:`eagle_train.factory.TargetCheck`); a module built without
        ``aux_layer_ids`` or ``dataset_dir`` takes them from the training data and records them.

        Raises:
            ValueError: the data module expects, or a manifest has, other facts."""
        if self.drafter.compile_layer and not unsharded(self.trainer.strategy):
            self.drafter.compile_layer = False  # a compiled region would see sharded parameters
            log.info("compile_layer off under %s", type(self.trainer.strategy).__name__)
        dm = getattr(self.trainer, "datamodule", None)
        if not callable(getattr(dm, "hold_to", None)):
            return
        ids = dm.hold_to(int(self.target_config["hidden_size"]), self.aux_layer_ids)
        if self.aux_layer_ids is None:
            self.aux_layer_ids = ids
            self.hparams["drafter"]["aux_layer_ids"] = ids
        loaders = [dm.train_dataloader()] + ([dm.val_dataloader()] if getattr(dm, "val_sources", None) else [])
        for loader in loaders:
            for where, fingerprint in loader.dataset.fingerprints.items():
                self.target_check({**loader.dataset.facts, "weights_fingerprint": fingerprint}, where)

    def on_train_start(self) -> None:
        pb = self.trainer.progress_bar_callback  # "Epoch 0/-2" when only time or steps bound the run
        if (self.trainer.max_epochs or 0) < 0 and hasattr(pb, "_get_train_description"):
            pb._get_train_description = lambda current_epoch: f"Epoch {current_epoch}"
        if self.drafter_options.compile_warmup and self.device.type == "cuda":
            if unsharded(self.trainer.strategy):
                self.warm_up_compiles()
            else:  # sharded strategies (FSDP, DeepSpeed) gather parameters in their own forward only
                log.info("compile warm-up skipped under %s", type(self.trainer.strategy).__name__)

    def warm_up_compiles(self) -> float:
        """:func:`eagle_train.warmup.warm_up_compiles` of this module: seconds spent."""
        return warm_up_compiles(self)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.clock.start()

    def training_seconds(self) -> float:
        """Wall-clock training time so far, across resumes (saved in checkpoints)."""
        return self.clock.seconds()

    # ------------------------------------------------------------------ checkpoints
    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | Path, map_location: Any = None, **kwargs: Any):
        """Lightning's loader, self-contained and safe (:func:`eagle_train.checkpoint.load_module`):
        ``d2t``/``t2d`` come from the checkpoint itself; loads with ``weights_only=True``.

        Raises:
            ValueError: the path does not exist, is not a torch checkpoint file, or is not a
                checkpoint of this module (no ``drafter.d2t``/``t2d``); names the path.
        """
        from eagle_train.checkpoint import load_module

        return load_module(cls, checkpoint_path, map_location, **kwargs)

    def untrained_drafter(self):
        """This drafter at initialisation (same seed, vocabulary and target; never trained)."""
        vocab = DraftVocab(self.drafter.d2t, self.drafter.t2d, "this drafter's")
        return make_drafter(self.hparams.target_model_path, vocab, self.drafter_options,
                            self.drafter.zero_features).drafter

    @property
    def excluded_keys(self) -> Optional[list[str]]:
        """The sample keys this drafter's training left out (sorted; ``[]``: none), as recorded in
        its checkpoint (not re-read from the ``exclude_keys`` file, which may have changed since);
        None for a checkpoint written before they were recorded."""
        return self.held_out.recorded

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["eagle"] = {"draft_config": self.drafter.cfg.to_dict(), "aux_layer_ids": self.aux_layer_ids,
                               "training_seconds": self.training_seconds(), "excluded_keys": self.excluded_keys}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the training clock and the held-out keys the checkpoint records.

        Raises:
            ValueError: a module given ``exclude_keys`` (a resumed training) whose keys differ from
                the recorded ones (:meth:`eagle_train.heldout.HeldOutKeys.restore`)."""
        eagle = checkpoint.get("eagle") or {}
        self.clock.before = float(eagle.get("training_seconds", 0.0))
        self.held_out.restore(eagle.get("excluded_keys"))  # None: written before the keys were recorded
