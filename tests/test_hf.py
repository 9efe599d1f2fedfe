"""HuggingFace in and out: logits against transformers, round trips, sharded loads, bad folders.

The fixtures (tests/fixtures/hf/, made by tests/make_hf_fixtures.py) are tiny random models
saved by transformers with their float32 logits on fixed tokens, so these tests need no torch.
Where transformers is installed (the `parity` extra), the live tests also run it.
"""
import dataclasses
import json
import os
import shutil
import struct
import subprocess
import sys
import sysconfig

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import train_dense as td
import train_grpo as tg
from common import hf, train
from common.data import DataConfig, batch_rows, load_dataset, prepare
from common.mesh import MeshConfig, make_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")
FAMILIES = ["llama2", "llama3.1", "llama3.2", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text",
            "gemma", "olmo3", "olmo2", "gemma4_text", "gemma4_ple", "qwen3_5", "gpt2"]
TOL = 1e-4  # float32, on logits that reach 3 to 50 in these fixtures
# Bookkeeping in a config.json, not the model: left out of the key-by-key comparison.
BOOKKEEPING = {"transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
               "pad_token_id", "use_cache", "initializer_range", "attention_dropout",
               "max_window_layers",
               # transformers 5's Gemma copies: a private pattern (layer_types says it), and
               # an encoder switch whose absence means causal, as it does in 4.x.
               "_sliding_window_pattern", "use_bidirectional_attention"}


def fixture(name):
    return os.path.join(FIXTURES, name)


def expected(name):
    e = np.load(os.path.join(fixture(name), "expected.npz"))
    return e["tokens"], e["logits"]


def logits(params, cfg, tokens, mesh=None):
    if mesh is None:
        return np.asarray(jax.jit(td.forward, static_argnums=2)(params, tokens, cfg))
    with jax.set_mesh(mesh):
        tokens = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"), None)))
        return np.asarray(jax.jit(td.forward, static_argnums=2)(params, tokens, cfg))


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def host(params):
    return jax.tree.map(np.asarray, jax.device_get(params))


@pytest.fixture(scope="module")
def loaded():
    return {name: td.load_hf(fixture(name)) for name in FAMILIES}


# ----------------------------------------------------------------------------------------------
# Parity with transformers


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name, loaded):
    cfg, params = loaded[name]
    tokens, want = expected(name)
    diff = max_diff(logits(params, cfg, tokens), want)
    print(f"{name}: max |logit difference| {diff:.2e}")
    assert diff < TOL


