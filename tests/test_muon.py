"""--train.optimizer muon: the Newton-Schulz step and the update against plain references,
which parameters get Muon, sharded == unsharded, each device's share and its memory, resume,
and the refusals."""
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
import train_grpo as tg
import train_moe as tm
from common import optim, train
from common.checkpoint import ConfigConflictError
from common.mesh import MeshConfig, make_mesh
from tests import test_moe
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
    return optim.optimizer(kind, optax.constant_schedule(lr), b1=0.9, b2=0.95,
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
        tx = optim.optimizer("muon", optax.constant_schedule(1.0), b1=0.9, b2=0.95,
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
    present = {path[-1].key for path, _ in flat}   # Gemma 4's per-layer-input ones: not here
    assert names == set(td.MUON_DIMS) & present and {"wq", "wo", "w_down"} <= names
    assert not {"embed", "unembed", "final_norm", "attn_norm", "bq", "q_norm"} & names


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_steps_follow_optax_and_a_nonfinite_one_keeps_the_whole_state(kind):
    """common/train.py `update`: AdamW's moments are kept inside the optimiser
    (`scale_by_adam_kept`), so each step equals optax.adamw's, within float32 rounding (XLA
    fuses the two differently), over steps that clip and decay; a gradient with a NaN then
    leaves the parameters, the moments and every count exactly as they were."""
    params = perturbed_params(small_cfg(KNOBS))
    mask = lambda p: jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key in {"embed", "unembed"} | set(td.MUON_DIMS), p)
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        optax.linear_schedule(0.0, 0.01, 3), 0.9, 0.95, weight_decay=0.1, mask=mask))
    tx = optim.optimizer(kind, optax.linear_schedule(0.0, 0.01, 3), b1=0.9, b2=0.95,
                         weight_decay=0.1, clip_norm=1.0, decayed={"embed", "unembed"} | set(
                             td.MUON_DIMS), muon_dims=td.MUON_DIMS)
    step = jax.jit(lambda s, g: train.update(tx, g, s))
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    p_ref, s_ref = params, ref.init(params)
    for i in range(4):
        grads = jax.tree.map(lambda p: (i + 1) * jnp.cos(3 * p + i), params)  # norm > 1: clipped
        state, m = step(state, grads)
        u, s_ref = jax.jit(ref.update)(grads, s_ref, p_ref)
        p_ref = optax.apply_updates(p_ref, u)
        assert not bool(m["nonfinite"]) and float(m["grad_norm"]) > 1
        if kind == "adamw":
            for a, b in zip(jax.tree.leaves((state["params"], state["opt_state"])),
                            jax.tree.leaves((p_ref, s_ref))):
                np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
    after, m = step(state, bad)
    assert bool(m["nonfinite"]) and int(after["step"]) == 5
    for a, b in zip(jax.tree.leaves((after["params"], after["opt_state"])),
                    jax.tree.leaves((state["params"], state["opt_state"]))):
        np.testing.assert_array_equal(a, b)
    # Any other optax optimiser handed to `update` is kept by its selects, its Adam state too.
    s_ref = {"params": p_ref, "opt_state": s_ref, "step": jnp.zeros((), jnp.int32)}
    after = jax.jit(lambda s, g: train.update(ref, g, s))(s_ref, bad)[0]
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(s_ref | {"step": 1})):
        np.testing.assert_array_equal(a, b)


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
    """Two layers over 8 devices: each stack padded with 6 zero matrices, each device one
    matrix of it; over fsdp x tensor both matrix dimensions move onto the batch and back."""
    cfg = small_cfg(optimizer="muon", lr=1e-2)
    batches = [tokens(cfg)] * 4  # one batch again: the loss must fall
    ref, ref_losses = run_steps(cfg, batches, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    got, losses = run_steps(dataclasses.replace(cfg, mesh=mesh), batches, make_mesh(mesh))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert ref_losses[-1] < ref_losses[0]


def optax_muon(dims):
    """The optimiser's Muon before issue 33: optax's scale_by_muon on every matrix whole."""
    numbers = lambda tree: jax.tree_util.tree_map_with_path(
        lambda path, _: optax.contrib.MuonDimensionNumbers(*dims[path[-1].key]), tree)
    return optax.contrib.scale_by_muon(beta=0.95, ns_steps=5, weight_dimension_numbers=numbers)


def test_the_update_is_optax_scale_by_muon():
    """Ours (momentum, Nesterov, the iteration, its state) equals optax's over three steps, on
    wide and tall matrices, one of them zero (it stays zero, no NaN)."""
    dims = {"wq": ((1,), (2, 3)), "w_down": ((1,), (2,))}
    rng = np.random.default_rng(3)
    params = {"wq": jnp.zeros((2, 16, 4, 8)), "w_down": jnp.zeros((3, 40, 16))}
    ours, theirs = optim.scale_by_muon(dims, jnp.float32), optax_muon(dims)
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)  # checkpoints unchanged
    for _ in range(3):
        g = {k: jnp.asarray(rng.standard_normal(p.shape), jnp.float32) for k, p in params.items()}
        g["w_down"] = g["w_down"].at[1].set(0.0)
        u, s_ours = ours.update(g, s_ours, params)
        v, s_theirs = theirs.update(g, s_theirs, params)
        for a, b in zip(jax.tree.leaves((u, s_ours)), jax.tree.leaves((v, s_theirs))):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert np.all(np.asarray(u["w_down"][1]) == 0)


