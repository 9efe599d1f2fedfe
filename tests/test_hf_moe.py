"""HuggingFace in and out for train_moe.py: Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek-V3, Kimi K2,
Llama 4, DeepSeek-V2, Gemma 4's MoE (26B-A4B, a gemma4_text folder) and DeepSeek-V3.2 (its
sparse attention's indexer) against transformers.

Same fixtures and checks as tests/test_hf.py (see there), for the mixture-of-experts families:
one tensor per expert and per layer, loaded straight onto the expert axis. Kimi K2's folder is
DeepSeek-V3's model under model_type kimi_k2, which transformers reads only as deepseek_v3.
"""
import dataclasses
import json
from functools import partial
import os
import shutil
import sysconfig
import tempfile

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import train_dense as td
import train_moe as tm
from common import hf, train
from common.data import DataConfig, batch_rows, load_dataset, prepare
from common.mesh import MeshConfig, make_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")
FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3", "kimi_k2", "llama4_text",
            "deepseek_v2", "gemma4_moe", "deepseek_v32", "qwen3_next", "qwen3_5_moe",
            "deepseek_v3_no_mtp", "deepseek_v32_long", "qwen3_next_own_shared"]
TOL = 1e-4
# Written as this model_type; the others as the knobs say (Qwen3.5's would be qwen3_next's).
AS = {"kimi_k2": "kimi_k2", "qwen3_5_moe": "qwen3_5_moe_text"}
BOOKKEEPING = {"transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
               "pad_token_id", "use_cache", "initializer_range", "attention_dropout",
               "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
               "pretraining_tp", "qk_head_dim"}  # transformers' own, derived or unused


def fixture(name):
    return os.path.join(FIXTURES, name)


def expected(name):
    e = np.load(os.path.join(fixture(name), "expected.npz"))
    return e["tokens"], e["logits"]


def logits(params, cfg, tokens, mesh=None):
    if mesh is None:
        return np.asarray(jax.jit(tm.forward, static_argnums=2)(params, tokens, cfg))
    with jax.set_mesh(mesh):
        tokens = jax.device_put(tokens, NamedSharding(mesh, P(tm.MOE_BATCH, None)))
        return np.asarray(jax.jit(tm.forward, static_argnums=2)(params, tokens, cfg))


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


def host(params):
    return jax.tree.map(np.asarray, jax.device_get(params))


@pytest.fixture(scope="module")
def loaded():
    return {name: tm.load_hf(fixture(name)) for name in FAMILIES}


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_match_transformers(name, loaded):
    cfg, params = loaded[name]
    tokens, want = expected(name)
    diff = max_diff(logits(params, cfg, tokens), want)
    print(f"{name}: max |logit difference| {diff:.2e}")
    assert diff < TOL


def test_config_mapping_and_routing_matters(loaded):
    mx, qm = loaded["mixtral"][0], loaded["qwen3_moe"][0]
    assert (mx.n_experts, mx.top_k, mx.norm_topk, mx.qk_norm) == (4, 2, True, False)
    assert (qm.n_experts, qm.top_k, qm.norm_topk, qm.qk_norm, qm.head_dim) == (4, 3, False,
                                                                                True, 12)
    # Renormalising the top-k weights or not is visible at this tolerance, both ways. Gemma 4
    # norms the experts' sum, which undoes a per-token factor; its per-expert scales and its
    # router's gain are visible instead.
    for name in FAMILIES:
        cfg, params = loaded[name]
        tokens, want = expected(name)
        flipped = dataclasses.replace(cfg, norm_topk=not cfg.norm_topk)
        assert (max_diff(logits(params, flipped, tokens), want) > 1e-2) != (name == "gemma4_moe")
    cfg, params = loaded["gemma4_moe"]
    tokens, want = expected("gemma4_moe")
    for k in ("expert_scale", "router_scale"):
        ones = {s: dict(params[s], **{k: np.ones_like(params[s][k])}) for s in (
            "layers", "global_layers")}
        assert max_diff(logits(params | ones, cfg, tokens), want) > 1e-2