def test_config_mapping(loaded):
    """The knobs each fixture turns on arrive in our config (the parity above needs them)."""
    c = {name: loaded[name][0] for name in FAMILIES}
    assert c["llama3.1"].rope_scaling == 8.0 and c["llama3.1"].rope_original_max_len == 64
    assert c["llama3.1"].head_dim == 12 != c["llama3.1"].d_model // c["llama3.1"].n_heads
    assert c["llama3.2"].tie_embeddings and "unembed" not in loaded["llama3.2"][1]
    assert c["mistral"].n_kv_heads == 1 and c["mistral"].max_seq_len == 48  # sliding window
    assert c["qwen2"].qkv_bias and c["qwen2"].tie_embeddings and c["qwen2"].norm_eps == 1e-6
    assert c["qwen3"].qk_norm and not c["qwen3"].qkv_bias
    assert c["llama2"].n_kv_heads == c["llama2"].n_heads == 4
    g2, g3 = c["gemma2"], c["gemma3_text"]
    assert (g2.sliding_window, g2.global_every, g2.attn_softcap, g2.final_softcap,
            g2.query_scale) == (5, 2, 3.0, 2.5, 16.0) and not g2.qk_norm
    assert g2.norm_plus_one and g2.sandwich_norm and g2.embed_scale and g2.gelu
    assert (g3.global_every, g3.rope_theta, g3.rope_local_theta, g3.rope_linear) == (
        3, 1000.0, 100.0, 2.0) and g3.qk_norm and not g3.attn_softcap
    g1 = c["gemma"]   # Gemma 1: Gemma 2's knobs less the sandwich, caps, windows, query scale
    assert g1.norm_plus_one and g1.embed_scale and g1.gelu and g1.tie_embeddings
    assert not (g1.sandwich_norm or g1.sliding_window or g1.attn_softcap or g1.query_scale)
    assert g1.n_kv_heads == 1 and g1.head_dim == 12
    # The released Gemma 1 configs say "gelu", which transformers reads as the tanh GeGLU.
    legacy = hf.read_config(fixture("gemma")) | {"hidden_act": "gelu"}
    assert td.config_from_hf(legacy) == g1
    o3, o2 = c["olmo3"], c["olmo2"]  # OLMo: post norms, q/k norms over all heads; 3: windows
    assert o3.post_norm and o3.qk_norm and o3.qk_norm_whole and not o3.sandwich_norm
    assert (o3.sliding_window, o3.global_every, o3.rope_theta, o3.rope_local_theta,
            o3.yarn_factor, o3.yarn_original_max_len) == (5, 4, 100.0, 1000.0, 4.0, 512)
    assert loaded["olmo3"][1]["layers"]["k_norm"].shape == (4, 2, 12)  # [L, K, H]
    assert "attn_norm" not in loaded["olmo3"][1]["layers"] and not o3.tie_embeddings
    assert o2.post_norm and o2.qk_norm_whole and not (o2.sliding_window or o2.yarn_factor)
    g = c["gpt2"]  # GPT-2: its own key names, n_inner null (4 d), the tanh GELU, tied
    assert (g.d_model, g.n_layers, g.n_heads, g.n_kv_heads, g.head_dim, g.d_ff, g.max_seq_len,
            g.norm_eps) == (32, 2, 4, 4, 8, 128, 32, 1e-5)
    assert g.layer_norm and g.learned_pos and g.plain_mlp and g.proj_bias and g.qkv_bias
    assert g.gelu and g.tie_embeddings and loaded["gpt2"][1]["pos_embed"].shape == (32, 32)


@pytest.mark.parametrize("name, mistake", [
    ("gemma2", dict(sliding_window=0)), ("gemma2", dict(attn_softcap=0.0)),
    ("gemma2", dict(final_softcap=0.0)), ("gemma2", dict(query_scale=0.0)),
    ("gemma2", dict(global_every=4)), ("gemma3_text", dict(rope_local_theta=0.0)),
    ("gemma3_text", dict(rope_linear=0.0)), ("gemma3_text", dict(global_every=2)),
    ("gemma", dict(norm_plus_one=False)), ("gemma", dict(embed_scale=False)),
    ("gemma", dict(gelu=False))])
def test_parity_catches_gemma_mistakes(loaded, name, mistake):
    """Each Gemma knob moves the fixtures' logits far past the tolerance: a window that does
    not bite, a dropped soft-cap, a head-width query scale, the wrong layer pattern or RoPE."""
    cfg, params = loaded[name]
    tokens, want = expected(name)
    assert max_diff(logits(params, dataclasses.replace(cfg, **mistake), tokens), want) > 1e-2


@pytest.mark.parametrize("mistake", [
    dict(sliding_window=0), dict(global_every=2), dict(rope_local_theta=0.0), dict(yarn_factor=0.0),
    dict(yarn_original_max_len=256), dict(yarn_factor=2.0)])
def test_parity_catches_olmo3_mistakes(loaded, mistake):
    """Each OLMo 3 knob moves the fixture's logits past the tolerance: a window that does not
    bite, the wrong layer pattern, the local layers' RoPE base, YaRN dropped or mis-sized."""
    cfg, params = loaded["olmo3"]
    tokens, want = expected("olmo3")
    assert max_diff(logits(params, dataclasses.replace(cfg, **mistake), tokens), want) > 1e-2


def test_parity_catches_swapped_gemma_norms(loaded):
    """Gemma's post_attention_layernorm is the attention's output norm, not the MLP's input
    norm as in Llama: the mapping that confuses the two fails parity."""
    cfg, params = loaded["gemma2"]
    tokens, want = expected("gemma2")
    lay = dict(params["layers"])
    lay["mlp_norm"], lay["attn_post_norm"] = lay["attn_post_norm"], lay["mlp_norm"]
    assert max_diff(logits(params | {"layers": lay}, cfg, tokens), want) > 1e-2


