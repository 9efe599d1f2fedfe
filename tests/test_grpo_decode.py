"""train_grpo.py's refill rollout (issue 75): rows at their own cache columns, finished rows
refilled with waiting prompts, the cache read as far as the rows reach, weights cast once;
against the full forward, the halving rollout, prompts decoded alone, and the bench's table."""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_grpo as tg
from bench import grpo_tpu
from common import lora, train
from test_grpo import GEMMA2, KNOBS, SMALL, grpo_config, left_padded, perturbed_params

KW = dict(max_new=8, eos_id=2, pad_id=0, n_valid=14)


def right_padded(lengths, width, vocab, seed=0):
    ids, valid = left_padded(lengths, width, vocab, seed)
    return ids, valid, np.stack([np.roll(r, -(~v).sum()) for r, v in zip(ids, valid)])


def refill(m, *a, rows, segment=3, **kw):
    return jax.device_get(jax.jit(partial(tg.refill_rollout, cfg=m, rows=rows, segment=segment,
                                          **KW | kw))(*a))


@pytest.mark.parametrize("knobs", ["small", "knobs"])
def test_refill_rollout_decodes_the_full_forward_s_greedy_tokens(knobs):
    """Greedy, every row at once, the cache read in segments of 3 columns: each token is the
    argmax of one full forward over prompt + completion, and the tokens, masks and log-probs
    are the halving rollout's (left-padded, its columns shared)."""
    m = dict(small=SMALL, knobs=KNOBS)[knobs]
    params = perturbed_params(m, seed=5)
    lengths = np.array([6, 3, 1, 4, 5, 2, 6, 1])
    ids, valid, right = right_padded(lengths, 6, m.vocab_size)
    out = refill(m, params, right, lengths.astype(np.int32), jax.random.key(0), 0.0, rows=8)
    old = jax.device_get(jax.jit(partial(tg.rollout, cfg=m, **KW))(
        params, ids, valid, jax.random.key(0), jnp.float32(0.0)))
    np.testing.assert_array_equal(out["tokens_QN"], old["tokens_BN"])
    np.testing.assert_array_equal(out["mask_QN"], old["mask_BN"])
    np.testing.assert_allclose(out["logp_QN"], old["logp_BN"], rtol=1e-5, atol=1e-5)
    valid_S = np.concatenate([valid, np.ones((8, 8), bool)], 1)
    full = jax.jit(partial(tg.forward, cfg=m))(
        params, np.concatenate([ids, out["tokens_QN"]], 1),
        positions=tg.padded_positions(valid_S), mask_BTS=tg.padded_mask(valid_S, 0, 14))
    want, mask = np.asarray(full)[:, 5:13, :14].argmax(-1), out["mask_QN"]
    np.testing.assert_array_equal(out["tokens_QN"][mask], want[mask])
    assert mask[:, 0].all() and int(out["steps"]) == int(old["steps"])


def test_refilled_rows_equal_the_prompts_decoded_alone():
    """8 prompts on 3 rows, sampled (EOS about 1 in 14): rows that finish take the next prompt
    and feed it from column 0. Each prompt's completion and log-probs are those it gets on a
    row of its own, and its log-probs the training forward's (the importance ratio's "old")."""
    m = KNOBS
    params = perturbed_params(m, seed=5)
    lengths = np.array([6, 3, 1, 4, 5, 2, 6, 1])
    ids, valid, right = right_padded(lengths, 6, m.vocab_size)
    args = (jax.random.key(1), jnp.float32(1.0))
    out = refill(m, params, right, lengths.astype(np.int32), *args, rows=3, segment=4)
    for q in range(8):
        one = refill(m, params, right[q:q + 1], lengths[q:q + 1].astype(np.int32), *args,
                     rows=1, segment=4, ids_Q=jnp.array([q]))
        np.testing.assert_array_equal(out["tokens_QN"][q], one["tokens_QN"][0])
        np.testing.assert_array_equal(out["mask_QN"][q], one["mask_QN"][0])
        np.testing.assert_allclose(out["logp_QN"][q], one["logp_QN"][0], rtol=1e-5, atol=1e-5)
    n = out["mask_QN"].sum(1)
    assert n.min() < 8 and int(out["steps"]) < (lengths + n).sum()  # rows ended, refilled
    ref, _, _ = jax.jit(partial(tg.completion_logps, cfg=m, temperature=1.0, n_valid=14))(
        params, {"prompt": ids, "prompt_valid": valid, "completion": out["tokens_QN"]})
    mask = out["mask_QN"]
    np.testing.assert_allclose(out["logp_QN"][mask], np.asarray(ref)[mask], rtol=1e-5,
                               atol=5e-5)


