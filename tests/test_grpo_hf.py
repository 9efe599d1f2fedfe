"""train_grpo.py --init-from-hf: the policy starts from a HuggingFace folder.

Against the committed fixtures of tests/test_hf.py (tiny random models saved by transformers,
with its float32 logits on fixed tokens): the model train_grpo.py builds from the folder gives
transformers' logits, a short GRPO run starts from those weights with the folder's tokenizer,
and bad input is a clear error before anything compiles.
"""
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
from functools import partial

import jax
import numpy as np
import pytest

import train_dense as td
import train_grpo as tg
from common import hf, train
from common.checkpoint import CheckpointConfig
from common.mesh import MeshConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")
FAMILIES = ["llama2", "llama3.1", "llama3.2", "mistral", "qwen2", "qwen3", "gemma2",
            "gemma3_text", "olmo3", "olmo2", "qwen3_5", "gpt2"]
TOL = 1e-4  # float32, as tests/test_hf.py


def hf_tokenizer(path):
    return tg.make_tokenizer(tg.Config(init_from_hf=path))


def with_source(cfg):
    hf_config, model = hf.model_source(cfg)
    return train.with_model(cfg, tg.config_from_hf(*hf_config) if hf_config else model)


def fixture(name):
    return os.path.join(FIXTURES, name)


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def test_mapping_and_config_translation_equal_train_dense():
    """Copied from train_dense.py's section 7 (each trainer stands alone): they must agree."""
    for name in FAMILIES + ["qwen3_moe"]:
        c = hf.read_config(fixture(name))
        if c["model_type"] not in tg.HF_ARCHITECTURES:
            with pytest.raises(hf.HFError, match="not a dense family this trainer loads"):
                tg.config_from_hf(c)
            continue
        m = tg.config_from_hf(c)
        assert dataclasses.asdict(m) == dataclasses.asdict(td.config_from_hf(c)), name
        assert tg.hf_mapping(m) == td.hf_mapping(td.ModelConfig(**dataclasses.asdict(m)))
        for mt in ("", c["model_type"]):  # the export's config.json too
            assert tg.config_to_hf(m, mt, "bfloat16") == td.config_to_hf(
                td.ModelConfig(**dataclasses.asdict(m)), mt, "bfloat16"), name


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_after_init_from_hf_matches_transformers(name):
    """The CLI path: the preset's tiny model is replaced by the folder's, whose weights then
    give transformers' logits through train_grpo.py's own forward."""
    cfg = with_source(tg.cli(["tiny", "--init-from-hf", fixture(name)]))
    shape, params = tg.load_hf(fixture(name))
    assert cfg.model == dataclasses.replace(shape, remat=tg.PRESETS["tiny"][1].model.remat)
    assert cfg.model.vocab_size == 64 != tg.PRESETS["tiny"][1].model.vocab_size
    e = np.load(os.path.join(fixture(name), "expected.npz"))
    got = np.asarray(jax.jit(partial(tg.forward, cfg=cfg.model))(params, e["tokens"]))
    diff = float(np.max(np.abs(got - e["logits"])))
    print(f"{name}: max |logit difference| {diff:.2e}")
    assert diff < TOL


# ------------------------------------------------------------------------------ a GRPO run

CHARS = "0123456789+= "


def with_sentencepiece(src, dst):
    """The fixture plus a character-level tokenizer.model (ids 0-2: unk, bos, eos)."""
    import sentencepiece as spm
    shutil.copytree(src, dst)
    text = [f"{a}+{b}={str(a + b)[::-1]} " for a in range(100) for b in range(0, 100, 7)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=model,
                                   model_type="char", vocab_size=64, hard_vocab_limit=False,
                                   character_coverage=1.0, num_threads=1, minloglevel=2)
    with open(os.path.join(dst, "tokenizer.model"), "wb") as f:
        f.write(model.getvalue())
    return str(dst)


def with_tokenizer_json(src, dst):
    """The fixture plus a Qwen-style tokenizer.json: one token per character, an EOS named in
    tokenizer_config.json, no BOS."""
    tokenizers = pytest.importorskip("tokenizers")
    shutil.copytree(src, dst)
    vocab = {"<pad>": 0, "<unk>": 1, "<|endoftext|>": 2} | {c: 3 + i for i, c in enumerate(CHARS)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token="<unk>"))
    tok.decoder = tokenizers.decoders.Fuse()
    tok.save(os.path.join(dst, "tokenizer.json"))
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "bos_token": None}, f)
    return str(dst)


