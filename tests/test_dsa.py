"""DeepSeek-V3.2's sparse attention (DSA) in train_moe.py against references written here: the
lightning indexer's scores and top k per query, MLA over the chosen keys against a masked dense
MLA (values and gradients), the warm-up's and the sparse stage's KL by hand, the stages'
gradients and frozen weights, expert x fsdp x tensor against one device, and a resumed run that
crosses from the warm-up into the sparse stage."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_moe as tm
from common.data import DataConfig
from common.mesh import MeshConfig, make_mesh
from common.train import ConfigError
from test_deepseek import (DS, data_path, expert_parallel_equals_one_device,  # noqa: F401
                           random_layer, resumed_equals_uninterrupted, rope_halves)

# DeepSeek-V3's test block with an indexer of 8 heads, 6 keys a query of T = 24, in blocks of
# 5 queries (the last one padded); RoPE in pairs for MLA, as V3.2's.
DSA = dataclasses.replace(DS, index_n_heads=8, index_head_dim=8, index_topk=6, index_chunk=5,
                          rope_interleave=True)
T = 24


def setup(cfg, seed=1, B=2):
    lp = random_layer(cfg, seed)
    h = np.asarray(jax.random.normal(jax.random.key(seed + 2), (B, T, cfg.d_model)))
    return lp, h, jnp.broadcast_to(jnp.arange(T), (B, T)), tm.rope_inv_freq(cfg)


def reference_index_scores(h, lp, cfg):
    """I_ts = sum_m w_tm ReLU(q_tm . k_s) / sqrt(M I), query by query in numpy (one batch row);
    -inf after the query."""
    lp = {k: np.asarray(v, np.float64) for k, v in lp.items()}
    rms = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * w
    pos, inv, Hr = np.arange(T, dtype=np.float64), tm.rope_inv_freq(cfg).astype(np.float64), 4
    c_q = rms(h @ lp["wq_a"], lp["q_norm_a"])
    k = h @ lp["idx_wk"]
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
    k = k * lp["idx_k_norm"] + lp["idx_k_bias"]
    k = np.concatenate([rope_halves(k[:, :Hr], pos, inv), k[:, Hr:]], -1)   # halves, not pairs
    w = h @ lp["idx_w"] / math.sqrt(cfg.index_n_heads * cfg.index_head_dim)
    out = np.full((T, T), -np.inf)
    for t in range(T):
        q = np.einsum("r,rmi->mi", c_q[t], lp["idx_wq"])
        q = np.concatenate([rope_halves(q[:, :Hr], np.full(q.shape[0], t, np.float64), inv),
                            q[:, Hr:]], -1)
        for s in range(t + 1):
            out[t, s] = np.sum(w[t] * np.maximum(q @ k[s], 0.0))
    return out


def reference_choice(scores, K):
    """Each query's min(K, t + 1) best keys (the causal ones), as a [T, T] mask."""
    chosen = np.zeros(scores.shape, bool)
    for t in range(T):
        order = np.argsort(-scores[t, :t + 1])
        chosen[t, order[:K]] = True
        if K <= t:  # no near-tie at the edge, or the choice would be arbitrary
            edge = np.sort(scores[t, :t + 1])[::-1]
            assert edge[K - 1] - edge[K] > 1e-4, (t, edge[K - 1:K + 1])
    return chosen


def test_indexer_scores_and_top_k_equal_a_per_query_reference():
    lp, h, pos, inv = setup(DSA)
    _, c_q, _, _ = tm.mla(jnp.asarray(h), lp, pos, inv, DSA, latents=True)
    q, k, w = tm.indexer(jnp.asarray(h), c_q, lp, pos, inv, DSA)
    got = np.asarray(tm.index_scores(q, k, w, pos, pos))
    top = np.asarray(jax.lax.top_k(got, DSA.index_topk)[1])
    for b in range(2):
        want = reference_index_scores(h[b].astype(np.float64), lp, DSA)
        np.testing.assert_allclose(np.where(np.isinf(want), 0, got[b]),
                                   np.where(np.isinf(want), 0, want), rtol=1e-4, atol=1e-5)
        assert np.all(np.isneginf(got[b]) == np.isneginf(want))
        chosen = reference_choice(want, DSA.index_topk)
        for t in range(T):
            assert set(top[b, t][:min(t + 1, DSA.index_topk)]) == set(np.flatnonzero(chosen[t]))