@pytest.mark.parametrize("name", ["deepseek_v32", "deepseek_v32_long"])
def test_deepseek_v32_choice_matters(name, loaded):
    """The fixtures' queries keep 5 of up to 16 keys, or 12 of up to 37 (4 indexer heads, so
    many keys tie at 0, the earlier chosen): attending every key, or choosing with the indexer's
    key bias zeroed, misses transformers' logits by far; query blocks of 5 or 7, the last one
    padded, change nothing."""
    cfg, params = loaded[name]
    tokens, want = expected(name)
    T = tokens.shape[1]
    assert cfg.index_topk < T and cfg.rope_interleave and T % 5 and T % 7
    zero = {s: dict(params[s], idx_k_bias=np.zeros_like(params[s]["idx_k_bias"])) for s in (
        "layers", "dense_layers")}
    for p, c in ((params, dataclasses.replace(cfg, index_topk=T)), (params | zero, cfg)):
        assert max_diff(logits(p, c, tokens), want) > 1e-2
    for Q in (5, 7):
        assert max_diff(logits(params, dataclasses.replace(cfg, index_chunk=Q), tokens), want) < TOL


transformers = None
try:
    import torch
    import transformers
except ImportError:
    pass
live = pytest.mark.skipif(transformers is None, reason="transformers not installed (extra: parity)")


def hf_logits(folder, tokens):
    """transformers' logits, its top-k taking tied values in index order (as ours and as the
    fixtures were made: V3.2's indexer ties where every head's ReLU is 0)."""
    from make_hf_fixtures import stable_topk
    if hf.read_config(folder)["model_type"] == "kimi_k2":  # Moonshot's own code otherwise
        with tempfile.TemporaryDirectory() as tmp:
            return hf_logits(copy("", os.path.join(tmp, "as-deepseek"), lambda c: c.update(
                model_type="deepseek_v3"), src=folder), tokens)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad(), stable_topk():
        return model(torch.from_numpy(np.asarray(tokens, np.int64))).logits.numpy()


@pytest.mark.parametrize("name", FAMILIES)
def test_save_load_round_trip(name, loaded, tmp_path):
    cfg, params = loaded[name]
    src = hf.Checkpoint(fixture(name))
    out = str(tmp_path / "out")
    files = tm.save_hf(params, cfg, out, max_shard_bytes=6000, model_type=AS.get(name, ""))
    assert hf.INDEX in files and len(files) > 3
    cfg2, params2 = tm.load_hf(out)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(host(params)), jax.tree.leaves(host(params2))):
        np.testing.assert_array_equal(a, b)
    ours = hf.Checkpoint(out)
    assert {n: ours.shape(n) for n in ours.names()} == {n: src.shape(n) for n in src.names()}
    want = dict(src.config)
    if want["head_dim"] is None:  # transformers' way of saying hidden_size / heads
        want["head_dim"] = want["hidden_size"] // want["num_attention_heads"]
    differ = {k: (v, ours.config.get(k, "(absent)")) for k, v in want.items()
              if k not in BOOKKEEPING and ours.config.get(k, "(absent)") != v}
    if name in ("qwen3_moe", "qwen3_next", "qwen3_next_own_shared"):  # dense layers' width (none)
        assert differ == {"intermediate_size": (48, 16)}
    elif name == "deepseek_v3_no_mtp":  # the MTP module it counts and lacks: none, said so
        assert differ == {"num_nextn_predict_layers": (1, 0)}
    elif name == "qwen3_5_moe":  # RoPE's sections for images' positions: a text model has none
        assert list(differ) == ["rope_parameters"] and ours.config["rope_parameters"] == {
            k: v for k, v in want["rope_parameters"].items() if not k.startswith("mrope")}
    else:
        assert differ == {}


@live
@pytest.mark.parametrize("name", FAMILIES)
def test_live_fixture_and_export(name, loaded, tmp_path):
    """transformers computes the stored logits on the fixture, and the same on our export."""
    tokens, want = expected(name)
    assert max_diff(hf_logits(fixture(name), tokens), want) < TOL
    cfg, params = loaded[name]
    tm.save_hf(params, cfg, str(tmp_path), dtype="bfloat16", model_type=AS.get(name, ""))
    assert max_diff(hf_logits(str(tmp_path), tokens), want) < TOL


