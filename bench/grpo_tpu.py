"""GRPO on one accelerator at a real size: `make bench-grpo-tpu` (issue 75).

Decoding a token reads every weight and the live KV cache once, so memory bandwidth bounds
it. This prints, per repeat, the rollout's decode tokens/s (rows x new tokens over the
rollout's wall time, prefill included) and its share of that bound: the seconds its steps
would take at the chip's copy bandwidth, measured in the same run (a bfloat16 array read and
written, 2 x its bytes a pass), over the seconds they took. A step's bytes are the decode
weights in the compute dtype (train_grpo.decode_params: the unembedding, or the tied table,
read whole; an untied embedding only looked up) plus each row's keys and values up to its
new token. Then the policy update's MFU (`train_grpo.py --bench`: 6N + attention FLOPs per
token over the data-sheet peak; 4N under LoRA, the default at both real sizes: see LORA) on
--update-rows rows of --update-new completion tokens (512:
see --update-new). The policy is random weights of the preset's shape (no
download): rows never draw EOS (its id is out of range), so every row decodes all its tokens.

    python bench/grpo_tpu.py                          # qwen3-0.6b, 64 rows x 1024 new, 2 repeats
    python bench/grpo_tpu.py --size llama3.2-1b       # LoRA (rank 16) as qwen3-0.6b: base frozen
    python bench/grpo_tpu.py --size tiny --new 16     # the CPU's smoke test

The table's rows (`parse` reads them back): `| size | repeat | rows | new | decode tok/s |
bound tok/s | share | copy GB/s | update MFU |`.
"""
import argparse
import dataclasses
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import train_dense as td  # noqa: E402
import train_grpo as tg  # noqa: E402
from common import multislice  # noqa: E402

COLUMNS = ("size", "repeat", "rows", "new", "decode tok/s", "bound tok/s", "share",
           "copy GB/s", "update MFU")
# Sizes trained through adapters on one v5e: full AdamW of qwen3-0.6b (float32 masters, m, v,
# gradients) needs 16.0 GiB there (AOT-compiled, 4 rows x 512 tokens a microbatch), llama3.2-1b more
LORA = {"llama3.2-1b": 16, "qwen3-0.6b": 16}


def model(size: str) -> tg.ModelConfig:
    if size == "tiny":  # float32, the tests' scale: the CPU runs the whole bench in seconds
        return tg.ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                              head_dim=16, d_ff=128, max_seq_len=2048)
    return tg.ModelConfig(**dataclasses.asdict(td.PRESETS[size][1].model))


def copy_bandwidth(n_bytes: int) -> float:
    """Bytes/s of an elementwise pass over a bfloat16 array (read once, written once)."""
    x = jnp.ones((n_bytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: x * 2)
    f(x).block_until_ready()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * n_bytes / float(np.median(times))


def step_bytes(m: tg.ModelConfig, lengths: np.ndarray, new: int) -> np.ndarray:
    """Bytes each decode step must read: the decode weights, then every row's cached keys
    and values through its new token (step i of a row with a P-token prompt: P + i + 1)."""
    dec = jax.eval_shape(lambda k: tg.decode_params(tg._init(m, k), m), jax.random.key(0))
    w = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(dec))
    if not m.tie_embeddings:  # only B rows of the table are gathered
        w -= dec["embed"].size * dec["embed"].dtype.itemsize
    per_col = 2 * m.n_layers * m.n_kv_heads * m.head_dim * jnp.dtype(m.dtype).itemsize
    cols = (lengths[:, None] + np.arange(1, new + 1)).sum(0)  # [new]: the rows' columns
    return w + per_col * cols


def rollout(fn, cfg: tg.Config, rows: int, prompt: int, seed: int):
    """(seconds, steps, prompt lengths) of the second of two rollouts of `rows` prompts of up
    to `prompt` tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, prompt // 2), prompt + 1, rows).astype(np.int32)
    ids = rng.integers(3, cfg.model.vocab_size, (rows, prompt)).astype(np.int32)
    params = tg.init_params(cfg.model, jax.random.key(seed))  # freed before the update
    args = jax.device_put((params, ids, lengths, jax.random.key(seed), jnp.float32(1.0)))
    step = fn.lower(*args, rows=rows).compile()  # (on disk after the first invocation)
    jax.block_until_ready(step(*args))  # first touch of the cache's memory, untimed
    t0 = time.perf_counter()
    out = jax.block_until_ready(step(*args))
    return time.perf_counter() - t0, int(out["steps"]), lengths


def decoder(cfg: tg.Config):
    """train_grpo's refill rollout, jitted once for the repeats; EOS never drawn."""
    return jax.jit(lambda *a, rows: tg.refill_rollout(
        *a, cfg=cfg.model, rows=rows, max_new=cfg.grpo.max_new_tokens, eos_id=-1, pad_id=0,
        n_valid=cfg.model.vocab_size, segment=cfg.grpo.decode_segment), static_argnames="rows")