SHARES = {  # name: (shape, (input axes, output axes), the parameter's spec, mesh)
    # 5 layers over 8 devices: 3 zero matrices of padding; the matrix over fsdp and tensor
    "wq": ((5, 16, 4, 6), ((1,), (2, 3)), P(None, "fsdp", "tensor", None),
           MeshConfig(fsdp=4, tensor=2)),
    "wo": ((3, 4, 6, 16), ((1, 2), (3,)), P(None, "tensor", None, "fsdp"),
           MeshConfig(fsdp=4, tensor=2)),
    # layers x experts, the experts staying split: a device's 2 experts x 3 layers padded to 8
    # matrices over fsdp x tensor
    "experts": ((3, 4, 16, 12), ((2,), (3,)), P(None, "expert", "fsdp", "tensor"),
                MeshConfig(fsdp=2, expert=2, tensor=2)),
    # a replicated axis (data) takes its slice of the batch; a tall matrix
    "data": ((4, 4, 24, 8), ((2,), (3,)), P(None, "expert", "fsdp", None),
             MeshConfig(data=2, fsdp=2, expert=2)),
    "unknown": ((3, 16, 24), ((1,), (2,)), None, MeshConfig(fsdp=8)),  # whole, as XLA puts it
}


@pytest.mark.parametrize("name", sorted(SHARES))
def test_each_device_orthogonalises_its_share(name):
    """orthogonalise_stack under a mesh: every matrix of the stack, each device holding its
    share, equals the float64 iteration on that matrix (so the padding, the batch's order
    and the way back are right), a zero matrix stays zero, and the result comes back in the
    parameter's spec."""
    shape, (ins, outs), spec, mesh_cfg = SHARES[name]
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    x[1] = 0.0
    mesh = make_mesh(mesh_cfg)
    f = jax.jit(partial(optim.orthogonalise_stack, ins=ins, outs=outs,
                        coeffs=jnp.asarray(optim.NS_COEFFS), spec=spec))
    with jax.set_mesh(mesh):
        got = f(jax.device_put(x, NamedSharding(mesh, spec or P())))
    if spec is not None:
        assert got.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)
    batch = [a for a in range(x.ndim) if a not in ins + outs]
    m = x.transpose(batch + [*ins, *outs]).reshape(-1, np.prod([shape[a] for a in ins]),
                                                    np.prod([shape[a] for a in outs]))
    want = np.stack([newton_schulz(g) if g.any() else g for g in m])
    order = batch + [*ins, *outs]
    want = want.reshape([shape[a] for a in order]).transpose(np.argsort(order))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-4, atol=2e-5)
    assert np.all(np.asarray(got)[1] == 0)


def test_sharded_moe_muon_steps_equal_unsharded():
    """train_moe.py on expert 4 x fsdp 2 steps as on one device: the experts' [L, E] batches
    (a device's 2 experts x 3 MoE layers, over fsdp), the shared expert's 3 layers padded to 4,
    the dense first layer's stack of one padded to 2."""
    model = dataclasses.replace(test_moe.SMALL, n_layers=4, first_k_dense=1, dense_d_ff=24,
                                qk_norm=False, n_shared_experts=1)
    cfg = test_moe.small_cfg(model, optimizer="muon")
    batches, losses, params = [test_moe.tokens(cfg)] * 3, [], []
    for mesh_cfg in (MeshConfig(fsdp=1), MeshConfig(fsdp=2, expert=4)):
        mesh = make_mesh(mesh_cfg, jax.devices()[:mesh_cfg.fsdp * mesh_cfg.expert])
        c = dataclasses.replace(cfg, mesh=mesh_cfg)
        st = tm.train_state(c, mesh)
        with jax.set_mesh(mesh):
            state = st.fresh(jax.random.key(0))
            step = st.jit(partial(tm.train_step, cfg=c, tx=st.tx))
            losses.append([])
            for b in batches:
                state, m = step(state, jax.device_put(b, NamedSharding(mesh, P(tm.MOE_BATCH))))
                losses[-1].append(float(m["loss"]))
        params.append(jax.device_get(state["params"]))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    test_moe.assert_trees_close(params[1], params[0])
    assert losses[0][-1] < losses[0][0]


def test_the_update_holds_a_share_of_the_matrices_not_all():
    """Compiled on 8 devices (fsdp 8), Muon's update of two stacks of 32 matrices needs a
    fraction of the temporary memory that optax's whole-matrix update needs (4.25 MiB against
    44 MiB on JAX 0.10.2 and 0.12; 8 MiB a stack): each device iterates on 4 matrices of each
    stack, not on all 32."""
    mesh = make_mesh(MeshConfig(fsdp=8))
    dims = {"w_up": ((1,), (2,)), "w_down": ((1,), (2,))}
    specs = {"w_up": P(None, "fsdp", None), "w_down": P(None, None, "fsdp")}
    params = {k: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, specs[k]))
              for k, shape in (("w_up", (32, 128, 512)), ("w_down", (32, 512, 128)))}
    temp = []
    for tx in (optim.scale_by_muon(dims, jnp.float32, specs), optax_muon(dims)):
        with jax.set_mesh(mesh):
            c = jax.jit(tx.update).lower(params, jax.eval_shape(tx.init, params)).compile()
        temp.append(c.memory_analysis().temp_size_in_bytes)
    assert temp[0] < 0.25 * temp[1], temp


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
