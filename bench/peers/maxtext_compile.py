"""MaxText's ahead-of-time TPU compile of one training step, reported as one JSON line: the
peer side of bench/compile_tpu.py (`make compile-tpu`). Run with the MaxText venv's python
(bench/peers/maxtext.sh install prints it):

    python maxtext_compile.py compile_topology=v5p-8 model_name=llama3.1-8b \\
        override_model_config=True base_num_decoder_layers=4 per_device_batch_size=1 \\
        max_target_length=2048 scan_layers=false

The key=value overrides are MaxText's own (base.yml's names), given after its base.yml. This is
MaxText's `train_compile` main, run unchanged (its flags, its mesh, its train_step), with its
`jit_and_compile` wrapped to keep the compiled executable: train_compile prints the cost and
memory analyses only as Python reprs, so the figures are read from the executable here. The
last line of stdout is

    MAXTEXT_COMPILE {"per_device_bytes": ..., "xla_flops": ..., "est_step_s": ..., ...}

with the same keys as our dry run's report (common/train.py dry_run, xla_cost): memory as
arguments + outputs - donated + temporaries, per chip (MaxText's own "Total estimated memory
size" sums the same four); XLA's FLOPs per chip; optimal_seconds as est_step_s; and
xla_while_loops, the loops whose bodies the cost analysis counts once.
"""
import glob
import json
import os
import sys
import tempfile
import time

PREFIX = "MAXTEXT_COMPILE "


def main(overrides: list[str]) -> None:
    bad = [a for a in overrides if "=" not in a]
    if bad or not overrides:
        sys.exit(f"maxtext_compile.py: expected MaxText key=value overrides (compile_topology=v5p-8 "
                 f"model_name=...), got {bad or 'none'}")
    import jax
    import maxtext
    # MaxText keeps compiled steps in ~/jax_cache; a hit would time a load, not a compile.
    jax.config.update("jax_enable_compilation_cache", False)
    from maxtext.trainers.pre_train import train_compile as tc
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    kept, inner = {}, tc.jit_and_compile

    def keep(*args, **kwargs):   # the lower + compile of train_compile.main, timed
        t0 = time.perf_counter()
        kept["compiled"] = inner(*args, **kwargs)
        kept["compile_s"] = time.perf_counter() - t0
        return kept["compiled"]

    tc.jit_and_compile = keep
    # What train_compile needs besides the model, unless given: one slice, and its output
    # folder (it writes none when compiling, but insists on one) out of the working directory.
    given = {a.split("=", 1)[0] for a in overrides}
    defaults = {"compile_topology_num_slices": "1", "run_name": "compile_tpu",
                "base_output_directory": os.path.join(tempfile.gettempdir(), "maxtext_compile"),
                "enable_checkpointing": "false", "skip_jax_distributed_system": "true"}
    overrides = [f"{k}={v}" for k, v in defaults.items() if k not in given] + overrides
    t0 = time.perf_counter()
    tc.main(["train_compile", base, *overrides])
    wall = time.perf_counter() - t0
    compiled = kept["compiled"]
    report = {"compile_s": kept["compile_s"], "wall_s": wall}
    leaves = [s for s in jax.tree.leaves(compiled.input_shardings) if hasattr(s, "mesh")]
    if leaves:
        devs = leaves[0].mesh.devices
        report |= {"devices": int(devs.size), "device_kind": devs.flat[0].device_kind}
    mem = compiled.memory_analysis()
    if mem is not None:
        sizes = {k: int(getattr(mem, k + "_in_bytes")) for k in
                 ("argument_size", "output_size", "alias_size", "temp_size")}
        report |= sizes | {"per_device_bytes": sizes["argument_size"] + sizes["output_size"]
                           - sizes["alias_size"] + sizes["temp_size"]}
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):   # older JAX: one dict per computation
        cost = cost[0] if cost else None
    for k, ours in {"flops": "xla_flops", "bytes accessed": "xla_bytes_accessed",
                    "optimal_seconds": "est_step_s"}.items():
        if isinstance(cost, dict) and isinstance(cost.get(k), (int, float)) and cost[k] >= 0:
            report[ours] = float(cost[k])
    report["xla_while_loops"] = compiled.as_text().count(" while(")  # bodies counted once
    if os.environ.get("COMPILE_TPU_HLO"):  # compile_tpu.py --hlo: for bench/hlo_bytes.py
        with open(os.environ["COMPILE_TPU_HLO"], "w") as f:
            f.write(compiled.as_text())
    report["versions"] = {"jax": jax.__version__, "maxtext": _version("maxtext"),
                          "libtpu": _libtpu_version()}
    print(PREFIX + json.dumps(report), flush=True)


def _libtpu_version() -> str:
    """The version of the libtpu that compiled: TPU_LIBRARY_PATH's, when set, overrides the
    venv's package (bench/compile_tpu.py points it at the other side's libtpu)."""
    path = os.environ.get("TPU_LIBRARY_PATH")
    if not path:
        return _version("libtpu")
    site = os.path.dirname(os.path.dirname(path))   # .../site-packages/libtpu/libtpu.so
    found = glob.glob(os.path.join(site, "libtpu-*.dist-info"))
    ver = os.path.basename(found[0]).removeprefix("libtpu-").removesuffix(".dist-info") \
        if found else "?"
    return f"{ver} ({path})"


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    main(sys.argv[1:])
