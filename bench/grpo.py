"""GRPO side by side with TRL on the same model: `make bench-grpo`.

One GRPO step is a rollout of G completions for each of P prompts (sampled with a KV cache)
then the policy update. Ours is train_grpo.py's loop (`tiny` preset, no warm start); TRL's is
GRPOTrainer (bench/peers/trl.sh, installed on first use into its own venv) on the same
weights, exported here as a HuggingFace folder with the character tokenizer, with the same P,
G, completion budget, temperature, learning rate and loss ("grpo", beta 0, one pass), float32,
CPU. `--size small` is a realistic RL step instead of an overhead test: a ~27M-parameter policy
(d 512, 8 layers), 16 prompts x 8 completions of up to 128 tokens at temperature 1, beta 0.04
(a reference model in play on both sides), learning rate 1e-9: both sides then sample from the
exported policy at every step (Adam moves a weight by about the rate a step), so their
completions come from one distribution and the steps do the same work in expectation (at a
real rate the two policies drift apart, and with them the lengths a step pays for); a step
computes the same at any rate. Each side's completion tokens over the timed steps are printed
beside its times. Rounds alternate the two sides in one invocation. Both are measured alike
(bench/stats.py): each step's wall time and its rollout tokens/s (completion tokens sampled
over the sampling time), steps WARMUP+1..WARMUP+steps (the first WARMUP steps dropped: they
compile), their medians, then the medians of the rounds and the ratios.
"""
import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import train_dense as td  # noqa: E402
import train_grpo as tg  # noqa: E402
from bench import stats  # noqa: E402

PEER = os.path.join(ROOT, "bench", "peers", "trl.sh")
# --size: (model overrides, GRPO overrides) on the `tiny` preset; the same on both sides.
SIZES = {"tiny": ({}, {}),
         "small": (dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=64,
                        d_ff=1536, max_seq_len=256),
                   dict(prompts_per_step=16, group_size=8, max_new_tokens=128, temperature=1.0,
                        beta=0.04, lr=1e-9))}


def config(size: str, prompts_per_step: int = 0, group_size: int = 0,
           lr: float | None = None) -> tg.Config:
    """The `tiny` preset resized by SIZES[size]; P, G and the learning rate when given."""
    cfg, (model, grpo) = tg.PRESETS["tiny"][1], SIZES[size]
    g = dataclasses.replace(cfg.grpo, **grpo)
    g = dataclasses.replace(g, prompts_per_step=prompts_per_step or g.prompts_per_step,
                            group_size=group_size or g.group_size, lr=g.lr if lr is None else lr)
    return dataclasses.replace(cfg, grpo=g, model=dataclasses.replace(cfg.model, **model))


def export(cfg: tg.Config, out: str) -> None:
    """The policy's initial weights (what train_grpo.py starts from with no warm start) as a
    HuggingFace Llama folder, and tokenizer.json of train_grpo.py's character vocabulary."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors, decoders
    params = tg.init_params(cfg.model, jax.random.key(cfg.grpo.seed))
    tok = tg.CharTokenizer
    td.save_hf(params, td.ModelConfig(**dataclasses.asdict(cfg.model)), out, base_config={
        "bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id})
    t = Tokenizer(models.WordLevel({s: i for i, s in enumerate(tok.SYMBOLS)}, unk_token="<pad>"))
    t.add_special_tokens(list(tok.SYMBOLS[:3]))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")   # one token per character
    t.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[
        ("<bos>", tok.bos_id)])                                      # as CharTokenizer.prompt
    t.decoder = decoders.Fuse()
    t.save(os.path.join(out, "tokenizer.json"))


def prompts(cfg: tg.Config, last: int) -> list[dict]:
    """The prompts ours samples at steps 1..last (train_loop's `prompts_at`), in order."""
    g = cfg.grpo
    return [{"prompt": p, "answer": a} for step in range(last) for p, a in tg.problems(
        np.random.default_rng([g.seed, 0, step]), g.prompts_per_step, cfg.task)]


def same_flags(cfg: tg.Config) -> list[str]:
    """train_grpo.py's flags for what SIZES may change: the model and the rollout ours runs."""
    g, m = cfg.grpo, cfg.model
    return [f"--{sec}.{k.replace('_', '-')}={getattr(c, k)}" for sec, c, ks in (
        ("model", m, ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff",
                       "max_seq_len")),
        ("grpo", g, ("prompts_per_step", "group_size", "max_new_tokens", "temperature",
                     "beta", "lr"))) for k in ks]


