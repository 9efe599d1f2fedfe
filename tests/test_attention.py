"""common/attention.py: `reference` against a float64 formula written here (every knob, each
seen to matter), `blocked` against `reference` in values and in gradients for q, k, v and the
sinks (each knob alone, then all at once), in bfloat16, and its compiled backward's
temporaries growing linearly in T where the plain softmax's grow as T^2."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from common import attention as A


def qkv(T=32, N=4, K=2, H=8, V=8, B=2, seed=0, shift=0.0):
    """Random q, k, v; `shift` added to every q and k entry makes all logits large alike
    (about shift^2 H scale), so a soft-cap bites while the softmax stays soft."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H), np.float32) + shift
    k = rng.standard_normal((B, T, K, H), np.float32) + shift
    v = rng.standard_normal((B, T, K, V), np.float32)
    return q, k, v


def packed(T, lengths=((10, 12), (5, 20))):
    """Segment ids [2, T]: three examples per row, the last one taking what is left."""
    return np.stack([np.repeat([0, 1, 2], [a, b, T - a - b]) for a, b in lengths]).astype(
        np.int32)


def naive(q, k, v, *, scale, causal=True, window=0, cap=0.0, sinks=None, seg=None):
    """Attention in float64 numpy, written apart from `reference`: each query head's own copy
    of its key head, the mask from tril/triu, the sink a column of the exponentials."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, N, _ = q.shape
    G = N // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    logits = np.einsum("bqnh,bknh->bnqk", q, k) * scale
    if cap:
        logits = cap * np.tanh(logits / cap)
    ones = np.ones((T, T), bool)
    mask = (np.tril(ones) if causal else ones) & (np.triu(ones, 1 - window) if window else ones)
    mask = np.broadcast_to(mask, (B, 1, T, T))
    if seg is not None:
        mask = mask & (np.asarray(seg)[:, None, :, None] == np.asarray(seg)[:, None, None, :])
    e = np.exp(logits - logits.max(-1, keepdims=True)) * mask
    den = e.sum(-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(np.asarray(sinks, np.float64)[None, :, None, None]
                           - logits.max(-1, keepdims=True))
    return np.einsum("bnqk,bknv->bqnv", e / den, v)


def test_reference_equals_a_plain_formula_and_every_knob_matters():
    q, k, v = qkv(T=24, H=8, V=6, seed=1)
    # The causal GQA case, the softmax written inline as a third opinion.
    got = jax.jit(partial(A.reference, scale=0.35))(q, k, v)
    s = np.einsum("btkgh,bskh->bkgts", q.reshape(2, 24, 2, 2, 8).astype(np.float64), k) * 0.35
    s = np.where(np.tril(np.ones((24, 24), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bkgts,bskv->btkgv", p / p.sum(-1, keepdims=True), v).reshape(2, 24, 4, 6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, naive(q, k, v, scale=0.35), rtol=1e-5, atol=1e-6)

    q, k, v = qkv(T=24, H=8, V=6, seed=2, shift=1.5)   # logits near 20: cap 10 bites
    kw = dict(scale=0.35, window=7, cap=10.0, sinks=np.array([3.0, -1.0, 0.5, 2.0], np.float32),
              seg=packed(24, ((9, 8), (4, 11))))
    want = naive(q, k, v, **kw)
    got = jax.jit(partial(A.reference, scale=0.35, window=7, cap=10.0))(
        q, k, v, sinks_N=kw["sinks"], segment_ids=kw["seg"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    off = dict(causal=False, window=0, cap=0.0, sinks=None, seg=None)
    for name, value in off.items():   # each knob moves the output by far more than the tolerance
        assert np.abs(naive(q, k, v, **{**kw, name: value}) - want).max() > 1e-2, name


def test_reference_kv_prefix_and_rows_with_nothing_allowed():
    """S > T: the queries are the last T positions, as in the self-attention over all S.
    S < T: the first T - S queries see no key, output 0, and every gradient stays finite."""
    q, k, v = qkv(T=20, seed=3)
    ref = jax.jit(partial(A.reference, scale=0.3, window=6))
    np.testing.assert_allclose(ref(q[:, 13:], k, v), ref(q, k, v)[:, 13:], rtol=1e-6, atol=1e-6)
    sinks = jnp.ones(4)
    f = lambda q, k, v, s: A.reference(q, k[:, :12], v[:, :12], scale=0.3, sinks_N=s)
    o, grads = jax.jit(lambda *a: (f(*a), jax.grad(lambda *a: f(*a).sum(), (0, 1, 2, 3))(*a)))(
        q, k, v, sinks)
    assert np.all(np.asarray(o)[:, :8] == 0) and np.abs(np.asarray(o)[:, 8:]).min() > 0
    assert all(np.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("N,K,T,cap", [(4, 2, 1, 0.0), (4, 4, 1, 0.0), (4, 2, 7, 5.0)])
def test_cached_heads_first_equals_reference(N, K, T, cap, dtype):
    """`cached` (the KV cache kept [B, K, S, H]) is `reference` on [B, S, K, H] with the same
    mask: one decoded token or a prefill's T, GQA or not, soft-capped, padding and an empty
    tail masked, a row with nothing allowed giving 0; in bfloat16 too, against
    float32's."""
    q, k, v = qkv(T=20, N=N, K=K, shift=0.5 if cap else 0.0)
    q = q[:, -T:]
    mask = np.random.default_rng(1).random((2, T, 20)) < 0.6
    mask[0, 0] = False
    ref = A.reference(q, k, v, scale=0.3, causal=False, cap=cap, mask_BTS=mask)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)
    got = jax.jit(partial(A.cached, scale=0.3, cap=cap))(q, heads_first(k), heads_first(v),
                                                         mask_BTS=mask)
    tol = 1e-6 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)
    assert not np.asarray(got, np.float32)[0, 0].any()


