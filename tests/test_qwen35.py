"""Qwen3-Next's hybrid block in train_moe.py (issue 36): the chunkwise gated delta rule against
its token-by-token form and a float64 loop written here (values and gradients, chunk sizes that
do and do not divide the length), the whole model's logits against transformers' on a tiny
checkpoint (tests/make_hf_fixtures.py qwen3_next) and back out through save_hf, tensor x fsdp x
expert against one device, the 80B-A3B preset's counts against the published ones, the checks,
and a few steps of tiny-qwen35 lowering its loss. Qwen3.5's folders (qwen3_5_moe: the same block,
other names) are checked with the other families in tests/test_hf_moe.py; here their release
layout, experts fused two tensors a layer and the MTP module beside. Last, the dense models'
block in train_dense.py (qwen3_5 folders: tests/test_hf.py): sharded against one device, the
preset and its FLOPs, the refusals, left padding."""
import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import train_dense as td
import train_grpo as tg
import train_moe as tm
from common import hf
from common.mesh import MeshConfig, make_mesh
from common.train import ConfigError
from test_deepseek import DS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3_next")
# tiny-qwen35 smaller still: 4 layers (3 DeltaNet, 1 attention), 2 key heads serving 4 value
# heads, chunks of 8 (the 13-token windows below: a padded tail)
CFG = dataclasses.replace(tm.PRESETS["tiny-qwen35"][1].model, vocab_size=128, d_model=32,
                          head_dim=16, rotary_dim=4, d_ff=32, linear_k_dim=8, linear_v_dim=6,
                          linear_chunk=8)


def delta_rule_float64(q, k, v, g, b):
    """S <- e^g S;  S <- S + b k (v - S^T k)^T;  o = S^T q: one token and one head at a time."""
    B, T, H, Dk = k.shape
    o = np.zeros(v.shape)
    for i in range(B):
        for h in range(H):
            S = np.zeros((Dk, v.shape[-1]))
            for t in range(T):
                S = np.exp(g[i, t, h]) * S
                S = S + b[i, t, h] * np.outer(k[i, t, h], v[i, t, h] - S.T @ k[i, t, h])
                o[i, t, h] = S.T @ q[i, t, h]
    return o


def delta_inputs(T, seed=0, B=2, H=3, Dk=8, Dv=6):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    return (unit(rng.normal(size=(B, T, H, Dk))) / math.sqrt(Dk), unit(rng.normal(size=(
        B, T, H, Dk))), rng.normal(size=(B, T, H, Dv)), -rng.uniform(0, 1.5, (B, T, H)),
        1 / (1 + np.exp(-rng.normal(size=(B, T, H)))))


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_chunked_delta_rule_equals_recurrent_and_float64(chunk):
    """T = 19: chunks of 4 and 7 leave a padded tail, 64 is one chunk. Values against the
    float64 loop; gradients of a random projection of the output against the recurrent form's
    and against float64 central differences along a random direction (every input moved)."""
    xs = delta_inputs(19)
    f32 = [jnp.asarray(x, jnp.float32) for x in xs]
    want = delta_rule_float64(*xs)
    chunked = jax.jit(partial_chunk := lambda *a: tm.delta_rule_chunked(*a, chunk)[0])
    np.testing.assert_allclose(chunked(*f32), want, atol=2e-6)
    np.testing.assert_allclose(jax.jit(tm.delta_rule_recurrent)(*f32), want, atol=2e-6)
    w = np.random.default_rng(1).normal(size=want.shape)
    grads = [jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=range(5))(*f32)
             for f in (partial_chunk, tm.delta_rule_recurrent)]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, atol=2e-5)
    d = [np.random.default_rng(2 + i).normal(size=x.shape) for i, x in enumerate(xs)]
    eps = 1e-6
    moved = lambda s: np.sum(delta_rule_float64(*[x + s * e for x, e in zip(xs, d)]) * w)
    numeric = (moved(eps) - moved(-eps)) / (2 * eps)
    analytic = sum(float(jnp.sum(gr * e)) for gr, e in zip(grads[0], d))
    assert analytic == pytest.approx(numeric, rel=1e-4)


