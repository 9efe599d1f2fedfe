"""LoRA (--lora.rank, issue 41): the adapters' table, the start equal to the base model, the merge
by hand, gradients reaching only the adapters, sharded == one device, the memory a frozen model
saves, bad flags refused, and the exported adapter loaded by peft onto transformers' model."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_dense as td
import train_moe as tm
from common import hf, lora, train
from common.data import DataConfig
from common.mesh import MeshConfig, make_mesh
from tests.test_hf import data_path, host  # noqa: F401
from tests.test_moe import SMALL as MOE
from tests.test_sft import SMALL

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LORA = lora.LoRAConfig(rank=4, alpha=8.0, targets=td.Config().lora.targets)


def table(targets=LORA.targets, model=SMALL):
    return lora.lora_table(td._param_table(model), td.MUON_DIMS,
                           dataclasses.replace(LORA, targets=targets))


def random_adapters(model=SMALL, seed=3):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda e: jnp.asarray(0.2 * rng.standard_normal(e[0]), jnp.float32),
                        table(model=model), is_leaf=train.is_entry)


def test_table_shapes_specs_and_refusals():
    t = table()
    L, D, N, K, H, F = 2, 32, 4, 2, 8, 64
    # the Muon matrices this (Llama) model has: Gemma 4's and DeltaNet's are not in its table
    assert set(t) == {"layers"} and set(t["layers"]) <= set(td.MUON_DIMS)
    got = {k: (v["a"][0], v["b"][0]) for k, v in t["layers"].items()}
    assert got == {"wq": ((L, D, 4), (L, 4, N, H)), "wk": ((L, D, 4), (L, 4, K, H)),
                   "wv": ((L, D, 4), (L, 4, K, H)), "wo": ((L, N, H, 4), (L, 4, D)),
                   "w_gate": ((L, D, 4), (L, 4, F)), "w_up": ((L, D, 4), (L, 4, F)),
                   "w_down": ((L, F, 4), (L, 4, D))}
    # each half split as the weight's axes it spans, the rank whole; b starts at zero
    spec = td._param_table(SMALL)["layers"]["wq"][1]
    assert t["layers"]["wq"]["a"][1] == jax.sharding.PartitionSpec(*spec[:2], None)
    assert t["layers"]["wq"]["b"][1] == jax.sharding.PartitionSpec(spec[0], None, *spec[2:])
    assert t["layers"]["wq"]["b"][2] == 0.0 and t["layers"]["wq"]["a"][2] == D ** -0.5
    assert set(table("wq,wo")["layers"]) == {"wq", "wo"}
    with pytest.raises(td.ConfigError, match="--lora.targets 'wq,q_proj'"):
        table("wq,q_proj")
    with pytest.raises(td.ConfigError, match="none of these weights is in this model"):
        table("ple_gate")


def test_start_is_the_base_model_and_the_merge_is_by_hand():
    base, tokens = base_params(td, SMALL), jnp.arange(24).reshape(2, 12) % SMALL.vocab_size
    fresh = train.table_init(table(), jax.random.key(0))
    want = td.forward(base, tokens, SMALL)
    np.testing.assert_array_equal(td.forward(lora.adapt(base, fresh, 2.0), tokens, SMALL), want)

    ad, s = random_adapters(), LORA.alpha / LORA.rank
    merged = lora.merged(lora.adapt(base, ad, s))["layers"]
    a, b, w = (lambda n: np.asarray(ad["layers"][n]["a"], np.float64),
               lambda n: np.asarray(ad["layers"][n]["b"], np.float64),
               lambda n: np.asarray(base["layers"][n], np.float64))
    by_hand = {"wq": np.einsum("ldr,lrnh->ldnh", a("wq"), b("wq")),
               "wo": np.einsum("lnhr,lrd->lnhd", a("wo"), b("wo")),
               "w_down": np.einsum("lfr,lrd->lfd", a("w_down"), b("w_down"))}
    for n, d in by_hand.items():
        np.testing.assert_allclose(merged[n], w(n) + s * d, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(merged["attn_norm"], base["layers"]["attn_norm"])
    # each layer merging its own in the scan == the whole model merged first
    got = td.forward(lora.adapt(base, ad, s), tokens, SMALL)
    whole = td.forward(base | {"layers": merged}, tokens, SMALL)
    np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(np.asarray(got) - np.asarray(want))) > 0.1


def lora_cfg(model=SMALL, lora=LORA, **kw):
    t = dict(batch_size=8, seq_len=16, lr=0.01, warmup_steps=0, schedule="constant") | kw
    return td.Config(model=dataclasses.replace(model, dtype="float32"),
                     train=td.TrainConfig(**t), lora=lora)


def base_params(mod, model, seed=1):
    """Random weights, norm gains near 1 (numpy: nothing to compile)."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, s: jnp.asarray((1.0 if "norm" in jax.tree_util.keystr(path) else 0.0)
                                    + 0.1 * rng.standard_normal(s.shape), jnp.float32),
        jax.eval_shape(partial(mod._init, model), jax.random.key(0)))