def test_refill_on_a_model_it_does_not_fit_is_a_clear_error():
    cfg = dataclasses.replace(grpo_config("/nonexistent", 1, grpo=dict(decode="refill")),
                              model=GEMMA2)  # a window: columns counted per row, not shared
    with pytest.raises(tg.ConfigError, match="--grpo.decode refill.*--grpo.decode halving"):
        tg.validate(cfg, jax.device_count(), tg.CharTokenizer())


def test_decode_params_merge_lora_and_cast_the_matrices_once():
    """LoRA's adapters merged into the weights and the matrices in bfloat16, the norm gains
    float32: the forward on them is the forward on the adapted model, in bfloat16."""
    m = dataclasses.replace(KNOBS, dtype="bfloat16")
    params = perturbed_params(m, seed=2)
    rng = np.random.default_rng(3)
    ad = {"layers": {"wq": {"a": rng.normal(0, .1, (2, 32, 4)).astype(np.float32),
                            "b": rng.normal(0, .1, (2, 4, 4, 8)).astype(np.float32)}}}
    adapted = lora.adapt(params, ad, 2.0)
    dec = tg.decode_params(adapted, m)
    assert dec["layers"]["wq"].dtype == dec["embed"].dtype == jnp.bfloat16
    assert dec["layers"]["attn_norm"].dtype == dec["layers"]["q_norm"].dtype == jnp.float32
    x = np.random.default_rng(0).integers(0, 16, (2, 6))
    fwd = jax.jit(partial(tg.forward, cfg=m))
    np.testing.assert_allclose(fwd(dec, x), fwd(adapted, x), rtol=1e-6, atol=1e-6)


def test_the_bench_table_parses_and_its_bytes_are_counted_by_hand():
    row = {"size": "qwen3-0.6b", "repeat": 1, "rows": 64, "new": 1024, "decode tok/s": 5123.4,
           "bound tok/s": 9000.2, "share": 0.5693, "copy GB/s": 700.04, "update MFU": 0.4612}
    got = grpo_tpu.parse("noise\n" + grpo_tpu.render([row, row | {"repeat": 2}]) + "\nmore")
    assert [r["repeat"] for r in got] == [1, 2] and got[0]["size"] == "qwen3-0.6b"
    for k, v in list(row.items())[1:]:
        assert got[0][k] == pytest.approx(v, rel=1e-3), k  # as printed: 3-4 digits
    m = dataclasses.replace(SMALL, dtype="bfloat16")  # untied: the embedding only looked up
    b = grpo_tpu.step_bytes(m, np.array([3, 5]), 2)
    L, D, F, N, K, H, V = 2, 32, 64, 4, 2, 8, 16
    w = 2 * (L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F) + D * V) + 4 * (
        2 * L * D + D)  # bf16 matrices, f32 norms
    np.testing.assert_array_equal(b, w + 2 * L * K * H * 2 * np.array([4 + 6, 5 + 7]))


@pytest.mark.chip
@pytest.mark.skipif(jax.default_backend() == "cpu", reason="needs an accelerator")
def test_refill_rollout_on_the_chip_in_bfloat16_matches_the_full_forward():
    """On the chip, bfloat16, qwen3's knobs at a small size with a real head width (128):
    the log-probs of the greedy tokens decoded from the cache are the full forward's within
    bfloat16's rounding (0.05), and a token differs only where the forward's top two logits
    are that close."""
    m = dataclasses.replace(KNOBS, d_model=256, n_heads=4, n_kv_heads=2, head_dim=128, d_ff=512,
                            vocab_size=512, max_seq_len=128, dtype="bfloat16")
    params = tg.init_params(m, jax.random.key(0))
    lengths = np.array([16, 9, 1, 12] * 4)
    ids, valid, right = right_padded(lengths, 16, m.vocab_size)
    kw = dict(max_new=48, eos_id=-1, pad_id=0, n_valid=m.vocab_size)
    out = jax.device_get(jax.jit(partial(tg.refill_rollout, cfg=m, rows=16, segment=16, **kw))(
        params, right, lengths.astype(np.int32), jax.random.key(0), jnp.float32(0.0)))
    tokens = out["tokens_QN"]
    valid_S = np.concatenate([valid, np.ones((16, 48), bool)], 1)
    full = np.asarray(jax.jit(partial(tg.forward, cfg=m))(
        params, np.concatenate([ids, tokens], 1), positions=tg.padded_positions(valid_S),
        mask_BTS=tg.padded_mask(valid_S, 0, 64)), np.float32)[:, 15:63]
    logp = jax.nn.log_softmax(full, -1)
    np.testing.assert_allclose(out["logp_QN"], np.take_along_axis(logp, tokens[..., None], -1)[
        ..., 0], atol=0.05)
    top2 = -np.sort(-full, -1)[..., :2]
    differ = tokens != full.argmax(-1)
    assert np.all(top2[..., 0][differ] - top2[..., 1][differ] < 0.05)
