"""What the trainers share on purpose they copy (each script stands alone, DESIGN.md); these
tests hold every copy of more than a few lines equal, so that a fix in one file cannot miss
the others: the same source text where the code is the same, the same values where a
declaration is (config fields, constants, parameter tables), the same numbers where only the
comments differ."""
import ast
import dataclasses
import inspect

import numpy as np
import pytest

import train_dense as td
import train_grpo as tg
import train_moe as tm

# Functions whose source text is the same in each file that has them.
SAME_SOURCE = {
    "constrain": (td, tm, tg), "rms_norm": (td, tm, tg), "apply_rope": (td, tm, tg),
    "param_specs": (td, tm, tg), "_init": (td, tm, tg),
    "init_params": (td, tm, tg), "count_params": (td, tm, tg), "unembedding": (td, tm, tg),
    "cli": (td, tm, tg), "make_schedule": (td, tm),
    # The MoE trainer's loss is dense's fused chunked cross-entropy, soft-cap included (its
    # `_softcap` is held below, in all three files).
    "_chunked": (td, tm), "cross_entropy": (td, tm), "_ce_fused": (td, tm),
    "_ce_fused_fwd": (td, tm), "_ce_fused_bwd": (td, tm),
    # Qwen3.5's Gated DeltaNet and partial RoPE: the dense models' are the MoE models'
    # (and train_grpo.py's policy's, whose decode carries the DeltaNet state)
    "gated_deltanet": (td, tm, tg), "causal_conv": (td, tm, tg), "delta_rule_chunked": (td, tm, tg),
    "partial_rope": (td, tm, tg), "weights": (td, tm, tg), "unit_lower_solve": (td, tm, tg),
    # train_grpo.py's policy is train_dense.py's model, Gemma's knobs included, with its HF
    # translation (its block and hidden add a KV cache: tests/test_grpo.py holds their numbers).
    "ModelConfig": (td, tg), "_param_table": (td, tg), "rope_inv_freq": (td, tg),
    "_softcap": (td, tm, tg), "hf_mapping": (td, tg), "_hf_sizes": (td, tg),
    "config_from_hf": (td, tg), "config_to_hf": (td, tg), "load_hf": (td, tg), "save_hf": (td, tg),
    "flops_per_token": (td, tg), "check_model": (td, tg), "_hf_keys": (td, tg),
    "_layer_types": (td, tg), "_misfit": (td, tg),
    # Quantized training's matmul (--model.quant): the same in both trainers
    "quantize": (td, tm), "_qdot": (td, tm), "qdot": (td, tm), "_qdot_bwd": (td, tm),
    "matmuls": (td, tm),
}
SAME_VALUE = {name: (td, tg) for name in (
    "MUON_DIMS", "HF_ARCHITECTURES", "GEMMA", "_HF_DEFAULTS", "HF_KEYS", "HF_FAMILY_KEYS",
    "HF_NULL", "HF_SPELLED", "HF_REFUSED", "HF_KNOBS", "HF_NEEDS", "HF_CONSTANTS", "HF_TOP",
    "HF_LAYER", "QWEN35_KEYS", "HF_GATE", "HF_ROPE", "GPT2_KEYS", "HF_GPT2", "_GPT2")}


@pytest.mark.parametrize("name", sorted(SAME_SOURCE))
def test_copied_functions_have_the_same_source(name):
    first, *others = SAME_SOURCE[name]
    for mod in others:
        assert inspect.getsource(getattr(mod, name)) == inspect.getsource(
            getattr(first, name)), f"{mod.__name__}.{name} differs from {first.__name__}'s"


def test_no_check_is_listed_twice():
    """A key written twice in a dict literal keeps only its last value: the first check would
    silently never run (`_softcap` once was)."""
    twice = []
    for node in ast.walk(ast.parse(open(__file__).read())):
        if isinstance(node, ast.Dict):
            keys = [ast.literal_eval(k) for k in node.keys if isinstance(k, ast.Constant)]
            twice += [f"line {node.lineno}: {k!r}" for k in sorted(set(keys), key=repr)
                      if keys.count(k) > 1]
    assert not twice, twice


