"""A run that goes wrong stops at once, says why, and keeps its last good state.

A diverging run (a learning rate of 1e4) stops within a few steps with exit code 3, the newest
checkpoint is finite and is the state before the bad step, and a resume with a sane learning
rate goes on from it; --train.max-bad-steps N skips N bad updates and stops on the next. Every
numeric flag of every trainer is checked before anything compiles, against a range written
down in this file (EXPECTED, not read from the code under test): the values just outside it,
NaN, inf and 2^31 must exit 2, name the flag and print no traceback, and the values at its
edges must pass. A run directory that cannot be written is refused the same way.
"""
import dataclasses
import functools
import inspect
import json
import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import train_dense as td
import train_grpo as tg
import train_moe as tm
from common import train
from common.checkpoint import CheckpointConfig, Checkpointer
from common.config import check_ranges, compute_fields, may_change
from tests.test_train import MODEL, data_path  # noqa: F401  (data_path: a pytest fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(run_dir, data, lr, **train_kw):
    return td.Config(model=MODEL, train=td.TrainConfig(
        steps=12, batch_size=8, seq_len=32, warmup_steps=1, lr=lr, schedule="constant",
        log_every=1, eval_every=100, eval_batches=1, sample_tokens=0, **train_kw),
        data=td.DataConfig(path=data), checkpoint=CheckpointConfig(every=1, keep=20),
        run_dir=str(run_dir))


def records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def saved(run_dir, step=None):
    with Checkpointer(str(run_dir), CheckpointConfig(async_save=False)) as ckpt:
        steps = ckpt.all_steps()
        cfg = config(run_dir, "", 1.0)
        st = td.train_state(cfg, td.make_mesh(cfg.mesh))
        return steps, jax.device_get(ckpt.restore(step or steps[-1], st.abstract()))


def corrupt(monkeypatch, steps):
    """A bad batch at each of `steps` (1-based): a token id past the vocabulary, whose
    embedding lookup is NaN, as corrupt data would be."""
    real = td.get_batch

    def get_batch(tokens, *, step, seed, **kw):
        b = real(tokens, step=step, seed=seed, **kw)
        if step + 1 in steps and seed == 0:  # the train split (eval draws with seed + 1)
            b = jax.device_put(b.at[0, 3].set(10**6), b.sharding)
        return b
    monkeypatch.setattr(td, "get_batch", get_batch)


def test_a_bad_step_stops_the_run_and_keeps_the_last_good_state(data_path, tmp_path,
                                                                  monkeypatch):
    run, ref = tmp_path / "run", tmp_path / "ref"
    corrupt(monkeypatch, {5})
    with pytest.raises(train.NonFiniteError, match=r"step 5: loss nan, grad_norm nan: not "
                                                   r"finite.*--train.max-bad-steps"):
        td.main(config(run, data_path, 3e-3))
    steps, state = saved(run)
    assert steps == [1, 2, 3, 4]  # nothing of step 5, though every step is a save step
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state))
    monkeypatch.undo()
    # The state before the bad step: four good steps alone end in it, bitwise.
    td.main(dataclasses.replace(config(ref, data_path, 3e-3), train=dataclasses.replace(
        config(ref, data_path, 3e-3).train, steps=4)))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(saved(ref)[1])):
        np.testing.assert_array_equal(a, b)
    # A rerun resumes from it (here with a lower learning rate) and trains to the end.
    again = td.main(config(run, data_path, 1e-3))
    assert again["start_step"] == 4 and again["final_step"] == 12
    assert all(math.isfinite(r["loss"]) for r in records(run) if "loss" in r)


