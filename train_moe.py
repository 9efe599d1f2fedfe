"""Mixture-of-experts decoder (Mixtral, Qwen3-MoE): dropless routing and expert parallelism.

    python train_moe.py tiny-moe                                  # the `make train-moe` run
    python train_moe.py mixtral-8x7b --mesh.expert 8 --mesh.fsdp -1
    python train_moe.py qwen3-30b-a3b --dry-run --mesh.expert 8   # compile only, print memory

Sections, in reading order: 1 config and presets, 2 parameters and their shardings, 3 model
(attention, router, dispatch to the experts, grouped matmul), 4 loss and train step, 5 FLOPs
and MFU, 6 main, 7 HuggingFace in and out (Mixtral, Qwen3-MoE). Shapes are suffixed on tensor
names: B batch, T sequence, D model width, N query heads, K key/value heads, H head width,
V vocabulary, L layers, E experts, F expert MLP width, R experts chosen per token (top-k),
A = tokens x R assignments, M rows of a grouped matmul, G groups, X experts held by one
device, P devices on the expert axis, C expert capacity.

The MoE block, per layer (Switch Transformer, Mixtral, Qwen3-MoE):

    p = softmax(h W_router)            in float32: near-ties flip on bfloat16 rounding
    experts, g = top_k(p), renormalised to sum 1 when norm_topk (Mixtral, Qwen3-MoE)
    y = sum_r g_r SwiGLU_{expert_r}(h)

Dropless (the default): the (token, expert) assignments are sorted by expert and every
expert runs on exactly its rows as one grouped matmul (`jax.lax.ragged_dot`; on the CPU a
tiled equivalent, see `grouped_mlp`). Nothing is padded to a capacity and nothing dropped.
Capacity mode (`--model.capacity-factor > 0`, GShard/MaxText): each expert takes at most
C = ceil(cf * tokens * R / E) rows per batch shard, first choices first, and the rest skip
the expert (the residual stream carries them); the dropped fraction is logged.

Expert parallelism: the experts are split over the `expert` mesh axis, which also splits
the batch. In a `shard_map`, each device sorts its own assignments by expert, sends every
peer the rows for the experts it holds (all-to-all), runs its experts, and sends the
results back (all-to-all). Data and fsdp sharding work as in the dense trainer: an expert
weight is split on d over fsdp and gathered per layer, and on its hidden width over tensor.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

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
from common.data import DataConfig, get_batch, load_dataset
from common.mesh import (BATCH_AXES, MeshConfig, MeshError, batch_shards, describe, make_mesh,
                         resolve)

# The batch is split over data and fsdp, as in the dense trainer, and over expert: the devices
# of one expert group each hold other tokens, which the all-to-all sends to their experts.
MOE_BATCH = BATCH_AXES + ("expert",)

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
    n_experts: int = 8
    top_k: int = 2                # experts per token
    d_ff: int = 256               # hidden width of each expert's SwiGLU
    norm_topk: bool = True        # renormalise the top-k weights to sum 1 (Mixtral, Qwen3-MoE)
    capacity_factor: float = 0.0  # 0 = dropless; > 0: capacity mode, tokens over capacity dropped
    max_seq_len: int = 2048
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qk_norm: bool = False         # Qwen3: RMSNorm on each head of q and k before RoPE
    # How to compute, not what: these may change when a run is resumed.
    dtype: Literal["float32", "bfloat16"] = "float32"  # activations and matmuls; weights stay f32
    attention: Literal["auto", "xla", "cudnn", "einsum"] = "auto"
    remat: Literal["full", "dots", "none"] = "full"     # what the backward pass may keep
    scan_layers: bool = True
    loss_chunk: int = 256         # sequence positions per cross-entropy chunk (bounds [B,T,V])
    grouped_matmul: Literal["auto", "ragged_dot", "tiled"] = "auto"  # auto: tiled on the CPU
    gmm_tile: int = 128           # rows per tile of the tiled grouped matmul


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 16          # global, in sequences
    seq_len: int = 256
    microbatches: int = 1         # gradient accumulation: batch_size is split into this many
    lr: float = 2e-3
    min_lr_ratio: float = 0.1     # the schedule ends at lr * min_lr_ratio
    warmup_steps: int = 30
    schedule: Literal["cosine", "constant", "wsd"] = "cosine"
    decay_fraction: float = 0.2   # wsd: the last fraction of steps decays linearly
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0
    z_loss: float = 0.0           # weight of the output mean(logsumexp^2) (PaLM); 0 = off
    load_balance_loss: float = 0.01  # weight of the Switch load-balancing loss (mean over layers)
    router_z_loss: float = 0.001  # weight of the router's mean(logsumexp^2) (ST-MoE)
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    sample_tokens: int = 96       # printed at the end; 0 = no sample
    temperature: float = 0.7      # of that sample; 0 = greedy
    sample_prompt: str = "def"    # no trailing space: sentencepiece would make it a lone "▁"
    peak_tflops: float = 0.0      # per device, for MFU; 0 = look up (TPU/GPU) or measure (CPU)
    profile_steps: tuple[int, ...] = ()  # first and last step to trace into <run_dir>/profile


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run_dir: str = "runs/tiny-moe"
    dry_run: bool = False         # compile one step on abstract inputs, print memory, exit
    bench: int = 0                # time this many steps on synthetic tokens, print, exit
    bench_twin: bool = True       # --bench also times the dense twin (same active parameters)
    quiet: bool = False           # no progress lines; steps, evals and the summary still print
    init_from_hf: str = ""        # HuggingFace folder: start from its weights and config.json


def _big(model: ModelConfig, run: str, seq_len: int = 4096) -> Config:
    return Config(model=dataclasses.replace(model, dtype="bfloat16"),
                  train=TrainConfig(steps=100_000, batch_size=256, seq_len=seq_len, lr=3e-4,
                                    warmup_steps=2000, log_every=10, eval_every=1000,
                                    sample_tokens=0, load_balance_loss=0.001),
                  checkpoint=CheckpointConfig(every=1000), run_dir=f"runs/{run}")


_QWEN3_MOE = dict(vocab_size=151936, head_dim=128, n_kv_heads=4, n_experts=128, top_k=8,
                  max_seq_len=40960, rope_theta=1_000_000.0, norm_eps=1e-6, qk_norm=True)

PRESETS: dict[str, tuple[str, Config]] = {
    # No remat: the tiny model's activations are a few MB, and recomputing them would cost a
    # third of every step on a laptop CPU.
    "tiny-moe": ("~9M parameters (4.5M active), 8 experts top-2, on the embedded corpus: the "
                 "`make train-moe` default", Config(model=ModelConfig(remat="none"))),
    "mixtral-8x7b": ("Mixtral 8x7B (8 experts, top-2)", _big(ModelConfig(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
        n_experts=8, top_k=2, d_ff=14336, max_seq_len=32768, rope_theta=1_000_000.0,
        norm_eps=1e-5), "mixtral-8x7b")),
    "qwen3-30b-a3b": ("Qwen3-30B-A3B (128 experts, top-8, q/k norm)", _big(ModelConfig(
        d_model=2048, n_layers=48, n_heads=32, d_ff=768, **_QWEN3_MOE), "qwen3-30b-a3b")),
    "qwen3-235b-a22b": ("Qwen3-235B-A22B (128 experts, top-8, q/k norm)", _big(ModelConfig(
        d_model=4096, n_layers=94, n_heads=64, d_ff=1536, **_QWEN3_MOE), "qwen3-235b-a22b")),
}

# Keys of the saved run config that a resumed run may change: how long, how often, on what
# mesh and how it computes. Anything else (the model, the routing, the optimiser) must match.
MAY_CHANGE = frozenset({
    "train.steps", "train.log_every", "train.eval_every", "train.eval_batches",
    "train.sample_tokens", "train.temperature", "train.sample_prompt", "train.peak_tflops",
    "train.microbatches", "train.profile_steps", "quiet",
    "mesh", "checkpoint", "dry_run", "bench", "bench_twin", "data.cache_dir", "run_dir",
    "model.dtype", "model.attention", "model.remat", "model.scan_layers", "model.loss_chunk",
    "model.grouped_matmul", "model.gmm_tile"})


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag and the fix."""


