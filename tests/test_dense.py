"""The dense model against references: itself unsharded, a naive loop, hand counts."""
import dataclasses
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import train_dense as td
from common.mesh import MeshConfig, MeshError, make_mesh
from tests.spawn import scatter_loops

SMALL = td.ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=8, d_ff=64, max_seq_len=64, loss_chunk=8)
# Every knob on at once: Qwen2 biases, Qwen3 q/k norm, tied embeddings, Llama 3.1 rope scaling.
KNOBS = dataclasses.replace(SMALL, qkv_bias=True, qk_norm=True, tie_embeddings=True,
                            rope_scaling=8.0, rope_original_max_len=32)
# Gemma 2's knobs (window 5 of the 16-token test sequence, padded to whole blocks) and Gemma 3's.
GEMMA2 = dataclasses.replace(SMALL, n_layers=4, sliding_window=5, global_every=2, attn_softcap=3.0,
                             final_softcap=2.5, query_scale=10.0, norm_plus_one=True,
                             sandwich_norm=True, embed_scale=True, gelu=True, tie_embeddings=True)
GEMMA3 = dataclasses.replace(GEMMA2, n_layers=3, global_every=3, attn_softcap=0.0,
                             final_softcap=0.0, qk_norm=True, rope_local_theta=100.0,
                             rope_linear=2.0)
# OLMo 3's: post norms, q/k norms over all heads, a window of 5 on layer 0, YaRN on layer 1.
# GPT-2's block (GPT-3's): LayerNorm, learned positions, a plain GELU MLP, biases everywhere.
GPT2 = dataclasses.replace(SMALL, n_kv_heads=SMALL.n_heads, tie_embeddings=True, **td._GPT2)
OLMO3 = dataclasses.replace(SMALL, post_norm=True, qk_norm=True, qk_norm_whole=True,
                            sliding_window=5, global_every=2, rope_local_theta=100.0,
                            yarn_factor=4.0, yarn_original_max_len=16)


def small_cfg(model=SMALL, mesh=MeshConfig(fsdp=1), **train):
    t = dict(batch_size=8, seq_len=16, warmup_steps=2, steps=10, lr=1e-2)
    return td.Config(model=model, train=td.TrainConfig(**(t | train)), mesh=mesh)


def tokens(cfg, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1),
                        dtype=np.int32)


def perturbed_params(cfg):
    """Random weights with non-trivial norms and biases (ones/zeros would hide bugs)."""
    p = td.init_params(cfg.model, jax.random.key(1))
    leaves, tree = jax.tree.flatten(p)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.1 * jax.random.normal(k, x.shape)
                                     for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("name,count", [
    ("llama2-7b", 6_738_415_616), ("llama3.1-8b", 8_030_261_248),
    ("llama3.1-70b", 70_553_706_496), ("llama3.1-405b", 405_853_388_800),
    ("mistral-7b", 7_248_023_552), ("llama3.2-1b", 1_235_814_400),
    ("qwen3-0.6b", 596_049_920), ("qwen3-8b", 8_190_735_360),
    # OLMo 3: what transformers' Olmo3ForCausalLM has at the released configs' shapes.
    ("olmo3-7b", 7_298_011_136), ("olmo3-32b", 32_233_522_176),
    # GPT-3: 96 layers of 12 d^2 + 13 d, the tables and the final LayerNorm: the paper's 174.6B;
    # MaxText's 22B, 6B (16384 positions) and its 52k test model
    ("gpt3-175b", 96 * (12 * 12288**2 + 13 * 12288) + (50257 + 2048 + 2) * 12288),
    ("gpt3-22b", 22_049_107_968), ("gpt3-6b", 5_588_736_000), ("gpt3-52k", 52_464),
    ("tiny-gpt3", 4_339_200)])
def test_preset_parameter_counts(name, count):
    assert td.count_params(td.PRESETS[name][1].model) == count


