"""DeepSeek-V4's knobs in train_moe.py against references written here: the Sinkhorn projection
and the hyper-connections' mixing, the KV compressor (CSA's overlapping windows, HCA's), CSA's
choice of compressed keys, hash routing with sqrt-softplus scores, V4's clamped SwiGLU; the logits
of a deepseek_v4 folder made by transformers (tests/make_hf_fixtures.py: every layer kind, hash
layers, 2 streams), save and load, expert x fsdp x tensor against one device, the release's
parameter counts and a dry run of DeepSeek-V4-Flash with expert parallelism."""
import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_moe as tm
from common import hf
from common.mesh import MeshConfig, make_mesh
from common.train import ConfigError
from test_hf_moe import expected, fixture, hf_logits, live, max_diff

# The fixture's model: layers window, CSA (rate 4), HCA (rate 8), CSA, window; 2 hash layers.
V4 = tm.ModelConfig(
    vocab_size=64, d_model=32, n_layers=5, n_heads=4, n_kv_heads=1, head_dim=16, n_experts=4,
    top_k=2, d_ff=16, max_seq_len=64, q_lora_rank=12, rotary_dim=4, hc_mult=2,
    compress_ratios=(0, 4, 8, 4, 0), o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8,
    index_topk=2, n_hash_layers=2, sigmoid_routing=True, sqrt_softplus=True, routed_scale=1.5,
    n_shared_experts=1, swiglu_limit=1.0, sliding_window=4, attn_sinks=True, rope_theta=1000.0,
    compress_rope_theta=4000.0, yarn_factor=4.0, yarn_original_max_len=16, yarn_beta_fast=8.0,
    norm_eps=1e-6, loss_chunk=8, gmm_tile=8, grouped_matmul="tiled")
RNG = np.random.default_rng(0)


def rms(x, w=1.0, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def rope_pairs(x, pos, inv):
    """Pairs (2i, 2i+1) of the last 2 len(inv) dims turned by pos * inv_i (transformers' V4)."""
    R, ang = 2 * len(inv), pos[:, None] * inv[None]
    a, b = x[..., -R::2], x[..., 1 - R::2]
    r = np.stack([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)
    return np.concatenate([x[..., :-R], r.reshape(*x.shape[:-1], R)], -1)


def test_sinkhorn_projects_to_doubly_stochastic_as_the_loop_does():
    c = RNG.uniform(0.01, 1.0, (5, 4, 4))
    want = c / (c.sum(-2, keepdims=True) + 1e-6)
    for _ in range(19):
        want = want / (want.sum(-1, keepdims=True) + 1e-6)
        want = want / (want.sum(-2, keepdims=True) + 1e-6)
    got = np.asarray(tm.sinkhorn(jnp.asarray(c, jnp.float32), 20, 1e-6))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got.sum(-2), 1.0, atol=1e-5)   # columns exactly, rows nearly
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-3)
    assert np.abs(np.asarray(tm.sinkhorn(jnp.asarray(c, jnp.float32), 1, 1e-6)).sum(-1) - 1).max() > 0.05


def test_hyper_connections_equal_the_formula():
    """pre, post and comb from the normed flattened streams; the sublayer's input sum pre_s x_s;
    stream i after it post_i o + sum_j comb_ji x_j."""
    S, D, T = 3, 8, 5
    x = RNG.standard_normal((1, T, S, D))
    lp = {"hc_attn_fn": RNG.standard_normal((S * D, (2 + S) * S)) * 0.3,
          "hc_attn_base": RNG.standard_normal((2 + S) * S) * 0.3,
          "hc_attn_scale": 1 + RNG.standard_normal(3) * 0.3}
    cfg = dataclasses.replace(V4, hc_mult=S, hc_sinkhorn_iters=7)
    post, comb, h = tm.hc_pre(jnp.asarray(x, jnp.float32), jax.tree.map(
        lambda a: jnp.asarray(a, jnp.float32), lp), "attn", cfg)
    o = RNG.standard_normal((1, T, D))
    out = np.asarray(tm.hc_post(jnp.asarray(x, jnp.float32), jnp.asarray(o, jnp.float32), post, comb))
    for t in range(T):
        m = rms(x[0, t].reshape(-1)) @ lp["hc_attn_fn"]
        a, b = lp["hc_attn_scale"], lp["hc_attn_base"]
        pre = 1 / (1 + np.exp(-(m[:S] * a[0] + b[:S]))) + 1e-6
        pst = 2 / (1 + np.exp(-(m[S:2 * S] * a[1] + b[S:2 * S])))
        z = (m[2 * S:] * a[2] + b[2 * S:]).reshape(S, S)
        c = np.exp(z - z.max(-1, keepdims=True))
        c = c / c.sum(-1, keepdims=True) + 1e-6
        c = c / (c.sum(0) + 1e-6)
        for _ in range(6):
            c = c / (c.sum(1, keepdims=True) + 1e-6)
            c = c / (c.sum(0) + 1e-6)
        np.testing.assert_allclose(np.asarray(h)[0, t], pre @ x[0, t], rtol=1e-4, atol=1e-5)
        want = pst[:, None] * o[0, t][None] + c.T @ x[0, t]
        np.testing.assert_allclose(out[0, t], want, rtol=1e-4, atol=1e-5)


