"""Start-up of a multi-process run: `jax.distributed.initialize` when the environment asks.

A single process (a laptop, one GPU, one TPU VM host of a single-host slice) skips it.
Several processes are recognised from:
- our own variables (set by a launcher or by hand): JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
  JAX_PROCESS_ID;
- Slurm (SLURM_NTASKS > 1) and multi-host TPU VMs, which JAX's own cluster detection handles
  when `initialize()` is called without arguments.
"""
import functools
import os
import socket
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


class DistributedInitError(RuntimeError):
    """The process group could not be formed; the message says what to check."""


def wants_distributed(env=os.environ) -> bool:
    # A TPU pod slice lists every worker of the slice; one host means nothing to join.
    return (int(env.get("JAX_NUM_PROCESSES", "1")) > 1 or int(env.get("SLURM_NTASKS", "1")) > 1
            or len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1)


def initialize() -> None:
    """Join the process group if there is one; otherwise do nothing. Idempotent. The wait for
    the others is bounded (JAX_TRAINERS_INIT_TIMEOUT seconds, default 300): a wrong coordinator
    address or a process that never starts is an error that says what to check, not a hang."""
    if not wants_distributed() or jax.distributed.is_initialized():
        return
    timeout_s = int(os.environ.get("JAX_TRAINERS_INIT_TIMEOUT", "300"))
    # CPU processes exchange collectives over gloo (the default CPU backend has none);
    # harmless where the devices are GPUs or TPUs.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    if "JAX_COORDINATOR_ADDRESS" in os.environ:
        kwargs = dict(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                      num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                      process_id=int(os.environ["JAX_PROCESS_ID"]))
    where = kwargs.get("coordinator_address", "auto-detected (Slurm/TPU)")
    hint = ("check that process 0 runs on the coordinator address, that every one of the "
            f"{kwargs.get('num_processes', '')} processes was started, and that the port is "
            "reachable from all of them")
    # JAX aborts the whole process (a C++ fatal error, no Python exception) when the group
    # does not form in time, so say what we are waiting for, and why it may fail, first.
    print(f"distributed: process {kwargs.get('process_id', '?')} joining coordinator {where}, "
          f"waiting up to {timeout_s} s for all processes (if this fails: {hint})",
          file=sys.stderr, flush=True)
    if kwargs.get("process_id", 0) != 0:
        _wait_for_coordinator(kwargs["coordinator_address"], timeout_s, hint)
    try:
        jax.distributed.initialize(initialization_timeout=timeout_s, **kwargs)
    except Exception as e:  # the coordinator is the usual culprit: say which one we tried
        raise DistributedInitError(
            f"jax.distributed.initialize did not complete within {timeout_s} s (coordinator "
            f"{where}, {kwargs.get('num_processes', '?')} processes): "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}. Fix: {hint}.") from e


def _wait_for_coordinator(address: str, timeout_s: int, hint: str) -> None:
    """Poll the coordinator's port, so an unreachable one is a Python error we can explain."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise DistributedInitError(
                    f"no coordinator answered at {address} within {timeout_s} s ({e}): "
                    f"{hint} (JAX_COORDINATOR_ADDRESS).") from None
            time.sleep(0.5)


@functools.lru_cache(maxsize=1)
def _or_over_processes():
    mesh = Mesh(np.array(jax.devices()), ("all",))
    reduce = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))
    return NamedSharding(mesh, P("all")), reduce


def any_process(flag: bool) -> jax.Array:
    """OR of `flag` over every process, as a device scalar still in flight. A SIGTERM may reach
    one process only, yet all must save the same step or the checkpoint's barriers wait
    forever; the loop reads the result one step later, so no step waits for it."""
    sharding, reduce = _or_over_processes()
    local = np.full((1,), int(flag), np.int32)
    return reduce(jax.make_array_from_callback((jax.device_count(),), sharding, lambda _: local))


def enable_compilation_cache() -> None:
    """Keep compiled steps over a second on disk, so a restart or a second run skips most
    compilation: JAX_COMPILATION_CACHE_DIR if set, else $JAX_TRAINERS_CACHE/xla (by default
    ~/.cache/jax_trainers/xla). Off for CPU processes in a group: with JAX 0.12.1, a program
    with gloo collectives read back from the cache deadlocks in its first collective (every
    device of every process waits in gloo's all-gather; compiled afresh, the same program
    runs), and a CPU group is a test harness, where recompiling costs seconds."""
    if jax.distributed.is_initialized() and jax.default_backend() == "cpu":
        jax.config.update("jax_enable_compilation_cache", False)
        return
    if jax.config.jax_compilation_cache_dir:
        return
    path = os.environ.get("JAX_TRAINERS_CACHE", os.path.expanduser("~/.cache/jax_trainers"))
    jax.config.update("jax_compilation_cache_dir", os.path.join(path, "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
