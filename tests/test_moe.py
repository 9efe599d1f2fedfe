"""The MoE trainer against references: a naive per-token loop, itself on one device, hand
counts and hand-computed losses; and end to end: train, resume, refuse bad input."""
import dataclasses
import json
import math
import os
import subprocess
import sys
import sysconfig
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import train_moe as tm
from common.attention import attend
from common.data import DataConfig, prepare
from common.mesh import MeshConfig, MeshError, make_mesh
from tests.spawn import xla_flags
from tests.test_dense import _has_libtpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# gmm_tile 8 < the rows per expert: the tiled grouped matmul really pads several tiles.
# top_k 3 > the 2 experts a device holds at expert=4: the exchange's buffers are then
# smaller than all of a device's rows (see _dropless_exchange).
SMALL = tm.ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=8, n_experts=8, top_k=3, d_ff=16, max_seq_len=64, loss_chunk=8,
                       gmm_tile=8, grouped_matmul="tiled", qk_norm=True)
# Large enough that no expert ever overflows: C = ceil(cf * n * k / E) = n tokens.
NO_DROP_CF = SMALL.n_experts / SMALL.top_k


def small_cfg(model=SMALL, mesh=MeshConfig(fsdp=1), **train):
    t = dict(batch_size=8, seq_len=16, warmup_steps=2, steps=10, lr=1e-2)
    return tm.Config(model=model, train=tm.TrainConfig(**(t | train)), mesh=mesh)


def perturbed_params(model, seed=1):
    """Random weights with non-trivial norms (ones would hide bugs) and a router strong enough
    that the experts' loads are uneven. Drawn with numpy: compiling jax.random for every
    parameter costs seconds on the CPU."""
    rng = np.random.default_rng(seed)
    entry = lambda e: isinstance(e, tuple) and len(e) == 3 and isinstance(e[1], P)
    base = lambda shape, std: np.ones(shape) if std is None else std * rng.standard_normal(shape)
    p = jax.tree.map(lambda e: (base(e[0], e[2]) + 0.1 * rng.standard_normal(e[0])
                                ).astype(np.float32), tm._param_table(model), is_leaf=entry)
    p["layers"]["w_router"] *= 10
    return p


def tokens(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1),
                        dtype=np.int32)


def assert_trees_close(a, b, rtol=1e-4, atol=1e-6, scaled_atol=1e-5):
    """Leaf by leaf; an element near zero may also differ by `scaled_atol` of its leaf's largest
    magnitude: a gradient summed over tokens in another order (another device count, another
    XLA) cancels to small values whose float32 error follows the terms, not the result."""
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        tol = max(atol, scaled_atol * float(np.max(np.abs(y), initial=0.0)))
        np.testing.assert_allclose(x, y, rtol=rtol, atol=tol, err_msg=jax.tree_util.keystr(path))


# ------------------------------------------------------------------------ the MoE layer


def naive_moe(h_BTD, lp, cfg):
    """Token by token (vmapped for compile time, each token on its own): softmax over the
    router, the k best experts by argsort, the weighted sum of their SwiGLUs."""
    def one_token(x_D):
        p_E = jax.nn.softmax(x_D @ lp["w_router"])
        chosen = jnp.argsort(-p_E)[:cfg.top_k]
        w = p_E[chosen] / (p_E[chosen].sum() if cfg.norm_topk else 1.0)
        return sum(w[j] * tm.swiglu(x_D, {k: lp[k][e] for k in ("w_gate", "w_up", "w_down")})
                   for j, e in enumerate(chosen))
    B, T, D = h_BTD.shape
    return jax.vmap(one_token)(h_BTD.reshape(B * T, D)).reshape(B, T, D)


def one_layer(params):
    return jax.tree.map(lambda a: a[0], params["layers"])