def validate(cfg: Config, n_devices: int) -> None:
    """Every check that needs no compilation, so a bad launch fails in a second."""
    m, t = cfg.model, cfg.train
    mesh = resolve(cfg.mesh, n_devices, max(1, math.prod(cfg.mesh.dcn())))
    if m.n_experts < 2:
        raise ConfigError(f"--model.n-experts {m.n_experts}: a mixture needs at least 2 experts; "
                          "one expert is a dense MLP, which train_dense.py trains (with "
                          "--model.d-ff for its width).")
    if not 1 <= m.top_k <= m.n_experts:
        raise ConfigError(f"--model.top-k {m.top_k} must be between 1 and --model.n-experts "
                          f"{m.n_experts}: each token picks top-k distinct experts.")
    ep = mesh.expert * mesh.dcn_expert
    if m.n_experts % ep:
        raise ConfigError(f"--mesh.expert {ep} does not divide --model.n-experts {m.n_experts}: "
                          "each device of the expert axis holds n_experts / expert whole experts; "
                          f"choose an expert axis size that divides {m.n_experts}.")
    if m.capacity_factor < 0:
        raise ConfigError(f"--model.capacity-factor {m.capacity_factor}: use 0 for dropless "
                          "routing or a positive factor (1.25 is usual) for capacity mode.")
    if m.gmm_tile < 1:
        raise ConfigError(f"--model.gmm-tile {m.gmm_tile} must be >= 1.")
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
    shards = fsdp * mesh.data * mesh.dcn_data * ep
    if t.batch_size % t.microbatches:
        raise ConfigError(f"--train.batch-size {t.batch_size} is not divisible by "
                          f"--train.microbatches {t.microbatches}.")
    if (t.batch_size // t.microbatches) % shards:
        raise ConfigError(f"--train.batch-size {t.batch_size} / --train.microbatches "
                          f"{t.microbatches} is not divisible by data x fsdp x expert = {shards} "
                          f"batch shards; use a batch size that is a multiple of "
                          f"{shards * t.microbatches}.")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"--train.seq-len {t.seq_len} exceeds the model's maximum "
                          f"--model.max-seq-len {m.max_seq_len}.")
    if t.seq_len % min(m.loss_chunk, t.seq_len):
        raise ConfigError(f"--train.seq-len {t.seq_len} is not a multiple of --model.loss-chunk "
                          f"{m.loss_chunk}.")
    if t.steps < 1 or t.log_every < 1 or t.eval_every < 1:
        raise ConfigError("--train.steps, --train.log-every and --train.eval-every must be >= 1.")
    problem = observe.profile_steps_problem(t.profile_steps, "--train.profile-steps", t.steps)
    if problem:
        raise ConfigError(problem)


# ----------------------------------------------------------------------------------------------
# 2. Parameters and their shardings
# ----------------------------------------------------------------------------------------------


def _param_table(cfg: ModelConfig) -> dict:
    """The one definition of the parameter tree: name -> (shape, PartitionSpec, init std).

    Per-layer weights are stacked on a leading L axis so the layers run under lax.scan, and
    the experts of a layer on an E axis, split over the `expert` mesh axis: a device holds
    whole experts. Within an expert, d is split over fsdp (gathered per layer) and the hidden
    width over tensor, as in a dense MLP. Init std: 0.02, scaled by 1/sqrt(2L) on the two
    projections that write into the residual stream (GPT-2). std None = ones (norms).
    """
    L, D, N, K, H, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                        cfg.vocab_size)
    E, F = cfg.n_experts, cfg.d_ff
    std, out_std = 0.02, 0.02 / math.sqrt(2 * L)
    # One expert (the benchmark's dense twin) cannot be split; the expert axis then only
    # splits the batch.
    ex = "expert" if E > 1 else None
    layers = {
        "attn_norm": ((L, D), P(None, None), None),
        "wq": ((L, D, N, H), P(None, "fsdp", "tensor", None), std),
        "wk": ((L, D, K, H), P(None, "fsdp", "tensor", None), std),
        "wv": ((L, D, K, H), P(None, "fsdp", "tensor", None), std),
        "wo": ((L, N, H, D), P(None, "tensor", None, "fsdp"), out_std),
        "mlp_norm": ((L, D), P(None, None), None),
        "w_router": ((L, D, E), P(None, "fsdp", None), std),
        "w_gate": ((L, E, D, F), P(None, ex, "fsdp", "tensor"), std),
        "w_up": ((L, E, D, F), P(None, ex, "fsdp", "tensor"), std),
        "w_down": ((L, E, F, D), P(None, ex, "tensor", "fsdp"), out_std),
    }
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


def count_active_params(cfg: ModelConfig) -> int:
    """Parameters one token uses: all of them but the n_experts - top_k experts it skips."""
    unused = cfg.n_layers * (cfg.n_experts - cfg.top_k) * 3 * cfg.d_model * cfg.d_ff
    return count_params(cfg) - unused


# ----------------------------------------------------------------------------------------------
# 3. Model
# ----------------------------------------------------------------------------------------------