@live
def test_live_deepseek_variants_the_fixtures_lack(tmp_path):
    """What the fixtures do not have, exported and run by transformers: no query latent
    (q_proj, as V2-Lite), halves-rotated RoPE (rope_interleave false, our default), no YaRN,
    no groups, two shared experts, two dense layers, values as wide as the queries."""
    model = tm.ModelConfig(**dict(DEEPSEEK, q_lora_rank=0, rope_interleave=False, n_group=0,
                                  topk_group=0, n_shared_experts=2, first_k_dense=2,
                                  n_layers=4, v_head_dim=12), vocab_size=64, d_model=32,
                           n_heads=4, n_experts=4, top_k=2, d_ff=16, max_seq_len=64)
    rng = np.random.default_rng(7)
    params = jax.tree.map(
        lambda e: (1.0 if e[2] is None else 0.0) + 0.3 * rng.standard_normal(e[0], np.float32),
        tm._hf_table(model), is_leaf=train.is_entry)
    tm.save_hf(params, model, str(tmp_path))
    assert tm.config_from_hf(hf.read_config(str(tmp_path))) == dataclasses.replace(
        model, head_dim=model.qk_rope_head_dim)
    tokens = np.random.default_rng(8).integers(0, 64, (2, 16))
    assert max_diff(hf_logits(str(tmp_path), tokens), logits(params, model, tokens)) < TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_sharded_load_equals_one_device(name, loaded):
    cfg, one = loaded[name]
    tensor = 1 if name == "gemma4_moe" else 2  # its global layers' one K/V head (26B's: 2) whole
    mesh = make_mesh(MeshConfig(fsdp=4 // tensor, tensor=tensor, expert=2))
    cfg2, params = tm.load_hf(fixture(name), mesh)
    for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(
            train.table_specs(tm._hf_table(cfg)), is_leaf=lambda s: isinstance(s, P))):
        assert x.sharding == NamedSharding(mesh, spec)
    for a, b in zip(jax.tree.leaves(host(one)), jax.tree.leaves(host(params))):
        np.testing.assert_array_equal(a, b)
    tokens, want = expected(name)
    tokens4, want4 = np.concatenate([tokens] * (4 // tensor)), np.concatenate([want] * (4 // tensor))
    assert max_diff(logits(params, cfg2, tokens4, mesh), want4) < TOL


def copy(name, tmp_path, edit, src=None):
    dst = str(tmp_path) if src else str(tmp_path / name)
    shutil.copytree(src or fixture(name), dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        c = json.load(f)
    edit(c)
    with open(path, "w") as f:
        json.dump(c, f)
    return dst


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(mlp_only_layers=[1]), r"dense MLP layers between the MoE layers"),
    (lambda c: c.update(num_local_experts=8), r"tensors that a qwen3_moe model .* are missing"),
    (lambda c: c.update(moe_intermediate_size=8), r"down_proj.weight has shape \[32, 16\] "
                                                  r"but config.json implies \[32, 8\]"),
    (lambda c: c.update(model_type="qwen3"), r"model_type 'qwen3' is not a mixture-of-experts"),
])
def test_bad_folders(tmp_path, edit, match):
    with pytest.raises(hf.HFError, match=match):
        tm.load_hf(copy("qwen3_moe", tmp_path, edit))


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(scoring_func="softmax"), r"scoring_func 'softmax' .* not implemented"),
    (lambda c: c["rope_parameters"].update(mscale=1.0), r"YaRN with mscale == mscale_all_dim"),
    (lambda c: c.update(first_k_dense_replace=2), r"tensors that a deepseek_v3 model .* missing"),
])
def test_bad_deepseek_folders(tmp_path, edit, match):
    with pytest.raises(hf.HFError, match=match):
        tm.load_hf(copy("deepseek_v3", tmp_path, edit))


