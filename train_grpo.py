"""GRPO / GSPO post-training of a dense decoder with verifiable rewards, in one file.

    python train_grpo.py tiny                       # the `make train-grpo` run: warm start, GRPO
    python train_grpo.py tiny --grpo.loss gspo      # sequence-level importance ratios
    python train_grpo.py tiny --init-from runs/tiny # start from a train_dense.py run
    python train_grpo.py tiny --init-from-hf ~/hf/Qwen3-0.6B  # from a HuggingFace folder

The loop (Shao et al. 2024, "DeepSeekMath", section 4.1): draw a batch of prompts, sample G
completions of each on the device (prefill, then decode with a preallocated KV cache), score
each completion with plain-Python reward functions, normalise the rewards within each group of
G into advantages, and take `mu` clipped policy-gradient steps on that batch against the
log-probabilities recorded while sampling. The policy is train_dense.py's model, copied here
(section 3) and held numerically identical to it by tests/test_grpo.py.

Sections, in reading order: 1 config and presets, 2 parameters and their shardings (as in
train_dense.py), 3 model (as in train_dense.py, plus padding masks and a KV cache),
4 rollouts, 5 task, tokenizer and rewards, 6 advantages, loss and train step, 7 main,
8 HuggingFace in (--init-from-hf).
Shapes are suffixed on tensor names: B batch (rollouts), T sequence, S key sequence (the KV
cache), P prompt, N new (completion) tokens, D model width, H head width, K key/value heads,
V vocabulary, L layers. Run with `--help` for every flag.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from common import hf, multislice, observe
from common.checkpoint import (CheckpointConfig, CheckpointError, Checkpointer,
                               ConfigConflictError, PreemptionGuard, check_run_config,
                               read_run_config, run_path)
from common.data import open_tokenizer, run_tokenizer
from common.mesh import BATCH_AXES, MeshConfig, MeshError, describe, make_mesh, resolve

# ----------------------------------------------------------------------------------------------
# 1. Config
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """train_dense.py's ModelConfig, field for field: a dense checkpoint's config loads as-is."""
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
    # How to compute, not what: these may change when a run is resumed.
    dtype: Literal["float32", "bfloat16"] = "float32"  # activations and matmuls; weights stay f32
    attention: Literal["auto", "xla", "cudnn", "einsum"] = "auto"
    remat: Literal["full", "dots", "none"] = "full"     # what the backward pass may keep
    scan_layers: bool = True
    loss_chunk: int = 256         # unused here: train_dense's cross-entropy knobs, kept so
    loss_impl: Literal["fused", "remat"] = "fused"  # that a dense config.json loads unchanged


# Fields that say how to compute rather than what the model is: with --init-from they keep
# this run's values, everything else comes from the dense run's config.json.
COMPUTE_FIELDS = ("dtype", "attention", "remat", "scan_layers", "loss_chunk", "loss_impl")


@dataclass(frozen=True)
class TaskConfig:
    """Addition with the sum written backwards: 12+345= -> 753 (357 reversed).

    Reversed, the answer comes least significant digit first, so each digit depends only on
    the two operand digits of its column and the carry from the digit just written: a causal
    model can compute it left to right, and a model of ~1M parameters learns it on a CPU in
    minutes (Lee et al. 2023, "Teaching Arithmetic to Small Transformers").
    """
    min_digits: int = 1           # each operand has min_digits..max_digits digits
    max_digits: int = 3
    eval_prompts: int = 256       # fixed held-out prompts, greedy-decoded every --grpo.eval-every
    eval_seed: int = 12345


@dataclass(frozen=True)
class GRPOConfig:
    steps: int = 600              # rollout batches (each followed by `mu` optimiser steps)
    prompts_per_step: int = 32    # on the demo, 32 prompts x 4 beat 16 x 8 and 8 x 16 for the
    group_size: int = 4           # same 128 rollouts: G completions per prompt
    max_new_tokens: int = 6       # the completion budget (and Dr. GRPO's constant)
    temperature: float = 0.7      # rollouts (the held-out eval is greedy); on the demo 0.7
                                  # learns faster than 1.0, whose samples are mostly noise
    top_k: int = 0                # 0 = off
    top_p: float = 1.0            # 1 = off
    loss: Literal["grpo", "bnpo", "dr_grpo", "dapo", "gspo"] = "grpo"
    scale_rewards: bool = True    # divide advantages by the group's std (off: Dr. GRPO)
    eps_low: float = -1.0         # clip ratio below 1 - eps_low; -1 = the variant's paper value
    eps_high: float = -1.0        # clip ratio above 1 + eps_high; -1 = the variant's paper value
    beta: float = 0.0             # weight of the k3 KL to the reference; 0 = no reference kept
    mu: int = 1                   # optimiser passes per rollout batch (PPO epochs)
    microbatches: int = 1         # gradient accumulation within each pass
    lr: float = 3e-4              # the demo: 1e-3 dips first, 3e-3 collapses the policy
    warmup_steps: int = 10
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.99
    clip_norm: float = 1.0
    format_weight: float = 0.1    # reward weight of the format check (correctness weighs 1)
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50
    profile_steps: tuple[int, ...] = ()  # first and last step to trace into <run_dir>/profile


@dataclass(frozen=True)
class WarmStartConfig:
    """Supervised fine-tuning on correct worked examples before GRPO: from random weights the
    reward is zero for every completion, every group's advantages are zero and GRPO has no
    gradient; it needs a policy that is sometimes right."""
    max_steps: int = 1500         # 0 = no warm start
    target_reward: float = 0.3    # stop once the sampled (not greedy) reward reaches this
    check_every: int = 20         # sample one completion of as many prompts as a rollout batch
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 20


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    warm: WarmStartConfig = field(default_factory=WarmStartConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run_dir: str = "runs/grpo-tiny"
    init_from: str = ""           # a train_dense.py run dir: its model, tokenizer and weights
    init_from_hf: str = ""        # a HuggingFace folder: its config.json, tokenizer and weights
    quiet: bool = False           # no progress lines; steps, evals and the summary still print


# The demo model: ~0.4M parameters, a 16-symbol character vocabulary (section 5).
_TINY_MODEL = ModelConfig(vocab_size=16, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2,
                          head_dim=32, d_ff=384, max_seq_len=32, remat="none")

PRESETS: dict[str, tuple[str, Config]] = {
    "tiny": ("~0.4M-parameter model on reversed addition: the `make train-grpo` run",
             Config(model=_TINY_MODEL, checkpoint=CheckpointConfig(every=25))),
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

# Keys of the saved run config that a resumed run may change: how long, how often, on what
# mesh and how it computes. The warm start is over once a checkpoint exists.
MAY_CHANGE = frozenset({
    "grpo.steps", "grpo.log_every", "grpo.eval_every", "grpo.microbatches", "warm", "mesh",
    "grpo.profile_steps", "quiet",
    "checkpoint", "run_dir", "model.dtype", "model.attention", "model.remat",
    "model.scan_layers", "model.loss_chunk", "model.loss_impl"})

# Clip ranges from the papers, used when --grpo.eps-low/--grpo.eps-high are -1.
# PPO/GRPO: 0.2 both ways. DAPO's clip-higher: 0.2 / 0.28 (Yu et al. 2025, section 3.1).
# GSPO: 3e-4 / 4e-4, since a sequence-level ratio is a geometric mean of token ratios and
# moves far less (Zheng et al. 2025, section 5.1).
PAPER_EPS = {"grpo": (0.2, 0.2), "bnpo": (0.2, 0.2), "dr_grpo": (0.2, 0.2),
             "dapo": (0.2, 0.28), "gspo": (3e-4, 4e-4)}


def clip_range(g: GRPOConfig) -> tuple[float, float]:
    lo, hi = PAPER_EPS[g.loss]
    lo = lo if g.eps_low < 0 else g.eps_low
    hi = hi if g.eps_high < 0 else g.eps_high
    return lo, hi


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag and the fix."""


