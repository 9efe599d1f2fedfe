"""Llama 4 in train_moe.py against references written here: chunked attention against masked
full attention, the unrotated global layer's query temperature position by position, the routing
(score before the experts, a shared expert) token by token, expert parallelism against one device,
each knob visible in the HF fixture's logits, transformers' parameter counts, and dry runs of the
released models on simulated devices. The logits against transformers: tests/test_hf_moe.py."""
import dataclasses
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_moe as tm
from common import attention as attn
from common import hf
from common.mesh import MeshConfig, make_mesh
from test_gptoss import qkv
from test_hf import multimodal_copy
from test_hf_moe import float8_folders
from test_moe import assert_trees_close, loss_and_grads, perturbed_params, small_cfg, tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Four layers, MoE on the odd ones (top-2 of 8 with a shared expert), chunks of 5 of 16 tokens,
# layer 3 unrotated with a temperature that rises within 16 positions (floor 4).
LLAMA4 = dataclasses.replace(
    tm.ModelConfig(**tm._LLAMA4), vocab_size=128, d_model=32, n_layers=4, n_heads=4,
    n_kv_heads=2, head_dim=8, n_experts=8, top_k=2, d_ff=16, max_seq_len=64, loss_chunk=8,
    gmm_tile=8, grouped_matmul="tiled", moe_every=2, dense_d_ff=24, attn_chunk=5,
    attn_temp_floor=4, qk_l2_norm=True, rope_theta=100.0)


