"""common/eval.py: lm-evaluation-harness on our forward (issue 42).

The scores equal a plain reference from the trainer's `forward` logits (log-softmax sums, one
request at a time, no padding) to 1e-5, dense and MoE, on one device and on 8; greedy
generation equals a plain argmax loop over `forward`; where torch and transformers are
installed, the same requests equal lm-eval's own `hf` model on our exported folder to 1e-4;
and a tiny run trained here scores the shipped nextline task above chance, end to end (files,
metrics record). The tests needing lm-eval skip without it (the `eval` extra)."""
import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_dense as td
import train_moe as tm
from common import eval as ev, train
from common.config import ConfigError
from common.data import DataConfig
from common.mesh import MeshConfig, make_mesh

DENSE = td.ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=8, d_ff=64, max_seq_len=64, loss_chunk=16)
MOE = tm.ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=8, n_experts=8, top_k=2, d_ff=32, max_seq_len=64, loss_chunk=16)
MODELS = {"dense": (td, DENSE), "moe": (tm, MOE)}
FORWARD = {k: jax.jit(lambda p, x, mod=mod, m=m: mod.forward(jax.device_get(p), x, m))
           for k, (mod, m) in MODELS.items()}  # the plain reference: one row, unpadded


@pytest.fixture(scope="module", autouse=True)
def lm_evals_own_index_built_once():
    """lm-eval's index of its own ~13,000 task YAMLs, which task_manager builds when a name is
    not one of ours (~7 s a time here), built once for the file: the two refusals of a
    misspelt task below each built it. The same index, from the same files: the name is still
    looked up in it and refused. Our own tasks' manager (include_defaults=False, what a
    run's evals use) is made afresh each time, as before."""
    try:
        import lm_eval.tasks as tasks
    except ImportError:
        yield
        return
    real, made = tasks.TaskManager, {}

    def task_manager(*args, **kw):
        if not kw.get("include_defaults", True):
            return real(*args, **kw)
        key = repr((args, sorted(kw.items())))
        if key not in made:
            made[key] = real(*args, **kw)
        return made[key]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tasks, "TaskManager", task_manager)
        yield


def scorer(name: str, mesh_cfg: MeshConfig, batch_size: int = 4, max_length: int = 64):
    mod, m = MODELS[name]
    n = int(np.prod([s for s in mesh_cfg.ici() if s > 0]))
    mesh = make_mesh(mesh_cfg, jax.devices()[:n])
    params = mod.init_params(m, jax.random.key(0), mesh)
    # Off their init (norms at 1, biases at 0), so every weight shapes the logits.
    params = jax.tree.map(lambda p, k: p + 0.05 * jax.random.normal(k, p.shape), params,
                          jax.tree.unflatten(jax.tree.structure(params), list(
                              jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))))
    return ev.Scorer(lambda p, x: mod.forward(p, x, m), params, mesh, batch_size, max_length)


def pairs(n: int = 8, seed: int = 0):
    """(context, continuation) ids of lengths across three buckets, and one past max_length."""
    rng = np.random.default_rng(seed)
    out = [(rng.integers(0, 512, rng.integers(1, 50)).tolist(),
            rng.integers(0, 512, rng.integers(1, 9)).tolist()) for _ in range(n)]
    return out + [(rng.integers(0, 512, 80).tolist(), rng.integers(0, 512, 3).tolist())]


def reference(name: str, params, ctx, cont, max_length: int = 64):
    """log p(cont | ctx) and greedy? from one unpadded row's logits, cut from the left to
    max_length + 1 tokens as lm-eval's hf model cuts it."""
    mod, m = MODELS[name]
    whole = np.array(ctx + cont)[-(max_length + 1):]
    z = np.asarray(jax.nn.log_softmax(FORWARD[name](params, whole[None, :-1])[0], -1))
    at, cont = np.arange(len(whole) - len(cont) - 1, len(whole) - 1), np.array(cont)
    return float(np.sum(z[at, cont])), bool(np.all(np.argmax(z[at], -1) == cont))


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_loglikelihoods_equal_forward_reference(name):
    sc = scorer(name, MeshConfig(fsdp=1))
    got = sc.loglikelihoods(pairs())
    want = [reference(name, sc.params, c, d) for c, d in pairs()]
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], atol=1e-5, rtol=0)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert 2 <= len(sc.shapes) and {s[2] for s in sc.shapes} <= {16, 32, 64, 65}  # buckets


@pytest.mark.parametrize("name, mesh", [("dense", MeshConfig(data=2, fsdp=2, tensor=2)),
                                        ("moe", MeshConfig(fsdp=2, expert=4))])