def test_blocked_refuses_what_it_does_not_compute():
    q, k, v = qkv(T=8)
    for args, kw in (((q, k[:, :6], v[:, :6]), {}),     # cross-attention, S != T
                     ((q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)), {}),  # 4 % 3
                     ((q, k, v), dict(block=0))):
        with pytest.raises(ValueError):
            A.blocked(*args, scale=1.0, **kw)


def both(q, k, v, sinks, seg, ct, block, **kw):
    """(output, (dq, dk, dv, dsinks)) of `reference` and of `blocked`, cotangent ct."""
    def run(q, k, v, sinks, seg, ct):
        out = []
        for fn in (A.reference, partial(A.blocked, block=block)):
            f = lambda q, k, v, s: fn(q, k, v, sinks_N=s, segment_ids=seg, **kw)
            o, vjp = jax.vjp(f, q, k, v, sinks)
            out.append((o, vjp(ct)))
        return out
    return jax.jit(run)(q, k, v, sinks, seg, ct)


def assert_close(got, want, rtol=1e-5):
    """Elementwise, within rtol of the array's largest entry (gradients cross zero)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


SINKS = np.array([1.5, -1.0, 0.5, 3.0], np.float32)   # 3.0: a head that mostly rests
CASES = {   # name: (qkv's shapes, block, the knobs)
    "causal": (dict(K=4), 8, dict()),
    "gqa": (dict(K=2), 8, dict()),
    "mqa": (dict(K=1), 8, dict()),
    "non-causal": (dict(), 8, dict(causal=False)),
    "window 5, block 8": (dict(), 8, dict(window=5)),
    # 10 = 8 + 2: tile pairs (i, i - 2) hold one allowed (t, s), the corner t - s = 9.
    "window 10, block 8": (dict(), 8, dict(window=10)),
    "window > T": (dict(), 8, dict(window=40)),
    "soft-cap 30": (dict(shift=4.0), 8, dict(cap=30.0)),
    "sinks": (dict(), 8, dict(sinks_N=SINKS)),
    "segments": (dict(), 8, dict(segment_ids=packed(32))),
    "mla dims": (dict(H=24, V=16), 8, dict()),
    "T=37, block 16, non-causal": (dict(T=37), 16, dict(causal=False)),   # padded keys: masked
    "all": (dict(T=45, H=24, V=16, shift=3.0), 16,
            dict(window=18, cap=30.0, sinks_N=SINKS, segment_ids=packed(45, ((14, 17), (3, 30))))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_blocked_equals_reference_in_values_and_gradients(name):
    shapes, block, kw = CASES[name]
    kw = dict(kw)
    q, k, v = qkv(**shapes, seed=len(name))
    scale = q.shape[-1] ** -0.5
    if kw.get("cap"):   # the cap bites: most logits past it, where tanh bends
        G = q.shape[2] // k.shape[2]
        logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, G, axis=2)) * scale
        assert np.median(logits) > 1.2 * kw["cap"]
    sinks, seg = kw.pop("sinks_N", None), kw.pop("segment_ids", None)
    ct = np.random.default_rng(7).standard_normal((*q.shape[:3], v.shape[-1]), np.float32)
    (o_ref, g_ref), (o, g) = both(q, k, v, sinks, seg, ct, block, scale=scale, **kw)
    assert_close(o, o_ref)
    for got, want, what in zip(g, g_ref, ("dq", "dk", "dv", "dsinks")):
        if want is None:
            assert got is None, what
        else:
            assert_close(got, want), what


@pytest.mark.parametrize("name", ["causal", "gqa", "window 10, block 8", "sinks", "segments",
                                  "T=37, block 16, non-causal", "all"])
def test_blocked_gives_each_heads_largest_logit_and_the_same_output(name):
    """with_max (QK-clip): the online softmax's row maxima, over the allowed pairs and the rows
    that exist (not a sink's logit, not the padding), equal a float64 formula's; the output
    and the gradients are with_max=False's."""
    shapes, block, kw = CASES[name]
    kw = dict(kw) | ({"sinks_N": SINKS + 20.0} if "sinks_N" in kw else {})  # above every logit
    q, k, v = qkv(**shapes, seed=len(name) + 1)
    scale, T = q.shape[-1] ** -0.5, q.shape[1]
    run = lambda m: partial(A.blocked, scale=scale, block=block, with_max=m, **kw)
    o, top = jax.jit(run(True))(q, k, v)
    np.testing.assert_array_equal(o, jax.jit(run(False))(q, k, v))
    f = lambda m: (lambda q, k, v: jnp.sum(run(m)(q, k, v)[0] if m else run(m)(q, k, v)))
    for a, b in zip(jax.grad(f(True), (0, 1, 2))(q, k, v), jax.grad(f(False), (0, 1, 2))(q, k, v)):
        np.testing.assert_array_equal(a, b)
    G = q.shape[2] // k.shape[2]
    s = np.einsum("btnh,bsnh->bnts", q.astype(np.float64), np.repeat(k, G, axis=2)) * scale
    if kw.get("cap"):
        s = kw["cap"] * np.tanh(s / kw["cap"])
    t, u = np.arange(T)[:, None], np.arange(T)[None, :]
    ok = ((u <= t) if kw.get("causal", True) else True) & (
        (t - u < kw["window"]) if kw.get("window") else True)
    ok = np.broadcast_to(ok, (q.shape[0], 1, T, T))
    if kw.get("segment_ids") is not None:
        seg = np.asarray(kw["segment_ids"])
        ok = ok & (seg[:, None, :, None] == seg[:, None, None, :])
    np.testing.assert_allclose(top, np.where(ok, s, -np.inf).max(axis=(0, 2, 3)), rtol=1e-5)


def test_blocked_in_bfloat16_is_the_float32_reference_within_bfloat16s_precision():
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(T=40, K=2, H=16, V=16, seed=5))
    ct = jnp.asarray(np.random.default_rng(8).standard_normal((2, 40, 4, 16)), jnp.bfloat16)
    up = lambda x: x.astype(jnp.float32)

    @jax.jit
    def run(q, k, v, ct):
        kw = dict(scale=0.25, window=11)
        o, vjp = jax.vjp(partial(A.blocked, block=16, **kw), q, k, v)
        o_ref, vjp_ref = jax.vjp(partial(A.reference, **kw), up(q), up(k), up(v))
        return (o, vjp(ct)), (o_ref, vjp_ref(up(ct)))

    (o, grads), (o_ref, grads_ref) = run(q, k, v, ct)
    assert o.dtype == jnp.bfloat16
    assert_close(o, o_ref, rtol=2e-2)
    for got, want in zip(grads, grads_ref):
        assert got.dtype == jnp.bfloat16
        assert_close(got, want, rtol=3e-2)