def ours(cfg: tg.Config, last: int, run_dir: str, flags: list[str]) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each round, never a resume
    cmd = [sys.executable, "train_grpo.py", "tiny", "--warm.max-steps", "0", "--grpo.steps",
           str(last), "--grpo.eval-every", "100000", "--checkpoint.every", "100000",
           *same_flags(cfg),
           "--run-dir", run_dir, "--quiet", *flags]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        jsonl = f.read()
    B = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    return {"seconds": stats.metrics_step_seconds(jsonl),
            "tok_s": stats.metrics_step_seconds(jsonl, "rollout_tokens_per_s", 1.0),
            "tokens": stats.metrics_step_seconds(jsonl, "completions/mean_length", B)}


def peer(cfg: tg.Config, last: int, hf_dir: str, prompts_json: str, log: str) -> dict:
    g = cfg.grpo
    with open(log, "w") as f:
        subprocess.run(["bash", PEER, "--model", hf_dir, "--prompts", prompts_json, "--steps",
                        str(last), "--group", str(g.group_size), "--prompts-per-step",
                        str(g.prompts_per_step), "--max-new", str(g.max_new_tokens),
                        "--temperature", str(g.temperature), "--lr", str(g.lr), "--beta",
                        str(g.beta), "--out",
                        os.path.join(os.path.dirname(log), "trl-out")],
                       stdout=f, stderr=subprocess.STDOUT, check=True)
    with open(log) as f:
        text = f.read()
    return {"seconds": stats.trl_step_seconds(text), "tok_s": stats.trl_step_seconds(text, "tok/s"),
            "tokens": stats.trl_step_seconds(text, "rollout")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny",
                    help="tiny: the preset (overhead); small: ~27M parameters, 128 new tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10,
                    help=f"timed steps per run, after {stats.WARMUP} warm-up steps")
    ap.add_argument("--prompts-per-step", type=int, default=0, help="P (0: the preset's)")
    ap.add_argument("--group-size", type=int, default=0, help="G (0: the preset's)")
    ap.add_argument("--lr", type=float, default=None,
                    help="both sides' learning rate (default: the size's; small's is 1e-9)")
    ap.add_argument("--dir", default=os.path.join(ROOT, "runs", "bench-grpo"),
                    help="the exported model, the prompts and both sides' logs")
    ap.add_argument("flags", nargs="*", help="extra train_grpo.py flags for our side")
    a = ap.parse_args()
    cfg = config(a.size, a.prompts_per_step, a.group_size, a.lr)
    g = cfg.grpo
    first, last = stats.WARMUP + 1, stats.WARMUP + a.steps
    os.makedirs(a.dir, exist_ok=True)
    hf_dir, prompts_json = os.path.join(a.dir, "hf"), os.path.join(a.dir, "prompts.json")
    shutil.rmtree(hf_dir, ignore_errors=True)
    export(cfg, hf_dir)
    with open(prompts_json, "w") as f:
        json.dump(prompts(cfg, last), f)
    print(f"model {tg.count_params(cfg.model):,} parameters (exported to {hf_dir}) | "
          f"{g.prompts_per_step} prompts x {g.group_size} completions x <= {g.max_new_tokens} "
          f"tokens, temperature {g.temperature:g}, beta {g.beta:g}, lr {g.lr:g} | steps {first}-"
          f"{last} of each run", flush=True)
    rows = {"ours": [], "trl": []}
    for r in range(a.rounds):
        for side, got in (("ours", ours(cfg, last, os.path.join(a.dir, "ours-run"), a.flags)),
                          ("trl", peer(cfg, last, hf_dir, prompts_json,
                                       os.path.join(a.dir, f"trl-{r + 1}.log")))):
            rows[side].append((stats.median_over(got["seconds"], first, last),
                               stats.median_over(got["tok_s"], first, last),
                               sum(got["tokens"][s] for s in range(first, last + 1))))
        (so, to, no), (st, tt, nt) = rows["ours"][-1], rows["trl"][-1]
        # The work each side's timed steps did: the completion tokens they sampled.
        print(f"round {r + 1}: ours {1e3 * so:.0f} ms/step, {to:.0f} rollout tok/s, {no:.0f} "
              f"completion tokens | trl {1e3 * st:.0f} ms/step, {tt:.0f} rollout tok/s, "
              f"{nt:.0f} completion tokens", flush=True)
    med = {k: [statistics.median(x[i] for x in v) for i in (0, 1)] for k, v in rows.items()}
    (so, to), (st, tt) = med["ours"], med["trl"]
    print(f"grpo: ours {1e3 * so:.0f} ms/step, {to:.0f} rollout tok/s | trl {1e3 * st:.0f} "
          f"ms/step, {tt:.0f} rollout tok/s | step time ratio (trl/ours) {st / so:.2f}, "
          f"rollout ratio (ours/trl) {to / tt:.2f} (medians of {a.rounds} rounds) | completion "
          f"tokens in the timed steps, all rounds: ours {sum(x[2] for x in rows['ours']):.0f}, "
          f"trl {sum(x[2] for x in rows['trl']):.0f}")


if __name__ == "__main__":
    main()