def test_the_gate_decays_and_beta_writes():
    """g = 0, b = 1 writes each value over the last (|k| = 1 keys repeated: o_t = v_t); g very
    negative forgets everything before the token: o_t = b_t v_t (k_t.q_t) alone."""
    q, k, v, g, b = delta_inputs(9)
    k = np.broadcast_to(k[:, :1], k.shape)
    out = np.asarray(tm.delta_rule_chunked(k, k, v, np.zeros_like(g), np.ones_like(b), 4)[0])
    np.testing.assert_allclose(out, v, atol=1e-5)
    out = np.asarray(tm.delta_rule_chunked(q, k, v, np.full_like(g, -80.0), b, 4)[0])
    np.testing.assert_allclose(out, b[..., None] * v * np.sum(k * q, -1, keepdims=True),
                               atol=1e-6)


def random_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: np.asarray(x) + 0.1 * rng.standard_normal(x.shape).astype(
        np.float32), tm.init_params(cfg, jax.random.key(seed)))


def loss_and_grads(cfg, params, batch, mesh):
    with jax.set_mesh(mesh):
        params = jax.device_put(params, tm.named(mesh, tm.param_specs(cfg)))
        f = jax.jit(jax.value_and_grad(lambda p, b: tm.loss_fn(p, b, cfg, tm.TrainConfig(
            load_balance_loss=0.1))[0]))
        loss, g = f(params, batch)
        return float(loss), jax.device_get(g)


def test_sharded_equals_one_device():
    """Loss and every gradient on tensor 2 x fsdp 2 x expert 2 (DeltaNet's key-head groups,
    the attention's heads and the shared expert over tensor) against one device. Within 1e-3 of
    each leaf's largest entry: float32's error here, not the sharding's (against float64 on one
    device the one-device gradients of lin_q are off by 1.4e-4 of 3.2, a data-parallel 8's by
    6.6e-4: the chunks' triangular solves and the L2 norms amplify the summation order)."""
    cfg = dataclasses.replace(CFG, n_kv_heads=2)
    params, batch = random_params(cfg), np.random.default_rng(3).integers(
        0, cfg.vocab_size, (8, 14), dtype=np.int32)
    one = loss_and_grads(cfg, params, batch, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    got = loss_and_grads(cfg, params, batch, make_mesh(MeshConfig(fsdp=2, expert=2, tensor=2)))
    assert got[0] == pytest.approx(one[0], rel=1e-6)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(one[1])):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-3 * np.abs(y).max(),
                                   err_msg=jax.tree_util.keystr(path))
    for name in ("lin_q", "lin_k", "lin_v", "lin_z", "lin_b", "lin_a", "lin_conv", "A_log",
                 "dt_bias", "lin_norm", "shared_router"):
        assert float(np.abs(one[1]["layers"][name]).max()) > 1e-6, name   # each is trained
    assert float(np.abs(one[1]["global_layers"]["wq_gate"]).max()) > 1e-6


def test_preset_parameter_counts():
    """Qwen3-Next-80B-A3B: "80B in total and 3B activated", 79B without the embeddings (its
    model card). Ours: 79,674,391,296 in all, 3,874,929,408 a token uses, of which the
    embedding and the head are 2 x 151936 x 2048."""
    cfg = tm.PRESETS["qwen3-next-80b-a3b"][1]
    tm.validate(cfg, 8)
    m, embeddings = cfg.model, 2 * 151936 * 2048
    assert tm.count_params(m) == 79_674_391_296 and round(tm.count_params(m) / 1e9) == 80
    assert round((tm.count_params(m) - embeddings) / 1e9) == 79
    assert tm.count_active_params(m) == 3_874_929_408
    assert round((tm.count_active_params(m) - embeddings) / 1e9) == 3
    shapes = jax.eval_shape(lambda: tm.init_params(m, jax.random.key(0)))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == tm.count_params(m)
    tm.validate(tm.PRESETS["tiny-qwen35"][1], 1)


