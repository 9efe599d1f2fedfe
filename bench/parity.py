"""Side by side with MaxText on the same model: `make bench-parity`.

Alternates our step (`train_dense.py bench-parity --bench N`) and the peer script
(`../shared/bench/peer_maxtext.sh`, MaxText 0.2.5 on the CPU, installed on first use into a
Python 3.12 venv) for several rounds in one invocation, so both see the same machine, and
prints the medians and their ratio. Not part of CI: the peer needs a few GB and minutes.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ours(steps: int, flags: list[str]) -> float:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    out = subprocess.run([sys.executable, "train_dense.py", "bench-parity", "--bench", str(steps),
                          *flags], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return float(re.search(r"bench \| ([0-9.]+) tok/s", out.stdout).group(1))


def peer(script: str, steps: int) -> float:
    out = subprocess.run(["bash", script, str(steps + 5)], capture_output=True, text=True,
                         check=True)
    return float(re.search(r"maxtext_tok_per_s ([0-9.]+)", out.stdout).group(1))


# One lever at a time against the preset's defaults (fused CE, chunk 256, remat full, scanned
# layers, attention auto): what each choice is worth on this machine.
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
            runs[name].append(ours(steps, [*flags, *extra]))
        print(f"round {r + 1} done", flush=True)
    base = statistics.median(runs["default"])
    for name, v in runs.items():
        m = statistics.median(v)
        print(f"{name:50s} {m:6.0f} tok/s  x{m / base:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=15, help="timed steps per run, after warm-up")
    ap.add_argument("--peer", default=os.path.join(ROOT, "..", "shared", "bench",
                                                   "peer_maxtext.sh"))
    ap.add_argument("--study", action="store_true",
                    help="no peer: time our step under each speed flag (STUDY), medians of rounds")
    ap.add_argument("flags", nargs="*", help="extra train_dense.py flags for our side")
    a = ap.parse_args()
    if a.study:
        return study(a.rounds, a.steps, a.flags)
    if not os.path.exists(a.peer):
        sys.exit(f"error: peer script {a.peer} not found; pass --peer PATH")
    mine, theirs = [], []
    for r in range(a.rounds):
        mine.append(ours(a.steps, a.flags))
        theirs.append(peer(a.peer, a.steps))
        print(f"round {r + 1}: ours {mine[-1]:.0f} tok/s | maxtext {theirs[-1]:.0f} tok/s",
              flush=True)
    m, t = statistics.median(mine), statistics.median(theirs)
    print(f"ours {m:.0f} tok/s | maxtext {t:.0f} tok/s | ratio {m / t:.2f}")


if __name__ == "__main__":
    main()
