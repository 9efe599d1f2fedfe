"""Quantized training (--model.quant, docs/quant.md): the rounding within each format's bound,
the quantized matmul and its gradients against a reference written with explicit casts, a
quantized step sharded as on one device, the f32 checkpoint it saves, the layers that refuse it,
and on a chip the integer units' numbers equal to the CPU's."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import train_dense as td
import train_grpo as tg
import train_moe as tm
from common.mesh import MeshConfig, make_mesh
from tests.test_dense import (SMALL, _has_libtpu, grads_and_loss, perturbed_params, small_cfg,
                              tokens)

RNG = np.random.default_rng(0)
# Rows of very different sizes: per-channel scales must follow each one.
X = (RNG.standard_normal((6, 5, 32)) * np.exp(RNG.uniform(-4, 4, (6, 5, 1)))).astype(np.float32)
W = (RNG.standard_normal((32, 24)) * 0.02).astype(np.float32)
G = RNG.standard_normal((6, 5, 24)).astype(np.float32)


@pytest.mark.parametrize("fmt,rel,tiny", [("int8", 0.0, 0.5), ("e4m3", 2.0 ** -4, 2.0 ** -10),
                                          ("e5m2", 2.0 ** -3, 2.0 ** -17)])
def test_quantize_dequantize_error_within_the_formats_bound(fmt, rel, tiny):
    """int8: half a step of scale (max |x| / 127) per channel; fp8: half an ulp, 2^-(m+1) of
    |x| for m mantissa bits, or half the smallest subnormal step, times the tensor's scale."""
    axes = (2,) if fmt == "int8" else None
    q, s = td.quantize(jnp.asarray(X), fmt, axes)
    err = np.abs(np.asarray(q, np.float32) * np.asarray(s) - X)
    bound = np.maximum(rel * np.abs(X), tiny * np.asarray(s)) * (1 + 1e-6)
    assert np.all(err <= bound) and np.max(err / bound) > 0.3  # the bound is also nearly met
    assert np.max(np.abs(np.asarray(q, np.float32))) == td.QUANT[fmt][1]  # the range is used
    assert q.dtype == td.QUANT[fmt][0]


def _int8(x, axes):
    s = np.max(np.abs(x), axis=axes, keepdims=True) / np.float32(127)
    return np.clip(np.round(x / s), -127, 127).astype(np.int8), s.astype(np.float32)


def _fp8(x, dt, top):
    s = np.float32(np.max(np.abs(x)) / np.float32(top))
    return (x / s).astype(dt), s


def test_int8_matmul_and_its_gradients_equal_explicit_casts():
    """y = (q_x q_w in int32) s_x s_w, per token and per output channel; dx and dw likewise,
    each operand quantized along the contraction of its own product."""
    y, vjp = jax.vjp(lambda x, w: td.qdot("btd,df->btf", "int8", x, w), X, W)
    dx, dw = vjp(jnp.asarray(G))
    i32 = lambda a: a.astype(np.int32)
    (qx, sx), (qw, sw) = _int8(X, 2), _int8(W, 0)
    np.testing.assert_allclose(y, (i32(qx) @ i32(qw)).astype(np.float32) * (sx * sw), rtol=1e-6)
    (qg, sg), (qw, sw) = _int8(G, 2), _int8(W, 1)                    # dx = g w^T over f
    ref = np.einsum("btf,df->btd", i32(qg), i32(qw)).astype(np.float32) * (sg * sw[None, :, 0])
    np.testing.assert_allclose(dx, ref, rtol=1e-6)
    (qx, sx), (qg, sg) = _int8(X, (0, 1)), _int8(G, (0, 1))          # dw = x^T g over b, t
    ref = np.einsum("btd,btf->df", i32(qx), i32(qg)).astype(np.float32) * (sx[0, 0][:, None] * sg[0])
    np.testing.assert_allclose(dw, ref, rtol=1e-6)


def test_fp8_matmul_is_e4m3_forward_and_e5m2_gradients():
    e4, e5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    f32 = lambda a: a.astype(np.float32)
    y, vjp = jax.vjp(lambda x, w: td.qdot("btd,df->btf", "fp8", x, w), X, W)
    dx, dw = vjp(jnp.asarray(G))
    (qx, sx), (qw, sw), (qg, sg) = _fp8(X, e4, 448), _fp8(W, e4, 448), _fp8(G, e5, 57344)
    np.testing.assert_allclose(y, f32(qx) @ f32(qw) * (sx * sw), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dx, f32(qg) @ f32(qw).T * (sg * sw), rtol=1e-5, atol=1e-7)
    ref = np.einsum("btd,btf->df", f32(qx), f32(qg)) * (sx * sg)
    np.testing.assert_allclose(dw, ref, rtol=1e-5, atol=1e-7)