def validate(cfg: Config, n_devices: int, tok) -> None:
    """Every check that needs no compilation, so a bad launch fails in a second."""
    m, g, w, t = cfg.model, cfg.grpo, cfg.warm, cfg.task
    mesh = resolve(cfg.mesh, n_devices, max(1, math.prod(cfg.mesh.dcn())))
    if mesh.expert * mesh.dcn_expert != 1:
        raise ConfigError(f"--mesh.expert {mesh.expert}: the dense model has no experts; "
                          "keep it 1.")
    tp = mesh.tensor * mesh.dcn_tensor
    for flag, v in [("--model.n-heads", m.n_heads), ("--model.n-kv-heads", m.n_kv_heads),
                    ("--model.d-ff", m.d_ff), ("--model.vocab-size", m.vocab_size)]:
        if v % tp:
            raise ConfigError(f"{flag} {v} is not divisible by --mesh.tensor {tp}: tensor "
                              f"parallelism splits it evenly; choose a tensor size dividing {v}.")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"--model.n-heads {m.n_heads} is not a multiple of --model.n-kv-heads "
                          f"{m.n_kv_heads} (each key/value head serves a whole group).")
    fsdp = mesh.fsdp * mesh.dcn_fsdp
    if m.d_model % fsdp:
        raise ConfigError(f"--model.d-model {m.d_model} is not divisible by --mesh.fsdp {fsdp}.")
    if m.head_dim % 2:
        raise ConfigError(f"--model.head-dim {m.head_dim} must be even (RoPE rotates pairs).")
    if tok.vocab_size > m.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} tokens but --model.vocab-size is "
                          f"{m.vocab_size}; set --model.vocab-size {tok.vocab_size} or larger.")
    if g.group_size < 2:
        raise ConfigError(f"--grpo.group-size {g.group_size}: advantages compare the completions "
                          "of one prompt with each other, so a group needs at least 2.")
    shards = batch_shards_of(mesh)
    rows = g.prompts_per_step * g.group_size
    if rows % (shards * g.microbatches):
        raise ConfigError(f"--grpo.prompts-per-step {g.prompts_per_step} x --grpo.group-size "
                          f"{g.group_size} = {rows} rollouts do not split into --grpo.microbatches "
                          f"{g.microbatches} x {shards} batch shards (data x fsdp); make it a "
                          f"multiple of {shards * g.microbatches}.")
    for flag, v in [("--task.eval-prompts", t.eval_prompts), ("--warm.batch-size", w.batch_size)]:
        if v % shards:
            raise ConfigError(f"{flag} {v} is not divisible by the {shards} batch shards "
                              f"(data x fsdp); use a multiple of {shards}.")
    if not 1 <= t.min_digits <= t.max_digits:
        raise ConfigError(f"--task.min-digits {t.min_digits} / --task.max-digits {t.max_digits}: "
                          "need 1 <= min <= max.")
    need = max(len(tok.encode(a)) for a in longest_answers(t)) + 1
    if g.max_new_tokens < need:
        raise ConfigError(f"--grpo.max-new-tokens {g.max_new_tokens} cannot hold the longest "
                          f"answer and its end-of-sequence token ({need} tokens); raise it.")
    if prompt_width(t) + g.max_new_tokens > m.max_seq_len:
        raise ConfigError(f"prompt ({prompt_width(t)}) + --grpo.max-new-tokens "
                          f"({g.max_new_tokens}) exceed --model.max-seq-len {m.max_seq_len}.")
    if g.temperature <= 0:
        raise ConfigError(f"--grpo.temperature {g.temperature}: rollouts must sample (> 0); the "
                          "held-out eval is the greedy one.")
    if not 0 < g.top_p <= 1 or g.top_k < 0:
        raise ConfigError(f"--grpo.top-p {g.top_p} must be in (0, 1] and --grpo.top-k "
                          f"{g.top_k} >= 0 (0 = off).")
    if g.beta < 0 or g.mu < 1 or g.steps < 0 or g.log_every < 1 or g.eval_every < 1:
        raise ConfigError("--grpo.beta must be >= 0, --grpo.mu, --grpo.log-every and "
                          "--grpo.eval-every >= 1, --grpo.steps >= 0.")
    lo, hi = clip_range(g)
    if not (0 < lo < 1 and hi > 0):
        raise ConfigError(f"--grpo.eps-low {lo} must be in (0, 1) and --grpo.eps-high {hi} > 0.")
    problem = observe.profile_steps_problem(g.profile_steps, "--grpo.profile-steps", g.steps)
    if problem:
        raise ConfigError(problem)


def batch_shards_of(mesh: MeshConfig) -> int:
    return mesh.data * mesh.fsdp * mesh.dcn_data * mesh.dcn_fsdp


# ----------------------------------------------------------------------------------------------
# 2. Parameters and their shardings (copied from train_dense.py; tests keep them identical)
# ----------------------------------------------------------------------------------------------


def _param_table(cfg: ModelConfig) -> dict:
    """The one definition of the parameter tree: name -> (shape, PartitionSpec, init std).

    Per-layer weights are stacked on a leading L axis so the layers run under lax.scan.
    Init std: 0.02, scaled by 1/sqrt(2L) on the two projections that write into the residual
    stream (GPT-2), so its variance does not grow with depth. std None = ones (norms),
    0.0 = zeros (biases).
    """
    L, D, N, K, H, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads,
                           cfg.head_dim, cfg.d_ff, cfg.vocab_size)
    std, out_std = 0.02, 0.02 / math.sqrt(2 * L)
    layers = {
        "attn_norm": ((L, D), P(None, None), None),
        "wq": ((L, D, N, H), P(None, "fsdp", "tensor", None), std),
        "wk": ((L, D, K, H), P(None, "fsdp", "tensor", None), std),
        "wv": ((L, D, K, H), P(None, "fsdp", "tensor", None), std),
        "wo": ((L, N, H, D), P(None, "tensor", None, "fsdp"), out_std),
        "mlp_norm": ((L, D), P(None, None), None),
        "w_gate": ((L, D, F), P(None, "fsdp", "tensor"), std),
        "w_up": ((L, D, F), P(None, "fsdp", "tensor"), std),
        "w_down": ((L, F, D), P(None, "tensor", "fsdp"), out_std),
    }
    if cfg.qkv_bias:
        layers |= {"bq": ((L, N, H), P(None, "tensor", None), 0.0),
                   "bk": ((L, K, H), P(None, "tensor", None), 0.0),
                   "bv": ((L, K, H), P(None, "tensor", None), 0.0)}
    if cfg.qk_norm:
        layers |= {"q_norm": ((L, H), P(None, None), None), "k_norm": ((L, H), P(None, None), None)}
    table = {"embed": ((V, D), P("tensor", "fsdp"), std), "layers": layers,
             "final_norm": ((D,), P(None), None)}
    if not cfg.tie_embeddings:
        table["unembed"] = ((D, V), P("fsdp", "tensor"), std)
    return table


def _is_entry(x) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[1], P)


def param_specs(cfg: ModelConfig) -> dict:
    return jax.tree.map(lambda e: e[1], _param_table(cfg), is_leaf=_is_entry)


def _init(cfg: ModelConfig, key: jax.Array) -> dict:
    table = _param_table(cfg)
    entries, treedef = jax.tree.flatten(table, is_leaf=_is_entry)
    keys = jax.random.split(key, len(entries))

    def one(entry, k):
        shape, _, std = entry
        if std is None:
            return jnp.ones(shape, jnp.float32)
        return std * jax.random.normal(k, shape, jnp.float32)

    return jax.tree.unflatten(treedef, [one(e, k) for e, k in zip(entries, keys)])


def named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def init_params(cfg: ModelConfig, key: jax.Array, mesh=None) -> dict:
    """Float32 master weights, each created directly in its shards (never whole on one device)."""
    out = named(mesh, param_specs(cfg)) if mesh is not None else None
    return jax.jit(partial(_init, cfg), out_shardings=out)(key)


def count_params(cfg: ModelConfig) -> int:
    shapes = jax.eval_shape(partial(_init, cfg), jax.random.key(0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))


# ----------------------------------------------------------------------------------------------
# 3. Model (train_dense.py's, plus a padding mask, shifted positions and a KV cache)
# ----------------------------------------------------------------------------------------------


