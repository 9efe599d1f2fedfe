"""Pipeline stages (--mesh.stage, issue 35): a pipelined step is the one-device step, in
train_dense.py and in train_moe.py (experts split over `expert` or `fsdp` inside each stage,
the router's statistics each microbatch's as accumulation makes them, DeepSeek's dense first
layer before the pipeline and its MTP module after it). GPipe and the circular schedule give
the same losses and gradients step after step; a pipelined run's checkpoint (the unpipelined
[L, ...] stacks) goes on unchanged on one device and on another stage count; launches the
pipeline cannot run are refused naming their flags."""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import train_dense as td
import train_moe as tm
from common.checkpoint import CheckpointConfig, Checkpointer
from common.mesh import MeshConfig, make_mesh

MODEL = td.ModelConfig(vocab_size=128, d_model=32, n_layers=8, n_heads=4, n_kv_heads=2,
                       head_dim=8, d_ff=64, max_seq_len=16, loss_chunk=8)
# DeepSeek-V3's placement at its smallest: a dense first layer (before the pipeline), 4 MoE
# layers (2 stages x 2 repeats of 1), a shared expert, biased sigmoid routing, an MTP module;
# QK-clip on (its maxima, each microbatch's, cross the pipeline as the routing's do), low
# enough to act on the small logits of the first steps.
MOE = tm.ModelConfig(vocab_size=128, d_model=32, n_layers=5, n_heads=4, n_kv_heads=2,
                     head_dim=8, n_experts=4, top_k=2, d_ff=32, first_k_dense=1, dense_d_ff=64,
                     n_shared_experts=1, sigmoid_routing=True, mtp_depth=1, max_seq_len=16,
                     loss_chunk=8)
MOE_TRAIN = dict(microbatches=4, qk_clip_threshold=1e-3)
ROWS = {td: 12, tm: 16}  # the MoE's microbatches of 4 rows split over expert (or fsdp) 2


def config(mesh=MeshConfig(fsdp=1), optimizer="adamw", model=MODEL, mod=td, **train):
    t = dict(batch_size=ROWS[mod], seq_len=8, warmup_steps=1, steps=8, lr=1e-2, microbatches=6,
             optimizer=optimizer)
    return mod.Config(model=model, train=mod.TrainConfig(**(t | train)), mesh=mesh)


def batches(n, seed=0, mod=td):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, MODEL.vocab_size, (ROWS[mod], 9), dtype=np.int32) for _ in range(n)]


def mesh_of(mc: MeshConfig):
    n = mc.stage * mc.fsdp * mc.data * mc.expert * mc.tensor
    return make_mesh(mc, jax.devices()[:n])


def rows(mesh, mod):  # the batch's sharding
    return NamedSharding(mesh, P(tm.MOE_BATCH if mod is tm else ("data", "fsdp")))


def sgd_steps(cfg, mesh, n=3, mod=td):
    """Each step's metrics and gradient, n steps of SGD at rate 1 on (an optimiser whose state
    is the last gradient, exactly)."""
    st = mod.train_state(cfg, mesh)
    tx = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                      lambda g, s, p=None: (jax.tree.map(jnp.negative, g), g))

    def step(params, batch):
        state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
        new, m = mod.train_step(state, batch, cfg=cfg, tx=tx)
        return new["params"], new["opt_state"], m
    with jax.set_mesh(mesh):
        params = jax.device_put(mod.init_params(cfg.model, jax.random.key(1)),
                                st.shardings["params"])
        step = jax.jit(step, out_shardings=(st.shardings["params"], None, None))
        out = []
        for b in batches(n, mod=mod):
            params, g, m = step(params, jax.device_put(b, rows(mesh, mod)))
            out.append((jax.device_get(m), jax.device_get(g)))
        return out


def same_steps(want, got):
    for (want_m, want_g), (m, g) in zip(want, got):
        for k in ("loss", "aux_loss", "router_z", "load_min", "load_max", "mtp_loss",
                  "max_attn_logit"):
            if k in want_m:  # the routing figures: each microbatch's, as unpipelined
                np.testing.assert_allclose(m[k], want_m[k], rtol=1e-6, err_msg=k)
        # Each weight's gradient to 1e-5 of its largest entry: the microbatches sum in another
        # order, and an entry that nearly cancels (1.3e-3 of a 5.7e-3 leaf) moved 2.3e-7 on an
        # AMD EPYC; a stage that dropped or repeated a microbatch moves entries by their size.
        for a, b in zip(jax.tree.leaves(want_g), jax.tree.leaves(g)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * np.abs(a).max())


