"""Preference tuning (--data.format dpo, issue 41): pairs as rows, the DPO, IPO and SimPO
losses against a hand computation, the frozen reference, sharding, a short run that learns
the preference, and bad input refused before anything compiles."""
import contextlib
import dataclasses
import io
import json
import math
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm

import train_dense as td
from common import data as D
from common.mesh import MeshConfig, make_mesh
from tests.test_sft import SMALL, perturbed_params, tokenizer, write_jsonl  # noqa: F401

ROW = 32  # positions per row: 16 for the chosen answer's example, 16 for the rejected one's


def random_pairs(n, seed=0):
    """n pairs sharing a random prompt of 3-6 tokens, with answers of 2-5 tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(3, SMALL.vocab_size, rng.integers(3, 7))
        pair = []
        for _ in range(2):
            answer = rng.integers(3, SMALL.vocab_size, rng.integers(2, 6))
            tokens = np.concatenate([prompt, answer]).astype(np.int32)
            pair.append(D.Example(tokens, np.arange(len(tokens)) >= len(prompt)))
        out.append(tuple(pair))
    return out


def as_batch(packed):
    return {f: jnp.asarray(getattr(packed, f)) for f in D.PACKED_FIELDS}


def logps_by_hand(params, pairs, model):
    """[n, 2]: each answer's summed log p(token), its example run alone through `forward`."""
    out = np.zeros((len(pairs), 2))
    for i, pair in enumerate(pairs):
        for j, ex in enumerate(pair):
            logits = np.asarray(td.forward(params, jnp.asarray(ex.tokens[None, :-1]), model),
                                np.float64)[0]
            logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                   keepdims=True)) - logits.max(-1, keepdims=True)
            lp = logp[np.arange(len(ex.tokens) - 1), ex.tokens[1:]]
            out[i, j] = lp[ex.trained[1:]].sum()
    return out


def dpo_cfg(loss="dpo", model=SMALL, **train):
    return td.Config(model=model, train=td.TrainConfig(**train),
                     data=D.DataConfig(format="dpo"), dpo=td.DPOConfig(loss=loss),
                     init_from="runs/somewhere")


