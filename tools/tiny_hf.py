"""A tiny HuggingFace chat model and chat data for `make finetune-hf`, made here (no
download): a Qwen3-shaped folder with random weights (2 layers, d_model 64, 0.1M
parameters) and the real tokenizer.json + chat template of tests/fixtures/chat, and a JSONL of
short conversations. What it shows is the flow: HF folder -> SFT on chat -> export-hf ->
transformers; a real model (Qwen3-0.6B, Llama-3.2-1B) goes through the same commands.

    python tools/tiny_hf.py --out hf/tiny-chat --data data/chat-demo.jsonl
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CHAT = os.path.join(ROOT, "tests", "fixtures", "chat")
WORDS = ["red", "green", "blue", "cat", "dog", "bird", "sun", "sky", "grass", "yes", "no"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def make_folder(out: str, seed: int = 0, d_model: int = 64) -> str:
    """The model folder: config.json, model.safetensors, the tokenizer, generation_config."""
    import jax
    import numpy as np

    import train_dense as td
    from common import hf
    from common.data import HFTokenizer
    cfg = td.ModelConfig(vocab_size=512, d_model=d_model, n_layers=2, n_heads=4, n_kv_heads=2,
                         head_dim=d_model // 4, d_ff=2 * d_model, max_seq_len=256, qk_norm=True,
                         loss_chunk=64)
    rng = np.random.default_rng(seed)  # norms off 1 and matrices off their init: a model
    params = jax.tree.map(               # whose logits mean something to compare
        lambda p: p + 0.05 * rng.standard_normal(p.shape).astype(np.float32),
        jax.device_get(td.init_params(cfg, jax.random.key(seed))))
    tok = HFTokenizer(os.path.join(CHAT, "tokenizer.json"))
    ids = dict(bos_token_id=tok.bos_id(), eos_token_id=tok.eos_id(), pad_token_id=0)
    td.save_hf(params, cfg, out, base_config=ids)
    hf.copy_tokenizer(CHAT, out)
    hf.write_json(os.path.join(out, "generation_config.json"), ids | {"do_sample": False})
    return out


def conversations(n: int = 400, seed: int = 0) -> list[dict]:
    """Say-this-word and count-up questions, one or two turns, some with a system turn."""
    import random
    rng, rows = random.Random(seed), []
    for i in range(n):
        w, k = rng.choice(WORDS), rng.randrange(len(NUMBERS) - 1)
        turns = [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": w},
                 {"role": "user", "content": f"What is after {NUMBERS[k]}?"},
                 {"role": "assistant", "content": NUMBERS[k + 1]}]
        turns = turns[:2] if i % 3 == 0 else turns[2:] if i % 3 == 1 else turns
        if i % 4 == 0:
            turns = [{"role": "system", "content": "Answer with one word."}] + turns
        rows.append({"messages": turns})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="hf/tiny-chat")
    ap.add_argument("--data", default="data/chat-demo.jsonl")
    a = ap.parse_args()
    if os.path.exists(a.out):
        sys.exit(f"error: {a.out} exists; remove it or pass another --out")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    make_folder(a.out)
    os.makedirs(os.path.dirname(a.data) or ".", exist_ok=True)
    with open(a.data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in conversations())
    print(f"wrote {a.out} (tiny Qwen3-shaped model, chat template) and {a.data} "
          f"({len(conversations())} conversations)")


if __name__ == "__main__":
    main()