def test_the_moe_trainers_copy_and_its_float_kernel_fallback_give_qdots_numbers():
    """The experts' matmuls (megablox takes no int8) run on `floats`' rounded values: in f32,
    `qdot`'s forward; its gradients round w and x along the forward's axes: close to qdot's."""
    x, w = jnp.asarray(X.reshape(30, 32)), jnp.asarray(W)[None]
    cfg = tm.ModelConfig(quant="int8")
    q = lambda x, w: tm.qdot("md,df->mf", "int8", x, w[0])
    f = lambda x, w: tm.floats(lambda x, w: x @ w[0], cfg)(x, w)
    (yq, vq), (yf, vf) = jax.vjp(q, x, w), jax.vjp(f, x, w)
    g = jnp.asarray(G.reshape(30, 24))
    np.testing.assert_allclose(yf, yq, rtol=1e-5, atol=1e-6)
    (dxq, dwq), (dxf, dwf) = vq(g), vf(g)
    np.testing.assert_allclose(dxf, dxq, rtol=0.05, atol=0.02 * np.max(np.abs(dxq)))
    assert np.linalg.norm(dwf - dwq) < 0.05 * np.linalg.norm(dwq)


@pytest.mark.parametrize("quant", ["int8", "fp8"])
def test_a_quantized_step_on_fsdp_x_tensor_equals_one_device(quant):
    """Scales are maxima (exact under any split) and int8 sums are exact: the sharded step's
    loss and gradients are the one device's, up to float reassociation elsewhere (which may
    move a value across a rounding boundary: a loose tolerance on the gradients)."""
    cfg = small_cfg(dataclasses.replace(SMALL, quant=quant))
    params, batch = perturbed_params(cfg), tokens(cfg)
    ref_loss, ref_g = grads_and_loss(cfg, params, batch, make_mesh(MeshConfig(fsdp=1),
                                                                   jax.devices()[:1]))
    loss, g = grads_and_loss(cfg, params, batch, make_mesh(MeshConfig(fsdp=4, tensor=2)))
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for a, b in zip(jax.tree.leaves(ref_g), jax.tree.leaves(g)):
        # 1.9e-3 on JAX 0.12 (one weight), under 1e-3 on 0.10: a value rounded to the next int8
        # step moves its gradient by 1/127 of its row's largest; a wrong scale would move O(1).
        assert np.linalg.norm(a - b) <= 5e-3 * np.linalg.norm(a) + 1e-7
    unquantized = grads_and_loss(small_cfg(), params, batch, make_mesh(MeshConfig(fsdp=1),
                                                                       jax.devices()[:1]))[0]
    assert loss != unquantized and loss == pytest.approx(unquantized, rel=0.02)