def test_pairs_are_rows_of_two_segments(tokenizer, tmp_path):
    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    rows = [{"prompt": "def f(x):", "chosen": " return x", "rejected": " pass"},
            {"messages": [{"role": "user", "content": "Name a vowel."},
                          {"role": "assistant", "content": "a"},
                          {"role": "user", "content": "Another?"}],
             "chosen": "e", "rejected": "b, not one"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    ds = D.load_dataset(D.DataConfig(format="dpo", path=path, eval_path=path,
                                     tokenizer=tokenizer), seq_len=256)
    assert isinstance(ds, D.PreferenceDataset) and ds.train.num_rows == 2
    for r, (chosen, rejected) in enumerate([(" return x", " pass"), ("e", "b, not one")]):
        seg, w, tgt = ds.train.segment_ids[r], ds.train.weights[r], ds.train.targets[r]
        assert set(seg[:128]) <= {0, 1} and set(seg[128:]) <= {0, 2}
        assert ds.train.positions[r, 128] == 0  # the rejected answer's example starts afresh
        for s, want in ((1, chosen), (2, rejected)):
            trained = tgt[(seg == s) & (w > 0)].tolist()
            assert trained[-1] == sp.eos_id() and sp.decode(trained[:-1]) == want
    # Only the last answer is trained: the earlier assistant turn is context in both.
    assert sp.decode(ds.eval_examples[1].prompt.tolist()).endswith(
        "<|assistant|>\na<|user|>\nAnother?\n<|assistant|>\n")
    assert sp.decode(ds.eval_examples[1].answer[:-1].tolist()) == "e"


@pytest.mark.parametrize("loss", ["dpo", "ipo", "simpo"])
def test_loss_equals_a_hand_computation(loss):
    params, ref = perturbed_params(SMALL, 1), perturbed_params(SMALL, 2)
    pairs = random_pairs(5)
    batch = as_batch(D.pack_pairs(pairs, ROW))
    n = 4.0  # any divisor: microbatches divide by the whole batch's pairs
    cfg = dpo_cfg(loss)
    got, aux = jax.jit(partial(td.dpo_loss, cfg=cfg, n=n))(params, batch,
                                                           ref=None if loss == "simpo" else ref)
    s, s_ref = logps_by_hand(params, pairs, SMALL), logps_by_hand(ref, pairs, SMALL)
    length = np.array([[ex.trained[1:].sum() for ex in pair] for pair in pairs])
    d = cfg.dpo
    if loss == "simpo":
        r = d.simpo_beta * s / length
        margin = r[:, 0] - r[:, 1]
        want = np.log1p(np.exp(-(margin - d.simpo_gamma)))
    else:
        r = d.beta * (s - s_ref)
        margin = r[:, 0] - r[:, 1]
        want = (np.log1p(np.exp(-margin)) if loss == "dpo"
                else (margin / d.beta - 1 / (2 * d.beta)) ** 2)
    assert float(got) == pytest.approx(want.sum() / n, rel=1e-4)
    assert float(aux["dpo"]["reward_margin"]) == pytest.approx(margin.sum() / n, rel=1e-4)
    assert float(aux["dpo"]["accuracy"]) == pytest.approx((margin > 0).sum() / n)  # no ties
    assert 0 < (margin > 0).sum() < len(pairs)  # the accuracy is not trivially 0 or 1
    if loss != "simpo":
        kl = ((s - s_ref)[:, 0] / length[:, 0]).sum() / n
        assert float(aux["dpo"]["kl_chosen"]) == pytest.approx(kl, rel=1e-4)
    else:
        assert "kl_chosen" not in aux["dpo"]


def step_fn(cfg, mesh):
    st = td.train_state(cfg, mesh)
    return st, st.jit(partial(td.train_step, cfg=cfg, tx=st.tx))


def test_the_reference_at_step_0_is_the_starting_model():
    cfg = dpo_cfg(batch_size=8, seq_len=ROW)
    params, pairs = perturbed_params(SMALL), random_pairs(8)
    batch = as_batch(D.pack_pairs(pairs, ROW))
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        st, step = step_fn(cfg, mesh)
        state = st.from_params(jax.tree.map(jnp.copy, params))
        ref_logps = np.asarray(jax.jit(partial(td.sequence_logps, cfg=SMALL))(
            state["ref"], batch)[0])
        np.testing.assert_allclose(ref_logps, logps_by_hand(params, pairs, SMALL), rtol=1e-4)
        state, m = step(state, batch)
        # Policy == reference: no margin, loss log 2, nothing drifted; then the policy moves
        # and the reference stays where it was.
        assert float(m["loss"]) == pytest.approx(math.log(2), rel=1e-5)
        assert float(m["reward_margin"]) == 0 and float(m["kl_chosen"]) == 0
        assert float(m["accuracy"]) == 0.5  # ties count half
        for a, b in zip(jax.tree.leaves(state["ref"]), jax.tree.leaves(params)):
            np.testing.assert_array_equal(a, b)
        state, m = step(state, batch)
        assert float(m["kl_chosen"]) != 0 and float(m["loss"]) < math.log(2)


def test_sharded_equals_one_device():
    cfg = dpo_cfg(batch_size=8, seq_len=ROW, lr=1e-2, warmup_steps=1)
    params = perturbed_params(SMALL)
    batches = [as_batch(D.pack_pairs(random_pairs(8, seed), ROW)) for seed in (1, 2)]
    runs = []
    for mesh in (make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]),
                 make_mesh(MeshConfig(fsdp=8))):
        with jax.set_mesh(mesh):
            st, step = step_fn(cfg, mesh)
            state, ms = st.from_params(jax.tree.map(jnp.copy, params)), []
            for b in batches:
                state, m = step(state, b)
                ms.append(jax.device_get(m))
            runs.append((ms, jax.device_get(state["params"])))
    (m1, p1), (m8, p8) = runs
    for a, b in zip(m1, m8):
        for k in ("loss", "reward_margin", "accuracy", "kl_chosen", "grad_norm"):
            assert float(a[k]) == pytest.approx(float(b[k]), rel=1e-4, abs=1e-6), k
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p8)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4)  # Adam: updates of ~lr


