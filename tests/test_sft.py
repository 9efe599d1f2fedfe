"""Supervised fine-tuning: packed rows against one example at a time, the block-diagonal
mask, loss masks and averaging, bad JSONL, and a fine-tune from a pre-training run."""
import dataclasses
import io
import json
import os
import sysconfig
import tokenize
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import train_dense as td
from common.attention import attend
from common import data as D
from common.checkpoint import CheckpointConfig, Checkpointer
from common.config import may_change
from common.mesh import MeshConfig, make_mesh
from tests.spawn import xla_flags

SMALL = td.ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=8, d_ff=64, max_seq_len=64, loss_chunk=8)
LENGTHS = (5, 9, 4, 7, 12, 3, 6)  # tokens per example; packed into rows of 16 positions


def perturbed_params(model, seed=1):
    """Random weights, norm gains near but not at 1 (ones would hide a wrong mask or
    position); drawn with numpy, which needs no compilation."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(partial(td._init, model), jax.random.key(0))
    return jax.tree_util.tree_map_with_path(
        lambda path, s: jnp.asarray((1.0 if "norm" in jax.tree_util.keystr(path) else 0.0)
                                    + 0.1 * rng.standard_normal(s.shape), jnp.float32), shapes)


def random_examples(seed=0):
    """Examples whose first half is prompt (untrained) and second half answer (trained)."""
    rng = np.random.default_rng(seed)
    return [D.Example(rng.integers(3, SMALL.vocab_size, n).astype(np.int32),
                      np.arange(n) >= n // 2) for n in LENGTHS]


def as_batch(packed, names=D.PACKED_FIELDS):
    return {f: jnp.asarray(getattr(packed, f)) for f in names}


def one_by_one(params, examples, model):
    """(logits, per-target cross-entropy) of each example run alone: a row of its own with
    positions 0.. and no segment ids, right-padded (causal: the padding never reaches it)."""
    T = max(len(ex.tokens) for ex in examples) - 1
    x, y = np.zeros((2, len(examples), T), np.int32)
    for i, ex in enumerate(examples):
        x[i, :len(ex.tokens) - 1], y[i, :len(ex.tokens) - 1] = ex.tokens[:-1], ex.tokens[1:]
    logits = jax.jit(partial(td.forward, cfg=model))(params, jnp.asarray(x))
    ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.asarray(y)[..., None], -1)
    return [(np.asarray(logits[i, :len(ex.tokens) - 1]), np.asarray(ce[i, :len(ex.tokens) - 1, 0]))
            for i, ex in enumerate(examples)]


@pytest.mark.parametrize("attention", ["xla", "einsum"])
def test_packed_rows_equal_examples_run_one_by_one(attention):
    model = dataclasses.replace(SMALL, attention=attention)
    params, examples = perturbed_params(model), random_examples()
    packed = D.pack_examples(examples, 16)
    assert packed.num_rows < len(examples)  # several examples share a row
    assert max(packed.segment_ids.max(axis=1)) >= 3
    batch = as_batch(packed)
    logits = np.asarray(jax.jit(partial(td.forward, cfg=model))(
        params, batch["inputs"], segment_ids=batch["segment_ids"], positions=batch["positions"]))
    ces = []
    alone = one_by_one(params, examples, model)
    for i, ex in enumerate(examples):
        # Find the example in its row by its input tokens.
        n = len(ex.tokens) - 1
        hits = [(r, c) for r in range(packed.num_rows) for c in range(16 - n + 1)
                if packed.positions[r, c] == 0
                and np.array_equal(packed.inputs[r, c:c + n], ex.tokens[:-1])]
        assert len(hits) == 1, i
        r, c = hits[0]
        ref_logits, ce = alone[i]
        np.testing.assert_allclose(logits[r, c:c + n], ref_logits, rtol=1e-5, atol=1e-5)
        ces.append(ce)
    # Per token: the mean over every trained target of every example.
    want = np.concatenate([ce[ex.trained[1:]] for ce, ex in zip(ces, examples)]).mean()
    for impl in ("fused", "remat"):
        got = jax.jit(partial(td.loss_fn, cfg=dataclasses.replace(model, loss_impl=impl)))(
            params, batch)[1]["ce"]
        assert float(got) == pytest.approx(want, rel=1e-5)
    # Per example: the mean over examples of each one's own mean.
    by_example = as_batch(D.pack_examples(examples, 16, loss_average="example"))
    want = np.mean([ce[ex.trained[1:]].mean() for ce, ex in zip(ces, examples)])
    got = jax.jit(partial(td.loss_fn, cfg=model))(params, by_example)[1]["ce"]
    assert float(got) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("attention", ["xla", "einsum"])
def test_attention_never_crosses_segments(attention):
    model = dataclasses.replace(SMALL, attention=attention)
    params = perturbed_params(model)
    packed = D.pack_examples(random_examples(), 16)
    r = int(np.argmax(packed.segment_ids.max(axis=1)))  # the row with the most examples
    seg, row = packed.segment_ids[r], packed.inputs[r].copy()
    assert seg.max() >= 3
    fwd = jax.jit(partial(td.forward, cfg=model))
    run = lambda x, s=seg: np.asarray(fwd(params, jnp.asarray(x[None]),
                                          segment_ids=jnp.asarray(s[None]),
                                          positions=jnp.asarray(packed.positions[r][None])))[0]
    changed = row.copy()
    changed[seg == 2] = (changed[seg == 2] + 7) % model.vocab_size
    a, b = run(row), run(changed)
    others = (seg != 2) & (seg != 0)
    np.testing.assert_array_equal(a[others], b[others])
    assert np.abs(a[seg == 2] - b[seg == 2]).max() > 1e-3
    # The same perturbation without segment ids does reach the later examples: the check
    # above is not vacuous.
    one = np.ones_like(seg)
    assert np.abs(run(row, one)[seg == 3] - run(changed, one)[seg == 3]).max() > 1e-3


def grads_of_step(params, batch, cfg):
    from test_dense import grads_of_step as of_step  # the gradient that train_step applies
    return of_step(params, batch, cfg)


def test_gradient_accumulation_over_uneven_microbatches():
    """Microbatches with different numbers of trained tokens still give the batch mean."""
    examples = random_examples() + random_examples(seed=5)
    packed = D.pack_examples(examples, 16, pack=False)  # one per row: uneven weights per row
    by_weight = np.argsort(-packed.weights.sum(axis=1), kind="stable")
    order = np.ravel(np.column_stack([by_weight[:4], by_weight[-4:]]))  # heavy rows even
    batch = jax.tree.map(lambda x: x[order], as_batch(packed, D.PACKED_FIELDS[:3]))
    sums = np.asarray(batch["weights"]).sum(axis=1)
    assert sums[0::2].sum() != sums[1::2].sum()  # microbatch m takes rows m, m+2, ...
    cfg = lambda m: td.Config(model=SMALL, train=td.TrainConfig(batch_size=8, microbatches=m))
    params = perturbed_params(SMALL)
    g1, l1 = jax.jit(partial(grads_of_step, cfg=cfg(1)))(params, batch)
    g2, l2 = jax.jit(partial(grads_of_step, cfg=cfg(2)))(params, batch)
    assert float(l2) == pytest.approx(float(l1), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


# ---- JSONL, the template, masks ------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, f) for f in ("textwrap.py", "string.py", "shlex.py")]
    folder = D.prepare(files, str(tmp_path_factory.mktemp("tok") / "prepared"), vocab_size=400)
    return os.path.join(folder, "tokenizer.model")


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Name a vowel."},
                     {"role": "assistant", "content": "a"},
                     {"role": "user", "content": "Another?"},
                     {"role": "assistant", "content": "e, then i"}]}


def test_chat_template_masks_all_but_the_assistant_turns(tokenizer, tmp_path):
    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    path = write_jsonl(tmp_path / "c.jsonl", [CHAT, {"prompt": "x = ", "completion": "1"}])
    chat, pair = D.tokenize_examples(D.read_sft_jsonl(path), sp)
    eos = sp.eos_id()
    assert list(chat.tokens).count(eos) == 2  # EOS decodes to "": the text reads as below
    assert sp.decode(chat.tokens.tolist()) == ("<|system|>\nBe brief.\n<|user|>\nName a vowel."
                                               "\n<|assistant|>\na<|user|>\nAnother?\n"
                                               "<|assistant|>\ne, then i")
    trained = [sp.decode(chat.tokens[s].tolist()) for s in np.split(
        np.arange(len(chat.tokens)), np.flatnonzero(np.diff(chat.trained.astype(int))) + 1)
        if chat.trained[s[0]]]
    assert trained == ["a", "e, then i"]
    assert [int(t) for t, m in zip(chat.tokens, chat.trained) if m].count(eos) == 2
    assert chat.tokens[-1] == eos and chat.trained[-1]
    assert sp.decode(chat.prompt.tolist()).endswith("<|assistant|>\n")
    assert sp.decode(chat.answer[:-1].tolist()) == "a" and chat.answer[-1] == eos
    assert sp.decode(pair.prompt.tolist()) == "x = "
    assert sp.decode(pair.answer.tolist()) == "1" and pair.answer[-1] == eos


def test_prompt_targets_do_not_change_the_loss_and_answer_targets_do(tokenizer, tmp_path):
    sp = spm.SentencePieceProcessor(model_file=tokenizer)
    model = dataclasses.replace(SMALL, vocab_size=sp.get_piece_size())
    params = perturbed_params(model)
    examples = D.tokenize_examples(D.read_sft_jsonl(write_jsonl(
        tmp_path / "m.jsonl", [CHAT, {"prompt": "def f(x):", "completion": " return x"}])), sp)
    packed = D.pack_examples(examples, 64)
    batch = as_batch(packed)
    loss = jax.jit(lambda b: td.loss_fn(params, b, model)[1]["ce"])
    base = float(loss(batch))
    w = packed.weights
    prompt_at = tuple(np.argwhere((w == 0) & (packed.segment_ids > 0))[3])
    answer_at = tuple(np.argwhere(w > 0)[1])

    def with_target(at, packed=packed):
        t = packed.targets.copy()
        t[at] = (t[at] + 5) % model.vocab_size
        return dict(as_batch(packed), targets=jnp.asarray(t))

    assert float(loss(with_target(prompt_at))) == base
    assert float(loss(with_target(answer_at))) != pytest.approx(base, rel=1e-6)
    everything = D.pack_examples(examples, 64, train_on="all")
    assert (everything.weights > 0).sum() == (everything.segment_ids > 0).sum()
    assert float(loss(with_target(prompt_at, everything))) != pytest.approx(
        float(loss(as_batch(everything))), rel=1e-6)


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "a", "completion": "b"', "line 2: not valid JSON"),
    ('{"prompt": "a"}', "line 2: missing field 'completion'"),
    ('{"completion": "b"}', "line 2: missing field 'prompt'"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "line 2: messages[0] has role 'robot'"),
    ('{"messages": [{"role": "user"}]}', 'line 2: messages[0] needs the fields "role" and'),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: no assistant turn"),
    ('{"prompt": 1, "completion": "b"}', "line 2: field 'prompt' is a int"),
    ('[1, 2]', "line 2: a JSON list, not an object"),
])
def test_bad_jsonl_line_names_file_and_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": "b"}, line])
    with pytest.raises(ValueError, match="bad.jsonl, " + message.replace("[", r"\[")
                       .replace("]", r"\]")):
        D.read_sft_jsonl(path)


def test_missing_file_and_empty_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data.path .*nope.jsonl.*no such file"):
        D.read_sft_jsonl(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="holds no examples"):
        D.read_sft_jsonl(write_jsonl(tmp_path / "empty.jsonl", ["", "  "]))


def test_overlong_examples_are_truncated_or_dropped_and_counted(tokenizer, tmp_path, capsys):
    rows = [{"prompt": "p", "completion": "ok"}] * 6 + [
        {"prompt": "p", "completion": "word " * 40},      # answer cut short: truncated
        {"prompt": "word " * 40, "completion": "late"}]   # answer cut off entirely
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    cfg = D.DataConfig(format="sft", path=path, eval_path=path, tokenizer=tokenizer)
    ds = D.load_sft(cfg, seq_len=16)
    s = ds.train.stats
    assert (s["examples"], s["truncated"], s["dropped_untrained"], s["kept"]) == (8, 2, 1, 7)
    assert "1 dropped with nothing left to train" in capsys.readouterr().out
    assert ds.train.positions.max() == 15 and (ds.train.segment_ids > 0).sum() == (
        6 * (len(ds.eval_examples[0].tokens) - 1) + 16)
    ds = D.load_sft(dataclasses.replace(cfg, overlong="drop"), seq_len=16)
    s = ds.train.stats
    assert (s["truncated"], s["dropped_overlong"], s["kept"]) == (0, 2, 6)
    assert "2 dropped as too long" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no example is left to train on"):
        D.load_sft(dataclasses.replace(cfg, overlong="drop"), seq_len=2)


def test_batches_are_a_pure_function_of_seed_and_step():
    rows = [D.packed_rows(10, seed=3, step=s, batch_size=4) for s in range(5)]
    flat = np.concatenate(rows)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    np.testing.assert_array_equal(rows[3], D.packed_rows(10, seed=3, step=3, batch_size=4))
    assert not np.array_equal(rows[0], D.packed_rows(10, seed=4, step=0, batch_size=4))
    packed = D.pack_examples(random_examples(), 16, pack=False)
    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    b = D.get_batch(packed, seed=0, step=1, batch_size=8, seq_len=16,
                    sharding=NamedSharding(mesh, P(("data", "fsdp"), None)))
    assert set(b) == {"inputs", "targets", "weights"}  # unpacked: the causal mask suffices
    want = D.packed_rows(packed.num_rows, seed=0, step=1, batch_size=8)
    np.testing.assert_array_equal(np.asarray(b["inputs"]), packed.inputs[want])


def test_sampling_several_prompts_at_once_equals_one_at_a_time():
    """Left-padded prompts of different lengths: the pads are a segment of their own."""
    model = dataclasses.replace(SMALL, attention="xla")
    cfg = td.Config(model=model, train=td.TrainConfig(seq_len=32, sample_tokens=6,
                                                     temperature=0.0))
    params = perturbed_params(model)
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    with jax.set_mesh(mesh):
        together = td.sample(params, prompts, cfg, mesh, jax.random.key(0), 90)
        alone = [td.sample(params, [p], cfg, mesh, jax.random.key(0), 90)[0] for p in prompts]
    assert together == alone and len(set(map(tuple, alone))) > 1


def test_cudnn_with_packed_rows_is_refused_before_compiling():
    cfg = td.Config(model=dataclasses.replace(SMALL, attention="cudnn"),
                    train=td.TrainConfig(batch_size=8, seq_len=32),
                    data=D.DataConfig(format="sft", path="x.jsonl"))
    with pytest.raises(td.ConfigError, match="--model.attention cudnn cannot mask packed"):
        td.validate(cfg, 8)
    td.validate(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pack=False)), 8)
    with pytest.raises(D.DataError, match="--data.format sft needs --data.path"):
        D.load_dataset(D.DataConfig(format="sft"), seq_len=32)
    # An explicit mask (GRPO's padding) runs on XLA, whatever the flag asks.
    q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 4, 4, 8)), jnp.float32)
    mask = jnp.asarray(np.tri(4, dtype=bool))[None]
    np.testing.assert_array_equal(attend(q, q, q, impl="cudnn", scale=0.3, mask_BTS=mask),
                                  attend(q, q, q, impl="xla", scale=0.3, mask_BTS=mask))


# ---- From a pre-training run --------------------------------------------------------------


def test_fine_tune_from_a_pretraining_run(tokenizer, tmp_path, capsys):
    folder = os.path.dirname(tokenizer)
    model = td.ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=8, d_ff=64, max_seq_len=64, loss_chunk=16)
    train = dict(batch_size=8, warmup_steps=1, lr=3e-3, schedule="constant",
                 log_every=1, eval_batches=1, sample_tokens=8)
    pre = td.Config(model=model, train=td.TrainConfig(steps=2, **train, seq_len=32),
                    data=D.DataConfig(path=folder), run_dir=str(tmp_path / "pre"))
    td.main(pre)
    rng = np.random.default_rng(0)
    rows = [{"messages": [{"role": "user", "content": f"{a} plus {b}?"},
                          {"role": "assistant", "content": f"{a + b}"}]}
            if i % 2 else {"prompt": f"{a}+{b}=", "completion": f"{a + b}"}
            for i, (a, b) in enumerate(rng.integers(0, 50, (60, 2)))]
    sft = td.Config(model=dataclasses.replace(model, n_layers=1),  # replaced by pre's model
                    train=td.TrainConfig(steps=4, eval_every=2, eval_samples=2, **train,
                                         seq_len=64),
                    data=D.DataConfig(format="sft", path=write_jsonl(tmp_path / "s.jsonl", rows),
                                      eval_fraction=0.2),
                    run_dir=str(tmp_path / "sft"), init_from=str(tmp_path / "pre"),
                    checkpoint=CheckpointConfig(every=2))
    out = td.main(sft)
    log = capsys.readouterr().out
    assert "initialised from" in log and "data: sft train: 48 examples in" in log
    assert "of 48 examples: 0 truncated" in log
    assert [s for s, _ in out["evals"]] == [0, 2, 4]
    assert out["evals"][-1][1] < out["evals"][0][1]
    assert len(out["samples"]) == 2 and "held-out 2 |" in log
    assert 0 < out["packing"]["train"]["non_pad"] <= 1
    # The fine-tune started from pre's weights: its step-0 eval equals pre's weights' eval.
    with Checkpointer(pre.run_dir, CheckpointConfig(async_save=False)) as ck:
        mesh = make_mesh(MeshConfig(fsdp=-1))
        with jax.set_mesh(mesh):
            abstract = td.train_state(pre, mesh).abstract()
            full = ck.restore(2, abstract)
            part = ck.restore(2, {"params": abstract["params"]}, partial=True)
    assert set(part) == {"params"}
    for a, b in zip(jax.tree.leaves(full["params"]), jax.tree.leaves(part["params"])):
        np.testing.assert_array_equal(a, b)
    # Resuming the fine-tune continues it (the init is not repeated).
    again = td.main(dataclasses.replace(sft, train=dataclasses.replace(sft.train, steps=6)))
    log = capsys.readouterr().out
    assert "resumed from step 4" in log and "initialised from" not in log
    assert again["final_step"] == 6
    # What comes after SFT finds the pre-training tokenizer through --init-from: an export
    # ships it, and GRPO starts from the fine-tune with it.
    files = td.export_hf(sft.run_dir, str(tmp_path / "hf"))
    assert "tokenizer.model" in files
    with open(tmp_path / "hf" / "tokenizer.model", "rb") as a, open(tokenizer, "rb") as b:
        assert a.read() == b.read()
    import train_grpo as tg
    tok = tg.make_tokenizer(tg.Config(init_from=sft.run_dir))
    assert tok.encode("1+2=") == D.open_tokenizer(tokenizer).encode("1+2=")


def test_a_run_saved_before_the_sft_fields_existed_still_resumes(tmp_path):
    from common.checkpoint import ConfigConflictError, check_run_config
    cfg = dataclasses.asdict(td.Config())
    old = json.loads(json.dumps(cfg))
    for key in ("format", "eval_path", "eval_fraction", "tokenizer", "train_on", "loss_average",
                "overlong", "pack"):
        del old["data"][key]
    del old["init_from"], old["train"]["eval_samples"]
    with open(tmp_path / "config.json", "w") as f:
        json.dump(old, f)
    defaults = dataclasses.asdict(td.Config())
    check_run_config(str(tmp_path), cfg, may_change(td.Config), defaults=defaults)
    sft = dataclasses.asdict(td.Config(data=D.DataConfig(format="sft")))
    with pytest.raises(ConfigConflictError, match='data.format: \\(absent\\) \\(saved\\) -> "sft"'):
        check_run_config(str(tmp_path), sft, may_change(td.Config), defaults=defaults)
    with pytest.raises(ConfigConflictError, match="data.format"):
        check_run_config(str(tmp_path), cfg, may_change(td.Config))  # without defaults: refused


def test_a_fine_tune_of_a_fine_tune_finds_the_pretraining_tokenizer(tokenizer, tmp_path):
    def run(name, **kw):
        os.makedirs(tmp_path / name / "checkpoints")
        with open(tmp_path / name / "config.json", "w") as f:
            json.dump(dataclasses.asdict(td.Config(**kw)), f)
        return str(tmp_path / name)

    pre = run("pre", data=D.DataConfig(path=os.path.dirname(tokenizer)))
    first = run("sft1", data=D.DataConfig(format="sft", path="a.jsonl"), init_from=pre)
    second = run("sft2", data=D.DataConfig(format="sft", path="b.jsonl"), init_from=first)
    assert D.run_tokenizer(second) == tokenizer
    named = run("sft3", data=D.DataConfig(format="sft", path="c.jsonl", tokenizer="t.model"),
                init_from=first)
    assert D.run_tokenizer(named) == "t.model"
    with pytest.raises(FileNotFoundError, match="--init-from .*nowhere.*not a train_dense.py run"):
        D.run_tokenizer(str(tmp_path / "nowhere"))


def test_bad_input_on_the_command_line_exits_2_naming_the_line(tokenizer, tmp_path):
    import subprocess
    import sys
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "x"}\n')
    with pytest.raises(D.DataError, match=r"bad.jsonl, line 2: not UTF-8"):
        D.read_sft_jsonl(str(path))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "train_dense.py", "tiny-sft", "--data.path", str(path),
                        "--data.tokenizer", tokenizer, "--init-from", "", "--run-dir",
                        str(tmp_path / "run")], cwd=root, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    assert "error:" in r.stderr and "bad.jsonl, line 2: not UTF-8" in r.stderr
    assert "Traceback" not in r.stderr


def without_sft(src: str) -> str:
    """`src` less its SFT and DPO lines: each line whose comment is `# SFT` or `# DPO`, the lines
    its open brackets run on to, and the block it opens when it ends with a colon."""
    depth = {}  # line -> how many brackets it leaves open
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.OP and tok.string in "([{)]}":
            depth[tok.start[0]] = depth.get(tok.start[0], 0) + (1 if tok.string in "([{" else -1)
    lines, drop = src.splitlines(keepends=True), set()
    indent = lambda s: len(s) - len(s.lstrip())
    for i, line in enumerate(lines, 1):
        if not line.rstrip().endswith(("# SFT", "# DPO")) or i in drop:
            continue
        j, open_ = i, depth.get(i, 0)
        while open_ > 0:
            j += 1
            open_ += depth.get(j, 0)
        drop |= set(range(i, j + 1))
        if lines[j - 1].split("#")[0].rstrip().endswith(":"):
            while j < len(lines) and (not lines[j].strip() or indent(lines[j]) > indent(line)):
                j += 1
                drop.add(j)
            while not lines[j - 1].strip():  # the blank lines after the block stay
                drop.discard(j)
                j -= 1
    return "".join(s for i, s in enumerate(lines, 1) if i not in drop)


def test_without_sft_drops_marked_lines_their_brackets_and_blocks():
    src = ("a = 1\nif x:  # SFT\n    b = 2\n\n    c = 3\n\nd = f(1,  # SFT\n      2)\n"
           "p = {\n    'a': 1,\n    'b': (2,  # SFT\n          3),\n}\n")
    assert without_sft(src) == "a = 1\n\np = {\n    'a': 1,\n}\n"


def test_a_pretraining_fork_deletes_the_sft_lines_and_still_trains(tmp_path):
    """The module docstring's promise: train_dense.py less its `# SFT` and `# DPO` lines trains
    `tiny`."""
    import subprocess
    import sys
    from common.data import prepare
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = open(os.path.join(root, "train_dense.py")).read()
    (tmp_path / "train_dense.py").write_text(without_sft(src))
    stdlib = sysconfig.get_paths()["stdlib"]
    data = prepare([os.path.join(stdlib, f) for f in ("argparse.py", "textwrap.py", "string.py",
                                                      "shlex.py", "fnmatch.py")],
                   str(tmp_path / "data"), vocab_size=400)
    env = dict(os.environ, PYTHONPATH=root, XLA_FLAGS=xla_flags(1))
    r = subprocess.run([sys.executable, str(tmp_path / "train_dense.py"), "tiny", "--data.path",
                        data, "--run-dir", str(tmp_path / "run"), "--model.vocab-size", "512",
                        "--model.d-model", "32", "--model.n-layers", "1", "--model.d-ff", "64",
                        "--train.steps", "2", "--train.batch-size", "2", "--train.seq-len", "32",
                        "--train.log-every", "1", "--train.eval-every", "2",
                        "--train.eval-batches", "1", "--train.sample-tokens", "4",
                        "--checkpoint.every", "0"], cwd=root, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 2 |" in r.stdout and "eval_loss" in r.stdout and "sample:" in r.stdout