@pytest.mark.parametrize("name,total,active,vision,published", [
    ("qwen3.5-397b-a17b", 396_346_350_336, 17_349_040_896, 456_010_480, (397, 17)),
    ("qwen3.5-35b-a3b", 34_660_610_688, 3_454_988_928, 446_571_248, (35, 3))])
def test_qwen35_preset_counts(name, total, active, vision, published):
    """Qwen3.5's "397B-A17B" and "35B-A3B" count the vision tower too (not the MTP module): with
    transformers' Qwen3.5 vision config (27 blocks 1152 wide, out to d_model; `vision` counted
    there on the meta device), 396.8B and 35.1B in all; 17.3B and 3.5B a token uses (ours, the
    embedding and head included). A shared expert 4096 wide (one report's) would make 19.6B."""
    m = tm.PRESETS[name][1].model
    tm.validate(tm.PRESETS[name][1], 8)
    assert (tm.count_params(m), tm.count_active_params(m)) == (total, active)
    assert (round((total + vision) / 1e9), round(active / 1e9)) == published
    shapes = jax.eval_shape(lambda: tm.init_params(m, jax.random.key(0)))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == total


def test_bad_flags():
    with pytest.raises(ConfigError, match="--mesh.context"):
        tm.validate(tm.Config(model=CFG, mesh=MeshConfig(context=2, fsdp=-1)), 8)
    with pytest.raises(ConfigError, match="--model.linear-k-heads 2 .* --model.n-layers 6"):
        tm.validate(tm.Config(model=dataclasses.replace(CFG, n_layers=6)), 8)
    with pytest.raises(ConfigError, match="--model.linear-v-heads 3"):
        tm.validate(tm.Config(model=dataclasses.replace(CFG, linear_v_heads=3)), 8)
    with pytest.raises(ConfigError, match="--model.rotary-dim 17 turns 18 dims"):
        tm.validate(tm.Config(model=dataclasses.replace(CFG, rotary_dim=17)), 8)
    with pytest.raises(ConfigError, match="--model.linear-k-heads"):
        tm.validate(tm.Config(model=dataclasses.replace(CFG, n_kv_heads=4), mesh=MeshConfig(
            fsdp=1, tensor=4, data=2)), 8)


def test_shared_expert_of_its_own_width_and_odd_rotary_counts():
    """--model.shared-d-ff: a shared expert of its own width (Qwen3.5's and Qwen3-Next's
    shared_expert_intermediate_size; the qwen3_next_own_shared fixture's logits, round trip and
    export: tests/test_hf_moe.py), counted, written and read back, only where a shared expert is
    and in Qwen's folders. An odd rotary count R turns R + 1 dims at theta^(-2i/R), as
    transformers' int(head_dim x partial_rotary_factor) does: refused only past the head."""
    D, L, F, wide = CFG.d_model, CFG.n_layers, CFG.d_ff, dataclasses.replace(CFG, shared_d_ff=48)
    tm.validate(tm.Config(model=wide), 8)
    shapes = jax.eval_shape(lambda: tm.init_params(wide, jax.random.key(0)))
    assert shapes["layers"]["shared_up"].shape == (L - 1, D, 48)
    assert shapes["global_layers"]["shared_down"].shape == (1, 48, D)
    assert tm.count_params(wide) - tm.count_params(CFG) == 3 * D * (48 - F) * L == \
        tm.count_active_params(wide) - tm.count_active_params(CFG)
    assert tm.flops_per_token(wide, 16) - tm.flops_per_token(CFG, 16) == 6 * 3 * D * (48 - F) * L
    c = tm.config_to_hf(wide)
    assert c["shared_expert_intermediate_size"] == 48 and tm.config_from_hf(c).shared_d_ff == 48
    assert tm.config_from_hf(tm.config_to_hf(CFG)).shared_d_ff == 0   # as wide as the experts
    with pytest.raises(ConfigError, match="--model.shared-d-ff shape a shared expert"):
        tm.validate(tm.Config(model=dataclasses.replace(wide, n_shared_experts=0,
                                                        shared_gated=False)), 8)
    with pytest.raises(hf.HFError, match="does not fit"):
        tm.config_to_hf(dataclasses.replace(DS, shared_d_ff=8))
    odd = dataclasses.replace(CFG, rotary_dim=5)
    tm.validate(tm.Config(model=odd), 8)
    np.testing.assert_allclose(tm.rope_inv_freq(odd), CFG.rope_theta ** -(np.arange(0, 5, 2) / 5),
                               rtol=1e-6)
    c = tm.config_to_hf(odd)
    assert tm.config_from_hf(c).rotary_dim == 5
    c["rope_parameters"]["partial_rotary_factor"] = c["partial_rotary_factor"] = 1.0
    with pytest.raises(hf.HFError, match="16 dims turned of 15"):
        tm.config_from_hf(c | {"head_dim": 15})


