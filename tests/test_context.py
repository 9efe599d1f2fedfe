"""Context parallelism (--mesh.context): the sequence split over devices equals one device.

The kernels against `reference` on random q/k/v (every knob, both strategies, both layouts,
tiles small enough that the causal and window skipping is exercised), then the trainers' loss
and gradients on context meshes against one device, the order a user sees restored, and the
refusals."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_dense as td
import train_moe as tm
from common import attention as A
from common.mesh import MeshConfig, make_mesh
from tests import test_dense as dense
from tests import test_moe as moe
from tests.test_deepseek import DS
from tests.test_gptoss import GPT, gpt_params
from tests.test_train import config, data_path, metrics  # noqa: F401  (data_path: a fixture)

B, T, N, K, H = 2, 32, 4, 2, 8
RNG = np.random.default_rng(0)
Q, KK, V = (jnp.asarray(RNG.normal(size=(B, T, n, H)), jnp.float32) for n in (N, K, K))
SINKS = jnp.asarray(RNG.normal(size=(N,)), jnp.float32)
SEG = jnp.asarray([[0] * 13 + [1] * 19, [0] * 5 + [1] * 20 + [2] * 7], jnp.int32)
KNOBS = {"causal": {}, "window": dict(window=5), "cap+sinks": dict(cap=2.0, sinks=True),
         "segments+window": dict(segments=True, window=9), "bidirectional": dict(causal=False)}


def _attention(fn, knobs, order):
    """fn's output in sequence order and a weighted sum of it to differentiate, on inputs in
    `order` (the context shards'), every output element weighted differently."""
    def f(q, k, v, sinks):
        kw = {k: v for k, v in knobs.items() if k not in ("sinks", "segments")}
        o = fn(q[:, order], k[:, order], v[:, order], scale=0.3, sinks_N=sinks if knobs.get(
            "sinks") else None, segment_ids=SEG[:, order] if knobs.get("segments") else None, **kw)
        o = o[:, np.argsort(order)]
        return jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape))), o
    return jax.jit(jax.value_and_grad(f, (0, 1, 2, 3), has_aux=True))


@pytest.mark.parametrize("knobs", KNOBS.values(), ids=KNOBS.keys())
@pytest.mark.parametrize("strategy", A.CONTEXT_IMPLS)
def test_context_attention_equals_the_reference(strategy, knobs):
    # Ulysses splits the heads over context: 8 query heads over 2 key/value heads, repeated
    # until 4 context shards (x 2 tensor) divide them
    q, sinks = (Q, SINKS) if strategy != "ulysses" else (
        jnp.concatenate([Q, Q[:, ::-1]], 2), jnp.concatenate([SINKS, -SINKS]))
    (_, want), g_want = _attention(A.reference, knobs, np.arange(T))(q, KK, V, sinks)
    for mc, balanced, block in [(MeshConfig(fsdp=2, context=2, tensor=2), True, 512),
                                (MeshConfig(fsdp=2, context=4), True, 2),
                                (MeshConfig(context=4, tensor=2), False, 3)]:
        fn = lambda *a, **kw: A.context_attention(*a, strategy=strategy, balanced=balanced,
                                                  block=block, **kw)
        with jax.set_mesh(make_mesh(mc)):
            (_, got), g_got = _attention(fn, knobs, A.context_order(T, mc.context, balanced))(
                q, KK, V, sinks)
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=str(mc))
        for a, b in zip(g_got, g_want):
            np.testing.assert_allclose(a, b, atol=5e-6, err_msg=str(mc))


def test_the_balanced_layout_gives_each_shard_an_early_and_a_late_chunk():
    order = A.context_order(16, 4)
    assert order.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                           [6, 7, 8, 9]]
    # Causal work per shard: the keys its queries may read, all equal.
    assert len({int(np.sum(s + 1)) for s in order.reshape(4, 4)}) == 1
    with jax.set_mesh(make_mesh(MeshConfig(fsdp=2, context=4))):
        for T in (16, 13):   # 13: padded to 16 at the end, the padding dropped on the way back
            x = jnp.arange(2 * T).reshape(2, T)
            assert A.to_context(x)[0].shape == (2, 16)
            assert (A.from_context(A.to_context(x)[0], T) == x).all()


def dense_cfg(model, impl):
    return dense.small_cfg(dataclasses.replace(model, context_attention=impl))


@functools.cache
def dense_one_device(model):
    """(params, batch, loss, gradients) of `model` on one device, where there is no context to
    split and so no context strategy: one reference for the three strategies' tests, computed
    once a file rather than once each. Host arrays: nothing of JAX's is kept past the file."""
    cfg = dense.small_cfg(model)
    params, batch = jax.device_get(dense.perturbed_params(cfg)), dense.tokens(cfg)
    one = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    return (params, batch, *dense.grads_and_loss(cfg, params, batch, one))