def test_parity_catches_rope_mistakes(loaded):
    """The tolerance is tight enough to see the mistakes a converter makes: dropping Llama
    3.1's frequency rescaling, or rotating interleaved pairs (Meta's layout) where HF rotates
    halves, which needs a permutation of q_proj/k_proj rows that we rightly do not apply."""
    cfg, params = loaded["llama3.1"]
    tokens, want = expected("llama3.1")
    assert max_diff(logits(params, dataclasses.replace(cfg, rope_scaling=0.0), tokens),
                    want) > 1e-2
    H = cfg.head_dim
    interleave = np.concatenate([np.arange(0, H, 2), np.arange(1, H, 2)])
    layers = dict(params["layers"])
    for w in ("wq", "wk"):
        layers[w] = np.asarray(layers[w])[..., interleave]
    assert max_diff(logits(params | {"layers": layers}, cfg, tokens), want) > 1e-2


transformers = None
try:
    import torch
    import transformers
except ImportError:
    pass
live = pytest.mark.skipif(transformers is None, reason="transformers not installed (extra: parity)")


def hf_logits(folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.from_numpy(np.asarray(tokens, np.int64))).logits.numpy()


@live
@pytest.mark.parametrize("name", FAMILIES)
def test_live_fixture_logits_are_current(name):
    """The stored logits are what the installed transformers computes on the fixture."""
    tokens, want = expected(name)
    assert max_diff(hf_logits(fixture(name), tokens), want) < TOL


# ----------------------------------------------------------------------------------------------
# Saving


@pytest.mark.parametrize("name", FAMILIES)
def test_save_load_round_trip(name, loaded, tmp_path):
    cfg, params = loaded[name]
    src = hf.Checkpoint(fixture(name))
    out = str(tmp_path / "out")
    files = td.save_hf(params, cfg, out, model_type=src.config["model_type"],
                       max_shard_bytes=6000)
    assert hf.INDEX in files and len(files) > 3  # several shards and their index
    cfg2, params2 = td.load_hf(out)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(host(params)), jax.tree.leaves(host(params2))):
        np.testing.assert_array_equal(a, b)

    # What transformers reads: the fixture's tensor names and shapes, its config keys.
    ours = hf.Checkpoint(out)
    assert {n: ours.shape(n) for n in ours.names()} == {n: src.shape(n) for n in src.names()}
    differ = {k: (v, ours.config.get(k, "(absent)")) for k, v in src.config.items()
              if k not in BOOKKEEPING and ours.config.get(k, "(absent)") != v}
    if name == "mistral":  # the sliding window became the maximum length, by design
        assert differ == {"sliding_window": (48, None), "max_position_embeddings": (64, 48)}
    elif name == "qwen3_5":  # RoPE's sections for images' positions: a text model has none
        assert list(differ) == ["rope_parameters"] and ours.config["rope_parameters"] == {
            k: v for k, v in src.config["rope_parameters"].items() if not k.startswith("mrope")}
    elif name == "gpt2":  # n_inner written out; what transformers assumes left out (dropout
        # in training, the double-heads model's summary, cross-attention off)
        assert differ.pop("n_inner") == (None, 4 * 32) and all(
            k.endswith("pdrop") or k.startswith("summary_") or k == "add_cross_attention"
            for k in differ)
    else:
        assert differ == {}


@pytest.mark.parametrize("name", ["qwen2", "llama3.1"])
def test_bfloat16_export_is_the_fixture_bit_for_bit(name, loaded, tmp_path):
    """The fixtures hold bfloat16: loading widens to float32 exactly, so writing bfloat16
    again must give back every tensor unchanged."""
    cfg, params = loaded[name]
    src = hf.Checkpoint(fixture(name))
    td.save_hf(params, cfg, str(tmp_path), model_type=src.config["model_type"], dtype="bfloat16")
    ours = hf.Checkpoint(str(tmp_path))
    assert ours.names() == src.names()
    for n in src.names():
        assert ours.array(n).dtype == src.array(n).dtype
        np.testing.assert_array_equal(ours.array(n).view(np.uint16), src.array(n).view(np.uint16))