def test_a_few_steps_lower_the_loss():
    """tiny-qwen35's block at test size, Adam on one batch: the loss falls."""
    params = tm.init_params(CFG, jax.random.key(0))
    batch = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 33), dtype=np.int32)
    tx = optax.adam(3e-3)
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss, g = jax.value_and_grad(lambda p: tm.loss_fn(p, batch, CFG)[0])(params)
        upd, state = tx.update(g, state)
        return optax.apply_updates(params, upd), state, loss
    losses = []
    for _ in range(12):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses


def test_qwen35_release_layout(tmp_path):
    """Qwen3.5's releases hold each layer's experts in two tensors (gate_up_proj [E, 2F, D], the
    gate the first half; down_proj [E, D, F]), as transformers 5 does, and keep the MTP module
    (mtp.*), which transformers' text model skips. The fixture written so, as a text-only
    folder: the same parameters, bit for bit; a fused tensor of another shape is refused."""
    src = hf.Checkpoint(os.path.join(ROOT, "tests", "fixtures", "hf", "qwen3_5_moe"))
    cfg, want = tm.load_hf(src.path)
    f32, tensors = np.dtype(np.float32), []
    at = lambda n: np.asarray(src.array(n), np.float32)
    for name in sorted(src.names()):
        if ".experts.0." in name and name.endswith("gate_proj.weight"):
            pre, E = name.split("experts.0.")[0] + "experts.", cfg.n_experts
            one = lambda p: np.stack([at(f"{pre}{e}.{p}_proj.weight") for e in range(E)])
            fused = {"gate_up_proj": np.concatenate([one("gate"), one("up")], 1),
                     "down_proj": one("down")}
            tensors += [(pre + k, x.shape, f32, lambda x=x: x) for k, x in fused.items()]
        elif ".experts." not in name:
            tensors.append((name, src.shape(name), f32, lambda n=name: at(n)))
    tensors.append(("mtp.fc.weight", (4, 4), f32, lambda: np.ones((4, 4), np.float32)))
    os.makedirs(tmp_path / "fused")
    hf._write_file(str(tmp_path / "fused" / hf.SINGLE), tensors)
    hf.write_json(str(tmp_path / "fused" / hf.CONFIG), src.config)
    cfg2, got = tm.load_hf(str(tmp_path / "fused"))
    assert cfg2 == cfg and cfg.linear_v_heads // cfg.linear_k_heads == 3
    for a, b in zip(jax.tree.leaves(jax.device_get(want)), jax.tree.leaves(jax.device_get(got))):
        np.testing.assert_array_equal(a, b)
    down = "model.layers.1.mlp.experts.down_proj"
    hf._write_file(str(tmp_path / "fused" / hf.SINGLE), [
        t if t[0] != down else (down, (4, 32, 8), f32, lambda: np.zeros((4, 32, 8), np.float32))
        for t in tensors])
    with pytest.raises(hf.HFError, match=r"down_proj has shape \[4, 32, 8\] but config.json "
                                         r"implies \[4, 32, 16\]"):
        tm.load_hf(str(tmp_path / "fused"))


