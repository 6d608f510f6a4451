"""``eagle-data extract|inspect|merge``: the commands that make and look at a dataset."""

from __future__ import annotations

import json
import sys
from typing import Optional

from rich.console import Console

from eagle_data.extract.config import ExtractConfig
from eagle_data.regen.config import RegenerateConfig


def extract(cfg: ExtractConfig) -> None:
    """Run ``eagle-data extract`` (the options are :class:`ExtractConfig`'s fields) and report."""
    from eagle_data.extract.config import check_paths

    check_paths(cfg)  # before the imports of torch and transformers: a mistake answers at once
    from eagle_data.extract.manifest import RanksDisagree
    from eagle_data.extract.run import run_extract

    out = cfg.out
    res = run_extract(cfg)  # no sample at all: NoSamples, a ValueError (exit 2)
    if "merge_error" in res:  # this rank finished; the dataset is not merged (its old manifest is removed)
        raise RanksDisagree(f"{res['merge_error']}\n(this rank's own extraction finished and is kept)")
    con = Console(stderr=True)
    st = res["run_stats"]
    if st.get("nothing_to_do"):
        con.print("[bold]nothing to do[/]: already extracted from this source with these settings "
                  "(the model was not loaded)")
    else:
        con.print(f"[bold]extracted[/] {st['new_samples']} samples, {st['new_tokens']} tokens in {st['seconds']} s "
                  f"({st['tokens_per_s']} tok/s); rows skipped in this run (rows an earlier run skipped are "
                  f"decided again): {st['skip_counts'] or 'none'}")
    if "schema_version" in res:
        bpt = res["total_bytes"] / max(res["num_tokens"], 1)
        raw = 4 * res["hidden_size"] * 2
        con.print(f"dataset: {res['num_samples']} samples, {res['num_tokens']} tokens, "
                  f"{len(res['shards'])} shard(s), {res['total_bytes'] / 2**20:.1f} MiB "
                  f"({bpt:.0f} B/token = {bpt / raw:.3f} x the {raw} B/token of raw bf16 hidden states)")
    print(out)



def inspect(path: str, sample: Optional[int] = None, max_chars: int = 3000, key: Optional[str] = None) -> None:
    """Print a dataset's manifest summary and one sample with its loss-masked text highlighted.

    Args:
        path: dataset directory (with manifest.json).
        sample: which sample (index order) to show (default: the first multi-turn one under 1,500 tokens).
        max_chars: cut the shown text after this many characters.
        key: show the sample with this key instead (e.g. a key named in an error or the skip log).
    """
    from eagle_data.tools.inspect import inspect_dataset

    inspect_dataset(path, sample, max_chars, key=key)


def merge(path: str) -> None:
    """Combine per-rank progress files and index parts into manifest.json + index.parquet.

    Args:
        path: dataset directory written by one or more ranks.
    """
    from eagle_data.extract.manifest import merge as _merge

    m = _merge(path)
    print(json.dumps({k: m[k] for k in ("num_samples", "num_tokens", "total_bytes", "skip_counts")}, indent=1))


def templates(show: Optional[str] = None) -> None:
    """List the chat templates shipped with eagle-data (use one with `extract --chat_template NAME`).

    Each is a byte-exact copy of a model family's template; sources, commits and licenses are in
    eagle_data/templates/SOURCES.md.

    Args:
        show: print this template's text (a name or alias) instead of the list.
    """
    from eagle_data.templates import ALIASES, DIR, names, resolve

    if show is not None:
        print(resolve(show).read_text(encoding="utf-8"), end="")
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"chat templates ({DIR})")
    t.add_column("name")
    t.add_column("also accepted as")
    for n in names():
        t.add_row(n, ", ".join(sorted(a for a, s in ALIASES.items() if s == n and a != n)))
    Console().print(t)


def regenerate(cfg: RegenerateConfig) -> None:
    """Run ``eagle-data regenerate`` (the options are :class:`RegenerateConfig`'s fields) and report."""
    from eagle_data.regen.config import check_paths

    check_paths(cfg)  # before the imports of torch and transformers: a mistake answers at once
    from eagle_data.regen.run import run_regenerate

    res = run_regenerate(cfg)
    st = res["run_stats"]
    con = Console(stderr=True)
    speed = f" ({st['tokens_per_s']} tok/s)" if st["tokens_per_s"] else ""
    con.print(f"[bold]this run[/]: {st['rows']} source rows processed, {st['tokens_generated']} tokens generated in "
              f"{st['generation_seconds']} s{speed}; rejected: {st['rejects'] or 'none'}")
    if not res.get("complete"):
        con.print(f"rank {cfg.rank} of {cfg.world_size} has finished; not complete yet: ranks not finished "
                  f"{res['ranks_unfinished']}, first rows missing {res['missing_rows']} (run every rank with the same "
                  f"options and --num_samples, --rank R --world_size {cfg.world_size})")
        print(cfg.out)
        return
    con.print(f"all ranks: {res['input_rows']} rows = {res['regenerated']} regenerated + {res['failed']} failed "
              f"+ {res['skipped']} skipped; reasons {res['reasons'] or 'none'}; turns by finish {res['finish']}"
              + (f"; notes {res['notes']}" if res["notes"] else ""))
    if res["input_rows"] == 0:
        con.print(f"[bold red]error:[/] the source {cfg.data!r} has no rows")
        sys.exit(2)
    if res["regenerated"] == 0:
        con.print(f"[bold red]error:[/] no row was regenerated; see {cfg.out}/rejects/")
        sys.exit(2)
    if res["finish"].get("length") and cfg.length_replies == "keep":
        con.print(f"note: {res['finish']['length']} turn(s) ran out of tokens (max_new_tokens / max_length); "
                  "extraction supervises an end-of-turn token after them. --length_replies reject drops them")
    con.print(f"next: eagle-data extract --data {cfg.out} ...")
    print(cfg.out)