def constrain(x, spec: P):
    """Pin an activation's sharding when a mesh is set (jax.set_mesh); a no-op without one."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec)


ACT_BTD = P(MOE_BATCH, None, None)  # activations between blocks: batch-sharded, d replicated


def rms_norm(x, w, eps):
    # Statistics in float32 whatever the compute dtype: bfloat16 squares lose the small values.
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    H = cfg.head_dim
    return (1.0 / cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H)).astype(np.float32)


def apply_rope(x_BTNH, pos_BT, inv_freq):
    """Rotate the two halves of each head (the HuggingFace layout: its q/k weights load as-is)."""
    ang_BTh = pos_BT[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(ang_BTh)[:, :, None, :], jnp.sin(ang_BTh)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def attention(q_BTNH, k_BSKH, v_BSKH, cfg: ModelConfig, mask_BTS=None):
    """Causal grouped-query attention: query head n reads key/value head n // (N/K).

    mask_BTS (True = may attend), when given, is applied on top of the causal mask: packed
    rows pass "same segment", so attention never crosses from one example into another.
    """
    if cfg.attention != "einsum":
        if mask_BTS is not None and cfg.attention == "cudnn":
            # jax.nn.dot_product_attention's cuDNN path takes causal and length masks only.
            raise ValueError("--model.attention cudnn cannot take an attention mask (packed "
                             "segments); use --model.attention auto or xla")
        impl = None if cfg.attention == "auto" else cfg.attention
        mask = None if mask_BTS is None else mask_BTS[:, None]
        return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=mask, is_causal=True,
                                            implementation=impl)
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    s_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH,
                         preferred_element_type=jnp.float32) / math.sqrt(H)
    allowed = jnp.tril(jnp.ones((T, k_BSKH.shape[1]), bool))
    if mask_BTS is not None:
        allowed = allowed & mask_BTS[:, None, None]
    s_BKGTS = jnp.where(allowed, s_BKGTS, -1e30)   # finite: a fully masked row stays NaN-free
    p_BKGTS = jax.nn.softmax(s_BKGTS, axis=-1).astype(v_BSKH.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", p_BKGTS, v_BSKH).reshape(B, T, N, H)


def router(h_BTD, w_DE, cfg: ModelConfig):
    """Top-k routing and its statistics: (weights [B,T,R] f32, experts [B,T,R] int32, stats).

    Switch load balancing (Fedus et al. 2021, eq. 4), with HuggingFace's and MaxText's top-k
    convention so their coefficients carry over: aux = E * sum_e f_e * P_e, f_e the fraction
    of tokens that chose e among their top k (the f_e sum to k), P_e the mean router
    probability of e. Perfect balance gives k; a collapse onto k experts gives E. Its
    gradient reaches the router through P only. Router z-loss (ST-MoE, Zoph et al. 2022):
    mean logsumexp(logits)^2, which keeps the logits small enough for float32 softmax to stay
    exact. `load` is each expert's share of the assignments (1/E when balanced).
    """
    E, R = cfg.n_experts, cfg.top_k
    logits_BTE = jnp.einsum("btd,de->bte", h_BTD.astype(jnp.float32), w_DE)
    probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    gate_BTR, expert_BTR = jax.lax.top_k(probs_BTE, R)
    if cfg.norm_topk:
        gate_BTR = gate_BTR / jnp.sum(gate_BTR, axis=-1, keepdims=True)
    n_tokens = h_BTD.shape[0] * h_BTD.shape[1]
    count_E = jnp.sum(jax.nn.one_hot(expert_BTR, E, dtype=jnp.float32), axis=(0, 1, 2))
    aux = E * jnp.sum(count_E / n_tokens * jnp.mean(probs_BTE, axis=(0, 1)))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1)))
    load_E = count_E / (n_tokens * R)
    stats = {"aux_loss": aux, "router_z": z, "load_min": jnp.min(load_E),
             "load_max": jnp.max(load_E)}
    return gate_BTR, expert_BTR.astype(jnp.int32), stats


def swiglu(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def _grouped_impl(cfg: ModelConfig) -> str:
    if cfg.grouped_matmul != "auto":
        return cfg.grouped_matmul
    # XLA:CPU has no grouped matmul: it rewrites ragged_dot into a dense matmul of every row
    # with every group's weights, zero-masked (E times the FLOPs and memory; 2-6x slower than
    # the tiled form, forward and backward, at E=8 on a laptop CPU). TPUs, and GPUs where
    # XLA has a grouped GEMM for the shapes and dtype, run it as one; elsewhere, pick tiled.
    return "tiled" if jax.default_backend() == "cpu" else "ragged_dot"


def _tile_layout(sizes_G, M: int, tile: int):
    """Each group padded to whole tiles: (destination row of each input row, group of each
    tile, number of tiles). Rows past sum(sizes) belong to no group and are sent out of range.

    The number of tiles is static, M / tile + G: every group wastes less than one tile.
    """
    G = sizes_G.shape[0]
    n_tiles = -(-M // tile) + G
    end_G = jnp.cumsum(sizes_G)
    tiles_G = (sizes_G + tile - 1) // tile
    tile_end_G = jnp.cumsum(tiles_G)
    row_M = jnp.arange(M)
    group_M = jnp.searchsorted(end_G, row_M, side="right")     # G for rows past the groups
    g_M = jnp.minimum(group_M, G - 1)
    within_M = row_M - (end_G - sizes_G)[g_M]
    dest_M = jnp.where(group_M < G, (tile_end_G - tiles_G)[g_M] * tile + within_M,
                       n_tiles * tile)
    group_n = jnp.minimum(jnp.searchsorted(tile_end_G, jnp.arange(n_tiles), side="right"), G - 1)
    return dest_M, group_n, n_tiles


def grouped_mlp(x_MD, sizes_G, w_gate_GDF, w_up_GDF, w_down_GFD, cfg: ModelConfig):
    """SwiGLU of expert g on its rows: x is sorted by group, sizes_G[g] rows each. Rows past
    sum(sizes_G) (buffer padding) give zeros.

    "ragged_dot": a grouped GEMM, each row against its own group's weights only.
    "tiled" (megablocks-style, for the CPU): every group is padded to whole tiles of
    `gmm_tile` rows and each tile is multiplied with its group's weights, one batched matmul
    over tiles; the cost is at most G tiles of padding and one weight copy per tile.
    """
    if _grouped_impl(cfg) == "ragged_dot":
        h_MF = (jax.nn.silu(jax.lax.ragged_dot(x_MD, w_gate_GDF, sizes_G))
                * jax.lax.ragged_dot(x_MD, w_up_GDF, sizes_G))
        return jax.lax.ragged_dot(h_MF, w_down_GFD, sizes_G)
    M, D = x_MD.shape
    tile = min(cfg.gmm_tile, M)
    dest_M, group_n, n = _tile_layout(sizes_G, M, tile)
    x_ntD = jnp.zeros((n * tile, D), x_MD.dtype).at[dest_M].set(x_MD, mode="drop")
    x_ntD = x_ntD.reshape(n, tile, D)
    h_ntF = (jax.nn.silu(jnp.einsum("ntd,ndf->ntf", x_ntD, w_gate_GDF[group_n]))
             * jnp.einsum("ntd,ndf->ntf", x_ntD, w_up_GDF[group_n]))
    y_ntD = jnp.einsum("ntf,nfd->ntd", h_ntF, w_down_GFD[group_n])
    return y_ntD.reshape(n * tile, -1).at[dest_M].get(mode="fill", fill_value=0)


def _inverse(perm):
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def capacity(n_tokens: int, cfg: ModelConfig) -> int:
    """Rows per expert per batch shard in capacity mode (GShard): cf x the balanced share."""
    return max(1, math.ceil(cfg.capacity_factor * n_tokens * cfg.top_k / cfg.n_experts))


def _dropless_exchange(x_AD, e_A, sizes_E, w, cfg: ModelConfig, peers: int, S: int):
    """Rows sorted by expert -> their experts on the peers of the expert axis -> back.

    Peer p holds experts p*X .. p*X+X-1, so the sorted rows are already grouped by peer.
    ragged_all_to_all would send exactly those rows, but XLA:CPU cannot run it (JAX 0.10
    and 0.12: "HLO opcode ragged-all-to-all is not supported"), so this sends fixed-size
    buffers of S rows per peer, the most any peer can be owed: every token may send all its
    min(X, k) choices among one peer's experts there (MaxText sizes its buffers the same
    way). That stays dropless at up to P times the traffic and buffer memory of the exact
    exchange (and, with the CPU's tiled matmul, whose tile count is static, the expert
    FLOPs).
    """
    A, D = x_AD.shape
    X = cfg.n_experts // peers
    sizes_PX = sizes_E.reshape(peers, X)
    send_P = jnp.sum(sizes_PX, axis=1)
    start_P = jnp.cumsum(send_P) - send_P
    r_S = jnp.arange(S)
    valid_PS = r_S[None, :] < send_P[:, None]
    src_PS = jnp.minimum(start_P[:, None] + r_S[None, :], A - 1)
    send_PSD = jnp.where(valid_PS[..., None], x_AD[src_PS], 0).astype(x_AD.dtype)
    recv_PSD = jax.lax.all_to_all(send_PSD, "expert", 0, 0)       # [source peer, row, d]
    rsizes_PX = jax.lax.all_to_all(sizes_PX, "expert", 0, 0)      # [source peer, my expert]
    # Each peer's rows arrive sorted by (local) expert; merge them into one sorted run.
    local_PS = jax.vmap(lambda ends: jnp.searchsorted(ends, r_S, side="right"))(
        jnp.cumsum(rsizes_PX, axis=1))                             # X marks padding
    order_M = jnp.argsort(local_PS.reshape(-1), stable=True)
    y_MD = grouped_mlp(recv_PSD.reshape(peers * S, D)[order_M], jnp.sum(rsizes_PX, axis=0),
                       *w, cfg)
    back_PSD = jax.lax.all_to_all(y_MD[_inverse(order_M)].reshape(peers, S, D), "expert", 0, 0)
    # Sorted row a went to peer p = expert // X, at row a - start_P[p] of that peer's buffer.
    peer_A = e_A // X
    return back_PSD.reshape(peers * S, D)[peer_A * S + jnp.arange(A) - start_P[peer_A]]


def _capacity_exchange(x_AD, e_A, sizes_E, w, cfg: ModelConfig, peers: int, C: int):
    """Capacity mode: the first C rows of each expert go into an [E, C, d] buffer (the rest
    are dropped), which is split by expert over the peers with one all-to-all and comes
    back with another. Returns (results of the rows in sorted order, rows dropped)."""
    A, D = x_AD.shape
    E, X = cfg.n_experts, cfg.n_experts // peers
    rank_A = jnp.arange(A) - (jnp.cumsum(sizes_E) - sizes_E)[e_A]
    keep_A = rank_A < C
    slot_A = jnp.where(keep_A, e_A * C + rank_A, E * C)
    buf_ECD = jnp.zeros((E * C, D), x_AD.dtype).at[slot_A].set(x_AD, mode="drop")
    buf_PXCD = buf_ECD.reshape(peers, X, C, D)
    if peers > 1:
        buf_PXCD = jax.lax.all_to_all(buf_PXCD, "expert", 0, 0)  # now [source peer, X, C, d]
    x_XMD = buf_PXCD.transpose(1, 0, 2, 3).reshape(X, peers * C, D)
    w_gate, w_up, w_down = w
    h_XMF = (jax.nn.silu(jnp.einsum("xmd,xdf->xmf", x_XMD, w_gate))
             * jnp.einsum("xmd,xdf->xmf", x_XMD, w_up))
    y_XMD = jnp.einsum("xmf,xfd->xmd", h_XMF, w_down)
    y_PXCD = y_XMD.reshape(X, peers, C, D).transpose(1, 0, 2, 3)
    if peers > 1:
        y_PXCD = jax.lax.all_to_all(y_PXCD, "expert", 0, 0)      # [expert's peer, X, C, d]
    y_AD = y_PXCD.reshape(E * C, D).at[slot_A].get(mode="fill", fill_value=0)
    return y_AD, A - jnp.sum(keep_A)


def experts(x_BTD, expert_BTR, gate_BTR, w_gate, w_up, w_down, *, cfg: ModelConfig,
            peers: int = 1, sharded: bool = False):
    """The experts' output for this device's tokens, and how many assignments were dropped.

    Runs per device inside `shard_map` when sharded (x and the routing are this device's
    batch shard; the weights are its X = E/P experts, d split over fsdp, F over tensor), or
    on everything at once without a mesh.
    """
    dt = x_BTD.dtype
    B, T, D = x_BTD.shape
    R, n = cfg.top_k, B * T
    w = (w_gate.astype(dt), w_up.astype(dt), w_down.astype(dt))
    if sharded:
        # FSDP: gather this layer's expert weights over fsdp in the compute dtype (half the
        # traffic in bfloat16); autodiff turns the gather into a reduce-scatter of gradients.
        w = (jax.lax.all_gather(w[0], "fsdp", axis=1, tiled=True),
             jax.lax.all_gather(w[1], "fsdp", axis=1, tiled=True),
             jax.lax.all_gather(w[2], "fsdp", axis=2, tiled=True))
    x_nD = x_BTD.reshape(n, D)
    # Assignments choice-major (a = r * n + token): within an expert the sort keeps every
    # first choice ahead of every second choice, so capacity mode drops second choices
    # first (GShard's priority), and dropless mode loses nothing by it.
    e_A = expert_BTR.reshape(n, R).T.reshape(-1)
    order_A = jnp.argsort(e_A, stable=True)
    x_AD, sorted_e_A = x_nD[order_A % n], e_A[order_A]
    sizes_E = jnp.bincount(e_A, length=cfg.n_experts).astype(jnp.int32)
    if cfg.capacity_factor > 0:
        y_AD, dropped = _capacity_exchange(x_AD, sorted_e_A, sizes_E, w, cfg, peers,
                                           capacity(n, cfg))
    elif peers > 1:
        y_AD = _dropless_exchange(x_AD, sorted_e_A, sizes_E, w, cfg, peers,
                                  S=n * min(cfg.n_experts // peers, R))
        dropped = jnp.zeros((), jnp.int32)
    else:
        y_AD, dropped = grouped_mlp(x_AD, sizes_E, *w, cfg), jnp.zeros((), jnp.int32)
    y_RnD = y_AD[_inverse(order_A)].reshape(R, n, D)
    gate_nR = gate_BTR.reshape(n, R).astype(dt)
    y_nD = jnp.einsum("rnd,nr->nd", y_RnD, gate_nR, preferred_element_type=jnp.float32)
    if sharded:
        y_nD = jax.lax.psum(y_nD, "tensor")   # each tensor shard summed over its slice of F
    return y_nD.astype(dt).reshape(B, T, D), dropped.reshape(1)


def moe(h_BTD, lp: dict, cfg: ModelConfig):
    """The MoE block on normed activations: (output [B,T,D], routing stats)."""
    gate_BTR, expert_BTR, stats = router(h_BTD, lp["w_router"], cfg)
    ws = (lp["w_gate"], lp["w_up"], lp["w_down"])
    if cfg.n_experts == 1:
        # The dense twin of `bench`: one expert, weight exactly 1, routing is the identity.
        dt = h_BTD.dtype
        y = swiglu(h_BTD, *(w[0].astype(dt) for w in ws))
        return constrain(y, ACT_BTD), stats | {"dropped": jnp.zeros((), jnp.float32)}
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        y, dropped = experts(h_BTD, expert_BTR, gate_BTR, *ws, cfg=cfg)
    else:
        act = P(MOE_BATCH, None, None)
        w_in, w_out = P("expert", "fsdp", "tensor"), P("expert", "tensor", "fsdp")
        y, dropped = jax.shard_map(
            partial(experts, cfg=cfg, peers=mesh.shape["expert"], sharded=True),
            in_specs=(act, act, act, w_in, w_in, w_out), out_specs=(act, P(MOE_BATCH)),
        )(h_BTD, expert_BTR, gate_BTR, *ws)
    n_assign = h_BTD.shape[0] * h_BTD.shape[1] * cfg.top_k
    return y, stats | {"dropped": jnp.sum(dropped) / n_assign}


def block(x_BTD, lp: dict, pos_BT, inv_freq, cfg: ModelConfig):
    dt = x_BTD.dtype
    w = lambda name: lp[name].astype(dt)   # f32 master weights, compute-dtype matmuls
    h = rms_norm(x_BTD, lp["attn_norm"], cfg.norm_eps)
    q = jnp.einsum("btd,dnh->btnh", h, w("wq"))
    k = jnp.einsum("btd,dkh->btkh", h, w("wk"))
    v = jnp.einsum("btd,dkh->btkh", h, w("wv"))
    if cfg.qk_norm:
        q, k = rms_norm(q, lp["q_norm"], cfg.norm_eps), rms_norm(k, lp["k_norm"], cfg.norm_eps)
    q, k = apply_rope(q, pos_BT, inv_freq), apply_rope(k, pos_BT, inv_freq)
    o = attention(q, k, v, cfg)
    x_BTD = constrain(x_BTD + jnp.einsum("btnh,nhd->btd", o, w("wo")), ACT_BTD)
    y_BTD, stats = moe(rms_norm(x_BTD, lp["mlp_norm"], cfg.norm_eps), lp, cfg)
    return constrain(x_BTD + y_BTD, ACT_BTD), stats


REMAT_POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def hidden(params: dict, tokens_BT, cfg: ModelConfig):
    """Token ids -> (final-normed hidden states [B, T, D], per-layer routing stats [L])."""
    dt = jnp.dtype(cfg.dtype)
    # Gather the table's fsdp shards first (as FSDP does for every weight): a lookup into a
    # table split on d makes XLA replicate the whole result and re-split it.
    embed = constrain(params["embed"], P("tensor", None))
    x = constrain(jnp.take(embed, tokens_BT, axis=0).astype(dt), ACT_BTD)
    pos_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
    inv_freq = rope_inv_freq(cfg)

    def layer(x, lp):
        return block(x, lp, pos_BT, inv_freq, cfg)

    if cfg.remat != "none":
        # prevent_cse=False: inside scan the recomputation cannot be merged away anyway.
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
    if cfg.scan_layers:
        x, stats = jax.lax.scan(layer, x, params["layers"])
    else:
        per_layer = []
        for i in range(cfg.n_layers):
            x, s = layer(x, jax.tree.map(lambda a: a[i], params["layers"]))
            per_layer.append(s)
        stats = jax.tree.map(lambda *a: jnp.stack(a), *per_layer)
    return rms_norm(x, params["final_norm"], cfg.norm_eps), stats


def unembedding(params: dict, cfg: ModelConfig):
    return params["embed"].T if cfg.tie_embeddings else params["unembed"]


def forward(params: dict, tokens_BT, cfg: ModelConfig):
    """Logits [B, T, V] in float32. Training never builds these whole: see `loss_sums`."""
    h, _ = hidden(params, tokens_BT, cfg)
    return jnp.einsum("btd,dv->btv", h, unembedding(params, cfg).astype(h.dtype),
                      preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------
# 4. Loss and train step
# ----------------------------------------------------------------------------------------------


def loss_sums(params: dict, batch_BT1, cfg: ModelConfig):
    """Summed cross-entropy, summed logsumexp^2 over all B*T targets, and routing stats [L].

    The [B, T, V] logits never exist at once: the sequence is cut into chunks of
    `loss_chunk` positions, each chunk's logits are made, reduced and dropped, and remat
    recomputes them in the backward pass.
    """
    inputs, targets = batch_BT1[:, :-1], batch_BT1[:, 1:]
    h_BTD, stats = hidden(params, inputs, cfg)
    w_DV = unembedding(params, cfg).astype(h_BTD.dtype)
    B, T, D = h_BTD.shape
    C = min(cfg.loss_chunk, T)
    h_nBCD = h_BTD.reshape(B, T // C, C, D).swapaxes(0, 1)
    t_nBC = targets.reshape(B, T // C, C).swapaxes(0, 1)

    @partial(jax.checkpoint, prevent_cse=False)
    def chunk(carry, xs):
        h_BCD, t_BC = xs
        logits = jnp.einsum("bcd,dv->bcv", h_BCD, w_DV, preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, t_BC[..., None], axis=-1)[..., 0]
        return (carry[0] + jnp.sum(lse - tgt), carry[1] + jnp.sum(lse * lse)), None

    zero = jnp.zeros((), jnp.float32)
    (ce, z), _ = jax.lax.scan(chunk, (zero, zero), (h_nBCD, t_nBC))
    return ce, z, stats


def loss_fn(params, batch_BT1, cfg: ModelConfig, t: TrainConfig = TrainConfig()):
    """Objective = mean cross-entropy + z_loss * mean lse^2 + the router losses, each a mean
    over layers. Returns (objective, {"ce": mean cross-entropy, routing stats per layer})."""
    ce, z, stats = loss_sums(params, batch_BT1, cfg)
    n = batch_BT1.shape[0] * (batch_BT1.shape[1] - 1)
    obj = ((ce + t.z_loss * z) / n + t.load_balance_loss * jnp.mean(stats["aux_loss"])
           + t.router_z_loss * jnp.mean(stats["router_z"]))
    return obj, {"ce": ce / n, **stats}


def make_schedule(t: TrainConfig):
    """Learning rate at optimiser step s (0-based); step 0 already gets lr / warmup_steps."""
    end, warmup = t.lr * t.min_lr_ratio, max(t.warmup_steps, 1)
    if t.schedule == "cosine":
        base = optax.warmup_cosine_decay_schedule(0.0, t.lr, warmup, max(t.steps, warmup + 1), end)
    elif t.schedule == "constant":
        base = optax.join_schedules([optax.linear_schedule(0.0, t.lr, warmup),
                                     optax.constant_schedule(t.lr)], [warmup])
    else:
        # Warmup-stable-decay (MiniCPM): flat at the peak, then a linear cool-down at the end.
        decay = max(1, int(t.steps * t.decay_fraction))
        stable = max(t.steps - decay - warmup, 0)
        base = optax.join_schedules(
            [optax.linear_schedule(0.0, t.lr, warmup), optax.constant_schedule(t.lr),
             optax.linear_schedule(t.lr, end, decay)], [warmup, warmup + stable])
    return lambda s: base(s + 1)


DECAYED = {"embed", "unembed", "wq", "wk", "wv", "wo", "w_router", "w_gate", "w_up", "w_down"}


def make_optimizer(t: TrainConfig):
    # Weight decay on matrices only: decaying norms' gains only hurts.
    mask = lambda params: {k: (jax.tree.map(lambda _: k in DECAYED, v) if k != "layers" else
                               {n: n in DECAYED for n in v}) for k, v in params.items()}
    return optax.chain(optax.clip_by_global_norm(t.clip_norm),
                       optax.adamw(make_schedule(t), t.b1, t.b2, weight_decay=t.weight_decay,
                                   mask=mask))


def compute_grads(params, batch_BT1, cfg: Config):
    """Gradient of the mean objective over the global batch, accumulated over microbatches;
    the aux (cross-entropy, routing stats) is the microbatches' mean."""
    M = cfg.train.microbatches
    grad_fn = jax.grad(partial(loss_fn, cfg=cfg.model, t=cfg.train), has_aux=True)
    if M == 1:
        return grad_fn(params, batch_BT1)
    # Microbatch m takes rows m, m+M, m+2M, ...: each device keeps its own rows of every
    # microbatch, so the split moves no data between devices.
    B, T1 = batch_BT1.shape
    mb_MBT = constrain(batch_BT1.reshape(B // M, M, T1).swapaxes(0, 1), P(None, MOE_BATCH, None))

    def acc(carry, mb):
        return jax.tree.map(jnp.add, carry, grad_fn(params, mb)), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, mb_MBT[0]))
    total, _ = jax.lax.scan(acc, zeros, mb_MBT)
    return jax.tree.map(lambda x: x / M, total)


