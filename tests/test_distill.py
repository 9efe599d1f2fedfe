"""Distillation (--distill.teacher, issue 41): the KL term against a naive reference (softened,
weighted, top-k cut), top-k = the vocabulary equal to no cut, the mixed objective, a short run
from a teacher run directory that resumes with the teacher in its checkpoint, bad input."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_dense as td
from common import train
from common.checkpoint import check_run_config
from common.checkpoint import CheckpointConfig, Checkpointer
from common.mesh import MeshConfig, make_mesh
from tests.test_lora import base_params
from tests.test_sft import SMALL

TEACHER = dataclasses.replace(SMALL, d_model=48, n_layers=3, head_dim=12, d_ff=96,
                              final_softcap=30.0)


def naive_kl(zs, zt, w, tau, k):
    """sum_t w_t tau^2 KL(p_t || p_s) in float64, each position on its own."""
    zs, zt = np.asarray(zs, np.float64) / tau, np.asarray(zt, np.float64) / tau
    if k:
        kth = np.sort(zt, axis=-1)[..., -k][..., None]
        zt = np.where(zt >= kth, zt, -np.inf)
    lse = lambda z: np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1, keepdims=True)) + \
        z.max(-1, keepdims=True)
    lpt, lps = zt - lse(zt), zs - lse(zs)
    pt = np.exp(lpt)
    kl = np.sum(np.where(pt > 0, pt * (lpt - lps), 0.0), axis=-1)
    return tau ** 2 * np.sum(kl * w)


@pytest.mark.parametrize("tau, k", [(1.0, 0), (2.0, 0), (1.0, 5), (0.5, 17)])
def test_distill_kl_equals_a_naive_reference(tau, k):
    sp, tp = base_params(td, SMALL), base_params(td, TEACHER, seed=2)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, SMALL.vocab_size, (2, 17)), jnp.int32)
    w = rng.random((2, 16)).astype(np.float32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": jnp.asarray(w)}
    d = td.DistillConfig(teacher="t", weight=0.3, temperature=tau, top_k=k)
    obj, aux = td.loss_fn(sp, batch, SMALL, n=1.0, distill=(tp, TEACHER, d))
    want = naive_kl(td.forward(sp, tokens[:, :-1], SMALL), td.forward(tp, tokens[:, :-1],
                                                                       TEACHER), w, tau, k)
    np.testing.assert_allclose(aux["distill_kl"], want, rtol=2e-5)
    ce = td.loss_fn(sp, batch, SMALL, n=1.0)[1]["ce"]
    np.testing.assert_allclose(aux["ce"], ce, rtol=1e-6)
    np.testing.assert_allclose(obj, 0.7 * ce + 0.3 * want, rtol=2e-5)


def test_top_k_of_the_whole_vocabulary_is_no_cut():
    sp, tp = base_params(td, SMALL), base_params(td, TEACHER, seed=2)
    tokens = jnp.arange(34).reshape(2, 17) % SMALL.vocab_size
    kl = lambda k: td.loss_fn(sp, tokens, SMALL, distill=(tp, TEACHER, td.DistillConfig(
        teacher="t", top_k=k)))[1]["distill_kl"]
    np.testing.assert_allclose(kl(SMALL.vocab_size), kl(0), rtol=1e-6)
    assert kl(2) != pytest.approx(float(kl(0)), rel=1e-3)


def teacher_run(root, model=dataclasses.replace(TEACHER, vocab_size=4096)):
    """A train_dense.py run directory with one checkpoint of `model` (perturbed weights)."""
    cfg = td.Config(model=model, run_dir=str(root / "teacher"))
    check_run_config(cfg.run_dir, dataclasses.asdict(cfg))
    mesh = make_mesh(MeshConfig(fsdp=-1))
    params = base_params(td, model, seed=2)
    with jax.set_mesh(mesh):
        state = td.train_state(cfg, mesh).from_params(jax.tree.map(jnp.copy, params))
        with Checkpointer(cfg.run_dir, CheckpointConfig()) as ckpt:
            ckpt.save(5, state, force=True)
    return cfg.run_dir, params


def test_a_run_learns_from_a_teacher_run_and_resumes(tmp_path, capsys):
    t_dir, t_params = teacher_run(tmp_path)
    args = lambda run, steps: ["tiny", "--distill.teacher", t_dir,
                               "--model.d-model", "32", "--model.n-layers", "2",
                               "--model.head-dim", "8", "--model.d-ff", "64",
                               "--train.steps", str(steps), "--train.batch-size", "8",
                               "--train.seq-len", "32", "--train.sample-tokens", "0",
                               "--train.log-every", "1", "--train.eval-every", "2",
                               "--checkpoint.every", "2", "--run-dir", str(tmp_path / run)]
    full = td.main(td.cli(args("a", 3)))
    td.main(td.cli(args("b", 2)))
    resumed = td.main(td.cli(args("b", 3)))
    assert "resumed from step 2" in capsys.readouterr().out
    for a, b in zip(jax.tree.leaves(jax.device_get(full["state"])),
                    jax.tree.leaves(jax.device_get(resumed["state"]))):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(jax.device_get(full["state"]["teacher"])),
                    jax.tree.leaves(t_params)):
        np.testing.assert_array_equal(a, b)  # loaded, and never trained
    rows = [json.loads(x) for x in open(tmp_path / "a" / "metrics.jsonl")]
    assert all(r["distill_kl"] > 0 for r in rows if "loss" in r)


def test_bad_teachers_are_refused_before_compiling(tmp_path):
    t_dir, _ = teacher_run(tmp_path, dataclasses.replace(TEACHER, vocab_size=128))
    cfg = td.cli(["tiny", "--distill.teacher", t_dir])
    with pytest.raises(td.ConfigError, match="its vocabulary \\(128\\) must be the student's"):
        td.main(cfg)
    with pytest.raises(FileNotFoundError, match="--distill.teacher"):
        td.main(td.cli(["tiny", "--distill.teacher", str(tmp_path / "none")]))
    with pytest.raises(td.ConfigError, match="--distill.weight"):
        td.main(td.cli(["tiny", "--distill.teacher", t_dir, "--distill.weight", "1.5"]))


def test_a_huggingface_folder_teaches_too(tmp_path):
    model = dataclasses.replace(TEACHER, vocab_size=4096, final_softcap=0.0)
    params = base_params(td, model, seed=4)
    td.save_hf(params, model, str(tmp_path / "hf"), model_type="llama")
    out = td.main(td.cli(["tiny", "--distill.teacher", str(tmp_path / "hf"), "--model.d-model",
                          "32", "--model.n-layers", "1", "--model.head-dim", "8",
                          "--train.steps", "1", "--train.batch-size", "8", "--train.seq-len",
                          "32", "--train.sample-tokens", "0", "--run-dir", str(tmp_path / "r")]))
    for a, b in zip(jax.tree.leaves(jax.device_get(out["state"]["teacher"])),
                    jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


def test_saved_top_k_reproduce_the_online_loss(tmp_path):
    """--distill.save writes the teacher's top-k of the run's batches; a student reading them
    (no teacher in its state) trains as one running the teacher with the same cut: with k =
    the vocabulary, as one with no cut at all."""
    t_dir, _ = teacher_run(tmp_path)
    logits, V = str(tmp_path / "topk"), 4096
    args = lambda run, *extra: td.cli([
        "tiny", "--distill.teacher", t_dir, "--distill.top-k", str(V), "--model.d-model", "32",
        "--model.n-layers", "2", "--model.head-dim", "8", "--train.steps", "2",
        "--train.batch-size", "8", "--train.seq-len", "32", "--train.sample-tokens", "0",
        "--train.log-every", "1", "--run-dir", str(tmp_path / run), *extra])
    saved = td.main(args("s", "--distill.logits", logits, "--distill.save"))
    assert saved["steps"] == 2 and not os.path.exists(tmp_path / "s")  # no run was made
    assert np.load(os.path.join(logits, "00000001-indices.npy")).shape == (8, 32, V)
    online = td.main(args("a", "--distill.top-k", "0"))
    offline = td.main(args("b", "--distill.logits", logits))
    assert "teacher" not in offline["state"]
    for a, b in zip(jax.tree.leaves(jax.device_get(online["state"]["params"])),
                    jax.tree.leaves(jax.device_get(offline["state"]["params"]))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    kl = lambda run: [json.loads(x)["distill_kl"] for x in open(tmp_path / run / "metrics.jsonl")
                      if "distill_kl" in x]
    np.testing.assert_allclose(kl("a"), kl("b"), rtol=1e-5)
    with pytest.raises(td.ConfigError, match="not empty"):
        td.main(args("s2", "--distill.logits", logits, "--distill.save"))
    with pytest.raises(td.ConfigError, match="saved for"):
        td.main(args("c", "--distill.logits", logits, "--train.seq-len", "16"))
