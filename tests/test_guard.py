"""A run that goes wrong stops at once, says why, and keeps its last good state.

A diverging run (a learning rate of 1e4) stops within a few steps with exit code 3, the newest
checkpoint is finite and is the state before the bad step, and a resume with a sane learning
rate goes on from it; --train.max-bad-steps N skips N bad updates and stops on the next. Every
numeric flag of every trainer is checked before anything compiles: a table generated from
the config dataclasses feeds each one zero, a negative, NaN and a huge value, and wherever
the value is outside the flag's range the run must exit 2, name the flag, and print no
traceback. A run directory that cannot be written is refused the same way.
"""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import train_dense as td
import train_grpo as tg
import train_moe as tm
from common import train
from common.checkpoint import CheckpointConfig, Checkpointer
from tests.test_train import MODEL, data_path  # noqa: F401  (data_path: a pytest fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(run_dir, data, lr, **train_kw):
    return td.Config(model=MODEL, train=td.TrainConfig(
        steps=12, batch_size=8, seq_len=32, warmup_steps=1, lr=lr, schedule="constant",
        log_every=1, eval_every=100, eval_batches=1, sample_tokens=0, **train_kw),
        data=td.DataConfig(path=data), checkpoint=CheckpointConfig(every=1, keep=20),
        run_dir=str(run_dir))


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def saved(run_dir, step=None):
    with Checkpointer(str(run_dir), CheckpointConfig(async_save=False)) as ckpt:
        steps = ckpt.all_steps()
        cfg = config(run_dir, "", 1.0)
        st = td.train_state(cfg, td.make_mesh(cfg.mesh))
        return steps, jax.device_get(ckpt.restore(step or steps[-1], st.abstract()))


def corrupt(monkeypatch, steps):
    """A bad batch at each of `steps` (1-based): a token id past the vocabulary, whose
    embedding lookup is NaN, as corrupt data would be."""
    real = td.get_batch

    def get_batch(tokens, *, step, seed, **kw):
        b = real(tokens, step=step, seed=seed, **kw)
        if step + 1 in steps and seed == 0:  # the train split (eval draws with seed + 1)
            b = jax.device_put(b.at[0, 3].set(10**6), b.sharding)
        return b
    monkeypatch.setattr(td, "get_batch", get_batch)


def test_a_bad_step_stops_the_run_and_keeps_the_last_good_state(data_path, tmp_path,
                                                                  monkeypatch):
    run, ref = tmp_path / "run", tmp_path / "ref"
    corrupt(monkeypatch, {5})
    with pytest.raises(train.NonFiniteError, match=r"step 5: loss nan, grad_norm nan: not "
                                                   r"finite.*--train.max-bad-steps"):
        td.main(config(run, data_path, 3e-3))
    steps, state = saved(run)
    assert steps == [1, 2, 3, 4]  # nothing of step 5, though every step is a save step
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state))
    monkeypatch.undo()
    # The state before the bad step: four good steps alone end in it, bitwise.
    td.main(dataclasses.replace(config(ref, data_path, 3e-3), train=dataclasses.replace(
        config(ref, data_path, 3e-3).train, steps=4)))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(saved(ref)[1])):
        np.testing.assert_array_equal(a, b)
    # A rerun resumes from it (here with a lower learning rate) and trains to the end.
    again = td.main(config(run, data_path, 1e-3))
    assert again["start_step"] == 4 and again["final_step"] == 12
    assert all(math.isfinite(r["loss"]) for r in records(run) if "loss" in r)


