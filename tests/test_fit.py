"""Fitting a model on one chip (issue 71): remat policies that keep what is cheap to keep, an
`auto` that picks the most that fits, Adam's moments and the master weights in bfloat16, and
the optimiser state in host memory."""
import contextlib
import dataclasses
import io
import math
import os
import re
import sysconfig
from types import SimpleNamespace
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import train_dense as td
import train_moe as tm
from common import optim, train
from common.checkpoint import CheckpointConfig
from common.data import DataConfig, prepare
from common.mesh import MeshConfig, make_mesh

DENSE = td.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=8, d_ff=64, max_seq_len=32, loss_chunk=8, qk_norm=True)
MOE = tm.ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                     n_experts=4, top_k=2, d_ff=16, max_seq_len=32, loss_chunk=8,
                     grouped_matmul="tiled", gmm_tile=8)
POLICIES = ("qkv", "attn", "proj", "offload", "dots", "none")


@pytest.mark.parametrize("mod,model", [(td, DENSE), (tm, MOE)], ids=["dense", "moe"])
def test_every_remat_policy_gives_fulls_loss_and_gradients(mod, model):
    """A policy only chooses what the backward pass keeps: the same numbers as `full` within
    float32 rounding (recomputed and kept values may fuse differently)."""
    params = mod.init_params(model, jax.random.key(0))
    tok = jax.random.randint(jax.random.key(1), (2, 17), 0, model.vocab_size)

    def loss_and_grad(remat):
        cfg = dataclasses.replace(model, remat=remat)
        ce = lambda p: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
            mod.forward(p, tok[:, :-1], cfg), tok[:, 1:]))
        return jax.jit(jax.value_and_grad(ce))(params)

    ref_loss, ref_grad = loss_and_grad("full")
    for remat in POLICIES:
        loss, grad = loss_and_grad(remat)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, err_msg=remat)
        for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grad),
                                jax.tree.leaves(ref_grad)):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-7,
                                       err_msg=f"{remat} {jax.tree_util.keystr(path)}")


def test_remat_policies_keep_what_they_name():
    """The named tensors are what a policy saves: `proj` keeps more than `attn`, than `qkv`,
    than `full`, whose residuals are the layers' inputs only."""
    params = td.init_params(DENSE, jax.random.key(0))
    tok = jnp.zeros((2, 16), jnp.int32)
    kept = {}
    for remat in ("full", "qkv", "attn", "proj"):
        cfg = dataclasses.replace(DENSE, remat=remat)
        with contextlib.redirect_stdout(io.StringIO()) as out:
            jax.ad_checkpoint.print_saved_residuals(lambda p: td.forward(p, tok, cfg).sum(), params)
        kept[remat] = sum(math.prod(map(int, m.split(","))) for m in re.findall(
            r"\[([\d,]+)\] output of scan", out.getvalue()))
    L, B, T, D, N, K, H, F = 2, 2, 16, 32, 4, 2, 8, 64
    assert kept["qkv"] - kept["full"] == L * B * T * (N + 2 * K) * H
    assert kept["attn"] - kept["qkv"] == L * B * T * N * H
    # o and the MLP's two inputs; its output joins the stream unnormed, which no gradient reads
    assert kept["proj"] - kept["attn"] == L * B * T * (D + 2 * F), kept


def test_auto_remat_picks_the_most_kept_policy_that_fits(capsys):
    """Given the device's limit, `auto` takes the first of REMAT_ORDER whose compiled step fits
    (XLA refusing one larger than the device counts as not fitting), the same every time; below
    them all `full`; with no limit stated (the CPU), `none`. The steps here are stand-ins that
    report each policy's bytes, as a compiled step's memory analysis does."""
    needs = dict(zip(train.REMAT_ORDER, (900, 700, 650, 400, 300, 200)))

    class Step:  # step_for(policy).lower(state, batch).compile().memory_analysis()
        def __init__(self, remat):
            self.lower = lambda *a: self
            self.compile = lambda: self
            self.remat = remat

        def memory_analysis(self):
            if self.remat == "none":
                raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
            return SimpleNamespace(
                argument_size_in_bytes=100, output_size_in_bytes=100, alias_size_in_bytes=100,
                temp_size_in_bytes=needs[self.remat] - 100)

    mesh = make_mesh(MeshConfig())
    for limit, want in ((10**6, "proj"), (700, "proj"), (699, "dots"), (500, "attn"),
                        (300, "qkv"), (250, "full"), (100, "full")):
        with mock.patch.object(train, "memory_limit", lambda device: limit):
            assert train.auto_remat(Step, None, None, mesh) == want, limit
    assert "no policy fits; full" in capsys.readouterr().out
    assert train.auto_remat(Step, None, None, mesh) == "none"  # the CPU states no limit
    assert "cpu devices state no memory limit: none" in capsys.readouterr().out


def test_auto_remat_in_the_trainer(monkeypatch):
    """--model.remat auto compiles the real step under each policy before training: with room
    for all, the first, `none`; the dry run reports the step it chose."""
    cfg = td.Config(model=dataclasses.replace(DENSE, remat="auto"),
                    train=td.TrainConfig(batch_size=8, seq_len=16), dry_run=True)
    monkeypatch.setattr(train, "memory_limit", lambda device: 2**40)
    assert td.main(cfg)["remat"] == "none"


