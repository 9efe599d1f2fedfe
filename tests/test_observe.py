"""Seeing a run: TensorBoard files equal metrics.jsonl, plots, profiles, progress, the summary,
and a loop that fetches metrics on log steps only. One short run of each trainer."""
import contextlib
import dataclasses
import glob
import gzip
import io
import json
import os
import struct
import subprocess
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train_dense as td
import train_grpo as tg
import train_moe as tm
from common import observe
from tools import plot
from common.checkpoint import CheckpointConfig, check_run_config
from common.config import may_change
from common.data import DataConfig, prepare
from common.mesh import MeshConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, LOG_EVERY, EVAL_EVERY, PROFILE = 8, 3, 4, (4, 5)
LOGGED = [1, 3, 6, 8]  # the first step, every LOG_EVERY, the last


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, f) for f in ("argparse.py", "textwrap.py", "string.py")]
    return prepare(files, str(tmp_path_factory.mktemp("d") / "prepared"), vocab_size=400)


def dense_config(run_dir, data_path, **train):
    model = td.ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=8, d_ff=64, max_seq_len=64, loss_chunk=16)
    t = dict(steps=STEPS, batch_size=8, seq_len=32, warmup_steps=2, lr=3e-3,
             log_every=LOG_EVERY, eval_every=EVAL_EVERY, eval_batches=1, sample_tokens=0,
             profile_steps=PROFILE) | train
    return td.Config(model=model, train=td.TrainConfig(**t), mesh=MeshConfig(fsdp=-1),
                     data=DataConfig(path=data_path), checkpoint=CheckpointConfig(every=0),
                     run_dir=str(run_dir))


@pytest.fixture(scope="module")
def dense_run(data_path, tmp_path_factory):
    """One train_dense.py run that records how the trainer's own code read device arrays:
    every explicit jax.device_get, and every implicit read (float(x), bool(x), x.item(), ...)
    made from train_dense.py. A transfer guard would be simpler, but on the CPU it never
    fires: host and device memory are one."""
    run_dir = tmp_path_factory.mktemp("dense") / "run"
    fetched, implicit = [], []
    real_get = jax.device_get
    Array = type(jnp.zeros(()))

    def counting_get(x):
        fetched.append(sorted(x) if isinstance(x, dict) else type(x).__name__)
        return real_get(x)

    def watch(name):
        method = getattr(Array, name)

        def read(self, *a, **kw):
            caller = sys._getframe(1).f_code
            if os.path.basename(caller.co_filename) == "train_dense.py":
                implicit.append(f"{name} in {caller.co_name}")
            return method(self, *a, **kw)
        return read

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(jax, "device_get", counting_get)
        for name in ("__float__", "__int__", "__bool__", "__index__", "item", "tolist"):
            mp.setattr(Array, name, watch(name))
        summary = td.main(dense_config(run_dir, data_path))
    return {"dir": str(run_dir), "out": out.getvalue(), "fetched": fetched,
            "implicit": implicit, "summary": summary}


