"""GRPO / GSPO post-training of a dense decoder with verifiable rewards, in one file.

    python train_grpo.py tiny                       # the `make train-grpo` run: warm start, GRPO
    python train_grpo.py tiny --grpo.loss gspo      # sequence-level importance ratios
    python train_grpo.py tiny --init-from runs/tiny # start from a train_dense.py run
    python train_grpo.py tiny --init-from-hf ~/hf/Qwen3-0.6B  # from a HuggingFace folder
    python train_grpo.py tiny --bench 10            # time the policy update; --dry-run: memory

The loop (Shao et al. 2024, "DeepSeekMath", section 4.1): draw prompts, sample G completions of
each on the device (prefill, then decode with a preallocated KV cache), score them with
plain-Python reward functions, normalise the rewards within each group into advantages, and
take `mu` clipped policy-gradient steps against the log-probs recorded while sampling. The policy
is train_dense.py's model, Gemma's knobs included, held to it by tests/test_copies.py and
tests/test_grpo.py. Shapes: B batch (rollouts), T sequence, S key sequence (the KV cache), P
prompt, N new (completion) tokens, D model, H head, K key/value heads, V vocabulary.
"""
import math
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name as named_as  # what --model.remat may keep
from jax.sharding import PartitionSpec as P

from common import hf, lora, observe, optim, sampling, train
from common.attention import attend, cached
from common.config import check_ranges, how, knob, need, resumable
from common.checkpoint import CheckpointConfig
from common.data import (CharTokenizer, ChatTemplate, PretrainedTokenizer, decode_completions,
                         encode_completions, left_pad, open_tokenizer, run_tokenizer)
from common.lora import LoRAConfig, lora_table
from common.mesh import BATCH_AXES, MeshConfig, describe, make_mesh, resolve
from common.task import (Row, Task, columns, exact, format_reward, load_task, pack, problems,
                         prompt_width, score)
from common.train import ConfigError, fetch, log, named

# ----------------------------------------------------------------------------------------------
# 1. Config
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2           # < n_heads: grouped-query attention
    head_dim: int = 64
    d_ff: int = 768
    max_seq_len: int = 2048
    rope_theta: float = 10_000.0
    rope_scaling: float = 0.0     # Llama 3.1 frequency scaling factor (8.0); 0 = off
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False        # Qwen2
    qk_norm: bool = False         # Qwen3: RMSNorm on each head of q and k before RoPE
    # Gemma 2 / 3. Off = falsy = the Llama block bit for bit
    sliding_window: int = 0       # local layers see the last W tokens, themselves included
    global_every: int = 0         # with a window: layers n-1, 2n-1, ... are global; 0 = none
    rope_local_theta: float = 0.0  # the local layers' RoPE base (Gemma 3: 10k); 0 = rope_theta
    rope_linear: float = 0.0      # global layers' positions divided by this (Gemma 3 4B+: 8)
    attn_softcap: float = 0.0     # Gemma 2: logits -> c tanh(logits / c) (attention, final)
    final_softcap: float = 0.0
    query_scale: float = 0.0      # logits scaled by query_scale^-1/2 (query_pre_attn_scalar); 0 = H
    norm_plus_one: bool = False   # RMSNorm gains stored as w, applied as (1 + w)
    sandwich_norm: bool = False   # norms after attention and MLP too, before the residual adds
    embed_scale: bool = False     # embeddings times sqrt(d_model), rounded to the compute dtype
    gelu: bool = False            # GeGLU with tanh-approximated GELU instead of SwiGLU
    # OLMo 2 / 3 (with Gemma 3's windows and RoPE bases)
    post_norm: bool = False       # norms only after attention and MLP, none before
    qk_norm_whole: bool = False   # the q and k norms span all heads at once ([N, H], [K, H])
    yarn_factor: float = 0.0      # YaRN RoPE on the global layers: context stretched this much
    yarn_original_max_len: int = 4096  # ... from this pre-training context (beta 32 and 1)
    # Gemma 4 (with Gemma 3's windows, q/k norms and sandwich norms)
    global_head_dim: int = 0      # global layers this wide: a stack of their own; 0 = one stack
    global_kv_heads: int = 0      # ... with this many key/value heads; 0 = n_kv_heads
    k_eq_v: bool = False          # ... and no value projection: values are the keys' (unnormed)
    rope_partial: float = knob(0.0, "[0, 1]")  # global layers rotate this share of frequencies
    v_norm: bool = False          # values RMS-normed per head, without a gain
    layer_scale: bool = False     # each layer's output times a stored constant (HF's buffer)
    ple_dim: int = 0              # per-layer inputs this wide: a second embedding, one per layer
    kv_shared: int = 0            # the last n layers reuse the last earlier K/V of their kind
    wide_shared_mlp: bool = False  # ... and their MLPs are 2 d_ff wide
    # Qwen3.5 (with (1 + w) norms, q/k norms): with global_every n, the layers between the global
    # ones are Gated DeltaNet (`gated_deltanet`) with this many key heads (0 = none), each
    # serving value heads in groups
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 128
    linear_v_dim: int = 128
    linear_conv: int = 4          # the causal depthwise convolution's width over q, k and v
    linear_chunk: int = how(64)   # positions per chunk of the chunkwise delta rule
    attn_gate: bool = False       # attention output times sigmoid of a second query projection
    rotary_dim: int = 0           # rotate only each head's first this many dims; 0 = all
    layer_norm: bool = False      # GPT-2/3 (with gelu, qkv_bias): LayerNorm, with a bias
    learned_pos: bool = False     # a learned table of max_seq_len positions added, no RoPE
    plain_mlp: bool = False       # act(x W_up) W_down: no gate
    proj_bias: bool = False       # biases on the attention output and the MLP's projections
    # How to compute, not what: these may change when a run is resumed.
    dtype: Literal["float32", "bfloat16"] = how("float32")  # activations and matmuls (weights f32)
    # auto: splash on TPU, cuDNN on GPU where it applies, else blocked (common/attention.py)
    attention: Literal["auto", "splash", "cudnn", "blocked", "xla", "einsum"] = how("auto")
    context_attention: Literal["allgather", "ring", "ulysses"] = how("allgather")  # --mesh.context
    # What the backward pass may keep (common/train.py's REMAT_NAMES); auto: the most that fits
    remat: Literal["auto", "full", "qkv", "attn", "proj", "offload", "dots", "none"] = how("full")
    scan_layers: bool = how(True)
    loss_chunk: int = how(256)    # sequence positions per cross-entropy chunk (bounds [B,T,V])
    loss_impl: Literal["fused", "remat"] = how("fused")  # gradient made with the loss, or rebuilt
    vocab_split: bool = how(False)  # the unembedding (or tied table) split on V, as the loss uses
    quant: Literal["none", "int8", "fp8"] = how("none")  # the big matmuls (docs/quant.md)


@dataclass(frozen=True)
class TaskConfig:
    """Your prompts and rewards (--task.path, common/task.py), or the demo: sums written
    backwards, 12+345= -> 753. Least significant digit first, each digit needs only its column
    and the carry just written, so a ~1M-parameter causal model learns it on a CPU in minutes
    (Lee et al. 2023, "Teaching Arithmetic to Small Transformers")."""
    min_digits: int = 1           # each operand has min_digits..max_digits digits
    max_digits: int = 3
    eval_prompts: int = 256       # fixed held-out prompts, greedy-decoded every --grpo.eval-every
    eval_seed: int = knob(12345, ">= 0")  # which --task.path prompts are held out
    path: str = ""                # a JSONL of prompts (+ fields); "" = the addition demo
    eval_path: str = ""           # held-out prompts (its first --task.eval-prompts); "" = from path
    rewards: tuple[str, ...] = () # FILE.py:fn,fn (TRL's fn(completions, **fields)) or exact, format
    reward_weights: tuple[float, ...] = ()  # one per reward function, in order; () = 1 each
    format_regex: str = ""        # the built-in format reward: the completion must match it too


@dataclass(frozen=True)
class GRPOConfig:
    steps: int = resumable(2000, ">= 0")  # rollout batches (each followed by `mu` optimiser steps)
    prompts_per_step: int = 32    # on the demo, 32 prompts x 4 beat 16 x 8 and 8 x 16 for the
    group_size: int = 4           # same 128 rollouts: G completions per prompt
    max_new_tokens: int = 6       # the completion budget (and Dr. GRPO's constant)
    temperature: float = 0.7      # rollouts (eval: greedy); 0.7 learns faster than 1.0 here
    top_k: int = 0                # 0 = off
    top_p: float = knob(1.0, "(0, 1]")  # 1 = off
    loss: Literal["grpo", "bnpo", "dr_grpo", "dapo", "gspo"] = "grpo"
    scale_rewards: bool = True    # divide advantages by the group's std (off: Dr. GRPO)
    eps_low: float = knob(-1.0, "-1 or (0, 1)")  # clip ratio below 1 - eps_low; -1 = the paper's
    eps_high: float = knob(-1.0, "-1 or > 0")  # clip ratio above 1 + eps_high; -1 = the paper's
    beta: float = 0.0             # weight of the k3 KL to the reference; 0 = no reference kept
    mu: int = 1                   # optimiser passes per rollout batch (PPO epochs)
    # Completions sampled per step; 0: one update's (prompts-per-step x group-size). More: the
    # rollout's whole groups split into updates of that size, each an optimiser step, `mu`
    # passes over them (TRL's steps_per_generation): fewer, larger generate calls.
    rollout_batch: int = knob(0, ">= 0")
    pack: bool = how(True)        # score and update the rollout's tokens, packed, not its pads
    # Rollouts: `refill_rollout` (rows that finish take waiting prompts; the live cache read)
    # or `rollout` (done rows dropped by halvings); auto: refill off the CPU where it applies
    decode: Literal["auto", "halving", "refill"] = how("auto")
    decode_rows: int = how(0, ">= 0")  # refill: rows decoded at once; 0 = the whole rollout
    decode_segment: int = how(128, ">= 1")  # refill: the cache columns read grow by this
    microbatches: int = resumable(1)  # gradient accumulation within each pass
    lr: float = resumable(3e-4)   # the demo: 1e-3 dips first, 3e-3 collapses the policy
    warmup_steps: int = knob(10, ">= 0")
    weight_decay: float = 0.0
    b1: float = knob(0.9, "[0, 1)")
    b2: float = knob(0.99, "[0, 1)")
    clip_norm: float = 1.0
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: the hidden matrices (common/optim.py)
    muon_dtype: Literal["float32", "bfloat16"] = "float32"  # Muon's momentum and iteration
    qk_clip_threshold: float = resumable(0.0, ">= 0")  # MuonClip: q.k logits <= this; 0 = off
    format_weight: float = knob(0.1, ">= 0")  # reward of the format check (correctness: 1)
    seed: int = 0
    log_every: int = resumable(10)
    eval_every: int = resumable(50)
    profile_steps: tuple[int, ...] = resumable(())  # first, last step traced to <run_dir>/profile
    peak_tflops: float = resumable(0.0)  # per device, for MFU; 0 = look up or measure
    max_bad_steps: int = resumable(0)  # updates with a non-finite loss, KL or gradient to skip


