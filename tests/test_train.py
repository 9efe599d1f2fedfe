"""train_dense.main end to end: resume, reshard, refuse, preempt. Tiny model, prepared data."""
import dataclasses
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig

import jax
import numpy as np
import pytest

import train_dense as td
from common.checkpoint import CheckpointConfig, CheckpointError, Checkpointer, ConfigConflictError
from common.data import DataConfig, prepare
from common.mesh import MeshConfig, make_mesh
from tests.spawn import spawn, xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = td.ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=8, d_ff=64, max_seq_len=64, loss_chunk=16)
TINY_FLAGS = ["--model.vocab-size", "512", "--model.d-model", "32", "--model.n-layers", "2",
              "--model.n-heads", "4", "--model.n-kv-heads", "2", "--model.head-dim", "8",
              "--model.d-ff", "64", "--train.batch-size", "8", "--train.seq-len", "32"]


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    """A few stdlib modules as 'user text', tokenized with a small vocabulary."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = [os.path.join(stdlib, f) for f in ("argparse.py", "textwrap.py", "string.py",
                                              "shlex.py", "fnmatch.py")]
    return prepare(files, str(tmp_path_factory.mktemp("d") / "prepared"), vocab_size=400)


def config(run_dir, data_path, steps, mesh=MeshConfig(fsdp=-1), every=3, **model):
    return td.Config(
        model=dataclasses.replace(MODEL, **model),
        train=td.TrainConfig(steps=steps, batch_size=8, seq_len=32, warmup_steps=2, lr=3e-3,
                             schedule="constant", log_every=1, eval_every=4, eval_batches=1,
                             sample_tokens=8),
        mesh=mesh, data=DataConfig(path=data_path),
        checkpoint=CheckpointConfig(every=every, keep=2), run_dir=str(run_dir))


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_resumed_equals_uninterrupted(data_path, tmp_path, capsys):
    full = td.main(config(tmp_path / "a", data_path, steps=6))
    td.main(config(tmp_path / "b", data_path, steps=3))
    resumed = td.main(config(tmp_path / "b", data_path, steps=6))
    out = capsys.readouterr().out
    assert "resumed from step 3" in out and "sample:" in out
    assert resumed["final_step"] == full["final_step"] == 6
    for a, b in zip(jax.tree.leaves(jax.device_get(full["state"]["params"])),
                    jax.tree.leaves(jax.device_get(resumed["state"]["params"]))):
        np.testing.assert_array_equal(a, b)   # bitwise, same mesh
    la = [m["loss"] for m in metrics(tmp_path / "a")]
    lb = [m["loss"] for m in metrics(tmp_path / "b")]
    assert [m["step"] for m in metrics(tmp_path / "a")] == [1, 2, 3, 4, 5, 6]
    assert la == lb
    assert la[-1] < la[0]
    # A third start has nothing left to do and says so rather than training again.
    td.main(config(tmp_path / "b", data_path, steps=6))
    assert "nothing to train" in capsys.readouterr().out


def test_restore_onto_another_mesh(data_path, tmp_path):
    a = config(tmp_path / "a", data_path, steps=4, mesh=MeshConfig(fsdp=-1))
    td.main(a)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    other = MeshConfig(data=2, fsdp=2, tensor=2)

    restored = {}
    for name, mc in (("a", a.mesh), ("b", other)):
        mesh = make_mesh(mc)
        with jax.set_mesh(mesh):
            abstract = td.train_state(a, mesh).abstract()
            with Checkpointer(str(tmp_path / name), a.checkpoint) as ckpt:
                state = ckpt.restore(4, abstract)
        wq = state["params"]["layers"]["wq"]
        assert wq.sharding.mesh.shape["tensor"] == mc.tensor
        restored[name] = jax.device_get(state)
    for x, y in zip(jax.tree.leaves(restored["a"]), jax.tree.leaves(restored["b"])):
        np.testing.assert_array_equal(x, y)

    td.main(dataclasses.replace(a, train=dataclasses.replace(a.train, steps=5)))
    td.main(dataclasses.replace(a, run_dir=str(tmp_path / "b"), mesh=other,
                                train=dataclasses.replace(a.train, steps=5)))
    la, lb = metrics(tmp_path / "a")[-1], metrics(tmp_path / "b")[-1]
    assert la["step"] == lb["step"] == 5
    assert lb["loss"] == pytest.approx(la["loss"], rel=1e-5)


def test_conflicting_run_config_is_refused_and_nothing_is_lost(data_path, tmp_path):
    td.main(config(tmp_path, data_path, steps=3))
    before = sorted(os.listdir(tmp_path / "checkpoints"))
    with pytest.raises(ConfigConflictError) as e:
        td.main(config(tmp_path, data_path, steps=3, n_layers=3))
    assert "model.n_layers" in str(e.value) and "--run-dir" in str(e.value)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == before


def test_corrupt_checkpoint_is_a_clear_error(data_path, tmp_path):
    td.main(config(tmp_path, data_path, steps=3))
    data_files = [f for f in glob.glob(str(tmp_path / "checkpoints" / "3" / "**" / "*"),
                                       recursive=True)
                  if os.path.isfile(f) and "metadata" not in os.path.basename(f).lower()]
    assert data_files
    for f in data_files:
        with open(f, "r+b") as fh:
            fh.truncate(0)
    with pytest.raises(CheckpointError) as e:
        td.main(config(tmp_path, data_path, steps=4))
    assert os.path.join("checkpoints", "3") in str(e.value)


def test_missing_data_path_names_the_flag(tmp_path):
    cfg = config(tmp_path / "run", str(tmp_path / "nowhere"), steps=1)
    with pytest.raises((FileNotFoundError, ValueError)) as e:
        td.main(cfg)
    assert "--data.path" in str(e.value) and "prepare" in str(e.value)


def test_cli_bad_input_exits_2_with_the_flag(tmp_path):
    env = dict(os.environ, XLA_FLAGS=xla_flags(8))
    r = subprocess.run([sys.executable, "train_dense.py", "tiny", "--mesh.fsdp", "3",
                        "--run-dir", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert "--mesh.fsdp 3" in r.stderr and "Traceback" not in r.stderr


def test_sigterm_saves_at_the_next_step_and_exits_0(data_path, tmp_path):
    env = dict(os.environ, XLA_FLAGS=xla_flags(1),
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "train_dense.py", "tiny", *TINY_FLAGS, "--data.path", data_path,
           "--run-dir", str(tmp_path), "--train.steps", "100000", "--train.log-every", "1",
           "--checkpoint.every", "0", "--train.sample-tokens", "0"]
    p = spawn(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("step 3 |"):
            p.send_signal(signal.SIGTERM)
            break
    rest, _ = p.communicate(timeout=600)
    out = "".join(lines) + rest
    assert p.returncode == 0, out
    assert "SIGTERM: saved step" in out
    saved = [int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()]
    assert len(saved) == 1 and 3 <= saved[0] < 100000