def reference_compress(h, cp, prefix, rate, overlap, inv):
    """Window by window: entry w = sum over its tokens (CSA: window w-1's first series, then
    window w's second) of softmax(z + bias) * c per channel, RMS-normed, turned at w * rate."""
    c, z = h @ cp[f"{prefix}_wkv"], h @ cp[f"{prefix}_wgate"]
    n, out = h.shape[0] // rate, []
    for w in range(n):
        zs = z[w * rate:(w + 1) * rate] + cp[f"{prefix}_bias"]
        cs = c[w * rate:(w + 1) * rate]
        if overlap:
            Hc = c.shape[1] // 2
            cs, zs = cs[:, Hc:], zs[:, Hc:]
            if w:
                prev = slice((w - 1) * rate, w * rate)
                cs = np.concatenate([c[prev, :Hc], cs])
                zs = np.concatenate([z[prev, :Hc] + cp[f"{prefix}_bias"][:, :Hc], zs])
        p = np.exp(zs - zs.max(0))
        out.append(rms((p / p.sum(0) * cs).sum(0), cp[f"{prefix}_norm"]))
    return rope_pairs(np.stack(out), np.arange(n) * rate, inv)


def random_stack(cfg, name, seed=1):
    rng = np.random.default_rng(seed)
    return {k: (0.3 * rng.standard_normal(shape[1:]) + (std is None)).astype(np.float32)
            for k, (shape, _, std) in tm._param_table(cfg)[name].items()}


@pytest.mark.parametrize("kind", ["csa", "hca"])
def test_compressor_equals_window_reference(kind):
    T, csa = 19, kind == "csa"   # a tail of 3 (CSA) or 3 (HCA) tokens: no entry
    cp = random_stack(V4, kind)
    h = RNG.standard_normal((2, T, V4.d_model)).astype(np.float32)
    inv = tm.rope_inv_freq(V4)
    rate = 4 if csa else 8
    got = np.asarray(tm.compress(jnp.asarray(h), cp, "cmp", rate, csa, inv, V4))
    assert got.shape == (2, T // rate, V4.head_dim)
    for b in range(2):
        want = reference_compress(h[b].astype(np.float64), {k: v.astype(np.float64) for k, v in
                                                            cp.items()}, "cmp", rate, csa, inv)
        np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-5)


