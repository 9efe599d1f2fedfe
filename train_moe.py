"""Mixture-of-experts decoder (Mixtral, Qwen3-MoE, GPT-OSS, DeepSeek-V3, Kimi K2): dropless routing,
expert parallelism; what no model changes (state, optimiser, MFU, the loop, the CLI) is in common/.

    python train_moe.py tiny-moe                                  # the `make train-moe` run
    python train_moe.py mixtral-8x7b --mesh.expert 8 --mesh.fsdp -1
    python train_moe.py qwen3-30b-a3b --dry-run --mesh.expert 8   # compile only, print memory
    python train_moe.py export-hf --run-dir runs/tiny-moe --out hf/tiny-moe

Tensor names end in their shapes: B batch, T sequence, D model width, N query heads, K key/value
heads, H head width, V vocabulary, L layers, E experts, F expert MLP width, R experts chosen per
token (top-k), A = tokens x R assignments, M rows of a grouped matmul, G groups, X experts held by
one device, P devices on the expert axis, C expert capacity.

The MoE block, per layer (Switch Transformer, Mixtral, Qwen3-MoE):

    p = softmax(h W_router)            in float32: near-ties flip on bfloat16 rounding
    experts, g = top_k(p), renormalised to sum 1 when norm_topk (Mixtral, Qwen3-MoE)
    y = sum_r g_r SwiGLU_{expert_r}(h)

Dropless (the default): the (token, expert) assignments are sorted by expert and each expert
runs on exactly its rows, one grouped matmul (`grouped_mlp`), nothing padded or dropped.
Capacity mode (`--model.capacity-factor > 0`, GShard/MaxText): an expert takes at most
C = ceil(cf * tokens * R / E) rows per batch shard, first choices first; the rest skip it (the
residual stream carries them). Expert parallelism: the `expert` mesh axis splits the experts
and the batch; in a `shard_map` each device sends each peer the rows for its experts and gets
the results back (two all-to-alls). Data and fsdp sharding work as in train_dense.py."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from common import hf, train
from common.attention import attend, check_kernel, choose, fold_context, from_context, to_context
from common.config import how, knob, resumable
from common.checkpoint import CheckpointConfig
from common.data import DataConfig, get_batch, load_dataset
from common.eval import DuringTraining
from common.mesh import BATCH_AXES, MeshConfig, describe, make_mesh, resolve, target_platform
from common.train import ConfigError, LoRAConfig, log, named, need

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
    # 0 = dropless; > 0: capacity mode, tokens over capacity dropped. Not the model's shape:
    # HF's models are dropless, and capacity is an approximation that training may choose.
    capacity_factor: float = knob(0.0, compute=True)
    max_seq_len: int = 2048
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qk_norm: bool = False         # Qwen3: RMSNorm on each head of q and k before RoPE
    # GPT-OSS. Each knob's off value is falsy and leaves the Mixtral block bit for bit.
    sliding_window: int = 0       # local layers see the last W tokens, themselves included
    global_every: int = 0         # with a window: layers n-1, 2n-1, ... are global; 0 = none
    attn_sinks: bool = False      # a learned logit per head joins every softmax's denominator
    attn_bias: bool = False       # biases on q, k, v and o
    moe_bias: bool = False        # biases on the router and on each expert's three projections
    swiglu_limit: float = 0.0     # clamped SwiGLU (see `glu`) at this limit (7.0); 0 = plain
    yarn_factor: float = 0.0      # YaRN RoPE: context stretched this many times (32); 0 = off
    yarn_original_max_len: int = 4096  # the context the model was pre-trained on
    yarn_beta_fast: float = 32.0  # dims turning more often than this over it are kept ...
    yarn_beta_slow: float = 1.0   # ... less often than this interpolated, a ramp between
    yarn_truncate: bool = True    # round the ramp's ends to whole dims (GPT-OSS: False)
    # DeepSeek-V2/V3 and Kimi K2 (see `mla` and `router`); off when falsy, as above.
    kv_lora_rank: int = 0         # MLA: keys and values from one normed latent this wide; 0 = GQA
    q_lora_rank: int = 0          # MLA: queries through a normed latent this wide; 0 = direct
    qk_nope_head_dim: int = 128   # MLA: the per-head part of q and k that is not rotated
    qk_rope_head_dim: int = 64    # MLA: the rotated part; its key is one for all heads
    v_head_dim: int = 128         # MLA: the value heads' width
    yarn_mscale_all_dim: float = 0.0  # MLA with YaRN: the m of its temperature (see `attention`)
    rope_interleave: bool = False  # RoPE turns pairs (2i, 2i+1), as DeepSeek's and Llama 4's do
    sigmoid_routing: bool = False  # scores sigmoid(logits); top-k chosen on scores + a bias
    routed_scale: float = 0.0     # the routed experts' output times this (routed_scaling_factor)
    seq_aux: bool = False         # the aux loss per sequence, then averaged (DeepSeek-V3's)
    n_group: int = 0              # group-limited routing: experts in this many groups ...
    topk_group: int = 0           # ... of which each token may use the best this many
    n_shared_experts: int = 0     # a SwiGLU n_shared_experts x d_ff wide that every token uses
    first_k_dense: int = 0        # the first this many layers have a dense MLP, no experts
    dense_d_ff: int = 0           # that MLP's hidden width
    # Llama 4 (its config.json's names in `_HF_FAMILY_FIELDS`): see `block` and `attention`.
    moe_every: int = 1            # 2: the odd layers MoE, the even ones dense (dense_d_ff wide)
    score_inputs: bool = False    # each expert's input, not its output, times the routing score
    attn_chunk: int = 0           # local layers attend within aligned chunks this long; 0 = off
    global_nope: bool = False     # global layers unrotated (NoPE), their queries tempered ...
    attn_temp_scale: float = 0.0  # ... by 1 + this * log(1 + floor((t + 1) / attn_temp_floor))
    attn_temp_floor: int = 8192
    qk_l2_norm: bool = False      # unweighted RMSNorm of q and k after RoPE, on the RoPE layers
    rope_scaling: float = 0.0     # Llama 3.1's RoPE scaling (train_dense.py's); 0 = off
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    # Gemma 4 26B-A4B (with GPT-OSS's windows, Qwen3's q/k norms): see `block` and `hidden`.
    gemma4: bool = False          # its block: sandwich norms, GeGLU, embeddings x sqrt(d), values
    # normed, layer scalars, a normed router with per-expert scales, and beside the experts a
    # dense GeGLU (dense_d_ff wide); logits q.k unscaled
    rope_local_theta: float = 0.0  # the local layers' RoPE base; 0 = rope_theta
    global_head_dim: int = 0      # the global layers this wide: a stack of their own
    global_kv_heads: int = 0      # ... with this many key/value heads; 0 = n_kv_heads
    k_eq_v: bool = False          # ... and no value projection: values are the keys' (unnormed)
    rope_partial: float = knob(0.0, "[0, 1]")  # the global layers rotate this share of frequencies
    final_softcap: float = 0.0    # logits -> c tanh(logits / c)
    # How to compute, not what: these may change when a run is resumed.
    dtype: Literal["float32", "bfloat16"] = how("float32")  # activations and matmuls (weights f32)
    # auto: splash on TPU, cuDNN on GPU where it applies, else blocked (common/attention.py)
    attention: Literal["auto", "splash", "cudnn", "blocked", "xla", "einsum"] = how("auto")
    context_attention: Literal["allgather", "ring", "ulysses"] = how("allgather")  # --mesh.context
    remat: Literal["full", "dots", "none"] = how("full")  # what the backward pass may keep
    scan_layers: bool = how(True)
    loss_chunk: int = how(256)    # sequence positions per cross-entropy chunk (bounds [B,T,V])
    grouped_matmul: Literal["auto", "ragged_dot", "tiled", "megablox"] = how("auto")  # _grouped_impl
    gmm_tile: int = how(128)      # rows per tile of the tiled grouped matmul
    down_split: Literal["f", "d"] = how("f")  # the axis of w_down fsdp splits (`_layer_table`)
    # DeepSeek-V3.2's sparse attention (DSA, see `dsa`): a lightning indexer of index_n_heads
    # heads (0 = off) picks each query's index_topk keys, to which alone MLA attends
    index_n_heads: int = 0
    index_head_dim: int = 128
    index_topk: int = 2048
    index_chunk: int = how(64)    # queries per block of the indexer's scores and the attention
    mtp_depth: int = knob(0, ">= 0")  # DeepSeek-V3's multi-token prediction modules (`mtp`)
    # Qwen3-Next (see `gated_deltanet`): with global_every n, the layers between the global ones
    # are Gated DeltaNet with this many key heads (0 = none), each serving value heads in groups
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 128
    linear_v_dim: int = 128
    linear_conv: int = 4          # the causal depthwise convolution's width over q, k and v
    linear_chunk: int = how(64)   # positions per chunk of the chunkwise delta rule
    attn_gate: bool = False       # attention output times sigmoid of a second query projection
    rotary_dim: int = 0           # rotate only each head's first this many dims; 0 = all
    norm_offset: bool = False     # RMSNorm gains stored zero-centred: the gain is 1 + w
    shared_gated: bool = False    # the shared expert's output times sigmoid(h . w) per token
    # DeepSeek-V4 (see `v4_hidden`): hc_mult residual streams mixed by mHC (0 = off); each layer's
    # attention by compress_ratios: 0 the window alone, csa_ratio CSA, another rate HCA; one K = V
    # head (n_kv_heads 1) turned on its last rotary_dim dims, in pairs
    hc_mult: int = 0
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    compress_ratios: tuple[int, ...] = ()
    csa_ratio: int = 4
    compress_rope_theta: float = 10_000.0  # the compressed layers' RoPE base (YaRN theirs only)
    o_groups: int = 0             # the output projection: heads in this many groups, each ...
    o_lora_rank: int = 0          # ... projected to this width, then all of them to d_model
    n_hash_layers: int = 0        # the first this many layers route by a token's fixed experts
    sqrt_softplus: bool = False   # sigmoid routing's scores sqrt(softplus(logits)) instead


@dataclass(frozen=True)
class TrainConfig:
    steps: int = resumable(300)
    batch_size: int = 16          # global, in sequences
    seq_len: int = 256
    microbatches: int = resumable(1)  # gradient accumulation: batch_size is split into this many
    pipeline_repeats: int = resumable(1)  # --mesh.stage: chunks of layers a stage holds (circular)
    lr: float = resumable(2e-3)
    min_lr_ratio: float = knob(0.1, "[0, 1]")  # the schedule ends at lr * min_lr_ratio
    warmup_steps: int = knob(30, ">= 0")
    schedule: Literal["cosine", "constant", "wsd"] = "cosine"
    decay_fraction: float = knob(0.2, "(0, 1]")  # wsd: the last fraction of steps decays linearly
    weight_decay: float = knob(0.1, ">= 0")
    b1: float = knob(0.9, "[0, 1)")
    b2: float = knob(0.95, "[0, 1)")
    clip_norm: float = 1.0
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: the hidden matrices (common/train.py)
    muon_dtype: Literal["float32", "bfloat16"] = "float32"  # Muon's momentum and iteration
    qk_clip_threshold: float = resumable(0.0, ">= 0")  # MuonClip: q.k logits <= this; 0 = off
    z_loss: float = 0.0           # weight of the output mean(logsumexp^2) (PaLM); 0 = off
    load_balance_loss: float = knob(0.01, ">= 0")  # Switch balancing loss weight (layer mean)
    router_z_loss: float = knob(0.001, ">= 0")  # weight of the router's mean(logsumexp^2) (ST-MoE)
    router_bias_rate: float = 0.0  # sigmoid routing: each step a bias moves this far (1e-3)
    seed: int = 0
    log_every: int = resumable(10)
    eval_every: int = resumable(100)
    eval_batches: int = resumable(4)
    eval_tasks: str = resumable("")  # lm-eval tasks scored at each eval (docs/eval.md); "" = none
    eval_tasks_limit: int = resumable(0, ">= 0")  # examples per task; 0 = all
    sample_tokens: int = resumable(96, ">= 0")  # printed at the end; 0 = no sample
    temperature: float = resumable(0.7, ">= 0")  # of that sample; 0 = greedy
    sample_prompt: str = resumable("def")  # no trailing space: it would tokenize as a lone "▁"
    peak_tflops: float = resumable(0.0)  # per device, for MFU; 0 = look up or measure
    profile_steps: tuple[int, ...] = resumable(())  # first, last step traced to <run_dir>/profile
    max_bad_steps: int = resumable(0)  # non-finite updates to skip; then stop
    # DSA: the first this many steps train only the indexer, on dense attention (`dsa`)
    indexer_warmup_steps: int = knob(0, ">= 0")
    mtp_weight: float = resumable(0.3, ">= 0")  # the MTP loss's (DeepSeek-V3: 0.3, then 0.1)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = resumable(MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = resumable(CheckpointConfig)
    lora: LoRAConfig = field(default_factory=partial(  # LoRA
        LoRAConfig, targets="wq,wk,wv,wo,w_gate,w_up,w_down"))
    run_dir: str = resumable("runs/tiny-moe")
    dry_run: bool = resumable(False)  # compile one step on abstract inputs, print memory, exit
    compile_topology: str = resumable("")  # --dry-run for this TPU type (v5p-256): libtpu
    compile_slices: int = resumable(1)  # ... and this many slices of it (set --mesh.dcn-* to match)
    bench: int = resumable(0)     # time this many steps on synthetic tokens, print, exit
    bench_twin: bool = resumable(True)  # --bench also times the dense twin (same active parameters)
    quiet: bool = resumable(False)  # no progress lines; steps, evals and the summary still print
    init_from_hf: str = ""        # HuggingFace folder: start from its weights and config.json


# DeepSeek-V3's balancing (sec. 4.2) for the sigmoid presets: bias rate 1e-3, aux 1e-4, no z.
_DEEPSEEK_BALANCE = dict(router_bias_rate=1e-3, load_balance_loss=1e-4, router_z_loss=0.0)


def _big(model: ModelConfig, run: str) -> Config:
    balance = (_DEEPSEEK_BALANCE if model.sigmoid_routing and not model.score_inputs else
               dict(load_balance_loss=1e-3))
    return Config(model=dataclasses.replace(model, dtype="bfloat16"), train=TrainConfig(
        steps=100_000, batch_size=256, seq_len=4096, lr=3e-4, warmup_steps=2000, log_every=10,
        eval_every=1000, sample_tokens=0, **balance), checkpoint=CheckpointConfig(every=1000),
        run_dir=f"runs/{run}")


_QWEN3_MOE = dict(rope_theta=1_000_000.0, norm_eps=1e-6, qk_norm=True)
# GPT-OSS (OpenAI 2025): its released config.json's values.
_GPT_OSS = dict(sliding_window=128, global_every=2, attn_sinks=True, attn_bias=True, moe_bias=True,
                swiglu_limit=7.0, yarn_factor=32.0, yarn_truncate=False, rope_theta=150_000.0)
# DeepSeek's MLA (V2-Lite's, V3's, Kimi K2's); V3 and K2 share the block (their config.json): a
# query latent, 8 of the routed experts plus one shared, sigmoid scores, YaRN with mscale 1.
_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            norm_eps=1e-6, yarn_original_max_len=4096, seq_aux=True)
_DEEPSEEK_V2 = _MLA | dict(norm_topk=False, n_shared_experts=2, first_k_dense=1,
                           yarn_factor=40.0, yarn_mscale_all_dim=0.707, rope_interleave=True)
_DEEPSEEK_V3 = _MLA | dict(q_lora_rank=1536, dense_d_ff=18432, n_shared_experts=1,
                           sigmoid_routing=True, yarn_mscale_all_dim=1.0)
# Llama 4 (its config.json's): top-1 sigmoid routing of the expert's input beside a shared
# expert; every fourth layer global and unrotated, the others in chunks of 8192 tokens.
_LLAMA4 = dict(sigmoid_routing=True, norm_topk=False, score_inputs=True, n_shared_experts=1,
               global_every=4, global_nope=True, attn_chunk=8192, attn_temp_scale=0.1,
               rope_interleave=True, rope_theta=500_000.0)
# Gemma 4's MoE (its config.json's): the 31B's attention (every sixth layer global, 512 wide with
# K = V heads, a quarter of its frequencies turned), a dense GeGLU beside the experts, soft-cap.
_GEMMA4 = dict(gemma4=True, qk_norm=True, tie_embeddings=True, norm_eps=1e-6, sliding_window=1024,
               global_every=6, rope_theta=1e6, rope_local_theta=1e4, global_head_dim=512,
               k_eq_v=True, rope_partial=0.25, final_softcap=30.0)
# Qwen3-Next: three Gated DeltaNet layers (16 key heads, 32 value heads, 128 wide) to one of
# gated attention (a quarter of each head turned, q/k norms), zero-centred norm gains, a gated
# shared expert beside the routed ones (transformers' Qwen3NextConfig defaults).
_QWEN3_NEXT = dict(norm_eps=1e-6, qk_norm=True, global_every=4, linear_k_heads=16,
                   linear_v_heads=32, attn_gate=True, norm_offset=True, n_shared_experts=1,
                   shared_gated=True)
# DeepSeek-V4 (its config.json): mHC over 4 streams; one K = V head 512 wide, 64 dims turned;
# a window of 128 on every layer, CSA (rate 4, the indexer's best 512) and HCA (rate 128) layers
# beside it, YaRN on those; the first 3 layers hash-routed, the rest by sqrt-softplus scores.
_DEEPSEEK_V4 = dict(hc_mult=4, q_lora_rank=1024, rotary_dim=64, o_groups=8, o_lora_rank=1024,
                    sliding_window=128, attn_sinks=True, index_n_heads=64, index_head_dim=128,
                    index_topk=512, sigmoid_routing=True, sqrt_softplus=True, routed_scale=1.5,
                    n_shared_experts=1, swiglu_limit=10.0, n_hash_layers=3, norm_eps=1e-6,
                    compress_rope_theta=160_000.0, yarn_factor=16.0, yarn_original_max_len=65536)
# The released models: description, shape (these fields), the family's and model's knobs.
_SHAPE = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
          "n_experts", "top_k", "d_ff", "max_seq_len")
_RELEASED = {
    "mixtral-8x7b": ("Mixtral 8x7B (8 experts, top-2)",
                     (32000, 4096, 32, 32, 8, 128, 8, 2, 14336, 32768), dict(rope_theta=1e6)),
    "qwen3-30b-a3b": ("Qwen3-30B-A3B (128 experts, top-8, q/k norm)",
                      (151936, 2048, 48, 32, 4, 128, 128, 8, 768, 40960), _QWEN3_MOE),
    "qwen3-235b-a22b": ("Qwen3-235B-A22B (128 experts, top-8, q/k norm)",
                        (151936, 4096, 94, 64, 4, 128, 128, 8, 1536, 40960), _QWEN3_MOE),
    # V2 routes by softmax, its top 6 not renormalised, beside 2 shared experts; Lite has no
    # query latent and no groups.
    "deepseek-v2-lite": ("DeepSeek-V2-Lite (64 experts top-6 + 2 shared, MLA)",
                         (102400, 2048, 27, 16, 16, 64, 64, 6, 1408, 163840), _DEEPSEEK_V2 | dict(
                             dense_d_ff=10944)),
    "deepseek-v2": ("DeepSeek-V2 (160 experts top-6 in 8 groups + 2 shared, MLA)",
                    (102400, 5120, 60, 128, 128, 64, 160, 6, 1536, 163840), _DEEPSEEK_V2 | dict(
                        q_lora_rank=1536, dense_d_ff=12288, routed_scale=16.0, n_group=8,
                        topk_group=3)),
    "deepseek-v3": ("DeepSeek-V3 (256 experts top-8 in 8 groups + 1 shared, MLA; its multi-"
                    "token-prediction module)",
                    (129280, 7168, 61, 128, 128, 64, 256, 8, 2048, 163840), _DEEPSEEK_V3 | dict(
                        routed_scale=2.5, n_group=8, topk_group=4, first_k_dense=3,
                        yarn_factor=40.0, mtp_depth=1)),
    "kimi-k2": ("Kimi K2 (384 experts top-8 + 1 shared, MLA, DeepSeek-V3's block)",
                (163840, 7168, 61, 64, 64, 64, 384, 8, 2048, 131072), _DEEPSEEK_V3 | dict(
                    first_k_dense=1, routed_scale=2.827, rope_theta=50_000.0, yarn_factor=32.0,
                    yarn_beta_fast=1.0, norm_eps=1e-5)),
    "deepseek-v4-flash": ("DeepSeek-V4-Flash (256 experts top-6 + 1 shared, the first 3 layers "
                          "hash-routed; mHC over 4 streams; window, CSA and HCA attention; "
                          "without the MTP module)", (129280, 4096, 43, 64, 1, 512, 256, 6, 2048,
                                                      1048576), _DEEPSEEK_V4 | dict(
                              compress_ratios=(0, 0) + (4, 128) * 20 + (4,))),
    "gpt-oss-20b": ("GPT-OSS 20B (32 experts, top-4)",
                    (201088, 2880, 24, 64, 8, 64, 32, 4, 2880, 131072), _GPT_OSS),
    "gpt-oss-120b": ("GPT-OSS 120B (128 experts, top-4)",
                     (201088, 2880, 36, 64, 8, 64, 128, 4, 2880, 131072), _GPT_OSS),
    "llama4-scout-17b-16e": ("Llama 4 Scout (16 experts, top-1 + 1 shared, q/k norm)",
                             (202048, 5120, 48, 40, 8, 128, 16, 1, 8192, 10485760), _LLAMA4 | dict(
                                 qk_l2_norm=True, rope_scaling=16.0, rope_high_freq_factor=1.0)),
    "llama4-maverick-17b-128e": ("Llama 4 Maverick (128 experts, top-1 + 1 shared, on every "
                                 "second layer; dense layers between)",
                                 (202048, 5120, 48, 40, 8, 128, 128, 1, 8192, 1048576),
                                 _LLAMA4 | dict(moe_every=2, dense_d_ff=16384)),
    "gemma4-26b-a4b": ("Gemma 4 26B-A4B, its text model (128 experts, top-8, beside a dense MLP)",
                       (262144, 2816, 30, 16, 8, 256, 128, 8, 704, 262144), _GEMMA4 | dict(
                           global_kv_heads=2, dense_d_ff=2112)),
    # the release's config.json: RoPE base 1e7, 262144 positions (transformers: 1e4, 32768)
    "qwen3-next-80b-a3b": ("Qwen3-Next 80B-A3B (512 experts top-10 + 1 gated shared; DeltaNet "
                           "on 3 layers of 4)", (151936, 2048, 48, 16, 2, 256, 512, 10, 512,
                                                 262144), _QWEN3_NEXT | dict(
                               rotary_dim=64, rope_theta=1e7)),
    # Qwen3.5: the releases' text_config (their vision tower and MTP module are not ours)
    "qwen3.5-397b-a17b": ("Qwen3.5-397B-A17B, its language model (512 experts top-10 + 1 gated "
                          "shared; DeltaNet on 3 layers of 4, 64 value heads)", (
                              248320, 4096, 60, 32, 2, 256, 512, 10, 1024, 262144), _QWEN3_NEXT
                          | dict(linear_v_heads=64, rotary_dim=64, rope_theta=1e7)),
    "qwen3.5-35b-a3b": ("Qwen3.5-35B-A3B, its language model (256 experts top-8 + 1 gated "
                        "shared; DeltaNet on 3 layers of 4)", (
                            248320, 2048, 40, 16, 2, 256, 256, 8, 512, 262144), _QWEN3_NEXT
                        | dict(rotary_dim=64, rope_theta=1e7))}

_RELEASED["deepseek-r1"] = ("DeepSeek-R1 (DeepSeek-V3's model)", *_RELEASED["deepseek-v3"][1:])
# DeepSeek-V3.2(-Exp): V3's model, its MLA in RoPE pairs, and the lightning indexer (its config).
_RELEASED["deepseek-v3.2"] = ("DeepSeek-V3.2 (DeepSeek-V3 with sparse attention: MLA over each "
                              "query's 2048 keys as a lightning indexer ranks them; without the "
                              "MTP module)", _RELEASED["deepseek-v3"][1], _RELEASED["deepseek-v3"][
                                  2] | dict(rope_interleave=True, index_n_heads=64,
                                            index_head_dim=128, index_topk=2048, mtp_depth=0))

PRESETS: dict[str, tuple[str, Config]] = {
    # No remat: the tiny model's activations are a few MB, and recomputing them would cost a
    # third of every step on a laptop CPU.
    "tiny-moe": ("~9M parameters (4.5M active), 8 experts top-2, on the embedded corpus: the "
                 "`make train-moe` default", Config(model=ModelConfig(remat="none"))),
    "tiny-gptoss": ("tiny-moe with GPT-OSS's knobs (window 128 of the 256 tokens on every "
                    "second layer): `make train-moe MOE_PRESET=tiny-gptoss`", Config(
                        model=ModelConfig(remat="none", **_GPT_OSS), run_dir="runs/tiny-gptoss")),
    # DeepSeek-V3's block at tiny-moe's size: 8 experts in 4 groups (2 chosen), its balancing.
    "tiny-deepseek": ("tiny-moe with DeepSeek-V3's knobs (MLA, sigmoid group-limited routing "
                      "with bias balancing, a shared expert, a dense first layer): "
                      "`make train-moe MOE_PRESET=tiny-deepseek`", Config(model=ModelConfig(
                          remat="none", n_kv_heads=4, kv_lora_rank=64, q_lora_rank=96,
                          qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                          sigmoid_routing=True, routed_scale=2.5, n_group=4, topk_group=2,
                          n_shared_experts=1, first_k_dense=1, dense_d_ff=512, seq_aux=True),
                          train=TrainConfig(**_DEEPSEEK_BALANCE), run_dir="runs/tiny-deepseek")),
    "tiny-llama4": ("tiny-moe with Llama 4's knobs (top-1 + shared expert on every second layer, "
                    "chunks of 64 tokens, layer 4 unrotated): `make train-moe MOE_PRESET=tiny-"
                    "llama4`", Config(model=ModelConfig(remat="none", **_LLAMA4 | dict(
                        top_k=1, moe_every=2, dense_d_ff=512, attn_chunk=64, attn_temp_floor=64,
                        qk_l2_norm=True)), run_dir="runs/tiny-llama4")),
    "tiny-gemma4-moe": ("tiny-moe with Gemma 4's knobs (every second layer global, 128 wide with "
                        "one K = V head; a dense MLP beside the experts): `make train-moe "
                        "MOE_PRESET=tiny-gemma4-moe`", Config(model=ModelConfig(
                            remat="none", **_GEMMA4 | dict(sliding_window=128, global_every=2,
                                                           global_head_dim=128, global_kv_heads=1,
                                                           dense_d_ff=512)),
                            run_dir="runs/tiny-gemma4-moe")),
    "tiny-qwen35": ("tiny-moe with Qwen3-Next's block (layers 1-3 Gated DeltaNet with 2 key and "
                    "4 value heads, layer 4 gated attention, a gated shared expert): `make "
                    "train-moe MOE_PRESET=tiny-qwen35`", Config(model=ModelConfig(
                        remat="none", **_QWEN3_NEXT | dict(linear_k_heads=2, linear_v_heads=4,
                                                           linear_k_dim=64, linear_v_dim=64,
                                                           rotary_dim=16)),
                        run_dir="runs/tiny-qwen35")),
    # The model bench/peers/maxtext.sh runs in MaxText (Mixtral block), for side-by-side speed.
    "bench-parity-moe": ("MaxText comparison: d 256, 4 layers, 8 experts top-2, expert MLP 512, "
                         "vocab 32000, seq 256, batch 8", Config(ModelConfig(
                             vocab_size=32000, n_kv_heads=4, d_ff=512), TrainConfig(
                             batch_size=8, seq_len=256), bench_twin=False)),
} | {name: (about, _big(ModelConfig(**dict(zip(_SHAPE, shape)), **knobs), name))
     for name, (about, shape, knobs) in _RELEASED.items()}
_TINY_DS = PRESETS["tiny-deepseek"][1]
PRESETS["tiny-deepseek32"] = (
    "tiny-deepseek with DeepSeek-V3.2's indexer (4 heads 32 wide; each query's best 64 of the "
    "256 keys), its first 20 steps the indexer's warm-up: `make train-moe MOE_PRESET=tiny-"
    "deepseek32`", dataclasses.replace(_TINY_DS, model=dataclasses.replace(
        _TINY_DS.model, rope_interleave=True, index_n_heads=4, index_head_dim=32, index_topk=64),
        train=dataclasses.replace(_TINY_DS.train, indexer_warmup_steps=20),
        run_dir="runs/tiny-deepseek32"))

PRESETS["tiny-deepseek4"] = (
    "tiny-moe with DeepSeek-V4's block (mHC over 4 streams; layers window, CSA, HCA (rate 16), "
    "CSA, a window of 64; the first layer hash-routed, a shared expert): `make train-moe "
    "MOE_PRESET=tiny-deepseek4`", Config(model=ModelConfig(remat="none", **_DEEPSEEK_V4 | dict(
        n_kv_heads=1, q_lora_rank=96, rotary_dim=16, o_groups=2, o_lora_rank=64, sliding_window=64,
        index_n_heads=4, index_head_dim=32, index_topk=16, n_hash_layers=1, yarn_factor=0.0,
        compress_ratios=(0, 4, 16, 4))), train=TrainConfig(**_DEEPSEEK_BALANCE),
        run_dir="runs/tiny-deepseek4"))

# ----------------------------------------------------------------------------------------------
# 2. Parameters and their shardings
# ----------------------------------------------------------------------------------------------
def _param_table(cfg: ModelConfig) -> dict:
    """The one definition of the parameter tree: name -> (shape, PartitionSpec, init std; None:
    ones). Layers stacked on a leading L axis (for lax.scan), a layer's experts on an E axis split
    over `expert` (whole experts per device, d over fsdp, hidden width over tensor). Std 0.02, over
    sqrt(2L) into the residual stream (GPT-2). The dense layers (first_k_dense, run first, or with
    moe_every 2 one before each MoE layer) are a second stack: a scan needs the same weights in
    every layer."""
    L, D, V, n_moe = cfg.n_layers, cfg.d_model, cfg.vocab_size, moe_layers(cfg)
    table = {"embed": ((V, D), P("tensor", "fsdp"), 0.02),
             "layers": _layer_table(cfg, n_moe, moe=True),
             "final_norm": ((D,), P(None), 0.0 if cfg.norm_offset else None)}
    if n_moe < L:
        table["dense_layers"] = _layer_table(cfg, L - n_moe, moe=False)
    if cfg.global_head_dim or cfg.linear_k_heads:  # Gemma 4, Qwen3-Next: each period's global
        n = cfg.global_every                         # layer, of its own shape
        table |= {"layers": _layer_table(cfg, L - L // n, True), "global_layers": _layer_table(
            cfg, L // n, True, glob=True)}
    if not cfg.tie_embeddings:
        table["unembed"] = ((D, V), P("fsdp", "tensor"), 0.02)
    if S := cfg.hc_mult:  # DeepSeek-V4: the compressors of the CSA and HCA layers (a stack each),
        # the hash layers' token -> experts tables (frozen: no gradient, no decay), the streams' head
        Lh = cfg.n_hash_layers  # the first layers route by hashing: a stack of their own
        table |= {k: _compressor_table(cfg, k) for k, n in zip(("csa", "hca"), v4_kinds(cfg)[2][
            1:]) if n} | {"hc_head_fn": ((S * D, S), P("fsdp", None), 0.02), "hc_head_base": (
                (S,), P(None), 0.0), "hc_head_scale": ((1,), P(None), None),
            "layers": _layer_table(cfg, L - Lh, moe=True)} | ({"hash_layers": _layer_table(
                cfg, Lh, moe=True) | {"tid2eid": ((Lh, V, cfg.top_k), P(None), partial(
                hash_experts, cfg.n_experts))}} if Lh
            else {})
    if Dm := cfg.mtp_depth:  # per depth (`mtp`): norms, the projection of [e; h], a MoE layer
        table["mtp"] = {"layers": _layer_table(cfg, Dm, moe=True), "eh_proj": (
            (Dm, 2 * D, D), P(None, "fsdp", None), 0.02)} | {
            k: ((Dm, D), P(None, None), None) for k in ("enorm", "hnorm", "head_norm")}
    return table


def moe_layers(cfg: ModelConfig) -> int:
    return (cfg.n_layers - cfg.first_k_dense) // cfg.moe_every


def _layer_table(cfg: ModelConfig, L: int, moe: bool, glob: bool = False) -> dict:
    """One stack of L layers: attention (GQA or MLA), then the experts or a dense MLP. A row:
    name -> (shape and spec after the L axis, init std, whether this stack has it)."""
    D, N, K, H, E, F = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_experts,
                        cfg.d_ff)
    C, Qr, Hn, Hr, Hv = (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_nope_head_dim,
                         cfg.qk_rope_head_dim, cfg.v_head_dim)
    v4, G, Ro, S = moe and cfg.hc_mult > 0, cfg.o_groups, cfg.o_lora_rank, cfg.hc_mult
    Fd, Fs, q_latent = cfg.dense_d_ff, cfg.n_shared_experts * F, bool((C or v4) and Qr)
    Mi, Hi = cfg.index_n_heads, cfg.index_head_dim
    std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)
    H, K = (cfg.global_head_dim, cfg.global_kv_heads or K) if glob and cfg.global_head_dim else (
        H, K)  # Gemma 4's
    g4, lin = moe and cfg.gemma4, moe and not glob and cfg.linear_k_heads  # lin: DeltaNet's
    Hk, Lv, Dk, Dv = (cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim)
    r = Lv // max(Hk, 1)
    ex = "expert" if E > 1 else None  # one expert (the dense twin): the axis only splits the batch
    bias = moe and cfg.moe_bias  # b_down is whole on every tensor shard: `experts` adds it on one
    qk_norm, biased = moe and cfg.qk_norm and not lin, moe and cfg.attn_bias
    rows = {
        "attn_norm": ((D,), (None,), None, True), "mlp_norm": ((D,), (None,), None, True),
        "wq": ((D, N, Hn + Hr if C else H), ("fsdp", "tensor", None), std, not q_latent and
               not lin), "wk": ((D, K, H), ("fsdp", "tensor", None), std, not C and not lin
               and not v4), "wv": ((D, K, H), ("fsdp", "tensor", None), std, not C and not v4
                                   and not (glob and cfg.k_eq_v) and not lin),
        "wo": ((N, Hv if C else H, D), ("tensor", None, "fsdp"), out_std, not lin and not v4),
        # DeepSeek-V4 (`v4_attention`): one normed K = V head, the grouped output projection;
        # mHC's weights before the attention and the MLP (`hc_pre`)
        "wkv": ((D, H), ("fsdp", None), std, v4),
        "wo_a": ((G, N * H // max(G, 1), Ro), ("tensor", None, None), std, v4),
        "wo_b": ((G * Ro, D), (None, "fsdp"), out_std, v4),
        **{f"hc_{k}_{n}": (s, sp, sd, v4) for k in ("attn", "ffn") for n, (s, sp, sd) in dict(
            fn=((S * D, (2 + S) * S), ("fsdp", None), std), base=(((2 + S) * S,), (None,), 0.0),
            scale=((3,), (None,), None)).items()},
        "wq_gate": ((D, N, H), ("fsdp", "tensor", None), std, moe and cfg.attn_gate and not lin),
        # Gated DeltaNet (`gated_deltanet`): per key head its q, k, its group's v, z, b and a
        **{k: ((D, Hk, *s), ("fsdp", "tensor") + (None,) * len(s), std, lin) for k, s in dict(
            lin_q=(Dk,), lin_k=(Dk,), lin_v=(r, Dv), lin_z=(r, Dv), lin_b=(r,), lin_a=(r,)
        ).items()},
        "lin_conv": ((cfg.linear_conv, 1, 2 * Hk * Dk + Lv * Dv), (None, None, None),
                     1 / math.sqrt(cfg.linear_conv), lin),
        "A_log": ((Lv,), ("tensor",), 0.5, lin), "dt_bias": ((Lv,), ("tensor",), None, lin),
        "lin_norm": ((Dv,), (None,), None, lin),
        "lin_wo": ((Lv, Dv, D), ("tensor", None, "fsdp"), out_std, lin),
        # MLA (see `mla`): latents whole on each device, heads over tensor
        "wkv_a": ((D, C + Hr), ("fsdp", None), std, C),
        "kv_norm": ((C or H,), (None,), None, C or v4),
        "wkv_b": ((C, N, Hn + Hv), (None, "tensor", None), std, C),
        "wq_a": ((D, Qr), ("fsdp", None), std, q_latent),
        "q_norm_a": ((Qr,), (None,), None, q_latent),
        "wq_b": ((Qr, N, Hn + Hr if C else H), (None, "tensor", None), std, q_latent),
        "mlp_gate": ((D, Fd), ("fsdp", "tensor"), std, not moe or g4),
        "mlp_up": ((D, Fd), ("fsdp", "tensor"), std, not moe or g4),
        "mlp_down": ((Fd, D), ("tensor", "fsdp"), out_std, not moe or g4),
        # The MoE stack's only: DeepSeek's dense first layers have none of the rest.
        "w_router": ((D, E), ("fsdp", None), std, moe),
        "w_gate": ((E, D, F), (ex, "fsdp", "tensor"), std, moe),
        "w_up": ((E, D, F), (ex, "fsdp", "tensor"), std, moe),
        # fsdp on F: on d, its last axis, XLA:TPU copied each gradient to a d-major layout to
        # reduce it (DeepSeek-V3, v5p-32: 3 x 7.5 GB a step, est. 0.6308 s -> 0.5643 without)
        "w_down": ((E, F, D), (ex, ("tensor", "fsdp"), None) if cfg.down_split == "f" else (
            ex, "tensor", "fsdp"), out_std, moe),
        "shared_gate": ((D, Fs), ("fsdp", "tensor"), std, moe and Fs),
        "shared_up": ((D, Fs), ("fsdp", "tensor"), std, moe and Fs),
        "shared_down": ((Fs, D), ("tensor", "fsdp"), out_std, moe and Fs),
        "shared_router": ((D, 1), ("fsdp", None), std, moe and cfg.shared_gated),
        "q_norm": ((H,), (None,), None, qk_norm), "k_norm": ((H,), (None,), None, qk_norm),
        "bq": ((N, H), ("tensor", None), 0.0, biased), "bo": ((D,), (None,), 0.0, biased),
        "bk": ((K, H), ("tensor", None), 0.0, biased),
        "bv": ((K, H), ("tensor", None), 0.0, biased),
        "sinks": ((N,), ("tensor",), 0.0, moe and cfg.attn_sinks),
        "b_router": ((E,), (None,), 0.0, bias), "b_gate": ((E, F), (ex, "tensor"), 0.0, bias),
        "b_up": ((E, F), (ex, "tensor"), 0.0, bias), "b_down": ((E, D), (ex, None), 0.0, bias),
        **{k: ((D,), (None,), None, g4) for k in (  # Gemma 4's norms and router gain (of D)
            "attn_post_norm", "dense_post_norm", "moe_norm", "moe_post_norm", "mlp_post_norm",
            "router_scale")}, "expert_scale": ((E,), (None,), None, g4),
        "layer_scale": ((1,), (None,), None, g4),
        # DSA's indexer (`indexer`), in every layer: its heads over tensor as MLA's
        "idx_wq": ((Qr, Mi, Hi), (None, "tensor", None), std, Mi and not v4),
        "idx_wk": ((D, Hi), ("fsdp", None), std, Mi and not v4),
        "idx_w": ((D, Mi), ("fsdp", "tensor"), std, Mi and not v4),
        "idx_k_norm": ((Hi,), (None,), None, Mi and not v4),
        "idx_k_bias": ((Hi,), (None,), 0.0, Mi and not v4)}
    zero = lambda k, s: 0.0 if cfg.norm_offset and k in OFFSET_NORMS else s  # gains 1 + w
    return {k: ((L, *shape), P(None, *spec), zero(k, s)) for k, (shape, spec, s, on) in
            rows.items() if on}


OFFSET_NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm")  # with norm_offset: 1 + w


def hash_experts(E: int, shape):
    """V4's hash tables from scratch: token t's R distinct experts (40503 t + r E/R) mod E."""
    t, R = np.arange(shape[1])[:, None], shape[2]
    return jnp.broadcast_to(jnp.asarray((t * 40503 + np.arange(R) * (E // R)) % E, jnp.float32), shape)


def v4_kinds(cfg: ModelConfig):
    """DeepSeek-V4's layers: each one's kind (0 window, 1 CSA, 2 HCA) [L], its place in its
    kind's stack [L], the stacks' sizes (window, CSA, HCA) and the HCA rate."""
    r = np.asarray(cfg.compress_ratios or (0,) * cfg.n_layers)
    kind = np.where(r == 0, 0, np.where(r == cfg.csa_ratio, 1, 2))
    return kind, np.array([np.sum(kind[:i] == k) for i, k in enumerate(kind)], np.int32), [
        int(np.sum(kind == k)) for k in range(3)], int(max(r[kind == 2], default=0))


def _compressor_table(cfg: ModelConfig, kind: str) -> dict:
    """A stack of V4's KV compressors (`compress`): CSA's (rate csa_ratio, windows overlapping:
    two series a token) with its indexer's own compressor and queries, or HCA's."""
    D, H, Mi, Hi, csa = cfg.d_model, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim, kind == "csa"
    _, _, sizes, hca = v4_kinds(cfg)
    rate, w = (cfg.csa_ratio, 2) if csa else (hca, 1)
    rows = {f"{p}_{n}": r for p, Hc in (("cmp", H), ("idx", Hi))[:1 + csa] for n, r in dict(
        wkv=((D, w * Hc), ("fsdp", None), 0.02), wgate=((D, w * Hc), ("fsdp", None), 0.02),
        bias=((rate, w * Hc), (None, None), 0.0), norm=((Hc,), (None,), None)).items()}
    if csa:
        rows |= {"idx_wq": ((cfg.q_lora_rank, Mi, Hi), (None, "tensor", None), 0.02),
                 "idx_w": ((D, Mi), ("fsdp", "tensor"), 0.02)}
    return {k: ((sizes[1 if csa else 2], *s), P(None, *sp), sd) for k, (s, sp, sd) in rows.items()}


def param_specs(cfg: ModelConfig) -> dict:
    return train.table_specs(_param_table(cfg))


def _init(cfg: ModelConfig, key: jax.Array) -> dict:
    return train.table_init(_param_table(cfg), key)


def init_params(cfg: ModelConfig, key: jax.Array, mesh=None) -> dict:
    """Float32 master weights, each created directly in its shards (never whole on one device)."""
    out = named(mesh, param_specs(cfg)) if mesh is not None else None
    return jax.jit(partial(_init, cfg), out_shardings=out)(key)


# ----------------------------------------------------------------------------------------------
# 3. Model
# ----------------------------------------------------------------------------------------------
def block(x_BTD, lp: dict, pos_BT, inv_freq, cfg: ModelConfig, max_logits: bool = False,
          is_global=True, warm=None):
    """One layer: attention, then the experts (first_k_dense layers: a dense SwiGLU, no stats;
    with DSA, `warm` (traced) picks its stage and its KL is a statistic of every layer)."""
    lp = train.merged(lp)  # LoRA: each adapted weight merged, in its layer
    lp = lp | {k: 1 + lp[k] for k in OFFSET_NORMS if k in lp} if cfg.norm_offset else lp
    w = weights(lp, x_BTD.dtype, cfg)
    h = rms_norm(x_BTD, lp["attn_norm"], cfg.norm_eps)
    if lin := "lin_q" in lp:  # Qwen3-Next's linear layers: no attention, no logits to clip
        a_BTNV, ind, max_logits = None, {}, False
    elif cfg.index_n_heads:
        a_BTNV, ind = dsa(h, lp, pos_BT, inv_freq, cfg, warm)
    elif cfg.kv_lora_rank:
        q, k, v = mla(h, lp, pos_BT, inv_freq, cfg)
    else:
        q, k = (jnp.einsum("btd,dnh->btnh", h, w(name)) for name in ("wq", "wk"))
        v = jnp.einsum("btd,dnh->btnh", h, w("wv")) if "wv" in lp else k  # else Gemma 4's K = V
        if cfg.attn_bias:
            q, k, v = q + w("bq"), k + w("bk"), v + w("bv")
        if cfg.qk_norm:
            q, k = rms_norm(q, lp["q_norm"], cfg.norm_eps), rms_norm(k, lp["k_norm"], cfg.norm_eps)
        v = rms_norm(v, 1.0, cfg.norm_eps) if cfg.gemma4 else v  # per head, without a gain
        q, k = (halves(x) if cfg.rope_interleave else x for x in (q, k))
        rope = partial_rope if cfg.rotary_dim else apply_rope  # Qwen3-Next: a share of the dims
        qr, kr = rope(q, pos_BT, inv_freq), rope(k, pos_BT, inv_freq)
        if cfg.qk_l2_norm:
            qr, kr = rms_norm(qr, 1.0, cfg.norm_eps), rms_norm(kr, 1.0, cfg.norm_eps)
        if cfg.global_nope:  # Llama 4's global layers: no rotation; the temperature of
            # Nakanishi 2025 (arXiv 2501.19399) sharpens far queries, which see more keys
            t_BT = 1 + cfg.attn_temp_scale * jnp.log1p(
                jnp.floor((pos_BT + 1.0) / cfg.attn_temp_floor))
            qr = jnp.where(is_global, (q * t_BT[..., None, None]).astype(q.dtype), qr)
            kr = jnp.where(is_global, k, kr)
        q, k = qr, kr
    if not (cfg.index_n_heads or lin):
        a_BTNV, ind = attention(q, k, v, lp, cfg, is_global, max_logits), {}
    a_BTNV, top_N = a_BTNV if max_logits else (a_BTNV, None)  # DSA refuses QK-clip
    if cfg.attn_gate and not lin:  # Qwen3-Next: a gate per head and channel
        a_BTNV = a_BTNV * jax.nn.sigmoid(jnp.einsum("btd,dnh->btnh", h, w("wq_gate")))
    o = (gated_deltanet(h, lp, cfg)[0] if lin else
         jnp.einsum("btnh,nhd->btd", a_BTNV, w("wo")))
    o = rms_norm(o, lp["attn_post_norm"], cfg.norm_eps) if cfg.gemma4 else o
    x_BTD = constrain(x_BTD + (o + w("bo") if cfg.attn_bias else o), ACT_BTD)
    h = rms_norm(x_BTD, lp["mlp_norm"], cfg.norm_eps)
    W, C = (n if n < x_BTD.shape[1] else 0 for n in (cfg.sliding_window, cfg.attn_chunk))
    # for QK-clip: each head's largest attention logit, the kernel's or as `attention` computes it
    top = {"max_logit": top_N if top_N is not None else train.max_logits(
        q, k, scale=logit_scale(cfg, q.shape[-1]), window=W, local_chunk=0 if W else C,
        is_global=is_global)} if max_logits else {}
    if "w_router" not in lp:
        return constrain(x_BTD + swiglu(h, {"w_" + k: w("mlp_" + k) for k in PROJ}), ACT_BTD
                         ), top | ind
    if not cfg.gemma4:
        y_BTD, stats = moe(h, lp, cfg)
        return constrain(x_BTD + y_BTD, ACT_BTD), stats | top | ind
    # Gemma 4: a dense GeGLU and the experts side by side, each normed in and out, then their
    # sum; the router reads the stream normed, times its gain over sqrt(d); the layer's scalar.
    # (The experts' post-norm undoes any factor common to a token's k weights: renormalising
    # them or not changes the output only through the norm's epsilon.)
    norm = lambda x, name: rms_norm(x, lp[name], cfg.norm_eps)
    y = norm(swiglu(h, {"w_" + k: w("mlp_" + k) for k in PROJ}, cfg), "dense_post_norm")
    y_BTD, stats = moe(norm(x_BTD, "moe_norm"), lp, cfg, rms_norm(
        x_BTD, lp["router_scale"] / math.sqrt(x_BTD.shape[-1]), cfg.norm_eps))
    x_BTD = x_BTD + norm(y + norm(y_BTD, "moe_post_norm"), "mlp_post_norm")
    return constrain(x_BTD * jax.lax.stop_gradient(lp["layer_scale"]).astype(x_BTD.dtype),
                     ACT_BTD), stats | top


def attention(q_BTNH, k_BTKH, v_BTKV, lp: dict, cfg: ModelConfig, is_global, with_max=False):
    """One layer's attention by the compile target's kernel (common/attention.py), with GPT-OSS's
    sinks and window (`is_global`, traced, picks the layer's kind) and MLA's values narrower than
    its queries. with_max: (output, each head's largest logit if the kernel keeps it, else None;
    Llama 4's chunked layers run it per chunk, and None)."""
    T = q_BTNH.shape[1]
    W = cfg.sliding_window if cfg.sliding_window < T else 0  # else: all in reach
    C = cfg.attn_chunk if cfg.attn_chunk < T else 0
    kmax = with_max and not C
    att = partial(attend, impl=cfg.attention, sinks_N=lp.get("sinks"), context=cfg.context_attention,
                  scale=logit_scale(cfg, q_BTNH.shape[-1]), batch_axes=MOE_BATCH, with_max=kmax)
    full = partial(att, q_BTNH, k_BTKH, v_BTKV)
    local = partial(full, window=W) if W else partial(in_chunks, att, C, q_BTNH, k_BTKH, v_BTKV)
    if isinstance(is_global, bool):  # a stack of one kind (Gemma 4's)
        out = full() if is_global or not (W or C) else local()
    else:
        out = jax.lax.cond(is_global, full, local) if W or C else full()
    return out if kmax or not with_max else (out, None)


def logit_scale(cfg: ModelConfig, H: int) -> float:
    """1/sqrt(H) times the square of YaRN's temperature 0.1 m ln(factor) + 1, which scales q and k
    alike (m = 1; DeepSeek leaves the rotation unscaled and gives m = mscale_all_dim); Gemma 4:
    1 (its q and k are normed)."""
    f, m = cfg.yarn_factor, cfg.yarn_mscale_all_dim or 1.0
    return ((0.1 * m * math.log(f) + 1.0) ** 2 if f > 1 else 1.0) / (
        1.0 if cfg.gemma4 else math.sqrt(H))


def in_chunks(att, C: int, *qkv_BTNH):
    """Causal attention within aligned chunks of C positions (Llama 4's local layers), the
    chunks folded into the batch: O(T C) in any kernel. The tail is padded: nothing attends it."""
    T = qkv_BTNH[0].shape[1]
    fold = lambda x: jnp.pad(x, ((0, 0), (0, -T % C), (0, 0), (0, 0))).reshape(-1, C, *x.shape[2:])
    o = att(*map(fold, qkv_BTNH))
    return o.reshape(-1, T + -T % C, *o.shape[2:])[:, :T]


def mla(h_BTD, lp: dict, pos_BT, inv_freq, cfg: ModelConfig, latents: bool = False):
    """Multi-head latent attention's queries, keys and values (DeepSeek-V2, sec. 2.1):

        c_kv = RMSNorm(h W_kv_a[:C]),   [k_nope_n, v_n] = c_kv W_kv_b   (per head n)
        k_rope = RoPE(h W_kv_a[C:])     one rotated key for all heads
        q_n = [q_nope, RoPE(q_rope)] of h W_q, or of RMSNorm(h W_q_a) W_q_b with q_lora_rank
        k_n = [k_nope_n, k_rope]

    Training builds every head's key and value; decoding would cache only c_kv and k_rope (C + Hr
    numbers a token, not 2 N H), W_k_b absorbed into the query and W_v_b into W_o. rope_interleave
    takes pairs (2i, 2i+1), put out in halves as transformers does: the same for q and k. With
    `latents`: (q, the query latent c_q, c_kv, k_rope), which DSA attends with (`dsa`)."""
    w = weights(lp, h_BTD.dtype, cfg)
    C, Hn, eps, c_q = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.norm_eps, None
    if cfg.q_lora_rank:
        c_q = rms_norm(jnp.einsum("btd,dc->btc", h_BTD, w("wq_a")), lp["q_norm_a"], eps)
        q = jnp.einsum("btc,cnh->btnh", c_q, w("wq_b"))
    else:
        q = jnp.einsum("btd,dnh->btnh", h_BTD, w("wq"))
    kv = jnp.einsum("btd,dc->btc", h_BTD, w("wkv_a"))
    c_kv = rms_norm(kv[..., :C], lp["kv_norm"], eps)
    pairs = halves if cfg.rope_interleave else (lambda x: x)
    k_rope = apply_rope(pairs(kv[:, :, None, C:]), pos_BT, inv_freq)[:, :, 0]
    q = jnp.concatenate([q[..., :Hn], apply_rope(pairs(q[..., Hn:]), pos_BT, inv_freq)], axis=-1)
    return (q, c_q, c_kv, k_rope) if latents else (q, *mla_kv(c_kv, k_rope, lp, cfg))


def mla_kv(c_kv_BTC, k_rope_BTR, lp: dict, cfg: ModelConfig):
    """Every head's key [k_nope_n, k_rope] and value [B, T, N, .] from the latents."""
    kv_b = jnp.einsum("btc,cnh->btnh", c_kv_BTC, weights(lp, c_kv_BTC.dtype, cfg)("wkv_b"))
    k_nope, v = kv_b[..., :cfg.qk_nope_head_dim], kv_b[..., cfg.qk_nope_head_dim:]
    k_rope = jnp.broadcast_to(k_rope_BTR[:, :, None], k_nope.shape[:3] + k_rope_BTR.shape[2:])
    return jnp.concatenate([k_nope, k_rope], -1), v


def halves(x):
    """Pairs (2i, 2i+1) to halves (i, H/2 + i), as `apply_rope` rotates; q and k alike, so their
    dot products are unchanged (Llama 4's, DeepSeek's pairs; transformers does the same)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], -1)


# Qwen3-Next's linear layers: Gated DeltaNet (Yang, Kautz and Hatamizadeh 2024, arXiv 2412.06464).
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


def delta_rule_recurrent(q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH):
    """The same token by token, the reference for `delta_rule_chunked`: S <- e^g S, then
    S <- S + k (b (v - S^T k))^T, o = S^T q."""
    def step(S, x):
        q, k, v, g, b = x
        S = S * jnp.exp(g)[..., None, None]
        d = b[..., None] * (v - jnp.einsum("bhkv,bhk->bhv", S, k))
        S = S + k[..., :, None] * d[..., None, :]
        return S, jnp.einsum("bhkv,bhk->bhv", S, q)
    (B, _, H, Dk), Dv = k_BTHK.shape, v_BTHV.shape[-1]
    xs = [x.astype(jnp.float32).swapaxes(0, 1) for x in (q_BTHK, k_BTHK, v_BTHV, g_BTH, beta_BTH)]
    return jax.lax.scan(step, jnp.zeros((B, H, Dk, Dv), jnp.float32), xs)[1].swapaxes(0, 1)


# DeepSeek-V3.2's sparse attention (DSA: the V3.2 report, sec. 2.1; its inference/model.py).
def dsa(h_BTD, lp: dict, pos_BT, inv_freq, cfg: ModelConfig, warm=None):
    """MLA over each query's index_topk keys, as the lightning indexer (`indexer`) ranks them:
    (output [B, T, N, Hv], {"indexer_kl": the indexer's KL per query}). In blocks of
    index_chunk queries (each rematerialised), one block's keys gathered as MLA's latents
    [c_kv, k_rope] (C + Hr numbers a key), queries absorbed into them (q_nope W_k_b^T, and
    W_v_b after the sum): O(T k) memory and attention work; the indexer's scores are O(T^2)
    work (the release's too, in fp8), O(block T) memory. The indexer reads h and c_q detached,
    so its one signal is its KL to the main heads' attention p_t = mean_n softmax_n (eq. 3):
    `warm` (traced; None = never) the warm-up, MLA dense, the KL over every causal key; else
    sparse, the KL over the k chosen (p renormalised there by construction)."""
    dt, Hn, C, sg = h_BTD.dtype, cfg.qk_nope_head_dim, cfg.kv_lora_rank, jax.lax.stop_gradient
    q, c_q, c_kv, k_rope = mla(h_BTD, lp, pos_BT, inv_freq, cfg, latents=True)
    iq, ik, iw = indexer(sg(h_BTD), sg(c_q), lp, pos_BT, inv_freq, cfg)
    B, T = pos_BT.shape
    Q, K, w_b = min(cfg.index_chunk, T), min(cfg.index_topk, T), weights(lp, dt, cfg)("wkv_b")
    n, scale, lat = -(-T // Q), logit_scale(cfg, Hn + cfg.qk_rope_head_dim), jnp.concatenate(
        [c_kv, k_rope], -1)
    # Padded queries sit at position 0: one key each, a KL of 0, their outputs cut off.
    blocks = [jnp.pad(x, [(0, 0), (0, n * Q - T)] + [(0, 0)] * (x.ndim - 2)).reshape(
        B, n, Q, *x.shape[2:]).swapaxes(0, 1) for x in (q, pos_BT, iq, iw)]
    scores = lambda p, iq, iw: index_scores(iq, ik, iw, p, pos_BT)

    def sparse(q, p, iq, iw):
        top_BQK, i_BQK = jax.lax.top_k(scores(p, iq, iw), K)
        ok = jnp.isfinite(top_BQK)[:, :, None]   # fewer than k causal keys: -inf ones chosen
        kv_BQKc = jax.vmap(lambda x, i: x[i])(lat, i_BQK)
        q_c = jnp.concatenate([jnp.einsum("bqnh,cnh->bqnc", q[..., :Hn], w_b[..., :Hn]),
                               q[..., Hn:]], -1)
        s = jnp.einsum("bqnc,bqkc->bqnk", q_c, kv_BQKc, preferred_element_type=jnp.float32)
        p_BQNK = jax.nn.softmax(jnp.where(ok, s * scale, -jnp.inf), axis=-1)
        o = jnp.einsum("bqnk,bqkc->bqnc", p_BQNK.astype(dt), kv_BQKc[..., :C])
        return (jnp.einsum("bqnc,cnv->bqnv", o, w_b[..., Hn:]),
                indexer_kl(jnp.mean(p_BQNK, 2), top_BQK, ok[:, :, 0]))

    def kl_dense(q, p, iq, iw, k):   # the warm-up's target: every head's dense attention
        ok = pos_BT[:, None] <= p[..., None]
        s = jnp.einsum("bqnh,bsnh->bqns", sg(q), sg(k), preferred_element_type=jnp.float32)
        p_BQNS = jax.nn.softmax(jnp.where(ok[:, :, None], s * scale, -jnp.inf), axis=-1)
        return indexer_kl(jnp.mean(p_BQNS, 2), scores(p, iq, iw), ok)

    def run(body, *closed):
        out = jax.lax.scan(lambda c, xs: (c, jax.checkpoint(body)(*xs, *closed)), None, blocks)[1]
        return out if isinstance(out, tuple) else (None, out)

    def stage_sparse():
        o_nBQNV, kl_n = run(sparse)
        return o_nBQNV.swapaxes(0, 1).reshape(B, n * Q, *o_nBQNV.shape[3:])[:, :T], jnp.sum(kl_n)

    def stage_dense():
        k, v = mla_kv(c_kv, k_rope, lp, cfg)
        return attention(q, k, v, lp, cfg, True), jnp.sum(run(kl_dense, k)[1])

    o, kl = stage_sparse() if warm is None else jax.lax.cond(warm, stage_dense, stage_sparse)
    return o, {"indexer_kl": kl / (B * T)}


def indexer(h_BTD, c_q_BTR, lp: dict, pos_BT, inv_freq, cfg: ModelConfig):
    """The lightning indexer's queries [B, T, M, I] (from MLA's normed query latent), its one
    key a token [B, T, I] (h through a LayerNorm with a bias) and each head's weight [B, T, M]
    (from h, in float32): I_ts = sum_m w_tm ReLU(q_tm . k_s) (the report's eq. 1). q and k are
    rotated on their first qk_rope_head_dim dims in halves, not pairs even where MLA's are (the
    release's, transformers'); 1/sqrt(I) and 1/sqrt(M) fold into w (ReLU(a x) = a ReLU(x), a >
    0). The release's fp8 scores and Hadamard rotation (orthogonal: q.k unchanged) are left out."""
    w, Hr = weights(lp, h_BTD.dtype, cfg), cfg.qk_rope_head_dim
    rope = lambda x: jnp.concatenate([apply_rope(x[..., :Hr], pos_BT, inv_freq), x[..., Hr:]], -1)
    k = jnp.einsum("btd,di->bti", h_BTD, w("idx_wk")).astype(jnp.float32)
    k = k - jnp.mean(k, -1, keepdims=True)
    k = k * jax.lax.rsqrt(jnp.mean(k * k, -1, keepdims=True) + 1e-6) * lp["idx_k_norm"]
    k = rope((k + lp["idx_k_bias"]).astype(h_BTD.dtype)[:, :, None])[:, :, 0]
    wt = jnp.einsum("btd,dm->btm", h_BTD.astype(jnp.float32), lp["idx_w"]) * (
        cfg.index_n_heads * cfg.index_head_dim) ** -0.5
    return rope(jnp.einsum("btr,rmi->btmi", c_q_BTR, w("idx_wq"))), k, wt


def index_scores(q_BQMI, k_BSI, w_BQM, pos_BQ, pos_BS):
    """The indexer's I [B, Q, S] in float32, -inf at the keys after each query."""
    s = jax.nn.relu(jnp.einsum("bqmi,bsi->bqms", q_BQMI, k_BSI, preferred_element_type=jnp.float32))
    return jnp.where(pos_BS[:, None] <= pos_BQ[..., None], jnp.einsum("bqms,bqm->bqs", s, w_BQM),
                     -jnp.inf)


def indexer_kl(p_BQS, logit_BQS, ok_BQS):
    """sum_q KL(p_q || softmax(logit_q)) over the keys where ok: p the main attention's, a
    constant target (the indexer learns from it, the heads not from the indexer)."""
    p = jax.lax.stop_gradient(p_BQS)
    log_q = jax.nn.log_softmax(jnp.where(ok_BQS, logit_BQS, -jnp.inf), axis=-1)
    return jnp.sum(jnp.where(ok_BQS & (p > 0), p * (jnp.log(jnp.where(p > 0, p, 1.0)) -
                                                   jnp.where(ok_BQS, log_q, 0.0)), 0.0))


# DeepSeek-V4 (its report; transformers' deepseek_v4): mHC streams, compressed attention, hashing.
def v4_hidden(params: dict, x_BTD, pos_BT, tokens_BT, cfg: ModelConfig, remat):
    """The layers over hc_mult copies of the embeddings [B, T, S, D], scanned with each layer's
    kind (`v4_kinds`; a lax.switch picks its attention), collapsed by the head's weights (pre of
    `hc_pre`), final-normed; and the routing stats [L]. Window layers turn by rope_theta, the
    compressed ones (their compressors and indexer too) by compress_rope_theta with YaRN."""
    kind_L, idx_L, _, _ = v4_kinds(cfg)
    kinds, S, Lh = sorted(set(kind_L.tolist())), cfg.hc_mult, cfg.n_hash_layers
    invs = (rope_inv_freq(dataclasses.replace(cfg, yarn_factor=0.0)), rope_inv_freq(
        dataclasses.replace(cfg, rope_theta=cfg.compress_rope_theta)))

    def layer(x, xs):
        lp, k, i = xs
        lp = train.merged(lp)  # LoRA
        post, comb, h = hc_pre(x, lp, "attn", cfg)
        o, kl = v4_attention(rms_norm(h, lp["attn_norm"], cfg.norm_eps), lp, params, kinds, k, i,
                             pos_BT, invs, cfg)
        x = hc_post(x, o, post, comb)
        post, comb, h = hc_pre(x, lp, "ffn", cfg)
        y, stats = moe(rms_norm(h, lp["mlp_norm"], cfg.norm_eps), lp, cfg, hashed=lp[
            "tid2eid"].astype(jnp.int32)[tokens_BT] if "tid2eid" in lp else None)
        return hc_post(x, y, post, comb), stats | ({"indexer_kl": kl} if cfg.index_n_heads else {})
    x = constrain(jnp.broadcast_to(x_BTD[:, :, None], (*x_BTD.shape[:2], S, x_BTD.shape[-1])), ACT_BTSD)
    run = lambda x, stack, at: jax.lax.scan(remat(layer), x, (params[stack], jnp.asarray(
        [kinds.index(k) for k in kind_L[at]]), jnp.asarray(idx_L[at])), unroll=not cfg.scan_layers)
    x = run(x, "hash_layers", slice(0, Lh))[0] if Lh else x  # their routing stats: no choice
    x, stats = run(x, "layers", slice(Lh, None))
    mix = hc_mix(x, params["hc_head_fn"], cfg)
    pre = jax.nn.sigmoid(mix * params["hc_head_scale"] + params["hc_head_base"]) + cfg.hc_eps
    h = jnp.einsum("bts,btsd->btd", pre, x.astype(jnp.float32)).astype(x.dtype)
    return rms_norm(h, final_gain(params, cfg), cfg.norm_eps), stats


def hc_mix(x_BTSD, fn, cfg: ModelConfig):
    """The S streams flattened, RMS-normed without a gain, projected (float32)."""
    flat = x_BTSD.reshape(*x_BTSD.shape[:2], -1).astype(jnp.float32)
    return jnp.einsum("btc,ck->btk", rms_norm(flat, 1.0, cfg.norm_eps), fn)


def hc_pre(x_BTSD, lp: dict, name: str, cfg: ModelConfig):
    """Manifold-constrained hyper-connections (mHC: Xie et al. 2026; the V4 report sec. 2.2), the
    weights of one sublayer from its input streams x: with m = hc_mix(x) split (S, S, S x S),

        pre = sigmoid(a_0 m_pre + b) + eps,  post = 2 sigmoid(a_1 m_post + b),
        comb = Sinkhorn(softmax_rows(a_2 m_comb + b) + eps)   (doubly stochastic: `sinkhorn`),

    -> (post [B, T, S], comb [B, T, S, S], the sublayer's input sum_s pre_s x_s [B, T, D])."""
    S, eps = cfg.hc_mult, cfg.hc_eps
    m, a, b = hc_mix(x_BTSD, lp[f"hc_{name}_fn"], cfg), lp[f"hc_{name}_scale"], lp[f"hc_{name}_base"]
    pre = jax.nn.sigmoid(m[..., :S] * a[0] + b[:S]) + eps
    post = 2 * jax.nn.sigmoid(m[..., S:2 * S] * a[1] + b[S:2 * S])
    comb = jax.nn.softmax((m[..., 2 * S:] * a[2] + b[2 * S:]).reshape(*m.shape[:2], S, S), -1)
    h = jnp.einsum("bts,btsd->btd", pre, x_BTSD.astype(jnp.float32)).astype(x_BTSD.dtype)
    return post, sinkhorn(comb + eps, cfg.hc_sinkhorn_iters, eps), h


def sinkhorn(c, iters: int, eps: float):
    """Sinkhorn-Knopp toward a doubly stochastic matrix: columns normed, then (rows, columns)
    iters - 1 times (transformers' order and epsilon)."""
    c = c / (jnp.sum(c, -2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (jnp.sum(c, -1, keepdims=True) + eps)
        c = c / (jnp.sum(c, -2, keepdims=True) + eps)
    return c


def hc_post(x_BTSD, o_BTD, post_BTS, comb_BTSS):
    """Stream i after a sublayer: post_i o + sum_j comb_ji x_j."""
    dt = x_BTSD.dtype
    return constrain(post_BTS.astype(dt)[..., None] * o_BTD[:, :, None] + jnp.einsum(
        "btji,btjd->btid", comb_BTSS.astype(dt), x_BTSD), ACT_BTSD)


def rope_pairs(x, pos, inv_freq, sign: float = 1.0):
    """RoPE on the last 2 len(inv_freq) dims of x [B, T, N, H] in pairs (2i, 2i+1) (V4's
    layout); sign -1 turns back."""
    R, f32 = 2 * len(inv_freq), jnp.float32
    ang = pos[..., None, None].astype(f32) * inv_freq
    cos, sin = jnp.cos(ang), sign * jnp.sin(ang)
    a, b = x[..., -R::2].astype(f32), x[..., 1 - R::2].astype(f32)
    r = jnp.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(*x.shape[:-1], R)
    return jnp.concatenate([x[..., :-R], r.astype(x.dtype)], -1)


def v4_attention(h_BTD, lp: dict, params: dict, kinds, kind, i, pos_BT, invs, cfg: ModelConfig):
    """V4's attention [B, T, D]: queries from a normed latent (each head RMS-normed, no gain), one
    normed key that is also the value; each query sees the last sliding_window keys, and on
    compressed layers the entries (`compress`) whose windows have closed (CSA: those of them its
    indexer ranks in its best index_topk), with a sink per head; the output turned back by its
    query's angle, then the grouped projection: per group of heads o_lora_rank wide, then d. And
    CSA's indexer's KL to the heads' mean attention over its chosen entries (DSA's sparse stage's
    objective, `dsa`: its one signal; the choice itself has no gradient), else 0."""
    w, eps, (B, T), dt = weights(lp, h_BTD.dtype, cfg), cfg.norm_eps, pos_BT.shape, h_BTD.dtype
    c_q = rms_norm(jnp.einsum("btd,dr->btr", h_BTD, w("wq_a")), lp["q_norm_a"], eps)
    q0 = rms_norm(jnp.einsum("btr,rnh->btnh", c_q, w("wq_b")), 1.0, eps)
    kv0 = rms_norm(jnp.einsum("btd,dh->bth", h_BTD, w("wkv")), lp["kv_norm"], eps)[:, :, None]
    W = cfg.sliding_window or T
    t, s = np.arange(T)[:, None], np.arange(T)[None]
    local = jnp.broadcast_to((s <= t) & (s > t - W), (B, T, T))

    def branch(k):
        def run():
            inv = invs[k > 0]
            q, kv = rope_pairs(q0, pos_BT, inv), rope_pairs(kv0, pos_BT, inv)[:, :, 0]
            keys, ok, kl = kv, local, jnp.zeros((), jnp.float32)
            if k:
                cp = jax.tree.map(lambda a: a[i], params["csa" if k == 1 else "hca"])
                ck, cok, score = compressed_keys(h_BTD, c_q, cp, pos_BT, inv, k == 1, cfg)
                keys, ok = jnp.concatenate([kv, ck], 1), jnp.concatenate([local, cok], 2)
            o, p = sink_attention(q, keys, ok, lp["sinks"], cfg)
            if k == 1 and score is not None:  # (queries with no entry yet: none, and no NaN)
                pc, none = jnp.mean(p[..., T:], 2), ~jnp.any(cok, -1, keepdims=True)
                kl = indexer_kl(pc / jnp.maximum(jnp.sum(pc, -1, keepdims=True), 1e-30), jnp.where(
                    none, 0.0, score), cok | none) / (B * T)
            return rope_pairs(o, pos_BT, inv, -1.0), kl
        return run
    o, kl = (jax.lax.switch(kind, [branch(k) for k in kinds]) if len(kinds) > 1 else
             branch(kinds[0])())
    o = jnp.einsum("btgc,gcr->btgr", o.reshape(B, T, cfg.o_groups, -1), w("wo_a"))
    return jnp.einsum("btc,cd->btd", o.reshape(B, T, -1), w("wo_b")), kl


def sink_attention(q_BTNH, k_BSH, ok_BTS, sinks_N, cfg: ModelConfig):
    """Softmax attention of every head over one shared key = value head where ok, a learned
    logit per head joining each denominator (GPT-OSS's sinks); 1/sqrt(H), float32; and p."""
    s = jnp.einsum("btnh,bsh->btns", q_BTNH, k_BSH, preferred_element_type=jnp.float32)
    s = jnp.where(ok_BTS[:, :, None], s / math.sqrt(q_BTNH.shape[-1]), -jnp.inf)
    m = jnp.maximum(jnp.max(s, -1), sinks_N)[..., None]
    p = jnp.exp(s - m)
    p = p / (jnp.sum(p, -1, keepdims=True) + jnp.exp(sinks_N[:, None] - m))
    return jnp.einsum("btns,bsh->btnh", p.astype(q_BTNH.dtype), k_BSH), p


def compress(h_BTD, cp: dict, prefix: str, rate: int, overlap: bool, inv, cfg: ModelConfig):
    """V4's KV compressor [B, T // rate, Hc]: per window of `rate` tokens (the tail cut off) the
    entry sum_j softmax_j(z_j + bias_j) * c_j of c = h W_kv, z = h W_gate per channel, RMS-normed,
    turned at the window's first position. `overlap` (CSA): each token gives two series a, b; entry
    w pools window w-1's a with window w's b (2 x rate tokens; window 0: b alone)."""
    w, (B, T, _) = (lambda k: cp[k].astype(h_BTD.dtype)), h_BTD.shape  # (a small stack's)
    n = T // rate
    c, z = (jnp.einsum("btd,dc->btc", h_BTD[:, :n * rate], w(f"{prefix}_{k}")).reshape(
        B, n, rate, -1) for k in ("wkv", "wgate"))
    z = z.astype(jnp.float32) + cp[f"{prefix}_bias"]
    if overlap:
        Hc = c.shape[-1] // 2
        prev = lambda x, fill: jnp.concatenate([jnp.full_like(x[:, :1, :, :Hc], fill),
                                                x[:, :-1, :, :Hc]], 1)
        c = jnp.concatenate([prev(c, 0.0), c[..., Hc:]], 2)
        z = jnp.concatenate([prev(z, -jnp.inf), z[..., Hc:]], 2)
    e = jnp.sum(c * jax.nn.softmax(z, axis=2).astype(c.dtype), axis=2)
    e = rms_norm(e, cp[f"{prefix}_norm"], cfg.norm_eps)[:, :, None]
    return rope_pairs(e, jnp.broadcast_to(jnp.arange(n) * rate, (B, n)), inv)[:, :, 0]


def compressed_keys(h_BTD, c_q, cp: dict, pos_BT, inv, csa: bool, cfg: ModelConfig):
    """A compressed layer's entries [B, n, H], which each query sees [B, T, n] and the indexer's
    scores: the entries whose window has closed (w < (t + 1) // rate); CSA: of them the
    index_topk its lightning indexer scores best, I_tw = sum_m w_tm ReLU(q_tm . k_w) / sqrt(M I)
    over its own compressed keys, from h and c_q detached (as `dsa`'s)."""
    rate = cfg.csa_ratio if csa else v4_kinds(cfg)[3]
    keys = compress(h_BTD, cp, "cmp", rate, csa, inv, cfg)
    n = keys.shape[1]
    ok = jnp.arange(n) < ((pos_BT + 1) // rate)[..., None]
    if not csa or not n:
        return keys, ok, None
    w, h_BTD, c_q = (lambda k: cp[k].astype(h_BTD.dtype)), *map(jax.lax.stop_gradient, (h_BTD, c_q))
    ik = compress(h_BTD, cp, "idx", rate, True, inv, cfg)
    iq = rope_pairs(jnp.einsum("btr,rmi->btmi", c_q, w("idx_wq")), pos_BT, inv)
    wt = jnp.einsum("btd,dm->btm", h_BTD.astype(jnp.float32), cp["idx_w"]) / math.sqrt(
        cfg.index_n_heads * cfg.index_head_dim)
    score = jnp.einsum("btm,btmw->btw", wt, jax.nn.relu(jnp.einsum(
        "btmi,bwi->btmw", iq, ik, preferred_element_type=jnp.float32)))
    top = jax.lax.top_k(jnp.where(ok, score, -jnp.inf), min(cfg.index_topk, n))[1]
    return keys, ok & jnp.any(jax.nn.one_hot(top, n, dtype=jnp.bool_), axis=-2), score


def constrain(x, spec: P):
    """Pin an activation's sharding when a mesh is set (jax.set_mesh); a no-op without one."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec)


# The batch is split over data, fsdp and expert: the all-to-all takes tokens to their experts.
MOE_BATCH = BATCH_AXES + ("expert",)
ACT_BTD = P(MOE_BATCH, "context", None)  # between blocks: batch and sequence split, d whole
ACT_BTSD = P(MOE_BATCH, "context", None, None)  # V4's hc_mult streams
# A small batch's loss is vocabulary-parallel (train_dense.py's VOCAB_DV): V over fsdp, expert.
VOCAB_DV, LOSS_BTD = P(None, ("tensor", "fsdp", "expert")), P(("data", "context"), None, None)


def weights(lp: dict, dt, cfg: ModelConfig):
    """name -> the layer's f32 master weight in the compute dtype, keeping the master's sharding:
    FSDP gathers it in the compute dtype and reduce-scatters its gradient (not all-reduces)."""
    specs = param_specs(cfg)
    spec = {**specs.get("dense_layers", {}), **specs.get("global_layers", {}), **specs["layers"]}
    return lambda name: constrain(lp[name].astype(dt), P(*spec[name][1:]))


def rms_norm(x, w, eps):
    # Statistics in float32 whatever the compute dtype: bfloat16 squares lose the small values.
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """theta^(-2i/H) (MLA: of the qk_rope_head_dim part); with YaRN (Peng et al. 2023, as in
    transformers) the dims turning fewer than beta_slow times over the original context are
    slowed by `factor`, those turning more than beta_fast times kept, a linear ramp between;
    with rope_scaling, Llama 3.1's (train_dense.py's `rope_inv_freq`)."""
    H = cfg.qk_rope_head_dim if cfg.kv_lora_rank else cfg.rotary_dim or cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, H, 2, dtype=np.float64) / H)
    if cfg.rope_scaling > 0:
        lo, hi, wavelen = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, 2 * np.pi / inv
        smooth = (cfg.rope_original_max_len / wavelen - lo) / ((hi - lo) or 1.0)
        mid = (1 - smooth) * inv / cfg.rope_scaling + smooth * inv
        inv = np.where(wavelen < cfg.rope_original_max_len / hi, inv, np.where(
            wavelen > cfg.rope_original_max_len / lo, inv / cfg.rope_scaling, mid))
    if cfg.yarn_factor:
        dim = lambda turns: H * math.log(cfg.yarn_original_max_len / (turns * 2 * math.pi)) / (
            2 * math.log(cfg.rope_theta))
        lo, hi = dim(cfg.yarn_beta_fast), dim(cfg.yarn_beta_slow)
        lo, hi = (math.floor(lo), math.ceil(hi)) if cfg.yarn_truncate else (lo, hi)
        lo, hi = max(lo, 0), min(hi, H - 1)
        ramp = np.clip((np.arange(H // 2) - lo) / ((hi - lo) or 0.001), 0, 1)
        inv = inv / cfg.yarn_factor * ramp + inv * (1 - ramp)
    inv[int(cfg.rope_partial * H // 2) if cfg.rope_partial else H:] = 0.0  # Gemma 4's global
    return inv.astype(np.float32)


def apply_rope(x_BTNH, pos_BT, inv_freq):
    """Rotate the two halves of each head (the HuggingFace layout: its q/k weights load as-is)."""
    ang_BTh = pos_BT[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(ang_BTh)[:, :, None, :], jnp.sin(ang_BTh)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def partial_rope(x_BTNH, pos_BT, inv_freq):
    """`apply_rope` on each head's first 2 len(inv_freq) dims (rotary_dim), the rest unturned."""
    R = 2 * len(inv_freq)
    return jnp.concatenate([apply_rope(x_BTNH[..., :R], pos_BT, inv_freq), x_BTNH[..., R:]], -1)


def embed(params: dict, tokens_BT, cfg: ModelConfig):
    """Token ids -> (embeddings [B, T, D] in the compute dtype, positions [B, T]); with
    --mesh.context both in the order of its shards (common/attention.py)."""
    dt = jnp.dtype(cfg.dtype)
    tokens_BT, pos_BT = to_context(tokens_BT, jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]),
                                                               tokens_BT.shape))
    # Every token is looked up in each device's fsdp shard of d (the ids are small), then the
    # rows go to their batch shards: gathering the table instead would put all of it, and
    # its whole gradient, on every device (2 GiB each for a 128k vocabulary at d 8192).
    tokens = constrain(tokens_BT, P(None, None))
    x = constrain(jnp.take(params["embed"].astype(dt), tokens, axis=0),
                  P(None, None, ("fsdp", "context")))
    return constrain(x, ACT_BTD) * (jnp.asarray(math.sqrt(cfg.d_model), dt) if cfg.gemma4
                                    else 1), pos_BT


def rematted(f, cfg: ModelConfig):
    """A layer under --model.remat. Inside a rolled scan the recomputation cannot be merged
    away; unrolled, XLA would merge it into the forward pass (and keep every activation)."""
    return f if cfg.remat == "none" else jax.checkpoint(
        f, prevent_cse=not cfg.scan_layers, policy={
            "full": jax.checkpoint_policies.nothing_saveable,
            "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[cfg.remat])


def hidden(params: dict, tokens_BT, cfg: ModelConfig, max_logits: bool = False, warm=None,
           pipeline: tuple[int, int] | None = None):
    """Token ids -> (final-normed hidden states [B, T, D], per-layer routing stats [L], and
    with max_logits each head's largest attention logit, "max_logit" [L, N]). With `pipeline`
    (microbatches, repeats) and a `stage` mesh axis the MoE stack runs as a pipeline
    (`train.pipelined`, its stats each microbatch's, as accumulation makes them); the
    embeddings and the dense first layers before it, on every stage and all rows."""
    x, pos_BT = embed(params, tokens_BT, cfg)
    if cfg.hc_mult:
        return v4_hidden(params, x, pos_BT, tokens_BT, cfg, partial(rematted, cfg=cfg))
    inv_freq = rope_inv_freq(cfg)
    L, W, n, Kd = cfg.n_layers, cfg.sliding_window, cfg.global_every, cfg.first_k_dense
    is_global_L = (np.arange(L) + 1) % n == 0 if n else np.full(L, not (W or cfg.attn_chunk))
    remat = partial(rematted, cfg=cfg)
    bare = lambda x, xs, pos=pos_BT: block(x, xs[0], pos, inv_freq, cfg, max_logits, xs[1], warm)
    layer = remat(bare)  # pipelined: `bare` on a microbatch's positions, checkpointed there
    # Unrolled (--model.no-scan-layers), each layer is compiled on its own.
    scan = partial(jax.lax.scan, unroll=not cfg.scan_layers)
    if cfg.global_head_dim or cfg.linear_k_heads:  # Gemma 4: periods of n - 1 local layers
        # and a global one, each kind its own stack and RoPE (the local base; the global width,
        # partly turned); Qwen3-Next: n - 1 DeltaNet layers, then a global one
        local = rope_inv_freq(dataclasses.replace(cfg, rope_partial=0.0, rope_theta=(
            cfg.rope_local_theta or cfg.rope_theta)))
        wide = rope_inv_freq(dataclasses.replace(cfg, head_dim=cfg.global_head_dim or cfg.head_dim))
        kind = lambda inv, g: remat(lambda x, lp: block(x, lp, pos_BT, inv, cfg, max_logits, g))

        def period(x, xs):
            x, stats = jax.lax.scan(kind(local, False), x, xs[0], unroll=not cfg.scan_layers)
            x, last = kind(wide, True)(x, xs[1])
            return x, jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), stats, last)
        by = jax.tree.map(lambda a: a.reshape(L // n, n - 1, *a.shape[1:]), params["layers"])
        x, stats = jax.lax.scan(period, x, (by, params["global_layers"]),
                                unroll=not cfg.scan_layers)  # stats [L/n, n, ...]: layer order
        return rms_norm(x, final_gain(params, cfg), cfg.norm_eps), jax.tree.map(
            lambda a: a.reshape(L, *a.shape[2:]), stats)
    dense = lambda top: {k + "_dense": v for k, v in top.items()}   # the dense layers' logits
    if Kd:  # the dense layers come first, as their own stack
        x, top = scan(layer, x, (params["dense_layers"], jnp.asarray(is_global_L[:Kd])))
    if cfg.moe_every == 2:  # Llama 4 Maverick: each step a dense layer, then a MoE layer
        def pair(x, xs):
            x, top = layer(x, (xs[0], xs[2]))
            x, stats = layer(x, (xs[1], xs[3]))
            return x, stats | dense(top)
        g = jnp.asarray(is_global_L.reshape(-1, 2))
        x, stats = jax.lax.scan(pair, x, (params["dense_layers"], params["layers"], g[:, 0],
                                          g[:, 1]), unroll=not cfg.scan_layers)
    elif pipeline and train.stages() > 1:
        x, stats = train.pipelined(bare, x, (params["layers"], is_global_L[Kd:]), pos_BT,
                                   *pipeline, MOE_BATCH, scan, remat)
    else:
        x, stats = scan(layer, x, (params["layers"], jnp.asarray(is_global_L[Kd:])))
    stats |= dense(top) if Kd else {}
    return rms_norm(x, final_gain(params, cfg), cfg.norm_eps), stats


def final_gain(params: dict, cfg: ModelConfig):
    return params["final_norm"] + 1 if cfg.norm_offset else params["final_norm"]


def unembedding(params: dict, cfg: ModelConfig):
    return params["embed"].T if cfg.tie_embeddings else params["unembed"]


def forward(params: dict, tokens_BT, cfg: ModelConfig):
    """Logits [B, T, V] in float32. Training never builds these whole: see `loss_fn`."""
    h = from_context(hidden(params, tokens_BT, cfg)[0], tokens_BT.shape[1])
    return _softcap(jnp.einsum("btd,dv->btv", h, unembedding(params, cfg).astype(h.dtype),
                               preferred_element_type=jnp.float32), cfg.final_softcap)


def mtp(params: dict, h_BTD, inputs_BT, targets_BT, cfg: ModelConfig, head, max_logits=False):
    """DeepSeek-V3's multi-token prediction (sec. 2.2), for training: module k = 1..D reads at
    position i token i+k's embedding and the previous depth's state h^{k-1}_i (h^0: the main
    model's final-normed output, which vLLM feeds the released module),

        h'_i = [RMSNorm_e(Emb(t_{i+k})); RMSNorm_h(h^{k-1}_i)] W_eh,   h^k = TRM_k(h'),

    and predicts token i+k+1 with its own norm and the shared head (`head`: objective and ce
    sums). Positions past the window (i+k+1 > T) have no target: weight 0. Returns the depths'
    mean objectives' mean, their cross-entropies' mean, and the modules' stats [D] (routing;
    with max_logits, for QK-clip, each head's largest logit)."""
    mp, spec, inv_freq = params["mtp"], param_specs(cfg)["mtp"]["eh_proj"], rope_inv_freq(cfg)
    top = train.merged({k: v for k, v in mp.items() if k != "layers"})  # LoRA: eh_proj's
    obj, ce, stats = 0.0, 0.0, []
    for k in range(1, cfg.mtp_depth + 1):
        ahead = lambda x: jnp.pad(x[:, k:], ((0, 0), (0, k)))  # position i holds i+k's
        e_BTD, pos_BT = embed(params, ahead(inputs_BT), cfg)
        norm = lambda x, name: rms_norm(x, top[name][k - 1], cfg.norm_eps)
        w = constrain(top["eh_proj"][k - 1].astype(h_BTD.dtype), P(*spec[1:]))
        x = jnp.einsum("btc,cd->btd", jnp.concatenate(
            [norm(e_BTD, "enorm"), norm(h_BTD, "hnorm")], -1), w)
        h_BTD, s = rematted(lambda x, lp: block(x, lp, pos_BT, inv_freq, cfg, max_logits), cfg)(
            constrain(x, ACT_BTD), jax.tree.map(lambda a: a[k - 1], mp["layers"]))
        valid_BT = ahead(jnp.ones(inputs_BT.shape, jnp.float32))  # a mean over these
        o, c = head(norm(h_BTD, "head_norm"), ahead(targets_BT), valid_BT / jnp.sum(valid_BT))
        obj, ce, stats = obj + o / cfg.mtp_depth, ce + c / cfg.mtp_depth, stats + [s]
    return obj, ce, jax.tree.map(lambda *x: jnp.stack(x), *stats)


# ----------------------------------------------------------------------------------------------
# 4. Loss and train step
# ----------------------------------------------------------------------------------------------
def train_step(state: dict, batch_BT1, *, cfg: Config, tx):
    """One optimiser step on a global batch [B, T+1] -> (new state, metrics): gradient and aux the
    microbatches' mean, heads over --train.qk-clip-threshold clipped after the update (`qk_clip`),
    the router biases (state["buffers"]) moved by the step's load unless it is skipped."""
    tau, W = cfg.train.qk_clip_threshold, cfg.train.indexer_warmup_steps
    # Pipelined, the microbatches are the pipeline's, in one pass: it needs them all at once.
    M = 1 if train.stages() > 1 else cfg.train.microbatches
    buffers, warm = state.get("buffers", {}), state["step"] < W if W else None  # DSA's stage
    grad_fn = jax.grad(lambda p, b: loss_fn(with_buffers(  # LoRA: p the adapters
        train.weights(state, cfg.lora, p), buffers), b, cfg.model, cfg.train, warm), has_aux=True)
    grads, aux = train.accumulate(grad_fn, state["params"], batch_BT1, M, MOE_BATCH)
    tops = {s: aux.pop(k) for s, k in (("layers", "max_logit"), ("dense_layers", "max_logit_dense"),
                                       ("mtp", "max_logit_mtp")) if k in aux}  # microbatches' max
    grads, aux = jax.tree.map(lambda x: x / M, (grads, aux))
    m = cfg.model   # MLA: the heads' own q/k parts and the rotary query, never the shared key
    qk = dict(q=("wq", "wq_b"), k=("wkv_b",), nope=m.qk_nope_head_dim) if m.kv_lora_rank else dict(
        q=("wq", "bq"), k=("wk", "bk"))
    clip = partial(train.qk_clip, tops=tops, tau=tau, **qk) if tau > 0 else None
    new, metrics = train.update(tx, grads, state, aux["ce"], after=clip)
    if W:  # DSA's warm-up: all but the indexer frozen (no weight decay either); their moments
        # stay 0 (zero gradients), Adam's bias correction counts from step 0 all the same
        new["params"] = jax.tree_util.tree_map_with_path(lambda path, a, b: a if str(
            path[-1].key).startswith("idx_") else jnp.where(warm, b, a), new["params"],
            state["params"])
    if buffers and cfg.train.router_bias_rate:
        leaves, tree = jax.tree.flatten(buffers)  # the MoE layers', then the MTP modules'
        bias, rate = jnp.concatenate(leaves), cfg.train.router_bias_rate
        held = metrics["nonfinite"] | (warm is not None and warm)  # DSA's warm-up holds them too
        moved = jnp.where(held, bias, balance_biases(bias, aux["load"], rate))
        new["buffers"] = jax.tree.unflatten(tree, jnp.split(moved, np.cumsum(
            [len(b) for b in leaves])[:-1]))
    if tau > 0:
        metrics["max_attn_logit"] = jnp.max(jnp.concatenate([t.ravel() for t in tops.values()]))
    return new, metrics | {"loss": aux["ce"], "lr": make_schedule(cfg.train)(state["step"]),
                           "load_min": aux["load_min"], "load_max": aux["load_max"]} | {
        k: jnp.mean(aux[k]) for k in ("aux_loss", "router_z", "dropped", "indexer_kl")
        if k in aux} | ({"mtp_loss": aux["mtp_ce"]} if "mtp_ce" in aux else {})


def loss_fn(params, batch_BT1, cfg: ModelConfig, t: TrainConfig = TrainConfig(), warm=None):
    """The objective on token windows [B, T+1], every next token a target (all B*T of them):

        loss = ce + z_loss * mean_t lse_t^2
               + load_balance_loss * mean_l aux_l + router_z_loss * mean_l router_z_l,
        ce = mean_t (lse_t - l_t[y_t])

    for logits l_t = h_t W_unembed, lse_t = logsumexp(l_t), and layer l's router losses (the
    MTP modules' among them), plus with --model.mtp-depth the MTP loss (`mtp`). Returns (loss,
    {"ce": ce, routing stats [L], "mtp_ce"}); `_ce_fused` takes `loss_chunk` positions at a time."""
    def head(h_BTD, targets_BT, wt_BT=None):  # sums of the (weighted) objective and ce
        h_BTD, targets_BT, wt_BT = fold_context(h_BTD, *to_context(targets_BT, wt_BT))
        w_DV = unembedding(params, cfg).astype(h_BTD.dtype)  # (the loss's chunks stay local)
        if targets_BT.size <= cfg.vocab_size:  # cast where the master is (train_dense.py's)
            own = w_DV if cfg.tie_embeddings else constrain(w_DV, param_specs(cfg)["unembed"])
            h_BTD, w_DV = constrain(h_BTD, LOSS_BTD), constrain(own, VOCAB_DV)
        chunk = cfg.loss_chunk if targets_BT.size <= cfg.vocab_size else train.ce_chunk(
            cfg.loss_chunk, *targets_BT.shape, cfg.d_model, (*MOE_BATCH, "context"))
        return _ce_fused(partial(cross_entropy, z_loss=t.z_loss, cap=cfg.final_softcap), h_BTD,
                         w_DV, targets_BT, wt_BT, chunk, not cfg.scan_layers)
    inputs, targets = batch_BT1[:, :-1], batch_BT1[:, 1:]
    h_BTD, stats = hidden(params, inputs, cfg, max_logits=t.qk_clip_threshold > 0, warm=warm,
                          pipeline=(t.microbatches, t.pipeline_repeats))
    (obj, ce), n, extra = head(h_BTD, targets), targets.size, {}
    loss = obj / n
    if cfg.mtp_depth:  # pipelined: each microbatch's routing stats, as accumulation makes them
        M = t.microbatches if train.stages() > 1 else 1
        mtp_obj, mtp_ce, mtp_stats = jax.tree_util.tree_map_with_path(
            lambda path, a: a if train.is_max(path) else a / M, train.accumulate(
                lambda _, b: mtp(params, *b, cfg, head, t.qk_clip_threshold > 0), None, (
                    h_BTD, inputs, targets), M, MOE_BATCH))
        loss, extra = loss + t.mtp_weight * mtp_obj, {"mtp_ce": mtp_ce}
        if "max_logit" in mtp_stats:  # QK-clip: the modules' stack's own, [D, N]
            extra["max_logit_mtp"] = mtp_stats.pop("max_logit")
        stats = {k: jnp.concatenate([v, mtp_stats[k]]) if k in mtp_stats else v
                 for k, v in stats.items()}  # routing's; the main stacks' maxima stay theirs
    loss = (loss + t.load_balance_loss * jnp.mean(stats["aux_loss"]) + t.router_z_loss
            * jnp.mean(stats["router_z"]))
    if cfg.index_n_heads:  # DSA: + the indexer's KL (layer mean), alone in its warm-up (`dsa`)
        stats["indexer_kl"] = jnp.mean(jnp.concatenate([jnp.atleast_1d(stats.pop(k)) for k in (
            "indexer_kl_dense", "indexer_kl") if k in stats]))
        loss = stats["indexer_kl"] + (loss if warm is None else jnp.where(warm, 0.0, loss))
    return loss, {"ce": ce / n, **stats, **extra}


def cross_entropy(h_BCD, w_DV, t_BC, wt_BC, *, z_loss: float, cap: float, grad: bool,
                  dw_dtype=jnp.float32):
    """One chunk's (objective, cross-entropy) sums, and with `grad` the objective's gradient
    (dh, dW). Weights wt_BC (None = all 1) scale each target's terms and gradient alike.

    For p = softmax(l), d(lse - l[y])/dl = p - onehot(y) and d(lse^2)/dl = 2 lse p: both are
    known the moment the chunk's logits are, so no logits need be kept or rebuilt.
    """
    logits = _softcap(jnp.einsum("bcd,dv->bcv", h_BCD, w_DV,
                                 preferred_element_type=jnp.float32), cap)
    lse = jax.nn.logsumexp(logits, axis=-1)
    hot = jax.nn.one_hot(t_BC, w_DV.shape[1], dtype=logits.dtype)
    tgt = jnp.sum(logits * hot, axis=-1)   # not a gather: the vocabulary is split (VOCAB_DV)
    ce_BC, z_BC = lse - tgt, lse * lse
    if wt_BC is not None:
        ce_BC, z_BC = ce_BC * wt_BC, z_BC * wt_BC
    ce = jnp.sum(ce_BC)
    sums = ce + z_loss * jnp.sum(z_BC), ce
    if not grad:
        return sums
    dl = jnp.exp(logits - lse[..., None]) * (1.0 + 2.0 * z_loss * lse)[..., None] - hot
    dl = dl if wt_BC is None else dl * wt_BC[..., None]
    dl = dl * (1.0 - jnp.square(logits / cap)) if cap else dl   # d(c tanh(z/c))/dz
    dh_BCD = jnp.einsum("bcv,dv->bcd", dl.astype(w_DV.dtype), w_DV,
                        preferred_element_type=jnp.float32).astype(h_BCD.dtype)
    dw_DV = jnp.einsum("bcd,bcv->dv", h_BCD, dl.astype(h_BCD.dtype),
                       preferred_element_type=dw_dtype)
    return sums, (dh_BCD, dw_DV)


def make_schedule(t: TrainConfig):
    return train.lr_schedule(t.schedule, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio,
                             t.decay_fraction)


# Muon's matrices: name -> (input axes, output axes); [L] and [L, E] axes are batches of
# separate matrices (one per layer and expert). The router keeps AdamW, as in Kimi K2.
MUON_DIMS = {"wo": ((1, 2), (3,)), **dict.fromkeys(("w_gate", "w_up", "w_down"), ((2,), (3,))),
             "eh_proj": ((1,), (2,)),
             **dict.fromkeys(("wq", "wk", "wv", "wq_b", "wkv_b"), ((1,), (2, 3))),
             **dict.fromkeys(("wq_a", "wkv_a", "shared_gate", "shared_up", "shared_down",
                              "mlp_gate", "mlp_up", "mlp_down"), ((1,), (2,)))}


def make_optimizer(t: TrainConfig, specs: dict | None = None):
    return train.optimizer(t.optimizer, make_schedule(t), b1=t.b1, b2=t.b2,
                           weight_decay=t.weight_decay, clip_norm=t.clip_norm,
                           decayed={"embed", "unembed", "w_router", "idx_wq", "idx_wk", "idx_w",
                                    *MUON_DIMS},
                           muon_dims=MUON_DIMS, muon_dtype=t.muon_dtype, specs=specs)


def train_state(cfg: Config, mesh) -> train.TrainState:
    """{params, opt_state, step; with sigmoid routing buffers: the router biases} on `mesh`."""
    bt, specs = _buffer_table(cfg.model), param_specs(cfg.model)
    if mesh.shape["stage"] > 1:  # --mesh.stage: each stage holds its share of the MoE layers
        specs["layers"] = {k: P("stage", *s[1:]) for k, s in specs["layers"].items()}
    buffers = (lambda: train.table_init(bt, jax.random.key(0)), train.table_specs(bt))
    lora = cfg.lora.rank and (  # LoRA
        train.lora_table(_param_table(cfg.model), MUON_DIMS, cfg.lora), cfg.train.seed)
    return train.TrainState(partial(_init, cfg.model), specs, make_optimizer(cfg.train, specs),
                            mesh, buffers=buffers if bt else None, lora=lora or None)


def count_params(cfg: ModelConfig) -> int:
    return train.table_count(_param_table(cfg))


def count_active_params(cfg: ModelConfig) -> int:
    """Parameters one token uses: all of them but the n_experts - top_k experts it skips."""
    per_expert = 3 * cfg.d_model * cfg.d_ff + (2 * cfg.d_ff + cfg.d_model) * cfg.moe_bias
    unused = (moe_layers(cfg) + cfg.mtp_depth) * (cfg.n_experts - cfg.top_k) * per_expert
    return count_params(cfg) - unused


def _chunked(chunk: int, *xs_BT):
    def cut(x):
        if x is None:
            return None
        B, T = x.shape[:2]
        C = min(chunk, T)
        return x.reshape(B, T // C, C, *x.shape[2:]).swapaxes(0, 1)
    return [cut(x) for x in xs_BT]


def _softcap(logits, cap: float):
    return cap * jnp.tanh(logits / cap) if cap else logits   # Gemma 2's final soft-cap


@partial(jax.custom_vjp, nondiff_argnums=(0, 5, 6))
def _ce_fused(ce_fn, h_BTD, w_DV, t_BT, wt_BT, chunk: int, unroll: bool = False):
    """ce_fn's sums over the sequence's chunks, each chunk's gradient made with its sums.

    Each chunk leaves only its dh and adds to dW. Against `_ce_remat` this saves the second
    unembedding matmul, which dominates the step when the vocabulary is large. Only the
    objective is differentiated; the cross-entropy is a report. Weights are data.
    """
    return _ce_fused_fwd(ce_fn, h_BTD, w_DV, t_BT, wt_BT, chunk, unroll)[0]


def _ce_fused_fwd(ce_fn, h_BTD, w_DV, t_BT, wt_BT, chunk, unroll=False):
    # One chunk: its dW straight in the weight's dtype, so that the devices' partial sums are
    # reduced in it (the 70B's gathered unembedding: half the bytes); several add up in float32.
    dt = w_DV.dtype if h_BTD.shape[1] <= chunk else jnp.float32

    def one(acc, xs):
        acc, xs = jax.lax.optimization_barrier((acc, xs))  # chunk by chunk, not all logits at once
        (obj, ce), (dh_BCD, dw_DV) = ce_fn(xs[0], w_DV, *xs[1:], grad=True, dw_dtype=dt)
        return (acc[0] + obj, acc[1] + ce, acc[2] + dw_DV), dh_BCD

    zero = jnp.zeros((), jnp.float32)
    (obj, ce, dw_DV), dh_nBCD = jax.lax.scan(
        one, (zero, zero, jnp.zeros(w_DV.shape, dt)),
        _chunked(chunk, h_BTD, t_BT, wt_BT), unroll=unroll)
    dh_BTD = dh_nBCD.swapaxes(0, 1).reshape(h_BTD.shape)
    return (obj, ce), (dh_BTD, dw_DV.astype(w_DV.dtype))


def _ce_fused_bwd(ce_fn, chunk, unroll, res, g):
    dh_BTD, dw_DV = res
    return ((g[0] * dh_BTD).astype(dh_BTD.dtype), (g[0] * dw_DV).astype(dw_DV.dtype), None,
            None)


_ce_fused.defvjp(_ce_fused_fwd, _ce_fused_bwd)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token on the *active* parameters: 3x the forward, 2 per weight of every
    matmul a token goes through (q, k, v, o, router, top_k experts, unembedding) plus attention's
    2 * 2 * T * N * H per layer (PaLM app. B). Sorting, exchanges and padding are overhead."""
    if S := cfg.hc_mult:  # V4: its projections, mHC's, the compressors' and indexer's; keys: the
        # window, the closed entries (CSA: the chosen ones; its indexer scores them all), q.v 2H
        D, N, H, T, Qr, Mi, Hi = (cfg.d_model, cfg.n_heads, cfg.head_dim, seq_len, cfg.q_lora_rank,
                                  cfg.index_n_heads, cfg.index_head_dim)
        _, _, (_, nc, nh), rate = v4_kinds(cfg)
        w = cfg.n_layers * (D * Qr + Qr * N * H + D * H + (N * H + cfg.o_groups * D) *
                            cfg.o_lora_rank + 2 * S * D * (2 + S) * S + D * cfg.n_experts + (cfg.top_k + cfg.n_shared_experts) * 3 * D
                            * cfg.d_ff) + nc * (4 * D * (H + Hi) + Qr * Mi * Hi + D * Mi) + \
            nh * 2 * D * H + D * cfg.vocab_size
        keys = cfg.n_layers * min(T, cfg.sliding_window) + nc * (min(
            cfg.index_topk, T // cfg.csa_ratio) + T // cfg.csa_ratio * Mi * Hi / (2 * N * H)) + (
            nh * (T // rate) if nh else 0)
        return 3.0 * (2 * w + 2 * keys * N * 2 * H)
    D, N, K, H, L = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    attn, Hqv = D * N * H + 2 * D * K * H + N * H * D, 2 * H   # Hqv: q.k and p.v widths
    if cfg.kv_lora_rank:   # MLA: the latents' down- and up-projections, keys and values
        Hn, Hr, Hv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        C, Qr, Hq, Hqv = cfg.kv_lora_rank, cfg.q_lora_rank, Hn + Hr, Hn + Hr + Hv
        attn = ((D * Qr + Qr * N * Hq) if Qr else D * N * Hq) + D * (C + Hr) + \
            C * N * (Hn + Hv) + N * Hv * D
    Lm = moe_layers(cfg)
    mlp = D * cfg.n_experts + (cfg.top_k + cfg.n_shared_experts) * 3 * D * cfg.d_ff
    matmul_weights = L * attn + Lm * mlp + (L - Lm) * 3 * D * cfg.dense_d_ff + D * cfg.vocab_size
    W, n = cfg.sliding_window or cfg.attn_chunk, cfg.global_every  # a local layer: min(T, W) keys
    n_global = (L // n if n else 0) if W else L
    keys = n_global * seq_len + (L - n_global) * min(seq_len, W or seq_len)
    matmul_weights += cfg.mtp_depth * (2 * D * D + attn + mlp + D * cfg.vocab_size)
    keys += cfg.mtp_depth * seq_len  # each MTP module: W_eh, a (global) MoE layer, the head
    if cfg.global_head_dim:  # Gemma 4: global layers of their own width G and K/V heads (q.k and
        # p.v 2G wide), and a dense MLP beside every layer's experts
        G, Kg = cfg.global_head_dim, cfg.global_kv_heads or K
        matmul_weights += n_global * (D * G * (2 * N + Kg * (2 - cfg.k_eq_v)) - attn) + \
            L * 3 * D * cfg.dense_d_ff
        keys += n_global * seq_len * (2 * G / Hqv - 1)
    if Hk := cfg.linear_k_heads:  # Qwen3-Next: n - 1 of n layers DeltaNet (no keys attended):
        # their projections, and per token its chunk's C keys (q.k, k.k, the solve's rows) and
        # three state products; the global layers' gates; the shared expert's gate
        Hv, Dk, Dv, Ll, C = (cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim,
                             L - L // n, min(cfg.linear_chunk, seq_len))
        matmul_weights += Ll * (D * (2 * Hk * Dk + 2 * Hv * Dv + 2 * Hv) + Hv * Dv * D - attn) + (
            L - Ll) * D * N * H * cfg.attn_gate + Ll * Hv * (C * (2 * Dk + 2 * Dv) + 3 * Dk * Dv)
        keys -= Ll * seq_len
    if cfg.index_n_heads:  # DSA: the indexer's projections and its scores over every key; MLA
        Mi, Hi = cfg.index_n_heads, cfg.index_head_dim   # over each query's top k
        matmul_weights += L * (cfg.q_lora_rank * Mi * Hi + D * (Mi + Hi))
        keys = L * (min(seq_len, cfg.index_topk) + seq_len * Mi * Hi / (N * Hqv))
    return 3.0 * (2 * matmul_weights + 2 * keys * N * Hqv)   # + attention's


def validate(cfg: Config, n_devices: int, platform: str = "") -> None:
    """Every check that needs no compilation, so a bad launch fails in a second (`platform`:
    the compile target's, where it is not this host's)."""
    m, t = cfg.model, cfg.train
    train.check_ranges(cfg)
    mesh = resolve(cfg.mesh, n_devices, max(1, math.prod(cfg.mesh.dcn())))
    train.check_lora(cfg.lora, t.optimizer, t.qk_clip_threshold)  # LoRA
    Kd = m.first_k_dense  # the pipeline runs the MoE stack; the dense layers come before it
    train.check_pipeline(mesh, t.microbatches, t.pipeline_repeats, (f"--model.n-layers {m.n_layers}"
                         + f" less --model.first-k-dense {Kd}" * bool(Kd), moe_layers(m)), [
        f for f, on in (("--model.gemma4", m.gemma4), ("--model.linear-k-heads", m.linear_k_heads),
                        ("--model.hc-mult", m.hc_mult),
                        ("--model.moe-every 2", m.moe_every > 1), ("--model.index-n-heads",
                        m.index_n_heads), ("--mesh.context", mesh.context * mesh.dcn_context > 1),
                        ("--lora.rank", cfg.lora.rank), ("dropless experts on --model.grouped-"
                        "matmul ragged_dot (auto on GPUs), which XLA:TPU cannot compile batched "
                        "over stages: set --model.capacity-factor 1.25 or --model.grouped-matmul "
                        "tiled (megablox on TPUs)", not m.capacity_factor and _grouped_impl(
                            m, platform) == "ragged_dot")) if on])
    need(m.n_experts >= 2, f"--model.n-experts {m.n_experts}: a mixture needs at least 2 "
         "experts; one expert is a dense MLP, which train_dense.py trains (with --model.d-ff "
         "for its width).")
    need(1 <= m.top_k <= m.n_experts, f"--model.top-k {m.top_k} must be between 1 and "
         f"--model.n-experts {m.n_experts}: each token picks top-k distinct experts.")
    need(m.capacity_factor >= 0, f"--model.capacity-factor {m.capacity_factor}: use 0 for "
         "dropless routing or a positive factor (1.25 is usual) for capacity mode.")
    need(m.gmm_tile >= 1, f"--model.gmm-tile {m.gmm_tile} must be >= 1.")
    need(m.grouped_matmul != "megablox" or (platform or target_platform()) != "gpu", "--model."
         "grouped-matmul megablox is a TPU kernel (interpreted on a CPU); use auto on a GPU.")
    # A device of the expert axis holds n_experts / expert whole experts.
    train.check_sizes(mesh, {"expert": [("--model.n-experts", m.n_experts)], "tensor": [
        ("--model.n-heads", m.n_heads), ("--model.n-kv-heads", m.n_kv_heads),
        ("--model.dense-d-ff", m.dense_d_ff),
        ("--model.global-kv-heads", m.global_kv_heads), ("--model.index-n-heads", m.index_n_heads),
        ("--model.o-groups", m.o_groups),
        ("--model.linear-k-heads", m.linear_k_heads),
        ("--model.vocab-size", m.vocab_size)], "fsdp": [("--model.d-model", m.d_model)]})
    f = m.down_split == "f"  # w_down's F split over tensor, fsdp and context (`_layer_table`)
    ways = train.batch_shards(mesh, ("tensor", "fsdp", "context") if f else ("tensor",))
    need(m.d_ff % ways == 0, f"--model.d-ff {m.d_ff} is not divisible by "
         f"{'tensor x fsdp x context' if f else 'tensor'} = {ways}: each expert's down projection "
         "is split on it. Choose sizes dividing it" + ", or --model.down-split d (fsdp on "
         "d_model: a TPU then copies its gradient to reduce it)" * f + ".")
    need(m.n_heads % m.n_kv_heads == 0, f"--model.n-heads {m.n_heads} is not a multiple of "
         f"--model.n-kv-heads {m.n_kv_heads} (each key/value head serves a whole group).")
    need(m.head_dim % 2 == 0, f"--model.head-dim {m.head_dim} must be even (RoPE rotates pairs).")
    need(m.sliding_window or m.attn_chunk or m.global_nope or m.linear_k_heads or
         not m.global_every, f"--model."
         f"global-every {m.global_every} without --model.sliding-window (or --model.attn-chunk,"
         " --model.global-nope, --model.linear-k-heads): the layers between the global ones are"
         " the local ones. Give "
         "the window, or --model.global-every 0.")
    need(not (m.sliding_window and m.attn_chunk), "--model.sliding-window with --model.attn-"
         "chunk: a local layer has one or the other; set one to 0.")
    train.check_batch(t.batch_size, t.microbatches, mesh, MOE_BATCH)
    need(t.seq_len <= m.max_seq_len, f"--train.seq-len {t.seq_len} exceeds the model's maximum "
         f"--model.max-seq-len {m.max_seq_len}.")
    train.check_sequence(mesh, t.seq_len, m.loss_chunk, t.qk_clip_threshold, m.attn_chunk,
                         (m.context_attention, m.n_heads, m.n_kv_heads))
    train.check_profile(t.profile_steps, t.steps)
    train.check_qk_clip("--train.qk-clip-threshold", t.qk_clip_threshold,
                        m.qk_norm or m.qk_l2_norm)
    _validate_deepseek(m, t)
    _validate_gemma4(m)
    need(not m.mtp_depth or m.mtp_depth < t.seq_len and not m.gemma4,
         f"--model.mtp-depth {m.mtp_depth}: each module predicts one token further, so fewer "
         f"than --train.seq-len {t.seq_len}; not with --model.gemma4 (its layers come in kinds).")
    _validate_dsa(m, t, mesh.context * mesh.dcn_context, cfg.lora.rank)
    _validate_v4(m, t, mesh.context * mesh.dcn_context)
    _validate_qwen3_next(m, t, mesh.context * mesh.dcn_context)


def _validate_v4(m: ModelConfig, t: TrainConfig, context: int) -> None:
    kind_L, _, sizes, hca = v4_kinds(m)
    r, flag = m.compress_ratios, f"--model.hc-mult {m.hc_mult}"
    clash = [f for f in ("kv_lora_rank", "gemma4", "linear_k_heads", "first_k_dense", "mtp_depth",
                         "global_every", "attn_chunk", "qk_norm", "attn_bias", "moe_bias",
                         "n_group") if getattr(m, f)]
    need(not m.hc_mult or len(r) == m.n_layers and len({x for x in r if x not in (0, m.csa_ratio)})
         <= 1 and m.csa_ratio > 0 and m.n_kv_heads == 1 and m.q_lora_rank and m.sliding_window
         and m.attn_sinks and m.sigmoid_routing and m.o_groups and m.o_lora_rank and
         m.n_heads % m.o_groups == 0 and 0 < m.rotary_dim <= min(m.head_dim, m.index_head_dim if
                                                                 sizes[1] else m.head_dim)
         and (m.index_n_heads or not sizes[1]) and m.n_hash_layers < m.n_layers and not clash,
         f"{flag} (DeepSeek-V4) needs --model.compress-ratios, one per layer of --model.n-layers"
         f" {m.n_layers} (0, --model.csa-ratio {m.csa_ratio}, or one HCA rate), --model.n-kv-heads"
         " 1, --model.q-lora-rank, --model.sliding-window, --model.attn-sinks, --model.sigmoid-"
         "routing, --model.o-groups dividing --model.n-heads with --model.o-lora-rank, an even "
         "--model.rotary-dim within the head (and the indexer's), --model.index-n-heads where CSA"
         " layers are, fewer --model.n-hash-layers than layers" + (
             f"; --model.{clash[0].replace('_', '-')} is not V4's: turn it off" if clash else "")
         + ".")
    need(not m.hc_mult or context == 1 and not t.qk_clip_threshold and not t.indexer_warmup_steps,
         f"{flag} with --mesh.context, --train.qk-clip-threshold or --train.indexer-warmup-steps: "
         "not built for V4's attention yet; set them to 1, 0 and 0.")
    need(m.hc_mult or not (r or m.o_groups or m.n_hash_layers or m.sqrt_softplus), "--model."
         "compress-ratios, --model.o-groups, --model.n-hash-layers and --model.sqrt-softplus are "
         "DeepSeek-V4's: add --model.hc-mult, or turn them off.")


def _validate_qwen3_next(m: ModelConfig, t: TrainConfig, context: int) -> None:
    n, flag = m.global_every, f"--model.linear-k-heads {m.linear_k_heads}"
    clash = [f for f in ("gemma4", "kv_lora_rank", "sliding_window", "attn_chunk", "global_nope",
                         "first_k_dense", "mtp_depth") if getattr(m, f)] + ["moe_every"] * (
        m.moe_every > 1)
    need(not m.linear_k_heads or n > 1 and m.n_layers % n == 0 and m.linear_v_heads %
         m.linear_k_heads == 0 and not clash, f"{flag} (Gated DeltaNet) runs in periods of "
         f"--model.global-every {n} layers (n - 1 DeltaNet, then full attention) dividing "
         f"--model.n-layers {m.n_layers}, each key head serving a whole group of --model.linear-"
         f"v-heads {m.linear_v_heads}" + (f"; --model.{clash[0].replace('_', '-')} is not "
                                          "built with it: turn it off" if clash else "") + ".")
    need(not m.linear_k_heads or context == 1 and not t.qk_clip_threshold, f"{flag} with "
         "--mesh.context > 1 or --train.qk-clip-threshold: the delta rule's state runs through "
         "the whole sequence (not split across devices yet) and has no logits to clip; set "
         "--mesh.context 1 and --train.qk-clip-threshold 0.")
    need(m.linear_k_heads or not m.linear_v_heads, f"--model.linear-v-heads {m.linear_v_heads} "
         "without --model.linear-k-heads: give both (Gated DeltaNet) or neither.")
    need(m.rotary_dim % 2 == 0 and m.rotary_dim <= m.head_dim and not (m.rotary_dim and (
        m.kv_lora_rank or m.gemma4)), f"--model.rotary-dim {m.rotary_dim}: an even number of "
         f"dims at most --model.head-dim {m.head_dim} (RoPE turns pairs), not with MLA or Gemma 4 "
         "(which rotate their own way).")
    need(m.n_shared_experts or not m.shared_gated, "--model.shared-gated gates a shared expert: "
         "add --model.n-shared-experts 1.")


def _validate_dsa(m: ModelConfig, t: TrainConfig, context: int, lora: int) -> None:
    on, flag = m.index_n_heads > 0, f"--model.index-n-heads {m.index_n_heads}"
    if m.hc_mult:  # V4's indexer (`compressed_keys`): `_validate_v4`
        return
    need(not on or m.kv_lora_rank and m.q_lora_rank, f"{flag}: DeepSeek's sparse attention is "
         "MLA's with a query latent, which its indexer reads; give --model.kv-lora-rank and "
         "--model.q-lora-rank, or set it to 0.")
    need(not on or m.qk_rope_head_dim <= m.index_head_dim and m.index_head_dim % 2 == 0,
         f"--model.index-head-dim {m.index_head_dim} must be even and at least --model.qk-rope-"
         f"head-dim {m.qk_rope_head_dim}: the indexer rotates that many of its dims.")
    need(not on or not (context > 1 or t.qk_clip_threshold or m.global_every or m.moe_every > 1),
         f"{flag} with --mesh.context, --train.qk-clip-threshold, --model.global-every or "
         "--model.moe-every: not built for sparse attention; turn those off.")
    need(on or not t.indexer_warmup_steps, f"--train.indexer-warmup-steps "
         f"{t.indexer_warmup_steps} trains an indexer the model lacks: add --model.index-n-heads.")
    need(not (t.indexer_warmup_steps and lora), "--train.indexer-warmup-steps with --lora.rank: "
         "the warm-up trains the indexer's own weights, which LoRA freezes; pick one.")
    need(not (on and m.mtp_depth), f"{flag} with --model.mtp-depth {m.mtp_depth}: the MTP "
         "modules are not built with sparse attention yet; set one of them to 0.")


def _validate_gemma4(m: ModelConfig) -> None:
    n, clash = m.global_every, [f for f in (
        "kv_lora_rank", "attn_sinks", "attn_bias", "moe_bias", "swiglu_limit", "sigmoid_routing",
        "score_inputs", "n_shared_experts", "attn_chunk", "global_nope", "qk_l2_norm",
        "yarn_factor", "rope_scaling", "first_k_dense") if getattr(m, f)] + ["moe_every"] * (
        m.moe_every > 1)
    need(not m.gemma4 or m.global_head_dim and m.sliding_window and n > 1 and m.n_layers % n == 0
         and m.qk_norm and m.dense_d_ff and not clash, f"--model.gemma4 runs in periods of "
         f"--model.global-every {n} layers (n - 1 local, windowed by --model.sliding-window, then"
         f" a global one --model.global-head-dim wide) dividing --model.n-layers {m.n_layers}, "
         "with --model.qk-norm and --model.dense-d-ff (the MLP beside the experts)"
         + (f"; --model.{clash[0].replace('_', '-')} is not Gemma 4's" if clash else "") + ".")
    need(m.gemma4 or not (m.global_head_dim or m.global_kv_heads or m.k_eq_v or m.rope_partial or
                          m.rope_local_theta), "--model.global-head-dim, --model.global-kv-heads,"
         " --model.k-eq-v, --model.rope-partial and --model.rope-local-theta are Gemma 4's: add "
         "--model.gemma4, or turn them off.")
    need(m.n_heads % max(m.global_kv_heads, 1) == 0 and m.global_head_dim % 2 == 0, f"--model."
         f"global-kv-heads {m.global_kv_heads} does not divide --model.n-heads {m.n_heads}, or "
         f"--model.global-head-dim {m.global_head_dim} is odd (RoPE rotates pairs).")


def _validate_deepseek(m: ModelConfig, t: TrainConfig) -> None:
    if m.kv_lora_rank:
        clash = [f for f in ("qk_norm", "attn_bias", "attn_sinks", "sliding_window") if
                 getattr(m, f)]
        need(not clash, f"--model.kv-lora-rank {m.kv_lora_rank} (MLA) with --model."
             f"{clash[0].replace('_', '-') if clash else ''}: MLA is DeepSeek's attention, "
             "which has none of those; turn it off.")
        need(m.n_kv_heads == m.n_heads, f"--model.n-kv-heads {m.n_kv_heads} with MLA: MLA builds a "
             f"key and a value for each query head; set it to --model.n-heads {m.n_heads}.")
        need(m.qk_rope_head_dim >= 2 and m.qk_rope_head_dim % 2 == 0, f"--model.qk-rope-head-"
             f"dim {m.qk_rope_head_dim} must be even and positive (RoPE rotates pairs).")
        need(m.v_head_dim <= m.qk_nope_head_dim + m.qk_rope_head_dim, f"--model.v-head-dim "
             f"{m.v_head_dim} exceeds the query width {m.qk_nope_head_dim + m.qk_rope_head_dim}"
             " (nope + rope), to which the values are padded; narrow it.")
        need(not m.yarn_factor or m.yarn_mscale_all_dim, "--model.yarn-factor with MLA needs "
             "--model.yarn-mscale-all-dim (DeepSeek-V3: 1.0): the logits' YaRN correction.")
    need(m.kv_lora_rank or not m.yarn_mscale_all_dim, "--model.yarn-mscale-all-dim is MLA's "
         "(--model.kv-lora-rank > 0); turn it off.")
    need(not m.n_group or (m.n_experts % m.n_group == 0 and 1 <= m.topk_group <= m.n_group and
                           m.top_k <= m.topk_group * (m.n_experts // m.n_group) and
                           m.n_experts >= 2 * m.n_group),
         f"--model.n-group {m.n_group} --model.topk-group {m.topk_group}: the groups must split "
         f"--model.n-experts {m.n_experts} evenly, at least 2 experts each (each group is ranked "
         f"by its best two), and the chosen groups must hold --model.top-k {m.top_k} experts.")
    need(m.sigmoid_routing and not m.score_inputs or not t.router_bias_rate, "--train.router-"
         "bias-rate moves DeepSeek-V3's choice biases (Llama 4's routing has none): add "
         "--model.sigmoid-routing, or set it to 0.")
    need(not (m.sigmoid_routing and m.moe_bias), "--model.sigmoid-routing with --model.moe-bias: "
         "GPT-OSS's router bias and DeepSeek's choice bias are different models; pick one.")
    need(0 <= m.first_k_dense < m.n_layers and bool(m.first_k_dense or m.moe_every > 1 or
                                                   m.gemma4) == bool(m.dense_d_ff),
         f"--model.first-k-dense {m.first_k_dense} --model.moe-every {m.moe_every} --model."
         f"dense-d-ff {m.dense_d_ff}: give dense layers (or Gemma 4's MLPs) and their width, "
         f"or neither, with fewer dense layers than --model.n-layers {m.n_layers}.")
    need(m.moe_every == 1 or m.moe_every == 2 and not m.first_k_dense and m.n_layers % 2 == 0,
         f"--model.moe-every {m.moe_every}: 1 (every layer MoE) or 2 (Llama 4 Maverick's dense "
         "and MoE layers in turn: an even --model.n-layers, no --model.first-k-dense).")


# ----------------------------------------------------------------------------------------------
# 5. Experts: routing and dispatch
# ----------------------------------------------------------------------------------------------
def moe(h_BTD, lp: dict, cfg: ModelConfig, route_BTD=None, hashed=None):
    """The MoE block on normed activations: (output [B,T,D], routing stats). Gemma 4 routes
    `route_BTD`, normed its own way, and scales each expert's weight by its own factor; V4's hash
    layers fix the experts (`hashed` [B,T,R])."""
    gate_BTR, expert_BTR, stats = router(h_BTD if route_BTD is None else route_BTD,
                                         lp["w_router"], cfg, lp.get("b_router"),
                                         lp.get("router_bias"), hashed)
    gate_BTR = gate_BTR * lp["expert_scale"][expert_BTR] if "expert_scale" in lp else gate_BTR
    dt = h_BTD.dtype  # cast outside the shard_map: mixtral's TPU step moves 6% fewer bytes
    ws = {k: lp[k].astype(dt) for k in ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
          if k in lp}
    if cfg.n_experts == 1:  # `bench`'s dense twin: one expert of weight 1, routing the identity
        y = swiglu(h_BTD, {k: a[0] for k, a in ws.items()}, cfg)
        return constrain(y, ACT_BTD), stats | {"dropped": jnp.zeros((), jnp.float32)}
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        y, dropped = experts(h_BTD, expert_BTR, gate_BTR, ws, cfg)
    else:  # each weight as its table shards it, less the layer axis
        act, spec = ACT_BTD, param_specs(cfg)["layers"]
        y, dropped = jax.shard_map(
            partial(experts, cfg=cfg, peers=mesh.shape["expert"], sharded=True),
            in_specs=(act, act, act, {k: P(*spec[k][1:]) for k in ws}),
            out_specs=(act, P((*MOE_BATCH, "context"))),
            # Pipelined (a vmap over stages) its values vary over `stage`, which specs cannot name;
            # megablox's kernel declares no varying axes
            check_vma=train.stages() == 1 and _grouped_impl(cfg) != "megablox")(
                h_BTD, expert_BTR, gate_BTR, ws)
    if cfg.n_shared_experts:  # DeepSeek's shared experts: one wider SwiGLU every token uses
        s = swiglu(h_BTD, {"w_" + k: lp["shared_" + k].astype(dt) for k in PROJ}, cfg)
        y = y + (s * jax.nn.sigmoid(h_BTD @ lp["shared_router"].astype(dt)) if cfg.shared_gated
                 else s)  # Qwen3-Next: a per-token gate on it
    return y, stats | {"dropped": jnp.sum(dropped) / expert_BTR.size}  # of the assignments


def router(h_BTD, w_DE, cfg: ModelConfig, b_E=None, bias_E=None, hashed=None):
    """Top-k routing and its statistics: (weights [B,T,R] f32, experts [B,T,R] int32, stats).

    Switch load balancing (Fedus et al. 2021, eq. 4) in HuggingFace's and MaxText's top-k
    convention, so their coefficients carry over: aux = E * sum_e f_e * P_e, f_e the fraction
    of tokens that chose e among their top k (the f_e sum to k), P_e e's mean router
    probability: k when balanced, E when collapsed onto k experts; its gradient reaches the
    router through P only. Router z-loss (ST-MoE): mean logsumexp(logits)^2 keeps the logits
    small enough for a float32 softmax to stay exact. `load`: each expert's share of the
    assignments. GPT-OSS's router has a bias b_E and softmaxes the k chosen logits: the same
    weights as the renormalised top k of the whole softmax (norm_topk).
    DeepSeek-V3 (sigmoid_routing): scores s = sigmoid(logits), the top k chosen on s + bias_E
    (`balance_biases`) but weighted by s alone, renormalised (norm_topk), times routed_scale.
    With n_group a token first keeps its best topk_group of n_group groups, ranked by the sum
    of their two best s + bias, and chooses among those (DeepSeek-V2, softmax: ranked by their
    best probability). The aux loss takes P_e = s / sum(s). V4: s = sqrt(softplus(logits)), and
    on its hash layers the experts are the token's (`hashed`), weighted as the chosen ones."""
    E, R, G = cfg.n_experts, cfg.top_k, cfg.n_group
    logits_BTE = jnp.einsum("btd,de->bte", h_BTD.astype(jnp.float32), w_DE)
    logits_BTE = logits_BTE if b_E is None else logits_BTE + b_E
    if cfg.sigmoid_routing:
        scores_BTE = (jnp.sqrt(jax.nn.softplus(logits_BTE)) if cfg.sqrt_softplus else
                      jax.nn.sigmoid(logits_BTE))
        probs_BTE = scores_BTE / jnp.sum(scores_BTE, axis=-1, keepdims=True)
    else:
        scores_BTE = probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    choice_BTE = scores_BTE if bias_E is None else scores_BTE + bias_E
    if G:  # V3 ranks a group by its two best s + bias, V2 (softmax) by its best probability
        groups = choice_BTE.reshape(*choice_BTE.shape[:2], G, E // G)
        rank_BTG = (jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1) if cfg.sigmoid_routing else
                    jnp.max(groups, axis=-1))
        keep_BTG = jnp.sum(jax.nn.one_hot(jax.lax.top_k(rank_BTG, cfg.topk_group)[1], G,
                                          dtype=jnp.int32), axis=2) > 0
        choice_BTE = jnp.where(jnp.repeat(keep_BTG, E // G, axis=-1), choice_BTE, -jnp.inf)
    expert_BTR = jax.lax.top_k(choice_BTE, R)[1]
    expert_BTR = expert_BTR if hashed is None else hashed
    gate_BTR = jnp.take_along_axis(scores_BTE, expert_BTR, axis=-1)
    if cfg.norm_topk:  # HF's epsilon: all k sigmoid scores may underflow to 0 (a softmax's
        # sum is >= 1/E, which the epsilon leaves unchanged in float32)
        gate_BTR = gate_BTR / (jnp.sum(gate_BTR, axis=-1, keepdims=True) + 1e-20)
    gate_BTR = gate_BTR * (cfg.routed_scale or 1.0)
    B, T = h_BTD.shape[:2]
    count_BE = jnp.sum(jax.nn.one_hot(expert_BTR, E, dtype=jnp.float32), axis=(1, 2))
    count_E, n_tokens = jnp.sum(count_BE, axis=0), B * T
    # seq_aux (DeepSeek-V3 eqs. 17-19): f and P of each sequence, the mean over sequences
    aux = E * (jnp.mean(jnp.sum(count_BE / T * jnp.mean(probs_BTE, axis=1), axis=-1)) if
               cfg.seq_aux else jnp.sum(count_E / n_tokens * jnp.mean(probs_BTE, axis=(0, 1))))
    load_E = count_E / (n_tokens * R)
    return gate_BTR, expert_BTR.astype(jnp.int32), {
        "aux_loss": aux, "router_z": jnp.mean(jnp.square(jax.nn.logsumexp(logits_BTE, axis=-1))),
        "load": load_E, "load_min": jnp.min(load_E), "load_max": jnp.max(load_E)}


def _buffer_table(cfg: ModelConfig) -> dict:
    """State that is not trained: with sigmoid routing, each MoE layer's bias on the scores
    that choose the experts (DeepSeek-V3's e_score_correction_bias), moved by `balance_biases`."""
    L, on = moe_layers(cfg) - cfg.n_hash_layers, cfg.sigmoid_routing and not cfg.score_inputs
    bias = lambda n: {"layers": {"router_bias": ((n, cfg.n_experts), P(None, None), 0.0)}}
    return bias(L) | ({"mtp": bias(cfg.mtp_depth)} if cfg.mtp_depth else {}) if on else {}


def with_buffers(params: dict, buffers: dict) -> dict:
    """The weights with the buffers (under stop_gradient) joined into their stacks."""
    return train.join(params, jax.tree.map(jax.lax.stop_gradient, buffers))


def balance_biases(bias_LE, load_LE, rate: float):
    """Auxiliary-loss-free balancing (DeepSeek-V3, sec. 2.1.2): after each step a bias rises by
    `rate` if its expert took less than the even share of its layer's assignments, falls if
    more: the choice drifts toward idle experts; the combine weights are the gradient's alone."""
    return bias_LE + rate * jnp.sign(1.0 / load_LE.shape[-1] - load_LE)


PROJ = ("gate", "up", "down")  # an MLP's projections: `swiglu` takes w_gate, ..., b_down
SWIGLU_ALPHA = 1.702  # GPT-OSS's sigmoid gain: g sigmoid(1.702 g) approximates GELU


def glu(g, u, cfg: ModelConfig | None = None):
    """silu(g) u (Gemma 4: gelu(g) u); with swiglu_limit (GPT-OSS) g is clamped above and u on
    both sides at the limit, and the gate is g sigmoid(alpha g) (u + 1)."""
    c = cfg.swiglu_limit if cfg is not None else 0.0
    if cfg is not None and cfg.gemma4:  # GeGLU, with the tanh GELU
        return jax.nn.gelu(g, approximate=True) * u
    if not c:
        return jax.nn.silu(g) * u
    g, u = jnp.minimum(g, c), jnp.clip(u, -c, c)
    if cfg.hc_mult:  # DeepSeek-V4's: the plain SwiGLU of the clamped g and u
        return jax.nn.silu(g) * u
    return g * jax.nn.sigmoid(SWIGLU_ALPHA * g) * (u + 1)


def swiglu(x, w: dict, cfg: ModelConfig | None = None, mm=jnp.matmul, at=lambda b: b):
    """An MLP on rows x (w: w_gate, w_up, w_down, with moe_bias b_gate, b_up, b_down). Every
    dispatch path runs its experts here, differing only in `mm(x, weight)` (batched over
    experts, ragged or tiled) and `at(bias)` (each row's expert's bias, onto the rows)."""
    def proj(x, name):
        y = mm(x, w["w_" + name])
        return y + at(w["b_" + name]) if "b_" + name in w else y
    return proj(glu(proj(x, "gate"), proj(x, "up"), cfg), "down")


def _grouped_impl(cfg: ModelConfig, platform: str = "") -> str:
    # auto: XLA:CPU rewrites ragged_dot as every row times every group's weights, zero-masked (E
    # times the FLOPs; 2-6x slower than tiled at E=8 on a laptop); GPUs run it as one grouped
    # GEMM; on TPUs XLA copied each gathered expert weight to another layout for it (Mixtral's
    # v5p-8 compile: 58 of 275 GB a step), which megablox's kernels do not. The compile target
    # decides, not the host (--compile-topology: the TPU's).
    return cfg.grouped_matmul if cfg.grouped_matmul != "auto" else {
        "cpu": "tiled", "tpu": "megablox"}.get(platform or target_platform(), "ragged_dot")


def _tile_layout(sizes_G, M: int, tile: int):
    """Each group padded to whole tiles: (destination row of each input row, group of each
    tile, number of tiles: static, M / tile + G). Rows past sum(sizes) go out of range."""
    G, row_M = sizes_G.shape[0], jnp.arange(M)
    n_tiles, tiles_G = -(-M // tile) + G, (sizes_G + tile - 1) // tile
    end_G, tile_end_G = jnp.cumsum(sizes_G), jnp.cumsum(tiles_G)
    group_M = jnp.searchsorted(end_G, row_M, side="right")     # G for rows past the groups
    g_M = jnp.minimum(group_M, G - 1)
    within_M = row_M - (end_G - sizes_G)[g_M]
    dest_M = jnp.where(group_M < G, (tile_end_G - tiles_G)[g_M] * tile + within_M, n_tiles * tile)
    group_n = jnp.minimum(jnp.searchsorted(tile_end_G, jnp.arange(n_tiles), side="right"), G - 1)
    return dest_M, group_n, n_tiles


def grouped_mlp(x_MD, sizes_G, w, cfg: ModelConfig):
    """SwiGLU of expert g on its sizes_G[g] rows of x (sorted by group; rows past the sum give
    zeros, or with biases values no one reads); w as `swiglu`'s with a leading G axis. "tiled"
    (megablocks-style, for the CPU): each group padded to whole tiles of `gmm_tile` rows, one
    batched matmul over tiles: at most G tiles of padding, one weight copy per tile."""
    M, D = x_MD.shape
    if (impl := _grouped_impl(cfg)) in ("ragged_dot", "megablox"):
        group_M = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes_G), jnp.arange(M), side="right"),
                              sizes_G.shape[0] - 1)
        if impl == "ragged_dot":
            return swiglu(x_MD, w, cfg, lambda x, w: jax.lax.ragged_dot(x, w, sizes_G),
                          lambda b: b[group_M])
        from jax.experimental.pallas.ops.tpu.megablox import gmm  # JAX's Pallas kernel for TPUs,
        # MaxText's tiles: tm rows against their groups' weights as stored. Rows past sum(sizes)
        # and the padding to whole tiles are never written: cut off.
        tm = min(512, -(-M // 128) * 128)
        pad = lambda a: jnp.pad(a, ((0, -M % tm), (0, 0)))
        mm = lambda x, w: gmm(x, w, sizes_G, x.dtype, (tm, *(min(1024, n) for n in w.shape[1:])),
                              interpret=target_platform() != "tpu")
        return swiglu(pad(x_MD), w, cfg, mm, lambda b: pad(b[group_M]))[:M]
    tile = min(cfg.gmm_tile, M)
    dest_M, group_n, n = _tile_layout(sizes_G, M, tile)
    x_ntD = jnp.zeros((n * tile, D), x_MD.dtype).at[dest_M].set(x_MD, mode="drop")
    y_ntD = swiglu(x_ntD.reshape(n, tile, D), w, cfg,
                   lambda x, w: jnp.einsum("ntd,ndf->ntf", x, w[group_n]),
                   lambda b: b[group_n][:, None])
    return y_ntD.reshape(n * tile, -1).at[dest_M].get(mode="fill", fill_value=0)


def _inverse(perm):
    return jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))


def _dropless_exchange(x_AD, e_A, sizes_E, w, cfg: ModelConfig, peers: int, S: int):
    """Rows sorted by expert (so by peer: p holds experts p*X .. p*X+X-1) -> their experts on the
    peers of the expert axis -> back. XLA:CPU cannot run ragged_all_to_all (JAX 0.10, 0.12), so
    this sends each peer S rows, the most it can be owed (each token's min(X, k) choices there;
    MaxText sizes them alike): dropless at up to P times the exact exchange's traffic."""
    (A, D), X = x_AD.shape, cfg.n_experts // peers
    sizes_PX, r_S = sizes_E.reshape(peers, X), jnp.arange(S)
    send_P = jnp.sum(sizes_PX, axis=1)
    start_P = jnp.cumsum(send_P) - send_P
    valid_PS = r_S[None, :] < send_P[:, None]
    src_PS = jnp.minimum(start_P[:, None] + r_S[None, :], A - 1)
    send_PSD = jnp.where(valid_PS[..., None], x_AD[src_PS], 0).astype(x_AD.dtype)
    recv_PSD = jax.lax.all_to_all(send_PSD, "expert", 0, 0)       # [source peer, row, d]
    rsizes_PX = jax.lax.all_to_all(sizes_PX, "expert", 0, 0)      # [source peer, my expert]
    # Each peer's rows arrive sorted by (local) expert; merge them into one sorted run.
    local_PS = jax.vmap(lambda ends: jnp.searchsorted(ends, r_S, side="right"))(
        jnp.cumsum(rsizes_PX, axis=1))                             # X marks padding
    order_M = jnp.argsort(local_PS.reshape(-1), stable=True)
    y_MD = grouped_mlp(recv_PSD.reshape(peers * S, D)[order_M], jnp.sum(rsizes_PX, axis=0), w, cfg)
    back_PSD = jax.lax.all_to_all(y_MD[_inverse(order_M)].reshape(peers, S, D), "expert", 0, 0)
    # Sorted row a went to peer p = expert // X, at row a - start_P[p] of that peer's buffer.
    peer_A = e_A // X
    return back_PSD.reshape(peers * S, D)[peer_A * S + jnp.arange(A) - start_P[peer_A]]


def _capacity_exchange(x_AD, e_A, sizes_E, w, cfg: ModelConfig, peers: int, C: int):
    """Capacity mode: each expert's first C rows go into an [E, C, d] buffer (the rest are
    dropped), sent to the experts' peers and back. Returns (sorted rows' results, dropped)."""
    (A, D), E, X = x_AD.shape, cfg.n_experts, cfg.n_experts // peers
    rank_A = jnp.arange(A) - (jnp.cumsum(sizes_E) - sizes_E)[e_A]
    keep_A = rank_A < C
    slot_A = jnp.where(keep_A, e_A * C + rank_A, E * C)
    buf_ECD = jnp.zeros((E * C, D), x_AD.dtype).at[slot_A].set(x_AD, mode="drop")
    buf_PXCD = buf_ECD.reshape(peers, X, C, D)
    if peers > 1:
        buf_PXCD = jax.lax.all_to_all(buf_PXCD, "expert", 0, 0)  # now [source peer, X, C, d]
    x_XMD = buf_PXCD.transpose(1, 0, 2, 3).reshape(X, peers * C, D)
    y_XMD = swiglu(x_XMD, w, cfg, partial(jnp.einsum, "xmd,xdf->xmf"), lambda b: b[:, None])
    y_PXCD = y_XMD.reshape(X, peers, C, D).transpose(1, 0, 2, 3)
    if peers > 1:
        y_PXCD = jax.lax.all_to_all(y_PXCD, "expert", 0, 0)      # [expert's peer, X, C, d]
    y_AD = y_PXCD.reshape(E * C, D).at[slot_A].get(mode="fill", fill_value=0)
    return y_AD, A - jnp.sum(keep_A)


def experts(x_BTD, expert_BTR, gate_BTR, w: dict, cfg: ModelConfig, peers: int = 1,
            sharded: bool = False):
    """The experts' output for this device's tokens and how many assignments were dropped: in
    `shard_map` when sharded (a batch shard, X = E/P experts, F over tensor), else
    on everything at once. w: the layer's expert weights in x's dtype, named as in `swiglu`."""
    (B, T, D), dt = x_BTD.shape, x_BTD.dtype
    R, n = cfg.top_k, B * T
    if sharded:
        # FSDP: gather d of w_gate, w_up [X, D, F] and F (or d) of w_down [X, F, D] in the
        # compute dtype, half the traffic in bfloat16; autodiff makes it a reduce of gradients.
        w |= {k: jax.lax.all_gather(w[k], ("fsdp", "context"), axis=2 if k == "w_down" and (
            cfg.down_split == "d") else 1, tiled=True) for k in ("w_gate", "w_up", "w_down")}
        if "b_down" in w:  # the tensor shards' outputs are summed: the down bias joins one
            w["b_down"] = jnp.where(jax.lax.axis_index("tensor") == 0, w["b_down"], 0).astype(dt)
    # Assignments choice-major (a = r * n + token): within an expert the sort keeps every
    # first choice ahead of every second choice, so capacity mode drops second choices
    # first (GShard's priority), and dropless mode loses nothing by it.
    e_A = expert_BTR.reshape(n, R).T.reshape(-1)
    order_A = jnp.argsort(e_A, stable=True)
    x_AD, sorted_e_A = x_BTD.reshape(n, D)[order_A % n], e_A[order_A]
    gate_nR = gate_BTR.reshape(n, R).astype(dt)
    if cfg.score_inputs:  # Llama 4: the score scales what goes in; the outputs are summed
        x_AD, gate_nR = x_AD * gate_nR.T.reshape(-1)[order_A, None], jnp.ones_like(gate_nR)
    sizes_E = jnp.bincount(e_A, length=cfg.n_experts).astype(jnp.int32)
    dropped = jnp.zeros((), jnp.int32)
    if cfg.capacity_factor > 0:  # C rows per expert per batch shard: cf x the even share
        C = max(1, math.ceil(cfg.capacity_factor * n * R / cfg.n_experts))
        y_AD, dropped = _capacity_exchange(x_AD, sorted_e_A, sizes_E, w, cfg, peers, C)
    elif peers > 1:
        y_AD = _dropless_exchange(x_AD, sorted_e_A, sizes_E, w, cfg, peers,
                                  S=n * min(cfg.n_experts // peers, R))
    else:
        y_AD = grouped_mlp(x_AD, sizes_E, w, cfg)
    y_nD = jnp.einsum("rnd,nr->nd", y_AD[_inverse(order_A)].reshape(R, n, D), gate_nR,
                      preferred_element_type=jnp.float32)
    if sharded:
        y_nD = jax.lax.psum(y_nD, "tensor")   # each tensor shard summed over its slice of F
    return y_nD.astype(dt).reshape(B, T, D), dropped.reshape(1)


# ----------------------------------------------------------------------------------------------
# 6. Main and the training loop
# ----------------------------------------------------------------------------------------------
def main(cfg: Config) -> dict:
    hf_config, model = train.model_source(cfg)  # --init-from-hf's config, --init-from's model
    cfg = train.with_model(cfg, config_from_hf(*hf_config) if hf_config else model)
    train.start(cfg.quiet)
    devices = train.devices(cfg.compile_topology, cfg.compile_slices, cfg.dry_run)
    validate(cfg, len(devices), devices[0].platform)
    mesh, tc, m, pf = make_mesh(cfg.mesh, devices), cfg.train, cfg.model, devices[0].platform
    st = train_state(cfg, mesh)
    step_fn = st.jit(partial(train_step, cfg=cfg, tx=st.tx))
    check_kernel(m.attention, pf, tc.seq_len)
    H, V = ((m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim) if m.kv_lora_rank else
            (m.head_dim, m.head_dim))  # query and value head widths (MLA's differ)
    kernel = choose(m.attention, pf, dtype=m.dtype, T=tc.seq_len, sinks=m.attn_sinks, H=H, V=V,
                    context=(mesh.shape["context"], m.context_attention))
    drop = "dropless" if m.capacity_factor == 0 else f"capacity factor {m.capacity_factor}"
    log(f"model {count_params(m):,} parameters, {count_active_params(m):,} active ({m.n_experts} "
        f"experts, top-{m.top_k}, {drop}, {_grouped_impl(m, pf)} grouped matmul, {kernel} "
        f"attention; MFU counts active FLOPs) | mesh {describe(mesh)} | {len(devices)} {pf} "
        f"devices, {jax.process_count()} process(es)")
    pipe = train.pipeline_report(mesh, tc.pipeline_repeats, tc.microbatches, moe_layers(m), (
        "the embeddings" + f", the {m.first_k_dense} dense layers" * bool(m.first_k_dense) +
        " on every stage (all rows), the final norm, head and loss on 1/S of the rows each" +
        f", the {m.mtp_depth} MTP module(s) on every stage" * bool(m.mtp_depth)))
    # Random tokens for --dry-run and --bench: no data, no checkpoints.
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (tc.batch_size, tc.seq_len + 1),
                                               np.int32)
    if cfg.dry_run:
        return train.dry_run(step_fn, st.abstract(), train.put(tokens, mesh, MOE_BATCH, True),
                             mesh, count_params(m), active_params=count_active_params(m),
                             attention=kernel, grouped_matmul=_grouped_impl(m, pf), **pipe)
    with jax.set_mesh(mesh):
        if cfg.bench:
            return bench(cfg, mesh, train.put(tokens, mesh, MOE_BATCH))
        return train_loop(cfg, mesh, st, step_fn)


def train_loop(cfg: Config, mesh, st: train.TrainState, step_fn) -> dict:
    tc, mc, ds = cfg.train, cfg.model, load_dataset(cfg.data)
    if cfg.init_from_hf and (note := hf.check_tokenizer(
            cfg.init_from_hf, ds.tokenizer_path, f"--data.path {cfg.data.path!r}")):
        log(note)
    train.check_vocab(ds.vocab_size, mc.vocab_size)
    batch = partial(get_batch, batch_size=tc.batch_size, seq_len=tc.seq_len,
                    sharding=named(mesh, P(MOE_BATCH, None)))
    eval_fn = jax.jit(lambda params, b: loss_fn(params, b, mc, tc)[1]["ce"])  # held-out ce
    weights = lambda s: with_buffers(train.weights(s, cfg.lora), s.get("buffers", {}))
    tasks = DuringTraining(tc, mc, forward, mesh, ds.tokenizer_path)  # --train.eval-tasks

    def evaluate(params) -> dict:
        held_out = (batch(ds.eval, seed=cfg.data.seed + 1, step=i) for i in range(tc.eval_batches))
        loss = float(np.mean(jax.device_get([eval_fn(params, b) for b in held_out])))
        log(f"eval step {loop.step} | eval_loss {loss:.3f}")
        return {"eval_loss": loss} | tasks(params, loop.step)

    def show(r: dict) -> str:
        drop = f" | dropped {100 * r['dropped']:.1f}%" if mc.capacity_factor > 0 else ""
        return (f"loss {r['loss']:.3f} | " + (f"indexer_kl {r['indexer_kl']:.3f} | " if
                                               "indexer_kl" in r else "") + f"aux {r['aux_loss']:.3f} | router_z "
                f"{r['router_z']:.2f} | load {min(r['load_min']):.3f}-{max(r['load_max']):.3f}"
                f"{drop} | lr {r['lr']:.1e} | grad_norm {r['grad_norm']:.2f}" + (
                    f" | max_logit {r['max_attn_logit']:.1f}" if tc.qk_clip_threshold else "") + (
                    f" | mtp {r['mtp_loss']:.3f}" if mc.mtp_depth else ""))

    with train.Run(cfg, tc.profile_steps, defaults=Config()) as run:
        state, start = run.resume(st.abstract())
        if state is None and cfg.init_from_hf:  # the router biases come with the weights
            weights_and_biases = load_hf(cfg.init_from_hf, mesh)[1]
            state = st.from_params(*train.split(weights_and_biases, _buffer_table(mc)))
        elif state is None:
            state = st.fresh(jax.random.key(tc.seed))
        loop = train.Loop(run, start, tc.steps, log_every=tc.log_every,
                          eval_every=tc.eval_every, tokens_per_step=tc.batch_size * tc.seq_len,
                          flops_per_token=flops_per_token(mc, tc.seq_len),
                          peak_tflops=tc.peak_tflops, show=show, max_bad_steps=tc.max_bad_steps)
        next_batch = partial(batch, ds.train, seed=cfg.data.seed)
        step_fn = loop.compile(step_fn, state, next_batch(step=start))
        for step in loop:
            state, metrics = step_fn(state, next_batch(step=step))
            loop.log(metrics)
            if loop.eval_due:
                loop.eval(evaluate(weights(state)))
            loop.checkpoint(state)
        run.ckpt.wait()
        if tc.sample_tokens > 0:  # one prompt: this forward has no segments to left-pad with
            prompt, params = ds.encode(tc.sample_prompt), weights(state)
            buf, _, _, width = train.prompt_rows(
                [prompt], tc.sample_tokens, min(tc.seq_len, mc.max_seq_len), mesh, MOE_BATCH)

            @jax.jit
            def decode(params, buf, key):  # every new token in one program
                def one(i, carry):
                    return train.next_token(forward(params, carry[0], mc), *carry, i,
                                            temperature=tc.temperature, n_valid=ds.vocab_size)
                return jax.lax.fori_loop(width, width + tc.sample_tokens, one, (buf, key))[0]
            new = train.completions(decode(params, buf, jax.random.key(tc.seed + 7)), 1, width)
            log("sample:\n" + ds.decode(prompt + new[0]))
        r = ([r for r in run.metrics_log.records if "load_max" in r] or [None])[-1]
        routing = r and (f"expert shares {min(r['load_min']):.3f}-{max(r['load_max']):.3f} "
                         f"(even: {1 / mc.n_experts:.3f}) | aux loss {r['aux_loss']:.3f} | "
                         f"router z {r['router_z']:.2f} (last logged step)") or "-"
        return loop.summary(int(jax.device_get(state["step"])), f"{tc.batch_size} x {tc.seq_len}",
                            [("routing", routing)]) | {"state": state}


def bench(cfg: Config, mesh, batch) -> dict:
    """Median step time over --bench steps on random tokens of the MoE model and (--bench-twin) its
    dense twin, each MoE block one SwiGLU top_k x d_ff wide (the same active matmul FLOPs without
    routing, sorting or exchanges); their cost ratio per active FLOP is the price of dispatch."""
    tc, report, m = cfg.train, {}, cfg.model
    twin = dataclasses.replace(cfg, model=dataclasses.replace(m, n_experts=1, top_k=1, n_group=0,
                               d_ff=m.top_k * m.d_ff, capacity_factor=0.0, topk_group=0))
    peak = train.peak_flops_per_device(tc.peak_tflops)
    for what, c in [("moe", cfg)] + ([("dense", twin)] if cfg.bench_twin else []):
        log(f"bench {what} | {count_active_params(c.model) / 1e6:.2f}M active parameters; "
            "MFU on active FLOPs")
        st = train_state(c, mesh)
        report[what] = train.bench(
            st.jit(partial(train_step, cfg=c, tx=st.tx)), st.fresh(jax.random.key(tc.seed)),
            batch, cfg.bench, tokens_per_step=tc.batch_size * tc.seq_len,
            flops_per_token=flops_per_token(c.model, tc.seq_len), peak=peak, what=" " + what)
    if cfg.bench_twin:
        report["cost_ratio"] = report["dense"]["mfu"] / report["moe"]["mfu"]
        log(f"bench | the MoE step costs {report['cost_ratio']:.2f}x the dense step per "
            f"active FLOP")
    return report


# ----------------------------------------------------------------------------------------------
# 7. HuggingFace in and out
# ----------------------------------------------------------------------------------------------

# As in train_dense.py: HF rotates the two halves of each head, as `apply_rope` does, so no
# weight is permuted (DeepSeek's pairs: rope_interleave). The experts are stored one tensor
# per expert and per layer.
HF_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "gpt_oss": "GptOssForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                    "kimi_k2": "DeepseekV3ForCausalLM",  # Kimi K2: DeepSeek-V3's, renamed
                    "deepseek_v2": "DeepseekV2ForCausalLM",
                    "llama4_text": "Llama4ForCausalLM", "gemma4_text": "Gemma4ForCausalLM",
                    "deepseek_v32": "DeepseekV32ForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",  # Qwen3.5 (its language model)
                    "deepseek_v4": "DeepseekV4ForCausalLM"}
HF_DEEPSEEK = ("deepseek_v3", "kimi_k2", "deepseek_v2", "deepseek_v32")
HF_QWEN_NEXT = ("qwen3_next", "qwen3_5_moe_text")  # Qwen3.5: 3-Next's block, other names
# What transformers assumes for a key that config.json leaves out (its config classes).
_HF_DEFAULTS = {
    "mixtral": dict(rms_norm_eps=1e-5, max_position_embeddings=131072, num_key_value_heads=8,
                    rope_theta=1_000_000.0, num_local_experts=8, num_experts_per_tok=2),
    "qwen3_moe": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=4,
                      rope_theta=10_000.0, num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768, norm_topk_prob=False),
    "gpt_oss": dict(rms_norm_eps=1e-5, max_position_embeddings=131072, num_key_value_heads=8,
                    num_local_experts=128, num_experts_per_tok=4, head_dim=64, sliding_window=128,
                    attention_bias=True, swiglu_limit=7.0, swiglu_alpha=SWIGLU_ALPHA,
                    rope_theta=150_000.0, rope_scaling=dict(rope_type="yarn", factor=32.0,
                    truncate=False, original_max_position_embeddings=4096)),
    "deepseek_v3": dict(rms_norm_eps=1e-6, max_position_embeddings=4096, rope_theta=10_000.0,
                        num_attention_heads=128, intermediate_size=18432, n_routed_experts=256,
                        moe_intermediate_size=2048, num_experts_per_tok=8, n_shared_experts=1,
                        routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
                        topk_group=4, first_k_dense_replace=3, norm_topk_prob=True,
                        rope_interleave=True),
    "deepseek_v2": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10_000.0,
                        num_attention_heads=32, intermediate_size=11008, n_routed_experts=64,
                        moe_intermediate_size=1407, n_shared_experts=2, routed_scaling_factor=1.0,
                        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
                        qk_nope_head_dim=128, first_k_dense_replace=0, topk_method="greedy"),
    "llama4_text": dict(rms_norm_eps=1e-5, max_position_embeddings=131072, num_key_value_heads=8,
                        head_dim=128, num_local_experts=16, num_experts_per_tok=1,
                        intermediate_size=8192, intermediate_size_mlp=16384, use_qk_norm=True,
                        interleave_moe_layer_step=1, no_rope_layer_interval=4,
                        attention_chunk_size=8192, attn_temperature_tuning=True, floor_scale=8192,
                        attn_scale=0.1, rope_theta=500_000.0),
    "gemma4_text": dict(rms_norm_eps=1e-6, max_position_embeddings=131072, head_dim=256,
                        num_key_value_heads=4, sliding_window=512, global_head_dim=512,
                        intermediate_size=9216, hidden_size_per_layer_input=256),
    "qwen3_next": dict(rms_norm_eps=1e-6, max_position_embeddings=32768, num_key_value_heads=2,
                       head_dim=256, num_experts=512, num_experts_per_tok=10,
                       moe_intermediate_size=512, shared_expert_intermediate_size=512,
                       norm_topk_prob=True, linear_num_key_heads=16, linear_num_value_heads=32,
                       linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_conv_kernel_dim=4)}
_HF_DEFAULTS["qwen3_5_moe_text"] = _HF_DEFAULTS["qwen3_next"] | dict(num_experts=256,
                                                                       num_experts_per_tok=8)
# DeepSeek-V3.2: V3's with the indexer; its MLA always rotates pairs (no rope_interleave key).
_HF_DEFAULTS["deepseek_v32"] = _HF_DEFAULTS["deepseek_v3"] | dict(
    max_position_embeddings=163840, index_n_heads=64, index_head_dim=128, index_topk=2048)
# config.json's keys that are our fields, in every family and then per family (Kimi K2's: V3's),
# written as they are, read as the field's type (null as 0); config_*_hf spell out the rest.
_HF_FIELDS = dict(vocab_size="vocab_size", hidden_size="d_model", num_hidden_layers="n_layers",
                  num_attention_heads="n_heads", num_key_value_heads="n_kv_heads",
                  head_dim="head_dim", max_position_embeddings="max_seq_len",
                  rms_norm_eps="norm_eps", tie_word_embeddings="tie_embeddings",
                  num_experts_per_tok="top_k")
_HF_FAMILY_FIELDS = {
    "mixtral": dict(num_local_experts="n_experts", intermediate_size="d_ff"),
    "qwen3_moe": dict(num_local_experts="n_experts", num_experts="n_experts",
                      moe_intermediate_size="d_ff", norm_topk_prob="norm_topk"),
    "gpt_oss": dict(num_local_experts="n_experts", intermediate_size="d_ff",
                    attention_bias="attn_bias", swiglu_limit="swiglu_limit"),
    "deepseek_v3": dict(n_routed_experts="n_experts", moe_intermediate_size="d_ff",
                        norm_topk_prob="norm_topk", routed_scaling_factor="routed_scale",
                        first_k_dense_replace="first_k_dense",
                        num_nextn_predict_layers="mtp_depth") | {k: k for k in (
        "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "rope_interleave", "n_shared_experts", "seq_aux")},
    "deepseek_v2": dict(n_routed_experts="n_experts", moe_intermediate_size="d_ff",
                        routed_scaling_factor="routed_scale", first_k_dense_replace="first_k_dense")
    | {k: k for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                      "v_head_dim", "n_shared_experts", "seq_aux")},
    "llama4_text": dict(num_local_experts="n_experts", intermediate_size="d_ff",
                        interleave_moe_layer_step="moe_every", use_qk_norm="qk_l2_norm",
                        attention_chunk_size="attn_chunk", floor_scale="attn_temp_floor"),
    "gemma4_text": dict(num_experts="n_experts", top_k_experts="top_k", sliding_window=
                        "sliding_window", moe_intermediate_size="d_ff", intermediate_size=
                        "dense_d_ff", attention_k_eq_v="k_eq_v", final_logit_softcapping=
                        "final_softcap", tie_word_embeddings="tie_embeddings"),
    "qwen3_next": dict(num_experts="n_experts", moe_intermediate_size="d_ff", norm_topk_prob=
                       "norm_topk", linear_num_key_heads="linear_k_heads", linear_num_value_heads=
                       "linear_v_heads", linear_key_head_dim="linear_k_dim", linear_value_head_dim=
                       "linear_v_dim", linear_conv_kernel_dim="linear_conv")}
_HF_FAMILY_FIELDS["qwen3_5_moe_text"] = {  # it always renormalises the top k
    k: f for k, f in _HF_FAMILY_FIELDS["qwen3_next"].items() if k != "norm_topk_prob"}
_HF_FAMILY_FIELDS["deepseek_v32"] = {k: f for k, f in _HF_FAMILY_FIELDS["deepseek_v3"].items() if
                                     k != "rope_interleave"} | {k: k for k in (
    "index_n_heads", "index_head_dim", "index_topk")}
# What we write for what we do not implement, per family; reading refuses other values of
# the keys that change the model (`config_from_hf`).
_HF_CONSTANTS = {"mixtral": dict(router_jitter_noise=0.0),
                 "qwen3_moe": dict(decoder_sparse_step=1, mlp_only_layers=[],
                                   use_sliding_window=False, attention_bias=False),
                 "gpt_oss": dict(swiglu_alpha=SWIGLU_ALPHA),
                 "deepseek_v3": dict(scoring_func="sigmoid", topk_method="noaux_tc",
                                     attention_bias=False),
                 "deepseek_v2": dict(scoring_func="softmax", attention_bias=False, mlp_bias=False,
                                     norm_topk_prob=False),
                 "llama4_text": dict(router_jitter_noise=0.0, attention_bias=False),
                 "gemma4_text": dict(enable_moe_block=True, hidden_size_per_layer_input=0,
                                     hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                                     vocab_size_per_layer_input=262144, num_kv_shared_layers=0,
                                     use_double_wide_mlp=False, use_bidirectional_attention=None)}
_HF_CONSTANTS["deepseek_v32"] = _HF_CONSTANTS["deepseek_v3"]
_HF_CONSTANTS["qwen3_next"] = dict(decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False)
_HF_CONSTANTS["qwen3_5_moe_text"] = dict(attention_bias=False)
# The knobs some families' config.json says and no other's: on exactly in those families, or
# (the second table) on only in those. Mixtral and GPT-OSS always renormalise the top k.
_HF_OWN = dict(attn_sinks=("gpt_oss",), moe_bias=("gpt_oss",), swiglu_limit=("gpt_oss",),
               sigmoid_routing=("deepseek_v3", "llama4_text", "deepseek_v32"),
               score_inputs=("llama4_text",), gemma4=("gemma4_text",),
               global_head_dim=("gemma4_text",), index_n_heads=("deepseek_v32",),
               **dict.fromkeys(("linear_k_heads", "attn_gate", "norm_offset", "shared_gated"),
                               ("qwen3_next",)))
_HF_ONLY = dict(attn_bias=("gpt_oss",), sliding_window=("gpt_oss", "gemma4_text"),
                n_shared_experts=("deepseek_v3", "deepseek_v2", "llama4_text", "deepseek_v32",
                                  "qwen3_next"), rotary_dim=("qwen3_next",),
                first_k_dense=("deepseek_v3", "deepseek_v2", "deepseek_v32"), mtp_depth=("deepseek_v3",),
                yarn_factor=("gpt_oss", "deepseek_v3", "deepseek_v2", "deepseek_v32"),
                **dict.fromkeys((
                    "attn_chunk", "global_nope", "attn_temp_scale", "qk_l2_norm", "rope_scaling"),
                    ("llama4_text",)), **dict.fromkeys(("rope_local_theta", "global_kv_heads",
                    "k_eq_v", "rope_partial", "final_softcap"), ("gemma4_text",)))

# Each weight's HuggingFace name (after model.layers.{i}. for a layer's) and layout (common/hf.py;
# a stack's layer axis goes first on our side), in the atoms of `_hf_sizes`: l the MoE layers, j
# DeepSeek's dense ones before them. kv_b_proj holds each head's nope key then its value, as wkv_b.
_HF_TOP = {"embed": ("model.embed_tokens.weight", "v d -> v d"),
           "final_norm": ("model.norm.weight", "d -> d"),
           "unembed": ("lm_head.weight", "v d -> d v")}
_HF_LAYER = {"attn_norm": ("input_layernorm.weight", "d -> d"),
             "mlp_norm": ("post_attention_layernorm.weight", "d -> d")} | {
    k: ("self_attn." + name, layout) for k, (name, layout) in dict(
        wq=("q_proj.weight", "(n h) d -> d n h"), wk=("k_proj.weight", "(k h) d -> d k h"),
        wv=("v_proj.weight", "(k h) d -> d k h"), wo=("o_proj.weight", "d (n h) -> n h d"),
        bq=("q_proj.bias", "(n h) -> n h"), bk=("k_proj.bias", "(k h) -> k h"),
        bv=("v_proj.bias", "(k h) -> k h"), bo=("o_proj.bias", "d -> d"),
        q_norm=("q_norm.weight", "h -> h"), k_norm=("k_norm.weight", "h -> h"),
        sinks=("sinks", "n -> n"), wkv_a=("kv_a_proj_with_mqa.weight", "a d -> d a"),
        kv_norm=("kv_a_layernorm.weight", "c -> c"), wkv_b=("kv_b_proj.weight", "(n x) c -> c n x"),
        wq_a=("q_a_proj.weight", "r d -> d r"), q_norm_a=("q_a_layernorm.weight", "r -> r"),
        wq_b=("q_b_proj.weight", "(n q) r -> r n q"),  # DSA's indexer: m heads i wide
        idx_wq=("indexer.wq_b.weight", "(m i) r -> r m i"),
        idx_wk=("indexer.wk.weight", "i d -> d i"), idx_w=("indexer.weights_proj.weight",
                                                           "m d -> d m"),
        idx_k_norm=("indexer.k_norm.weight", "i -> i"),
        idx_k_bias=("indexer.k_norm.bias", "i -> i")).items()} | {
    k: ("mlp." + name, layout) for k, (name, layout) in dict(
        mlp_gate=("gate_proj.weight", "g d -> d g"), mlp_up=("up_proj.weight", "g d -> d g"),
        mlp_down=("down_proj.weight", "d g -> g d"), w_router=("gate.weight", "e d -> d e"),
        shared_gate=("shared_experts.gate_proj.weight", "s d -> d s"),
        shared_up=("shared_experts.up_proj.weight", "s d -> d s"),
        shared_down=("shared_experts.down_proj.weight", "d s -> s d"),
        router_bias=("gate.e_score_correction_bias", "e -> e"),  # a buffer of ours
        w_gate=("experts.{e}.gate_proj.weight", "f d -> e d f"),
        w_up=("experts.{e}.up_proj.weight", "f d -> e d f"),
        w_down=("experts.{e}.down_proj.weight", "d f -> e f d")).items()}
_HF_MLA = {"wq": ("self_attn.q_proj.weight", "(n q) d -> d n q"),
           "wo": ("self_attn.o_proj.weight", "d (n w) -> n w d")}
MTP_COPIES = (".embed_tokens.weight", ".shared_head.head.weight")  # `save_hf` writes, as released
# GPT-OSS stores each layer's experts as one tensor, [in, out], gate and up interleaved
# (gate_up_proj[..., 0::2] is the gate); MXFP4 checkpoints read as that too (common/hf.py).
_HF_FAMILY_NAMES = {
    "mixtral": {"w_router": ("block_sparse_moe.gate.weight", "e d -> d e"),
                "w_gate": ("block_sparse_moe.experts.{e}.w1.weight", "f d -> e d f"),
                "w_up": ("block_sparse_moe.experts.{e}.w3.weight", "f d -> e d f"),
                "w_down": ("block_sparse_moe.experts.{e}.w2.weight", "d f -> e f d")},
    "gpt_oss": {"w_router": ("mlp.router.weight", "e d -> d e"),
                "b_router": ("mlp.router.bias", "e -> e"),
                "w_gate": ("mlp.experts.gate_up_proj", "e d (f 2:0) -> e d f"),
                "w_up": ("mlp.experts.gate_up_proj", "e d (f 2:1) -> e d f"),
                "w_down": ("mlp.experts.down_proj", "e f d -> e f d"),
                "b_gate": ("mlp.experts.gate_up_proj_bias", "e (f 2:0) -> e f"),
                "b_up": ("mlp.experts.gate_up_proj_bias", "e (f 2:1) -> e f"),
                "b_down": ("mlp.experts.down_proj_bias", "e d -> e d")},
    # Llama 4: gate and up in halves of one tensor per layer; dense layers under the same name.
    "llama4_text": {k: ("feed_forward." + name, layout) for k, (name, layout) in dict(
        w_router=("router.weight", "e d -> d e"),
        w_gate=("experts.gate_up_proj", "e d (2:0 f) -> e d f"),
        w_up=("experts.gate_up_proj", "e d (2:1 f) -> e d f"),
        w_down=("experts.down_proj", "e f d -> e f d"),
        shared_gate=("shared_expert.gate_proj.weight", "s d -> d s"),
        shared_up=("shared_expert.up_proj.weight", "s d -> d s"),
        shared_down=("shared_expert.down_proj.weight", "d s -> s d"),
        mlp_gate=("gate_proj.weight", "g d -> d g"), mlp_up=("up_proj.weight", "g d -> d g"),
        mlp_down=("down_proj.weight", "d g -> g d")).items()},
    # Gemma 4: norms around its two MLPs (dense_*, moe_*), gate and up in halves of [e, 2f, d]
    "gemma4_text": {k: (n + ".weight" * ("norm" in k), "d -> d") for k, n in dict(
        mlp_norm="pre_feedforward_layernorm", attn_post_norm="post_attention_layernorm",
        dense_post_norm="post_feedforward_layernorm_1", moe_norm="pre_feedforward_layernorm_2",
        moe_post_norm="post_feedforward_layernorm_2", mlp_post_norm="post_feedforward_layernorm",
        router_scale="router.scale").items()} | dict(
        w_router=("router.proj.weight", "e d -> d e"), layer_scale=("layer_scalar", "o -> o"),
        expert_scale=("router.per_expert_scale", "e -> e"),
        w_gate=("experts.gate_up_proj", "e (2:0 f) d -> e d f"),
        w_up=("experts.gate_up_proj", "e (2:1 f) d -> e d f"),
        w_down=("experts.down_proj", "e d f -> e f d")),
    # Qwen3-Next: the query and its gate interleaved per head; DeltaNet's fused projections,
    # per key head (lk) its q, k (lq wide), its group's (lr value heads) v and z, then b and a;
    # the conv's channels (lx) every q, k, v, its taps (lw); Hv value heads (lv) Dv wide (ly)
    "qwen3_next": {k: ("self_attn.q_proj.weight", f"(n 2:{i} h) d -> d n h") for i, k in enumerate(
        ("wq", "wq_gate"))} | {k: ("mlp." + name, layout) for k, (name, layout) in dict(
            shared_gate=("shared_expert.gate_proj.weight", "s d -> d s"),
            shared_up=("shared_expert.up_proj.weight", "s d -> d s"),
            shared_down=("shared_expert.down_proj.weight", "d s -> s d"),
            shared_router=("shared_expert_gate.weight", "o d -> d o")).items()} | {
        k: ("linear_attn." + name, layout) for k, (name, layout) in dict(
            lin_conv=("conv1d.weight", "lx o lw -> lw o lx"), A_log=("A_log", "lv -> lv"),
            dt_bias=("dt_bias", "lv -> lv"), lin_norm=("norm.weight", "ly -> ly"), lin_wo=(
                "out_proj.weight", "d (lv ly) -> lv ly d")).items()} | {
        f"lin_{x}": ("linear_attn.in_proj_qkvz.weight", f"(lk [lq|lq|lr ly|lr ly]:{i}) d -> d lk "
                     + ("lq" if i < 2 else "lr ly")) for i, x in enumerate("qkvz")} | {
        f"lin_{x}": ("linear_attn.in_proj_ba.weight", f"(lk 2:{i} lr) d -> d lk lr")
        for i, x in enumerate("ba")}}
# Qwen3.5: DeltaNet's projections one after another over all heads (q, k, v in one tensor); the
# experts, as released, in two tensors per layer (transformers writes them one by one, as ours).
_HF_FAMILY_NAMES["qwen3_5_moe_text"] = _HF_FAMILY_NAMES["qwen3_next"] | {
    f"lin_{x}": ("linear_attn.in_proj_qkv.weight", f"([lk lq|lk lq|lk lr ly]:{i}) d -> d lk "
                 + ("lq" if i < 2 else "lr ly")) for i, x in enumerate("qkv")} | {
    k: ("linear_attn." + name, layout) for k, (name, layout) in dict(
        lin_z=("in_proj_z.weight", "(lk lr ly) d -> d lk lr ly"),
        lin_b=("in_proj_b.weight", "(lk lr) d -> d lk lr"),
        lin_a=("in_proj_a.weight", "(lk lr) d -> d lk lr")).items()}
_HF_FUSED = {k: ("mlp.experts." + n, l) for k, (n, l) in dict(
    w_gate=("gate_up_proj", "e (2:0 f) d -> e d f"), w_up=("gate_up_proj", "e (2:1 f) d -> e d f"),
    w_down=("down_proj", "e d f -> e f d")).items()}


# ---- DeepSeek-V4 (deepseek_v4): its config.json and names, apart from the tables above (to join
# them at merge). transformers writes per-layer `layer_types` and `mlp_layer_types` and RoPE per
# kind ("main": the window layers', "compress": YaRN); the release says compress_ratios,
# num_hash_layers, rope_scaling and qk_rope_head_dim.
_HF_V4_FIELDS = dict(n_routed_experts="n_experts", moe_intermediate_size="d_ff",
                     norm_topk_prob="norm_topk", routed_scaling_factor="routed_scale") | {
    k: k for k in ("q_lora_rank", "n_shared_experts", "index_n_heads", "index_head_dim",
                   "index_topk", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "o_groups", "o_lora_rank",
                   "compress_rope_theta", "sliding_window", "swiglu_limit")}
_HF_V4_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
# Names under model.layers.{i}. as transformers writes them (the release's, which lacks "model.");
# W, R, C the compressor's width, rate and norm (`_hf_v4_mapping`)
_HF_V4 = {k: ("attn." + n, lay) for k, (n, lay) in dict(
    wq_a=("wq_a.weight", "r d -> d r"), q_norm_a=("q_norm.weight", "r -> r"),
    wq_b=("wq_b.weight", "(n h) r -> r n h"), wkv=("wkv.weight", "h d -> d h"),
    kv_norm=("norm.weight", "h -> h"), sinks=("attn_sink", "n -> n"),
    wo_a=("wo_a.weight", "(og or) oc -> og oc or"), wo_b=("wo_b.weight", "d ow -> ow d"),
    idx_wq=("indexer.wq_b.weight", "(m i) r -> r m i"),
    idx_w=("indexer.weights_proj.weight", "m d -> d m")).items()} | {
    f"{p}_{n}": (f"attn.{q}compressor.{m}", lay) for p, q in (("cmp", ""), ("idx", "indexer."))
    for n, m, lay in (("wkv", "wkv.weight", "W d -> d W"), ("wgate", "wgate.weight", "W d -> d W"),
                      ("bias", "ape", "R W -> R W"), ("norm", "norm.weight", "C -> C"))} | {
    f"hc_{k}_{n}": (f"hc_{k}_{n}", lay) for k in ("attn", "ffn") for n, lay in dict(
        fn="hk hd -> hd hk", base="hk -> hk", scale="o3 -> o3").items()} | {
    k: ("ffn." + n, lay) for k, (n, lay) in dict(
        w_router=("gate.weight", "e d -> d e"), router_bias=("gate.bias", "e -> e"),
        tid2eid=("gate.tid2eid", "v kr -> v kr"), **{f"{p}_{n}": (f"{q}.{w}.weight", lay) for p, q, lay3 in (
            ("w", "experts.{e}", ("f d -> e d f", "d f -> e f d")),
            ("shared", "shared_experts", ("s d -> d s", "d s -> s d")))
            for n, w, lay in (("gate", "w1", lay3[0]), ("up", "w3", lay3[0]),
                              ("down", "w2", lay3[1]))}).items()} | dict(
    attn_norm=("attn_norm.weight", "d -> d"), mlp_norm=("ffn_norm.weight", "d -> d"))


def _hf_v4_mapping(cfg: ModelConfig) -> dict:
    """`hf_mapping` for deepseek_v4: each stack's layers as `a*i + b` (the release's pattern)."""
    kind_L, names = v4_kinds(cfg)[0], _HF_V4

    def at(k, atom):
        pos = np.flatnonzero(kind_L == k)
        a = int(pos[1] - pos[0]) if len(pos) > 1 else 1
        if not np.array_equal(pos, pos[0] + a * np.arange(len(pos))):
            raise hf.HFError(f"compress_ratios {cfg.compress_ratios}: the layers of each kind must"
                             " be evenly spaced for a deepseek_v4 folder.")
        return atom, f"{{{atom}*{a}+{pos[0]}}}"
    stacks = {"layers": ("l", f"{{l+{cfg.n_hash_layers}}}"), "hash_layers": ("y", "{y}"),
              "csa": at(1, "ca"), "hca": at(2, "ha")}
    sub = {"csa": dict(W="c2", R="rc"), "hca": dict(W="h", R="rh")}
    lay = lambda k, w: " ".join({"C": "i" if w.startswith("idx") else "h", "W": "i2" if w.startswith(
        "idx") else sub.get(k, {}).get("W"), "R": sub.get(k, {}).get("R")}.get(t, t) for t in
                                names[w][1].split())
    top = _HF_TOP | {"unembed": ("head.weight", "v d -> d v")} | {k: (
        f"model.hc_head.hc_{k[8:]}", lay) for k, lay in dict(
        hc_head_fn="hn hd -> hd hn", hc_head_base="hn -> hn", hc_head_scale="o -> o").items()}
    return {k: {w: (f"model.layers.{stacks[k][1]}.{names[w][0]}", lay(k, w).replace(
        "-> ", f"-> {stacks[k][0]} ")) for w in v} if k in stacks else top[k]
            for k, v in _hf_table(cfg).items()}


def _v4_from_hf(c: dict, where: str) -> ModelConfig:
    bad = lambda what: hf.HFError(f"{where}: {what} is not implemented by train_moe.py, so this "
                                  "deepseek_v4 model cannot be loaded faithfully.")
    if lacking := [k for k in (*_HF_FIELDS, *_HF_V4_FIELDS, "scoring_func") if k not in c]:
        raise hf.HFError(f"{where} has no {lacking[0]!r}; it is not a complete deepseek_v4 config.")
    L, H, rates = c["num_hidden_layers"], c["head_dim"], c.get("compress_rates") or {}
    csa, hca = (rates.get(k, c.get(f"compress_rate_{a}", r)) for k, a, r in zip(
        _HF_V4_KINDS[1:], ("csa", "hca"), (4, 128)))
    kinds = c.get("layer_types") or [_HF_V4_KINDS[(0, csa).index(r) if r in (0, csa) else 2]
                                     for r in c.get("compress_ratios") or []][:L] or (
        [_HF_V4_KINDS[2]] * min(L, 2) + [_HF_V4_KINDS[1 + (i % 2 == 0)] for i in range(L - 2)])
    Lh = c.get("num_hash_layers", 3)
    mlp = c.get("mlp_layer_types") or ["hash_moe"] * min(L, Lh) + ["moe"] * max(L - Lh, 0)
    Lh = mlp.count("hash_moe")
    rp = c.get("rope_parameters") or {}
    main, comp = rp.get("main") or {"rope_theta": c["rope_theta"]}, rp.get("compress") or dict(
        c.get("rope_scaling") or {}, rope_theta=c["compress_rope_theta"])
    part = main.get("partial_rotary_factor") or c.get("partial_rotary_factor") or c.get(
        "qk_rope_head_dim", 64) / H
    yarn = (comp.get("rope_type") or comp.get("type")) == "yarn"
    for what, wrong in ((f"mlp_layer_types {mlp} (hash layers first)", mlp != ["hash_moe"] * Lh + [
            "moe"] * (L - Lh)), (f"scoring_func {c['scoring_func']!r}", c["scoring_func"] not in (
            "sqrtsoftplus", "sigmoid")), (f"{c['num_key_value_heads']} key/value heads", c[
            "num_key_value_heads"] != 1), ("biases on the projections", c.get("attention_bias") or c.get(
            "mlp_bias")), (f"hidden_act {c.get('hidden_act')!r}", c.get("hidden_act", "silu") != "silu"),
            (f"rope {main} on the window layers", main.get("rope_type", "default") != "default"),
            (f"rope {comp} on the compressed ones", comp.get("attention_factor", 1.0) != 1.0 or
             not yarn and comp.get("rope_type", comp.get("type", "default")) != "default")):
        if wrong:
            raise bad(what)
    m = {f: type(getattr(ModelConfig, f))(c[k]) for k, f in (_HF_FIELDS | _HF_V4_FIELDS).items()}
    m |= dict(compress_ratios=tuple((0, csa, hca)[_HF_V4_KINDS.index(k)] for k in kinds),
              csa_ratio=csa, n_hash_layers=Lh, rotary_dim=int(H * part), rope_theta=float(
                  main["rope_theta"]), compress_rope_theta=float(comp["rope_theta"]),
              sigmoid_routing=True, sqrt_softplus=c["scoring_func"] == "sqrtsoftplus",
              attn_sinks=True)
    if yarn:
        m |= dict(yarn_factor=float(comp["factor"]), yarn_beta_fast=float(comp.get("beta_fast", 32)),
                  yarn_beta_slow=float(comp.get("beta_slow", 1)), yarn_truncate=bool(comp.get(
                      "truncate", True)), yarn_original_max_len=int(comp[
                          "original_max_position_embeddings"]))
    return ModelConfig(**m)


def _v4_to_hf(cfg: ModelConfig, dtype: str) -> dict:
    kind_L, _, _, hca = v4_kinds(cfg)
    L, Lh, part = cfg.n_layers, cfg.n_hash_layers, cfg.rotary_dim / cfg.head_dim
    main = dict(rope_type="default", rope_theta=cfg.rope_theta, partial_rotary_factor=part)
    comp = main | dict(rope_theta=cfg.compress_rope_theta) | (dict(
        rope_type="yarn", factor=cfg.yarn_factor, beta_fast=cfg.yarn_beta_fast, beta_slow=
        cfg.yarn_beta_slow, original_max_position_embeddings=cfg.yarn_original_max_len,
        attention_factor=1.0, truncate=cfg.yarn_truncate) if cfg.yarn_factor else {})
    return dict(architectures=[HF_ARCHITECTURES["deepseek_v4"]], model_type="deepseek_v4") | {
        k: getattr(cfg, f) for k, f in (_HF_FIELDS | _HF_V4_FIELDS).items()} | dict(
        layer_types=[_HF_V4_KINDS[k] for k in kind_L], compress_rates={
            _HF_V4_KINDS[1]: cfg.csa_ratio, _HF_V4_KINDS[2]: hca or 128},
        mlp_layer_types=["hash_moe"] * Lh + ["moe"] * (L - Lh), rope_theta=cfg.rope_theta,
        rope_parameters=dict(main=main, compress=comp), partial_rotary_factor=part,
        scoring_func="sqrtsoftplus" if cfg.sqrt_softplus else "sigmoid", hidden_act="silu",
        num_nextn_predict_layers=0, dtype=dtype, torch_dtype=dtype)
# ---- end of DeepSeek-V4's HF block


def hf_mapping(cfg: ModelConfig, model_type: str, fused: bool = False) -> dict:
    """Our parameter tree (the buffers too), each leaf as (HuggingFace tensor name, layout);
    `fused`: the experts of a layer in two tensors, as transformers 5 holds them."""
    if cfg.hc_mult:
        return _hf_v4_mapping(cfg)
    names = (_HF_LAYER | (_HF_FUSED if fused else {}) | (_HF_MLA if cfg.kv_lora_rank else {}) |
             _HF_FAMILY_NAMES.get(model_type, {}))
    stacks = ({"layers": ("l", "{l*2+1}"), "dense_layers": ("j", "{j*2}")} if cfg.moe_every == 2
              else {"layers": ("l", f"{{l+{cfg.first_k_dense}}}"), "dense_layers": ("j", "{j}")})
    if n := (cfg.global_head_dim or cfg.linear_k_heads) and cfg.global_every:  # Gemma 4's,
        # Qwen3-Next's local and global (t) layers,
        stacks = {"layers": ("l", f"{{l*{n}//{n - 1}}}"),  # the latter z wide with u K/V heads
                  "global_layers": ("t", f"{{t*{n}+{n - 1}}}")}
    wide = lambda l: str.maketrans("hk", "zu") if l == "t" else {}
    entry = lambda w, l, i: (f"model.layers.{i}.{names[w][0]}",  # layers stacked on l (or j)
                             names[w][1].translate(wide(l)).replace("-> ", f"-> {l} "))
    out = {k: {w: entry(w, *stacks[k]) for w in v} if k in stacks else _HF_TOP[k]
           for k, v in _hf_table(cfg).items() if k != "mtp"}
    if cfg.mtp_depth:  # DeepSeek-V3's MTP modules: the layers after the last (p: the depth)
        i = f"{{p+{cfg.n_layers}}}"
        out["mtp"] = {"layers": {w: entry(w, "p", i) for w in _hf_table(cfg)["mtp"]["layers"]}} | {
            k: (f"model.layers.{i}.{name}.weight", layout) for k, (name, layout) in dict(
                enorm=("enorm", "d -> p d"), hnorm=("hnorm", "d -> p d"), head_norm=(
                    "shared_head.norm", "d -> p d"), eh_proj=("eh_proj", "d b -> p b d")).items()}
    return out


def _hf_sizes(cfg: ModelConfig) -> dict:
    C, Hn, Hr, Hv = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    t = cfg.n_layers // cfg.global_every if cfg.global_head_dim or cfg.linear_k_heads else 0
    Lk, Lv, Dk, Dv = (cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim)
    r = Lv // max(Lk, 1)
    v4 = dict(og=cfg.o_groups, oc=cfg.n_heads * cfg.head_dim // max(cfg.o_groups, 1),
              ow=cfg.o_groups * cfg.o_lora_rank, hk=(2 + cfg.hc_mult) * cfg.hc_mult, hn=cfg.hc_mult,
              hd=cfg.hc_mult * cfg.d_model, o3=3, kr=cfg.top_k, c2=2 * cfg.head_dim, rc=cfg.csa_ratio,
              rh=v4_kinds(cfg)[3], i2=2 * cfg.index_head_dim, y=cfg.n_hash_layers, ca=v4_kinds(
                  cfg)[2][1], ha=v4_kinds(cfg)[2][2], **{"or": cfg.o_lora_rank}) if cfg.hc_mult else {}
    return v4 | dict(l=moe_layers(cfg) - t - cfg.n_hash_layers, t=t, o=1, u=cfg.global_kv_heads or cfg.n_kv_heads,
                z=cfg.global_head_dim or cfg.head_dim, e=cfg.n_experts, d=cfg.d_model, n=cfg.n_heads,
                k=cfg.n_kv_heads, h=cfg.head_dim, f=cfg.d_ff, v=cfg.vocab_size,
                j=cfg.n_layers - moe_layers(cfg), a=C + Hr, c=C, r=cfg.q_lora_rank, q=Hn + Hr,
                x=Hn + Hv, w=Hv, g=cfg.dense_d_ff, s=cfg.n_shared_experts * cfg.d_ff,
                m=cfg.index_n_heads, i=cfg.index_head_dim, p=cfg.mtp_depth, b=2 * cfg.d_model,
                lk=Lk, lq=Dk, lr=r, lx=2 * Lk * Dk + Lv * Dv,
                lw=cfg.linear_conv, lv=Lv, ly=Dv)


def config_from_hf(c: dict, where: str = "config.json") -> ModelConfig:
    """Our ModelConfig from a HuggingFace config.json (as a dict). Anything that would change
    what the model computes and that we do not implement is an error, never ignored."""
    mt = c.get("model_type")
    if mt not in HF_ARCHITECTURES or mt == "gemma4_text" and not c.get("enable_moe_block"):
        raise hf.HFError(f"{where}: model_type {mt!r} is not a mixture-of-experts family that "
                         f"train_moe.py loads ({', '.join(HF_ARCHITECTURES)}); dense models "
                         "(llama, mistral, qwen2, qwen3, gemma4_text without enable_moe_block) "
                         "belong to train_dense.py.")
    if mt == "deepseek_v4":
        return _v4_from_hf(c, where)
    fam = "deepseek_v3" if mt == "kimi_k2" else mt
    # transformers 5 spells Qwen3-MoE's expert count num_local_experts: read it before the defaults
    qwen_experts = c.get("num_experts", c.get("num_local_experts"))
    c = _HF_DEFAULTS[fam] | c
    unsupported = lambda what: hf.HFError(f"{where}: {what} is not implemented by train_moe.py, "
                                          f"so this {mt} model cannot be loaded faithfully.")
    wide = ("moe_intermediate_size" if mt in ("qwen3_moe", "gemma4_text", *HF_QWEN_NEXT,
                                              *HF_DEEPSEEK) else
            "intermediate_size")
    if lacking := [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                               "num_attention_heads", wide) if k not in c]:
        raise hf.HFError(f"{where} has no {lacking[0]!r}; it is not a complete {mt} config.")
    only = dict(hidden_act="silu", partial_rotary_factor=1.0, decoder_sparse_step=1,
                moe_layer_freq=1)  # the one value we implement of each
    only |= dict(swiglu_alpha=SWIGLU_ALPHA) if mt == "gpt_oss" else dict(
        scoring_func="sigmoid", topk_method="noaux_tc") if fam in ("deepseek_v3", "deepseek_v32") else dict(
        scoring_func="softmax") if fam == "deepseek_v2" else dict(
        hidden_activation="gelu_pytorch_tanh", hidden_size_per_layer_input=0,
        num_kv_shared_layers=0) if mt == "gemma4_text" else {}
    only = {k: v for k, v in only.items() if not (mt in HF_QWEN_NEXT and k[0] == "p")}
    for key, want in only.items():
        if c.get(key, want) != want:
            raise unsupported(f"{key} {c[key]!r} (only {want!r})")
    if fam == "deepseek_v2" and c["topk_method"] not in ("greedy", "group_limited_greedy"):
        raise unsupported(f"topk_method {c['topk_method']!r} (only 'greedy' and "
                          "'group_limited_greedy')")
    if c.get("attention_bias") and mt != "gpt_oss":
        raise unsupported("attention_bias (biases on the attention projections)")
    if c.get("mlp_only_layers"):
        raise unsupported("dense MLP layers between the MoE layers (mlp_only_layers)")
    # DeepSeek's YaRN gives mscale == mscale_all_dim: transformers then leaves the rotation
    # unscaled (its factor is their ratio) and the logits times mscale(factor, all_dim)^2.
    if mt == "gemma4_text":  # RoPE per layer kind: the local layers' default, the global ones'
        per = c.get("rope_parameters") or {}   # proportional (a share turned: `rope_partial`)
        local, kind, _ = hf.rope_parameters({"rope_parameters": per.get("sliding_attention")},
                                            10_000.0, where)
        c = c | {"rope_parameters": per.get("full_attention")}
        if kind != "default":
            raise unsupported(f"rope type {kind!r} on the sliding-window layers")
    theta, kind, rope = hf.rope_parameters(c, c.get("rope_theta", 1e6), where)
    if not (kind == "default" or kind == "llama3" and mt == "llama4_text" or kind == "yarn" and (
            mt == "gpt_oss" or mt in HF_DEEPSEEK and not rope.get("attention_factor") and
            rope.get("mscale_all_dim") and rope.get("mscale") == rope["mscale_all_dim"]) or
            kind == "proportional" and mt == "gemma4_text" and rope.get("factor", 1.0) == 1.0):
        raise unsupported(f"rope {kind!r} {rope} (only the default, GPT-OSS's YaRN, DeepSeek's "
                          "YaRN with mscale == mscale_all_dim, Llama 4's 'llama3', Gemma 4's "
                          "'proportional')")
    m = {f: type(getattr(ModelConfig, f))(c.get(k) or 0)
         for k, f in (_HF_FIELDS | _HF_FAMILY_FIELDS[fam]).items()}
    # A window of W tokens changes nothing on sequences of at most W (GPT-OSS's: per layer, below).
    window = c.get("sliding_window") if mt != "gpt_oss" and (
        mt == "mixtral" or c.get("use_sliding_window")) else None
    m |= dict(n_kv_heads=m["n_kv_heads"] or m["n_heads"], rope_theta=theta,
              head_dim=m["head_dim"] or m["d_model"] // m["n_heads"], qk_norm=mt in ("qwen3_moe", *HF_QWEN_NEXT),
              max_seq_len=min(m["max_seq_len"], window or m["max_seq_len"]))
    if kind == "yarn":
        m |= dict(yarn_factor=float(rope["factor"]),
                  yarn_beta_fast=float(rope.get("beta_fast") or 32),
                  yarn_beta_slow=float(rope.get("beta_slow") or 1),
                  yarn_truncate=bool(rope.get("truncate", True)),
                  yarn_original_max_len=rope["original_max_position_embeddings"])
    if kind == "llama3":
        m |= dict(rope_scaling=float(rope["factor"]), rope_low_freq_factor=float(rope[
            "low_freq_factor"]), rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_len=int(rope["original_max_position_embeddings"]))
    if mt == "qwen3_moe":
        m["n_experts"] = qwen_experts or c["num_experts"]
    elif mt == "gpt_oss":  # every second layer windowed, or none
        L, W = m["n_layers"], c.get("sliding_window") or 0
        alternate = ["full_attention" if i % 2 else "sliding_attention" for i in range(L)]
        if (kinds := c.get("layer_types") or alternate) not in (alternate, ["full_attention"] * L):
            raise unsupported(f"layer_types {kinds} (windows on every second layer, or none)")
        windowed = W > 0 and "sliding_attention" in kinds
        m |= dict(sliding_window=W if windowed else 0, global_every=2 if windowed else 0,
                  attn_sinks=True, moe_bias=True)
    elif mt in HF_DEEPSEEK:  # one group = none; head_dim: the rotated part's
        v2, Kd = fam == "deepseek_v2", m["first_k_dense"]  # V2: softmax, its pairs always
        G = c.get("n_group") or 1 if not v2 or c["topk_method"] != "greedy" else 1
        m |= dict(head_dim=m["qk_rope_head_dim"], sigmoid_routing=not v2, n_group=G if G > 1 else 0,
                  seq_aux=bool(c.get("seq_aux", True)), topk_group=c["topk_group"] if G > 1 else 0,
                  yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
                  dense_d_ff=c["intermediate_size"] if Kd else 0)
        m |= dict(norm_topk=False, rope_interleave=True) if v2 else dict(
            rope_interleave=True) if mt == "deepseek_v32" else {}
    elif mt == "llama4_text":  # every n-th layer global and unrotated, chunks on the others
        L, n, s = m["n_layers"], c["no_rope_layer_interval"], m["moe_every"]
        rope_at = [int((i + 1) % n != 0) for i in range(L)]  # HF's no_rope_layers: 1 = RoPE
        kinds = ["chunked_attention" if r and m["attn_chunk"] else "full_attention"
                 for r in rope_at]
        want = [rope_at, list(range(s - 1, L, s)), kinds]
        if [c.get(k) or w for k, w in zip(("no_rope_layers", "moe_layers", "layer_types"),
                                          want)] != want:
            raise unsupported("no_rope_layers, moe_layers or layer_types other than NoPE on "
                              "every n-th layer and MoE on every (or every second) layer")
        m |= dict(global_every=n, global_nope=True, sigmoid_routing=True, norm_topk=False,
                  score_inputs=True, n_shared_experts=1, rope_interleave=True,
                  attn_temp_scale=float(c["attn_scale"]) if c["attn_temperature_tuning"] else 0.0,
                  dense_d_ff=c["intermediate_size_mlp"] if s > 1 else 0)
    elif mt == "gemma4_text":  # every n-th layer global, of its own shape: per layer (5.x) or not
        kinds, L = c.get("layer_types") or [], m["n_layers"]
        n, K = kinds.index("full_attention") + 1 if "full_attention" in kinds else 0, c.get(
            "num_global_key_value_heads") if m["k_eq_v"] else None
        glob = {int(i): v for i, v in (c.get("per_layer_config") or dict.fromkeys(range(
            n - 1, L, n), {"head_dim": c["global_head_dim"]} | ({"num_key_value_heads": K} if K
                                                                 else {}))).items()}
        if n < 2 or kinds != (["sliding_attention"] * (n - 1) + ["full_attention"]) * (L // n) or \
                sorted(glob) != list(range(n - 1, L, n)) or any(v != glob[n - 1] or set(v) - {
                    "head_dim", "num_key_value_heads"} for v in glob.values()):
            raise unsupported(f"layer_types {kinds} with per_layer_config {glob} (only every "
                              "n-th layer global, all alike, the last one global)")
        m |= dict(gemma4=True, qk_norm=True, global_every=n, rope_local_theta=local, rope_partial=
                  float(rope.get("partial_rotary_factor", 1.0)) % 1.0, global_head_dim=glob[
                      n - 1]["head_dim"], global_kv_heads=glob[n - 1].get("num_key_value_heads", 0))
    elif mt in HF_QWEN_NEXT:  # every n-th layer full attention, DeltaNet between
        kinds, L, H = c.get("layer_types") or [], m["n_layers"], m["head_dim"]
        n = c.get("full_attention_interval") or (kinds.index("full_attention") + 1 if
                                                  "full_attention" in kinds else 4)
        R = int(H * (c.get("partial_rotary_factor") or rope.get("partial_rotary_factor", 0.25)))
        if kinds and kinds != (["linear_attention"] * (n - 1) + ["full_attention"]) * (L // n) or \
                c.get("shared_expert_intermediate_size") != m["d_ff"] or R % 2:
            raise unsupported(f"layer_types {kinds} (only every n-th layer full), a shared expert "
                              f"not as wide as the routed ones, or {R} dims turned (odd)")
        m |= dict(global_every=n, attn_gate=True, norm_offset=True, n_shared_experts=1,
                  shared_gated=True, rotary_dim=R if R < H else 0)
    return ModelConfig(**m)


def _model_type(cfg: ModelConfig, model_type: str) -> str:
    """The family to write: the one asked for (or the knobs'), if the knobs fit it."""
    if cfg.hc_mult or model_type == "deepseek_v4":
        if not cfg.hc_mult or model_type not in ("", "deepseek_v4"):
            raise hf.HFError(f"model_type {model_type!r} does not fit this model: mHC streams "
                             "(--model.hc-mult) are deepseek_v4's, and only its.")
        return "deepseek_v4"
    fam = next(m for m, knobs in (  # the first family whose knobs are all on
        ("gemma4_text", "gemma4"), ("llama4_text", "score_inputs"),
        ("qwen3_next", "linear_k_heads"), ("qwen3_moe", "qk_norm"), ("gpt_oss", "attn_sinks"),
        ("deepseek_v32", "index_n_heads"), ("deepseek_v3", "kv_lora_rank sigmoid_routing"),
        ("deepseek_v2", "kv_lora_rank"), ("mixtral", ""))
        if all(getattr(cfg, k) for k in knobs.split()))
    mt = model_type or fam
    if mt not in HF_ARCHITECTURES:
        raise hf.HFError(f"model_type {mt!r}: choose one of {', '.join(HF_ARCHITECTURES)}.")
    kind = "deepseek_v3" if mt == "kimi_k2" else "qwen3_next" if mt in HF_QWEN_NEXT else mt
    if (kind != fam or any(bool(getattr(cfg, k)) != (kind in f) for k, f in _HF_OWN.items()) or
            any(getattr(cfg, k) and kind not in fs for k, fs in _HF_ONLY.items()) or
            mt in ("mixtral", "gpt_oss", "gemma4_text", "qwen3_5_moe_text") and not cfg.norm_topk or
            cfg.moe_every > 1 and
            kind != "llama4_text" or kind in ("deepseek_v2", "deepseek_v32") and (
                kind == "deepseek_v2" and cfg.norm_topk or not cfg.rope_interleave) or
            kind == "llama4_text" and (cfg.norm_topk or not (
                cfg.rope_interleave and cfg.n_shared_experts == 1 and cfg.global_nope))):
        raise hf.HFError(f"model_type {mt!r} does not fit this model: q/k norms are qwen3_moe's; "
                         "mixtral and gpt_oss always renormalise the top-k weights; sinks, "
                         "biases, windows and the clamp are gpt_oss's (and all of its); MLA, "
                         "shared experts and dense layers deepseek_v3's, kimi_k2's and (with "
                         "softmax routing, not renormalised, RoPE pairs) deepseek_v2's, the indexer "
                         "(RoPE pairs) deepseek_v32's, sigmoid "
                         "routing theirs; YaRN is theirs and gpt_oss's; scaled expert inputs, one "
                         "shared expert, RoPE pairs, NoPE, chunks, moe_every and Llama 3.1's "
                         "RoPE llama4_text's; Gemma 4's block gemma4_text's.")
    return mt


def config_to_hf(cfg: ModelConfig, model_type: str = "", dtype: str = "float32") -> dict:
    """A config.json for `cfg` that transformers 4.4x and 5.x both read."""
    mt = _model_type(cfg, model_type)
    if mt == "deepseek_v4":
        return _v4_to_hf(cfg, dtype)
    fam = "deepseek_v3" if mt == "kimi_k2" else mt
    rope = dict(rope_type="default", rope_theta=cfg.rope_theta) | ({"partial_rotary_factor": (
        cfg.rotary_dim or cfg.head_dim) / cfg.head_dim} if mt in HF_QWEN_NEXT else {})
    if cfg.yarn_factor:
        rope |= dict(rope_type="yarn", factor=cfg.yarn_factor, beta_fast=cfg.yarn_beta_fast,
                     beta_slow=cfg.yarn_beta_slow,
                     original_max_position_embeddings=cfg.yarn_original_max_len,
                     **({} if cfg.yarn_truncate else {"truncate": False}), **(dict(
                         mscale=cfg.yarn_mscale_all_dim, mscale_all_dim=cfg.yarn_mscale_all_dim)
                         if cfg.kv_lora_rank else {}))
    if cfg.rope_scaling:
        rope |= dict(rope_type="llama3", factor=cfg.rope_scaling,
                     low_freq_factor=cfg.rope_low_freq_factor,
                     high_freq_factor=cfg.rope_high_freq_factor,
                     original_max_position_embeddings=cfg.rope_original_max_len)
    c = dict(architectures=[HF_ARCHITECTURES[mt]], model_type=mt) | {
        k: getattr(cfg, f) for k, f in (_HF_FIELDS | _HF_FAMILY_FIELDS[fam]).items()} | dict(
        hidden_act="silu", rope_parameters=rope, rope_theta=cfg.rope_theta,
        rope_scaling=rope if cfg.yarn_factor or cfg.rope_scaling else None, sliding_window=None,
        attention_dropout=0.0, initializer_range=0.02, use_cache=True, dtype=dtype,
        torch_dtype=dtype) | _HF_CONSTANTS[fam]
    if mt in ("qwen3_moe", "qwen3_next"):  # intermediate_size: dense layers', none of which
        c["intermediate_size"] = cfg.d_ff
    if mt in HF_QWEN_NEXT:
        n = cfg.global_every
        c |= dict(shared_expert_intermediate_size=cfg.d_ff, full_attention_interval=n,
                  layer_types=(["linear_attention"] * (n - 1) + ["full_attention"]) * (
                      cfg.n_layers // n), partial_rotary_factor=rope["partial_rotary_factor"])
    elif mt == "gpt_oss":
        L, W = cfg.n_layers, cfg.sliding_window
        c |= dict(sliding_window=W or None, layer_types=[
            "sliding_attention" if W and (i + 1) % (cfg.global_every or L + 1) else
            "full_attention" for i in range(L)])
    elif mt in HF_DEEPSEEK:  # transformers' head_dim is the rotated part's
        c |= dict(head_dim=cfg.qk_rope_head_dim, intermediate_size=cfg.dense_d_ff or cfg.d_ff,
                  q_lora_rank=cfg.q_lora_rank or None, n_group=cfg.n_group or 1,
                  topk_group=cfg.topk_group or 1, routed_scaling_factor=cfg.routed_scale or 1.0)
        if fam == "deepseek_v2":
            c["topk_method"] = "group_limited_greedy" if cfg.n_group else "greedy"
        if fam == "deepseek_v32":  # transformers' per-layer lists, as it writes them
            L, Kd = cfg.n_layers, cfg.first_k_dense
            c |= dict(mlp_bias=False, layer_types=["indexed_attention"] * L,
                      mlp_layer_types=["dense"] * Kd + ["sparse"] * (L - Kd))
    elif mt == "llama4_text":
        L, n, s = cfg.n_layers, cfg.global_every or cfg.n_layers + 1, cfg.moe_every
        rope_at = [int((i + 1) % n != 0) for i in range(L)]  # 1: RoPE (and chunks, if any)
        c |= dict(attention_chunk_size=cfg.attn_chunk or None, no_rope_layer_interval=n,
                  no_rope_layers=rope_at, layer_types=["chunked_attention" if r and
                                                       cfg.attn_chunk else "full_attention"
                                                       for r in rope_at],
                  moe_layers=list(range(s - 1, L, s)), intermediate_size_mlp=cfg.dense_d_ff or
                  cfg.d_ff, attn_temperature_tuning=bool(cfg.attn_temp_scale),
                  attn_scale=cfg.attn_temp_scale or 0.1)
    elif mt == "gemma4_text":  # RoPE per layer kind, the global layers' shape per layer (5.x)
        L, n, K = cfg.n_layers, cfg.global_every, cfg.global_kv_heads
        c = {k: v for k, v in c.items() if k not in ("hidden_act", "rope_theta", "rope_scaling",
                                                     "num_experts_per_tok")} | dict(
            sliding_window=cfg.sliding_window, rope_parameters=dict(full_attention=dict(
                rope_type="proportional", rope_theta=cfg.rope_theta, partial_rotary_factor=
                cfg.rope_partial or 1.0), sliding_attention=dict(
                rope_type="default", rope_theta=cfg.rope_local_theta or cfg.rope_theta)),
            layer_types=(["sliding_attention"] * (n - 1) + ["full_attention"]) * (L // n),
            per_layer_config={str(i): {"head_dim": cfg.global_head_dim} | (
                {"num_key_value_heads": K} if K else {}) for i in range(n - 1, L, n)})
    return c


def _hf_table(cfg: ModelConfig) -> dict:
    """The parameters and the buffers: a HuggingFace folder holds DeepSeek's choice bias too."""
    return train.join(_param_table(cfg), _buffer_table(cfg))


def load_hf(path: str, mesh=None) -> tuple[ModelConfig, dict]:
    """A HuggingFace folder (config.json and safetensors, one file or sharded with an index)
    as our ModelConfig and float32 parameters placed by `param_specs` on `mesh` (each device
    reads only its experts' blocks), the router biases inside the layers (`with_buffers`)."""
    ckpt = hf.Checkpoint(path)
    cfg, mt = config_from_hf(ckpt.config, ckpt.config_file), ckpt.config["model_type"]
    fused = "w_gate" not in _HF_FAMILY_NAMES.get(mt, {}) and any(  # transformers 5's experts
        n.endswith("mlp.experts.gate_up_proj") for n in ckpt.names())
    return cfg, train.hf_params(  # Qwen's text-only exports may keep the MTP module (mtp.*)
        ckpt, mesh, _hf_table(cfg), hf_mapping(cfg, mt, fused), _hf_sizes(cfg),
        unused=lambda n: n.endswith(MTP_COPIES) or n.startswith("mtp."))


def save_hf(params: dict, cfg: ModelConfig, path: str, *, model_type: str = "",
            base_config: dict | None = None, dtype: str = "float32",
            max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """`params` (router biases inside, as `load_hf` gives them) as a HuggingFace folder: config.json
    and safetensors shards of at most `max_shard_bytes`; `base_config`'s other keys kept."""
    mt = _model_type(cfg, model_type or (base_config or {}).get("model_type", ""))
    mapping = hf_mapping(cfg, mt)
    for k in range(cfg.mtp_depth):  # each MTP layer holds copies of the shared embedding and
        at, copy = f"model.layers.{cfg.n_layers + k}.", f"mtp_copy{k}"  # head (vLLM reads them)
        params = params | {copy: {"embed": params["embed"], "head": unembedding(params, cfg)}}
        mapping = mapping | {copy: {"embed": (at + MTP_COPIES[0][1:], "v d -> v d"),
                                    "head": (at + MTP_COPIES[1][1:], "v d -> d v")}}
    return hf.save(path, params, mapping, _hf_sizes(cfg), config_to_hf(cfg, mt, dtype),
                   base_config, dtype=dtype, max_shard_bytes=max_shard_bytes)


# export-hf: a run's checkpoint, router biases included, as a HuggingFace folder.
def export_hf(run_dir: str, out: str, step: int = -1, dtype: train.ExportDtype = "float32",
              model_type: Literal[("", *HF_ARCHITECTURES)] = "", max_shard_gb: float = 5.0):
    with train.run_config(run_dir) as saved:  # unreadable: a ConfigError naming it
        cfg = Config(model=ModelConfig(**saved["model"]), train=TrainConfig(**saved["train"]),
                     data=DataConfig(**saved["data"]), run_dir=run_dir)
    ex = train.export(run_dir, step, saved, {"params": _param_table(cfg.model), "buffers":
                      _buffer_table(cfg.model)}, dtype, max_shard_gb, data=cfg.data,
                      dims=MUON_DIMS)
    return ex.written(save_hf(ex.params, cfg.model, out, model_type=model_type, **ex.hf_args), out)
export_hf.__doc__ = train.EXPORT_HF_DOC


def cli(args=None) -> Config:
    return train.cli(PRESETS, args)


if __name__ == "__main__":
    train.run_cli(main, cli, export_hf)