def steps(cfg, mesh, n=3, mod=td):
    """n steps from perturbed base weights on fixed random tokens; the state, on the host."""
    st = mod.train_state(cfg, mesh)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (n, 8, 17), np.int32)
    with jax.set_mesh(mesh):
        state = st.from_params(jax.device_put(base_params(mod, cfg.model), st.base_sh))
        fn = st.jit(partial(mod.train_step, cfg=cfg, tx=st.tx))
        for i in range(n):
            state, m = fn(state, train.put(tokens[i], mesh, td.BATCH_AXES))
    return host(state), m


def test_gradients_reach_only_the_adapters():
    cfg = lora_cfg()
    state, m = steps(cfg, make_mesh(MeshConfig(), jax.devices()[:1]), n=2)
    assert set(state) == {"params", "opt_state", "step", "base"}
    for x, y in zip(jax.tree.leaves(state["base"]), jax.tree.leaves(base_params(td, cfg.model))):
        np.testing.assert_array_equal(x, y)  # frozen, bit for bit
    assert all(np.abs(v["b"]).max() > 0 for v in state["params"]["layers"].values())
    # Adam's moments exist for the adapters alone
    n_ad = sum(x.size for x in jax.tree.leaves(state["params"]))
    n_opt = sum(x.size for x in jax.tree.leaves(state["opt_state"]))
    assert 2 * n_ad <= n_opt < 2 * n_ad + 16 and np.isfinite(m["loss"])


def test_sharded_equals_one_device():
    cfg = lora_cfg()
    one, _ = steps(cfg, make_mesh(MeshConfig(), jax.devices()[:1]))
    many, _ = steps(cfg, make_mesh(MeshConfig(fsdp=2, tensor=2, data=2), jax.devices()))
    for x, y in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(many["params"])):
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-6)


def test_moe_experts_adapted_sharded_equals_one_device():
    """MoE: the experts' matrices adapted too ([L, E, D, r] and [L, E, r, F], split over the
    expert axis as theirs are); the start is the base model; 8 devices == 1."""
    cfg = tm.Config(model=dataclasses.replace(MOE, dtype="float32"), train=tm.TrainConfig(
        batch_size=8, seq_len=16, lr=0.01, warmup_steps=0, schedule="constant"), lora=LORA)
    t = lora.lora_table(tm._param_table(cfg.model), tm.MUON_DIMS, LORA)["layers"]
    assert t["w_gate"]["a"][0] == (2, 8, 32, 4) and t["w_gate"]["b"][0] == (2, 8, 4, 16)
    assert t["w_gate"]["a"][1][1] == tm._param_table(cfg.model)["layers"]["w_gate"][1][1]
    base, tokens = base_params(tm, cfg.model), jnp.arange(32).reshape(2, 16)
    fresh = train.table_init(lora.lora_table(tm._param_table(cfg.model), tm.MUON_DIMS, LORA),
                             jax.random.key(0))
    np.testing.assert_array_equal(tm.forward(lora.adapt(base, fresh, 2.0), tokens, cfg.model),
                                  tm.forward(base, tokens, cfg.model))
    one, _ = steps(cfg, make_mesh(MeshConfig(), jax.devices()[:1]), mod=tm)
    many, m = steps(cfg, make_mesh(MeshConfig(expert=4, fsdp=2), jax.devices()), mod=tm)
    for x, y in zip(jax.tree.leaves(one["base"]), jax.tree.leaves(base)):
        np.testing.assert_array_equal(x, y)
    assert np.abs(one["params"]["layers"]["w_down"]["b"]).max() > 0 and np.isfinite(m["loss"])
    for x, y in zip(jax.tree.leaves(one["params"]), jax.tree.leaves(many["params"])):
        np.testing.assert_allclose(x, y, rtol=1e-3, atol=2e-5)  # Adam's first steps: ~lr sign(g)


@pytest.mark.parametrize("fmt", ["text", "dpo"])
def test_a_frozen_model_needs_less_memory(fmt, monkeypatch):
    """The dry run's per-device bytes: no gradient or moments for the base (nor, in DPO, a
    copy of it as the reference: the base is the reference)."""
    monkeypatch.setattr(td.hf, "model_source", lambda cfg: (None, cfg.model))  # no run read

    def report(rank):
        args = ["tiny", "--dry-run", "--lora.rank", str(rank), "--train.batch-size", "8",
                "--train.seq-len", "64"] + (["--data.format", "dpo", "--init-from", "x"]
                                            if fmt == "dpo" else [])
        return td.main(td.cli(args))
    full, lora = report(0), report(8)
    # the tiny model's 5M float32 parameters: Adam's two moments (and DPO's reference) gone
    saved = full["per_device_bytes"] - lora["per_device_bytes"]
    assert saved > (3 if fmt == "dpo" else 2) * 4 * 0.9 * full["params"] / 8, (full, lora)