def test_sharded_equals_one_device(name, mesh):
    """8 devices, the weights split as in training, the batch over data/fsdp/expert."""
    one, many = scorer(name, MeshConfig(fsdp=1)), scorer(name, mesh, batch_size=5)
    assert many.B == 8 and len(jax.tree.leaves(many.params)[0].sharding.device_set) == 8
    np.testing.assert_allclose([s for s, _ in many.loglikelihoods(pairs())],
                               [s for s, _ in one.loglikelihoods(pairs())], atol=1e-5, rtol=0)
    prompts = [c[:20] for c, _ in pairs(5, seed=1)]
    assert many.generate(prompts, 6) == one.generate(prompts, 6)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_generate_equals_greedy_loop(name):
    mod, m = MODELS[name]
    sc = scorer(name, MeshConfig(fsdp=1), max_length=40)
    prompts = [c for c, _ in pairs(2, seed=2)] + [[7]]  # one cut from the left to fit
    got = sc.generate(prompts, 5)
    # One row at a time in a buffer of 40, the argmax read after the last token (the padding
    # after it cannot reach it: attention is causal), so the reference compiles once.
    step = jax.jit(lambda p, x, n: jnp.argmax(mod.forward(p, x, m)[0, n - 1]))
    for p, g in zip(prompts, got):
        x = list(p[-(40 - 5):])  # room for the new tokens within max_length
        for _ in range(5):
            x.append(int(step(sc.params, np.array([x + [0] * (40 - len(x))]), len(x))))
        assert g == x[-5:]


def lm_for(name: str, tok_path: str):
    pytest.importorskip("lm_eval")
    return ev.lm_class()(scorer(name, MeshConfig(fsdp=1)), tok_path)


def test_text_requests_and_rolling(tmp_path):
    """Through lm-eval's request objects: a (context, continuation) text splits into the ids
    its whole encoding has; a long text's rolling log-likelihood is the sum of its windows."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    tok = tiny_hf_folder(tmp_path) + "/tokenizer.json"
    lm = lm_for("dense", tok)
    ctx, cont = "def add(a, b):\n    return", " a + b"
    (lp, _), = lm.loglikelihood([Instance("loglikelihood", {}, (ctx, cont), 0)])
    ids, n_ctx = lm.tok_encode(ctx + cont), len(lm.tok_encode(ctx))
    assert lp == pytest.approx(reference("dense", lm.scorer.params, ids[:n_ctx], ids[n_ctx:])[0],
                               abs=1e-5)
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    short, long = "import os\n", "import os\n" * 40  # the long one: several windows of 64
    (one, many) = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate([short, long])])
    ids = lm.tok_encode(short)
    assert one == pytest.approx(reference("dense", lm.scorer.params, [lm.prefix_token_id], ids)[0],
                                abs=1e-5)
    ids = lm.tok_encode(long)
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
        ids, lm.prefix_token_id, 64, 1)]
    assert len(ids) > 2 * 64 and len(windows) >= 3
    assert many == pytest.approx(sum(reference("dense", lm.scorer.params, c, d)[0]
                                     for c, d in windows), abs=1e-4)


def tiny_hf_folder(tmp_path) -> str:
    """tools/tiny_hf.py's Qwen3-shaped folder (real tokenizer.json), written by our save_hf."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    import tiny_hf
    out = str(tmp_path / "hf")
    if not os.path.isdir(out):
        tiny_hf.make_folder(out)
    return out