@pytest.fixture(scope="module")
def one_device():
    return sgd_steps(config(), mesh_of(MeshConfig(fsdp=1)))


@pytest.mark.parametrize("mesh, repeats, microbatches", [
    (MeshConfig(stage=2, fsdp=2), 1, 2),   # GPipe, as many microbatches as stages
    (MeshConfig(stage=4, fsdp=2), 2, 6),   # circular: 2 chunks of one layer on each stage, and
], ids=["gpipe-2x2", "circular-4x2"])    # microbatches waiting for stage 0 between rounds
def test_a_pipelined_step_is_the_one_device_step(one_device, mesh, repeats, microbatches):
    same_steps(one_device, sgd_steps(config(mesh, microbatches=microbatches,
                                            pipeline_repeats=repeats), mesh_of(mesh)))


@pytest.fixture(scope="module")
def moe_one_device():
    want = sgd_steps(config(model=MOE, mod=tm, **MOE_TRAIN), mesh_of(MeshConfig(fsdp=1)), mod=tm)
    assert want[0][0]["max_attn_logit"] > MOE_TRAIN["qk_clip_threshold"]  # the clip acts
    return want


@pytest.mark.parametrize("mesh, repeats, impl", [
    (MeshConfig(stage=2, tensor=2, expert=2, fsdp=1), 1, "tiled"),  # GPipe; experts, heads split
    (MeshConfig(stage=2, fsdp=2), 2, "tiled"),  # circular, the weights split in each stage
    (MeshConfig(stage=2, tensor=2, expert=2, fsdp=1), 1, "megablox"),  # the TPU's, interpreted
], ids=["gpipe-2x-tensor2-expert2", "circular-2x-fsdp2", "gpipe-megablox"])
def test_a_pipelined_moe_step_is_the_one_device_step(moe_one_device, mesh, repeats, impl):
    """The same 4 microbatches: the aux losses, router z and loads are nonlinear in the batch, so
    they match only if each layer's come from each microbatch as accumulation takes them (and
    QK-clip's maxima, if each is the largest over them)."""
    model = dataclasses.replace(MOE, grouped_matmul=impl)
    same_steps(moe_one_device, sgd_steps(config(mesh, model=model, mod=tm, **MOE_TRAIN,
                                                pipeline_repeats=repeats), mesh_of(mesh), mod=tm))


def train(cfg, mesh, state, steps, save=None, mod=td):
    """Optimiser steps of the real train_step from `state` (None: fresh), each on its step's
    batch; with `save` (a folder) the state after the first is saved there: (state, losses)."""
    st = mod.train_state(cfg, mesh)
    with jax.set_mesh(mesh):
        state = st.fresh(jax.random.key(0)) if state is None else state
        step, losses = st.jit(partial(mod.train_step, cfg=cfg, tx=st.tx)), []
        for i in steps:
            state, m = step(state, jax.device_put(batches(i + 1, mod=mod)[i], rows(mesh, mod)))
            losses.append(float(m["loss"]))
            if save and i == steps[0]:
                with Checkpointer(save, CheckpointConfig(async_save=False)) as ckpt:
                    ckpt.save(i + 1, state, force=True)
    return state, losses


def test_a_pipelined_checkpoint_goes_on_on_one_device_and_on_other_stages(tmp_path):
    """A circular run on 2 stages saves its first step; restored onto one device and onto 4
    GPipe stages, the next two steps are the pipelined run's own. Muon: its iteration on each
    layer's matrices while the stacks are split over stage (AdamW's update, elementwise, cannot
    tell; test_a_pipelined_step_is_the_one_device_step holds its gradients)."""
    goes_on(config(MeshConfig(stage=2, fsdp=2), "muon", pipeline_repeats=2), tmp_path,
            [MeshConfig(fsdp=1), MeshConfig(stage=4, fsdp=2)], td, MODEL.n_layers)


