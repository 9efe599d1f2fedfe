"""Gemma 4 (dense, text) in train_dense.py: the whole model against a plain per-layer reference
written here (per-layer inputs and shared keys and values included), logits against transformers
on two fixtures (the 31B's knobs; E2B's per-layer inputs and shared K/V), export and reload, the
presets' sizes against transformers' own model, and the refusals. (The GRPO policy's copy:
tests/test_grpo.py.) At the end, Gemma 4's MoE (26B-A4B) in train_moe.py: its presets' sizes,
FLOPs, refusals and a sharded step (its logits against transformers: tests/test_hf_moe.py)."""
import dataclasses
import json
import math
import os
import shutil
from functools import partial

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import train_dense as td
import train_grpo as tg
import train_moe as tm
from common import hf
from common.train import ConfigError
from tests.test_hf import TOL, expected, fixture, logits, max_diff


# The 31B's knobs: every third layer global, twice as wide with one K = V head, a quarter of its
# frequencies turned; then E2B's: per-layer inputs, the last period reusing the keys and values
# of the periods before (two of them: the carry crosses a period), its MLPs twice as wide.
GEMMA4 = td.ModelConfig(vocab_size=64, d_model=32, n_layers=6, n_heads=4, n_kv_heads=2,
                        head_dim=12, d_ff=48, max_seq_len=64, norm_eps=1e-6, rope_theta=1000.0,
                        rope_local_theta=100.0, sliding_window=5, global_every=3, qk_norm=True,
                        sandwich_norm=True, embed_scale=True, gelu=True, tie_embeddings=True,
                        query_scale=1.0, final_softcap=4.0, global_head_dim=24,
                        global_kv_heads=1, k_eq_v=True, rope_partial=0.25, v_norm=True,
                        layer_scale=True)
GEMMA4_PLE = dataclasses.replace(GEMMA4, n_layers=9, k_eq_v=False, global_kv_heads=0,
                                 ple_dim=8, kv_shared=3, wide_shared_mlp=True)


# ----------------------------------------------------------------------------------------------
# The whole model against a plain reference