@pytest.mark.parametrize("model", [
    SMALL, dataclasses.replace(SMALL, grouped_matmul="ragged_dot", norm_topk=False),
    dataclasses.replace(SMALL, grouped_matmul="megablox"),  # the TPU's kernel, interpreted
], ids=["tiled", "ragged_dot-no-renorm", "megablox"])
def test_dropless_layer_equals_naive_per_token_loop(model):
    lp = one_layer(perturbed_params(model))
    rng = np.random.default_rng(3)
    h = rng.standard_normal((2, 8, model.d_model), np.float32)
    ct = rng.standard_normal(h.shape, np.float32)   # a cotangent: every output matters
    keys = ("w_router", "w_gate", "w_up", "w_down")

    def output_and_grads(layer_fn):
        def f(h, ws):
            y = layer_fn(h, dict(lp, **ws))
            return jnp.sum(y * ct), y
        return jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True))

    ws = {k: lp[k] for k in keys}
    g_got, got = output_and_grads(lambda h, lp: tm.moe(h, lp, model)[0])(h, ws)
    g_want, want = output_and_grads(lambda h, lp: naive_moe(h, lp, model))(h, ws)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert_trees_close(g_got, g_want, rtol=1e-4, atol=1e-6)
    # The router gradient is not trivially zero: the gate weights depend on it.
    assert float(np.abs(g_want[1]["w_router"]).max()) > 1e-3
    # And the routing is uneven, so the groups are ragged.
    _, e, _ = jax.jit(partial(tm.router, cfg=model))(h, lp["w_router"])
    assert len(set(np.bincount(np.asarray(e).ravel(), minlength=8).tolist())) > 2