def constrain(x, spec: P):
    """Pin an activation's sharding when a mesh is set (jax.set_mesh); a no-op without one."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec)


ACT_BTD = P(BATCH_AXES, None, None)  # activations between blocks: batch-sharded, d replicated
CACHE_LBSKH = P(None, BATCH_AXES, None, "tensor", None)  # KV cache: rows and kv heads split


def rms_norm(x, w, eps):
    # Statistics in float32 whatever the compute dtype: bfloat16 squares lose the small values.
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """theta^(-2i/H), with Llama 3.1's rescaling when rope_scaling > 0: wavelengths longer than
    original_max_len / low_freq_factor are slowed by `factor`, shorter than
    original_max_len / high_freq_factor kept, and the band between interpolated smoothly."""
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
    return inv.astype(np.float32)


def apply_rope(x_BTNH, pos_BT, inv_freq):
    """Rotate the two halves of each head (the HuggingFace layout: its q/k weights load as-is)."""
    ang_BTh = pos_BT[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(ang_BTh)[:, :, None, :], jnp.sin(ang_BTh)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def attention(q_BTNH, k_BSKH, v_BSKH, cfg: ModelConfig, mask_BTS=None):
    """Causal grouped-query attention: query head n reads key/value head n // (N/K).

    mask_BTS (True = may attend), when given, replaces the causal mask: it also hides the
    left padding of prompts and the unwritten tail of a KV cache.
    """
    if cfg.attention != "einsum":
        if mask_BTS is not None:
            # cuDNN's fused kernel takes only causal or length masks: an explicit one runs on XLA.
            return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask_BTS[:, None],
                                                implementation="xla")
        impl = None if cfg.attention == "auto" else cfg.attention
        return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, is_causal=True,
                                            implementation=impl)
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    s_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH,
                         preferred_element_type=jnp.float32) / math.sqrt(H)
    causal_TS = jnp.tril(jnp.ones((T, k_BSKH.shape[1]), bool))
    allowed = causal_TS if mask_BTS is None else mask_BTS[:, None, None]
    s_BKGTS = jnp.where(allowed, s_BKGTS, -1e30)   # finite: a fully masked row stays NaN-free
    p_BKGTS = jax.nn.softmax(s_BKGTS, axis=-1).astype(v_BSKH.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", p_BKGTS, v_BSKH).reshape(B, T, N, H)


def block(x_BTD, lp: dict, pos_BT, inv_freq, cfg: ModelConfig, mask_BTS=None, kv=None,
          index=None):
    """One transformer block. With `kv` (this layer's cache, k and v [B, S, K, H]) the new
    keys and values are written at column `index` and the queries attend over the whole
    cache; returns (x, kv)."""
    dt = x_BTD.dtype
    w = lambda name: lp[name].astype(dt)   # f32 master weights, compute-dtype matmuls
    h = rms_norm(x_BTD, lp["attn_norm"], cfg.norm_eps)
    q = jnp.einsum("btd,dnh->btnh", h, w("wq"))
    k = jnp.einsum("btd,dkh->btkh", h, w("wk"))
    v = jnp.einsum("btd,dkh->btkh", h, w("wv"))
    if cfg.qkv_bias:
        q, k, v = q + w("bq"), k + w("bk"), v + w("bv")
    if cfg.qk_norm:
        q, k = rms_norm(q, lp["q_norm"], cfg.norm_eps), rms_norm(k, lp["k_norm"], cfg.norm_eps)
    q, k = apply_rope(q, pos_BT, inv_freq), apply_rope(k, pos_BT, inv_freq)
    if kv is not None:
        # Keys are cached after RoPE, so a cached key never needs its position again.
        k = jax.lax.dynamic_update_slice_in_dim(kv[0], k.astype(kv[0].dtype), index, axis=1)
        v = jax.lax.dynamic_update_slice_in_dim(kv[1], v.astype(kv[1].dtype), index, axis=1)
        kv = (k, v)
    o = attention(q, k, v, cfg, mask_BTS)
    x_BTD = x_BTD + jnp.einsum("btnh,nhd->btd", o, w("wo"))
    h = rms_norm(x_BTD, lp["mlp_norm"], cfg.norm_eps)
    g = jnp.einsum("btd,df->btf", h, w("w_gate"))
    u = jnp.einsum("btd,df->btf", h, w("w_up"))
    x_BTD = x_BTD + jnp.einsum("btf,fd->btd", jax.nn.silu(g) * u, w("w_down"))
    return constrain(x_BTD, ACT_BTD), kv


REMAT_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _embed(params: dict, tokens_BT, cfg: ModelConfig):
    # Gather the table's fsdp shards first (as FSDP does for every weight): a lookup into a
    # table split on d makes XLA replicate the whole result and re-split it.
    embed = constrain(params["embed"], P("tensor", None))
    return constrain(jnp.take(embed, tokens_BT, axis=0).astype(jnp.dtype(cfg.dtype)), ACT_BTD)


def hidden(params: dict, tokens_BT, cfg: ModelConfig, pos_BT=None, mask_BTS=None):
    """Token ids -> final-normed hidden states [B, T, D] in the compute dtype.

    With the defaults this is train_dense.py's `hidden`. Left-padded rows pass their
    positions (counted from the first real token) and a mask that hides the padding, so a
    padded prompt computes exactly what it would unpadded.
    """
    x = _embed(params, tokens_BT, cfg)
    if pos_BT is None:
        pos_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
    inv_freq = rope_inv_freq(cfg)

    def layer(x, lp):
        return block(x, lp, pos_BT, inv_freq, cfg, mask_BTS)[0], None

    if cfg.remat != "none":
        # prevent_cse=False: inside scan the recomputation cannot be merged away anyway.
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
    if cfg.scan_layers:
        x, _ = jax.lax.scan(layer, x, params["layers"])
    else:
        for i in range(cfg.n_layers):
            x, _ = layer(x, jax.tree.map(lambda a: a[i], params["layers"]))
    return rms_norm(x, params["final_norm"], cfg.norm_eps)


def unembedding(params: dict, cfg: ModelConfig):
    return params["embed"].T if cfg.tie_embeddings else params["unembed"]


def logits_of(params: dict, h_BTD, cfg: ModelConfig):
    return jnp.einsum("btd,dv->btv", h_BTD, unembedding(params, cfg).astype(h_BTD.dtype),
                      preferred_element_type=jnp.float32)


def forward(params: dict, tokens_BT, cfg: ModelConfig, pos_BT=None, mask_BTS=None):
    """Logits [B, T, V] in float32 (train_dense.py's `forward` when pos and mask are None)."""
    return logits_of(params, hidden(params, tokens_BT, cfg, pos_BT, mask_BTS), cfg)


def padded_positions(valid_BS):
    """RoPE positions of a left-padded row: 0 at its first real token (pads get 0, unused)."""
    return jnp.maximum(jnp.cumsum(valid_BS.astype(jnp.int32), axis=1) - 1, 0)


def padded_mask(valid_BS, start, T: int):
    """[B, T, S] mask of queries at columns start..start+T-1: causal, and never onto a pad."""
    q_T = start + jnp.arange(T)
    causal_TS = jnp.arange(valid_BS.shape[1])[None, :] <= q_T[:, None]
    return causal_TS[None] & valid_BS[:, None, :]


def init_cache(cfg: ModelConfig, B: int, S: int) -> dict:
    shape = (cfg.n_layers, B, S, cfg.n_kv_heads, cfg.head_dim)
    zeros = lambda: constrain(jnp.zeros(shape, jnp.dtype(cfg.dtype)), CACHE_LBSKH)
    return {"k": zeros(), "v": zeros()}


def forward_cached(params: dict, tokens_BT, cache: dict, index, pos_BT, mask_BTS,
                   cfg: ModelConfig):
    """Logits of T new tokens at columns index..index+T-1 of a preallocated KV cache
    [L, B, S, K, H], and the cache with their keys and values written in. Prefill is T = the
    prompt width at index 0; each decode step is T = 1."""
    x = _embed(params, tokens_BT, cfg)
    inv_freq = rope_inv_freq(cfg)

    def layer(x, xs):
        lp, k, v = xs
        x, (k, v) = block(x, lp, pos_BT, inv_freq, cfg, mask_BTS, (k, v), index)
        return x, (k, v)

    xs = (params["layers"], cache["k"], cache["v"])
    if cfg.scan_layers:
        x, (k, v) = jax.lax.scan(layer, x, xs)
    else:
        kvs = []
        for i in range(cfg.n_layers):
            x, kv = layer(x, jax.tree.map(lambda a: a[i], xs))
            kvs.append(kv)
        k, v = (jnp.stack([kv[j] for kv in kvs]) for j in (0, 1))
    h = rms_norm(x, params["final_norm"], cfg.norm_eps)
    return logits_of(params, h, cfg), {"k": constrain(k, CACHE_LBSKH),
                                       "v": constrain(v, CACHE_LBSKH)}


# ----------------------------------------------------------------------------------------------
# 4. Rollouts: prefill, then decode with the KV cache until EOS or the token budget
# ----------------------------------------------------------------------------------------------

MASKED = -1e30  # finite: exp() underflows to 0 and 0 * MASKED stays 0 (entropy is NaN-free)


def policy_logits(logits_BV, temperature, n_valid: int):
    """The sampling policy's logits: ids past the tokenizer's vocabulary (the model's may be
    padded) are impossible, and the temperature divides. The loss scores tokens under this
    same distribution, so rollout-time and training-time log-probs are comparable."""
    z = logits_BV / temperature
    return jnp.where(jnp.arange(z.shape[-1]) < n_valid, z, MASKED)


def sample(key, z_BV, temperature, top_k: int, top_p: float):
    """One token per row from policy logits z; argmax where temperature == 0.

    top-k keeps the k largest logits; top-p (Holtzman et al. 2020) keeps the smallest set of
    most likely tokens whose mass reaches p: a token stays if the mass before it is < p.
    """
    if top_k > 0:
        kth = jax.lax.top_k(z_BV, top_k)[0][:, -1:]
        z_BV = jnp.where(z_BV < kth, MASKED, z_BV)
    if top_p < 1.0:
        desc_BV = -jnp.sort(-z_BV, axis=-1)
        p_BV = jax.nn.softmax(desc_BV, axis=-1)
        n_keep = jnp.sum(jnp.cumsum(p_BV, axis=-1) - p_BV < top_p, axis=-1, keepdims=True)
        z_BV = jnp.where(z_BV < jnp.take_along_axis(desc_BV, n_keep - 1, axis=-1), MASKED, z_BV)
    drawn = jax.random.categorical(key, z_BV, axis=-1)
    return jnp.where(temperature > 0, drawn, jnp.argmax(z_BV, axis=-1)).astype(jnp.int32)


def rollout(params, prompt_BP, valid_BP, key, temperature, *, cfg: ModelConfig, max_new: int,
            eos_id: int, pad_id: int, n_valid: int, top_k: int = 0, top_p: float = 1.0):
    """Complete every row of a left-padded prompt batch; runs whole on the device.

    Returns completion ids [B, N] (pad after EOS), their mask (True up to and including EOS),
    the log-probs of the drawn tokens under the temperature-scaled policy (the "old" policy of
    the importance ratio; top-k/top-p truncation is a sampling device, not part of the
    policy being optimised, as in TRL), and the number of decode steps run.
    `temperature` is traced: the greedy eval (0) and the sampled rollouts share one compile.
    """
    B, Pw = prompt_BP.shape
    S = Pw + max_new
    valid_BS = jnp.concatenate([valid_BP, jnp.ones((B, max_new), bool)], axis=1)
    pos_BS = padded_positions(valid_BS)
    logits_BPV, cache = forward_cached(params, prompt_BP, init_cache(cfg, B, S), 0,
                                       pos_BS[:, :Pw], padded_mask(valid_BS, 0, Pw), cfg)
    safe_t = jnp.where(temperature > 0, temperature, 1.0)

    def cond(c):
        return (c["i"] < max_new) & ~jnp.all(c["done_B"])

    def body(c):
        i = c["i"]
        key, sub = jax.random.split(c["key"])
        z_BV = policy_logits(c["logits_BV"], safe_t, n_valid)
        tok_B = sample(sub, z_BV, temperature, top_k, top_p)
        logp_B = jnp.take_along_axis(jax.nn.log_softmax(z_BV, axis=-1), tok_B[:, None], -1)[:, 0]
        live_B = ~c["done_B"]
        tok_B = jnp.where(live_B, tok_B, pad_id)
        col = Pw + i
        logits_B1V, cache = forward_cached(
            params, tok_B[:, None], c["cache"], col,
            jax.lax.dynamic_slice_in_dim(pos_BS, col, 1, axis=1), padded_mask(valid_BS, col, 1),
            cfg)
        return {"i": i + 1, "key": key, "cache": cache, "logits_BV": logits_B1V[:, 0],
                "done_B": c["done_B"] | (tok_B == eos_id),
                "tokens_BN": c["tokens_BN"].at[:, i].set(tok_B),
                "mask_BN": c["mask_BN"].at[:, i].set(live_B),
                "logp_BN": c["logp_BN"].at[:, i].set(jnp.where(live_B, logp_B, 0.0))}

    init = {"i": jnp.zeros((), jnp.int32), "key": key, "cache": cache,
            "logits_BV": logits_BPV[:, -1], "done_B": jnp.zeros((B,), bool),
            "tokens_BN": jnp.full((B, max_new), pad_id, jnp.int32),
            "mask_BN": jnp.zeros((B, max_new), bool),
            "logp_BN": jnp.zeros((B, max_new), jnp.float32)}
    out = jax.lax.while_loop(cond, body, init)
    return {k: out[k] for k in ("tokens_BN", "mask_BN", "logp_BN")} | {"steps": out["i"]}


def completion_logps(params, prompt_BP, valid_BP, completion_BN, cfg: ModelConfig,
                     temperature: float, n_valid: int):
    """Log-probs [B, N] of the completion tokens and the policy's entropy at each, from one
    forward over prompt + completion. Only the N completion positions are unembedded: the
    [B, T, V] logits of the prompt are never made."""
    Pw = prompt_BP.shape[1]
    tokens_BT = jnp.concatenate([prompt_BP, completion_BN], axis=1)[:, :-1]
    valid_BT = jnp.concatenate([valid_BP, jnp.ones_like(completion_BN, bool)], axis=1)[:, :-1]
    h_BTD = hidden(params, tokens_BT, cfg, padded_positions(valid_BT),
                   padded_mask(valid_BT, 0, tokens_BT.shape[1]))
    z_BNV = policy_logits(logits_of(params, h_BTD[:, Pw - 1:], cfg), temperature, n_valid)
    logp_BNV = jax.nn.log_softmax(z_BNV, axis=-1)
    logp_BN = jnp.take_along_axis(logp_BNV, completion_BN[..., None], axis=-1)[..., 0]
    entropy_BN = -jnp.sum(jnp.exp(logp_BNV) * logp_BNV, axis=-1)
    return logp_BN, entropy_BN


# ----------------------------------------------------------------------------------------------
# 5. Task, tokenizer and rewards
# ----------------------------------------------------------------------------------------------


class CharTokenizer:
    """One token per character of "0123456789+= ", plus pad, begin and end of sequence.

    Why characters and not a trained sentencepiece model: the task's text is digits, '+' and
    '='; BPE would merge digit runs into pieces of varying length, so the model would have to
    learn how each piece spells its digits before it could add them. With one digit per token
    the columns of the sum line up token for token, 16 ids split over any power-of-two tensor
    axis, and nothing has to be trained or downloaded. (--init-from and --init-from-hf use the
    model's own tokenizer instead: the weights only understand that one.)
    """
    SYMBOLS = ("<pad>", "<bos>", "<eos>") + tuple("0123456789+= ")
    pad_id, bos_id, eos_id = 0, 1, 2
    vocab_size = len(SYMBOLS)
    _ids = {c: i for i, c in enumerate(SYMBOLS) if len(c) == 1}

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the task's vocabulary "
                             f"{''.join(self.SYMBOLS[3:])!r}") from None

    def decode(self, ids) -> str:
        return "".join(self.SYMBOLS[i] for i in ids if i > self.eos_id)

    def prompt(self, text: str) -> list[int]:
        return [self.bos_id] + self.encode(text)


class PretrainedTokenizer:
    """The tokenizer a pretrained model came with: a train_dense.py run's (--init-from) or a
    HuggingFace folder's (--init-from-hf), sentencepiece or tokenizer.json, through
    common/data.py's open_tokenizer. `start_id` is the token after which the model saw a
    document begin, and each prompt begins with it."""

    def __init__(self, path: str, eos_id: int, start_id: int):
        self._sp = open_tokenizer(path)
        self.vocab_size, self.eos_id, self.start_id = self._sp.get_piece_size(), eos_id, start_id
        self.pad_id = 0  # never read: pads are masked out of attention and the loss

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def prompt(self, text: str) -> list[int]:
        return [self.start_id] + self.encode(text)


def problems(rng: np.random.Generator, n: int, t: TaskConfig) -> list[tuple[str, str]]:
    """n (prompt, answer) pairs: "a+b=" and the digits of a+b reversed."""
    out = []
    for _ in range(n):
        a, b = (int(rng.integers(10 ** (d - 1) if d > 1 else 0, 10 ** d))
                for d in rng.integers(t.min_digits, t.max_digits + 1, size=2))
        out.append((f"{a}+{b}=", str(a + b)[::-1]))
    return out


def prompt_width(t: TaskConfig) -> int:
    """Columns of every prompt batch: the longest prompt's characters, a begin token, and one
    more for a tokenizer's leading-space piece. Fixed, so every batch has one shape."""
    return 2 * t.max_digits + 2 + 2


def longest_answers(t: TaskConfig) -> list[str]:
    top = 10 ** t.max_digits - 1
    return [str(top + top)[::-1], str(top + 1)[::-1]]


def encode_prompts(tok, texts: list[str], width: int):
    """Left-padded ids [B, width] and their validity mask: every row ends at the same column,
    so generation starts at one column for the whole batch."""
    ids = np.full((len(texts), width), tok.pad_id, np.int32)
    valid = np.zeros((len(texts), width), bool)
    for r, text in enumerate(texts):
        p = tok.prompt(text)
        if len(p) > width:
            raise ValueError(f"prompt {text!r} is {len(p)} tokens, more than the width {width}")
        ids[r, width - len(p):], valid[r, width - len(p):] = p, True
    return ids, valid


def encode_completions(tok, texts: list[str], width: int):
    """Right-padded ids [B, width] of text + EOS, and the mask of those tokens."""
    ids = np.full((len(texts), width), tok.pad_id, np.int32)
    mask = np.zeros((len(texts), width), bool)
    for r, text in enumerate(texts):
        c = (tok.encode(text) + [tok.eos_id])[:width]
        ids[r, :len(c)], mask[r, :len(c)] = c, True
    return ids, mask


def decode_completions(tok, tokens_BN: np.ndarray, mask_BN: np.ndarray):
    """Text of each completion (without its EOS) and whether it ended with EOS."""
    texts, finished = [], np.zeros(len(tokens_BN), bool)
    for r in range(len(tokens_BN)):
        ids = tokens_BN[r, mask_BN[r]].tolist()
        finished[r] = bool(ids) and ids[-1] == tok.eos_id
        texts.append(tok.decode(ids[:-1] if finished[r] else ids))
    return texts, finished


# Reward functions: plain Python over decoded text, one float per completion, as TRL's
# `reward_funcs` (completions, **columns) -> list[float]. Each is logged as rewards/<name>.

def correctness_reward(completions: list[str], *, answers: list[str], **_) -> np.ndarray:
    """1 if the completion is exactly the reversed sum (surrounding spaces aside), else 0."""
    return np.array([float(c.strip() == a) for c, a in zip(completions, answers)], np.float32)


def format_reward(completions: list[str], *, finished: np.ndarray, **_) -> np.ndarray:
    """1 if the completion is digits only and stopped by itself (EOS within the budget)."""
    return np.array([float(bool(f) and re.fullmatch(r"\s*[0-9]+\s*", c) is not None)
                     for c, f in zip(completions, finished)], np.float32)


def reward_funcs(g: GRPOConfig) -> dict[str, tuple[Callable, float]]:
    return {"correctness": (correctness_reward, 1.0), "format": (format_reward, g.format_weight)}


def score(funcs, completions, answers, finished) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Total reward sum_f w_f r_f per completion, and each function's unweighted rewards."""
    each = {n: f(completions, answers=answers, finished=finished) for n, (f, _) in funcs.items()}
    total = sum(w * each[n] for n, (_, w) in funcs.items())
    return total.astype(np.float32), each


# ----------------------------------------------------------------------------------------------
# 6. Advantages, loss and train step
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


def policy_loss(logp_BN, old_BN, adv_B, mask_BN, g: GRPOConfig, *, ref_BN=None,
                n_tokens=None):
    """The clipped surrogate, aggregated as `g.loss` says. Returns (loss, sums) where sums
    holds the masked sums of the per-token diagnostics (exact under gradient accumulation).

    Per token, with ratio r = pi/pi_old and eps_low/eps_high from `clip_range`:
        l_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta * KL_t
    GSPO replaces r by the sequence ratio s_i = exp(mean_t log r_t) (Zheng et al. 2025,
    eq. 7), the geometric mean of the token ratios, for every token of sequence i.
    `n_tokens`: DAPO's normaliser, the completion tokens of the whole rollout batch.
    """
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
    adv = jnp.broadcast_to(adv_BN, m.shape)
    low = (ratio < 1 - lo) & (adv < 0)    # clipped from below: the min chose the clip
    high = (ratio > 1 + hi) & (adv > 0)
    sums |= {"clip_ratio/low_mean": jnp.sum(low * m), "clip_ratio/high_mean": jnp.sum(high * m),
             "clip_ratio/region_mean": jnp.sum((low | high) * m), "tokens": jnp.sum(m)}
    return loss, sums


def grpo_loss(params, batch: dict, cfg: Config, n_valid: int):
    logp_BN, entropy_BN = completion_logps(params, batch["prompt"], batch["prompt_valid"],
                                           batch["completion"], cfg.model, cfg.grpo.temperature,
                                           n_valid)
    loss, sums = policy_loss(logp_BN, batch["old_logp"], batch["adv"], batch["mask"], cfg.grpo,
                             ref_BN=batch.get("ref_logp"), n_tokens=batch["n_tokens"])
    sums["entropy"] = jnp.sum(entropy_BN * batch["mask"])
    return loss, sums


def schedule(lr: float, warmup: int):
    """Linear warmup to `lr`, then constant; step 0 already gets lr / warmup."""
    warmup = max(warmup, 1)
    base = optax.join_schedules([optax.linear_schedule(0.0, lr, warmup),
                                 optax.constant_schedule(lr)], [warmup])
    return lambda s: base(s + 1)


DECAYED = {"embed", "unembed", "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}


def make_optimizer(lr: float, warmup: int, g: GRPOConfig):
    """AdamW with global-norm clipping, built exactly as train_dense.py builds it, so that a
    dense checkpoint's optimiser state has the tree this file expects (--init-from)."""
    mask = lambda params: {k: (jax.tree.map(lambda _: k in DECAYED, v) if k != "layers" else
                               {n: n in DECAYED for n in v}) for k, v in params.items()}
    return optax.chain(optax.clip_by_global_norm(g.clip_norm),
                       optax.adamw(schedule(lr, warmup), g.b1, g.b2, weight_decay=g.weight_decay,
                                   mask=mask))


def grpo_optimizer(cfg: Config):
    return make_optimizer(cfg.grpo.lr, cfg.grpo.warmup_steps, cfg.grpo)


def split_rows(x, M: int):
    """[B, ...] -> [M, B/M, ...]; microbatch m takes rows m, m+M, ...: each device keeps its
    own rows of every microbatch, so the split moves no data between devices."""
    y = x.reshape(x.shape[0] // M, M, *x.shape[1:]).swapaxes(0, 1)
    return constrain(y, P(None, BATCH_AXES, *([None] * (x.ndim - 1))))


def compute_grads(params, batch: dict, cfg: Config, n_valid: int):
    """Gradient of the loss over the rollout batch, accumulated over microbatches."""
    M = cfg.grpo.microbatches
    grad_fn = jax.grad(partial(grpo_loss, cfg=cfg, n_valid=n_valid), has_aux=True)
    if M == 1:
        return grad_fn(params, batch)
    rows = {k: v for k, v in batch.items() if k != "n_tokens"}
    # DAPO divides by the whole batch's tokens; the mean over M microbatches below divides
    # by M again, so each microbatch is handed n_tokens / M.
    shared = {"n_tokens": batch["n_tokens"] / M}

    def acc(carry, mb):
        g, s = grad_fn(params, mb | shared)
        return (jax.tree.map(jnp.add, carry[0], g), jax.tree.map(jnp.add, carry[1], s)), None

    shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[::M], rows) | shared)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    (g, sums), _ = jax.lax.scan(acc, zeros, jax.tree.map(lambda x: split_rows(x, M), rows))
    return jax.tree.map(lambda x: x / M, g), sums


def train_step(state: dict, batch: dict, *, cfg: Config, n_valid: int):
    """One optimiser step on a rollout batch; returns the new state and metrics."""
    tx = grpo_optimizer(cfg)
    grads, sums = compute_grads(state["params"], batch, cfg, n_valid)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    n = jnp.maximum(sums.pop("tokens"), 1.0)
    metrics = {k: v / n for k, v in sums.items()}
    metrics |= {"grad_norm": optax.tree.norm(grads),
                "learning_rate": schedule(cfg.grpo.lr, cfg.grpo.warmup_steps)(state["step"])}
    return state | {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


def reference_logps(ref_params, batch: dict, *, cfg: Config, n_valid: int):
    return completion_logps(ref_params, batch["prompt"], batch["prompt_valid"],
                            batch["completion"], cfg.model, cfg.grpo.temperature, n_valid)[0]


def sft_step(state: dict, batch: dict, *, cfg: Config, n_valid: int):
    """Warm start: cross-entropy on the answer tokens (and EOS) of correct examples."""
    tx = make_optimizer(cfg.warm.lr, cfg.warm.warmup_steps, cfg.grpo)

    def loss_fn(params):
        logp_BN, _ = completion_logps(params, batch["prompt"], batch["prompt_valid"],
                                      batch["completion"], cfg.model, 1.0, n_valid)
        m = batch["mask"].astype(jnp.float32)
        return -jnp.sum(logp_BN * m) / jnp.sum(m)

    loss, grads = jax.value_and_grad(loss_fn)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
            "step": state["step"] + 1}, loss


def state_shardings(cfg: Config, mesh, tx, with_ref: bool) -> dict:
    """Shardings of {params, opt_state, step[, ref]}: Adam's moments follow their parameter."""
    p_sh = named(mesh, param_specs(cfg.model))
    abstract = jax.eval_shape(partial(_init, cfg.model), jax.random.key(0))
    replicated = NamedSharding(mesh, P())
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, abstract), p_sh,
                                   transform_non_params=lambda _: replicated)
    out = {"params": p_sh, "opt_state": opt_sh, "step": replicated}
    return out | {"ref": p_sh} if with_ref else out