def reference_forward(params, tokens, cfg):
    """Gemma 4 written out plainly in float64 numpy, one sequence and layer at a time, from
    transformers' description: x = E[t] sqrt(d); per-layer inputs (E_ple[t] sqrt(p) + the
    normed projection x P / sqrt(d)) / sqrt(2); per layer: pre-norm, q and k normed per head,
    values normed without a gain (keys' projection where K = V), RoPE with the kind's base and
    width (global: only the first rope_partial of the frequencies), logits q.k unscaled, a
    window on local layers, post-norm, residual; GeGLU likewise; the per-layer input gated by
    gelu(x W_gate), projected, normed, added; the layer's scalar. Layers past n_layers -
    kv_shared use the keys and values of the last earlier layer of their kind. Gains multiply
    as stored."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    eps, L, n, S, P = cfg.norm_eps, cfg.n_layers, cfg.global_every, cfg.kv_shared, cfg.ple_dim
    norm = lambda x, w=1.0: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w
    gelu = lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    T, N = tokens.shape[1], cfg.n_heads
    pos = np.arange(T)

    def rope(x, theta, part):
        H = x.shape[-1]
        inv = theta ** (-np.arange(0, H, 2) / H) * (np.arange(H // 2) < int(part * H // 2))
        c, s = np.cos(pos[:, None] * inv)[:, None], np.sin(pos[:, None] * inv)[:, None]
        x1, x2 = x[..., :H // 2], x[..., H // 2:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    def weights(i):  # layer i's weights: its kind's stack, at its place among that kind
        g, j, own = i // n, i % n, (L - S) // n
        shared, is_global = i >= L - S, j == n - 1
        stack = ("shared_" if shared else "") + ("global_layers" if is_global else "layers")
        at = g - own * shared if is_global else (g - own * shared) * (n - 1) + j
        return {k: v[at] for k, v in p[stack].items()}, is_global, shared

    out = []
    for row in tokens:
        x = p["embed"][row] * np.sqrt(cfg.d_model)
        if P:
            proj = norm((x @ p["ple_proj"] / np.sqrt(cfg.d_model)).reshape(T, L, P), p["ple_norm"])
            ple = (proj + p["ple_embed"][row].reshape(T, L, P) * np.sqrt(P)) / np.sqrt(2)
        last = {}   # kind -> the last keys and values made
        for i in range(L):
            l, is_global, shared = weights(i)
            theta, part = (cfg.rope_theta, cfg.rope_partial or 1) if is_global else (
                cfg.rope_local_theta, 1)
            h = norm(x, l["attn_norm"])
            q = rope(norm(np.einsum("td,dnh->tnh", h, l["wq"]), l["q_norm"]), theta, part)
            if not shared:
                k = np.einsum("td,dkh->tkh", h, l["wk"])
                v = np.einsum("td,dkh->tkh", h, l["wv"]) if "wv" in l else k
                last[is_global] = rope(norm(k, l["k_norm"]), theta, part), norm(v)
            k, v = last[is_global]
            allowed = pos[None] <= pos[:, None]
            if not is_global:
                allowed &= pos[:, None] - pos[None] < cfg.sliding_window
            o = np.zeros(q.shape)
            for h_ in range(N):
                kv = h_ // (N // k.shape[1])
                s = np.where(allowed, q[:, h_] @ k[:, kv].T, -np.inf)
                w = np.exp(s - s.max(-1, keepdims=True))
                o[:, h_] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
            x = x + norm(np.einsum("tnh,nhd->td", o, l["wo"]), l["attn_post_norm"])
            h = norm(x, l["mlp_norm"])
            x = x + norm((gelu(h @ l["w_gate"]) * (h @ l["w_up"])) @ l["w_down"],
                         l["mlp_post_norm"])
            if P:
                x = x + norm((gelu(x @ l["ple_gate"]) * ple[:, i]) @ l["ple_out"],
                             l["ple_post_norm"])
            x = x * l["layer_scale"]
        z = norm(x, p["final_norm"]) @ p["embed"].T
        out.append(cfg.final_softcap * np.tanh(z / cfg.final_softcap))
    return np.stack(out)


def unit_params(cfg, seed=0):
    """Weights whose every entry matters: unit-scale activations, gains and scalars near 1; q/k
    gains near 1/2, so that the unscaled logits q.k (about H) do not make a softmax so sharp
    that float32 rounding decides it."""
    p = td.init_params(cfg, jax.random.key(seed))
    leaves, tree = jax.tree_util.tree_flatten_with_path(p)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    out = []
    for (path, x), k in zip(leaves, keys):
        name, z = path[-1].key, jax.random.normal(k, x.shape)
        fan_in = (math.prod(x.shape[-3:-1]) if name == "wo" else x.shape[-2] if name in (
            "w_down", "ple_out") else cfg.ple_dim if name == "ple_embed" else cfg.d_model)
        gain = "norm" in name or name == "layer_scale"
        out.append((1.0 + 0.3 * z) * (0.5 if name in ("q_norm", "k_norm") else 1.0) if gain else
                   z * fan_in ** -0.5)
    return jax.tree_util.tree_unflatten(tree, out)


@pytest.mark.parametrize("cfg", [GEMMA4, GEMMA4_PLE], ids=["31b", "e2b"])
@pytest.mark.parametrize("scan", [True, False])
def test_forward_equals_plain_reference(cfg, scan):
    cfg = dataclasses.replace(cfg, scan_layers=scan)
    params = unit_params(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16), np.int32)
    got = logits(params, cfg, tokens)
    # float32 against the float64 reference: E2B's per-layer inputs were under 5e-5 off on an AMD
    # EPYC and 7.2e-5 on an Intel Xeon (XLA:CPU's vector math differs by ISA); the knobs
    # below move the logits by more than 1e-3.
    np.testing.assert_allclose(got, reference_forward(params, tokens, cfg), atol=2e-4)
    # The knobs move these logits, so the equality holds each of them to the reference.
    for knob in ("rope_partial", "v_norm", "layer_scale", "rope_local_theta", "final_softcap"):
        off = dataclasses.replace(cfg, **{knob: type(getattr(cfg, knob))()})
        assert max_diff(logits(params, off, tokens), got) > 1e-3, knob


# ----------------------------------------------------------------------------------------------
# HuggingFace: transformers' logits, export, reload


@pytest.fixture(scope="module")
def loaded():
    return {name: td.load_hf(fixture(name)) for name in ("gemma4_text", "gemma4_ple")}


def test_config_mapping(loaded):
    """The knobs each fixture turns on arrive in our config, and the parameters in their stacks."""
    a, b = loaded["gemma4_text"][0], loaded["gemma4_ple"][0]
    assert (a.global_every, a.sliding_window, a.head_dim, a.global_head_dim, a.n_kv_heads,
            a.global_kv_heads, a.k_eq_v, a.rope_partial, a.rope_theta, a.rope_local_theta,
            a.final_softcap, a.query_scale) == (3, 5, 12, 24, 2, 1, True, 0.25, 1000.0, 100.0,
                                                2.5, 1.0)
    assert a.v_norm and a.layer_scale and a.qk_norm and not a.norm_plus_one and not a.ple_dim
    assert (b.ple_dim, b.kv_shared, b.wide_shared_mlp, b.k_eq_v, b.global_kv_heads,
            b.rope_partial) == (8, 3, True, False, 0, 0.5)
    p = loaded["gemma4_ple"][1]
    assert p["global_layers"]["wv"].shape == (1, 32, 1, 16)   # its own, no K = V
    assert p["shared_layers"]["w_up"].shape == (2, 32, 96) and "wk" not in p["shared_layers"]
    assert p["ple_embed"].shape == (64, 6 * 8) and "wv" not in loaded["gemma4_text"][1][
        "global_layers"]


@pytest.mark.parametrize("name, mistake", [
    ("gemma4_text", dict(rope_partial=0.0)), ("gemma4_text", dict(v_norm=False)),
    ("gemma4_text", dict(layer_scale=False)), ("gemma4_text", dict(query_scale=0.0)),
    ("gemma4_text", dict(final_softcap=0.0)), ("gemma4_text", dict(rope_local_theta=0.0)),
    ("gemma4_ple", dict(rope_local_theta=0.0)), ("gemma4_ple", dict(rope_partial=0.0))])
def test_parity_catches_gemma4_mistakes(loaded, name, mistake):
    cfg, params = loaded[name]
    tokens, want = expected(name)
    assert max_diff(logits(params, dataclasses.replace(cfg, **mistake), tokens), want) > 1e-2


def test_parity_catches_dropped_per_layer_inputs(loaded):
    cfg, params = loaded["gemma4_ple"]
    tokens, want = expected("gemma4_ple")
    cut = params | {"ple_embed": params["ple_embed"] * 0}
    assert max_diff(logits(cut, cfg, tokens), want) > 1e-2


@pytest.mark.parametrize("name", ["gemma4_text", "gemma4_ple"])
def test_the_policy_reads_our_export(name, loaded, tmp_path):
    """test_hf.py's round trip holds the export to the fixture; the GRPO policy reads it too."""
    cfg, params = loaded[name]
    td.save_hf(params, cfg, str(tmp_path), max_shard_bytes=6000)
    assert dataclasses.asdict(tg.load_hf(str(tmp_path))[0]) == dataclasses.asdict(cfg)


