"""DeepSeek-V3's knobs in train_moe.py against references written here: MLA with every head's
key and value built by hand, sigmoid routing with its choice bias and groups, the
auxiliary-loss-free bias update, and a resumed run that carries the biases."""
import dataclasses
import json
import math
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_moe as tm
from common.data import DataConfig, prepare
from common.mesh import MeshConfig, make_mesh
from common.train import ConfigError

# Values narrower than the queries (6 < 8 + 4), a query latent and YaRN with its mscale.
DS = tm.ModelConfig(vocab_size=128, d_model=32, n_layers=3, n_heads=4, n_kv_heads=4,
                    n_experts=8, top_k=2, d_ff=16, max_seq_len=64, loss_chunk=8, gmm_tile=8,
                    grouped_matmul="tiled", kv_lora_rank=16, q_lora_rank=12,
                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, yarn_factor=4.0,
                    yarn_original_max_len=16, yarn_mscale_all_dim=0.7, sigmoid_routing=True,
                    routed_scale=2.5, n_group=4, topk_group=2, n_shared_experts=1,
                    first_k_dense=1, dense_d_ff=24)


def random_layer(cfg, seed=1):
    """One dense layer's weights from its table, every one random, norm gains included
    (ones would hide a misplaced norm); in numpy, so that nothing compiles but the model."""
    rng = np.random.default_rng(seed)
    return {k: (0.3 * rng.standard_normal(shape[1:]) + (std is None)).astype(np.float32)
            for k, (shape, _, std) in tm._layer_table(cfg, 1, moe=False).items()}


def rope_halves(x, pos, inv, pairs=False):
    """Dim i turns with dim i + h/2; with `pairs` (DeepSeek's layout) 2i with 2i + 1, the
    result kept interleaved: a different order from the model's, the same q.k."""
    ang = pos[:, None] * inv[None]                       # [T, h]
    x1, x2 = (x[:, 0::2], x[:, 1::2]) if pairs else np.split(x, 2, axis=-1)
    y1, y2 = x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)
    return np.stack([y1, y2], -1).reshape(x.shape) if pairs else np.concatenate([y1, y2], -1)


def reference_mla(h, lp, cfg):
    """Head by head in numpy, one batch row: [k_nope_n, v_n] = c W_kv_b[:, n], k_n = [k_nope_n,
    RoPE(k_rope)], causal softmax at (nope + rope)^-1/2 times DeepSeek's mscale squared."""
    lp = {k: np.asarray(v, np.float64) for k, v in lp.items()}
    norm = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * w
    T = h.shape[0]
    C, Hn = cfg.kv_lora_rank, cfg.qk_nope_head_dim
    pos, inv = np.arange(T, dtype=np.float64), tm.rope_inv_freq(cfg).astype(np.float64)
    assert inv.shape == (cfg.qk_rope_head_dim // 2,)
    q_all = np.einsum("tc,cnh->tnh", norm(h @ lp["wq_a"], lp["q_norm_a"]), lp["wq_b"])
    kv = h @ lp["wkv_a"]
    c = norm(kv[:, :C], lp["kv_norm"])
    k_rope = rope_halves(kv[:, C:], pos, inv, cfg.rope_interleave)
    mscale = 0.1 * cfg.yarn_mscale_all_dim * math.log(cfg.yarn_factor) + 1.0
    scale = mscale ** 2 / math.sqrt(Hn + cfg.qk_rope_head_dim)
    out = []
    for n in range(cfg.n_heads):
        q = np.concatenate([q_all[:, n, :Hn], rope_halves(q_all[:, n, Hn:], pos, inv,
                                                           cfg.rope_interleave)], -1)
        k = np.concatenate([c @ lp["wkv_b"][:, n, :Hn], k_rope], -1)
        v = c @ lp["wkv_b"][:, n, Hn:]
        s = np.where(np.tril(np.ones((T, T), bool)), q @ k.T * scale, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out.append((p / p.sum(-1, keepdims=True)) @ v)
    return np.stack(out, axis=1)                         # [T, N, Hv]


@pytest.mark.parametrize("interleave", [False, True])
def test_mla_equals_per_head_reference(interleave):
    cfg = dataclasses.replace(DS, rope_interleave=interleave)
    lp = random_layer(cfg)
    h = jax.random.normal(jax.random.key(3), (2, 10, cfg.d_model))
    pos = jnp.broadcast_to(jnp.arange(10), (2, 10))
    got = jax.jit(lambda h, lp: tm.attention(*tm.mla(h, lp, pos, tm.rope_inv_freq(cfg), cfg),
                                             lp, cfg, True))(h, lp)
    assert got.shape == (2, 10, cfg.n_heads, cfg.v_head_dim)
    for b in range(2):
        np.testing.assert_allclose(got[b], reference_mla(np.asarray(h[b], np.float64), lp, cfg),
                                   rtol=2e-4, atol=2e-5)


def loss_and_grads(cfg, params, bias, batch, mesh):
    with jax.set_mesh(mesh):
        params = jax.device_put(params, tm.named(mesh, tm.param_specs(cfg)))
        f = jax.jit(jax.value_and_grad(lambda p, b: tm.loss_fn(
            tm.with_buffers(p, {"layers": {"router_bias": bias}}), b, cfg,
            tm.TrainConfig(load_balance_loss=0.1)), has_aux=True))
        (loss, _), g = f(params, batch)
        return float(loss), jax.device_get(g)


def test_expert_parallel_equals_one_device():
    """Loss and every gradient, expert 2 x fsdp 2 x tensor 2 against one device: MLA's heads
    and the shared and dense MLPs split over tensor, the groups' choice with the bias."""
    one = expert_parallel_equals_one_device(dataclasses.replace(DS, n_layers=2))
    for name in ("wkv_b", "shared_down", "w_router"):   # each is trained: not zero
        assert float(np.abs(one[1]["layers"][name]).max()) > 1e-4, name


def expert_parallel_equals_one_device(cfg):
    """Checks loss and gradients on both meshes equal; returns one device's."""
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: np.asarray(x) + 0.1 * rng.standard_normal(x.shape).astype(
        np.float32), tm.init_params(cfg, jax.random.key(0)))
    bias = jnp.asarray(rng.standard_normal((1, 8)) * 0.1, jnp.float32)
    batch = rng.integers(0, cfg.vocab_size, (8, 17), dtype=np.int32)
    one = loss_and_grads(cfg, params, bias, batch, make_mesh(MeshConfig(fsdp=1),
                                                             jax.devices()[:1]))
    got = loss_and_grads(cfg, params, bias, batch, make_mesh(MeshConfig(fsdp=2, expert=2,
                                                                        tensor=2)))
    assert got[0] == pytest.approx(one[0], rel=1e-6)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(one[1])):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    return one