def abstract_state(cfg: Config, tx, shardings: dict) -> dict:
    """The state's shapes, dtypes and target shardings, with nothing allocated."""
    def make(key):
        params = _init(cfg.model, key)
        s = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
        return s | {"ref": params} if "ref" in shardings else s
    shapes = jax.eval_shape(make, jax.random.key(0))
    return jax.tree.map(lambda s, d: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=d),
                        shapes, shardings)


# ----------------------------------------------------------------------------------------------
# 7. Main
# ----------------------------------------------------------------------------------------------


def log(*a, **kw):
    if multislice.is_main_process():
        print(*a, **kw, flush=True)


def put(x: np.ndarray, mesh):
    """A host array every process holds whole -> a batch-sharded global array."""
    spec = P(BATCH_AXES, *([None] * (x.ndim - 1)))
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda i: x[i])


def fetch(x) -> np.ndarray:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def dense_run_config(run_dir: str) -> dict:
    return read_run_config(run_dir, "--init-from", trained=True)


def resolve_init_from(cfg: Config) -> Config:
    """With --init-from, the model is the dense run's; with --init-from-hf, the one that the
    folder's config.json describes. How to compute stays this run's either way."""
    if cfg.init_from and cfg.init_from_hf:
        raise ConfigError(f"--init-from {cfg.init_from} and --init-from-hf {cfg.init_from_hf}: "
                          "start from one or the other.")
    if cfg.init_from_hf:
        saved = dataclasses.asdict(config_from_hf(
            hf.read_config(cfg.init_from_hf), os.path.join(cfg.init_from_hf, hf.CONFIG)))
    elif cfg.init_from:
        saved = dense_run_config(cfg.init_from).get("model", {})
    else:
        return cfg
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    if set(saved) - known:
        raise ConfigError(f"--init-from {cfg.init_from}: its model has fields this file does not "
                          f"know ({sorted(set(saved) - known)}); was it written by train_dense.py?")
    arch = {k: v for k, v in saved.items() if k not in COMPUTE_FIELDS}
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **arch))