# ----------------------------------------------------------------------------------------------
# Qwen3.5's dense models in train_dense.py (the same DeltaNet, a SwiGLU MLP in every layer);
# their qwen3_5 folders' parity, round trip and sharded load are tests/test_hf.py's.
DENSE = dataclasses.replace(td.PRESETS["tiny-qwen35-dense"][1].model, vocab_size=128, d_model=32,
                            head_dim=16, rotary_dim=4, d_ff=48, linear_k_dim=8, linear_v_dim=6,
                            linear_chunk=8)


def dense_loss_and_grads(params, batch, mesh):
    with jax.set_mesh(mesh):
        params = jax.device_put(params, td.named(mesh, td.param_specs(DENSE)))
        loss, g = jax.jit(jax.value_and_grad(lambda p: td.loss_fn(p, batch, DENSE)[0]))(params)
        return float(loss), jax.device_get(g)


def test_dense_sharded_equals_one_device_and_every_weight_learns():
    """tensor 2 x fsdp 2 x data 2 (DeltaNet's key-head groups and the attention's heads over
    tensor) against one device, as train_moe.py's twin above; then Adam on one batch lowers
    the loss."""
    rng = np.random.default_rng(4)
    params = jax.tree.map(lambda x: np.asarray(x) + 0.1 * rng.standard_normal(x.shape).astype(
        np.float32), td.init_params(DENSE, jax.random.key(1)))
    batch = rng.integers(0, DENSE.vocab_size, (8, 14), dtype=np.int32)
    one = dense_loss_and_grads(params, batch, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    got = dense_loss_and_grads(params, batch, make_mesh(MeshConfig(fsdp=2, data=2, tensor=2)))
    assert got[0] == pytest.approx(one[0], rel=1e-6)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(one[1])):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-3 * np.abs(y).max(),
                                   err_msg=jax.tree_util.keystr(path))
    for stack, names in (("layers", ("lin_q", "lin_k", "lin_v", "lin_z", "lin_b", "lin_a",
                                     "lin_conv", "A_log", "dt_bias", "lin_norm", "lin_wo")),
                         ("global_layers", ("wq", "wq_gate", "q_norm", "k_norm"))):
        for name in names:
            assert float(np.abs(one[1][stack][name]).max()) > 1e-6, name   # each is trained
    tx = optax.adam(3e-3)
    state, losses = tx.init(params), []
    step = jax.jit(lambda p, s: (lambda l, g: (l, *tx.update(g, s)))(*jax.value_and_grad(
        lambda p: td.loss_fn(p, batch, DENSE)[0])(p)))
    for _ in range(10):
        loss, upd, state = step(params, state)
        params, losses = optax.apply_updates(params, upd), losses + [float(loss)]
    assert losses[-1] < losses[0] - 0.5, losses


def test_dense_preset_and_flops():
    """The preset validates; its parameters are what init makes; DeltaNet layers cost their
    projections and chunk work, no attention over keys (against the same model all attention)."""
    cfg = td.PRESETS["tiny-qwen35-dense"][1]
    td.validate(cfg, 8)
    shapes = jax.eval_shape(lambda: td.init_params(cfg.model, jax.random.key(0)))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == td.count_params(cfg.model)
    m, T = cfg.model, 256
    plain = dataclasses.replace(m, linear_k_heads=0, linear_v_heads=0, global_every=0,
                                attn_gate=False)
    D, N, H, Hv, Dk, Dv, C = m.d_model, m.n_heads, m.head_dim, 4, 64, 64, 64
    lin = D * (2 * 2 * Dk + 2 * Hv * Dv + 2 * Hv) + Hv * Dv * D + Hv * (
        C * 2 * (Dk + Dv) + 3 * Dk * Dv)
    attn = D * N * H * 2 + D * m.n_kv_heads * H * 2
    assert td.flops_per_token(m, T) - td.flops_per_token(plain, T) == pytest.approx(
        3 * (2 * (3 * (lin - attn) + D * N * H) - 3 * 4 * T * H * N))


