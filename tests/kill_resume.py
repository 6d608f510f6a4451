#!/usr/bin/env python
"""Crash-test extraction: kill it with SIGKILL at random points, resume, compare.

    python tests/kill_resume.py --kills 10 --samples 50

1. An uninterrupted reference extraction (tiny random Llama + local JSONL with a few bad
   records, float32, each sample captured alone so numerics cannot depend on batch
   composition) into ``WORK/ref``.
2. The same extraction into ``WORK/run``, SIGKILLed ``--kills`` times at random moments (a
   quarter of them at a random time during startup/repair/first shard, the rest at a random time after the child
   published a new shard, so kills land in the forward pass, in shard writes, in renames
   and progress writes), plus ``--terms`` clean interruptions (SIGTERM, SIGINT alternating)
   after each of which the directory must already be clean (no temporaries, every shard on
   disk listed, every listed shard present). Each time the same extraction resumes.
3. A final resume to completion, then: identical sample keys, bit-identical tensors and
   metadata, identical index rows and skip counts, no duplicates, no leftovers
   (``*.tmp``, unlisted tars or index parts), and :func:`eagle_data.tools.verify.verify_dataset` passes.

Children are ``os.fork()``-ed from this already-initialised process (imports once, ~ms per
start); ``--spawn`` runs each as a real ``eagle-data extract`` process instead (slower:
seconds of imports per start). Prints a JSON summary; exit status 0 iff everything matched.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # tiny model (benchmarks.tiny_targets) + offline tokenizer helpers

import torch  # noqa: E402
from eagle_data.extract.config import ExtractConfig
from eagle_data.extract.signals import ExtractionInterrupted
from eagle_data.extract.run import run_extract  # noqa: E402
from eagle_data.extract.resume import load_progress
from eagle_data.format.layout import index_part  # noqa: E402
from eagle_data.format.schema import decode_tensors  # noqa: E402


def make_fixture(work: Path, samples: int, seed: int = 0) -> tuple[Path, Path]:
    """Tiny model folder + JSONL of ``samples`` good chats (varied lengths) and a few bad rows."""
    from templates import TEMPLATES_DIR, family_tokenizer
    from tiny import tiny_llama

    model = work / "model"
    if not (model / "config.json").exists():
        tiny_llama().save_pretrained(model)
        family_tokenizer(TEMPLATES_DIR / "smollm2.jinja").save_pretrained(model)
    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog hello there how are you fine thank".split()
    rows = []
    for i in range(samples):
        q = " ".join(rng.choice(words) for _ in range(rng.randint(2, 20)))
        a = " ".join(rng.choice(words) for _ in range(rng.randint(2, 40)))
        rows.append({"id": f"c{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
        if i % 12 == 5:  # bad rows interleaved: skips must be recorded exactly once across kills
            rows.append({"id": f"bad{i}", "conversations": [{"from": "human", "value": "only a question"}]})
    data = work / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data


def config(out: Path, model: Path, data: Path, shard_max_samples: int, front: str = "thread") -> ExtractConfig:
    return ExtractConfig(out=str(out), model=str(model), data=str(data), num_samples=None, dtype="float32",
                         aux_layer_ids=[1, 3, 5], shard_max_samples=shard_max_samples, batch_tokens=4096,
                         max_batch_size=1, sort_window=8, front=front, progress=False)


class _Forked:
    """A forked child running ``run_extract`` (Popen-like: ``pid``, ``poll()``, ``returncode``)."""

    def __init__(self, cfg: ExtractConfig):
        self.returncode = None
        self.pid = os.fork()
        if self.pid == 0:
            code = 0
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                run_extract(cfg)
            except ExtractionInterrupted:
                code = 130
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self):
        while self.poll() is None:
            time.sleep(0.002)
        return self.returncode


def start(cfg: ExtractConfig, spawn: bool):
    if not spawn:
        return _Forked(cfg)
    cmd = [sys.executable, "-m", "eagle_data.cli.main", "extract", "--out", cfg.out, "--model", cfg.model,
           "--data", cfg.data, "--num_samples", "null", "--dtype", cfg.dtype, "--aux_layer_ids", "[1, 3, 5]",
           "--shard_max_samples", str(cfg.shard_max_samples), "--batch_tokens", str(cfg.batch_tokens),
           "--max_batch_size", str(cfg.max_batch_size), "--sort_window", str(cfg.sort_window),
           "--front", cfg.front, "--progress", "false"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _tars(out: Path) -> set[str]:
    return {p.name for p in out.glob("*.tar")}


def _wait_for_new_shard(proc, out: Path, before: set[str], timeout: float) -> bool:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end and proc.poll() is None:
        if _tars(out) - before:
            return True
        time.sleep(0.002)
    return False


def leftovers(out: Path) -> list[str]:
    """Temporaries, and shards / index parts on disk that rank 0's progress does not list."""
    prog = load_progress(out, 0) or {"shards": []}
    listed = {s["name"] for s in prog["shards"]}
    bad = [str(p.relative_to(out)) for p in out.rglob("*.tmp")]
    bad += [p.name for p in out.glob("*.tar") if p.name not in listed]
    bad += [f"index/{p.name}" for p in (out / "index").glob("*.parquet") if p.name[:-8] + ".tar" not in listed]
    bad += [f"missing {n}" for n in listed if not (out / n).exists() or not index_part(out, n).exists()]
    return bad