@dataclass(frozen=True)
class WarmStartConfig:
    """SFT on correct examples first: from random weights every reward and advantage is zero
    and GRPO has no gradient; it needs a policy that is sometimes right."""
    max_steps: int = knob(1500, ">= 0")  # 0 = no warm start
    target_reward: float = knob(0.2, ">= 0")  # stop at this sampled (not greedy) reward: low,
    check_every: int = 20         # so that GRPO has room (0.3 left some seeds no gain to find)
    batch_size: int = 256         # 64 made the warm start of 1 seed in 3 slow, and GRPO stall
    lr: float = 3e-3
    warmup_steps: int = knob(20, ">= 0")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    warm: WarmStartConfig = resumable(WarmStartConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    mesh: MeshConfig = resumable(MeshConfig)
    checkpoint: CheckpointConfig = resumable(CheckpointConfig)
    lora: LoRAConfig = field(default_factory=partial(  # LoRA (the warm start trains it all)
        LoRAConfig, targets="wq,wk,wv,wo,w_gate,w_up,w_down"))
    run_dir: str = resumable("runs/grpo-tiny")
    init_from: str = ""           # a train_dense.py run dir: its model, tokenizer and weights
    init_from_hf: str = ""        # a HuggingFace folder: its config.json, tokenizer and weights
    quiet: bool = resumable(False)  # no progress lines; steps, evals and the summary still print
    dry_run: bool = resumable(False)  # compile one policy update on abstract inputs, print memory
    bench: int = resumable(0)     # time this many policy updates on synthetic rollouts, exit


# The demo model: ~0.4M parameters, a 16-symbol character vocabulary (common/data.py). It
# recomputes (remat full): kept, each stacked residual of the scan is zero-filled and copied.
# Its update runs as 4 microbatches of 32 rollouts: each one's activations stay in the CPU's
# cache (`make bench-grpo`'s update: 31-39 ms in one pass, 27-29 in four).
_TINY_MODEL = ModelConfig(vocab_size=16, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                          head_dim=32, d_ff=384, max_seq_len=32)

PRESETS: dict[str, tuple[str, Config]] = {
    "tiny": ("~0.4M-parameter model on reversed addition: the `make train-grpo` run",
             Config(model=_TINY_MODEL, grpo=GRPOConfig(microbatches=4),
                    checkpoint=CheckpointConfig(every=25))),
    # On-policy (mu = 1) the sequence ratio is 1 and GSPO's gradient is GRPO's; the second
    # pass over each batch is where the two differ.
    "tiny-gspo": ("the same with GSPO's sequence-level ratio, its clip range and 2 passes",
                  Config(model=_TINY_MODEL, grpo=GRPOConfig(loss="gspo", mu=2),
                         checkpoint=CheckpointConfig(every=25), run_dir="runs/grpo-tiny-gspo")),
    "from-dense": ("start from `make train`'s checkpoint (runs/tiny) and its tokenizer",
                   Config(init_from="runs/tiny", warm=WarmStartConfig(lr=1e-3),
                          grpo=GRPOConfig(lr=3e-4, max_new_tokens=8),
                          run_dir="runs/grpo-from-dense")),
}


# Clip ranges from the papers, used when --grpo.eps-low/--grpo.eps-high are -1.
# PPO/GRPO: 0.2 both ways. DAPO's clip-higher: 0.2 / 0.28 (Yu et al. 2025, section 3.1).
# GSPO: 3e-4 / 4e-4, since a sequence-level ratio is a geometric mean of token ratios and
# moves far less (Zheng et al. 2025, section 5.1).
PAPER_EPS = {"grpo": (0.2, 0.2), "bnpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2),
             "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}


def clip_range(g: GRPOConfig) -> tuple[float, float]:
    lo, hi = PAPER_EPS[g.loss]
    return (lo if g.eps_low < 0 else g.eps_low), (hi if g.eps_high < 0 else g.eps_high)


# ----------------------------------------------------------------------------------------------
# 2. Parameters and their shardings (train_dense.py's; tests/test_copies.py keeps them equal)
# ----------------------------------------------------------------------------------------------
def _param_table(cfg: ModelConfig) -> dict:
    """The one definition of the parameter tree: name -> (shape, PartitionSpec, init std).
    Per-layer weights are stacked on a leading L axis so the layers run under lax.scan. Init std
    0.02, times 1/sqrt(2L) on the two projections that write into the residual stream (GPT-2)
    so that its variance does not grow with depth; None = ones (norms), 0.0 = zeros (biases)."""
    L, D, N, K, H, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads,
                           cfg.head_dim, cfg.d_ff, cfg.vocab_size)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * L)
    one = 0.0 if cfg.norm_plus_one else None   # a (1 + w) gain starts at w = 0
    bias, qk, sw = cfg.qkv_bias, cfg.qk_norm, cfg.sandwich_norm or cfg.post_norm
    pre, hs = not cfg.post_norm, ("tensor", None) if cfg.qk_norm_whole else (None,)  # q/k norms
    ple, Pd, ln, pb = bool(cfg.ple_dim), cfg.ple_dim, cfg.layer_norm, cfg.proj_bias  # pb: GPT-2's
    Hk, Lv, Dk, Dv = (cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim)

    def stack(count, H=H, K=K, F=F, kv=True, wv=True, lin=False):  # kv: the layer makes its
        # own K and V; lin: Gated DeltaNet's projections (`gated_deltanet`) instead of attention
        r = Lv // max(Hk, 1)
        rows = {  # name: (shape and spec after the L axis, init std, whether this model has it)
            "attn_norm": ((D,), (None,), one, pre), "mlp_norm": ((D,), (None,), one, pre),
            "wq": ((D, N, H), ("fsdp", "tensor", None), std, True),
            "wk": ((D, K, H), ("fsdp", "tensor", None), std, kv),
            "wv": ((D, K, H), ("fsdp", "tensor", None), std, kv and wv),
            "wo": ((N, H, D), ("tensor", None, "fsdp"), out_std, True),
            "attn_norm_bias": ((D,), (None,), 0.0, pre and ln), "mlp_norm_bias": (
                (D,), (None,), 0.0, pre and ln), "bo": ((D,), (None,), 0.0, pb),
            "b_up": ((F,), ("tensor",), 0.0, pb), "b_down": ((D,), (None,), 0.0, pb),
            "w_gate": ((D, F), ("fsdp", "tensor"), std, not cfg.plain_mlp),
            "w_up": ((D, F), ("fsdp", "tensor"), std, True),
            "w_down": ((F, D), ("tensor", "fsdp"), out_std, True),
            "bq": ((N, H), ("tensor", None), 0.0, bias),
            "bk": ((K, H), ("tensor", None), 0.0, bias and kv),
            "bv": ((K, H), ("tensor", None), 0.0, bias and kv),
            "q_norm": ((N, H)[-len(hs):], hs, one, qk),
            "k_norm": ((K, H)[-len(hs):], hs, one, qk and kv),
            "attn_post_norm": ((D,), (None,), one, sw), "mlp_post_norm": ((D,), (None,), one, sw),
            "ple_gate": ((D, Pd), ("fsdp", None), std, ple),  # Gemma 4's per-layer input
            "ple_out": ((Pd, D), (None, "fsdp"), out_std, ple),
            "ple_post_norm": ((D,), (None,), one, ple),
            "layer_scale": ((1,), (None,), None, cfg.layer_scale),
            "wq_gate": ((D, N, H), ("fsdp", "tensor", None), std, cfg.attn_gate),
            # per key head its q, k, its group's v, z, b and a (train_moe.py's `_layer_table`)
            **{k: ((D, Hk, *s), ("fsdp", "tensor") + (None,) * len(s), std, lin) for k, s in dict(
                lin_q=(Dk,), lin_k=(Dk,), lin_v=(r, Dv), lin_z=(r, Dv), lin_b=(r,), lin_a=(r,)
            ).items()},
            "lin_conv": ((cfg.linear_conv, 1, 2 * Hk * Dk + Lv * Dv), (None, None, None),
                         1 / math.sqrt(cfg.linear_conv), lin),
            "A_log": ((Lv,), ("tensor",), 0.5, lin), "dt_bias": ((Lv,), ("tensor",), None, lin),
            "lin_norm": ((Dv,), (None,), None, lin),   # a plain gain, even with (1 + w) norms
            "lin_wo": ((Lv, Dv, D), ("tensor", None, "fsdp"), out_std, lin),
        }
        attn = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "q_norm", "k_norm", "wq_gate")
        return {k: ((count, *s), P(None, *p), i) for k, (s, p, i, on) in rows.items()
                if on and not (lin and k in attn)}

    split = cfg.vocab_split and cfg.tie_embeddings  # the tied table split on V, as the loss uses it
    table = {"embed": ((V, D), P(("tensor", "fsdp"), None) if split else P("tensor", "fsdp"), std),
             "final_norm": ((D,), P(None), one)}
    table |= {"final_norm_bias": ((D,), P(None), 0.0)} if ln else {}
    table |= {"pos_embed": ((cfg.max_seq_len, D), P(None, "fsdp"), std)} if cfg.learned_pos else {}
    if cfg.global_head_dim:  # Gemma 4: local and global layers of different shapes, and the
        # last kv_shared of each without keys and values of their own: four stacks
        n, S, GH, GK = cfg.global_every, cfg.kv_shared, cfg.global_head_dim, cfg.global_kv_heads
        glob = dict(H=GH, K=GK or K, wv=not cfg.k_eq_v)
        wide = dict(F=2 * F) if cfg.wide_shared_mlp else {}
        table |= {"layers": stack((L - S) // n * (n - 1)),
                  "global_layers": stack((L - S) // n, **glob)}
        if S:
            table |= {"shared_layers": stack(S // n * (n - 1), kv=False, **wide),
                      "shared_global_layers": stack(S // n, kv=False, **wide, **glob)}
    elif Hk:  # Qwen3.5: periods of n layers, n - 1 DeltaNet then a global one, a stack each
        table |= {"layers": stack(L - L // cfg.global_every, lin=True),
                  "global_layers": stack(L // cfg.global_every)}
    else:
        table["layers"] = stack(L)
    if ple:  # one table of L * Pd per token, and the stream's projection onto the same
        table |= {"ple_embed": ((V, L * Pd), P("tensor", "fsdp"), std),
                  "ple_proj": ((D, L * Pd), P("fsdp", "tensor"), std),
                  "ple_norm": ((Pd,), P(None), one)}
    w = P(None, ("tensor", "fsdp")) if cfg.vocab_split else P("fsdp", "tensor")
    unembed = {} if cfg.tie_embeddings else {"unembed": ((D, V), w, std)}
    return table | unembed


def param_specs(cfg: ModelConfig) -> dict:
    return train.table_specs(_param_table(cfg))


def _init(cfg: ModelConfig, key: jax.Array) -> dict:
    return train.table_init(_param_table(cfg), key)


def init_params(cfg: ModelConfig, key: jax.Array, mesh=None) -> dict:
    """Float32 master weights, each created directly in its shards (never whole on one device)."""
    out = named(mesh, param_specs(cfg)) if mesh is not None else None
    return jax.jit(partial(_init, cfg), out_shardings=out)(key)


def count_params(cfg: ModelConfig) -> int:
    return train.table_count(_param_table(cfg))


def train_state(cfg: Config, mesh, tx, ref: bool = False, lora: bool = True) -> train.TrainState:
    """{params, opt_state, step} with optimiser `tx` on `mesh`; `ref`: the KL reference too
    (under --lora.rank, the frozen base is the reference)."""
    lora = lora and cfg.lora.rank and (  # LoRA
        lora_table(_param_table(cfg.model), MUON_DIMS, cfg.lora), cfg.grpo.seed)
    return train.TrainState(partial(_init, cfg.model), param_specs(cfg.model), tx, mesh,
                            ref=ref and not lora, lora=lora or None)


# ----------------------------------------------------------------------------------------------
# 3. Model (train_dense.py's, plus a padding mask, shifted positions and a KV cache)
# ----------------------------------------------------------------------------------------------
def block(x_BTD, lp: dict, cfg: ModelConfig, *, pos_BT, inv_freq, mask_BTS=None, kv=None,
          index=0, max_logits: bool = False, is_global=True, shared=None, keep_kv=False,
          ple_BTP=None, cache=False):
    """train_dense.py's block (tests/test_grpo.py holds the two equal) with a padding mask and
    a KV cache (`cache`): with `kv` (this layer's k and v [B, K, S, H], heads first, or the
    whole stack [L, B, K, S, H] and this layer's index, written in place) the new keys and
    values are written at column `index` (or each row's own, [B]) and the queries attend over
    the cache's first columns, as many as the mask spans (the live ones, when decoding); returns
    (x, (kv, stats: with max_logits the heads' largest logit)). Gemma 4: a layer without keys
    and values of its own attends over `shared`, an earlier layer's (k, v) (its cache, when
    decoding), which stats hold with `keep_kv`."""
    dt, lp = x_BTD.dtype, lora.merged(lp)  # LoRA: each adapted weight merged, in its layer
    w = lambda name: lp[name].astype(dt)   # f32 master weights, compute-dtype matmuls
    b = lambda name: w(name) if name in lp else 0  # biases: those this model has

    def norm(x, name):  # a gain [N, H] (OLMo's q/k norms) normalises all heads at once
        g, b = 1.0 + lp[name] if cfg.norm_plus_one else lp[name], lp.get(name + "_bias")
        return rms_norm(x.reshape(*x.shape[:-g.ndim], -1), g.ravel(), cfg.norm_eps, b).reshape(
            x.shape)

    h = x_BTD if cfg.post_norm else norm(x_BTD, "attn_norm")
    if "lin_q" in lp:  # Qwen3.5's DeltaNet layers: left padding zeroed, so the state stays 0
        # through it and the convolution sees zeros before a prompt, as at a row's start; with
        # a cache, `kv` is the layer's state (`gated_deltanet`), continued by these tokens
        T = x_BTD.shape[1]
        valid = 1 if mask_BTS is None else jnp.take_along_axis(  # each token's own column
            mask_BTS, (index + jnp.arange(T))[None, :, None], 2).astype(h.dtype)
        o, kv = gated_deltanet(h * valid, lp, cfg, kv)
        kv, stats = kv if cache else None, {}
    else:
        if np.ndim(inv_freq) == 2:
            inv_freq = jnp.where(is_global, inv_freq[1], inv_freq[0])
        q = jnp.einsum("btd,dnh->btnh", h, w("wq")) + (w("bq") if cfg.qkv_bias else 0)
        rope = partial_rope if cfg.rotary_dim else apply_rope  # Qwen3.5: a share of the dims
        rope = (lambda x, *_: x) if cfg.learned_pos else rope
        q = rope(norm(q, "q_norm") if cfg.qk_norm else q, pos_BT, inv_freq)
        if shared is None:  # else a Gemma 4 layer reusing an earlier layer's (kv_shared)
            k = jnp.einsum("btd,dkh->btkh", h, w("wk"))
            v = jnp.einsum("btd,dkh->btkh", h, w("wv")) if "wv" in lp else k  # else k_eq_v
            if cfg.qkv_bias:
                k, v = k + w("bk"), v + w("bv")
            k = rope(norm(k, "k_norm") if cfg.qk_norm else k, pos_BT, inv_freq)
            v = rms_norm(v, 1.0, cfg.norm_eps) if cfg.v_norm else v  # Gemma 4's: per head
            # Keys are cached after RoPE, so a cached key never needs its position again.
            if kv is not None:  # the stack's columns in place, not a layer's [B, K, S, H] rewritten
                whole = len(kv) == 3  # else one layer's (Gemma 4's periods): a stack of one
                ck, cv, i = kv if whole else (kv[0][None], kv[1][None], 0)
                put = lambda c, a: jax.lax.dynamic_update_slice(
                    c, a.swapaxes(1, 2)[None].astype(c.dtype), (i, 0, 0, index, 0)
                ) if jnp.ndim(index) == 0 else c.at[  # a column per row, written as one H-vector
                    # per (row, head, token): a [K, H] window would make XLA:TPU lay the whole
                    # cache out S before K, copying it in and out at every step
                    i, jnp.arange(len(a))[:, None, None], jnp.arange(a.shape[2])[:, None],
                    index[:, None, None] + jnp.arange(a.shape[1])].set(
                    a.swapaxes(1, 2).astype(c.dtype))
                ck, cv = put(ck, k), put(cv, v)
                live = slice(None if mask_BTS is None else mask_BTS.shape[-1])  # only columns
                k, v = ck[i, :, :, live], cv[i, :, :, live]  # the mask spans are read
                kv = (ck, cv) if whole else (k, v)
            shared = k, v
        q, k, v = (named_as(x, n) for x, n in zip((q, *shared), "qkv"))
        if cfg.yarn_factor:  # YaRN's temperature where it stretches RoPE: logits x (0.1 ln s + 1)^2
            q = q * jnp.where(is_global, (0.1 * math.log(max(cfg.yarn_factor, 1)) + 1) ** 2, 1.0)
        S = k.shape[2 if cache else 1]
        W = cfg.sliding_window if cfg.sliding_window < S else 0  # else: all within reach
        stats = {"max_logit": optim.max_logits(q, k, mask_BTS, window=W, is_global=is_global)
                 } if max_logits else {}
        # The mask: left padding and a cache's empty tail, which XLA's masked softmax takes.
        full = partial(cached, q, k, v) if cache else partial(attend, q, k, v, impl=cfg.attention)
        full = partial(full, mask_BTS=mask_BTS, scale=(cfg.query_scale or cfg.head_dim) ** -0.5,
                       cap=cfg.attn_softcap)
        if W and mask_BTS is not None:  # the window as a mask, the queries at columns index..
            near_TS = (index + jnp.arange(q.shape[1]))[:, None] - jnp.arange(S) < W
            local = partial(full, mask_BTS=mask_BTS & near_TS)
        else:
            local = partial(full, window=W)
        pick = (lambda a, b: a() if is_global else b()) if isinstance(is_global, bool) else partial(
            jax.lax.cond, is_global)  # a stack of one kind (Gemma 4's) knows it when traced
        o = pick(full, local) if W else full()
        if cfg.attn_gate:  # Qwen3.5: a gate per head and channel
            o = o * jax.nn.sigmoid(jnp.einsum("btd,dnh->btnh", h, w("wq_gate")))
        o = named_as(jnp.einsum("btnh,nhd->btd", named_as(o, "attn"), w("wo")) + b("bo"), "o")
    x_BTD = x_BTD + (norm(o, "attn_post_norm") if cfg.sandwich_norm or cfg.post_norm else o)
    h = x_BTD if cfg.post_norm else norm(x_BTD, "mlp_norm")
    act = lambda g: jax.nn.gelu(g, approximate=True) if cfg.gelu else jax.nn.silu(g)
    u = named_as(jnp.einsum("btd,df->btf", h, w("w_up")) + b("b_up"), "mlp_in")
    g = None if cfg.plain_mlp else named_as(jnp.einsum("btd,df->btf", h, w("w_gate")), "mlp_in")
    u = act(u) if g is None else act(g) * u  # GPT-2's MLP has no gate
    y = named_as(jnp.einsum("btf,fd->btd", u, w("w_down")) + b("b_down"), "mlp_out")
    x_BTD = x_BTD + (norm(y, "mlp_post_norm") if cfg.sandwich_norm or cfg.post_norm else y)
    if cfg.ple_dim:  # Gemma 4: the layer's own input, gated by the stream, normed, added
        g = act(jnp.einsum("btd,dp->btp", x_BTD, w("ple_gate"))) * ple_BTP
        x_BTD = x_BTD + norm(jnp.einsum("btp,pd->btd", g, w("ple_out")), "ple_post_norm")
    if cfg.layer_scale:  # a constant (HF's buffer), which training leaves as loaded
        x_BTD = x_BTD * jax.lax.stop_gradient(lp["layer_scale"]).astype(dt)
    return constrain(x_BTD, ACT_BTD), (kv, stats | ({"kv": (k, v)} if keep_kv else {}))


def constrain(x, spec: P):
    """Pin an activation's sharding when a mesh is set (jax.set_mesh); a no-op without one."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec)


ACT_BTD = P(BATCH_AXES, None, None)  # activations between blocks: batch-sharded, d replicated
CACHE_LBKSH = P(None, BATCH_AXES, "tensor", None, None)  # KV cache: rows and kv heads split
CACHE_SPECS = {"k": CACHE_LBKSH, "v": CACHE_LBKSH,  # and DeltaNet's: rows and key heads split
               **dict.fromkeys(("conv_q", "conv_k", "conv_v"), P(None, BATCH_AXES, None, "tensor")),
               "delta": P(None, BATCH_AXES, "tensor")}


def rms_norm(x, w, eps, b=None):  # with a bias b: LayerNorm (GPT-2's), the mean removed first
    # Statistics in float32 whatever the compute dtype: bfloat16 squares lose the small values.
    x32 = x.astype(jnp.float32)
    x32 = x32 if b is None else x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w + (0 if b is None else b)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """theta^(-2i/H), with Llama 3.1's rescaling when rope_scaling > 0: wavelengths longer than
    original_max_len / low_freq_factor are slowed by `factor`, shorter than
    original_max_len / high_freq_factor kept, and the band between interpolated smoothly. YaRN
    alike: dims turning over 32 times in yarn_original_max_len kept, under once slowed by
    yarn_factor, a ramp between (its ends rounded to whole dims)."""
    H = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H)
    if cfg.rope_scaling > 0:
        wavelen = 2 * np.pi / inv
        lo = cfg.rope_original_max_len / cfg.rope_low_freq_factor
        hi = cfg.rope_original_max_len / cfg.rope_high_freq_factor
        smooth = ((cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor)
                  / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
        mid = (1 - smooth) * inv / cfg.rope_scaling + smooth * inv
        inv = np.where(wavelen < hi, inv, np.where(wavelen > lo, inv / cfg.rope_scaling, mid))
    if cfg.yarn_factor:
        dim = lambda turns: H * math.log(cfg.yarn_original_max_len / (turns * 2 * math.pi)) / (
            2 * math.log(cfg.rope_theta))
        lo, hi = max(math.floor(dim(32)), 0), min(math.ceil(dim(1)), H - 1)
        ramp = np.clip((np.arange(H // 2) - lo) / ((hi - lo) or 0.001), 0, 1)
        inv = inv / cfg.yarn_factor * ramp + inv * (1 - ramp)
    if cfg.rope_partial:  # Gemma 4's proportional RoPE: the slow rest not turned (frequency 0)
        inv[int(cfg.rope_partial * H // 2):] = 0.0
    return inv.astype(np.float32)


def apply_rope(x_BTNH, pos_BT, inv_freq):
    """Rotate the two halves of each head (the HuggingFace layout: its q/k weights load as-is)."""
    ang_BTh = pos_BT[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(ang_BTh)[:, :, None, :], jnp.sin(ang_BTh)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def weights(lp: dict, dt, cfg: ModelConfig):
    """name -> the layer's f32 master weight in the compute dtype, keeping the master's sharding:
    FSDP gathers it in the compute dtype and reduce-scatters its gradient (not all-reduces)."""
    specs = param_specs(cfg)
    spec = {**specs.get("dense_layers", {}), **specs.get("global_layers", {}), **specs["layers"]}
    return lambda name: constrain(lp[name].astype(dt), P(*spec[name][1:]))


def partial_rope(x_BTNH, pos_BT, inv_freq):
    """`apply_rope` on each head's first 2 len(inv_freq) dims (rotary_dim), the rest unturned."""
    R = 2 * len(inv_freq)
    return jnp.concatenate([apply_rope(x_BTNH[..., :R], pos_BT, inv_freq), x_BTNH[..., R:]], -1)


# Qwen3.5's linear layers: Gated DeltaNet (Yang, Kautz and Hatamizadeh 2024, arXiv 2412.06464),
# train_dense.py's (tests/test_copies.py holds each copy equal).
def gated_deltanet(h_BTD, lp: dict, cfg: ModelConfig, state=None):
    """A linear layer's token mixer [B, T, D]: per value head a state S [Dk, Dv] that decays and
    is corrected toward each token's value (the gated delta rule, `delta_rule_chunked`),

        S_t = a_t S_{t-1} (I - b_t k_t k_t^T) + b_t k_t v_t^T,    o_t = S_t^T q_t / sqrt(Dk),

    q, k, v from h through a causal depthwise convolution (`causal_conv`) and SiLU, q and k
    L2-normed (|k| = 1: I - b k k^T contracts for b in (0, 1)); b = sigmoid(h W_b) the write
    strength, a = exp(g), g = -exp(A_log) softplus(h W_a + dt_bias) (Mamba-2's discretised
    decay). Each key head serves a group of Hv / Hk value heads, whose v, z, b, a weights are
    stored on its axis: a tensor shard holds whole groups. Out: RMSNorm(o) * silu(h W_z) per
    head (a plain gain), then W_o. Returns (out, state): `state` (None = a sequence's start)
    is each of q, k, v's last K - 1 inputs to the convolution and S [B, Hv, Dk, Dv], which the
    tokens continue (decoding: train_grpo.py's cache holds it)."""
    dt, f32, Hk, Dk = h_BTD.dtype, jnp.float32, cfg.linear_k_heads, cfg.linear_k_dim
    w, (B, T), r = weights(lp, dt, cfg), h_BTD.shape[:2], cfg.linear_v_heads // Hk
    q, k, v, z, b, a = (jnp.einsum("btd,dk...->btk...", h_BTD, w("lin_" + n)) for n in "qkvzba")
    conv = w("lin_conv")[:, 0]  # [K, channels]: every head's q, then k, then v (the checkpoint's order)
    past = (None,) * 3 if state is None else state[:3]
    (q, qp), (k, kp), (v, vp) = (causal_conv(x, c.reshape(-1, *x.shape[2:]), p) for x, c, p in zip(
        (q, k, v), jnp.split(conv, [Hk * Dk, 2 * Hk * Dk], 1), past))
    heads = lambda x: x.reshape(B, T, Hk * r, -1)
    l2 = lambda x: jnp.repeat(x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6), r, 2)
    b, a = (x.astype(f32).reshape(B, T, Hk * r) for x in (b, a))
    g = -jnp.exp(lp["A_log"]) * jax.nn.softplus(a + lp["dt_bias"])
    q, k = (l2(x.astype(f32)) for x in (q, k))
    o, S = delta_rule_chunked(q / math.sqrt(Dk), k, heads(v), g, jax.nn.sigmoid(b),
                              cfg.linear_chunk, None if state is None else state[3])
    o = rms_norm(o.astype(dt), lp["lin_norm"], cfg.norm_eps) * jax.nn.silu(heads(z).astype(f32))
    return jnp.einsum("bthv,hvd->btd", o.astype(dt), w("lin_wo")), (qp, kp, vp, S)


def causal_conv(x_BT_, w_K_, past=None):
    """SiLU of a causal depthwise convolution over time, y_t = sum_j w_j x_{t-K+1+j}, with x < 0
    the K - 1 inputs `past` (zeros at a sequence's start); and the last K - 1 inputs, for next."""
    K, T = w_K_.shape[0], x_BT_.shape[1]
    xp = jnp.concatenate([jnp.zeros((x_BT_.shape[0], K - 1, *x_BT_.shape[2:]), x_BT_.dtype) if (
        past is None) else past.astype(x_BT_.dtype), x_BT_], 1)
    return jax.nn.silu(sum(w_K_[j] * xp[:, j:j + T] for j in range(K))), xp[:, T:]


def unit_lower_solve(A, B):
    """X with (I + A) X = B, A strictly lower-triangular [..., C, C]: forward substitution in
    halves (log2 C levels of matmuls). Not LAPACK's batched solve: on the CPU its batches are
    spread over XLA's thread pool, and two solves waiting on it at once deadlocked every run of
    the training loop here (jaxlib's ParallelBatchMap)."""
    h = A.shape[-1] // 2
    if not h:
        return B
    x1 = unit_lower_solve(A[..., :h, :h], B[..., :h, :])
    x2 = unit_lower_solve(A[..., h:, h:], B[..., h:, :] - A[..., h:, :h] @ x1)
    return jnp.concatenate([x1, x2], -2)


def delta_rule_chunked(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH, chunk: int, S=None):
    """(o [B, T, H, Dv], the last S) in float32 of the gated delta rule from state S (None =
    zeros), in chunks of C positions (the WY/UT
    form: Yang et al. 2024, arXiv 2406.06484 sec. 3, and 2412.06464 sec. 3.3): O(T C) work and
    memory within chunks, a lax.scan over them carrying S [B, H, Dk, Dv]. In a chunk entered
    with S_0, with log-decays G_i = g_1 + ... + g_i, the chunk's C corrections are one unit
    lower-triangular solve (I + A) [u | w] = [b v | b e^G k], A_ij = b_i e^{G_i - G_j} k_i.k_j
    (j < i); the corrected values v' = u - w S_0, and

        o = (e^G q) S_0 + (e^{G_i - G_j} q_i.k_j, j <= i) v',   S_C = e^{G_C} S_0 + (e^{G_C - G} k)^T v'.

    Every exponent is <= 0 (g <= 0), so nothing grows. The tail is padded with g = b = k = 0,
    which leaves the state as it was."""
    (B, T, H, Dk), Dv, f32 = k_BTHK.shape, v_BTHV.shape[-1], jnp.float32
    C = min(chunk, T)
    n = -(-T // C)
    cut = lambda x: jnp.pad(x.astype(f32), [(0, 0), (0, n * C - T)] + [(0, 0)] * (x.ndim - 2)
                            ).reshape(B, n, C, *x.shape[2:]).swapaxes(2, 3)   # [B, n, H, C, .]
    q, k, v, g, b = map(cut, (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH))
    G = jnp.cumsum(g, -1)
    causal = np.tril(np.ones((C, C), bool))
    decay = jnp.exp(jnp.where(causal, G[..., :, None] - G[..., None, :], -jnp.inf))
    dots = lambda x, y: jnp.einsum("bnhik,bnhjk->bnhij", x, y)
    A = jnp.tril(b[..., None] * dots(k, k) * decay, -1)
    uw = unit_lower_solve(A, jnp.concatenate([b[..., None] * v, (b * jnp.exp(G))[..., None] * k],
                                             -1))

    def step(S, xs):
        u, w, attn, qg, kg, last = xs
        vn = u - jnp.einsum("bhck,bhkv->bhcv", w, S)
        o = jnp.einsum("bhck,bhkv->bhcv", qg, S) + jnp.einsum("bhij,bhjv->bhiv", attn, vn)
        return S * last[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", kg, vn), o
    xs = (uw[..., :Dv], uw[..., Dv:], dots(q, k) * decay, q * jnp.exp(G)[..., None],
          k * jnp.exp(G[..., -1:] - G)[..., None], jnp.exp(G[..., -1]))
    S = jnp.zeros((B, H, Dk, Dv), f32) if S is None else S.astype(f32)
    S, o = jax.lax.scan(step, S, [x.swapaxes(0, 1) for x in xs])
    return o.transpose(1, 0, 3, 2, 4).reshape(B, n * C, H, Dv)[:, :T], S


def hidden(params: dict, tokens_BT, cfg: ModelConfig, *, positions=None, mask_BTS=None,
           cache=None, index=0, max_logits: bool = False):
    """Token ids -> (final-normed hidden states [B, T, D] in the compute dtype, KV cache, stats):
    train_dense.py's `hidden` with the defaults. Left-padded rows pass positions counted from
    their first real token and a mask that hides the padding. With `cache` (keys and values
    [L, B, K, S, H]) the tokens sit at columns index..index+T-1 and are written in."""
    # Gather the table's fsdp shards first (as FSDP does for every weight), in the compute
    # dtype: a lookup into a table split on d makes XLA replicate the whole result.
    dt = jnp.dtype(cfg.dtype)
    look = lambda table, ids=tokens_BT: constrain(jnp.take(constrain(table.astype(dt), P(
        "tensor", None)), ids, axis=0), ACT_BTD)
    x = look(params["embed"])
    x = x * jnp.asarray(math.sqrt(cfg.d_model), dt) if cfg.embed_scale else x
    pos_BT = (jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
              if positions is None else positions)
    x = x + look(params["pos_embed"], pos_BT) if cfg.learned_pos else x  # GPT-2's
    inv_freq = rope_inv_freq(replace(cfg, head_dim=cfg.global_head_dim or cfg.rotary_dim or (
        cfg.head_dim))) / (cfg.rope_linear or 1.0)
    L, W, n, S = cfg.n_layers, cfg.sliding_window, cfg.global_every, cfg.kv_shared
    is_global_L = (np.arange(L) + 1) % n == 0 if W and n else np.full(L, not W)
    if W:  # [local, global] frequencies: Gemma 3's local layers have their own base, unscaled
        local = replace(cfg, rope_theta=cfg.rope_local_theta or cfg.rope_theta, rope_scaling=0.0,
                        yarn_factor=0.0, rope_partial=0.0)
        inv_freq = [rope_inv_freq(local), inv_freq]  # Gemma 4's of two widths, one per stack
        inv_freq = inv_freq if cfg.global_head_dim else np.stack(inv_freq)
    elif cfg.linear_k_heads:  # Qwen3.5: Gemma 4's periods, DeltaNet (unturned) as the local layers
        inv_freq = [None, inv_freq]
    ple_LBTP, gain = None, lambda w: 1.0 + w if cfg.norm_plus_one else w
    if cfg.ple_dim:  # Gemma 4: each layer's own input (train_dense.py's)
        scale = lambda x, c: x * jnp.asarray(c, dt)
        pr = scale(jnp.einsum("btd,dq->btq", x, params["ple_proj"].astype(dt)), cfg.d_model ** -.5)
        pr = rms_norm(pr.reshape(*pr.shape[:2], L, -1), gain(params["ple_norm"]), cfg.norm_eps)
        e = scale(look(params["ple_embed"]), math.sqrt(cfg.ple_dim)).reshape(pr.shape)
        ple_LBTP = jnp.moveaxis(scale(pr + e, 2 ** -0.5), 2, 0)
    # Decoding keeps no activations for a backward.
    remat = lambda f: f if cache is not None else train.remat(f, cfg.remat, cfg.scan_layers)
    # Unrolled (--model.no-scan-layers), each layer is compiled on its own.
    scan = partial(jax.lax.scan, unroll=not cfg.scan_layers)
    run = partial(block, cfg=cfg, pos_BT=pos_BT, mask_BTS=mask_BTS, index=index,
                  max_logits=max_logits, cache=cache is not None)
    kv_of = lambda p: None if cache is None else tuple(cache[p + w] for w in cache_parts(cfg, p))
    if not (cfg.global_head_dim or cfg.linear_k_heads):
        layer = remat(lambda x, lp, kv, is_global, ple: run(x, lp, inv_freq=inv_freq, kv=kv,
                                                            is_global=is_global, ple_BTP=ple))

        def each(c, xs):  # a cache is carried whole, each layer writing its columns in place
            kv = None if cache is None else (*c[1:], xs[1])  # the stack and this layer's index
            x, (kv, st) = layer(c[0], xs[0], kv, *xs[2:])
            return (x, *(kv or ())), st
        (x, *kv), stats = scan(each, (x, *(kv_of("") or ())), (
            params["layers"], jnp.arange(L), jnp.asarray(is_global_L), ple_LBTP))
        new = {"": kv}
    else:  # Gemma 4's periods (train_dense.py's), each kind's cache [its layers, B, K, S, H];
        # Qwen3.5's, DeltaNet's states (`init_cache`) as the local layers' cache
        def kind(is_global, keep):
            return remat(lambda x, lp, ple, kv, shared: run(
                x, lp, inv_freq=inv_freq[is_global], is_global=is_global, kv=kv, shared=shared,
                keep_kv=keep, ple_BTP=ple))

        def period(c, xs, shared=None):
            (loc, glob, ple, cl, cg), (x, kv), keep = xs, c, bool(S) and shared is None
            at = lambda i: None if ple is None else ple[i]

            def local(c, a):
                x, (kv, st) = kind(False, keep)(c[0], *a, shared and shared[0])
                return (x, st.get("kv")), kv
            (x, kv_l), cl = scan(local, (x, kv and kv[0]), (loc, at(slice(-1)), cl))
            x, (cg, st) = kind(True, keep)(x, glob, at(-1), cg, shared and shared[1])
            return (x, kv and (kv_l, st["kv"])), (cl, cg)

        own, G = (L - S) // n, L // n
        by = lambda t, m: jax.tree.map(lambda a: a.reshape(m, -1, *a.shape[1:]), t)
        ple = [None, None] if ple_LBTP is None else jnp.split(by(ple_LBTP, G), [own])
        B, T = x.shape[:2]  # the keys a shared layer reads: this pass's, or the cache's
        zeros = lambda K, H: (jnp.zeros((B, T, K, H) if cache is None else (
            B, K, cache["k"].shape[3], H), dt),) * 2
        kv = (zeros(cfg.n_kv_heads, cfg.head_dim), zeros(cfg.global_kv_heads or cfg.n_kv_heads,
                                                         cfg.global_head_dim)) if S else None
        (x, kv), new = scan(period, (x, kv), (by(params["layers"], own), params["global_layers"],
                                              ple[0], by(kv_of(""), own), kv_of("global_")))
        new = {"": jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), new[0]), "global_": new[1]}
        if S:
            (x, _), _ = scan(partial(period, shared=kv), (x, None), (
                by(params["shared_layers"], G - own), params["shared_global_layers"], ple[1],
                None, None))
        stats = {}
    if cache is not None:
        cache = {p + w: constrain(a, CACHE_SPECS[w]) for p, kv in new.items()
                 for w, a in zip(cache_parts(cfg, p), kv)}
    bias = params.get("final_norm_bias")  # LayerNorm's (GPT-2)
    return rms_norm(x, gain(params["final_norm"]), cfg.norm_eps, bias), cache, stats


def unembedding(params: dict, cfg: ModelConfig):
    return params["embed"].T if cfg.tie_embeddings else params["unembed"]


def logits_of(params: dict, h_BTD, cfg: ModelConfig):
    return _softcap(jnp.einsum("btd,dv->btv", h_BTD, unembedding(params, cfg).astype(
        h_BTD.dtype), preferred_element_type=jnp.float32), cfg.final_softcap)


def _softcap(logits, cap: float):
    return cap * jnp.tanh(logits / cap) if cap else logits   # Gemma 2's final soft-cap


def forward(params: dict, tokens_BT, cfg: ModelConfig, *, positions=None, mask_BTS=None):
    """Logits [B, T, V] in float32 (train_dense.py's `forward`, with `hidden`'s padding)."""
    h = hidden(params, tokens_BT, cfg, positions=positions, mask_BTS=mask_BTS)[0]
    return logits_of(params, h, cfg)


def padded_positions(valid_BS):
    """RoPE positions of a left-padded row: 0 at its first real token (pads get 0, unused)."""
    return jnp.maximum(jnp.cumsum(valid_BS.astype(jnp.int32), axis=1) - 1, 0)


def padded_mask(valid_BS, start, T: int):
    """[B, T, S] mask of queries at columns start..start+T-1: causal, and never onto a pad."""
    q_T = start + jnp.arange(T)
    causal_TS = jnp.arange(valid_BS.shape[1])[None, :] <= q_T[:, None]
    return causal_TS[None] & valid_BS[:, None, :]


# ----------------------------------------------------------------------------------------------
# 4. Advantages, loss and train step
# ----------------------------------------------------------------------------------------------
def group_advantages(rewards_B: np.ndarray, group_size: int, scale: bool) -> np.ndarray:
    """A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4) (Shao et al. 2024, eq. 4 with
    outcome supervision), or r_i - mean(r_group) without the std (Liu et al. 2025,
    "Understanding R1-Zero-Like Training", Dr. GRPO: the std weights easy and hard prompts
    unequally). std is the sample std (ddof 1), as TRL computes it. A group whose rewards are
    all equal gets advantage 0: it carries no signal about which completion was better."""
    r_GG = rewards_B.reshape(-1, group_size).astype(np.float64)
    a = r_GG - r_GG.mean(axis=1, keepdims=True)
    if scale:
        a = a / (r_GG.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    return a.reshape(-1).astype(np.float32)


def policy_loss(logp_BN, old_BN, adv_B, mask_BN, g: GRPOConfig, *, ref_BN=None, n_tokens=None):
    """The clipped surrogate, aggregated as `g.loss` says. Returns (loss, sums) where sums
    holds the masked sums of the per-token diagnostics (exact under gradient accumulation).

    Per token, with ratio r = pi/pi_old and eps_low/eps_high from `clip_range`:
        l_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta * KL_t
    GSPO replaces r by the sequence ratio s_i = exp(mean_t log r_t) (Zheng et al. 2025,
    eq. 7), the geometric mean of the token ratios, for every token of sequence i.
    `n_tokens`: DAPO's normaliser, the completion tokens of the whole update batch."""
    m = mask_BN.astype(jnp.float32)
    len_B = jnp.sum(m, axis=1)
    # Padding is zeroed before any exp(): an inf there would turn into NaN under the mask,
    # in the loss and in its gradient.
    log_r_BN = jnp.where(mask_BN, logp_BN - old_BN, 0.0)
    if g.loss == "gspo":
        log_r_BN = jnp.broadcast_to(
            (jnp.sum(log_r_BN * m, axis=1) / jnp.maximum(len_B, 1.0))[:, None], m.shape)
    ratio = jnp.exp(log_r_BN)
    adv_BN = adv_B[:, None]
    lo, hi = clip_range(g)
    per_token = -jnp.minimum(ratio * adv_BN, jnp.clip(ratio, 1 - lo, 1 + hi) * adv_BN)
    sums = {}
    if g.beta > 0:
        # k3 (Schulman 2020, "Approximating KL divergence"): exp(q) - q - 1 with
        # q = log pi_ref - log pi; unbiased for KL(pi || pi_ref) and never negative.
        q = jnp.where(mask_BN, ref_BN - logp_BN, 0.0)
        kl = jnp.exp(q) - q - 1
        per_token = per_token + g.beta * kl
        sums["kl"] = jnp.sum(kl * m)
    total = jnp.sum(per_token * m)
    if g.loss in ("grpo", "gspo"):
        # GRPO (Shao et al. 2024, eq. 3): 1/G sum_i 1/|o_i| sum_t l_t; a sequence's tokens
        # share its weight equally, so long completions weigh less per token.
        loss = jnp.mean(jnp.sum(per_token * m, axis=1) / jnp.maximum(len_B, 1.0))
    elif g.loss == "bnpo":
        # BNPO: every token of the (micro)batch weighs the same: sum_{i,t} l_t / sum_i |o_i|.
        loss = total / jnp.maximum(jnp.sum(m), 1.0)
    elif g.loss == "dr_grpo":
        # Dr. GRPO (Liu et al. 2025, eq. 3): sum_{i,t} l_t / (B * max_new_tokens), a constant
        # that removes GRPO's bias towards long wrong answers and short right ones.
        loss = total / (m.shape[0] * g.max_new_tokens)
    else:
        # DAPO (Yu et al. 2025, eq. 8, token-level policy gradient): sum_{i,t} l_t over the
        # tokens of the whole rollout batch, whatever microbatch each token is in.
        loss = total / jnp.maximum(n_tokens, 1.0)
    low = (ratio < 1 - lo) & (adv_BN < 0)    # clipped from below: the min chose the clip
    high = (ratio > 1 + hi) & (adv_BN > 0)
    sums |= {"clip_ratio/low_mean": jnp.sum(low * m), "clip_ratio/high_mean": jnp.sum(high * m),
             "clip_ratio/region_mean": jnp.sum((low | high) * m), "tokens": jnp.sum(m)}
    return loss, sums


def train_step(state: dict, batch: dict, *, cfg: Config, n_valid: int):
    """One optimiser step (then QK-clip) on a rollout batch, accumulated over --grpo.microbatches;
    returns the new state and metrics (the diagnostics' means over the completion tokens)."""
    g, tx = cfg.grpo, make_optimizer(cfg.grpo, specs=param_specs(cfg.model))
    M, tau, rows = g.microbatches, g.qk_clip_threshold, dict(batch)
    # DAPO divides by the whole batch's tokens; the mean over M microbatches below divides
    # by M again, so each microbatch is handed n_tokens / M.
    loss = partial(loss_fn, cfg=cfg, n_valid=n_valid, n_tokens=rows.pop("n_tokens") / M,
                   max_logits=tau > 0)
    on = lambda p, b: loss(lora.weights(state, cfg.lora, p), b)  # LoRA: the adapters trained
    grads, sums = train.accumulate(jax.grad(on, has_aux=True), state["params"], rows, M,
                                   BATCH_AXES)
    grads, max_LN = jax.tree.map(lambda x: x / M, grads), sums.pop("max_logit", None)
    n = jnp.maximum(sums.pop("tokens"), 1.0)
    metrics = {k: v / n for k, v in sums.items()}  # the KL among them: checked with the update
    clip = partial(optim.qk_clip, tops={"layers": max_LN}, tau=tau, q=("wq", "bq"),
                   k=("wk", "bk")) if tau else None
    new, checks = train.update(tx, grads, state, *metrics.values(), after=clip)
    metrics |= {"max_attn_logit": jnp.max(max_LN)} if tau else {}
    return new, metrics | checks | {"lr": optim.lr_schedule(
        "constant", g.lr, g.warmup_steps)(state["step"])}


def loss_fn(params, batch: dict, cfg: Config, *, n_valid: int, n_tokens, max_logits=False):
    """A (micro)batch of rollouts' policy loss and its masked sums: policy_loss's, the
    policy's entropy and `hidden`'s stats (the largest attention logits, for QK-clip)."""
    logp_BN, entropy_BN, stats = completion_logps(params, batch, cfg.model, cfg.grpo.temperature,
                                                  n_valid, max_logits=max_logits)
    loss, sums = policy_loss(logp_BN, batch["old_logp"], batch["adv"], batch["mask"], cfg.grpo,
                             ref_BN=batch.get("ref_logp"), n_tokens=n_tokens)
    return loss, sums | stats | {"entropy": jnp.sum(entropy_BN * batch["mask"])}


def sft_step(state: dict, batch: dict, *, cfg: Config, n_valid: int):
    """Warm start: cross-entropy on the answer tokens (and EOS) of correct examples."""
    tx = make_optimizer(cfg.grpo, cfg.warm, param_specs(cfg.model))

    def sft_loss(params):
        logp_BN = completion_logps(params, batch, cfg.model, 1.0, n_valid)[0]
        return -jnp.sum(logp_BN * batch["mask"]) / jnp.sum(batch["mask"])

    loss, grads = jax.value_and_grad(sft_loss)(state["params"])
    new, checks = train.update(tx, grads, state, loss)
    return new, {"loss": loss} | checks


MUON_DIMS = {"wq": ((1,), (2, 3)), "wk": ((1,), (2, 3)), "wv": ((1,), (2, 3)),
             "wo": ((1, 2), (3,)), "w_gate": ((1,), (2,)), "w_up": ((1,), (2,)),
             "w_down": ((1,), (2,)), "ple_gate": ((1,), (2,)), "ple_out": ((1,), (2,)),
             **dict.fromkeys(("wq_gate", "lin_q", "lin_k", "lin_b", "lin_a"), ((1,), (2, 3))),
             "lin_v": ((1,), (2, 3, 4)), "lin_z": ((1,), (2, 3, 4)), "lin_wo": ((1, 2), (3,))}


def make_optimizer(g: GRPOConfig, warm: WarmStartConfig | None = None, specs: dict | None = None):
    """train_dense.py's optimiser (a dense run's state fits it), flat after a linear warmup:
    GRPO's, or with `warm` the warm start's; `specs` (the parameters') split Muon's matrices."""
    lr, warmup = (warm.lr, warm.warmup_steps) if warm else (g.lr, g.warmup_steps)
    return optim.optimizer(g.optimizer, optim.lr_schedule("constant", lr, warmup), b1=g.b1,
                           b2=g.b2, weight_decay=g.weight_decay, clip_norm=g.clip_norm,
                           decayed={"embed", "unembed", "ple_embed", "ple_proj", *MUON_DIMS},
                           muon_dims=MUON_DIMS, muon_dtype=g.muon_dtype, specs=specs)


def flops_per_step(cfg: Config, width: int, new: int = 0) -> tuple[int, float]:
    """(tokens, model FLOPs) of a GRPO step over its rollout's padded rows of `width` prompt
    columns + `new` (default: the budget): mu training passes, one forward for the rollout,
    one for the reference."""
    g, T = cfg.grpo, width + (new or cfg.grpo.max_new_tokens)
    tokens = updates_per_rollout(g) * g.prompts_per_step * g.group_size * T
    return tokens, tokens * flops_per_token(cfg.model, T) * (g.mu + (1 + (g.beta > 0)) / 3)


def updates_per_rollout(g: GRPOConfig) -> int:
    return max(1, g.rollout_batch // (g.prompts_per_step * g.group_size))


def update(step_fn, state: dict, batch: dict, g: GRPOConfig, mesh) -> tuple[dict, list]:
    """`mu` passes over a rollout batch (host arrays) in its updates of prompts-per-step x
    group-size rows, in order: an optimiser step each; the state and each step's metrics."""
    S, U = updates_per_rollout(g), g.prompts_per_step * g.group_size
    parts = [batch] if S == 1 else [  # one update: the rollout's arrays stay where they are
        train.put({k: v[i * len(v) // S:(i + 1) * len(v) // S] for k, v in batch.items()
                   if k != "n_tokens"}
                  | {"n_tokens": np.float32(batch["mask"][i * U:(i + 1) * U].sum())},
                  mesh, BATCH_AXES) for i in range(S)]
    passes = []
    for part in parts * g.mu:  # each pass over the updates in order
        state, m = step_fn(state, part)
        passes.append(m)
    return state, passes


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, 3x the forward (PaLM, appendix B): 2 per matmul weight (not the
    embedding lookup) and 2 * 2 * T * N * H per layer for q.k and p.v over the whole sequence
    (the causal half is not subtracted: XLA computes it), min(T, W) keys on windowed layers.
    Remat's recomputation is not counted: MFU measures useful work."""
    D, N, H, L = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.n_layers
    matmul_weights = D * cfg.vocab_size + L * cfg.ple_dim * D + sum(  # Gemma 4's projection
        math.prod(e[0]) for k, stack in _param_table(cfg).items() if k.endswith("layers")
        for name, e in stack.items() if name in MUON_DIMS)   # the layers' matrices
    W, n = cfg.sliding_window, cfg.global_every
    n_global = (L // n if n else 0) if W else L
    keys = n_global * seq_len * (cfg.global_head_dim or H) + (L - n_global) * min(
        seq_len, W or seq_len) * H   # times the head width of their layers
    if cfg.linear_k_heads:  # Qwen3.5: n - 1 of n layers DeltaNet (no keys attended): per token
        # its chunk's C keys (q.k, k.k, the solve's rows) and three state products
        Ll, C = L - L // n, min(cfg.linear_chunk, seq_len)
        keys -= Ll * seq_len * H
        matmul_weights += Ll * cfg.linear_v_heads * (C * 2 * (cfg.linear_k_dim + cfg.linear_v_dim)
                                                     + 3 * cfg.linear_k_dim * cfg.linear_v_dim)
    attn = 2 * 2 * keys * N
    return 3.0 * (2 * matmul_weights + attn)


def validate(cfg: Config, n_devices: int, tok) -> Task:
    """Every check that needs no compilation, so a bad launch fails in a second; the task."""
    m, g, w, t = cfg.model, cfg.grpo, cfg.warm, cfg.task
    check_ranges(cfg)
    mesh = resolve(cfg.mesh, n_devices, max(1, math.prod(cfg.mesh.dcn())))
    check_model(m, mesh, "--grpo.qk-clip-threshold", g.qk_clip_threshold)
    need(m.quant == "none", f"--model.quant {m.quant}: quantized training is train_dense.py's "
         "and train_moe.py's; the policy here trains in --model.dtype. Use --model.quant none.")
    lora.check_lora(cfg.lora, g.optimizer, g.qk_clip_threshold, "--grpo")  # LoRA
    need(m.remat != "auto", "--model.remat auto: train_dense.py and train_moe.py pick it; here "
         "name a policy (full, qkv, attn, proj, offload, dots or none).")
    need(mesh.stage * mesh.dcn_stage == 1, f"--mesh.stage {mesh.stage}: pipeline stages are "
         "train_dense.py's and train_moe.py's; here the devices would repeat one another's "
         "work. Keep it 1 and spread the policy over --mesh.fsdp.")
    need(mesh.context * mesh.dcn_context == 1, f"--mesh.context {mesh.context}: rollouts decode "
         "token by token, which a split sequence cannot; keep it 1 (train_dense.py and "
         "train_moe.py train long sequences over it).")
    train.check_vocab(tok.vocab_size, m.vocab_size)
    need(g.group_size >= 2, f"--grpo.group-size {g.group_size}: advantages compare the "
         "completions of one prompt with each other, so a group needs at least 2.")
    shards, rows = train.batch_shards(mesh), g.prompts_per_step * g.group_size
    train.check_batch(rows, g.microbatches, mesh, flag="--grpo", what=(
        f"--grpo.prompts-per-step {g.prompts_per_step} x --grpo.group-size {g.group_size}"))
    need(g.rollout_batch % rows == 0, f"--grpo.rollout-batch {g.rollout_batch} is not a "
         f"multiple of the update batch (--grpo.prompts-per-step x --grpo.group-size = {rows}): "
         f"the rollout splits into whole updates; use {rows * max(1, g.rollout_batch // rows)}.")
    for flag, v in [("--task.eval-prompts", t.eval_prompts), ("--warm.batch-size", w.batch_size)]:
        need(v % shards == 0, f"{flag} {v} is not divisible by the {shards} batch shards "
             f"(data x fsdp); use a multiple of {shards}.")
    need(t.path or 1 <= t.min_digits <= t.max_digits, f"--task.min-digits {t.min_digits} / "
         f"--task.max-digits {t.max_digits}: need 1 <= min <= max.")
    task = make_task(cfg, tok)  # a bad prompts or rewards file stops here
    need(w.max_steps <= 0 or task.answer_tokens, f"--warm.max-steps {w.max_steps}: the warm "
         f"start fine-tunes on each prompt's 'answer', and --task.path {t.path} has none; pass "
         "--warm.max-steps 0 (a pretrained policy needs no warm start).")
    n = task.answer_tokens  # the longest answer + EOS: the warm start's target
    need(w.max_steps <= 0 and t.path or g.max_new_tokens >= n, f"--grpo.max-new-tokens "
         f"{g.max_new_tokens} cannot hold the longest answer and its end-of-sequence token "
         f"({n} tokens); raise it.")
    need(task.width + g.max_new_tokens <= m.max_seq_len, f"prompt ({task.width}) + "
         f"--grpo.max-new-tokens ({g.max_new_tokens}) exceed --model.max-seq-len {m.max_seq_len}.")
    train.check_profile(g.profile_steps, g.steps, "--grpo")
    need(g.decode != "refill" or refills(m), f"--grpo.decode refill: rows at their own columns "
         "need every layer to attend over a cache of its own, without a window (not Gemma's "
         "windows or shared layers, nor DeltaNet); use --grpo.decode halving.")
    return task


def refills(m: ModelConfig) -> bool:  # `refill_rollout` applies to this model
    return not (m.sliding_window or m.global_head_dim or m.linear_k_heads or m.kv_shared)


def check_model(m: ModelConfig, mesh, clip_flag: str, tau: float) -> None:
    """The model's shape against the mesh, its knobs together, QK-clip (`tau`) on it."""
    need(mesh.expert * mesh.dcn_expert == 1, f"--mesh.expert {mesh.expert}: the dense model has "
         "no experts; keep it 1 (use train_moe.py for expert parallelism).")
    train.check_sizes(mesh, {"tensor": [
        ("--model.n-heads", m.n_heads), ("--model.n-kv-heads", m.n_kv_heads),
        ("--model.d-ff", m.d_ff), ("--model.vocab-size", m.vocab_size),
        ("--model.global-kv-heads", m.global_kv_heads or m.n_kv_heads),
        ("--model.linear-k-heads", m.linear_k_heads)],
        "fsdp": [("--model.d-model", m.d_model)]})
    ways = train.batch_shards(mesh, ("tensor", "fsdp", "context"))
    need(not m.vocab_split or m.vocab_size % ways == 0, f"--model.vocab-split: --model.vocab-size "
         f"{m.vocab_size} is not divisible by tensor x fsdp x context = {ways}; use "
         "--model.no-vocab-split, or other mesh sizes.")
    need(m.n_heads % m.n_kv_heads == 0, f"--model.n-heads {m.n_heads} is not a multiple of "
         f"--model.n-kv-heads {m.n_kv_heads} (each key/value head serves a whole group).")
    need(m.head_dim % 2 == 0, f"--model.head-dim {m.head_dim} must be even (RoPE rotates pairs).")
    need(m.sliding_window or m.linear_k_heads or not m.global_every, f"--model.global-every "
         f"{m.global_every} without --model.sliding-window or --model.linear-k-heads: the layers "
         "between the global ones are the windowed (or DeltaNet) ones. Give one, or "
         "--model.global-every 0.")
    need(not (m.post_norm and m.sandwich_norm), "--model.post-norm with --model.sandwich-norm: "
         "OLMo's norms after attention and MLP replace those before, Gemma's sandwich keeps "
         "both. Choose one.")
    need(m.qk_norm or not m.qk_norm_whole, "--model.qk-norm-whole without --model.qk-norm: it "
         "says how the q/k norms span the heads. Add --model.qk-norm, or drop it.")
    need(not (m.yarn_factor and (m.rope_scaling or m.rope_linear)), "--model.yarn-factor with "
         "--model.rope-scaling or --model.rope-linear: RoPE is stretched one way. Keep one.")
    need(not (m.layer_norm and (m.post_norm or m.sandwich_norm or m.qk_norm)), "--model.layer-norm "
         "with post, sandwich or q/k norms: GPT-2's LayerNorms are the pre-norms. Drop those.")
    n, G, S = m.global_every, m.global_head_dim, m.kv_shared
    need(not G or m.sliding_window and n > 1 and m.n_layers % n == 0 and G % 2 == 0, f"--model."
         f"global-head-dim {G}: the global layers, a stack of their own, run in periods of "
         f"--model.global-every {n} layers with --model.sliding-window; give both, the period "
         f"dividing --model.n-layers {m.n_layers}, and an even width.")
    need(G or not (m.global_kv_heads or m.k_eq_v or S), "--model.global-kv-heads, --model.k-eq-v "
         "and --model.kv-shared shape Gemma 4's global stack: give --model.global-head-dim.")
    need(m.n_heads % (m.global_kv_heads or m.n_kv_heads) == 0, f"--model.global-kv-heads "
         f"{m.global_kv_heads} does not divide --model.n-heads {m.n_heads}.")
    need(S % max(n, 1) == 0 and S <= m.n_layers - n and (S or not m.wide_shared_mlp),
         f"--model.kv-shared {S}: whole periods of --model.global-every {n} layers, leaving one "
         "that makes keys and values (and --model.wide-shared-mlp only with shared layers).")
    Hk, flag = m.linear_k_heads, f"--model.linear-k-heads {m.linear_k_heads}"
    need(not Hk or n > 1 and m.n_layers % n == 0 and m.linear_v_heads % Hk == 0 and not (
        m.sliding_window or G or m.ple_dim), f"{flag} (Gated DeltaNet) runs in periods of "
         f"--model.global-every {n} layers (n - 1 DeltaNet, then full attention) dividing "
         f"--model.n-layers {m.n_layers}, each key head serving a whole group of --model.linear-"
         f"v-heads {m.linear_v_heads}, without Gemma's windows, global stacks or per-layer inputs.")
    off = [f"{f} {v}" for f, v in (("--mesh.context", mesh.context * mesh.dcn_context), (
        "--mesh.stage", mesh.stage * mesh.dcn_stage), (clip_flag, tau)) if v and v != 1]
    need(not (Hk and off), f"{flag} with {', '.join(off)}: the delta rule's state runs through "
         "the whole sequence (not split across devices or pipeline stages yet) and has no logits "
         f"to clip; set --mesh.context 1, --mesh.stage 1 and {clip_flag} 0.")
    need(Hk or not m.linear_v_heads, f"--model.linear-v-heads {m.linear_v_heads} without "
         "--model.linear-k-heads: give both (Gated DeltaNet) or neither.")
    need(m.rotary_dim % 2 == 0 and m.rotary_dim <= m.head_dim and not (m.rotary_dim and (
        G or m.rope_partial)), f"--model.rotary-dim {m.rotary_dim}: an even number of dims at "
         f"most --model.head-dim {m.head_dim} (RoPE turns pairs), not with Gemma 4's RoPE.")
    optim.check_qk_clip(clip_flag, tau, m.qk_norm)
    need(not (tau and G), f"{clip_flag} {tau} with --model.global-head-dim: Gemma 4's periods "
         f"record no logits to clip. Set {clip_flag} 0.")
    need(not (tau and (m.attn_softcap or m.query_scale)), f"{clip_flag} {tau} with Gemma's "
         "attention (--model.attn-softcap, --model.query-scale): the soft-cap already bounds "
         f"the logits. Set {clip_flag} 0.")


# ----------------------------------------------------------------------------------------------
# 5. Rollouts: prefill, then decode with the KV cache until EOS or the token budget
# ----------------------------------------------------------------------------------------------
def policy_logits(logits_BV, temperature, n_valid: int):
    """The sampling policy's logits: ids past the tokenizer's vocabulary (the model's may be
    padded) are impossible, and the temperature divides. The loss scores tokens under this
    same distribution, so rollout-time and training-time log-probs are comparable."""
    z = logits_BV / temperature
    return jnp.where(jnp.arange(z.shape[-1]) < n_valid, z, sampling.MASKED)


def init_cache(cfg: ModelConfig, B: int, S: int) -> dict:
    """Keys and values [L, B, K, S, H] of the layers that make their own (heads first: see
    common/attention.py `cached`); Gemma 4's and Qwen3.5's global layers, a stack of their own,
    as "global_k" and "global_v". Qwen3.5's DeltaNet layers keep their state instead
    (`gated_deltanet`): q, k and v's last C - 1 inputs to the convolution and the delta rule's
    S [Hv, Dk, Dv]."""
    zeros = lambda w, *shape, dt=jnp.dtype(cfg.dtype): constrain(jnp.zeros(shape, dt),
                                                                 CACHE_SPECS[w])
    L, K, H = cfg.n_layers - cfg.kv_shared, cfg.n_kv_heads, cfg.head_dim
    G = L // cfg.global_every if cfg.global_head_dim or cfg.linear_k_heads else 0
    cache = {"global_" + w: zeros(w, G, B, cfg.global_kv_heads or K, S, cfg.global_head_dim or H)
             for w in "kv" if G}
    if not cfg.linear_k_heads:
        return cache | {w: zeros(w, L - G, B, K, S, H) for w in "kv"}
    Hk, Dk, Dv, C = cfg.linear_k_heads, cfg.linear_k_dim, cfg.linear_v_dim, cfg.linear_conv - 1
    r = cfg.linear_v_heads // Hk
    return cache | {"conv_q": zeros("conv_q", L - G, B, C, Hk, Dk),
                    "conv_k": zeros("conv_k", L - G, B, C, Hk, Dk),
                    "conv_v": zeros("conv_v", L - G, B, C, Hk, r, Dv),
                    "delta": zeros("delta", L - G, B, Hk * r, Dk, Dv, dt=jnp.float32)}


def cache_parts(cfg: ModelConfig, prefix: str) -> tuple[str, ...]:
    """The names of one stack's cache entries (after its prefix), in the block's order."""
    return ("conv_q", "conv_k", "conv_v", "delta") if cfg.linear_k_heads and not prefix else (
        "k", "v")


def forward_cached(params: dict, tokens_BT, cfg: ModelConfig, *, cache: dict, index, positions,
                   mask_BTS):
    """Logits [B, 1, V] after T new tokens at columns index..index+T-1 of a preallocated KV
    cache, and the cache with their keys and values written in (prefill: the prompt at 0;
    decoding: T = 1). Only the last position is unembedded: a prefill's [B, T, V] logits
    (15 GiB for 128 prompts of 200 tokens over Qwen3's 152k vocabulary) are never made."""
    h_BTD, cache, _ = hidden(params, tokens_BT, cfg, positions=positions, mask_BTS=mask_BTS,
                             cache=cache, index=index)
    return logits_of(params, h_BTD[:, -1:], cfg), cache


def rollout(params, prompt_BP, valid_BP, key, temperature, *, cfg: ModelConfig, max_new: int,
            eos_id: int, pad_id: int, n_valid: int, top_k: int = 0, top_p: float = 1.0,
            min_rows: int = 0):
    """Complete every row of a left-padded prompt batch, whole on the device: completion ids
    [B, N] (pad after EOS), their mask (True up to and including EOS), the log-probs of the
    drawn tokens under the temperature-scaled policy (the importance ratio's "old" policy;
    top-k/top-p truncation is a sampling device, not part of the policy, as in TRL) and the
    decode steps run. `temperature` is traced: greedy eval and rollouts share one compile.
    With `min_rows` (a multiple of the batch shards), whenever half the rows are done the live
    ones are gathered, KV cache and all, into a batch half as large, down to min_rows: a long
    tail of a few rows stops costing the whole batch's matmuls and cache reads (each halving
    is one more decode loop compiled). Every row draws with its own noise: the same tokens."""
    B, Pw = prompt_BP.shape
    params = decode_params(params, cfg)
    valid_BS = jnp.concatenate([valid_BP, jnp.ones((B, max_new), bool)], axis=1)
    pos_BS, safe_t = padded_positions(valid_BS), jnp.where(temperature > 0, temperature, 1.0)
    step = lambda tokens_BT, cache, col, T, rows: forward_cached(  # T tokens at columns col..
        params, tokens_BT, cfg, cache=cache, index=col, mask_BTS=padded_mask(
            valid_BS[rows], col, T), positions=jax.lax.dynamic_slice_in_dim(
            pos_BS[rows], col, T, axis=1))
    logits_B1V, cache = step(prompt_BP, init_cache(cfg, B, Pw + max_new), 0, Pw, slice(None))

    def body(c):
        i, rows = c["i"], c["rows"]  # rows: the batch's rows that this one's are
        key, sub = jax.random.split(c["key"])
        z_BV = policy_logits(c["logits_BV"], safe_t, n_valid)
        tok_B = sampling.draw(sub, z_BV, temperature, top_k, top_p, rows, B)
        logp_B = jnp.take_along_axis(jax.nn.log_softmax(z_BV, axis=-1), tok_B[:, None], -1)[:, 0]
        live_B = ~c["done_B"]
        tok_B = jnp.where(live_B, tok_B, pad_id)
        logits_B1V, cache = step(tok_B[:, None], c["cache"], Pw + i, 1, rows)
        return c | {"i": i + 1, "key": key, "cache": cache, "logits_BV": logits_B1V[:, 0],
                    "done_B": c["done_B"] | (tok_B == eos_id),
                    "tokens_BN": c["tokens_BN"].at[rows, i].set(tok_B),
                    "mask_BN": c["mask_BN"].at[rows, i].set(live_B),
                    "logp_BN": c["logp_BN"].at[rows, i].set(jnp.where(live_B, logp_B, 0.0))}

    c = {"i": jnp.zeros((), jnp.int32), "key": key, "cache": cache, "rows": jnp.arange(B),
         "logits_BV": logits_B1V[:, 0], "done_B": jnp.zeros((B,), bool),
         "tokens_BN": jnp.full((B, max_new), pad_id, jnp.int32),
         "mask_BN": jnp.zeros((B, max_new), bool),
         "logp_BN": jnp.zeros((B, max_new), jnp.float32)}
    b = B
    while True:
        half = b // 2 if min_rows and b // 2 >= min_rows and b // 2 % min_rows == 0 else 0
        c = jax.lax.while_loop(lambda c: (c["i"] < max_new) & ~jnp.all(c["done_B"]) & (
            jnp.sum(~c["done_B"]) > half), body, c)
        if not half:
            break
        keep = jnp.argsort(c["done_B"], stable=True)[:half]  # every live row, done ones after
        c |= {k: c[k][keep] for k in ("rows", "logits_BV", "done_B")} | {"cache": {
            n: constrain(x[:, keep], CACHE_SPECS[n.removeprefix("global_")])
            for n, x in c["cache"].items()}}
        b = half
    return {k: c[k] for k in ("tokens_BN", "mask_BN", "logp_BN")} | {"steps": c["i"]}


MATMULS = {*MUON_DIMS, "embed", "unembed", "ple_embed", "ple_proj", "bq", "bk", "bv"}


def decode_params(params: dict, cfg: ModelConfig) -> dict:
    """The policy as a rollout reads it, made once: LoRA's adapters merged, the matrices in the
    compute dtype (norm gains stay float32, as the training forward reads them). Cast inside
    the decode loop instead, every step would read the float32 masters: twice the bytes."""
    def one(path, x):
        x = x.merged() if isinstance(x, lora.Adapted) else x
        return x.astype(cfg.dtype) if path[-1].key in MATMULS else x
    return jax.tree_util.tree_map_with_path(one, params, is_leaf=lambda x: isinstance(
        x, lora.Adapted))


def refill_rollout(params, prompt_QP, len_Q, key, temperature, *, cfg: ModelConfig, rows: int,
                   max_new: int, eos_id: int, pad_id: int, n_valid: int, top_k: int = 0,
                   top_p: float = 1.0, segment: int = 128, ids_Q=None):
    """`rollout` for Q right-padded prompts (their lengths len_Q) on `rows` decode rows: a row
    whose completion ends takes the next waiting prompt, fed one token a step from column 0 of
    its cache row while the other rows decode (each row writes its own column). Every prompt
    draws with noise of its own, fold_in(key, ids_Q[q]) then its token index, so its completion
    is the one it gets decoded alone. A step attends over the cache's first W columns only,
    W growing in `segment`s as the longest row does (a decode loop compiled per segment):
    the keys and values read are about the live ones, not the whole budget's."""
    Q, Pw = prompt_QP.shape
    B, S = rows, Pw + max_new
    params, ids_Q = decode_params(params, cfg), jnp.arange(Q) if ids_Q is None else ids_Q
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    col_P = jnp.arange(Pw)
    mask_BPP = (col_P[:, None] >= col_P) & (col_P < len_Q[:B, None])[:, None, :]
    h_BPD, cache, _ = hidden(params, prompt_QP[:B], cfg, positions=jnp.broadcast_to(col_P, (
        B, Pw)), mask_BTS=mask_BPP, cache=init_cache(cfg, B, S), index=0)
    last_BD = jnp.take_along_axis(h_BPD, len_Q[:B, None, None] - 1, axis=1)

    def body(c, W):
        n, q = c["n_B"], c["q_B"]  # n: the tokens of row's prompt q in its cache
        qs = jnp.minimum(q, Q - 1)
        j, gen = n - len_Q[qs], (q < Q) & (n >= len_Q[qs])  # j: the completion token due
        keys = jax.vmap(lambda i, j: jax.random.fold_in(jax.random.fold_in(key, i), j))(
            ids_Q[qs], j)
        z_BV = policy_logits(c["logits_BV"], safe_t, n_valid)
        tok_B = jax.vmap(lambda k, z: sampling.draw(k, z[None], temperature, top_k, top_p)[0])(
            keys, z_BV)
        logp_B = jnp.take_along_axis(jax.nn.log_softmax(z_BV, axis=-1), tok_B[:, None], -1)[:, 0]
        at = (jnp.where(gen, q, Q), j)  # rows not sampling write nowhere (dropped)
        done = gen & ((tok_B == eos_id) | (j + 1 >= max_new))
        q = jnp.where(done, c["next"] + jnp.cumsum(done) - 1, q)  # the next waiting prompts
        n, qs = jnp.where(done, 0, n), jnp.minimum(q, Q - 1)
        feed_B = jnp.where(q >= Q, pad_id, jnp.where(n < len_Q[qs], prompt_QP[qs, jnp.minimum(
            n, Pw - 1)], tok_B))
        h_B1D, cache, _ = hidden(params, feed_B[:, None], cfg, positions=n[:, None],
                                 mask_BTS=(jnp.arange(W) <= n[:, None])[:, None],
                                 cache=c["cache"], index=n)
        return c | {"i": c["i"] + 1, "cache": cache, "logits_BV": logits_of(params, h_B1D, cfg
                                                                             )[:, 0],
                    "n_B": jnp.where(q < Q, n + 1, 0), "q_B": q, "next": c["next"] + done.sum(),
                    "tokens_QN": c["tokens_QN"].at[at].set(tok_B, mode="drop"),
                    "mask_QN": c["mask_QN"].at[at].set(True, mode="drop"),
                    "logp_QN": c["logp_QN"].at[at].set(logp_B, mode="drop")}

    c = {"i": jnp.zeros((), jnp.int32), "cache": cache, "n_B": len_Q[:B], "q_B": jnp.arange(B),
         "next": jnp.int32(B), "logits_BV": logits_of(params, last_BD, cfg)[:, 0],
         "tokens_QN": jnp.full((Q, max_new), pad_id, jnp.int32),
         "mask_QN": jnp.zeros((Q, max_new), bool), "logp_QN": jnp.zeros((Q, max_new), jnp.float32)}
    for W in range(Pw + segment, S + segment, segment):  # columns 0..W-1 read, W <= S
        W = min(W, S)
        c = jax.lax.while_loop(lambda c: jnp.any(c["q_B"] < Q) & (jnp.max(c["n_B"]) < W),
                               partial(body, W=W), c)
    return {k: c[k] for k in ("tokens_QN", "mask_QN", "logp_QN")} | {"steps": c["i"]}


def sampler(cfg: Config, mesh, tok, task: Task):
    """`generate(params, rows, key, temperature)`: one completion of each prompt, sampled on the
    device (rollouts and greedy evals share one compile), decoded and scored on the host."""
    g = cfg.grpo
    shards = train.batch_shards(mesh)  # halving down to 8 rows or so
    same = dict(cfg=cfg.model, max_new=g.max_new_tokens, eos_id=tok.eos_id, pad_id=tok.pad_id,
                n_valid=tok.vocab_size, top_k=g.top_k, top_p=g.top_p)
    refill = g.decode == "refill" or g.decode == "auto" and refills(cfg.model) and (
        mesh.size == 1 and mesh.devices.flat[0].platform != "cpu")
    rollout_fn = jax.jit(partial(rollout, **same, min_rows=-(-8 // shards) * shards))
    refill_fn = jax.jit(partial(refill_rollout, **same, segment=g.decode_segment),
                        static_argnames="rows")

    def generate(params, items: list[Row], key, temperature: float) -> dict:
        ids, valid = left_pad([r.ids for r in items], task.width, tok.pad_id)
        t0 = time.perf_counter()
        batch = train.put({"prompt": ids, "prompt_valid": valid}, mesh, BATCH_AXES)
        if refill:  # the prompts right-padded: each row's tokens from column 0
            right = np.stack([np.roll(r, -(~v).sum()) for r, v in zip(ids, valid)])
            out = refill_fn(params, right, valid.sum(1).astype(np.int32), key,
                            jnp.float32(temperature), rows=min(g.decode_rows or len(ids), len(ids)))
            out = train.put({k.replace("_Q", "_B"): fetch(v) for k, v in out.items()}, mesh,
                            BATCH_AXES)  # split over the batch shards as the update's batch
        else:
            out = rollout_fn(params, batch["prompt"], batch["prompt_valid"], key,
                             jnp.float32(temperature))
        tokens, mask = fetch(out["tokens_BN"]), fetch(out["mask_BN"])
        seconds = time.perf_counter() - t0
        texts, finished = decode_completions(tok, tokens, mask)
        total, each = score(task.rewards, texts, columns(items), finished)
        batch |= {"completion": out["tokens_BN"], "mask": out["mask_BN"],
                  "old_logp": out["logp_BN"]}
        return {"batch": batch, "texts": texts, "mask": mask, "finished": finished,
                "host": (ids, valid, tokens),
                "reward": total, "rewards": each, "seconds": seconds,
                "score_seconds": time.perf_counter() - t0 - seconds}
    return generate


def completion_logps(params, b: dict, cfg: ModelConfig, temperature: float, n_valid: int,
                     max_logits: bool = False):
    """Log-probs [B, N] of the completion tokens, the policy's entropy at each and `hidden`'s
    stats, from one forward over prompt + completion: left-padded rows (b's prompt,
    prompt_valid, completion) or the packed rows of common/task.py `pack` (b's tokens,
    positions, segment, where). Only the N completion positions are unembedded: the [B, T, V]
    logits of the prompt are never made."""
    if "tokens" in b:  # packed: causal within each sequence, pads (segment 0) never read
        seg_BT, T = b["segment"], b["tokens"].shape[1]
        mask_BTS = ((seg_BT[:, :, None] == seg_BT[:, None, :]) & (seg_BT[:, None, :] > 0)
                    & (jnp.arange(T)[:, None] >= jnp.arange(T)))
        h_BTD, _, stats = hidden(params, b["tokens"], cfg, positions=b["positions"],
                                 mask_BTS=mask_BTS, max_logits=max_logits)
        h_BND, completion_BN = h_BTD.reshape(-1, h_BTD.shape[-1])[b["where"]], b["completion"]
    else:
        Pw, completion_BN = b["prompt"].shape[1], b["completion"]
        tokens_BT = jnp.concatenate([b["prompt"], completion_BN], axis=1)[:, :-1]
        valid_BT = jnp.concatenate([b["prompt_valid"], jnp.ones_like(completion_BN, bool)],
                                   axis=1)[:, :-1]
        h_BTD, _, stats = hidden(params, tokens_BT, cfg, positions=padded_positions(valid_BT),
                                 mask_BTS=padded_mask(valid_BT, 0, tokens_BT.shape[1]),
                                 max_logits=max_logits)
        h_BND = h_BTD[:, Pw - 1:]
    z_BNV = policy_logits(logits_of(params, h_BND, cfg), temperature, n_valid)
    logp_BNV = jax.nn.log_softmax(z_BNV, axis=-1)
    logp_BN = jnp.take_along_axis(logp_BNV, completion_BN[..., None], axis=-1)[..., 0]
    entropy_BN = -jnp.sum(jnp.exp(logp_BNV) * logp_BNV, axis=-1)
    return logp_BN, entropy_BN, stats


# ----------------------------------------------------------------------------------------------
# 6. Task and rewards (the demo's problems and character tokenizer are in common/)
# ----------------------------------------------------------------------------------------------
def make_task(cfg: Config, tok) -> Task:
    """--task.path's prompts and --task.rewards (common/task.py), or the addition demo."""
    t, g = cfg.task, cfg.grpo
    if t.path:  # a HuggingFace folder's chat template renders them, as its model saw chat
        template = ChatTemplate.find(cfg.init_from_hf) if cfg.init_from_hf else None
        return load_task(t, tok, template, g.seed)
    mine = [f for f in ("eval_path", "rewards", "reward_weights", "format_regex") if getattr(t, f)]
    if mine:
        raise ConfigError(f"--task.{mine[0].replace('_', '-')} goes with --task.path (your "
                          "prompts); the addition demo has its own rewards.")
    # common/task.py's built-ins, logged as rewards/<name>: exactly the reversed sum (spaces
    # aside); digits only and stopped by itself (EOS within the budget).
    rewards = {"correctness": (exact, 1.0), "format": (format_reward("[0-9]+"), g.format_weight)}
    top = 10 ** t.max_digits - 1  # the longest answers: 99+99 and 99+1, reversed

    def rows(rng, n):  # the built-in `exact` reads each row's `answer`
        return [Row(tok.prompt(p), {"answer": a}, p, a) for p, a in problems(rng, n, t)]
    return Task(rows_at=lambda step, n, salt: rows(np.random.default_rng([g.seed, salt, step]), n),
                eval_rows=rows(np.random.default_rng([t.eval_seed]), t.eval_prompts),
                rewards=rewards, width=prompt_width(t),
                answer_tokens=max(len(tok.encode(str(top + b)[::-1])) for b in (top, 1)) + 1,
                show=lambda r, c: f"  {r.text}{c:<6} (expected {r.answer})")


# ----------------------------------------------------------------------------------------------
# 7. Main and the training loop
# ----------------------------------------------------------------------------------------------
def main(cfg: Config) -> dict:
    train.start(cfg.quiet)
    hf_config, model = hf.model_source(cfg)  # --init-from-hf's config, --init-from's model
    cfg = train.with_model(cfg, config_from_hf(*hf_config) if hf_config else model)
    g, tok = cfg.grpo, make_tokenizer(cfg)
    task = validate(cfg, jax.device_count(), tok)
    mesh = make_mesh(cfg.mesh)
    st = train_state(cfg, mesh, make_optimizer(g, specs=param_specs(cfg.model)), ref=g.beta > 0)
    step_fn = st.jit(partial(train_step, cfg=cfg, n_valid=tok.vocab_size))
    lo, hi = clip_range(g)
    log(f"model {count_params(cfg.model) / 1e6:.2f}M parameters | mesh {describe(mesh)} | "
        f"{jax.device_count()} {jax.devices()[0].platform} devices | loss {g.loss} (clip "
        f"{1 - lo:g}..{1 + hi:g}, beta {g.beta:g}, mu {g.mu} x {updates_per_rollout(g)} updates "
        f"per rollout, {'std-scaled' if g.scale_rewards else 'mean-centred'} advantages)")
    batch = synthetic_batch(cfg, tok, task.width)  # --dry-run and --bench: one policy update on it
    if cfg.dry_run:
        return train.dry_run(step_fn, st.abstract(), train.put(batch, mesh, BATCH_AXES, True),
                             mesh, count_params(cfg.model))
    with jax.set_mesh(mesh):
        if cfg.bench:
            T = task.width + g.max_new_tokens
            return train.bench(step_fn, st.fresh(jax.random.key(g.seed)), train.put(
                batch, mesh, BATCH_AXES), cfg.bench, tokens_per_step=len(batch["prompt"]) * T,
                flops_per_token=flops_per_token(cfg.model, T),
                peak=train.peak_flops_per_device(g.peak_tflops))
        with train.Run(cfg, g.profile_steps, defaults=Config()) as run:
            return train_loop(cfg, mesh, tok, task, st, step_fn, run)


def train_loop(cfg: Config, mesh, tok, task: Task, st: train.TrainState, step_fn,
               run: train.Run) -> dict:
    g, generate, held_out = cfg.grpo, sampler(cfg, mesh, tok, task), {}
    prompts = g.prompts_per_step * updates_per_rollout(g)  # a rollout's, each G times
    # The old and the reference log-probs, where both are needed, in one program.
    logp_fn = jax.jit(lambda ps, b: [completion_logps(p, b, cfg.model, g.temperature,
                                                      tok.vocab_size)[0] for p in ps])
    merge = jax.jit(lambda s: lora.merged(lora.weights(s, cfg.lora)))  # LoRA: once a rollout
    policy = lambda s: merge(s) if "base" in s else s["params"]

    def evaluate(params) -> dict:
        """Greedy completions of the fixed held-out prompts."""
        r = generate(params, task.eval_rows, jax.random.key(0), 0.0)
        held_out["texts"] = r["texts"]
        return {"eval_reward": float(r["reward"].mean())} | {
            f"eval_rewards/{n}/mean": float(v.mean()) for n, v in r["rewards"].items()}

    (state, start), warm = run.resume(st.abstract()), {}
    if state is None:  # a new run: from --init-from-hf, --init-from, or random weights
        params = (load_hf(cfg.init_from_hf, mesh)[1] if cfg.init_from_hf else
                  train.restore_params(cfg.init_from, st.abstract()[st.model]) if cfg.init_from
                  else init_params(cfg.model, jax.random.key(g.seed), mesh))
        if cfg.warm.max_steps > 0:
            params, warm = warm_start(cfg, mesh, tok, params, generate, task, run)
        state = st.from_params(params)
        run.ckpt.save(0, state, force=True)  # a resume never repeats the warm start
    tokens, flops = flops_per_step(cfg, task.width)
    loop = train.Loop(run, start, g.steps, log_every=1, eval_every=g.eval_every,
                      tokens_per_step=tokens, flops_per_token=flops / tokens, show=None,
                      flag="--grpo", max_bad_steps=g.max_bad_steps, peak_tflops=g.peak_tflops)
    ev = loop.eval(evaluate(policy(state)))
    log(f"eval step {start} | held-out reward {ev['eval_reward']:.3f} (greedy, "
        f"{len(task.eval_rows)} prompts)")
    rollout_tokens, rollout_s, phases = 0, 0.0, []
    shards = train.batch_shards(mesh)

    for step in loop:
        t0 = time.perf_counter()
        items = [p for p in task.rows_at(step, prompts, 0) for _ in range(g.group_size)]
        r = generate(p := policy(state), items, jax.random.fold_in(jax.random.key(g.seed), step),
                     g.temperature)
        lengths, t1 = r["mask"].sum(axis=1), time.perf_counter()
        rollout_tokens, rollout_s = rollout_tokens + int(lengths.sum()), rollout_s + r["seconds"]
        # The log-probs and the update over the longest completion's columns, rounded up to a
        # power of two (a few programs, not one per length): the columns after it are masked
        # out of every loss, and causal attention never reads them (as TRL pads to the longest).
        N = min(g.max_new_tokens, max(8, 1 << (int(lengths.max()) - 1).bit_length()))
        batch = r["batch"] | {k: r["batch"][k][:, :N] for k in ("completion", "mask", "old_logp")}
        batch |= train.put({"adv": group_advantages(r["reward"], g.group_size, g.scale_rewards),
                            "n_tokens": np.float32(lengths.sum())}, mesh, BATCH_AXES)
        scored = batch  # what logp_fn reads: the padded rows, or all the packed ones
        if g.pack and not cfg.model.linear_k_heads:  # (DeltaNet's state would cross rows)
            ids, valid, tokens = r["host"]
            rows = pack(ids, valid, tokens[:, :N], lengths, parts=updates_per_rollout(g),
                        microbatches=g.microbatches, multiple=shards)
            batch = {k: v for k, v in batch.items() if k not in ("prompt", "prompt_valid")}
            batch |= train.put(rows, mesh, BATCH_AXES)
            scored = batch | {"where": batch.pop("where_all")}
        # The old log-probs where the decode's (bfloat16) differ from the training forward's,
        # and the reference's: one program.
        by = {"old_logp": p} if cfg.model.dtype != "float32" else {}
        by |= {"ref_logp": state.get("ref", state.get("base"))} if g.beta > 0 else {}
        if by:
            batch |= dict(zip(by, logp_fn(tuple(by.values()), scored)))
        # Split on the host (each update's rows sharded anew), or waited for: the phases' times.
        batch = (jax.device_get if updates_per_rollout(g) > 1 else jax.block_until_ready)(batch)
        t2 = time.perf_counter()
        state, passes = update(step_fn, state, batch, g, mesh)
        # Fetched at once: the next rollout needs these parameters anyway, so there is
        # nothing for the host to overlap with.
        passes = jax.device_get(passes)
        m = {k: float(np.mean([p[k] for p in passes])) for k in passes[0]}
        m |= {f"time/{k}_ms": 1e3 * v for k, v in (("rollout", r["seconds"]), ("rewards", r[
            "score_seconds"]), ("logps", t2 - t1), ("update", time.perf_counter() - t2))}
        phases += [m] if step > start else []  # the first step compiles
        if m["nonfinite"]:  # some pass did not update: stop, or count it within the allowance
            loop.nonfinite(loop.step, m)
        run.profiler.after(loop.step, state)
        rec = {"step": loop.step} | rollout_record(r, lengths, g.group_size) | m
        rec["ms_per_step"] = 1e3 * (time.perf_counter() - t0)
        tokens, flops = flops_per_step(cfg, task.width, N)  # padded: the useful share counts
        real = (r["host"][1].sum() + lengths.sum()) / (len(lengths) * (task.width + N))
        rec["mfu"] = train.mfu(flops / tokens, real * tokens / rec["ms_per_step"] * 1e3, loop.peak)
        if loop.eval_due:
            rec |= loop.eval(evaluate(policy(state)), write=False)
        if loop.step % g.log_every == 0 or loop.step == g.steps or "eval_reward" in rec:
            log_step(rec)
        run.metrics_log.write(rec)
        loop.checkpoint(state)

    run.ckpt.wait()
    for row, c in zip(task.eval_rows[:4], held_out["texts"]):
        log(task.show(row, c))
    evals = [(s, e["eval_reward"]) for s, e in loop.evals]
    best, tok_s = max(evals, key=lambda e: e[1]), rollout_tokens / max(rollout_s, 1e-9)
    end = int(jax.device_get(state["step"])) // (g.mu * updates_per_rollout(g))
    timing = (f" (warm start {observe.duration(warm['warm_start_s'])} over "
              f"{warm['warm_start_steps']} steps)" if warm else "")
    out = loop.summary(end, f"{prompts} prompts x {g.group_size} completions x "
                       f"{task.width + g.max_new_tokens} tokens", [
        ("held-out", f"reward {evals[0][1]:.3f} (step {evals[0][0]}) -> {evals[-1][1]:.3f} "
                     f"(step {evals[-1][0]}) | best {best[1]:.3f} (step {best[0]}), greedy"),
        ("rollouts", f"{rollout_tokens:,} completion tokens sampled this run, {tok_s:.0f} "
                     f"tok/s{timing}"),
        ("phases", " | ".join(f"{k} {np.mean([p[f'time/{k}_ms'] for p in phases]):.0f} ms" for k
                              in ("rollout", "rewards", "logps", "update")) + " (means after "
                   "the first step; rollout: prefill, decode, fetch; logps: advantages, the "
                   "reference's and old log-probs)" if phases else "one step: it compiled")])
    return out | warm | {"state": state, "eval": evals, "rollout_tokens_per_s": tok_s}


def rollout_record(r: dict, lengths: np.ndarray, group_size: int) -> dict:
    """A step's rollout figures, named as TRL logs them."""
    rec = {"reward": float(r["reward"].mean()), "reward_std": float(r["reward"].std(ddof=1))}
    for n, v in r["rewards"].items():
        rec |= {f"rewards/{n}/mean": float(v.mean()), f"rewards/{n}/std": float(v.std(ddof=1))}
    zero_std = r["reward"].reshape(-1, group_size).std(axis=1) == 0
    return rec | {"frac_reward_zero_std": float(np.mean(zero_std)),
                  "completions/mean_length": float(lengths.mean()),
                  "completions/max_length": int(lengths.max()),
                  "completions/min_length": int(lengths.min()),
                  "completions/clipped_ratio": float(np.mean(~r["finished"])),
                  "rollout_tokens_per_s": float(lengths.sum() / r["seconds"])}


def log_step(r: dict) -> None:
    labels = {"correctness": "correct"}  # the demo's reward, as its log lines read in docs/grpo.md
    kl = f" | kl {r['kl']:.4f}" if "kl" in r else ""
    held = f" | held-out {r['eval_reward']:.3f}" if "eval_reward" in r else ""
    each = "".join(f" | {labels.get(k[8:-5], k[8:-5])} {v:.3f}" for k, v in r.items()
                   if k.startswith("rewards/") and k.endswith("/mean"))
    log(f"step {r['step']} | reward {r['reward']:.3f} ± {r['reward_std']:.3f}{each}{kl} | "
        f"clip {r['clip_ratio/region_mean']:.3f} | len {r['completions/mean_length']:.1f}/"
        f"{r['completions/max_length']} | entropy {r['entropy']:.3f}{held} | "
        f"{r['rollout_tokens_per_s'] / 1e3:.1f}k rollout tok/s | {r['ms_per_step']:.0f} ms/step")


def warm_start(cfg: Config, mesh, tok, params, generate, task: Task, run: train.Run):
    """SFT on correct examples until the sampled (not greedy) reward reaches
    --warm.target-reward (WarmStartConfig says why)."""
    w, g = cfg.warm, cfg.grpo
    st = train_state(cfg, mesh, make_optimizer(g, w, param_specs(cfg.model)), lora=False)
    state = st.from_params(params)
    step_fn = st.jit(partial(sft_step, cfg=cfg, n_valid=tok.vocab_size))
    t0, losses = time.perf_counter(), []
    for i in range(w.max_steps):  # a step's prompts: a pure function of (seed, step)
        items = task.rows_at(i, w.batch_size, 1)
        arrays = (left_pad([r.ids for r in items], task.width, tok.pad_id)
                  + encode_completions(tok, [r.answer for r in items], g.max_new_tokens))
        batch = dict(zip(("prompt", "prompt_valid", "completion", "mask"), arrays))
        state, m = step_fn(state, train.put(batch, mesh, BATCH_AXES))
        losses.append(m)
        if (i + 1) % w.check_every == 0 or i + 1 == w.max_steps:
            losses = jax.device_get(losses)
            if any(m["nonfinite"] for m in losses):  # not applied; nothing saved yet
                raise train.NonFiniteError(f"warm start step {i + 1}: a non-finite loss or "
                                           f"gradient; lower --warm.lr {w.lr} and rerun.")
            # Distinct prompts, as many as a rollout batch has rows (the same compile).
            r = generate(state["params"], task.rows_at(i, g.prompts_per_step * g.group_size, 2),
                         jax.random.fold_in(jax.random.key(g.seed + 1), i), g.temperature)
            reward = float(r["reward"].mean())
            sft_loss, losses = float(np.mean([m["loss"] for m in losses])), []
            log(f"warm start step {i + 1} | sft_loss {sft_loss:.3f} | sampled reward "
                f"{reward:.3f} (target {w.target_reward}) | {time.perf_counter() - t0:.0f} s")
            # Counted in its own steps: in TensorBoard, a run of its own.
            run.metrics_log.write({"warm_step": i + 1, "sft_loss": sft_loss, "reward": reward},
                                  step_key="warm_step", run="warm_start")
            if reward >= w.target_reward:
                break
    return state["params"], {"warm_start_steps": i + 1, "warm_start_s": time.perf_counter() - t0}


def synthetic_batch(cfg: Config, tok, width: int) -> dict[str, np.ndarray]:
    """A rollout batch of random tokens, for --dry-run and --bench (no rollouts are run)."""
    g, rng = cfg.grpo, np.random.default_rng(0)
    B, Pw, N = g.prompts_per_step * g.group_size, width, g.max_new_tokens
    logp = np.full((B, N), -math.log(tok.vocab_size), np.float32)
    return {"prompt": rng.integers(0, tok.vocab_size, (B, Pw), np.int32),
            "prompt_valid": np.ones((B, Pw), bool), "mask": np.ones((B, N), bool),
            "completion": rng.integers(0, tok.vocab_size, (B, N), np.int32), "old_logp": logp,
            "adv": rng.standard_normal(B).astype(np.float32), "n_tokens": np.float32(B * N)
            } | ({"ref_logp": logp} if g.beta > 0 else {})


def make_tokenizer(cfg: Config):
    if cfg.init_from_hf:  # its own: completions are decoded to be scored, in its words
        # Your prompts meet its chat template: encoded by tokenizer.json, as transformers does.
        return PretrainedTokenizer(*hf.tokenizer(cfg.init_from_hf, prefer_json=bool(cfg.task.path)))
    if not cfg.init_from:
        return CharTokenizer()
    # Pre-training or SFT: the file the dense run (or the run it fine-tuned) tokenized with.
    # The dense model saw documents separated by EOS: after one, a document begins.
    path = run_tokenizer(cfg.init_from)
    eos = open_tokenizer(path).eos_id()
    return PretrainedTokenizer(path, eos, eos)


# ----------------------------------------------------------------------------------------------
# 8. HuggingFace in and out (--init-from-hf, export-hf): train_dense.py's section 6
# ----------------------------------------------------------------------------------------------
# HuggingFace rotates the two halves of each head, as `apply_rope` does: its q_proj, k_proj load
# as they are (Meta's code rotates interleaved pairs; HF permuted those rows once, at conversion).
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                    "gemma3_text": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                    "olmo3": "Olmo3ForCausalLM", "gemma4_text": "Gemma4ForCausalLM",
                    "qwen3_5_text": "Qwen3_5ForCausalLM",  # Qwen3.5 (its language model)
                    "gpt2": "GPT2LMHeadModel"}  # GPT-2, and GPT-3's block
GEMMA = ("gemma2", "gemma3_text", "gemma4_text")
# What transformers assumes for a key that config.json leaves out (its config classes).
_GEMMA_HF = dict(num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                 sliding_window=4096, tie_word_embeddings=True)
_HF_DEFAULTS = {mt: dict(rms_norm_eps=1e-6) | d for mt, d in {
    "llama": dict(max_position_embeddings=2048),
    "mistral": dict(max_position_embeddings=131072, num_key_value_heads=8, sliding_window=4096),
    "qwen2": dict(max_position_embeddings=32768, num_key_value_heads=32),
    "qwen3": dict(max_position_embeddings=32768, num_key_value_heads=32, head_dim=128),
    "gemma": _GEMMA_HF | dict(max_position_embeddings=8192, num_key_value_heads=16),
    "gemma2": _GEMMA_HF | dict(max_position_embeddings=8192, attn_logit_softcapping=50.0,
                               final_logit_softcapping=30.0),
    "gemma3_text": _GEMMA_HF | dict(max_position_embeddings=131072, sliding_window_pattern=6,
                                    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0),
    "olmo2": dict(max_position_embeddings=2048, rms_norm_eps=1e-5),
    "olmo3": dict(max_position_embeddings=2048, rms_norm_eps=1e-5, sliding_window=4096,
                  rope_theta=500_000.0),
    "gemma4_text": dict(max_position_embeddings=131072, num_key_value_heads=4, head_dim=256,
                        sliding_window=512, sliding_window_pattern=6, tie_word_embeddings=True,
                        rope_theta=10_000.0, global_head_dim=512, attention_k_eq_v=False,
                        hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
                        num_kv_shared_layers=0, use_double_wide_mlp=False),
    "qwen3_5_text": dict(max_position_embeddings=32768, num_key_value_heads=4, head_dim=256,
                         linear_num_key_heads=16, linear_num_value_heads=32,
                         linear_key_head_dim=128, linear_value_head_dim=128,
                         linear_conv_kernel_dim=4),
    "gpt2": dict(max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=True),
}.items()}
# GPT-2's config.json spells these keys its own way (read as ours; n_inner null: 4 d).
GPT2_KEYS = dict(n_embd="hidden_size", n_layer="num_hidden_layers", n_head="num_attention_heads",
                 n_positions="max_position_embeddings", n_inner="intermediate_size",
                 layer_norm_epsilon="rms_norm_eps")
# config.json keys that are our knobs as they stand, in every family and then in some: read as the
# knob's type (absent, null or 0: its default), written as its value.
HF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "d_model", "head_dim": "head_dim",
           "intermediate_size": "d_ff", "num_hidden_layers": "n_layers", "rms_norm_eps": "norm_eps",
           "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads",
           "max_position_embeddings": "max_seq_len", "tie_word_embeddings": "tie_embeddings"}
QWEN35_KEYS = {"linear_num_key_heads": "linear_k_heads", "linear_num_value_heads": "linear_v_heads",
               "linear_key_head_dim": "linear_k_dim", "linear_value_head_dim": "linear_v_dim",
               "linear_conv_kernel_dim": "linear_conv"}
HF_FAMILY_KEYS = {(*GEMMA, "olmo3"): dict(sliding_window="sliding_window"),
                  GEMMA: dict(final_logit_softcapping="final_softcap"),
                  GEMMA[:2]: dict(attn_logit_softcapping="attn_softcap",
                                  query_pre_attn_scalar="query_scale"),
                  GEMMA[2:]: dict(attention_k_eq_v="k_eq_v", num_kv_shared_layers="kv_shared",
                                  hidden_size_per_layer_input="ple_dim"),
                  ("qwen3_5_text",): QWEN35_KEYS}
HF_NULL = ("sliding_window", "attn_softcap", "final_softcap")  # 0 (off) written as null
# Knobs config.json says in its own way (`config_from_hf`), and the families that say them.
HF_SPELLED = dict(global_every=(*GEMMA, "olmo3", "qwen3_5_text"), rotary_dim=("qwen3_5_text",),
                  rope_local_theta=("gemma3_text", "olmo3", "gemma4_text"), **dict.fromkeys(
                      ("global_head_dim", "global_kv_heads", "wide_shared_mlp"), GEMMA[2:]))
# The global layers' RoPE types, in the order one is picked to write: the families that have
# it, its parameters that are knobs, the others at HF's defaults (written so, read only so) and
# the value that leaves a knob at its default (Gemma 4's 1.0).
_ALL, _NOT_GEMMA2 = tuple(HF_ARCHITECTURES), tuple(m for m in HF_ARCHITECTURES if m != "gemma2")
HF_ROPE = {"proportional": (GEMMA[2:], dict(partial_rotary_factor="rope_partial",
                                            factor="rope_linear"), {}, 1.0),
           "llama3": (_ALL, dict(factor="rope_scaling", low_freq_factor="rope_low_freq_factor",
                                 high_freq_factor="rope_high_freq_factor",
                                 original_max_position_embeddings="rope_original_max_len"), {}, 0),
           "yarn": (_NOT_GEMMA2, dict(factor="yarn_factor",  # OLMo 3's
                                      original_max_position_embeddings="yarn_original_max_len"),
                    dict(beta_fast=32.0, beta_slow=1.0), 0),
           "linear": (_NOT_GEMMA2, {"factor": "rope_linear"}, {}, 0),  # Gemma 2's: local too
           "default": (_ALL, {}, {}, 0)}
# config.json keys that change what the model computes. We implement the value `config_to_hf`
# writes back for the model read (where it writes none: null or these); another is refused, the
# error saying so in these words ({v}: its value, {w}: ours).
_BIAS = ((False,), "attention_bias / mlp_bias {v!r} (biases on every projection)")
HF_REFUSED = dict(
    hidden_act=((), "hidden activation {v!r} (only {w})"), attention_bias=_BIAS, mlp_bias=_BIAS,
    partial_rotary_factor=((1.0,), "partial_rotary_factor {v}"),
    use_bidirectional_attention=((False, "vision"),  # "vision": only images' tokens see ahead
                                 "use_bidirectional_attention {v!r} (an encoder)"),
    enable_moe_block=((), "enable_moe_block (26B-A4B's experts; train_moe.py loads it)"),
    layer_types=((), "layer_types {v} (only every n-th layer global)"),
    per_layer_config=((), "per_layer_config {v} (only the global layers', all alike)"),
    activation_function=(("gelu_pytorch_tanh",), "activation_function {v!r} (only {w})"),
    scale_attn_weights=((True,), "scale_attn_weights {v}"),
    scale_attn_by_inverse_layer_idx=((False,), "scale_attn_by_inverse_layer_idx {v}"))
# The knobs a family implies (config.json does not spell them); the others are off.
_GPT2 = dict(layer_norm=True, learned_pos=True, plain_mlp=True, proj_bias=True, qkv_bias=True,
             gelu=True)
_GEMMA_KNOBS = dict(norm_plus_one=True, sandwich_norm=True, embed_scale=True, gelu=True)
HF_KNOBS = {"llama": {}, "mistral": {}, "qwen2": dict(qkv_bias=True), "qwen3": dict(qk_norm=True),
            "gemma": _GEMMA_KNOBS | dict(sandwich_norm=False), "gemma2": _GEMMA_KNOBS,
            "gemma3_text": _GEMMA_KNOBS | dict(qk_norm=True), **dict.fromkeys(
                ("olmo2", "olmo3"), dict(post_norm=True, qk_norm=True, qk_norm_whole=True)),
            "gemma4_text": _GEMMA_KNOBS | dict(norm_plus_one=False, qk_norm=True, v_norm=True,
                                               layer_scale=True, query_scale=1.0),
            "qwen3_5_text": dict(norm_plus_one=True, qk_norm=True, attn_gate=True), "gpt2": _GPT2}
HF_NEEDS = {"gemma4_text": "global_head_dim", "qwen3_5_text": "linear_k_heads"}  # on, to write
# What transformers itself writes into each family's config.json, beyond our fields.
_GELU_TANH = dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                  attention_bias=False)
HF_CONSTANTS = {"llama": dict(attention_bias=False, mlp_bias=False, pretraining_tp=1),
                "mistral": dict(sliding_window=None),
                "qwen2": dict(use_sliding_window=False, sliding_window=None),
                "qwen3": dict(use_sliding_window=False, sliding_window=None, attention_bias=False),
                "gemma": _GELU_TANH, "gemma2": _GELU_TANH, "gemma3_text": _GELU_TANH,
                "olmo2": dict(attention_bias=False), "olmo3": dict(attention_bias=False),
                "gemma4_text": _GELU_TANH | dict(enable_moe_block=False, num_experts=None,
                                                 top_k_experts=None, moe_intermediate_size=None),
                "qwen3_5_text": dict(attention_bias=False), "gpt2": dict(
                    activation_function="gelu_new", scale_attn_weights=True,
                    scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)}
# Our parameters as HuggingFace tensors (name, layout: common/hf.py). HF's nn.Linear keeps
# [out, in], ours [in, out] with the heads split out: a transpose and a reshape, then stacked
# on l. Atoms: l layers, d model, n query heads, k key/value heads, h head width, f MLP, v vocab.
HF_TOP = {"embed": ("model.embed_tokens.weight", "v d -> v d"),
          "unembed": ("lm_head.weight", "v d -> d v"),
          "final_norm": ("model.norm.weight", "d -> d")}
HF_LAYER = {"attn_norm": ("input_layernorm.weight", "d -> d"),
            "mlp_norm": ("post_attention_layernorm.weight", "d -> d"),
            # Gemma's sandwich: its post_attention_layernorm is the attention's output norm
            "attn_post_norm": ("post_attention_layernorm.weight", "d -> d"),
            "mlp_post_norm": ("post_feedforward_layernorm.weight", "d -> d")} | {
    k: ("self_attn." + name, layout) for k, (name, layout) in dict(
        wq=("q_proj.weight", "(n h) d -> d n h"), wk=("k_proj.weight", "(k h) d -> d k h"),
        wv=("v_proj.weight", "(k h) d -> d k h"), wo=("o_proj.weight", "d (n h) -> n h d"),
        bq=("q_proj.bias", "(n h) -> n h"), bk=("k_proj.bias", "(k h) -> k h"),
        bv=("v_proj.bias", "(k h) -> k h"), q_norm=("q_norm.weight", "h -> h"),
        k_norm=("k_norm.weight", "h -> h")).items()} | {
    k: ("mlp." + name, layout) for k, (name, layout) in dict(
        w_gate=("gate_proj.weight", "f d -> d f"), w_up=("up_proj.weight", "f d -> d f"),
        w_down=("down_proj.weight", "d f -> f d")).items()} | {  # Gemma 4's (o: 1)
    "ple_gate": ("per_layer_input_gate.weight", "p d -> d p"),
    "ple_out": ("per_layer_projection.weight", "d p -> p d"),
    "ple_post_norm": ("post_per_layer_input_norm.weight", "d -> d"),
    "layer_scale": ("layer_scalar", "o -> o")} | {  # Qwen3.5's DeltaNet (train_moe.py's names)
    k: ("linear_attn." + name, layout) for k, (name, layout) in dict(
        lin_conv=("conv1d.weight", "lx o lw -> lw o lx"), A_log=("A_log", "lv -> lv"),
        dt_bias=("dt_bias", "lv -> lv"), lin_norm=("norm.weight", "ly -> ly"),
        lin_wo=("out_proj.weight", "d (lv ly) -> lv ly d"),
        lin_z=("in_proj_z.weight", "(lk lr ly) d -> d lk lr ly"),
        lin_b=("in_proj_b.weight", "(lk lr) d -> d lk lr"),
        lin_a=("in_proj_a.weight", "(lk lr) d -> d lk lr")).items()} | {
    f"lin_{x}": ("linear_attn.in_proj_qkv.weight", f"([lk lq|lk lq|lk lr ly]:{i}) d -> d lk "
                 + ("lq" if i < 2 else "lr ly")) for i, x in enumerate("qkv")}
# GPT-2's: Conv1D weights stored [in, out]; one c_attn with every head's q, then k, then v
HF_GPT2 = {k: ("transformer." + n, lay) for k, (n, lay) in dict(
    embed=("wte.weight", "v d -> v d"), pos_embed=("wpe.weight", "x d -> x d"),
    final_norm=("ln_f.weight", "d -> d"), final_norm_bias=("ln_f.bias", "d -> d")).items()} | dict(
    attn_norm=("ln_1.weight", "d -> d"), attn_norm_bias=("ln_1.bias", "d -> d"),
    mlp_norm=("ln_2.weight", "d -> d"), mlp_norm_bias=("ln_2.bias", "d -> d"),
    wo=("attn.c_proj.weight", "(n h) d -> n h d"), bo=("attn.c_proj.bias", "d -> d"),
    w_up=("mlp.c_fc.weight", "d f -> d f"), b_up=("mlp.c_fc.bias", "f -> f"),
    w_down=("mlp.c_proj.weight", "f d -> f d"), b_down=("mlp.c_proj.bias", "d -> d")) | {
    w + x: ("attn.c_attn." + n, f"{d}(3:{i} {a} h) -> {d}{a} h") for i, (x, a) in enumerate(
        zip("qkv", "nkk")) for w, n, d in (("w", "weight", "d "), ("b", "bias", ""))}
HF_GATE = {k: ("self_attn.q_proj.weight", f"(n 2:{i} h) d -> d n h") for i, k in enumerate(
    ("wq", "wq_gate"))}
# Gemma 4's per-layer inputs: one table [v, L p] (q = L p), the stream's projection, its norm
HF_PLE = {"ple_embed": ("model.embed_tokens_per_layer.weight", "v q -> v q"),
          "ple_proj": ("model.per_layer_model_projection.weight", "q d -> d q"),
          "ple_norm": ("model.per_layer_projection_norm.weight", "p -> p")}


def hf_mapping(cfg: ModelConfig) -> dict:
    """`_param_table`'s tree, each leaf as its (HuggingFace tensor name, layout). Gemma 4's
    stacks are each kind's layers in their periods of n: local (all but every n-th), global
    (every n-th), then the same for the kv_shared layers; the global ones of their own width
    (j) and heads (u), the shared ones' MLPs perhaps 2 d_ff wide (w)."""
    whole = {n: (HF_LAYER[n][0], f"({a} h) -> {a} h") for n, a in zip(("q_norm", "k_norm"), "nk")}
    names = HF_LAYER | ({"mlp_norm": ("pre_feedforward_layernorm.weight", "d -> d")}  # Gemma's
                        if cfg.sandwich_norm else {}) | (whole if cfg.qk_norm_whole else {}) | (
        HF_GATE if cfg.attn_gate else {}) | (HF_GPT2 if cfg.learned_pos else {})
    n, F = cfg.global_every, cfg.n_layers - cfg.kv_shared
    at = {"layers": ("l", "{l}")} if not (cfg.global_head_dim or cfg.linear_k_heads) else {
        "layers": ("l", f"{{l*{n}//{n - 1}}}"), "global_layers": ("g", f"{{g*{n}+{n - 1}}}"),
        "shared_layers": ("s", f"{{s*{n}//{n - 1}+{F}}}"),
        "shared_global_layers": ("t", f"{{t*{n}+{F + n - 1}}}")}
    atoms = lambda k: str.maketrans(dict(("hj", "ku") * ("global" in k) + ("fw",) * (
        k.startswith("shared") and cfg.wide_shared_mlp)))
    stack = "transformer.h" if cfg.learned_pos else "model.layers"  # GPT-2's name
    layer = lambda k, w: (f"{stack}.{at[k][1]}." + names[w][0], names[w][1].translate(
        atoms(k)).replace("-> ", f"-> {at[k][0]} "))
    return {k: {w: layer(k, w) for w in v} if k in at else (HF_TOP | HF_PLE | names)[k]
            for k, v in _param_table(cfg).items()}


def _hf_sizes(cfg: ModelConfig) -> dict:
    L, n, S = cfg.n_layers, max(cfg.global_every, 1), cfg.kv_shared
    own = (L - S) // n if cfg.global_head_dim or cfg.linear_k_heads else 0  # global periods
    Hk, Hv, Dk, Dv = (cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim)
    return dict(l=L - S - own, g=own, s=S - S // n, t=S // n, d=cfg.d_model, n=cfg.n_heads,
                k=cfg.n_kv_heads, h=cfg.head_dim, f=cfg.d_ff, v=cfg.vocab_size, o=1,
                j=cfg.global_head_dim or cfg.head_dim, u=cfg.global_kv_heads or cfg.n_kv_heads,
                w=2 * cfg.d_ff, p=cfg.ple_dim, q=L * cfg.ple_dim, lk=Hk, lq=Dk,
                lr=Hv // max(Hk, 1), lx=2 * Hk * Dk + Hv * Dv, lw=cfg.linear_conv, lv=Hv, ly=Dv,
                x=cfg.max_seq_len)


def _hf_keys(mt: str) -> dict:
    return HF_KEYS | {k: v for ms, keys in HF_FAMILY_KEYS.items() if mt in ms
                      for k, v in keys.items()}


def _layer_types(L: int, n: int, local: str) -> list[str]:
    """Every n-th of L layers full attention, the others `local` ("": none)."""
    return ["full_attention" if not local or n and (i + 1) % n == 0 else local for i in range(L)]


def config_from_hf(c: dict, where: str = "config.json") -> ModelConfig:
    """Our ModelConfig from a HuggingFace config.json (as a dict), by the tables above. What we
    implement is what `config_to_hf` writes back for it: anything else that would change what
    the model computes (HF_REFUSED, the RoPE's parameters) is an error, never ignored."""
    mt = c.get("model_type")
    if mt not in HF_ARCHITECTURES:
        raise hf.HFError(f"{where}: model_type {mt!r} is not a dense family this trainer loads "
                         f"({', '.join(HF_ARCHITECTURES)}); mixture-of-experts models (mixtral, "
                         "qwen3_moe) belong to train_moe.py.")
    if mt == "gpt2":
        c = {GPT2_KEYS.get(k, k): v for k, v in c.items()}
        c["intermediate_size"] = c.get("intermediate_size") or 4 * c.get("hidden_size", 0)
    c = _HF_DEFAULTS[mt] | c
    unsupported = lambda what: hf.HFError(f"{where}: {what} is not implemented here, so this "
                                          f"{mt} model cannot be loaded faithfully.")
    if lacking := [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in c]:
        raise hf.HFError(f"{where} has no {lacking[0]!r}; it is not a complete {mt} config.")
    if mt.startswith("gemma"):  # its hidden_activation first; Gemma 1's "gelu" is the tanh one
        act = c.get("hidden_activation") or c.get("hidden_act")
        c |= dict(hidden_act="gelu_pytorch_tanh" if (mt, act) == ("gemma", "gelu") else act)
    typed = lambda k, v: type(getattr(ModelConfig, k))(v)  # HF writes 256 for a float
    f = {k: typed(k, c[key]) for key, k in _hf_keys(mt).items() if c.get(key)}  # 0: ours
    f = dict(n_kv_heads=f["n_heads"], head_dim=f["d_model"] // f["n_heads"]) | f | HF_KNOBS[mt]
    rope, says = c.get("rope_parameters") or {}, [k for k, ms in HF_SPELLED.items() if mt in ms]
    if "rope_local_theta" in says:  # global and local RoPE: per layer type
        local = {"rope_parameters": rope.get("sliding_attention", {})}
        f["rope_local_theta"], kind, _ = hf.rope_parameters(
            local, c.get("rope_local_base_freq", c["rope_theta"]), where)
        if kind != "default":
            raise unsupported(f"rope type {kind!r} on the sliding-window layers")
        c = c | {"rope_parameters": rope["full_attention"]} if "full_attention" in rope else c
    f["rope_theta"], kind, rope = hf.rope_parameters(c, 10_000.0, where)
    rope = {"original_max_position_embeddings": c["max_position_embeddings"]} | rope  # if absent
    f = {k: v for k, v in f.items() if k != "rope_local_theta" or v != f["rope_theta"]}  # 1 base
    families, knobs, fixed, off = HF_ROPE.get(kind, ((), {}, {}, 0))
    if mt not in families:
        ok = [k for k, r in HF_ROPE.items() if mt in r[0]]
        raise unsupported(f"rope type {kind!r} (only {', '.join(ok)})")
    if lacking := [p for p in knobs if p not in rope and not off]:
        raise hf.HFError(f"{where}: rope type {kind!r} without {', '.join(sorted(lacking))}.")
    f |= {k: typed(k, rope[p]) for p, k in knobs.items() if rope.get(p, off) != off}
    # A window changes nothing on sequences no longer than itself: it becomes the maximum length.
    window = c.get("sliding_window") if mt == "mistral" or c.get("use_sliding_window") else None
    if window is not None and mt not in GEMMA:
        f["max_seq_len"] = min(f["max_seq_len"], window)
    L = c["num_hidden_layers"]
    local = "linear_attention" if mt == "qwen3_5_text" else "sliding_attention"
    if "global_every" in says:  # every n-th layer global (or full attention), the others local
        kinds = c.get("layer_types") or _layer_types(L, dict(gemma2=2, olmo3=4).get(mt) or c.get(
            "_sliding_window_pattern", c.get("sliding_window_pattern",
                                             c.get("full_attention_interval", 4))), local)
        n = f["global_every"] = kinds.index("full_attention") + 1 if "full_attention" in kinds else 0
    if mt == "gemma4_text":  # the global layers' width and heads: per layer (5.x) or not
        if c["hidden_size_per_layer_input"] and c["vocab_size_per_layer_input"] != c["vocab_size"]:
            raise unsupported("a per-layer input vocabulary unlike vocab_size")
        own = (c.get("per_layer_config") or {}).get(str(n - 1)) or dict(head_dim=c[
            "global_head_dim"], num_key_value_heads=c["attention_k_eq_v"] and c.get(
            "num_global_key_value_heads"))
        f |= dict(global_head_dim=own.get("head_dim", f["head_dim"]), global_kv_heads=own.get(
            "num_key_value_heads") or 0, wide_shared_mlp=bool(f.get("kv_shared") and c[
            "use_double_wide_mlp"]))
    if mt == "qwen3_5_text":  # the gated attention turns a share of each head
        H = f["head_dim"]
        R = int(H * float(c.get("partial_rotary_factor") or rope.get("partial_rotary_factor", 1)))
        if R % 2 or n < 2 or L % n:
            raise unsupported(f"layer_types {kinds} (only every n-th layer full, n > 1 dividing "
                              f"{L}) or {R} dims turned (odd)")
        f["rotary_dim"], c = R if R < H else 0, c | {"partial_rotary_factor": None}
    m = ModelConfig(**f)
    w = config_to_hf(m, mt)
    for key, (also, what) in HF_REFUSED.items():
        if c.get(key) not in (None, w.get(key), *also) and (key in w or also):
            raise unsupported(what.format(v=c[key], w=w.get(key)))
    ours = {"truncate": True} | (rp := w.get("rope_parameters", {})).get("full_attention", rp)
    if fixed and (odd := {p: v for p, v in rope.items() if v is not None and not math.isclose(
            v, ours.get(p, math.nan))}):
        raise unsupported(f"YaRN with {odd} (only {ours})")
    return m


def _misfit(cfg: ModelConfig, mt: str) -> dict:
    """The knobs of `cfg` that family `mt`'s config.json cannot say, by the tables above: one the
    family implies, at another value; one that only others say, off its default; one it needs."""
    says = set(_hf_keys(mt).values()) | {k for k, ms in HF_SPELLED.items() if mt in ms} | {
        k for ms, knobs, *_ in HF_ROPE.values() if mt in ms for k in knobs.values()}
    some = {k for m in _ALL for k in [*HF_KNOBS[m], *_hf_keys(m).values()]} | set(HF_SPELLED) | {
        k for _, knobs, *_ in HF_ROPE.values() for k in knobs.values()}
    one = dict(head_dim=cfg.d_model // cfg.n_heads, n_kv_heads=cfg.n_heads) if mt == "gpt2" else {}
    want = lambda k: HF_KNOBS[mt].get(k, one.get(k, getattr(cfg if k in says else ModelConfig, k)))
    return {k: getattr(cfg, k) for k in sorted(some) if getattr(cfg, k) != want(k) or k == (
        HF_NEEDS.get(mt)) and not getattr(cfg, k) or k == "query_scale" and cfg.query_scale % 1}


def config_to_hf(cfg: ModelConfig, model_type: str = "", dtype: str = "float32") -> dict:
    """A config.json for `cfg` that transformers 4.4x and 5.x both read (each finds its own
    spelling of the rope settings), by the tables above. model_type "" picks the first family
    whose config.json says this model."""
    mt = model_type or next((m for m in HF_ARCHITECTURES if not _misfit(cfg, m)), "llama")
    if mt not in HF_ARCHITECTURES:
        raise hf.HFError(f"model_type {mt!r}: choose one of {', '.join(HF_ARCHITECTURES)}.")
    if bad := _misfit(cfg, mt):
        raise hf.HFError(f"model_type {mt!r} does not fit this model ({bad}): q/k/v biases "
                         "are qwen2's; q/k norms qwen3's, gemma3_text's, OLMo's (whole, with post "
                         "norms); (1 + w) norms, GeGLU, the embedding scale Gemmas'; sandwich "
                         "norms, soft-caps gemma2's, gemma3_text's; windows theirs and olmo3's, "
                         "a local RoPE gemma3_text's and olmo3's; gemma4_text needs global layers "
                         "of their own, normed values, scaled layers, a query scale of 1; "
                         "qwen3_5_text Gated DeltaNet layers and gated attention; gpt2 "
                         "LayerNorm, learned positions, a GELU MLP, biases, d / n wide heads.")
    kind, (_, knobs, fixed, off) = next((k, r) for k, r in HF_ROPE.items() if mt in r[0] and (
        r[3] or all(getattr(cfg, k) for k in [*r[1].values()][:1])))  # the first that is on
    rope = {"rope_type": kind, "rope_theta": cfg.rope_theta} | {
        p: getattr(cfg, k) for p, k in knobs.items() if getattr(cfg, k) or not off} | ({
        "partial_rotary_factor": 1.0} if kind == "proportional" and not cfg.rope_partial else {})
    rope |= fixed | ({"attention_factor": 0.1 * math.log(max(cfg.yarn_factor, 1)) + 1}  # HF's
                     if kind == "yarn" else {})
    L, n, says = cfg.n_layers, cfg.global_every, [k for k, ms in HF_SPELLED.items() if mt in ms]
    c = dict(architectures=[HF_ARCHITECTURES[mt]], model_type=mt, hidden_act="silu", **{
        key: getattr(cfg, k) if getattr(cfg, k) or k not in HF_NULL else None
        for key, k in _hf_keys(mt).items()}, rope_parameters=rope, rope_theta=cfg.rope_theta,
             rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"}
             if kind != "default" else None, attention_dropout=0.0, initializer_range=0.02,
             use_cache=True, dtype=dtype, torch_dtype=dtype) | HF_CONSTANTS[mt]
    if "global_every" in says or mt in ("qwen2", "qwen3"):  # each layer's kind
        c["layer_types"] = _layer_types(L, n, "linear_attention" if mt == "qwen3_5_text" else
                                        "sliding_attention" if cfg.sliding_window else "")
    if mt in ("qwen2", "qwen3"):
        c["max_window_layers"] = L
    if mt in GEMMA:
        c |= dict(query_pre_attn_scalar=int(cfg.query_scale or cfg.head_dim),
                  sliding_window_pattern=n or L + 1)
    if mt == "gemma4_text":  # no 4.x spellings; the global layers' shape per layer, as 5.x
        G, K = cfg.global_head_dim, cfg.global_kv_heads
        c = {k: v for k, v in c.items() if k not in ("rope_theta", "rope_scaling", "hidden_act",
                                                     "query_pre_attn_scalar")} | dict(
            use_double_wide_mlp=cfg.wide_shared_mlp,
            vocab_size_per_layer_input=cfg.vocab_size if cfg.ple_dim else 262144,  # HF's
            per_layer_config={str(i): {"head_dim": G} | ({"num_key_value_heads": K} if K else {})
                              for i in range(n - 1, L, n)})
    if mt == "qwen3_5_text":  # n - 1 DeltaNet layers, then gated attention turning a share
        c |= dict(full_attention_interval=n, rope_parameters=rope | {
            "partial_rotary_factor": (cfg.rotary_dim or cfg.head_dim) / cfg.head_dim})
    if mt == "gpt2":  # its own spellings; no RoPE, heads d / n wide, its own activation
        c = {{v: k for k, v in GPT2_KEYS.items()}.get(k, k): v for k, v in c.items() if not (
            k.startswith("rope") or k in ("head_dim", "num_key_value_heads", "hidden_act"))}
    if "rope_local_theta" in says:  # 5.x: rope_parameters per layer type
        local = cfg.rope_local_theta or cfg.rope_theta  # 4.x Gemma 3 its local base
        c |= dict(rope_parameters={"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": local}}) | (
            {"rope_local_base_freq": local} if mt == "gemma3_text" else {})
    return c


def load_hf(path: str, mesh=None) -> tuple[ModelConfig, dict]:
    """A HuggingFace folder (config.json and safetensors, one file or sharded with an index)
    as our ModelConfig and float32 parameters placed with their `param_specs` on `mesh`."""
    ckpt = hf.Checkpoint(path)
    cfg = config_from_hf(ckpt.config, ckpt.config_file)
    # Gemma 4's layers that reuse keys and values may carry projections that nothing reads
    unused = lambda name: (p := name.split("."))[:2] == ["model", "layers"] and p[3:4] == [
        "self_attn"] and p[4] in ("k_proj", "v_proj", "k_norm") and int(p[2]) >= (
        cfg.n_layers - cfg.kv_shared) or p[0] == "mtp" or (  # Qwen3.5's MTP module (text-only
        p[-1] in ("bias", "masked_bias") and p[-2] == "attn")  # exports), GPT-2's causal masks
    return cfg, hf.hf_params(ckpt, mesh, _param_table(cfg), hf_mapping(cfg), _hf_sizes(cfg),
                             unused)


def save_hf(params: dict, cfg: ModelConfig, path: str, *, model_type: str = "",
            base_config: dict | None = None, dtype: str = "float32",
            max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """`params` as a HuggingFace folder that transformers (and vLLM) load: config.json, and
    safetensors shards of at most `max_shard_bytes` with their index. `base_config` (the
    config.json the run started from) keeps its other keys: token ids, chat settings."""
    c = config_to_hf(cfg, model_type or (base_config or {}).get("model_type", ""), dtype)
    return hf.save(path, params, hf_mapping(cfg), _hf_sizes(cfg), c, base_config, dtype=dtype,
                   max_shard_bytes=max_shard_bytes)


# export-hf: the policy, and the tokenizer of the model it started from (the demo's has none).
def export_hf(run_dir: str, out: str, step: int = -1, dtype: hf.ExportDtype = "float32",
              model_type: Literal[("", *HF_ARCHITECTURES)] = "", max_shard_gb: float = 5.0):
    with hf.run_config(run_dir) as saved:  # unreadable: a ConfigError naming it
        model = ModelConfig(**saved["model"])
    ex = hf.export(run_dir, step, saved, {"params": _param_table(model)}, dtype, max_shard_gb,
                   tokenizer_run=saved.get("init_from", ""), dims=MUON_DIMS)
    return ex.written(save_hf(ex.params, model, out, model_type=model_type, **ex.hf_args), out)
export_hf.__doc__ = hf.EXPORT_HF_DOC


def cli(args=None) -> Config:
    return train.cli(PRESETS, args)


if __name__ == "__main__":
    train.run_cli(main, cli, export_hf)
