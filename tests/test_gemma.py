"""Gemma 2 and 3 in train_dense.py: the windowed attention against full attention with a band
mask, the whole model against a plain per-layer reference written here, the presets' sizes,
and the Llama/Mistral/Qwen presets unchanged by the new knobs. (HF parity: tests/test_hf.py;
sharded == unsharded: tests/test_dense.py.)"""
import dataclasses
import math
import os
import re
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_dense as td
from common import attention as attn
from common.train import ConfigError

GEMMA2 = td.ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2,
                        head_dim=12, d_ff=48, max_seq_len=64, norm_eps=1e-6, rope_theta=100.0,
                        sliding_window=5, global_every=2, attn_softcap=3.0, final_softcap=2.5,
                        query_scale=16.0, norm_plus_one=True, sandwich_norm=True,
                        embed_scale=True, gelu=True, tie_embeddings=True)
GEMMA3 = dataclasses.replace(GEMMA2, n_layers=6, n_kv_heads=1, global_every=3, attn_softcap=0.0,
                             final_softcap=0.0, qk_norm=True, rope_theta=1000.0,
                             rope_local_theta=100.0, rope_linear=2.0)


def random_qkv(B, T, N, K, H, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((B, T, n, H)), jnp.float32) for n in (N, K, K))


@pytest.mark.parametrize("T, W, packed", [(16, 4, False), (16, 5, False), (17, 4, True),
                                          (12, 5, True), (64, 8, False)])
