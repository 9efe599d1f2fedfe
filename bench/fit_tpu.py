"""Fitting the chip and remat policies, measured on one TPU chip (issue 71; docs/speed.md).

    python bench/fit_tpu.py [loss] [fit] [remat] [moe]     # all four when none is named

Each section runs its rows in this one process (the chip is opened once, ~15 s saved a row),
each row with the trainer's `--bench N` (the median step of N after compile and one warm-up),
and prints one line a row: tok/s, ms/step, the compiled step's bytes per chip against the
chip's limit, or why the row failed (out of memory, say). Sections and their rough chip time:

    loss   tiny, 300 steps, each memory option: eval loss against float32's       ~1.5 min
    fit    llama3.2-1b at 2048 x 4: which option makes full training fit 15.75 GiB  ~3 min
    remat  qwen3-0.6b at 2048 x 8 (and auto) and 8192 x 2 under each remat policy ~5 min
    moe    qwen3-30b-a3b's block (2 layers, 32 experts, vocab 32k) at 2048 x 8      ~2.5 min

(estimates: ~30-45 s a row, mostly compilation; run `loss fit` and `remat moe` as two calls
to stay under a 10-minute limit each).
Read: per row the fastest policy that fits (the table's best), and `auto`'s pick, which its
`remat auto:` lines explain (the bytes each policy needs against the chip's limit).
"""
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402

import train_dense as td  # noqa: E402
import train_moe as tm  # noqa: E402
from common import train  # noqa: E402

BENCH = ["--bench", "5", "--quiet"]
BF16_STATE = ["--train.mu-dtype", "bfloat16", "--train.nu-dtype", "bfloat16"]
MEMORY = {"float32": [], "mu bf16": ["--train.mu-dtype", "bfloat16"], "mu+nu bf16": BF16_STATE,
          "weights+mu+nu bf16": ["--train.weight-dtype", "bfloat16", *BF16_STATE],
          "offload": ["--train.offload-opt-state"]}
LLAMA_1B = ["llama3.2-1b", "--train.batch-size", "4", "--train.seq-len", "2048", *BENCH]
QWEN_2K = ["qwen3-0.6b", "--train.batch-size", "8", "--train.seq-len", "2048", *BENCH]
QWEN_8K = ["qwen3-0.6b", "--train.batch-size", "2", "--train.seq-len", "8192", *BENCH]
MOE = ["qwen3-30b-a3b", "--model.n-layers", "2", "--model.n-experts", "32", "--model.vocab-size",
       "32768", "--train.batch-size", "8", "--train.seq-len", "2048", *BENCH]
POLICIES = ("full", "attn", "proj", "offload", "auto")  # dots and none: out of HBM (issue 71)
SECTIONS = {
    "fit": [(f"llama3.2-1b 2048x4 {k}", td, LLAMA_1B + v) for k, v in MEMORY.items()
            if k not in ("float32", "mu bf16")]
    + [("llama3.2-1b 2048x4 mu+nu bf16, remat auto", td, LLAMA_1B + BF16_STATE + [
        "--model.remat", "auto"])],
    "remat": [(f"qwen3-0.6b 2048x8 remat {p}", td, QWEN_2K + ["--model.remat", p])
              for p in POLICIES]
    + [(f"qwen3-0.6b 8192x2 remat {p}", td, QWEN_8K + ["--model.remat", p]) for p in POLICIES[:4]],
    "moe": [(f"moe 2048x8 remat {p}", tm, MOE + ["--model.remat", p]) for p in POLICIES[:4]],
}


def row(name: str, mod, args: list[str]) -> None:
    t0 = time.perf_counter()
    try:
        out = mod.main(mod.cli(args))
        out = out.get("moe", out)  # train_moe.py's bench reports the MoE model under "moe"
        gib = out.get("per_device_bytes", 0) / 2**30
        print(f"ROW | {name} | {out['tokens_per_s']:,.0f} tok/s | {out['ms_per_step']:.1f} "
              f"ms/step | {gib:.2f} GiB compiled | wall {time.perf_counter() - t0:.0f} s",
              flush=True)
    except (Exception, SystemExit) as e:  # out of memory, a bad flag: the row says so, go on
        traceback.print_exc(limit=1)
        print(f"ROW | {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
              flush=True)


def losses() -> None:
    """`make train`'s run (tiny, 300 steps) under each memory option: its last eval loss."""
    for k, v in MEMORY.items():
        with tempfile.TemporaryDirectory() as d:
            out = td.main(td.cli(["tiny", "--run-dir", d, "--quiet", "--train.sample-tokens",
                                  "0", *v]))
        print(f"ROW | tiny 300 steps {k} | eval loss {out['evals'][-1][1]:.4f} | "
              f"{out['ms_per_step']:.2f} ms/step", flush=True)


if __name__ == "__main__":
    wanted = sys.argv[1:] or ["loss", "fit", "remat", "moe"]
    d = jax.devices()[0]
    print(f"device {d.device_kind}, limit {(train.memory_limit(d) or 0) / 2**30:.2f} GiB")
    for section in wanted:
        if section == "loss":
            losses()
        for name, mod, args in SECTIONS.get(section, []):
            row(name, mod, args)
