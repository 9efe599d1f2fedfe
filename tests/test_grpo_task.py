"""train_grpo.py on the user's own task: --task.path prompts, --task.rewards from a Python file.

A short run on a tiny model learns an easy task from a prompts file and a reward file (the
reward rises), the rewards receive the lines' fields aligned with the completions, a chat
template renders the prompts as transformers would, and bad files and reward functions are
refused with a message naming them.
"""
import dataclasses
import json
import os
import shutil
import textwrap

import jax
import numpy as np
import pytest

import train_dense as td
import train_grpo as tg
from common import data as D
from common import task as T
from common import train
from common.checkpoint import CheckpointConfig
from common.data import ChatTemplate, DataError
from common.mesh import MeshConfig

CHAT = os.path.join(os.path.dirname(__file__), "fixtures", "chat")
SMALL = tg.ModelConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=8, d_ff=64, max_seq_len=32, remat="none")


def jsonl(path, lines):
    with open(path, "w") as f:
        f.writelines((line if isinstance(line, str) else json.dumps(line)) + "\n"
                     for line in lines)
    return str(path)


def sums(tmp_path):
    """100 prompts "a+b=" (the char tokenizer spells them), each with its own fields."""
    return jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"{a}+{b}=", "want": "7", "id": 10 * a + b}
                                              for a in range(10) for b in range(10)])


REWARDS = """
import json

def has_want(completions, want, **_):
    return [float(w in c) for c, w in zip(completions, want)]

def record(completions, **fields):  # weight 0: watches what the rewards are given
    with open({log!r}, "a") as f:
        f.write(json.dumps(dict(fields, completions=completions)) + "\\n")
    return [0] * len(completions)

def bad_length(completions, **_):
    return [1.0]

def raises(completions, want, **_):
{RAISES}

def raises_later(completions, **_):  # passes the check on empty completions, not the run's
    return [{{}}["x"] if c else 0.0 for c in completions]
"""
RAISES = "    return [1.0 / len(c) for c in completions]  # ZeroDivisionError on an empty one"
REWARDS = REWARDS.replace("{RAISES}", RAISES)


def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS.format(log=str(tmp_path / "calls.jsonl")))
    return str(path)


def config(tmp_path, steps, model=SMALL, grpo=None, **task):
    g = dict(steps=steps, prompts_per_step=8, group_size=4, max_new_tokens=3, lr=3e-3,
             warmup_steps=1, eval_every=5, log_every=5)
    t = dict(eval_prompts=16) | task
    return tg.Config(model=model, grpo=tg.GRPOConfig(**(g | (grpo or {}))),
                     warm=tg.WarmStartConfig(max_steps=0), task=tg.TaskConfig(**t),
                     mesh=MeshConfig(fsdp=-1), checkpoint=CheckpointConfig(every=100),
                     run_dir=str(tmp_path / "run"))


def recording_left_pad(monkeypatch):
    """Every prompt batch the rollouts are given (train_grpo.left_pad's output), in order."""
    batches = []

    def left_pad(ids, width, pad_id):
        out = D.left_pad(ids, width, pad_id)
        batches.append(out)
        return out
    monkeypatch.setattr(tg, "left_pad", left_pad)
    return batches


# ------------------------------------------------------------------------------ a run