def make_tokenizer(cfg: Config):
    if cfg.init_from_hf:
        return hf_tokenizer(cfg.init_from_hf)
    if cfg.init_from:
        # Pre-training or SFT: the file the dense run (or the run it fine-tuned) tokenized with.
        path = run_tokenizer(cfg.init_from, dense_run_config)
        eos = open_tokenizer(path).eos_id()
        # The dense model saw documents separated by EOS: after one, a document begins.
        return PretrainedTokenizer(path, eos, eos)
    return CharTokenizer()


def load_dense_params(cfg: Config, mesh) -> dict:
    """The parameters of the latest checkpoint of a train_dense.py run, sharded for this mesh.
    Its state is {params, opt_state, step} with train_dense's AdamW; only params are kept."""
    tx = make_optimizer(1.0, 1, cfg.grpo)
    sh = state_shardings(cfg, mesh, tx, with_ref=False)
    with Checkpointer(cfg.init_from, CheckpointConfig(async_save=False)) as ckpt:
        step = ckpt.latest_step()
        if step is None:
            raise CheckpointError(f"--init-from {cfg.init_from}: no complete checkpoint in "
                                  f"{cfg.init_from}/checkpoints; train it first.")
        state = ckpt.restore(step, abstract_state(cfg, tx, sh))
    log(f"initialised from {cfg.init_from}/checkpoints/{step} (train_dense.py)")
    return state["params"]