def test_blocked_backward_memory_grows_linearly_where_the_plain_softmax_grows_as_T_squared():
    """Compiled only: XLA's temporaries for the gradient at T = 2048, 4096, 8192."""
    def temp_bytes(fn, T):
        sd = [jax.ShapeDtypeStruct((1, T, n, 64), jnp.float32) for n in (2, 1, 1)]
        grad = jax.grad(lambda q, k, v: fn(q, k, v, scale=0.125).sum(), argnums=(0, 1, 2))
        return jax.jit(grad).lower(*sd).compile().memory_analysis().temp_size_in_bytes

    for fn, lo, hi in ((partial(A.blocked, block=512), 0.0, 2.5), (A.reference, 3.0, 5.0)):
        sizes = [temp_bytes(fn, T) for T in (2048, 4096, 8192)]
        ratios = [b / a for a, b in zip(sizes, sizes[1:])]
        assert all(lo < r < hi for r in ratios), (fn, sizes)


# ---- the TPU's kernel, and the choice by compile target ---------------------------------


@pytest.mark.parametrize("knobs", ["causal", "all"])
def test_splash_equals_reference_under_a_mesh(knobs):
    """The splash kernel (interpreted on the CPU: the same Pallas program a TPU compiles) in
    shard_map over a 2 x 2 mesh, rows over fsdp and heads over tensor, against `reference`:
    values and gradients; "all" is GQA, MLA's narrower values, a window, a soft-cap, sinks
    and packed rows at once."""
    from common.mesh import MeshConfig, make_mesh
    B, T, N, K, H, V = 4, 256, 4, 2, 16, 8
    q, k, v = qkv(T=T, N=N, K=K, H=H, V=V if knobs == "all" else H, B=B, shift=0.3)
    kw = dict(scale=0.3)
    sinks = None
    if knobs == "all":
        sinks = jnp.asarray(np.random.default_rng(3).standard_normal(N), jnp.float32)
        seg = np.repeat(np.arange(4), T // 4)[None] + np.arange(B)[:, None] * (np.arange(T) > 99)
        kw |= dict(window=100, cap=5.0, segment_ids=jnp.asarray(seg, jnp.int32))
    ct = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, N, v.shape[-1])),
                     jnp.float32)

    def loss(f, q, k, v, s):
        return jnp.sum(f(q, k, v, sinks_N=s, **kw) * ct)

    argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
    grad = lambda f: jax.value_and_grad(partial(loss, f), argnums=argnums)
    want, want_g = grad(A.reference)(q, k, v, sinks)
    with jax.set_mesh(make_mesh(MeshConfig(fsdp=2, tensor=2), jax.devices()[:4])):
        got, got_g = jax.jit(grad(partial(A.splash, interpret=True)))(q, k, v, sinks)
    assert_close(got, want)
    for a, b in zip(got_g, want_g):
        assert_close(a, b)


