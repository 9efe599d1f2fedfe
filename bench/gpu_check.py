"""The GPU's kernels against the softmax they replace, before bench/gpu.sh times anything.

`attend` picks cuDNN's fused kernel or our blocked one by the knobs (common/attention.py
`choose`); on a CPU the suite holds both to `reference`, but cuDNN only runs here. Each case
draws bfloat16 q, k, v, runs the kernel `auto` picks on the GPU, and compares the output and
the gradients of q, k, v with `reference` in float32 on the same inputs, as the largest error
over the largest value (bf16 keeps 8 bits: 1/128 is its rounding step, a fused kernel's
rescaling adds a few). Then the trainers themselves: `train_dense.py tiny` and
`train_moe.py tiny-moe` for STEPS steps on the GPU and on this host's CPU, their losses
compared (float32 both; XLA's GPU matmuls round through TF32, so the curves part slowly).
Exit 1 naming what is off; 3 when no GPU is visible.

    python bench/gpu_check.py [STEPS]    (bench/gpu.sh runs it first; STEPS 0: kernels only)
"""
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common import attention as A  # noqa: E402

TOL = 2e-2  # of the largest |value|: a few bf16 steps; a wrong mask or scale is off by ~1
# (name, T, N, K, H, V, knobs): the shapes the presets train at, one per path `auto` takes.
CASES = [("causal GQA", 2048, 16, 4, 128, 128, {}),
         ("sliding window 512", 2048, 16, 4, 128, 128, dict(window=512)),
         ("head 64, MHA", 1024, 8, 8, 64, 64, {}),
         ("soft-cap 50", 1024, 8, 4, 128, 128, dict(cap=50.0)),
         ("MLA widths 192/128", 1024, 8, 8, 192, 128, {}),
         ("packed segments", 1024, 8, 4, 128, 128, dict(segments=True))]


def case(T, N, K, H, V, knobs, seed=0):
    """(kernel, worst relative error over out, dq, dk, dv) of one case."""
    r = np.random.default_rng(seed)
    q, k, v, do = (jnp.asarray(r.standard_normal(s, np.float32), jnp.bfloat16) for s in
                   ((2, T, N, H), (2, T, K, H), (2, T, K, V), (2, T, N, V)))
    kw = dict(scale=H ** -0.5, causal=True, window=knobs.get("window", 0),
              cap=knobs.get("cap", 0.0))
    if knobs.get("segments"):  # three documents per row
        kw["segment_ids"] = jnp.asarray(np.repeat([0, 1, 2], [T // 4, T // 2, T // 4])[None]
                                        .repeat(2, 0), jnp.int32)
    kind = A.choose("auto", "gpu", dtype=q.dtype, T=T, H=H, V=V, cap=kw["cap"],
                    segments="segment_ids" in kw)

    def run(f, *xs):
        out, vjp = jax.vjp(lambda *a: f(*a, **kw), *xs)
        return (out, *vjp(do.astype(out.dtype)))

    got = jax.jit(lambda *xs: run(A.attend, *xs))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.jit(lambda *xs: run(A.reference, *xs))(*f32)
    errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)) / jnp.max(jnp.abs(w)))
            for g, w in zip(got, want)]
    return kind, errs


def losses(trainer, preset, steps, platform, out):
    """The run's loss per step, trained on `platform` into a fresh folder under `out`."""
    run = os.path.join(out, f"{preset}-{platform}")
    env = dict(os.environ, JAX_PLATFORMS=platform)
    r = subprocess.run([sys.executable, trainer, preset, "--train.steps", str(steps),
                        "--train.log-every", "1", "--run-dir", run], env=env, cwd=ROOT,
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"gpu_check: {trainer} {preset} on {platform} failed:\n{r.stderr[-3000:]}")
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [m["loss"] for m in map(json.loads, f) if "loss" in m]


def main() -> int:
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        print(f"gpu_check: no GPU visible to JAX ({jax.devices()}); this check needs one",
              file=sys.stderr)
        return 3
    print(f"gpu_check: {gpus[0].device_kind}, jax {jax.__version__}: kernels vs reference "
          f"(float32), max |error| / max |value| over out, dq, dk, dv; tolerance {TOL}")
    bad = []
    for name, T, N, K, H, V, knobs in CASES:
        kind, errs = case(T, N, K, H, V, knobs)
        ok = max(errs) <= TOL
        bad += [] if ok else [name]
        print(f"gpu_check: {'ok ' if ok else 'BAD'} {name:20s} T {T} -> {kind:8s} "
              + " ".join(f"{e:.1e}" for e in errs))
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    with tempfile.TemporaryDirectory() as out:
        for trainer, preset in (("train_dense.py", "tiny"), ("train_moe.py", "tiny-moe"))[
                :2 if steps else 0]:
            gpu, cpu = (losses(trainer, preset, steps, p, out) for p in ("cuda", "cpu"))
            first, last = (abs(gpu[i] - cpu[i]) / cpu[i] for i in (0, -1))
            ok = first <= 1e-3 and last <= 2e-2  # step 1: rounding alone; then the paths part
            bad += [] if ok else [f"{preset}'s losses"]
            print(f"gpu_check: {'ok ' if ok else 'BAD'} {preset:9s} {steps} steps, loss GPU "
                  f"{gpu[0]:.4f} -> {gpu[-1]:.4f}, CPU {cpu[0]:.4f} -> {cpu[-1]:.4f} "
                  f"(relative {first:.1e} at step 1, {last:.1e} at {steps})")
    if bad:
        print(f"gpu_check: off the reference: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
