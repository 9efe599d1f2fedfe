"""Processes a test starts die with it, their descendants too: a multi-process run that hangs
(a collective waiting on a peer that will never answer) must fail its own test, not go on
holding the cores, or a pipe, for the rest of the suite. In CI it did: a hung two-process
pipeline run left trainers spinning, the tests after it slowed past their timeouts, and the
whole run past CI's cut-off. tests/conftest.py calls `kill_spawned` after every test."""
import os
import signal
import subprocess
import threading

_live: list[tuple[subprocess.Popen, threading.Timer]] = []


def descendants(pid: int) -> list[int]:
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except FileNotFoundError:
            continue
        for c in kids:
            out += [c, *descendants(c)]
    return out


def kill_tree(p: subprocess.Popen) -> None:
    # Only while p is unreaped is its pid surely still ours. The launcher's children run in
    # sessions of their own, so the tree is walked, not a process group; the whole tree is
    # listed before anything dies (an orphan is re-parented out of reach), the root first (a
    # launcher would restart a killed child).
    if p.poll() is not None:
        return
    for pid in [p.pid, *descendants(p.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def spawn(cmd: list[str], deadline: float = 600, **kw) -> subprocess.Popen:
    """subprocess.Popen(cmd, **kw), killed with its descendants after `deadline` seconds or
    when the test ends, whichever is first."""
    p = subprocess.Popen(cmd, **kw)
    timer = threading.Timer(deadline, kill_tree, [p])
    timer.daemon = True
    timer.start()
    _live.append((p, timer))
    return p


def kill_spawned() -> None:
    while _live:
        p, timer = _live.pop()
        timer.cancel()
        kill_tree(p)


def run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw), except that
    a timeout kills the descendants too (subprocess.run's kills the child alone)."""
    p = spawn(cmd, deadline=timeout + 5, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
              text=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(p)
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


LEGACY = "--xla_cpu_use_fusion_emitters=false"  # JAX 0.10's older CPU code generator (conftest.py)


def scatter_loops() -> int:
    """The loops XLA:CPU adds to a step by expanding a scatter (the embedding's gradient) under
    the older code generator: a step with no loop of its own has this many."""
    return int(LEGACY in os.environ.get("XLA_FLAGS", "").split())


def xla_flags(devices: int = 0) -> str:
    """XLA_FLAGS for a process a test starts: the suite's own (conftest.py's level-0 compiles,
    which halve a two-process launch's CPU time: each process compiles afresh, see
    common/multislice.py) with `devices` simulated CPU devices (0: none named, as the
    launcher's --cpu-devices then adds)."""
    keep = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join(keep + [f"--xla_force_host_platform_device_count={devices}"] * bool(devices))