def train_step(state: dict, batch_BT1, *, cfg: Config, tx):
    """One optimiser step on a global batch [B, T+1]; returns the new state and metrics."""
    grads, aux = compute_grads(state["params"], batch_BT1, cfg)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": aux["ce"], "grad_norm": optax.tree.norm(grads),
               "lr": make_schedule(cfg.train)(state["step"]),
               "aux_loss": jnp.mean(aux["aux_loss"]), "router_z": jnp.mean(aux["router_z"]),
               "load_min": aux["load_min"], "load_max": aux["load_max"],
               "dropped": jnp.mean(aux["dropped"])}
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, metrics


def eval_step(params, batch_BT1, *, cfg: ModelConfig):
    return loss_fn(params, batch_BT1, cfg)[1]["ce"]


def state_shardings(cfg: Config, mesh, tx):
    """Shardings of {params, opt_state, step}: Adam's moments follow their parameter."""
    p_sh = named(mesh, param_specs(cfg.model))
    abstract = jax.eval_shape(partial(_init, cfg.model), jax.random.key(0))
    replicated = NamedSharding(mesh, P())
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, abstract), p_sh,
                                   transform_non_params=lambda _: replicated)
    return {"params": p_sh, "opt_state": opt_sh, "step": replicated}


def _make_state(cfg: Config, tx):
    def make(key):
        params = _init(cfg.model, key)
        return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}
    return make