@pytest.mark.parametrize("change, mesh, match", [
    (dict(), MeshConfig(context=2, fsdp=-1), "--model.linear-k-heads 2 with --mesh.context 2"),
    (dict(), MeshConfig(stage=2, fsdp=-1), "--mesh.stage 2"),
    (dict(n_layers=6), MeshConfig(), r"--model.linear-k-heads 2 .* --model.n-layers 6"),
    (dict(linear_v_heads=3), MeshConfig(), "whole group of --model.linear-v-heads 3"),
    (dict(rotary_dim=5), MeshConfig(), "--model.rotary-dim 5"),
    (dict(sliding_window=8), MeshConfig(), "without Gemma's windows"),
    (dict(linear_k_heads=0, global_every=0), MeshConfig(), "--model.linear-v-heads 4 without"),
    (dict(n_kv_heads=4), MeshConfig(tensor=4, fsdp=-1), "--model.linear-k-heads 2 is not divisible by "
                                            "--mesh.tensor 4")])
def test_dense_bad_flags(change, mesh, match):
    cfg = td.Config(model=dataclasses.replace(DENSE, **change), mesh=mesh,
                    train=td.TrainConfig(microbatches=2))
    with pytest.raises(ConfigError, match=match):
        td.validate(cfg, 8)


def test_dense_refusals_by_name():
    """QK-clip has no logits in DeltaNet layers, in either trainer of the dense model (GRPO
    decodes Qwen3.5: tests/test_grpo.py)."""
    with pytest.raises(ConfigError, match="--train.qk-clip-threshold 50.0: the delta rule"):
        td.validate(td.Config(model=DENSE, train=td.TrainConfig(qk_clip_threshold=50.0)), 8)
    cfg = tg.cli(["tiny", "--model.linear-k-heads", "2", "--model.linear-v-heads", "4",
                  "--model.global-every", "2", "--model.attn-gate", "--model.qk-norm",
                  "--grpo.qk-clip-threshold", "50"])
    with pytest.raises(ConfigError, match="--grpo.qk-clip-threshold 50.0: the delta rule"):
        tg.validate(cfg, 8, tg.CharTokenizer())
    tg.validate(dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, qk_clip_threshold=0)),
                8, tg.CharTokenizer())


def test_dense_left_padding_is_as_if_absent():
    """A prompt left-padded for decoding (`sampling.prompt_rows`: padding a segment 0 of its own,
    positions from the prompt's start) gives the logits of the prompt alone: DeltaNet's state
    stays 0 through the zeroed padding, its convolution sees zeros as before a row's start."""
    params = td.init_params(DENSE, jax.random.key(2))
    tokens = np.random.default_rng(5).integers(1, DENSE.vocab_size, (1, 11), dtype=np.int32)
    pad = 5
    padded = np.concatenate([np.full((1, pad), 7, np.int32), tokens], 1)
    seg = (np.arange(pad + 11) >= pad).astype(np.int32)[None]
    pos = np.maximum(np.arange(pad + 11) - pad, 0)[None]
    want = td.forward(params, tokens, DENSE)
    got = td.forward(params, padded, DENSE, segment_ids=seg, positions=pos)[:, pad:]
    np.testing.assert_allclose(got, want, atol=2e-5)
    lp = jax.tree.map(lambda a: a[0], params["layers"])   # unzeroed, the padding would leak
    h = np.random.default_rng(6).standard_normal((1, pad + 11, DENSE.d_model)).astype(np.float32)
    mix = lambda h: td.gated_deltanet(h, lp, DENSE)[0]
    leak = mix(h)[:, pad:] - mix(h[:, pad:])
    assert float(np.abs(leak).max()) > 1e-3
