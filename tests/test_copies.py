"""The pieces train_moe.py copies from train_dense.py (each script stands alone) stay equal."""
import dataclasses

import jax
import numpy as np
import pytest

import train_dense as td
import train_moe as tm

FIELDS = dict(vocab_size=64, d_model=16, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8,
              qk_norm=True)  # train_moe.py has no Llama 3.1 rope scaling


def configs(**kw):
    mine = {f.name for f in dataclasses.fields(tm.ModelConfig)}
    return (td.ModelConfig(**FIELDS, **kw),
            tm.ModelConfig(**{k: v for k, v in (FIELDS | kw).items() if k in mine}))


@pytest.mark.parametrize("attention", ["xla", "einsum"])
def test_norm_rope_attention_are_the_same_functions(attention):
    d, m = configs(attention=attention)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 12, 16), np.float32)
    w = rng.standard_normal((16,), np.float32)
    np.testing.assert_array_equal(td.rms_norm(x, w, 1e-5), tm.rms_norm(x, w, 1e-5))
    np.testing.assert_array_equal(td.rope_inv_freq(d), tm.rope_inv_freq(m))
    q = rng.standard_normal((2, 12, 4, 8), np.float32)
    k, v = (rng.standard_normal((2, 12, 2, 8), np.float32) for _ in range(2))
    pos = np.broadcast_to(np.arange(12), (2, 12))
    inv = td.rope_inv_freq(d)
    np.testing.assert_array_equal(td.apply_rope(q, pos, inv), tm.apply_rope(q, pos, inv))
    np.testing.assert_array_equal(td.attention(q, k, v, d), tm.attention(q, k, v, m))


def test_schedules_are_the_same():
    t = dict(steps=50, warmup_steps=5, lr=1.0, min_lr_ratio=0.1)
    for name in ("cosine", "constant", "wsd"):
        a = td.make_schedule(td.TrainConfig(schedule=name, **t))
        b = tm.make_schedule(tm.TrainConfig(schedule=name, **t))
        np.testing.assert_allclose([a(s) for s in range(50)], [b(s) for s in range(50)])