def test_shared_layers_projections_in_a_release_are_not_read(tmp_path):
    """transformers ignores k_proj, v_proj and k_norm of the layers that reuse keys and values
    (a release may carry them): so do we, and the logits stay transformers'."""
    safetensors = pytest.importorskip("safetensors.numpy")
    folder = str(tmp_path / "ple")
    shutil.copytree(fixture("gemma4_ple"), folder, ignore=shutil.ignore_patterns("*.safetensors"))
    src = hf.Checkpoint(fixture("gemma4_ple"))
    extra = {f"model.layers.4.self_attn.{w}.weight": np.ones(s, np.float32)
             for w, s in (("k_proj", (12, 32)), ("k_norm", (12,)))}
    safetensors.save_file({n: np.asarray(src.array(n), np.float32) for n in src.names()} | extra,
                          os.path.join(folder, "model.safetensors"))
    cfg2, params2 = td.load_hf(folder)
    tokens, want = expected("gemma4_ple")
    assert max_diff(logits(params2, cfg2, tokens), want) < TOL


def test_a_multimodal_gemma4_folder_loads_its_language_model(loaded, tmp_path, capsys):
    """The released Gemma 4 folders (model_type gemma4): the text model alone, the towers
    skipped with one line."""
    from tests.test_hf import multimodal_copy
    folder = multimodal_copy(fixture("gemma4_text"), tmp_path / "gemma4", "gemma4")
    cfg, params = td.load_hf(folder)
    assert cfg == loaded["gemma4_text"][0]
    assert "not the 1 tensors of its other towers" in capsys.readouterr().out
    tokens, want = expected("gemma4_text")
    assert max_diff(logits(params, cfg, tokens), want) < TOL


