"""Ring against all-gather attention on a split sequence (`make bench-context`; issue 34).

The `tiny` preset's training step at a long sequence (4096 by default) on 4 simulated CPU
devices: the sequence whole on each device (--mesh.fsdp 4, one sequence per device) and split
over them (--mesh.context 4) with each strategy. For each: the dry run's memory per device
and the median ms/step of `--bench` (synthetic tokens, the trainer's own step). Each run is a
process of its own (the device count is fixed when JAX starts). CPU timings are noisy: run it
twice and read the spread; the memory is exact.
"""
import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(flags: list[str], devices: int = 4) -> dict:
    """A dry run and a bench of train_dense.py with these flags, in a child process of
    `devices` simulated CPU devices (bench/pipeline.py runs its schedules with it too)."""
    code = ("import sys, train_dense as td; from common import train\n"
            "cfg = td.cli(sys.argv[1:]); train.start(True)\n"
            "import dataclasses as d\n"
            "m = td.main(d.replace(cfg, dry_run=True)); b = td.main(cfg)\n"
            "t = b['step_seconds']\n"
            "print('REPORT', m['per_device_bytes'], b['ms_per_step'], 1e3 * min(t), 1e3 * max(t))")
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    out = subprocess.run([sys.executable, "-c", code, *flags], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    line = [x for x in out.stdout.splitlines() if x.startswith("REPORT")]
    if out.returncode or not line:
        raise SystemExit(f"bench: {' '.join(flags)} failed:\n{out.stderr[-2000:]}")
    mem, ms, lo, hi = line[-1].split()[1:]
    return {"gib": int(mem) / 2**30, "ms": float(ms), "min": float(lo), "max": float(hi)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    base = ["tiny", "--train.seq-len", str(a.seq_len), "--model.max-seq-len", str(a.seq_len),
            "--bench", str(a.steps), "--quiet"]
    runs = {"whole (fsdp 4, batch 4)": ["--mesh.fsdp", "4", "--train.batch-size", "4"],
            **{f"context 4, {s} (batch 1)": ["--mesh.fsdp", "1", "--mesh.context", "4",
                                             "--train.batch-size", "1",
                                             "--model.context-attention", s]
               for s in ("allgather", "ring", "ulysses")}}
    print(f"tiny, seq {a.seq_len}, 4 CPU devices, {a.steps} bench steps")
    print("| layout | GiB per device (dry run) | ms/step (median) | tokens/s |")
    print("| --- | --- | --- | --- |")
    for name, flags in runs.items():
        r = one(base + flags)
        tokens = a.seq_len * int(flags[flags.index("--train.batch-size") + 1])
        print(f"| {name} | {r['gib']:.3f} | {r['ms']:.1f} | {tokens / r['ms'] * 1e3:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