def route(cfg, bias=None, seed=0, T=64):
    h = jax.random.normal(jax.random.key(seed), (1, T, cfg.d_model))
    w = jax.random.normal(jax.random.key(seed + 1), (cfg.d_model, cfg.n_experts)) * 0.3
    gate, expert, stats = jax.jit(lambda h, w, b: tm.router(h, w, cfg, bias_E=b))(h, w, bias)
    scores = jax.nn.sigmoid(jnp.einsum("btd,de->bte", h, w))
    return np.asarray(gate[0]), np.asarray(expert[0]), np.asarray(scores[0]), stats


def test_the_bias_changes_the_choice_but_not_the_weights():
    cfg = dataclasses.replace(DS, n_group=0, topk_group=0)
    bias = jnp.zeros(cfg.n_experts).at[5].set(10.0)   # expert 5 always chosen
    g0, e0, s, _ = route(cfg)
    g1, e1, _, _ = route(cfg, bias)
    assert (e1 == 5).any(axis=-1).all() and not (e0 == 5).any(axis=-1).all()
    for gate, expert in ((g0, e0), (g1, e1)):   # weights: the scores of the chosen, no bias
        chosen = np.take_along_axis(s, expert, -1)
        np.testing.assert_allclose(gate, 2.5 * chosen / chosen.sum(-1, keepdims=True),
                                   rtol=1e-5)