# ------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("impl", ["xla", "blocked"])
@pytest.mark.parametrize("C", [4, 5])   # 5: 12 tokens padded to whole chunks
def test_chunked_attention_equals_masked_full_attention(impl, C):
    q, k, v = qkv()
    att = partial(attn.attend, impl=impl, scale=0.3)
    got = tm.in_chunks(att, C, q, k, v)
    chunk_BT = np.broadcast_to(np.arange(q.shape[1]) // C, q.shape[:2])
    want = attn.reference(q, k, v, scale=0.3, segment_ids=chunk_BT)  # causal within a chunk
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.abs(want - attn.reference(q, k, v, scale=0.3)).max() > 1e-2


def test_global_layer_is_unrotated_with_the_query_temperature_per_position():
    """A global layer (a dense one) against float64 position by position: no RoPE, query t
    times 1 + 0.1 log(1 + floor((t + 1) / 4)), plain causal softmax, then the MLP."""
    dp = jax.tree.map(lambda a: a[0], perturbed_params(LLAMA4)["dense_layers"])
    w = jax.tree.map(lambda a: np.asarray(a, np.float64), dp)
    x = np.random.default_rng(2).standard_normal((2, 16, 32))
    B, T, D = x.shape
    norm = lambda y, g: y / np.sqrt((y * y).mean(-1, keepdims=True) + LLAMA4.norm_eps) * g
    h = norm(x, w["attn_norm"])
    q, k, v = (np.einsum("btd,dnh->btnh", h, w[n]) for n in ("wq", "wk", "wv"))
    k, v = np.repeat(k, 2, 2), np.repeat(v, 2, 2)   # two query heads per key/value head
    o = np.zeros(q.shape)
    for t in range(T):
        temp = 1 + 0.1 * np.log1p(np.floor((t + 1) / 4))
        s = np.einsum("bnh,bsnh->bns", q[:, t] * temp, k[:, :t + 1]) / 8 ** 0.5
        p = np.exp(s - s.max(-1, keepdims=True))
        o[:, t] = np.einsum("bns,bsnh->bnh", p / p.sum(-1, keepdims=True), v[:, :t + 1])
    y = x + np.einsum("btnh,nhd->btd", o, w["wo"])
    h = norm(y, w["mlp_norm"])
    g, u = h @ w["mlp_gate"], h @ w["mlp_up"]
    want = y + (g / (1 + np.exp(-g)) * u) @ w["mlp_down"]
    pos = np.broadcast_to(np.arange(T), (B, T))
    run = jax.jit(lambda x, lp, m: tm.block(x, lp, pos, tm.rope_inv_freq(m), m,
                                            is_global=True)[0], static_argnums=2)
    np.testing.assert_allclose(run(x.astype(np.float32), dp, LLAMA4), want, rtol=1e-4,
                               atol=1e-4)
    cold = run(x.astype(np.float32), dp, dataclasses.replace(LLAMA4, attn_temp_scale=0.0))
    assert np.abs(np.asarray(cold) - want).max() > 1e-3   # the temperature shows


# --------------------------------------------------------------------------- the routing


def naive_llama4_moe(h_BTD, lp, cfg):
    """Token by token: the k largest router logits, each score sigmoid(logit) multiplying the
    chosen expert's input, the outputs summed, plus the shared expert on the token."""
    def one_token(x):
        logits = x @ lp["w_router"]
        top = jnp.argsort(-logits)[:cfg.top_k]
        expert = lambda e, y: tm.swiglu(y, {w: lp[w][e] for w in ("w_gate", "w_up", "w_down")})
        shared = tm.swiglu(x, {"w_" + w: lp["shared_" + w] for w in tm.PROJ})
        return shared + sum(expert(e, x * jax.nn.sigmoid(logits[e])) for e in top)
    B, T, D = h_BTD.shape
    return jax.vmap(one_token)(h_BTD.reshape(B * T, D)).reshape(B, T, D)


@pytest.mark.parametrize("knobs", [dict(), dict(grouped_matmul="ragged_dot"), dict(top_k=1),
                                   dict(capacity_factor=LLAMA4.n_experts / LLAMA4.top_k)],
                         ids=["tiled", "ragged_dot", "top-1", "capacity-room-for-all"])
def test_routing_scores_the_inputs_and_adds_the_shared_expert(knobs):
    model = dataclasses.replace(LLAMA4, **knobs)
    lp = jax.tree.map(lambda a: a[0], perturbed_params(model)["layers"])
    h = np.random.default_rng(3).standard_normal((2, 8, 32), np.float32)
    got = jax.jit(lambda h, lp: tm.moe(h, lp, model)[0])(h, lp)
    want = jax.jit(partial(naive_llama4_moe, cfg=model))(h, lp)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Scaling the outputs instead (every other family) is a different layer.
    other = jax.jit(lambda h, lp: tm.moe(h, lp, dataclasses.replace(model, score_inputs=False))[0])
    assert np.abs(np.asarray(other(h, lp)) - np.asarray(want)).max() > 1e-3


def test_expert_parallel_equals_one_device():
    """Loss and every gradient, expert 2 x fsdp 2 x tensor 2 against one device, over the
    dense and MoE stacks, chunks and the unrotated layer."""
    cfg = small_cfg(LLAMA4, load_balance_loss=0.1, router_z_loss=0.01)
    params, batch = perturbed_params(LLAMA4), tokens(cfg)
    one = loss_and_grads(cfg, params, batch, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    mesh = MeshConfig(fsdp=2, expert=2, tensor=2)
    got = loss_and_grads(dataclasses.replace(cfg, mesh=mesh), params, batch, make_mesh(mesh))
    assert got[0] == pytest.approx(one[0], rel=1e-6)
    assert_trees_close(got[2], one[2])
    assert float(np.abs(one[2]["dense_layers"]["mlp_gate"]).max()) > 1e-4
    assert float(np.abs(one[2]["layers"]["shared_gate"]).max()) > 1e-4


# ------------------------------------------------------------------ the fixture's knobs


@pytest.fixture(scope="module")
def fixture():
    folder = os.path.join(ROOT, "tests", "fixtures", "hf", "llama4_text")
    cfg, params = tm.load_hf(folder)
    e = np.load(os.path.join(folder, "expected.npz"))
    return cfg, params, e["tokens"], e["logits"]


@pytest.mark.parametrize("off", [
    dict(attn_chunk=0), dict(global_nope=False), dict(attn_temp_scale=0.0),
    dict(qk_l2_norm=False), dict(rope_scaling=0.0), dict(rope_interleave=False),
    dict(score_inputs=False)])
def test_each_knob_shows_in_the_fixture_logits(fixture, off):
    cfg, params, toks, want = fixture
    forward = jax.jit(tm.forward, static_argnums=2)
    assert np.abs(np.asarray(forward(params, toks, cfg)) - want).max() < 1e-4
    assert np.abs(np.asarray(forward(params, toks, dataclasses.replace(cfg, **off))) -
                  want).max() > 1e-3


def test_a_multimodal_folder_loads_its_language_model(fixture, tmp_path, capsys):
    """The released folders (model_type llama4): the text model's tensors under
    language_model., beside a vision tower, its config in text_config. The same logits as the
    text-only folder; export writes a text-only folder."""
    cfg, params, toks, want = fixture
    folder = multimodal_copy(os.path.join(ROOT, "tests", "fixtures", "hf", "llama4_text"),
                             tmp_path / "llama4", "llama4")
    cfg2, params2 = tm.load_hf(folder)
    assert cfg2 == cfg
    assert "not the 1 tensors of its other towers (vision_model." in capsys.readouterr().out
    got = jax.jit(tm.forward, static_argnums=2)(params2, toks, cfg2)
    assert np.abs(np.asarray(got) - want).max() < 1e-4
    tm.save_hf(params2, cfg2, str(tmp_path / "out"), base_config=hf.read_config(folder))
    out = hf.read_config(str(tmp_path / "out"), text=False)
    assert out["model_type"] == "llama4_text" and "text_config" not in out
    assert tm.load_hf(str(tmp_path / "out"))[0] == cfg


def test_fbgemm_float8_reads_as_its_dequantised_weights(tmp_path, monkeypatch):
    """Maverick's FP8 release (fbgemm, as transformers loads it): the MLPs and experts as e4m3
    with one scale per output channel (a Linear's [O, 1], gate_up_proj's [E, 1, 2F],
    down_proj's [E, D, 1]); attention, router and norms unquantised. It must load, sharded, as
    exactly the weights q * scale that a float32 folder of them holds."""
    def per_channel(name, w, f8):
        if "feed_forward" not in name or "router" in name:
            return None
        scale = np.abs(w).max(axis=1, keepdims=True) / 448   # [O, 1] or experts' [E, 1, O]
        q = (w / scale).astype(f8)
        return (q, "_scale", scale.swapaxes(1, 2) if name.endswith("down_proj") else scale,
                q.astype(np.float32) * scale)
    quant = float8_folders(hf.Checkpoint(os.path.join(ROOT, "tests", "fixtures", "hf",
                                                      "llama4_text")), tmp_path, monkeypatch,
                           per_channel, {"quant_method": "fbgemm_fp8",
                                         "activation_scale_ub": 1200.0})
    assert sum(t[0].endswith("_scale") for t in quant) == 16   # 2 dense MLPs, 2 shared, 2 x experts
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2, expert=2))
    _, want = tm.load_hf(str(tmp_path / "f32"))
    _, got = tm.load_hf(str(tmp_path / "fp8"), mesh)
    for a, b in zip(jax.tree.leaves(jax.device_get(want)), jax.tree.leaves(jax.device_get(got))):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------------ the released models


