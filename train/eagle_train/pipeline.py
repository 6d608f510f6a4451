"""End-to-end drafter demo on CPU: vocab -> train -> tau (trained vs untrained) -> export.

    from eagle_train.pipeline import demo
    demo("out/smollm2-sharegpt", "out/drafter-demo", minutes=5)
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)


def check_demo_args(minutes: float, draft_vocab_size: int, heldout_fraction: float, eval_samples: int,
                    positions_per_sample: int, ttt_steps: int, eval_steps: int, max_length: int, lr: float,
                    threads: Optional[int]) -> None:
    """Refuse numbers :func:`demo` cannot use, before it reads or writes anything.

    Raises:
        ValueError: naming the first bad argument.
    """
    if not (math.isfinite(minutes) and minutes > 0):
        raise ValueError(f"minutes must be a number > 0 (training wall time), got {minutes}")
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a number > 0, got {lr}")
    for name, v, low in (("draft_vocab_size", draft_vocab_size, 1), ("eval_samples", eval_samples, 1),
                         ("positions_per_sample", positions_per_sample, 1), ("ttt_steps", ttt_steps, 1),
                         ("eval_steps", eval_steps, 1), ("max_length", max_length, 2), ("threads", threads, 1)):
        if v is not None and v < low:
            raise ValueError(f"{name} must be >= {low}, got {v}")


def demo(dataset_dir: str, out_dir: str, minutes: float = 5.0, draft_vocab_size: int = 2048,
         heldout_fraction: float = 0.1, eval_samples: int = 12, positions_per_sample: int = 16, ttt_steps: int = 4,
         eval_steps: int = 7, max_length: int = 384, lr: float = 2e-3, target_model: str = "smollm2", seed: int = 0,
         threads: Optional[int] = None) -> dict[str, Any]:
    """Train a SmolLM2 drafter for ``minutes`` on CPU and report acceptance length.

    Steps: (1) deterministic held-out index split (``heldout_keys.json``); (2) draft vocabulary
    from the training keys' histogram; (3) ``Trainer.fit`` with ``max_time`` (held-out keys are
    dropped from batches); (4) tau of the trained and of the untrained (same init) drafter on
    the held-out samples against the fp32 HF target, plot; (5) SGLang and vLLM (speculators format) exports.

    CPU-scale defaults (a 2-core machine does ~3-5 s per 384-token step): draft vocab 2048,
    4 unrolled TTT steps in training (the GPU configs use 7), chains of ``eval_steps`` = 7
    proposals at evaluation, lr 2e-3 constant after 10 warmup steps, gradient clipping 1.0.

    Raises:
        ValueError: an argument out of range (:func:`check_demo_args`), a bad dataset.

    Returns:
        dict with ``tau_trained`` (+ ``tau_ci95_trained``), ``tau_untrained``, ``tau_prompt_lookup``,
        ``plot``, ``checkpoint``, ``export``.
    """
    check_demo_args(minutes, draft_vocab_size, heldout_fraction, eval_samples, positions_per_sample, ttt_steps,
                    eval_steps, max_length, lr, threads)
    from eagle_train.heldout import heldout_split
    from eagle_train.quiet import quiet_lightning
    from eagle_train.vocab import build_vocab

    quiet_lightning()
    if threads:
        torch.set_num_threads(threads)
    out = Path(out_dir).expanduser().resolve()  # absolute: the checkpoint names files in it
    out.mkdir(parents=True, exist_ok=True)
    dataset_dir = str(Path(dataset_dir).expanduser().resolve())
    held = heldout_split(dataset_dir, heldout_fraction, seed=seed, min_count=2)
    (out / "heldout_keys.json").write_text(json.dumps(held))
    vocab_path = out / f"draft_vocab_{draft_vocab_size}.safetensors"
    build_vocab(dataset_dir, draft_vocab_size, out=vocab_path, exclude_keys=held, rebuild=True)  # a fresh run
    module, untrained, steps, ckpt = _train(out, dataset_dir, target_model, vocab_path, draft_vocab_size, ttt_steps,
                                            lr, seed, minutes, max_length)
    keys = held[:eval_samples]
    res, plot = _score(module, untrained, dataset_dir, keys, out, eval_steps, positions_per_sample, max_length)
    exp, exp_vllm = _export(module, out)
    summary = {"tau_trained": res["trained"]["tau"], "tau_untrained": res["untrained"]["tau"],
               "tau_prompt_lookup": res["prompt_lookup"]["tau"], "tau_ci95_trained": res["trained"]["tau_ci95"],
               "accept_at_least_trained": res["trained"]["accept_at_least"],
               "accept_at_least_untrained": res["untrained"]["accept_at_least"],
               "num_chains": res["trained"]["num_chains"], "heldout_samples": len(keys),
               "train_steps": steps, "plot": str(plot), "checkpoint": str(ckpt), "export": str(exp),
               "export_vllm": str(exp_vllm)}
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=1))
    print(f"tau trained       = {summary['tau_trained']:.3f} (95 % {summary['tau_ci95_trained']})\n"
          f"tau untrained     = {summary['tau_untrained']:.3f}\n"
          f"tau prompt lookup = {summary['tau_prompt_lookup']:.3f} (the free n-gram baseline)\n"
          f"plot: {plot}\nexport: {exp} (SGLang), {exp_vllm} (vLLM, speculators format)")
    return summary


def _train(out: Path, dataset_dir: str, target_model: str, vocab_path: Path, draft_vocab_size: int, ttt_steps: int,
           lr: float, seed: int, minutes: float, max_length: int):
    """Train for ``minutes`` (held-out keys of ``out/heldout_keys.json`` dropped from batches);
    returns the module, the same drafter untrained, the steps trained and the checkpoint."""
    import lightning.pytorch as pl

    from eagle_data.stream.datamodule import EagleDataModule
    from eagle_train.module import EagleDrafterModule
    from eagle_train.options import DrafterOptions, LossOptions, OptimOptions

    pl.seed_everything(seed)
    module = EagleDrafterModule(target_model_path=target_model, draft_vocab=str(vocab_path), dataset_dir=dataset_dir,
                                draft_vocab_size=draft_vocab_size, exclude_keys=str(out / "heldout_keys.json"), lr=lr,
                                drafter=DrafterOptions(seed=seed),
                                loss=LossOptions(ttt_steps=ttt_steps, exclude_oov=False),
                                optim=OptimOptions(warmup_steps=10, min_lr_ratio=1.0))
    untrained = module.untrained_drafter()  # identical init (same seed), never trained
    dm = EagleDataModule(train=dataset_dir, batch_size=1, max_length=max_length, num_workers=0, pin_memory=False,
                         seed=seed)
    trainer = pl.Trainer(accelerator="cpu", devices=1, precision="32-true", max_time={"minutes": minutes},
                         gradient_clip_val=1.0,
                         max_epochs=-1, default_root_dir=str(out), log_every_n_steps=10, enable_checkpointing=False,
                         logger=pl.loggers.CSVLogger(str(out), name="logs"), enable_progress_bar=False)
    trainer.fit(module, datamodule=dm)
    ckpt = out / "last.ckpt"
    trainer.save_checkpoint(str(ckpt), weights_only=False)  # a full checkpoint (resumable); says so
    log.info("trained %d steps -> %s", trainer.global_step, ckpt)
    return module, untrained, trainer.global_step, ckpt


def _score(module, untrained, dataset_dir: str, keys: list[str], out: Path, eval_steps: int,
           positions_per_sample: int, max_length: int):
    """tau of the trained and untrained drafter and of prompt lookup on ``keys``; the results and their plot."""
    from eagle_data.tools.read_samples import read_samples
    from eagle_train.evaluate import acceptance, load_target, plot_acceptance
    from eagle_train.ngram import PromptLookupDrafter

    samples = read_samples(dataset_dir, keys)
    target = load_target(module.hparams.target_model_path)
    oracles: dict = {}
    res = {name: acceptance(d, target, samples, eval_steps, positions_per_sample, max_length, oracles)
           for name, d in (("trained", module.drafter.eval()), ("untrained", untrained.eval()),
                           ("prompt_lookup", PromptLookupDrafter()))}
    return res, plot_acceptance(res, out / "acceptance.png")


def _export(module, out: Path):
    """SGLang and vLLM (speculators) exports of the trained drafter in ``out`` (a rerun replaces its own)."""
    from eagle_train.export import default_verifier, export_drafter

    exp = export_drafter(module.drafter, module.target_config, module.aux_layer_ids, out / "sglang_drafter",
                         overwrite=True)
    exp_vllm = export_drafter(module.drafter, module.target_config, module.aux_layer_ids, out / "vllm_drafter",
                              format="speculators", verifier=default_verifier(module.hparams.target_model_path),
                              overwrite=True)
    return exp, exp_vllm
