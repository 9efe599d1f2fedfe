"""common/checkpoint.py on 8 simulated CPU devices: save, reshard on restore, keep-N,
cut-off saves, damaged and foreign directories, failing saves, run configs, SIGTERM."""

import glob
import json
import os
import shutil
import signal
import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from common.checkpoint import (
    CheckpointConfig,
    CheckpointError,
    Checkpointer,
    ConfigConflictError,
    PreemptionGuard,
    check_run_config,
)


class AdamLike(NamedTuple):
    """Stands in for an optax state: a named tuple of trees, stored by Orbax as a dict."""

    count: jax.Array
    mu: dict


# Parameter name -> (shape, dtype, partition spec), shaped like the dense trainer's tree.
SPECS = {
    "embed": ((16, 8), jnp.float32, P("tensor", "fsdp")),
    "layers/wq": ((2, 8, 4, 2), jnp.float32, P(None, "fsdp", "tensor", None)),
    "layers/w_down": ((2, 16, 8), jnp.bfloat16, P(None, "tensor", "fsdp")),
    "final_norm": ((8,), jnp.float32, P()),
}


def mesh_of(shape, devices=None):
    devices = jax.devices() if devices is None else devices
    return Mesh(np.array(devices).reshape(shape), ("fsdp", "tensor"))


def nest(flat):
    tree = {}
    for key, value in flat.items():
        *parents, leaf = key.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def shardings(mesh_or_device):
    """The target sharding of every leaf: NamedShardings on a mesh, or one device."""
    if isinstance(mesh_or_device, Mesh):
        params = nest({k: NamedSharding(mesh_or_device, spec) for k, (_, _, spec) in SPECS.items()})
        scalar = NamedSharding(mesh_or_device, P())
    else:
        params = nest({k: SingleDeviceSharding(mesh_or_device) for k in SPECS})
        scalar = SingleDeviceSharding(mesh_or_device)
    return {"params": params, "opt_state": (AdamLike(count=scalar, mu=params), None), "step": scalar}


def make_state(mesh, seed=0):
    """A train-state-like tree with distinct values everywhere, sharded on `mesh`."""
    rng = np.random.default_rng(seed)
    host = nest({k: rng.standard_normal(shape).astype(dtype) for k, (shape, dtype, _) in SPECS.items()})
    mu = jax.tree.map(lambda x: (x * 3).astype(x.dtype), host)
    tree = {
        "params": host,
        "opt_state": (AdamLike(count=np.int32(7), mu=mu), None),
        "step": np.int32(seed + 11),
    }
    return jax.tree.map(jax.device_put, tree, shardings(mesh))


def abstract(state, target):
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings(target)
    )


def host_copy(state):
    return jax.tree.map(lambda x: np.array(x), state)


def assert_bitwise_equal(restored, expected_host):
    flat_r = jax.tree_util.tree_leaves_with_path(restored)
    flat_e = jax.tree_util.tree_leaves_with_path(expected_host)
    assert [p for p, _ in flat_r] == [p for p, _ in flat_e]
    for (path, r), (_, e) in zip(flat_r, flat_e):
        r = np.asarray(r)
        assert r.dtype == e.dtype and r.shape == e.shape, path
        # Compare the bytes, so that -0.0 vs 0.0 or a NaN payload would count too.
        assert r.tobytes() == e.tobytes(), jax.tree_util.keystr(path)


def committed_dirs(run_dir):
    return sorted(os.listdir(os.path.join(run_dir, "checkpoints")))


@pytest.fixture(scope="module")
def mesh42():
    return mesh_of((4, 2))


@pytest.fixture(scope="module")
def state(mesh42):
    return make_state(mesh42)


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")


# -- save and restore -----------------------------------------------------------------------


def test_restore_reshards_onto_other_meshes_and_one_device(run_dir, state):
    expected = host_copy(state)
    with Checkpointer(run_dir, CheckpointConfig(async_save=False)) as ckpt:
        assert ckpt.save(100, state)

    targets = [
        mesh_of((8, 1)),  # same devices, another layout
        mesh_of((2, 1), jax.devices()[:2]),  # fewer devices
        jax.devices()[5],  # one device, not the first
    ]
    with Checkpointer(run_dir, CheckpointConfig()) as ckpt:
        assert ckpt.latest_step() == 100
        for target in targets:
            want = abstract(state, target)
            restored = ckpt.restore(100, want)
            assert_bitwise_equal(restored, expected)
            got_shardings = jax.tree.map(lambda x: x.sharding, restored)
            assert got_shardings == jax.tree.map(lambda x: x.sharding, want)