@pytest.mark.parametrize("name,total,active", [
    ("llama4-scout-17b-16e", 107_769_861_120, 17_172_894_720),
    ("llama4-maverick-17b-128e", 400_711_848_960, 17_184_691_200)])
def test_preset_parameter_counts(name, total, active):
    """transformers' Llama4ForCausalLM of each config.json (counted on its meta device): Meta's
    "17B active" and "109B" / "400B" total, which add the vision tower (~0.9B) to the text."""
    m = tm.PRESETS[name][1].model
    assert tm.count_params(m) == total and tm.count_active_params(m) == active
    D, L, F, Lm = m.d_model, m.n_layers, m.d_ff, tm.moe_layers(m)
    attn_w = 2 * D * m.n_heads * m.head_dim + 2 * D * m.n_kv_heads * m.head_dim
    hand = (2 * m.vocab_size * D + D + L * (attn_w + 2 * D) + Lm * (D * m.n_experts + 6 * D * F)
            + (L - Lm) * 3 * D * m.dense_d_ff)   # each MoE layer: one routed + the shared expert
    assert hand == active and round(active / 1e9) == 17


@pytest.mark.parametrize("name,mesh", [("llama4-scout-17b-16e", ["--mesh.expert", "8"]), (
    "llama4-maverick-17b-128e", ["--mesh.expert", "4", "--mesh.fsdp", "2"])])
def test_released_models_compile_with_expert_parallelism(name, mesh):
    """The whole step at 16k tokens (chunks of 8192 and the global layers), abstract: nothing is
    allocated on the 8 simulated devices."""
    report = tm.main(tm.cli([name, "--dry-run", *mesh, "--train.batch-size", "8",
                             "--train.seq-len", "16384", "--quiet"]))
    assert report["params"] == tm.count_params(tm.PRESETS[name][1].model)
