"""scripts/tau_bench.sh refuses what it would otherwise skip unsaid: a misspelt phase, MINUTES that
are not increasing numbers; MINUTES written another way (0.050, 1e-1) name the checkpoints the
training writes ({m:g}); an eval with no checkpoint at all fails instead of printing an empty table."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, **env):
    e = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OUT": str(tmp_path / "tau"),
         "PYTHONPATH": os.pathsep.join(sys.path), **env}
    return subprocess.run(["bash", str(ROOT / "scripts" / "tau_bench.sh")], env=e, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("env,msg", [({"PHASES": "evl"}, "PHASES: unknown phase 'evl'"),
                                     ({"PHASES": "eval", "MINUTES": "2 1"}, "MINUTES: numbers > 0, increasing"),
                                     ({"PHASES": "eval", "MINUTES": "1 1"}, "MINUTES: numbers > 0, increasing"),
                                     ({"PHASES": "eval", "MINUTES": "0 1"}, "MINUTES: numbers > 0, increasing"),
                                     ({"PHASES": "eval", "MINUTES": "two"}, "MINUTES: numbers > 0, increasing"),
                                     ({"PHASES": "eval", "MINUTES": "0.1 0.10000001"}, "each once to 6 significant"),
                                     ({"PHASES": " \t\n"}, "PHASES: empty")])
def test_bad_phases_and_minutes_are_refused(tmp_path, env, msg):
    r = _run(tmp_path, **env)
    assert r.returncode == 2 and msg in r.stderr, (r.returncode, r.stdout, r.stderr)


def test_minutes_name_the_checkpoints_as_training_writes_them_and_no_checkpoint_fails(tmp_path):
    r = _run(tmp_path, PHASES="eval", MINUTES="0.050 1e-1")
    assert r.returncode == 1 and "eval: no checkpoint to evaluate" in r.stderr
    assert "at_0.05min.ckpt" in r.stdout and "at_0.1min.ckpt" in r.stdout and "0.050" not in r.stdout
    r = _run(tmp_path, PHASES="\teval\n", MINUTES="1")  # any white space around phases: eval still runs
    assert r.returncode == 1 and "at_1min.ckpt" in r.stdout and "no checkpoint to evaluate" in r.stderr
