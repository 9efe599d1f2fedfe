"""TRL's GRPOTrainer on the model and prompts bench/grpo.py exported: the peer of `make bench-grpo`.

Runs in its own venv (bench/peers/trl.sh installs it): torch, transformers and TRL only, none
of this project. Loads the HuggingFace folder (float32, CPU), builds the character tokenizer
that folder's tokenizer.json describes, and trains STEPS GRPO steps on the prompts file, in
its order: each step samples G completions for each of P prompts with transformers'
`generate` (KV cache), scores them and makes one policy update. Prints one line per step:

    trl step 3 | seconds 0.8123 | rollout 384 tokens in 0.2011 s | tok/s 1909.5

a step's wall time (on_step_begin to on_step_end: generation, rewards and the update) and its
rollout: the completion tokens sampled (up to and including EOS) over `generate`'s time.
"""
import argparse
import json
import re
import time

import torch
import transformers
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback


def correctness(completions, answer, **_):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


EOS = [None]  # the tokenizer's, set in main


def digits_only(completions, completion_ids, **_):
    # train_grpo.py's format reward: digits only, and stopped by itself (EOS within the budget;
    # TRL's ids run up to and including the first EOS). Without the EOS condition TRL's policy
    # was not paid for stopping and by step 4 wrote ~115-token completions where ours wrote
    # 5-50, so the two sides' steps no longer did the same work.
    return [float(re.fullmatch(r"\s*[0-9]+\s*", c) is not None and ids[-1:] == EOS)
            for c, ids in zip(completions, completion_ids)]


class Timer(TrainerCallback):
    """Each optimiser step's wall time, and the rollout figures `generate` recorded in it."""

    def __init__(self, rollout: list):
        self.rollout, self.t0 = rollout, 0.0

    def on_step_begin(self, args, state, control, **kw):
        self.rollout.clear()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        dt = time.perf_counter() - self.t0
        n, s = sum(r[0] for r in self.rollout), sum(r[1] for r in self.rollout)
        print(f"trl step {state.global_step} | seconds {dt:.4f} | rollout {n} tokens in "
              f"{s:.4f} s | tok/s {n / max(s, 1e-9):.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the exported HuggingFace folder")
    ap.add_argument("--prompts", required=True, help='JSON: [{"prompt": ..., "answer": ...}]')
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--group", type=int, required=True, help="completions per prompt (G)")
    ap.add_argument("--prompts-per-step", type=int, required=True, help="P")
    ap.add_argument("--max-new", type=int, required=True)
    ap.add_argument("--temperature", type=float, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--beta", type=float, default=0.0, help="KL weight (> 0: a reference kept)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    print(f"trl {trl.__version__} | transformers {transformers.__version__} | torch "
          f"{torch.__version__} | {torch.get_num_threads()} threads", flush=True)
    torch.manual_seed(0)
    tok = PreTrainedTokenizerFast(tokenizer_file=f"{a.model}/tokenizer.json", bos_token="<bos>",
                                  eos_token="<eos>", pad_token="<pad>")
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    EOS[0] = tok.eos_token_id
    rollout = []
    generate = model.generate

    def timed_generate(*args, **kw):
        t0 = time.perf_counter()
        out = generate(*args, **kw)
        dt = time.perf_counter() - t0
        comp = out[:, kw["input_ids"].shape[1]:]
        eos = comp == tok.eos_token_id
        first = torch.where(eos.any(1), eos.int().argmax(1), comp.shape[1] - 1)
        rollout.append((int((first + 1).sum()), dt))   # tokens up to and including EOS
        return out

    model.generate = timed_generate
    with open(a.prompts) as f:
        rows = json.load(f)
    B = a.prompts_per_step * a.group
    args = trl.GRPOConfig(
        output_dir=a.out, max_steps=a.steps, per_device_train_batch_size=B,
        gradient_accumulation_steps=1, num_generations=a.group, max_completion_length=a.max_new,
        temperature=a.temperature, top_k=0, top_p=1.0, learning_rate=a.lr, beta=a.beta,
        num_iterations=1, loss_type="grpo", scale_rewards="group", shuffle_dataset=False,
        gradient_checkpointing=False,  # TRL defaults to True; train_grpo.py tiny keeps activations
        reward_weights=[1.0, 0.1], use_cpu=True, bf16=False, fp16=False, report_to="none",
        save_strategy="no", logging_steps=10_000, disable_tqdm=True, seed=0,
        dataloader_num_workers=0)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[correctness, digits_only], args=args,
                              train_dataset=Dataset.from_list(rows), processing_class=tok,
                              callbacks=[Timer(rollout)])
    trainer.train()


if __name__ == "__main__":
    main()