def main(cfg: Config) -> dict:
    multislice.initialize()
    multislice.enable_compilation_cache()
    observe.configure(quiet=cfg.quiet)
    cfg = resolve_init_from(cfg)
    tok = make_tokenizer(cfg)
    validate(cfg, jax.device_count(), tok)
    mesh = make_mesh(cfg.mesh)
    lo, hi = clip_range(cfg.grpo)
    log(f"model {count_params(cfg.model) / 1e6:.2f}M parameters | mesh {describe(mesh)} | "
        f"{jax.device_count()} {jax.devices()[0].platform} devices | loss {cfg.grpo.loss} "
        f"(clip {1 - lo:g}..{1 + hi:g}, beta {cfg.grpo.beta:g}, mu {cfg.grpo.mu}, "
        f"{'std-scaled' if cfg.grpo.scale_rewards else 'mean-centred'} advantages)")
    run_path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    if multislice.is_main_process():
        check_run_config(cfg.run_dir, dataclasses.asdict(cfg), MAY_CHANGE)
    # Closed in reverse: the last save is waited for (and raises if it failed) first.
    with jax.set_mesh(mesh), \
            observe.MetricsLog(cfg.run_dir, dataclasses.asdict(cfg)) as metrics_log, \
            observe.Profiler(cfg.run_dir, cfg.grpo.profile_steps) as profiler, \
            Checkpointer(cfg.run_dir, cfg.checkpoint) as ckpt:
        return Trainer(cfg, mesh, tok, ckpt, metrics_log, profiler).run()