@pytest.mark.parametrize("impl", A.CONTEXT_IMPLS)
@pytest.mark.parametrize("model", [dense.SMALL, dense.GEMMA2, dense.GPT2],
                         ids=["llama", "gemma2", "gpt2"])
def test_dense_context_equals_one_device(model, impl):
    """Causal, GQA, a sliding window (Gemma 2: 5 of 16 tokens, soft-caps) on context 2 with fsdp
    and with tensor, and context 4; GPT-2's learned positions in the reordered sequence."""
    cfg = dense_cfg(model, impl)
    params, batch, ref_loss, ref_g = dense_one_device(model)
    for mc in (MeshConfig(fsdp=4, context=2), MeshConfig(fsdp=2, context=2, tensor=2),
               MeshConfig(fsdp=2, context=4)):
        loss, g = dense.grads_and_loss(cfg, params, batch, make_mesh(mc))
        assert loss == pytest.approx(ref_loss, rel=1e-6), mc
        for a, b in zip(jax.tree.leaves(ref_g), jax.tree.leaves(g)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(mc))


def test_dense_packed_rows_and_logits_in_the_users_order():
    """SFT's packed rows (segment ids, positions restarting per example) split over context,
    and `forward`'s logits in sequence order, each equal to one device's."""
    cfg = dense_cfg(dense.KNOBS, "ring")
    params = dense.perturbed_params(cfg)
    rng = np.random.default_rng(5)
    seg = np.sort(rng.integers(0, 3, (8, 16)), axis=1).astype(np.int32)
    pos = np.concatenate([np.arange(16)[None] - np.argmax(seg[:, None] == seg[:, :, None],
                                                          axis=2)], 0).astype(np.int32)
    toks = rng.integers(0, 256, (8, 16), dtype=np.int32)
    batch = {"inputs": toks, "targets": np.roll(toks, -1, 1), "segment_ids": seg,
             "positions": pos, "weights": (rng.random((8, 16)) > 0.3).astype(np.float32)}
    loss = jax.jit(jax.value_and_grad(lambda p, b: td.loss_fn(p, b, cfg.model)[0]))
    logits = jax.jit(lambda p, b: td.forward(p, b["inputs"], cfg.model,
                                             segment_ids=b["segment_ids"],
                                             positions=b["positions"]))
    out = {}
    for name, mesh in [("one", make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])),
                       ("context", make_mesh(MeshConfig(fsdp=2, context=4)))]:
        with jax.set_mesh(mesh):
            out[name] = jax.device_get((loss(params, batch), logits(params, batch)))
    (l1, g1), z1 = out["one"]
    (l2, g2), z2 = out["context"]
    assert float(l2) == pytest.approx(float(l1), rel=1e-6)
    np.testing.assert_allclose(z2, z1, atol=2e-5)
    moe.assert_trees_close(g1, g2)


@pytest.mark.parametrize("name,model,params", [
    ("mixtral", moe.SMALL, lambda m: moe.perturbed_params(m)),
    ("deepseek-mla", dataclasses.replace(DS, context_attention="ring"),
     lambda m: moe.perturbed_params(m)),
    ("gpt-oss-sinks-window", GPT, gpt_params),
    ("gpt-oss-ulysses", dataclasses.replace(GPT, context_attention="ulysses"), gpt_params)],
    ids=lambda x: x if isinstance(x, str) else "")