def test_reward_from_a_file_rises_and_sees_the_fields_aligned(tmp_path, monkeypatch):
    """From random weights, reward 1 for a completion holding the line's `want` ("7"): GRPO
    alone raises it within 15 steps. Every call of the rewards gets each JSONL field as a list
    aligned with the completions: row i's `prompt` is what the model was prompted with in
    row i, the G completions of a prompt get G copies of its line, and `finished` comes too."""
    batches = recording_left_pad(monkeypatch)
    rf = rewards_file(tmp_path)
    cfg = config(tmp_path, 15, path=sums(tmp_path), rewards=(f"{rf}:has_want,record",),
                 reward_weights=(1.0, 0.0))
    out = tg.main(cfg)
    steps = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    reward = [r["rewards/has_want/mean"] for r in steps if "rewards/has_want/mean" in r]
    print(f"sampled reward {reward[0]:.3f} -> {reward[-1]:.3f}, held-out {out['eval']}")
    assert len(reward) == 15 and "rewards/record/mean" in steps[-1]
    assert reward[0] < 0.4 and np.mean(reward[-3:]) > reward[0] + 0.4, reward
    assert out["eval"][0][1] < 0.4 and out["eval"][-1][1] >= out["eval"][0][1] + 0.5, out["eval"]

    calls = [json.loads(line) for line in open(tmp_path / "calls.jsonl")]
    assert calls[0]["completions"] == ["", ""]  # the check before compiling
    calls = calls[1:]
    assert len(calls) == len(batches) == 15 + 4  # 15 rollouts, evals at steps 0, 5, 10, 15
    tok = tg.CharTokenizer()
    for call, (ids, valid) in zip(calls, batches):
        n = len(call["completions"])
        assert set(call) == {"prompt", "want", "id", "finished", "completions"}
        assert all(len(v) == n == len(ids) for v in call.values())
        assert call["prompt"] == [tok.decode(row[v]) for row, v in zip(ids, valid)]
        assert call["id"] == [int(p[0]) * 10 + int(p[2]) for p in call["prompt"]]
        assert all(isinstance(f, bool) for f in call["finished"]) and set(call["want"]) == {"7"}
    rollouts = [c for c in calls if len(c["completions"]) == 32]
    assert len(rollouts) == 15
    for c in rollouts:  # groups of G = 4 rows of one line, 8 distinct lines per step
        ids = np.array(c["id"]).reshape(8, 4)
        assert (ids == ids[:, :1]).all() and len(set(ids[:, 0])) == 8
    held = {i for c in calls if len(c["completions"]) == 16 for i in c["id"]}
    assert len(held) == 16 and not held & {i for c in rollouts for i in c["id"]}


def test_draws_are_a_pure_function_of_the_step_and_cover_each_epoch():
    a = [T.draw(10, 4, seed=0, step=s) for s in range(5)]  # 20 draws: two epochs of 10
    assert (np.concatenate(a) == np.concatenate([T.draw(10, 4, seed=0, step=s)
                                                 for s in range(5)])).all()
    flat = np.concatenate(a)
    assert sorted(flat[:10]) == list(range(10)) == sorted(flat[10:])
    assert not (flat[:10] == flat[10:]).all()  # each epoch in its own order
    assert not (T.draw(10, 4, seed=1, step=0) == a[0]).all()


# ------------------------------------------------------------------------------ a chat template


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny Qwen3-shaped HuggingFace folder with the committed chat tokenizer."""
    pytest.importorskip("jinja2", reason="pip install -e '.[hf]'")
    pytest.importorskip("tokenizers", reason="pip install -e '.[hf]'")
    folder = tmp_path_factory.mktemp("chat_model")
    m = td.ModelConfig(vocab_size=448, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2,
                       head_dim=8, d_ff=64, max_seq_len=128, qk_norm=True)
    td.save_hf(td.init_params(m, jax.random.key(0)), m, str(folder), model_type="qwen3")
    for name in os.listdir(CHAT):
        shutil.copy(os.path.join(CHAT, name), folder)
    return str(folder)


def test_chat_template_renders_the_rollout_prompts(chat_model, tmp_path, monkeypatch):
    """With --init-from-hf's chat template, the prompt ids given to the rollout are the
    template's rendering (with the generation prompt) encoded whole: its BOS once, not also
    the tokenizer's start token. A plain `prompt` string is rendered as one user turn."""
    batches = recording_left_pad(monkeypatch)
    questions = ["What is 2 + 3?", "Say hello.", "What color is the sky?", "Name a dog."]
    lines = [{"messages": ([{"role": "system", "content": "Answer with one word."}] if i % 2
                           else []) + [{"role": "user", "content": q}], "answer": "blue"}
             for i, q in enumerate(questions * 6)]
    cfg = dataclasses.replace(config(tmp_path, 1, grpo=dict(group_size=2), eval_prompts=8,
                                     path=jsonl(tmp_path / "chat.jsonl", lines),
                                     rewards=("exact,format",)), init_from_hf=chat_model)
    tg.main(cfg)
    tok, template = tg.make_tokenizer(cfg), ChatTemplate.find(chat_model)
    want = {tuple(tok.encode(template.render(line["messages"], add_generation_prompt=True)))
            for line in lines}
    ids, valid = batches[1]  # [0]: the held-out prompts at step 0; [1]: step 1's rollouts
    got = {tuple(row[v].tolist()) for row, v in zip(ids, valid)}
    assert got <= want and len(got) >= 3 and ids.shape == (16, max(len(w) for w in want))
    assert all(w.count(tok.start_id) == 1 and w[0] == tok.start_id for w in got)
    assert tok.decode(next(iter(got))).endswith("<|im_end|>\n<|im_start|>assistant\n")
    row = T.prompt_row({"prompt": "Say hello."}, "test", tok, template)
    assert row.ids == tok.encode(template.render([{"role": "user", "content": "Say hello."}],
                                                 add_generation_prompt=True))