def test_max_bad_steps_skips_that_many_then_stops(data_path, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    corrupt(monkeypatch, {3, 5, 6, 9})
    with pytest.raises(train.NonFiniteError, match=r"step 9: .*\(3 skipped in this run, of 3\)"):
        td.main(config(run, data_path, 3e-3, max_bad_steps=3))
    out = capsys.readouterr().out
    for i, step in enumerate((3, 5, 6), 1):
        assert f"step {step}: loss nan, grad_norm nan: not finite; update skipped ({i} of " \
               "--train.max-bad-steps 3)" in out
    steps, state = saved(run)
    assert steps[-1] == 8 and all(np.isfinite(x).all() for x in jax.tree.leaves(state))
    recs = {r["step"]: r for r in records(run) if "loss" in r}
    assert recs[8]["skipped_steps"] == 3 and recs[4]["skipped_steps"] >= 1
    # A skipped step leaves the parameters as they were: 3 and 4 train on what step 2 left.
    assert recs[3]["nonfinite"] == 1.0 and recs[4]["nonfinite"] == 0.0


def test_a_learning_rate_of_1e4_exits_3_within_a_few_steps(data_path, tmp_path):
    flags = ["--model.vocab-size", "512", "--model.d-model", "32", "--model.n-layers", "2",
             "--model.n-heads", "4", "--model.n-kv-heads", "2", "--model.head-dim", "8",
             "--model.d-ff", "64", "--train.batch-size", "8", "--train.seq-len", "32",
             "--train.steps", "12", "--train.sample-tokens", "0", "--data.path", data_path,
             "--checkpoint.every", "1"]
    r = subprocess.run([sys.executable, "train_dense.py", "tiny", *flags, "--train.lr", "1e4",
                        "--run-dir", str(tmp_path / "r")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "not finite" in r.stderr and "Traceback" not in r.stderr
    bad = int(re.search(r"error: step (\d+):", r.stderr).group(1))
    steps, state = saved(tmp_path / "r")
    assert bad <= 12 and steps[-1] < bad  # what huge steps left is finite, if meaningless
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state))


# ---- every numeric flag, checked before compiling ----------------------------------------
# The range of each numeric flag, written down here and not read from the trainers, so that a
# range the code widens or narrows by mistake fails below. "-1 or R": -1 has a meaning of its
# own (the paper's clip range, the latest checkpoint, "the devices left" for a mesh axis).

MESH = """mesh.data mesh.fsdp mesh.context mesh.tensor mesh.expert mesh.stage: -1 or >= 1
          mesh.dcn_data mesh.dcn_fsdp mesh.dcn_context mesh.dcn_tensor mesh.dcn_expert
          mesh.dcn_stage: >= 1"""
CKPT = """checkpoint.every: >= 0 | checkpoint.keep: > 0 | checkpoint.restore_step: -1 or >= 0
          bench: >= 0"""
DATA = "data.vocab_size: > 0 | data.seed: >= 0 | data.eval_fraction: (0, 1)"
LLAMA = """model.vocab_size model.d_model model.n_layers model.n_heads model.n_kv_heads
           model.head_dim model.d_ff model.max_seq_len model.rope_theta model.norm_eps
           model.rope_low_freq_factor model.rope_high_freq_factor model.rope_original_max_len
           model.loss_chunk: > 0 | model.rope_scaling: >= 0"""
TRAIN = """train.steps train.batch_size train.seq_len train.microbatches train.lr train.clip_norm
           train.log_every train.eval_every train.eval_batches: > 0
           train.warmup_steps train.weight_decay train.qk_clip_threshold train.z_loss train.seed
           train.sample_tokens train.temperature train.peak_tflops train.max_bad_steps: >= 0
           train.min_lr_ratio: [0, 1] | train.decay_fraction: (0, 1]
           train.b1 train.b2: [0, 1)"""
GEMMA = """model.sliding_window model.global_every model.rope_local_theta model.rope_linear
           model.attn_softcap model.final_softcap model.query_scale: >= 0"""
OLMO = "model.yarn_factor: >= 0 | model.yarn_original_max_len: > 0"
GEMMA4 = """model.global_head_dim model.global_kv_heads model.ple_dim model.kv_shared: >= 0
            model.rope_partial: [0, 1]"""
QWEN35 = """model.linear_k_heads model.linear_v_heads model.rotary_dim: >= 0
            model.linear_k_dim model.linear_v_dim model.linear_conv model.linear_chunk: > 0"""
EXPECTED = {
    "train_dense": [MESH, CKPT, DATA, LLAMA, GEMMA, OLMO, GEMMA4, QWEN35, TRAIN, """
        train.eval_samples train.eval_tasks_limit: >= 0 | compile_slices: > 0
        train.pipeline_repeats: > 0
        dpo.beta dpo.simpo_beta: > 0 | dpo.simpo_gamma: >= 0
        lora.rank: >= 0 | lora.alpha: > 0
        distill.weight: [0, 1] | distill.temperature: > 0 | distill.top_k: >= 0"""],
    "train_moe": [MESH, CKPT, DATA, TRAIN, """
        train.eval_tasks_limit: >= 0 | train.pipeline_repeats: > 0
        model.vocab_size model.d_model model.n_layers model.n_heads model.n_kv_heads
        model.head_dim model.n_experts model.top_k model.d_ff model.max_seq_len
        model.rope_theta model.norm_eps model.yarn_original_max_len model.yarn_beta_fast
        model.yarn_beta_slow model.qk_nope_head_dim model.qk_rope_head_dim model.v_head_dim
        model.loss_chunk model.gmm_tile model.moe_every model.attn_temp_floor
        model.rope_low_freq_factor model.rope_high_freq_factor model.rope_original_max_len: > 0
        model.attn_chunk model.attn_temp_scale model.rope_scaling
        model.capacity_factor model.sliding_window model.global_every model.swiglu_limit
        model.yarn_factor model.kv_lora_rank model.q_lora_rank model.yarn_mscale_all_dim
        model.routed_scale model.n_group model.topk_group model.n_shared_experts model.shared_d_ff
        model.first_k_dense model.dense_d_ff model.rope_local_theta model.global_head_dim
        model.global_kv_heads model.final_softcap: >= 0 | model.rope_partial: [0, 1]
        train.load_balance_loss train.router_z_loss train.router_bias_rate: >= 0
        model.index_n_heads model.mtp_depth train.indexer_warmup_steps train.mtp_weight: >= 0
        model.index_head_dim model.index_topk model.index_chunk: > 0
        model.linear_k_heads model.linear_v_heads model.rotary_dim: >= 0
        model.linear_k_dim model.linear_v_dim model.linear_conv model.linear_chunk: > 0
        compile_slices: > 0 | lora.rank: >= 0 | lora.alpha: > 0"""],
    "train_grpo": [MESH, CKPT, LLAMA, GEMMA, OLMO, GEMMA4, QWEN35, """
        grpo.prompts_per_step grpo.group_size grpo.max_new_tokens grpo.temperature grpo.mu
        grpo.microbatches grpo.lr grpo.clip_norm grpo.log_every grpo.eval_every: > 0
        grpo.steps grpo.top_k grpo.beta grpo.warmup_steps grpo.weight_decay
        grpo.qk_clip_threshold grpo.format_weight grpo.seed grpo.peak_tflops
        grpo.max_bad_steps grpo.rollout_batch grpo.decode_rows: >= 0 | grpo.decode_segment: >= 1
        grpo.top_p: (0, 1] | grpo.eps_low: -1 or (0, 1) | grpo.eps_high: -1 or > 0
        grpo.b1 grpo.b2: [0, 1)
        warm.check_every warm.batch_size warm.lr: > 0
        warm.max_steps warm.target_reward warm.warmup_steps: >= 0
        task.min_digits task.max_digits task.eval_prompts: > 0 | task.eval_seed: >= 0
        lora.rank: >= 0 | lora.alpha: > 0"""],
}


def expected(mod) -> dict[str, str]:
    """{dotted flag: its range} from EXPECTED: "a b c: RULE" lines, several split by "|"."""
    out = {}
    for chunk in EXPECTED[mod.__name__]:
        for names, rule in re.findall(r"([a-z0-9_.\s]+?):\s*([^|\n]+)", chunk):
            out |= {n: rule.strip() for n in names.split()}
    return out


def probes(rule: str, is_int: bool) -> tuple[list, list]:
    """(values outside `rule`, values inside it), at its edges; written without the code's
    own range reader. Every number must also be finite, and an int fit int32."""
    special, _, rule = rule.rpartition(" or ")
    d = 1 if is_int else 0.01
    if rule[0] in "[(":
        lo, hi = (float(x) for x in rule[1:-1].split(","))
        out = [lo if rule[0] == "(" else lo - d, hi if rule[-1] == ")" else hi + d]
        inside = [lo if rule[0] == "[" else lo + d, hi if rule[-1] == "]" else hi - d]
    else:
        op, x = rule.split()
        x = float(x)
        out, inside = ([x, x - 1], [x + d]) if op == ">" else ([x - d, x - 1], [x])
    if special:
        out, inside = [v for v in out if v != float(special)] + [float(special) - 1], \
            inside + [float(special)]
    out += [2**31] if is_int else [float("nan"), float("inf")]
    fmt = lambda v: str(int(v)) if is_int else repr(float(v))
    return list(dict.fromkeys(map(fmt, out))), list(dict.fromkeys(map(fmt, inside)))


def numeric_flags(cfg, prefix=""):
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            yield from numeric_flags(v, f"{prefix}{f.name}.")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield f"{prefix}{f.name}", isinstance(v, int)


TRAINERS = [(td, "tiny"), (tm, "tiny-moe"), (tg, "tiny")]


@pytest.mark.parametrize("mod, preset", TRAINERS, ids=[m.__name__ for m, _ in TRAINERS])
def test_the_range_table_names_every_numeric_flag(mod, preset):
    """A new numeric flag needs its range written in EXPECTED; a removed one, its line gone."""
    flags = {p for p, _ in numeric_flags(mod.PRESETS[preset][1])}
    assert flags == set(expected(mod)), (flags ^ set(expected(mod)))


CASES = [(mod, preset, path, is_int) for mod, preset in TRAINERS
         for path, is_int in numeric_flags(mod.PRESETS[preset][1])]


@pytest.fixture(scope="module", autouse=True)
def sources_read_once():
    """Each class's source read once for the file, not once a parse. tyro takes the flags' help
    from the config classes' source (inspect.getsource, which on Python < 3.13 parses the whole
    trainer file to find a class) and empties its caches after every parse, so each of the ~600
    parses below read ~8 classes afresh: ~40% of this file's time. The files do not change while
    it runs, so the parse is the same with the source kept: what reaches the range checks, the
    messages and the exit codes is untouched."""
    getsource = inspect.getsource

    @functools.cache
    def cached(obj):
        return getsource(obj)

    def read(obj):
        try:
            return cached(obj)
        except TypeError:  # unhashable: not a class or function; read as before
            return getsource(obj)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inspect, "getsource", read)
        yield


