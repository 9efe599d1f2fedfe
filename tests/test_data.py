"""common/data.py: tokenizer, prepared folders, batches, the embedded corpus, errors.

Tokenizers here are tiny (a few hundred pieces, byte fallback) and trained on a few tens of
KB of generated text, so every test runs in well under a second.
"""
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from common import data, observe
from common.data import DataConfig, batch_rows, get_batch, load_dataset, prepare

VOCAB = 400


def code_text(seed: int, n_funcs: int) -> str:
    """Python-looking text: indentation by spaces and tabs, blank lines, digits, unicode."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_funcs):
        name = rng.choice(["alpha", "beta", "gamma", "delta"]) + f"_{i}"
        lines += [
            f"def {name}(x, y={rng.randint(0, 9999)}):",
            f'    """Return the {name} of x (naïve, ≤ {rng.randint(0, 99)})."""',
            "\tif x > y:",
            f"        return x * {rng.randint(0, 999)}  # café",
            "",
            "",
            "    timeout = 1000000",  # frequent: without split_digits BPE would merge "00"
            "    return y",
        ]
    return "\n".join(lines) + "\n"


def split_on_eos(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    cuts = np.flatnonzero(tokens == eos)
    assert len(cuts) and cuts[-1] == len(tokens) - 1, "every document must end with EOS"
    return np.split(tokens, cuts[:-1] + 1)


@pytest.fixture(scope="module")
def code_folder(tmp_path_factory):
    """A prepared folder from a folder of text files, shared by the tests that only read."""
    src = tmp_path_factory.mktemp("src")
    docs = {}
    for i, suffix in enumerate([".py", ".txt", ".md", ".py", ".txt", ".py"]):
        path = src / ("sub" if i % 2 else "") / f"doc{i}{suffix}"
        path.parent.mkdir(exist_ok=True)
        docs[str(path)] = code_text(i, 60)
        if i == 4:  # Windows line ends are kept as they are
            docs[str(path)] = docs[str(path)].replace("\n", "\r\n")
        path.write_bytes(docs[str(path)].encode("utf-8"))
    (src / "notes.bin").write_bytes(b"\xff\xfe not text")  # wrong suffix: skipped
    (src / ".hidden.txt").write_text("secret")  # hidden: skipped
    out = tmp_path_factory.mktemp("prepared") / "code"
    prepare([str(src)], str(out), vocab_size=VOCAB)
    return out, [docs[k] for k in sorted(docs)]


# ----------------------------------------------------------------------------------------------
# Tokenizer


def test_tokenizer_round_trips_code_and_unicode(code_folder):
    ds = load_dataset(DataConfig(path=str(code_folder[0])))
    samples = [
        "class A:\n    def f(self):\n\t\treturn 1\n\n\n        # deep\n",
        "  leading and trailing  \n",
        "\n\nstarts with newlines",
        "windows\r\nline ends\r\n",
        "digits 1234567890 and 3.14159e-10",
        "unicode: é ü 日本語 ☃ 🙂 \u00a0nbsp \u200bzwsp",
        "\t\tx = [  1,\t2 ]\n",
        "",
    ]
    for text in samples:
        assert ds.decode(ds.encode(text)) == text
    # split_digits: no piece holds two digits, so numbers are spelled out digit by digit.
    pieces = [ds._sp.id_to_piece(i) for i in ds.encode("x = 1234567890; timeout = 1000000")
              if not ds._sp.is_byte(i)]  # byte pieces are spelled <0x3B>
    assert not any(sum(c.isdigit() for c in p) > 1 for p in pieces), pieces
    # Indentation is learned as whitespace pieces, not spelled out one space at a time.
    assert len(ds.encode("        return x")) < len("        return x") // 2
    assert ds.vocab_size == ds._sp.get_piece_size() <= VOCAB
    assert (ds.bos_id, ds.eos_id) == (1, 2)


# ----------------------------------------------------------------------------------------------
# prepare


def read_sidecar(folder, split):
    with open(os.path.join(folder, f"{split}.json")) as f:
        return json.load(f)


def test_prepare_folder_of_text_files(code_folder):
    out, docs = code_folder
    ds = load_dataset(DataConfig(path=str(out)))
    assert sorted(os.listdir(out)) == sorted(data.PREPARED_FILES)
    train_meta, eval_meta = read_sidecar(out, "train"), read_sidecar(out, "eval")
    assert train_meta["num_tokens"] == len(ds.train) and eval_meta["num_tokens"] == len(ds.eval)
    assert train_meta["dtype"] == "uint16" and ds.train.dtype == np.uint16
    assert train_meta["vocab_size"] == ds.vocab_size and train_meta["eos_id"] == ds.eos_id
    # Six documents: one is held out (round(0.01 * 6) = 0, but at least one), five train.
    assert (train_meta["num_documents"], eval_meta["num_documents"]) == (5, 1)
    train_docs = [ds.decode(d) for d in split_on_eos(np.asarray(ds.train), ds.eos_id)]
    eval_docs = [ds.decode(d) for d in split_on_eos(np.asarray(ds.eval), ds.eos_id)]
    # Each document, whole, lands in exactly one split; train keeps the input order.
    assert sorted(train_docs + eval_docs) == sorted(docs)
    assert train_docs == [d for d in docs if d not in eval_docs]
    assert ds.decode(ds.train) == "".join(train_docs)  # EOS decodes to nothing


def test_prepare_single_document_is_split_by_tokens(tmp_path):
    text = code_text(7, 200)
    (tmp_path / "book.txt").write_text(text, encoding="utf-8")
    out = prepare([str(tmp_path / "book.txt")], str(tmp_path / "out"), vocab_size=VOCAB,
                  eval_fraction=0.05)
    ds = load_dataset(DataConfig(path=out))
    assert read_sidecar(out, "train")["num_tokens"] == len(ds.train)
    assert read_sidecar(out, "eval")["num_tokens"] == len(ds.eval)
    total = len(ds.train) + len(ds.eval)
    assert len(ds.eval) == round(0.05 * total)
    assert ds.eval[-1] == ds.eos_id and ds.eos_id not in np.asarray(ds.train)
    assert ds.decode(np.concatenate([ds.train, ds.eval])) == text
    assert text.startswith(ds.decode(ds.train)[:-8])  # the cut may split a byte sequence


def test_prepare_jsonl(tmp_path):
    rng = random.Random(1)
    docs = [code_text(i, rng.randint(1, 4)) for i in range(40)]
    with open(tmp_path / "a.jsonl", "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "content": d}) + "\n")
            if i == 5:
                f.write("\n")  # blank lines are skipped
    out = prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "out"), vocab_size=VOCAB,
                  field="content", eval_fraction=0.1, seed=3)
    ds = load_dataset(DataConfig(path=out))
    train_meta, eval_meta = read_sidecar(out, "train"), read_sidecar(out, "eval")
    assert (train_meta["num_tokens"], eval_meta["num_tokens"]) == (len(ds.train), len(ds.eval))
    assert (train_meta["num_documents"], eval_meta["num_documents"]) == (36, 4)
    train_docs = [ds.decode(d) for d in split_on_eos(np.asarray(ds.train), ds.eos_id)]
    eval_docs = [ds.decode(d) for d in split_on_eos(np.asarray(ds.eval), ds.eos_id)]
    assert len(eval_docs) == 4 and sorted(train_docs + eval_docs) == sorted(docs)
    assert docs[0] in ds.decode(ds.train) or docs[0] in ds.decode(ds.eval)

    # Deterministic: the same inputs and seed give the same bytes; another seed another split.
    again = prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "again"), vocab_size=VOCAB,
                    field="content", eval_fraction=0.1, seed=3)
    for name in ("train.bin", "eval.bin"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    other = prepare([str(tmp_path / "a.jsonl")], str(tmp_path / "other"), vocab_size=VOCAB,
                    field="content", eval_fraction=0.1, seed=4,
                    tokenizer=str(tmp_path / "out" / "tokenizer.model"))
    ods = load_dataset(DataConfig(path=other))
    assert ods.vocab_size == ds.vocab_size
    assert sorted(ds.decode(d) for d in split_on_eos(np.asarray(ods.eval), ods.eos_id)) \
        != sorted(eval_docs)


def test_prepare_cli_prints_what_it_wrote(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(code_text(0, 30) * 3)
    (tmp_path / "b.txt").write_text(code_text(1, 30))
    out = tmp_path / "out"
    data.main(["prepare", "--input", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"),
               "--out", str(out), "--vocab-size", "350", "--eval-fraction", "0.5"])
    printed = capsys.readouterr().out
    n_train = read_sidecar(out, "train")["num_tokens"]
    assert f"wrote {out}" in printed and f"{n_train:,} uint16 tokens" in printed
    with pytest.raises(SystemExit) as e:
        data.main(["prepare", "--input", str(tmp_path / "a.txt"), "--out", str(out)])
    assert e.value.code == 2 and re.search("--out .* already exists", capsys.readouterr().err)
    for flag, bad in (("--vocab-size", "0"), ("--vocab-size", "-5"), ("--eval-fraction", "0"),
                      ("--eval-fraction", "nan"), ("--eval-fraction", "1.5"), ("--seed", "-1")):
        with pytest.raises(SystemExit) as e:  # every number checked, before any work
            data.main(["prepare", "--input", str(tmp_path / "a.txt"), "--out",
                       str(tmp_path / "new"), flag, bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and flag in err and "Traceback" not in err, (flag, bad, err)


# ----------------------------------------------------------------------------------------------
# Batches


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "tests/conftest.py should give 8 CPU devices"
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))


def test_batch_is_the_same_on_any_layout(mesh):
    tokens = np.random.default_rng(0).integers(0, 60000, size=5000).astype(np.uint16)
    kw = dict(seed=7, step=11, batch_size=16, seq_len=7)
    layouts = {
        "one device": SingleDeviceSharding(jax.devices()[0]),
        "data+fsdp rows": NamedSharding(mesh, P(("data", "fsdp"), None)),
        "replicated": NamedSharding(mesh, P()),
        "rows and columns": NamedSharding(mesh, P("data", "fsdp")),
    }
    ref = np.asarray(get_batch(tokens, sharding=layouts["one device"], **kw))
    assert ref.shape == (16, 8) and ref.dtype == np.int32
    for name, sharding in layouts.items():
        batch = get_batch(tokens, sharding=sharding, **kw)
        assert batch.sharding == sharding and batch.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(batch), ref, err_msg=name)
    # Processes that each build only their own rows agree with the whole batch.
    per_process = [batch_rows(tokens, rows=slice(a, b), **kw)
                   for a, b in [(0, 5), (5, 12), (12, 16)]]
    np.testing.assert_array_equal(np.concatenate(per_process), ref)
    np.testing.assert_array_equal(batch_rows(tokens, rows=slice(3, 16, 4), **kw), ref[3::4])
    # Another step or seed: another batch.
    assert not np.array_equal(np.asarray(get_batch(tokens, sharding=layouts["one device"],
                                                   **{**kw, "step": 12})), ref)
    assert not np.array_equal(batch_rows(tokens, **{**kw, "seed": 8}), ref)


def test_batch_rows_are_windows_of_the_tokens():
    n, seq_len = 3000, 31
    tokens = np.arange(n, dtype=np.uint32)  # a token's value is its position
    for step in range(5):
        batch = batch_rows(tokens, seed=0, step=step, batch_size=8, seq_len=seq_len)
        x, y = batch[:, :-1], batch[:, 1:]
        starts = batch[:, 0]
        np.testing.assert_array_equal(batch, starts[:, None] + np.arange(seq_len + 1))
        np.testing.assert_array_equal(y, x + 1)  # targets are the next tokens
        assert starts.max() + seq_len + 1 <= n
    # With seq_len + 2 tokens there are two windows: both are drawn, none runs off the end.
    starts = {int(batch_rows(tokens[:seq_len + 2], seed=0, step=s, batch_size=4,
                             seq_len=seq_len)[i, 0]) for s in range(8) for i in range(4)}
    assert starts == {0, 1}


def test_batch_from_prepared_memmap(code_folder, mesh):
    ds = load_dataset(DataConfig(path=str(code_folder[0])))
    assert isinstance(ds.train, np.memmap)
    batch = np.asarray(get_batch(ds.train, seed=0, step=0, batch_size=8, seq_len=16,
                                 sharding=NamedSharding(mesh, P(("data", "fsdp"), None))))
    train = np.asarray(ds.train)
    for row in batch:
        hits = np.flatnonzero(train[:len(train) - 16] == row[0])
        assert any(np.array_equal(train[h:h + 17], row) for h in hits)


def test_batch_needs_enough_tokens():
    with pytest.raises(ValueError, match=r"seq_len \+ 2 = 10"):
        batch_rows(np.arange(9, dtype=np.uint16), seed=0, step=0, batch_size=2, seq_len=8)
    with pytest.raises(ValueError, match="9 tokens"):
        get_batch(np.arange(9, dtype=np.uint16), seed=0, step=0, batch_size=2, seq_len=8,
                  sharding=SingleDeviceSharding(jax.devices()[0]))
    batch_rows(np.arange(10, dtype=np.uint16), seed=0, step=0, batch_size=2, seq_len=8)


# ----------------------------------------------------------------------------------------------
# Errors


def test_missing_data_path_says_how_to_make_one(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as e:
        load_dataset(DataConfig(path=str(missing)))
    msg = str(e.value)
    assert "--data.path" in msg and str(missing) in msg
    assert "python -m common.data prepare --input" in msg and f"--out {missing}" in msg
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "train.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="--data.path.*tokenizer.model is missing"):
        load_dataset(DataConfig(path=str(tmp_path / "half")))


def test_truncated_token_file_is_an_error(code_folder, tmp_path):
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(code_folder[0], copy)
    with open(copy / "eval.bin", "r+b") as f:
        f.truncate(os.path.getsize(copy / "eval.bin") - 2)
    with pytest.raises(ValueError, match="eval.bin.*truncated"):
        load_dataset(DataConfig(path=str(copy)))


def test_malformed_jsonl_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "fine too"}\n{"text": oops}\n')
    with pytest.raises(ValueError, match=rf"{bad}, line 3: not valid JSON"):
        prepare([str(bad)], str(tmp_path / "out"), vocab_size=VOCAB)
    # Nothing is left behind by a failed prepare: no output, no temporary folder.
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_jsonl_without_the_field(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ValueError) as e:
        prepare([str(path)], str(tmp_path / "out"), vocab_size=VOCAB)
    msg = str(e.value)
    assert str(path) in msg and "line 2" in msg and "'text'" in msg and "--field" in msg
    with pytest.raises(ValueError, match="line 1: field 'n' holds int"):
        path.write_text('{"n": 3}\n')
        prepare([str(path)], str(tmp_path / "out"), field="n")


def test_prepare_never_overwrites(tmp_path):
    (tmp_path / "a.txt").write_text(code_text(0, 20))
    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(ValueError) as e:
        prepare([str(tmp_path / "a.txt")], str(out), vocab_size=VOCAB)
    assert "--out" in str(e.value) and str(out) in str(e.value)
    assert os.listdir(out) == ["precious.txt"] and (out / "precious.txt").read_text() == "keep me"
    # An existing empty folder is fine (a user may have made it first).
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare([str(tmp_path / "a.txt")], str(empty), vocab_size=VOCAB)
    assert sorted(os.listdir(empty)) == sorted(data.PREPARED_FILES)


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--input .*nope\.txt.*no such file"):
        prepare([str(tmp_path / "nope.txt")], str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("")
    with pytest.raises(ValueError, match="no text found"):
        prepare([str(tmp_path / "empty")], str(tmp_path / "out"))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.txt.*not UTF-8"):
        prepare([str(tmp_path / "latin1.txt")], str(tmp_path / "out"))
    (tmp_path / "a.txt").write_text("hello\n")
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"), tokenizer="missing.model")
    with pytest.raises(ValueError, match="--vocab-size 260: .*required_chars.*larger --vocab"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"), vocab_size=260)
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        prepare([str(tmp_path / "a.txt")], str(tmp_path / "out"),
                tokenizer=str(tmp_path / "a.txt"))
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------
# The embedded corpus (capped to a few hundred KB here; the real one is ~11 MB)


def test_embedded_corpus_small(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(observe, "_QUIET", False)   # an earlier --quiet run in this worker
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(data, "STDLIB_MAX_BYTES", 300_000)
    ds = load_dataset(DataConfig(vocab_size=VOCAB))
    printed = capsys.readouterr().out
    assert "training tokenizer on" in printed and " s\n" in printed
    folder = os.path.dirname(ds.tokenizer_path)
    assert folder.startswith(str(tmp_path / "cache"))
    v = sys.version_info
    assert f"py{v.major}.{v.minor}.{v.micro}" in folder and f"vocab{VOCAB}" in folder

    # The capped corpus is the longest prefix of the sorted file list that fits.
    files, every = data._stdlib_files(300_000), data._stdlib_files(10**12)
    size = sum(os.path.getsize(f) for f in files)
    assert files == every[:len(files)] and files == sorted(files)
    assert size <= 300_000 < size + os.path.getsize(every[len(files)])
    assert os.path.basename(files[0]) == "__future__.py"
    assert len(every) > 300 and not any(
        part in data.STDLIB_SKIP_DIRS for f in every for part in f.split(os.sep))
    texts = [Path(f).read_bytes().decode("utf-8") for f in files]
    decoded = [ds.decode(d) for d in split_on_eos(np.concatenate([ds.train, ds.eval]), ds.eos_id)]
    assert sorted(decoded) == sorted(t for t in texts if t)

    # Second call: the cache is used as is, nothing is rebuilt or printed.
    mtime = os.path.getmtime(os.path.join(folder, "train.bin"))
    again = load_dataset(DataConfig(vocab_size=VOCAB))
    assert again.tokenizer_path == ds.tokenizer_path and capsys.readouterr().out == ""
    assert os.path.getmtime(os.path.join(folder, "train.bin")) == mtime
    # An explicit --data.cache-dir beats the environment.
    assert data._cache_root("/somewhere/else") == "/somewhere/else"
    assert data._cache_root(data.DEFAULT_CACHE_DIR) == str(tmp_path / "cache")


def test_embedded_corpus_two_processes_at_once(tmp_path):
    code = ("import hashlib, os, sys; from common import data; "
            "p = data._stdlib_corpus(sys.argv[1], vocab_size=400, max_bytes=150_000); "
            "print(p, hashlib.sha256(open(os.path.join(p, 'train.bin'), 'rb').read()).hexdigest())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
    last_lines = [out.strip().splitlines()[-1] for out, _ in results]
    assert last_lines[0] == last_lines[1]
    version_dir = os.path.dirname(last_lines[0].split()[0])
    assert os.listdir(version_dir) == [os.path.basename(last_lines[0].split()[0])]


def test_publish_keeps_the_first_folder(tmp_path):
    final = tmp_path / "final"
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "who").write_text(name)
    assert data._publish(str(tmp_path / "a"), str(final))
    assert not data._publish(str(tmp_path / "b"), str(final))
    assert (final / "who").read_text() == "a"


def test_default_sample_prompt_does_not_end_in_a_lone_space_token(code_folder):
    # "def " used to end in the piece "▁", which in training text mostly precedes digits:
    # the end-of-run sample of a well-trained model was a run of "1"s.
    import train_dense
    ds = load_dataset(DataConfig(path=str(code_folder[0])))
    ids = ds.encode(train_dense.TrainConfig().sample_prompt)
    assert ids and ds.decode(ids[-1:]).strip(), ds.decode(ids)