# ------------------------------------------------------------------------------ built-ins, bad input


def test_built_in_rewards_and_weights(tmp_path):
    rewards = T.load_rewards(("exact,format",), (1.0, 0.5), r"[a-z]+", {"prompt", "answer"})
    completions = [" blue ", "blue", "Blue", "blue!"]
    total, each = T.score(rewards, completions, {"answer": ["blue", 7, "blue", "blue"]},
                          [True, False, True, True])
    assert each["exact"].tolist() == [1, 0, 0, 0] and each["format"].tolist() == [1, 0, 0, 0]
    np.testing.assert_allclose(total, [1.5, 0, 0, 0])
    assert T.score(rewards, ["7"], {"answer": [7]}, [True])[1]["exact"].tolist() == [1]
    with pytest.raises(tg.ConfigError, match="'answer' field"):
        T.load_rewards(("exact",), (), "", {"prompt"})
    with pytest.raises(tg.ConfigError, match="2 weights for 1 rewards"):
        T.load_rewards(("format",), (1.0, 2.0), "", {"prompt"})
    with pytest.raises(tg.ConfigError, match="neither FILE.py"):
        T.load_rewards(("exactly",), (), "", {"prompt"})
    with pytest.raises(tg.ConfigError, match="--task.format-regex '\\[': not a regular"):
        T.load_rewards(("format",), (), "[", {"prompt"})
    with pytest.raises(tg.ConfigError, match="--task.format-regex is the built-in format"):
        T.load_rewards(("exact",), (), "a+", {"prompt", "answer"})
    with pytest.raises(tg.ConfigError, match="defines no function 'nope' \\(it defines bad_length"):
        T.load_rewards((f"{rewards_file(tmp_path)}:nope",), (), "", {"prompt"})


def test_a_failing_reward_is_named_with_its_file(tmp_path):
    rf = rewards_file(tmp_path)
    funcs = T.load_rewards((f"{rf}:raises,bad_length",), (), "", {"prompt", "want"})
    fields, line = {"want": ["7", "7"]}, REWARDS.split("\n").index(RAISES) + 1
    with pytest.raises(T.RewardError, match=r"reward 'raises' \(.*my_rewards.py\) raised "
                                            rf"ZeroDivisionError: .*my_rewards.py, line {line}\)"):
        T.score(funcs, ["7", ""], fields, [True, True])
    with pytest.raises(T.RewardError, match=r"reward 'bad_length' \(.*my_rewards.py\) returned "
                                            r"1 values for 2 completions"):
        T.score({"bad_length": funcs["bad_length"]}, ["7", "8"], fields, [True, True])
    for out, what in [([1.0, float("nan")], "nan for completion 1"), ([None, 1], "None"),
                      ("11", "returned a str"), ([1, "1"], "'1' for completion 1")]:
        with pytest.raises(T.RewardError, match=what):
            T.score({"f": (lambda c, **_: out, 1.0)}, ["a", "b"], {}, [True, True])
    # In a run: refused on empty completions before anything compiles or is written ...
    cfg = config(tmp_path, 1, path=sums(tmp_path), rewards=(f"{rf}:has_want,raises",))
    with pytest.raises(T.RewardError, match="before training.*'raises'.*ZeroDivisionError"):
        tg.main(cfg)
    assert not os.path.exists(tmp_path / "run")
    # ... or on the first completions (the held-out ones at step 0), which the command line
    # prints as one line and exits 2 with, like any bad input.
    cfg = config(tmp_path, 1, path=sums(tmp_path), rewards=(f"{rf}:raises_later",))
    with pytest.raises(T.RewardError, match=r"reward 'raises_later' \(.*my_rewards.py\) raised "
                                            r"KeyError: 'x' \(at .*my_rewards.py, line \d+\), on "
                                            r"a batch of 16 completions"):
        tg.main(cfg)
    assert issubclass(T.RewardError, train.INPUT_ERRORS)


