"""The HuggingFace fine-tune flow: a folder's own chat template renders SFT chat (as
transformers renders it, only assistant turns trained), and a template without findable
assistant turns is refused. The fixture is a real tokenizer.json with a chat template
(tests/fixtures/chat/, made by tests/make_chat_fixture.py)."""
import json
import os
import shutil

import pytest

from common import data as D

CHAT = os.path.join(os.path.dirname(__file__), "fixtures", "chat")
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"},
     {"role": "assistant", "content": "The answer is 5."},
     {"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "system", "content": "Answer with one word."},
     {"role": "user", "content": "What color is the sky?"},
     {"role": "assistant", "content": "blue"}],
]

try:
    import transformers
except ImportError:
    transformers = None
live = pytest.mark.skipif(transformers is None, reason="transformers not installed (extra: parity)")


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("jinja2", reason="pip install -e '.[hf]'")
    return D.HFTokenizer(os.path.join(CHAT, "tokenizer.json"))


def encoded(conversation, tok):
    spans = D.ChatTemplate.find(CHAT).spans(conversation, "test")
    return D.tokenize_examples([spans], tok)[0]


def test_rendering_and_mask_cover_exactly_the_assistant_turns(tok):
    ex = encoded(CONVERSATIONS[0], tok)
    assert tok.decode(ex.tokens) == (
        "<|bos|><|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
        "The answer is 5.<|im_end|>\n<|im_start|>user\nSay hello.<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n")
    runs, start = [], None  # the trained runs, decoded
    for i, t in enumerate(list(ex.trained) + [False]):
        if t and start is None:
            start = i
        elif not t and start is not None:
            runs.append(tok.decode(ex.tokens[start:i]))
            start = None
    assert runs == ["The answer is 5.<|im_end|>\n", "Hello!<|im_end|>\n"]
    assert tok.decode(ex.prompt).endswith("<|im_start|>assistant\n")


@live
@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
def test_live_rendering_equals_apply_chat_template(tok, i):
    ht = transformers.AutoTokenizer.from_pretrained(CHAT)
    conv, template = CONVERSATIONS[i], D.ChatTemplate.find(CHAT)
    assert template.render(conv) == ht.apply_chat_template(conv, tokenize=False)
    assert template.render(conv[:1], True) == ht.apply_chat_template(
        conv[:1], tokenize=False, add_generation_prompt=True)
    ids = ht.apply_chat_template(conv, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert encoded(conv, tok).tokens.tolist() == list(ids)


def chat_folder(tmp_path, template: str):
    folder = tmp_path / "tok"
    shutil.copytree(CHAT, folder)
    (folder / "chat_template.jinja").write_text(template)
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 2))
    return folder, jsonl


# The first renders only the last assistant turn (earlier ones vanish from the rendering of the
# whole); the second never writes the assistant's content.
@pytest.mark.parametrize("template", [
    "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}",
    "{% for m in messages %}{{ m['role'] }}\n{% endfor %}"])
def test_a_template_without_findable_assistant_turns_is_refused(tok, tmp_path, template):
    folder, jsonl = chat_folder(tmp_path, template)
    cfg = D.DataConfig(format="sft", path=str(jsonl), tokenizer=str(folder / "tokenizer.json"))
    with pytest.raises(D.DataError, match="gives no way to find assistant turn"):
        D.load_sft(cfg, seq_len=64)


def test_sft_rows_from_an_hf_tokenizer_use_its_template(tok, tmp_path):
    folder, jsonl = chat_folder(tmp_path, open(os.path.join(CHAT, "chat_template.jinja")).read())
    cfg = D.DataConfig(format="sft", path=str(jsonl), tokenizer=str(folder / "tokenizer.json"),
                       eval_fraction=0.25)
    ds = D.load_sft(cfg, seq_len=128)
    prompts = [tok.decode(ex.prompt) for ex in ds.eval_examples]
    assert all(p.startswith("<|bos|><|im_start|>") and p.endswith("assistant\n") for p in prompts)