def test_param_specs_match_params_tree():
    for model in (SMALL, KNOBS, OLMO3, GPT2):
        shapes = jax.eval_shape(partial(td._init, model), jax.random.key(0))
        specs = td.param_specs(model)
        assert jax.tree.structure(shapes) == jax.tree.structure(
            specs, is_leaf=lambda x: isinstance(x, P))
        for s, spec in zip(jax.tree.leaves(shapes),
                           jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
            assert len(spec) == len(s.shape)


def grads_and_loss(cfg, params, batch, mesh):
    with jax.set_mesh(mesh):
        p_sh = td.named(mesh, td.param_specs(cfg.model))
        params = jax.device_put(params, p_sh)
        batch = jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp"), None)))
        f = jax.jit(jax.value_and_grad(lambda p, b: td.loss_fn(p, b, cfg.model)[0]))
        loss, g = f(params, batch)
        return float(loss), jax.device_get(g)


@pytest.mark.parametrize("model", [SMALL, KNOBS, GEMMA2, GEMMA3, OLMO3,
                                   dataclasses.replace(SMALL, vocab_split=True),
                                   dataclasses.replace(KNOBS, vocab_split=True)],
                         ids=["llama", "all-knobs", "gemma2", "gemma3", "olmo3", "vocab-split",
                              "tied-vocab-split"])
def test_sharded_equals_unsharded(model):
    if model.vocab_split:  # the unembedding stored as the vocabulary-parallel loss reads it
        V = ("tensor", "fsdp", "context")  # (a tied table: its rows, looked up where they lie)
        assert td.param_specs(model)["embed" if model.tie_embeddings else "unembed"] == (
            P(V, None) if model.tie_embeddings else P(None, V))
    cfg = small_cfg(model)
    params, batch = perturbed_params(cfg), tokens(cfg)
    ref_loss, ref_g = grads_and_loss(cfg, params, batch, make_mesh(MeshConfig(fsdp=1),
                                                                   jax.devices()[:1]))
    for mc in (MeshConfig(data=8, fsdp=1), MeshConfig(fsdp=4, tensor=2),
               MeshConfig(data=2, fsdp=2, tensor=2)):
        loss, g = grads_and_loss(cfg, params, batch, make_mesh(mc))
        assert loss == pytest.approx(ref_loss, rel=1e-6), mc
        for a, b in zip(jax.tree.leaves(ref_g), jax.tree.leaves(g)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def run_steps(cfg, batches, mesh):
    st = td.train_state(cfg, mesh)
    with jax.set_mesh(mesh):
        state = st.fresh(jax.random.key(cfg.train.seed))
        step = st.jit(partial(td.train_step, cfg=cfg, tx=st.tx))
        losses = []
        for b in batches:
            state, m = step(state, jax.device_put(b, NamedSharding(mesh, P(("data", "fsdp")))))
            losses.append(float(m["loss"]))
        return jax.device_get(state["params"]), losses


def grads_of_step(params, batch, cfg):
    """The gradient train_step applies (read off an SGD step of rate 1) and its loss."""
    tx = optax.sgd(1.0)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    new, m = td.train_step(state, batch, cfg=cfg, tx=tx)
    return jax.tree.map(jnp.subtract, params, new["params"]), m["loss"]


def test_gradient_accumulation_equals_one_big_batch():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    one, four = small_cfg(batch_size=16), small_cfg(batch_size=16, microbatches=4)
    params, batch = perturbed_params(one), tokens(one)
    with jax.set_mesh(mesh):
        params = jax.device_put(params, td.named(mesh, td.param_specs(SMALL)))
        batch = jax.device_put(batch, NamedSharding(mesh, P(("data", "fsdp"))))
        g1, l1 = jax.jit(partial(grads_of_step, cfg=one))(params, batch)
        g4, l4 = jax.jit(partial(grads_of_step, cfg=four))(params, batch)
    assert float(l4) == pytest.approx(float(l1), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g4)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_training_reduces_loss_on_a_repeated_batch():
    batch = tokens(small_cfg())
    _, losses = run_steps(small_cfg(), [batch] * 10, make_mesh(MeshConfig(fsdp=1),
                                                               jax.devices()[:1]))
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize("attention", ["blocked", "xla", "einsum"])
def test_causality(attention):
    model = dataclasses.replace(KNOBS, attention=attention)
    cfg = small_cfg(model)
    params, x = perturbed_params(cfg), tokens(cfg)[:, :-1]
    t = 9
    y = x.copy()
    y[:, t] = (y[:, t] + 1) % model.vocab_size
    a, b = td.forward(params, x, model), td.forward(params, y, model)
    np.testing.assert_array_equal(a[:, :t], b[:, :t])
    assert np.abs(a[:, t:] - b[:, t:]).max() > 1e-4   # and it does see the past


def test_einsum_attention_equals_xla_and_blocked():
    cfg = small_cfg(KNOBS)
    params, batch = perturbed_params(cfg), tokens(cfg)
    b = td.forward(params, batch[:, :-1], dataclasses.replace(KNOBS, attention="einsum"))
    for impl in ("xla", "blocked"):
        a = td.forward(params, batch[:, :-1], dataclasses.replace(KNOBS, attention=impl))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["fused", "remat"])
def test_chunked_loss_equals_full_logits_values_and_gradients(impl):
    """Both chunked cross-entropies against autodiff through the whole [B, T, V] logits."""
    cfg = small_cfg(KNOBS)
    params, batch = perturbed_params(cfg), tokens(cfg)
    z = 1e-2

    def plain(p):
        lg = td.forward(p, batch[:, :-1], KNOBS)
        lse = jax.nn.logsumexp(lg, -1)
        ce = lse - jnp.take_along_axis(lg, batch[:, 1:, None], -1)[..., 0]
        return jnp.mean(ce + z * lse ** 2), jnp.mean(ce)

    (ref_obj, ref_ce), ref_g = jax.value_and_grad(plain, has_aux=True)(params)
    for chunk in (4, 16):
        m = dataclasses.replace(KNOBS, loss_chunk=chunk, loss_impl=impl)
        (obj, aux), g = jax.value_and_grad(lambda p: td.loss_fn(p, batch, m, z_loss=z),
                                           has_aux=True)(params)
        ce = aux["ce"]
        assert float(obj) == pytest.approx(float(ref_obj), rel=1e-5)
        assert float(ce) == pytest.approx(float(ref_ce), rel=1e-5)
        for a, b in zip(jax.tree.leaves(ref_g), jax.tree.leaves(g)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("chunk,dw", [(16, "bf16"), (4, "f32")])
def test_one_loss_chunk_makes_dw_in_the_weights_dtype(chunk, dw):
    """One chunk: dW comes out of its matmul in the weight's dtype, so the devices' partial sums
    are reduced in it (bfloat16: half the bytes); several chunks add up in float32. Either way
    the gradient is float32's to bfloat16's precision."""
    cfg = small_cfg(dataclasses.replace(SMALL, dtype="bfloat16", loss_chunk=chunk))
    params, batch = perturbed_params(cfg), tokens(cfg)
    grad = lambda m: jax.grad(lambda p: td.loss_fn(p, batch, m)[0])(params)
    D, V = SMALL.d_model, SMALL.vocab_size
    assert re.findall(rf"(\w+)\[{D},{V}\] = dot_general", str(jax.make_jaxpr(
        lambda: grad(cfg.model))())) == [dw]
    want = grad(dataclasses.replace(cfg.model, dtype="float32"))["unembed"]
    got = grad(cfg.model)["unembed"]
    np.testing.assert_allclose(got, want, atol=0.02 * float(np.abs(want).max()))


@pytest.mark.parametrize("d_model,want", [(32, 32), (24, 32), (4, 8)])
def test_a_gathered_unembedding_takes_chunks_of_d_model_targets_a_device(d_model, want):
    """More targets than vocabulary: the unembedding is gathered whole on each device and each
    chunk adds a whole [D, V] to dW, so a chunk holds at least d_model targets a device (one
    row a device here: d_model positions), --model.loss-chunk (8) at the least, dividing T
    (64). The loss is still the full logits' one."""
    m = dataclasses.replace(SMALL, d_model=d_model, n_layers=3, vocab_size=128)
    cfg = small_cfg(m, batch_size=8, seq_len=64)
    params, batch = perturbed_params(cfg), tokens(cfg)
    lg = td.forward(params, batch[:, :-1], m)
    ref = jnp.mean(jax.nn.logsumexp(lg, -1)
                   - jnp.take_along_axis(lg, batch[:, 1:, None], -1)[..., 0])
    with jax.set_mesh(make_mesh(MeshConfig(fsdp=8))):
        loss = lambda p: td.loss_fn(p, batch, m)[0]
        scans = re.findall(r"length=(\d+)", str(jax.make_jaxpr(jax.grad(loss))(params)))
        assert float(jax.jit(loss)(params)) == pytest.approx(float(ref), rel=1e-5)
    assert set(map(int, scans)) == {3, 64 // want}, scans  # the layers', the chunks'


def test_grouped_query_attention_equals_repeated_kv_heads():
    """GQA with K kv heads == multi-head attention whose kv weights repeat each head N/K times."""
    cfg = small_cfg(SMALL)
    params = perturbed_params(cfg)
    mha = dataclasses.replace(SMALL, n_kv_heads=SMALL.n_heads)
    rep = lambda w: jnp.repeat(w, SMALL.n_heads // SMALL.n_kv_heads, axis=2)
    p2 = jax.tree.map(lambda x: x, params)
    p2["layers"] = dict(params["layers"], wk=rep(params["layers"]["wk"]),
                        wv=rep(params["layers"]["wv"]))
    x = tokens(cfg)[:, :-1]
    np.testing.assert_allclose(td.forward(params, x, SMALL), td.forward(p2, x, mha),
                               rtol=1e-5, atol=1e-5)


def test_llama31_rope_scaling():
    m = td.PRESETS["llama3.1-8b"][1].model
    plain = td.rope_inv_freq(dataclasses.replace(m, rope_scaling=0.0))
    scaled = td.rope_inv_freq(m)
    wavelen = 2 * np.pi / plain
    hi = wavelen < 8192 / 4
    lo = wavelen > 8192 / 1
    np.testing.assert_allclose(scaled[hi], plain[hi])          # short wavelengths untouched
    np.testing.assert_allclose(scaled[lo], plain[lo] / 8, rtol=1e-6)  # long ones slowed 8x
    mid = ~hi & ~lo
    assert mid.any() and np.all(scaled[mid] < plain[mid]) and np.all(scaled[mid] > plain[mid] / 8)


def test_flops_per_token_hand_count():
    m = td.ModelConfig(vocab_size=100, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1,
                       head_dim=4, d_ff=16)
    # per layer: wq 8*2*4=64, wk 8*1*4=32, wv 32, wo 2*4*8=64, gate/up/down 3*8*16=384 -> 576
    # matmul weights: 2*576 + unembed 8*100 = 1952; forward 2*1952 = 3904
    # attention, T=10: per layer 2 products * 2 FLOPs * 10 * 2 heads * 4 = 320; 2 layers = 640
    assert td.flops_per_token(m, 10) == 3 * (3904 + 640)


def test_schedule_warmup_and_end():
    t = td.TrainConfig(lr=1.0, warmup_steps=10, steps=100, min_lr_ratio=0.1)
    for name in ("cosine", "constant", "wsd"):
        s = td.make_schedule(dataclasses.replace(t, schedule=name))
        assert float(s(0)) == pytest.approx(0.1)       # step 0 already learns
        assert float(s(9)) == pytest.approx(1.0)
        end = float(s(99))
        assert end == pytest.approx(1.0 if name == "constant" else 0.1, abs=1e-2)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("mesh,train,model,flag", [
    (MeshConfig(fsdp=3, tensor=2), {}, {}, "--mesh.fsdp"),
    (MeshConfig(fsdp=-1, tensor=8), {}, {}, "--model.n-heads"),
    (MeshConfig(fsdp=-1, expert=2), {}, {}, "--mesh.expert"),
    (MeshConfig(fsdp=8), {"batch_size": 12}, {}, "--train.batch-size"),
    (MeshConfig(fsdp=8), {"batch_size": 8, "microbatches": 2}, {}, "--train.batch-size"),
    (MeshConfig(fsdp=8), {"seq_len": 128}, {}, "--train.seq-len"),
    (MeshConfig(fsdp=8), {}, {"n_kv_heads": 3}, "--model.n-heads"),
    (MeshConfig(fsdp=4, tensor=2), {}, {"vocab_size": 300, "vocab_split": True},
     "--model.vocab-split: --model.vocab-size 300 is not divisible by tensor x fsdp x context = 8"),
])
def test_bad_config_is_a_clear_error_before_compiling(mesh, train, model, flag):
    cfg = small_cfg(dataclasses.replace(SMALL, **model), mesh, **train)
    with pytest.raises((td.ConfigError, MeshError)) as e:
        td.validate(cfg, jax.device_count())
    assert flag in str(e.value)


@pytest.mark.parametrize("flags, match", [
    (["--model.post-norm", "--model.sandwich-norm"], "--model.post-norm with --model.sandwich"),
    (["--model.qk-norm-whole"], "--model.qk-norm-whole without --model.qk-norm"),
    (["--model.yarn-factor", "8", "--model.rope-scaling", "8"], "--model.yarn-factor with"),
    (["--model.yarn-factor", "8", "--model.rope-linear", "8"], "--model.yarn-factor with")])
def test_bad_olmo_flags(flags, match):
    with pytest.raises(td.ConfigError, match=match):
        td.validate(td.cli(["tiny", *flags]), 1)


def test_gpt3_175b_is_the_published_count_and_bad_gpt2_flags():
    assert td.count_params(td.PRESETS["gpt3-175b"][1].model) == 174_604_259_328
    with pytest.raises(td.ConfigError, match="--model.layer-norm with post"):
        td.validate(td.cli(["tiny-gpt3", "--model.sandwich-norm"]), 1)
    with pytest.raises(td.ConfigError, match="exceeds the model's maximum"):
        td.validate(td.cli(["tiny-gpt3", "--train.seq-len", "1024"]), 1)
    # GPT-3's knobs are gpt2's alone, which says neither grouped queries nor a head width
    assert td.config_to_hf(GPT2)["model_type"] == "gpt2"
    with pytest.raises(td.hf.HFError, match="does not fit this model.*'layer_norm': True"):
        td.config_to_hf(GPT2, "llama")
    for odd in (dict(n_kv_heads=2), dict(head_dim=16)):
        with pytest.raises(td.hf.HFError, match="'gpt2' does not fit"):
            td.config_to_hf(dataclasses.replace(GPT2, **odd), "gpt2")
    with pytest.raises(td.hf.HFError, match="'gpt2' does not fit.*'qk_norm': True"):
        td.config_to_hf(dataclasses.replace(GPT2, qk_norm=True), "gpt2")


def test_tiny_olmo3_windows_and_stretches_its_training_sequence():
    cfg = td.PRESETS["tiny-olmo3"][1]
    td.validate(cfg, 1)
    m = cfg.model
    assert 0 < m.sliding_window < cfg.train.seq_len == m.yarn_original_max_len
    assert m.post_norm and m.qk_norm_whole and m.global_every == 4


def test_unknown_preset_is_rejected(capsys):
    with pytest.raises(SystemExit) as e:
        td.cli(["llama9-1t"])
    assert e.value.code != 0
    assert "llama9-1t" in capsys.readouterr().err


def test_cli_overrides_any_field():
    cfg = td.cli(["qwen3-0.6b", "--model.n-layers", "3", "--mesh.tensor", "2"])
    assert cfg.model.n_layers == 3 and cfg.model.qk_norm and cfg.mesh.tensor == 2


def test_dry_run_reports_memory_without_allocating():
    cfg = td.Config(model=dataclasses.replace(td.PRESETS["qwen3-0.6b"][1].model, n_layers=2),
                    train=td.TrainConfig(batch_size=8, seq_len=512),
                    mesh=MeshConfig(fsdp=4, tensor=2), dry_run=True)
    report = td.main(cfg)
    assert report["devices"] == 8
    # f32 weights + two Adam moments, split 8 ways, are a floor for the arguments.
    assert report["argument_size"] >= 3 * 4 * report["params"] / 8 * 0.99
    assert report["per_device_bytes"] > report["argument_size"] - report["alias_size"]


@pytest.mark.parametrize("chips,torus,shape", [
    (4, True, (2, 2, 1)), (8, True, (2, 2, 2)), (64, True, (4, 4, 4)), (128, True, (4, 4, 8)),
    (1024, True, (8, 8, 16)), (1, False, (1, 1)), (8, False, (2, 4)), (256, False, (16, 16))])
def test_tpu_topology_shapes_are_cloud_tpus(chips, torus, shape):
    from common.mesh import tpu_topology_shape
    assert tpu_topology_shape(chips, torus) == shape


@pytest.mark.parametrize("shape,torus,wrap", [   # Cloud TPU's (MaxText's table agrees)
    ((2, 4, 4), True, (False,) * 3), ((4, 4, 4), True, (True,) * 3),      # v5p-64, v5p-128
    ((4, 4, 8), True, (True,) * 3), ((2, 4), False, (False,) * 3),        # v5p-256, v6e-8
    ((8, 16), False, (False, True, False)), ((16, 16), False, (True, True, False))])
def test_tpu_slices_wrap_around_where_cloud_tpus_do(shape, torus, wrap):
    from common.mesh import tpu_topology_wrap
    assert tpu_topology_wrap(shape, torus) == wrap


def _has_libtpu() -> bool:
    import importlib.util
    return importlib.util.find_spec("libtpu") is not None


@pytest.mark.parametrize("argv,flag", [
    (["tiny", "--compile-topology", "v5p-16"], "--dry-run"),          # cannot train on it
    (["tiny", "--dry-run", "--compile-topology", "v9x-8"], "v9x-8"),  # unknown generation
    (["tiny", "--dry-run", "--compile-topology", "v5p-12"], "v5p-12"),  # not a power of two
])
def test_compile_topology_bad_input_is_a_clear_error(argv, flag):
    with pytest.raises((td.ConfigError, MeshError)) as e:
        td.main(td.cli(argv))
    assert flag in str(e.value)


@pytest.mark.skipif(_has_libtpu(), reason="libtpu is installed here")
def test_compile_topology_without_libtpu_says_how_to_get_it():
    with pytest.raises(MeshError) as e:
        td.main(td.cli(["tiny", "--dry-run", "--compile-topology", "v5p-8"]))
    assert "--compile-topology v5p-8" in str(e.value) and "tpu" in str(e.value)


@pytest.mark.skipif(not _has_libtpu(), reason="ahead-of-time TPU compilation needs libtpu "
                    "(pip install -e '.[tpu]'): `make test-tpu`, a leg of .ci/run")
def test_compile_topology_compiles_for_a_tpu_slice():
    """The training step for a v5p-8 from this CPU host, with the TPU's splash attention, the
    compile target's and not the host's; at 2k tokens it takes less memory than the
    materialised softmax's [B, N, T, T] scores."""
    argv = ["tiny", "--dry-run", "--compile-topology", "v5p-8", "--mesh.fsdp", "-1",
            "--train.seq-len", "2048", "--model.dtype", "bfloat16", "--model.n-layers", "1"]
    report = td.main(td.cli(argv))
    assert report["devices"] == 4 and report["platform"] == "tpu"
    assert report["attention"] == "splash" and report["per_device_bytes"] > 0
    plain = td.main(td.cli(argv + ["--model.attention", "einsum"]))
    assert plain["attention"] == "einsum"
    assert report["per_device_bytes"] < 0.5 * plain["per_device_bytes"]


@pytest.mark.skipif(not _has_libtpu(), reason="needs libtpu (`make test-tpu`)")
def test_compile_topology_mesh_is_the_compile_target_on_a_cpu_host():
    from common.mesh import target_platform, tpu_topology_devices
    mesh = make_mesh(MeshConfig(fsdp=4), tpu_topology_devices("v5p-8", 1))
    seen = []
    with jax.set_mesh(mesh):
        jax.jit(lambda x: seen.append(target_platform()) or x).trace(
            jax.ShapeDtypeStruct((4,), jnp.float32))
    assert seen == ["tpu"] and jax.default_backend() == "cpu"


def test_a_long_sequence_dry_run_grows_linearly_in_the_sequence():
    """On the CPU `auto` is the blocked kernel, which never holds [T, T] scores: the whole
    step's temporaries grow ~linearly in T (the materialised softmax's ~4x per doubling)."""
    def temp(T, attention="auto"):
        report = td.main(td.cli(["tiny", "--dry-run", "--mesh.fsdp", "-1", "--train.batch-size",
                                 "8", "--train.seq-len", str(T), "--model.max-seq-len", str(T),
                                 "--model.n-layers", "1", "--model.attention", attention]))
        assert report["attention"] == ("blocked" if attention == "auto" else attention)
        return report["temp_size"]
    assert temp(4096) / temp(2048) < 2.4
    assert temp(4096, "einsum") / temp(2048, "einsum") > 3


def test_bench_parity_preset_matches_maxtexts_model():
    cfg = td.PRESETS["bench-parity"][1]
    assert td.count_params(cfg.model) == 20_580_608   # what MaxText prints for this model
    assert (cfg.train.batch_size, cfg.train.seq_len, cfg.model.dtype) == (8, 256, "float32")


@pytest.mark.parametrize("flags", [
    {"loss_impl": "remat"}, {"loss_chunk": 4}, {"remat": "none"}, {"remat": "dots"},
    {"attention": "einsum"}, {"scan_layers": False}])
def test_every_speed_flag_gives_the_default_loss_and_gradients(flags):
    cfg = small_cfg(KNOBS)
    params, batch = perturbed_params(cfg), tokens(cfg)
    grad = jax.jit(jax.value_and_grad(lambda p, m: td.loss_fn(p, batch, m)[0]),
                   static_argnums=1)
    ref, ref_g = grad(params, KNOBS)
    got, g = grad(params, dataclasses.replace(KNOBS, **flags))
    assert float(got) == pytest.approx(float(ref), rel=1e-6)
    for a, b in zip(jax.tree.leaves(ref_g), jax.tree.leaves(g)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_unrolled_layers_leave_no_loop_for_xlas_cost_analysis():
    """--model.no-scan-layers unrolls the chunked loss too: XLA's cost analysis counts a loop
    body once, and `make compile-tpu` reads it (bench/compile_tpu.py)."""
    argv = ["tiny", "--dry-run", "--mesh.fsdp", "-1", "--model.n-layers", "2",
            "--train.seq-len", "128", "--model.loss-chunk", "64", "--model.no-scan-layers"]
    assert td.main(td.cli(argv))["xla_while_loops"] == scatter_loops()  # scanned: +layers, loss