def jsonl(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_events(folder):
    """{(tag, step): value} and {tag: text} from TensorBoard event files, parsed by hand:
    TFRecord framing (u64 length, u32 crc, data, u32 crc) around Event protos."""
    from tensorboardX.proto import event_pb2
    scalars, texts = {}, {}
    files = sorted(glob.glob(os.path.join(folder, "events.out.tfevents.*")))
    assert files, f"no event files in {folder}"
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        i = 0
        while i < len(data):
            (n,) = struct.unpack_from("<Q", data, i)
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    scalars[(v.tag, event.step)] = v.simple_value
                else:
                    texts[v.tag] = v.tensor.string_val[0].decode()
    return scalars, texts


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


# ---------------------------------------------------------------------------------- dense run


def test_event_files_hold_what_metrics_jsonl_holds(dense_run):
    recs = jsonl(dense_run["dir"])
    assert [r["step"] for r in recs if "loss" in r] == LOGGED
    # Eval at 4 is no log step: a record of its own; eval at 8 joins that step's record.
    assert {"step": 4, "eval_loss": recs[2]["eval_loss"]} == recs[2]
    assert "eval_loss" in recs[-1] and recs[-1]["step"] == 8
    scalars, texts = read_events(os.path.join(dense_run["dir"], "tensorboard"))
    expected = {(k, r["step"]): v for r in recs for k, v in r.items() if k != "step"}
    assert set(expected) <= set(scalars)
    assert {t for t, _ in expected} == {"loss", "eval_loss", "lr", "grad_norm", "tokens_per_s",
                                        "mfu", "ms_per_step", "nonfinite", "skipped_steps"}
    for key, v in expected.items():
        assert scalars[key] == np.float32(v), key   # TensorBoard keeps float32
    config = json.loads("\n".join(l[4:] for l in texts["config/text_summary"].splitlines()))
    with open(os.path.join(dense_run["dir"], "config.json")) as f:
        assert config == json.load(f)


def test_loop_fetches_metrics_on_log_steps_only(dense_run):
    # Every read of a device array is an explicit jax.device_get: metrics once per log step
    # (one step late, not every step), plus the per-step stop vote and non-finite flag
    # (scalars of the step before) and the evals. A float(metrics["loss"]) in the loop would wait for each step.
    assert dense_run["implicit"] == []
    metric_fetches = [f for f in dense_run["fetched"] if isinstance(f, list) and "loss" in f]
    assert len(metric_fetches) == len(LOGGED) < STEPS
    assert dense_run["summary"]["final_step"] == STEPS


def test_profile_steps_write_a_trace_of_those_steps(dense_run):
    sessions = glob.glob(os.path.join(dense_run["dir"], "profile", "plugins", "profile", "*"))
    assert len(sessions) == 1
    xplane = glob.glob(os.path.join(sessions[0], "*.xplane.pb"))
    assert xplane and os.path.getsize(xplane[0]) > 1000
    with gzip.open(os.path.join(sessions[0], "perfetto_trace.json.gz")) as f:
        events = json.load(f)["traceEvents"]
    steps = {int(e["args"]["step_num"]) for e in events if e.get("name") == "train"}
    assert steps == set(range(PROFILE[0], PROFILE[1] + 1))
    assert f"profile: tracing steps {PROFILE[0]}-{PROFILE[1]}" in dense_run["out"]


def test_progress_and_the_end_of_run_summary(dense_run):
    out, recs = dense_run["out"], jsonl(dense_run["dir"])
    assert "compiling train step ... " in out and " s | peak " in out
    assert f"checkpoint: saving step {STEPS} ... " in out
    summary = out[out.index("run " + dense_run["dir"] + ": done"):]
    best = min(r["eval_loss"] for r in recs if "eval_loss" in r)
    tokens = STEPS * 8 * 32
    for text in (f"0 -> {STEPS}", f"{tokens:,} this run", f"best eval loss {best:.3f}",
                 "tok/s, MFU", os.path.join(dense_run["dir"], "checkpoints"),
                 os.path.join(dense_run["dir"], "tensorboard"),
                 f"make plot RUN={dense_run['dir']}", f"steps {PROFILE[0]}-{PROFILE[1]}"):
        assert text in summary, text
    assert len(summary.splitlines()) <= 24   # one screen


def test_plot_cli_writes_readable_pngs(dense_run, tmp_path):
    r = subprocess.run([sys.executable, "-m", "tools.plot", dense_run["dir"], "--out",
                        str(tmp_path), "--log-y"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    names = sorted(os.listdir(tmp_path))
    assert names == ["loss.png", "lr.png", "throughput.png"]
    from PIL import Image
    for name in names:
        path = str(tmp_path / name)
        assert png_size(path) == plot.PIXELS
        colours = np.unique(np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3), axis=0)
        assert len(colours) > 50, name   # lines, text and antialiasing, not a blank canvas


def test_resume_restores_with_progress_and_has_nothing_to_do(dense_run, data_path, capsys):
    td.main(dense_config(dense_run["dir"], data_path, profile_steps=()))
    out = capsys.readouterr().out
    assert f"checkpoint: restoring step {STEPS} from " in out and "nothing to train" in out
    assert "0 this run" in out


# ------------------------------------------------------------------------- MoE and GRPO runs


def test_moe_expert_load_reaches_tensorboard_and_plots(data_path, tmp_path):
    model = tm.ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=8, n_experts=8, top_k=3, d_ff=16, max_seq_len=64,
                           loss_chunk=8, gmm_tile=8, grouped_matmul="tiled", remat="none")
    cfg = tm.Config(model=model, train=tm.TrainConfig(
        steps=2, batch_size=8, seq_len=16, warmup_steps=1, log_every=1, eval_every=2,
        eval_batches=1, sample_tokens=0), mesh=MeshConfig(data=2, fsdp=1, expert=4),
        data=DataConfig(path=data_path), checkpoint=CheckpointConfig(every=0),
        run_dir=str(tmp_path / "moe"), quiet=True)
    tm.main(cfg)
    recs = jsonl(cfg.run_dir)
    scalars, _ = read_events(os.path.join(cfg.run_dir, "tensorboard"))
    for r in recs:
        for layer in range(model.n_layers):
            assert scalars[(f"load_max/layer_{layer}", r["step"])] == np.float32(
                r["load_max"][layer])
        for key in ("aux_loss", "router_z", "loss", "mfu"):
            assert scalars[(key, r["step"])] == np.float32(r[key])
    paths = plot.plot([cfg.run_dir])
    assert "expert_load.png" in {os.path.basename(p) for p in paths}


def test_grpo_rewards_and_kl_reach_tensorboard_and_plots(tmp_path):
    model = tg.ModelConfig(vocab_size=16, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                           head_dim=8, d_ff=64, max_seq_len=32, remat="none")
    cfg = tg.Config(model=model, grpo=tg.GRPOConfig(
        steps=2, prompts_per_step=8, group_size=4, max_new_tokens=3, warmup_steps=1,
        eval_every=2, beta=0.04), warm=tg.WarmStartConfig(max_steps=2, check_every=1,
                                                          batch_size=8, target_reward=2.0),
        task=tg.TaskConfig(min_digits=1, max_digits=1, eval_prompts=8),
        mesh=MeshConfig(fsdp=-1), checkpoint=CheckpointConfig(every=0),
        run_dir=str(tmp_path / "grpo"), quiet=True)
    tg.main(cfg)
    recs = jsonl(cfg.run_dir)
    steps = [r for r in recs if "reward" in r and "step" in r]
    scalars, _ = read_events(os.path.join(cfg.run_dir, "tensorboard"))
    for r in steps:
        for key in ("reward", "kl", "clip_ratio/region_mean", "completions/mean_length",
                    "entropy", "rewards/correctness/mean"):
            assert scalars[(key, r["step"])] == np.float32(r[key]), key
    # The warm start counts its own steps: a TensorBoard run of its own.
    warm, _ = read_events(os.path.join(cfg.run_dir, "tensorboard", "warm_start"))
    assert {s for (t, s) in warm if t == "warm_start/sft_loss"} == {1, 2}
    names = {os.path.basename(p) for p in plot.plot([cfg.run_dir])}
    assert {"reward.png", "kl.png", "lengths.png", "warm_start.png"} <= names


# ------------------------------------------------------------------------------ pieces


def test_plot_reads_a_resumed_run_and_compares_runs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, recs in ((a, [1, 2, 3, 4, "resume", 3, 4, 5]), (b, [1, 2, 3])):
        d.mkdir()
        lines, seg = [], 0
        for s in recs:
            if s == "resume":
                seg = 1
                continue
            lines.append(json.dumps({"step": s, "loss": 10.0 * seg + s, "lr": 1e-3}))
        lines.append(json.dumps({"step": recs[-1], "eval_loss": 9.0}))
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 6, "lo')  # cut off
    run = plot.read_run(str(a))
    assert [r["step"] for r in run.steps] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in run.steps] == [1, 2, 13, 14, 15]   # the resumed values win
    assert run.steps[-1]["eval_loss"] == 9.0
    figs = plot.figures([run, plot.read_run(str(b))])
    assert set(figs) == {"loss", "lr"}
    assert len(figs["loss"].axes[0].get_lines()) == 4   # 2 runs x (train, eval)
    assert plot.default_out([str(a), str(b)]) == str(tmp_path / "compare-a-b")
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        plot.read_run(str(tmp_path))


