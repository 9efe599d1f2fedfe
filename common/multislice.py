"""Start-up of a multi-process run: `jax.distributed.initialize` when the environment asks.

A single process (a laptop, one GPU, one TPU VM host of a single-host slice) skips it.
Several processes are recognised from:
- our own variables (set by a launcher or by hand): JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
  JAX_PROCESS_ID;
- Slurm (SLURM_NTASKS > 1) and multi-host TPU VMs, which JAX's own cluster detection handles
  when `initialize()` is called without arguments.
"""
from __future__ import annotations

import os

import jax


def wants_distributed(env=os.environ) -> bool:
    if int(env.get("JAX_NUM_PROCESSES", "1")) > 1:
        return True
    if int(env.get("SLURM_NTASKS", "1")) > 1:
        return True
    # A TPU pod slice lists every worker of the slice; one host means nothing to join.
    return len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1


def initialize(timeout_s: int = 300) -> None:
    """Join the process group if there is one; otherwise do nothing. Idempotent."""
    if not wants_distributed() or jax.distributed.is_initialized():
        return
    if jax.config.jax_platforms in (None, "", "cpu") and "JAX_NUM_PROCESSES" in os.environ:
        # CPU processes exchange collectives over gloo (the default CPU backend has none).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    if "JAX_COORDINATOR_ADDRESS" in os.environ:
        kwargs = dict(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                      num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                      process_id=int(os.environ["JAX_PROCESS_ID"]))
    try:
        jax.distributed.initialize(initialization_timeout=timeout_s, **kwargs)
    except Exception as e:  # the coordinator is the usual culprit: say which one we tried
        where = kwargs.get("coordinator_address", "auto-detected (Slurm/TPU)")
        raise RuntimeError(f"jax.distributed.initialize failed (coordinator {where}, "
                           f"timeout {timeout_s}s): {e}. Check that process 0 is up and the "
                           "address is reachable from every process.") from e


def is_main_process() -> bool:
    return jax.process_index() == 0