def init_state(cfg: Config, tx, shardings) -> dict:
    return jax.jit(_make_state(cfg, tx), out_shardings=shardings)(jax.random.key(cfg.train.seed))


def abstract_state(cfg: Config, tx, shardings) -> dict:
    """The state's shapes, dtypes and target shardings, with nothing allocated."""
    shapes = jax.eval_shape(_make_state(cfg, tx), jax.random.key(0))
    return jax.tree.map(lambda s, d: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=d),
                        shapes, shardings)


# ----------------------------------------------------------------------------------------------
# 5. FLOPs and MFU
# ----------------------------------------------------------------------------------------------


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token on the *active* parameters: 3x the forward.

    Forward, per token: 2 FLOPs per weight of every matmul it goes through (q, k, v, o, the
    router, and top_k experts' gate, up and down in each layer, and the unembedding), plus
    attention's two [T, T] products, 2 * 2 * T * N * H per layer (PaLM appendix B). Sorting,
    gathers, the all-to-alls and capacity padding are overhead, not counted: MFU measures
    useful work.
    """
    D, N, K, H, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    per_layer = D * N * H + 2 * D * K * H + N * H * D + D * cfg.n_experts + \
        cfg.top_k * 3 * D * cfg.d_ff
    matmul_weights = L * per_layer + D * cfg.vocab_size
    attn = L * 2 * 2 * seq_len * N * H
    return 3.0 * (2 * matmul_weights + attn)


# Dense bf16 peak per chip, from the vendors' data sheets.
PEAK_TFLOPS = {"TPU v4": 275, "TPU v5 lite": 197, "TPU v5e": 197, "TPU v5p": 459, "TPU v5": 459,
               "TPU v6 lite": 918, "TPU v6e": 918, "H100": 989, "H200": 989, "A100": 312,
               "B200": 2250, "L4": 121, "A10": 125}


def peak_flops_per_device(override_tflops: float = 0.0) -> tuple[float, str]:
    if override_tflops > 0:
        return override_tflops * 1e12, "--train.peak-tflops"
    kind = jax.devices()[0].device_kind
    for name, tf in PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return tf * 1e12, f"{kind} data sheet"
    if jax.devices()[0].platform != "cpu":
        return 0.0, f"unknown device {kind!r}: pass --train.peak-tflops"
    # CPU: all simulated devices share the host's cores, so measure the host once with a
    # float32 matmul and divide among them.
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    mm(a).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(5):
        out = mm(a)
    out.block_until_ready()
    host = 5 * 2 * n ** 3 / (time.perf_counter() - t0)
    return host / jax.device_count(), f"measured f32 matmul, host {host / 1e9:.0f} GFLOP/s"


# ----------------------------------------------------------------------------------------------
# 6. Main
# ----------------------------------------------------------------------------------------------


def log(*a, **kw):
    if multislice.is_main_process():
        print(*a, **kw, flush=True)


def sample(params, prompt: list[int], cfg: Config, mesh, key, n_valid: int) -> list[int]:
    """Decode `sample_tokens` tokens after `prompt` with full forwards (no KV cache: this is
    a peek at the model, not an inference server), jitted once for a fixed-size buffer.
    Only the first `n_valid` ids are drawn: the model's vocabulary may be padded past the
    tokenizer's."""
    n_new, T = cfg.train.sample_tokens, min(cfg.train.seq_len, cfg.model.max_seq_len)
    prompt = prompt[-(T - n_new):]
    B = batch_shards(mesh, MOE_BATCH)  # one row per batch shard: the constraints stay even
    buf = np.zeros((B, T), np.int32)
    buf[:, :len(prompt)] = prompt
    temp = cfg.train.temperature

    @jax.jit
    def run(params, buf, key):
        def one(i, carry):
            buf, key = carry
            logits = forward(params, buf, cfg.model)[:, i - 1, :n_valid]
            key, sub = jax.random.split(key)
            nxt = (jnp.argmax(logits, -1) if temp == 0 else
                   jax.random.categorical(sub, logits / temp, axis=-1))
            return buf.at[:, i].set(nxt.astype(buf.dtype)), key
        return jax.lax.fori_loop(len(prompt), len(prompt) + n_new, one, (buf, key))[0]

    out = run(params, jax.device_put(buf, NamedSharding(mesh, P(MOE_BATCH, None))), key)
    return np.asarray(jax.device_get(out))[0, len(prompt):len(prompt) + n_new].tolist()


def dry_run(cfg: Config, mesh, tx) -> dict:
    """Compile one train step on abstract inputs (nothing allocated) and report memory."""
    sh = state_shardings(cfg, mesh, tx)
    abstract = abstract_state(cfg, tx, sh)
    batch = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len + 1), jnp.int32,
                                 sharding=NamedSharding(mesh, P(MOE_BATCH, None)))
    t0 = time.perf_counter()
    step = jax.jit(partial(train_step, cfg=cfg, tx=tx), donate_argnums=0,
                   out_shardings=(sh, None))
    compiled = step.lower(abstract, batch).compile()
    mem = compiled.memory_analysis()
    n = count_params(cfg.model)
    report = {"params": n, "active_params": count_active_params(cfg.model),
              "devices": mesh.size, "compile_s": time.perf_counter() - t0}
    if mem is not None:
        report |= {k: int(getattr(mem, k + "_in_bytes")) for k in
                   ("argument_size", "output_size", "alias_size", "temp_size")}
        report["per_device_bytes"] = (report["argument_size"] + report["output_size"]
                                      - report["alias_size"] + report["temp_size"])
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    log(f"dry run | {n:,} parameters | mesh {describe(mesh)} | compiled in "
        f"{report['compile_s']:.1f} s")
    if mem is not None:
        log(f"per device: {gib(report['per_device_bytes'])} = arguments "
            f"{gib(report['argument_size'])} + outputs {gib(report['output_size'])} - donated "
            f"{gib(report['alias_size'])} + temporaries {gib(report['temp_size'])}")
    return report


def dense_twin(cfg: Config) -> Config:
    """The same network with each MoE block replaced by one dense SwiGLU of width
    top_k x d_ff: the same active matmul FLOPs, without routing, sorting or exchanges."""
    m = cfg.model
    return dataclasses.replace(cfg, model=dataclasses.replace(
        m, n_experts=1, top_k=1, d_ff=m.top_k * m.d_ff, capacity_factor=0.0))


def _bench_one(cfg: Config, mesh, tx, peak: float, what: str) -> dict:
    tc = cfg.train
    sh = state_shardings(cfg, mesh, tx)
    state = init_state(cfg, tx, sh)
    batch = jax.device_put(
        np.random.default_rng(0).integers(0, cfg.model.vocab_size,
                                          (tc.batch_size, tc.seq_len + 1), dtype=np.int32),
        NamedSharding(mesh, P(MOE_BATCH, None)))
    t0 = time.perf_counter()
    step = jax.jit(partial(train_step, cfg=cfg, tx=tx), donate_argnums=0,
                   out_shardings=(sh, None)).lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    state, m = step(state, batch)  # warm-up: first-touch allocations
    jax.block_until_ready(m)
    times = []
    for _ in range(cfg.bench):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    dt = float(np.median(times))
    tok_s = tc.batch_size * tc.seq_len / dt
    mfu = flops_per_token(cfg.model, tc.seq_len) * tok_s / (peak * jax.device_count())
    log(f"bench {what} | {tok_s:.0f} tok/s | {1e3 * dt:.1f} ms/step (median of {cfg.bench}, "
        f"min {1e3 * min(times):.1f}) | MFU {100 * mfu:.1f}% | "
        f"{count_active_params(cfg.model) / 1e6:.2f}M active parameters | "
        f"compile {compile_s:.1f} s")
    return {"tokens_per_s": tok_s, "ms_per_step": 1e3 * dt, "mfu": mfu, "compile_s": compile_s}