def test_keep_last_n_and_every(run_dir, state):
    with Checkpointer(run_dir, CheckpointConfig(every=1, keep=2, async_save=False)) as ckpt:
        for step in range(1, 6):
            assert ckpt.save(step, state)
        assert ckpt.latest_step() == 5
        assert ckpt.all_steps() == [4, 5]
    assert committed_dirs(run_dir) == ["4", "5"]

    other = run_dir + "-every"
    with Checkpointer(other, CheckpointConfig(every=3, keep=5)) as ckpt:
        saved = [step for step in range(1, 8) if ckpt.save(step, state)]
        assert saved == [3, 6]
        assert ckpt.save(7, state, force=True)  # the end of training, or a preemption
        assert not ckpt.save(7, state, force=True)  # already on disk: nothing to add
        ckpt.wait()
        assert ckpt.all_steps() == [3, 6, 7]
        with pytest.raises(CheckpointError, match="later step 7"):
            ckpt.save(5, state, force=True)

    with Checkpointer(other + "-0", CheckpointConfig(every=0)) as ckpt:
        assert not any(ckpt.save(step, state) for step in range(0, 5))
        assert ckpt.latest_step() is None


def test_resume_step_follows_config(run_dir, state):
    with Checkpointer(run_dir, CheckpointConfig(every=1, async_save=False)) as ckpt:
        assert ckpt.resume_step() is None
        ckpt.save(1, state)
        ckpt.save(2, state)
        assert ckpt.resume_step() == 2
    with Checkpointer(run_dir, CheckpointConfig(restore_step=1)) as ckpt:
        assert ckpt.resume_step() == 1
    with Checkpointer(run_dir, CheckpointConfig(restore_step=9)) as ckpt:
        with pytest.raises(CheckpointError, match=r"restore_step=9.*\[1, 2\]"):
            ckpt.resume_step()
    with pytest.raises(ValueError, match="keep"):
        CheckpointConfig(keep=0)


def test_async_save_survives_donation_then_restores(run_dir, mesh42):
    state = make_state(mesh42, seed=1)
    expected = host_copy(state)
    want = abstract(state, mesh42)
    bump = jax.jit(lambda s: jax.tree.map(lambda x: x + 1, s), donate_argnums=0)
    with Checkpointer(run_dir, CheckpointConfig(every=10, async_save=True)) as ckpt:
        assert ckpt.save(10, state)
        # The training loop donates the state to the next step as soon as save returns;
        # the background write must not see the overwritten buffers.
        state = bump(bump(state))
        ckpt.wait()
        assert ckpt.latest_step() == 10
        assert_bitwise_equal(ckpt.restore(10, want), expected)


# -- saves that are cut off or fail ---------------------------------------------------------


def test_cut_off_save_does_not_hide_last_good_checkpoint(run_dir, state, monkeypatch):
    expected = host_copy(state)
    ckpts = os.path.join(run_dir, "checkpoints")
    with Checkpointer(run_dir, CheckpointConfig(every=1, async_save=False)) as ckpt:
        ckpt.save(2, state)
        # What a save killed half way leaves: Orbax writes into `<step>.orbax-checkpoint-tmp`
        # and renames it to `<step>` only once everything is down.
        half = os.path.join(ckpts, "5.orbax-checkpoint-tmp")
        shutil.copytree(os.path.join(ckpts, "2"), half)
        if os.path.exists(os.path.join(half, "commit_success.txt")):  # newer Orbax writes it
            os.remove(os.path.join(half, "commit_success.txt"))
        for f in glob.glob(os.path.join(half, "state", "d", "*")):
            os.remove(f)
        assert ckpt.latest_step() == 2 and ckpt.all_steps() == [2]

    # A real Orbax save that dies in the background just before its commit (the rename).
    def killed(self):
        raise OSError("killed before commit")

    monkeypatch.setattr(ocp.path.atomicity.AtomicRenameTemporaryPath, "finalize", killed)
    with Checkpointer(run_dir, CheckpointConfig(every=1, async_save=True)) as ckpt:
        assert ckpt.latest_step() == 2
        assert ckpt.save(3, state)
        with pytest.raises(CheckpointError, match="step 3 in the background.*killed before commit"):
            ckpt.wait()
        assert ckpt.latest_step() == 2
    monkeypatch.undo()
    leftover = os.path.join(ckpts, "3.orbax-checkpoint-tmp")
    # The arrays were written; only the commit (the renames) is missing.
    assert glob.glob(os.path.join(leftover, "state*", "**", "d", "*"), recursive=True)

    # The restarted run: the leftovers are neither checkpoints nor foreign files. Reading
    # leaves them alone (they could belong to a save in progress); the first save sweeps
    # them away.
    shutil.copytree(leftover, os.path.join(ckpts, "9.orbax-checkpoint-tmp"))
    with Checkpointer(run_dir, CheckpointConfig(every=1)) as ckpt:
        assert ckpt.latest_step() == 2
        assert_bitwise_equal(ckpt.restore(2, abstract(state, jax.devices()[0])), expected)
        assert sorted(os.listdir(ckpts)) == ["2", "3.orbax-checkpoint-tmp", "9.orbax-checkpoint-tmp"]
        assert ckpt.save(3, state)
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3]
    assert sorted(os.listdir(ckpts)) == ["2", "3"]