def test_reference_safetensors_reads_our_files(loaded, tmp_path):
    safetensors = pytest.importorskip("safetensors")
    cfg, params = loaded["qwen2"]
    td.save_hf(params, cfg, str(tmp_path), max_shard_bytes=6000)
    ours = hf.Checkpoint(str(tmp_path))
    seen = set()
    for file in sorted(os.listdir(tmp_path)):
        if file.endswith(".safetensors"):
            with safetensors.safe_open(str(tmp_path / file), framework="np") as f:
                assert f.metadata() == {"format": "pt"}
                for n in f.keys():
                    np.testing.assert_array_equal(f.get_tensor(n), ours.array(n))
                    seen.add(n)
    assert seen == ours.names()


@live
@pytest.mark.parametrize("name", FAMILIES)
def test_live_transformers_loads_our_export(name, loaded, tmp_path):
    cfg, params = loaded[name]
    td.save_hf(params, cfg, str(tmp_path), model_type=hf.read_config(fixture(name))["model_type"],
               max_shard_bytes=6000)
    tokens, want = expected(name)
    assert max_diff(hf_logits(str(tmp_path), tokens), want) < TOL


# ----------------------------------------------------------------------------------------------
# Sharded loading


@pytest.mark.parametrize("name", ["qwen3", "llama3.1", "qwen3_5", "gpt2"])  # 3.5: DeltaNet over
# tensor; GPT-2: q, k and v fused in one tensor, each device reading its heads
def test_sharded_load_equals_one_device(name, loaded):
    cfg, one = loaded[name]
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    cfg2, params = td.load_hf(fixture(name), mesh)
    specs = td.param_specs(cfg)
    for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(
            specs, is_leaf=lambda s: isinstance(s, P))):
        assert x.sharding == NamedSharding(mesh, spec)
    for a, b in zip(jax.tree.leaves(host(one)), jax.tree.leaves(host(params))):
        np.testing.assert_array_equal(a, b)
    tokens, want = expected(name)
    tokens4, want4 = np.concatenate([tokens, tokens]), np.concatenate([want, want])
    assert max_diff(logits(params, cfg2, tokens4, mesh), want4) < TOL


def test_load_refuses_a_mesh_that_does_not_divide_the_model():
    with pytest.raises(td.ConfigError, match=r"splits 2 ways"):
        td.load_hf(fixture("mistral"), make_mesh(MeshConfig(fsdp=4, tensor=2)))  # 1 kv head


# ----------------------------------------------------------------------------------------------
# Bad folders: each a clear error that names the problem


def copy(name, tmp_path, edit=None):
    dst = str(tmp_path / name)
    shutil.copytree(fixture(name), dst)
    if edit:
        path = os.path.join(dst, "config.json")
        with open(path) as f:
            c = json.load(f)
        edit(c)
        with open(path, "w") as f:
            json.dump(c, f)
    return dst


def test_missing_shard(tmp_path):
    folder = copy("qwen3", tmp_path)
    os.remove(os.path.join(folder, "model-00003-of-00004.safetensors"))
    with pytest.raises(hf.HFError, match=r"1 of the 4 shards .* missing: "
                                         r"model-00003-of-00004.safetensors"):
        td.load_hf(folder)


def test_index_that_lies(tmp_path):
    folder = copy("qwen3", tmp_path)
    path = os.path.join(folder, hf.INDEX)
    with open(path) as f:
        index = json.load(f)
    index["weight_map"]["model.norm.weight"] = "model-00001-of-00004.safetensors"
    with open(path, "w") as f:
        json.dump(index, f)
    with pytest.raises(hf.HFError, match=r"places model.norm.weight in model-00001-of-00004"):
        td.load_hf(folder)


def test_shape_mismatch(tmp_path):
    folder = copy("llama2", tmp_path, lambda c: c.update(intermediate_size=40))
    with pytest.raises(hf.HFError, match=r"model.layers.0.mlp.down_proj.weight has shape "
                                         r"\[32, 48\] but config.json implies \[32, 40\]"):
        td.load_hf(folder)


