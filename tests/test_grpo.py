"""train_grpo.py against references: train_dense.py's model, the full forward pass, losses
computed by hand from the papers' equations, hand-written completions, and itself (resumed,
sharded, accumulated)."""
import dataclasses
import json
import math
import os
import sysconfig
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_dense as td
import train_grpo as tg
from common.checkpoint import CheckpointConfig, Checkpointer, check_run_config
from common.data import DataConfig, encode_prompts, prepare
from common.mesh import BATCH_AXES, MeshConfig, MeshError, make_mesh
from common.task import pack
from common import sampling, train

SMALL = tg.ModelConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=8, d_ff=64, max_seq_len=32, loss_chunk=8, remat="none")
# Every knob on at once: Qwen2 biases, Qwen3 q/k norm, tied embeddings, Llama 3.1 rope scaling.
KNOBS = dataclasses.replace(SMALL, qkv_bias=True, qk_norm=True, tie_embeddings=True,
                            rope_scaling=8.0, rope_original_max_len=16)
# Gemma 2's knobs (a window shorter than the tests' rows, soft-caps, (1 + w) and sandwich
# norms, GeGLU, the embedding scale), then Gemma 3's (q/k norms, a local RoPE base, linear
# scaling on the global layers, no soft-caps).
GEMMA2 = dataclasses.replace(SMALL, sliding_window=4, global_every=2, attn_softcap=3.0,
                             final_softcap=2.5, query_scale=12.0, norm_plus_one=True,
                             sandwich_norm=True, embed_scale=True, gelu=True, tie_embeddings=True)
GEMMA3 = dataclasses.replace(GEMMA2, attn_softcap=0.0, final_softcap=0.0, qk_norm=True,
                             rope_local_theta=100.0, rope_linear=2.0)
# OLMo 3's: post norms only, q/k norms over all heads, a window, YaRN on the global layer.
OLMO3 = dataclasses.replace(SMALL, post_norm=True, qk_norm=True, qk_norm_whole=True,
                            sliding_window=4, global_every=2, rope_local_theta=100.0,
                            yarn_factor=4.0, yarn_original_max_len=8)

# Gemma 4's (the 31B's): global layers (every second) twice as wide with one key/value head
# whose keys are the values, proportional RoPE, v norms, layer scalars; then E2B's: per-layer
# inputs and a last period reusing the first's keys and values, its MLPs twice as wide.
GEMMA4 = dataclasses.replace(SMALL, n_layers=4, sliding_window=4, global_every=2, qk_norm=True,
                             sandwich_norm=True, embed_scale=True, gelu=True, query_scale=1.0,
                             global_head_dim=16, global_kv_heads=1, k_eq_v=True, v_norm=True,
                             rope_partial=0.5, layer_scale=True, final_softcap=2.5)
GEMMA4_PLE = dataclasses.replace(GEMMA4, k_eq_v=False, global_kv_heads=0, ple_dim=4,
                                 kv_shared=2, wide_shared_mlp=True)
# Qwen3.5's: a Gated DeltaNet layer then a gated attention layer turning a quarter of each head,
# in chunks of 4 (the tests' 12 columns: three chunks, a decoded token a chunk of its own).
QWEN35 = dataclasses.replace(SMALL, n_layers=4, global_every=2, qk_norm=True, norm_plus_one=True,
                             attn_gate=True, rotary_dim=2, linear_k_heads=2, linear_v_heads=4,
                             linear_k_dim=8, linear_v_dim=6, linear_chunk=4)

# GPT-2's block (GPT-3's): LayerNorm, learned positions, a plain GELU MLP, biases everywhere.
GPT2 = dataclasses.replace(SMALL, n_kv_heads=4, tie_embeddings=True, **td._GPT2)


def put(x, mesh):
    return train.put(x, mesh, BATCH_AXES)


def dense(m: tg.ModelConfig) -> td.ModelConfig:
    return td.ModelConfig(**dataclasses.asdict(m))