def test_group_limited_routing_stays_in_the_best_groups():
    cfg = dataclasses.replace(DS, n_experts=16, top_k=4, n_group=4, topk_group=2)
    bias = jax.random.normal(jax.random.key(9), (16,)) * 0.1
    _, expert, s, _ = route(cfg, bias, T=256)
    groups = (s + np.asarray(bias)).reshape(-1, 4, 4)
    group_score = np.sort(groups, -1)[..., -2:].sum(-1)
    best = np.argsort(-group_score, -1)[:, :2]
    assert all(set(e // 4) <= set(g) for e, g in zip(expert, best))
    # Without the limit the top 4 often leave those groups: the check above has teeth.
    _, free, _, _ = route(dataclasses.replace(cfg, n_group=0, topk_group=0), bias, T=256)
    assert sum(not set(e // 4) <= set(g) for e, g in zip(free, best)) > 20


def test_softmax_group_limited_routing_ranks_groups_by_their_best_probability():
    """DeepSeek-V2 (topk_method group_limited_greedy): the softmax's probabilities, the groups
    ranked by their largest, the top k of the best groups' experts, not renormalised, scaled."""
    cfg = dataclasses.replace(DS, sigmoid_routing=False, norm_topk=False, routed_scale=16.0,
                              n_experts=16, top_k=4, n_group=4, topk_group=2)
    gate, expert, _, _ = route(cfg, T=256)
    h = jax.random.normal(jax.random.key(0), (1, 256, cfg.d_model))[0]   # as `route` draws
    p = np.asarray(jax.nn.softmax(h @ (jax.random.normal(jax.random.key(1), (32, 16)) * 0.3)))
    best = np.argsort(-p.reshape(-1, 4, 4).max(-1), -1)[:, :2]
    keep = (np.arange(4)[None, :, None] == best[:, None, :]).any(-1)   # [T, group]
    kept = np.where(np.repeat(keep, 4, -1), p, 0.0)
    want = np.sort(np.argsort(-kept, -1)[:, :4], -1)
    np.testing.assert_array_equal(np.sort(expert, -1), want)
    np.testing.assert_allclose(gate, 16.0 * np.take_along_axis(p, expert, -1), rtol=1e-5)
    # The V3 ranking (the sum of a group's two best) chooses otherwise: the ranking matters.
    v3 = np.argsort(-np.sort(p.reshape(-1, 4, 4), -1)[..., -2:].sum(-1), -1)[:, :2]
    assert (np.sort(best, -1) != np.sort(v3, -1)).any()


def test_bias_update_moves_a_skewed_router_toward_uniform():
    cfg = dataclasses.replace(DS, n_group=0, topk_group=0)
    h = jax.random.normal(jax.random.key(0), (1, 512, cfg.d_model))
    w = jax.random.normal(jax.random.key(1), (cfg.d_model, cfg.n_experts)) * 0.3
    skew = jnp.zeros(cfg.n_experts).at[:2].set(2.0)   # experts 0 and 1 favoured by every token
    step = jax.jit(lambda bias: (lambda load: (tm.balance_biases(bias, load[None], 0.01),
                                               load.max() - load.min()))(
        tm.router(h, w, cfg, skew, bias[0])[2]["load"]))
    bias, spreads = jnp.zeros((1, cfg.n_experts)), []
    for _ in range(100):
        bias, spread = step(bias)
        spreads.append(float(spread))
    assert spreads[0] > 0.15 and spreads[-1] < spreads[0] / 3, spreads[::10]


def test_sequence_wise_aux_loss_against_a_hand_computation():
    """DeepSeek-V3 eqs. 17-19, in the k-at-balance convention of the batch-wise loss: per
    sequence E * sum_e (count_e / T) * mean_t s'_e, s' = s / sum(s); then the mean. Two
    sequences routed to different experts balance as a batch, not each on its own."""
    cfg = dataclasses.replace(DS, n_group=0, topk_group=0, seq_aux=True)
    h = jax.random.normal(jax.random.key(0), (2, 32, cfg.d_model))
    w = jax.random.normal(jax.random.key(1), (cfg.d_model, cfg.n_experts)) * 0.3
    skew = jnp.zeros((2, 1, cfg.n_experts)).at[0, :, :4].set(3.0).at[1, :, 4:].set(3.0)
    stats = {}
    for per_seq in (True, False):
        c = dataclasses.replace(cfg, seq_aux=per_seq)
        _, expert, stats[per_seq] = jax.jit(lambda h, w, b: tm.router(h, w, c, bias_E=b))(
            h, w, skew)
    s = np.asarray(jax.nn.sigmoid(jnp.einsum("btd,de->bte", h, w)))
    p = s / s.sum(-1, keepdims=True)
    count = np.stack([np.bincount(np.asarray(expert[b]).ravel(), minlength=8) for b in (0, 1)])
    want = np.mean([8 * np.sum(count[b] / 32 * p[b].mean(0)) for b in (0, 1)])
    assert float(stats[True]["aux_loss"]) == pytest.approx(want, rel=1e-5)
    assert float(stats[True]["aux_loss"]) > float(stats[False]["aux_loss"]) + 0.1


def test_mla_and_routing_refuse_bad_flags():
    with pytest.raises(ConfigError, match="n-kv-heads"):
        tm._validate_deepseek(dataclasses.replace(DS, n_kv_heads=2), tm.TrainConfig())
    with pytest.raises(ConfigError, match="sigmoid-routing"):
        tm._validate_deepseek(dataclasses.replace(DS, sigmoid_routing=False),
                              tm.TrainConfig(router_bias_rate=1e-3))
    with pytest.raises(ConfigError, match="n-group"):
        tm._validate_deepseek(dataclasses.replace(DS, topk_group=1, top_k=3), tm.TrainConfig())
    with pytest.raises(ConfigError, match="dense-d-ff 25"):
        tm.validate(tm.Config(model=dataclasses.replace(DS, dense_d_ff=25),
                              mesh=MeshConfig(fsdp=1, tensor=2)), 2)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, f) for f in ("argparse.py", "textwrap.py")]
    return prepare(files, str(tmp_path_factory.mktemp("d") / "prepared"), vocab_size=400)


@pytest.mark.parametrize("mtp", [0, 1])
def test_resumed_equals_uninterrupted_biases_included(data_path, tmp_path, capsys, mtp):
    """4 steps in one go == 2 steps, a resume to 4: the state bitwise, the router biases
    (moved every step, outside the optimiser's state) among it; with a multi-token-prediction
    module (tests/test_mtp.py) its own bias too, moved by its layer's load, its loss logged."""
    def config(run_dir, steps):
        return tm.Config(
            model=dataclasses.replace(DS, vocab_size=512, n_layers=2, mtp_depth=mtp),
            train=tm.TrainConfig(steps=steps, batch_size=8, seq_len=16, warmup_steps=1, lr=1e-2,
                                 schedule="constant", log_every=1, eval_every=100,
                                 sample_tokens=0, router_bias_rate=1e-2, peak_tflops=1.0),
            mesh=MeshConfig(data=2, fsdp=1, expert=4), data=DataConfig(path=data_path),
            checkpoint=tm.CheckpointConfig(every=2, keep=2), run_dir=str(run_dir))

    full, _ = resumed_equals_uninterrupted(config, tmp_path, capsys)
    for bias in jax.tree.leaves(full["state"]["buffers"]):   # the MoE layer's, the module's
        # 4 moves of +-0.01 each: a whole number of hundredths, not all back at zero.
        bias = np.asarray(bias)
        assert bias.shape == (1, 8) and 0 < np.abs(bias).max() <= 0.04 + 1e-6
        np.testing.assert_allclose(bias * 100, np.round(bias * 100), atol=1e-4)
    assert len(jax.tree.leaves(full["state"]["buffers"])) == 1 + mtp
    first = json.loads(open(tmp_path / "a" / "metrics.jsonl").readline())
    assert ("mtp_loss" in first) == bool(mtp)   # at the start near ln 512, as the loss is
    assert not mtp or abs(first["mtp_loss"] - np.log(512)) < 0.2
    assert "router_bias" not in str(jax.tree_util.tree_structure(full["state"]["opt_state"]))


def resumed_equals_uninterrupted(config, tmp_path, capsys):
    """Checks config(dir, 4) run in one go equals config(dir, 2) resumed to 4, bitwise; returns
    the uninterrupted run's summary and the 2-step one's."""
    full = tm.main(config(tmp_path / "a", 4))
    half = tm.main(config(tmp_path / "b", 2))
    resumed = tm.main(config(tmp_path / "b", 4))
    assert "resumed from step 2" in capsys.readouterr().out
    a, b = (jax.tree_util.tree_flatten_with_path(jax.device_get(r["state"]))[0]
            for r in (full, resumed))
    assert [p for p, _ in a] == [p for p, _ in b]
    for (path, x), (_, y) in zip(a, b):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))
    return full, half


