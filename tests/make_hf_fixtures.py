"""Make the tiny HuggingFace checkpoints that tests/test_hf.py and tests/test_hf_moe.py check
our loaders against.

    pip install torch transformers          # the `parity` extra; only this script needs them
    python tests/make_hf_fixtures.py        # rewrites tests/fixtures/hf/
    python tests/make_hf_fixtures.py gemma2 # remakes only the named families, merging
                                            # their entries into MANIFEST.json

For each family a tiny random model is built with `transformers`, given weights far from
its default initialisation (norm gains and biases away from 1 and 0, matrices large enough
that the logits spread over several units), saved in bfloat16 as `save_pretrained` writes
it, read back in float32, and run on fixed tokens. The folder keeps the checkpoint and
`expected.npz` (tokens, float32 logits), so CI checks parity without torch.

Each family turns on what its published models use and what is easy to get wrong: GQA and
MQA, head counts that are not powers of two, a head width that is not d_model / heads,
Llama 3.1 rope scaling with every frequency band in play (a low rope_theta makes the
rescaled bands matter within 16 positions), tied embeddings, Qwen2's q/k/v biases, Qwen3's
q/k norms, Mistral's sliding window, top-k weights renormalised or not (Mixtral, Qwen3-MoE),
and checkpoints split into several shards with an index. Gemma 2 and Gemma 3 add RMSNorm gains
stored as w in (1 + w), a sqrt(d_model) embedding scale, four norms per layer, GELU (tanh),
query_pre_attn_scalar that is not head_dim, windows shorter than the sequence on every second
(Gemma 2) or third (Gemma 3) layer, tanh soft-capping of scores and logits small enough to bend
them (Gemma 2), and q/k norms with a local RoPE base and a linearly scaled global one (Gemma 3).
OLMo 2 and 3 add norms only after attention and MLP and q/k norms over all heads at once; OLMo 3
windows on three layers of four with their own RoPE base and YaRN on the fourth. GPT-OSS adds sinks
away from zero, biases everywhere, one window layer and one full, YaRN and its clamped SwiGLU. Llama 4 adds
MoE on every second layer with the scores on the experts' inputs and a shared expert, chunked
attention, an unrotated layer whose query temperature rises within the 16 tokens, the L2 q/k
norm and RoPE in pairs. Gemma 4's MoE adds a dense MLP beside the experts in every layer, each
normed in and out, and a router with its own gain and per-expert scales. DeepSeek-V3.2 adds
the lightning indexer (LayerNorm'd key with a bias, ReLU scores weighted per head, RoPE in halves)
choosing fewer keys than the 16 tokens. Qwen3.5's is multimodal as released (its language model
under model.language_model, a vision tower beside) with 3 value heads to a DeltaNet key head;
its dense models (qwen3_5) the same block with a SwiGLU MLP in every layer, over two periods.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
TOKENS_SHAPE = (2, 16)

_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64)

_DEEPSEEK = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=12,
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8,
    num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
    routed_scaling_factor=2.5, rms_norm_eps=1e-6, num_mtp_layers=0, rope_interleave=True,
    rope_parameters=dict(rope_type="yarn", rope_theta=100.0, factor=4.0, beta_fast=8.0,
                         beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707,
                         original_max_position_embeddings=16), max_position_embeddings=64)

# Gemma 4 as the 31B (gemma4_text, below), and with 26B-A4B's experts beside its MLPs (gemma4_moe)
_GEMMA4 = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=12, global_head_dim=24,
    num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=5,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=100.0),
                         full_attention=dict(rope_type="proportional", rope_theta=1000.0,
                                             partial_rotary_factor=0.25)),
    final_logit_softcapping=2.5, hidden_size_per_layer_input=0, rms_norm_eps=1e-6,
    tie_word_embeddings=True, max_position_embeddings=64)

# name -> (model_type, config kwargs, max shard size or None for a single file)
FAMILIES = {
    "llama2": ("llama", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=64), None),
    "llama3.1": ("llama", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5,
        rope_theta=100.0, rope_scaling=_LLAMA3_ROPE, max_position_embeddings=128), "16KB"),
    "llama3.2": ("llama", dict(
        vocab_size=64, hidden_size=36, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5,
        rope_theta=300.0, rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=True,
        max_position_embeddings=128), None),
    "mistral": ("mistral", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-5, rope_theta=1000.0,
        sliding_window=48, max_position_embeddings=64), None),
    "qwen2": ("qwen2", dict(
        vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True, max_position_embeddings=64), None),
    "qwen3": ("qwen3", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6,
        rope_theta=1000.0, tie_word_embeddings=False, max_position_embeddings=64), "16KB"),
    # Mixture of experts (train_moe.py). Mixtral always renormalises its top-k weights;
    # this Qwen3-MoE does not (norm_topk_prob false) and picks 3 of 4.
    "mixtral": ("mixtral", dict(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=64), None),
    "qwen3_moe": ("qwen3_moe", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        num_experts=4, num_experts_per_tok=3, norm_topk_prob=False, rms_norm_eps=1e-6,
        rope_theta=1000.0, max_position_embeddings=64), "16KB"),
    # Gemma: layers 0 and 2 slide (window 5 of 16 tokens), 1 and 3 are global.
    "gemma2": ("gemma2", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, query_pre_attn_scalar=16,
        sliding_window=5, attn_logit_softcapping=3.0, final_logit_softcapping=2.5,
        rope_theta=100.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=64), None),
    # Layer i is global iff (i + 1) % 3 == 0: layer 2 only. No attention soft-cap, as published.
    "gemma3_text": ("gemma3_text", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=12, query_pre_attn_scalar=16,
        sliding_window=5, sliding_window_pattern=3, rope_theta=1000.0, rope_local_base_freq=100.0,
        rope_scaling=dict(rope_type="linear", factor=2.0), final_logit_softcapping=None,
        attn_logit_softcapping=None, rms_norm_eps=1e-6, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=64), "16KB"),
    # GPT-OSS: layer 0 slides (window 5 of 16 tokens), layer 1 is full; YaRN with a small base
    # and original context, so the ramp between kept and stretched frequencies lies within
    # the head; a clamp low enough (1.5) that gate and up values pass it.
    "gpt_oss": ("gpt_oss", dict(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=5, swiglu_limit=1.5, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="yarn", rope_theta=100.0, factor=4.0, beta_fast=8.0,
                             beta_slow=1.0, truncate=False, original_max_position_embeddings=16),
        max_position_embeddings=64), None),
    # DeepSeek-V3: a dense first layer then two MoE layers, MLA with a query latent and values
    # narrower than the queries, 8 experts in 4 groups of which 2 are searched, a shared
    # expert, the choice bias away from zero, YaRN with a small original context, and
    # DeepSeek's interleaved RoPE. Kimi K2 is the same model without groups, renamed.
    "deepseek_v3": ("deepseek_v3", dict(_DEEPSEEK, n_group=4, topk_group=2), "16KB"),
    "kimi_k2": ("deepseek_v3", dict(_DEEPSEEK, n_group=1, topk_group=1,
                                    routed_scaling_factor=2.827, rope_parameters=dict(
                                        _DEEPSEEK["rope_parameters"], beta_fast=1.0)), None),
    # Llama 4: four layers, MoE on the odd ones (top-2 of 4, the scores scaling the experts'
    # inputs, a shared expert), dense ones of their own width between; layer 3 unrotated with
    # its query temperature already rising (floor_scale 4), the others in chunks of 5 of the
    # 16 tokens with the L2 q/k norm; RoPE in pairs, scaled as Llama 3.1's.
    "llama4_text": ("llama4_text", dict(
        vocab_size=64, hidden_size=32, intermediate_size=16, intermediate_size_mlp=40,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=2,
        no_rope_layer_interval=4, attention_chunk_size=5, attn_temperature_tuning=True,
        floor_scale=4, attn_scale=0.1, use_qk_norm=True, rms_norm_eps=1e-5,
        rope_parameters=dict(_LLAMA3_ROPE, rope_theta=100.0), max_position_embeddings=64),
        None),
    # DeepSeek-V2: softmax routing limited to the best 2 of 4 groups (each ranked by its best
    # probability), the top 2 not renormalised and scaled by 2, no query latent (V2-Lite's
    # q_proj), YaRN with mscale, RoPE pairs (V2 always interleaves).
    "deepseek_v2": ("deepseek_v2", dict(
        {k: v for k, v in _DEEPSEEK.items() if k not in ("num_mtp_layers", "rope_interleave")},
        q_lora_rank=None, n_group=4, topk_group=2, topk_method="group_limited_greedy",
        norm_topk_prob=False, routed_scaling_factor=2.0), None),
    # Gemma 1: (1 + w) norms, GeGLU under its legacy name "gelu" (transformers takes the tanh
    # approximation), the sqrt(d) embedding scale, tied, multi-query (2B's), head_dim 12 != d/4.
    "gemma": ("gemma", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=12, rms_norm_eps=1e-6,
        rope_theta=10000.0, hidden_act="gelu", tie_word_embeddings=True,
        max_position_embeddings=64), None),
    # OLMo 3: norms only after attention and MLP, q/k norms over all heads at once (k's over
    # 2 kv heads), layers 0-2 slide (window 5 of 16 tokens) with their own RoPE base, layer 3
    # is full with YaRN (released: factor 8 of 8192; here 4 of 512 with a small base, so that
    # the ramp between kept and stretched frequencies lies inside the head) and its attention
    # factor.
    "olmo3": ("olmo3", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6,
        sliding_window=5, rope_parameters=dict(
            full_attention=dict(rope_type="yarn", rope_theta=100.0, factor=4.0,
                                original_max_position_embeddings=512, beta_fast=32.0,
                                beta_slow=1.0, attention_factor=1.1386294361119891),
            sliding_attention=dict(rope_type="default", rope_theta=1000.0)),
        max_position_embeddings=2048), "16KB"),
    # OLMo 2: OLMo 3's block without windows; one RoPE for all layers.
    "olmo2": ("olmo2", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=1000.0,
        max_position_embeddings=64), None),
    # Gemma 4 as the 31B: layers 2 and 5 global (window 5 of 16 tokens on the others), twice
    # as wide (24) with one key/value head whose keys are the values, a quarter of their
    # frequencies turned (proportional RoPE, base 1000 here); v norms, layer scalars, a final
    # soft-cap that bends the logits.
    "gemma4_text": ("gemma4_text", _GEMMA4, "16KB"),
    # Gemma 4 as E2B/E4B: per-layer inputs (8 wide per layer), the last period (layers 3-5)
    # reusing the keys and values of layers 1 (local) and 2 (global), its MLPs twice as wide;
    # the global layers' own width without K = V.
    "gemma4_ple": ("gemma4_text", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=1, head_dim=12, global_head_dim=16,
        attention_k_eq_v=False, sliding_window=5, num_kv_shared_layers=3,
        use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=64,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=100.0),
                             full_attention=dict(rope_type="proportional", rope_theta=1000.0,
                                                 partial_rotary_factor=0.5)),
        final_logit_softcapping=2.5, rms_norm_eps=1e-6, tie_word_embeddings=True,
        max_position_embeddings=64), None),
    # Gemma 4 as 26B-A4B: the 31B's attention (layers 2, 5 global, twice as wide, one K = V
    # head, a quarter turned) and in every layer a dense GeGLU (24 wide) beside 8 experts
    # (16 wide, top 2), the router's gain and per-expert scales away from 1.
    "gemma4_moe": ("gemma4_text", dict(_GEMMA4, intermediate_size=24, moe_intermediate_size=16,
                                       enable_moe_block=True, num_experts=8, top_k_experts=2),
                   "16KB"),
    # DeepSeek-V3.2: DeepSeek-V3's fixture with the lightning indexer in every layer (8 heads 8
    # wide, 4 of them rotated), each query keeping its best 5 keys: sparse from the sixth token.
    "deepseek_v32": ("deepseek_v32", dict(
        {k: v for k, v in _DEEPSEEK.items() if k not in ("rope_interleave", "num_mtp_layers")},
        n_group=4, topk_group=2,
        index_n_heads=8, index_head_dim=8, index_topk=5), "16KB"),
    # Qwen3-Next: layers 0-2 Gated DeltaNet (2 key heads 8 wide, each serving 2 value heads 6
    # wide; a 4-tap conv), layer 3 gated attention turning 4 of its 16 dims; 4 experts top 2
    # beside a gated shared expert; norm gains zero-centred (1 + w) but the DeltaNet's output norm.
    "qwen3_next": ("qwen3_next", dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1000.0, partial_rotary_factor=0.25),
        max_position_embeddings=64), "16KB"),
    # Qwen3.5 as released: multimodal (its language model under model.language_model, a one-block
    # vision tower beside it), the text's RoPE split into sections for images; Qwen3-Next's block
    # with DeltaNet's projections one after another over all heads. Layers 0-2 DeltaNet (2 key
    # heads 8 wide, each serving 3 value heads 6 wide), layer 3 gated attention turning 4 of 16.
    "qwen3_5_moe": ("qwen3_5_moe", dict(text_config=dict(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
        linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1000.0, partial_rotary_factor=0.25,
                             mrope_section=[1, 1, 0], mrope_interleaved=True),
        max_position_embeddings=64), vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
            num_position_embeddings=4)), "16KB"),
    # Qwen3.5's dense models as released (multimodal, as qwen3_5_moe): every layer a SwiGLU MLP;
    # two periods of 3 DeltaNet layers (2 key heads 8 wide, each serving 3 value heads 6 wide)
    # and a gated attention layer turning 4 of its 16 dims.
    "qwen3_5": ("qwen3_5", dict(text_config=dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=6,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1000.0, partial_rotary_factor=0.25,
                             mrope_section=[1, 1, 0], mrope_interleaved=True),
        max_position_embeddings=64), vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
            num_position_embeddings=4)), "16KB"),
    # DeepSeek-V4: 2 mHC streams; layers window, CSA (rate 4, its indexer keeping 2 of the 4
    # entries), HCA (rate 8), CSA, window; the window 4 of the 16 tokens; the first 2 layers hash-
    # routed; 4 of each head's 16 dims turned in pairs, YaRN on the compressed layers; the clamp
    # 1.0 inside the activations' spread; the output projection in 2 groups.
    "deepseek_v4": ("deepseek_v4", dict(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, q_lora_rank=12,
        partial_rotary_factor=0.25, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        routed_scaling_factor=1.5, layer_types=[
            "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
            "compressed_sparse_attention", "sliding_attention"], compress_rates={
            "compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 3, hc_mult=2, sliding_window=4, o_groups=2,
        o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=2, swiglu_limit=1.0,
        rope_theta=1000.0, compress_rope_theta=4000.0, max_position_embeddings=64,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
                             beta_fast=8.0, beta_slow=1.0)), None),
}
# Written as this model_type (the checkpoint is the other's, as Moonshot ships it).
RENAMED = {"kimi_k2": "kimi_k2"}


def randomize(model: torch.nn.Module, seed: int, model_type: str = "") -> None:
    """Weights whose every entry matters to the logits: unit-scale activations, gains near
    but not at 1, biases away from 0. Gemma's RMSNorm multiplies by (1 + w), so there w is
    the noise itself; and Gemma multiplies embeddings by sqrt(d_model), so its table is drawn
    that much smaller (unit-scale rows after the scale, tied logits that a soft-cap bends
    without flattening)."""
    gemma = "gemma" in model_type
    plus_one = gemma and model_type != "gemma4_text" or model_type in ("qwen3_next",
                                                                         "qwen3_5_moe", "qwen3_5")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in sorted(model.named_buffers()):  # DeepSeek's choice bias: a buffer
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            if name.endswith("layer_scalar"):  # Gemma 4's, saved with the weights
                b.copy_(1.0 + 0.3 * torch.randn(b.shape, generator=g))
            if name.endswith("tid2eid"):  # DeepSeek-V4's hash layers: distinct experts a token
                E = model.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:b.shape[1]]
                                     for _ in range(b.shape[0])]))
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("sinks"):  # a logit each head's softmax weighs against its keys
                p.copy_(1.0 + noise)
            elif name.endswith(("norm.weight", "norm_1.weight", "norm_2.weight", "router.scale",
                                "per_expert_scale")):
                gated = name.endswith("linear_attn.norm.weight")  # Qwen3-Next's, as stored
                p.copy_(0.3 * noise if plus_one and not gated else 1.0 + 0.3 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif name.endswith(("embed_tokens.weight", "embed_tokens_per_layer.weight")):
                p.copy_(noise / p.shape[-1] ** 0.5 if gemma else noise)
            else:  # [..., out, in] (a Linear, or stacked experts): unit-variance outputs
                p.copy_(noise / p.shape[-1] ** 0.5)


def make(name: str, model_type: str, kwargs: dict, shard: str | None, seed: int) -> dict:
    folder = os.path.join(OUT, name)
    shutil.rmtree(folder, ignore_errors=True)
    cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    # a multimodal model whole (its other towers in the folder too), as released
    auto = getattr(transformers, "AutoModelForImageTextToText" if "text_config" in kwargs else
                   "AutoModelForCausalLM")
    model = auto.from_config(cfg, dtype=torch.float32)
    randomize(model, seed, model_type)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size=shard or "50GB")
    # The reference is the saved bfloat16 weights, read back and run in float32.
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                            attn_implementation="eager")
    vocab = kwargs.get("text_config", kwargs)["vocab_size"]
    tokens = np.random.default_rng(seed).integers(0, vocab, TOKENS_SHAPE)
    with torch.no_grad():
        logits = ref(torch.from_numpy(tokens)).logits.float().numpy()
    np.savez(os.path.join(folder, "expected.npz"), tokens=tokens.astype(np.int32),
             logits=logits.astype(np.float32))
    if name in RENAMED:
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            c = json.load(f)
        with open(path, "w") as f:
            json.dump(c | {"model_type": RENAMED[name]}, f, indent=2)
    files = sorted(os.listdir(folder))
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in files)
    return {"files": files, "bytes": size, "logit_absmax": float(np.abs(logits).max())}


def main(names: list[str]) -> None:
    """All families, rewriting MANIFEST.json; or only `names`, merging their entries into it
    and leaving the other families' folders alone."""
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        sys.exit(f"unknown families {unknown}; known: {list(FAMILIES)}")
    os.makedirs(OUT, exist_ok=True)
    manifest = os.path.join(OUT, "MANIFEST.json")
    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    report = {**versions, "families": {}}
    if names:
        with open(manifest) as f:
            report = json.load(f)
    for i, (name, (model_type, kwargs, shard)) in enumerate(FAMILIES.items()):
        if names and name not in names:
            continue
        entry = make(name, model_type, kwargs, shard, seed=i)  # seed: the place in FAMILIES
        # A merged entry made by other versions than the manifest's says which.
        entry.update({k: v for k, v in versions.items() if report[k] != v})
        report["families"][name] = entry
        print(f"{name:10s} {entry}")
    with open(manifest, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
        f.write("\n")
    total = sum(r["bytes"] for r in report["families"].values())
    print(f"total {total / 1e3:.0f} KB in {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