def perturbed_params(m, seed=1):
    """Random weights with non-trivial norms and biases (ones/zeros would hide bugs). Drawn
    with NumPy: XLA takes seconds to compile the init's random numbers, and tests are many."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(partial(tg._init, m), jax.random.key(0))
    return jax.tree.map_with_path(
        lambda path, s: (rng.normal(0, 0.1, s.shape) + ("norm" in jax.tree_util.keystr(path)))
        .astype(np.float32), shapes)


def left_padded(lengths, width, vocab, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), width), np.int32)
    valid = np.zeros((len(lengths), width), bool)
    for r, n in enumerate(lengths):
        ids[r, width - n:] = rng.integers(3, vocab, n)
        valid[r, width - n:] = True
    return ids, valid


# ------------------------------------------------------------------------------ the model


def test_model_config_and_parameter_tree_equal_train_dense():
    """Same fields with the same defaults, so a dense run's config.json loads as the policy's."""
    f = lambda cls: [(x.name, x.default) for x in dataclasses.fields(cls)]
    assert f(tg.ModelConfig) == f(td.ModelConfig)
    for m in (SMALL, KNOBS, GEMMA2, GEMMA3, OLMO3, GEMMA4, GEMMA4_PLE, QWEN35, GPT2):
        assert tg.param_specs(m) == td.param_specs(dense(m))
        a = jax.eval_shape(partial(tg._init, m), jax.random.key(3))
        b = jax.eval_shape(partial(td._init, dense(m)), jax.random.key(3))
        assert a == b   # tree, shapes and dtypes
        assert tg.count_params(m) == td.count_params(dense(m))
        # The init draws the same numbers (its std per leaf): compared on the (cheap) jaxpr.
        assert (str(jax.make_jaxpr(partial(tg._init, m))(jax.random.key(3))) ==
                str(jax.make_jaxpr(partial(td._init, dense(m)))(jax.random.key(3))))


MODELS = {"knobs": KNOBS, "gemma2": GEMMA2, "gemma3": GEMMA3, "olmo3": OLMO3, "gemma4": GEMMA4,
          "gemma4_ple": GEMMA4_PLE, "qwen35": QWEN35, "gpt2": GPT2}


@pytest.mark.parametrize("knobs", MODELS)
@pytest.mark.parametrize("attention,scan", [("xla", True), ("einsum", False)])
def test_copied_forward_equals_train_dense(attention, scan, knobs):
    m = dataclasses.replace(MODELS[knobs], attention=attention, scan_layers=scan)
    params = perturbed_params(m)
    x = np.random.default_rng(0).integers(0, m.vocab_size, (4, 12)).astype(np.int32)
    np.testing.assert_array_equal(np.asarray(jax.jit(partial(tg.forward, cfg=m))(params, x)),
                                  np.asarray(jax.jit(partial(td.forward, cfg=dense(m)))(params, x)))


@pytest.mark.parametrize("knobs", MODELS)
@pytest.mark.parametrize("attention,scan", [("xla", True), ("einsum", False)])
def test_kv_cache_decode_equals_full_forward(attention, scan, knobs):
    """Prefill a left-padded prompt batch, then feed a continuation one token at a time
    through the cache: the logits at each new position equal one full forward pass, and the
    full pass on a padded row equals train_dense's forward on that row without its pads
    (Gemma's window, counted in columns, is the same counted in positions: pads come first)."""
    m = dataclasses.replace(MODELS[knobs], attention=attention, scan_layers=scan)
    params = perturbed_params(m)
    # Gemma 4 does not divide q.k by sqrt(H): its float32 rounding is larger (xla against
    # einsum attention on the same rows: 2e-5).
    tol = dict(rtol=5e-5, atol=5e-5) if m.query_scale == 1.0 else dict(rtol=1e-5, atol=1e-5)
    Pw, N = 7, 5
    prompt, valid = left_padded([7, 2, 4, 2], Pw, m.vocab_size)
    cont = np.random.default_rng(1).integers(3, m.vocab_size, (4, N)).astype(np.int32)
    tokens = np.concatenate([prompt, cont], 1)
    valid_S = np.concatenate([valid, np.ones((4, N), bool)], 1)
    S = Pw + N
    pos = tg.padded_positions(valid_S)
    fwd = jax.jit(partial(tg.forward, cfg=m))
    full = np.asarray(fwd(params, tokens, positions=pos, mask_BTS=tg.padded_mask(valid_S, 0, S)))
    dense_fwd = jax.jit(partial(td.forward, cfg=dense(m)))
    for r in (0, 1):  # padded == unpadded, against the dense trainer itself
        real = tokens[r, valid_S[r]]
        np.testing.assert_allclose(full[r, valid_S[r]], dense_fwd(params, real[None])[0],
                                   **tol)

    step = jax.jit(partial(tg.forward_cached, cfg=m))
    logits, cache = step(params, prompt, cache=tg.init_cache(m, 4, S), index=0,
                         positions=pos[:, :Pw], mask_BTS=tg.padded_mask(valid_S, 0, Pw))
    np.testing.assert_allclose(logits[:, 0], full[:, Pw - 1], **tol)  # the prompt's last
    for i in range(N):
        col = Pw + i
        logits, cache = step(params, cont[:, i:i + 1], cache=cache, index=col,
                             positions=pos[:, col:col + 1], mask_BTS=tg.padded_mask(valid_S, col, 1))
        np.testing.assert_allclose(logits[:, 0], full[:, col], **tol)


def run_rollout(m, params, prompt, valid, key, temperature, max_new=8, n_valid=14, **kw):
    fn = jax.jit(partial(tg.rollout, cfg=m, max_new=max_new, eos_id=2, pad_id=0,
                         n_valid=n_valid, **kw))
    return jax.device_get(fn(params, prompt, valid, key, jnp.float32(temperature)))


@pytest.mark.parametrize("knobs", ["small", "qwen35"])  # Qwen3.5: DeltaNet states decoded
def test_rollout_masks_after_eos_and_its_logps_equal_the_training_forward(knobs):
    m = SMALL if knobs == "small" else QWEN35
    params = perturbed_params(m, seed=5)
    prompt, valid = left_padded([6, 3, 1, 4] * 4, 6, m.vocab_size)
    out = run_rollout(m, params, prompt, valid, jax.random.key(0), 1.0)
    tokens, mask, logp = out["tokens_BN"], out["mask_BN"], out["logp_BN"]
    assert tokens.max() < 14                      # ids past the tokenizer's vocabulary: never
    stopped = 0
    for r in range(len(tokens)):
        eos = np.flatnonzero(tokens[r] == 2)
        end = eos[0] + 1 if len(eos) else tokens.shape[1]
        np.testing.assert_array_equal(mask[r], np.arange(tokens.shape[1]) < end)
        assert np.all(tokens[r, end:] == 0) and np.all(logp[r, end:] == 0)
        stopped += end < tokens.shape[1]
    assert 0 < stopped < len(tokens)              # both kinds of row are exercised
    ref, _, _ = jax.jit(partial(tg.completion_logps, cfg=m, temperature=1.0, n_valid=14))(
        params, {"prompt": prompt, "prompt_valid": valid, "completion": tokens})
    # float32 rounding: DeltaNet's state decoded token by token against the chunked forward
    # differed by 2.1e-5 here (JAX 0.10's older CPU code generator); the state 1% off, by 0.59
    np.testing.assert_allclose(logp[mask], np.asarray(ref)[mask], rtol=1e-5, atol=5e-5)
    # A row finishes early only when every row is done: run with EOS impossible to draw.
    full = run_rollout(m, params, prompt, valid, jax.random.key(0), 1.0, n_valid=2)
    assert int(full["steps"]) == 8 and full["mask_BN"].all()


@pytest.mark.parametrize("knobs", ["small", "qwen35"])  # Qwen3.5: its states split on heads
def test_greedy_rollout_is_the_same_sharded(knobs):
    m = SMALL if knobs == "small" else QWEN35
    params = perturbed_params(m, seed=5)
    prompt, valid = left_padded([6, 3, 1, 4] * 2, 6, m.vocab_size)
    one = run_rollout(m, params, prompt, valid, jax.random.key(0), 0.0)
    mesh = make_mesh(MeshConfig(fsdp=4, tensor=2))
    with jax.set_mesh(mesh):
        sp = jax.device_put(params, tg.named(mesh, tg.param_specs(m)))
        two = run_rollout(m, sp, put(prompt, mesh), put(valid, mesh), jax.random.key(0), 0.0)
    np.testing.assert_array_equal(one["tokens_BN"], two["tokens_BN"])
    np.testing.assert_allclose(one["logp_BN"], two["logp_BN"], rtol=1e-5, atol=1e-5)
    # Greedy: each token is the argmax of the (masked) forward at its position.
    valid_S = np.concatenate([valid, np.ones((8, 8), bool)], 1)
    ref = jax.jit(partial(tg.forward, cfg=m))(
        params, np.concatenate([prompt, one["tokens_BN"]], 1),
        positions=tg.padded_positions(valid_S), mask_BTS=tg.padded_mask(valid_S, 0, 14))
    want = np.asarray(ref)[:, 5:13, :14].argmax(-1)
    mask = one["mask_BN"]
    np.testing.assert_array_equal(one["tokens_BN"][mask], want[mask])


def test_sampled_rollout_is_the_same_sharded():
    """Temperature 1 with top-k: the same key draws the same tokens on 8 devices as on one."""
    m = SMALL
    params = perturbed_params(m, seed=6)
    prompt, valid = left_padded([6, 3, 1, 4, 5, 2, 6, 1], 6, m.vocab_size)
    one = run_rollout(m, params, prompt, valid, jax.random.key(3), 1.0, top_k=5)
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    with jax.set_mesh(mesh):
        sp = jax.device_put(params, tg.named(mesh, tg.param_specs(m)))
        two = run_rollout(m, sp, put(prompt, mesh), put(valid, mesh), jax.random.key(3), 1.0,
                          top_k=5)
    np.testing.assert_array_equal(one["tokens_BN"], two["tokens_BN"])
    np.testing.assert_array_equal(one["mask_BN"], two["mask_BN"])
    assert len({tuple(r) for r in np.asarray(one["tokens_BN"])}) > 1  # sampled, not one path


@pytest.mark.parametrize("knobs", ["small", "qwen35", "gemma4_ple"])
def test_a_rollout_that_drops_its_done_rows_draws_the_same_tokens(knobs):
    """`min_rows`: as rows finish, the live ones are gathered into batches of 16 then 8 (KV
    cache, DeltaNet states and Gemma 4's global stack with them): the tokens are those of the
    whole batch decoded to the end, and on a mesh of 4 batch shards too."""
    m = dict(small=SMALL, qwen35=QWEN35, gemma4_ple=GEMMA4_PLE)[knobs]
    params = perturbed_params(m, seed=6)
    prompt, valid = left_padded([6, 3, 1, 4, 5, 2, 6, 1] * 4, 6, m.vocab_size)
    run = partial(run_rollout, m, max_new=24, top_k=6, n_valid=8)  # EOS ~1 in 8
    one = run(params, prompt, valid, jax.random.key(4), 1.0)
    ends = one["mask_BN"].sum(1)
    assert np.sort(ends)[24] < ends.max()        # 25 rows done before the last: both halvings
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    with jax.set_mesh(mesh):
        sp = jax.device_put(params, tg.named(mesh, tg.param_specs(m)))
        two = run(sp, put(prompt, mesh), put(valid, mesh), jax.random.key(4), 1.0, min_rows=8)
    np.testing.assert_array_equal(one["tokens_BN"], two["tokens_BN"])
    np.testing.assert_array_equal(one["mask_BN"], two["mask_BN"])
    # (Gemma 4's sharded forward rounds differently: 6e-5 in one entry of 768.)
    np.testing.assert_allclose(one["logp_BN"], two["logp_BN"], rtol=1e-4, atol=1e-4)
    assert int(one["steps"]) == int(two["steps"]) == ends.max()


def test_sampling_temperature_top_k_top_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    z = jnp.asarray(np.log(np.tile(probs, (20000, 1))), jnp.float32)
    draw = lambda **kw: np.asarray(sampling.draw(jax.random.key(0), z, jnp.float32(1.0), **kw))
    freq = lambda x: np.bincount(x, minlength=4) / len(x)
    np.testing.assert_allclose(freq(draw(top_k=0, top_p=1.0)), probs, atol=0.015)
    np.testing.assert_allclose(freq(draw(top_k=2, top_p=1.0)), [0.625, 0.375, 0, 0], atol=0.015)
    # Mass before each token: 0, 0.5, 0.8, 0.95. top-p keeps a token while that is < p.
    np.testing.assert_allclose(freq(draw(top_k=0, top_p=0.7)), [0.625, 0.375, 0, 0], atol=0.015)
    np.testing.assert_allclose(freq(draw(top_k=0, top_p=0.85)), [*probs[:3] / 0.95, 0], atol=0.015)
    assert freq(draw(top_k=0, top_p=0.4))[0] == 1.0
    greedy = sampling.draw(jax.random.key(0), z[:3], jnp.float32(0.0), 0, 1.0)
    np.testing.assert_array_equal(greedy, [0, 0, 0])
    # policy_logits divides by the temperature and forbids ids past the tokenizer's vocabulary
    pz = tg.policy_logits(jnp.asarray([[2.0, 4.0, 8.0]]), 2.0, n_valid=2)
    np.testing.assert_allclose(pz[0, :2], [1.0, 2.0])
    assert pz[0, 2] < -1e29


# ------------------------------------------------------------------------------ rewards


def test_reward_functions_on_hand_written_completions():
    answers = ["753", "753", "753", "753", "753", "01"]
    completions = ["753", " 753 ", "754", "7530", "", "01"]
    finished = np.array([True, True, True, False, True, False])
    cfg = tg.Config(grpo=tg.GRPOConfig(format_weight=0.1))
    funcs = tg.make_task(cfg, tg.CharTokenizer()).rewards  # the demo's
    correctness, fmt = funcs["correctness"][0], funcs["format"][0]
    np.testing.assert_array_equal(correctness(completions, answer=answers), [1, 1, 0, 0, 0, 1])
    np.testing.assert_array_equal(fmt(completions, finished=finished), [1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(fmt(["7+3", "=", "12"], finished=[True] * 3), [0, 0, 1])
    total, each = tg.score(funcs, completions, {"answer": answers}, finished)
    np.testing.assert_allclose(total, [1.1, 1.1, 0.1, 0, 0, 1.0], rtol=1e-6)
    assert set(each) == {"correctness", "format"}


def test_task_tokens_and_decoding():
    tok = tg.CharTokenizer()
    items = tg.problems(np.random.default_rng(0), 200, tg.TaskConfig(min_digits=1, max_digits=3))
    for prompt, answer in items:
        a, b = map(int, prompt[:-1].split("+"))
        assert prompt.endswith("=") and answer == str(a + b)[::-1]
        assert 1 <= len(str(a)) <= 3 and 1 <= len(str(b)) <= 3
    assert {len(p) for p, _ in items} == set(range(4, 9))   # prompts of every width occur
    assert tok.decode(tok.encode("12+345=")) == "12+345="
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("1x2")
    ids, valid = encode_prompts(tok, ["1+2=", "12+345="], 10)
    assert valid.sum(1).tolist() == [5, 8] and valid[:, -1].all() and ids[0, 5] == tok.bos_id
    comp = np.array([[5, 6, 2, 0], [5, 6, 7, 8]])
    texts, finished = tg.decode_completions(tok, comp, np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool))
    assert texts == ["23", "2345"] and finished.tolist() == [True, False]


# ------------------------------------------------------------------------------ advantages, losses


def test_group_advantages_by_hand():
    r = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5], np.float32)
    s = math.sqrt(1 / 3)   # sample std of (1, 0, 0, 1): sqrt(4 * 0.25 / 3)
    np.testing.assert_allclose(tg.group_advantages(r, 4, scale=True),
                               [0.5 / (s + 1e-4), -0.5 / (s + 1e-4), -0.5 / (s + 1e-4),
                                0.5 / (s + 1e-4), 0, 0, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(tg.group_advantages(r, 4, scale=False),
                               [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


# Four completions in two groups of two, up to three tokens, padded after their end. The second
# group's rewards are equal, so its advantages are 0. Ratios straddle both clip edges.
LOGP = np.array([[-1.0, -0.5, -2.0], [-0.3, -1.2, -9.0], [-0.8, -9.0, -9.0], [-1.5, -0.2, -0.4]])
OLD = np.array([[-1.4, -0.5, -1.9], [-0.1, -1.6, 0.0], [-0.9, 0.0, 0.0], [-1.5, -0.5, -0.2]])
REF = np.array([[-1.1, -0.7, -1.5], [-0.2, -1.0, 0.0], [-1.0, 0.0, 0.0], [-1.2, -0.3, -0.6]])
MASK = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], bool)
ADV = tg.group_advantages(np.array([1.0, 0.0, 0.5, 0.5], np.float32), 2, scale=True)


def hand_loss(loss: str, beta: float, lo: float, hi: float, N: int = 3):
    """The objectives written out term by term from the papers, in plain Python."""
    rows = []
    for i in range(4):
        T = [t for t in range(3) if MASK[i, t]]
        if loss == "gspo":
            s = math.exp(sum(LOGP[i, t] - OLD[i, t] for t in T) / len(T))
            ratios = {t: s for t in T}
        else:
            ratios = {t: math.exp(LOGP[i, t] - OLD[i, t]) for t in T}
        terms = {}
        for t in T:
            r, a = ratios[t], float(ADV[i])
            q = REF[i, t] - LOGP[i, t]
            terms[t] = -min(r * a, min(max(r, 1 - lo), 1 + hi) * a) + beta * (math.exp(q) - q - 1)
        rows.append(terms)
    n_tok = sum(len(t) for t in rows)
    if loss in ("grpo", "gspo"):
        return sum(sum(t.values()) / len(t) for t in rows) / 4
    if loss in ("bnpo", "dapo"):
        return sum(sum(t.values()) for t in rows) / n_tok
    return sum(sum(t.values()) for t in rows) / (4 * N)   # dr_grpo


@pytest.mark.parametrize("loss", ["grpo", "bnpo", "dr_grpo", "dapo", "gspo"])
@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_each_loss_equals_the_hand_computation(loss, beta):
    g = tg.GRPOConfig(loss=loss, beta=beta, max_new_tokens=3)
    lo, hi = tg.clip_range(g)
    assert (lo, hi) == tg.PAPER_EPS[loss]
    got, sums = tg.policy_loss(jnp.asarray(LOGP, jnp.float32), jnp.asarray(OLD, jnp.float32),
                               jnp.asarray(ADV), jnp.asarray(MASK), g,
                               ref_BN=jnp.asarray(REF, jnp.float32) if beta else None,
                               n_tokens=jnp.float32(MASK.sum()))
    assert float(got) == pytest.approx(hand_loss(loss, beta, lo, hi), rel=1e-5, abs=1e-7)
    assert float(sums["tokens"]) == 9
    if beta:
        kl = sum(math.exp(REF[i, t] - LOGP[i, t]) - (REF[i, t] - LOGP[i, t]) - 1
                 for i in range(4) for t in range(3) if MASK[i, t])
        assert float(sums["kl"]) == pytest.approx(kl, rel=1e-5)
    else:
        assert "kl" not in sums
    # Padding is ignored: garbage in the padded slots changes nothing.
    junk = np.where(MASK, LOGP, 123.0).astype(np.float32)
    old_junk = np.where(MASK, OLD, -77.0).astype(np.float32)
    again, _ = tg.policy_loss(jnp.asarray(junk), jnp.asarray(old_junk),
                              jnp.asarray(ADV), jnp.asarray(MASK), g,
                              ref_BN=jnp.asarray(REF, jnp.float32) if beta else None,
                              n_tokens=jnp.float32(MASK.sum()))
    assert float(again) == pytest.approx(float(got), rel=1e-6)


def test_the_all_equal_group_contributes_nothing_without_kl():
    g = tg.GRPOConfig(loss="bnpo")
    grad = jax.grad(lambda lp: tg.policy_loss(lp, jnp.asarray(OLD, jnp.float32), jnp.asarray(ADV),
                                              jnp.asarray(MASK), g,
                                              n_tokens=jnp.float32(9))[0])
    gr = np.asarray(grad(jnp.asarray(LOGP, jnp.float32)))
    assert np.all(gr[2:] == 0) and np.all(gr[~MASK] == 0)   # the equal group, the padding
    # Row 0's first token has ratio e^0.4 > 1.2 with A > 0: clipped, so no gradient either.
    assert gr[0, 0] == 0 and np.all(gr[0, 1:] != 0) and np.all(gr[1, :2] != 0)


def test_gspo_equals_grpo_on_single_token_completions_and_clip_counts():
    # One token per completion: the sequence ratio is the token ratio, so the objectives and
    # their gradients coincide (for the same clip range). Ratios: 0.7, 0.9, 1.1, 1.3.
    ratios = np.array([0.7, 0.9, 1.1, 1.3] * 2)
    adv = np.array([-1.0] * 4 + [1.0] * 4, np.float32)
    old = np.full((8, 3), -1.0, np.float32)
    logp = old + np.log(ratios)[:, None].astype(np.float32)
    mask = np.zeros((8, 3), bool)
    mask[:, 0] = True

    def run(loss, lp, m):
        g = tg.GRPOConfig(loss=loss, eps_low=0.2, eps_high=0.2)
        f = lambda x: tg.policy_loss(x, jnp.asarray(old), jnp.asarray(adv), jnp.asarray(m), g,
                                     n_tokens=jnp.float32(m.sum()))
        (val, sums), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp))
        return float(val), jax.device_get(sums), np.asarray(grad)

    gspo, s_gspo, g_gspo = run("gspo", logp, mask)
    grpo, s_grpo, g_grpo = run("grpo", logp, mask)
    assert gspo == pytest.approx(grpo, rel=1e-6)
    np.testing.assert_allclose(g_gspo, g_grpo, rtol=1e-6, atol=1e-8)
    # Clipped from below: ratio < 0.8 with A < 0 (row 0). From above: ratio > 1.2 with A > 0
    # (row 7). Rows 4 (0.7, A > 0) and 3 (1.3, A < 0) are outside the range but the min picks
    # the unclipped term: not counted, as in TRL.
    for s in (s_gspo, s_grpo):
        assert float(s["clip_ratio/low_mean"]) == 1
        assert float(s["clip_ratio/high_mean"]) == 1
        assert float(s["clip_ratio/region_mean"]) == 2
    # Where they must differ: several tokens whose ratios disagree.
    m3 = np.ones((8, 3), bool)
    lp3 = logp + np.array([0.0, 0.3, -0.3], np.float32)
    assert run("gspo", lp3, m3)[0] != pytest.approx(run("grpo", lp3, m3)[0], rel=1e-3)


