"""Lightning module of EAGLE-3 drafter training (``LightningCLI``: ``configs/train/*.yaml``).

Batches come from :class:`eagle_data.stream.datamodule.EagleDataModule`
(:class:`eagle_data.stream.collate.Batch`). Loss: :func:`eagle_train.loss.ttt_loss`.

Precision: parameters fp32; ``trainer.precision: bf16-mixed`` on GPU autocasts the matmuls
(attention softmax and the loss stay fp32). Distributed: ``trainer.strategy: ddp`` or
``fsdp`` (Lightning). Checkpoints hold the trainable drafter and ``d2t``/``t2d``; the frozen
target ``embed_tokens``/``lm_head`` are re-read from ``target_model_path`` on construction.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from eagle_train.guard import bad_rows, check_finite_weights, select_rows
from eagle_train.loss import ttt_loss
from eagle_train.model import DraftConfig, Eagle3Drafter, load_target_tensors, read_target_config, resolve_model_path
from eagle_train.vocab import build_vocab, load_vocab, read_key_list


def _load_checkpoint_file(path: str | Path) -> Any:
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


log = logging.getLogger(__name__)


def _unsharded(strategy: Any) -> bool:
    """One device or DDP: parameters are whole outside the strategy's forward (FSDP and DeepSpeed
    gather them in their own forward only, which the compile warm-up and a compiled layer bypass)."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

    return type(strategy) in (SingleDeviceStrategy, DDPStrategy)