def test_unknown_model_type(tmp_path):
    folder = copy("llama2", tmp_path, lambda c: c.update(model_type="bert"))
    with pytest.raises(hf.HFError, match=r"model_type 'bert' is not a dense family"):
        td.load_hf(folder)


@pytest.mark.parametrize("edit,match", [
    (lambda c: c["rope_parameters"].update(rope_type="dynamic", factor=4.0),
     r"rope type 'dynamic'"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0, beta_fast=16.0),
     r"YaRN with \{'beta_fast': 16.0\}"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn", factor=4.0, mscale=0.7,
                                           mscale_all_dim=0.7), r"YaRN with \{'mscale': 0.7"),
    (lambda c: c.update(hidden_act="gelu"), r"hidden activation 'gelu' \(only silu\)"),
    (lambda c: c.update(rope_parameters={"full_attention": c["rope_parameters"]}),
     r"rope parameters per layer type \(full_attention\)"),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "factor": 8.0}),
     r"'llama3' without high_freq_factor, low_freq_factor"),
    (lambda c: c.update(mlp_bias=True), r"attention_bias / mlp_bias"),
])
def test_unsupported_options(tmp_path, edit, match):
    with pytest.raises(hf.HFError, match=match):
        td.load_hf(copy("llama2", tmp_path, edit))


@pytest.mark.parametrize("name, edit, match", [
    ("gemma2", lambda c: c.update(layer_types=["full_attention", "sliding_attention"] * 2),
     r"layer_types .* \(only every n-th layer global\)"),
    ("gemma2", lambda c: c.update(rope_parameters={"rope_type": "linear", "rope_theta": 1e4,
                                                   "factor": 2.0}), r"rope type 'linear'"),
    ("gemma3_text", lambda c: c.update(use_bidirectional_attention=True),
     r"use_bidirectional_attention"),
    ("gemma3_text", lambda c: c["rope_parameters"]["sliding_attention"].update(
        rope_type="linear", factor=2.0), r"rope type 'linear' on the sliding-window layers"),
    ("gemma3_text", lambda c: c.update(hidden_activation="gelu"),
     r"hidden activation 'gelu' \(only gelu_pytorch_tanh\)"),
    ("gpt2", lambda c: c.update(activation_function="gelu"),
     r"activation_function 'gelu' \(only gelu_new\)"),
    ("gpt2", lambda c: c.update(scale_attn_by_inverse_layer_idx=True),
     r"scale_attn_by_inverse_layer_idx True"),
    ("gpt2", lambda c: c.update(scale_attn_weights=False), r"scale_attn_weights False"),
])
def test_unsupported_gemma_options(tmp_path, name, edit, match):
    with pytest.raises(hf.HFError, match=match):
        td.load_hf(copy(name, tmp_path, edit))


