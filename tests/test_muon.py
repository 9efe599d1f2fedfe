"""--train.optimizer muon: the Newton-Schulz step and the update against plain references,
which parameters get Muon, sharded == unsharded, resume, and the refusals."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import train_dense as td
import train_grpo as tg
import train_moe as tm
from common import train
from common.checkpoint import ConfigConflictError
from common.mesh import MeshConfig, make_mesh
from tests.test_dense import SMALL, KNOBS, perturbed_params, run_steps, small_cfg, tokens
from tests.test_train import config, data_path, metrics  # noqa: F401  (data_path: a fixture)

A, B, C = 3.4445, -4.775, 2.0315  # the quintic's coefficients (Jordan et al. 2024)


def newton_schulz(g, steps=5):
    """The plain iteration in float64: X <- aX + (b XX^T + c (XX^T)^2) X, on the wide side."""
    x = np.asarray(g, np.float64)
    wide = x.shape[0] <= x.shape[1]
    x = (x if wide else x.T) / (np.linalg.norm(x) + 1e-8)
    for _ in range(steps):
        m = x @ x.T
        x = A * x + (B * m + C * m @ m) @ x
    return x if wide else x.T


def optimizer(kind, lr=0.01, wd=0.1, dims=td.MUON_DIMS):
    return train.optimizer(kind, optax.constant_schedule(lr), b1=0.9, b2=0.95,
                           weight_decay=wd, clip_norm=1e9, decayed={"embed", "unembed"} | set(dims),
                           muon_dims=dims)


@pytest.mark.parametrize("shape", [(32, 48), (64, 16)])
def test_newton_schulz_orthogonalises_like_the_reference(shape):
    """One Muon update of a lone matrix, without weight decay, is -lr 0.2 sqrt(max) NS(g)."""
    g = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    tx = optimizer("muon", lr=1.0, wd=0.0, dims={"w": ((0,), (1,))})
    params = {"w": jnp.zeros(shape)}
    u, _ = tx.update({"w": jnp.asarray(g)}, tx.init(params), params)
    ns = -np.asarray(u["w"]) / (0.2 * np.sqrt(max(shape)))
    np.testing.assert_allclose(ns, newton_schulz(g), rtol=2e-4, atol=2e-5)
    s = np.linalg.svd(ns, compute_uv=False)
    assert 0.6 < s.min() and s.max() < 1.25  # the quintic's band around 1, not exactly 1


def test_bfloat16_runs_the_iteration_in_bfloat16():
    """--train.muon-dtype bfloat16: the momentum and the five steps in bfloat16, so the update
    is the float32 one to bfloat16's precision, not to float32's, and comes back float32."""
    g = np.random.default_rng(1).standard_normal((32, 48)).astype(np.float32)
    params = {"w": jnp.zeros(g.shape)}
    out = {}
    for dtype in ("float32", "bfloat16"):
        tx = train.optimizer("muon", optax.constant_schedule(1.0), b1=0.9, b2=0.95,
                             weight_decay=0.0, clip_norm=1e9, decayed={"w"},
                             muon_dims={"w": ((0,), (1,))}, muon_dtype=dtype)
        state = tx.init(params)
        u, state = tx.update({"w": jnp.asarray(g)}, state, params)
        assert u["w"].dtype == jnp.float32
        out[dtype] = np.asarray(u["w"])
    diff = np.abs(out["bfloat16"] - out["float32"]).max() / np.abs(out["float32"]).max()
    assert 1e-3 < diff < 0.15   # bfloat16 keeps 8 bits of mantissa; five steps compound it
    s = np.linalg.svd(out["bfloat16"] / (0.2 * np.sqrt(48)), compute_uv=False)
    assert 0.6 < s.min() and s.max() < 1.25  # still orthogonalised


def test_one_update_equals_the_formula_and_only_hidden_matrices_get_muon():
    """First step from zero momentum: -lr (0.2 sqrt(max(fan_in, fan_out)) NS(g) + wd p) on
    each matrix of each layer (Nesterov's (1 + beta) g is undone by NS's normalisation); every
    other parameter gets exactly the AdamW update."""
    params = perturbed_params(small_cfg(KNOBS))
    grads = jax.tree.map(lambda p: 0.01 * jnp.cos(jnp.arange(p.size).reshape(p.shape) + p),
                         params)
    lr, wd = 0.01, 0.1
    muon, adamw = optimizer("muon", lr, wd), optimizer("adamw", lr, wd)
    u_muon, _ = muon.update(grads, muon.init(params), params)
    u_adam, _ = adamw.update(grads, adamw.init(params), params)
    flat = jax.tree_util.tree_flatten_with_path(u_muon)[0]
    names = set()
    for path, u in flat:
        name = path[-1].key
        adam = dict(jax.tree_util.tree_flatten_with_path(u_adam)[0])[path]
        if name not in td.MUON_DIMS:  # embed, unembed, norms, biases
            np.testing.assert_array_equal(u, adam)
            continue
        names.add(name)
        ins_axes, out_axes = td.MUON_DIMS[name]
        g = np.asarray(dict(jax.tree_util.tree_flatten_with_path(grads)[0])[path])
        p = np.asarray(dict(jax.tree_util.tree_flatten_with_path(params)[0])[path])
        for layer in range(g.shape[0]):  # the stacked axis: separate matrices
            fan_in = int(np.prod([g.shape[a] for a in ins_axes]))
            m = g[layer].reshape(fan_in, -1)
            want = -lr * (0.2 * np.sqrt(max(m.shape)) * newton_schulz(m).reshape(g[layer].shape)
                          + wd * p[layer])
            np.testing.assert_allclose(np.asarray(u[layer]), want, rtol=2e-3, atol=2e-6)
    assert names == set(td.MUON_DIMS)
    assert not {"embed", "unembed", "final_norm", "attn_norm", "bq", "q_norm"} & names


def test_moe_muon_is_per_expert_and_leaves_the_router_to_adamw():
    cfg = tm.ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2,
                         head_dim=8, d_ff=12, n_experts=4, top_k=2)
    params = tm.init_params(cfg, jax.random.key(0))
    grads = jax.tree.map(lambda p: jnp.sin(jnp.arange(p.size).reshape(p.shape) * 0.37), params)
    tx = optimizer("muon", dims=tm.MUON_DIMS)
    u, _ = tx.update(grads, tx.init(params), params)
    ref = optimizer("adamw", dims=tm.MUON_DIMS)
    np.testing.assert_array_equal(u["layers"]["w_router"],
                                  ref.update(grads, ref.init(params), params)[0]["layers"]["w_router"])
    g = np.asarray(grads["layers"]["w_up"])[0, 1]  # layer 0, expert 1: its own matrix
    want = -0.01 * (0.2 * np.sqrt(max(g.shape)) * newton_schulz(g)
                    + 0.1 * np.asarray(params["layers"]["w_up"])[0, 1])
    np.testing.assert_allclose(np.asarray(u["layers"]["w_up"])[0, 1], want, rtol=2e-3,
                               atol=2e-6)


@pytest.mark.parametrize("mesh", [MeshConfig(fsdp=8), MeshConfig(fsdp=4, tensor=2)],
                         ids=["fsdp", "fsdp+tensor"])
def test_sharded_muon_steps_equal_unsharded(mesh):
    cfg = small_cfg(optimizer="muon", lr=1e-2)
    batches = [tokens(cfg)] * 4  # one batch again: the loss must fall
    ref, ref_losses = run_steps(cfg, batches, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    got, losses = run_steps(dataclasses.replace(cfg, mesh=mesh), batches, make_mesh(mesh))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert ref_losses[-1] < ref_losses[0]


def muon_config(run_dir, data_path, steps, **train_kw):
    c = config(run_dir, data_path, steps)
    return dataclasses.replace(c, train=dataclasses.replace(c.train, optimizer="muon", **train_kw))


def test_muon_resumes_bitwise_and_another_optimizer_is_refused(data_path, tmp_path):
    full = td.main(muon_config(tmp_path / "a", data_path, 6))
    td.main(muon_config(tmp_path / "b", data_path, 3))
    resumed = td.main(muon_config(tmp_path / "b", data_path, 6))
    for a, b in zip(jax.tree.leaves(jax.device_get(full["state"]["params"])),
                    jax.tree.leaves(jax.device_get(resumed["state"]["params"]))):
        np.testing.assert_array_equal(a, b)
    assert [m["loss"] for m in metrics(tmp_path / "a")] == [m["loss"] for m in
                                                            metrics(tmp_path / "b")]
    adamw = config(tmp_path / "b", data_path, 8)
    with pytest.raises(ConfigConflictError, match=r'train\.optimizer: "muon" \(saved\)(.|\n)*--init-from'):
        td.main(adamw)


def test_every_trainer_takes_the_flag():
    for mod, preset in ((td, "tiny"), (tm, "tiny-moe"), (tg, "tiny")):
        cfg = mod.cli([preset, "--" + ("grpo" if mod is tg else "train") + ".optimizer", "muon",
                       "--" + ("grpo" if mod is tg else "train") + ".muon-dtype", "bfloat16"])
        t = cfg.grpo if mod is tg else cfg.train
        assert (t.optimizer, t.muon_dtype) == ("muon", "bfloat16")
        st = mod.train_state(cfg, make_mesh(MeshConfig(fsdp=-1)), *(
            [tg.make_optimizer(cfg.grpo)] if mod is tg else []))
        mu = [x for x in jax.tree.leaves(st.abstract()["opt_state"]) if x.dtype == jnp.bfloat16]
        assert mu  # Muon's momentum, in the dtype asked for