def warm_up_shapes(max_length: int, max_tokens: Optional[int]) -> list[tuple[int, int]]:
    """``[(B, T)]`` of :meth:`EagleDrafterModule.warm_up_compiles`: three small shapes (static, dynamic,
    ``B = 1``) and, when ``max_tokens`` is known and larger, one batch at that token budget."""
    shapes = [(2, max(2, min(max_length, 384))), (5, max(2, min(max_length, 1000))), (1, max(2, min(max_length, 640)))]
    if max_tokens:
        t = max(2, min(max_length, 2048))
        b = max(2, max_tokens // t)
        if b * t > 5 * 1000:
            shapes.append((b, t))
    return shapes


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
        aux_layer_ids: the target aux layer ids (default: from ``dataset_dir``'s manifest).
        ttt_steps: K, unrolled drafter steps (EAGLE-3: 7).
        step_weight: loss weight ``w^k`` (0.8).
        exclude_oov: do not supervise rows whose target argmax is outside the draft vocab.
        lr, weight_decay, warmup_steps, min_lr_ratio, betas: AdamW + linear warmup + cosine decay
            over ``trainer.max_steps`` (or the estimated stepping batches), or over
            ``lr_schedule_minutes`` of training time when that is given.
        lr_schedule_minutes: run the cosine over this much wall-clock training time (from the first
            training batch; a resumed run continues the clock of its checkpoint) instead of steps:
            for fixed-time budgets (``TimedCheckpoints``). With
            neither steps nor this known (``max_time`` only), the lr stays constant after warm-up.
        init_lm_head_from_target: initialise ``lm_head`` with the target head's draft-vocab rows and
            ``norm`` with the target's final norm (a warm start; off: ``nn.Linear`` init, norm = 1).
        exclude_keys: JSON file with a list of sample keys to drop from training batches
            (a held-out split living in the same shards); a vocabulary built here from
            ``dataset_dir`` does not count them either.
        seed: seed of the drafter's initialisation.
        zero_features: control run: the target's aux states are replaced by zeros (in training
            and when the checkpoint is evaluated), so the drafter sees only tokens; it measures
            what the states contribute. Such a checkpoint is refused by ``export``.
        compile_warmup: on CUDA, one device or DDP, before the training clock starts (the first
            batch), run the loss forward and backward on synthetic batches of
            :func:`warm_up_shapes` (:meth:`warm_up_compiles`), so that torch.compile's first
            compiles (flex attention, the fused loss, the layer) do not eat the first timed
            minute of a fixed-time run. Nothing is learnt from them. (``trainer.max_time`` counts
            it: Lightning's timer starts before it.) A compiled layer that fails there (forward or
            backward) is turned off: training runs it eagerly.
        compile_layer: on CUDA, the drafter's decoder layer runs through ``torch.compile``
            (:attr:`eagle_train.model.Eagle3Drafter.compile_layer`: fewer, fused kernels per TTT
            step; eager again if inductor fails). CPU runs are eager either way, and so are
            sharded strategies (FSDP, DeepSpeed).
        check_target: refuse training data extracted from other weights than ``target_model_path``
            (the manifests' ``weights_fingerprint``; the vocabulary size is always checked).
    """

    def __init__(self, target_model_path: str, draft_vocab: Optional[str] = None, dataset_dir: Optional[str] = None,
                 draft_vocab_size: int = 32000, aux_layer_ids: Optional[list[int]] = None, ttt_steps: int = 7,
                 step_weight: float = 0.8, exclude_oov: bool = True, lr: float = 1e-4, weight_decay: float = 0.0,
                 warmup_steps: int = 0, min_lr_ratio: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                 init_lm_head_from_target: bool = True, exclude_keys: Optional[str] = None, seed: int = 0,
                 zero_features: bool = False, lr_schedule_minutes: Optional[float] = None,
                 compile_warmup: bool = True, check_target: bool = True, compile_layer: bool = True,
                 _vocab: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        super().__init__()
        self.save_hyperparameters(ignore=["_vocab"])
        tcfg = read_target_config(target_model_path)
        excluded = read_key_list(exclude_keys, "exclude_keys") if exclude_keys else []
        if _vocab is not None:  # from a checkpoint (load_from_checkpoint): the file is not needed
            d2t, t2d = _vocab
        elif dataset_dir:  # an existing draft_vocab is reused only if built from this data (held-out keys left out)
            d2t, t2d, path = build_vocab(dataset_dir, draft_vocab_size, out=draft_vocab, exclude_keys=excluded)
        elif draft_vocab and Path(draft_vocab).exists():
            d2t, t2d = load_vocab(draft_vocab)
            if int(d2t.numel()) != int(draft_vocab_size):
                raise ValueError(f"draft_vocab {draft_vocab} holds {d2t.numel()} tokens, draft_vocab_size is "
                                 f"{draft_vocab_size}: give the matching size or another file")
        else:
            raise ValueError("give draft_vocab (an existing d2t/t2d file) or dataset_dir to build one")
        if aux_layer_ids is None and dataset_dir:
            from eagle_data.format.records import read_manifest

            aux_layer_ids = list(read_manifest(dataset_dir)["aux_layer_ids"])
        self.aux_layer_ids = aux_layer_ids
        self.hparams["aux_layer_ids"] = aux_layer_ids  # in the checkpoint: export/eval need no dataset
        self.target_config = tcfg
        cfg = DraftConfig.from_target(tcfg, draft_vocab_size=int(d2t.numel()))
        w = load_target_tensors(target_model_path, ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"])
        if int(t2d.numel()) != int(w["lm_head.weight"].shape[0]):
            src = "the checkpoint's" if _vocab is not None else f"the one of {dataset_dir}" if dataset_dir else draft_vocab
            raise ValueError(f"draft vocabulary ({src}) maps a target vocabulary of {t2d.numel()} tokens; the target "
                             f"{target_model_path} (target_model_path) has {w['lm_head.weight'].shape[0]}: the data "
                             "or the vocabulary file comes from another model")
        gen = torch.random.fork_rng()
        with gen:
            torch.manual_seed(seed)
            head = w["lm_head.weight"][t2d].float() if init_lm_head_from_target else None
            self.drafter = Eagle3Drafter(cfg, w["model.embed_tokens.weight"].float(), d2t, t2d, head)
            if init_lm_head_from_target:  # the head expects the target's final-norm scale
                with torch.no_grad():
                    self.drafter.norm.weight.copy_(w["model.norm.weight"].float())
        self.drafter.zero_features = bool(zero_features)
        self.drafter.compile_layer = bool(compile_layer)
        self.register_buffer("target_lm_head", w["lm_head.weight"].float(), persistent=False)
        self._exclude = set(excluded)
        self.bad_samples = 0  # damaged samples this process dropped from its batches (see _filter)
        self.skipped_steps = 0  # steps that taught nothing on any rank: no update (see optimizer_step)
        self._step_teaches, self._step_skipped = False, False  # any micro-batch of the step taught; the last was skipped
        self._warned_unsupervised = False
        self._target_fingerprint: Optional[str] = None
        # the keys left out, as a checkpoint records them (on_load_checkpoint: the checkpoint's; None there
        # for one written before they were recorded)
        self._recorded_exclude: Optional[list[str]] = sorted(self._exclude)
        if lr_schedule_minutes is not None and not lr_schedule_minutes > 0:
            raise ValueError(f"lr_schedule_minutes must be > 0, got {lr_schedule_minutes!r}")
        self._t0: Optional[float] = None  # wall clock of the first training batch of this process
        self._trained_s = 0.0  # training seconds before it (a resumed run's, from the checkpoint)

    # ------------------------------------------------------------------ steps
    def _filter(self, batch: dict[str, Any], exclude: bool = True) -> tuple[Optional[dict[str, Any]], int]:
        """The batch without held-out keys (``exclude_keys``; when ``exclude``) and without damaged
        samples (:mod:`eagle_train.guard`: logged with their keys, counted in :attr:`bad_samples`),
        None when no row is left; and its supervised tokens. One host transfer per step, before the
        step's work is launched: each row's damage flag and supervised-token count."""
        keys = batch.get("keys")
        vocab = int(self.target_lm_head.shape[0])
        flags, supervised = torch.stack([bad_rows(batch, vocab).long(), batch["loss_mask"].sum(-1).long()]).tolist()
        keep = [i for i in range(len(flags)) if not (exclude and keys is not None and keys[i] in self._exclude)]
        named = [keys[i] if keys is not None else f"row {i}" for i in keep if flags[i]]
        if named:
            self.bad_samples += len(named)
            log.error("skipped %d sample(s) with a token id outside the target's vocabulary (%d) or non-finite "
                      "states: %s (damaged shards or another model's data: run `eagle-data verify` on the "
                      "dataset); %d skipped so far", len(named), vocab, ", ".join(map(str, named[:8])), self.bad_samples)
            keep = [i for i in keep if not flags[i]]
        out = batch if len(keep) == len(flags) else select_rows(batch, keep)
        return out, sum(supervised[i] for i in keep)

    def _shared(self, batch: dict[str, Any], stage: str, supervised: int):
        """The loss of a batch, logged: metrics are averaged over batches weighted by their
        supervised tokens — in training ``supervised`` (the loss-mask count read before the step,
        no extra host wait), in validation the rows each step's loss really scores (``n_k``: also
        without the positions no step reaches and, with ``exclude_oov``, the out-of-vocabulary
        teachers). A training batch that teaches nothing (samples cut by data.max_length before
        their first assistant token) is not logged; validation logs it with weight 0 (every rank
        must log each metric under sync_dist): it moves no average, and an epoch with nothing
        supervised reads NaN, not 0."""
        out = ttt_loss(self.drafter, self.target_lm_head, batch, self.hparams.ttt_steps,
                       self.hparams.step_weight, self.hparams.exclude_oov)
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
        self._step_teaches |= batch is not None and supervised > 0  # over accumulated micro-batches; optimizer_step resets
        if batch is None:  # whole batch held out: a zero loss keeps DDP ranks in step
            return sum(p.sum() * 0.0 for p in self.drafter.parameters())
        return self._shared(batch, "train", supervised)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        """The update, unless the step taught nothing on every rank (batches wholly held out or
        with no supervised token): AdamW would still move the weights by its momentum. Forward and
        backward run either way (DDP ranks stay in step); a skipped step is counted in
        :attr:`skipped_steps` (Lightning's ``global_step`` still counts it), the lr schedule does not
        advance."""
        result = optimizer_closure()
        teaches, self._step_teaches = float(self._step_teaches), False  # one process: a host bool, no device sync
        if self.trainer.world_size > 1:
            teaches = float(self.trainer.strategy.reduce(torch.tensor(teaches, device=self.device), reduce_op="sum"))
        self._step_skipped = teaches == 0
        if self._step_skipped:
            self.skipped_steps += 1
            if self.skipped_steps == 1:
                log.info("note: a training step had nothing to teach (its batch was held out, or no sample kept a "
                         "supervised token within data.max_length); no update, as intended (counted in skipped_steps)")
            return
        optimizer.step(closure=lambda: result)

    def lr_scheduler_step(self, scheduler, metric) -> None:
        """The schedule advances with the updates, not over a step :meth:`optimizer_step` skipped."""
        if self._step_skipped:
            return
        scheduler.step() if metric is None else scheduler.step(metric)

    def validation_step(self, batch, batch_idx):
        batch, supervised = self._filter(batch, exclude=False)  # the held-out keys are what validation may read
        if batch is None:  # every row damaged: weight-0 metrics, so that every DDP rank logs the same ones
            zero = torch.zeros((), device=self.device)
            k = self.hparams.ttt_steps
            self._log_metrics("val", zero, [zero] * k, [zero] * k, [0] * k)
            return None
        return self._shared(batch, "val", supervised)

    # ------------------------------------------------------------------ optim
    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay, betas=tuple(hp.betas))
        progress = self._schedule_progress()

        def f(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / max(hp.warmup_steps, 1)
            prog = progress(step)
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, f)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def setup(self, stage: str) -> None:
        """Hold the data module (:meth:`~eagle_data.stream.datamodule.EagleDataModule.hold_to`)
        to this drafter's facts: every manifest must have the target's hidden size and the
        drafter's aux layer ids (the export tells the server which layers to capture); a module
        built without ``aux_layer_ids`` or ``dataset_dir`` takes them from the training data and
        records them.

        Raises:
            ValueError: the data module expects, or a manifest has, other facts."""
        if self.drafter.compile_layer and not _unsharded(self.trainer.strategy):
            self.drafter.compile_layer = False  # a compiled region would see sharded parameters
            log.info("compile_layer off under %s", type(self.trainer.strategy).__name__)
        dm = getattr(self.trainer, "datamodule", None)
        if not callable(getattr(dm, "hold_to", None)):
            return
        ids = dm.hold_to(int(self.target_config["hidden_size"]), self.aux_layer_ids)
        if self.aux_layer_ids is None:
            self.aux_layer_ids = ids
            self.hparams["aux_layer_ids"] = ids
        loaders = [dm.train_dataloader()] + ([dm.val_dataloader()] if getattr(dm, "val_sources", None) else [])
        for loader in loaders:
            for where, fingerprint in loader.dataset.fingerprints.items():
                self._check_target({**loader.dataset.facts, "weights_fingerprint": fingerprint}, where)

    def _check_target(self, facts: dict[str, Any], where: str) -> None:
        """The data must come from this target: its vocabulary size, and (``check_target``) the
        fingerprint of its weights (:func:`eagle_data.format.fingerprint.weights_fingerprint`):
        another model's final states under this target's ``lm_head`` are a wrong teacher.

        Raises:
            ValueError: naming the data and both values."""
        vocab = int(self.target_lm_head.shape[0])
        if facts.get("vocab_size") is not None and int(facts["vocab_size"]) != vocab:
            raise ValueError(f"{where}: extracted by a model with vocab_size {facts['vocab_size']}, the target "
                             f"{self.hparams.target_model_path} (target_model_path) has {vocab}: give the target "
                             "that extracted the data")
        theirs = facts.get("weights_fingerprint")
        if not self.hparams.check_target or theirs in (None, "n/a"):
            return
        from eagle_data.format.fingerprint import weights_fingerprint

        if self._target_fingerprint is None:  # read once (first/last MiB of each weight file)
            self._target_fingerprint = weights_fingerprint(resolve_model_path(self.hparams.target_model_path))
        mine = self._target_fingerprint
        if mine != theirs:
            raise ValueError(f"{where}: extracted from other weights than the target "
                             f"{self.hparams.target_model_path} (target_model_path; weights_fingerprint {theirs} "
                             f"vs {mine}): this target's lm_head on those final states is a wrong teacher. Give "
                             "the target that extracted the data, or check_target false when it is the same "
                             "weights in other files (the fingerprint covers the weight files and config.json)")

    def on_train_start(self) -> None:
        pb = self.trainer.progress_bar_callback  # "Epoch 0/-2" when only time or steps bound the run
        if (self.trainer.max_epochs or 0) < 0 and hasattr(pb, "_get_train_description"):
            pb._get_train_description = lambda current_epoch: f"Epoch {current_epoch}"
        if self.hparams.compile_warmup and self.device.type == "cuda":
            if _unsharded(self.trainer.strategy):
                self.warm_up_compiles()
            else:  # sharded strategies (FSDP, DeepSpeed) gather parameters in their own forward only
                log.info("compile warm-up skipped under %s", type(self.trainer.strategy).__name__)

    def warm_up_compiles(self) -> float:
        """Loss forward + backward on synthetic batches (random tokens and states, the training
        data's batch dtype, under the trainer's precision) of shapes ``[2, t1]``, ``[5, t2]``,
        ``[1, t3]`` (t <= the data's ``max_length``): the static compile, the one dynamic in
        ``B`` and ``T``, and ``B = 1``; then ``[B4, t4]`` at the data's token budget
        (``max_tokens``): inductor specialises fusion decisions on the number of rows (seen on the
        H200: a recompile at ~9k rows for SmolLM2's drafter), and real batches are that large.
        Gradients are dropped; parameters, optimizer state and the global RNG are untouched.
        Returns the seconds spent (logged)."""
        t0 = time.perf_counter()
        data = getattr(getattr(self.trainer, "train_dataloader", None), "dataset", None)
        dtype = getattr(data, "dtype", torch.bfloat16)
        longest = getattr(data, "max_length", None) or 2048
        h, v = int(self.target_config["hidden_size"]), int(self.target_lm_head.shape[0])
        n_aux = len(self.aux_layer_ids or [0, 0, 0])
        on_gpu = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if on_gpu else []):
            for b, t in warm_up_shapes(longest, getattr(data, "max_tokens", None)):
                mask = torch.ones(b, t, dtype=torch.bool, device=self.device)
                if b > 1:
                    mask[-1, t // 2:] = False  # a padded row
                batch = {"input_ids": torch.randint(0, v, (b, t), device=self.device), "attention_mask": mask,
                         "loss_mask": mask.clone(),
                         "aux_hidden_states": torch.randn(b, t, n_aux * h, device=self.device).to(dtype),
                         "hidden_states": torch.randn(b, t, h, device=self.device).to(dtype)}
                try:
                    self._warm_up_step(batch)
                except Exception as e:  # noqa: BLE001 - inductor failures of any kind, also in the backward
                    if not self.drafter.compile_layer:
                        raise
                    self.drafter.compile_layer = False  # the eager layer: same math; a failure there is real
                    log.warning("compiled decoder layer failed in the warm-up (%s: %s); training runs it eagerly",
                                type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                    self._warm_up_step(batch)
        self.drafter.zero_grad(set_to_none=True)
        if on_gpu:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        log.info("compile warm-up: %.1f s before the training clock", seconds)
        return seconds

    def _warm_up_step(self, batch: dict[str, Any]) -> None:
        with self.trainer.precision_plugin.forward_context():
            loss = ttt_loss(self.drafter, self.target_lm_head, batch, self.hparams.ttt_steps,
                            self.hparams.step_weight, self.hparams.exclude_oov)["loss"]
        loss.backward()

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def training_seconds(self) -> float:
        """Wall-clock training time so far, across resumes (saved in checkpoints)."""
        return self._trained_s + (time.perf_counter() - self._t0 if self._t0 is not None else 0.0)

    def _schedule_progress(self):
        """``step -> [0, 1]``: the share of the run done, by training time (``lr_schedule_minutes``)
        or by steps (``max_steps`` or the estimated stepping batches); neither known: 0."""
        hp, tr = self.hparams, self.trainer
        if hp.lr_schedule_minutes:
            span = 60.0 * float(hp.lr_schedule_minutes)
            return lambda step: min(1.0, self.training_seconds() / span)
        total = tr.max_steps if tr.max_steps and tr.max_steps > 0 else tr.estimated_stepping_batches
        if not math.isfinite(total):  # max_time only
            return lambda step: 0.0
        total = max(int(total), 1)
        return lambda step: min(1.0, (step - hp.warmup_steps) / max(total - hp.warmup_steps, 1))

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: str | Path, map_location: Any = None, **kwargs: Any):
        """Lightning's loader, self-contained: ``d2t``/``t2d`` come from the checkpoint itself, so
        the draft-vocabulary file (and the dataset it was built from) may be gone. The target
        folder is still read (its frozen ``embed_tokens``/``lm_head`` are not in the checkpoint).
        Loads with ``weights_only=True`` (no arbitrary unpickling).

        Raises:
            ValueError: the path does not exist, is not a torch checkpoint file, or is not a
                checkpoint of this module (no ``drafter.d2t``/``t2d``); names the path.
        """
        ckpt = _load_checkpoint_file(checkpoint_path)
        sd = ckpt.get("state_dict", {}) if isinstance(ckpt, dict) else {}
        if "drafter.d2t" not in sd or "drafter.t2d" not in sd:
            raise ValueError(f"{checkpoint_path}: not an EagleDrafterModule checkpoint (no drafter.d2t/t2d)")
        # Built here rather than by Lightning's loader: a checkpoint written by LightningCLI carries an
        # instantiator that re-parses the arguments and would refuse the vocabulary tensors.
        hp = {k: v for k, v in (ckpt.get("hyper_parameters") or {}).items() if not k.startswith("_")}
        hp.update(kwargs)
        whose = "the target folder given" if "target_model_path" in kwargs else "its target folder"
        if hp.get("target_model_path") and not (resolve_model_path(hp["target_model_path"]) / "config.json").is_file():
            raise ValueError(f"{checkpoint_path}: {whose}, {hp['target_model_path']} (target_model_path), has no "
                             "config.json (moved or deleted?): give the target's folder (--target_model)")
        if (ckpt.get("eagle") or {}).get("excluded_keys") is not None:
            hp["exclude_keys"] = None  # the keys recorded at training are used (on_load_checkpoint), not the file
        elif hp.get("exclude_keys") and not Path(hp["exclude_keys"]).is_file():  # only training filters by it
            log.warning("%s: its held-out key file %s is gone; the loaded module filters no keys",
                        checkpoint_path, hp["exclude_keys"])
            hp["exclude_keys"] = None
        mod = cls(**hp, _vocab=(sd["drafter.d2t"], sd["drafter.t2d"]))
        try:
            mod.load_state_dict(sd, strict=True)
        except RuntimeError as e:  # size mismatches: a target of another shape
            raise ValueError(f"{checkpoint_path}: its drafter does not fit {whose}, {hp.get('target_model_path')} "
                             f"({str(e).splitlines()[-1].strip()[:200]})") from None
        mod.on_load_checkpoint(ckpt)
        check_finite_weights(mod.drafter, str(checkpoint_path))
        if map_location is not None and not callable(map_location) and not isinstance(map_location, dict):
            mod.to(map_location)
        return mod.eval()

    @property
    def excluded_keys(self) -> Optional[list[str]]:
        """The sample keys this drafter's training left out (sorted; ``[]``: none), as recorded in
        its checkpoint (not re-read from the ``exclude_keys`` file, which may have changed since);
        None for a checkpoint written before they were recorded."""
        return self._recorded_exclude

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["eagle"] = {"draft_config": self.drafter.cfg.to_dict(), "aux_layer_ids": self.aux_layer_ids,
                               "training_seconds": self.training_seconds(), "excluded_keys": self.excluded_keys}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the training clock and the held-out keys the checkpoint records.

        Raises:
            ValueError: a module given ``exclude_keys`` (a resumed training) whose keys differ from
                the recorded ones: the samples trained on so far would not be the ones held out."""
        eagle = checkpoint.get("eagle") or {}
        self._trained_s = float(eagle.get("training_seconds", 0.0))
        recorded = eagle.get("excluded_keys")  # None: written before the keys were recorded
        if self.hparams.get("exclude_keys") and recorded is not None and sorted(recorded) != sorted(self._exclude):
            raise ValueError(f"exclude_keys {self.hparams['exclude_keys']} holds {len(self._exclude)} key(s), the "
                             f"checkpoint's training left out {len(recorded)} others: a resumed run keeps the held-out "
                             "keys it started with (leave exclude_keys out, or give the same file); start a new run "
                             "to hold out other keys")
        self._recorded_exclude = recorded
        if self._recorded_exclude is not None:
            self._exclude = set(self._recorded_exclude)