@pytest.mark.parametrize("cap", [0.0, 3.0])
def test_windowed_attention_equals_band_masked_full_attention(T, W, packed, cap):
    """The blocked kernel's window (only the tiles it reaches; T padded to whole tiles)
    against every key with a band mask, forward and gradients, packed rows too."""
    cfg = dataclasses.replace(GEMMA2, attn_softcap=cap, query_scale=10.0)
    q, k, v = random_qkv(2, T, 4, 2, 12)
    t = np.arange(T)
    mask = np.broadcast_to(np.tril(np.ones((T, T), bool)), (2, T, T))
    if packed:
        seg = np.sort(np.random.default_rng(1).integers(0, 3, (2, T)), axis=1)
        mask = mask & (seg[:, :, None] == seg[:, None, :])
    band = jnp.asarray(mask & (t[:, None] - t[None] < W))
    r = jnp.asarray(np.random.default_rng(2).standard_normal((2, T, 4, 12)), jnp.float32)
    scale, c = cfg.query_scale ** -0.5, cfg.attn_softcap

    def f(window, m, q, k, v):
        if m is not None:  # every key, the band as a mask: a plain softmax written out here
            s = jnp.einsum("btkgh,bskh->bkgts", q.reshape(2, T, 2, 2, 12), k) * scale
            s = jnp.where(m[:, None, None], c * jnp.tanh(s / c) if c else s, -1e30)
            o = jnp.einsum("bkgts,bskh->btkgh", jax.nn.softmax(s, -1), v).reshape(q.shape)
        else:
            o = attn.blocked(q, k, v, window=window, scale=scale, cap=c, block=8,
                             segment_ids=jnp.asarray(seg) if packed else None)
        return jnp.sum(o * r)

    want, want_g = jax.value_and_grad(partial(f, 0, band), argnums=(0, 1, 2))(q, k, v)
    got, got_g = jax.value_and_grad(partial(f, W, None), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(got_g, want_g):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # A mask that does not reach back W tokens would differ: the window matters here.
    narrower = jnp.asarray(mask & (t[:, None] - t[None] < W - 1))
    assert abs(f(0, narrower, q, k, v) - want) > 1e-3


def test_bench_window_runs_and_reports_both_paths():
    """`make bench-window` on a toy size: both paths timed, their ratio printed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, os.path.join(root, "bench", "window.py"), "--seq-len",
                        "64", "--window", "8", "--batch", "1", "--repeats", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert re.search(r"window 8 .* ms", r.stdout) and re.search(r"every key .* ms", r.stdout)
    assert re.search(r"every key / window: [0-9.]+x \(B 1, T 64", r.stdout)


def test_uncapped_attention_is_the_fused_path():
    """Gemma 3's global layers (no cap, no window) with its query scale on XLA's fused softmax
    and on the blocked kernel: both the plain softmax."""
    q, k, v = random_qkv(2, 16, 4, 1, 12)
    want = attn.reference(q, k, v, scale=GEMMA3.query_scale ** -0.5)
    for impl in ("xla", "blocked"):
        got = attn.attend(q, k, v, impl=impl, scale=GEMMA3.query_scale ** -0.5)
        np.testing.assert_allclose(got, want, atol=2e-6)


# ----------------------------------------------------------------------------------------------
# The whole model against a plain reference


def reference_forward(params, tokens, cfg):
    """Gemma 2/3 written out plainly in float64 numpy, one sequence, layer and head at a time,
    from the published description: x = E[t] sqrt(d); per layer pre-norm, q/k norm (Gemma 3),
    RoPE with the layer kind's base, logits q.k / sqrt(query_pre_attn_scalar), soft-capped
    c tanh(s/c) (Gemma 2), causal with a window on local layers (every layer but the n-th),
    post-norm, residual; GeGLU with tanh GELU likewise; final norm, tied logits, final cap.
    Every RMSNorm multiplies by (1 + w)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    lay, eps = p["layers"], cfg.norm_eps
    norm = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1.0 + w)
    cap = lambda s, c: c * np.tanh(s / c) if c else s
    gelu = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    T, H, N, K = tokens.shape[1], cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    pos = np.arange(T)

    def rope(x, theta, scale):
        inv = theta ** (-np.arange(0, H, 2) / H) / scale
        c, s = np.cos(pos[:, None] * inv)[:, None], np.sin(pos[:, None] * inv)[:, None]
        x1, x2 = x[..., :H // 2], x[..., H // 2:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    out = []
    for row in tokens:
        x = p["embed"][row] * np.sqrt(cfg.d_model)
        for i in range(cfg.n_layers):
            l = {k: v[i] for k, v in lay.items()}
            is_global = (i + 1) % cfg.global_every == 0
            h = norm(x, l["attn_norm"])
            q, k, v = (np.einsum("td,dnh->tnh", h, l[w]) for w in ("wq", "wk", "wv"))
            if cfg.qk_norm:
                q, k = norm(q, l["q_norm"]), norm(k, l["k_norm"])
            theta = cfg.rope_theta if is_global else cfg.rope_local_theta or cfg.rope_theta
            scale = (cfg.rope_linear or 1.0) if is_global else 1.0
            q, k = rope(q, theta, scale), rope(k, theta, scale)
            allowed = pos[None] <= pos[:, None]
            if not is_global:
                allowed &= pos[:, None] - pos[None] < cfg.sliding_window
            o = np.zeros((T, N, H))
            for n in range(N):
                kv = n // (N // K)
                s = cap(q[:, n] @ k[:, kv].T / np.sqrt(cfg.query_scale), cfg.attn_softcap)
                s = np.where(allowed, s, -np.inf)
                w = np.exp(s - s.max(-1, keepdims=True))
                o[:, n] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
            x = x + norm(np.einsum("tnh,nhd->td", o, l["wo"]), l["attn_post_norm"])
            h = norm(x, l["mlp_norm"])
            y = (gelu(h @ l["w_gate"]) * (h @ l["w_up"])) @ l["w_down"]
            x = x + norm(y, l["mlp_post_norm"])
        out.append(cap(norm(x, p["final_norm"]) @ p["embed"].T, cfg.final_softcap))
    return np.stack(out)


def unit_params(cfg, seed=0):
    """Weights whose every entry matters: unit-scale activations, (1 + w) gains away from 1."""
    p = td.init_params(cfg, jax.random.key(seed))
    fan_in = dict(wo=cfg.n_heads * cfg.head_dim, w_down=cfg.d_ff)
    leaves, tree = jax.tree_util.tree_flatten_with_path(p)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = []
    for (path, x), k in zip(leaves, keys):
        name = path[-1].key
        scale = 0.3 if "norm" in name else fan_in.get(name, cfg.d_model) ** -0.5
        out.append(scale * jax.random.normal(k, x.shape))
    return jax.tree_util.tree_unflatten(tree, out)


@pytest.mark.parametrize("cfg", [GEMMA2, GEMMA3], ids=["gemma2", "gemma3"])
@pytest.mark.parametrize("scan", [True, False])
def test_forward_equals_plain_reference(cfg, scan):
    cfg = dataclasses.replace(cfg, scan_layers=scan)
    params = unit_params(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16), np.int32)
    want = reference_forward(params, tokens, cfg)
    got = np.asarray(jax.jit(td.forward, static_argnums=2)(params, tokens, cfg))
    np.testing.assert_allclose(got, want, atol=2e-5)
    if not scan:
        return  # the knobs are the same code either way: checked once, with the scan
    # Each knob changes these logits, so the equality above holds each one to the reference.
    for knob in dict(gemma2=["sliding_window", "attn_softcap", "final_softcap", "norm_plus_one",
                             "sandwich_norm", "embed_scale", "gelu", "query_scale"],
                     gemma3=["rope_local_theta", "rope_linear", "qk_norm"])[
                         "gemma3" if cfg.qk_norm else "gemma2"]:
        off = dataclasses.replace(cfg, **{knob: type(getattr(cfg, knob))()})
        off_params = td.init_params(off, jax.random.key(0))
        off_params = jax.tree.map(lambda a, b: b, off_params, {
            k: v if k != "layers" else {n: w for n, w in v.items() if n in off_params["layers"]}
            for k, v in params.items()})
        assert max_diff(jax.jit(td.forward, static_argnums=2)(off_params, tokens, off),
                        got) > 1e-3, knob


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def test_training_loss_applies_the_final_soft_cap():
    """The fused and the rematerialised cross-entropy both see capped logits, with the cap's
    derivative in the gradient: each equals the plain loss over forward()'s logits."""
    params = unit_params(GEMMA2)
    batch = np.random.default_rng(0).integers(0, 64, (2, 17), np.int32)

    def plain(p):
        lg = td.forward(p, batch[:, :-1], GEMMA2)
        return jnp.mean(jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(
            lg, batch[:, 1:, None], -1)[..., 0])

    want, want_g = jax.value_and_grad(plain)(params)
    for impl in ("fused", "remat"):
        cfg = dataclasses.replace(GEMMA2, loss_impl=impl, loss_chunk=8)
        got, got_g = jax.value_and_grad(lambda p: td.loss_fn(p, batch, cfg)[0])(params)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
            np.testing.assert_allclose(a, b, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Presets

COUNTS = {"gemma-2b": 2_506_172_416, "gemma-7b": 8_537_680_896,  # Gemma 1
          "gemma2-2b": 2_614_341_888, "gemma2-9b": 9_241_705_984, "gemma2-27b": 27_227_128_320,
          "gemma3-1b": 999_885_952,
          # The text models of the released 4B/12B/27B configs (vocabulary 262,208); Google's
          # report gives their non-embedding parameters as 3,209M, 10,759M and 25,600M; the
          # Gemma 1 report 1,981,884,416 (2B) and 7,751,248,896 (7B).
          "gemma3-4b": 3_880_263_168, "gemma3-12b": 11_766_034_176,
          "gemma3-27b": 27_009_346_304}


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_preset_parameter_counts(name):
    cfg = td.PRESETS[name][1].model
    shapes = jax.eval_shape(partial(td._init, cfg), jax.random.key(0))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == COUNTS[name]
    non_embed = COUNTS[name] - cfg.vocab_size * cfg.d_model
    report = {"gemma3-4b": 3209, "gemma3-12b": 10759, "gemma3-27b": 25600,
              "gemma-2b": 1981.884416, "gemma-7b": 7751.248896}.get(name)
    assert report is None or round(non_embed / 1e6, 6 if name.startswith("gemma-") else 0) == report


def test_tiny_gemma_windows_its_training_sequence():
    cfg = td.PRESETS["tiny-gemma"][1]
    assert 0 < cfg.model.sliding_window < cfg.train.seq_len and cfg.model.global_every == 2


def test_flops_count_a_window_as_its_keys():
    full = dataclasses.replace(GEMMA2, sliding_window=0, global_every=0)
    per_key = 3 * 2 * 2 * GEMMA2.n_heads * GEMMA2.head_dim
    # 2 of 4 layers slide over 5 keys instead of 64.
    assert td.flops_per_token(full, 64) - td.flops_per_token(GEMMA2, 64) == 2 * (64 - 5) * per_key


@pytest.mark.parametrize("flags, match", [
    (["--model.global-every", "2"], "without --model.sliding-window"),
    (["--model.sliding-window", "-1"], "--model.sliding-window -1: must be >= 0"),
])
def test_bad_gemma_flags(flags, match):
    with pytest.raises(ConfigError, match=match):
        td.validate(td.cli(["tiny", *flags]), 1)


def test_qk_clip_is_refused_with_soft_capped_attention():
    cfg = td.cli(["tiny-gemma", "--train.optimizer", "muon", "--train.qk-clip-threshold", "100"])
    with pytest.raises(ConfigError, match="soft-cap already bounds the logits"):
        td.validate(cfg, 1)


# The logits of each Llama/Mistral/Qwen preset's model (shrunk: its knobs, small shapes) on a
# fixed seed, as main at c3929ff gave them before the Gemma knobs: mean |logit|, RMS, and the
# last position's first six logits of the second row. Compared with a tolerance of 1e-5 of the
# RMS, not bit for bit: XLA's CPU code differs by instruction set and version (JAX 0.10.2 and
# 0.12.0.1 differ by up to 7e-7), while the smallest change this guards against moves them 50x
# more (RoPE base doubled: 5e-4; norm eps x10: 1.7e-2; init scale +1%: 3.5e-2).
UNCHANGED = {
    "tiny": [0.2535861, 0.3179472, -0.05337199, -0.2036235, 0.1289719, 0.1465814, 0.3533709,
        0.03551265],
    "llama2-7b": [0.1275142, 0.1600737, 0.1906604, -0.1113661, 0.2756228, 0.03583647,
        -0.1042785, -0.3662836],
    "llama3.1-8b": [0.1275147, 0.1600722, 0.1907313, -0.1107867, 0.2755844, 0.03531685,
        -0.1044687, -0.3665005],
    "mistral-7b": [0.1275142, 0.1600715, 0.1906844, -0.1107011, 0.2756641, 0.03533713,
        -0.1044133, -0.3664055],
    "qwen3-0.6b": [0.1322941, 0.1781071, -0.3238482, -0.03548802, 0.08432225, 0.1153193,
        -0.02129931, -0.04247994],
    "qwen3-8b": [0.1288638, 0.1616429, 0.02517215, -0.1384355, 0.2961462, 0.182188, 0.132117,
        -0.009130836],
}


@pytest.mark.parametrize("name", sorted(UNCHANGED))
def test_llama_mistral_qwen_logits_are_unchanged(name):
    cfg = td.PRESETS[name][1].model
    if name != "tiny":
        cfg = dataclasses.replace(cfg, vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                                  head_dim=16, d_ff=128, dtype="float32",
                                  n_kv_heads=min(cfg.n_kv_heads, 2))
    params = td.init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 64), np.int32)
    lg = np.asarray(jax.jit(td.forward, static_argnums=2)(params, tokens, cfg), np.float64)
    got = [np.abs(lg).mean(), np.sqrt(np.mean(lg ** 2)), *lg[1, -1, :6]]
    want = UNCHANGED[name]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * want[1])