def test_csa_sees_closed_windows_its_indexer_ranks_best():
    """Query t sees entry w iff its window closed (w < (t + 1) / 4) and the indexer's
    sum_m w_tm ReLU(q_tm . k_w) / sqrt(M I) ranks it among its best index_topk of those."""
    T, cfg = 24, V4
    cp = random_stack(cfg, "csa", seed=3)
    h = RNG.standard_normal((1, T, cfg.d_model)).astype(np.float32)
    c_q = RNG.standard_normal((1, T, cfg.q_lora_rank)).astype(np.float32)
    pos, inv = np.arange(T), tm.rope_inv_freq(cfg)
    keys, ok, _ = tm.compressed_keys(jnp.asarray(h), jnp.asarray(c_q), cp, jnp.asarray(pos)[None],
                                  inv, True, cfg)
    ok = np.asarray(ok)[0]
    f64 = {k: v.astype(np.float64) for k, v in cp.items()}
    ik = reference_compress(h[0].astype(np.float64), f64, "idx", 4, True, inv)
    wt = h[0] @ f64["idx_w"] / math.sqrt(cfg.index_n_heads * cfg.index_head_dim)
    for t in range(T):
        q = rope_pairs(np.einsum("r,rmi->mi", c_q[0, t], f64["idx_wq"]), np.full(2, t), inv)
        score = (wt[t][:, None] * np.maximum(q @ ik.T, 0)).sum(0)
        closed = (t + 1) // 4
        best = np.argsort(-score[:closed])[:cfg.index_topk]
        want = np.zeros(T // 4, bool)
        want[best] = True
        assert np.array_equal(ok[t], want), t
    assert ok[-1].sum() == cfg.index_topk < (T // 4)   # late queries: a real choice


def test_hash_routing_and_sqrt_softplus_scores():
    """Hash layers keep the token's experts; the weights are the chosen sqrt(softplus) scores,
    renormalised, times routed_scale, as on the learned layers (whose choice adds the bias)."""
    h = jax.random.normal(jax.random.key(0), (1, 16, V4.d_model))
    w = jax.random.normal(jax.random.key(1), (V4.d_model, V4.n_experts))
    fixed = jnp.asarray(RNG.integers(0, 4, (1, 16, 2)), jnp.int32)
    s = np.sqrt(np.log1p(np.exp(np.asarray(jnp.einsum("btd,de->bte", h, w)))))
    for hashed in (fixed, None):
        gate, expert, _ = tm.router(h, w, V4, bias_E=jnp.zeros(4), hashed=hashed)
        expert = np.asarray(expert)
        want = np.argsort(-s, -1)[..., :2] if hashed is None else np.asarray(fixed)
        assert np.array_equal(np.sort(expert, -1), np.sort(want, -1))
        chosen = np.take_along_axis(s, expert, -1)
        np.testing.assert_allclose(gate, 1.5 * chosen / chosen.sum(-1, keepdims=True), rtol=1e-5)


def test_v4_clamp_is_silu_of_the_clamped_gate_times_the_clamped_up():
    g, u = jnp.linspace(-3, 3, 13), jnp.linspace(3, -3, 13)
    want = jax.nn.silu(jnp.minimum(g, 1.0)) * jnp.clip(u, -1.0, 1.0)
    np.testing.assert_allclose(tm.glu(g, u, V4), want, rtol=1e-6)
    oss = tm.glu(g, u, dataclasses.replace(V4, hc_mult=0))   # GPT-OSS's differs
    assert float(jnp.max(jnp.abs(oss - want))) > 0.1


@pytest.fixture(scope="module")
def loaded():
    return tm.load_hf(fixture("deepseek_v4"))


def test_logits_match_transformers(loaded):
    cfg, params = loaded
    assert cfg == dataclasses.replace(V4, loss_chunk=256, gmm_tile=128, grouped_matmul="auto",
                                      rotary_dim=4, rope_theta=1000.0, yarn_beta_fast=8.0)
    tokens, want = expected("deepseek_v4")
    logits = lambda p, c=cfg: np.asarray(jax.jit(tm.forward, static_argnums=2)(p, tokens, c))
    diff = max_diff(logits(params), want)
    print(f"deepseek_v4: max |logit difference| {diff:.2e}")
    assert diff < 1e-4
    # each part is seen: the hash tables, the indexer's choice, the Sinkhorn iterations
    moved = dict(params, hash_layers=dict(params["hash_layers"], tid2eid=3 - params[
        "hash_layers"]["tid2eid"]))
    for p, c in ((moved, cfg), (params, dataclasses.replace(cfg, index_topk=4)),
                 (params, dataclasses.replace(cfg, hc_sinkhorn_iters=2))):
        assert max_diff(logits(p, c), want) > 1e-3


def test_save_load_round_trip(loaded, tmp_path):
    cfg, params = loaded
    out = str(tmp_path / "out")
    tm.save_hf(params, cfg, out, max_shard_bytes=6000)
    cfg2, params2 = tm.load_hf(out)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(jax.device_get(params2))):
        np.testing.assert_array_equal(a, b)
    src, ours = hf.Checkpoint(fixture("deepseek_v4")), hf.Checkpoint(out)
    assert {n: ours.shape(n) for n in ours.names()} == {n: src.shape(n) for n in src.names()}
    keys = ("layer_types", "compress_rates", "mlp_layer_types", "hc_mult", "o_groups",
            "swiglu_limit", "index_topk", "sliding_window", "scoring_func")
    assert {k: ours.config[k] for k in keys} == {k: src.config[k] for k in keys}
    assert ours.config["rope_parameters"]["compress"]["factor"] == 4.0


@live
def test_transformers_reads_our_export(loaded, tmp_path):
    cfg, params = loaded
    tm.save_hf(params, cfg, str(tmp_path))
    tokens, want = expected("deepseek_v4")
    assert max_diff(hf_logits(str(tmp_path), tokens), want) < 1e-4


def loss_and_grads(cfg, params, batch, mesh):
    bias = {"layers": {"router_bias": jnp.asarray(np.random.default_rng(5).standard_normal((
        3, 4)) * 0.1, jnp.float32)}}
    with jax.set_mesh(mesh):
        params = jax.device_put(params, tm.named(mesh, tm.param_specs(cfg)))
        f = jax.jit(jax.value_and_grad(lambda p, b: tm.loss_fn(tm.with_buffers(p, bias), b, cfg,
                                                               tm.TrainConfig()), has_aux=True))
        (loss, _), g = f(params, batch)
        return float(loss), jax.device_get(g)


def test_expert_fsdp_tensor_equals_one_device():
    cfg = dataclasses.replace(V4, vocab_size=128)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(lambda path, x: (np.asarray(x) + (
        0 if "tid2eid" in jax.tree_util.keystr(path) else 0.1 * rng.standard_normal(x.shape)
    )).astype(np.float32), tm.init_params(cfg, jax.random.key(0)))
    batch = rng.integers(0, cfg.vocab_size, (8, 25), dtype=np.int32)
    one = loss_and_grads(cfg, params, batch, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    got = loss_and_grads(cfg, params, batch, make_mesh(MeshConfig(fsdp=2, expert=2, tensor=2)))
    assert got[0] == pytest.approx(one[0], rel=1e-6)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(one[1])):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    for stack, name in (("layers", "hc_ffn_fn"), ("csa", "cmp_wgate"), ("hca", "cmp_bias"),
                        ("hash_layers", "w_router"), ("layers", "wo_a"), ("csa", "idx_wq"),
                        ("csa", "idx_wgate")):   # all trained, the indexer by its KL
        assert float(np.abs(one[1][stack][name]).max()) > 1e-5, (stack, name)
    assert float(np.abs(one[1]["hash_layers"]["tid2eid"]).max()) == 0.0   # frozen


def test_preset_parameter_counts():
    """transformers' DeepseekV4ForCausalLM of the release's config.json counted on the meta device
    (its MTP module left out, as here): 284,332,230,231 ("284B"); ours holds the 3 hash layers'
    token -> experts tables too (transformers' buffers), and 13.8B of it one token uses."""
    m = tm.PRESETS["deepseek-v4-flash"][1].model
    tables = 3 * m.vocab_size * m.top_k
    assert tm.count_params(m) == 284_332_230_231 + tables
    assert tm.count_active_params(m) == 284_332_230_231 + tables - 43 * 250 * 3 * 4096 * 2048
    assert round(tm.count_params(m) / 1e9) == 284
    tiny = tm.PRESETS["tiny-deepseek4"][1]
    tm.validate(tiny, 1)
    assert tm.v4_kinds(tiny.model)[2] == [1, 2, 1]


def test_flash_compiles_with_expert_parallelism():
    """The whole step at 1024 tokens, abstract: nothing is allocated on the 8 devices."""
    report = tm.main(tm.cli(["deepseek-v4-flash", "--dry-run", "--mesh.expert", "8",
                             "--train.batch-size", "8", "--train.seq-len", "1024", "--quiet"]))
    assert report["params"] == tm.count_params(tm.PRESETS["deepseek-v4-flash"][1].model)


@pytest.mark.parametrize("knobs,match", [
    (dict(compress_ratios=(0, 4)), "one per layer"),
    (dict(n_kv_heads=2), "n-kv-heads 1"),
    (dict(mtp_depth=1), "mtp-depth is not V4's"),
    (dict(hc_mult=0, index_n_heads=0), "DeepSeek-V4.s: add --model.hc-mult"),
])
def test_bad_configs(knobs, match):
    cfg = tm.Config(model=dataclasses.replace(V4, **knobs), train=tm.TrainConfig(
        batch_size=8, seq_len=16))
    with pytest.raises(ConfigError, match=match):
        tm.validate(cfg, 1)