def copy(name, tmp_path, edit):
    dst = str(tmp_path / name)
    shutil.copytree(fixture(name), dst)
    with open(os.path.join(dst, "config.json")) as f:
        c = json.load(f)
    edit(c)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(c, f)
    return dst


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.update(enable_moe_block=True),
     r"enable_moe_block \(26B-A4B's experts; train_moe.py loads it\)"),
    (lambda c: c["per_layer_config"].update({"0": {"head_dim": 24}}), r"per_layer_config"),
    (lambda c: c["per_layer_config"]["5"].update(head_dim=16), r"per_layer_config"),
    (lambda c: c.update(hidden_size_per_layer_input=4, vocab_size_per_layer_input=32),
     r"per-layer input vocabulary unlike vocab_size"),
    (lambda c: c["rope_parameters"]["sliding_attention"].update(rope_type="proportional"),
     r"rope type 'proportional' on the sliding-window layers"),
    (lambda c: c.update(use_bidirectional_attention="all"), r"use_bidirectional_attention"),
])
def test_unsupported_gemma4_options(tmp_path, edit, match):
    with pytest.raises(hf.HFError, match=match):
        td.load_hf(copy("gemma4_text", tmp_path, edit))


def test_a_released_config_without_per_layer_config(tmp_path):
    """The released folders spell the global layers' shape as global_head_dim and
    num_global_key_value_heads (transformers turns them into per_layer_config); the larger
    ones let images' tokens see each other ("vision"), which leaves text causal."""
    def release(c):
        del c["per_layer_config"]
        c.update(global_head_dim=24, num_global_key_value_heads=1,
                 use_bidirectional_attention="vision")
    assert td.load_hf(copy("gemma4_text", tmp_path, release))[0] == td.load_hf(
        fixture("gemma4_text"))[0]


def test_export_needs_gemma4s_global_stack():
    with pytest.raises(hf.HFError, match="gemma4_text needs global layers of their own"):
        td.config_to_hf(dataclasses.replace(GEMMA4, global_head_dim=0, global_kv_heads=0,
                                            k_eq_v=False), "gemma4_text")


# ----------------------------------------------------------------------------------------------
# Live: transformers itself (the `parity` extra)

transformers = None
try:
    import torch
    import transformers
except ImportError:
    pass