def test_max_bad_steps_skips_that_many_then_stops(data_path, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    corrupt(monkeypatch, {3, 5, 6, 9})
    with pytest.raises(train.NonFiniteError, match=r"step 9: .*\(3 skipped in this run, of 3\)"):
        td.main(config(run, data_path, 3e-3, max_bad_steps=3))
    out = capsys.readouterr().out
    for i, step in enumerate((3, 5, 6), 1):
        assert f"step {step}: loss nan, grad_norm nan: not finite; update skipped ({i} of " \
               "--train.max-bad-steps 3)" in out
    steps, state = saved(run)
    assert steps[-1] == 8 and all(np.isfinite(x).all() for x in jax.tree.leaves(state))
    recs = {r["step"]: r for r in records(run) if "loss" in r}
    assert recs[8]["skipped_steps"] == 3 and recs[4]["skipped_steps"] >= 1
    # A skipped step leaves the parameters as they were: 3 and 4 train on what step 2 left.
    assert recs[3]["nonfinite"] == 1.0 and recs[4]["nonfinite"] == 0.0


def test_a_learning_rate_of_1e4_exits_3_within_a_few_steps(data_path, tmp_path):
    flags = ["--model.vocab-size", "512", "--model.d-model", "32", "--model.n-layers", "2",
             "--model.n-heads", "4", "--model.n-kv-heads", "2", "--model.head-dim", "8",
             "--model.d-ff", "64", "--train.batch-size", "8", "--train.seq-len", "32",
             "--train.steps", "12", "--train.sample-tokens", "0", "--data.path", data_path,
             "--checkpoint.every", "1"]
    r = subprocess.run([sys.executable, "train_dense.py", "tiny", *flags, "--train.lr", "1e4",
                        "--run-dir", str(tmp_path / "r")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "not finite" in r.stderr and "Traceback" not in r.stderr
    bad = int(re.search(r"error: step (\d+):", r.stderr).group(1))
    steps, state = saved(tmp_path / "r")
    assert bad <= 12 and steps[-1] < bad  # what huge steps left is finite, if meaningless
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state))


# ---- every numeric flag, checked before compiling ----------------------------------------


def numeric_flags(cfg, prefix=""):
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            yield from numeric_flags(v, f"{prefix}{f.name}.")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield f"{prefix}{f.name}", type(v)


BAD = {int: ["0", "-1", str(2**40)], float: ["0", "-1", "nan", "1e400"]}
TRAINERS = [(td, "tiny", td.RULES), (tm, "tiny-moe", tm.RULES), (tg, "tiny", tg.RULES)]


def refused(cfg, path: str, value: str, rules: dict) -> bool:
    """Whether `value` is outside the range the trainer declares for `path` (train.RULES, its
    RULES, else the sign of the default; mesh sizes: >= 1 and multiplying to the devices)."""
    v = float(value)
    if path.startswith("mesh."):
        return v == 0 or v >= 2**31
    default = next(d for p, _, d in train._numbers(cfg) if p == path)
    rule = (train.RULES | rules).get(path) or (">= 0" if default == 0 else "> 0")
    return not train._within(v, rule) or v >= 2**31


CASES = [(mod, preset, path, value) for mod, preset, _ in TRAINERS
         for path, typ in numeric_flags(mod.PRESETS[preset][1]) for value in BAD[typ]]


@pytest.mark.parametrize("mod, preset, path, value", CASES,
                         ids=[f"{m.__name__}-{p}={v}" for m, _, p, v in CASES])
def test_every_numeric_flag_is_checked_before_compiling(mod, preset, path, value, tmp_path,
                                                        monkeypatch, capsys):
    if not refused(mod.PRESETS[preset][1], path, value, mod.RULES):
        pytest.skip(f"{value} is a valid --{path}")
    flag = "--" + path.replace("_", "-")
    # Whatever gets past the checks must not start training: fail loudly if it does.
    monkeypatch.setattr(train, "Run", lambda *a, **k: pytest.fail(f"{flag} {value} ran"))
    monkeypatch.setattr(train, "dry_run", lambda *a, **k: pytest.fail(f"{flag} {value} ran"))
    monkeypatch.setattr(sys, "argv", [f"{mod.__name__}.py", preset, flag, value,
                                      "--run-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        train.run_cli(mod.main, mod.cli)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert flag in err and "Traceback" not in err, err


def test_a_run_directory_that_cannot_be_written_is_refused(data_path, tmp_path, monkeypatch,
                                                           capsys):
    (tmp_path / "a-file").write_text("not a folder")
    run = tmp_path / "a-file" / "run"  # even root cannot make a folder inside a file
    monkeypatch.setattr(sys, "argv", ["train_dense.py", "tiny", "--data.path", data_path,
                                      "--run-dir", str(run), "--train.steps", "2"])
    with pytest.raises(SystemExit) as e:
        train.run_cli(td.main, td.cli)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--run-dir {run}: cannot write there" in err, err
    assert "Traceback" not in err