def bench(cfg: Config, mesh, tx) -> dict:
    """Median step time over `cfg.bench` steps after compilation, on random tokens (no data,
    no checkpoints), of the MoE model and (bench_twin) of its dense twin. Each step is
    synced here, which the training loop never does."""
    peak, src = peak_flops_per_device(cfg.train.peak_tflops)
    log(f"bench | MFU on active FLOPs, against {peak / 1e12:.3g} TFLOP/s per device ({src})")
    report = {"moe": _bench_one(cfg, mesh, tx, peak, "moe  ")}
    if cfg.bench_twin:
        report["dense"] = _bench_one(dense_twin(cfg), mesh, tx, peak, "dense")
        # Time per active FLOP, MoE over dense: the cost of routing, sorting and dispatch.
        report["cost_ratio"] = report["dense"]["mfu"] / report["moe"]["mfu"]
        log(f"bench | the MoE step costs {report['cost_ratio']:.2f}x the dense step per "
            f"active FLOP")
    return report


def main(cfg: Config) -> dict:
    cfg = with_hf_model(cfg)
    multislice.initialize()
    multislice.enable_compilation_cache()
    observe.configure(quiet=cfg.quiet)
    validate(cfg, jax.device_count())
    mesh = make_mesh(cfg.mesh)
    tx = make_optimizer(cfg.train)
    m = cfg.model
    log(f"model {count_params(m):,} parameters, {count_active_params(m):,} active "
        f"({m.n_experts} experts, top-{m.top_k}, "
        f"{'dropless' if m.capacity_factor == 0 else f'capacity factor {m.capacity_factor}'}, "
        f"{_grouped_impl(m)} grouped matmul) | mesh {describe(mesh)} | "
        f"{jax.device_count()} {jax.devices()[0].platform} devices, "
        f"{jax.process_count()} process(es)")
    with jax.set_mesh(mesh):
        if cfg.dry_run:
            return dry_run(cfg, mesh, tx)
        if cfg.bench:
            return bench(cfg, mesh, tx)
        return _train(cfg, mesh, tx)


def _train(cfg: Config, mesh, tx) -> dict:
    t_start = time.perf_counter()
    mc = cfg.model
    ds = load_dataset(cfg.data)
    if cfg.init_from_hf and (note := hf.check_tokenizer(
            cfg.init_from_hf, ds.tokenizer_path, f"--data.path {cfg.data.path!r}")):
        log(note)
    if ds.vocab_size > mc.vocab_size:
        raise ConfigError(f"the tokenizer has {ds.vocab_size} tokens but --model.vocab-size is "
                          f"{mc.vocab_size}; set --model.vocab-size {ds.vocab_size} or larger.")
    run_path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    if multislice.is_main_process():
        check_run_config(cfg.run_dir, dataclasses.asdict(cfg), MAY_CHANGE,
                         defaults=dataclasses.asdict(Config()))
    # Closed in reverse: the last save is waited for (and raises if it failed) first.
    with observe.MetricsLog(cfg.run_dir, dataclasses.asdict(cfg)) as metrics_log, \
            observe.Profiler(cfg.run_dir, cfg.train.profile_steps) as profiler, \
            Checkpointer(cfg.run_dir, cfg.checkpoint) as ckpt:
        return _train_loop(cfg, mesh, tx, ds, ckpt, metrics_log, profiler, t_start)


def _train_loop(cfg: Config, mesh, tx, ds, ckpt: Checkpointer, metrics_log: observe.MetricsLog,
                profiler: observe.Profiler, t_start: float) -> dict:
    tc, mc = cfg.train, cfg.model
    shardings = state_shardings(cfg, mesh, tx)
    start = ckpt.resume_step()
    if start is None:
        state, start = (init_state_from_hf(cfg, tx, shardings) if cfg.init_from_hf else
                        init_state(cfg, tx, shardings)), 0
    else:
        state = ckpt.restore(start, abstract_state(cfg, tx, shardings))
        log(f"resumed from step {start} ({cfg.run_dir}/checkpoints/{start})")

    batch_sh = NamedSharding(mesh, P(MOE_BATCH, None))
    next_batch = partial(get_batch, ds.train, seed=cfg.data.seed, batch_size=tc.batch_size,
                         seq_len=tc.seq_len, sharding=batch_sh)
    step_fn = jax.jit(partial(train_step, cfg=cfg, tx=tx), donate_argnums=0,
                      out_shardings=(shardings, None))
    eval_fn = jax.jit(partial(eval_step, cfg=mc))
    peak, peak_src = peak_flops_per_device(tc.peak_tflops)
    fpt = flops_per_token(mc, tc.seq_len)
    tokens_per_step = tc.batch_size * tc.seq_len

    def evaluate(params) -> float:
        losses = [eval_fn(params, get_batch(ds.eval, seed=cfg.data.seed + 1, step=i,
                                            batch_size=tc.batch_size, seq_len=tc.seq_len,
                                            sharding=batch_sh))
                  for i in range(tc.eval_batches)]
        return float(np.mean(jax.device_get(losses)))

    summary = {"start_step": start, "first_loss": None, "last_loss": None, "eval_loss": None,
               "best_eval": None}
    evals = {}  # step -> eval loss, joined to that step's log record

    def emit(step, m, dt_s, n_steps):
        tok_s = tokens_per_step * n_steps / dt_s
        mfu = fpt * tok_s / (peak * jax.device_count()) if peak else float("nan")
        rec = {"step": step, "loss": float(m["loss"]), "lr": float(m["lr"]),
               "grad_norm": float(m["grad_norm"]), "aux_loss": float(m["aux_loss"]),
               "router_z": float(m["router_z"]), "dropped": float(m["dropped"]),
               "load_min": np.asarray(m["load_min"]).tolist(),   # per layer
               "load_max": np.asarray(m["load_max"]).tolist(),
               "tokens_per_s": tok_s, "mfu": mfu, "ms_per_step": 1e3 * dt_s / n_steps}
        if step in evals:
            rec["eval_loss"] = evals.pop(step)
        summary["first_loss"] = summary["first_loss"] or rec["loss"]
        summary["last_loss"] = rec["loss"]
        drop = f" | dropped {100 * rec['dropped']:.1f}%" if mc.capacity_factor > 0 else ""
        log(f"step {step} | loss {rec['loss']:.3f} | aux {rec['aux_loss']:.3f} | router_z "
            f"{rec['router_z']:.2f} | load {min(rec['load_min']):.3f}-{max(rec['load_max']):.3f}"
            f"{drop} | lr {rec['lr']:.1e} | grad_norm {rec['grad_norm']:.2f} | "
            f"{tok_s / 1e3:.1f}k tok/s | MFU {100 * mfu:.1f}% | {rec['ms_per_step']:.0f} ms/step")
        metrics_log.write(rec)

    if start >= tc.steps:
        log(f"already at step {start} of --train.steps {tc.steps}: nothing to train "
            f"(raise --train.steps to continue)")
    else:
        with observe.progress("compiling train step") as p:
            step_fn = step_fn.lower(state, next_batch(step=start)).compile()
            p.note = (f"| peak {peak / 1e12:.3g} TFLOP/s per device ({peak_src}) | "
                      f"{fpt / 1e6:.1f} MFLOP/token (active)")
        summary["compile_s"] = p.seconds
        t_loop = time.perf_counter()
        pending = None  # (step, device metrics, steps covered): fetched one step late
        stop_vote = None  # did any process get SIGTERM? also read one step late
        t_log, steps_since = time.perf_counter(), 0
        with PreemptionGuard() as guard:
            for step in range(start, tc.steps):
                done = step + 1
                profiler.before(done)
                state, metrics = step_fn(state, next_batch(step=step))
                profiler.after(done, metrics)
                steps_since += 1
                if pending is not None:   # the previous log step is finished by now, or nearly
                    m = jax.device_get(pending[1])
                    now = time.perf_counter()
                    emit(pending[0], m, now - t_log, pending[2])
                    t_log, pending = now, None
                if done % tc.log_every == 0 or done == tc.steps or done == start + 1:
                    pending, steps_since = (done, metrics, steps_since), 0
                if done % tc.eval_every == 0 or done == tc.steps:
                    loss = evaluate(state["params"])
                    summary["eval_loss"] = loss
                    best = summary["best_eval"]
                    summary["best_eval"] = loss if best is None else min(best, loss)
                    log(f"eval step {done} | eval_loss {loss:.3f}")
                    if pending is not None and pending[0] == done:
                        evals[done] = loss
                    else:  # not a log step: a record of its own
                        metrics_log.write({"step": done, "eval_loss": loss})
                # Explicit, like every fetch in this loop: an implicit one (float(x) of a
                # device array) would hide a wait for the device.
                stop = stop_vote is not None and bool(jax.device_get(stop_vote))
                stop_vote = multislice.any_process(guard.requested)
                if ckpt.save(done, state, force=done == tc.steps or stop):
                    metrics_log.checkpointed()
                if stop:
                    log(f"SIGTERM: saved step {done}, exiting")
                    break
            if pending is not None:
                jax.block_until_ready(pending[1])
                emit(pending[0], jax.device_get(pending[1]), time.perf_counter() - t_log,
                     pending[2])
        summary["loop_s"] = time.perf_counter() - t_loop
    ckpt.wait()
    summary["final_step"] = int(jax.device_get(state["step"]))
    summary["state"] = state
    if tc.sample_tokens > 0:
        prompt = ds.encode(tc.sample_prompt)
        out = sample(state["params"], prompt, cfg, mesh, jax.random.key(tc.seed + 7),
                     ds.vocab_size)
        log("sample:\n" + ds.decode(prompt + out))
    _print_summary(cfg, summary, metrics_log, profiler, fpt, peak, time.perf_counter() - t_start)
    return summary