# ------------------------------------------------------------------ the flow, end to end
# The tiny Qwen3-shaped HF folder of `make finetune-hf` (tools/tiny_hf.py: our save_hf of
# perturbed random weights, the fixture's tokenizer, a generation_config.json), -> the hf-sft
# preset, 20 steps on chat -> export-hf.

@pytest.fixture(scope="module")
def flow(tok, tmp_path_factory):
    import train_dense as td
    from tools.tiny_hf import make_folder
    tmp = tmp_path_factory.mktemp("flow")
    src = make_folder(str(tmp / "hf"), d_model=32)
    words = ["red", "green", "blue", "one", "two", "three"]
    rows = [{"messages": [{"role": "user", "content": f"Say {w}."},
                          {"role": "assistant", "content": w}]} for w in words] * 4
    jsonl = tmp / "chat.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = td.cli(["hf-sft", "--init-from-hf", src, "--data.path", str(jsonl),
                  "--run-dir", str(tmp / "run"), "--train.steps", "20", "--train.batch-size",
                  "8", "--train.seq-len", "64", "--train.lr", "3e-3", "--train.eval-every",
                  "10", "--checkpoint.every", "10"])
    out = td.main(cfg)
    files = td.export_hf(str(tmp / "run"), str(tmp / "export"))
    return dict(src=src, out=out, export=str(tmp / "export"), files=files, cfg=cfg)


def test_sft_from_an_hf_folder_exports_what_transformers_needs(flow):
    import jax
    import numpy as np

    import train_dense as td
    from common import hf
    evals = [loss for _, loss in flow["out"]["evals"]]
    assert flow["out"]["final_step"] == 20 and evals[-1] < evals[0]
    _, params = td.load_hf(flow["export"])
    for a, b in zip(jax.tree.leaves(jax.device_get(params)),
                    jax.tree.leaves(jax.device_get(flow["out"]["state"]["params"]))):
        np.testing.assert_array_equal(a, b)
    source, ours = hf.read_config(flow["src"]), hf.read_config(flow["export"])
    assert ours["model_type"] == "qwen3"
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    assert {k: ours[k] for k in ids} == {k: source[k] for k in ids} and None not in map(ours.get, ids)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        assert name in flow["files"], name


@live
def test_live_transformers_loads_the_export_logits_and_greedy_tokens_equal_ours(flow, tok):
    import jax
    import numpy as np
    import torch

    import train_dense as td
    from common.mesh import MeshConfig, make_mesh
    model = transformers.AutoModelForCausalLM.from_pretrained(flow["export"],
                                                              dtype=torch.float32)
    ht = transformers.AutoTokenizer.from_pretrained(flow["export"])
    chat = [{"role": "user", "content": "Say blue."}]
    text = ht.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == D.ChatTemplate.find(flow["export"]).render(chat, True)
    prompt = tok.encode(text)
    cfg, params = td.load_hf(flow["export"])
    ours = np.asarray(td.forward(params, np.asarray([prompt], np.int32), cfg))
    with torch.no_grad():
        theirs = model(torch.tensor([prompt])).logits.numpy()
    assert np.max(np.abs(ours - theirs)) < 1e-4
    run = flow["cfg"]
    n = 8
    sample_cfg = td.Config(model=cfg, train=td.TrainConfig(seq_len=64, sample_tokens=n,
                                                          temperature=0.0))
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    with jax.set_mesh(mesh):
        mine = td.sample(params, [prompt], sample_cfg, mesh, jax.random.key(0),
                         tok.get_piece_size())[0]
    with torch.no_grad():
        hf_out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    hf_new = hf_out[0, len(prompt):].tolist()
    stop = mine.index(tok.eos_id()) + 1 if tok.eos_id() in mine else n
    assert hf_new == mine[:stop] and stop >= 2 and run.data.format == "sft"
