"""Scale-out data, measured: `prepare` throughput and memory, and training from a bucket.

    make bench-scale                         # ~500 MB corpus; figures, never asserts
    python bench/scale.py --mb 100 --steps 40

prepare: a generated corpus of JSONL shards (words drawn from a Zipf law, so the text has
the statistics of prose) is prepared with 1 and with 2 worker processes, and at a fifth of
the size with 1, each in a fresh process: MB/s of text, tokens/s, and the peak RSS of the
largest process (the prepare process or one worker: getrusage of the waited children). The
memory must not grow with the corpus: the fifth-size run's peak against the full one's.

gs:// reads: `train_dense.py tiny` for --steps steps on the prepared folder from local disk
and from tests/fake_gcs.py (an in-process fake of the GCS JSON API on loopback, so this
measures the reader's overhead, not a real network), alternating --rounds times: the
step-weighted mean ms/step after the first interval, as the run's summary reports it.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.observe import mean_ms_per_step  # noqa: E402


def corpus(folder: str, mb: int, shards: int = 8) -> int:
    """`mb` MB of JSONL in `shards` files; returns the bytes of text written."""
    rng = np.random.default_rng(0)
    words = np.array(["".join(rng.choice(list("etaoinshrdlucmfwypvbgkjqxz"), size=n))
                      for n in rng.integers(1, 11, size=20_000)])
    per_shard, total = mb * 1_000_000 // shards, 0
    os.makedirs(folder, exist_ok=True)
    for k in range(shards):
        with open(os.path.join(folder, f"part-{k:03d}.jsonl"), "w") as f:
            written = 0
            while written < per_shard:
                n = int(rng.integers(100, 2000))  # words per document
                text = " ".join(words[np.minimum(rng.zipf(1.2, size=n), len(words)) - 1])
                f.write(json.dumps({"text": text}) + "\n")
                written += len(text)
            total += written
    return total


def prepare(inputs: str, out: str, workers: int, text_bytes: int) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "common.data", "prepare", "--input", inputs,
                        "--out", out, "--workers", str(workers)], cwd=ROOT, text=True,
                       capture_output=True)
    seconds = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(r.stdout + r.stderr)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB, max over children
    tokens = sum(json.load(open(os.path.join(out, f"{s}.json")))["num_tokens"]
                 for s in ("train", "eval"))
    return {"workers": workers, "mb": text_bytes / 1e6, "s": seconds,
            "mb_s": text_bytes / 1e6 / seconds, "tok_s": tokens / seconds,
            # ru_maxrss of children only ever grows: a smaller run after a bigger one reads
            # as the bigger one's, so the runs go smallest first.
            "rss_mb": peak / 1024 if peak > before else float("nan")}


def train_ms(data: str, run: str, steps: int) -> float:
    r = subprocess.run([sys.executable, "train_dense.py", "tiny", "--data.path", data,
                        "--run-dir", run, "--train.steps", str(steps), "--train.log-every", "5",
                        "--train.eval-every", "100000", "--train.sample-tokens", "0"],
                       cwd=ROOT, text=True, capture_output=True)
    if r.returncode:
        raise SystemExit(r.stdout + r.stderr)
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    return mean_ms_per_step(records, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=500, help="corpus size of the full runs")
    ap.add_argument("--steps", type=int, default=60, help="tiny steps per gs:// round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        small, full = os.path.join(tmp, "small"), os.path.join(tmp, "full")
        small_bytes, full_bytes = corpus(small, args.mb // 5), corpus(full, args.mb)
        runs = [prepare(f"{small}/*.jsonl", f"{tmp}/out-small", 1, small_bytes),
                prepare(f"{full}/*.jsonl", f"{tmp}/out-1", 1, full_bytes),
                prepare(f"{full}/*.jsonl", f"{tmp}/out-2", 2, full_bytes)]
        print(f"prepare on {os.cpu_count()} cores (JSONL shards, a 4096-piece BPE trained "
              f"on an 8 MB sample):")
        for r in runs:
            print(f"  {r['mb']:6.0f} MB, {r['workers']} worker(s): {r['s']:6.1f} s | "
                  f"{r['mb_s']:5.2f} MB/s | {r['tok_s'] / 1e6:5.2f} M tok/s | peak RSS " + (
                      "not above the runs before" if r['rss_mb'] != r['rss_mb'] else
                      f"{r['rss_mb']:5.0f} MB"))
        print(f"  2 workers vs 1: {runs[1]['s'] / runs[2]['s']:.2f}x; peak RSS at "
              f"{runs[1]['mb'] / runs[0]['mb']:.0f}x the corpus: "
              f"{runs[1]['rss_mb'] / runs[0]['rss_mb']:.2f}x")

        os.environ.update(JAX_PLATFORMS="cpu")
        from tests.fake_gcs import FakeGCS  # a user's clone has tests/
        server = FakeGCS(buckets=["bench"]).start()
        os.environ.update(STORAGE_EMULATOR_HOST=server.url, GOOGLE_AUTH_TOKEN_FOR_TESTING="x",
                          TENSORSTORE_GCS_HTTP_URL=server.url)
        import logging

        import fsspec
        logging.getLogger("gcsfs").setLevel(logging.ERROR)  # "no default credentials": none needed
        fs = fsspec.filesystem("gs")
        for name in os.listdir(f"{tmp}/out-small"):
            fs.put_file(f"{tmp}/out-small/{name}", f"bench/data/{name}")
        ms = {"local": [], "gs": []}
        for i in range(args.rounds):
            ms["local"].append(train_ms(f"{tmp}/out-small", f"{tmp}/run-l{i}", args.steps))
            ms["gs"].append(train_ms("gs://bench/data", f"{tmp}/run-g{i}", args.steps))
            print(f"  round {i + 1}: local {ms['local'][-1]:.1f} ms/step | gs:// "
                  f"{ms['gs'][-1]:.1f} ms/step", flush=True)
        med = {k: statistics.median(v) for k, v in ms.items()}
        print(f"tiny, {args.steps} steps x {args.rounds} rounds: local disk {med['local']:.1f} "
              f"ms/step, gs:// (fake GCS on loopback) {med['gs']:.1f} ms/step (medians), "
              f"ratio {med['gs'] / med['local']:.2f}")
        server.stop()


if __name__ == "__main__":
    main()