def _print_summary(cfg: Config, s: dict, metrics_log, profiler, fpt: float, peak: float,
                   wall_s: float) -> None:
    """The run on one screen: how far it got, how well, how fast, and where its files are."""
    tc, fmt = cfg.train, observe.fmt
    start, end = s["start_step"], s["final_step"]
    tokens = (end - start) * tc.batch_size * tc.seq_len
    ms = observe.mean_ms_per_step(metrics_log.records, start)
    tok_s = tc.batch_size * tc.seq_len / ms * 1e3
    mfu = fpt * tok_s / (peak * jax.device_count()) if peak else float("nan")
    timing = f"{observe.duration(wall_s)}"
    if "compile_s" in s:
        timing += f" (compile {s['compile_s']:.1f} s, steps {observe.duration(s['loop_s'])})"
    logged = [r for r in metrics_log.records if "load_max" in r]
    routing = "-"
    if logged:
        r = logged[-1]
        routing = (f"expert shares {min(r['load_min']):.3f}-{max(r['load_max']):.3f} "
                   f"(even: {1 / cfg.model.n_experts:.3f}) | aux loss "
                   f"{r['aux_loss']:.3f} | router z {r['router_z']:.2f} (last logged step)")
    observe.print_summary(f"run {cfg.run_dir}: done", [
        ("steps", f"{start} -> {end} ({end - start} this run, of --train.steps {tc.steps})"),
        ("tokens", f"{tokens:,} this run ({tc.batch_size} x {tc.seq_len} per step)"),
        ("loss", f"{fmt(s['first_loss'])} -> {fmt(s['last_loss'])} | best eval loss "
                 f"{fmt(s['best_eval'])} | last eval loss {fmt(s['eval_loss'])}"),
        ("routing", routing),
        ("wall time", timing),
        ("throughput", f"{fmt(tok_s / 1e3, '.1f')}k tok/s, MFU {fmt(100 * mfu, '.1f')}% (active "
                       f"FLOPs), {fmt(ms, '.0f')} ms/step (mean over logged steps after the "
                       "first)"),
    ] + observe.where_rows(cfg.run_dir, metrics_log, profiler))


# ----------------------------------------------------------------------------------------------
# 7. HuggingFace in and out
# ----------------------------------------------------------------------------------------------

# As in train_dense.py: HF rotates the two halves of each head, as `apply_rope` does, so no
# weight is permuted. The experts are stored one tensor per expert and per layer.
HF_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# What transformers assumes for a key that config.json leaves out (its config classes).
_HF_DEFAULTS = {
    "mixtral": dict(rms_norm_eps=1e-5, max_position_embeddings=131072, num_key_value_heads=8,
                    rope_theta=1_000_000.0, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=4,
                      rope_theta=10_000.0, num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768, norm_topk_prob=False),
}


def hf_mapping(cfg: ModelConfig, model_type: str) -> dict:
    """Our parameter tree, each leaf as (HuggingFace tensor name, layout): see common/hf.py.
    Atoms: l layers, e experts, d model, n query heads, k key/value heads, h head width,
    f expert MLP width, v vocabulary. Mixtral calls the gate/up/down projections w1/w3/w2."""
    lay = "model.layers.{l}."
    if model_type == "mixtral":
        moe, gate, up, down = lay + "block_sparse_moe.", "w1", "w3", "w2"
    else:
        moe, gate, up, down = lay + "mlp.", "gate_proj", "up_proj", "down_proj"
    expert = moe + "experts.{e}."
    layers = {
        "attn_norm": (lay + "input_layernorm.weight", "d -> l d"),
        "wq": (lay + "self_attn.q_proj.weight", "(n h) d -> l d n h"),
        "wk": (lay + "self_attn.k_proj.weight", "(k h) d -> l d k h"),
        "wv": (lay + "self_attn.v_proj.weight", "(k h) d -> l d k h"),
        "wo": (lay + "self_attn.o_proj.weight", "d (n h) -> l n h d"),
        "mlp_norm": (lay + "post_attention_layernorm.weight", "d -> l d"),
        "w_router": (moe + "gate.weight", "e d -> l d e"),
        "w_gate": (expert + gate + ".weight", "f d -> l e d f"),
        "w_up": (expert + up + ".weight", "f d -> l e d f"),
        "w_down": (expert + down + ".weight", "d f -> l e f d"),
    }
    if cfg.qk_norm:
        layers |= {"q_norm": (lay + "self_attn.q_norm.weight", "h -> l h"),
                   "k_norm": (lay + "self_attn.k_norm.weight", "h -> l h")}
    tree = {"embed": ("model.embed_tokens.weight", "v d -> v d"), "layers": layers,
            "final_norm": ("model.norm.weight", "d -> d")}
    if not cfg.tie_embeddings:
        tree["unembed"] = ("lm_head.weight", "v d -> d v")
    return tree


def _hf_sizes(cfg: ModelConfig) -> dict:
    return dict(l=cfg.n_layers, e=cfg.n_experts, d=cfg.d_model, n=cfg.n_heads,
                k=cfg.n_kv_heads, h=cfg.head_dim, f=cfg.d_ff, v=cfg.vocab_size)


def config_from_hf(c: dict, where: str = "config.json") -> ModelConfig:
    """Our ModelConfig from a HuggingFace config.json (as a dict). Anything that would change
    what the model computes and that we do not implement is an error, never ignored."""
    mt = c.get("model_type")
    if mt not in HF_ARCHITECTURES:
        raise hf.HFError(f"{where}: model_type {mt!r} is not a mixture-of-experts family that "
                         f"train_moe.py loads ({', '.join(HF_ARCHITECTURES)}); dense models "
                         "(llama, mistral, qwen2, qwen3) belong to train_dense.py.")
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts, 4.x as num_experts.
    n_experts = c.get("num_experts", c.get("num_local_experts")) if mt == "qwen3_moe" else \
        c.get("num_local_experts")
    c = _HF_DEFAULTS[mt] | c

    def unsupported(what: str):
        return hf.HFError(f"{where}: {what} is not implemented by train_moe.py, so this {mt} "
                          "model cannot be loaded faithfully.")

    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size" if mt == "mixtral" else "moe_intermediate_size"):
        if key not in c:
            raise hf.HFError(f"{where} has no {key!r}; it is not a complete {mt} config.")
    if c.get("hidden_act", "silu") != "silu":
        raise unsupported(f"hidden_act {c['hidden_act']!r} (only silu)")
    if c.get("attention_bias"):
        raise unsupported("attention_bias (biases on the attention projections)")
    if c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1:
        raise unsupported("dense MLP layers between the MoE layers (mlp_only_layers, "
                          "decoder_sparse_step)")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        raise unsupported(f"partial_rotary_factor {c['partial_rotary_factor']}")
    theta, kind, _ = hf.rope_parameters(c, c["rope_theta"], where)
    if kind != "default":
        raise unsupported(f"rope type {kind!r} (only the default)")
    # A sliding window of W tokens changes nothing on sequences of at most W tokens.
    window = (c.get("sliding_window") if mt == "mixtral" or c.get("use_sliding_window")
              else None)
    max_len = c["max_position_embeddings"] if window is None else min(
        c["max_position_embeddings"], window)
    n_heads = c["num_attention_heads"]
    return ModelConfig(
        vocab_size=c["vocab_size"], d_model=c["hidden_size"], n_layers=c["num_hidden_layers"],
        n_heads=n_heads, n_kv_heads=c.get("num_key_value_heads") or n_heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
        n_experts=n_experts or c.get("num_experts") or c["num_local_experts"],
        top_k=c["num_experts_per_tok"],
        d_ff=c["intermediate_size"] if mt == "mixtral" else c["moe_intermediate_size"],
        norm_topk=True if mt == "mixtral" else bool(c["norm_topk_prob"]),
        max_seq_len=max_len, rope_theta=theta, norm_eps=float(c["rms_norm_eps"]),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)), qk_norm=mt == "qwen3_moe")