def masked_mla(h, lp, pos, inv, cfg, mask_BTS):
    """MLA with every head's key and value (`mla`, tested against transformers), dense, the
    softmax over the keys where mask: the reference the O(T k) path must equal."""
    q, k, v = tm.mla(h, lp, pos, inv, cfg)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * tm.logit_scale(cfg, q.shape[-1])
    p = jax.nn.softmax(jnp.where(mask_BTS[:, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, v)


def main_weights(lp):
    return {k: v for k, v in lp.items() if not k.startswith("idx_")}


@pytest.mark.parametrize("topk", [6, T, 64])
def test_sparse_attention_equals_masked_dense_mla(topk):
    """k < T: the dense MLA masked to the reference's choice, values and every main weight's
    gradient; k >= T: MLA's own dense attention (the kernel). The indexer gets nothing from
    the main path (its choice is not differentiable)."""
    cfg = dataclasses.replace(DSA, index_topk=topk)
    lp, h, pos, inv = setup(cfg)
    if topk < T:
        mask = np.stack([reference_choice(reference_index_scores(h[b].astype(np.float64), lp,
                                                                  cfg), topk) for b in range(2)])
        ref = lambda lp: masked_mla(jnp.asarray(h), lp, pos, inv, cfg, jnp.asarray(mask))
    else:
        ref = lambda lp: tm.attention(*tm.mla(jnp.asarray(h), lp, pos, inv, cfg), lp, cfg, True)
    r = jax.random.normal(jax.random.key(7), (2, T, cfg.n_heads, cfg.v_head_dim))
    ours = lambda lp: tm.dsa(jnp.asarray(h), lp, pos, inv, cfg)[0]
    got, want = jax.jit(ours)(lp), jax.jit(ref)(lp)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    g_got, g_want = (jax.jit(jax.grad(lambda lp: jnp.sum(f(lp) * r)))(lp) for f in (ours, ref))
    for name in main_weights(lp):
        np.testing.assert_allclose(g_got[name], g_want[name], rtol=1e-3, atol=1e-5, err_msg=name)
    assert float(np.abs(g_got["wkv_b"]).max()) > 1e-3
    assert all(float(np.abs(g_got[k]).max()) == 0 for k in lp if k.startswith("idx_"))


def test_tied_scores_choose_the_earlier_keys():
    """Keys all of whose indexer heads' ReLU is 0 score alike (common with few heads: the
    4-head, 12-of-37 V3.2 fixture of tests/fixtures/hf, whose transformers reference breaks ties
    so too, differs by 2.9 in its logits under torch's own order): each query then keeps its
    earliest keys, in every query block (of 5 here, the last one padded)."""
    lp, h, pos, inv = setup(DSA)
    lp = dict(lp, idx_w=jnp.zeros_like(lp["idx_w"]))   # every score 0
    first = np.tril(np.ones((T, T), bool)) & (np.arange(T) < DSA.index_topk)
    want = masked_mla(jnp.asarray(h), lp, pos, inv, DSA, jnp.asarray(np.stack([first] * 2)))
    np.testing.assert_allclose(tm.dsa(jnp.asarray(h), lp, pos, inv, DSA)[0], want, rtol=2e-4,
                               atol=2e-5)


def hand_kl(h, lp, cfg, sparse):
    """The report's KL by hand, one batch row: p_t = the mean over heads of dense MLA's softmax
    (over every causal key), or of the sparse one (over the chosen keys); the indexer's
    softmax over the same keys; sum_s p log(p / q), averaged over queries."""
    I = reference_index_scores(h.astype(np.float64), lp, cfg)
    keys = reference_choice(I, cfg.index_topk) if sparse else np.tril(np.ones((T, T), bool))
    q, k, _ = (np.asarray(x[0], np.float64) for x in tm.mla(
        jnp.asarray(h[None]), lp, jnp.arange(T)[None], tm.rope_inv_freq(cfg), cfg))
    s = np.einsum("tnh,snh->nts", q, k) * tm.logit_scale(cfg, q.shape[-1])
    s = np.where(keys[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).mean(0)
    i = np.where(keys, I, -np.inf)
    log_q = i - i.max(-1, keepdims=True) - np.log(np.exp(i - i.max(-1, keepdims=True)).sum(-1,
                                                                                  keepdims=True))
    return np.sum(np.where(keys, p * (np.log(np.where(keys, p, 1)) - np.where(keys, log_q, 0)),
                           0)) / T


@pytest.mark.parametrize("warm", [True, False])
def test_indexer_kl_equals_a_hand_computation(warm):
    lp, h, pos, inv = setup(DSA)
    f = jax.jit(lambda lp, w: tm.dsa(jnp.asarray(h), lp, pos, inv, DSA, w))
    o, stats = f(lp, jnp.asarray(warm))
    want = np.mean([hand_kl(h[b], lp, DSA, sparse=not warm) for b in range(2)])
    assert float(stats["indexer_kl"]) == pytest.approx(want, rel=1e-4)
    assert want > 0.05   # the indexer is far from the heads: the comparison has teeth
    if warm:  # the warm-up runs MLA dense
        dense = tm.attention(*tm.mla(jnp.asarray(h), lp, pos, inv, DSA), lp, DSA, True)
        np.testing.assert_allclose(o, dense, rtol=2e-4, atol=2e-5)


def test_each_stage_trains_what_the_report_says():
    """The indexer learns from its KL alone, the main model from the language-model loss alone
    (the indexer's input detached); in the warm-up the objective is the KL."""
    cfg = dataclasses.replace(DSA, n_layers=2, loss_chunk=8)
    params = tm.init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape),
                          params)
    batch = jax.random.randint(jax.random.key(2), (2, 17), 0, cfg.vocab_size)
    def grad(part, warm):   # the cross-entropy itself is a report: the objective less the KL
        f = lambda p: (lambda l, aux: aux[part] if part else l - (warm is None) * aux[
            "indexer_kl"])(*tm.loss_fn(p, batch, cfg, warm=warm))
        return jax.jit(jax.grad(f))(params)

    def largest(g, idx):
        return max(float(jnp.abs(x).max()) for path, x in jax.tree_util.tree_leaves_with_path(g)
                   if str(path[-1].key).startswith("idx_") == idx)
    kl, main, warm = grad("indexer_kl", None), grad("", None), grad("", jnp.asarray(True))
    assert largest(kl, False) == 0 and all(float(jnp.abs(kl["layers"][k]).max()) > 0
                                           for k in ("idx_wq", "idx_wk", "idx_w"))
    assert largest(main, True) == 0 and float(jnp.abs(main["layers"]["wkv_b"]).max()) > 1e-4
    assert largest(warm, False) == 0 and largest(warm, True) > 0


def test_expert_parallel_equals_one_device():
    """Loss and every gradient (the indexer's included) on expert 2 x fsdp 2 x tensor 2 (MLA's
    and the indexer's heads split over tensor) against one device."""
    one = expert_parallel_equals_one_device(dataclasses.replace(DSA, n_layers=2, index_n_heads=4))
    for name in ("idx_wq", "idx_wk", "idx_w", "wkv_b"):   # each is trained: not zero
        assert float(np.abs(one[1]["layers"][name]).max()) > 1e-6, name


def test_bad_indexer_flags():
    with pytest.raises(ConfigError, match="q-lora-rank"):
        tm._validate_dsa(dataclasses.replace(DSA, q_lora_rank=0), tm.TrainConfig(), 1, 0)
    with pytest.raises(ConfigError, match="index-head-dim 2"):
        tm._validate_dsa(dataclasses.replace(DSA, index_head_dim=2), tm.TrainConfig(), 1, 0)
    with pytest.raises(ConfigError, match="indexer-warmup-steps 5 trains an indexer"):
        tm._validate_dsa(DS, tm.TrainConfig(indexer_warmup_steps=5), 1, 0)
    with pytest.raises(ConfigError, match="mesh.context"):
        tm._validate_dsa(DSA, tm.TrainConfig(), 2, 0)
    with pytest.raises(ConfigError, match="index-topk 0"):
        tm.validate(tm.Config(model=dataclasses.replace(DSA, index_topk=0)), 8)
    with pytest.raises(ConfigError, match="index-n-heads 6"):
        tm.validate(tm.Config(model=dataclasses.replace(DSA, index_n_heads=6),
                              mesh=MeshConfig(fsdp=1, tensor=4)), 4)


def test_resumed_run_crosses_the_warm_up_bitwise(data_path, tmp_path, capsys):
    """4 steps (3 of warm-up, 1 sparse) in one go == 2 steps, a resume to 4: the state bitwise.
    After the 2 warm-up steps only the indexer has moved: every other weight and the router
    biases are still the initial ones; the sparse step moves them."""
    def config(run_dir, steps):
        return tm.Config(
            model=dataclasses.replace(DSA, vocab_size=512, n_layers=2, index_topk=4),
            train=tm.TrainConfig(steps=steps, batch_size=8, seq_len=16, warmup_steps=1, lr=1e-2,
                                 schedule="constant", log_every=1, eval_every=100,
                                 sample_tokens=0, router_bias_rate=1e-2, peak_tflops=1.0,
                                 indexer_warmup_steps=3),
            mesh=MeshConfig(data=2, fsdp=1, expert=4), data=DataConfig(path=data_path),
            checkpoint=tm.CheckpointConfig(every=2, keep=2), run_dir=str(run_dir))

    full, half = resumed_equals_uninterrupted(config, tmp_path, capsys)
    init = jax.device_get(tm.init_params(config("", 1).model, jax.random.key(0)))
    for state, warm in ((half["state"], True), (full["state"], False)):
        params = jax.device_get(state["params"])
        moved = {jax.tree_util.keystr(path): not np.array_equal(x, y) for (path, x), y in zip(
            jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(init))}
        idx = {k: "idx_" in k for k in moved}
        if warm:
            assert moved == idx
        else:
            assert all(moved.values())
        assert (np.abs(state["buffers"]["layers"]["router_bias"]).max() == 0) == warm


def test_preset_parameter_counts():
    """deepseek-v3.2: DeepSeek-V3's 671,026,404,352 and in each of the 61 layers an indexer of
    1536 x 64 x 128 + 7168 x (128 + 64) + 2 x 128 = 13,959,424 (transformers' count of
    DeepseekV32ForCausalLM at its default config, on the meta device: the same total)."""
    cfg = tm.PRESETS["deepseek-v3.2"][1]
    tm.validate(cfg, 8)
    shapes = jax.eval_shape(lambda: tm.init_params(cfg.model, jax.random.key(0)))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == 671_877_929_216
    assert tm.count_params(cfg.model) == 671_877_929_216 == 671_026_404_352 + 61 * 13_959_424
    assert tm.count_active_params(cfg.model) == 38_403_807_488
    tiny = tm.PRESETS["tiny-deepseek32"][1]
    tm.validate(tiny, 1)
    assert tiny.model.index_topk < tiny.train.seq_len and 0 < tiny.train.indexer_warmup_steps