@pytest.mark.parametrize("edit, match", [
    (lambda c: c["rope_parameters"]["full_attention"].update(attention_factor=1.5),
     r"YaRN with \{'attention_factor': 1.5\}"),
    (lambda c: c["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=2.0),
     r"rope type 'linear' on the sliding-window layers"),
    (lambda c: c.update(layer_types=["full_attention", "sliding_attention"] * 2),
     r"layer_types .* \(only every n-th layer global\)"),
    (lambda c: c.update(attention_bias=True), r"attention_bias / mlp_bias")])
def test_unsupported_olmo3_options(tmp_path, edit, match):
    with pytest.raises(hf.HFError, match=match):
        td.load_hf(copy("olmo3", tmp_path, edit))


def test_olmo3_from_a_released_config(tmp_path):
    """The released OLMo 3 folders spell RoPE as transformers 4.57 wrote it (rope_theta beside
    rope_scaling, no rope_parameters): YaRN on the full layers, one base for all layers."""
    released = {"rope_theta": 500000, "rope_scaling": {
        "attention_factor": 1.2079441541679836, "beta_fast": 32.0, "beta_slow": 1.0,
        "factor": 8.0, "original_max_position_embeddings": 8192, "rope_type": "yarn"}}
    def legacy(c):
        del c["rope_parameters"], c["layer_types"], c["head_dim"]
        c.update(released, hidden_size=48, max_position_embeddings=65536, sliding_window=4096)
    cfg = td.config_from_hf(hf.read_config(copy("olmo3", tmp_path, legacy)))
    assert cfg == dataclasses.replace(td.PRESETS["olmo3-7b"][1].model, **{
        k: getattr(cfg, k) for k in td.SHAPE + ("vocab_size", "dtype")})


def test_gemma3_from_a_transformers_4_config(tmp_path):
    """The 4.x spelling (rope_theta, rope_scaling, rope_local_base_freq, sliding_window_pattern,
    no layer_types) reads as the same model as transformers 5's per-layer-type one."""
    def legacy(c):
        rope = c.pop("rope_parameters")
        del c["layer_types"], c["_sliding_window_pattern"]
        c.update(rope_theta=rope["full_attention"]["rope_theta"], rope_scaling={
            "rope_type": "linear", "factor": rope["full_attention"]["factor"]},
            rope_local_base_freq=rope["sliding_attention"]["rope_theta"])
    assert td.load_hf(copy("gemma3_text", tmp_path, legacy))[0] == td.load_hf(
        fixture("gemma3_text"))[0]


def test_weights_we_would_drop(tmp_path):
    """Qwen2's biases under a llama config would be ignored by a lax loader: we refuse."""
    folder = copy("qwen2", tmp_path, lambda c: c.update(model_type="llama"))
    with pytest.raises(hf.HFError, match=r"tensors have no place .*q_proj.bias"):
        td.load_hf(folder)


def test_a_gpt2_release_loads(loaded, tmp_path):
    """openai-community/gpt2's file: the base model's names (no "transformer.") and each
    layer's causal mask (attn.bias, a buffer) beside the weights."""
    src, out = hf.Checkpoint(fixture("gpt2")), copy("gpt2", tmp_path)
    for f in os.listdir(out):
        if f.startswith("model"):
            os.remove(os.path.join(out, f))
    names = sorted(src.names())
    hf._write_file(os.path.join(out, "model.safetensors"), [
        (n.removeprefix("transformer."), src.shape(n), np.dtype(np.float32),
         lambda n=n: src.array(n).astype(np.float32)) for n in names] + [
        (f"h.{i}.attn.bias", (1, 1, 32, 32), np.dtype(np.float32),
         lambda: np.tril(np.ones((1, 1, 32, 32), np.float32))) for i in range(2)])
    cfg, params = td.load_hf(out)
    assert cfg == loaded["gpt2"][0]
    for a, b in zip(jax.tree.leaves(host(params)), jax.tree.leaves(host(loaded["gpt2"][1]))):
        np.testing.assert_array_equal(a, b)


def test_truncated_file(tmp_path):
    folder = copy("llama2", tmp_path)
    path = os.path.join(folder, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(hf.HFError, match=r"truncated"):
        td.load_hf(folder)


def test_save_refusals(loaded, tmp_path):
    cfg, params = loaded["qwen3"]
    with pytest.raises(hf.HFError, match=r"model_type 'llama' does not fit"):
        td.save_hf(params, cfg, str(tmp_path / "a"), model_type="llama")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "model.safetensors").write_text("old")
    with pytest.raises(hf.HFError, match=r"not empty"):
        td.save_hf(params, cfg, str(tmp_path / "b"))


# ----------------------------------------------------------------------------------------------
# The command line: --init-from-hf, train, export-hf


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, f) for f in ("argparse.py", "textwrap.py", "string.py")]
    return prepare(files, str(tmp_path_factory.mktemp("d") / "prepared"), vocab_size=400)


GEMMA2_KNOBS = dict(qk_norm=False, sliding_window=8, global_every=2, attn_softcap=5.0,
                    final_softcap=10.0, query_scale=16.0, norm_plus_one=True,
                    sandwich_norm=True, embed_scale=True, gelu=True, tie_embeddings=True)