def run(args) -> list[dict]:
    m = dataclasses.replace(model(args.size), remat=args.remat)
    rank = args.lora_rank if args.lora_rank >= 0 else LORA.get(args.size, 0)
    cfg = tg.Config(model=m, grpo=tg.GRPOConfig(
        max_new_tokens=args.new, prompts_per_step=args.update_rows // 4, group_size=4,
        microbatches=args.microbatches, decode_segment=args.segment),
        warm=tg.WarmStartConfig(max_steps=0), lora=dataclasses.replace(
            tg.Config().lora, rank=rank), quiet=True)
    multislice.enable_compilation_cache()  # a second invocation compiles nothing
    on_cpu = jax.default_backend() == "cpu"
    bw = copy_bandwidth(64 << 20 if on_cpu else 2 << 30)
    table, fn = [], decoder(cfg)
    for r in range(1, args.repeats + 1):
        seconds, steps, lengths = rollout(fn, cfg, args.rows, args.prompt, r)
        bound_s = float(step_bytes(m, lengths, args.new).sum()) / bw
        print(f"repeat {r}: rollout {seconds:.2f} s ({steps} steps), bound {bound_s:.2f} s",
              flush=True)
        try:  # an update that does not fit (say) still leaves the decode's figures
            upd = tg.main(dataclasses.replace(cfg, bench=args.update_steps, grpo=dataclasses.replace(
                cfg.grpo, max_new_tokens=args.update_new)))
        except Exception as e:
            print(f"repeat {r}: update failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            upd = {"mfu": math.nan, "ms_per_step": math.nan}
        table.append({"size": args.size, "repeat": r, "rows": args.rows, "new": args.new,
                      "decode tok/s": args.rows * args.new / seconds,
                      "bound tok/s": args.rows * args.new / bound_s,
                      "share": bound_s / seconds, "copy GB/s": bw / 1e9,
                      # Under LoRA the frozen weights get no gradient: the weight-gradient
                      # matmuls, a third of the 6N per token, are not done, so 4N is counted
                      "update MFU": upd["mfu"] * (2 / 3 if rank else 1)})
        print(f"repeat {r}: update {upd['ms_per_step']:.1f} ms/step\n" + render(table[-1:]),
              flush=True)
    return table


def render(table: list[dict]) -> str:
    fmt = {"decode tok/s": "{:.0f}", "bound tok/s": "{:.0f}", "share": "{:.1%}",
           "copy GB/s": "{:.1f}", "update MFU": "{:.1%}"}
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(fmt.get(c, "{}").format(row[c]) for c in COLUMNS)
                              + " |" for row in table])


def parse(text: str) -> list[dict]:
    """The table's rows back as dicts of numbers (percentages as fractions)."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(COLUMNS) or cells[0] == "size" or cells[0].startswith("---"):
            continue
        num = lambda c: float(c[:-1]) / 100 if c.endswith("%") else (
            math.nan if c == "nan" else float(c))
        out.append({k: (c if k == "size" else num(c)) for k, c in zip(COLUMNS, cells)})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="qwen3-0.6b", help="tiny, or a train_dense.py preset")
    p.add_argument("--rows", type=int, default=64, help="rollout rows decoded at once")
    p.add_argument("--new", type=int, default=1024, help="new tokens per row")
    p.add_argument("--prompt", type=int, default=64, help="longest prompt (lengths P/2..P)")
    p.add_argument("--segment", type=int, default=256, help="--grpo.decode-segment (128: "
                   "about twice the decode loops to compile, for ~6%% fewer bytes)")
    p.add_argument("--update-rows", type=int, default=64, help="rows of the timed update")
    # The update scores its N completion tokens' [B, N, V] logits whole (completion_logps): at
    # 1024 tokens of Qwen3's 152k vocabulary, 2 rows a microbatch need 16.1 GiB (v5e: 15.75).
    p.add_argument("--update-new", type=int, default=512, help="completion tokens per row")
    p.add_argument("--microbatches", type=int, default=16, help="of the update")
    p.add_argument("--update-steps", type=int, default=5)
    p.add_argument("--remat", default="full", choices=("full", "dots", "none"), help="update's")
    p.add_argument("--lora-rank", type=int, default=-1, help="-1: LORA's, else 0; 0: full")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    table = run(args)
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}")
    print(render(table))
    return table


if __name__ == "__main__":
    main()
