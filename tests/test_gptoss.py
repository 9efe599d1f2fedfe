"""GPT-OSS in train_moe.py against references written here: attention with sinks and windows,
the clamped SwiGLU, the layer with biases token by token, expert parallelism against one
device, MXFP4 dequantisation of hand-packed bytes, each knob visible in the HF fixture's
logits, and the published parameter counts."""
import dataclasses
import json
import os
import struct
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import train_moe as tm
from common import attention as attn
from common import hf
from common.mesh import MeshConfig, make_mesh
from test_moe import assert_trees_close, loss_and_grads, perturbed_params, small_cfg, tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every knob on; a window of 4 in 16 tokens on layer 0; a clamp of 0.5 that many gate and up
# values pass; YaRN's ramp inside the head (small base and original context).
GPT = tm.ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=8, n_experts=8, top_k=3, d_ff=16, max_seq_len=64, loss_chunk=8,
                     gmm_tile=8, grouped_matmul="tiled", sliding_window=4, global_every=2,
                     attn_sinks=True, attn_bias=True, moe_bias=True, swiglu_limit=0.5,
                     rope_theta=100.0, yarn_factor=4.0, yarn_original_max_len=16,
                     yarn_beta_fast=8.0, yarn_truncate=False)


def gpt_params(model=GPT, seed=1):
    p = perturbed_params(model, seed)
    rng = np.random.default_rng(seed + 1)
    for name in ("sinks", "b_router", "b_gate", "b_up", "b_down", "bq", "bk", "bv", "bo"):
        p["layers"][name] = (1.0 + rng.standard_normal(p["layers"][name].shape)).astype(
            np.float32)   # away from zero, so that each is seen
    return p


# ------------------------------------------------------------------------------ attention