def test_bfloat16_moments_update_as_optax_does():
    """--train.mu-dtype bfloat16 is optax.scale_by_adam(mu_dtype=bfloat16), the update read back
    from the rounded moment (ours) instead of the unrounded one (optax's): equal within its
    rounding (2^-8 of it, and half that through nu's square root); float32: optax's exactly."""
    shapes = {"a": (64, 32), "b": (32,)}
    params = {k: jnp.zeros(s) for k, s in shapes.items()}
    grads = [{k: jax.random.normal(jax.random.key(i * 7 + len(s)), s) * 10.0 ** -(i % 3)
              for k, s in shapes.items()} for i in range(5)]
    for mu, nu in (("float32", "float32"), ("bfloat16", "float32"), ("bfloat16", "bfloat16")):
        ours = optim.scale_by_adam_kept(0.9, 0.95, mu_dtype=mu, nu_dtype=nu)
        ref = optax.scale_by_adam(0.9, 0.95, mu_dtype=jnp.dtype(mu))
        s, r = ours.init(params), ref.init(params)
        r = r._replace(nu=optax.tree.cast(r.nu, nu))  # optax keeps nu in its state's dtype
        assert jax.tree.leaves(s.mu)[0].dtype == jnp.dtype(mu)
        assert jax.tree.leaves(s.nu)[0].dtype == jnp.dtype(nu)
        for g in grads:
            (u, s), (ur, r) = ours.update(g, s), ref.update(g, r)
            tol = 0 if mu == nu == "float32" else 2 ** -7  # bfloat16's rounding, relative
            for k in shapes:
                np.testing.assert_allclose(u[k], ur[k], rtol=tol, atol=tol * 1e-3,
                                           err_msg=f"{mu} {nu} {k}")
                assert u[k].dtype == jnp.float32
            np.testing.assert_allclose(s.mu["a"].astype(jnp.float32), r.mu["a"].astype(
                jnp.float32), rtol=tol)


def adam_state(state):
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    return next(x for x in jax.tree.leaves(state["opt_state"], is_leaf=is_adam) if is_adam(x))


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, f) for f in ("argparse.py", "textwrap.py", "string.py")]
    return prepare(files, str(tmp_path_factory.mktemp("d") / "prepared"), vocab_size=400)


def test_bfloat16_state_and_host_offload_save_restore_and_resume(data_path, tmp_path):
    """Master matrices and moments in bfloat16 (norm gains float32), the optimiser state in host
    memory: the checkpoint holds those dtypes, restores them, and a resumed run equals an
    uninterrupted one bit for bit."""
    def config(run_dir, steps):
        return td.Config(model=dataclasses.replace(DENSE, vocab_size=512), train=td.TrainConfig(
            steps=steps, batch_size=8, seq_len=16, warmup_steps=1, schedule="constant",
            log_every=1, eval_every=100,
            eval_batches=1, sample_tokens=0, weight_dtype="bfloat16", mu_dtype="bfloat16",
            nu_dtype="bfloat16", offload_opt_state=True),
            data=DataConfig(path=data_path), checkpoint=CheckpointConfig(every=2),
            run_dir=str(tmp_path / run_dir))

    full = td.main(config("a", 4))["state"]
    td.main(config("b", 2))
    resumed = td.main(config("b", 4))
    assert resumed["start_step"] == 2
    for a, b in zip(jax.tree.leaves(jax.device_get(full)),
                    jax.tree.leaves(jax.device_get(resumed["state"]))):
        np.testing.assert_array_equal(a, b)
    p, adam = full["params"], adam_state(full)
    assert p["layers"]["wq"].dtype == p["embed"].dtype == jnp.bfloat16
    assert p["layers"]["attn_norm"].dtype == p["final_norm"].dtype == jnp.float32
    assert adam.mu["layers"]["wq"].dtype == adam.nu["layers"]["wq"].dtype == jnp.bfloat16
    assert adam.mu["layers"]["wq"].sharding.memory_kind == "pinned_host"
    mesh = make_mesh(MeshConfig())
    with jax.set_mesh(mesh):  # the checkpoint itself holds those dtypes
        cfg = config("b", 4)
        st = td.train_state(cfg, mesh)
        with train.Checkpointer(cfg.run_dir, cfg.checkpoint) as ckpt:
            state = ckpt.restore(4, st.abstract())
    assert state["params"]["layers"]["w_up"].dtype == jnp.bfloat16
    assert adam_state(state).nu["embed"].dtype == jnp.bfloat16


def test_grpo_names_its_policy():
    """train_grpo.py shares the dense ModelConfig, `auto` included, but picks no policy."""
    import train_grpo as tg
    cfg = tg.cli(["tiny", "--model.remat", "auto"])
    with pytest.raises(tg.ConfigError, match="--model.remat auto"):
        tg.validate(cfg, jax.device_count(), tg.CharTokenizer())