# ------------------------------------------------------------------------------ step, sharding


def rollout_batch(cfg, seed=0):
    """A fixed, made-up rollout batch in the train step's format (no sampling involved)."""
    tok, g = tg.CharTokenizer(), cfg.grpo
    rng = np.random.default_rng(seed)
    items = tg.problems(rng, g.prompts_per_step * g.group_size, cfg.task)
    prompt, valid = encode_prompts(tok, [p for p, _ in items], tg.prompt_width(cfg.task))
    texts = [a if rng.random() < 0.5 else a[::-1] + "1" for _, a in items]
    comp, mask = tg.encode_completions(tok, texts, g.max_new_tokens)
    reward = np.array([float(t == a) for t, (_, a) in zip(texts, items)], np.float32)
    return {"prompt": prompt, "prompt_valid": valid, "completion": comp, "mask": mask,
            "old_logp": rng.normal(-1.5, 0.3, comp.shape).astype(np.float32),
            "adv": tg.group_advantages(reward, g.group_size, True),
            "ref_logp": rng.normal(-1.5, 0.3, comp.shape).astype(np.float32),
            "n_tokens": np.float32(mask.sum())}


def step_once(cfg, params, batch, mesh):
    with jax.set_mesh(mesh):
        st = tg.train_state(cfg, mesh, tg.make_optimizer(cfg.grpo))
        state = st.from_params(jax.device_put(params, st.shardings["params"]))
        b = {k: (put(v, mesh) if np.ndim(v) else v) for k, v in batch.items()}
        fn = st.jit(partial(tg.train_step, cfg=cfg, n_valid=16))
        state, m = fn(state, b)
        return jax.device_get(state["params"]), jax.device_get(m)