def test_multi_token_prediction_layer_is_left_out(tmp_path, capsys):
    """DeepSeek-V3's checkpoints end with the MTP module as layer num_hidden_layers: where
    num_nextn_predict_layers says 0 it is not part of the model we train, so it is skipped (and
    said), and nothing else is; where it says 1 the module is read (tests/test_mtp.py), whole."""
    dst = copy("deepseek_v3", tmp_path, lambda c: c.update(num_nextn_predict_layers=0))
    name = "model.layers.3.eh_proj.weight"
    hf._write_file(os.path.join(dst, "mtp.safetensors"), [
        (name, (32, 64), np.dtype(np.float32), lambda: np.ones((32, 64), np.float32))])
    with open(os.path.join(dst, hf.INDEX)) as f:
        index = json.load(f)
    index["weight_map"][name] = "mtp.safetensors"
    with open(os.path.join(dst, hf.INDEX), "w") as f:
        json.dump(index, f)
    cfg, params = tm.load_hf(dst)
    tokens, want = expected("deepseek_v3")
    assert max_diff(logits(params, cfg, tokens), want) < TOL
    assert "1 tensors of layers past num_hidden_layers" in capsys.readouterr().out
    hf.write_json(os.path.join(dst, hf.CONFIG), hf.read_config(dst) | {
        "num_nextn_predict_layers": 1})  # a module in part: the rest of it is missing
    with pytest.raises(hf.HFError, match=r"missing, e.g. model.layers.3.enorm.weight"):
        tm.load_hf(dst)


@pytest.mark.parametrize("depth", [0, 1])
def test_deepseek_saved_by_transformers_loads_trains_and_exports(depth, tmp_path, capsys):
    """transformers saves DeepSeek-V3 without its MTP module yet num_nextn_predict_layers 1: the
    folder loads with MTP off (said in one line), or with --model.mtp-depth 1 a fresh module
    (router biases 0); a step trains it and the export reads back as trained, the module too
    (and in transformers, with its logits)."""
    folder = fixture("deepseek_v3_no_mtp")
    cfg, params = tm.load_hf(folder, mtp_depth=depth)
    params, said = host(params), capsys.readouterr().out   # on the host: the step donates
    assert said.count("no MTP module") == 1 and ("start fresh" in said) == bool(depth)
    assert cfg.mtp_depth == depth and ("mtp" in params) == bool(depth)
    assert cfg == tm.hf_model_config(hf.Checkpoint(folder), depth, say=False)
    tokens, want = expected("deepseek_v3_no_mtp")
    assert max_diff(logits(params, cfg, tokens), want) < TOL   # the module is not in the logits
    if depth:
        assert np.all(np.asarray(params["mtp"]["layers"]["router_bias"]) == 0)
        assert tm.cli(["tiny-deepseek", "--init-from-hf", folder, "--model.mtp-depth", "1"]
                      ).model.mtp_depth == 1   # the one shape flag a folder may lack
    run = tm.Config(model=cfg, train=tm.TrainConfig(batch_size=2, seq_len=16, warmup_steps=0),
                    mesh=MeshConfig(fsdp=1))
    tm.validate(run, 1)
    mesh = make_mesh(run.mesh, jax.devices()[:1])
    st = tm.train_state(run, mesh)
    with jax.set_mesh(mesh):
        state = st.from_params(*train.split(params, tm._buffer_table(cfg)))
        batch = train.put(np.random.default_rng(0).integers(0, 64, (2, 17), np.int32), mesh,
                          tm.MOE_BATCH)
        state, metrics = st.jit(partial(tm.train_step, cfg=run, tx=st.tx))(state, batch)
    assert not bool(metrics["nonfinite"]) and (depth == 0 or np.isfinite(metrics["mtp_loss"]))
    trained = host(train.join(state["params"], state["buffers"]))
    assert max_diff(trained["embed"], params["embed"]) > 0
    out = str(tmp_path / "out")
    tm.save_hf(trained, cfg, out)
    cfg2, params2 = tm.load_hf(out)
    assert cfg2 == cfg and jax.tree.structure(params2) == jax.tree.structure(trained)
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(host(params2))):
        np.testing.assert_array_equal(a, b)
    if transformers is not None:
        assert max_diff(hf_logits(out, tokens), logits(trained, cfg, tokens)) < TOL


