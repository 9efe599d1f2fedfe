"""A run directory in a gs:// bucket: train, resume, refuse, profile, export, all against
tests/fake_gcs.py, an in-memory server for the part of the GCS JSON API the clients use.

Orbax writes the arrays through TensorStore's GCS driver (pointed at the fake by
TENSORSTORE_GCS_HTTP_URL), and everything else goes through etils.epath -> gcsfs (pointed
at it by STORAGE_EMULATOR_HOST): the very code paths a TPU pod uses against a real bucket.
"""
import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from etils import epath

import train_dense as td
from common import hf
from tools import plot
from common.checkpoint import CheckpointConfig, CheckpointError, Checkpointer, ConfigConflictError
from tests.test_train import config, data_path, metrics  # noqa: F401  (data_path: a fixture)

# The `gcs` fixture (a fake bucket) is in conftest.py.


def _path(url):
    return epath.Path(url)


def _params(result):
    return jax.tree.leaves(jax.device_get(result["state"]["params"]))


def _bucket_metrics(run):
    return [json.loads(line) for line in (_path(run) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def on_disk(data_path, tmp_path_factory):
    """The uninterrupted 6-step run on local disk that both bucket runs below must equal:
    trained once for the file, not once a test (its parameters and metrics.jsonl)."""
    local = tmp_path_factory.mktemp("local")
    return _params(td.main(config(local, data_path, steps=6))), metrics(local)


def test_resumed_in_a_bucket_equals_uninterrupted_on_disk(gcs, data_path, on_disk, tmp_path,
                                                          capsys):
    run = f"{gcs}/resume"
    full, local_metrics = on_disk
    first = config(run, data_path, steps=3)
    td.main(dataclasses.replace(first, train=dataclasses.replace(first.train, profile_steps=(2, 3))))
    resumed = td.main(config(run, data_path, steps=6))
    assert "resumed from step 3" in capsys.readouterr().out
    for a, b in zip(full, _params(resumed)):
        np.testing.assert_array_equal(a, b)  # bitwise: the bucket changes nothing

    root = _path(run)
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["3", "6"]
    for step in ("3", "6"):  # committed the object-store way: no rename, a commit file last
        assert (root / "checkpoints" / step / "commit_success.txt").exists()
    # metrics.jsonl is appended across the restart although a bucket object cannot be.
    assert [m["step"] for m in _bucket_metrics(run)] == [1, 2, 3, 4, 5, 6]
    assert [m["loss"] for m in _bucket_metrics(run)] == [m["loss"] for m in local_metrics]
    assert list((root / "tensorboard").glob("events.out.tfevents.*"))
    assert list((root / "profile").glob("plugins/profile/*/*.xplane.pb"))  # traced locally, then uploaded
    assert '"run_dir": "gs://' in (root / "config.json").read_text()
    pngs = plot.plot([run])  # make plot RUN=gs://...: reads the bucket, writes RUN/plots
    assert "gs://runs-bucket/resume/plots/loss.png" in pngs
    assert (root / "plots" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "gs:").exists() and not os.path.exists("gs:")


def test_cut_off_save_in_a_bucket_is_ignored_then_swept(gcs, data_path, on_disk, capsys):
    run = f"{gcs}/cutoff"
    td.main(config(run, data_path, steps=3))
    # A save of step 5 killed midway (by a run saving every step, say): Orbax's first file
    # is there, its commit file is not. No later save reuses the name, so only a sweep
    # frees the space.
    cut = _path(run) / "checkpoints" / "5"
    (cut / "_CHECKPOINT_METADATA").write_text("{}")
    (cut / "state" / "junk").write_text("half an array")
    with Checkpointer(run, CheckpointConfig()) as ckpt:
        assert ckpt.all_steps() == [3]
    resumed = td.main(config(run, data_path, steps=6))
    assert "resumed from step 3" in capsys.readouterr().out
    assert not cut.exists()
    assert sorted(p.name for p in (_path(run) / "checkpoints").iterdir()) == ["3", "6"]
    for a, b in zip(on_disk[0], _params(resumed)):
        np.testing.assert_array_equal(a, b)


def test_refusals_in_a_bucket_lose_nothing(gcs, data_path):
    # Someone else's files where the checkpoints would go: refused, and still there.
    notes = _path(f"{gcs}/foreign/checkpoints/notes.txt")
    notes.write_text("mine")
    with pytest.raises(CheckpointError, match="notes.txt"):
        td.main(config(f"{gcs}/foreign", data_path, steps=2))
    assert notes.read_text() == "mine"
    # A resume that changes the model: refused, and the saved config is untouched.
    run = f"{gcs}/conflict"
    td.main(config(run, data_path, steps=2))
    before = (_path(run) / "config.json").read_text()
    with pytest.raises(ConfigConflictError, match="model.d_ff"):
        td.main(config(run, data_path, steps=4, d_ff=96))
    assert (_path(run) / "config.json").read_text() == before


def test_init_from_and_export_read_a_bucket(gcs, data_path, tmp_path):
    run = f"{gcs}/source"
    src = td.main(config(run, data_path, steps=2))
    out = tmp_path / "hf"
    files = td.export_hf(run, str(out))
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files)
    _, params = td.load_hf(str(out))
    for a, b in zip(jax.tree.leaves(jax.device_get(src["state"]["params"])),
                    jax.tree.leaves(jax.device_get(params))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileNotFoundError, match="not a train_dense.py run directory"):
        hf.model_source(dataclasses.replace(config(tmp_path / "x", data_path, steps=2),
                                            init_from=f"{gcs}/nothing-here"))
