"""The settings of one regeneration run, declared once: :class:`RegenerateConfig` is the Python
API, the ``eagle-data regenerate`` command line and the YAML schema of ``configs/regenerate_*.yaml``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from eagle_data.extract.config import CommonConfig, _is_int, check_run_paths

#: settings that must be equal for a rerun to resume into the same output (``num_samples`` is
#: not one: a larger N extends a finished run)
RESUME_FIELDS = ("model", "backend", "data", "split", "mode", "max_new_tokens", "max_length", "temperature", "top_p", "top_k", "seed",
                 "chat_template", "template_date", "template_vars", "stop_tokens", "split_reasoning", "length_replies",
                 "rows_per_part", "world_size", "dtype")


@dataclass
class RegenerateConfig(CommonConfig):
    """Replace the assistant turns of chat data with the target model's own replies (greedy by default).

    The output folder is a source for ``eagle-data extract --data OUT``. Rerunning the same command resumes: finished parts are kept, the part in progress is redone.
    """

    out: str = "out/regenerated"
    """output directory: data/part-*.jsonl (the regenerated records), rejects/part-*.jsonl (rows
    not regenerated, with the reason), progress-RANK.json, regeneration.json (settings + counts)"""
    mode: Literal["last", "all"] = "all"
    """"all": every assistant turn in order, each regenerated reply the context of the next;
    "last": only the last assistant turn"""
    max_new_tokens: int = 1024
    """most tokens generated per turn"""
    max_length: int = 2048
    """most tokens of context + reply (as extract's max_length): a turn whose context is this long
    or longer is not regenerated"""
    temperature: float = 0.0
    """0 = greedy (default); > 0 samples"""
    top_p: float = 1.0
    """nucleus sampling (with temperature > 0)"""
    top_k: int = -1
    """top-k sampling (with temperature > 0); -1 = the whole vocabulary. The model's own
    generation_config.json sampling defaults are never applied: what runs is what these options say"""
    seed: int = 0
    """sampling seed (SGLang: one seed per row and turn; HF: one per generation batch)"""
    stop_tokens: list[str] = field(default_factory=list)
    """extra stop tokens (each must be one token), besides the template's end-of-turn token and the
    model's end-of-sequence tokens"""
    length_replies: Literal["keep", "reject"] = "keep"
    """a reply that ran out of tokens (finish "length"): "keep" it (extraction then supervises an
    end-of-turn token the model did not write there), or "reject" it: mode "all" cuts the record
    before that turn (note cut_at_length), else the row fails (reply_at_length)"""
    split_reasoning: bool = True
    """a reply holding "</think>" is stored as reasoning_content (before it) + content (after it)"""
    batch_size: Optional[int] = None
    """requests in flight at most (each row's next turn is asked for as soon as its reply is back):
    HF generates them as one left-padded batch (sorted by length); SGLang schedules them itself and
    needs many to fill a GPU. Default: 32 with HF, 1024 with SGLang"""
    rows_per_part: int = 256
    """source rows per output part (the unit of crash safety and of the rank split)"""

    def __post_init__(self) -> None:
        """Fill ``rank``/``world_size`` from the environment; check every value.

        Raises:
            ValueError: naming the bad setting.
        """
        super().__post_init__()
        if self.batch_size is None:
            self.batch_size = 1024 if self.backend == "sglang" else 32
        for name, lo in (("max_new_tokens", 1), ("max_length", 2), ("batch_size", 1), ("rows_per_part", 1)):
            v = getattr(self, name)
            if not _is_int(v) or v < lo:
                raise ValueError(f"{name} must be an integer >= {lo}, got {v!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        for name, allowed in (("mode", ("last", "all")), ("length_replies", ("keep", "reject"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if not isinstance(self.stop_tokens, list) or not all(isinstance(s, str) and s for s in self.stop_tokens):
            raise ValueError(f"stop_tokens must be a list of non-empty strings, got {self.stop_tokens!r}")


def check_paths(cfg: RegenerateConfig) -> None:
    """:func:`~eagle_data.extract.config.check_run_paths`, and ``out`` does not overlap a data folder.

    Raises:
        ValueError: see there; ``out`` is, or is inside, or holds the data folder.
    """
    check_run_paths(cfg)
    if Path(cfg.data).is_dir():
        out, data = Path(cfg.out).resolve(), Path(cfg.data).resolve()
        if out == data or data in out.parents or out in data.parents:
            raise ValueError(f"out {cfg.out!r} and data {cfg.data!r} overlap: the output would become part of "
                             "the source; use an --out outside the data folder")
