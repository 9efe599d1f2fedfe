"""DeepSeek-V3's multi-token prediction (train_moe.py `mtp`): its loss against a loop over
positions written here, sharded against one device, Muon on its projection, and its layers in
and out of a HuggingFace folder (a resumed run with it: tests/test_deepseek.py)."""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_moe as tm
from common import hf, lora, train
from common.mesh import MeshConfig, make_mesh
from common.train import ConfigError

# DeepSeek-V3's block (MLA, groups, a shared expert, a dense first layer), two MTP depths.
DS = tm.ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4,
                    n_experts=8, top_k=2, d_ff=16, max_seq_len=64, loss_chunk=8, gmm_tile=8,
                    grouped_matmul="tiled", kv_lora_rank=16, q_lora_rank=12,
                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True,
                    sigmoid_routing=True, routed_scale=2.5, n_group=4, topk_group=2,
                    n_shared_experts=1, first_k_dense=1, dense_d_ff=24, mtp_depth=2)


def random_params(cfg, seed=0):
    """Every weight random, norm gains around 1 but each its own (enorm != hnorm: a swapped
    concatenation shows), the router biases inside the layers, as `load_hf` gives them."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda e: ((1.0 if e[2] is None else 0.0) + 0.2 * rng.standard_normal(
        e[0])).astype(np.float32), tm._hf_table(cfg), is_leaf=train.is_entry)


def naive_mtp_ce(params, batch, cfg):
    """Per depth k, per position i < T - k, written out: the module's input at i is
    [norm_e(E[t_{i+k}]); norm_h(h^{k-1}_i)] W_eh, its sequence only the T - k positions that
    have a target (no padding), the block the trainer's, then -log softmax(norm(h^k_i) W) at
    t_{i+k+1}; the mean over positions, then over depths."""
    norm = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * g
    inputs, T = batch[:, :-1], batch.shape[1] - 1
    h = np.asarray(tm.hidden(params, jnp.asarray(inputs), cfg)[0], np.float64)  # h^0
    mp, E = params["mtp"], np.asarray(params["embed"], np.float64)
    inv = tm.rope_inv_freq(cfg)
    means = []
    for k in range(1, cfg.mtp_depth + 1):
        n = T - k
        rows = []
        for b in range(batch.shape[0]):
            x = np.stack([np.concatenate([norm(E[batch[b, i + k]], mp["enorm"][k - 1]),
                                          norm(h[b, i], mp["hnorm"][k - 1])]) @ mp["eh_proj"][k - 1]
                          for i in range(n)])
            rows.append(x)
        lp = jax.tree.map(lambda a: a[k - 1], mp["layers"])
        pos = jnp.broadcast_to(jnp.arange(n), (batch.shape[0], n))
        h = np.asarray(tm.block(jnp.asarray(np.stack(rows), jnp.float32), lp, pos, inv, cfg)[0],
                       np.float64)
        losses = []
        for b in range(batch.shape[0]):
            for i in range(n):
                z = norm(h[b, i], mp["head_norm"][k - 1]) @ np.asarray(params["unembed"])
                z = z - z.max()
                losses.append(np.log(np.exp(z).sum()) - z[batch[b, i + k + 1]])
        means.append(np.mean(losses))
    return float(np.mean(means))


def test_mtp_loss_equals_a_loop_over_positions():
    params = random_params(DS)
    batch = np.random.default_rng(1).integers(0, DS.vocab_size, (2, 17), dtype=np.int32)
    t = tm.TrainConfig(mtp_weight=0.3, load_balance_loss=0.0, router_z_loss=0.0)
    loss_fn = jax.jit(lambda p, b, cfg: tm.loss_fn(p, b, cfg, t), static_argnums=2)
    loss, aux = loss_fn(params, batch, DS)
    want = naive_mtp_ce(params, batch, DS)
    assert float(aux["mtp_ce"]) == pytest.approx(want, rel=1e-5)
    assert float(loss) == pytest.approx(float(aux["ce"]) + 0.3 * want, rel=1e-5)
    assert aux["load"].shape == (1 + 2, 8)   # the MoE layer's routing, then the two modules'
    # Teeth: the main loss is the one without MTP, and the concatenation's order shows.
    off = dataclasses.replace(DS, mtp_depth=0)
    assert float(loss_fn(train.split(params, {"mtp": 0})[0], batch, off)[1]["ce"]) == \
        pytest.approx(float(aux["ce"]), rel=1e-6)
    eh = params["mtp"]["eh_proj"]
    swapped = params | {"mtp": params["mtp"] | {"eh_proj": np.concatenate(
        [eh[:, 32:], eh[:, :32]], 1)}}
    assert abs(float(loss_fn(swapped, batch, DS)[1]["mtp_ce"]) - want) > 1e-3


def loss_and_grads(cfg, params, batch, mesh):
    with jax.set_mesh(mesh):
        params = jax.device_put(params, tm.named(mesh, train.table_specs(tm._hf_table(cfg))))
        f = jax.jit(jax.value_and_grad(lambda p, b: tm.loss_fn(p, b, cfg, tm.TrainConfig(
            load_balance_loss=0.1)), has_aux=True))
        (loss, aux), g = f(params, batch)
        return float(loss), float(aux["mtp_ce"]), jax.device_get(g)


def test_mtp_expert_parallel_equals_one_device():
    """Loss, MTP loss and every gradient on expert 2 x fsdp 2 x tensor 2 against one device."""
    cfg = dataclasses.replace(DS, mtp_depth=1)
    params = random_params(cfg)
    batch = np.random.default_rng(2).integers(0, cfg.vocab_size, (8, 17), dtype=np.int32)
    one = loss_and_grads(cfg, params, batch, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    got = loss_and_grads(cfg, params, batch, make_mesh(MeshConfig(fsdp=2, expert=2, tensor=2)))
    assert got[:2] == pytest.approx(one[:2], rel=1e-6)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got[2]), jax.tree.leaves(one[2])):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    for name in ("eh_proj", "enorm", "hnorm", "head_norm"):   # each is trained: not zero
        assert float(np.abs(one[2]["mtp"][name]).max()) > 1e-5, name


@pytest.mark.parametrize("how", ["allgather", "ring"])
def test_mtp_context_parallel_equals_one_device(how):
    """--mesh.context 2: the shifted tokens, targets and weights in the shards' order."""
    cfg = dataclasses.replace(DS, attention="xla", context_attention=how)
    params = random_params(cfg)
    batch = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 33), dtype=np.int32)

    def loss(mesh):
        with jax.set_mesh(mesh):
            p = jax.device_put(params, tm.named(mesh, train.table_specs(tm._hf_table(cfg))))
            loss, aux = jax.jit(lambda p, b: tm.loss_fn(p, b, cfg))(p, batch)
            return float(loss), float(aux["mtp_ce"])
    one = loss(make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    assert loss(make_mesh(MeshConfig(fsdp=1, context=2), jax.devices()[:2])) == pytest.approx(
        one, rel=1e-6)


def test_muon_trains_the_projection():
    """--train.optimizer muon: eh_proj is one of its matrices (MUON_DIMS), orthogonalised. One
    device: on fsdp 2 x expert 2 x tensor 2 this step deadlocked in XLA's CPU collectives (a
    rendezvous timeout) when it ran after tests/test_moe.py in one process, never alone."""
    cfg = tm.Config(model=dataclasses.replace(DS, mtp_depth=1), train=tm.TrainConfig(
        optimizer="muon", batch_size=8, seq_len=16, lr=1e-2, warmup_steps=0),
        mesh=MeshConfig(fsdp=1))
    tm.validate(cfg, 1)
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    st = tm.train_state(cfg, mesh)
    with jax.set_mesh(mesh):
        state = st.fresh(jax.random.key(0))
        before = np.asarray(state["params"]["mtp"]["eh_proj"])
        batch = train.put(np.random.default_rng(3).integers(0, 128, (8, 17), np.int32), mesh,
                          tm.MOE_BATCH)
        state, metrics = st.jit(partial(tm.train_step, cfg=cfg, tx=st.tx))(state, batch)
    assert np.isfinite(float(metrics["mtp_loss"])) and not bool(metrics["nonfinite"])
    step = np.asarray(state["params"]["mtp"]["eh_proj"]) - before
    s = np.linalg.svd(step[0], compute_uv=False)   # Muon's update: near-equal singular values
    assert s.min() > 0.5 * s.max()


def test_lora_adapts_the_modules():
    """LoRA's adapters reach the modules' block and projection (merged where they are used)."""
    cfg = tm.Config(model=dataclasses.replace(DS, mtp_depth=1), train=tm.TrainConfig(
        batch_size=8, seq_len=16, lr=1e-2, warmup_steps=0), mesh=MeshConfig(fsdp=1),
        lora=lora.LoRAConfig(rank=2, targets="wo,w_gate,eh_proj"))
    tm.validate(cfg, 1)
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    st = tm.train_state(cfg, mesh)
    with jax.set_mesh(mesh):
        state = st.fresh(jax.random.key(0))
        batch = train.put(np.random.default_rng(3).integers(0, 128, (8, 17), np.int32), mesh,
                          tm.MOE_BATCH)
        state, metrics = st.jit(partial(tm.train_step, cfg=cfg, tx=st.tx))(state, batch)
    assert set(state["params"]["mtp"]) == {"eh_proj", "layers"} and not bool(metrics["nonfinite"])
    for path in (("eh_proj", "b"), ("layers", "w_gate", "b")):   # b starts at 0: it moved
        b = state["params"]["mtp"][path[0]]
        b = b[path[1]][path[2]] if len(path) == 3 else b[path[1]]
        assert float(np.abs(np.asarray(b)).max()) > 0, path


def test_mtp_refuses_bad_flags():
    with pytest.raises(ConfigError, match="--model.mtp-depth 16"):
        tm.validate(tm.Config(model=dataclasses.replace(DS, mtp_depth=16),
                              train=tm.TrainConfig(seq_len=16, batch_size=8)), 8)
    with pytest.raises(ConfigError, match="--model.mtp-depth 2: the MTP modules are not built"):
        tm.validate(tm.Config(model=dataclasses.replace(DS, index_n_heads=2, index_head_dim=8,
                                                        index_topk=4), train=tm.TrainConfig(
            seq_len=16, batch_size=8)), 8)


def test_hf_round_trip_with_mtp(tmp_path):
    """The modules as the releases carry them: layer n_layers + k with enorm, hnorm, eh_proj,
    shared_head.norm, a MoE block, and copies of the shared embedding and head; back the same."""
    params = random_params(DS)
    files = tm.save_hf(params, DS, str(tmp_path / "out"))
    ckpt = hf.Checkpoint(str(tmp_path / "out"))
    assert ckpt.config["num_nextn_predict_layers"] == 2 and len(files) >= 2
    assert ckpt.shape("model.layers.2.eh_proj.weight") == (32, 64)
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                 "mlp.gate.e_score_correction_bias", "mlp.experts.7.down_proj.weight"):
        assert f"model.layers.3.{name}" in ckpt.names(), name
    np.testing.assert_array_equal(ckpt.array("model.layers.3.shared_head.head.weight"),
                                  params["unembed"].T)
    np.testing.assert_array_equal(ckpt.array("model.layers.2.embed_tokens.weight"),
                                  params["embed"])
    # [e; h]: the embedding's half first, as vLLM's DeepSeekMTP concatenates
    np.testing.assert_array_equal(ckpt.array("model.layers.2.eh_proj.weight"),
                                  params["mtp"]["eh_proj"][0].T)
    cfg, loaded = tm.load_hf(str(tmp_path / "out"))
    how = dict(loss_chunk=DS.loss_chunk, grouped_matmul=DS.grouped_matmul, gmm_tile=DS.gmm_tile)
    assert dataclasses.replace(cfg, **how) == dataclasses.replace(DS, head_dim=DS.qk_rope_head_dim)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(
            jax.device_get(loaded))):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_mtp_only_in_deepseek_v3_folders():
    with pytest.raises(hf.HFError, match="does not fit"):
        tm.config_to_hf(dataclasses.replace(tm.ModelConfig(), mtp_depth=1), "mixtral")


try:
    import torch
    import transformers
except ImportError:
    transformers = None


@pytest.mark.skipif(transformers is None, reason="transformers not installed (extra: parity)")
def test_transformers_loads_an_export_with_mtp(tmp_path):
    """transformers' DeepseekV3 has no MTP module: it leaves the extra layers unread, and its
    logits are our forward's (which the modules do not touch)."""
    params = random_params(DS)
    tm.save_hf(params, DS, str(tmp_path))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager")
    tokens = np.random.default_rng(4).integers(0, DS.vocab_size, (2, 16))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    got = np.asarray(jax.jit(tm.forward, static_argnums=2)(params, tokens, DS))
    assert float(np.max(np.abs(got - want))) < 1e-4