def low_over_high(n, seed):
    """Pairs whose chosen answer is a token of the vocabulary's lower half and whose rejected
    one is of its upper half: a preference a model can learn, and show on pairs it never saw."""
    rng = np.random.default_rng(seed)
    V = SMALL.vocab_size
    return [tuple(D.Example(np.append(prompt, a).astype(np.int32), np.arange(5) >= 4)
                  for a in (rng.integers(3, V // 2), rng.integers(V // 2, V)))
            for prompt in rng.integers(3, V, (n, 4))]


def test_a_short_run_learns_the_preference():
    cfg = dpo_cfg(batch_size=16, seq_len=16, lr=1e-2, warmup_steps=2, steps=40,
                  schedule="constant")
    cfg = dataclasses.replace(cfg, dpo=td.DPOConfig(beta=0.5))
    train = D.pack_pairs(low_over_high(640, 0), 16)
    held = as_batch(D.pack_pairs(low_over_high(64, 1), 16))
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    accuracy = jax.jit(lambda p, ref: td.dpo_loss(p, held, cfg, ref, n=64)[1]["dpo"]["accuracy"])
    with jax.set_mesh(mesh):
        st, step = step_fn(cfg, mesh)
        state = st.from_params(perturbed_params(SMALL))
        before = float(accuracy(state["params"], state["ref"]))
        for i in range(cfg.train.steps):
            rows = np.arange(16 * i, 16 * (i + 1)) % train.num_rows
            state, m = step(state, {f: jnp.asarray(getattr(train, f)[rows])
                                    for f in D.PACKED_FIELDS})
        after = float(accuracy(state["params"], state["ref"]))
    assert before == 0.5 and after >= 0.9, (before, after)  # policy == reference: all ties


def test_bad_input_is_refused_before_compiling(tmp_path):
    cfg = dataclasses.replace(dpo_cfg(batch_size=8, seq_len=32), init_from="")
    with pytest.raises(td.ConfigError, match="--data.format dpo needs --init-from RUN_DIR or "
                                             "--init-from-hf"):
        td.validate(cfg, 8)
    td.validate(dataclasses.replace(cfg, init_from_hf="hf/x"), 8)
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"},
                                                {"prompt": "a", "chosen": "b"}])
    with pytest.raises(D.DataError, match="bad.jsonl, line 2: field 'rejected' is missing"):
        D.read_preference_jsonl(path)
    with pytest.raises(SystemExit):
        td.cli(["tiny-dpo", "--dpo.loss", "dop"])
    assert td.cli(["tiny-dpo", "--dpo.loss", "simpo"]).dpo.loss == "simpo"
    with pytest.raises(td.ConfigError, match="--dpo.beta -1.0: must be > 0"):
        td.validate(dataclasses.replace(cfg, dpo=td.DPOConfig(beta=-1.0)), 8)


def pretrained_and_pairs(tokenizer, tmp_path):
    """A DPO config --init-from a 1-step pretraining run, on 40 sums with off-by-one rejects."""
    import os
    from common.checkpoint import CheckpointConfig
    model = dataclasses.replace(SMALL, vocab_size=512, loss_chunk=16)
    train = dict(batch_size=8, warmup_steps=1, lr=3e-3, log_every=1, eval_batches=1,
                 sample_tokens=4)
    pre = td.Config(model=model, train=td.TrainConfig(steps=1, **train, seq_len=32),
                    data=D.DataConfig(path=os.path.dirname(tokenizer)),
                    run_dir=str(tmp_path / "pre"), checkpoint=CheckpointConfig(every=1))
    td.main(pre)
    rng = np.random.default_rng(0)
    rows = [{"prompt": f"{a}+{b}=", "chosen": f"{a + b}", "rejected": f"{a + b + 1}"}
            for a, b in rng.integers(0, 50, (40, 2))]
    dpo = td.Config(model=model, train=td.TrainConfig(steps=2, eval_every=2, eval_samples=2,
                                                      **train, seq_len=32),
                    data=D.DataConfig(format="dpo", path=write_jsonl(tmp_path / "p.jsonl", rows),
                                      eval_fraction=0.2),
                    run_dir=str(tmp_path / "dpo"), init_from=pre.run_dir,
                    checkpoint=CheckpointConfig(every=2))
    return dpo


@pytest.fixture(scope="module")
def kept_reference_run(tokenizer, tmp_path_factory):
    """The pretraining run and the 2-step DPO run from it (the reference kept in the state),
    made once for the file: both tests below need this same run. (config, result, its log)"""
    dpo = pretrained_and_pairs(tokenizer, tmp_path_factory.mktemp("kept"))
    with contextlib.redirect_stdout(io.StringIO()) as log:
        out = td.main(dpo)
    return dpo, out, log.getvalue()


def test_preference_tuning_from_a_pretraining_run(kept_reference_run, capsys):
    """The loop end to end: --init-from a run, held-out figures before the first step and at
    each eval, greedy answers, and a resume that keeps the reference."""
    dpo, out, log = kept_reference_run
    assert "data: dpo train: 32 pairs in 32 rows of 32" in log
    # Before the first step the policy is the reference: every pair a tie.
    assert "eval step 0 | eval_loss 0.693 | eval_accuracy 0.500 | eval_kl_chosen 0.000" in log
    assert [s for s, _ in out["evals"]] == [0, 2] and len(out["samples"]) == 2
    assert out["eval_kl_chosen"] != 0 and "held-out answers exactly right" in log
    again = td.main(dataclasses.replace(dpo, train=dataclasses.replace(dpo.train, steps=3)))
    assert "resumed from step 2" in capsys.readouterr().out and again["final_step"] == 3


def test_precomputed_reference_trains_as_the_kept_one(kept_reference_run, tmp_path):
    """--dpo.precompute-ref: the start's log-probs of every training and held-out pair made
    once and saved in the run; no reference copy in the state; the same run as one that keeps
    the reference; a resume reads them back, one that wants more steps is refused."""
    kept, a, _ = kept_reference_run
    pre = dataclasses.replace(kept, run_dir=str(tmp_path / "pre-ref"),
                              dpo=td.DPOConfig(precompute_ref=True))
    b = td.main(pre)
    assert "ref" in a["state"] and "ref" not in b["state"]
    assert os.path.isfile(os.path.join(pre.run_dir, "ref_logps.npz"))
    for x, y in zip(jax.tree.leaves(jax.device_get(a["state"]["params"])),
                    jax.tree.leaves(jax.device_get(b["state"]["params"]))):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
    for k in ("eval_loss", "eval_accuracy", "eval_reward_margin"):
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    with pytest.raises(td.ConfigError, match="made for 2 steps"):
        td.main(dataclasses.replace(pre, train=dataclasses.replace(pre.train, steps=3)))


def test_dry_run_and_bench_take_random_pairs(capsys, monkeypatch):
    """--dry-run and --bench read no data: the step compiles and runs on random pairs, the
    frozen reference counted in the memory (the parameters twice, Adam's moments once more)."""
    # --init-from's model, without a run to read it from (neither reads its weights)
    monkeypatch.setattr(td.hf, "model_source", lambda cfg: (None, cfg.model))
    cfg = dataclasses.replace(dpo_cfg(batch_size=8, seq_len=32, steps=2), dry_run=True)
    dpo = td.main(cfg)["argument_size"]
    plain = td.main(dataclasses.replace(cfg, data=D.DataConfig()))["argument_size"]
    assert 1.25 < dpo / plain < 1.4, (dpo, plain)  # 4 copies of the parameters against 3
    td.main(dataclasses.replace(cfg, dry_run=False, bench=2))
    assert "bench | " in capsys.readouterr().out
