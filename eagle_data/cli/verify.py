"""``eagle-data verify DIR``: the command line face of :mod:`eagle_data.tools.verify`."""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

_WHAT = {
    "manifest": "manifest readable, schema + conventions, totals",
    "shards": "present, size + sha256 + sample count as listed",
    "samples": "schema, rows == len(input_ids) == len(loss_mask), dtypes, no NaN/Inf",
    "keys": "unique across shards/ranks, key = TAG_ROW, row in its rank",
    "index": "index.parquet rows == stored samples, columns agree",
    "directory": "no temporaries, no unlisted shards / index parts",
    "recompute": "random samples re-run through the HF reference backend",
}


#: columns the recompute table is laid out in at least (each number stays whole)
RECOMPUTE_WIDTH = 150


def print_report(rep: Any, max_problems: int = 30, console: Console | None = None) -> None:
    """Summary table (one row per check), the first ``max_problems`` problems, recompute errors
    of a :class:`~eagle_data.tools.verify.VerifyReport` (that module loads torch: imported where
    used, so a mistyped command answers at once)."""
    from eagle_data.tools.recompute import EXPECTED_TOKEN_REL
    from eagle_data.tools.verify import CATEGORIES

    con = console or Console()
    counts = Counter(c for c, _, _ in rep.problems)
    t = Table(title=f"eagle-data verify {rep.path}: {rep.num_shards} shard(s), {rep.num_samples} sample(s), "
                    f"{rep.num_tokens} token(s)")
    t.add_column("check", no_wrap=True)
    t.add_column("result", no_wrap=True)
    t.add_column("what is checked", overflow="fold")
    for c in CATEGORIES:
        if c == "recompute" and not rep.recompute and not counts[c]:
            continue
        t.add_row(c, f"[red]FAIL ({counts[c]})[/]" if counts[c] else "[green]ok[/]", _WHAT[c])
    con.print(t)
    if rep.recompute:
        r = Table(title=f"recompute: {len(rep.recompute_keys)} sample(s), rtol {rep.rtol:.3g} (on max|Δ| / max|ref|)")
        r.add_column("layer", no_wrap=True)
        r.add_column("max|Δ| / max|ref|", justify="right", no_wrap=True)
        for col in ("per-token rel. p50", "p99", "max", "min cosine") + (("|Δ| / fp8 bound",) if rep.recompute_bound else ()):
            r.add_column(col, justify="right", no_wrap=True)
        for name, err in rep.recompute.items():
            tok = rep.recompute_tokens.get(name, {})
            bound = (f"{rep.recompute_bound[name]:.3f}" if name in rep.recompute_bound else "-",) if rep.recompute_bound else ()
            r.add_row(name, f"[{'red' if rep.rtol is not None and err > rep.rtol else 'green'}]{err:.3e}[/]",
                      *(f"{tok[k]:.2e}" for k in ("token_rel_p50", "token_rel_p99", "token_rel_max")),
                      f"{tok['min_cosine']:.6f}", *bound)
        # laid out at least RECOMPUTE_WIDTH wide: every number whole (a narrow terminal wraps the lines)
        wide = Console(file=con.file, width=max(con.width, RECOMPUTE_WIDTH), force_terminal=con.is_terminal,
                       no_color=con.no_color)
        wide.print(r)
        if rep.dtype in EXPECTED_TOKEN_REL:
            same = "a recompute in the same dtype and batch reproduces the stored values (0)"
            if rep.recompute_bound:
                same = (f"fp8 fields (last column): |Δ| is the quantisation error, within its bound when <= 1 "
                        f"for a float32 extraction (a bf16 one adds its batch-composition noise, so values above "
                        f"1 are expected there; the verdict checks the error relative to each layer's maximum "
                        f"against rtol); other fields: {same}")
            batch = ("" if rep.dtype == "float32" else
                     "; another batch composition in bf16 differs by 1-8 % per token (cosine > 0.99)")
            con.print(f"rounding to {rep.dtype} moves a token by about {EXPECTED_TOKEN_REL[rep.dtype]:.1e} "
                      f"(relative): {same}{batch}")
    for c, where, what in rep.problems[:max_problems]:
        con.print(f"[red]{c}[/] {where}: {what}", markup=True, highlight=False, soft_wrap=True)  # whole, never cut
    if len(rep.problems) > max_problems:
        con.print(f"... and {len(rep.problems) - max_problems} more problem(s)")
    con.print("[bold green]OK[/]" if rep.ok else f"[bold red]FAILED[/]: {len(rep.problems)} problem(s)")


def verify(path: str, recompute: int = 0, seed: int = 0, device: str = "cpu", rtol: Optional[float] = None,
           max_problems: int = 30) -> None:
    """Verify a dataset directory end to end (shards, samples, keys, index). Exits 1 on failure.

    Checks every shard against the manifest (sha256, size, sample count), the schema,
    rows == len(input_ids) == len(loss_mask), no NaN/Inf, unique keys across shards and ranks,
    index.parquet against the shards, no leftover files, and that there is at least one sample.
    Bad arguments (negative --rtol, an unusable --device) exit 2 before anything is read.

    Args:
        path: dataset directory (with manifest.json; run `eagle-data merge` first if missing).
        recompute: re-run this many random samples through the HF reference backend (model,
            aux layer ids and compute dtype from the manifest) and report the max relative error per layer.
        seed: random seed choosing the recomputed samples.
        device: device for the recompute ("cpu", "cuda", "cuda:1", ...; checked when recompute > 0).
        rtol: max relative error allowed in the recompute, >= 0 (default: 1e-4 for float32 data,
            5e-2 if the compute or storage dtype is bfloat16).
        max_problems: print at most this many problems (>= 0).
    """
    if max_problems < 0:
        raise ValueError(f"max_problems must be >= 0, got {max_problems}")
    from eagle_data.tools.verify import verify_dataset

    rep = verify_dataset(path, recompute=recompute, seed=seed, device=device, rtol=rtol)
    print_report(rep, max_problems)
    if not rep.ok:
        raise SystemExit(1)
