"""HuggingFace in and out for train_moe.py: Mixtral, Qwen3-MoE and GPT-OSS against transformers.

Same fixtures and checks as tests/test_hf.py (see there), for the mixture-of-experts families:
one tensor per expert and per layer, loaded straight onto the expert axis.
"""
import dataclasses
import json
import os
import shutil
import sysconfig

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
FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss"]
TOL = 1e-4
BOOKKEEPING = {"transformers_version", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
               "pad_token_id", "use_cache", "initializer_range", "attention_dropout",
               "output_router_logits", "router_aux_loss_coef", "router_jitter_noise"}


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
    # Renormalising the top-k weights or not is visible at this tolerance, both ways.
    for name in FAMILIES:
        cfg, params = loaded[name]
        tokens, want = expected(name)
        flipped = dataclasses.replace(cfg, norm_topk=not cfg.norm_topk)
        assert max_diff(logits(params, flipped, tokens), want) > 1e-2


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


@pytest.mark.parametrize("name", FAMILIES)
def test_save_load_round_trip(name, loaded, tmp_path):
    cfg, params = loaded[name]
    src = hf.Checkpoint(fixture(name))
    out = str(tmp_path / "out")
    files = tm.save_hf(params, cfg, out, max_shard_bytes=6000)  # family picked from the knobs
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
    if name == "qwen3_moe":  # the width of dense layers, which this model has none of
        assert differ == {"intermediate_size": (48, 16)}
    else:
        assert differ == {}


@live
@pytest.mark.parametrize("name", FAMILIES)
def test_live_fixture_and_export(name, loaded, tmp_path):
    """transformers computes the stored logits on the fixture, and the same on our export."""
    tokens, want = expected(name)
    assert max_diff(hf_logits(fixture(name), tokens), want) < TOL
    cfg, params = loaded[name]
    tm.save_hf(params, cfg, str(tmp_path), dtype="bfloat16")
    assert max_diff(hf_logits(str(tmp_path), tokens), want) < TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_sharded_load_equals_one_device(name, loaded):
    cfg, one = loaded[name]
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2, expert=2))
    cfg2, params = tm.load_hf(fixture(name), mesh)
    for x, spec in zip(jax.tree.leaves(params), jax.tree.leaves(
            tm.param_specs(cfg), is_leaf=lambda s: isinstance(s, P))):
        assert x.sharding == NamedSharding(mesh, spec)
    for a, b in zip(jax.tree.leaves(host(one)), jax.tree.leaves(host(params))):
        np.testing.assert_array_equal(a, b)
    tokens, want = expected(name)
    tokens4, want4 = np.concatenate([tokens, tokens]), np.concatenate([want, want])
    assert max_diff(logits(params, cfg2, tokens4, mesh), want4) < TOL


def copy(name, tmp_path, edit):
    dst = str(tmp_path / name)
    shutil.copytree(fixture(name), dst)
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


def test_each_trainer_points_to_the_other():
    with pytest.raises(hf.HFError, match=r"belong to train_moe.py"):
        td.load_hf(fixture("mixtral"))
    with pytest.raises(hf.HFError, match=r"belong to train_dense.py"):
        tm.load_hf(fixture("qwen3"))


def test_init_from_hf_train_and_export(tmp_path):
    stdlib = sysconfig.get_paths()["stdlib"]
    data = prepare([os.path.join(stdlib, f) for f in ("argparse.py", "textwrap.py")],
                   str(tmp_path / "data"), vocab_size=400)
    model = tm.ModelConfig(vocab_size=400, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=8, n_experts=4, top_k=2, d_ff=16, max_seq_len=64,
                           loss_chunk=16, remat="none")
    rng = np.random.default_rng(5)  # in numpy: nothing to compile
    published = jax.tree.map(
        lambda e: (1.0 if e[2] is None else 0.0) + 0.3 * rng.standard_normal(e[0], np.float32),
        tm._param_table(model), is_leaf=train.is_entry)
    src = str(tmp_path / "published")
    tm.save_hf(published, model, src, base_config={"eos_token_id": 2})
    shutil.copy(os.path.join(data, "tokenizer.model"), src)

    args = ["tiny-moe", "--init-from-hf", src, "--data.path", data, "--run-dir",
            str(tmp_path / "run"), "--train.steps", "2", "--train.batch-size", "8",
            "--train.seq-len", "32", "--train.sample-tokens", "0", "--train.log-every", "1",
            "--checkpoint.every", "2", "--mesh.expert", "2", "--mesh.fsdp", "-1"]
    with pytest.raises(tm.ConfigError, match=r"--model.n-experts conflicts with --init-from-hf"):
        tm.cli(args + ["--model.n-experts", "8"])
    cfg = tm.cli(args)
    summary = tm.main(cfg)
    batch = batch_rows(load_dataset(DataConfig(path=data)).train, seed=0, step=0,
                       batch_size=8, seq_len=32)
    h, _ = tm.hidden(published, batch[:, :-1], train.with_source_model(cfg, tm.config_from_hf, tm.COMPUTE_FIELDS).model)
    logp = jax.nn.log_softmax(h @ published["unembed"], axis=-1)
    want = -float(np.mean(np.take_along_axis(np.asarray(logp), batch[:, 1:, None], -1)))
    first = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert first["step"] == 1 and first["loss"] == pytest.approx(want, rel=1e-5)

    out = str(tmp_path / "exported")
    tm.export_hf(str(tmp_path / "run"), out)
    _, params_out = tm.load_hf(out)
    for a, b in zip(jax.tree.leaves(host(summary["state"]["params"])),
                    jax.tree.leaves(host(params_out))):
        np.testing.assert_array_equal(a, b)
    assert hf.read_config(out)["eos_token_id"] == 2 and os.path.isfile(
        os.path.join(out, "tokenizer.model"))
