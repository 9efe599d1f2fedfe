"""GPipe against the circular schedule on the CPU (`make bench-pipeline`; issue 35).

The `tiny` preset's step (8 layers, 32 sequences: 16 would not split in 4 microbatches over
fsdp 8) in M microbatches (4 by default) on 8 simulated CPU devices: without stages (fsdp 8,
the same accumulation), then over 2 and 4 stages, each stage holding one chunk of adjacent
layers (GPipe) or V chunks that are not adjacent (circular, `--train.pipeline-repeats V`).
Per row: the schedule's ticks and bubble, the dry run's memory per device, and ms/step of
`--bench` (median, min-max over the steps).

Here every simulated device shares the same two cores, so a tick costs the work of all its
stages and the bubble's idle slots are work done on padding: the ms/step follow the work,
(V M + S - 1) ticks x S stages x L / (S V) layers, against M x L without stages (the "work"
column: their ratio, 1 + (S - 1) / (V M)); on a real pipeline the same ratio is the time.
Each row is a process of its own (the device count is fixed when JAX starts); CPU timings
are noisy: run it twice and read the spread.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from context import one  # noqa: E402  (bench/context.py: a dry run and a bench in a child)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8,
                    help="tiny's 4 doubled by default, so 4 stages can hold 2 chunks each")
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    M, L = a.microbatches, a.layers
    base = ["tiny", "--model.n-layers", str(L), "--train.batch-size", "32",
            "--train.microbatches", str(M), "--bench", str(a.steps), "--quiet"]
    rows = [(1, 1)] + [(S, V) for S in (2, 4) for V in (1, 2) if L % (S * V) == 0 and M >= S]
    print(f"tiny with {L} layers, batch 32 x 256 in {M} microbatches, 8 CPU devices, "
          f"{a.steps} bench steps")
    print("| stages x fsdp | schedule | ticks | bubble | work | GiB per device (dry run) "
          "| ms/step median (min-max) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for S, V in rows:
        flags = ["--mesh.stage", str(S), "--mesh.fsdp", str(8 // S),
                 "--train.pipeline-repeats", str(V)]
        r = one(base + flags, devices=8)
        ticks = V * M + S - 1 if S > 1 else M   # without stages: the M accumulation steps
        name = "none" if S == 1 else "GPipe" if V == 1 else f"circular, V {V}"
        bubble = f"{(S - 1) / ticks:.1%}" if S > 1 else "-"
        work = ticks / (V * M) if S > 1 else 1.0
        print(f"| {S} x {8 // S} | {name} | {ticks} | {bubble} | {work:.2f} | {r['gib']:.3f} | "
              f"{r['ms']:.0f} ({r['min']:.0f}-{r['max']:.0f}) |", flush=True)


if __name__ == "__main__":
    main()