def test_without_tensorboardx_a_run_still_logs_and_says_so_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)   # import raises ImportError
    monkeypatch.setattr(observe, "_TBX_HINT_SHOWN", False)
    for _ in range(2):
        with observe.MetricsLog(str(tmp_path), {"x": 1}) as log:
            log.write({"step": 1, "loss": 2.5})
            assert not log.has_tensorboard
    out = capsys.readouterr().out
    assert out.count("tensorboardX is not installed") == 1 and "pip install" in out
    assert jsonl(tmp_path) == [{"step": 1, "loss": 2.5}] * 2
    assert not os.path.exists(tmp_path / "tensorboard")


def test_scalars_flatten_per_layer_lists():
    assert observe.scalars({"step": 3, "a": 1, "load": [0.1] * 11, "name": "x", "ok": True},
                           skip=("step",)) == {"a": 1.0, "ok": 1.0, **{
                               f"load/layer_{i:02d}": 0.1 for i in range(11)}}


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_lines(monkeypatch, capsys):
    observe.configure(quiet=False)
    with observe.progress("counting", total=4, unit="files") as p:
        p.update(4)
        p.note = "(done)"
    assert capsys.readouterr().out.startswith("counting ... 4/4 files (100%), ")
    with observe.progress("short", min_s=5.0):
        pass
    with pytest.raises(RuntimeError), observe.progress("broken"):
        raise RuntimeError
    assert capsys.readouterr().out == "broken ... failed\n"
    observe.configure(quiet=True)
    try:
        with observe.progress("hidden", unit="x") as p:
            p.update()
    finally:
        observe.configure(quiet=False)
    assert capsys.readouterr().out == ""
    # On a terminal the line is redrawn in place while the wait goes on.
    term = _Terminal()
    monkeypatch.setattr(sys, "stdout", term)
    with observe.progress("waiting", unit="items") as p:
        p.update(7)
        give_up = time.monotonic() + 30   # a bound, not a timing: the redraws come every 0.5 s
        while term.getvalue().count("\rwaiting") < 2 and time.monotonic() < give_up:
            time.sleep(0.05)
    text = term.getvalue()
    assert text.count("\rwaiting ... 7 items, ") >= 3 and text.endswith(" s\x1b[K\n")