class Trainer:
    """The host loop. Everything per-token runs in the four jitted functions built here."""

    def __init__(self, cfg: Config, mesh, tok, ckpt: Checkpointer,
                 metrics_log: observe.MetricsLog, profiler: observe.Profiler):
        self.cfg, self.mesh, self.tok, self.ckpt = cfg, mesh, tok, ckpt
        self.metrics_log, self.profiler = metrics_log, profiler
        g, n_valid = cfg.grpo, tok.vocab_size
        self.width = prompt_width(cfg.task)
        self.funcs = reward_funcs(g)
        self.tx = grpo_optimizer(cfg)
        self.shardings = state_shardings(cfg, mesh, self.tx, with_ref=g.beta > 0)
        self.rollout_fn = jax.jit(partial(
            rollout, cfg=cfg.model, max_new=g.max_new_tokens, eos_id=tok.eos_id,
            pad_id=tok.pad_id, n_valid=n_valid, top_k=g.top_k, top_p=g.top_p))
        self.step_fn = jax.jit(partial(train_step, cfg=cfg, n_valid=n_valid), donate_argnums=0,
                               out_shardings=(self.shardings, None))
        self.ref_fn = jax.jit(partial(reference_logps, cfg=cfg, n_valid=n_valid))
        eval_rng = np.random.default_rng([cfg.task.eval_seed])
        self.eval_problems = problems(eval_rng, cfg.task.eval_prompts, cfg.task)
        self.summary = {"eval": []}

    # -- pieces ---------------------------------------------------------------------------

    def generate(self, params, items: list[tuple[str, str]], key, temperature: float):
        """Roll out one completion per (prompt, answer) and score it; returns host arrays."""
        ids, valid = encode_prompts(self.tok, [p for p, _ in items], self.width)
        t0 = time.perf_counter()
        out = self.rollout_fn(params, put(ids, self.mesh), put(valid, self.mesh), key,
                              jnp.float32(temperature))
        tokens, mask = fetch(out["tokens_BN"]), fetch(out["mask_BN"])
        seconds = time.perf_counter() - t0
        texts, finished = decode_completions(self.tok, tokens, mask)
        total, each = score(self.funcs, texts, [a for _, a in items], finished)
        return {"out": out, "prompt": ids, "valid": valid, "texts": texts, "finished": finished,
                "tokens": tokens, "mask": mask, "reward": total, "rewards": each,
                "seconds": seconds}

    def evaluate(self, params) -> dict:
        """Greedy completions of the fixed held-out prompts."""
        r = self.generate(params, self.eval_problems, jax.random.key(0), 0.0)
        self.last_eval_texts = r["texts"]
        return {"eval_reward": float(r["reward"].mean())} | {
            f"eval_rewards/{n}/mean": float(v.mean()) for n, v in r["rewards"].items()}

    def problems_at(self, step: int, n: int, salt: int = 0):
        """The prompts of a step: a pure function of (seed, step), so a resume needs no state."""
        rng = np.random.default_rng([self.cfg.grpo.seed, salt, step])
        return problems(rng, n, self.cfg.task)

    def group_batch(self, step: int, salt: int = 0) -> list[tuple[str, str]]:
        """prompts_per_step prompts, each repeated group_size times in consecutive rows."""
        g = self.cfg.grpo
        return [p for p in self.problems_at(step, g.prompts_per_step, salt)
                for _ in range(g.group_size)]

    def record(self, rec: dict) -> None:
        if "warm_step" in rec:  # counted in its own steps: in TensorBoard, a run of its own
            self.metrics_log.write(rec, step_key="warm_step", run="warm_start")
        else:
            self.metrics_log.write(rec)

    # -- warm start -----------------------------------------------------------------------

    def warm_start(self, params):
        """SFT on correct examples until the sampled reward reaches the target."""
        cfg, w = self.cfg, self.cfg.warm
        tx = make_optimizer(w.lr, w.warmup_steps, cfg.grpo)
        sh = state_shardings(cfg, self.mesh, tx, with_ref=False)
        state = jax.jit(lambda p: {"params": p, "opt_state": tx.init(p),
                                   "step": jnp.zeros((), jnp.int32)}, out_shardings=sh)(params)
        step_fn = jax.jit(partial(sft_step, cfg=cfg, n_valid=self.tok.vocab_size),
                          donate_argnums=0, out_shardings=(sh, None))
        t0, losses = time.perf_counter(), []
        for i in range(w.max_steps):
            items = self.problems_at(i, w.batch_size, salt=1)
            prompt, valid = encode_prompts(self.tok, [p for p, _ in items], self.width)
            comp, mask = encode_completions(self.tok, [a for _, a in items],
                                            cfg.grpo.max_new_tokens)
            batch = {k: put(v, self.mesh) for k, v in (("prompt", prompt), ("prompt_valid", valid),
                                                        ("completion", comp), ("mask", mask))}
            state, loss = step_fn(state, batch)
            losses.append(loss)
            if (i + 1) % w.check_every == 0 or i + 1 == w.max_steps:
                # Distinct prompts, as many as a rollout batch has rows (the same compile).
                rows = cfg.grpo.prompts_per_step * cfg.grpo.group_size
                r = self.generate(state["params"], self.problems_at(i, rows, salt=2),
                                  jax.random.fold_in(jax.random.key(cfg.grpo.seed + 1), i),
                                  cfg.grpo.temperature)
                reward = float(r["reward"].mean())
                sft_loss = float(np.mean(jax.device_get(losses)))
                losses = []
                log(f"warm start step {i + 1} | sft_loss {sft_loss:.3f} | sampled reward "
                    f"{reward:.3f} (target {w.target_reward}) | {time.perf_counter() - t0:.0f} s")
                self.record({"warm_step": i + 1, "sft_loss": sft_loss, "reward": reward})
                if reward >= w.target_reward:
                    break
        self.summary["warm_start_steps"] = i + 1
        self.summary["warm_start_s"] = time.perf_counter() - t0
        return state["params"]

    def initial_state(self):
        cfg = self.cfg
        if cfg.init_from_hf:
            _, params = load_hf(cfg.init_from_hf, self.mesh)
            log(f"initialised from {cfg.init_from_hf} (HuggingFace)")
        elif cfg.init_from:
            params = load_dense_params(cfg, self.mesh)
        else:
            params = init_params(cfg.model, jax.random.key(cfg.grpo.seed), self.mesh)
        if cfg.warm.max_steps > 0:
            params = self.warm_start(params)
        tx, with_ref = self.tx, cfg.grpo.beta > 0

        def make(p):
            s = {"params": p, "opt_state": tx.init(p), "step": jnp.zeros((), jnp.int32)}
            # The reference is a copy, not an alias: the policy's buffers are donated.
            return s | {"ref": jax.tree.map(jnp.copy, p)} if with_ref else s
        return jax.jit(make, out_shardings=self.shardings)(params)

    # -- GRPO -----------------------------------------------------------------------------

    def run(self) -> dict:
        cfg, g = self.cfg, self.cfg.grpo
        t_start = time.perf_counter()
        start = self.ckpt.resume_step()
        if start is None:
            state, start = self.initial_state(), 0
            # Saved at once: a resume never repeats the warm start.
            self.ckpt.save(0, state, force=True)
        else:
            state = self.ckpt.restore(start, abstract_state(cfg, self.tx, self.shardings))
            log(f"resumed from step {start} ({cfg.run_dir}/checkpoints/{start})")
        ev = self.evaluate(state["params"])
        self.summary["eval"].append((start, ev["eval_reward"]))
        log(f"eval step {start} | held-out reward {ev['eval_reward']:.3f} (greedy, "
            f"{len(self.eval_problems)} prompts)")
        self.record({"step": start} | ev)
        if start >= g.steps:
            log(f"already at step {start} of --grpo.steps {g.steps}: nothing to train (raise "
                "--grpo.steps to continue)")
        rollout_tokens, rollout_s = 0, 0.0
        t_loop = time.perf_counter()
        stop_vote = None  # did any process get SIGTERM? read one step late, as train_dense does
        with PreemptionGuard() as guard:
            for step in range(start, g.steps):
                t0 = time.perf_counter()
                self.profiler.before(step + 1)
                items = self.group_batch(step)
                r = self.generate(state["params"], items,
                                  jax.random.fold_in(jax.random.key(g.seed), step), g.temperature)
                lengths = r["mask"].sum(axis=1)
                rollout_tokens += int(lengths.sum())
                rollout_s += r["seconds"]
                adv = group_advantages(r["reward"], g.group_size, g.scale_rewards)
                batch = {"prompt": put(r["prompt"], self.mesh),
                         "prompt_valid": put(r["valid"], self.mesh),
                         "completion": r["out"]["tokens_BN"], "mask": r["out"]["mask_BN"],
                         "old_logp": r["out"]["logp_BN"], "adv": put(adv, self.mesh),
                         "n_tokens": jnp.float32(lengths.sum())}
                if g.beta > 0:
                    batch["ref_logp"] = self.ref_fn(state["ref"], batch)
                passes = []
                for _ in range(g.mu):
                    state, m = self.step_fn(state, batch)
                    passes.append(m)
                # Fetched at once: the next rollout needs these parameters anyway, so there is
                # nothing for the host to overlap with.
                m = {k: float(np.mean([p[k] for p in jax.device_get(passes)])) for k in passes[0]}
                done = step + 1
                self.profiler.after(done, state)
                rec = {"step": done, "reward": float(r["reward"].mean()),
                       "reward_std": float(r["reward"].std(ddof=1))}
                for n, v in r["rewards"].items():
                    rec |= {f"rewards/{n}/mean": float(v.mean()),
                            f"rewards/{n}/std": float(v.std(ddof=1))}
                stds = r["reward"].reshape(-1, g.group_size).std(axis=1)
                rec |= {"frac_reward_zero_std": float(np.mean(stds == 0)),
                        "completions/mean_length": float(lengths.mean()),
                        "completions/max_length": int(lengths.max()),
                        "completions/min_length": int(lengths.min()),
                        "completions/clipped_ratio": float(np.mean(~r["finished"]))} | m
                rec["rollout_tokens_per_s"] = float(lengths.sum() / r["seconds"])
                rec["ms_per_step"] = 1e3 * (time.perf_counter() - t0)
                if done % g.eval_every == 0 or done == g.steps:
                    rec |= self.evaluate(state["params"])
                    self.summary["eval"].append((done, rec["eval_reward"]))
                if done % g.log_every == 0 or done == g.steps or "eval_reward" in rec:
                    self.log_step(rec)
                self.record(rec)
                stop = stop_vote is not None and bool(jax.device_get(stop_vote))  # same everywhere
                stop_vote = multislice.any_process(guard.requested)
                if self.ckpt.save(done, state, force=done == g.steps or stop):
                    self.metrics_log.checkpointed()
                if stop:
                    log(f"SIGTERM: saved step {done}, exiting")
                    break
        loop_s = time.perf_counter() - t_loop
        self.ckpt.wait()
        for (p, a), c in zip(self.eval_problems[:4], self.last_eval_texts):
            log(f"  {p}{c:<6} (expected {a})")
        self.summary |= {"state": state, "final_step": int(jax.device_get(state["step"])) // g.mu,
                         "rollout_tokens_per_s": rollout_tokens / max(rollout_s, 1e-9)}
        self.print_summary(start, rollout_tokens, rollout_s, loop_s,
                           time.perf_counter() - t_start)
        return self.summary

    def print_summary(self, start: int, rollout_tokens: int, rollout_s: float, loop_s: float,
                      wall_s: float) -> None:
        """The run on one screen: how far it got, how well, how fast, and where its files are."""
        g, s, fmt = self.cfg.grpo, self.summary, observe.fmt
        end, evals = s["final_step"], s["eval"]
        best = max(evals, key=lambda e: e[1])
        steps = [r for r in self.metrics_log.records if "reward" in r and "step" in r]
        last = steps[-1] if steps else {}
        timing = observe.duration(wall_s)
        if "warm_start_s" in s:
            timing += (f" (warm start {observe.duration(s['warm_start_s'])} over "
                       f"{s['warm_start_steps']} steps)")
        ms = observe.mean_ms_per_step(self.metrics_log.records, start)
        kl = f" | kl {last['kl']:.4f}" if "kl" in last else ""
        observe.print_summary(f"run {self.cfg.run_dir}: done", [
            ("steps", f"{start} -> {end} ({end - start} this run, of --grpo.steps {g.steps}; "
                      f"{g.prompts_per_step} prompts x {g.group_size} completions, {g.mu} "
                      f"pass(es) each)"),
            ("tokens", f"{rollout_tokens:,} completion tokens sampled this run"),
            ("held-out", f"reward {evals[0][1]:.3f} (step {evals[0][0]}) -> {evals[-1][1]:.3f} "
                         f"(step {evals[-1][0]}) | best {best[1]:.3f} (step {best[0]}), greedy"),
            ("last step", f"reward {fmt(last.get('reward'))}{kl} | clip "
                          f"{fmt(last.get('clip_ratio/region_mean'))} | length "
                          f"{fmt(last.get('completions/mean_length'), '.1f')}"),
            ("wall time", timing),
            ("throughput", f"rollouts {rollout_tokens / max(rollout_s, 1e-9):.0f} tok/s | "
                           f"{fmt(ms, '.0f')} ms/step (mean over steps after the first) | "
                           f"steps {observe.duration(loop_s)}"),
        ] + observe.where_rows(self.cfg.run_dir, self.metrics_log, self.profiler))

    def log_step(self, rec: dict) -> None:
        kl = f" | kl {rec['kl']:.4f}" if "kl" in rec else ""
        held = f" | held-out {rec['eval_reward']:.3f}" if "eval_reward" in rec else ""
        log(f"step {rec['step']} | reward {rec['reward']:.3f} ± {rec['reward_std']:.3f} | "
            f"correct {rec['rewards/correctness/mean']:.3f} | format "
            f"{rec['rewards/format/mean']:.3f}{kl} | clip {rec['clip_ratio/region_mean']:.3f} | "
            f"len {rec['completions/mean_length']:.1f}/{rec['completions/max_length']} | "
            f"entropy {rec['entropy']:.3f}{held} | {rec['rollout_tokens_per_s'] / 1e3:.1f}k "
            f"rollout tok/s | {rec['ms_per_step']:.0f} ms/step")


# ----------------------------------------------------------------------------------------------
# 8. HuggingFace in (--init-from-hf): train_dense.py's section 7, the loading half
# ----------------------------------------------------------------------------------------------

# The parameter tree is train_dense.py's, so its name mapping and config translation are too
# (tests/test_grpo_hf.py holds them equal); the file handling is common/hf.py's. HuggingFace
# rotates the two halves of each head, as `apply_rope` does: no weight needs a permutation.
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# What transformers assumes for a key that config.json leaves out (its config classes).
_HF_DEFAULTS = {
    "llama": dict(rms_norm_eps=1e-6, max_position_embeddings=2048),
    "mistral": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, num_key_value_heads=8,
                    sliding_window=4096),
    "qwen2": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=32),
    "qwen3": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=32,
                  head_dim=128),
}


