"""Real processes over loopback (gloo collectives): equality, hybrid mesh, kills, preemption."""
import json
import os
import random
import re
import signal
import subprocess
import sys
import sysconfig
import time

import jax
import numpy as np
import pytest
from etils import epath

import train_dense as td
from common.checkpoint import Checkpointer
from common.data import prepare
from common.mesh import make_mesh
from tests.spawn import run, spawn, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 10
FLAGS = ["--model.vocab-size", "512", "--model.d-model", "32", "--model.n-layers", "2",
         "--model.n-heads", "4", "--model.n-kv-heads", "2", "--model.head-dim", "8",
         "--model.d-ff", "64", "--train.batch-size", "8", "--train.seq-len", "32",
         "--train.log-every", "1", "--train.eval-every", "1000", "--train.sample-tokens", "0",
         "--train.warmup-steps", "2", "--train.lr", "3e-3", "--checkpoint.every", "2"]


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, f) for f in ("argparse.py", "textwrap.py", "shlex.py")]
    return prepare(files, str(tmp_path_factory.mktemp("d") / "prepared"), vocab_size=400)


# train_moe.py: 4 experts, so expert=4 puts one expert per device and tokens cross processes
MOE = ["tiny-moe", *FLAGS, "--model.n-experts", "4", "--model.d-ff", "32"]


def trainer_args(data_path, run_dir, *extra, preset=("tiny", *FLAGS)):
    return [*preset, "--data.path", data_path, "--run-dir", str(run_dir),
            "--train.steps", str(STEPS), *extra]


def env(**kw):
    # the launcher (or the test) says how many devices a process has
    return dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags()) | kw