def float8_folders(src: hf.Checkpoint, tmp_path, monkeypatch, quantise, quantization_config):
    """Two folders of src's tensors: "fp8", where `quantise(name, w)` gives (e4m3 values, the
    scales' name suffix, the scales, w as a reader must give it back) or None (kept float32),
    and "f32", every tensor as that float32. Returns the fp8 folder's tensor list."""
    import ml_dtypes
    f8 = np.dtype(ml_dtypes.float8_e4m3fn)
    monkeypatch.setitem(hf.DTYPE_NAMES, f8, "F8_E4M3")   # only the tests write float8
    quant, plain, f32 = [], [], np.dtype(np.float32)
    for name in sorted(src.names()):
        w = np.asarray(src.array(name), np.float32)
        if (got := quantise(name, w, f8)) is None:
            quant.append((name, w.shape, f32, lambda w=w: w))
        else:
            q, suffix, scale, w = got
            quant += [(name, q.shape, f8, lambda q=q: q), (name + suffix, scale.shape, f32,
                                                           lambda s=scale.astype(f32): s)]
        plain.append((name, w.shape, f32, lambda w=w: w))
    for folder, tensors, extra in ((tmp_path / "fp8", quant, {"quantization_config":
                                    quantization_config}), (tmp_path / "f32", plain, {})):
        os.makedirs(folder)
        hf._write_file(str(folder / hf.SINGLE), tensors)
        hf.write_json(str(folder / hf.CONFIG), src.config | extra)
    return quant


def tiled(b):
    """DeepSeek's float8 for float8_folders: each projection e4m3, one scale per b x b tile."""
    def quantise(name, w, f8):
        if "proj" not in name or not name.endswith(".weight"):
            return None
        pad = [(0, -n % b) for n in w.shape]
        tiles = np.pad(np.abs(w), pad).reshape(-(-w.shape[0] // b), b, -1, b).max(
            axis=(1, 3)) / 448 + 1e-8
        scale = np.repeat(np.repeat(tiles, b, 0), b, 1)[:w.shape[0], :w.shape[1]]
        q = (w / scale).astype(f8)
        return q, "_scale_inv", tiles, q.astype(np.float32) * scale
    return quantise


def test_float8_release_reads_as_its_dequantised_weights(tmp_path, monkeypatch):
    """DeepSeek-V3's own format: every projection as e4m3 with one scale per tile (here 4 x 4,
    so that tiles straddle the heads and the per-device blocks of a sharded load). It must
    load as exactly the weights q * scale that a float32 folder of them holds."""
    float8_folders(hf.Checkpoint(fixture("deepseek_v3")), tmp_path, monkeypatch, tiled(4),
                   {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [4, 4]})
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2, expert=2))
    cfg, want = tm.load_hf(str(tmp_path / "f32"))
    _, got = tm.load_hf(str(tmp_path / "fp8"), mesh)
    for a, b in zip(jax.tree.leaves(host(want)), jax.tree.leaves(host(got))):
        np.testing.assert_array_equal(a, b)
    tokens, ref = expected("deepseek_v3")
    assert max_diff(logits(want, cfg, tokens), ref) > 1e-3   # the rounding is real (routing flips)
    with open(tmp_path / "fp8" / hf.CONFIG) as f:   # tiles of 128 do not fit these scales
        c = json.load(f)
    c["quantization_config"]["weight_block_size"] = [128, 128]
    hf.write_json(str(tmp_path / "fp8" / hf.CONFIG), c)
    with pytest.raises(hf.HFError, match=r"no .*_scale_inv of shape \[1, 1\]"):
        tm.load_hf(str(tmp_path / "fp8"))


