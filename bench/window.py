"""Gemma's sliding window against every key: one soft-capped attention layer of `tiny-gemma`,
forward and backward, at a long sequence (`make bench-window`; docs/gemma.md).

Both are common/attention.py's blocked kernel (what the CPU runs): the local path visits
only the tiles the window reaches (O(T W)), the global one every causal tile (O(T^2 / 2)).
Alternating repetitions, medians.
"""
import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_dense as td  # noqa: E402
from common.attention import blocked  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    cfg = td.PRESETS["tiny-gemma"][1].model
    rng = np.random.default_rng(0)
    B, T, N, K, H = a.batch, a.seq_len, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32) for _ in range(2))

    def grad_fn(window):
        loss = lambda q, k, v: jnp.sum(blocked(q, k, v, window=window, cap=cfg.attn_softcap,
                                               scale=cfg.head_dim ** -0.5, block=window or 256))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    fns = {f"window {a.window}": grad_fn(a.window), "every key": grad_fn(0)}
    for f in fns.values():
        jax.block_until_ready(f(q, k, v))  # compile
    times = {name: [] for name in fns}
    for _ in range(a.repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(q, k, v))
            times[name].append(time.perf_counter() - t0)
    med = {name: float(np.median(t)) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:12s} {1e3 * med[name]:9.0f} ms (median of {a.repeats}; "
              f"{1e3 * min(t):.0f}-{1e3 * max(t):.0f})")
    print(f"every key / window: {med['every key'] / med[f'window {a.window}']:.2f}x "
          f"(B {B}, T {T}, {N} heads / {K} kv heads of {H}, forward + backward)")


if __name__ == "__main__":
    main()