@pytest.mark.parametrize("platform,kw,want", [
    ("tpu", {}, "splash"), ("tpu", dict(T=1000), "blocked"),   # splash's tiles are 128 wide
    ("gpu", dict(dtype="bfloat16"), "cudnn"), ("gpu", {}, "blocked"),   # cuDNN: 16-bit only
    ("gpu", dict(dtype="bfloat16", cap=50.0), "blocked"),
    ("gpu", dict(dtype="bfloat16", sinks=True), "blocked"),
    ("gpu", dict(dtype="bfloat16", segments=True), "blocked"),
    ("gpu", dict(dtype="bfloat16", V=128, H=192), "blocked"),  # MLA's widths
    ("cpu", dict(dtype="bfloat16"), "blocked"), ("cpu", {}, "blocked")])
def test_auto_picks_the_kernel_of_the_compile_target(platform, kw, want):
    args = dict(dtype="float32", T=2048, H=128, V=128) | kw
    assert A.choose("auto", platform, **args) == want
    assert A.choose("einsum", platform, **args) == "einsum"   # a named kernel is kept


def test_the_compile_target_is_the_mesh_s_platform():
    from common.mesh import MeshConfig, make_mesh, target_platform
    seen = []
    with jax.set_mesh(make_mesh(MeshConfig(fsdp=2), jax.devices()[:2])):
        jax.jit(lambda x: seen.append(target_platform()) or x)(1.0)
    assert seen == ["cpu"] and target_platform() == jax.default_backend()