def test_lora_refusals():
    for extra, match in [(["--train.optimizer", "muon"], "--lora.rank 4 trains its adapters"),
                         (["--lora.targets", "embed"], "--lora.targets 'embed'"),
                         (["--lora.rank", "-1"], "--lora.rank")]:
        with pytest.raises(td.ConfigError, match=match):
            cfg = td.cli(["tiny", "--lora.rank", "4", "--dry-run"] + extra)
            td.validate(cfg, 8)
            td.train_state(cfg, make_mesh(MeshConfig(fsdp=8)))


try:
    import peft  # noqa: F401
    import torch  # noqa: F811
    import transformers
except ImportError:
    peft = None


@pytest.mark.skipif(peft is None, reason="peft, torch, transformers not installed")
def test_peft_loads_our_adapter(data_path, tmp_path):  # noqa: F811
    """A LoRA run from a HuggingFace folder; its adapter folder, loaded by peft onto that
    folder's model, and its merged export, loaded by transformers, give our logits."""
    model = td.ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=8, d_ff=64, max_seq_len=64, loss_chunk=16)
    rng = np.random.default_rng(5)
    published = jax.tree.map(
        lambda e: (1.0 if e[2] is None else 0.0) + 0.3 * rng.standard_normal(e[0], np.float32),
        td._param_table(model), is_leaf=train.is_entry)
    src = str(tmp_path / "published")
    td.save_hf(published, model, src, model_type="llama")
    shutil.copy(os.path.join(data_path, "tokenizer.model"), src)
    run = str(tmp_path / "run")
    cfg = td.cli(["tiny", "--init-from-hf", src, "--data.path", data_path, "--run-dir", run,
                  "--train.steps", "3", "--train.batch-size", "8", "--train.seq-len", "32",
                  "--train.lr", "0.02", "--train.warmup-steps", "0", "--train.schedule",
                  "constant", "--train.sample-tokens", "0", "--checkpoint.every", "3",
                  "--model.dtype", "float32", "--lora.rank", "4", "--lora.alpha", "8"])
    state = td.main(cfg)["state"]
    m = train.with_model(cfg, td.config_from_hf(*hf.model_source(cfg)[0])).model
    tokens = rng.integers(0, 512, (2, 24))
    ours = np.asarray(td.forward(lora.weights(state, cfg.lora), jnp.asarray(tokens), m))
    base = np.asarray(td.forward(state["base"], jnp.asarray(tokens), m))
    assert np.max(np.abs(ours - base)) > 0.05  # the adapters moved the logits

    def export(*extra):
        out = str(tmp_path / ("adapter" if extra else "merged"))
        r = subprocess.run([sys.executable, os.path.join(ROOT, "train_dense.py"), "export-hf",
                            "--run-dir", run, "--out", out, *extra], capture_output=True,
                           text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr
        return out
    adapter, merged = export("--adapter"), export()
    assert json.load(open(os.path.join(adapter, "adapter_config.json")))["r"] == 4
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        t = torch.from_numpy(tokens)
        got_peft = peft.PeftModel.from_pretrained(hf_base, adapter)(t).logits.numpy()
        got_merged = transformers.AutoModelForCausalLM.from_pretrained(
            merged, dtype=torch.float32)(t).logits.numpy()
    assert np.max(np.abs(got_peft - ours)) < 1e-4
    assert np.max(np.abs(got_merged - ours)) < 1e-4


def test_grpo_trains_adapters_over_its_full_warm_start_and_resumes(tmp_path, capsys):
    """GRPO with --lora.rank: the warm start (SFT) trains the whole model, which then stays
    frozen as the base and the KL reference (no copy of it); rollouts sample the adapted
    policy; resumed == uninterrupted, bit for bit; export-hf writes the merged model."""
    from tests.test_grpo import grpo_config, metrics
    import train_grpo as tg
    cfg = lambda d, n: grpo_config(tmp_path / d, n, lora=LORA, grpo=dict(mu=1), warm=dict(
        max_steps=10, check_every=10, batch_size=32, lr=1e-2, target_reward=2.0))
    full = tg.main(cfg("a", 3))
    tg.main(cfg("b", 2))
    resumed = tg.main(cfg("b", 3))
    assert "resumed from step 2" in capsys.readouterr().out
    state = jax.device_get(full["state"])
    assert set(state) == {"params", "opt_state", "step", "base"}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(jax.device_get(resumed["state"]))):
        np.testing.assert_array_equal(a, b)
    start = jax.device_get(tg.main(cfg("c", 0))["state"])  # the warm start alone
    for a, b in zip(jax.tree.leaves(state["base"]), jax.tree.leaves(start["base"])):
        np.testing.assert_array_equal(a, b)  # the warm start's model, frozen since
    assert any(np.abs(v["b"]).max() > 0 for v in state["params"]["layers"].values())
    steps = [r for r in metrics(tmp_path / "a") if "step" in r and "reward" in r]
    assert steps[0]["kl"] < 1e-9 < steps[1]["kl"]  # the policy starts as its reference
    out = str(tmp_path / "hf")
    tg.export_hf(str(tmp_path / "a"), out)
    _, merged = tg.load_hf(out)
    want = lora.merged(lora.weights(state, LORA))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(jax.device_get(merged))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