@pytest.mark.parametrize("lines,match", [
    (None, "--task.path .*: no such file"),
    ([], "holds no prompts"),
    (['{"prompt": "1+1="}', '{"prompt": "2+2="'], r"prompts.jsonl, line 2: not valid JSON"),
    (['{"prompt": "1+1="}', '', '{"question": "2+2="}'],
     r"prompts.jsonl, line 3: needs a \"prompt\" or a \"messages\" field"),
    (['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "2+2="}'],
     r"prompts.jsonl, line 2: fields \['prompt'\] differ from .*line 1's \['answer', 'prompt'\]"),
    (['{"prompt": 12}'], r"line 1: \"prompt\" is a int"),
    (['{"prompt": "1=", "finished": true}'], "line 1: field 'finished' is what the trainer"),
    (['{"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", '
      '"content": "2"}]}'], "line 1: the last message is the assistant's"),
    (['{"messages": [{"role": "user", "content": "1+1="}]}'],
     "line 1: chat \"messages\" need a chat template.*has none"),
    (['{"prompt": "one plus one"}'], "line 1: character 'o' is not in the task's vocabulary"),
])
def test_bad_prompts_files_name_the_file_and_line(tmp_path, lines, match):
    path = str(tmp_path / "prompts.jsonl") if lines is None else jsonl(tmp_path / "prompts.jsonl",
                                                                        lines)
    cfg = config(tmp_path, 1, path=path, rewards=("format",))
    with pytest.raises((DataError, FileNotFoundError), match=match):
        tg.main(cfg)
    assert not os.path.exists(tmp_path / "run")  # refused before the run directory was made


def test_bad_task_flags_are_refused_before_compiling(tmp_path):
    path = sums(tmp_path)
    for task, match in [
            (dict(path=path), "--task.path needs --task.rewards"),
            (dict(rewards=("format",)), "--task.rewards goes with --task.path"),
            (dict(path=path, rewards=("format",), eval_prompts=104), "leaves none to train on"),
            (dict(path=path, rewards=("format",), eval_path=path, eval_prompts=104),
             "holds 100 prompts, fewer than --task.eval-prompts 104")]:
        with pytest.raises((tg.ConfigError, DataError), match=match):
            tg.validate(config(tmp_path, 1, **task), jax.device_count(), tg.CharTokenizer())
    with pytest.raises(tg.ConfigError, match="--warm.max-steps 5: the warm start fine-tunes"):
        tg.validate(dataclasses.replace(config(tmp_path, 1, path=path, rewards=("format",)),
                                        warm=tg.WarmStartConfig(max_steps=5)),
                    jax.device_count(), tg.CharTokenizer())
    with pytest.raises(tg.ConfigError, match="exceed --model.max-seq-len 6"):
        tg.validate(config(tmp_path, 1, model=dataclasses.replace(SMALL, max_seq_len=6),
                           path=path, rewards=("format",)), jax.device_count(),
                    tg.CharTokenizer())