@pytest.mark.parametrize("name", sorted(SAME_VALUE))
def test_copied_constants_are_equal(name):
    first, *others = SAME_VALUE[name]
    for mod in others:
        assert getattr(mod, name) == getattr(first, name), name


def fields(cls):
    """Each field's type, default and knob metadata (range, resume, compute: common/config.py)."""
    return {f.name: (f.type, f.default, dict(f.metadata)) for f in dataclasses.fields(cls)}


def test_config_fields_agree():
    # The MoE trainer's optimiser and loop settings are the dense ones plus its router losses.
    shared = fields(td.TrainConfig).keys() & fields(tm.TrainConfig).keys()
    assert shared >= {"steps", "lr", "schedule", "b1", "b2", "clip_norm", "log_every"}
    assert {k: fields(td.TrainConfig)[k] for k in shared} == {
        k: fields(tm.TrainConfig)[k] for k in shared}
    shared = fields(td.ModelConfig).keys() & fields(tm.ModelConfig).keys() - {"d_ff"}  # per expert
    assert {k: fields(td.ModelConfig)[k] for k in shared} == {
        k: fields(tm.ModelConfig)[k] for k in shared}
    # LoRA's default targets: each trainer names its own weights, the same names in all three.
    assert td.Config().lora == tm.Config().lora == tg.Config().lora


FIELDS = dict(vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
              qk_norm=True)


def test_moe_parameter_table_shares_the_dense_entries():
    """Attention, embeddings and norms: the same shapes, shardings and init in both files."""
    d, m = td._param_table(td.ModelConfig(**FIELDS)), tm._param_table(tm.ModelConfig(**FIELDS))
    shared = d["layers"].keys() & m["layers"].keys() - {"w_gate", "w_up", "w_down"}  # experts'
    assert shared >= {"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "q_norm", "k_norm"}
    assert {k: d["layers"][k] for k in shared} == {k: m["layers"][k] for k in shared}
    assert {k: v for k, v in d.items() if k != "layers"} == {
        k: v for k, v in m.items() if k != "layers"}


def test_moe_rope_frequencies_without_yarn_are_the_dense_ones():
    """train_moe.py's rope_inv_freq is its own text (YaRN); with YaRN off it gives dense's
    frequencies. (rms_norm, apply_rope, attention and the schedule are the same text above.)"""
    d, m = td.ModelConfig(**FIELDS), tm.ModelConfig(**FIELDS)
    assert m.yarn_factor == 0
    np.testing.assert_array_equal(td.rope_inv_freq(d), tm.rope_inv_freq(m))


def test_moe_hf_names_share_the_dense_entries():
    """The HuggingFace names of what the two models share (embeddings, norms, attention)."""
    shared = td.HF_LAYER.keys() & tm._HF_LAYER.keys() - {"w_gate", "w_up", "w_down"}  # experts'
    assert shared >= {"attn_norm", "mlp_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm"}
    assert {k: td.HF_LAYER[k] for k in shared} == {k: tm._HF_LAYER[k] for k in shared}
    assert td.HF_TOP == tm._HF_TOP


def test_qwen35_hf_names_are_the_moe_ones():
    """Qwen3.5's DeltaNet projections, gated query and config keys: the dense folders spell them
    as the MoE ones do (train_moe.py's qwen3_5_moe_text entries)."""
    moe = tm._HF_FAMILY_NAMES["qwen3_5_moe_text"]
    ours = {k: v for k, v in td.HF_LAYER.items() if k.startswith("lin_") or k in (
        "A_log", "dt_bias")} | td.HF_GATE
    assert len(ours) == 13 and ours == {k: moe[k] for k in ours}
    assert td.QWEN35_KEYS == {k: v for k, v in tm._HF_FAMILY_FIELDS["qwen3_5_moe_text"].items()
                              if k.startswith("linear_")}