def hf_mapping(cfg: ModelConfig) -> dict:
    """Our parameter tree, each leaf as (HuggingFace tensor name, layout): see common/hf.py.

    HF's nn.Linear keeps [out, in]; ours are [in, out] with the heads split out, so every
    projection is a transpose plus a reshape, and per-layer tensors stack on l.
    Atoms: l layers, d model, n query heads, k key/value heads, h head width, f MLP, v vocab.
    """
    lay = "model.layers.{l}."
    layers = {
        "attn_norm": (lay + "input_layernorm.weight", "d -> l d"),
        "wq": (lay + "self_attn.q_proj.weight", "(n h) d -> l d n h"),
        "wk": (lay + "self_attn.k_proj.weight", "(k h) d -> l d k h"),
        "wv": (lay + "self_attn.v_proj.weight", "(k h) d -> l d k h"),
        "wo": (lay + "self_attn.o_proj.weight", "d (n h) -> l n h d"),
        "mlp_norm": (lay + "post_attention_layernorm.weight", "d -> l d"),
        "w_gate": (lay + "mlp.gate_proj.weight", "f d -> l d f"),
        "w_up": (lay + "mlp.up_proj.weight", "f d -> l d f"),
        "w_down": (lay + "mlp.down_proj.weight", "d f -> l f d"),
    }
    if cfg.qkv_bias:
        layers |= {"bq": (lay + "self_attn.q_proj.bias", "(n h) -> l n h"),
                   "bk": (lay + "self_attn.k_proj.bias", "(k h) -> l k h"),
                   "bv": (lay + "self_attn.v_proj.bias", "(k h) -> l k h")}
    if cfg.qk_norm:
        layers |= {"q_norm": (lay + "self_attn.q_norm.weight", "h -> l h"),
                   "k_norm": (lay + "self_attn.k_norm.weight", "h -> l h")}
    tree = {"embed": ("model.embed_tokens.weight", "v d -> v d"), "layers": layers,
            "final_norm": ("model.norm.weight", "d -> d")}
    if not cfg.tie_embeddings:
        tree["unembed"] = ("lm_head.weight", "v d -> d v")
    return tree


def _hf_sizes(cfg: ModelConfig) -> dict:
    return dict(l=cfg.n_layers, d=cfg.d_model, n=cfg.n_heads, k=cfg.n_kv_heads, h=cfg.head_dim,
                f=cfg.d_ff, v=cfg.vocab_size)


def config_from_hf(c: dict, where: str = "config.json") -> ModelConfig:
    """Our ModelConfig from a HuggingFace config.json (as a dict). Anything that would change
    what the model computes and that we do not implement is an error, never ignored."""
    mt = c.get("model_type")
    if mt not in HF_ARCHITECTURES:
        raise hf.HFError(f"{where}: model_type {mt!r} is not a dense family that train_grpo.py "
                         f"loads ({', '.join(HF_ARCHITECTURES)}); mixture-of-experts models "
                         "(mixtral, qwen3_moe) are not trained with GRPO here.")
    c = _HF_DEFAULTS[mt] | c

    def unsupported(what: str):
        return hf.HFError(f"{where}: {what} is not implemented by train_grpo.py, so this "
                          f"{mt} model cannot be loaded faithfully.")

    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):
        if key not in c:
            raise hf.HFError(f"{where} has no {key!r}; it is not a complete {mt} config.")
    if c.get("hidden_act", "silu") != "silu":
        raise unsupported(f"hidden_act {c['hidden_act']!r} (only silu)")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise unsupported("attention_bias / mlp_bias (biases on every projection)")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise unsupported(f"partial_rotary_factor {c['partial_rotary_factor']}")
    theta, kind, rope = hf.rope_parameters(c, 10_000.0, where)
    scaling = {}
    if kind == "llama3":
        lacking = {"factor", "low_freq_factor", "high_freq_factor"} - set(rope)
        if lacking:
            raise hf.HFError(f"{where}: rope type 'llama3' without {', '.join(sorted(lacking))}.")
        scaling = dict(rope_scaling=float(rope["factor"]),
                       rope_low_freq_factor=float(rope["low_freq_factor"]),
                       rope_high_freq_factor=float(rope["high_freq_factor"]),
                       rope_original_max_len=int(rope.get("original_max_position_embeddings",
                                                          c["max_position_embeddings"])))
    elif kind != "default":
        raise unsupported(f"rope type {kind!r} (only the default and 'llama3')")
    # A sliding window of W tokens changes nothing on sequences of at most W tokens, and we
    # sample no longer ones: the window becomes the model's maximum length.
    window = (c.get("sliding_window") if mt == "mistral" or c.get("use_sliding_window")
              else None)
    max_len = c["max_position_embeddings"] if window is None else min(
        c["max_position_embeddings"], window)
    n_heads = c["num_attention_heads"]
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=c["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // n_heads, d_ff=c["intermediate_size"],
        max_seq_len=max_len, rope_theta=theta, norm_eps=float(c["rms_norm_eps"]),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)), qkv_bias=mt == "qwen2",
        qk_norm=mt == "qwen3", **scaling)


def load_hf(path: str, mesh=None) -> tuple[ModelConfig, dict]:
    """A HuggingFace folder (config.json and safetensors, one file or sharded with an index)
    as our ModelConfig and float32 parameters, each placed with its `param_specs` sharding on
    `mesh` (default: the first device). Tensors stream in block by block: see common/hf.py."""
    ckpt = hf.Checkpoint(path)
    cfg = config_from_hf(ckpt.config, os.path.join(path, hf.CONFIG))
    if mesh is None:
        mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    table = _param_table(cfg)
    flat = {k: v for k, v in table.items() if k != "layers"} | {
        f"layers/{k}": v for k, v in table["layers"].items()}
    for name, (shape, spec, _) in flat.items():
        for n, axes in zip(shape, spec):
            ways = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else
                                                     axes or ()))
            if n % ways:
                raise ConfigError(f"{path}: {name} has a dimension of {n}, which the mesh "
                                  f"({describe(mesh)}) splits {ways} ways; choose mesh sizes "
                                  "that divide the model's.")
    # Some exports keep lm_head.weight although it is tied; older ones saved rotary tables.
    ignore = lambda n: (cfg.tie_embeddings and n == "lm_head.weight") or n.endswith(
        "rotary_emb.inv_freq")
    params = hf.load(ckpt, hf_mapping(cfg), _hf_sizes(cfg), named(mesh, param_specs(cfg)),
                     what=f"{ckpt.config['model_type']} model of this config", ignore=ignore)
    return cfg, params


def hf_tokenizer(path: str) -> PretrainedTokenizer:
    """The folder's own tokenizer: GRPO decodes every completion to score it, so the words
    must be the ones the weights were trained on."""
    files = [os.path.join(path, n) for n in ("tokenizer.model", "tokenizer.json")
             if os.path.isfile(os.path.join(path, n))]
    if not files:
        raise FileNotFoundError(
            f"--init-from-hf {path} has no tokenizer.model or tokenizer.json; GRPO decodes "
            "completions to score them with the model's own tokenizer. Copy the model's "
            "tokenizer files into the folder.")
    try:  # sentencepiece first: it needs no optional package
        tok = open_tokenizer(files[0])
    except (ValueError, OSError, RuntimeError) as e:
        raise ConfigError(f"--init-from-hf {path}: cannot read {files[0]} ({e}).") from None
    eos = tok.eos_id()
    if eos < 0:  # tokenizer.json without tokenizer_config.json: config.json may still say
        ids = hf.read_config(path).get("eos_token_id")
        ids = ids if isinstance(ids, list) else [ids]  # instruct models list several
        eos = ids[0] if ids and isinstance(ids[0], int) else -1
    if eos < 0:
        raise ConfigError(f"--init-from-hf {path}: no end-of-sequence token in its tokenizer "
                          "files or config.json; rollouts stop at it, so set eos_token in "
                          "tokenizer_config.json or eos_token_id in config.json.")
    # Llama begins each document with BOS; Qwen has none and separates documents with EOS.
    start = tok.bos_id() if tok.bos_id() >= 0 else eos
    return PretrainedTokenizer(files[0], eos, start)


def refuse_shape_flags(args: list[str]) -> None:
    """A --model.* flag that sets the shape contradicts --init-from-hf: say so, do not pick."""
    if problem := hf.shape_flag_problem(args, COMPUTE_FIELDS):
        raise ConfigError(problem)


def cli(args=None) -> Config:
    import tyro
    cfg = tyro.extras.overridable_config_cli(PRESETS, args=args)
    if cfg.init_from_hf:
        refuse_shape_flags(sys.argv[1:] if args is None else args)
    return cfg


if __name__ == "__main__":
    try:
        main(cli())
    except (ConfigError, MeshError, ConfigConflictError, CheckpointError, FileNotFoundError,
            multislice.DistributedInitError, hf.HFError) as e:
        # Bad input: a one-paragraph reason and the fix, not a traceback.
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
