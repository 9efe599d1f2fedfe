"""What a dead process costs, and what checkpointing costs (issue: many processes).

    make bench-recovery                      # 3 kills of a 2-process tiny run, then the
    python bench/recovery.py --kills 5        # checkpoint overhead; figures, never asserts

Recovery: `common.launch` runs PRESET as 2 processes x 4 simulated CPU devices. After the
group reaches a random step, one process (chosen at random) gets SIGKILL; the launcher
restarts the group, which resumes from its last complete checkpoint, and prints
"launch: recovered in N s": from the death to the first step of the new group (start-up,
jax.distributed, compile, restore). Repeated --kills times in the same run.

Overhead: the same preset in one process for --overhead-steps steps, with an asynchronous
save every --every steps and with none, alternating --rounds times; ms/step is the
step-weighted mean of the logged intervals after the first.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.observe import mean_ms_per_step  # noqa: E402

RECOVERED = re.compile(r"launch: recovered in ([\d.]+) s")
STEP = re.compile(r"^(?:\[\d+\] )?step (\d+) \|")


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []


def recovery(preset: list[str], kills: int, every: int, seed: int) -> list[float]:
    """Seconds from each kill to the first step after it, as the launcher measured them."""
    rng = random.Random(seed)
    run = tempfile.mkdtemp(prefix="bench-recovery-")
    steps = 12 * (kills + 1) + every
    cmd = [sys.executable, "-m", "common.launch", "--nproc", "2", "--cpu-devices", "4",
           "--max-restarts", str(kills), "--", sys.executable, "train_dense.py", *preset,
           "--run-dir", run, "--train.steps", str(steps), "--train.log-every", "1",
           "--train.eval-every", "100000", "--train.sample-tokens", "0",
           "--checkpoint.every", str(every)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # the launcher sets each process's devices
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    # Each kill lands a few steps after the group's first step (so past a save, sometimes).
    times, done, target = [], 0, None
    try:
        for line in p.stdout:
            if m := RECOVERED.search(line):
                times.append(float(m[1]))
                print(f"  kill {len(times)}: recovered in {m[1]} s", flush=True)
                target = None
            elif (m := STEP.match(line)) and len(times) == done and done < kills:
                step = int(m[1])
                if target is None:
                    target = step + rng.randint(2, every + 3)
                if step >= target:
                    victims = _children(p.pid)
                    if len(victims) == 2:
                        victim = rng.choice(victims)
                        print(f"  kill {done + 1}: SIGKILL to pid {victim} at step {step}", flush=True)
                        os.kill(victim, signal.SIGKILL)
                        done += 1
        p.wait(timeout=600)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    if p.returncode != 0:
        raise SystemExit(f"bench-recovery: the launcher exited {p.returncode}; run it by hand: "
                         + " ".join(cmd))
    return times


def ms_per_step(preset: list[str], steps: int, every: int) -> float:
    run = tempfile.mkdtemp(prefix="bench-ckpt-")
    cmd = [sys.executable, "train_dense.py", *preset, "--run-dir", run, "--train.steps", str(steps),
           "--train.log-every", "5", "--train.eval-every", "100000", "--train.sample-tokens", "0",
           "--checkpoint.every", str(every), "--quiet"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench-recovery: {' '.join(cmd)} failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return mean_ms_per_step([json.loads(line) for line in f], 0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", help="a train_dense.py preset, then any flags")
    ap.add_argument("--flags", default="", help="extra train_dense.py flags, one string")
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    ap.add_argument("--overhead-steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    preset = [a.preset, *a.flags.split()]
    if a.kills:
        print(f"recovery: {' '.join(preset)}, 2 processes x 4 CPU devices, checkpoint every "
              f"{a.every} steps, {a.kills} kills", flush=True)
        t = recovery(preset, a.kills, a.every, a.seed)
        print(f"recovery: {', '.join(f'{x:.1f}' for x in t)} s; median {statistics.median(t):.1f} s "
              f"(death to the first step of the new group)", flush=True)
    if a.rounds:
        print(f"checkpoint overhead: {' '.join(preset)}, 1 process, {a.overhead_steps} steps, "
              f"save every {a.every} vs never, {a.rounds} alternating rounds", flush=True)
        saving, never = [], []
        for i in range(a.rounds):
            saving.append(ms_per_step(preset, a.overhead_steps, a.every))
            never.append(ms_per_step(preset, a.overhead_steps, 0))
            print(f"  round {i + 1}: {saving[-1]:.0f} ms/step saving, {never[-1]:.0f} ms/step never",
                  flush=True)
        s, n = statistics.median(saving), statistics.median(never)
        print(f"checkpoint overhead: {s:.0f} vs {n:.0f} ms/step (medians): "
              f"{100 * (s / n - 1):+.1f}% per step with a save every {a.every}", flush=True)


if __name__ == "__main__":
    main()
