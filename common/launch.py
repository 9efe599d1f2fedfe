"""Run N local processes as one JAX job, and restart the whole group when one dies.

    python -m common.launch --nproc 2 --cpu-devices 4 -- python train_dense.py tiny ...
    python -m common.launch --nproc 8 --gpus -- python train_dense.py llama3.1-8b ...

Each process gets JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID, which
`common.multislice.initialize` turns into `jax.distributed.initialize`. A collective job cannot lose
a member and go on, so when one process dies (a signal, a non-zero exit) the launcher kills the
others and starts the group again; the trainer resumes from its last complete checkpoint, and
because a batch is a pure function of (seed, step) the resumed run retraces the lost steps exactly.
SIGTERM to the launcher is a preemption, not a failure: it is passed on, every process saves at its
next step boundary and exits 0, and nothing is restarted. Exit codes 2 (bad flags or data, reported
before anything runs) and 3 (the run diverged: a non-finite loss or gradient, and its last good
state is saved) are not retried either: a restart would fail the same way.
"""
import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

STEP_LINE = re.compile(r"^step \d+ \|")


class Group:
    """One attempt: N processes sharing a coordinator, their output relayed line by line."""

    def __init__(self, cmd: list[str], nproc: int, cpu_devices: int, gpus: bool, attempt: int):
        with socket.socket() as s:  # a fresh port per attempt: the old one may be in TIME_WAIT
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.first_step_at: float | None = None
        self.procs = []
        for i in range(nproc):
            env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                       JAX_NUM_PROCESSES=str(nproc), JAX_PROCESS_ID=str(i),
                       JAX_TRAINERS_ATTEMPT=str(attempt), PYTHONUNBUFFERED="1")
            if cpu_devices:
                env["JAX_PLATFORMS"] = "cpu"
                n = "--xla_force_host_platform_device_count"  # this one, not the caller's
                env["XLA_FLAGS"] = " ".join([f for f in env.get("XLA_FLAGS", "").split()
                                             if not f.startswith(n)] + [f"{n}={cpu_devices}"])
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = str(i)
            # start_new_session: a Ctrl-C or SIGTERM to the launcher's terminal group reaches
            # only the launcher, which then decides what the children get.
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, bufsize=1, start_new_session=True)
            self.procs.append(p)
            threading.Thread(target=self._relay, args=(i, p), daemon=True).start()

    def _relay(self, i: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            if self.first_step_at is None and STEP_LINE.match(line):
                self.first_step_at = time.monotonic()
            sys.stdout.write(line if i == 0 else f"[{i}] {line}")
            sys.stdout.flush()

    def poll(self) -> tuple[int, int] | None:
        """(index, exit code) of the first process that failed, else None."""
        return next(((i, p.returncode) for i, p in enumerate(self.procs)
                     if p.poll() not in (None, 0)), None)

    def done(self) -> bool:
        return all(p.poll() == 0 for p in self.procs)

    def signal(self, sig: int) -> None:
        for p in self.procs:
            p.send_signal(sig)  # a no-op for a process already reaped or gone


def run(cmd: list[str], nproc: int, cpu_devices: int = 0, gpus: bool = False,
        max_restarts: int = 3) -> int:
    preempted = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: preempted.set())
    died_at = None
    for attempt in range(max_restarts + 1):
        group = Group(cmd, nproc, cpu_devices, gpus, attempt)
        forwarded = False
        while True:
            time.sleep(0.05)
            if died_at is not None and group.first_step_at is not None:
                print(f"launch: recovered in {group.first_step_at - died_at:.1f} s "
                      f"(death to first step of attempt {attempt})", flush=True)
                died_at = None
            if preempted.is_set() and not forwarded:
                print("launch: SIGTERM: asking every process to save and exit", flush=True)
                group.signal(signal.SIGTERM)
                forwarded = True
            if group.done():
                return 0
            if (failed := group.poll()) is not None:
                break
        i, rc = failed
        how = f"was killed by {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
        died_at = time.monotonic()
        # The survivors are blocked in collectives with a dead peer: nothing to save, and a
        # polite SIGTERM would only make them wait for a step that never completes.
        group.signal(signal.SIGKILL)
        for p in group.procs:
            p.wait()
        if rc in (2, 3) and not preempted.is_set():
            why = "rejected its input" if rc == 2 else "stopped a diverging run"
            print(f"launch: process {i} {why} (exit code {rc}); a restart would fail the same "
                  "way, so not restarting", flush=True)
            return rc
        if stop := (" while preempted; not restarting" if preempted.is_set() else
                    f"; restart limit ({max_restarts}) reached, giving up"
                    if attempt == max_restarts else ""):
            print(f"launch: process {i} {how}{stop}", flush=True)
            return rc if rc > 0 else 1
        print(f"launch: process {i} {how}; restarting all {nproc} "
              f"processes (restart {attempt + 1} of {max_restarts})", flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    if "--" not in (argv := sys.argv[1:] if argv is None else argv):
        print("usage: python -m common.launch --nproc N [--cpu-devices D | --gpus] "
              "[--max-restarts R] -- COMMAND ...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    ap = argparse.ArgumentParser(prog="python -m common.launch")
    ap.add_argument("--nproc", type=int, required=True, help="processes to start")
    ap.add_argument("--cpu-devices", type=int, default=0,
                    help="simulated CPU devices per process (tests, laptops)")
    ap.add_argument("--gpus", action="store_true", help="one GPU per process (CUDA_VISIBLE_DEVICES)")
    ap.add_argument("--max-restarts", type=int, default=3)
    a = ap.parse_args(argv[:cut])
    if not argv[cut + 1:]:
        ap.error("no command after --")
    if a.nproc < 1:
        ap.error(f"--nproc {a.nproc}: need at least 1 process")
    return run(argv[cut + 1:], a.nproc, a.cpu_devices, a.gpus, a.max_restarts)


if __name__ == "__main__":
    sys.exit(main())
