"""Scale-out data: prepared folders in a gs:// bucket (tests/fake_gcs.py), read by ranges;
`prepare` over Parquet and JSONL shards with worker processes, killed and rerun."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from etils import epath

import train_dense as td
from common.data import DataConfig, RemoteTokens, batch_rows, load_dataset, prepare
from tests.spawn import run, spawn
from tests.test_multiprocess import ROOT, env
from tests.test_train import config, metrics

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # {'note ' * (i % 5)}\n" for i in range(300)]


def write_shards(folder, kind, n=3):
    os.makedirs(folder, exist_ok=True)
    for k in range(n):
        part = TEXTS[k::n]
        if kind == "jsonl":
            with open(os.path.join(folder, f"part-{k}.jsonl"), "w") as f:
                f.writelines(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(part))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq
            pq.write_table(pa.table({"id": list(range(len(part))), "body": part}),
                           os.path.join(folder, f"part-{k}.parquet"), row_group_size=16)


def files(folder):
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def test_parquet_and_jsonl_shards_with_workers_write_the_same_tokens(tmp_path):
    pytest.importorskip("pyarrow", reason="pip install -e '.[parquet]'")
    write_shards(tmp_path / "j", "jsonl")
    write_shards(tmp_path / "p", "parquet")
    one = prepare([str(tmp_path / "j" / "*.jsonl")], str(tmp_path / "one"), field="body",
                  vocab_size=300)
    two = prepare([str(tmp_path / "p" / "*.parquet")], str(tmp_path / "two"), field="body",
                  vocab_size=300, workers=2)
    a, b = files(one), files(two)
    assert a.keys() == b.keys() and a == b  # tokenizer, tokens and sidecars, byte for byte
    assert json.loads(a["train.json"])["num_documents"] + json.loads(
        a["eval.json"])["num_documents"] == len(TEXTS)
    with pytest.raises(ValueError, match=r"column 'text' is missing.*--field"):
        prepare([str(tmp_path / "p")], str(tmp_path / "three"))
    with pytest.raises(FileNotFoundError, match="pattern matches nothing"):
        prepare([str(tmp_path / "p" / "*.txt")], str(tmp_path / "four"))


def test_a_killed_prepare_leaves_nothing_a_trainer_loads(tmp_path):
    big = tmp_path / "big.txt"  # ~40 MB: tokenizing takes seconds, time enough to kill it
    big.write_text("".join(TEXTS) * 2000)
    out = tmp_path / "data"
    cmd = [sys.executable, "-m", "common.data", "prepare", "--input", str(big), "--out",
           str(out), "--vocab-size", "300"]
    p = spawn(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".data.tmp-*/train.bin")):  # tokens being written
        assert p.poll() is None and time.time() < deadline, "prepare ended before the kill"
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not out.exists()
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_dataset(DataConfig(path=str(out)))
    r = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(load_dataset(DataConfig(path=str(out))).train) > 1_000_000
    assert not list(tmp_path.glob(".data.tmp-*"))  # the killed build's folder is gone too


@pytest.fixture(scope="module")
def bucket_data(gcs, tmp_path_factory):
    """The same prepared folder on disk and in the bucket (uploaded by prepare itself)."""
    tmp = tmp_path_factory.mktemp("scale")
    (tmp / "a.txt").write_text("".join(TEXTS) * 20)
    local = prepare([str(tmp / "a.txt")], str(tmp / "local"), vocab_size=300)
    remote = prepare([str(tmp / "a.txt")], f"{gcs}/data/a", vocab_size=300)
    return local, remote


def test_prepare_to_a_bucket_and_read_back_by_rows(gcs, bucket_data):
    local, remote = bucket_data
    for name, data in files(local).items():
        assert epath.Path(remote, name).read_bytes() == data
    with pytest.raises(ValueError, match="already holds a prepared folder"):
        prepare([os.path.join(local, "train.bin")], remote)
    r, l = load_dataset(DataConfig(path=remote)), load_dataset(DataConfig(path=local))
    assert isinstance(r.train, RemoteTokens) and len(r.train) == len(l.train)
    assert open(r.tokenizer_path, "rb").read() == open(l.tokenizer_path, "rb").read()
    for step in range(3):
        for rows in (slice(None), slice(2, 5)):
            kw = dict(seed=1, step=step, batch_size=8, seq_len=16, rows=rows)
            assert np.array_equal(batch_rows(r.train, **kw), batch_rows(l.train, **kw))


def test_an_upload_cut_short_is_refused_then_replaced(gcs, bucket_data, tmp_path):
    local, _ = bucket_data
    cut = f"{gcs}/data/cut"
    for name in ("tokenizer.model", "train.bin"):  # what a killed upload leaves
        epath.Path(cut, name).write_bytes(open(os.path.join(local, name), "rb").read())
    with pytest.raises(FileNotFoundError, match="train.json is missing"):
        load_dataset(DataConfig(path=cut))
    (tmp_path / "a.txt").write_text("".join(TEXTS) * 20)
    prepare([str(tmp_path / "a.txt")], cut, vocab_size=300)
    assert load_dataset(DataConfig(path=cut)).vocab_size == load_dataset(
        DataConfig(path=local)).vocab_size


def test_two_processes_read_only_their_rows_of_a_bucket(gcs, gcs_server, bucket_data):
    local, _ = bucket_data
    remote = f"{gcs}/data/two"  # a folder of its own: no other test's read-ahead lands here
    for name, data in files(local).items():
        epath.Path(remote, name).write_bytes(data)
    served = gcs_server.served
    steps, batch, seq = 5, 16, 32
    r = run([sys.executable, "-m", "common.launch", "--nproc", "2", "--cpu-devices", "4",
             "--max-restarts", "0", "--", sys.executable, "tests/read_batches.py", remote, local,
             str(steps), str(batch), str(seq)], timeout=300, cwd=ROOT, env=env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("batches equal") == 2, r.stdout + r.stderr
    # Each process its 8 rows of each step, and of the step after the last (read ahead):
    # had each read every row, twice this.
    assert served["data/two/train.bin"] == (steps + 1) * batch * (seq + 1) * 2


def test_training_from_a_bucket_equals_training_from_disk(gcs, bucket_data, tmp_path):
    local, remote = bucket_data
    td.main(config(tmp_path / "local", local, steps=4))
    td.main(config(tmp_path / "remote", remote, steps=4))
    assert [m["loss"] for m in metrics(tmp_path / "local") if "loss" in m] == [
        m["loss"] for m in metrics(tmp_path / "remote") if "loss" in m]