def goes_on(piped, tmp_path, meshes, mod, n_layers):
    """`piped` runs 3 steps, saving the first; restored onto each of `meshes` (one repeat), it
    runs steps 2 and 3 as `piped` did."""
    want, want_losses = train(piped, mesh_of(piped.mesh), None, range(3), str(tmp_path), mod)
    for mc in meshes:
        cfg = dataclasses.replace(piped, mesh=mc, train=dataclasses.replace(
            piped.train, pipeline_repeats=1))
        mesh = mesh_of(mc)
        with Checkpointer(str(tmp_path), CheckpointConfig(async_save=False)) as ckpt:
            restored = ckpt.restore(1, mod.train_state(cfg, mesh).abstract())
        assert restored["params"]["layers"]["wq"].shape[0] == n_layers  # saved unpipelined
        got, losses = train(cfg, mesh, restored, range(1, 3), mod=mod)
        np.testing.assert_allclose(losses, want_losses[1:], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(jax.device_get(want)),
                        jax.tree.leaves(jax.device_get(got))):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_a_pipelined_moe_checkpoint_goes_on_on_one_device(tmp_path):
    """A circular MoE run (2 stages, experts over expert 2, Muon) saves its first step; on one
    device the next two steps are its own, the router biases moved by each step's loads."""
    goes_on(config(MeshConfig(stage=2, expert=2), "muon", MOE, tm, **MOE_TRAIN,
                   pipeline_repeats=2, router_bias_rate=1e-3), tmp_path, [MeshConfig(fsdp=1)],
            tm, tm.moe_layers(MOE))


@pytest.mark.parametrize("mesh, train_kw, model_kw, flags", [
    (MeshConfig(stage=4, fsdp=2), dict(microbatches=2), {}, ["--train.microbatches 2",
                                                            "--mesh.stage 4"]),
    (MeshConfig(stage=4, fsdp=2), dict(pipeline_repeats=3), {}, [
        "--model.n-layers 8", "--mesh.stage 4", "--train.pipeline-repeats 3"]),
    (MeshConfig(stage=2, fsdp=2), {}, dict(n_layers=6, ple_dim=4), ["--mesh.stage 2",
                                                                     "--model.ple-dim"]),
    (MeshConfig(stage=2, context=2, fsdp=2), {}, {}, ["--mesh.stage 2", "--mesh.context"]),
])
def test_what_the_pipeline_cannot_run_is_refused_naming_the_flags(mesh, train_kw, model_kw,
                                                                  flags):
    cfg = config(mesh, model=dataclasses.replace(MODEL, **model_kw), **train_kw)
    with pytest.raises(td.ConfigError) as e:
        td.validate(cfg, mesh.stage * mesh.fsdp * mesh.context)
    for flag in flags:
        assert flag in str(e.value), str(e.value)


@pytest.mark.parametrize("args, flags", [
    (["tiny-moe"], ["--train.microbatches 1", "--mesh.stage 2"]),
    (["tiny-deepseek", "--train.microbatches", "2"], [  # 3 MoE layers after the dense one
        "--model.n-layers 4 less --model.first-k-dense 1", "--mesh.stage 2"]),
    (["tiny-qwen35", "--train.microbatches", "2"], ["--mesh.stage 2", "--model.linear-k-heads"]),
    (["tiny-llama4", "--train.microbatches", "2"], ["--mesh.stage 2", "--model.moe-every 2"]),
    (["tiny-moe", "--train.microbatches", "2", "--lora.rank", "4"], ["--lora.rank"]),
    (["tiny-moe", "--train.microbatches", "2", "--model.grouped-matmul", "ragged_dot"], [
        "--model.grouped-matmul ragged_dot", "--model.capacity-factor"]),
])
def test_what_the_moe_pipeline_cannot_run_is_refused_naming_the_flags(args, flags):
    cfg = tm.cli([*args, "--mesh.stage", "2", "--mesh.fsdp", "4"])
    with pytest.raises(td.ConfigError) as e:
        tm.validate(cfg, 8)
    for flag in flags:
        assert flag in str(e.value), str(e.value)


def test_grpo_refuses_stages():
    """train_grpo.py does not pipeline: there a stage axis would repeat the work unseen."""
    import train_grpo as tg
    cfg = tg.cli(["tiny", "--mesh.stage", "2", "--mesh.fsdp", "4"])
    with pytest.raises(td.ConfigError, match="--mesh.stage 2: pipeline stages are train_dense.py's and train_moe"):
        tg.validate(cfg, 8, None)
