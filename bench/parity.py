"""Side by side with MaxText on the same model: `make bench-parity` (dense), `make bench-parity-moe`.

Alternates our step (`train_dense.py bench-parity` or `train_moe.py bench-parity-moe`, with
--bench) and the peer (bench/peers/maxtext.sh: MaxText 0.2.5 on the CPU, installed on first
use into its own Python 3.12 venv) for several rounds in one invocation, so both see the same
machine, and prints each side's median and the ratio. Both sides are measured alike
(bench/stats.py): each step's wall time from its log, steps WARMUP..WARMUP+steps-1 kept,
their median, tokens/s = batch x seq / median. The MoE bench also checks that MaxText's
printed parameter count is ours (the dense bench too). Not part of CI: the peer needs a few GB and minutes.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench import stats  # noqa: E402

PEER = os.path.join(ROOT, "bench", "peers", "maxtext.sh")
TOKENS_PER_STEP = 8 * 256  # both presets: batch 8 x seq 256
SIDES = {"dense": ("train_dense.py", "bench-parity"), "moe": ("train_moe.py", "bench-parity-moe")}


def ours_log(model: str, last: int, flags: list[str]) -> str:
    script, preset = SIDES[model]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    out = subprocess.run([sys.executable, script, preset, "--bench", str(last), *flags],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"error: {script} {preset} --bench failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return out.stdout


def peer_log(model: str, last: int, path: str) -> str:
    """MaxText's log of steps 0..last (step 0 compiles)."""
    subprocess.run(["bash", PEER, model, str(last + 1), path], check=True)
    with open(path) as f:
        return f.read()


def maxtext_params(log: str) -> int:
    """MaxText's exact parameter count: the line bench/peers/maxtext.sh appends (from its
    TensorBoard summary), which must agree with the billions its log prints at start-up."""
    exact = int(re.search(r"maxtext num_model_parameters: (\d+)", log).group(1))
    billions = re.search(r"number parameters: ([0-9.]+) billion", log).group(1)
    if f"{exact / 1e9:.3f}" != billions:
        raise ValueError(f"MaxText printed {billions} billion parameters but counted {exact}")
    return exact


def our_params(model: str) -> int:
    import train_dense
    import train_moe
    mod = train_moe if model == "moe" else train_dense
    return mod.count_params(mod.PRESETS[SIDES[model][1]][1].model)


def ours(model: str, steps: int, flags: list[str]) -> float:
    last = stats.WARMUP + steps - 1
    return stats.tokens_per_s(stats.ours_step_seconds(ours_log(model, last, flags)),
                              stats.WARMUP, last, TOKENS_PER_STEP)


# One lever at a time against the preset's defaults (fused CE, chunk 256, remat full, scanned
# layers, attention auto): what each choice is worth on this machine (dense only).
STUDY = {
    "default": [],
    "loss_impl remat (CE logits rebuilt in backward)": ["--model.loss-impl", "remat"],
    "loss_chunk 64": ["--model.loss-chunk", "64"],
    "loss_chunk 128": ["--model.loss-chunk", "128"],
    "remat dots": ["--model.remat", "dots"],
    "remat none": ["--model.remat", "none"],
    "layers unrolled (no scan)": ["--model.no-scan-layers"],
    "attention einsum": ["--model.attention", "einsum"],
    "attention xla": ["--model.attention", "xla"],
}


def study(rounds: int, steps: int, flags: list[str]) -> None:
    """Interleave the variants round by round so that drift in the machine's load spreads
    over all of them, then print each median and its ratio to the default."""
    runs = {k: [] for k in STUDY}
    for r in range(rounds):
        for name, extra in STUDY.items():
            runs[name].append(ours("dense", steps, [*flags, *extra]))
        print(f"round {r + 1} done", flush=True)
    base = statistics.median(runs["default"])
    for name, v in runs.items():
        m = statistics.median(v)
        print(f"{name:50s} {m:6.0f} tok/s  x{m / base:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SIDES), default="dense")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15,
                    help=f"timed steps per run, after {stats.WARMUP} warm-up steps")
    ap.add_argument("--logs", default=os.path.join(ROOT, "runs", "bench-parity-logs"),
                    help="where both sides' logs of the last invocation are kept")
    ap.add_argument("--study", action="store_true",
                    help="no peer: time our dense step under each speed flag, medians of rounds")
    ap.add_argument("flags", nargs="*", help="extra flags for our side's trainer")
    a = ap.parse_args()
    if a.study:
        return study(a.rounds, a.steps, a.flags)
    os.makedirs(a.logs, exist_ok=True)
    first, last = stats.WARMUP, stats.WARMUP + a.steps - 1
    mine, theirs = [], []
    for r in range(a.rounds):
        log = ours_log(a.model, last, a.flags)
        with open(os.path.join(a.logs, f"{a.model}-ours-{r + 1}.log"), "w") as f:
            f.write(log)
        mine.append(stats.tokens_per_s(stats.ours_step_seconds(log), first, last,
                                       TOKENS_PER_STEP))
        peer = peer_log(a.model, last, os.path.join(a.logs, f"{a.model}-maxtext-{r + 1}.log"))
        theirs.append(stats.tokens_per_s(stats.maxtext_step_seconds(peer), first, last,
                                         TOKENS_PER_STEP))
        if r == 0:
            n_ours, n_peer = our_params(a.model), maxtext_params(peer)
            print(f"parameters: ours {n_ours:,} | maxtext {n_peer:,}"
                  f"{'' if n_ours == n_peer else '  MISMATCH: not the same model'}", flush=True)
            if n_ours != n_peer:
                sys.exit(1)
        print(f"round {r + 1}: ours {mine[-1]:.0f} tok/s | maxtext {theirs[-1]:.0f} tok/s "
              f"(median step of steps {first}-{last})", flush=True)
    m, t = statistics.median(mine), statistics.median(theirs)
    print(f"{a.model}: ours {m:.0f} tok/s | maxtext {t:.0f} tok/s | ratio {m / t:.2f} "
          f"(medians of {a.rounds} rounds; logs in {a.logs})")


if __name__ == "__main__":
    main()