def test_float8_parts_read_per_block(tmp_path, monkeypatch):
    """Qwen3.5's DeltaNet query, key and value rows in one float8 tensor, tiles of 5 x 5
    straddling the parts (16, 16 and 36 rows): each part of each device block loads as the
    float32 folder's weights."""
    quant = float8_folders(hf.Checkpoint(fixture("qwen3_5_moe")), tmp_path, monkeypatch,
                           tiled(5), {"quant_method": "fp8", "weight_block_size": [5, 5]})
    qkv = [t for t in quant if t[0] == "model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert [(t[1], t[2].itemsize) for t in qkv] == [((68, 32), 1)]   # e4m3
    _, want = tm.load_hf(str(tmp_path / "f32"))
    _, got = tm.load_hf(str(tmp_path / "fp8"), make_mesh(MeshConfig(fsdp=2, tensor=2, expert=2)))
    for a, b in zip(jax.tree.leaves(host(want)), jax.tree.leaves(host(got))):
        np.testing.assert_array_equal(a, b)


def test_each_trainer_points_to_the_other():
    with pytest.raises(hf.HFError, match=r"belong to train_moe.py"):
        td.load_hf(fixture("mixtral"))
    with pytest.raises(hf.HFError, match=r"belong to train_dense.py"):
        tm.load_hf(fixture("qwen3"))


# DeepSeek's: MLA, a dense first layer, groups, a shared expert, and router biases that must
# come in with the weights and go out with them.
DEEPSEEK = dict(n_layers=3, n_kv_heads=4, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8,
                qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True, sigmoid_routing=True,
                routed_scale=2.5, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense=1,
                dense_d_ff=24)


@pytest.mark.parametrize("preset,knobs", [("tiny-moe", {}), ("tiny-deepseek", DEEPSEEK)])
def test_init_from_hf_train_and_export(tmp_path, preset, knobs):
    stdlib = sysconfig.get_paths()["stdlib"]
    data = prepare([os.path.join(stdlib, f) for f in ("argparse.py", "textwrap.py")],
                   str(tmp_path / "data"), vocab_size=400)
    model = tm.ModelConfig(**dict(dict(
        vocab_size=400, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
        n_experts=4, top_k=2, d_ff=16, max_seq_len=64, loss_chunk=16, remat="none"), **knobs))
    rng = np.random.default_rng(5)  # in numpy: nothing to compile
    published = jax.tree.map(
        lambda e: (1.0 if e[2] is None else 0.0) + 0.3 * rng.standard_normal(e[0], np.float32),
        tm._hf_table(model), is_leaf=train.is_entry)
    src = str(tmp_path / "published")
    tm.save_hf(published, model, src, base_config={"eos_token_id": 2})
    shutil.copy(os.path.join(data, "tokenizer.model"), src)
    if knobs:  # as transformers saves DeepSeek: an MTP module counted, none there; one fresh
        hf.write_json(os.path.join(src, hf.CONFIG), hf.read_config(src) | {
            "num_nextn_predict_layers": 1})

    args = [preset, "--init-from-hf", src, "--data.path", data, "--run-dir",
            str(tmp_path / "run"), "--train.steps", "2", "--train.batch-size", "8",
            "--train.seq-len", "32", "--train.sample-tokens", "0", "--train.log-every", "1",
            "--checkpoint.every", "2", "--mesh.expert", "2", "--mesh.fsdp", "-1"] + [
                "--model.mtp-depth", "1"] * bool(knobs)
    with pytest.raises(tm.ConfigError, match=r"--model.n-experts conflicts with --init-from-hf"):
        tm.cli(args + ["--model.n-experts", "8"])
    cfg = tm.cli(args)
    summary = tm.main(cfg)
    batch = batch_rows(load_dataset(DataConfig(path=data)).train, seed=0, step=0,
                       batch_size=8, seq_len=32)
    h, _ = tm.hidden(published, batch[:, :-1], train.with_model(cfg, tm.config_from_hf(*hf.model_source(cfg)[0])).model)
    assert ("mtp_loss" in json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())) == bool(
        knobs) == ("mtp" in summary["state"]["params"])
    logp = jax.nn.log_softmax(h @ published["unembed"], axis=-1)
    want = -float(np.mean(np.take_along_axis(np.asarray(logp), batch[:, 1:, None], -1)))
    first = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert first["step"] == 1 and first["loss"] == pytest.approx(want, rel=1e-5)

    out = str(tmp_path / "exported")
    tm.export_hf(str(tmp_path / "run"), out)
    _, params_out = tm.load_hf(out)
    state = summary["state"]
    trained = train.join(state["params"], state.get("buffers", {}))
    assert jax.tree.structure(trained) == jax.tree.structure(params_out)
    for a, b in zip(jax.tree.leaves(host(trained)), jax.tree.leaves(host(params_out))):
        np.testing.assert_array_equal(a, b)
    if knobs:  # the biases started as the folder's and moved by the balancing
        moved = state["buffers"]["layers"]["router_bias"] - published["layers"]["router_bias"]
        moved = np.abs(np.asarray(moved))
        assert np.all(moved < 2e-3 + 1e-6) and np.any(moved > 1e-3)
    assert hf.read_config(out)["eos_token_id"] == 2 and os.path.isfile(
        os.path.join(out, "tokenizer.model"))