def read_dataset(out: Path) -> tuple[dict, dict, dict]:
    """``{key: (tensors, meta)}``, ``{key: index row without 'shard'}``, manifest."""
    import pyarrow.parquet as pq
    import tarfile

    m = json.loads((out / "manifest.json").read_text())
    samples: dict = {}
    for s in m["shards"]:
        with tarfile.open(out / s["name"]) as tf:
            for mem in tf.getmembers():
                key, ext = mem.name.split(".", 1)
                samples.setdefault(key, []).append((ext, tf.extractfile(mem).read()))
    out_s = {}
    for key, parts in samples.items():
        d = dict(parts)
        assert len(parts) == 2, f"{key}: {len(parts)} members (duplicate?)"
        out_s[key] = (decode_tensors(d["safetensors"], key), json.loads(d["json"]))
    rows = {r["key"]: {k: v for k, v in r.items() if k != "shard"} for r in pq.read_table(out / "index.parquet").to_pylist()}
    return out_s, rows, m


def compare(ref: Path, run: Path) -> list[str]:
    """Differences between two finished datasets (empty = identical keys, bits, index, skips)."""
    (a, ia, ma), (b, ib, mb) = read_dataset(ref), read_dataset(run)
    diffs = []
    if sorted(a) != sorted(b):
        diffs.append(f"keys differ: only ref {sorted(set(a) - set(b))[:5]}, only run {sorted(set(b) - set(a))[:5]}")
    if mb["num_samples"] != len(b):
        diffs.append(f"manifest num_samples {mb['num_samples']} != {len(b)} stored")
    for k in sorted(set(a) & set(b)):
        (ta, ja), (tb, jb) = a[k], b[k]
        for f in ta:
            x, y = ta[f], tb[f]
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(
                x.view(torch.uint8) if x.is_floating_point() else x, y.view(torch.uint8) if y.is_floating_point() else y)
            if not same:
                diffs.append(f"{k}: {f} not bit-identical")
        if ja != jb:
            diffs.append(f"{k}: metadata differs")
    if ia != ib:
        diffs.append("index rows differ")
    if ma["skip_counts"] != mb["skip_counts"]:
        diffs.append(f"skip counts differ: {ma['skip_counts']} vs {mb['skip_counts']}")
    return diffs