def _model_type(cfg: ModelConfig, model_type: str) -> str:
    mt = model_type or ("qwen3_moe" if cfg.qk_norm else "mixtral")
    if mt not in HF_ARCHITECTURES:
        raise hf.HFError(f"model_type {mt!r}: choose one of {', '.join(HF_ARCHITECTURES)}.")
    if cfg.qk_norm != (mt == "qwen3_moe") or (mt == "mixtral" and not cfg.norm_topk):
        raise hf.HFError(f"model_type {mt!r} does not fit this model (qk_norm={cfg.qk_norm}, "
                         f"norm_topk={cfg.norm_topk}): q/k norms are qwen3_moe's, and "
                         "mixtral always renormalises its top-k weights.")
    return mt


def config_to_hf(cfg: ModelConfig, model_type: str = "", dtype: str = "float32") -> dict:
    """A config.json for `cfg` that transformers 4.4x and 5.x both read."""
    mt = _model_type(cfg, model_type)
    c = dict(architectures=[HF_ARCHITECTURES[mt]], model_type=mt, vocab_size=cfg.vocab_size,
             hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
             num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
             head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.max_seq_len,
             rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
             rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
             rope_theta=cfg.rope_theta, rope_scaling=None, sliding_window=None,
             num_experts_per_tok=cfg.top_k, num_local_experts=cfg.n_experts,
             attention_dropout=0.0, initializer_range=0.02, use_cache=True, dtype=dtype,
             torch_dtype=dtype)
    if mt == "mixtral":
        c |= dict(intermediate_size=cfg.d_ff, router_jitter_noise=0.0)
    else:  # intermediate_size is the width of dense layers, which this model has none of
        c |= dict(num_experts=cfg.n_experts, moe_intermediate_size=cfg.d_ff,
                  intermediate_size=cfg.d_ff, norm_topk_prob=cfg.norm_topk,
                  decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                  attention_bias=False)
    return c


def _flat_table(cfg: ModelConfig) -> dict:
    table = _param_table(cfg)
    return {k: v for k, v in table.items() if k != "layers"} | {
        f"layers/{k}": v for k, v in table["layers"].items()}


def load_hf(path: str, mesh=None) -> tuple[ModelConfig, dict]:
    """A HuggingFace folder (config.json and safetensors, one file or sharded with an index)
    as our ModelConfig and float32 parameters, each placed with its `param_specs` sharding on
    `mesh` (default: the first device), every device reading only its own experts' blocks."""
    ckpt = hf.Checkpoint(path)
    cfg = config_from_hf(ckpt.config, os.path.join(path, hf.CONFIG))
    if mesh is None:
        mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    for name, (shape, spec, _) in _flat_table(cfg).items():
        for n, axes in zip(shape, spec):
            ways = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else
                                                     axes or ()))
            if n % ways:
                raise ConfigError(f"{path}: {name} has a dimension of {n}, which the mesh "
                                  f"({describe(mesh)}) splits {ways} ways; choose mesh sizes "
                                  "that divide the model's.")
    mt = ckpt.config["model_type"]
    ignore = lambda n: (cfg.tie_embeddings and n == "lm_head.weight") or n.endswith(
        "rotary_emb.inv_freq")
    params = hf.load(ckpt, hf_mapping(cfg, mt), _hf_sizes(cfg),
                     named(mesh, param_specs(cfg)), what=f"{mt} model of this config",
                     ignore=ignore)
    return cfg, params


def save_hf(params: dict, cfg: ModelConfig, path: str, *, model_type: str = "",
            base_config: dict | None = None, dtype: str = "float32",
            max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """Write `params` as a HuggingFace folder that transformers (and vLLM) load: config.json
    and safetensors shards of at most `max_shard_bytes` with their index. `base_config` (the
    config.json the run started from) keeps its other keys. Returns the files written."""
    base = dict(base_config or {})
    mt = _model_type(cfg, model_type or base.get("model_type", ""))
    for key in ("layer_types", "quantization_config", "transformers_version", "rope_scaling",
                "rope_parameters"):
        base.pop(key, None)
    return hf.save(path, params, hf_mapping(cfg, mt), _hf_sizes(cfg),
                   base | config_to_hf(cfg, mt, dtype), dtype=dtype,
                   max_shard_bytes=max_shard_bytes)


# Starting a run from published weights (--init-from-hf), and exporting one (export-hf).

# What --init-from-hf leaves to the flags: how to compute, and the capacity factor (HF's
# models are dropless; capacity mode is a training-time approximation one may choose).
_KEEP_FIELDS = tuple(sorted(k.split(".", 1)[1] for k in MAY_CHANGE if k.startswith("model.")
                            )) + ("capacity_factor",)


def with_hf_model(cfg: Config) -> Config:
    """With --init-from-hf the model's shape comes from PATH/config.json; only how it computes
    (--model.dtype, ... and --model.capacity-factor) stays the flags'."""
    if not cfg.init_from_hf:
        return cfg
    shape = config_from_hf(hf.read_config(cfg.init_from_hf),
                           os.path.join(cfg.init_from_hf, hf.CONFIG))
    keep = {f: getattr(cfg.model, f) for f in _KEEP_FIELDS}
    return dataclasses.replace(cfg, model=dataclasses.replace(shape, **keep))


def refuse_shape_flags(args: list[str]) -> None:
    """A --model.* flag that sets the shape contradicts --init-from-hf: say so, do not pick."""
    if problem := hf.shape_flag_problem(args, _KEEP_FIELDS):
        raise ConfigError(problem)


def init_state_from_hf(cfg: Config, tx, shardings) -> dict:
    """Step 0 from published weights: parameters from --init-from-hf, a fresh optimiser."""
    _, params = load_hf(cfg.init_from_hf, shardings["step"].mesh)
    opt_state = jax.jit(tx.init, out_shardings=shardings["opt_state"])(params)
    return {"params": params, "opt_state": opt_state,
            "step": jax.device_put(jnp.zeros((), jnp.int32), shardings["step"])}


def export_hf(run_dir: str, out: str, step: int = -1,
              dtype: Literal["float32", "bfloat16"] = "float32",
              model_type: Literal["", "mixtral", "qwen3_moe"] = "",
              max_shard_gb: float = 5.0) -> list[str]:
    """Write a run's checkpoint as a HuggingFace folder (config.json, safetensors, tokenizer).

    Args:
        run_dir: The run directory: its config.json and checkpoints/.
        out: The folder to create (new or empty).
        step: The checkpoint to export; -1 = the latest.
        dtype: Of the weights written (checkpoints hold float32).
        model_type: The family; "" = the source's, else qwen3_moe for q/k norm, or mixtral.
        max_shard_gb: The largest safetensors file.
    """
    path = run_path(run_dir, "config.json")
    saved = read_run_config(run_dir, "--run-dir")
    try:
        cfg = Config(model=ModelConfig(**saved["model"]), train=TrainConfig(**saved["train"]),
                     data=DataConfig(**saved["data"]), run_dir=run_dir)
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{path} is not a run config this train_moe.py reads ({e}).")
    n = len(jax.devices())  # fsdp over every local device: each holds 1/n of the state
    n = n if cfg.model.d_model % n == 0 else 1
    mesh = make_mesh(MeshConfig(fsdp=n), jax.devices()[:n])
    tx = make_optimizer(cfg.train)
    with Checkpointer(run_dir, CheckpointConfig(restore_step=step)) as ckpt:
        at = ckpt.resume_step()
        if at is None:
            raise CheckpointError(f"--run-dir {run_dir} has no checkpoint to export.")
        params = ckpt.restore(at, abstract_state(cfg, tx, state_shardings(cfg, mesh, tx)))
        params = params["params"]
    src = saved.get("init_from_hf") or ""
    try:
        tokenizer = None if src else load_dataset(cfg.data).tokenizer_path
    except (FileNotFoundError, ValueError, OSError):  # data gone: export without a tokenizer
        tokenizer = None
    base, tokenizer_dir = hf.export_extras(src, tokenizer)
    files = save_hf(params, cfg.model, out, model_type=model_type, base_config=base,
                    dtype=dtype, max_shard_bytes=int(max_shard_gb * 2**30))
    if tokenizer_dir:
        files += hf.copy_tokenizer(tokenizer_dir, out)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
    print(f"export-hf: step {at} of {run_dir} -> {out} ({len(files)} files, {size / 1e9:.2f} GB, "
          f"{dtype}): {', '.join(files)}", flush=True)
    return files


def cli(args=None) -> Config:
    import tyro
    cfg = tyro.extras.overridable_config_cli(PRESETS, args=args)
    if cfg.init_from_hf:
        refuse_shape_flags(sys.argv[1:] if args is None else args)
    return cfg


if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["export-hf"]:  # python train_moe.py export-hf --run-dir R --out O
            import tyro
            tyro.cli(export_hf, args=sys.argv[2:], prog="train_moe.py export-hf")
        else:
            main(cli())
    except (ConfigError, MeshError, ConfigConflictError, CheckpointError, FileNotFoundError,
            hf.HFError) as e:
        # Bad input: a one-paragraph reason and the fix, not a traceback.
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