@pytest.mark.parametrize("name,mtp,total,active", [
    # Published: 15.7B (2.4B active), 236B (21B), 671B (37B) without the MTP module, ~1T
    # (32B); DeepSeek-V2's and R1's also transformers' of their config.json (meta device).
    # V3's MTP module: 11.6B of its own (the release: "11.5B unique"), 685B with its copies of
    # the embedding and head (0.93B each) as the checkpoint holds them (and fp8 scales).
    ("deepseek-v2-lite", 0, 15_706_484_224, 2_661_150_208),
    ("deepseek-v2", 0, 235_741_434_880, 21_375_800_320),
    ("deepseek-v3", 0, 671_026_404_352, 37_552_282_624),
    ("deepseek-v3", 1, 682_636_472_320, 38_240_382_976),
    ("deepseek-r1", 1, 682_636_472_320, 38_240_382_976),
    ("kimi-k2", 0, 1_026_408_209_408, 32_861_477_888)])
def test_preset_parameter_counts(name, mtp, total, active):
    cfg = tm.PRESETS[name][1]
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp_depth=mtp))
    tm.validate(cfg, 8)
    shapes = jax.eval_shape(lambda: tm.init_params(cfg.model, jax.random.key(0)))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == total
    assert tm.count_params(cfg.model) == total and tm.count_active_params(cfg.model) == active