def _front_children(work: Path) -> list[int]:
    """Live front processes (``--front process``) of runs into ``work`` (their command line names the
    front's entry point; their parent's names ``work``, or they were orphaned: parent 1 or gone)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes()
            if not d.name.isdigit() or b"front_process import child_main" not in cmd or int(d.name) == os.getpid():
                continue
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes() if ppid > 1 else b""
            if ppid <= 1 or str(work).encode() in parent or not parent:
                found.append(int(d.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def kill_resume(work: Path, kills: int = 10, samples: int = 50, terms: int = 2, seed: int = 0,
                spawn: bool = False, log=print, front: str = "thread") -> dict:
    from eagle_data.tools.verify import verify_dataset

    if not spawn:
        torch.set_num_threads(1)  # before this process's first torch op: no OpenMP pool exists when we fork
    rng = random.Random(seed)
    model, data = make_fixture(work, samples, seed)
    shard_max = max(1, samples // (3 * (kills + terms)))  # >= 3 shards per interruption: margin to finish
    ref, run = work / "ref", work / "run"
    t0 = time.monotonic()
    p = start(config(ref, model, data, shard_max, front), spawn)
    first_shard = None
    while p.poll() is None:
        if first_shard is None and _tars(ref):
            first_shard = time.monotonic() - t0
        time.sleep(0.002)
    t_ref = time.monotonic() - t0
    assert p.returncode == 0, f"reference run failed ({p.returncode})"
    n_shards = len(json.loads((ref / "manifest.json").read_text())["shards"])
    t_shard = max((t_ref - (first_shard or 0)) / max(n_shards - 1, 1), 0.005)
    log(f"reference: {n_shards} shards of <= {shard_max} samples in {t_ref:.2f} s "
        f"(first shard after {first_shard or 0:.2f} s, ~{t_shard * 1e3:.0f} ms/shard)")
    plan = ["kill"] * kills + [("term", "int")[i % 2] for i in range(terms)]
    rng.shuffle(plan)
    events = []
    for what in plan:
        before = _tars(run)
        t_start = time.monotonic()
        p = start(config(run, model, data, shard_max, front), spawn)
        # each wait ends early at the next new shard: timed from the reference run alone, a run on a
        # loaded machine got through every remaining shard before its kill (9 of 10 kills delivered)
        if what == "kill" and rng.random() < 0.25:  # startup, resume repair or the first shard
            _wait_for_new_shard(p, run, before, rng.uniform(0, (first_shard or 0) + t_shard))
        elif not _wait_for_new_shard(p, run, before, timeout=120):
            events.append({"event": what, "result": f"child exited first ({p.poll()})"})
            log(json.dumps(events[-1]))
            break
        else:
            _wait_for_new_shard(p, run, _tars(run), rng.uniform(0, t_shard))
        sig = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}[what]
        alive = p.poll() is None
        if alive:
            os.kill(p.pid, sig)
        code = p.wait()
        prog = load_progress(run, 0)
        ev = {"event": what, "after_s": round(time.monotonic() - t_start, 3), "delivered": alive, "exit": code,
              "shards_listed": len(prog["shards"]) if prog else 0}
        if what != "kill" and alive:
            ev["clean"] = not leftovers(run)
            # SIGTERM: dies by the signal after cleanup; SIGINT: KeyboardInterrupt (130 in a fork, a
            # traceback and 1 from the CLI)
            ev["expected_exit"] = code == -signal.SIGTERM if what == "term" else code in (-signal.SIGINT, 130, 1)
        events.append(ev)
        log(json.dumps(ev))
        if not alive:
            break
    p = start(config(run, model, data, shard_max, front), spawn)
    final_code = p.wait()
    kills_done = sum(e["event"] == "kill" and e.get("delivered", False) for e in events)
    diffs = compare(ref, run) if final_code == 0 else [f"final resume failed ({final_code})"]
    rep = verify_dataset(run) if final_code == 0 else None
    t_end = time.monotonic() + 5
    while (orphans := _front_children(work)) and time.monotonic() < t_end:  # a front outlives its parent briefly
        time.sleep(0.1)
    summary = {
        "samples": len(read_dataset(ref)[0]), "shards": n_shards, "kills": kills_done,
        "interruptions": sum(e["event"] != "kill" and e.get("delivered", False) for e in events),
        "interruptions_clean": all(e.get("clean", True) and e.get("expected_exit", True) for e in events),
        "final_exit": final_code, "leftovers": leftovers(run), "front": front, "front_orphans": orphans,
        "diffs": diffs[:20],
        "verify_ok": bool(rep and rep.ok), "verify_problems": rep.problems[:10] if rep else None,
        "seconds": round(time.monotonic() - t0, 1),
        "undelivered": [e for e in events if not e.get("delivered", False)],
    }
    summary["ok"] = (kills_done >= kills and summary["interruptions_clean"] and final_code == 0
                     and not diffs and not summary["leftovers"] and summary["verify_ok"] and not orphans)
    return summary


def main() -> int:
    import logging

    import transformers

    transformers.utils.logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING, format="  [child %(process)d] %(levelname)s %(message)s")
    logging.getLogger("eagle_data.extract.conversations").setLevel(logging.ERROR)  # the planted bad rows
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=10, help="SIGKILLs during the run")
    ap.add_argument("--samples", type=int, default=50, help="good chats in the test data (a few bad rows are added)")
    ap.add_argument("--terms", type=int, default=2, help="clean SIGTERM/SIGINT interruptions")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spawn", action="store_true", help="run real `eagle-data extract` processes instead of forks")
    ap.add_argument("--front", default="thread", choices=["thread", "process"],
                    help="where the extraction's front runs (extract --front)")
    ap.add_argument("--work", default=None, help="working directory (default: a fresh temporary one)")
    a = ap.parse_args()
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="kill_resume_"))
    work.mkdir(parents=True, exist_ok=True)
    summary = kill_resume(work, a.kills, a.samples, a.terms, a.seed, a.spawn, log=lambda s: print(s, file=sys.stderr),
                          front=a.front)
    summary["work"] = str(work)
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
