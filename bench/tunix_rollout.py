"""tunix's rollout tokens/s beside bench/grpo_tpu.py's (issue 75): the same model shape
(qwen3-0.6b, random bfloat16 weights), rows, prompt lengths and new tokens, sampled at
temperature 1 with tunix's own sampler (tunix.generate.sampler.Sampler: its vanilla JAX
rollout engine, a KV cache, prefill then a jitted decode loop), EOS never drawn.

tunix (PyPI: google-tunix 0.1.7) does not install offline as it declares itself: its
requirement tensorflow_datasets needs `promise`, which PyPI has only as a source archive, and
its whole closure of wheels is ~340 MB (llvmlite, pyarrow, transformers, ...). Its sampler
imports with a subset: google-tunix, flax, jaxtyping, wadler-lindig, treescope, google-metrax,
clu, wrapt, perfetto, rich, tensorboardX, tqdm, huggingface-hub, sentencepiece, pillow, pandas,
python-dateutil, safetensors (+ optax, orbax-checkpoint), installed --no-deps:

    pip download --no-deps --only-binary=:all: --python-version 3.11 \\
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl-tunix <those>
    pip install --no-deps --no-index --target /tmp/site .whl-tunix/*.whl  # 26 MB of wheels
    python bench/tunix_rollout.py                   # --size tiny: the CPU's smoke test

(with rich's and flax's small deps: markdown-it-py, mdurl, pygments, msgpack, typing-extensions).
On the CPU, tiny, 8 rows x 16 new: 1279 tok/s (2026-12-08; the table's second repeat).
"""
import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.generate import sampler as sampler_lib
from tunix.models.qwen3 import model as qwen3


class Ids:
    """A tokenizer of space-separated ids: the prompts are random ids, as in grpo_tpu.py."""
    def __init__(self, vocab):
        self.vocab = vocab

    def encode(self, text, **kw):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kw):
        return " ".join(map(str, ids))

    def bos_id(self):
        return 1

    def eos_id(self):
        return self.vocab - 1  # never drawn (EOS is given out of range below)

    def pad_id(self):
        return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="qwen3-0.6b", choices=("qwen3-0.6b", "tiny"))
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    dt = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    cfg = qwen3.ModelConfig.qwen3_0p6b() if a.size != "tiny" else qwen3.ModelConfig(
        num_layers=2, vocab_size=256, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16,
        num_kv_heads=2, rope_theta=10_000, norm_eps=1e-6, use_tied_embedding=True)
    cfg = dataclasses.replace(cfg, **dt)
    model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))
    cache = sampler_lib.CacheConfig(cache_size=a.prompt + 1 + a.new, num_layers=cfg.num_layers,
                                    num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    sampler = sampler_lib.Sampler(model, Ids(cfg.vocab_size), cache)
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}")
    print("| peer | size | repeat | rows | new | rollout s | decode tok/s |\n|---|---|---|---|---|---|---|")
    for r in range(a.repeats + 1):  # the first call compiles
        rng = np.random.default_rng(r)
        lengths = rng.integers(max(1, a.prompt // 2), a.prompt + 1, a.rows)
        prompts = [" ".join(map(str, rng.integers(3, cfg.vocab_size - 1, n))) for n in lengths]
        t0 = time.perf_counter()
        out = sampler(prompts, max_generation_steps=a.new, max_prompt_length=a.prompt + 1,
                      temperature=1.0, top_p=1.0, eos_tokens=[cfg.vocab_size], seed=r)
        jax.block_until_ready(out.tokens)
        s = time.perf_counter() - t0
        n = sum(len(t) for t in out.tokens)
        if r:
            print(f"| tunix | {a.size} | {r} | {a.rows} | {a.new} | {s:.2f} | {n / s:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