live = pytest.mark.skipif(transformers is None, reason="transformers not installed (extra: parity)")


COUNTS = {"gemma4-31b": 30_697_345_340, "tiny-gemma4": 6_100_836,
          "gemma4-e2b": 4_628_569_379, "gemma4-e4b": 7_463_013_418}
MOE_COUNTS = {"gemma4-26b-a4b": 25_233_141_790, "tiny-gemma4-moe": 9_913_380}  # train_moe.py's


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_preset_parameter_counts(name):
    assert td.count_params(td.PRESETS[name][1].model) == COUNTS[name]


@live
@pytest.mark.parametrize("name", sorted(COUNTS) + sorted(MOE_COUNTS))
def test_live_preset_counts_equal_transformers(name):
    """Our count is what transformers' Gemma4ForCausalLM of the exported config holds (built on
    the meta device: no memory): its parameters, and the layer scalars it saves with them. The
    MoE presets are train_moe.py's."""
    mod, want = (td, COUNTS[name]) if name in COUNTS else (tm, MOE_COUNTS[name])
    c = mod.config_to_hf(mod.PRESETS[name][1].model)
    with torch.device("meta"):
        model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**c))
    n = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for k, b in model.named_buffers() if k.endswith("layer_scalar"))
    assert n == want


# ----------------------------------------------------------------------------------------------
# Presets, flags, FLOPs


def test_tiny_gemma4_windows_its_training_sequence_and_shares_its_last_period():
    cfg = td.PRESETS["tiny-gemma4"][1]
    m = cfg.model
    assert 0 < m.sliding_window < cfg.train.seq_len and m.kv_shared == m.global_every == 2
    assert m.global_head_dim > m.head_dim and m.k_eq_v and m.ple_dim
    td.validate(cfg, 8)


@pytest.mark.parametrize("flags, match", [
    (["--model.global-head-dim", "128"], "run in periods of --model.global-every 0"),
    (["--model.sliding-window", "64", "--model.global-every", "3", "--model.global-head-dim",
      "128"], "the period dividing --model.n-layers 4"),
    (["--model.k-eq-v"], "give --model.global-head-dim"),
    (["--model.kv-shared", "1"], "give --model.global-head-dim"),
    (["--model.rope-partial", "1.5"], r"--model.rope-partial 1.5: must be \[0, 1\]"),
])
def test_bad_gemma4_flags(flags, match):
    with pytest.raises(ConfigError, match=match):
        td.validate(td.cli(["tiny", *flags]), 1)


@pytest.mark.parametrize("flags, match", [
    (["--model.kv-shared", "1"], "whole periods of --model.global-every 2"),
    (["--model.kv-shared", "4"], "whole periods of --model.global-every 2"),
    (["--model.global-kv-heads", "3"], "does not divide --model.n-heads 4"),
    (["--model.no-qk-norm", "--train.optimizer", "muon", "--train.qk-clip-threshold", "100"],
     "Gemma 4's periods record no logits"),
])
def test_bad_tiny_gemma4_flags(flags, match):
    with pytest.raises(ConfigError, match=match):
        td.validate(td.cli(["tiny-gemma4", *flags]), 1)


def test_flops_count_the_global_layers_width_and_the_per_layer_inputs():
    m, T = td.PRESETS["tiny-gemma4"][1].model, 256
    D, N, H, G, K, F, P = 256, 4, 64, 128, 2, 768, 32
    local = 2 * D * N * H + 2 * D * K * H + 3 * D * F      # layer 0
    glob = 2 * D * N * G + D * 1 * G + 3 * D * F           # layer 1: K = V, one head
    shared = 2 * D * N * H + 6 * D * F + 2 * D * N * G + 6 * D * F  # layers 2, 3: no K/V
    weights = local + glob + shared + 4 * 2 * D * P + 4 * P * D + D * 4096
    attn = 4 * N * (2 * T * G + 2 * min(T, 128) * H)
    assert td.flops_per_token(m, T) == 3.0 * (2 * weights + attn)