def test_failing_save_raises(run_dir, state, monkeypatch):
    for async_save in (False, True):
        ckpts = os.path.join(run_dir, "checkpoints")
        with Checkpointer(run_dir, CheckpointConfig(every=1, async_save=async_save)) as ckpt:
            assert ckpt.save(1, state)
            ckpt.wait()
            # The disk goes away under a running job: the directory becomes a file.
            shutil.rmtree(ckpts)
            with open(ckpts, "w") as f:
                f.write("not a directory")
            with pytest.raises(CheckpointError, match="step 2.*Not a directory"):
                ckpt.save(2, state)
                ckpt.wait()  # an async save may only fail in the background
        os.remove(ckpts)

    # A background failure that nobody waits for surfaces at the next save, naming its step.
    def full(self):
        raise OSError(28, "No space left on device")

    with Checkpointer(run_dir, CheckpointConfig(every=1, async_save=True)) as ckpt:
        monkeypatch.setattr(ocp.path.atomicity.AtomicRenameTemporaryPath, "finalize", full)
        assert ckpt.save(1, state)
        with pytest.raises(CheckpointError, match="step 1 in the background.*No space left"):
            ckpt.save(2, state)
        monkeypatch.undo()
        assert ckpt.save(3, state)
        ckpt.wait()
        assert ckpt.all_steps() == [3]


# -- damaged, foreign and mismatched checkpoints ---------------------------------------------


# A failed TensorStore read leaves a callback aimed at Orbax's already-closed event loop;
# Python reports it as "Exception ignored". It is noise on the error path, not our error.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_checkpoint_names_the_step(run_dir, state):
    with Checkpointer(run_dir, CheckpointConfig(every=1, async_save=False)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state)
    ckpts = os.path.join(run_dir, "checkpoints")
    data = lambda step: [
        f for f in glob.glob(os.path.join(ckpts, str(step), "state", "**", "d", "*"), recursive=True)
    ]
    assert data(3) and data(2)
    for f in data(3):  # removed
        os.remove(f)
    for f in data(2):  # truncated
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)

    want = abstract(state, mesh_of((4, 2)))
    with Checkpointer(run_dir, CheckpointConfig()) as ckpt:
        for step in (3, 2):
            with pytest.raises(CheckpointError) as err:
                ckpt.restore(step, want)
            msg = str(err.value)
            assert os.path.join(ckpts, str(step)) + " is damaged" in msg and "Fix:" in msg
            assert "tensorstore_spec" not in msg  # the multi-kilobyte spec is cut off
        ckpt.restore(1, want)  # the one before is still good
        with pytest.raises(CheckpointError, match=r"no complete checkpoint for step 7.*\[1, 2, 3\]"):
            ckpt.restore(7, want)


def test_foreign_directory_is_refused_and_left_alone(run_dir):
    ckpts = os.path.join(run_dir, "checkpoints")
    os.makedirs(os.path.join(ckpts, "old_experiment"))
    os.makedirs(os.path.join(ckpts, "7"))  # a number, but not written by Orbax
    with open(os.path.join(ckpts, "notes.txt"), "w") as f:
        f.write("mine")
    before = sorted(os.listdir(ckpts))
    with pytest.raises(CheckpointError) as err:
        Checkpointer(run_dir, CheckpointConfig())
    msg = str(err.value)
    assert ckpts in msg and "--run-dir" in msg
    assert "7" in msg and "notes.txt" in msg and "old_experiment" in msg
    assert sorted(os.listdir(ckpts)) == before

    shutil.rmtree(ckpts)
    with open(ckpts, "w") as f:
        f.write("a file where the directory should be")
    with pytest.raises(CheckpointError, match="not a directory"):
        Checkpointer(run_dir, CheckpointConfig())


