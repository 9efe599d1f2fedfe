"""Dense decoder-only transformer (Llama 2/3, Mistral, Qwen2/3, Gemma 2/3): pre-training and
fine-tuning in one file; what no model changes (state, reports, the loop, the CLI) is in common/.

    python train_dense.py tiny                                   # the `make train` run
    python train_dense.py llama3.1-8b --mesh.fsdp 8 --train.steps 1000
    python train_dense.py llama3.1-70b --dry-run                 # compile only, print memory
    python train_dense.py tiny --init-from-hf ~/hf/Llama-3.2-1B --data.path data/mine
    python train_dense.py export-hf --run-dir runs/tiny --out hf/tiny

Lines ending in "# SFT" or "# DPO" (with their brackets and blocks) serve fine-tuning or
preference tuning only: a pre-training fork deletes them. Tensor names end in their shapes: B
batch, T sequence, S key sequence, D model width, N query heads, K key/value heads, H head width,
F MLP width, V vocabulary, L layers."""
import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name as named_as  # what --model.remat may keep
from jax.sharding import PartitionSpec as P

from common import hf, lora, optim, sampling, train
from common.attention import attend, check_kernel, choose, fold_context, from_context, to_context
from common.config import check_ranges, how, knob, need, resumable
from common.checkpoint import CheckpointConfig
from common.data import DataConfig, get_batch, load_dataset, run_tokenizer
from common.data import SFTDataset, held_out_batches  # SFT
from common.eval import DuringTraining, run_eval
from common.lora import LoRAConfig, lora_table
from common.mesh import BATCH_AXES, MeshConfig, describe, make_mesh, resolve
from common.pipeline import check_pipeline, pipeline_report, pipelined, stages
from common.train import ConfigError, log, named  # ConfigError: for callers

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
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: the hidden matrices (common/optim.py)
    muon_dtype: Literal["float32", "bfloat16"] = "float32"  # Muon's momentum and iteration
    # Fitting a chip (docs/speed.md): the matrices' master copy and Adam's moments in bfloat16
    # (MaxText's weight_dtype, mu_dtype); the optimiser state in host memory between steps
    weight_dtype: Literal["float32", "bfloat16"] = "float32"
    mu_dtype: Literal["float32", "bfloat16"] = "float32"
    nu_dtype: Literal["float32", "bfloat16"] = "float32"
    offload_opt_state: bool = resumable(False)
    qk_clip_threshold: float = resumable(0.0, ">= 0")  # MuonClip: q.k logits <= this; 0 = off
    z_loss: float = 0.0           # weight of mean(logsumexp^2) (PaLM); 0 = off
    seed: int = 0
    log_every: int = resumable(10)
    eval_every: int = resumable(100)
    eval_batches: int = resumable(4)
    eval_tasks: str = resumable("")  # lm-eval tasks scored at each eval (docs/eval.md); "" = none
    eval_tasks_limit: int = resumable(0, ">= 0")  # examples per task; 0 = all
    sample_tokens: int = resumable(96, ">= 0")  # printed at the end; 0 = no sample
    temperature: float = resumable(0.7, ">= 0")  # of that sample; 0 = greedy
    sample_prompt: str = resumable("def")  # no trailing space: it would tokenize as a lone "▁"
    eval_samples: int = resumable(32, ">= 0")  # held-out prompts answered per eval  # SFT
    peak_tflops: float = resumable(0.0)  # per device, for MFU; 0 = look up or measure
    profile_steps: tuple[int, ...] = resumable(())  # first, last step traced to <run_dir>/profile
    max_bad_steps: int = resumable(0)  # non-finite updates to skip; then stop


@dataclass(frozen=True)  # DPO
class DPOConfig:  # DPO
    """--data.format dpo: preference tuning against the frozen starting model (`dpo_loss`)."""
    loss: Literal["dpo", "ipo", "simpo"] = "dpo"
    beta: float = 0.1             # dpo, ipo: the reward is beta log(pi / pi_ref)
    simpo_beta: float = 2.0       # simpo: the reward is simpo_beta log(pi) / answer tokens
    simpo_gamma: float = knob(1.0, ">= 0")  # simpo: the target reward margin
    precompute_ref: bool = False  # the start's log-probs of every batch once, first: no copy kept


