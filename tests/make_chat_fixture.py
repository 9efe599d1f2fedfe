"""Make tests/fixtures/chat/: a real HuggingFace tokenizer (tokenizer.json, byte-level BPE of
512 ids trained here with the `tokenizers` library) with a chat template, for the fine-tune
flow's tests (tests/test_chat.py). Only the tokenizer is committed: the tests make the
model's weights themselves.

    python tests/make_chat_fixture.py      # needs only `tokenizers` (the hf extra)

The template is ChatML-style (<|im_start|>role ... <|im_end|>), begins with the BOS token
named in tokenizer_config.json (so the special-token variables are exercised), and renders
a default system turn when there is none (so a prefix's rendering is not just the messages).
"""
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "chat")
SPECIALS = ["<|pad|>", "<|bos|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] != 'system' %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def corpus() -> list[str]:
    words = ("the a one two three four five six seven eight nine ten red green blue cat dog "
             "bird says answer question what is color of sky grass sun yes no hello world "
             "please thank you helpful assistant system user").split()
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(400)]
    return lines + ["What is 2 + 3? The answer is 5.", "Say hello. Hello!"] * 50


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    os.makedirs(OUT, exist_ok=True)
    tok.save(os.path.join(OUT, "tokenizer.json"))
    with open(os.path.join(OUT, "chat_template.jinja"), "w") as f:
        f.write(TEMPLATE)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
              "eos_token": "<|im_end|>", "pad_token": "<|pad|>", "model_max_length": 256}
    with open(os.path.join(OUT, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    print(f"wrote {OUT}: {tok.get_vocab_size()} ids")


if __name__ == "__main__":
    main()