def reference_attention(q, k, v, sinks, window, scale):
    """Per sequence, head and query in float64: p_s = exp(l_s) / (sum_s' exp(l_s') + exp(sink))
    over the keys t - W < s <= t (all s <= t without a window), o = sum_s p_s v_s."""
    B, T, N, H = q.shape
    G = N // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(B):
        for n in range(N):
            for t in range(T):
                s = np.arange(max(0, t - window + 1) if window else 0, t + 1)
                logits = scale * (k[b, s, n // G].astype(np.float64) @ q[b, t, n])
                e = np.exp(logits - logits.max())
                sink = np.exp(sinks[n] - logits.max()) if sinks is not None else 0.0
                out[b, t, n] = (e / (e.sum() + sink)) @ v[b, s, n // G]
    return out


def qkv(T=12, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, T, 4, 8), np.float32)
    k, v = (rng.standard_normal((2, T, 2, 8), np.float32) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("window", [0, 5])   # 5: 12 tokens padded to whole blocks
def test_sink_attention_equals_a_plain_reference(window):
    q, k, v = qkv()
    sinks = np.array([2.0, -1.0, 0.5, 4.0], np.float32)   # 4.0: a head that mostly rests
    got = attn.blocked(q, k, v, window=window, scale=0.3, sinks_N=sinks, block=8)
    want = reference_attention(q, k, v, sinks, window, 0.3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The sinks matter at this tolerance: without them the rows sum to one.
    assert np.abs(want - reference_attention(q, k, v, None, window, 0.3)).max() > 1e-2


def test_a_sink_of_minus_infinity_is_plain_softmax_attention():
    q, k, v = qkv()
    none = np.full(4, -np.inf, np.float32)
    for window in (0, 4):
        got = attn.blocked(q, k, v, window=window, scale=8 ** -0.5, sinks_N=none, block=8)
        plain = attn.blocked(q, k, v, window=window, scale=8 ** -0.5, block=8)
        np.testing.assert_allclose(got, plain, rtol=1e-6, atol=1e-7)
    fused = attn.attend(q, k, v, impl="xla", scale=8 ** -0.5)
    np.testing.assert_allclose(attn.blocked(q, k, v, scale=8 ** -0.5, sinks_N=none),
                               fused, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------- the MLP


def test_clamped_swiglu_against_a_reference_beyond_the_clamp():
    g = np.array([-9.0, -7.5, -1.0, 0.0, 0.3, 6.9, 7.0, 7.1, 12.0], np.float32)
    u = np.array([-12.0, 8.0, -7.1, 3.0, -0.4, 6.9, -7.0, 7.5, 0.2], np.float32)
    cfg = dataclasses.replace(GPT, swiglu_limit=7.0)
    gc, uc = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)   # the gate only from above
    want = gc / (1 + np.exp(-1.702 * gc)) * (uc + 1)
    np.testing.assert_allclose(tm.glu(g, u, cfg), want, rtol=1e-6, atol=1e-6)
    assert want[-1] == pytest.approx(7.0 / (1 + np.exp(-1.702 * 7)) * 1.2, rel=1e-6)
    np.testing.assert_allclose(tm.glu(g, u), g / (1 + np.exp(-g)) * u, rtol=1e-6)   # off


def naive_layer(h_BTD, lp, cfg):
    """Token by token: router logits + bias, the softmax of the k largest, each chosen
    expert's (gate, up) with biases, clamped, and its down projection with bias."""
    def one_token(x):
        logits = x @ lp["w_router"] + lp["b_router"]
        top = jnp.argsort(-logits)[:cfg.top_k]
        w = jax.nn.softmax(logits[top])
        mlp = lambda e: (tm.glu(x @ lp["w_gate"][e] + lp["b_gate"][e],
                                x @ lp["w_up"][e] + lp["b_up"][e], cfg) @ lp["w_down"][e]
                         + lp["b_down"][e])
        return sum(w[j] * mlp(e) for j, e in enumerate(top))
    B, T, D = h_BTD.shape
    return jax.vmap(one_token)(h_BTD.reshape(B * T, D)).reshape(B, T, D)


@pytest.mark.parametrize("knobs", [dict(), dict(grouped_matmul="ragged_dot"),
                                   dict(grouped_matmul="megablox"),
                                   dict(capacity_factor=GPT.n_experts / GPT.top_k)],
                         ids=["tiled", "ragged_dot", "megablox", "capacity-room-for-all"])
def test_layer_with_biases_and_clamp_equals_token_by_token(knobs):
    model = dataclasses.replace(GPT, **knobs)
    lp = jax.tree.map(lambda a: a[0], gpt_params(model)["layers"])
    h = np.random.default_rng(3).standard_normal((2, 8, 32), np.float32)
    got = jax.jit(lambda h, lp: tm.moe(h, lp, model)[0])(h, lp)
    np.testing.assert_allclose(got, jax.jit(partial(naive_layer, cfg=model))(h, lp),
                               rtol=1e-5, atol=1e-5)


def test_expert_parallel_equals_one_device():
    """Loss and every gradient, expert 2 x fsdp 2 x tensor 2 against one device: the down
    bias is added on one tensor shard, the sinks and q/k/v biases split over tensor."""
    cfg = small_cfg(GPT, load_balance_loss=0.1, router_z_loss=0.01)
    params, batch = gpt_params(), tokens(cfg)
    one = loss_and_grads(cfg, params, batch, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    mesh = MeshConfig(fsdp=2, expert=2, tensor=2)
    got = loss_and_grads(dataclasses.replace(cfg, mesh=mesh), params, batch, make_mesh(mesh))
    assert got[0] == pytest.approx(one[0], rel=1e-6)
    assert_trees_close(got[2], one[2])
    for name in ("sinks", "b_down", "b_gate", "bo"):   # each is trained: not zero
        assert float(np.abs(one[2]["layers"][name]).max()) > 1e-4, name


# ------------------------------------------------------------------ the fixture's knobs


@pytest.fixture(scope="module")
def fixture():
    cfg, params = tm.load_hf(os.path.join(ROOT, "tests", "fixtures", "hf", "gpt_oss"))
    e = np.load(os.path.join(ROOT, "tests", "fixtures", "hf", "gpt_oss", "expected.npz"))
    return cfg, params, e["tokens"], e["logits"]


@pytest.mark.parametrize("off", [dict(sliding_window=0, global_every=0), dict(swiglu_limit=100.),
                                 dict(yarn_truncate=True), dict(yarn_factor=0.0), "sinks"])
def test_each_knob_shows_in_the_fixture_logits(fixture, off):
    cfg, params, toks, want = fixture
    if off == "sinks":
        params = dict(params, layers=dict(params["layers"], sinks=jnp.full_like(
            params["layers"]["sinks"], -jnp.inf)))
    else:
        cfg = dataclasses.replace(cfg, **off)
    got = jax.jit(tm.forward, static_argnums=2)(params, toks, cfg)
    assert float(np.abs(np.asarray(got) - want).max()) > 1e-3


# ------------------------------------------------------------------------------- MXFP4


def write_safetensors(path, tensors):
    """A safetensors file of uint8 arrays, written by hand (common/hf.py writes floats only)."""
    header, blobs, offset = {}, [], 0
    for name, x in tensors.items():
        header[name] = {"dtype": "U8", "shape": list(x.shape),
                        "data_offsets": [offset, offset + x.nbytes]}
        blobs.append(x.tobytes())
        offset += x.nbytes
    head = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def test_mxfp4_dequantises_hand_packed_bytes(tmp_path):
    """One output row, 64 inputs in two groups of 32: byte j holds inputs 2j (low nibble)
    and 2j + 1 (high nibble) of its group; each group has its power of two."""
    blocks = np.zeros((1, 2, 16), np.uint8)
    blocks[0, 0, 0] = 0x71          # inputs 0, 1: code 1 = 0.5, code 7 = 6.0
    blocks[0, 0, 15] = 0xF9         # inputs 30, 31: code 9 = -0.5, code 15 = -6.0
    blocks[0, 1, 3] = 0x2C          # inputs 38, 39: code 12 = -2.0, code 2 = 1.0
    scales = np.array([[127, 130]], np.uint8)   # 2^0 and 2^3
    write_safetensors(tmp_path / "model.safetensors", {"w_blocks": blocks, "w_scales": scales})
    (tmp_path / "config.json").write_text("{}")
    ck = hf.Checkpoint(str(tmp_path))
    assert ck.names() == {"w"} and ck.shape("w") == (64, 1)
    x = ck.array("w").read((64, 1), [slice(None), slice(None)])
    want = np.zeros((64, 1), np.float32)
    want[[0, 1, 30, 31, 38, 39], 0] = [0.5, 6.0, -0.5, -6.0, -16.0, 8.0]
    np.testing.assert_array_equal(x, want)


def test_mxfp4_device_blocks_equal_the_whole_tensor(tmp_path):
    """Random MXFP4 experts [E, 2F, D] loaded with the GPT-OSS layouts (gate and up
    interleaved) onto an expert x fsdp x tensor mesh: every device block == the slice of the
    whole dequantised tensor, and one uint8 tensor that is not a pair is refused."""
    E, F, D = 4, 16, 64
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (E, 2 * F, D // 32, 16), dtype=np.uint8)
    scales = rng.integers(120, 134, (E, 2 * F, D // 32), dtype=np.uint8)
    write_safetensors(tmp_path / "model.safetensors", {"x.gate_up_proj_blocks": blocks,
                                                       "x.gate_up_proj_scales": scales})
    (tmp_path / "config.json").write_text("{}")
    whole = hf.MXFP4(blocks, scales).take([np.arange(E), np.arange(D), np.arange(2 * F)])
    lut = hf.FP4_VALUES[np.stack([blocks & 15, blocks >> 4], -1)].reshape(E, 2 * F, D)
    np.testing.assert_array_equal(whole, (lut * 2.0 ** (np.repeat(scales, 32, -1).astype(
        np.int32) - 127)).swapaxes(1, 2))
    mesh = make_mesh(MeshConfig(fsdp=2, expert=2, tensor=2))
    spec = NamedSharding(mesh, P(None, "expert", "fsdp", "tensor"))
    mapping = {"w_gate": ("x.gate_up_proj", "e d (f 2:0) -> l e d f"),
               "w_up": ("x.gate_up_proj", "e d (f 2:1) -> l e d f")}
    got = hf.load(hf.Checkpoint(str(tmp_path)), mapping, dict(l=1, e=E, d=D, f=F),
                  {"w_gate": spec, "w_up": spec}, what="test")
    assert len(got["w_gate"].addressable_shards) == 8
    np.testing.assert_array_equal(np.asarray(got["w_gate"])[0], whole[..., 0::2])
    np.testing.assert_array_equal(np.asarray(got["w_up"])[0], whole[..., 1::2])
    write_safetensors(tmp_path / "model.safetensors", {"x.int8_weight": blocks})
    with pytest.raises(hf.HFError, match=r"x.int8_weight is uint8 but not half of an MXFP4"):
        hf.Checkpoint(str(tmp_path))


# ------------------------------------------------------------------------ parameter counts


@pytest.mark.parametrize("name,total,active,published_active", [
    ("gpt-oss-20b", 20_914_757_184, 4_187_440_704, 3.61),
    ("gpt-oss-120b", 116_829_156_672, 5_711_982_912, 5.13)])
def test_preset_parameter_counts(name, total, active, published_active):
    """Totals of the released checkpoints (transformers' model of each config.json); OpenAI's
    active counts leave out the embedding table, which ours include."""
    m = tm.PRESETS[name][1].model
    shapes = jax.eval_shape(partial(tm.init_params, m), jax.random.key(0))
    assert sum(x.size for x in jax.tree.leaves(shapes)) == tm.count_params(m) == total
    D, N, K, H, L, F = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.n_layers, m.d_ff
    attn = 2 * D * N * H + 2 * D * K * H + N * H + 2 * K * H + D + N   # + biases, sinks
    expert = 3 * D * F + 2 * F + D
    per_layer = attn + 2 * D + (D + 1) * m.n_experts + m.top_k * expert
    assert tm.count_active_params(m) == 2 * m.vocab_size * D + L * per_layer + D == active
    assert round((active - m.vocab_size * D) / 1e9, 2) == published_active