@dataclass(frozen=True)  # distillation
class DistillConfig:  # distillation
    """--distill.teacher: the student also learns the teacher's next-token distribution."""
    teacher: str = ""             # a train_dense.py run dir or HuggingFace folder; "" = off
    weight: float = knob(0.5, "[0, 1]")  # of the KL term; the data's own targets get 1 - it
    temperature: float = knob(1.0, "> 0")  # both distributions softened by it (Hinton 2015)
    top_k: int = knob(0, ">= 0")  # the teacher's k likeliest tokens only, renormalised; 0 = all
    logits: str = ""              # a folder of the teacher's top-k for this run's batches: read
    save: bool = False            # run the teacher once over them, write that folder, exit


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)  # DPO
    lora: LoRAConfig = field(default_factory=partial(  # LoRA
        LoRAConfig, targets="wq,wk,wv,wo,w_gate,w_up,w_down"))
    distill: DistillConfig = field(default_factory=DistillConfig)  # distillation
    mesh: MeshConfig = resumable(MeshConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = resumable(CheckpointConfig)
    run_dir: str = resumable("runs/tiny")
    init_from: str = ""           # a train_dense.py run dir: start from its latest parameters
    dry_run: bool = resumable(False)  # compile one step on abstract inputs, print memory, exit
    compile_topology: str = resumable("")  # --dry-run for this TPU type (v5p-256): libtpu
    compile_slices: int = resumable(1)  # ... and this many slices of it (set --mesh.dcn-* to match)
    bench: int = resumable(0)     # time this many steps on synthetic tokens, print, exit
    quiet: bool = resumable(False)  # no progress lines; steps, evals and the summary still print
    init_from_hf: str = ""        # HuggingFace folder: start from its weights and config.json


# A preset at scale: its family's fields (and training length), then its shape and changes.
_GEMMA = dict(head_dim=256, norm_eps=1e-6, tie_embeddings=True, norm_plus_one=True,
              sandwich_norm=True, embed_scale=True, gelu=True, query_scale=256.0)
_GPT2 = dict(layer_norm=True, learned_pos=True, plain_mlp=True, proj_bias=True, qkv_bias=True,
             gelu=True)
FAMILIES = {  # Gemma: (1 + w) and sandwich norms, GeGLU, tied embeddings scaled by sqrt(d)
    "llama2": (4096, dict(vocab_size=32000, max_seq_len=4096)),
    "llama3": (4096, dict(vocab_size=128256, max_seq_len=131072, rope_theta=5e5, rope_scaling=8.0,
                          vocab_split=True)),
    "mistral": (4096, dict(vocab_size=32768, max_seq_len=32768, rope_theta=1e6)),
    "qwen3": (4096, dict(vocab_size=151936, max_seq_len=40960, rope_theta=1e6, norm_eps=1e-6,
                         qk_norm=True)),
    "gemma": (8192, _GEMMA | dict(vocab_size=256000, max_seq_len=8192, sandwich_norm=False,
                                  query_scale=0.0)),  # Gemma 1: no sandwich, caps or windows
    "gemma2": (8192, _GEMMA | dict(vocab_size=256000, max_seq_len=8192, sliding_window=4096,
                                   global_every=2, attn_softcap=50.0, final_softcap=30.0)),
    "gemma3": (4096, _GEMMA | dict(vocab_size=262208, max_seq_len=131072, sliding_window=1024,
                                   global_every=6, rope_theta=1e6, rope_local_theta=1e4,
                                   rope_linear=8.0, qk_norm=True, vocab_split=True)),
    # Gemma 4: Gemma 3's windows and norms; wider global layers, K = V, proportional RoPE
    "gemma4": (4096, _GEMMA | dict(vocab_size=262144, max_seq_len=262144, sliding_window=1024,
                                   global_every=6, rope_theta=1e6, rope_local_theta=1e4,
                                   qk_norm=True, norm_plus_one=False, query_scale=1.0,
                                   final_softcap=30.0, global_head_dim=512, rope_partial=0.25,
                                   v_norm=True, layer_scale=True)),
    "olmo3": (8192, dict(vocab_size=100278, max_seq_len=65536, rope_theta=5e5, norm_eps=1e-6,
                         post_norm=True, qk_norm=True, qk_norm_whole=True, sliding_window=4096,
                         global_every=4, yarn_factor=8.0, yarn_original_max_len=8192)),
    "gpt3": (2048, _GPT2 | dict(vocab_size=50257, max_seq_len=2048, tie_embeddings=True)),
}
_GPT3 = dict(vocab_size=32768, max_seq_len=16384)  # MaxText's GPT-3 6B and 22B
_E = dict(max_seq_len=131072, sliding_window=512, ple_dim=256, kv_shared=20)  # Gemma 4 E2B/E4B
SHAPE = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff")
SIZES = {  # name: (description, family, shape, other fields)
    "llama2-7b": ("Llama 2 7B", "llama2", (4096, 32, 32, 32, 128, 11008)),
    "llama3.1-8b": ("Llama 3.1 8B (rope scaling 8x)", "llama3", (4096, 32, 32, 8, 128, 14336)),
    "llama3.2-1b": ("Llama 3.2 1B (tied embeddings, rope scaling 32x)", "llama3",
                    (2048, 16, 32, 8, 64, 8192), dict(tie_embeddings=True, rope_scaling=32.0)),
    # Their batches outnumber the vocabulary: the loss gathers the unembedding (split: no gain).
    "llama3.1-70b": ("Llama 3.1 70B", "llama3", (8192, 80, 64, 8, 128, 28672),
                     dict(vocab_split=False)),
    "llama3.1-405b": ("Llama 3.1 405B", "llama3", (16384, 126, 128, 8, 128, 53248),
                      dict(vocab_split=False)),
    "mistral-7b": ("Mistral 7B v0.3 (vocab 32768)", "mistral", (4096, 32, 32, 8, 128, 14336)),
    "qwen3-0.6b": ("Qwen3 0.6B (tied embeddings, q/k norm)", "qwen3",
                   (1024, 28, 16, 8, 128, 3072), dict(tie_embeddings=True)),
    "qwen3-8b": ("Qwen3 8B (q/k norm)", "qwen3", (4096, 36, 32, 8, 128, 12288)),
    "gemma-2b": ("Gemma 2B (multi-query)", "gemma", (2048, 18, 8, 1, 256, 16384)),
    "gemma-7b": ("Gemma 7B", "gemma", (3072, 28, 16, 16, 256, 24576)),
    "gemma2-2b": ("Gemma 2 2B", "gemma2", (2304, 26, 8, 4, 256, 9216)),
    "gemma2-9b": ("Gemma 2 9B", "gemma2", (3584, 42, 16, 8, 256, 14336)),
    "gemma2-27b": ("Gemma 2 27B", "gemma2", (4608, 46, 32, 16, 128, 36864),
                   dict(query_scale=144.0)),
    "gemma3-1b": ("Gemma 3 1B (text)", "gemma3", (1152, 26, 4, 1, 256, 6912), dict(
        vocab_size=262144, max_seq_len=32768, sliding_window=512, rope_linear=0.0)),
    "gemma3-4b": ("Gemma 3 4B, its text model", "gemma3", (2560, 34, 8, 4, 256, 10240)),
    "gemma3-12b": ("Gemma 3 12B, its text model", "gemma3", (3840, 48, 16, 8, 256, 15360)),
    "gemma3-27b": ("Gemma 3 27B, its text model", "gemma3", (5376, 62, 32, 16, 128, 21504),
                   dict(query_scale=168.0)),
    "gemma4-31b": ("Gemma 4 31B, its text model (global layers: 512 wide, 4 K = V heads)",
                   "gemma4", (5376, 60, 32, 16, 256, 21504), dict(global_kv_heads=4, k_eq_v=True)),
    "gemma4-e2b": ("Gemma 4 E2B, its text model (per-layer inputs, 20 layers reuse K/V)", "gemma4",
                   (1536, 35, 8, 1, 256, 6144), dict(global_every=5, wide_shared_mlp=True, **_E)),
    "gemma4-e4b": ("Gemma 4 E4B, its text model (per-layer inputs, 18 layers reuse K/V)", "gemma4",
                   (2560, 42, 8, 2, 256, 10240), _E | dict(kv_shared=18)),
    "olmo3-7b": ("OLMo 3 7B (post norms, windows, YaRN)", "olmo3", (4096, 32, 32, 32, 128, 11008)),
    "olmo3-32b": ("OLMo 3 32B", "olmo3", (5120, 64, 40, 8, 128, 27648)),
    "gpt3-175b": ("GPT-3 175B, the paper's", "gpt3", (12288, 96, 96, 96, 128, 49152)),
    "gpt3-22b": ("GPT-3 22B, MaxText's", "gpt3", (6144, 48, 24, 24, 256, 24576), _GPT3),
    "gpt3-6b": ("GPT-3 6B, MaxText's", "gpt3", (3072, 48, 12, 12, 256, 12288), _GPT3),
    "gpt3-52k": ("MaxText's GPT-3 test model", "gpt3", (16, 1, 2, 2, 8, 64), dict(vocab_size=1024)),
}


def _big(name: str, family: str, shape: tuple, fields=()) -> Config:
    seq_len, base = FAMILIES[family]
    return Config(model=ModelConfig(**base | dict(zip(SHAPE, shape)) | dict(fields),
                                    dtype="bfloat16"),
                  train=TrainConfig(steps=100_000, batch_size=256, seq_len=seq_len, lr=3e-4,
                                    warmup_steps=2000, eval_every=1000, sample_tokens=0),
                  checkpoint=CheckpointConfig(every=1000), run_dir=f"runs/{name}")


PRESETS: dict[str, tuple[str, Config]] = {
    "tiny": ("~5M parameters on the embedded corpus: the `make train` default", Config()),
    # The model ../shared/bench/peer_maxtext.sh runs in MaxText, for side-by-side speed.
    "bench-parity": ("MaxText comparison model: d 256, 4 layers, vocab 32000, seq 256, batch 8",
                     Config(ModelConfig(vocab_size=32000, n_kv_heads=4, d_ff=1024),
                            TrainConfig(batch_size=8), run_dir="runs/bench-parity")),
    **{name: (about, _big(name, *rest)) for name, (about, *rest) in SIZES.items()},
    # `tiny` with Gemma 2's knobs; its window (128) is half the training sequence.
    "tiny-gemma": ("`tiny` as Gemma 2: local/global layers, soft-caps, sandwich norms, GeGLU",
                   Config(model=ModelConfig(**FAMILIES["gemma2"][1] | dict(
                       vocab_size=4096, head_dim=64, query_scale=0.0, max_seq_len=2048,
                       sliding_window=128)), run_dir="runs/tiny-gemma")),
    # `tiny` with Gemma 4's knobs, the 31B's and E2B's: every second layer global (twice as
    # wide, one K = V head), per-layer inputs, the last two layers reusing the first two's K/V.
    "tiny-gemma4": ("`tiny` as Gemma 4: wide K = V global layers, per-layer inputs, shared K/V",
                    Config(model=ModelConfig(**FAMILIES["gemma4"][1] | dict(
                        vocab_size=4096, head_dim=64, max_seq_len=2048, sliding_window=128,
                        global_every=2, global_head_dim=128, global_kv_heads=1, k_eq_v=True,
                        ple_dim=32, kv_shared=2, wide_shared_mlp=True)),
                           run_dir="runs/tiny-gemma4")),
    # `tiny` with OLMo 3's knobs: window 128, YaRN stretching the 256 tokens it trains on 8x.
    "tiny-olmo3": ("`tiny` as OLMo 3: post norms, all-head q/k norms, local/global layers, YaRN",
                   Config(model=ModelConfig(**FAMILIES["olmo3"][1] | dict(
                       vocab_size=4096, max_seq_len=2048, sliding_window=128,
                       yarn_original_max_len=256)), run_dir="runs/tiny-olmo3")),
    # `tiny` with Qwen3.5's block: layers 1-3 Gated DeltaNet (2 key heads, each serving 2 value
    # heads), layer 4 gated attention turning a quarter of each head; (1 + w) and q/k norms.
    "tiny-qwen35-dense": ("`tiny` as Qwen3.5: Gated DeltaNet on 3 layers of 4, gated attention",
                          Config(model=ModelConfig(
                              norm_eps=1e-6, qk_norm=True, norm_plus_one=True, attn_gate=True,
                              global_every=4, linear_k_heads=2, linear_v_heads=4, linear_k_dim=64,
                              linear_v_dim=64, rotary_dim=16), run_dir="runs/tiny-qwen35-dense")),
    "tiny-gpt3": ("`tiny` as GPT-3: LayerNorm, learned positions, a GELU MLP, biases, tied", Config(
        ModelConfig(**_GPT2, tie_embeddings=True, n_kv_heads=4, d_ff=1024, max_seq_len=512),
        run_dir="runs/tiny-gpt3")),
    # `make sft`: tools/sft_demo.py writes the data; the model is the `make train` run's.
    "tiny-sft": (  # SFT
        "fine-tune runs/tiny on the generated instruction set: the `make sft` demo",
        Config(train=TrainConfig(steps=150, seq_len=128, warmup_steps=10, eval_every=50,
                                 sample_tokens=32, temperature=0.0), init_from="runs/tiny",
               data=DataConfig(format="sft", path="data/sft-demo/train.jsonl"),
               checkpoint=CheckpointConfig(every=50), run_dir="runs/tiny-sft")),
    # `make dpo`: tools/sft_demo.py --dpo writes the pairs; the model is the `make sft` run's.
    "tiny-dpo": (  # DPO
        "prefer right answers to corrupted ones, from runs/tiny-sft: the `make dpo` demo",
        Config(train=TrainConfig(steps=150, seq_len=128, lr=2e-4, warmup_steps=10,
                                 eval_every=25, sample_tokens=32, temperature=0.0),
               init_from="runs/tiny-sft", data=DataConfig(format="dpo", path=(
                   "data/dpo-demo/train.jsonl")), checkpoint=CheckpointConfig(every=50),
               dpo=DPOConfig(beta=0.5), run_dir="runs/tiny-dpo")),
    # `make distill`: a student a quarter of `make train`'s model learns from it (the teacher).
    "tiny-distill": (  # distillation
        "a 1.4M student of runs/tiny (the teacher) on the same corpus: the `make distill` demo",
        Config(ModelConfig(d_model=128, n_layers=2, head_dim=32, d_ff=384), run_dir=(
            "runs/tiny-distill"), distill=DistillConfig(teacher="runs/tiny"))),
    # The HuggingFace flow (`make finetune-hf`): the model, tokenizer and chat template come
    # from --init-from-hf; the learning rate suits a pretrained 0.5-8B model, not the demo.
    "hf-sft": (  # SFT
        "fine-tune --init-from-hf on your chat JSONL (--data.path): `make finetune-hf`",
        Config(train=TrainConfig(steps=200, seq_len=1024, lr=2e-5, warmup_steps=10,
                                 eval_every=50, sample_tokens=64, temperature=0.0),
               data=DataConfig(format="sft", path="data/chat.jsonl"),
               checkpoint=CheckpointConfig(every=100), run_dir="runs/finetune-hf")),
}


# ----------------------------------------------------------------------------------------------
# 2. Parameters and their shardings
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


# ----------------------------------------------------------------------------------------------
# 3. Model
# ----------------------------------------------------------------------------------------------
def block(x_BTD, lp: dict, cfg: ModelConfig, *, pos_BT, inv_freq, segment_ids=None,
          max_logits: bool = False, is_global=True, kv=None, keep_kv=False, ple_BTP=None):
    """One transformer block; returns (x, stats: with max_logits the heads' largest logit). With
    a sliding window, `is_global` (traced: the layers are scanned) picks the layer's kind;
    inv_freq is then [2, H/2], the local and the global frequencies. Gemma 4: a layer without
    keys and values of its own attends over `kv`, an earlier layer's (k, v), which stats hold
    with `keep_kv`; ple_BTP is the layer's own input."""
    dt, lp = x_BTD.dtype, lora.merged(lp)  # LoRA: each adapted weight merged, in its layer
    w, mm = weights(lp, dt, cfg), matmuls(cfg)
    b = lambda name: w(name) if name in lp else 0  # biases: those this model has

    def norm(x, name):  # a gain [N, H] (OLMo's q/k norms) normalises all heads at once
        g, b = 1.0 + lp[name] if cfg.norm_plus_one else lp[name], lp.get(name + "_bias")
        return rms_norm(x.reshape(*x.shape[:-g.ndim], -1), g.ravel(), cfg.norm_eps, b).reshape(
            x.shape)

    h = x_BTD if cfg.post_norm else norm(x_BTD, "attn_norm")
    if "lin_q" in lp:  # Qwen3.5's DeltaNet layers: no keys, no logits (QK-clip is refused).
        # Left padding (segment 0, before a prompt) zeroed: the state stays 0 through it and the
        # convolution sees zeros, as before a row's start; packed rows are refused (`validate`).
        seg = 1 if segment_ids is None else (segment_ids > 0)[..., None].astype(h.dtype)
        o, stats = gated_deltanet(h * seg, lp, cfg)[0], {}
    else:
        if np.ndim(inv_freq) == 2:
            inv_freq = jnp.where(is_global, inv_freq[1], inv_freq[0])
        q = mm("btd,dnh->btnh", h, w("wq")) + (w("bq") if cfg.qkv_bias else 0)
        rope = partial_rope if cfg.rotary_dim else apply_rope  # Qwen3.5: a share of the dims
        rope = (lambda x, *_: x) if cfg.learned_pos else rope
        q = rope(norm(q, "q_norm") if cfg.qk_norm else q, pos_BT, inv_freq)
        if kv is None:  # else a Gemma 4 layer reusing an earlier layer's (kv_shared)
            k = mm("btd,dkh->btkh", h, w("wk"))
            v = mm("btd,dkh->btkh", h, w("wv")) if "wv" in lp else k  # else k_eq_v
            if cfg.qkv_bias:
                k, v = k + w("bk"), v + w("bv")
            kv = (rope(norm(k, "k_norm") if cfg.qk_norm else k, pos_BT, inv_freq),
                  rms_norm(v, 1.0, cfg.norm_eps) if cfg.v_norm else v)  # Gemma 4's: per head
        q, k, v = (named_as(x, n) for x, n in zip((q, *kv), "qkv"))
        if cfg.yarn_factor:  # YaRN's temperature where it stretches RoPE: logits x (0.1 ln s + 1)^2
            q = q * jnp.where(is_global, (0.1 * math.log(max(cfg.yarn_factor, 1)) + 1) ** 2, 1.0)
        W = cfg.sliding_window if cfg.sliding_window < q.shape[1] else 0  # else: all within reach
        # The kernel is the compile target's (common/attention.py): splash, cuDNN or blocked.
        scale = (cfg.query_scale or cfg.head_dim) ** -0.5
        full = partial(attend, q, k, v, impl=cfg.attention, segment_ids=segment_ids, scale=scale,
                       context=cfg.context_attention, cap=cfg.attn_softcap, with_max=max_logits)
        pick = (lambda a, b: a() if is_global else b()) if isinstance(is_global, bool) else partial(
            jax.lax.cond, is_global)  # a stack of one kind (Gemma 4's) knows it when traced
        out = pick(full, partial(full, window=W)) if W else full()
        o, top = out if max_logits else (out, None)  # QK-clip: the kernel's own row maxima, or
        stats = {"max_logit": top if top is not None else optim.max_logits(  # made again
            q, k, segment_ids=segment_ids, scale=scale, window=W, is_global=is_global)
                 } if max_logits else {}
        if cfg.attn_gate:  # Qwen3.5: a gate per head and channel
            o = o * jax.nn.sigmoid(mm("btd,dnh->btnh", h, w("wq_gate")))
        o = named_as(mm("btnh,nhd->btd", named_as(o, "attn"), w("wo")) + b("bo"), "o")
    x_BTD = x_BTD + (norm(o, "attn_post_norm") if cfg.sandwich_norm or cfg.post_norm else o)
    h = x_BTD if cfg.post_norm else norm(x_BTD, "mlp_norm")
    act = lambda g: jax.nn.gelu(g, approximate=True) if cfg.gelu else jax.nn.silu(g)
    u = named_as(mm("btd,df->btf", h, w("w_up")) + b("b_up"), "mlp_in")
    g = None if cfg.plain_mlp else named_as(mm("btd,df->btf", h, w("w_gate")), "mlp_in")
    u = act(u) if g is None else act(g) * u  # GPT-2's MLP has no gate
    y = named_as(mm("btf,fd->btd", u, w("w_down")) + b("b_down"), "mlp_out")
    x_BTD = x_BTD + (norm(y, "mlp_post_norm") if cfg.sandwich_norm or cfg.post_norm else y)
    if cfg.ple_dim:  # Gemma 4: the layer's own input, gated by the stream, normed, added
        g = act(jnp.einsum("btd,dp->btp", x_BTD, w("ple_gate"))) * ple_BTP
        x_BTD = x_BTD + norm(jnp.einsum("btp,pd->btd", g, w("ple_out")), "ple_post_norm")
    if cfg.layer_scale:  # a constant (HF's buffer), which training leaves as loaded
        x_BTD = x_BTD * jax.lax.stop_gradient(lp["layer_scale"]).astype(dt)
    return constrain(x_BTD, ACT_BTD), stats | ({"kv": kv} if keep_kv else {})


def constrain(x, spec: P):
    """Pin an activation's sharding when a mesh is set (jax.set_mesh); a no-op without one."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec)


def weights(lp: dict, dt, cfg: ModelConfig):
    """name -> the layer's f32 master weight in the compute dtype, keeping the master's sharding:
    FSDP gathers it in the compute dtype and reduce-scatters its gradient (not all-reduces)."""
    specs = param_specs(cfg)
    spec = {**specs.get("dense_layers", {}), **specs.get("global_layers", {}), **specs["layers"]}
    return lambda name: constrain(lp[name].astype(dt), P(*spec[name][1:]))


ACT_BTD = P(BATCH_AXES, "context", None)  # between blocks: batch and sequence split, d whole


# Quantized training (--model.quant, docs/quant.md): a big matmul's operands rounded to int8 or
# fp8 with scales taken from the tensors themselves, in the forward and both backward matmuls;
# the f32 master weights take the gradient straight through. The same in train_moe.py.
QUANT = {"int8": (jnp.int8, 127.0), "e4m3": (jnp.float8_e4m3fn, 448.0),
         "e5m2": (jnp.float8_e5m2, 57344.0)}
F32 = jnp.float32


def quantize(x, fmt: str, axes=None):
    """(q, scale), x ~ q scale: scale = max |x| over `axes` (None: all) over the format's largest
    value; int8 rounds to the nearest integer, fp8 casts (to nearest even)."""
    dt, top = QUANT[fmt]
    s = jnp.max(jnp.abs(x.astype(F32)), axis=axes, keepdims=True) / top
    y = jnp.clip(x / jnp.where(s > 0, s, 1.0), -top, top)
    return (jnp.round(y) if fmt == "int8" else y).astype(dt), jnp.where(s > 0, s, 1.0)


def _qdot(spec: str, a, b, fa: str, fb: str):
    """einsum(spec, a, b) of a and b quantized. int8: a scale per index the product keeps (token,
    output channel): they factor out of the int32 sum of int8 products; fp8: one per tensor."""
    (ia, ib), out = spec.split("->")[0].split(","), spec.split("->")[1]
    axes = lambda i, f: tuple(k for k, c in enumerate(i) if c not in out) if f == "int8" else None
    (qa, sa), (qb, sb) = quantize(a, fa, axes(ia, fa)), quantize(b, fb, axes(ib, fb))
    y = jnp.einsum(spec, qa, qb, preferred_element_type=jnp.int32) if fa == "int8" else (
        jnp.einsum(spec, qa.astype(a.dtype), qb.astype(a.dtype), preferred_element_type=F32))
    # the scales' contracted axes are 1 long: their einsum is their product, the output's shape
    return (y.astype(F32) * jnp.einsum(spec, sa, sb)).astype(a.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def qdot(spec: str, fmt: str, x, w):
    """einsum(spec, x, w) quantized with --model.quant `fmt` (`_qdot`), and so are dx = g w^T and
    dw = x^T g, each along its own contraction; fp8: e4m3, the gradient e5m2 (arXiv 2209.05433)."""
    return _qdot(spec, x, w, *(("e4m3",) * 2 if fmt == "fp8" else (fmt, fmt)))


def _qdot_bwd(spec: str, fmt: str, res, g):
    (x, w), ((ix, iw), out) = res, (spec.split("->")[0].split(","), spec.split("->")[1])
    fg, fw = ("e5m2", "e4m3") if fmt == "fp8" else (fmt, fmt)
    return (_qdot(f"{out},{iw}->{ix}", g, w, fg, fw).astype(x.dtype),
            _qdot(f"{ix},{out}->{iw}", x, g, fw, fg).astype(w.dtype))


qdot.defvjp(lambda spec, fmt, x, w: (qdot(spec, fmt, x, w), (x, w)), _qdot_bwd)


def matmuls(cfg: ModelConfig):
    """The big matmuls' einsum(spec, x, w): quantized with --model.quant, else as is."""
    return jnp.einsum if cfg.quant == "none" else (lambda spec, x, w: qdot(spec, cfg.quant, x, w))


def rms_norm(x, w, eps, b=None):  # with a bias b: LayerNorm (GPT-2's), the mean removed first
    # Statistics in float32 whatever the compute dtype: bfloat16 squares lose the small values.
    x32 = x.astype(jnp.float32)
    x32 = x32 if b is None else x32 - jnp.mean(x32, axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w + (0 if b is None else b)).astype(x.dtype)


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


# Qwen3.5's linear layers: Gated DeltaNet (Yang, Kautz and Hatamizadeh 2024, arXiv 2412.06464),
# train_moe.py's (tests/test_copies.py holds each copy equal).
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


def hidden(params: dict, tokens_BT, cfg: ModelConfig, *, segment_ids=None, positions=None,
           max_logits: bool = False, pipeline: tuple[int, int] | None = None):
    """Token ids -> (final-normed hidden states [B, T, D] in the compute dtype, per-layer stats:
    with max_logits, "max_logit" [L, N], each head's largest attention logit).
    Packed rows (several examples in one row) pass `segment_ids` [B, T], equal within an
    example, so that attention stays inside each example (a block-diagonal causal mask), and
    `positions` [B, T], restarting at 0 in each example, for RoPE. Without them: one sequence
    per row, positions 0..T-1. With `pipeline` (microbatches, repeats) and a `stage` mesh axis,
    the layers run as a pipeline (`pipelined`); embeddings and the final norm outside it."""
    dt = jnp.dtype(cfg.dtype)
    pos_BT = (jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
              if positions is None else positions)
    # With --mesh.context the sequence is reordered for its shards (common/attention.py);
    # the hidden states stay in that order, the loss reorders its targets to match.
    tokens_BT, segment_ids, pos_BT = to_context(tokens_BT, segment_ids, pos_BT)
    # Every token is looked up in each device's fsdp shard of d (the ids are small; a table
    # split on V: in its rows, summed), then the rows go to their batch shards: gathering the
    # table would put all of it, and its gradient, on every device (2 GiB each at 128k x 8192).
    tokens = constrain(tokens_BT, P(None, None))
    look = lambda table, ids=tokens: constrain(constrain(jnp.take(
        table.astype(dt), ids, axis=0), P(None, None, ("fsdp", "context"))), ACT_BTD)
    x = look(params["embed"])
    x = x + look(params["pos_embed"], constrain(pos_BT, P(None, None))) if cfg.learned_pos else x
    x = x * jnp.asarray(math.sqrt(cfg.d_model), dt) if cfg.embed_scale else x
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
    if cfg.ple_dim:  # Gemma 4: each layer's own input, from its token (a second table) and
        # from the embedding (a projection), each scaled as HF does, the projection normed
        scale = lambda x, c: x * jnp.asarray(c, dt)
        pr = scale(jnp.einsum("btd,dq->btq", x, params["ple_proj"].astype(dt)), cfg.d_model ** -.5)
        pr = rms_norm(pr.reshape(*pr.shape[:2], L, -1), gain(params["ple_norm"]), cfg.norm_eps)
        e = scale(look(params["ple_embed"]), math.sqrt(cfg.ple_dim)).reshape(pr.shape)
        ple_LBTP = jnp.moveaxis(scale(pr + e, 2 ** -0.5), 2, 0)
    remat = partial(train.remat, policy=cfg.remat, scan=cfg.scan_layers)
    # Unrolled (--model.no-scan-layers), each layer is compiled on its own.
    scan = partial(jax.lax.scan, unroll=not cfg.scan_layers)
    run = partial(block, cfg=cfg, pos_BT=pos_BT, segment_ids=segment_ids, max_logits=max_logits)
    if not (cfg.global_head_dim or cfg.linear_k_heads):
        layer = remat(lambda x, xs: run(x, xs[0], inv_freq=inv_freq, is_global=xs[1],
                                        ple_BTP=xs[2]))
        if pipeline and stages() > 1:  # each microbatch's own positions and segments
            layer = lambda x, xs, rows: block(x, xs[0], cfg, pos_BT=rows[0], segment_ids=(
                rows[1]), inv_freq=inv_freq, is_global=xs[1])
            x, stats = pipelined(layer, x, (params["layers"], is_global_L), (
                pos_BT, segment_ids), *pipeline, BATCH_AXES, scan, remat)
        else:
            x, stats = scan(layer, x, (params["layers"], jnp.asarray(is_global_L), ple_LBTP))
    else:  # Gemma 4: periods of n layers, n - 1 local then a global one, each kind its own
        # stack; the last kv_shared layers' periods attend over the keys and values of the
        # last earlier layer of their kind, which the periods before carry along (and remat
        # keeps per layer, as it keeps the stream)
        def kind(is_global, keep):
            return remat(lambda x, lp, ple, kv: run(x, lp, inv_freq=inv_freq[is_global],
                                                    is_global=is_global, kv=kv, keep_kv=keep,
                                                    ple_BTP=ple))

        def period(c, xs, shared=None):
            (loc, glob, ple), (x, kv), keep = xs, c, bool(S) and shared is None
            at = lambda i: None if ple is None else ple[i]

            def local(c, a):
                x, st = kind(False, keep)(c[0], *a, shared and shared[0])
                return (x, st.get("kv")), None
            (x, kv_l), _ = scan(local, (x, kv and kv[0]), (loc, at(slice(-1))))
            x, st = kind(True, keep)(x, glob, at(-1), shared and shared[1])
            return (x, kv and (kv_l, st["kv"])), None

        own, G = (L - S) // n, L // n
        by = lambda t, m: jax.tree.map(lambda a: a.reshape(m, -1, *a.shape[1:]), t)
        ple = [None, None] if ple_LBTP is None else jnp.split(by(ple_LBTP, G), [own])
        zeros = lambda K, H: (jnp.zeros((*x.shape[:2], K, H), dt),) * 2
        kv = (zeros(cfg.n_kv_heads, cfg.head_dim), zeros(cfg.global_kv_heads or cfg.n_kv_heads,
                                                         cfg.global_head_dim)) if S else None
        (x, kv), _ = scan(period, (x, kv), (by(params["layers"], own), params["global_layers"],
                                           ple[0]))
        if S:
            (x, _), _ = scan(partial(period, shared=kv), (x, None), (
                by(params["shared_layers"], G - own), params["shared_global_layers"], ple[1]))
        stats = {}
    bias = params.get("final_norm_bias")  # LayerNorm's (GPT-2)
    return rms_norm(x, gain(params["final_norm"]), cfg.norm_eps, bias), stats


def unembedding(params: dict, cfg: ModelConfig):
    return params["embed"].T if cfg.tie_embeddings else params["unembed"]


def forward(params: dict, tokens_BT, cfg: ModelConfig, *, segment_ids=None, positions=None):
    """Logits [B, T, V] in float32. Training never builds these whole: see `loss_fn`. Packed
    rows pass segment ids and positions (see `hidden`)."""
    h = from_context(hidden(params, tokens_BT, cfg, segment_ids=segment_ids,
                            positions=positions)[0], tokens_BT.shape[1])
    return _softcap(jnp.einsum("btd,dv->btv", h, unembedding(params, cfg).astype(h.dtype),
                               preferred_element_type=jnp.float32), cfg.final_softcap)


# ----------------------------------------------------------------------------------------------
# 4. Loss and train step
# ----------------------------------------------------------------------------------------------
def train_step(state: dict, batch, *, cfg: Config, tx, teacher: ModelConfig | None = None):
    """One optimiser step on a global batch (tokens [B, T+1], or packed SFT rows); returns the
    new state and metrics. Every microbatch divides its sums by the whole batch's weight, so
    their gradients add up to the gradient of the batch mean even when they hold different
    numbers of trained tokens (SFT). With --train.qk-clip-threshold tau, heads whose logits
    exceeded tau have their query and key projections scaled down after the update (MuonClip,
    see common/optim.py `qk_clip`)."""
    tau, (batch, top_k) = cfg.train.qk_clip_threshold, (
        batch if isinstance(batch, tuple) else (batch, None))  # distillation, offline
    loss = partial(loss_fn, cfg=cfg.model, n=loss_weight(batch), z_loss=cfg.train.z_loss,
                   max_logits=tau > 0, pipeline=(
                       cfg.train.microbatches, cfg.train.pipeline_repeats))
    if teacher or top_k is not None:  # distillation: the teacher's distribution a second
        # target, the teacher run here or its saved top-k read with the batch
        loss = partial(loss, distill=(state["teacher"] if teacher else top_k, teacher,
                                      cfg.distill))
    if cfg.data.format == "dpo":  # DPO
        # pairs, against the frozen start; each microbatch over the whole batch's pairs
        loss = partial(dpo_loss, cfg=cfg, ref=state.get("ref", state.get("base")),
                       n=jnp.sum(jnp.max(batch["weights"], axis=-1) > 0))
    on = lambda p, b: loss(lora.weights(state, cfg.lora, p), b)  # LoRA: the adapters trained
    # Pipelined, the microbatches are the pipeline's, in one pass: it needs them all at once.
    grads, aux = train.accumulate(jax.grad(on, has_aux=True), state["params"], batch,
                                  1 if stages() > 1 else cfg.train.microbatches, BATCH_AXES)
    clip = partial(optim.qk_clip, tops={"layers": aux.get("max_logit")}, tau=tau,
                   q=("wq", "bq"), k=("wk", "bk")) if tau else None
    new, metrics = train.update(tx, grads, state, aux["ce"], after=clip)
    clipped = {"max_attn_logit": jnp.max(aux["max_logit"])} if tau > 0 else {}
    metrics |= aux.get("dpo", {}) | {k: aux[k] for k in ("distill_kl",) if k in aux}
    return new, metrics | clipped | {"loss": aux["ce"],
                                     "lr": make_schedule(cfg.train)(state["step"])}


# While a batch has fewer tokens than the vocabulary, the loss is vocabulary-parallel: the
# unembedding split on V over fsdp too and the hidden states gathered over fsdp instead
# ([B, T, D] is then smaller than [D, V]), so no device holds the whole weight or its float32
# gradient; the logsumexp and dh add up over the V shards. Larger batches gather the weight.
VOCAB_DV, LOSS_BTD = P(None, ("tensor", "fsdp")), P(("data", "context"), None, None)


def loss_fn(params, batch, cfg: ModelConfig, *, n=None, z_loss: float = 0.0,
            max_logits: bool = False, distill=None, pipeline=None):
    """The objective: the batch's targets' cross-entropy, each times its weight, over n

        ce = sum_t w_t (lse_t - l_t[y_t]) / n,   objective = ce + z_loss sum_t w_t lse_t^2 / n

    for logits l_t = h_t W_unembed and lse_t = logsumexp(l_t); n defaults to the batch's total
    weight (`loss_weight`), so both are means. The z term (PaLM) keeps the softmax normaliser
    near 1. Returns (objective, {"ce": ce, `hidden`'s stats}). The [B, T, V] logits never exist
    at once: `cross_entropy` takes `loss_chunk` positions at a time (with a 128k vocabulary,
    gigabytes become megabytes), and with loss_impl "fused" each chunk's gradient is made with
    its loss (`_ce_fused`). With `distill` (teacher parameters, ModelConfig, DistillConfig), the
    objective is (1 - weight) that + weight `distill_kl`."""
    inputs, targets, weights, segment_ids, positions = split_batch(batch)
    h_BTD, stats = hidden(params, inputs, cfg, segment_ids=segment_ids, positions=positions,
                          max_logits=max_logits, pipeline=pipeline)
    # Each context shard's positions as rows of their own: the loss's chunks stay local.
    h_BTD, targets, weights = fold_context(h_BTD, *to_context(targets, weights))
    w_DV = unembedding(params, cfg).astype(h_BTD.dtype)
    if targets.size <= cfg.vocab_size:  # cast where the master is: dW returns there in bf16
        # (else the update moves its moments to V); not a tied table (Gemma: +1.5 GiB a chip)
        w_DV = constrain(w_DV if cfg.tie_embeddings else constrain(
            w_DV, param_specs(cfg)["unembed"]), VOCAB_DV)
        h_BTD, chunk = constrain(h_BTD, LOSS_BTD), cfg.loss_chunk
    else:  # the unembedding gathered: chunks large enough that summing dW is not the cost
        chunk = train.ce_chunk(cfg.loss_chunk, *targets.shape, cfg.d_model,
                               (*BATCH_AXES, "context"))
    scan = _ce_fused if cfg.loss_impl == "fused" else _ce_remat
    obj, ce = scan(partial(cross_entropy, z_loss=z_loss, cap=cfg.final_softcap), h_BTD, w_DV,
                   targets, weights, chunk, not cfg.scan_layers)
    n = loss_weight(batch) if n is None else n
    if distill:  # distillation: the teacher run here, or its saved top-k (logits, token ids)
        (t, tm, d), sg = distill, jax.lax.stop_gradient
        t = (sg(fold_context(hidden(t, inputs, tm, segment_ids=segment_ids, positions=positions)[
            0])[0]), sg(unembedding(t, tm)), tm.final_softcap) if tm else fold_context(*t)
        kl = distill_kl(h_BTD, w_DV, t, weights, d, cfg.final_softcap, cfg.loss_chunk)
        obj, stats = (1 - d.weight) * obj + d.weight * kl, stats | {"distill_kl": kl / n}
    return obj / n, stats | {"ce": ce / n}


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


def split_batch(batch):
    """(inputs, targets, weights, segment_ids, positions) of a batch, each [B, T] or None. A
    pre-training batch is token windows [B, T+1]: every next token is a target, weight 1. SFT: a
    batch is a dict of packed rows (common/data.py, `Packed`): its weights are 0 on prompts and
    padding, and packed rows carry segment ids and per-example positions."""
    if isinstance(batch, dict):  # SFT
        return (batch["inputs"], batch["targets"], batch["weights"], batch.get("segment_ids"),
                batch.get("positions"))
    return batch[:, :-1], batch[:, 1:], None, None, None


def loss_weight(batch):
    """What the summed loss is divided by: the batch's total target weight (its number of
    trained tokens, or of examples under --data.loss-average example; B*T in pre-training)."""
    if isinstance(batch, dict):  # SFT
        return jnp.sum(batch["weights"])
    return batch.shape[0] * (batch.shape[1] - 1)


def sequence_logps(params, batch, cfg: ModelConfig):  # DPO
    """Each row's log-probability of its chosen (segment 1) and rejected (segment 2) answer,
    the sums of log p(target) over their weighted targets, [B, 2], and their counts [B, 2]. The
    logits are made `loss_chunk` positions at a time (each chunk's rebuilt in the backward)."""
    inputs, targets, weights, segment_ids, positions = split_batch(batch)
    h_BTD = from_context(hidden(params, inputs, cfg, segment_ids=segment_ids,
                                positions=positions)[0], inputs.shape[1])
    w_DV = unembedding(params, cfg).astype(h_BTD.dtype)

    def chunk(_, xs):
        z_BCV = chunk_logits(xs[0], w_DV, cfg.final_softcap)
        tgt = jnp.sum(z_BCV * jax.nn.one_hot(xs[1], w_DV.shape[1], dtype=z_BCV.dtype), axis=-1)
        return None, tgt - jax.nn.logsumexp(z_BCV, axis=-1)
    _, lp_nBC = jax.lax.scan(jax.checkpoint(chunk), None, _chunked(cfg.loss_chunk, h_BTD, targets))
    on_BTS = (segment_ids[..., None] == jnp.arange(1, 3)) * weights[..., None]
    lp_BT = lp_nBC.swapaxes(0, 1).reshape(targets.shape)
    return jnp.einsum("bt,bts->bs", lp_BT, on_BTS), jnp.sum(on_BTS, axis=1)


def dpo_loss(params, batch, cfg: Config, ref=None, n=1):  # DPO
    """The preference objective of a batch of pairs (one to a row: common/data.py `pack_pairs`),
    summed over pairs and divided by n. With s = log pi(answer | prompt) (`sequence_logps`), of
    the policy and of the frozen start `ref` (no gradient), and the chosen (w) and rejected (l)
    answers' rewards r:

        dpo    r = beta (s - s_ref)    -log sigmoid(r_w - r_l)                (Rafailov 2023)
        ipo    r = beta (s - s_ref)    ((r_w - r_l) / beta - 1 / (2 beta))^2   (Azar 2023)
        simpo  r = simpo_beta s / |y|  -log sigmoid(r_w - r_l - simpo_gamma)   (Meng 2024)

    (SimPO: length-normalised, no reference.) Returns (objective, {"ce": it, "dpo": figures}):
    the reward margin r_w - r_l, the accuracy (the share of r_w > r_l, ties counting half: 0.5
    while the policy is the reference) and "kl_chosen", the mean
    over chosen answers of log pi - log pi_ref per token: the policy's drift on the chosen text
    (an estimate of KL(pi || pi_ref) only where the text is pi's own samples)."""
    d, m = cfg.dpo, cfg.model
    s_BS, count_BS = sequence_logps(params, batch, m)
    ref_BS = batch["ref_logps"] if "ref_logps" in batch else s_BS if ref is None else (
        jax.lax.stop_gradient(sequence_logps(ref, batch, m)[0]))  # precomputed, or made here
    beta = d.simpo_beta if d.loss == "simpo" else d.beta
    r_BS = beta * (s_BS / jnp.maximum(count_BS, 1) if d.loss == "simpo" else s_BS - ref_BS)
    margin = r_BS[:, 0] - r_BS[:, 1]
    loss = {"dpo": lambda: -jax.nn.log_sigmoid(margin), "simpo": lambda: -jax.nn.log_sigmoid(
        margin - d.simpo_gamma), "ipo": lambda: (margin / beta - 0.5 / beta) ** 2}[d.loss]()
    mean = lambda x: jnp.sum(jnp.where(count_BS[:, 0] > 0, x, 0.0)) / n  # an empty row: no pair
    kl = (s_BS - ref_BS)[:, 0] / jnp.maximum(count_BS[:, 0], 1)
    return mean(loss), {"ce": mean(loss), "dpo": {
        "reward_margin": mean(margin), "accuracy": mean((margin > 0) + 0.5 * (margin == 0))} | (
        {"kl_chosen": mean(kl)} if ref is not None else {})}


def held_out_sums(params, batch, ref, cfg: Config) -> dict:
    """A held-out batch's sums, added up over the split: its weighted cross-entropy and weight
    "n"; DPO: the pairs' loss and figures (against `ref`) and their number."""
    if cfg.data.format == "dpo":  # DPO
        aux = dpo_loss(params, batch, cfg, ref)[1]
        return {"eval_loss": aux["ce"], "n": jnp.sum(jnp.max(batch["weights"], axis=-1) > 0)
                } | {f"eval_{k}": v for k, v in aux["dpo"].items()}
    t = cfg.train
    return {"eval_loss": loss_fn(params, batch, cfg.model, n=1, pipeline=(
        t.microbatches, t.pipeline_repeats))[1]["ce"], "n": loss_weight(batch)}


def distill_kl(h_BTD, w_DV, teacher, wt_BT, d: DistillConfig, cap, chunk: int):  # distillation
    """sum_t w_t tau^2 KL(p_teacher || p_student), each p = softmax(logits / tau) (Hinton et al.
    2015: tau^2 keeps the gradient's scale as tau grows). `teacher`: its hidden states, its
    unembedding and soft-cap, run here (cut to its top-k with --distill.top-k), or its saved
    top-k (logits [B, T, k], token ids): its distribution renormalised over those k tokens,
    the student's log-probs of them. `loss_chunk` positions at a time, rebuilt in backward."""
    tau, online = d.temperature, len(teacher) == 3

    def one(_, xs):
        h, wt, *t = xs
        lps = jax.nn.log_softmax(chunk_logits(h, w_DV, cap) / tau)
        zt, idx = (chunk_logits(t[0], *teacher[1:]), None) if online else t
        zt, idx = jax.lax.top_k(zt, d.top_k) if online and d.top_k else (zt, idx)
        lps = lps if idx is None else jnp.take_along_axis(lps, idx, axis=-1)
        lpt = jax.nn.log_softmax(zt / tau)
        kl = jnp.sum(jnp.exp(lpt) * (lpt - lps), axis=-1)
        return None, jnp.sum(kl if wt is None else kl * wt)
    xs = _chunked(chunk, h_BTD, wt_BT, *(teacher[:1] if online else teacher))
    return tau ** 2 * jnp.sum(jax.lax.scan(jax.checkpoint(one), None, xs)[1])


def make_schedule(t: TrainConfig):
    return optim.lr_schedule(t.schedule, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio,
                             t.decay_fraction)


# Muon's matrices in the [L, ...] stacks: name -> (input axes, output axes); the rest: AdamW.
MUON_DIMS = {"wq": ((1,), (2, 3)), "wk": ((1,), (2, 3)), "wv": ((1,), (2, 3)),
             "wo": ((1, 2), (3,)), "w_gate": ((1,), (2,)), "w_up": ((1,), (2,)),
             "w_down": ((1,), (2,)), "ple_gate": ((1,), (2,)), "ple_out": ((1,), (2,)),
             **dict.fromkeys(("wq_gate", "lin_q", "lin_k", "lin_b", "lin_a"), ((1,), (2, 3))),
             "lin_v": ((1,), (2, 3, 4)), "lin_z": ((1,), (2, 3, 4)), "lin_wo": ((1, 2), (3,))}


MATRICES = {"embed", "unembed", "ple_embed", "ple_proj", *MUON_DIMS}  # decayed; weight_dtype


def make_optimizer(t: TrainConfig, specs: dict | None = None):
    return optim.optimizer(t.optimizer, make_schedule(t), b1=t.b1, b2=t.b2,
                           weight_decay=t.weight_decay, clip_norm=t.clip_norm,
                           decayed=MATRICES, muon_dims=MUON_DIMS, muon_dtype=t.muon_dtype,
                           specs=specs, mu_dtype=t.mu_dtype, nu_dtype=t.nu_dtype)


def param_specs(cfg: ModelConfig) -> dict:
    return train.table_specs(_param_table(cfg))


def _init(cfg: ModelConfig, key: jax.Array) -> dict:
    return train.table_init(_param_table(cfg), key)


def init_params(cfg: ModelConfig, key: jax.Array, mesh=None) -> dict:
    """Float32 master weights, each created directly in its shards (never whole on one device)."""
    out = named(mesh, param_specs(cfg)) if mesh is not None else None
    return jax.jit(partial(_init, cfg), out_shardings=out)(key)


def train_state(cfg: Config, mesh, teacher: ModelConfig | None = None) -> train.TrainState:
    """{params, opt_state, step} of this model and optimiser on `mesh` (see common/train.py);
    DPO and IPO: "ref" too, the frozen start, never optimised (passed through the step)."""
    ref, lora = False, None
    ref = cfg.data.format == "dpo" and cfg.dpo.loss != "simpo" and not (  # DPO
        cfg.lora.rank or cfg.dpo.precompute_ref)
    if cfg.lora.rank:  # LoRA: the adapters trained, the model frozen (and DPO's reference)
        lora = lora_table(_param_table(cfg.model), MUON_DIMS, cfg.lora), cfg.train.seed
    frozen = {"teacher": (partial(_init, teacher), param_specs(teacher))} if teacher else None
    specs = param_specs(cfg.model)  # --mesh.stage: each stage holds its share of the layers
    if mesh.shape["stage"] > 1:
        specs["layers"] = {k: P("stage", *s[1:]) for k, s in specs["layers"].items()}
    return train.TrainState(partial(_init, cfg.model), specs, make_optimizer(cfg.train, specs),
                            mesh, ref=ref, lora=lora, frozen=frozen, cast=partial(
                                train.cast_matrices, dtype=cfg.train.weight_dtype,
                                matrices=MATRICES), offload=cfg.train.offload_opt_state)


def count_params(cfg: ModelConfig) -> int:
    return train.table_count(_param_table(cfg))


def _chunked(chunk: int, *xs_BT):
    def cut(x):
        if x is None:
            return None
        B, T = x.shape[:2]
        C = min(chunk, T)
        return x.reshape(B, T // C, C, *x.shape[2:]).swapaxes(0, 1)
    return [cut(x) for x in xs_BT]


def chunk_logits(h_BCD, w_DV, cap: float):  # float32, soft-capped (Gemma)
    return _softcap(jnp.einsum("bcd,dv->bcv", h_BCD, w_DV.astype(h_BCD.dtype),
                               preferred_element_type=jnp.float32), cap)


def _softcap(logits, cap: float):
    return cap * jnp.tanh(logits / cap) if cap else logits   # Gemma 2's final soft-cap


def _ce_remat(ce_fn, h_BTD, w_DV, t_BT, wt_BT, chunk: int, unroll: bool = False):
    """ce_fn's sums over the sequence's chunks, each chunk's logits rebuilt in the backward."""
    one = jax.checkpoint(lambda h_BCD, t_BC, wt_BC: ce_fn(h_BCD, w_DV, t_BC, wt_BC, grad=False),
                         prevent_cse=False)
    zero = jnp.zeros((), jnp.float32)
    sums, _ = jax.lax.scan(lambda acc, xs: (jax.tree.map(jnp.add, acc, one(*xs)), None),
                           (zero, zero), _chunked(chunk, h_BTD, t_BT, wt_BT), unroll=unroll)
    return sums


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


def validate(cfg: Config, n_devices: int) -> None:
    """Every check that needs no compilation, so a bad launch fails in a second."""
    m, t = cfg.model, cfg.train
    check_ranges(cfg)
    mesh = resolve(cfg.mesh, n_devices, max(1, math.prod(cfg.mesh.dcn())))
    check_model(m, mesh, "--train.qk-clip-threshold", t.qk_clip_threshold)
    train.check_batch(t.batch_size, t.microbatches, mesh)
    need(t.seq_len <= m.max_seq_len, f"--train.seq-len {t.seq_len} exceeds the model's maximum "
         f"--model.max-seq-len {m.max_seq_len}.")
    train.check_sequence(mesh, t.seq_len, m.loss_chunk, t.qk_clip_threshold,
                         heads=(m.context_attention, m.n_heads, m.n_kv_heads))
    train.check_profile(t.profile_steps, t.steps)
    check_pipeline(mesh, t.microbatches, t.pipeline_repeats, (  # the pipeline
        f"--model.n-layers {m.n_layers}", m.n_layers), [f for f, on in (
        ("--model.global-head-dim (Gemma 4's stacks)", m.global_head_dim), (
        "--model.ple-dim", m.ple_dim), ("--mesh.context", mesh.context * mesh.dcn_context > 1), (
        "--train.qk-clip-threshold", t.qk_clip_threshold), ("--lora.rank", cfg.lora.rank), (
        "--data.format dpo", cfg.data.format == "dpo"), ("--distill", cfg.distill.teacher or (
            cfg.distill.logits)), ("--model.linear-k-heads (DeltaNet)", m.linear_k_heads)) if on])
    need(not (m.linear_k_heads and (cfg.data.format == "dpo" or cfg.data.format == "sft" and  # SFT
              cfg.data.pack)), f"--model.linear-k-heads {m.linear_k_heads} with --data.format "
         f"{cfg.data.format} (packed rows): DeltaNet's state would run from one example into the "
         "next (it reads no segment ids yet); use --data.no-pack for SFT; DPO waits for it.")
    need(not (cfg.data.format == "sft" and cfg.data.pack and m.attention == "cudnn"),  # SFT
         "--model.attention cudnn cannot mask packed SFT rows (JAX's cuDNN path takes causal "
         "and length masks only); use --model.attention auto or xla, or --data.no-pack.")
    need(m.quant == "none" or not m.linear_k_heads, f"--model.quant {m.quant} with --model.linear"
         "-k-heads: Gated DeltaNet's layers have no quantized path; use --model.quant none.")
    lora.check_lora(cfg.lora, t.optimizer, t.qk_clip_threshold)  # LoRA
    need(cfg.data.format != "dpo" or (cfg.init_from or cfg.init_from_hf) and m.attention != (  # DPO
        "cudnn") and not t.qk_clip_threshold, "--data.format dpo needs --init-from RUN_DIR or "
         "--init-from-hf FOLDER (the model to tune, and the frozen reference), attention that "
         "masks segments (not --model.attention cudnn) and no --train.qk-clip-threshold.")


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
# 5. Main and the training loop
# ----------------------------------------------------------------------------------------------
def main(cfg: Config) -> dict:
    hf_config, model = hf.model_source(cfg)  # --init-from-hf's config, --init-from's model
    cfg = train.with_model(cfg, config_from_hf(*hf_config) if hf_config else model)
    train.start(cfg.quiet)
    devices = train.devices(cfg.compile_topology, cfg.compile_slices, cfg.dry_run)
    validate(cfg, len(devices))
    mesh, tc, m, pf = make_mesh(cfg.mesh, devices), cfg.train, cfg.model, devices[0].platform
    teacher = teacher_model(cfg, m)  # distillation
    st = train_state(cfg, mesh, teacher)
    step_fn = st.jit(partial(train_step, cfg=cfg, tx=st.tx, teacher=teacher))
    check_kernel(m.attention, pf, tc.seq_len)
    kernel = choose(m.attention, pf, dtype=m.dtype, T=tc.seq_len, H=m.head_dim, V=m.head_dim,
                    cap=m.attn_softcap, segments=cfg.data.format == "dpo"
                    or cfg.data.format == "sft" and cfg.data.pack,
                    context=(mesh.shape["context"], m.context_attention))
    log(f"model {count_params(m) / 1e6:.1f}M parameters, {kernel} attention | mesh "
        f"{describe(mesh)} | {len(devices)} {pf} devices, {jax.process_count()} process(es)")
    pipe = pipeline_report(mesh, tc.pipeline_repeats, tc.microbatches, m.n_layers, "the "
                           "embeddings on every stage, the final norm, head and loss on 1/S"
                           " of the rows each")
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, (tc.batch_size, tc.seq_len + 1),
                                               dtype=np.int32)
    if cfg.data.format == "dpo":  # DPO: random pairs, one a row, each answer ending its half
        B, T, h = tc.batch_size, tc.seq_len, np.arange(tc.seq_len) % (tc.seq_len // 2)
        row = lambda x, dt: np.broadcast_to(x, (B, T)).astype(dt)
        tokens = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], positions=row(h, np.int32),
                      weights=row(h >= T // 4, np.float32),
                      segment_ids=row(1 + (np.arange(T) >= T // 2), np.int32))
    if cfg.distill.logits and not cfg.distill.save:  # distillation, offline: random top-k
        k = (tc.batch_size, tc.seq_len, cfg.distill.top_k)
        tokens = (tokens, (np.ones(k, np.float32), np.zeros(k, np.int32) + np.arange(k[2])))
    if m.remat == "auto":  # the policy that keeps the most and fits, from compiled steps
        with_remat = lambda r: replace(cfg, model=replace(m, remat=r))
        cfg = with_remat(train.auto_remat(lambda r: st.jit(partial(
            train_step, cfg=with_remat(r), tx=st.tx, teacher=teacher)), st.abstract(),
            train.put(tokens, mesh, BATCH_AXES, True), mesh))
        m, step_fn = cfg.model, st.jit(partial(train_step, cfg=cfg, tx=st.tx, teacher=teacher))
    if cfg.dry_run:  # on random tokens, as --bench: no data read, no checkpoint written
        return train.dry_run(step_fn, st.abstract(), train.put(tokens, mesh, BATCH_AXES, True),
                             mesh, count_params(m), attention=kernel, remat=m.remat, **pipe)
    with jax.set_mesh(mesh):
        if cfg.bench:
            return train.bench(step_fn, st.fresh(jax.random.key(tc.seed)),
                               train.put(tokens, mesh, BATCH_AXES), cfg.bench,
                               tokens_per_step=tc.batch_size * tc.seq_len,
                               flops_per_token=flops_per_token(m, tc.seq_len),
                               peak=train.peak_flops_per_device(tc.peak_tflops))
        return train_loop(cfg, mesh, st, step_fn)


def train_loop(cfg: Config, mesh, st: train.TrainState, step_fn) -> dict:
    tc, mc, data, sft, dpo = cfg.train, cfg.model, cfg.data, False, False
    data, sft = init_data_config(cfg), cfg.data.format != "text"  # SFT
    dpo = cfg.data.format == "dpo"  # DPO
    ds = load_dataset(data, seq_len=tc.seq_len)
    if cfg.init_from_hf and (note := hf.check_tokenizer(
            cfg.init_from_hf, ds.tokenizer_path, f"--data.path {cfg.data.path!r}")):
        log(note)
    train.check_vocab(ds.vocab_size, mc.vocab_size)
    batch_sh = named(mesh, P(BATCH_AXES, None))
    batch = partial(get_batch, batch_size=tc.batch_size, seq_len=tc.seq_len, sharding=batch_sh)
    if cfg.distill.save:  # distillation, offline: the teacher's top-k of the batches, once
        return save_top_k(cfg, st, teacher_model(cfg, mc), lambda step: batch(
            ds.train, seed=cfg.data.seed, step=step))
    sums_fn = jax.jit(partial(held_out_sums, cfg=cfg))
    key = jax.random.key(tc.seed + 7)
    tasks = DuringTraining(tc, mc, forward, mesh, ds.tokenizer_path)  # --train.eval-tasks

    def evaluate(params) -> dict:
        """Held-out loss (SFT: the whole split, each trained token once; held-out answers too.
        DPO: each pair once; the preference figures too), and the scores of --train.eval-tasks."""
        batches = (batch(ds.eval, seed=cfg.data.seed + 1, step=i) for i in range(tc.eval_batches))
        if sft:  # SFT
            batches = held_out_batches(ds.eval, tc.batch_size, batch_sh)
        if refs:  # DPO, precomputed: each held-out batch's reference log-probs with it
            batches = [b | {"ref_logps": train.put(r, mesh, BATCH_AXES)} for b, r in zip(
                batches, refs["eval"])]
        got = jax.device_get([sums_fn(params, b, state.get("ref", state.get("base")))
                              for b in batches])
        out = {k: float(sum(g[k] for g in got) / sum(g["n"] for g in got))
               for k in sorted(got[0], key=lambda k: k != "eval_loss") if k != "n"}
        line = " | ".join(f"{k} {v:.3f}" for k, v in out.items())
        if sft and (samples := sft_samples(params, ds, cfg, mesh, key)):  # SFT
            out["exact_match"] = np.mean([r["sample"] == r["expected"] for r in samples])
            line += (f" | held-out answers exactly right {100 * out['exact_match']:.0f}% of "
                     f"{len(samples)}")
            line += "".join(f"\n  held-out {i} | {r['prompt'][-100:]!r} -> {r['sample']!r} "
                            f"(data: {r['expected']!r})" for i, r in enumerate(samples[:3], 1))
            out["samples"] = samples
        log(f"eval step {loop.step} | {line}")
        return out | tasks(params, loop.step)

    with train.Run(cfg, tc.profile_steps, defaults=Config(), keep_weights=(
            f"To keep its weights under new settings: a new --run-dir with --init-from "
            f"{cfg.run_dir}.")) as run:
        state, start = run.resume(st.abstract())
        if state is None:  # a new run: from --init-from-hf, --init-from, or random weights
            teacher = {"teacher": hf.frozen_params(cfg.distill.teacher, "--distill.teacher",
                       st.abstract()["teacher"], load_hf)} if st.frozen else {}  # distillation
            state = st.from_params(load_hf(cfg.init_from_hf, mesh)[1] if cfg.init_from_hf else
                                   train.restore_params(cfg.init_from, st.abstract()[st.model])
                                   if cfg.init_from else init_params(mc, jax.random.key(tc.seed),
                                                                     mesh), **teacher)
        loop = train.Loop(run, start, tc.steps, log_every=tc.log_every,
                          eval_every=tc.eval_every, tokens_per_step=tc.batch_size * tc.seq_len,
                          max_bad_steps=tc.max_bad_steps, peak_tflops=tc.peak_tflops,
                          flops_per_token=flops_per_token(mc, tc.seq_len), show=lambda r: (
                              f"loss {r['loss']:.3f} | lr {r['lr']:.1e} | grad_norm "
                              f"{r['grad_norm']:.2f}" + (f" | max_logit {r['max_attn_logit']:.1f}"
                                                         if tc.qk_clip_threshold else "")))
        if dpo:  # DPO
            loop.show = lambda r, show=loop.show: show(r) + "".join(
                f" | {k} {r[k]:.3f}" for k in ("accuracy", "reward_margin", "kl_chosen") if k in r)
        refs = {}
        if dpo and cfg.dpo.precompute_ref:  # DPO: the start's log-probs of every pair, once
            lps = jax.jit(lambda p, b: sequence_logps(p, b, mc)[0])
            w0 = lora.weights(state, cfg.lora)
            refs = train.precomputed(cfg.run_dir, "ref_logps.npz", start, lambda: {
                "train": [lps(w0, batch(ds.train, seed=cfg.data.seed, step=s))
                          for s in range(tc.steps)], "eval": [lps(w0, b) for b in (
                              held_out_batches(ds.eval, tc.batch_size, batch_sh))]})
            need(len(refs["train"]) >= tc.steps, f"--train.steps {tc.steps}: the reference's "
                 f"log-probs were made for {len(refs['train'])} steps; train longer in a new run.")
        if start == 0 and cfg.init_from and tc.steps > 0:  # the starting point, to compare
            loop.eval(evaluate(lora.weights(state, cfg.lora)))
        next_batch = partial(batch, ds.train, seed=cfg.data.seed)
        if refs:  # DPO, precomputed: each batch with its reference log-probs
            next_batch = lambda step, f=next_batch: f(step=step) | {"ref_logps": train.put(
                refs["train"][step], mesh, BATCH_AXES)}
        if cfg.distill.logits:  # distillation, offline: each batch with the teacher's top-k
            read = train.top_k_reader(cfg.distill.logits, top_k_meta(cfg), mesh, BATCH_AXES)
            next_batch = lambda step, f=next_batch: (f(step=step), read(step))
        step_fn = loop.compile(step_fn, state, next_batch(step=start))
        for step in loop:
            state, metrics = step_fn(state, next_batch(step=step))
            loop.log(metrics)
            if loop.eval_due:
                loop.eval(evaluate(lora.weights(state, cfg.lora)))
            loop.checkpoint(state)

        run.ckpt.wait()
        if tc.sample_tokens > 0 and not sft:  # SFT samples at eval
            prompt = ds.encode(tc.sample_prompt)
            out = sample(lora.weights(state, cfg.lora), [prompt], cfg, mesh, key, ds.vocab_size)[0]
            log("sample:\n" + ds.decode(prompt + out))
        end = int(jax.device_get(state["step"]))
        out = loop.summary(end, f"{tc.batch_size} x {tc.seq_len}") | {"state": state}
        if sft:  # SFT
            out["packing"] = {"train": ds.train.stats, "eval": ds.eval.stats}
        return out


def sample(params, prompts: list[list[int]], cfg: Config, mesh, key, n_valid: int):
    """--train.sample-tokens tokens after each prompt, at --train.temperature (0 = greedy)."""
    t, m = cfg.train, cfg.model
    buf, seg, pos, width = sampling.prompt_rows(prompts, t.sample_tokens,
                                                min(t.seq_len, m.max_seq_len), mesh, BATCH_AXES)

    @jax.jit
    def decode(params, buf, seg, pos, key):  # every new token in one program
        def one(i, carry):
            z_BTV = forward(params, carry[0], m, segment_ids=seg, positions=pos)
            return sampling.next_token(z_BTV, *carry, i, temperature=t.temperature, n_valid=n_valid)
        return jax.lax.fori_loop(width, width + t.sample_tokens, one, (buf, key))[0]
    return sampling.completions(decode(params, buf, seg, pos, key), len(prompts), width)


def sft_samples(params, ds: SFTDataset, cfg: Config, mesh, key) -> list[dict]:  # SFT
    """Answers to the first --train.eval-samples held-out prompts (greedy at --train.temperature
    0), cut at EOS, beside the answers in the data; the prompts are decoded as one batch."""
    examples = ds.eval_examples[:cfg.train.eval_samples]
    if not examples or cfg.train.sample_tokens < 1:
        return []
    outs = sample(params, [ex.prompt for ex in examples], cfg, mesh, key, ds.vocab_size)
    cut = lambda ids: ds.decode(ids[:ids.index(ds.eos_id)] if ds.eos_id in ids else ids)
    return [{"prompt": ds.decode(ex.prompt), "sample": cut(out),
             "expected": cut(ex.answer.tolist())} for ex, out in zip(examples, outs)]


def teacher_model(cfg: Config, student: ModelConfig) -> ModelConfig | None:  # distillation
    """--distill.teacher's model (a run's config.json, or a HuggingFace folder's), checked."""
    d, t = cfg.distill, cfg.distill.teacher
    need(not d.save or t and d.top_k and d.logits and jax.process_count() == 1, "--distill.save "
         "writes --distill.teacher's --distill.top-k (k > 0) logits to --distill.logits, from "
         "one process: give all three.")
    need(not d.logits or d.save or cfg.train.microbatches == 1 and cfg.data.format != "dpo",
         "--distill.logits (read): the saved top-k come whole with each batch, of text or SFT "
         "data; set --train.microbatches 1, and not --data.format dpo.")
    if not t or d.logits and not d.save:
        return None
    m = hf.frozen_model(t, "--distill.teacher", config_from_hf, ModelConfig)
    need(m.vocab_size == student.vocab_size and cfg.data.format != "dpo", f"--distill.teacher "
         f"{t}: its vocabulary ({m.vocab_size}) must be the student's ({student.vocab_size}), "
         "the same tokenizer, and the data pre-training or SFT (not --data.format dpo).")
    return replace(m, dtype=student.dtype, remat=student.remat, attention=student.attention)


def save_top_k(cfg: Config, st: train.TrainState, teacher: ModelConfig, batches):  # distillation
    """--distill.save (offline distillation, MaxText's recipe): the teacher's --distill.top-k
    logits and token ids of each of the run's --train.steps batches (`batches(step)`, the same
    the student draws), one pass, to --distill.logits as [B, T, k] .npy files per step."""
    d, m = cfg.distill, teacher

    @jax.jit
    def top(tp, batch):
        (inputs, _, _, segment_ids, positions), w = split_batch(batch), unembedding(tp, m)
        h = from_context(hidden(tp, inputs, m, segment_ids=segment_ids, positions=positions)[0],
                         inputs.shape[1])
        z = lambda _, h: (None, jax.lax.top_k(chunk_logits(h, w, m.final_softcap), d.top_k))
        return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(*inputs.shape, -1), jax.lax.scan(
            z, None, _chunked(m.loss_chunk, h)[0])[1])
    tp = hf.frozen_params(d.teacher, "--distill.teacher", st.abstract()["teacher"], load_hf)
    for step in range(cfg.train.steps):
        out = dict(zip(("values", "indices"), map(train.fetch, top(tp, batches(step)))))
        train.write_top_k(d.logits, step, out, top_k_meta(cfg))
    log(f"distill: the teacher's top-{d.top_k} of {cfg.train.steps} batches -> {d.logits}")
    return {"steps": cfg.train.steps, "logits": d.logits}


def top_k_meta(cfg: Config) -> dict:  # distillation, offline: what the saved top-k are of
    return {"top_k": cfg.distill.top_k, "batch_size": cfg.train.batch_size, "seq_len": cfg.train.
            seq_len, "data": [cfg.data.path, cfg.data.format, cfg.data.seed]}


def init_data_config(cfg: Config) -> DataConfig:  # SFT
    """SFT, DPO: without --data.tokenizer, tokenize as --init-from's run did (a path resolved here,
    not stored: the embedded corpus's cache path differs between machines and Pythons), or with
    --init-from-hf's tokenizer.json (as transformers does; its chat template with it)."""
    if cfg.data.format == "text" or cfg.data.tokenizer or not (cfg.init_from or cfg.init_from_hf):
        return cfg.data
    return replace(cfg.data, tokenizer=hf.tokenizer(cfg.init_from_hf, prefer_json=True)[0]
                   if cfg.init_from_hf else run_tokenizer(cfg.init_from))


# ----------------------------------------------------------------------------------------------
# 6. HuggingFace in and out
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
# Qwen3.5's gated attention: each head's query, then its gate, in one projection
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


# export-hf: an SFT run's tokenizer is its --init-from's (common/data.py `run_tokenizer`).
def export_hf(run_dir: str, out: str, step: int = -1, dtype: hf.ExportDtype = "float32",
              model_type: Literal[("", *HF_ARCHITECTURES)] = "", max_shard_gb: float = 5.0,
              adapter: bool = False):
    with hf.run_config(run_dir) as saved:  # unreadable: a ConfigError naming it
        cfg = Config(model=ModelConfig(**saved["model"]), train=TrainConfig(**saved["train"]),
                     data=DataConfig(**saved["data"]), run_dir=run_dir)
    ex = hf.export(run_dir, step, saved, {"params": _param_table(cfg.model)}, dtype,
                   max_shard_gb, tokenizer_run=run_dir, dims=MUON_DIMS)
    if adapter:  # LoRA: the adapters alone, for peft to load onto the model the run started from
        need(ex.adapters, f"--adapter: {run_dir} is not a LoRA run (no --lora.rank).")
        return ex.written(hf.save_adapter(out, ex.adapters, hf_mapping(cfg.model), _hf_sizes(
            cfg.model), ex.lora.rank, ex.lora.alpha, hf.hf_origin(saved), dtype), out)
    return ex.written(save_hf(ex.params, cfg.model, out, model_type=model_type, **ex.hf_args), out)
export_hf.__doc__ = hf.EXPORT_HF_DOC + ("    adapter: A LoRA run's adapters as a peft folder "
                                           "(adapter_config.json), not the merged model.\n")


def cli(args=None) -> Config:
    return train.cli(PRESETS, args)


if __name__ == "__main__":
    train.run_cli(main, cli, export_hf, run_eval)
