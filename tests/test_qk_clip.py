"""MuonClip's QK-clip (--train.qk-clip-threshold): the heads' largest logit against a plain
reference, the clip on a toy attention (clipped heads reach tau on the next forward, the
others are left bitwise), every trainer's step (the clip follows the update, sharded and
accumulated == one device), a whole run's metrics, and the refusal with QK-norm."""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_dense as td
import train_grpo as tg
import train_moe as tm
from common import train
from common.mesh import MeshConfig, make_mesh
from tests import test_grpo, test_moe
from tests.test_dense import SMALL, small_cfg, tokens
from tests.test_train import config, data_path, metrics  # noqa: F401  (data_path: a fixture)


def reference_max(q, k, allowed_BTS):
    """Per query head: max over the allowed (t, s) of q_t . k_s / sqrt(H), in float64."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    N, K, H = q.shape[2], k.shape[2], q.shape[3]
    return np.array([np.einsum("bth,bsh->bts", q[:, :, n], k[:, :, n // (N // K)])[
        allowed_BTS].max() / np.sqrt(H) for n in range(N)])


@pytest.mark.parametrize("chunk", [4, 512], ids=["4 chunks", "one chunk"])
def test_max_logits_equal_a_plain_reference(chunk):
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 16, 4, 8)).astype(np.float32)
    k = rng.normal(size=(2, 16, 2, 8)).astype(np.float32)
    k[:, -1] *= 10   # the last key dominates: only the last query may see it (causally)
    causal = np.broadcast_to(np.tril(np.ones((16, 16), bool)), (2, 16, 16))
    packed = causal & (np.arange(16)[:, None] // 8 == np.arange(16)[None, :] // 8)
    for mask, allowed in ((None, causal), (packed, packed)):
        got = train.max_logits(jnp.asarray(q), jnp.asarray(k), mask, chunk=chunk)
        np.testing.assert_allclose(got, reference_max(q, k, allowed), rtol=1e-5)
    full = np.ones((2, 16, 16), bool)
    assert not np.allclose(reference_max(q, k, full), reference_max(q, k, causal))


@pytest.mark.parametrize("kv_heads,bias", [(4, False), (2, True)], ids=["mha", "gqa+bias"])
def test_clipped_heads_reach_tau_and_the_others_are_untouched(kv_heads, bias):
    m = dataclasses.replace(SMALL, n_kv_heads=kv_heads, qkv_bias=bias)
    p = jax.tree.map(np.array, jax.device_get(td.init_params(m, jax.random.key(0))))
    lp = p["layers"]
    if bias:
        for name in ("bq", "bk"):
            lp[name] = np.random.default_rng(1).normal(0, 0.05, lp[name].shape).astype(np.float32)
    lp["wq"][-1, :, 1] *= 30   # head 1 of the last layer shouts (the layers before: as drawn)
    x = tokens(small_cfg(m))[:, :-1]
    max_of = jax.jit(lambda p: td.hidden(p, x, m, max_logits=True)[1]["max_logit"])
    before = np.asarray(max_of(p))
    others = np.ones(before.shape, bool)
    others[-1, 1] = False
    tau = float(np.sqrt(before[-1, 1] * before[others].max()))
    assert before[-1, 1] > tau > before[others].max()

    clipped = jax.device_get(train.qk_clip(p, jnp.asarray(before), tau))
    after = np.asarray(max_of(clipped))
    np.testing.assert_allclose(after[-1, 1], tau, rtol=1e-5)
    np.testing.assert_array_equal(after[others], before[others])
    new = clipped["layers"]
    gamma = tau / before[-1, 1]
    for name in set(lp) - {"wq", "wk", "bq", "bk"}:
        np.testing.assert_array_equal(new[name], lp[name], err_msg=name)
    for name in {"wq", "wk", "bq", "bk"} & set(lp):   # [L, ..., heads, H]
        for l, n in np.ndindex(lp[name].shape[0], lp[name].shape[-2]):
            a, b = (w[l][..., n, :] for w in (new[name], lp[name]))
            touched = (l, n) == (1, 1) and (name in ("wq", "bq") or (
                name in ("wk", "bk") and kv_heads == 4))
            if not touched:
                np.testing.assert_array_equal(a, b, err_msg=f"{name} layer {l} head {n}")
            else:  # sqrt(gamma) on each side; a shared (GQA) key: all of it on the query
                s = gamma if kv_heads != 4 else np.sqrt(gamma)
                np.testing.assert_allclose(a, b * s, rtol=1e-6, err_msg=name)


def steps_of(mod, cfg, params, batch, mesh):
    """One train step of `mod` from `params`: (new parameters, metrics)."""
    if mod is tg:
        return test_grpo.step_once(cfg, params, batch, mesh)
    with jax.set_mesh(mesh):
        st = mod.train_state(cfg, mesh)
        state = st.from_params(jax.device_put(params, st.shardings["params"]))
        step = st.jit(partial(mod.train_step, cfg=cfg, tx=st.tx))
        state, m = step(state, train.put(batch, mesh, tm.MOE_BATCH if mod is tm else
                                         ("data", "fsdp")))
        return jax.device_get(state["params"]), jax.device_get(m)


def case(mod):
    """(config with tau = 0, params, batch, the heads' largest logits [L, N] on that batch)."""
    if mod is td:
        cfg = small_cfg(dataclasses.replace(SMALL, qkv_bias=True))
        params = jax.device_get(td.init_params(cfg.model, jax.random.key(3)))
        batch = tokens(cfg)
        m = td.hidden(params, batch[:, :-1], cfg.model, max_logits=True)[1]
    elif mod is tm:
        cfg = test_moe.small_cfg(dataclasses.replace(test_moe.SMALL, qk_norm=False),
                                 batch_size=16, load_balance_loss=0.0)  # not linear in rows
        params = test_moe.perturbed_params(cfg.model)
        batch = tokens(cfg)
        m = tm.hidden(params, batch[:, :-1], cfg.model, max_logits=True)[1]
    else:
        cfg = test_grpo.small_cfg()
        params, batch = test_grpo.perturbed_params(test_grpo.SMALL, 5), test_grpo.rollout_batch(cfg)
        m = tg.completion_logps(params, batch["prompt"], batch["prompt_valid"],
                                batch["completion"], cfg.model, 1.0, 16, max_logits=True)[2]
    return cfg, params, batch, np.asarray(m["max_logit"])


def with_tau(mod, cfg, tau, microbatches=1):
    part = "grpo" if mod is tg else "train"
    return dataclasses.replace(cfg, **{part: dataclasses.replace(
        getattr(cfg, part), qk_clip_threshold=tau, microbatches=microbatches)})


@pytest.mark.parametrize("mod", [td, tm, tg], ids=["dense", "moe", "grpo"])
def test_every_trainer_clips_after_the_update(mod):
    """The step with tau == the step without, then qk_clip with the logits of the parameters
    it started from; on 8 devices in 2 microbatches as on one."""
    cfg, params, batch, max_LN = case(mod)
    tau = float(np.median(max_LN))   # half the heads over it
    one = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    plain, _ = steps_of(mod, cfg, params, batch, one)
    want = jax.device_get(train.qk_clip(plain, jnp.asarray(max_LN), tau))
    mesh = MeshConfig(fsdp=2, expert=4) if mod is tm else MeshConfig(fsdp=4, tensor=2)
    for c, m in ((with_tau(mod, cfg, tau), one),
                 (dataclasses.replace(with_tau(mod, cfg, tau, 2), mesh=mesh), make_mesh(mesh))):
        got, metrics_ = steps_of(mod, c, params, batch, m)
        np.testing.assert_allclose(metrics_["max_attn_logit"], max_LN.max(), rtol=1e-4)
        for name in ("wq", "wk", "wv", "bq", "bk"):
            if name in want["layers"]:
                np.testing.assert_allclose(got["layers"][name], want["layers"][name],
                                           rtol=1e-4, atol=1e-5, err_msg=name)
        changed = ~np.isclose(got["layers"]["wq"], plain["layers"]["wq"], rtol=1e-4,
                              atol=1e-7).all(axis=(1, 3))
        assert 0 < changed.sum() < changed.size   # some heads clipped, some not


def test_a_run_logs_the_largest_logit(data_path, tmp_path):
    c = config(tmp_path / "run", data_path, 3)
    c = dataclasses.replace(c, train=dataclasses.replace(c.train, qk_clip_threshold=1e-3))
    td.main(c)
    logged = [m["max_attn_logit"] for m in metrics(tmp_path / "run") if "loss" in m]
    assert len(logged) == 3 and all(x > 1e-3 for x in logged)


def test_qk_norm_is_refused_and_every_trainer_takes_the_flag():
    for mod, preset, part in ((td, "tiny", "train"), (tm, "tiny-moe", "train"),
                              (tg, "tiny", "grpo")):
        cfg = mod.cli([preset, f"--{part}.qk-clip-threshold", "100"])
        assert getattr(cfg, part).qk_clip_threshold == 100
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, qk_norm=True))
        args = (tg.CharTokenizer(),) if mod is tg else ()
        with pytest.raises(train.ConfigError, match=f"--{part}.qk-clip-threshold 100.0 with "
                                                    "--model.qk-norm"):
            mod.validate(cfg, 8, *args)