def small_cfg(**grpo):
    g = dict(prompts_per_step=4, group_size=4, max_new_tokens=5, beta=0.05, lr=1e-2)
    return tg.Config(model=SMALL, grpo=tg.GRPOConfig(**(g | grpo)),
                     task=tg.TaskConfig(max_digits=3, eval_prompts=8))


def test_sharded_and_accumulated_step_equals_one_plain_step():
    """One optimiser step on 1 device == on a 2x2x2 mesh in 2 microbatches. DAPO, whose
    normaliser spans the whole batch, is the variant that accumulation could get wrong."""
    cfg = small_cfg(loss="dapo")
    params, batch = perturbed_params(SMALL, seed=7), rollout_batch(cfg)
    ref_p, ref_m = step_once(cfg, params, batch, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]))
    c = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, microbatches=2))
    p, m = step_once(c, params, batch, make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
    for k in ("kl", "entropy", "clip_ratio/region_mean", "grad_norm"):
        assert float(m[k]) == pytest.approx(float(ref_m[k]), rel=1e-4, abs=1e-7), k
    for a, b in zip(jax.tree.leaves(ref_p), jax.tree.leaves(p)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_rollout_split_into_updates_equals_a_naive_loop():
    """--grpo.rollout-batch 32 in updates of 4 prompts x 4, mu 2: four optimiser steps, each on
    one half of the rollout in order, pass after pass, DAPO's normaliser counting that half's
    tokens; against a loop written here over the same slices."""
    cfg = small_cfg(loss="dapo", prompts_per_step=4, mu=2, rollout_batch=32)
    g = cfg.grpo
    big = dataclasses.replace(g, prompts_per_step=8)
    params = perturbed_params(SMALL, seed=8)
    batch = rollout_batch(dataclasses.replace(cfg, grpo=big))
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2), jax.devices()[:4])
    with jax.set_mesh(mesh):
        st = tg.train_state(cfg, mesh, tg.make_optimizer(g))
        fn = st.jit(partial(tg.train_step, cfg=cfg, n_valid=16))
        fresh = lambda: st.from_params(jax.device_put(params, st.shardings["params"]))
        state, passes = tg.update(fn, fresh(), batch, g, mesh)
        naive, seen = fresh(), []
        for _ in range(2):
            for lo in (0, 16):
                half = {k: put(v[lo:lo + 16], mesh) for k, v in batch.items() if k != "n_tokens"}
                n = np.float32(batch["mask"][lo:lo + 16].sum())
                naive, m = fn(naive, half | {"n_tokens": n})
                seen.append(m)
    assert len(passes) == 4 and int(state["step"]) == 4
    for a, b in zip(jax.tree.leaves(jax.device_get(state["params"])),
                    jax.tree.leaves(jax.device_get(naive["params"]))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for m, n in zip(passes, seen):
        for k in ("grad_norm", "kl", "clip_ratio/region_mean"):
            assert float(m[k]) == pytest.approx(float(n[k]), rel=1e-5, abs=1e-8), k
    # Four different steps (a repeated slice would repeat a gradient's norm).
    assert len({round(float(m["grad_norm"]), 6) for m in passes}) == 4


@pytest.mark.parametrize("knobs", ["small", "gemma2", "gemma4_ple"])
def test_packed_rollouts_score_as_the_padded_ones(knobs):
    """common/task.py `pack` drops the pads and lays several sequences in a row: the forward
    over the packed rows gives each completion token the log-prob and entropy of the padded
    forward (Gemma's windows shorter than a row, its shared keys and per-layer inputs included),
    and the rows hold every real token once and nothing else."""
    m = {"small": SMALL, "gemma2": GEMMA2, "gemma4_ple": GEMMA4_PLE}[knobs]
    params = perturbed_params(m, seed=3)
    prompt, valid = left_padded([6, 3, 1, 4, 2, 5, 6, 1], 6, m.vocab_size)
    comp = np.random.default_rng(0).integers(3, 14, (8, 8)).astype(np.int32)
    n_B = np.array([8, 1, 3, 5, 2, 8, 4, 6])
    mask = np.arange(8) < n_B[:, None]
    f = jax.jit(partial(tg.completion_logps, cfg=m, temperature=0.7, n_valid=14))
    ref = f(params, {"prompt": prompt, "prompt_valid": valid, "completion": comp})
    rows = pack(prompt, valid, comp, n_B)
    assert rows["tokens"].shape == (5, 13)       # 8 rows of 13 columns in 5
    assert (rows["segment"] > 0).sum() == valid.sum() + (n_B - 1).sum()
    for b in range(8):                           # each sequence whole, in order, once
        np.testing.assert_array_equal(rows["tokens"][rows["segment"] == b + 1], np.concatenate(
            [prompt[b][valid[b]], comp[b, :n_B[b] - 1]]))
    got = f(params, {k: rows[k] for k in ("tokens", "positions", "segment")} | {
        "where": rows["where_all"], "completion": comp})
    for a, b in zip(ref[:2], got[:2]):
        np.testing.assert_allclose(np.asarray(a)[mask], np.asarray(b)[mask], rtol=1e-5, atol=2e-5)


def test_a_packed_rollout_updates_as_the_padded_one():
    """Two updates of a rollout (--grpo.rollout-batch), each in two microbatches on a mesh of
    4 batch shards, mu 2, short answers in a budget of 24: the steps on the packed rows (each update's microbatches packed
    apart, as accumulate splits them) equal the steps on the padded rows."""
    cfg = small_cfg(loss="dapo", mu=2, rollout_batch=32, microbatches=2, max_new_tokens=24)
    g = cfg.grpo
    params = perturbed_params(SMALL, seed=8)
    batch = rollout_batch(dataclasses.replace(cfg, grpo=dataclasses.replace(g, prompts_per_step=8)))
    rows = pack(batch["prompt"], batch["prompt_valid"], batch["completion"],
                batch["mask"].sum(1), parts=2, microbatches=2, multiple=4)
    assert len(rows["tokens"]) < 32 and len(rows["tokens"]) % 16 == 0
    packed = {k: v for k, v in batch.items() if k not in ("prompt", "prompt_valid")} | {
        k: v for k, v in rows.items() if k != "where_all"}
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    with jax.set_mesh(mesh):
        st = tg.train_state(cfg, mesh, tg.make_optimizer(g))
        fn = st.jit(partial(tg.train_step, cfg=cfg, n_valid=16))
        fresh = lambda: st.from_params(jax.device_put(params, st.shardings["params"]))
        (a, ma), (b, mb) = (tg.update(fn, fresh(), x, g, mesh) for x in (batch, packed))
    for x, y in zip(ma, mb):
        for k in ("grad_norm", "kl", "entropy", "clip_ratio/region_mean"):
            assert float(x[k]) == pytest.approx(float(y[k]), rel=1e-5, abs=1e-7), k
    for x, y in zip(jax.tree.leaves(jax.device_get(a["params"])),
                    jax.tree.leaves(jax.device_get(b["params"]))):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_an_update_on_the_longest_completion_s_columns_equals_one_on_the_budget(loss):
    """The loop cuts a rollout's columns after its longest completion (rounded up to a power
    of two, at least 8) before the log-probs and the update: with a budget of 24 and answers
    of a few tokens, the step on 8 columns equals the step on all 24, Dr. GRPO's constant
    (the budget, not the columns) included."""
    cfg = small_cfg(loss=loss, max_new_tokens=24)
    params, batch = perturbed_params(SMALL, seed=9), rollout_batch(cfg)
    assert batch["mask"].shape[1] == 24 and not batch["mask"][:, 8:].any()
    cut = batch | {k: batch[k][:, :8] for k in ("completion", "mask", "old_logp", "ref_logp")}
    mesh = make_mesh(MeshConfig(fsdp=2, tensor=2), jax.devices()[:4])
    (p, m), (q, n) = step_once(cfg, params, batch, mesh), step_once(cfg, params, cut, mesh)
    # grad_norm holds the loss's scale (which Adam's update would hide); the parameters
    # after one Adam step at lr 1e-2 differ in the last bits where a gradient is near 0.
    for k in ("grad_norm", "kl", "entropy", "clip_ratio/region_mean"):
        assert float(m[k]) == pytest.approx(float(n[k]), rel=1e-5, abs=1e-8), k
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5)