@pytest.mark.parametrize("knobs", [{}, GEMMA2_KNOBS], ids=["qwen3", "gemma2"])
def test_init_from_hf_train_and_export(data_path, tmp_path, knobs):
    # A "published" model: random weights far from our init, the data's tokenizer, a token id
    # in its config that export must keep. Gemma 2's window (8) is a quarter of the sequence.
    model = td.ModelConfig(**dict(vocab_size=512, d_model=32, n_layers=2, n_heads=4,
                                  n_kv_heads=2, head_dim=8, d_ff=64, max_seq_len=64,
                                  qk_norm=True, loss_chunk=16) | knobs)
    rng = np.random.default_rng(5)  # in numpy: nothing to compile
    published = jax.tree.map(
        lambda e: (1.0 if e[2] is None else 0.0) + 0.3 * rng.standard_normal(e[0], np.float32),
        td._param_table(model), is_leaf=train.is_entry)
    src = str(tmp_path / "published")
    td.save_hf(published, model, src, base_config={"eos_token_id": 2, "bos_token_id": 1})
    shutil.copy(os.path.join(data_path, "tokenizer.model"), src)

    args = ["tiny", "--init-from-hf", src, "--data.path", data_path, "--run-dir",
            str(tmp_path / "run"), "--train.steps", "2", "--train.batch-size", "8",
            "--train.seq-len", "32", "--train.sample-tokens", "0", "--train.log-every", "1",
            "--checkpoint.every", "2", "--model.dtype", "float32"]
    with pytest.raises(td.ConfigError, match=r"--model.n-layers conflicts with --init-from-hf"):
        td.cli(args + ["--model.n-layers", "3"])
    cfg = td.cli(args)
    summary = td.main(cfg)
    # The first step's loss is the published model's, not a fresh init's (ln 512 = 6.24).
    batch = batch_rows(load_dataset(DataConfig(path=data_path)).train, seed=0, step=0,
                       batch_size=8, seq_len=32)
    model = train.with_model(cfg, td.config_from_hf(*hf.model_source(cfg)[0])).model
    want = float(td.loss_fn(published, batch, model)[1]["ce"])
    first = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert first["step"] == 1 and first["loss"] == pytest.approx(want, rel=1e-5)
    assert abs(want - np.log(512)) > 0.5

    out = str(tmp_path / "exported")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train_dense.py"), "export-hf",
                        "--run-dir", str(tmp_path / "run"), "--out", out],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "export-hf: step 2" in r.stdout
    cfg_out, params_out = td.load_hf(out)
    assert cfg_out == dataclasses.replace(model, dtype="float32")
    trained = host(summary["state"]["params"])
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(host(params_out))):
        np.testing.assert_array_equal(a, b)
    assert hf.read_config(out)["eos_token_id"] == 2
    assert open(os.path.join(out, "tokenizer.model"), "rb").read() == open(
        os.path.join(src, "tokenizer.model"), "rb").read()


def test_init_from_hf_refuses_another_tokenizer(data_path, tmp_path):
    src = str(tmp_path / "published")
    shutil.copytree(fixture("llama2"), src)
    with open(os.path.join(src, "tokenizer.model"), "wb") as f:
        f.write(b"not the data's tokenizer")
    cfg = td.Config(init_from_hf=src, data=DataConfig(path=data_path),
                    train=td.TrainConfig(batch_size=8, seq_len=32, steps=1),
                    run_dir=str(tmp_path / "run"))
    with pytest.raises(hf.HFError, match=r"tokenized with another one"):
        td.main(cfg)