def with_value(cfg, path: str, value):
    """cfg with the dotted field set, as the flag would set it (no parse: see below)."""
    head, _, rest = path.partition(".")
    return dataclasses.replace(cfg, **{head: with_value(getattr(cfg, head), rest, value)
                                       if rest else value})


@pytest.mark.parametrize("mod, preset, path, is_int", CASES,
                         ids=[f"{m.__name__}-{p}" for m, _, p, _ in CASES])
def test_every_numeric_flag_is_checked_before_compiling(mod, preset, path, is_int, tmp_path,
                                                        monkeypatch, capsys):
    """Each value just outside the flag's range (and NaN, inf, 2^31) is refused naming the
    flag; each value at the range's edges passes the checks. The first value outside goes the
    whole way a user's does (the command line, exit 2, no traceback, nothing run); the others
    go straight to the range check, which is what refuses them (a parse costs 0.15 s, and
    there are ~1,800 values). Mesh sizes are checked where the mesh is resolved: every value
    takes the whole way."""
    out, inside = probes(expected(mod)[path], is_int)
    flag = "--" + path.replace("_", "-")
    # Whatever gets past the checks must not start training: fail loudly if it does.
    monkeypatch.setattr(train, "Run", lambda *a, **k: pytest.fail(f"{flag} ran"))
    monkeypatch.setattr(train, "dry_run", lambda *a, **k: pytest.fail(f"{flag} ran"))
    mesh = path.startswith("mesh.")
    for i, value in enumerate(out):
        if i and not mesh:
            with pytest.raises((train.ConfigError, ValueError), match=re.escape(flag)):
                check_ranges(with_value(mod.PRESETS[preset][1], path,
                                        (int if is_int else float)(value)))
            continue
        monkeypatch.setattr(sys, "argv", [f"{mod.__name__}.py", preset, flag, value,
                                          "--run-dir", str(tmp_path)])
        with pytest.raises(SystemExit) as e:
            train.run_cli(mod.main, mod.cli)
        err = capsys.readouterr().err
        assert e.value.code == 2, f"{flag} {value}: {err}"
        assert flag in err and "Traceback" not in err, f"{flag} {value}: {err}"
    if mesh:
        return  # a mesh size in range may still not multiply to the devices
    check_ranges(mod.cli([preset, flag, inside[0]]))  # the parse takes the edge value
    for value in inside[1:]:
        check_ranges(with_value(mod.PRESETS[preset][1], path,
                                (int if is_int else float)(value)))