# ------------------------------------------------------------------------------ main


def grpo_config(run_dir, steps, mesh=MeshConfig(fsdp=-1), **kw):
    """A run small enough for a test: 1-digit sums, a ~30k-parameter model."""
    model = dataclasses.replace(SMALL, remat="none")
    g = dict(steps=steps, prompts_per_step=8, group_size=4, max_new_tokens=3, lr=3e-3,
             warmup_steps=1, eval_every=2, beta=0.04, mu=2)
    return tg.Config(model=model, grpo=tg.GRPOConfig(**(g | kw.pop("grpo", {}))),
                     warm=tg.WarmStartConfig(**({"max_steps": 0} | kw.pop("warm", {}))),
                     task=tg.TaskConfig(min_digits=1, max_digits=1, eval_prompts=32),
                     mesh=mesh, checkpoint=CheckpointConfig(every=2, keep=2),
                     run_dir=str(run_dir), **kw)


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_resumed_equals_uninterrupted_and_logs_trl_metrics(tmp_path, capsys):
    full = tg.main(grpo_config(tmp_path / "a", 3))
    tg.main(grpo_config(tmp_path / "b", 2))
    resumed = tg.main(grpo_config(tmp_path / "b", 3))
    assert "resumed from step 2" in capsys.readouterr().out
    for a, b in zip(jax.tree.leaves(jax.device_get(full["state"])),
                    jax.tree.leaves(jax.device_get(resumed["state"]))):
        np.testing.assert_array_equal(a, b)   # bitwise: the state, the reference included
    steps = [r for r in metrics(tmp_path / "a") if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for key in ("reward", "reward_std", "rewards/correctness/mean", "rewards/format/mean",
                "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "completions/mean_length", "completions/max_length", "entropy",
                "frac_reward_zero_std", "rollout_tokens_per_s"):
        assert key in steps[0], key
    assert "eval_reward" in steps[1] and "eval_reward" not in steps[0]
    timing = ("ms_per_step", "rollout_tokens_per_s", "mfu")   # and the phases' time/..._ms
    assert {"time/rollout_ms", "time/rewards_ms", "time/logps_ms", "time/update_ms"} <= set(steps[0])
    drop = lambda rs: [{k: v for k, v in r.items() if k not in timing and not k.startswith(
        "time/")} for r in rs]
    assert drop(steps) == drop([r for r in metrics(tmp_path / "b") if "reward" in r])
    assert steps[1]["kl"] > 0 and steps[0]["completions/max_length"] <= 3


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def dense_run(tmp_path_factory, request):
    """A train_dense.py run directory holding one (untrained) checkpoint and its config: a
    Llama-shaped model, or the same with Gemma 2's knobs."""
    root = tmp_path_factory.mktemp("dense")
    model = dataclasses.replace(GEMMA2 if request.param == "gemma2" else SMALL, vocab_size=512)
    stdlib = sysconfig.get_paths()["stdlib"]
    files = ("argparse.py", "textwrap.py", "string.py", "shlex.py", "fnmatch.py")
    data = prepare([os.path.join(stdlib, f) for f in files], str(root / "data"), vocab_size=400)
    cfg = td.Config(model=dense(model), data=DataConfig(path=data), run_dir=str(root / "run"))
    check_run_config(cfg.run_dir, dataclasses.asdict(cfg))
    mesh = make_mesh(MeshConfig(fsdp=-1))
    params = perturbed_params(model, seed=11)
    with jax.set_mesh(mesh):
        state = td.train_state(cfg, mesh).from_params(jax.tree.map(jnp.copy, params))
        with Checkpointer(cfg.run_dir, CheckpointConfig()) as ckpt:
            ckpt.save(7, state, force=True)
    return cfg, params


def test_init_from_a_train_dense_checkpoint(dense_run, tmp_path):
    dcfg, dparams = dense_run
    cfg = grpo_config(tmp_path / "g", 0, init_from=dcfg.run_dir, grpo=dict(max_new_tokens=6))
    out = tg.main(cfg)
    got = jax.device_get(out["state"]["params"])
    for a, b in zip(jax.tree.leaves(dparams), jax.tree.leaves(got)):
        np.testing.assert_array_equal(a, b)
    saved = json.load(open(tmp_path / "g" / "config.json"))
    assert saved["model"]["vocab_size"] == 512 and saved["init_from"] == dcfg.run_dir
    with pytest.raises(FileNotFoundError, match="--init-from"):
        tg.main(grpo_config(tmp_path / "h", 0, init_from=str(tmp_path / "nowhere")))
    if dcfg.model.sliding_window:  # a Gemma run is GRPO-trained, its knobs kept
        out = tg.main(grpo_config(tmp_path / "t", 1, init_from=dcfg.run_dir))
        assert out["state"]["params"]["layers"]["attn_post_norm"].shape == (2, 32)
        assert np.isfinite(out["eval"][-1][1]) and json.load(open(
            tmp_path / "t" / "config.json"))["model"]["global_every"] == 2


@pytest.mark.parametrize("change,flag", [
    (dict(grpo=dict(group_size=1)), "--grpo.group-size"),
    (dict(grpo=dict(prompts_per_step=3)), "--grpo.prompts-per-step"),
    (dict(grpo=dict(max_new_tokens=2)), "--grpo.max-new-tokens"),
    (dict(grpo=dict(rollout_batch=48)), "--grpo.rollout-batch"),  # not whole updates of 32
    (dict(grpo=dict(temperature=0.0)), "--grpo.temperature"),
    (dict(grpo=dict(top_p=0.0)), "--grpo.top-p"),
    (dict(mesh=MeshConfig(fsdp=2, tensor=4)), "--model.n-kv-heads"),
    (dict(mesh=MeshConfig(fsdp=3)), "--mesh.fsdp"),
])
def test_bad_config_is_a_clear_error_before_compiling(change, flag):
    cfg = grpo_config("/nonexistent", 1, **{k: v for k, v in change.items() if k == "mesh"},
                      grpo=change.get("grpo", {}))
    with pytest.raises((tg.ConfigError, MeshError)) as e:
        tg.validate(cfg, jax.device_count(), tg.CharTokenizer())
    assert flag in str(e.value)


def test_cli_presets():
    cfg = tg.cli(["tiny-gspo", "--grpo.beta", "0.1"])
    assert cfg.grpo.loss == "gspo" and cfg.grpo.beta == 0.1
    assert tg.clip_range(cfg.grpo) == (3e-4, 4e-4)


def test_short_grpo_run_raises_the_held_out_reward(tmp_path):
    """GRPO alone, from random weights (no warm start), with the format reward weighted 1: the
    greedy held-out reward rises from near 0 by learning to answer with digits and stop, and
    correctness starts to follow. (The demo, `make train-grpo`, shows correctness itself.)"""
    out = tg.main(grpo_config(tmp_path, 20, grpo=dict(eval_every=10, format_weight=1.0)))
    (s0, r0), (s1, r1) = out["eval"][0], out["eval"][-1]
    assert (s0, s1) == (0, 20)
    assert r0 < 0.3 and r1 >= r0 + 0.7, out["eval"]


def test_warm_start_stops_at_the_target_and_is_never_repeated(tmp_path, capsys):
    cfg = grpo_config(tmp_path, 0, warm=dict(max_steps=300, check_every=10, batch_size=32,
                                             lr=1e-2, target_reward=0.3))
    out = tg.main(cfg)
    warm = [r for r in metrics(tmp_path) if "warm_step" in r]
    assert warm[-1]["warm_step"] == out["warm_start_steps"] < 300
    assert warm[-1]["reward"] >= 0.3 > max(r["reward"] for r in warm[:-1])
    again = tg.main(dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, steps=1)))
    assert "resumed from step 0" in capsys.readouterr().out and "warm_start_steps" not in again


