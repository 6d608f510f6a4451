"""The settings of the τ benchmark (:mod:`benchmarks.tau`), declared once: :class:`TauConfig` is the
command line of ``python -m benchmarks tau`` (jsonargparse reads the fields, types and the
docstring under each) and its ``--config`` YAML."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Union

from benchmarks.tau_results import minute_names
from eagle_data.checks import check_positive
from eagle_data.format.names import FINAL_ROWS, STORAGE_DTYPE_NAMES

#: the phases, in the order they run
PHASES = ("prep", "regen", "extract", "tune", "train", "control", "eval", "serve")
#: Lightning's accelerator names (``--trainer.accelerator``)
ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "tpu", "auto")


class TauPhaseFailed(ChildProcessError):
    """A phase's command failed, or the tune found no candidate: the phases after it do not run."""


@dataclass
class TauConfig:
    """τ on real data after fixed training time: prep, regen, extract, tune, train, control, eval,
    serve (module :mod:`benchmarks.tau` says what each does and writes).

    Lists are YAML/JSON: ``--phases '[extract, tune]'`` (or words: ``--phases train``, ``--phases
    extract,tune``); options passed on to ``eagle-data`` are strings, numbers quoted:
    ``--train_args '["--model.lr", "6e-4"]'``. Every setting is checked before any phase runs.
    """

    out: str = "out/tau"
    """the benchmark's folder: data, datasets, vocabulary, runs, evaluations"""
    phases: Union[list[str], str] = field(default_factory=lambda: list(PHASES))
    """the phases to run (any of prep, regen, extract, tune, train, control, eval, serve; they run in that
    order): a list, or one word or several split by commas or spaces"""
    num_train: int = 6000
    """training rows: ShareGPT rows [0, num_train)"""
    num_heldout: int = 200
    """held-out rows: ShareGPT rows [17000, 17000 + num_heldout)"""
    device: str = "cuda"
    """where regenerate, extract and eval run the models (cpu, cuda or cuda:N)"""
    vocab_size: int = 16384
    """draft vocabulary size (``OUT/draft_vocab_{vocab_size}.safetensors``)"""
    minutes: list[float] = field(default_factory=lambda: [2.0, 4.0, 8.0])
    """training-time marks of the checkpoints, increasing (``OUT/run/at_{m}min.ckpt``, named ``{m:g}``);
    the lr cosine spans the last, training stops there; the control trains to the first"""
    accelerator: str = "gpu"
    """Lightning accelerator of the training runs"""
    precision: str = "bf16-mixed"
    """Lightning precision of the training runs"""
    eval_samples: int = 40
    """held-out conversations evaluated (the first keys, sorted)"""
    regenerate: bool = False
    """the regen phase runs and extraction reads its answers (``OUT/regen``) instead of the originals"""
    mix: bool = False
    """with ``regenerate``: train on the original rows (``OUT/train``) and their regenerated answers
    (``OUT/train_regen``) together; the draft vocabulary counts the regenerated set. Each arm
    (original, regenerated, mix) in its own ``out``: their extractions differ"""
    own_heldout: bool = False
    """also score every checkpoint on the target's own answers to the held-out conversations: the
    regen phase has the target rewrite every assistant turn of ``OUT/heldout.jsonl`` (greedy,
    ``serve_new_tokens`` per turn, ``regen_args`` -> ``OUT/regen_heldout``), extraction stores them as
    ``OUT/heldout_own``, the eval phase scores there too (``OUT/eval_own_*``). A served drafter
    continues the target's own text, not ShareGPT's: this τ (and prompt lookup's) is the offline
    stand-in for the engine's accept length. Evaluation data only. A turn cut at the budget is
    closed with an end-of-turn token, so later turns' contexts differ from a served conversation's
    (τ's oracle stays the target's own greedy continuation)"""
    regen_max_new_tokens: int = 512
    """regenerate: most new tokens per answer"""
    regen_batch_size: Optional[int] = None
    """regenerate: requests in flight at once (its ``--batch_size``; default: the engine's own)"""
    regen_rows_per_part: int = 500
    """regenerate: rows per output part"""
    regen_args: list[str] = field(default_factory=list)
    """more ``eagle-data regenerate`` options, e.g. ``["--backend", "sglang", "--backend_kwargs",
    '{"mem_fraction_static": 0.25}']``"""
    regen_ranks: int = 1
    """regenerate processes at once (``--rank R --world_size N``; with SGLang each starts an engine,
    one at a time, sizing its KV pool from the memory the earlier ones left: give each its share with
    ``max_total_tokens`` in ``regen_args``; a small target's engine is bound by its scheduler's one CPU
    core, so several fill the GPU better)"""
    storage_dtype: str = "bfloat16"
    """storage dtype of the training set (e.g. float8_e4m3fn); the held-out set is stored as served"""
    final_rows: str = "all"
    """final states of the training set: "all", or "taught" (only where they teach)"""
    cuda_graphs: bool = False
    """extraction runs the prefill through CUDA graphs"""
    extract_args: list[str] = field(default_factory=list)
    """more ``eagle-data extract`` options, e.g. ``["--backend", "sglang"]``"""
    train_config: str = "configs/train/tau_bench_gpu.yaml"
    """the training config of the train, control and tune runs"""
    lr: Optional[float] = None
    """learning rate of every run (wins over ``train_args`` and the tune's choice; a variant's own lr
    wins over it in the tune); default: the config's (or ``OUT/lr.txt`` when there is one)"""
    train_args: list[str] = field(default_factory=list)
    """more ``eagle-data train`` options for the train and control runs, e.g. ``["--model.step_weight",
    "0.9"]``; default: the tune's best variant (``OUT/train_args.txt``), when there was a tune"""
    variants: list[list[str]] = field(default_factory=list)
    """the tune's variants, each a list of more ``eagle-data train`` options, e.g.
    ``[["--model.lr", "1.2e-3", "--data.max_tokens", "65536"]]``; one with ``--model.zero_features true``
    is a control, scored (``eval_tune``) but never chosen"""
    lrs: list[float] = field(default_factory=list)
    """without ``variants``: one variant per learning rate"""
    sweep_seconds: float = 60
    """training time of each variant of the tune"""
    tune_workers: int = 3
    """loader workers of each variant of the tune (they train side by side)"""
    serve_prompts: int = 200
    """serve: held-out conversations whose opening user turn(s) are the prompts"""
    serve_new_tokens: int = 256
    """serve: tokens generated per prompt"""
    serve_speed_batches: list[int] = field(default_factory=lambda: [1, 32])
    """serve: batch sizes of the decode-speed runs (``[]``: none)"""
    serve_args: list[str] = field(default_factory=list)
    """more ``eagle-data serve-check`` options, e.g. ``["--attention_backend", "triton"]``"""
    eval_tune: list[str] = field(default_factory=list)
    """tune variants whose checkpoints the eval phase scores too (``["v1", "v4"]``, or ``["all"]``)"""

    def __post_init__(self) -> None:
        """Refuse, before any phase runs, what would otherwise be skipped unsaid (an unknown phase,
        marks that are not increasing numbers or name one checkpoint twice) or fail only in a late
        phase (a device, accelerator, dtype or count that the commands refuse).

        Raises:
            ValueError: naming the setting.
        """
        self.phases = _phase_list(self.phases)
        if self.mix and not self.regenerate:
            raise ValueError("mix needs regenerate: true (it trains on the original rows and their regenerated answers)")
        minute_names(self.minutes)
        if not self.sweep_seconds > 0:
            raise ValueError(f"sweep_seconds must be > 0, got {self.sweep_seconds}")
        if not re.fullmatch(r"(cpu|cuda)(:[0-9]+)?", self.device):  # --device gpuu failed after the prep
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {', '.join(ACCELERATORS)}, got {self.accelerator!r}")
        if self.storage_dtype not in STORAGE_DTYPE_NAMES:
            raise ValueError(f"storage_dtype must be one of {', '.join(STORAGE_DTYPE_NAMES)}, "
                             f"got {self.storage_dtype!r}")
        if self.final_rows not in FINAL_ROWS:
            raise ValueError(f"final_rows must be one of {', '.join(FINAL_ROWS)}, got {self.final_rows!r}")
        check_positive(num_train=self.num_train, num_heldout=self.num_heldout, vocab_size=self.vocab_size,
                       eval_samples=self.eval_samples, regen_max_new_tokens=self.regen_max_new_tokens,
                       regen_ranks=self.regen_ranks, serve_prompts=self.serve_prompts,
                       serve_new_tokens=self.serve_new_tokens,
                       regen_batch_size=self.regen_batch_size, regen_rows_per_part=self.regen_rows_per_part)
        if self.tune_workers < 0:
            raise ValueError(f"tune_workers must be >= 0, got {self.tune_workers}")
        for b in self.serve_speed_batches:
            check_positive(serve_speed_batches=b)
        for name, lr in [("lr", self.lr)] + [("lrs", x) for x in self.lrs]:
            if lr is not None and not lr > 0:
                raise ValueError(f"{name} must be > 0, got {lr}")


def _phase_list(phases: list[str] | str) -> list[str]:
    """``phases`` as a list of known phases: a list, or words split by commas or white space
    (``--phases train`` is ``--phases '[train]'``).

    Raises:
        ValueError: no phase, or an unknown one (a misspelt phase would be skipped unsaid).
    """
    words = re.split(r"[\s,]+", phases) if isinstance(phases, str) else phases
    out = [p.strip() for p in words if p.strip()]
    if not out:
        raise ValueError(f"phases: empty ({' '.join(PHASES)})")
    for p in out:
        if p not in PHASES:
            raise ValueError(f"phases: unknown phase {p!r} ({' '.join(PHASES)})")
    return out