@pytest.mark.parametrize("attention", ["blocked", "xla", "einsum"])
def test_packed_segments_attend_as_if_alone(attention):
    """Two packed segments (segment ids, as SFT's packed rows pass them), each causal, attend
    as if each were alone, whichever kernel runs; an explicit mask_BTS (GRPO's padding and KV
    cache) means the same pattern."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((2, 12, 4, 8), np.float32)
    k, v = (rng.standard_normal((2, 12, 2, 8), np.float32) for _ in range(2))
    seg = np.array([0] * 5 + [1] * 7)
    att = partial(attend, impl=attention, scale=8 ** -0.5)
    got = np.asarray(att(q, k, v, segment_ids=jnp.asarray(np.stack([seg, seg]))))
    for a, b in ((0, 5), (5, 12)):
        alone = att(q[:, a:b], k[:, a:b], v[:, a:b])
        np.testing.assert_allclose(got[:, a:b], alone, rtol=1e-5, atol=1e-6)
    mask = np.broadcast_to((seg[:, None] == seg[None, :]) & np.tri(12, dtype=bool), (2, 12, 12))
    np.testing.assert_allclose(got, att(q, k, v, mask_BTS=mask), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------- sharded == one device


def loss_and_grads(cfg, params, batch, mesh):
    with jax.set_mesh(mesh):
        params = jax.device_put(params, tm.named(mesh, tm.param_specs(cfg.model)))
        batch = jax.device_put(batch, NamedSharding(mesh, P(tm.MOE_BATCH, None)))
        f = jax.jit(jax.value_and_grad(
            lambda p, b: tm.loss_fn(p, b, cfg.model, cfg.train), has_aux=True))
        (loss, aux), g = f(params, batch)
        return float(loss), jax.device_get(aux), jax.device_get(g)


@pytest.fixture(scope="module")
def reference():
    """Dropless, one device: the loss includes the load-balancing and router z-losses."""
    cfg = small_cfg(load_balance_loss=0.1, router_z_loss=0.01)
    params, batch = perturbed_params(SMALL), tokens(cfg)
    one = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    return cfg, params, batch, loss_and_grads(cfg, params, batch, one)


@pytest.mark.parametrize("mesh,impl,split", [
    (MeshConfig(data=2, fsdp=1, expert=4), "tiled", "f"),
    (MeshConfig(fsdp=2, expert=2, tensor=2), "tiled", "f"),
    (MeshConfig(fsdp=2, expert=2, tensor=2), "tiled", "d"),
    (MeshConfig(fsdp=2, expert=2, tensor=2), "megablox", "f")],
    ids=["expert4", "expert2-fsdp2-tensor2", "down-split-d", "megablox"])
def test_expert_parallel_equals_one_device(reference, mesh, impl, split):
    cfg, params, batch, (ref_loss, ref_aux, ref_g) = reference
    cfg = dataclasses.replace(cfg, mesh=mesh, model=dataclasses.replace(
        cfg.model, grouped_matmul=impl, down_split=split))  # megablox: unwritten rows cut off
    loss, aux, g = loss_and_grads(cfg, params, batch, make_mesh(mesh))
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert_trees_close(g, ref_g)
    np.testing.assert_allclose(aux["load_max"], ref_aux["load_max"], rtol=1e-6)
    assert float(np.max(aux["dropped"])) == 0.0
    assert float(np.min(ref_aux["load_min"])) < 1 / 8 < float(np.max(ref_aux["load_max"]))


EXPERT4 = MeshConfig(data=2, fsdp=1, expert=4)


@pytest.mark.parametrize("capacity,mesh,skewed", [
    (NO_DROP_CF, None, False),
    (NO_DROP_CF, EXPERT4, False),
    (0.0, EXPERT4, True),
], ids=["capacity-room-for-all", "capacity-room-for-all-expert4", "dropless-expert4-skewed"])
def test_moe_layer_equals_dropless_on_one_device(capacity, mesh, skewed):
    """One MoE layer, values and gradients: capacity mode with room for every token, on one
    device and through the capacity all-to-all; and dropless expert parallelism when every
    token picks experts 0 and 1 (both on peer 0), the worst case its buffers are sized for."""
    lp = one_layer(perturbed_params(SMALL))
    rng = np.random.default_rng(6)
    h = rng.standard_normal((8, 4, SMALL.d_model), np.float32)
    ct = rng.standard_normal(h.shape, np.float32)
    if skewed:
        h[..., 0] = 4.0 + np.abs(h[..., 0])
        lp["w_router"][0, :2] += 10.0
        _, e, _ = jax.jit(partial(tm.router, cfg=SMALL))(h, lp["w_router"])
        assert np.all(np.sort(np.asarray(e)[..., :2], axis=-1) == [0, 1])
    model = dataclasses.replace(SMALL, capacity_factor=capacity)

    def output_and_grads(model):
        def f(h, lp):
            y = tm.moe(h, lp, model)[0]
            return jnp.sum(y * ct), y
        return jax.jit(jax.grad(f, argnums=(0, 1), has_aux=True))

    g_want, want = output_and_grads(SMALL)(h, lp)
    if mesh is None:
        g_got, got = output_and_grads(model)(h, lp)
    else:
        m = make_mesh(mesh)
        with jax.set_mesh(m):
            specs = jax.tree.map(lambda s: P(*s[1:]), tm.param_specs(SMALL)["layers"],
                                 is_leaf=lambda x: isinstance(x, P))
            g_got, got = output_and_grads(model)(
                jax.device_put(h, NamedSharding(m, P(tm.MOE_BATCH))),
                jax.device_put(lp, tm.named(m, specs)))
    np.testing.assert_allclose(jax.device_get(got), want, rtol=1e-5, atol=1e-6)
    assert_trees_close(jax.device_get(g_got), g_want)


def test_microbatches_average_to_the_whole_batch():
    """train_step with --train.microbatches 2 on an expert-parallel mesh: the loss and the
    gradient are the microbatches' mean, so equal to one pass over the whole batch (the
    load-balancing loss is off: it is not linear in the batch, the rest is)."""
    cfg = small_cfg(mesh=EXPERT4, batch_size=16, load_balance_loss=0.0, router_z_loss=0.01,
                    z_loss=1e-3)
    batch = tokens(cfg)
    mesh = make_mesh(EXPERT4)
    metrics = []
    with jax.set_mesh(mesh):
        for M in (1, 2):
            c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=M))
            tm.validate(c, jax.device_count())
            st = tm.train_state(c, mesh)
            step = st.jit(partial(tm.train_step, cfg=c, tx=st.tx))
            _, m = step(st.fresh(jax.random.key(0)),
                        jax.device_put(batch, NamedSharding(mesh, P(tm.MOE_BATCH, None))))
            metrics.append(jax.device_get(m))
    one, two = metrics
    for key in ("loss", "grad_norm", "router_z"):
        assert float(two[key]) == pytest.approx(float(one[key]), rel=1e-5), key


def test_capacity_mode_drops_second_choices_first():
    """8 tokens, 4 experts, top-2, capacity factor 0.5: C = ceil(0.5 * 8 * 2 / 4) = 2.
    Tokens 0-3 choose (1, 0), tokens 4-7 choose (0, 1): expert 0 holds the first choices of
    4-7 and the second choices of 0-3, and keeps tokens 4 and 5 (first choices first);
    expert 1 likewise keeps tokens 0 and 1. 12 of the 16 assignments are dropped."""
    m = dataclasses.replace(SMALL, n_experts=4, top_k=2, capacity_factor=0.5)
    lp = one_layer(perturbed_params(m))
    x = np.random.default_rng(5).standard_normal((1, 8, m.d_model), np.float32)
    e = np.array([[1, 0]] * 4 + [[0, 1]] * 4, np.int32)[None]
    g = np.array([[0.75, 0.25]] * 8, np.float32)[None]
    w = {k: lp[k] for k in ("w_gate", "w_up", "w_down")}
    y, dropped = jax.jit(partial(tm.experts, cfg=m))(x, e, g, w)
    f = lambda t, ex: np.asarray(tm.swiglu(x[0, t], {k: a[ex] for k, a in w.items()}))
    want = np.zeros((8, m.d_model), np.float32)
    want[0], want[1] = 0.75 * f(0, 1), 0.75 * f(1, 1)
    want[4], want[5] = 0.75 * f(4, 0), 0.75 * f(5, 0)
    np.testing.assert_allclose(y[0], want, rtol=1e-5, atol=1e-6)
    assert int(dropped[0]) == 12
    _, stats = jax.jit(partial(tm.moe, cfg=m))(x, lp)   # the fraction the trainer logs
    assert 0 < float(stats["dropped"]) <= 1


# ------------------------------------------------------------------ the fused cross-entropy


def test_fused_loss_and_gradient_equal_autodiff_through_whole_logits():
    """train_dense.py's fused chunked cross-entropy, copied here: the objective (with the
    z-loss and both router losses), the reported ce and every gradient equal autodiff
    through the whole [B, T, V] logits, for one chunk per sequence and for several."""
    cfg = small_cfg(dataclasses.replace(SMALL, remat="none"), z_loss=1e-2, load_balance_loss=0.1,
                    router_z_loss=1e-2)
    params, batch, t = perturbed_params(cfg.model), tokens(cfg), cfg.train

    def plain(p):
        h, stats = tm.hidden(p, batch[:, :-1], cfg.model)
        lg = jnp.einsum("btd,dv->btv", h, tm.unembedding(p, cfg.model))
        lse = jax.nn.logsumexp(lg, -1)
        ce = lse - jnp.take_along_axis(lg, batch[:, 1:, None], -1)[..., 0]
        obj = (jnp.mean(ce + t.z_loss * lse ** 2) + t.load_balance_loss
               * jnp.mean(stats["aux_loss"]) + t.router_z_loss * jnp.mean(stats["router_z"]))
        return obj, jnp.mean(ce)

    (ref_obj, ref_ce), ref_g = jax.jit(jax.value_and_grad(plain, has_aux=True))(params)
    for chunk in (4, 16):
        m = dataclasses.replace(cfg.model, loss_chunk=chunk)
        (obj, aux), g = jax.jit(jax.value_and_grad(
            lambda p: tm.loss_fn(p, batch, m, t), has_aux=True))(params)
        assert float(obj) == pytest.approx(float(ref_obj), rel=1e-5)
        assert float(aux["ce"]) == pytest.approx(float(ref_ce), rel=1e-5)
        assert_trees_close(ref_g, g, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ router losses by hand


def test_router_aux_losses_equal_a_hand_computation():
    """Router = identity, so the logits are the activations we choose; top-1 of 4 experts."""
    m = dataclasses.replace(SMALL, n_experts=4, top_k=1, d_model=4)
    logits = np.array([[2.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 0.0],
                       [1.0, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, -1.0]], np.float32)
    _, e, s = jax.jit(partial(tm.router, cfg=m))(logits[None], jnp.eye(4))
    assert np.asarray(e).ravel().tolist() == [0, 1, 0, 0]   # the last row: three-way tie, first
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    f = np.array([3, 1, 0, 0]) / 4                         # tokens per expert / tokens
    P_ = probs.mean(0)                                     # mean router probability
    assert float(s["aux_loss"]) == pytest.approx(4 * np.sum(f * P_), rel=1e-6)
    lse = np.log(np.exp(logits).sum(1))
    assert float(s["router_z"]) == pytest.approx(np.mean(lse ** 2), rel=1e-6)
    assert float(s["load_min"]) == 0.0 and float(s["load_max"]) == 0.75
    # Uniform router probabilities give exactly top_k, however the ties are broken.
    m2 = dataclasses.replace(m, top_k=2)
    _, _, s2 = jax.jit(partial(tm.router, cfg=m2))(jnp.zeros((1, 4, 4)), jnp.eye(4))
    assert float(s2["aux_loss"]) == pytest.approx(2.0, rel=1e-6)


# ------------------------------------------------------------------------ parameter counts


@pytest.mark.parametrize("name,total,active_b", [
    ("mixtral-8x7b", 46_702_792_704, 12.9), ("qwen3-30b-a3b", 30_532_122_624, 3.4),
    ("qwen3-235b-a22b", 235_093_634_560, 22.2)])
def test_preset_parameter_counts(name, total, active_b):
    m = tm.PRESETS[name][1].model
    assert tm.count_params(m) == total
    # Active, by hand: embeddings and every attention weight, the router, top_k of the experts.
    D, N, K, H, L = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.n_layers
    attn = D * N * H + 2 * D * K * H + N * H * D + (2 * H if m.qk_norm else 0)
    per_layer = attn + 2 * D + D * m.n_experts + m.top_k * 3 * D * m.d_ff
    hand = m.vocab_size * D * (1 if m.tie_embeddings else 2) + L * per_layer + D
    assert tm.count_active_params(m) == hand
    assert round(hand / 1e9, 1) == active_b   # the published "A3B", "A22B", 12.9B


def test_tiny_moe_preset_is_a_few_million_parameters():
    m = tm.PRESETS["tiny-moe"][1].model
    assert 2e6 < tm.count_active_params(m) < tm.count_params(m) < 12e6


def test_param_specs_match_params_tree():
    shapes = jax.eval_shape(partial(tm._init, SMALL), jax.random.key(0))
    specs = tm.param_specs(SMALL)
    is_p = lambda x: isinstance(x, P)
    assert jax.tree.structure(shapes) == jax.tree.structure(specs, is_leaf=is_p)
    for s, spec in zip(jax.tree.leaves(shapes), jax.tree.leaves(specs, is_leaf=is_p)):
        assert len(spec) == len(s.shape)
    assert specs["layers"]["w_gate"] == P(None, "expert", ("fsdp", "context"), "tensor")
    assert specs["layers"]["w_down"] == P(None, "expert", ("tensor", "fsdp", "context"), None)


def test_flops_per_token_hand_count():
    m = tm.ModelConfig(vocab_size=100, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1,
                       head_dim=4, n_experts=4, top_k=2, d_ff=16)
    # per layer: wq 64, wk 32, wv 32, wo 64, router 8*4=32, two experts 2*3*8*16=768 -> 992
    # matmul weights 2*992 + unembed 800 = 2784; forward 2*2784 = 5568
    # attention, T=10: per layer 2 * 2 * 10 * 2 heads * 4 = 320; 2 layers = 640
    assert tm.flops_per_token(m, 10) == 3 * (5568 + 640)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("mesh,model,train,flag", [
    (MeshConfig(fsdp=-1, expert=4), {"n_experts": 6}, {}, "--mesh.expert 4"),
    (MeshConfig(fsdp=-1), {"top_k": 9}, {}, "--model.top-k 9"),
    (MeshConfig(fsdp=-1), {"n_experts": 1, "top_k": 1}, {}, "train_dense.py"),
    (MeshConfig(fsdp=-1), {"capacity_factor": -1.0}, {}, "--model.capacity-factor"),
    (MeshConfig(fsdp=2, expert=4), {}, {"batch_size": 4}, "data x fsdp x expert"),
    (MeshConfig(fsdp=2, expert=4, tensor=2), {}, {}, "--mesh.fsdp"),
    (MeshConfig(fsdp=-1, tensor=8), {}, {}, "--model.n-heads"),
    (MeshConfig(fsdp=4, tensor=2), {"d_ff": 36}, {}, "--model.down-split d"),  # w_down's F
])
def test_bad_config_is_a_clear_error_before_compiling(mesh, model, train, flag):
    cfg = small_cfg(dataclasses.replace(SMALL, **model), mesh, **train)
    with pytest.raises((tm.ConfigError, MeshError)) as e:
        tm.validate(cfg, jax.device_count())
    assert flag in str(e.value)


def test_down_split_d_asks_only_tensor_to_divide_d_ff():
    cfg = small_cfg(dataclasses.replace(SMALL, d_ff=36, down_split="d"), MeshConfig(fsdp=4,
                                                                                   tensor=2))
    tm.validate(cfg, jax.device_count())


def test_megablox_is_refused_for_a_gpu():
    cfg = small_cfg(dataclasses.replace(SMALL, grouped_matmul="megablox"), MeshConfig(fsdp=-1))
    with pytest.raises(tm.ConfigError, match="--model.grouped-matmul megablox is a TPU kernel"):
        tm.validate(cfg, jax.device_count(), "gpu")
    tm.validate(cfg, jax.device_count(), "tpu")


def test_cli_bad_input_exits_2_naming_the_flag(tmp_path):
    env = dict(os.environ, XLA_FLAGS=xla_flags(8))
    r = subprocess.run([sys.executable, "train_moe.py", "tiny-moe", "--mesh.expert", "3",
                        "--mesh.fsdp", "1", "--mesh.data", "-1", "--run-dir", str(tmp_path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--mesh.expert 3" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(not _has_libtpu(), reason="ahead-of-time TPU compilation needs libtpu "
                    "(pip install -e '.[tpu]'): `make test-tpu`")
def test_compile_topology_compiles_the_moe_step_for_a_tpu_slice():
    """The whole MoE training step, expert parallel, compiled by libtpu for a v5p-8 (4 chips)
    from this CPU host; a TPU type without --dry-run is refused."""
    report = tm.main(tm.cli(["tiny-moe", "--dry-run", "--compile-topology", "v5p-8",
                             "--mesh.expert", "2", "--mesh.fsdp", "2"]))
    assert report["devices"] == 4 and report["platform"] == "tpu"
    assert report["per_device_bytes"] > 0
    # The TPU's grouped matmul and attention (the compile target's), not the host CPU's.
    assert (report["grouped_matmul"], report["attention"]) == ("megablox", "splash")
    # Dropless experts in pipeline stages: megablox's kernel batched over them (ragged_dot's
    # transpose is not, and is refused).
    report = tm.main(tm.cli(["tiny-moe", "--dry-run", "--compile-topology", "v5p-8",
                             "--compile-slices", "2", "--mesh.dcn-stage", "2", "--mesh.fsdp", "2",
                             "--mesh.expert", "2", "--train.microbatches", "2"]))
    assert report["devices"] == 8 and report["grouped_matmul"] == "megablox"


@pytest.mark.skipif(not _has_libtpu(), reason="ahead-of-time TPU compilation needs libtpu "
                    "(pip install -e '.[tpu]'): `make test-tpu`")
def test_compile_topology_reduce_scatters_expert_gradients_from_the_kernel(monkeypatch):
    """w_down split over fsdp on F (`_layer_table`): each expert weight's gradient is
    reduce-scattered as megablox's kernel leaves it. Split on d, its last axis, XLA:TPU copied
    it to another layout first (here 1 copy; DeepSeek-V3 on v5p-32: 3 of 7.5 GB a step)."""
    compiled, compile_ = [], jax.stages.Lowered.compile

    def keep(self, *args, **kwargs):
        compiled.append(compile_(self, *args, **kwargs))
        return compiled[-1]
    monkeypatch.setattr(jax.stages.Lowered, "compile", keep)
    tm.main(tm.cli(["tiny-moe", "--dry-run", "--compile-topology", "v5p-8", "--mesh.fsdp", "4"]))
    hlo = compiled[-1].as_text()
    assert (hlo.count("reduce-scatter(%tgmm"), hlo.count("copy(%tgmm")) == (3, 0)


def test_compile_topology_needs_dry_run():
    with pytest.raises(tm.ConfigError, match="--dry-run"):
        tm.main(tm.cli(["tiny-moe", "--compile-topology", "v5p-8"]))


def test_cli_overrides_any_field():
    cfg = tm.cli(["qwen3-30b-a3b", "--model.n-layers", "3", "--mesh.expert", "8",
                  "--model.capacity-factor", "1.25"])
    assert cfg.model.n_layers == 3 and cfg.model.n_experts == 128 and cfg.mesh.expert == 8
    assert cfg.model.capacity_factor == 1.25 and cfg.model.qk_norm


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, f) for f in ("argparse.py", "textwrap.py", "string.py")]
    return prepare(files, str(tmp_path_factory.mktemp("d") / "prepared"), vocab_size=400)


def test_train_log_and_resume_on_an_expert_parallel_mesh(data_path, tmp_path, capsys):
    cfg = tm.Config(
        model=dataclasses.replace(SMALL, vocab_size=512),
        train=tm.TrainConfig(steps=4, batch_size=8, seq_len=16, warmup_steps=1, lr=1e-2,
                             schedule="constant", log_every=1, eval_every=100,
                             eval_batches=1, sample_tokens=0, peak_tflops=1.0),
        mesh=MeshConfig(data=2, fsdp=1, expert=4), data=DataConfig(path=data_path),
        checkpoint=tm.CheckpointConfig(every=2, keep=2), run_dir=str(tmp_path))
    first = tm.main(cfg)
    out = capsys.readouterr().out
    assert f"{tm.count_active_params(cfg.model):,} active" in out
    assert "| aux " in out and "| load " in out
    with open(tmp_path / "metrics.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert len(r["load_min"]) == len(r["load_max"]) == SMALL.n_layers
        assert all(0 <= lo <= 1 / 8 <= hi <= 1 for lo, hi in zip(r["load_min"], r["load_max"]))
        assert r["aux_loss"] >= SMALL.top_k - 1e-5 and r["dropped"] == 0.0
        assert math.isfinite(r["loss"])
    assert recs[-1]["loss"] < recs[0]["loss"]
    # A second start resumes from the last checkpoint, onto another mesh, and has nothing
    # left to do (training on after a resume: test_resumed_equals_uninterrupted).
    again = tm.main(dataclasses.replace(cfg, mesh=MeshConfig(fsdp=2, expert=2, tensor=2)))
    out = capsys.readouterr().out
    assert "resumed from step 4" in out and "nothing to train" in out
    assert again["final_step"] == first["final_step"] == 4
    for a, b in zip(jax.tree.leaves(jax.device_get(first["state"])),
                    jax.tree.leaves(jax.device_get(again["state"]))):
        np.testing.assert_array_equal(a, b)


def test_resumed_equals_uninterrupted(data_path, tmp_path, capsys):
    """6 steps in one go == 3 steps, then a resume to 6: the same state, bitwise, and the
    same loss at every step, on an expert-parallel mesh (the all-to-all path)."""
    def config(run_dir, steps):
        return tm.Config(
            model=dataclasses.replace(SMALL, vocab_size=512),
            train=tm.TrainConfig(steps=steps, batch_size=8, seq_len=16, warmup_steps=2,
                                 lr=1e-2, schedule="constant", log_every=1, eval_every=4,
                                 eval_batches=1, sample_tokens=4, peak_tflops=1.0),
            mesh=EXPERT4, data=DataConfig(path=data_path),
            checkpoint=tm.CheckpointConfig(every=3, keep=2), run_dir=str(run_dir))

    full = tm.main(config(tmp_path / "a", 6))
    tm.main(config(tmp_path / "b", 3))
    resumed = tm.main(config(tmp_path / "b", 6))
    out = capsys.readouterr().out
    assert "resumed from step 3" in out and "sample:" in out
    assert resumed["start_step"] == 3 and resumed["final_step"] == full["final_step"] == 6
    a, b = (jax.tree_util.tree_flatten_with_path(jax.device_get(r["state"]))[0]
            for r in (full, resumed))
    assert [path for path, _ in a] == [path for path, _ in b]
    assert any("w_router" in jax.tree_util.keystr(path) for path, _ in a)
    for (path, x), (_, y) in zip(a, b):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))  # bitwise

    def losses(run):
        with open(tmp_path / run / "metrics.jsonl") as f:
            recs = [json.loads(line) for line in f]
        return [r["step"] for r in recs if "loss" in r], [r["loss"] for r in recs if "loss" in r]

    (steps_a, la), (steps_b, lb) = losses("a"), losses("b")
    assert steps_a == steps_b == [1, 2, 3, 4, 5, 6]
    assert la == lb