def test_prepare_and_check_a_hf_tokenizer_json(tmp_path):
    """Llama 3 and Qwen ship only tokenizer.json: prepare tokenizes with it (through the
    optional `tokenizers` package), EOS from tokenizer_config.json, and --init-from-hf accepts
    the data only if its tokenizer is the model's."""
    tokenizers = pytest.importorskip("tokenizers")
    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, f) for f in ("string.py", "textwrap.py", "shlex.py")]
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer, tok.decoder = byte_level, tokenizers.decoders.ByteLevel()
    tok.train(files, tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|begin|>", "<|end|>"],
        initial_alphabet=byte_level.alphabet(), show_progress=False))
    model = tmp_path / "model"
    model.mkdir()
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|end|>", "bos_token": {"content": "<|begin|>"}}))

    out = prepare(files, str(tmp_path / "data"), tokenizer=str(model / "tokenizer.json"))
    ds = load_dataset(DataConfig(path=out))
    assert ds.tokenizer_path.endswith("tokenizer.json")
    assert ds.vocab_size == tok.get_vocab_size() > 300
    assert (ds.eos_id, ds.bos_id) == (tok.token_to_id("<|end|>"), tok.token_to_id("<|begin|>"))
    text = "def f(x):\n    return x  # ünïcode"
    assert ds.encode(text) == tok.encode(text, add_special_tokens=False).ids
    assert ds.decode(ds.encode(text)) == text
    tokens = np.concatenate([ds.train, ds.eval])
    assert (tokens == ds.eos_id).sum() == len(files)  # one EOS after each document
    first = ds.train[:list(ds.train).index(ds.eos_id)]
    assert ds.decode(first) in [open(f).read() for f in files]

    assert hf.check_tokenizer(str(model), ds.tokenizer_path, "--data.path x") == ""
    other = tmp_path / "other"
    shutil.copytree(model, other)
    tok.add_special_tokens(["<|extra|>"])
    tok.save(str(other / "tokenizer.json"))
    with pytest.raises(hf.HFError, match=r"ships tokenizer.json, but the data \(--data.path x\)"):
        hf.check_tokenizer(str(other), ds.tokenizer_path, "--data.path x")
    os.remove(other / "tokenizer.json")
    assert "cannot be checked" in hf.check_tokenizer(str(other), ds.tokenizer_path, "")


def multimodal_copy(src: str, folder, model_type: str) -> str:
    """A released multimodal folder made from a text-only one, as transformers 5.25's
    save_pretrained writes Llama 4's and Gemma 3's: the text model's tensors under
    language_model., a vision tower's tensor beside them, the config under text_config."""
    os.makedirs(folder)
    vision = "vision_model.patch_embedding.linear.weight"
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    for i, file in enumerate(files):
        with open(os.path.join(src, file), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header, data = json.loads(f.read(n)), f.read()
        meta = header.pop("__metadata__", {})
        header = {"language_model." + k: v for k, v in header.items()} | {"__metadata__": meta}
        if i == 0:   # the vision tower's tensor, in the first file
            header[vision] = {"dtype": "BF16", "shape": [2, 2],
                              "data_offsets": [len(data), len(data) + 8]}
        head = json.dumps(header).encode()
        with open(os.path.join(folder, file), "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head + data + bytes(8 if i == 0 else 0))
    if os.path.isfile(os.path.join(src, hf.INDEX)):
        with open(os.path.join(src, hf.INDEX)) as f:
            index = json.load(f)
        index["weight_map"] = {"language_model." + k: v for k, v in index["weight_map"].items()
                               } | {vision: files[0]}
        with open(os.path.join(folder, hf.INDEX), "w") as f:
            json.dump(index, f)
    with open(os.path.join(src, "config.json")) as f:
        text = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"model_type": model_type, "text_config": text,
                   "vision_config": {"hidden_size": 2}}, f)
    return str(folder)


def test_a_multimodal_gemma3_folder_loads_its_language_model(loaded, tmp_path, capsys):
    """Gemma 3's 4B/12B/27B releases (model_type gemma3): the text model alone, with the
    text-only folder's logits; the GRPO policy reads it the same way."""
    folder = multimodal_copy(fixture("gemma3_text"), tmp_path / "gemma3", "gemma3")
    cfg, params = td.load_hf(folder)
    assert cfg == loaded["gemma3_text"][0]
    assert "not the 1 tensors of its other towers" in capsys.readouterr().out
    tokens, want = expected("gemma3_text")
    assert max_diff(logits(params, cfg, tokens), want) < TOL
    assert dataclasses.asdict(tg.load_hf(folder)[0]) == dataclasses.asdict(cfg)