# ----------------------------------------------------------------------------------------------
# Gemma 4's MoE (26B-A4B) in train_moe.py: its logits against transformers, export and reload
# are tests/test_hf_moe.py's (the gemma4_moe fixture); here its presets, FLOPs and refusals.


@pytest.mark.parametrize("name", sorted(MOE_COUNTS))
def test_moe_preset_parameter_counts(name):
    """26B-A4B: Google's 25.2B total and 3.8B active (the text model's)."""
    m = tm.PRESETS[name][1].model
    assert tm.count_params(m) == MOE_COUNTS[name]
    if name == "gemma4-26b-a4b":
        assert round(tm.count_active_params(m) / 1e8) == 38 and round(MOE_COUNTS[name] / 1e8) == 252


def test_moe_flops_count_the_global_layers_width_and_the_dense_mlp():
    cfg = tm.PRESETS["tiny-gemma4-moe"][1]
    m, T = cfg.model, 256
    D, N, H, G, K, F, Fd, E, R = 256, 4, 64, 128, 2, 256, 512, 8, 2
    local = 2 * D * N * H + 2 * D * K * H     # layers 0, 2
    glob = 2 * D * N * G + D * 1 * G          # layers 1, 3: one K = V head
    mlp = D * E + R * 3 * D * F + 3 * D * Fd  # router, top-2 experts, the dense MLP beside
    weights = 2 * local + 2 * glob + 4 * mlp + D * 4096
    attn = 4 * N * (2 * T * G + 2 * min(T, 128) * H)  # q.k and p.v, 2 layers of each kind
    assert tm.flops_per_token(m, T) == 3.0 * (2 * weights + attn)
    tm.validate(cfg, 8)


@pytest.mark.parametrize("flags, match", [
    (["--model.global-every", "3"], "dividing --model.n-layers 4"),
    (["--model.no-qk-norm"], "with --model.qk-norm"),
    (["--model.dense-d-ff", "0"], "--model.dense-d-ff"),
    (["--model.n-shared-experts", "1"], "--model.n-shared-experts is not Gemma 4's"),
    (["--model.global-kv-heads", "3"], "does not divide --model.n-heads 4"),
    (["--model.no-gemma4", "--model.dense-d-ff", "0"], "are Gemma 4's: add --model.gemma4"),
    (["--train.qk-clip-threshold", "100"], "with --model.qk-norm"),
])
def test_bad_tiny_gemma4_moe_flags(flags, match):
    with pytest.raises(ConfigError, match=match):
        tm.validate(tm.cli(["tiny-gemma4-moe", *flags]), 8)


def test_tiny_gemma4_moe_trains_sharded():
    """Two steps of the preset, made small, on fsdp 2 x tensor 2 x expert 2: finite, falling."""
    cfg = tm.cli(["tiny-gemma4-moe", "--model.vocab-size", "256", "--model.d-model", "64",
                  "--model.global-head-dim", "32", "--model.head-dim", "16", "--model.d-ff", "32",
                  "--model.dense-d-ff", "64", "--model.sliding-window", "8",
                  "--model.global-kv-heads", "2", "--train.batch-size", "8", "--train.seq-len",
                  "16", "--mesh.fsdp", "2", "--mesh.tensor", "2", "--mesh.expert", "2"])
    tm.validate(cfg, 8)
    mesh = tm.make_mesh(cfg.mesh)
    st = tm.train_state(cfg, mesh)
    step = st.jit(partial(tm.train_step, cfg=cfg, tx=st.tx))
    batch = jax.device_put(np.random.default_rng(0).integers(0, 256, (8, 17)).astype(np.int32),
                           NamedSharding(mesh, P(tm.MOE_BATCH, None)))
    state, losses = st.fresh(jax.random.key(0)), []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses)) and losses[2] < losses[0]