def test_data_preparation_counts_documents(tmp_path, capsys):
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * 40)
    prepare([str(tmp_path)], str(tmp_path / "out"), vocab_size=300, eval_fraction=0.34)
    out = capsys.readouterr().out
    assert "data: reading input text ... 3 documents, " in out
    assert "data: tokenizing 0.0 MB ... 3/3 documents (100%), " in out


@pytest.mark.parametrize("module,flag,cfg", [
    (td, "--train.profile-steps", lambda s: td.Config(train=td.TrainConfig(steps=10, profile_steps=s))),
    (tm, "--train.profile-steps", lambda s: tm.Config(train=tm.TrainConfig(steps=10, profile_steps=s))),
])
@pytest.mark.parametrize("steps", [(5, 3), (0, 2), (4, 11), (1, 2, 3)])
def test_bad_profile_steps_name_the_flag(module, flag, cfg, steps):
    with pytest.raises(module.ConfigError, match=flag):
        module.validate(cfg(steps), 8)


def test_grpo_bad_profile_steps_name_the_flag():
    assert observe.profile_steps_problem((3, 9), "--grpo.profile-steps", 4).startswith(
        "--grpo.profile-steps 3 9")
    assert observe.profile_steps_problem((2,), "--grpo.profile-steps", 4) is None