def test_moe_context_equals_one_device(name, model, params):
    cfg = moe.small_cfg(model, load_balance_loss=0.1, router_z_loss=0.01)
    p, batch = params(model), moe.tokens(cfg)
    want = moe.loss_and_grads(cfg, p, batch, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    for mc in (MeshConfig(fsdp=2, context=2, expert=2), MeshConfig(fsdp=2, context=4)):
        got = moe.loss_and_grads(cfg, p, batch, make_mesh(mc))
        assert got[0] == pytest.approx(want[0], rel=1e-5), mc
        moe.assert_trees_close(got[2], want[2], rtol=2e-4, atol=2e-6)


def test_ulysses_runs_splash_on_the_whole_sequence():
    """Ulysses with the TPU's kernel (interpreted here): splash over the gathered sequence, 8
    query heads over 2 key/value heads on 4 context shards x fsdp 2, causal, a window, packed
    segments, == the reference in values and gradients."""
    T2, rng = 256, np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.normal(size=(2, T2, n, 8)), jnp.float32) for n in (8, 2, 2))
    seg = jnp.asarray(np.repeat([[0, 1], [0, 2]], [100, 156], axis=1), jnp.int32)
    mc, order = MeshConfig(fsdp=2, context=4), A.context_order(T2, 4)
    for kw in ({}, {"window": 40}):
        def loss(fn, order, q, k, v):
            o = fn(q[:, order], k[:, order], v[:, order], scale=0.3, segment_ids=seg[:, order],
                   **kw)[:, np.argsort(order)]
            return jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape))), o
        grad = lambda fn, order: jax.jit(jax.value_and_grad(
            lambda *a: loss(fn, order, *a), (0, 1, 2), has_aux=True))(q, k, v)
        want = grad(A.reference, np.arange(T2))
        with jax.set_mesh(make_mesh(mc)):
            got = grad(lambda *a, **kw: A.context_attention(*a, strategy="ulysses", impl="splash",
                                                            **kw), order)
        np.testing.assert_allclose(got[0][1], want[0][1], atol=2e-5, err_msg=str(kw))
        for a, b in zip(got[1], want[1]):
            np.testing.assert_allclose(a, b, atol=5e-5, err_msg=str(kw))


@pytest.mark.parametrize("argv,flags", [
    (["--mesh.context", "4", "--train.seq-len", "36"], ["--train.seq-len 36", "--mesh.context 4"]),

    (["--mesh.context", "2", "--train.qk-clip-threshold", "50"],
     ["--train.qk-clip-threshold", "--mesh.context 2"]),
])
def test_a_sequence_the_context_cannot_split_is_refused_naming_both_flags(argv, flags):
    cfg = td.cli(["tiny", "--mesh.fsdp", "1", *argv])
    with pytest.raises(td.ConfigError) as e:
        td.validate(cfg, int(argv[1]))
    assert all(f in str(e.value) for f in flags), str(e.value)


def test_ulysses_refuses_heads_the_context_cannot_split():
    cfg = td.cli(["tiny", "--mesh.fsdp", "1", "--mesh.context", "8",   # 4 heads over 2
                  "--model.context-attention", "ulysses"])
    with pytest.raises(td.ConfigError, match="--model.context-attention ulysses over --mesh."
                                             "context 8.*--model.n-heads"):
        td.validate(cfg, 8)
    td.validate(dataclasses.replace(cfg, mesh=MeshConfig(fsdp=1, context=2, tensor=2)), 4)


def test_moe_refuses_chunked_local_attention_on_a_split_sequence():
    cfg = tm.cli(["tiny-llama4", "--mesh.fsdp", "1", "--mesh.context", "2"])
    with pytest.raises(tm.ConfigError, match="--model.attn-chunk"):
        tm.validate(cfg, 2)


def test_a_run_resumed_onto_another_context_size_follows_the_uninterrupted_one(data_path,
                                                                              tmp_path):
    """The user's loop (data, eval, checkpoints, the closing sample) with the sequence split:
    3 steps over context 2, resumed for 3 more over context 4, against 6 steps on one sequence
    per device. Equal within float tolerance, not bitwise: the split reorders the sums of the
    attention and the loss."""
    data = data_path
    whole = td.main(config(tmp_path / "a", data, steps=6))
    td.main(config(tmp_path / "b", data, steps=3, mesh=MeshConfig(fsdp=4, context=2)))
    split = td.main(config(tmp_path / "b", data, steps=6, mesh=MeshConfig(fsdp=2, context=4)))
    la, lb = ([m["loss"] for m in metrics(tmp_path / r)] for r in "ab")
    np.testing.assert_allclose(lb, la, rtol=2e-4)
    for a, b in zip(jax.tree.leaves(jax.device_get(whole["state"]["params"])),
                    jax.tree.leaves(jax.device_get(split["state"]["params"]))):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-5)


def test_muon_on_a_context_mesh_equals_one_device():
    """Muon's matrices arrive split over fsdp and context (common/train.py table_specs) and
    are orthogonalised in shares: three steps equal one device's."""
    cfg = dataclasses.replace(dense.small_cfg(dense.SMALL, optimizer="muon"))
    batch, out = dense.tokens(cfg), []
    for mc in (MeshConfig(fsdp=1), MeshConfig(fsdp=2, context=2, tensor=2)):
        mesh = make_mesh(mc, jax.devices()[:1] if mc.context == 1 else None)
        c = dataclasses.replace(cfg, mesh=mc)
        out.append(dense.run_steps(c, [batch] * 3, mesh)[0])
    moe.assert_trees_close(out[1], out[0], rtol=1e-4, atol=2e-6)