def test_tree_mismatch_names_the_key(run_dir, state, mesh42):
    with Checkpointer(run_dir, CheckpointConfig(async_save=False)) as ckpt:
        ckpt.save(1, state, force=True)
    good = abstract(state, mesh42)

    wider = jax.tree.map(lambda x: x, good)
    wq = wider["params"]["layers"]["wq"]
    wider["params"]["layers"]["wq"] = jax.ShapeDtypeStruct((2, 8, 4, 4), wq.dtype, sharding=wq.sharding)

    extra = jax.tree.map(lambda x: x, good)
    extra["params"]["bias"] = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(mesh42, P()))

    fewer = jax.tree.map(lambda x: x, good)
    del fewer["params"]["final_norm"]

    recast = jax.tree.map(lambda x: x, good)
    emb = recast["params"]["embed"]
    recast["params"]["embed"] = jax.ShapeDtypeStruct(emb.shape, jnp.bfloat16, sharding=emb.sharding)

    step_dir = os.path.join(run_dir, "checkpoints", "1")
    with Checkpointer(run_dir, CheckpointConfig()) as ckpt:
        for target, expected in [
            (wider, "params/layers/wq: shape (2, 8, 4, 2) in checkpoint, (2, 8, 4, 4) expected"),
            (extra, "params/bias: expected, but not in the checkpoint"),
            (fewer, "params/final_norm: in the checkpoint, but not expected"),
            (recast, "params/embed: dtype float32 in checkpoint, bfloat16 expected"),
        ]:
            with pytest.raises(CheckpointError) as err:
                ckpt.restore(1, target)
            assert expected in str(err.value) and step_dir in str(err.value)
            assert "config.json" in str(err.value)
        ckpt.restore(1, good)


# -- the run's config ---------------------------------------------------------------------


def test_check_run_config(run_dir):
    cfg = {"model": {"n_layers": 4, "d": 64}, "train": {"steps": 100, "lr": 3e-4}, "mesh": {"fsdp": 8}}
    path = os.path.join(run_dir, "config.json")

    check_run_config(run_dir, cfg)
    with open(path) as f:
        assert json.load(f) == cfg
    check_run_config(run_dir, json.loads(json.dumps(cfg)))  # the same config passes

    changed = {**cfg, "model": {"n_layers": 6, "d": 64}, "train": {"steps": 100, "lr": 1e-3}}
    with pytest.raises(ConfigConflictError) as err:
        check_run_config(run_dir, changed, may_change=frozenset({"train.steps"}))
    msg = str(err.value)
    assert "model.n_layers: 4 (saved) -> 6 (now)" in msg
    assert "train.lr: 0.0003 (saved) -> 0.001 (now)" in msg
    assert "--run-dir" in msg and "model.d" not in msg
    with open(path) as f:
        assert json.load(f) == cfg  # a refused resume changes nothing

    longer = {**cfg, "train": {"steps": 500, "lr": 3e-4}, "mesh": {"fsdp": 4, "tensor": 2}}
    check_run_config(run_dir, longer, may_change=frozenset({"train.steps", "mesh"}))
    with open(path) as f:
        assert json.load(f) == longer
    (backup,) = glob.glob(os.path.join(run_dir, "config.*.json"))
    with open(backup) as f:
        assert json.load(f) == cfg

    with open(path, "w") as f:
        f.write("{not json")
    with pytest.raises(ConfigConflictError, match="config.json"):
        check_run_config(run_dir, cfg)


# -- preemption ---------------------------------------------------------------------------


def test_preemption_guard_turns_sigterm_into_a_flag():
    calls = []
    original = signal.signal(signal.SIGTERM, lambda *a: calls.append(a))
    try:
        previous = signal.getsignal(signal.SIGTERM)
        with PreemptionGuard() as guard:
            assert not guard.requested
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while not guard.requested and time.monotonic() < deadline:
                time.sleep(0.01)
            assert guard.requested
        assert signal.getsignal(signal.SIGTERM) is previous
        assert calls == []  # the guard took the signal, not the previous handler

        # Off the main thread no handler can be installed: the guard never requests.
        seen = {}

        def worker():
            with PreemptionGuard() as g:
                seen["requested"] = g.requested

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert seen == {"requested": False}
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, original)


@pytest.mark.parametrize("text", ['{"model": {', "[1, 2]"])
def test_an_unreadable_run_config_exits_2_naming_it(tmp_path, text):
    """--init-from a run whose config.json is cut short or not an object: exit 2, the file
    named, no traceback (it was a bare ValueError the command line did not catch)."""
    import subprocess
    import sys
    run = tmp_path / "run"
    os.makedirs(run / "checkpoints")
    (run / "config.json").write_text(text)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "train_dense.py", "tiny", "--init-from", str(run),
                        "--run-dir", str(tmp_path / "new")], cwd=root, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "config.json" in r.stderr and "Traceback" not in r.stderr
