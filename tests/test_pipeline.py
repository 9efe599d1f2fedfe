"""Pipeline stages (--mesh.stage, issue 35): a pipelined step is the one-device step. GPipe
and the circular schedule give the same losses and gradients step after step; a pipelined
run's checkpoint (the unpipelined [L, ...] stacks) goes on unchanged on one device and on
another stage count; launches the pipeline cannot run are refused naming their flags."""
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
from common.checkpoint import CheckpointConfig, Checkpointer
from common.mesh import MeshConfig, make_mesh

MODEL = td.ModelConfig(vocab_size=128, d_model=32, n_layers=8, n_heads=4, n_kv_heads=2,
                       head_dim=8, d_ff=64, max_seq_len=16, loss_chunk=8)


def config(mesh=MeshConfig(fsdp=1), optimizer="adamw", model=MODEL, **train):
    t = dict(batch_size=12, seq_len=8, warmup_steps=1, steps=8, lr=1e-2, microbatches=6,
             optimizer=optimizer)
    return td.Config(model=model, train=td.TrainConfig(**(t | train)), mesh=mesh)


def batches(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, MODEL.vocab_size, (12, 9), dtype=np.int32) for _ in range(n)]


def mesh_of(mc: MeshConfig):
    n = mc.stage * mc.fsdp * mc.data
    return make_mesh(mc, jax.devices()[:n])


def sgd_steps(cfg, mesh, n=3):
    """Each step's loss and gradient, n steps of SGD at rate 1 on (an optimiser whose state is
    the last gradient, exactly)."""
    st = td.train_state(cfg, mesh)
    tx = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                      lambda g, s, p=None: (jax.tree.map(jnp.negative, g), g))

    def step(params, batch):
        state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
        new, m = td.train_step(state, batch, cfg=cfg, tx=tx)
        return new["params"], new["opt_state"], m["loss"]
    with jax.set_mesh(mesh):
        params = jax.device_put(td.init_params(MODEL, jax.random.key(1)), st.shardings["params"])
        step = jax.jit(step, out_shardings=(st.shardings["params"], None, None))
        out = []
        for b in batches(n):
            batch = jax.device_put(b, NamedSharding(mesh, P(("data", "fsdp"))))
            params, g, loss = step(params, batch)
            out.append((float(loss), jax.device_get(g)))
        return out


@pytest.fixture(scope="module")
def one_device():
    return sgd_steps(config(), mesh_of(MeshConfig(fsdp=1)))


@pytest.mark.parametrize("mesh, repeats, microbatches", [
    (MeshConfig(stage=2, fsdp=2), 1, 2),   # GPipe, as many microbatches as stages
    (MeshConfig(stage=4, fsdp=2), 2, 6),   # circular: 2 chunks of one layer on each stage, and
], ids=["gpipe-2x2", "circular-4x2"])    # microbatches waiting for stage 0 between rounds
def test_a_pipelined_step_is_the_one_device_step(one_device, mesh, repeats, microbatches):
    got = sgd_steps(config(mesh, microbatches=microbatches, pipeline_repeats=repeats),
                    mesh_of(mesh))
    for (want_loss, want_g), (loss, g) in zip(one_device, got):
        assert loss == pytest.approx(want_loss, rel=1e-6)
        for a, b in zip(jax.tree.leaves(want_g), jax.tree.leaves(g)):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def train(cfg, mesh, state, steps, save=None):
    """Optimiser steps of the real train_step from `state` (None: fresh), each on its step's
    batch; with `save` (a folder) the state after the first is saved there: (state, losses)."""
    st = td.train_state(cfg, mesh)
    with jax.set_mesh(mesh):
        state = st.fresh(jax.random.key(0)) if state is None else state
        step, losses = st.jit(partial(td.train_step, cfg=cfg, tx=st.tx)), []
        for i in steps:
            state, m = step(state, jax.device_put(batches(i + 1)[i], NamedSharding(
                mesh, P(("data", "fsdp")))))
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
    piped = config(MeshConfig(stage=2, fsdp=2), "muon", pipeline_repeats=2)
    want, want_losses = train(piped, mesh_of(piped.mesh), None, range(3), save=str(tmp_path))
    for mc, repeats in ((MeshConfig(fsdp=1), 1), (MeshConfig(stage=4, fsdp=2), 1)):
        cfg = dataclasses.replace(piped, mesh=mc, train=dataclasses.replace(
            piped.train, pipeline_repeats=repeats))
        mesh = mesh_of(mc)
        with Checkpointer(str(tmp_path), CheckpointConfig(async_save=False)) as ckpt:
            restored = ckpt.restore(1, td.train_state(cfg, mesh).abstract())
        assert restored["params"]["layers"]["wq"].shape[0] == MODEL.n_layers  # saved unpipelined
        got, losses = train(cfg, mesh, restored, range(1, 3))
        np.testing.assert_allclose(losses, want_losses[1:], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(jax.device_get(want["params"])),
                        jax.tree.leaves(jax.device_get(got["params"]))):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


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


@pytest.mark.parametrize("trainer", ["train_moe", "train_grpo"])
def test_the_other_trainers_refuse_stages(trainer):
    """Only train_dense.py pipelines: elsewhere a stage axis would repeat the work unseen."""
    mod = __import__(trainer)
    cfg = mod.cli(["tiny-moe" if trainer == "train_moe" else "tiny", "--mesh.stage", "2",
                   "--mesh.fsdp", "4"])
    args = (cfg, 8) if trainer == "train_moe" else (cfg, 8, None)
    with pytest.raises(td.ConfigError, match="--mesh.stage 2: pipeline stages are train_dense"):
        mod.validate(*args)