def test_a_run_directory_that_cannot_be_written_is_refused(data_path, tmp_path, monkeypatch,
                                                           capsys):
    (tmp_path / "a-file").write_text("not a folder")
    run = tmp_path / "a-file" / "run"  # even root cannot make a folder inside a file
    monkeypatch.setattr(sys, "argv", ["train_dense.py", "tiny", "--data.path", data_path,
                                      "--run-dir", str(run), "--train.steps", "2"])
    with pytest.raises(SystemExit) as e:
        train.run_cli(td.main, td.cli)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--run-dir {run}: cannot write there" in err, err
    assert "Traceback" not in err


# ---- what a resumed run may change, and what an initialised one keeps ------------------------
# Written down here, as the ranges are: the knobs (common/config.py) must declare exactly these.
LOOP = """steps lr log_every eval_every microbatches qk_clip_threshold profile_steps peak_tflops
          max_bad_steps"""
RESUMABLE = {
    "train_dense": f"""train: {LOOP} eval_batches sample_tokens temperature sample_prompt eval_samples
               eval_tasks eval_tasks_limit pipeline_repeats offload_opt_state
        model: dtype attention context_attention remat scan_layers loss_chunk loss_impl
               linear_chunk vocab_split quant
        : quiet mesh checkpoint dry_run compile_topology compile_slices bench run_dir
        data: cache_dir""",
    "train_moe": f"""train: {LOOP} eval_batches sample_tokens temperature sample_prompt
               eval_tasks eval_tasks_limit mtp_weight pipeline_repeats offload_opt_state
        model: dtype attention context_attention remat scan_layers loss_chunk grouped_matmul
               gmm_tile down_split index_chunk linear_chunk quant
        : quiet mesh checkpoint dry_run compile_topology compile_slices bench bench_twin run_dir
        data: cache_dir""",
    "train_grpo": f"""grpo: {LOOP} pack decode decode_rows decode_segment
        model: dtype attention context_attention remat scan_layers loss_chunk loss_impl
               linear_chunk vocab_split quant
        : quiet mesh checkpoint dry_run bench run_dir warm""",
}
# Model fields kept from this run's flags under --init-from(-hf): how to compute, not what.
COMPUTE = {"train_dense": "dtype attention context_attention remat scan_layers loss_chunk "
                          "loss_impl linear_chunk vocab_split quant",
           "train_moe": "dtype attention context_attention remat scan_layers loss_chunk "
                        "grouped_matmul gmm_tile down_split capacity_factor index_chunk "
                        "linear_chunk quant",
           "train_grpo": "dtype attention context_attention remat scan_layers loss_chunk "
                         "loss_impl linear_chunk vocab_split quant"}


@pytest.mark.parametrize("mod", [td, tm, tg], ids=lambda m: m.__name__)
def test_the_knobs_declare_what_a_resume_may_change(mod):
    want = {f"{sec}.{n}" if sec else n for sec, names in re.findall(
        r"(\w*):\s*([a-z0-9_\s]+?)(?=\n\s*\w*:|$)", RESUMABLE[mod.__name__]) for n in names.split()}
    assert may_change(mod.Config) == want
    assert set(compute_fields(mod.ModelConfig)) == set(COMPUTE[mod.__name__].split())