def test_moe_quantized_step_sharded_equals_one_device():
    """The experts too (rounded around the CPU's tiled grouped matmul), over expert x fsdp.
    (With --mesh.tensor the experts' F is split inside shard_map, and the scales of the products
    contracting it are per shard of F: tiles, not the one device's channels.)"""
    from tests import test_moe as t
    cfg = t.small_cfg(dataclasses.replace(t.SMALL, quant="int8"))
    params, batch = t.perturbed_params(cfg.model), t.tokens(cfg)
    one = t.loss_and_grads(cfg, params, batch, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    two = t.loss_and_grads(cfg, params, batch, make_mesh(MeshConfig(data=2, fsdp=2, expert=2)))
    assert two[0] == pytest.approx(one[0], rel=1e-5)
    for a, b in zip(jax.tree.leaves(one[2]), jax.tree.leaves(two[2])):
        assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(a) + 1e-7


def test_a_run_saved_quantized_resumes_without_and_exports_float32(tmp_path):
    """The checkpoint holds the f32 master weights whatever the matmuls ran in; quant is a
    compute choice: the run resumes without it, and exports float32 tensors."""
    from safetensors.numpy import load_file
    run = str(tmp_path / "run")
    flags = ["tiny", "--run-dir", run, "--model.d-model", "32", "--model.n-layers", "1",
             "--model.head-dim", "8", "--model.d-ff", "64", "--train.batch-size", "8",
             "--train.seq-len", "32", "--train.eval-every", "2", "--train.eval-batches", "1",
             "--train.sample-tokens", "0", "--checkpoint.every", "2", "--quiet"]
    first = td.main(td.cli(flags + ["--train.steps", "2", "--model.quant", "int8"]))
    assert first["final_step"] == 2
    saved = jax.device_get(first["state"]["params"])
    assert all(a.dtype == np.float32 for a in jax.tree.leaves(saved))
    later = td.main(td.cli(flags + ["--train.steps", "4"]))   # resumed, quant none
    assert later["final_step"] == 4 and later["start_step"] == 2
    files = td.export_hf(run, str(tmp_path / "hf"), step=2)
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert files and all(t.dtype == np.float32 for t in tensors.values())
    _, params = td.load_hf(str(tmp_path / "hf"))
    for a, b in zip(jax.tree.leaves(jax.device_get(params)), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("module,model,match", [
    (td, SMALL, "Gated DeltaNet"),
    (tm, tm.ModelConfig(n_experts=4, top_k=2, global_every=2, linear_k_heads=2,
                        linear_v_heads=2), "Gated DeltaNet"),
    (tg, SMALL, "train_dense.py's and train_moe.py's")])
def test_quant_is_refused_where_a_layer_kind_cannot_take_it(module, model, match):
    model = dataclasses.replace(model, quant="int8", **(
        {"global_every": 2, "linear_k_heads": 2, "linear_v_heads": 2} if module is td else {}))
    cfg = small_cfg(model) if module is td else module.Config(model=model)
    with pytest.raises(module.ConfigError) as e:
        module.validate(cfg, 1, *((None,) if module is tg else ()))
    assert "--model.quant int8" in str(e.value) and match in str(e.value)


@pytest.mark.skipif(not _has_libtpu(), reason="needs libtpu (`make test-tpu`)")
def test_int8_compiles_to_integer_dots_for_a_tpu_slice():
    """Compiled for a TPU v5e here, a quantized step's projections are s8 x s8 -> s32
    products (XLA:TPU writes dots as convolutions): the integer units, not bf16."""
    import re
    from functools import partial

    from jax.sharding import NamedSharding, PartitionSpec as P

    from common.mesh import tpu_topology_devices
    cfg = dataclasses.replace(SMALL, dtype="bfloat16", quant="int8", d_model=256, d_ff=512)
    mesh = make_mesh(MeshConfig(fsdp=1), tpu_topology_devices("v5e-1"))
    shapes = jax.eval_shape(partial(td._init, cfg), jax.random.key(0))
    with jax.set_mesh(mesh):
        p = jax.tree.map(lambda s, sp: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=(
            NamedSharding(mesh, sp))), shapes, td.param_specs(cfg))
        b = jax.ShapeDtypeStruct((2, 65), jnp.int32, sharding=NamedSharding(mesh, P()))
        hlo = jax.jit(jax.grad(lambda p, b: td.loss_fn(p, b, cfg)[0])).lower(p, b).compile()
    lines = hlo.as_text().splitlines()
    kind = {m[1]: m[2] for x in lines if (m := re.match(r"\s*(?:ROOT )?%(\S+) = (\w+)\[", x))}
    ops = [m.groups() for x in lines if (m := re.search(
        r"= s32\[.*? (?:convolution|dot)\(%([^,]+), %([^,)]+)\)", x))]
    assert len(ops) >= 2 * 7 and all(kind[a] == kind[b] == "s8" for a, b in ops)


@pytest.mark.chip
@pytest.mark.skipif(jax.default_backend() == "cpu", reason="needs an accelerator (make test-chip)")
def test_int8_on_the_chip_equals_the_cpu():
    """The integer units' int32 sums are exact: the chip's quantized matmul and gradients are
    the CPU's up to f32 rounding of the scales; a quantized tiny model's loss close to it."""
    cpu = jax.devices("cpu")[0]
    f = jax.jit(lambda x, w, g: jax.vjp(lambda x, w: td.qdot("btd,df->btf", "int8", x, w),
                                        x, w)[1](g))
    run = lambda d: jax.device_get(f(*jax.device_put((X, W, G), d)))
    for a, b in zip(run(jax.devices()[0]), run(cpu)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.max(np.abs(b)))
    cfg = small_cfg(dataclasses.replace(SMALL, quant="int8"))
    params, batch = perturbed_params(cfg), tokens(cfg)
    loss = lambda d: float(jax.jit(lambda p, b: td.loss_fn(p, b, cfg.model)[0])(
        *jax.device_put((params, batch), d)))
    with jax.default_matmul_precision("highest"):
        assert loss(jax.devices()[0]) == pytest.approx(loss(cpu), rel=1e-3)
