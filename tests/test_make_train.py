"""The README's first command as a user runs it: `make train` (the `tiny` preset, nothing
changed), then `make eval` on what it saved. The model it trains beats chance on the shipped
task; a second `make train` resumes instead of training again.

The longest test of the suite (300 steps of the 5M-parameter model, ~6 min on two free cores):
conftest.py starts it first so the other worker runs the rest meanwhile."""
import json
import os
import subprocess
import sys

import pytest

from tests.spawn import LEGACY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.timeout(3600)  # `make train` at XLA's default level: ~6 min here


def run(*argv):
    # One CPU device, as on the user's machine: not the 8 that conftest.py simulates, and
    # XLA's own optimisation level and code generator, not the suite's (level 0 halves this
    # run's speed).
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(
        ("--xla_force_host_platform_device_count", "--xla_backend_optimization_level", LEGACY)))
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=3600, env=dict(os.environ, XLA_FLAGS=flags))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def test_make_train_then_make_eval(tmp_path):
    pytest.importorskip("lm_eval")
    rd = str(tmp_path / "tiny")
    out = run("train_dense.py", "tiny", "--run-dir", rd)     # make train, in a folder of its own
    recs = [json.loads(line) for line in open(os.path.join(rd, "metrics.jsonl"))]
    loss = {r["step"]: r["loss"] for r in recs if "loss" in r}
    evals = {r["step"]: r["eval_loss"] for r in recs if "eval_loss" in r}
    # The README's figures, with room for another machine's float32 rounding: the loss starts
    # at ln 4096 = 8.32 (8.35 measured), steps 210-300 average 3.81, eval 4.96/4.49/4.30.
    assert max(loss) == 300 and abs(loss[1] - 8.35) < 0.1, loss.get(1)
    late = [loss[s] for s in range(210, 301) if s in loss]
    assert 3.5 < sum(late) / len(late) < 4.1, late
    assert sorted(evals) == [100, 200, 300] and evals[100] > evals[200] > evals[300]
    assert evals[300] < 4.6, evals
    assert "sample:" in out

    # make eval RUN=runs/tiny: nextline is four-way multiple choice (chance 0.25) over its
    # 500 examples; the binomial spread at chance is 0.019, and 0.336 was measured (0.330
    # from the same run on 8 simulated devices).
    run("train_dense.py", "eval", "--run-dir", rd, "--tasks", "nextline")
    res = json.load(open(os.path.join(rd, "eval", "nextline.json")))
    assert res["step"] == 300 and res["examples"]["effective"] == 500
    acc = res["metrics"]["acc_norm,none"]
    assert acc > 0.25 + 3 * 0.019, res["metrics"]

    again = run("train_dense.py", "tiny", "--run-dir", rd)
    assert "resumed from step 300" in again