def test_the_folders_tokenizer(tmp_path):
    sp = hf_tokenizer(with_sentencepiece(fixture("llama3.1"), tmp_path / "a"))
    assert (sp.eos_id, sp.start_id) == (2, 1)  # Llama: a document begins after BOS
    assert sp.decode(sp.encode("12+345=")) == "12+345=" and sp.prompt("1+2=")[0] == 1
    js = hf_tokenizer(with_tokenizer_json(fixture("qwen3"), tmp_path / "b"))
    assert (js.eos_id, js.start_id, js.vocab_size) == (2, 2, 16)  # Qwen: no BOS, after EOS
    assert js.encode("12+3=") == [4, 5, 13, 6, 14] and js.decode([4, 5, 13]) == "12+"
    # Without tokenizer_config.json the EOS comes from config.json, or there is none at all.
    os.remove(tmp_path / "b" / "tokenizer_config.json")
    with pytest.raises(hf.HFError, match="no end-of-sequence token"):
        hf_tokenizer(str(tmp_path / "b"))
    c = hf.read_config(str(tmp_path / "b")) | {"eos_token_id": [7, 2]}
    hf.write_json(str(tmp_path / "b" / "config.json"), c)
    assert hf_tokenizer(str(tmp_path / "b")).eos_id == 7


def grpo_config(run_dir, src, steps):
    g = dict(steps=steps, prompts_per_step=8, group_size=4, max_new_tokens=4, lr=3e-3,
             warmup_steps=1, eval_every=1, beta=0.04)
    return tg.Config(grpo=tg.GRPOConfig(**g), warm=tg.WarmStartConfig(max_steps=0),
                     task=tg.TaskConfig(min_digits=1, max_digits=1, eval_prompts=32),
                     mesh=MeshConfig(fsdp=-1), checkpoint=CheckpointConfig(every=1),
                     run_dir=str(run_dir), init_from_hf=src)


@pytest.mark.parametrize("name,add_tokenizer", [("llama3.1", with_sentencepiece),
                                                ("qwen3", with_tokenizer_json),
                                                ("qwen3_5", with_tokenizer_json)])
def test_short_grpo_run_starts_from_the_hf_weights(name, add_tokenizer, tmp_path):
    src = add_tokenizer(fixture(name), tmp_path / "model")
    out = tg.main(grpo_config(tmp_path / "run", src, 1))
    _, published = tg.load_hf(src)
    state = host(out["state"])
    # With --grpo.beta > 0 the reference is the starting policy, untouched by training: here
    # the published weights, bit for bit, sharded over 8 devices.
    for a, b in zip(jax.tree.leaves(host(published)), jax.tree.leaves(state["ref"])):
        np.testing.assert_array_equal(a, b)
    moved = [float(np.max(np.abs(a - b))) for a, b in
             zip(jax.tree.leaves(state["ref"]), jax.tree.leaves(state["params"]))]
    assert max(moved) > 0 and out["final_step"] == 1
    saved = json.load(open(tmp_path / "run" / "config.json"))
    assert saved["init_from_hf"] == src and saved["model"]["vocab_size"] == 64
    assert saved["model"]["qk_norm"] == (name != "llama3.1")
    # export-hf hands the policy back: the same weights bit for bit, the source's family,
    # config keys and tokenizer files.
    files = tg.export_hf(str(tmp_path / "run"), str(tmp_path / "export"))
    _, exported = tg.load_hf(str(tmp_path / "export"))
    for a, b in zip(jax.tree.leaves(host(exported)), jax.tree.leaves(state["params"])):
        np.testing.assert_array_equal(a, b)
    source, ours = hf.read_config(src), hf.read_config(str(tmp_path / "export"))
    assert ours["model_type"] == source["model_type"] and "config.json" in files
    assert ours["eos_token_id"] == source["eos_token_id"]
    assert {f for f in os.listdir(src) if f.startswith("tokenizer")} <= set(files)


# ------------------------------------------------------------------------------ bad input


def test_bad_input_is_a_clear_error(tmp_path):
    with pytest.raises(tg.ConfigError, match="--init-from runs/x and --init-from-hf"):
        tg.main(dataclasses.replace(grpo_config(tmp_path / "r", fixture("qwen3"), 1),
                                    init_from="runs/x"))
    with pytest.raises(FileNotFoundError, match="no tokenizer.model or tokenizer.json"):
        tg.main(grpo_config(tmp_path / "r", fixture("qwen3"), 1))
    with pytest.raises(tg.ConfigError, match="--model.n-layers conflicts with --init-from-hf"):
        tg.cli(["tiny", "--init-from-hf", fixture("qwen3"), "--model.n-layers", "3"])
    tg.cli(["tiny", "--init-from-hf", fixture("qwen3"), "--model.remat", "full"])  # how: allowed
    assert not os.path.exists(tmp_path / "r")  # refused before the run directory was made


def test_unknown_model_type_exits_with_a_message(tmp_path):
    src = shutil.copytree(fixture("qwen3"), tmp_path / "bert")
    hf.write_json(str(src / "config.json"), hf.read_config(str(src)) | {"model_type": "bert"})
    with pytest.raises(hf.HFError, match="model_type 'bert' is not a dense family"):
        with_source(grpo_config(tmp_path / "r", str(src), 1))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train_grpo.py"), "tiny",
                        "--init-from-hf", str(src), "--run-dir", str(tmp_path / "r")],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=os.environ | {"JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and "model_type 'bert'" in r.stderr
    assert "Traceback" not in r.stderr