@pytest.mark.parametrize("module,section", [(td, "train"), (tm, "train"), (tg, "grpo")])
def test_profiles_and_quiet_may_change_on_resume(module, section, tmp_path):
    cfg = module.Config()
    check_run_config(str(tmp_path), dataclasses.asdict(cfg), may_change(module.Config))
    changed = dataclasses.replace(cfg, quiet=True, **{section: dataclasses.replace(
        getattr(cfg, section), profile_steps=(2, 3))})
    check_run_config(str(tmp_path), dataclasses.asdict(changed), may_change(module.Config))


def test_make_targets_for_plots_and_tensorboard():
    def dry(*args):
        r = subprocess.run(["make", "-n", "-B", *args, "VENV=/nonexistent-venv"], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        return r.returncode, " ".join(r.stdout.replace("\\\n", " ").split()), r.stdout + r.stderr
    rc, out, _ = dry("plot", "RUN=runs/a runs/b", "ARGS=--log-y")
    assert rc == 0 and "/nonexistent-venv/bin/python -m tools.plot runs/a runs/b --log-y" in out
    rc, out, _ = dry("tensorboard", "RUN=runs/a")
    assert rc == 0 and "-m tensorboard.main --port 6006 --logdir runs/a" in out
    rc, out, _ = dry("tensorboard", "RUN=runs/a runs/b/", "PORT=7000")
    assert rc == 0 and "--port 7000 --logdir_spec a:runs/a,b:runs/b/" in out
    r = subprocess.run(["make", "plot", "VENV=/nonexistent-venv"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "make plot RUN=" in r.stdout
    assert not os.path.exists("/nonexistent-venv")   # refused before building a venv
    helped = subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "make plot " in helped and "make tensorboard " in helped


def test_summary_throughput_is_the_training_steps_with_eval_and_checkpoints_apart(tmp_path):
    """A 10 ms step, a 300 ms eval every 4 steps and a 200 ms save every 4: counted in, they
    would make the mean 135 ms/step; the summary says the steps' own ~10 ms, the rest apart."""
    from types import SimpleNamespace
    from common import train

    class Saves:  # a checkpointer whose every save is slow
        due = staticmethod(lambda step: step % 4 == 0)
        save = staticmethod(lambda step, state, force=False: (force or step % 4 == 0) and (
            time.sleep(0.2) or True))

    with observe.MetricsLog(str(tmp_path)) as log, observe.Profiler(str(tmp_path), ()) as prof:
        run = SimpleNamespace(dir=str(tmp_path), t_start=time.perf_counter(), metrics_log=log,
                              profiler=prof, ckpt=Saves())
        loop = train.Loop(run, 0, 12, log_every=2, eval_every=4, tokens_per_step=1000,
                          flops_per_token=1e6, peak_tflops=1.0, show=lambda r: "")
        for step in loop:
            time.sleep(0.01)
            loop.log({"loss": jnp.float32(step)})
            if loop.eval_due:
                time.sleep(0.3)
                loop.eval({"eval_loss": 1.0})
            loop.checkpoint({"w": jnp.zeros(())})
        out = loop.summary(12, "1 x 1000")
    assert 10 <= out["ms_per_step"] < 40, out["ms_per_step"]
    assert 0.9 <= out["eval_s"] < 1.5 and 0.6 <= out["checkpoint_s"] < 1.0, out
    assert all(r["ms_per_step"] < 60 for r in log.records[1:] if "ms_per_step" in r), [
        r.get("ms_per_step") for r in log.records]
