"""``LightningCLI`` entry of drafter training.

* ``python -m eagle_train.cli fit --config configs/train/smollm2_cpu.yaml`` (full LightningCLI:
  ``fit``/``validate``, ``--ckpt_path`` to resume, ``--print_config``);
* ``eagle-data train --config configs/train/smollm2_cpu.yaml --trainer.max_steps 100`` (same
  config sections through :func:`fit`, see :mod:`eagle_data.cli.train`).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch.cli import LightningCLI

log = logging.getLogger(__name__)


def _classes():
    from eagle_data.stream.datamodule import EagleDataModule

    from eagle_train.module import EagleDrafterModule
    return EagleDrafterModule, EagleDataModule


class _ParseOnlyCLI(LightningCLI):
    def instantiate_classes(self) -> None:  # validate the config, build nothing (tests)
        pass


def make_cli(args: Any = None, run: bool = True, parse_only: bool = False,
             parser_kwargs: Optional[dict[str, Any]] = None) -> LightningCLI:
    from eagle_train.quiet import quiet_lightning

    quiet_lightning()
    model, data = _classes()
    cls = _ParseOnlyCLI if parse_only else LightningCLI
    return cls(model, data, args=args, run=run, save_config_kwargs={"overwrite": True}, parser_kwargs=parser_kwargs)


def last_checkpoint(root: str) -> Optional[str]:
    """The newest ``last*.ckpt`` below ``root`` (each run writes its own ``lightning_logs/version_N``),
    or None."""
    found = sorted(Path(root).glob("**/last*.ckpt"), key=lambda p: p.stat().st_mtime)
    return str(found[-1]) if found else None


def _check_resume(ckpt: Any, path: str, model: dict[str, Any]) -> None:
    """A resume checkpoint is a Lightning checkpoint of this module with the configured drafter size.

    Raises:
        ValueError: naming the checkpoint and what differs.
    """
    sd = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(sd, dict) or "drafter.d2t" not in sd or "pytorch-lightning_version" not in ckpt:
        raise ValueError(f"{path}: not a Lightning checkpoint of an EagleDrafterModule (give a .ckpt the training "
                         f"wrote, e.g. --ckpt_path last)")
    have, want = int(sd["drafter.d2t"].numel()), model.get("draft_vocab_size")
    if want is not None and int(want) != have:
        raise ValueError(f"{path}: its drafter has a draft vocabulary of {have}, the config says draft_vocab_size "
                         f"{want}; resume with the run's own config")


def fit(config: dict[str, Any], ckpt_path: Optional[str] = None) -> str:
    """Train from LightningCLI-style sections (``model``, ``data``, ``trainer``, ``seed_everything``;
    a grouped model option may also be given by its field name alone, ``ttt_steps``: it joins
    its group, :func:`eagle_train.options.nest_groups`); resumes from ``ckpt_path``: a file, or
    "last" = the newest ``last*.ckpt`` below the trainer's ``default_root_dir`` (none yet: a
    fresh start, logged). Returns the best/last checkpoint path.

    Raises:
        ValueError: ``ckpt_path`` is not a checkpoint this module can load safely (no unpickling).
    """
    from jsonargparse import ArgumentError

    from eagle_train.checkpoint import load_checkpoint_file
    from eagle_train.option_names import did_you_mean
    from eagle_train.options import nest_groups

    if config.get("model") is not None:  # --model.ttt_steps: loss.ttt_steps
        config = {**config, "model": nest_groups(config["model"])}
    if ckpt_path == "last":
        root = (config.get("trainer") or {}).get("default_root_dir") or "."
        ckpt_path = last_checkpoint(root)
        log.info("--ckpt_path last: %s", ckpt_path or f"no last*.ckpt below {root}; starting from scratch")
    if ckpt_path is not None:  # refused here, with our message, before Lightning unpickles it
        _check_resume(load_checkpoint_file(ckpt_path), ckpt_path, config.get("model") or {})
    argv, sys.argv = sys.argv, sys.argv[:1]  # the sections are the arguments (LightningCLI warns on both)
    try:
        cli = make_cli(args={k: v for k, v in config.items() if v is not None}, run=False,
                       parser_kwargs={"prog": "eagle-data train", "exit_on_error": False})
    except ArgumentError as e:  # an unknown or mistyped option (a config's): one line, the closest valid one
        raise ValueError(f"train: {did_you_mean(str(e))} (every option: python -m eagle_train.cli fit "
                         f"--help)") from None
    finally:
        sys.argv = argv
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt_path)
    cb = cli.trainer.checkpoint_callback
    return (cb.last_model_path or cb.best_model_path) if cb is not None else ""


def main() -> None:
    make_cli()


if __name__ == "__main__":
    main()
