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
from common import optim, train
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
        got = optim.max_logits(jnp.asarray(q), jnp.asarray(k), mask, chunk=chunk)
        np.testing.assert_allclose(got, reference_max(q, k, allowed), rtol=1e-5)
    full = np.ones((2, 16, 16), bool)
    assert not np.allclose(reference_max(q, k, full), reference_max(q, k, causal))


def test_max_logits_see_windows_chunks_and_the_scale():
    """On a local layer only the window's (or the chunk's) pairs count; on a global one all
    causal pairs; the scale is the attention's, not 1/sqrt(H)."""
    rng = np.random.default_rng(1)
    q = rng.normal(size=(2, 16, 4, 8)).astype(np.float32)
    k = rng.normal(size=(2, 16, 2, 8)).astype(np.float32)
    k[:, 0] *= 10   # the first key dominates: a window or a chunk hides it from late queries
    t, s = np.arange(16)[:, None], np.arange(16)[None, :]
    causal = np.broadcast_to(s <= t, (2, 16, 16))
    for kw, allowed in (({"window": 3}, causal & (t - s < 3)),
                        ({"local_chunk": 5}, causal & (t // 5 == s // 5))):
        for is_global in (False, True):
            got = optim.max_logits(jnp.asarray(q), jnp.asarray(k), chunk=4, scale=0.7 / np.sqrt(8),
                                   is_global=jnp.asarray(is_global), **kw)
            want = reference_max(q, k, causal if is_global else allowed) * 0.7
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{kw} global {is_global}")
        assert not np.allclose(reference_max(q, k, allowed), reference_max(q, k, causal))


def spied_max_logits(monkeypatch, cfg, params, x, mod=tm):
    """(the heads' largest logits the trainer records, in layer order; the largest of the scores
    that `attend` is asked to soften, per call, in the order the layers ran): the latter from
    the plain q.k x scale with the causal mask, window and chunks `attend` receives, in float64
    on the host, independently of `max_logits`."""
    seen, real = [], mod.attend

    def spy(q, k, v, *, scale, window=0, **kw):
        def host(q, k, is_window):
            q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
            T, N, K = q.shape[1], q.shape[2], k.shape[2]
            t, s = np.arange(T)[:, None], np.arange(T)[None, :]
            ok = (s <= t) & ((t - s < window) if is_window else True)
            sc = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, N // K, axis=2)) * scale
            seen.append(np.where(ok, sc, -np.inf).max(axis=(0, 2, 3)))
        jax.debug.callback(host, q, k, window > 0, ordered=True)
        return real(q, k, v, scale=scale, window=window, **kw)

    monkeypatch.setattr(mod, "attend", spy)
    stats = mod.hidden(params, x, cfg, max_logits=True)[1]
    jax.effects_barrier()
    monkeypatch.setattr(mod, "attend", real)
    dense = np.asarray(stats.get("max_logit_dense", np.zeros((0, cfg.n_heads))))
    moe = np.asarray(stats["max_logit"])
    order = (np.stack([dense, moe], 1).reshape(-1, cfg.n_heads)
             if getattr(cfg, "moe_every", 1) == 2 else np.concatenate([dense, moe]))
    return order, np.stack(seen)


def test_dense_records_the_logits_of_its_windowed_layers(monkeypatch):
    """Mistral-style windows on alternate layers (train_dense.py; GRPO's block is its copy)."""
    cfg = dataclasses.replace(SMALL, sliding_window=4, global_every=2, scan_layers=False)
    params = jax.device_get(td.init_params(cfg, jax.random.key(0)))
    params["layers"]["wk"] = params["layers"]["wk"] * 8
    x = tokens(small_cfg(cfg))[:, :-1]
    x[:, 0] = 7
    recorded, computed = spied_max_logits(monkeypatch, cfg, params, jnp.asarray(x), td)
    np.testing.assert_allclose(recorded, computed, rtol=1e-4)


@pytest.mark.parametrize("family", ["gpt-oss", "deepseek", "llama4"])
def test_moe_records_the_logits_its_attention_computes(monkeypatch, family):
    """GPT-OSS: YaRN's mscale^2 on the logits, windows on alternate layers, sinks; DeepSeek: MLA
    (YaRN's mscale_all_dim, a query latent) with a dense first layer; Llama 4: chunked local
    layers, NoPE global ones with the query temperature, dense and MoE layers in turn."""
    from tests.test_deepseek import DS
    from tests.test_gptoss import GPT
    from tests.test_llama4 import LLAMA4
    cfg = {"gpt-oss": GPT, "deepseek": DS,
           "llama4": dataclasses.replace(LLAMA4, qk_l2_norm=False, attn_chunk=4)}[family]
    cfg = dataclasses.replace(cfg, scan_layers=False)   # the spy sees each layer once
    params = test_moe.perturbed_params(cfg)
    x = tokens(test_moe.small_cfg(cfg))[:, :-1]
    x[:, 0] = 7   # every row opens with the same token: a strong early key
    recorded, computed = spied_max_logits(monkeypatch, cfg, params, jnp.asarray(x))
    np.testing.assert_allclose(recorded, computed, rtol=1e-4)
    if family == "gpt-oss":   # YaRN's temperature: q.k / sqrt(H) alone would understate them
        assert tm.logit_scale(cfg, cfg.head_dim) > 1.25 / np.sqrt(cfg.head_dim)   # factor 4: 1.296


@pytest.mark.parametrize("family,again", [("dense", False), ("gpt-oss", False),
                                          ("deepseek", False), ("llama4", True)])
def test_the_blocked_kernel_gives_its_maxima_without_a_second_pass(monkeypatch, family, again):
    """On the CPU (blocked attention) the maxima come out of the kernel: `max_logits`' extra
    q.k pass runs only where the kernel runs per chunk (Llama 4's chunked layers)."""
    from tests.test_deepseek import DS
    from tests.test_gptoss import GPT
    from tests.test_llama4 import LLAMA4
    cfg = {"dense": dataclasses.replace(SMALL, sliding_window=4, global_every=2), "gpt-oss": GPT,
           "deepseek": DS, "llama4": dataclasses.replace(LLAMA4, qk_l2_norm=False, attn_chunk=4)
           }[family]
    mod = td if family == "dense" else tm
    params = (td.init_params(cfg, jax.random.key(0)) if mod is td else
              test_moe.perturbed_params(cfg))
    x = tokens(small_cfg(cfg) if mod is td else test_moe.small_cfg(cfg))[:, :-1]
    calls, real = [], optim.max_logits
    monkeypatch.setattr(optim, "max_logits", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    stats = mod.hidden(params, jnp.asarray(x), cfg, max_logits=True)[1]
    assert np.all(np.isfinite(np.asarray(stats["max_logit"])))
    assert bool(calls) == again


MLA = dict(q=("wq", "wq_b"), k=("wkv_b",), nope=8)   # DS's qk_nope_head_dim
GQA = dict(q=("wq", "bq"), k=("wk", "bk"))   # the trainers' own q/k weights and biases


@pytest.mark.parametrize("stack,key,shout", [("layers", "max_logit", (1, 1)),
                                             ("dense_layers", "max_logit_dense", (0, 2))],
                         ids=["last moe layer", "dense first layer"])
def test_mla_clip_scales_the_heads_own_parts_and_never_the_shared_rotary_key(stack, key, shout):
    """DeepSeek's MLA with a query latent and a dense first layer (Kimi K2's shape): a shouting
    head reaches tau after the clip, the other heads of its layer and the layers before keep
    their logits bitwise; the query's own part and the key's take sqrt(gamma), the rotary query
    part gamma, and the shared rotary key (wkv_a) and the values (wkv_b's last columns) nothing."""
    from tests.test_deepseek import DS
    params = test_moe.perturbed_params(DS)
    l, n = shout
    params[stack]["wq_b"][l, :, n] *= 30
    x = jnp.asarray(tokens(test_moe.small_cfg(DS))[:, :-1])
    tops_of = jax.jit(lambda p: {k: v for k, v in tm.hidden(p, x, DS, max_logits=True)[1].items()
                                 if k.startswith("max_logit")})
    before = jax.device_get(tops_of(params))
    rest = np.ones(before[key].shape, bool)
    rest[l, n] = False
    quiet = max(before[key][rest].max(), *(v.max() for k, v in before.items() if k != key))
    tau = float(np.sqrt(before[key][l, n] * quiet))
    assert before[key][l, n] > tau > quiet
    tops = {"layers": before["max_logit"], "dense_layers": before["max_logit_dense"]}
    clipped = jax.device_get(optim.qk_clip(params, tops, tau, **MLA))
    after = jax.device_get(tops_of(clipped))
    np.testing.assert_allclose(after[key][l, n], tau, rtol=1e-5)
    rest[l + 1:] = False   # the layers after it read what the clipped head wrote
    np.testing.assert_array_equal(after[key][rest], before[key][rest])
    g, Hn = tau / before[key][l, n], DS.qk_nope_head_dim
    old, new = params[stack], clipped[stack]
    for name in set(old) - {"wq_b", "wkv_b"}:   # wkv_a: the latent and the shared rotary key
        np.testing.assert_array_equal(new[name], old[name], err_msg=name)
    for name, lo, hi in (("wq_b", g ** .5, g), ("wkv_b", g ** .5, 1.0)):
        np.testing.assert_allclose(new[name][l, :, n], old[name][l, :, n] * np.where(
            np.arange(old[name].shape[-1]) < Hn, lo, hi), rtol=1e-6, err_msg=name)
        untouched = np.ones(old[name].shape[:1] + old[name].shape[2:3], bool)
        untouched[l, n] = False
        np.testing.assert_array_equal(new[name].swapaxes(1, 2)[untouched],
                                      old[name].swapaxes(1, 2)[untouched], err_msg=name)
    other = "dense_layers" if stack == "layers" else "layers"
    jax.tree.map(np.testing.assert_array_equal, clipped[other], params[other])


def test_kimi_and_deepseek_presets_take_muonclip():
    for preset in ("kimi-k2", "deepseek-v3"):
        cfg = tm.cli([preset, "--train.optimizer", "muon", "--train.qk-clip-threshold", "100",
                      "--mesh.expert", "8"])
        tm.validate(cfg, 8)


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

    clipped = jax.device_get(optim.qk_clip(p, {"layers": jnp.asarray(before)}, tau, **GQA))
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


def case(mod, mla=False):
    """(config with tau = 0, params, batch, the heads' largest logits {stack: [L, N]} on that
    batch)."""
    if mla:   # DeepSeek's MLA, a dense first layer (mla == "mtp": and V3's MTP module)
        from tests.test_deepseek import DS
        ds = dataclasses.replace(DS, mtp_depth=int(mla == "mtp"))
        cfg = test_moe.small_cfg(ds, batch_size=16, load_balance_loss=0.0, router_bias_rate=0.0)
        params, batch = test_moe.perturbed_params(ds), tokens(cfg)
        m = tm.hidden(params, batch[:, :-1], ds, max_logits=True)[1]
        tops = {"layers": np.asarray(m["max_logit"]),
                "dense_layers": np.asarray(m["max_logit_dense"])}
        if ds.mtp_depth:  # the module's logits, as the loss records them
            aux = tm.loss_fn(params, batch, ds, with_tau(tm, cfg, 1.0).train)[1]
            tops["mtp"] = np.asarray(aux["max_logit_mtp"])
        return cfg, params, batch, tops
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
        m = tg.completion_logps(params, batch, cfg.model, 1.0, 16, max_logits=True)[2]
    return cfg, params, batch, {"layers": np.asarray(m["max_logit"])}


def with_tau(mod, cfg, tau, microbatches=1):
    part = "grpo" if mod is tg else "train"
    return dataclasses.replace(cfg, **{part: dataclasses.replace(
        getattr(cfg, part), qk_clip_threshold=tau, microbatches=microbatches)})


@pytest.mark.parametrize("mod,mla", [(td, False), (tm, False), (tm, True), (tm, "mtp"),
                                     (tg, False)], ids=["dense", "moe", "deepseek", "mtp", "grpo"])
def test_every_trainer_clips_after_the_update(mod, mla):
    """The step with tau == the step without, then qk_clip with the logits of the parameters
    it started from (MLA's way, every stack, for DeepSeek); on 8 devices in 2 microbatches as
    on one."""
    cfg, params, batch, tops = case(mod, mla)
    every = np.concatenate([t.ravel() for t in tops.values()])
    tau = float(np.median(tops["mtp"] if mla == "mtp" else every))  # half the heads over it
    one = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    plain, _ = steps_of(mod, cfg, params, batch, one)
    want = jax.device_get(optim.qk_clip(plain, tops, tau, **(MLA if mla else GQA)))
    mesh = MeshConfig(fsdp=2, expert=4) if mod is tm else MeshConfig(fsdp=4, tensor=2)
    for c, m in ((with_tau(mod, cfg, tau), one),
                 (dataclasses.replace(with_tau(mod, cfg, tau, 2), mesh=mesh), make_mesh(mesh))):
        got, metrics_ = steps_of(mod, c, params, batch, m)
        np.testing.assert_allclose(metrics_["max_attn_logit"], every.max(), rtol=1e-4)
        at = lambda p, s: p[s]["layers"] if s == "mtp" else p[s]  # the module's own layers
        for stack in tops:
            for name in ("wq", "wk", "wv", "bq", "bk", "wq_b", "wkv_a", "wkv_b"):
                if name in at(want, stack):
                    np.testing.assert_allclose(at(got, stack)[name], at(want, stack)[name],
                                               rtol=1e-4, atol=1e-5, err_msg=f"{stack} {name}")
        q = "wq_b" if mla else "wq"
        changed = np.concatenate([~np.isclose(at(got, s)[q], at(plain, s)[q], rtol=1e-4,
                                              atol=1e-7).all(axis=(1, 3)).ravel() for s in tops])
        if mla == "mtp":  # the module's heads are clipped too
            assert (~np.isclose(at(got, "mtp")[q], at(plain, "mtp")[q], rtol=1e-4,
                                atol=1e-7)).any()
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