@pytest.mark.parametrize("impl", ["auto", "blocked", "xla", "einsum"])
def test_attend_computes_the_reference_whatever_it_runs(impl):
    q, k, v = qkv(T=40, V=8)
    for kw in ({}, dict(window=5), dict(cap=2.0, segment_ids=packed(40))):
        want = A.reference(q, k, v, scale=0.5, **kw)
        assert_close(A.attend(q, k, v, impl=impl, scale=0.5, **kw), want)
    t = np.arange(40)  # an explicit mask (GRPO's padding and KV cache): here a causal window
    mask = np.broadcast_to((t[:, None] >= t) & (t[:, None] - t < 5), (2, 40, 40))
    for cap in (0.0, 2.0):  # jax.nn's masked softmax, or the reference's soft-capped one
        assert_close(A.attend(q, k, v, impl=impl, scale=0.5, cap=cap, mask_BTS=mask),
                     A.reference(q, k, v, scale=0.5, window=5, cap=cap))
    with pytest.raises(ValueError, match="mask_BTS takes no window"):
        A.attend(q, k, v, scale=0.5, window=5, mask_BTS=mask)


@pytest.mark.parametrize("impl,platform,T,ok", [
    ("splash", "tpu", 2048, True), ("splash", "cpu", 2048, False), ("splash", "tpu", 1000, False),
    ("cudnn", "gpu", 1000, True), ("cudnn", "cpu", 2048, False), ("cudnn", "tpu", 2048, False),
    ("auto", "cpu", 7, True), ("blocked", "tpu", 7, True)])
def test_a_kernel_the_target_cannot_run_is_refused_before_compiling(impl, platform, T, ok):
    from common.config import ConfigError
    if ok:
        A.check_kernel(impl, platform, T)
    else:
        with pytest.raises(ConfigError, match=f"--model.attention {impl} .*use --model"):
            A.check_kernel(impl, platform, T)


@pytest.mark.parametrize("device,want", [
    (dict(device_kind="TPU v5", platform="tpu"), "tpu"), (dict(device_kind="TPU v6 lite"), "tpu"),
    (dict(device_kind="NVIDIA H100 80GB HBM3"), "gpu"), (dict(device_kind="cpu"), "cpu")])
def test_the_compile_target_from_an_abstract_device_of_any_jax(monkeypatch, device, want):
    """JAX 0.10.0's abstract device has only its kind (no platform): the floors leg runs it."""
    from types import SimpleNamespace
    from common import mesh as M
    fake = SimpleNamespace(empty=False, abstract_device=SimpleNamespace(**device))
    monkeypatch.setattr(jax.sharding, "get_abstract_mesh", lambda: fake)
    assert M.target_platform() == want