def launcher(data_path, run_dir, *extra, nproc=2, restarts=3, script="train_dense.py",
             preset=("tiny", *FLAGS)):
    cmd = [sys.executable, "-m", "common.launch", "--nproc", str(nproc), "--cpu-devices",
           str(8 // nproc), "--max-restarts", str(restarts), "--", sys.executable,
           script, *trainer_args(data_path, run_dir, *extra, preset=preset)]
    return spawn(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                 text=True, start_new_session=True)


def finish(p, timeout=600):  # a bound for a loaded machine (~2.5 min cold on a quiet one)
    out, _ = p.communicate(timeout=timeout)
    return out


def single_process(data_path, run_dir, *extra, script="train_dense.py", preset=("tiny", *FLAGS)):
    r = subprocess.run([sys.executable, script,
                        *trainer_args(data_path, run_dir, *extra, preset=preset)], cwd=ROOT,
                       timeout=600,
                       env=env(XLA_FLAGS=xla_flags(8)),
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def losses(run_dir):
    """Loss per step; a restarted run logs retraced steps again: they must agree."""
    out = {}
    for line in epath.Path(run_dir, "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert out.setdefault(rec["step"], rec["loss"]) == rec["loss"]
    return [out[s] for s in sorted(out)]


def final_params(run_dir, data_path):
    cfg = td.cli(trainer_args(data_path, run_dir))
    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh), Checkpointer(str(run_dir), cfg.checkpoint) as ckpt:
        assert ckpt.latest_step() == STEPS
        state = ckpt.restore(STEPS, td.train_state(cfg, mesh).abstract())
    return jax.device_get(state["params"])


def assert_bitwise(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def reference(data_path, tmp_path_factory):
    """An uninterrupted 2-process run: what every interrupted run must reproduce exactly."""
    run = tmp_path_factory.mktemp("ref")
    p = launcher(data_path, run)
    out = finish(p)
    assert p.returncode == 0, out
    return run


def child_pids(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def process_with_id(launcher_pid, jax_id):
    for c in child_pids(launcher_pid):
        with open(f"/proc/{c}/environ", "rb") as f:
            if f"JAX_PROCESS_ID={jax_id}".encode() in f.read().split(b"\0"):
                return c
    raise AssertionError("no such child")


def run_until_step(p, step):
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.startswith(f"step {step} |"):
            return seen
    raise AssertionError("run ended before step %d:\n%s" % (step, "".join(seen)))


def test_two_processes_equal_one_process(reference, data_path, tmp_path):
    single_process(data_path, tmp_path)
    np.testing.assert_allclose(losses(reference), losses(tmp_path), rtol=1e-5)
    assert len(losses(reference)) == STEPS


def test_hybrid_mesh_over_two_processes_equals_single_process(data_path, tmp_path):
    p = launcher(data_path, tmp_path / "hybrid", "--mesh.dcn-data", "2", "--mesh.fsdp", "-1")
    out = finish(p)
    assert p.returncode == 0, out
    assert "mesh data=2 fsdp=4" in out  # data: 2 slices (dcn) x 1 inside each (ici)
    single_process(data_path, tmp_path / "one", "--mesh.data", "2", "--mesh.fsdp", "4")
    np.testing.assert_allclose(losses(tmp_path / "hybrid"), losses(tmp_path / "one"), rtol=1e-5)


def test_moe_expert_parallel_over_two_processes_equals_one_process(data_path, tmp_path):
    # expert=4 x fsdp=2 over 2 processes of 4 devices: the all-to-all that sends tokens to
    # their experts crosses the process boundary, over gloo.
    mesh = ["--mesh.expert", "4", "--mesh.fsdp", "2"]
    p = launcher(data_path, tmp_path / "two", *mesh, script="train_moe.py", preset=MOE)
    out = finish(p)
    assert p.returncode == 0, out
    assert "2 process(es)" in out
    single_process(data_path, tmp_path / "one", *mesh, script="train_moe.py", preset=MOE)
    two, one = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert len(two) == STEPS
    np.testing.assert_allclose(two, one, rtol=1e-5)


def test_pipeline_stages_over_two_processes_survive_a_kill_and_equal_one_process(data_path,
                                                                                tmp_path):
    # --mesh.dcn-stage 2: one stage per process, so the collective-permute that hands each
    # microbatch to the next stage crosses the process boundary (over gloo); the circular
    # schedule (2 chunks of 1 layer per stage). A kill -9 of process 1 mid-run: the launcher
    # restarts both, they restore the pipelined state, and the losses are the one-process run's.
    pipe = ["--model.n-layers", "4", "--train.microbatches", "2", "--train.pipeline-repeats", "2"]
    p = launcher(data_path, tmp_path / "two", *pipe, "--mesh.dcn-stage", "2", "--mesh.fsdp", "-1")
    run_until_step(p, 5)
    os.kill(process_with_id(p.pid, 1), signal.SIGKILL)
    out = finish(p)
    assert p.returncode == 0, out
    assert "pipeline | 2 stages x 2 chunk(s) of 1 layers" in out, out
    assert "killed by SIGKILL; restarting all 2 processes" in out and "resumed from step" in out
    one = single_process(data_path, tmp_path / "one", *pipe, "--mesh.stage", "2", "--mesh.fsdp",
                         "4")
    assert "mesh stage=2 data=1 fsdp=4" in one, one
    two = losses(tmp_path / "two")
    assert len(two) == STEPS
    np.testing.assert_allclose(two, losses(tmp_path / "one"), rtol=1e-5)


@pytest.mark.parametrize("every", ["2", "1"], ids=["kill-between-saves", "kill-during-save"])
def test_kill_9_restarts_the_group_and_ends_bit_identical(reference, data_path, tmp_path, every):
    p = launcher(data_path, tmp_path, "--checkpoint.every", every)
    run_until_step(p, random.Random(every).randint(3, 7))
    os.kill(process_with_id(p.pid, 1), signal.SIGKILL)
    out = finish(p)
    assert p.returncode == 0, out
    assert "killed by SIGKILL; restarting all 2 processes" in out
    assert "resumed from step" in out and "launch: recovered in" in out
    assert_bitwise(final_params(tmp_path, data_path), final_params(reference, data_path))
    assert losses(tmp_path) == losses(reference)


def test_kill_9_with_the_run_in_a_bucket_ends_bit_identical(reference, data_path, gcs):
    # Each process writes its own shards into the bucket and the restarted group reads them
    # back: what a TPU pod without a shared disk does (see conftest.py for the fake bucket).
    run = f"{gcs}/two-processes"
    p = launcher(data_path, run)
    run_until_step(p, 5)
    os.kill(process_with_id(p.pid, 0), signal.SIGKILL)
    out = finish(p)
    assert p.returncode == 0, out
    assert "resumed from step" in out and "launch: recovered in" in out
    assert_bitwise(final_params(run, data_path), final_params(reference, data_path))
    assert losses(run) == losses(reference)


def test_sigterm_to_the_launcher_saves_exits_0_and_resumes_exactly(reference, data_path,
                                                                    tmp_path):
    p = launcher(data_path, tmp_path, "--checkpoint.every", "0")
    run_until_step(p, 3)
    p.send_signal(signal.SIGTERM)
    out = finish(p)
    assert p.returncode == 0, out
    assert "SIGTERM: saved step" in out and "restarting" not in out
    saved = [int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
    assert len(saved) == 1 and 3 <= saved[0] < STEPS
    p = launcher(data_path, tmp_path, "--checkpoint.every", "0")
    out = finish(p)
    assert p.returncode == 0 and f"resumed from step {saved[0]}" in out, out
    assert_bitwise(final_params(tmp_path, data_path), final_params(reference, data_path))


@pytest.mark.parametrize("case", ["wrong-address", "missing-process"])
def test_unreachable_coordinator_fails_fast_and_says_what_to_check(data_path, tmp_path, case):
    # wrong-address: process 1 looks for a coordinator nobody runs; missing-process: process 0
    # is the coordinator but process 1 never comes.
    pid = "1" if case == "wrong-address" else "0"
    e = env(JAX_COORDINATOR_ADDRESS="127.0.0.1:9", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=pid,
            JAX_TRAINERS_INIT_TIMEOUT="10")
    if case == "missing-process":
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            e["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "train_dense.py", *trainer_args(data_path, tmp_path)],
                       cwd=ROOT, env=e, capture_output=True, text=True, timeout=240)
    assert time.monotonic() - t0 < 150  # the 10 s set, not the default 300 (17 s here, quiet)
    assert r.returncode != 0
    assert "coordinator 127.0.0.1:" in r.stderr and "every one of the 2 processes" in r.stderr
    if case == "wrong-address":   # a Python error with the fix, not a C++ abort
        assert r.returncode == 2 and "no coordinator answered" in r.stderr, r.stderr


def test_bench_recovery_reports_its_figures(data_path):
    # `make bench-recovery` on a small model: one kill, one round of the overhead comparison.
    flags = " ".join(FLAGS[:-2] + ["--data.path", data_path])  # its own --checkpoint.every
    r = run([sys.executable, "bench/recovery.py", "--flags", flags, "--kills", "1", "--every",
             "2", "--overhead-steps", "10", "--rounds", "1"], timeout=600, cwd=ROOT, env=env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"recovery: [\d.]+ s; median [\d.]+ s", r.stdout), r.stdout
    assert re.search(r"checkpoint overhead: \d+ vs \d+ ms/step \(medians\): [+-][\d.]+%", r.stdout)


def test_eval_tasks_over_two_processes_equal_make_eval(data_path, tmp_path):
    """--train.eval-tasks in a 2-process MoE run whose experts span both processes: every
    process runs the harness in step, and the scores equal `make eval` of the saved step."""
    pytest.importorskip("lm_eval")
    import train_moe as tm
    from common import eval as ev
    p = launcher(data_path, tmp_path, "--mesh.expert", "4", "--mesh.fsdp", "2",
                 "--train.eval-tasks", "nextline", "--train.eval-tasks-limit", "8",
                 script="train_moe.py", preset=MOE)
    out = finish(p)
    assert p.returncode == 0, out
    assert out.count(f"eval step {STEPS} | nextline | acc ") == 1, out  # printed once
    rec = [json.loads(r) for r in epath.Path(tmp_path, "metrics.jsonl").read_text().splitlines()
           if "lm_eval" in r]
    assert [r["step"] for r in rec] == [STEPS]
    theirs = ev.evaluate(ev.EvalConfig(run_dir=str(tmp_path), limit=8), tm)["nextline"]
    assert (rec[0]["lm_eval/nextline/acc"], rec[0]["lm_eval/nextline/acc_norm"]) == (
        theirs["acc"], theirs["acc_norm"])


@pytest.mark.parametrize("script, args", [
    ("train_dense.py", ["tiny", "--train.steps", "3", "--train.sample-tokens", "16"]),
    ("train_moe.py", ["tiny-moe", "--train.steps", "3", "--train.sample-tokens", "16"]),
    ("train_grpo.py", ["tiny", "--grpo.steps", "2", "--warm.max-steps", "4"])],
    ids=["dense", "moe", "grpo"])
def test_presets_end_cleanly_on_two_processes(data_path, tmp_path, script, args):
    """The presets' defaults (the end sample, the held-out answers, the summary) over 2
    processes x 4 devices: exit 0, printed once, and MFU against a peak measured once, by
    process 0 (its value is not asserted: the suite's other worker shares the cores). The
    sample is 16 tokens, not 96: its full forwards over 8 padded rows cost ~6 steps' compute
    at 96 (20-40 s here), and what is tested, the path over two processes, is the same."""
    data = [] if script == "train_grpo.py" else ["--data.path", data_path]
    cmd = [sys.executable, "-m", "common.launch", "--nproc", "2", "--cpu-devices", "4",
           "--max-restarts", "0", "--", sys.executable, script, *args, *data,
           "--run-dir", str(tmp_path)]
    r = run(cmd, timeout=600, cwd=ROOT, env=env())
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count(f"run {tmp_path}: done") == 1, out
    if script == "train_grpo.py":
        assert out.count("(expected ") == 4, out  # the held-out answers, once
    else:
        assert out.count("sample:") == 1, out
    assert re.search(r"MFU \d+\.\d%", out), out  # the summary's, at least
    # The compile line names the peak's source once (GRPO's loop compiles as it goes).
    assert out.count("measured f32 matmul, host") == (script != "train_grpo.py"), out


@pytest.mark.parametrize("rc", [2, 3, 1])
def test_launcher_retries_only_what_a_restart_can_fix(rc):
    """2: bad input, 3: a diverged run (its last good state is saved): both would fail the
    same way again, so the group is not restarted; any other failure is."""
    r = run([sys.executable, "-m", "common.launch", "--nproc", "2", "--max-restarts", "1", "--",
             sys.executable, "-c", f"import sys; sys.exit({rc})"], timeout=120, cwd=ROOT,
            env=env())
    assert r.returncode == rc, r.stdout + r.stderr
    assert ("restarting all 2 processes" in r.stdout) == (rc == 1), r.stdout


def test_a_hung_launch_dies_with_its_tree_at_the_deadline_and_at_the_end_of_its_test():
    """tests/spawn.py, what keeps a hung run from outliving its test: a parent whose child sits
    in a session of its own (as the launcher's trainers do) and sleeps."""
    from tests import spawn as sp
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(600)'], start_new_session=True); print('up', flush=True);"
            " time.sleep(600)")
    for deadline in (3, 600):
        p = sp.spawn([sys.executable, "-c", code], deadline=deadline, stdout=subprocess.PIPE,
                     text=True)
        assert p.stdout.readline() == "up\n"
        time.sleep(0.5)
        tree = [p.pid, *sp.descendants(p.pid)]
        assert len(tree) == 2, tree
        if deadline == 600:
            sp.kill_spawned()  # what conftest.py does after every test
        assert p.wait(timeout=30) == -signal.SIGKILL
        for _ in range(100):  # the orphaned child is reaped by init, not by us
            if not os.path.exists(f"/proc/{tree[1]}") or "Z" in open(
                    f"/proc/{tree[1]}/stat").read().split()[2]:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the child {tree[1]} outlived its parent")