@pytest.mark.parametrize("dtype, beta", [("bfloat16", 0.0), ("float32", 0.0), ("bfloat16", 0.04)])
def test_bfloat16_first_update_is_on_policy(tmp_path, monkeypatch, dtype, beta):
    """In bfloat16 on an accelerator the KV-cache decode and the training forward round
    differently, enough to trip GSPO's 3e-4/4e-4 clip on the first, on-policy pass. The decode's
    log-probs are shifted here by 0.01 as such rounding might: in bfloat16 the ratio's "old"
    log-probs are the training forward's, so nothing clips; in float32 (where the two agree
    to 1e-6) they are the decode's, and the shift shows as clipping. With a reference too
    (one program makes both): were the two swapped, step 2's old log-probs would be the
    unmoved reference's, and clip."""
    real = tg.rollout
    monkeypatch.setattr(tg, "rollout", lambda *a, **k: (lambda out: out | {
        "logp_BN": out["logp_BN"] - 0.01})(real(*a, **k)))
    cfg = grpo_config(tmp_path, 2, grpo={"loss": "gspo", "beta": beta, "mu": 1},
                      warm={"max_steps": 20, "check_every": 10})
    tg.main(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype)))
    clip = [r["clip_ratio/region_mean"] for r in metrics(tmp_path) if "clip_ratio/region_mean" in r]
    assert len(clip) == 2
    assert (max(clip) == 0.0) if dtype == "bfloat16" else (min(clip) > 0), clip
    kl = [r["kl"] for r in metrics(tmp_path) if "kl" in r]
    assert (len(kl) == 2 and kl[1] > 0) if beta else not kl, kl