def test_equals_lm_eval_hf_model_on_our_export(tmp_path):
    """The same requests through our model and lm-eval's `hf` (transformers, float32) on the
    folder save_hf wrote: log-likelihoods to 1e-4, the same greedy answers."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    folder = tiny_hf_folder(tmp_path)
    ours = ev.lm_class()(*ev.open_model(ev.EvalConfig(hf=folder, batch_size=4), td))  # 8 devices
    theirs = HFLM(pretrained=folder, device="cpu", dtype="float32", batch_size=4)
    texts = ["red green blue", "The cat sat on the", "one two three four", "Say bird.", "yes"]
    ll = [Instance("loglikelihood", {}, (a, " " + b), i)
          for i, (a, b) in enumerate(zip(texts, ["sky", "mat", "five", "bird", "no"]))]
    np.testing.assert_allclose([lp for lp, _ in ours.loglikelihood(ll)],
                               [lp for lp, _ in theirs.loglikelihood(ll)], atol=1e-4, rtol=0)
    roll = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    np.testing.assert_allclose(ours.loglikelihood_rolling(roll), theirs.loglikelihood_rolling(roll),
                               atol=1e-4, rtol=0)
    gen = [Instance("generate_until", {}, (t, {"until": ["\n\n"], "max_gen_toks": 6,
                                              "do_sample": False}), i) for i, t in enumerate(texts)]
    assert ours.generate_until(gen) == theirs.generate_until(gen)


def test_make_eval_end_to_end(tmp_path, monkeypatch):
    """A tiny run trained here for a few steps, scored on the shipped task as `make eval`
    scores one (`python train_dense.py eval`, the trainer's own subcommand): eval/nextline.json
    and one metrics.jsonl record at the checkpoint's step. (Its accuracy is not asserted:
    beating chance takes the `make train` run, 300 steps of the 5M-parameter model; measured in
    docs/eval.md.)"""
    pytest.importorskip("lm_eval")
    run = str(tmp_path / "run")
    td.main(td.Config(model=dataclasses.replace(DENSE, vocab_size=4096), train=td.TrainConfig(
        steps=4, batch_size=8, seq_len=32, warmup_steps=1, eval_every=100, sample_tokens=0),
        data=DataConfig(), run_dir=run, quiet=True))
    monkeypatch.setattr(sys, "argv", ["train_dense.py", "eval", "--run-dir", run, "--limit", "20",
                                      "--max-length", "64"])
    train.run_cli(td.main, td.cli, td.export_hf, ev.run_eval)
    saved = json.load(open(os.path.join(run, "eval", "nextline.json")))
    out = {"nextline": {k.split(",")[0]: v for k, v in saved["metrics"].items()}}
    assert saved["step"] == 4 and saved["examples"]["effective"] == 20
    assert saved["speed"]["requests"] == 80 and 0 <= out["nextline"]["acc"] <= 1
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rec = [json.loads(line) for line in f][-1]
    assert rec == {"step": 4, "lm_eval/nextline/acc": out["nextline"]["acc"],
                   "lm_eval/nextline/acc_norm": out["nextline"]["acc_norm"]}


@pytest.mark.parametrize("name", MODELS)
def test_eval_tasks_during_training_equal_make_eval(tmp_path, name):
    """--train.eval-tasks: the harness at each eval of a dense and an MoE run, a curve in
    metrics.jsonl beside the loss; its last point equals `make eval` of the saved step."""
    pytest.importorskip("lm_eval")
    mod, m = MODELS[name]
    run = str(tmp_path / "run")
    mod.main(mod.Config(model=dataclasses.replace(m, vocab_size=4096), train=mod.TrainConfig(
        steps=4, batch_size=8, seq_len=32, warmup_steps=1, eval_every=2, sample_tokens=0,
        eval_tasks="nextline", eval_tasks_limit=12), data=DataConfig(), run_dir=run, quiet=True))
    with open(os.path.join(run, "metrics.jsonl")) as f:
        recs = [r for r in map(json.loads, f) if "lm_eval/nextline/acc" in r]
    assert [r["step"] for r in recs] == [2, 4] and all("eval_loss" in r for r in recs)
    out = ev.evaluate(ev.EvalConfig(run_dir=run, limit=12, max_length=64), mod)["nextline"]
    assert (recs[-1]["lm_eval/nextline/acc"], recs[-1]["lm_eval/nextline/acc_norm"]) == (
        out["acc"], out["acc_norm"])


def test_eval_tasks_refused_before_training(tmp_path):
    pytest.importorskip("lm_eval")
    with pytest.raises(ConfigError, match="--train.eval-tasks nextlin: no such task"):
        td.main(td.Config(model=DENSE, train=td.TrainConfig(
            steps=2, batch_size=8, seq_len=32, sample_tokens=0, eval_tasks="nextlin"),
            data=DataConfig(vocab_size=512), run_dir=str(tmp_path / "run"), quiet=True))
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_refusals(tmp_path):
    with pytest.raises(ConfigError, match="--run-dir RUN .* or --hf FOLDER"):
        ev.load(ev.EvalConfig(), None, td)
    with pytest.raises(ConfigError, match="--run-dir RUN .* or --hf FOLDER"):
        ev.load(ev.EvalConfig(run_dir="a", hf="b"), None, td)
    with pytest.raises(ConfigError, match="--batch-size 0: must be > 0"):
        ev.evaluate(ev.EvalConfig(hf="x", batch_size=0), td)
    run = tmp_path / "moe"  # an MoE run's config, scored by the dense trainer
    os.makedirs(run / "checkpoints" / "3")
    (run / "config.json").write_text(json.dumps({"model": dataclasses.asdict(MOE)}))
    with pytest.raises(ConfigError, match=r"lacks \(.*\): score it with its own \(train_moe.py"):
        ev.load(ev.EvalConfig(run_dir=str(run)), None, td)
    pytest.importorskip("lm_eval")
    with pytest.raises(ConfigError, match="--tasks hellaswagg: no such task.*nextline"):
        ev.evaluate(ev.EvalConfig(hf="x", tasks="nextline,hellaswagg"), td)
