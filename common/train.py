"""The training plumbing that no model changes, written once for every trainer.

A trainer (train_*.py) keeps what a forker edits: config and presets, parameter table, model,
loss, `train_step` and a short loop in plain sight. This file holds the rest, in the order of
its sections. It knows no model: it reads no ModelConfig field and calls no trainer function
(the trainer hands it data: tables, configs, logits).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from common import hf, multislice, observe
from common.config import ConfigError, check_ranges, compute_fields, knob, may_change
from common.checkpoint import (CheckpointError, Checkpointer, ConfigConflictError,
                               PreemptionGuard, RunConfigError, check_run_config, read_checkpoint,
                               read_run_config, run_path)
from common.data import DataError, load_dataset, open_tokenizer, run_tokenizer
from common.mesh import MeshConfig, MeshError, describe, make_mesh, tpu_topology_devices

log = observe.say  # process 0 prints; the others keep quiet


class NonFiniteError(RuntimeError):
    """Training diverged: a step's loss or gradient was not finite (exit code 3)."""


# Bad input of any kind: the command line prints the reason and exits 2, never a traceback.
INPUT_ERRORS = (ConfigError, MeshError, ConfigConflictError, CheckpointError, FileNotFoundError,
                DataError, multislice.DistributedInitError, hf.HFError, RunConfigError)


# --- Parameter tables: name -> (shape, PartitionSpec, init std) -------------------------------
def is_entry(x) -> bool:
    return isinstance(x, tuple) and len(x) == 3 and isinstance(x[1], P)


def table_specs(table: dict) -> dict:
    """The table's specs, each weight's "fsdp" dimension split over the context axis too: a
    context shard holds its share of the weights as an fsdp shard does (MaxText's rule), so a
    sequence split over C chips costs no more weight memory per chip than C sequences."""
    def wide(a):
        out = tuple(n for x in (a if isinstance(a, tuple) else (a,))
                    for n in ((x, "context") if x == "fsdp" else (x,)))
        return out if isinstance(a, tuple) or len(out) > 1 else a
    return jax.tree.map(lambda e: P(*map(wide, e[1])), table, is_leaf=is_entry)


def table_init(table: dict, key: jax.Array) -> dict:
    """Float32 weights: std None = ones (norm gains), 0.0 = zeros (biases), a function: std(shape)
    (DeepSeek-V4's hash tables), else normal(0, std). One key per entry, in the table's order."""
    entries, treedef = jax.tree.flatten(table, is_leaf=is_entry)
    keys = jax.random.split(key, len(entries))
    f32 = jnp.float32
    return jax.tree.unflatten(treedef, [
        jnp.ones(shape, f32) if std is None else std(shape) if callable(std) else
        std * jax.random.normal(k, shape, f32)
        for (shape, _, std), k in zip(entries, keys)])


def table_count(table: dict) -> int:
    return sum(math.prod(e[0]) for e in jax.tree.leaves(table, is_leaf=is_entry))


def join(tree: dict, extra: dict) -> dict:
    """`tree` with the leaves of `extra` (buffers, or their table) added into its stacks."""
    return {k: join(v, extra[k]) if isinstance(v, dict) and k in extra else v
            for k, v in tree.items()} | {k: v for k, v in extra.items() if k not in tree}


def split(tree: dict, like: dict) -> tuple[dict, dict]:
    """`join` undone: (tree without the keys of `like`, those leaves, shaped like `like`)."""
    rest = {k: split(v, like[k])[0] if isinstance(like.get(k), dict) else v
            for k, v in tree.items() if not (k in like and not isinstance(like[k], dict))}
    return rest, {k: split(tree[k], v)[1] if isinstance(v, dict) else tree[k]
                  for k, v in like.items()}


# --- LoRA (Hu et al. 2021): frozen weights, each plus a trained low-rank update -------------
@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """--lora.rank r > 0: train w + (alpha / r) a @ b in place of each layer weight w named in
    --lora.targets, a [in, r] and b [r, out]; every weight of the model stays frozen (no
    gradient, no optimiser state) and the adapters alone are trained and saved beside it.
    The trainer names its weights: its Config's default_factory sets `targets`."""
    rank: int = knob(0, ">= 0")
    alpha: float = knob(16.0, "> 0")
    targets: str = ""  # weight names, comma-separated, experts' included


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "a", "b"],
                   meta_fields=["scale"])
@dataclasses.dataclass
class Adapted:
    """A frozen weight w [..., *in, *out] and its adapter a [..., *in, r], b [..., r, *out],
    sharing w's leading axes (layers, experts), which a layer scan slices like any leaf."""
    w: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float

    def merged(self) -> jax.Array:
        n_out = self.w.ndim - self.a.ndim + 1
        lead, r = self.b.shape[:self.b.ndim - 1 - n_out], self.a.shape[-1]
        ab = jnp.einsum("...ir,...ro->...io", self.a.reshape(*lead, -1, r),
                        self.b.reshape(*lead, r, -1))
        return jax.lax.stop_gradient(self.w) + self.scale * ab.reshape(self.w.shape)


def lora_table(table: dict, dims: dict, lora: LoRAConfig) -> dict:
    """The adapters' parameter table: for each weight named in --lora.targets (`dims`: name ->
    its (input axes, output axes), contiguous after the stack's), a (std 1/sqrt(fan-in)) and b
    (zeros, so that training starts from the model itself), each split as w's axes it spans."""
    want = [t for t in lora.targets.split(",") if t]
    need(want and set(want) <= set(dims), f"--lora.targets {lora.targets!r}: name this "
         f"model's matrices, comma-separated, from {', '.join(sorted(dims))}.")

    def one(shape, spec, name):
        (i, *_), (o, *_) = dims[name]
        s, r = tuple(spec) + (None,) * (len(shape) - len(spec)), lora.rank
        return {"a": (shape[:o] + (r,), P(*s[:o], None), math.prod(shape[i:o]) ** -0.5),
                "b": (shape[:i] + (r,) + shape[o:], P(*s[:i], None, *s[o:]), 0.0)}
    walk = lambda t: {k: walk(v) if isinstance(v, dict) else one(*v[:2], k)
                      for k, v in t.items() if isinstance(v, dict) or k in want}
    prune = lambda t: {k: prune(v) if "a" not in v else v for k, v in t.items() if v and (
        "a" in v or prune(v))}
    out = prune(walk(table))
    need(out, f"--lora.targets {lora.targets!r}: none of these weights is in this model.")
    return out


def check_lora(lora: LoRAConfig, optimizer: str, qk_clip: float, flag: str = "--train") -> None:
    need(not lora.rank or optimizer == "adamw" and not qk_clip, f"--lora.rank {lora.rank} "
         "trains its adapters with AdamW, and QK-clip would rescale frozen weights: use "
         f"{flag}.optimizer adamw and no {flag}.qk-clip-threshold.")


def adapt(base: dict, adapters: dict, scale: float) -> dict:
    """The model's weights with each adapted one an `Adapted`: a layer merges its own
    (`merged`), so one layer's merged weights exist at a time, never a second model."""
    return {k: (adapt(v, adapters[k], scale) if "a" not in adapters[k] else
                Adapted(v, adapters[k]["a"], adapters[k]["b"], scale)) if k in adapters else v
            for k, v in base.items()}


def merged(tree: dict) -> dict:
    """`tree` with each `Adapted` leaf as its weight (a no-op without LoRA)."""
    return jax.tree.map(lambda x: x.merged() if isinstance(x, Adapted) else x, tree,
                        is_leaf=lambda x: isinstance(x, Adapted))


def weights(state: dict, lora: LoRAConfig, params: dict | None = None) -> dict:
    """The model the state holds: its parameters, or under LoRA its frozen "base" adapted by
    them (`params`: adapters in their place, those being differentiated)."""
    p = state["params"] if params is None else params
    return adapt(state["base"], p, lora.alpha / lora.rank) if "base" in state else p


def named(mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def check_divides(table: dict, mesh, where: str) -> None:  # each sharded dimension evenly
    flat = jax.tree_util.tree_flatten_with_path(table, is_leaf=is_entry)[0]
    for path, (shape, spec, _) in flat:
        for n, axes in zip(shape, spec):
            ways = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else
                                                     axes or ()))
            need(n % ways == 0, f"{where}: {'/'.join(str(k.key) for k in path)} has a dimension "
                 f"of {n}, which the mesh ({describe(mesh)}) splits {ways} ways; choose mesh "
                 "sizes that divide the model's.")


# --- Checks that need no compilation, so that a bad launch fails in a second ------------------
def need(ok, message: str) -> None:  # the message names the flag and the fix
    if not ok:
        raise ConfigError(message)


def check_sizes(mesh: MeshConfig, splits: dict[str, list[tuple[str, int]]]) -> None:
    """Each model size that a mesh axis splits ({axis: [(flag, size), ...]}) divides evenly."""
    for axis, sizes in splits.items():
        axes = ("fsdp", "context") if axis == "fsdp" else (axis,)   # see table_specs
        n = {a: getattr(mesh, a) * getattr(mesh, "dcn_" + a) for a in axes}
        ways, named = math.prod(n.values()), [f"--mesh.{a} {k}" for a, k in n.items() if k > 1]
        for flag, v in sizes:
            need(v % ways == 0, f"{flag} {v} is not divisible by {' x '.join(named)}: {axis} "
                 f"parallelism splits it evenly; choose sizes dividing {v}.")


def batch_shards(mesh: MeshConfig | jax.sharding.Mesh, axes=("data", "fsdp")) -> int:
    if isinstance(mesh, jax.sharding.Mesh):  # its axes are dcn x ici already
        return math.prod(mesh.shape[a] for a in axes)
    return math.prod(getattr(mesh, a) * getattr(mesh, "dcn_" + a) for a in axes)


def check_batch(batch_size: int, microbatches: int, mesh: MeshConfig,
                axes=("data", "fsdp"), flag: str = "--train", what: str = "") -> None:
    """The batch (`what` says what makes it, if not {flag}.batch-size) splits into
    microbatches, and each of those over the batch shards."""
    shards, what = batch_shards(mesh, axes), what or f"{flag}.batch-size {batch_size}"
    need(batch_size % microbatches == 0 and (batch_size // microbatches) % shards == 0, f"{what} "
         f"/ {flag}.microbatches {microbatches} is not divisible by {' x '.join(axes)} = {shards} "
         f"batch shards; use a batch size that is a multiple of {shards * microbatches}.")


def check_pipeline(mesh: MeshConfig, microbatches: int, repeats: int, layers: tuple[str, int],
                   off: list[str]) -> None:
    """The pipeline (`pipelined`) against its microbatches and its stack (`layers`: the flag
    that sets it, its length); `off`: the flags of what it does not run, refused by name."""
    S, V, M = mesh.stage * mesh.dcn_stage, repeats, microbatches
    need(M >= S, f"--train.microbatches {M} < --mesh.stage {S}: each stage needs a microbatch of "
         f"its own at every tick; use --train.microbatches {S} or more (more shrink the bubble).")
    need(layers[1] % (S * V) == 0, f"{layers[0]} is not divisible by --mesh.stage {S} x --train."
         f"pipeline-repeats {V}: each stage runs {V} equal chunks of layers; choose sizes whose "
         "product divides it.")
    need(S == 1 or not off, f"--mesh.stage {S} with {', '.join(off)}: the pipeline does not run "
         "these yet; use --mesh.stage 1, or leave them off.")


def pipeline_report(mesh, repeats: int, microbatches: int, layers: int, outside: str) -> dict:
    """The schedule's line, logged, and its bubble for the dry run's report ({} unpipelined)."""
    S, V, M = mesh.shape["stage"], repeats, microbatches
    if S == 1:
        return {}
    bubble = (S - 1) / (V * M + S - 1)
    log(f"pipeline | {S} stages x {V} chunk(s) of {layers // (S * V)} layers, {M} microbatches: "
        f"{V * M + S - 1} ticks, bubble (S-1)/(VM+S-1) {bubble:.1%} | outside it: {outside}")
    return {"pipeline_bubble": bubble}


def check_sequence(mesh: MeshConfig, seq_len: int, loss_chunk: int, qk_clip: float,
                   attn_chunk: int = 0, heads: tuple = ("allgather", 1, 1)) -> None:
    """The sequence splits over --mesh.context: into two chunks per shard (the load-balanced
    layout, common/attention.py), each shard's share into whole loss chunks; under Ulysses
    (heads: the strategy, query and key/value heads) a tensor shard's heads over context."""
    C, T = mesh.context * mesh.dcn_context, seq_len
    tp = mesh.tensor * mesh.dcn_tensor
    N, K = heads[1] // tp, max(heads[2] // tp, 1)
    need(C == 1 or heads[0] != "ulysses" or N % (C * K // math.gcd(K, C)) == 0, "--model."
         f"context-attention ulysses over --mesh.context {C}: a tensor shard's {N} query heads "
         f"(--model.n-heads / --mesh.tensor {tp}) must split into {C} groups of whole key/value "
         f"heads ({K}, repeated up to a multiple of {C}); use allgather or ring here.")
    need((C == 1 or T % (2 * C) == 0) and T // C % min(loss_chunk, T // C) == 0, f"--train."
         f"seq-len {T} over --mesh.context {C}: each shard's two halves and its --model.loss-"
         f"chunk {loss_chunk} positions must divide it; pick a multiple of both.")
    need(C == 1 or not qk_clip, f"--train.qk-clip-threshold with --mesh.context {C}: QK-clip's "
         "logit maxima are not taken over a split sequence yet. Set one of them off.")
    need(C == 1 or not attn_chunk, f"--model.attn-chunk with --mesh.context {C}: the chunked "
         "local layers fold the sequence into rows, which a split sequence cannot. Set one off.")


def check_vocab(tokenizer_size: int, vocab_size: int) -> None:
    need(tokenizer_size <= vocab_size, f"the tokenizer has {tokenizer_size} tokens but --model."
         f"vocab-size is {vocab_size}; set --model.vocab-size {tokenizer_size} or larger.")


def check_profile(profile_steps: tuple[int, ...], steps: int, flag: str = "--train") -> None:
    if problem := observe.profile_steps_problem(profile_steps, f"{flag}.profile-steps", steps):
        raise ConfigError(problem)


# --- Optimiser --------------------------------------------------------------------------------
def lr_schedule(kind: str, lr: float, warmup_steps: int, steps: int = 0,
                min_lr_ratio: float = 0.1, decay_fraction: float = 0.2):
    """Learning rate at optimiser step s (0-based); step 0 already gets lr / warmup_steps. cosine:
    down to lr * min_lr_ratio at `steps`; constant: flat after the warmup; wsd (warmup-stable-decay,
    MiniCPM): flat, then a linear cool-down over the last decay_fraction of the steps."""
    end, warmup = lr * min_lr_ratio, max(warmup_steps, 1)
    ramp = optax.linear_schedule(0.0, lr, warmup)
    if kind == "cosine":
        base = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end)
    elif kind == "constant":
        base = optax.join_schedules([ramp, optax.constant_schedule(lr)], [warmup])
    else:
        decay = max(1, int(steps * decay_fraction))
        stable = max(steps - decay - warmup, 0)
        base = optax.join_schedules(
            [ramp, optax.constant_schedule(lr), optax.linear_schedule(lr, end, decay)],
            [warmup, warmup + stable])
    return lambda s: base(s + 1)


NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic's (Jordan et al. 2024), optax's default


def newton_schulz(x, coeffs, steps: int = 5, eps: float = 1e-8):
    """Orthogonalise one matrix as optax.contrib.scale_by_muon does: on the wide side,
    Frobenius-normalised (a zero matrix stays zero), X <- aX + (b XX^T + c (XX^T)^2) X."""
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    x = x / (jnp.linalg.norm(x) + eps)
    for _ in range(steps):
        a = x @ x.T
        x = coeffs[0] * x + (coeffs[1] * a + coeffs[2] * a @ a) @ x
    return x if wide else x.T


def orthogonalise_stack(x, ins: tuple, outs: tuple, coeffs, spec: P | None = None):
    """Newton-Schulz on each matrix (ins x outs axes) of a stack; every other axis (layers,
    experts) is a batch of separate matrices. Under a mesh, given the parameter's layout `spec`
    (None: unknown, so each matrix whole where XLA puts it), each device orthogonalises only
    its share of the batch, each matrix whole: the batch axes already sharded (the experts)
    stay so; one all-to-all per sharded matrix dimension moves its mesh axes onto the batch,
    padded with zero matrices to a multiple of them; a replicated axis (data) takes its slice
    where it divides what is left. Then the same steps back: the update comes out in `spec`."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty or spec is None else {a: n for a, n in mesh.shape.items() if n > 1}
    entries = [*(spec or ()), *[None] * x.ndim][:x.ndim]
    on = [tuple(a for a in (e if isinstance(e, tuple) else (e,)) if a in sizes) for e in entries]
    first = lambda axes: sorted(axes, key=lambda a: not on[a])  # sharded major: clean merges
    batch = first(a for a in range(x.ndim) if a not in ins + outs)
    ins, outs = first(ins), first(outs)
    b_ax, m_ax, n_ax = (sum((on[a] for a in g), ()) for g in (batch, ins, outs))
    size = lambda axes: math.prod(sizes[a] for a in axes)
    m, n = (math.prod(x.shape[a] for a in g) for g in (ins, outs))
    # [b-shards, the matrices of each, m, n]: the first axis keeps the batch's sharding
    y = x.transpose(batch + ins + outs).reshape(size(b_ax), -1, m, n)
    count = y.shape[1]
    y = jnp.pad(y, ((0, 0), (0, -count % size(m_ax + n_ax)), (0, 0), (0, 0)))
    r_ax, left = (), y.shape[1] // size(m_ax + n_ax)
    for a in (a for a in sizes if a not in b_ax + m_ax + n_ax):
        if left % sizes[a] == 0:  # never padded: a replicated pad would be whole everywhere
            r_ax, left = r_ax + (a,), left // sizes[a]
    stages = [(b_ax, (), m_ax, n_ax), (b_ax, m_ax, (), n_ax), (b_ax, m_ax + n_ax, (), ()),
              (b_ax, m_ax + n_ax + r_ax, (), ())] if sizes else []
    pin = lambda v, st: jax.lax.with_sharding_constraint(v, P(*(e or None for e in st)))
    for st in stages:
        y = pin(y, st)
    y = jax.vmap(lambda v: newton_schulz(v, coeffs))(y.reshape(-1, m, n)).reshape(y.shape)
    for st in reversed(stages):
        y = pin(y, st)
    order = batch + ins + outs
    return y[:, :count].reshape([x.shape[a] for a in order]).transpose(np.argsort(order))


def scale_by_muon(muon_dims: dict, mu_dtype, specs: dict | None = None, beta: float = 0.95):
    """optax.contrib.scale_by_muon's Nesterov momentum and its state (checkpoints unchanged),
    then `orthogonalise_stack` on each matrix, given its parameter's spec in `specs`."""
    def init(params):
        return optax.contrib.MuonState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(
            params, dtype=mu_dtype), jnp.asarray(NS_COEFFS))

    def update(g, state, params=None):
        mu = optax.tree.update_moment(g, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        nesterov = jax.tree.map(lambda m, u: beta * m + (1 - beta) * u,
                                optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                                optax.tree.bias_correction(g, beta, count))
        spec = lambda path: specs and functools.reduce(lambda t, k: t[k.key], path, specs)
        u = jax.tree_util.tree_map_with_path(lambda path, x: orthogonalise_stack(
            x, *muon_dims[path[-1].key], state.ns_coeffs.astype(x.dtype), spec(path)), nesterov)
        return u, optax.contrib.MuonState(count, optax.tree.cast(mu, mu_dtype), state.ns_coeffs)
    return optax.GradientTransformation(init, update)


def optimizer(kind: str, schedule, *, b1: float, b2: float, weight_decay: float,
              clip_norm: float, decayed: set[str], muon_dims: dict, muon_dtype: str = "float32",
              specs: dict | None = None):
    """Clip by global norm, then AdamW, or Muon on the hidden matrices and AdamW on the rest. AdamW
    decays only the parameters whose name is in `decayed` (the matrices): decaying norm gains and
    biases only hurts. Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable", the Moonlight
    recipe Kimi K2 uses): Nesterov momentum 0.95, then 5 quintic Newton-Schulz steps that
    orthogonalise each matrix (optax.contrib.scale_by_muon's math, the momentum and the iteration in
    `muon_dtype`), scaled by 0.2 sqrt(max(fan_in, fan_out)) so that the update's RMS matches AdamW's
    and the same learning rate and weight decay serve both. `muon_dims`: name -> (input axes, output
    axes) of the hidden matrices; every other axis (the scanned layers, the experts) is a batch of
    separate matrices, split over the devices (`orthogonalise_stack`, given the parameters'
    PartitionSpecs `specs`). Embeddings, unembedding, norms, biases and the router are not in it and
    keep AdamW. The momentum is sharded like its parameter."""
    mask = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key in decayed, params)
    adam = optax.chain(scale_by_adam_kept(b1, b2), optax.add_decayed_weights(weight_decay, mask),
                       optax.scale_by_learning_rate(schedule))   # optax.adamw's chain and state
    if kind == "adamw":
        return _keeps_adam(optax.chain(optax.clip_by_global_norm(clip_norm), adam))

    def rms_match(updates, state, params=None):
        def scale(path, u):
            fan_in, fan_out = (math.prod(u.shape[a] for a in axes)
                               for axes in muon_dims[path[-1].key])
            return u * (0.2 * math.sqrt(max(fan_in, fan_out)))
        return jax.tree_util.tree_map_with_path(scale, updates), state

    def cast(dtype):  # the momentum's dtype is the iteration's (Nesterov's sum takes g's)
        return optax.GradientTransformation(lambda _: optax.EmptyState(), lambda u, s, p=None: (
            jax.tree.map(lambda x: x.astype(dtype), u), s))
    muon = optax.chain(
        cast(jnp.dtype(muon_dtype)), scale_by_muon(muon_dims, jnp.dtype(muon_dtype), specs),
        cast(jnp.float32), optax.GradientTransformation(lambda _: optax.EmptyState(), rms_match),
        optax.add_decayed_weights(weight_decay), optax.scale_by_learning_rate(schedule))
    labels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "muon" if path[-1].key in muon_dims else "adamw", params)
    return _keeps_adam(optax.chain(optax.clip_by_global_norm(clip_norm),
                                   optax.partition({"muon": muon, "adamw": adam}, labels)))


def _keeps_adam(tx):
    tx.update.adam_kept = True  # `update` leaves its Adam state to `scale_by_adam_kept`
    return tx


def scale_by_adam_kept(b1: float, b2: float, eps: float = 1e-8):
    """optax.scale_by_adam, whose state stays as it was where `update`'s verdict `ok` is False,
    and whose update reads the moments so kept: the same numbers. Selected only after Adam, the
    moments made XLA split each weight's update into two passes over it (Mixtral's v5p-8 step:
    est. 0.2204 s, 0.2166 so, as with no check at all)."""
    adam = optax.scale_by_adam(b1, b2, eps)

    def update(g, state, params=None, *, ok=True, **_):
        new = jax.tree.map(lambda a, b: jnp.where(ok, a, b), adam.update(g, state)[1], state)
        mu, nu = (optax.tree.bias_correction(m, b, new.count) for m, b in ((new.mu, b1),
                                                                           (new.nu, b2)))
        return jax.tree.map(lambda m, v: m / (jnp.sqrt(v + 0.0) + eps), mu, nu), new  # 0: eps_root
    return optax.GradientTransformationExtraArgs(adam.init, update)


def max_logits(q_BTNH, k_BSKH, mask_BTS=None, chunk: int = 512, *, segment_ids=None,
               scale=None, window: int = 0, local_chunk: int = 0, is_global=True):
    """[N] float32: per query head, the largest pre-softmax logit q.k x scale (default
    1/sqrt(H)) over the pairs the attention allows: causal (or mask_BTS), within each example
    of a packed row (segment_ids [B, T]) and, on a layer that is not `is_global` (traced), within
    `window` positions or the same `local_chunk`, for QK-clip. These are the logits that run,
    YaRN's temperature included through `scale` (a soft-cap is never applied: QK-clip is refused
    where one is). Fused kernels never show their scores, so they are made again here: q.k's
    FLOPs once more, without gradient, by chunks of queries, so that at most [B, N, chunk, S]
    float32 scores (and no [T, S] mask) exist at a time."""
    q, k = jax.lax.stop_gradient(q_BTNH), jax.lax.stop_gradient(k_BSKH)
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    C = chunk if T % chunk == 0 else T

    def one(i):
        q_BCKGH = jax.lax.dynamic_slice_in_dim(q, i * C, C, axis=1).reshape(B, C, K, N // K, H)
        s = jnp.einsum("bckgh,bskh->bkgcs", q_BCKGH, k, preferred_element_type=jnp.float32)
        t_C1, s_S = (i * C + jnp.arange(C))[:, None], jnp.arange(S)
        a = ((t_C1 >= s_S)[None] if mask_BTS is None else
             jax.lax.dynamic_slice_in_dim(mask_BTS, i * C, C, axis=1))
        if segment_ids is not None:
            seg_BC = jax.lax.dynamic_slice_in_dim(segment_ids, i * C, C, axis=1)
            a = a & (seg_BC[:, :, None] == segment_ids[:, None, :])
        if window:
            a = a & (is_global | (t_C1 - s_S < window))
        if local_chunk:
            a = a & (is_global | (t_C1 // local_chunk == s_S // local_chunk))
        return jnp.max(jnp.where(a[:, None, None], s, -jnp.inf), axis=(0, 3, 4)).reshape(N)
    return jnp.max(jax.lax.map(one, jnp.arange(T // C)), axis=0) * (scale or H ** -0.5)


def qk_clip(params: dict, tops: dict, tau: float, q: tuple, k: tuple, nope: int = 0) -> dict:
    """MuonClip's QK-clip (Kimi K2 report, sec. 2.1), after an update: every head whose largest
    logit this step, tops[stack] [L, N] for each stack of layers in params (or a module's
    "layers" under it), exceeded tau has its query and key projections (weights and biases,
    [L, ..., heads, H]) scaled by sqrt(tau / max) each, so that logit becomes tau; every other
    head is left exactly as it was. A key head that serves several query heads (grouped-query
    attention) is left alone and its queries take the whole factor, as K2 does with MLA's shared
    rotary key: scaling it would move its other heads' logits too. MLA (nope > 0: the width of
    the heads' own part): the query's own part and the key's (the first `nope` columns of q and
    of k's and v's joint up-projection) take sqrt(gamma) each, the query's rotary part the whole
    gamma, the shared rotary key and the values nothing."""
    def clip(layers, max_LN):
        ok = jnp.isfinite(max_LN) & (max_LN > tau)   # non-finite: the step is skipped anyway
        g_LN = jnp.where(ok, tau / jnp.where(ok, max_LN, 1.0), 1.0)
        shared = not nope and layers[k[0]].shape[-2] != layers[q[0]].shape[-2]
        root, one = jnp.sqrt(g_LN), jnp.ones_like(g_LN)
        # name: (the factor on its first `nope` columns, on the rest); nope 0: none is first
        scales = {n: (root, g_LN) if nope else (g_LN if shared else root,) * 2 for n in q}
        scales |= {n: (root, one if nope else root) for n in k if not shared}

        def scale(a, lo, hi):
            f = lambda s: s.reshape(s.shape[0], *[1] * (a.ndim - 3), s.shape[1], 1)
            return a * jnp.where(jnp.arange(a.shape[-1]) < nope, f(lo), f(hi))
        return layers | {n: scale(layers[n], *s) for n, s in scales.items() if n in layers}
    def stack(p, max_LN):  # a module holding its layers (DeepSeek's MTP) or the layers
        return p | {"layers": clip(p["layers"], max_LN)} if "layers" in p else clip(p, max_LN)
    return params | {name: stack(params[name], m) for name, m in tops.items()}


def check_qk_clip(flag: str, tau: float, qk_norm: bool) -> None:
    need(not (tau > 0 and qk_norm), f"{flag} {tau} with --model.qk-norm: the queries and keys "
         "are normalised after their projections, so scaling the projections would change "
         f"nothing (the norms' gains bound the logits instead). Set {flag} 0.")


# --- Training state ---------------------------------------------------------------------------
class TrainState:
    """{params, opt_state, step} on a mesh, Adam's moments sharded like their parameter (with
    `ref`, a frozen copy of the parameters: a KL reference). `init(key)` makes the float32
    parameters under jit, the specs as out_shardings: no device ever holds a whole model.
    `buffers` = (init(), specs): state the step updates by its own rule, never the optimiser
    (DeepSeek's router biases); saved and restored with the rest, under "buffers".
    `lora` = (the adapters' table, seed): "params" are then the adapters, the model a frozen
    "base" (`weights`), and `model` names which of the two a model's weights restore into.
    `frozen` = {name: (init, specs)}: other models the step reads and never changes (a
    distillation teacher), placed by their specs, given to `from_params` by name."""

    def __init__(self, init: Callable, specs: dict, tx, mesh, *, ref: bool = False,
                 buffers: tuple[Callable, dict] | None = None, lora: tuple | None = None,
                 frozen: dict | None = None):
        self.init, self.tx, self.mesh, self.ref = init, tx, mesh, ref
        self.buffers, self.lora, self.model = buffers, lora, "base" if lora else "params"
        self.frozen = frozen or {}
        p_sh = named(mesh, specs)
        if lora:  # the model frozen, the adapters trained: the optimiser sees only those
            p_sh, self.base_sh = named(mesh, table_specs(lora[0])), p_sh
        # No concrete key: with --compile-topology the mesh's devices do not exist here.
        abstract = jax.eval_shape(lambda: self._trained(init(jax.random.key(0))))
        replicated = NamedSharding(mesh, P())
        # Moments take their parameter's sharding; Muon's partition leaves MaskedNodes (no
        # state) where the other optimiser's parameters are.
        masked = lambda x: isinstance(x, optax.MaskedNode)
        opt_sh = optax.tree_map_params(tx, lambda v, s: v if masked(v) else s,
                                       jax.eval_shape(tx.init, abstract), p_sh, is_leaf=masked,
                                       transform_non_params=lambda _: replicated)
        optional = {"ref": p_sh if ref else None, "base": self.base_sh if lora else None,
                    "buffers": named(mesh, buffers[1]) if buffers else None}
        self.shardings = {"params": p_sh, "opt_state": opt_sh, "step": replicated} | {
            k: v for k, v in optional.items() if v is not None} | {
            k: named(mesh, specs) for k, (_, specs) in self.frozen.items()}

    def _trained(self, params):
        return table_init(self.lora[0], jax.random.key(self.lora[1])) if self.lora else params

    def _make(self, params, buffers=None, frozen=None):
        s = {"params": self._trained(params), "step": jnp.zeros((), jnp.int32)}
        s |= frozen or {k: init(jax.random.key(0)) for k, (init, _) in self.frozen.items()}
        s |= {"opt_state": self.tx.init(s["params"])} | ({"base": params} if self.lora else {})
        if self.buffers:
            s["buffers"] = self.buffers[0]() if buffers is None else buffers
        # The reference is a copy, not an alias: the policy's buffers are donated.
        return s | {"ref": jax.tree.map(jnp.copy, params)} if self.ref else s

    def fresh(self, key) -> dict:
        return jax.jit(lambda k: self._make(self.init(k)), out_shardings=self.shardings)(key)

    def from_params(self, params, buffers=None, **frozen) -> dict:
        """Given parameters (a fine-tune's start; and buffers, else fresh ones; the `frozen`
        models) with a fresh optimiser; they are donated."""
        return jax.jit(self._make, out_shardings=self.shardings, donate_argnums=(0, 1, 2))(
            params, buffers, frozen or None)

    def abstract(self) -> dict:
        """Shapes, dtypes and target shardings, nothing allocated: what a restore fills."""
        shapes = jax.eval_shape(lambda: self._make(self.init(jax.random.key(0))))
        return jax.tree.map(lambda s, d: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=d),
                            shapes, self.shardings)

    def jit(self, step_fn):
        """step_fn(state, batch) -> (state, metrics), jitted, the state donated: a step holds
        one copy of the state, not two."""
        return jax.jit(step_fn, donate_argnums=0, out_shardings=(self.shardings, None))


def update(tx, grads, state: dict, *checked, after: Callable | None = None) -> tuple[dict, dict]:
    """The optimiser step on `grads`, unless the gradient norm or a `checked` value (the loss)
    is not finite: then the parameters and optimiser state stay as they were. Decided on the
    device by a select, so no step waits for the host; the loop reads `nonfinite` with the
    metrics it fetches anyway and stops (or, with --*.max-bad-steps, skips). The step counter
    advances either way: the schedule stays with the data. `after(params)` edits the updated
    parameters (QK-clip) before that select, so a skipped step skips it too."""
    norm = optax.tree.norm(grads)
    ok = jnp.isfinite(norm)
    for x in checked:
        ok &= jnp.all(jnp.isfinite(x))
    updates, opt_state = optax.with_extra_args_support(tx).update(  # any optax transformation
        grads, state["opt_state"], state["params"], ok=ok)
    params = optax.apply_updates(state["params"], updates)
    params = after(params) if after else params
    inside = getattr(tx.update, "adam_kept", False)  # `optimizer()`'s: kept by Adam itself
    kept = lambda x: inside and isinstance(x, optax.ScaleByAdamState)
    keep = lambda new, old: jax.tree.map(lambda a, b: a if kept(a) else jnp.where(ok, a, b), new,
                                         old, is_leaf=kept)
    return state | {"params": keep(params, state["params"]),
                    "opt_state": keep(opt_state, state["opt_state"]),
                    "step": state["step"] + 1}, {"grad_norm": norm, "nonfinite": ~ok}


def accumulate(grad_fn, params, batch, microbatches: int, batch_axes):
    """The sum of grad_fn(params, mb) over `microbatches` slices of the batch's rows, under
    lax.scan (gradient accumulation), except outputs under a "max_" key (a per-head largest
    logit), which take the largest. Microbatch m takes rows m, m+M, m+2M, ...: each device
    keeps its own rows of every microbatch, so the split moves no data between devices."""
    M = microbatches
    if M == 1:
        return grad_fn(params, batch)

    def split(x):
        y = x.reshape(x.shape[0] // M, M, *x.shape[1:]).swapaxes(0, 1)
        if jax.sharding.get_abstract_mesh().empty:
            return y
        return jax.lax.with_sharding_constraint(y, P(None, batch_axes, *[None] * (x.ndim - 1)))

    def acc(carry, mb):
        return jax.tree_util.tree_map_with_path(
            lambda path, a, b: jnp.maximum(a, b) if is_max(path) else a + b,
            carry, grad_fn(params, mb)), None
    mbs = jax.tree.map(split, batch)
    shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], mbs))
    zeros = jax.tree_util.tree_map_with_path(
        lambda path, s: jnp.full(s.shape, -jnp.inf if is_max(path) else 0, s.dtype), shapes)
    return jax.lax.scan(acc, zeros, mbs)[0]


def is_max(path) -> bool:  # a largest logit (QK-clip's): combined over microbatches by max
    return any(str(getattr(k, "key", "")).startswith("max_") for k in path)


def ce_chunk(chunk: int, rows: int, T: int, D: int, axes: tuple) -> int:
    """Positions per cross-entropy chunk where the unembedding is gathered whole on each device
    (more targets than vocabulary; `axes` split the rows): each chunk then adds a whole f32 [D, V]
    to dW, 8DV bytes of memory traffic, so a chunk holds at least D targets a device, its logits
    no larger than that f32 dW (Llama 3.1 70B at 8k on v5p-256, 1 row a chip: 32 chunks gave an
    est. 0.769 s/step and 13.95 GiB a chip, one chunk 0.701 s and 9.53). At least `chunk`,
    and dividing T."""
    mesh = jax.sharding.get_abstract_mesh()
    shards = 1 if mesh.empty else math.prod(dict(mesh.shape).get(a, 1) for a in axes)
    C = min(T, max(chunk, -(-D * shards // rows)))
    return next(c for c in range(C, T + 1) if T % c == 0)


def stages() -> int:  # pipeline stages: the mesh's `stage` axis (1 without a mesh)
    return dict(jax.sharding.get_abstract_mesh().shape).get("stage", 1)


def pipelined(layer, x_BTD, xs_L, rows_B, M: int, V: int, batch_axes, scan=jax.lax.scan,
              remat=lambda f: f):
    """The layers as a pipeline over the `stage` axis, inside one SPMD program (GPipe, Huang et al.
    2019; circular with V > 1, Narayanan et al. 2021). `layer(x, xs, rows) -> (x, stats)` is one
    layer, xs its slice of the stacks xs_L [L, ...], rows its microbatch's share of rows_B [B, ...].
    Returns (output [B, T, D], stats [L, ...]: each layer's over the microbatches, combined as
    `accumulate` combines a step's, so that they are the unpipelined step's).

    The batch is cut into M microbatches and the L layers into S V chunks of K; chunk r S + s is
    stage s's in round r. At tick t stage s runs microbatch (t - s) mod M through its chunk of round
    (t - s) div M, all stages at once (a vmap over a stage-sharded axis), then hands its output to
    stage s + 1: a roll that XLA makes a collective-permute. What leaves the last stage waits in
    `buf` [M, ...] (every microbatch's current activation, the embeddings at first) until stage 0
    takes it up for the next round; M >= S keeps it there long enough. V M + S - 1 ticks, S - 1 of
    them idle for each stage: a bubble of (S - 1) / (V M + S - 1). The backward pass is this loop's
    autodiff (all forwards, then all backwards). `remat` (the trainer's jax.checkpoint) wraps a
    layer with the reading of its weights from the chunk: checkpointed after the read, each tick's
    weights were saved for the backward pass, ticks x the stage's weights (llama3.1-405b's GPipe on
    v5p: 30 GiB a chip); inside, they are read again from the chunk, which the loop keeps once."""
    S, pin = stages(), jax.lax.with_sharding_constraint
    K, ids = len(jax.tree.leaves(xs_L)[0]) // (S * V), jnp.arange(S)
    # Microbatch m: rows m, m+M, ... as `accumulate` takes them, so no row changes device.
    mb = lambda a: a.reshape(a.shape[0] // M, M, *a.shape[1:]).swapaxes(0, 1)
    # [L] -> [S, V, K]. The saved stacks keep the model's order for any S and V: for V = 1 each
    # stage's contiguous shard is its chunk; for V > 1 this costs an all-to-all each step.
    free = lambda a: P("stage", None, None, *[P.UNCONSTRAINED] * (a.ndim - 1))
    chunks = jax.tree.map(lambda a: pin(jnp.asarray(a).reshape(V, S, K, *a.shape[1:])
                                        .swapaxes(0, 1), free(a)), xs_L)
    rows = jax.tree.map(mb, rows_B)
    at = lambda i, a: (ids == i).reshape(-1, *[1] * (a.ndim - 1))  # stage i's slice of a

    one = remat(lambda x, chunk, r, k, rows: layer(x, jax.tree.map(lambda a: a[r, k], chunk), rows))

    def stage(x, chunk, r, i):  # one stage's chunk of round r, on microbatch i: (x, stats [K])
        rows_i = jax.tree.map(lambda a: a[i], rows)
        return scan(lambda x, k: one(x, chunk, r, k, rows_i), x, jnp.arange(K))

    def tick(carry, t):
        buf, prev = carry  # prev: what each stage received from the one before
        k = t - ids
        x = jnp.where(at(0, prev), buf[:, t % M], prev)
        out, stats = jax.vmap(stage, spmd_axis_name="stage")(x, chunks, jnp.clip(
            k // M, 0, V - 1), k % M)
        prev, slot = jnp.roll(out, 1, axis=0), (t - S + 1) % M  # the last stage's, to stage 0
        return (buf.at[:, slot].set(jnp.where(t >= S - 1, prev, buf[:, slot])), prev), stats
    buf = pin(jnp.broadcast_to(mb(x_BTD), (S, M, *mb(x_BTD).shape[1:])),
              P("stage", None, batch_axes))
    (buf, _), stats = jax.lax.scan(tick, (buf, jnp.zeros_like(buf[:, 0])),
                                   jnp.arange(V * M + S - 1))
    # Stats [tick, S, K, ...]: stage s ran round r's microbatch m at tick r M + m + s; picked
    # out [S, V, M, K], then in the layers' order (chunk r S + s) with the microbatches last.
    s, r, m = np.meshgrid(np.arange(S), np.arange(V), np.arange(M), indexing="ij")
    stats = jax.tree_util.tree_map_with_path(lambda path, a: (jnp.max if is_max(path) else (
        jnp.mean))(jnp.moveaxis(a[r * M + m + s, s], (0, 1, 3), (1, 0, 2)).reshape(
        S * V * K, M, *a.shape[3:]), axis=1), stats)
    # Stage 0's, its rows split over the stages (a reduce-scatter): the head and the loss after
    # it then cost each stage 1/S of their work and memory, not the whole batch's.
    out = jnp.sum(jnp.where(at(0, buf), buf, 0), axis=0).swapaxes(0, 1).reshape(x_BTD.shape)
    return pin(out, P((*batch_axes, "stage"), "context", None)), stats


def restore_params(run_dir: str, abstract_params, flag: str = "--init-from") -> dict:
    """The parameters of another run's latest checkpoint, read straight into these shardings.
    Its optimiser state is never read: a fine-tune starts a fresh one."""
    state, step = read_checkpoint(run_dir, {"params": abstract_params}, f"{flag} {run_dir}: no "
                                  f"complete checkpoint in {run_dir}/checkpoints; train it first.")
    log(f"initialised from {run_dir}/checkpoints/{step} (parameters; fresh optimiser)")
    return state["params"]


def write_top_k(folder: str, step: int, arrays: dict, meta: dict) -> None:
    """Offline distillation: step `step`'s teacher top-k ({name: [B, T, k]}) as .npy files in
    `folder`, a new or empty one (what it holds is said by `meta`, written first)."""
    if step == 0:
        need(not (os.path.isdir(folder) and os.listdir(folder)), f"--distill.logits {folder} is "
             "not empty; save the teacher's top-k into a new folder.")
        os.makedirs(folder, exist_ok=True)
        observe.write_json(os.path.join(folder, "meta.json"), meta)
    for name, x in arrays.items():
        np.save(os.path.join(folder, f"{step:08d}-{name}.npy"), x)


def top_k_reader(folder: str, meta: dict, mesh, batch_axes) -> Callable[[int], tuple]:
    """`read(step)`: `write_top_k`'s (values, indices) of `step`, placed on the batch's rows
    (each process reads its rows only), once `meta` says they were saved for these batches."""
    path, saved = os.path.join(folder, "meta.json"), None
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
    need(saved == meta, f"--distill.logits {folder}: saved for {saved}, not for this run's "
         f"batches ({meta}); save them with --distill.save and this run's flags.")

    def read(step: int) -> tuple:
        files = [os.path.join(folder, f"{step:08d}-{n}.npy") for n in ("values", "indices")]
        need(all(map(os.path.isfile, files)), f"--distill.logits {folder} has no top-k for "
             f"step {step}: save as many steps as --train.steps.")
        return tuple(put([np.load(f, mmap_mode="r") for f in files], mesh, batch_axes))
    return read


def precomputed(run_dir: str, name: str, start: int, make: Callable[[], dict]) -> dict:
    """Arrays a run makes once, at its start, and reads back when resumed (DPO's reference
    log-probs, made from weights that training then changes): {key: `make()`'s list of global
    arrays, stacked}, saved in the run directory as `name` by process 0."""
    path = run_path(run_dir, name)
    if path.exists():
        with path.open("rb") as f:
            return dict(np.load(f))
    need(start == 0, f"{path} is missing, and the weights it was made from are trained past: "
         "start a new --run-dir.")
    out = {k: np.stack([fetch(x) for x in v]) for k, v in make().items()}
    if jax.process_index() == 0:
        tmp = run_path(run_dir, name + ".tmp")
        with tmp.open("wb") as f:
            np.savez(f, **out)
        tmp.rename(path)
    return out


def _is_hf(path: str) -> bool:
    return os.path.isfile(os.path.join(path, hf.CONFIG)) and "model_type" in hf.read_config(path)


def frozen_model(path: str, flag: str, config_from_hf: Callable, model_cls):
    """The model config of a model the run reads but never trains (a distillation teacher):
    a HuggingFace folder's (`config_from_hf`) or a run directory's (`model_cls`)."""
    return (config_from_hf(hf.read_config(path), path) if _is_hf(path) else
            model_cls(**read_run_config(path, flag, trained=True)["model"]))


def frozen_params(path: str, flag: str, abstract, load_hf: Callable) -> dict:
    """Its parameters, placed as `abstract` says: `load_hf`'s, or the run's latest."""
    return (load_hf(path, jax.tree.leaves(abstract)[0].sharding.mesh)[1] if _is_hf(path) else
            restore_params(path, abstract, flag))


def model_source(cfg, prog: str = "train_dense.py") -> tuple[tuple[dict, str] | None, object]:
    """What the run's model comes from: ((--init-from-hf's config.json, its path), None), which
    the trainer's config_from_hf reads; or (None, cfg.model with the fields that --init-from's
    run, written by `prog`, saved); or (None, None): a fresh model. See `with_model`."""
    run, folder = getattr(cfg, "init_from", ""), getattr(cfg, "init_from_hf", "")
    need(not (run and folder), f"--init-from {run} and --init-from-hf {folder}: start from one "
         "or the other.")
    if folder:
        return (hf.read_config(folder), os.path.join(folder, hf.CONFIG)), None
    if not run:
        return None, None
    saved = read_run_config(run, "--init-from", trained=True).get("model", {})
    # A knob this file lacks is fine while it is off (falsy): train_grpo.py's policy is
    # train_dense.py's model without the Gemma knobs.
    unknown = {k: v for k, v in saved.items()
               if k not in {f.name for f in dataclasses.fields(cfg.model)}}
    need(not any(unknown.values()), f"--init-from {run}: its model sets fields this file does "
         f"not have ({ {k: v for k, v in unknown.items() if v} }); was it written by {prog}?")
    return None, dataclasses.replace(cfg.model, **{k: v for k, v in saved.items()
                                                   if k not in unknown})


def with_model(cfg, model):
    """cfg with the model its run starts from (None: its own), whose `how` fields
    (common/config.py) stay this run's flags."""
    return cfg if model is None else dataclasses.replace(cfg, model=dataclasses.replace(
        model, **{f: getattr(cfg.model, f) for f in compute_fields(type(cfg.model))}))


# --- FLOPs and MFU ----------------------------------------------------------------------------
# Dense bf16 peak per chip, from the vendors' data sheets.
PEAK_TFLOPS = {"TPU v4": 275, "TPU v5 lite": 197, "TPU v5e": 197, "TPU v5p": 459, "TPU v5": 459,
               "TPU v6 lite": 918, "TPU v6e": 918, "H100": 989, "H200": 989, "A100": 312,
               "B200": 2250, "L4": 121, "A10": 125}


def peak_flops_per_device(override_tflops: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from); 0 when unknown."""
    if override_tflops > 0:
        return override_tflops * 1e12, "--train.peak-tflops"
    kind = jax.devices()[0].device_kind
    for name, tf in PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return tf * 1e12, f"{kind} data sheet"
    if jax.devices()[0].platform != "cpu":
        return 0.0, f"unknown device {kind!r}: pass --train.peak-tflops"
    # CPU: all simulated devices share the host's cores, so measure the host once with a
    # float32 matmul and divide among them. With several processes, process 0 measures while
    # the others wait in the broadcast: measuring at once, each would see a share of the cores
    # (the processes are taken to share one host, as the launcher starts them).
    host, n, a = 0.0, 1024, jnp.ones((1024, 1024), jnp.float32)
    if jax.process_index() == 0:
        mm = jax.jit(lambda a: a @ a)
        mm(a).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(5):
            out = mm(a)
        out.block_until_ready()
        host = 5 * 2 * n ** 3 / (time.perf_counter() - t0)
    if jax.process_count() > 1:
        host = float(multihost_utils.broadcast_one_to_all(np.float32(host)))
    return host / jax.device_count(), f"measured f32 matmul, host {host / 1e9:.0f} GFLOP/s"


def mfu(flops_per_token: float, tokens_per_s: float, peak: float) -> float:
    return flops_per_token * tokens_per_s / (peak * jax.device_count()) if peak else math.nan


def mfu_text(util: float) -> str:
    return "MFU unknown" if math.isnan(util) else f"MFU {100 * util:.1f}%"


# --- Start-up, dry run and bench --------------------------------------------------------------
def start(quiet: bool) -> None:  # what every run does first
    multislice.initialize()
    multislice.enable_compilation_cache()
    observe.configure(quiet=quiet)


def devices(compile_topology: str = "", compile_slices: int = 1, dry_run: bool = False):
    """The devices to build the mesh from: this machine's, or with --compile-topology a TPU
    slice's that exists only as a description (for --dry-run)."""
    if not compile_topology:
        return jax.devices()
    need(dry_run, f"--compile-topology {compile_topology} compiles for hardware this machine "
         "does not have, so it cannot train: add --dry-run.")
    return tpu_topology_devices(compile_topology, compile_slices)


# XLA's cost_analysis() names -> the dry-run report's keys.
COST_KEYS = {"flops": "xla_flops", "bytes accessed": "xla_bytes_accessed",
             "optimal_seconds": "est_step_s"}


def xla_cost(compiled) -> dict:
    """XLA's own estimate of a compiled step: FLOPs, bytes accessed and, on TPU, its modelled
    step time (optimal_seconds); a key the backend does not give is absent. A while loop's
    body (a scanned layer stack, the chunked loss) is counted once, not once per trip, so
    `xla_while_loops` says how many the step has: with none the figures are the whole step."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # a backend without the analysis raises (the error type varies): no figures
        return {}
    if isinstance(cost, (list, tuple)):  # older JAX: a list with one dict per computation
        cost = cost[0] if cost else None
    if not isinstance(cost, dict):
        return {}
    out = {ours: float(cost[k]) for k, ours in COST_KEYS.items()
           if isinstance(cost.get(k), (int, float)) and cost[k] >= 0}  # XLA writes -1: unknown
    return out | {"xla_while_loops": compiled.as_text().count(" while(")} if out else out


def dry_run(step_fn, abstract_state, batch, mesh, n_params: int, **extra) -> dict:
    """Compile one jitted step on abstract inputs (nothing allocated) and report memory and
    XLA's cost analysis (xla_cost)."""
    t0 = time.perf_counter()
    # Only tracing runs under the mesh: with --compile-topology its devices do not exist here,
    # so no eager array may be created while it is set.
    with jax.set_mesh(mesh):
        compiled = step_fn.lower(abstract_state, batch).compile()
    mem = compiled.memory_analysis()
    report = {"params": n_params, **extra, "devices": mesh.size, "compile_s": time.perf_counter()
              - t0, "platform": mesh.devices.flat[0].platform, **xla_cost(compiled)}
    log(f"dry run | {n_params:,} parameters | mesh {describe(mesh)} | compiled in "
        f"{report['compile_s']:.1f} s")
    if mem is not None:
        report |= {k: int(getattr(mem, k + "_in_bytes")) for k in
                   ("argument_size", "output_size", "alias_size", "temp_size")}
        report["per_device_bytes"] = (report["argument_size"] + report["output_size"]
                                      - report["alias_size"] + report["temp_size"])
        gib = lambda b: f"{b / 2**30:.2f} GiB"
        log(f"per device: {gib(report['per_device_bytes'])} = arguments "
            f"{gib(report['argument_size'])} + outputs {gib(report['output_size'])} - donated "
            f"{gib(report['alias_size'])} + temporaries {gib(report['temp_size'])}")
    if "xla_flops" in report:
        est = f", est. {report['est_step_s']:.4g} s/step" if "est_step_s" in report else ""
        n = report["xla_while_loops"]
        log(f"XLA cost per device: {report['xla_flops']:.3e} FLOPs, "
            f"{report.get('xla_bytes_accessed', math.nan):.3e} bytes accessed{est}"
            + (f" ({n} while loop(s), each body counted once)" if n else ""))
    return report


def bench(step_fn, state, batch, n_steps: int, *, tokens_per_step: int,
          flops_per_token: float, peak: tuple[float, str], what: str = "") -> dict:
    """Median step time over `n_steps` steps after compilation and one warm-up step (first-
    touch allocations). Each step is synced here, which the training loop never does."""
    t0 = time.perf_counter()
    step = step_fn.lower(state, batch).compile()
    compile_s, times = time.perf_counter() - t0, []
    for _ in range(n_steps + 1):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    times = times[1:]  # the warm-up step's left out
    dt = float(np.median(times))
    tok_s = tokens_per_step / dt
    util = mfu(flops_per_token, tok_s, peak[0])
    log(f"bench{what} | {tok_s:.0f} tok/s | {1e3 * dt:.1f} ms/step (median of {n_steps}, "
        f"min {1e3 * min(times):.1f}) | {mfu_text(util)} of {peak[0] / 1e12:.3g} TFLOP/s per "
        f"device ({peak[1]}) | compile {compile_s:.1f} s")
    # Each step's wall time, the warm-up being step 0: what bench/stats.py reads.
    log(f"bench{what} | step seconds 1-{n_steps}: " + " ".join(f"{t:.4f}" for t in times))
    return {"tokens_per_s": tok_s, "ms_per_step": 1e3 * dt, "mfu": util, "compile_s": compile_s,
            "step_seconds": times}


def put(tree, mesh, batch_axes, abstract: bool = False):
    """Host arrays that every process holds whole -> global arrays split on their rows
    (scalars replicated); with `abstract`, only their shapes, dtypes and shardings. Not
    device_put: onto other processes' devices, it is not in every JAX we support."""
    def one(x):
        x = np.asarray(x)
        sh = NamedSharding(mesh, P(batch_axes, *[None] * (x.ndim - 1)) if x.ndim else P())
        return (jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh) if abstract else
                jax.make_array_from_callback(x.shape, sh, lambda i: x[i]))
    return jax.tree.map(one, tree)


def fetch(x) -> np.ndarray:
    """A global array, whole, on every process's host (gathered when several hold parts)."""
    return np.asarray(multihost_utils.process_allgather(x, tiled=True)
                      if jax.process_count() > 1 else jax.device_get(x))


MASKED = -1e30  # finite: exp() underflows to 0 and 0 * MASKED stays 0 (entropy is NaN-free)


def draw(key, z_BV, temperature, top_k: int, top_p: float, rows=None, n_rows: int = 0):
    """One token per row from policy logits z; argmax where temperature == 0. top-k keeps the
    k largest logits; top-p (Holtzman et al. 2020) keeps the smallest set of most likely tokens
    whose mass reaches p: a token stays if the mass before it is < p. `rows`: z's rows are
    these of a batch of n_rows, and each draws with that row's noise (jax.random.categorical's
    Gumbel-max over the whole batch), so a row's token does not depend on the rows beside it."""
    if top_k > 0:
        kth = jax.lax.top_k(z_BV, top_k)[0][:, -1:]
        z_BV = jnp.where(z_BV < kth, MASKED, z_BV)
    if top_p < 1.0:
        desc_BV = -jnp.sort(-z_BV, axis=-1)
        p_BV = jax.nn.softmax(desc_BV, axis=-1)
        n_keep = jnp.sum(jnp.cumsum(p_BV, axis=-1) - p_BV < top_p, axis=-1, keepdims=True)
        z_BV = jnp.where(z_BV < jnp.take_along_axis(desc_BV, n_keep - 1, axis=-1), MASKED, z_BV)
    drawn = jax.random.categorical(key, z_BV, axis=-1) if rows is None else jnp.argmax(
        jax.random.gumbel(key, (n_rows, z_BV.shape[-1]), z_BV.dtype)[rows] + z_BV, axis=-1)
    return jnp.where(temperature > 0, drawn, jnp.argmax(z_BV, axis=-1)).astype(jnp.int32)


def prompt_rows(prompts: list[list[int]], n_new: int, max_len: int, mesh, batch_axes):
    """(tokens, segment_ids, positions, width): the prompts left-padded to one width in a
    buffer with room for n_new tokens, placed over the batch axes, for a decode loop that
    fills column i with `next_token` from the logits at i - 1 (full forwards, no KV cache: a
    peek at the model, not an inference server). The padding is a segment of its own, which
    no prompt attends to, and each prompt's positions start at 0 as they did in training;
    segment_ids and positions are None when every prompt has the same length."""
    keep = max(1, max_len - n_new)
    prompts = [list(p)[-keep:] for p in prompts]
    width = max(map(len, prompts))
    shards = math.prod(mesh.shape[a] for a in batch_axes)  # whole rows per batch shard: the
    B = -(-len(prompts) // shards) * shards                 # activations split evenly
    buf = np.zeros((B, width + n_new), np.int32)
    seg, pos = np.ones_like(buf), np.zeros_like(buf)
    for i in range(B):
        p = prompts[min(i, len(prompts) - 1)]  # spare rows repeat the last prompt
        pad = width - len(p)
        buf[i, pad:width], seg[i, :pad] = p, 0
        pos[i, pad:] = np.arange(buf.shape[1] - pad)
    if all(len(p) == width for p in prompts):
        return put(buf, mesh, batch_axes), None, None, width
    return *put((buf, seg, pos), mesh, batch_axes), width


def next_token(logits_BTV, buf, key, i, *, temperature: float, n_valid: int):
    """(buf with column i drawn from the logits at i - 1, the next key); only the first
    n_valid ids are drawn: the vocabulary may be padded past the tokenizer's."""
    logits = logits_BTV[:, i - 1, :n_valid]
    key, sub = jax.random.split(key)
    nxt = draw(sub, logits / temperature if temperature else logits, temperature, 0, 1.0)
    return buf.at[:, i].set(nxt.astype(buf.dtype)), key


def completions(buf, n: int, width: int) -> list[list[int]]:
    """The new tokens of each of the n prompts in a decoded `prompt_rows` buffer."""
    out = fetch(buf)
    return [out[i, width:].tolist() for i in range(n)]


# --- A run directory opened for training, and the loop's mechanics ----------------------------
class Run(contextlib.AbstractContextManager):
    """The run directory of a training run: config.json checked against this run's config
    (nothing saved is overwritten by a conflicting one), metrics, profiler, checkpoints.
    Closed in reverse order: the last save is waited for (and raises if it failed) first."""

    def __init__(self, cfg, profile_steps: tuple[int, ...] = (), defaults=None,
                 keep_weights: str = ""):
        self.cfg, self.dir = cfg, cfg.run_dir
        self.t_start = time.perf_counter()
        try:  # refused now, not at the first save 100 steps in
            run_path(self.dir).mkdir(parents=True, exist_ok=True)
            if not observe.is_remote(self.dir):  # a bucket: Orbax reports its own errors
                probe = os.path.join(self.dir, f".write-test-{jax.process_index()}")
                open(probe, "w").close()
                os.remove(probe)
        except OSError as e:
            raise CheckpointError(f"--run-dir {self.dir}: cannot write there ({e}); choose a "
                                  "directory this user can write to.") from None
        config = dataclasses.asdict(cfg)
        if observe.is_main_process():
            check_run_config(self.dir, config, may_change(type(cfg)), keep_weights=keep_weights,
                             defaults=None if defaults is None else dataclasses.asdict(defaults))
        with contextlib.ExitStack() as stack:
            self.metrics_log = stack.enter_context(observe.MetricsLog(self.dir, config))
            self.profiler = stack.enter_context(observe.Profiler(self.dir, profile_steps))
            self.ckpt = stack.enter_context(Checkpointer(self.dir, cfg.checkpoint))
            self._stack = stack.pop_all()

    __exit__ = lambda self, *exc: self._stack.close()

    def resume(self, abstract_state) -> tuple[dict | None, int]:
        """(the latest checkpoint's state, its step), or (None, 0) in a new run directory."""
        start = self.ckpt.resume_step()
        if start is None:
            return None, 0
        state = self.ckpt.restore(start, abstract_state)
        log(f"resumed from step {start} ({self.dir}/checkpoints/{start})")
        return state, start


class Loop:
    """Everything a training loop does besides the step, so that the trainer shows its loop:

        loop = Loop(run, start, steps, log_every=..., eval_every=..., ...)
        for step in loop:                      # profiler marks; stops after a SIGTERM save
            state, metrics = step_fn(state, batch(step))
            loop.log(metrics)                  # fetched one step late: no sync per step
            if loop.eval_due:
                loop.eval({"eval_loss": evaluate(state["params"])})
            loop.checkpoint(state)             # every --checkpoint.every, at the end, SIGTERM

    A log line is "step N | " + show(record) + throughput and MFU; the record goes to
    metrics.jsonl (and TensorBoard). `loop.step` is the step just taken (1-based). A step
    whose metrics say `nonfinite` (see `update`) stops the run with NonFiniteError before
    anything of it is saved, or, within --*.max-bad-steps, is counted and skipped."""

    def __init__(self, run: Run, start: int, steps: int, *, log_every: int, eval_every: int,
                 tokens_per_step: int, flops_per_token: float, peak_tflops: float,
                 show: Callable[[dict], str], flag: str = "--train", max_bad_steps: int = 0):
        self.run, self.start, self.steps, self.flag = run, start, steps, flag
        self.max_bad_steps, self.bad_steps, self._metrics = max_bad_steps, 0, {}
        self.log_every, self.eval_every, self.show = log_every, eval_every, show
        self.tokens_per_step, self.fpt = tokens_per_step, flops_per_token
        self.peak, self.peak_src = peak_flops_per_device(peak_tflops)
        self.step, self.stopped, self.seconds, self.compile_s = start, False, 0.0, None
        self.evals, self.first_loss, self.last_loss = [], None, None  # evals: (step, figures)
        # _pending: (step, device metrics, steps covered, eval figures joined to it), fetched a
        # step late; _late: (did any process get SIGTERM?, was the step non-finite?, its
        # metrics), read a step late, when the device is done with it; _logged: the last record's
        self._pending, self._late, self._logged = None, None, start

    def compile(self, step_fn, state, batch):
        """The step compiled ahead of time (timed), unless nothing is left to train."""
        if self.start >= self.steps:
            return step_fn
        with observe.progress("compiling train step") as p:
            step_fn = step_fn.lower(state, batch).compile()
            p.note = (f"| peak {self.peak / 1e12:.3g} TFLOP/s per device ({self.peak_src}) | "
                      f"{self.fpt / 1e6:.1f} MFLOP/token")
        self.compile_s = p.seconds
        return step_fn

    def __iter__(self):
        if self.start >= self.steps:
            log(f"already at step {self.start} of {self.flag}.steps {self.steps}: nothing to "
                f"train (raise {self.flag}.steps to continue)")
        t_loop = self._t_log = time.perf_counter()
        with PreemptionGuard() as self._guard:
            for step in range(self.start, self.steps):
                self.step = step + 1
                self.run.profiler.before(self.step)
                yield step
                if self.stopped:
                    break
            if self._pending is not None:
                self._fetch_and_emit()
        self.seconds = time.perf_counter() - t_loop

    def log(self, metrics: dict) -> None:
        """The step's device metrics; the previous log step's, finished by now, are fetched."""
        self._metrics = metrics
        self.run.profiler.after(self.step, metrics)
        if self._pending is not None:
            self._fetch_and_emit()
        s = self.step
        if s % self.log_every == 0 or s == self.steps or s == self.start + 1:
            self._pending, self._logged = (s, metrics, s - self._logged, {}), s

    def _fetch_and_emit(self) -> None:
        step, metrics, n_steps, joined = self._pending
        # Explicit, like every fetch here: float(x) of a device array would hide a wait.
        m = jax.device_get(metrics)
        now = time.perf_counter()
        dt_s, self._t_log, self._pending = now - self._t_log, now, None
        tok_s = self.tokens_per_step * n_steps / dt_s
        util = mfu(self.fpt, tok_s, self.peak)
        rec = {"step": step} | {k: np.asarray(v).tolist() if np.ndim(v) else float(v)
                                for k, v in m.items()}
        rec |= {"tokens_per_s": tok_s, "mfu": util, "ms_per_step": 1e3 * dt_s / n_steps,
                "skipped_steps": self.bad_steps}
        rec |= joined
        if "loss" in rec:
            self.first_loss = rec["loss"] if self.first_loss is None else self.first_loss
            self.last_loss = rec["loss"]
        log(f"step {step} | {self.show(rec)} | {tok_s / 1e3:.1f}k tok/s | {mfu_text(util)} | "
            f"{rec['ms_per_step']:.0f} ms/step")
        self.run.metrics_log.write(rec)

    @property
    def eval_due(self) -> bool:
        return self.step % self.eval_every == 0 or self.step == self.steps

    def eval(self, figures: dict, write: bool = True) -> dict:
        """Held-out figures of this step: joined to its log record, else (unless the caller
        writes them itself) a record of their own."""
        self.evals.append((self.step, figures))
        if self._pending is not None and self._pending[0] == self.step:
            self._pending[3].update(figures)
        elif write:
            self.run.metrics_log.write({"step": self.step} | figures)
        return figures

    def checkpoint(self, state) -> None:
        """Save when due, at the last step, and at the step after any process got SIGTERM
        (the vote is read one step late: every process saves the same step). A step is saved
        only once its metrics are known finite: a save waits for its step anyway."""
        m, bad = self._metrics, self._metrics.get("nonfinite", False)
        late, self._late = self._late, (multislice.any_process(self._guard.requested), bad, m)
        stop, late_bad = (False, False) if late is None else jax.device_get(late[:2])
        if late_bad:
            self.nonfinite(self.step - 1, late[2])
        force = self.step == self.steps or stop
        if (force or self.run.ckpt.due(self.step)) and jax.device_get(bad):
            self.nonfinite(self.step, m)
            self._late = (self._late[0], False, m)  # counted once
        if self.run.ckpt.save(self.step, state, force=force):
            self.run.metrics_log.checkpointed()
        if stop:
            log(f"SIGTERM: saved step {self.step}, exiting")
            self.stopped = True

    def nonfinite(self, step: int, m: dict) -> None:
        """Step `step` (metrics `m`) did not update: stop, or count it and go on."""
        self.bad_steps, m = self.bad_steps + 1, jax.device_get(m)
        what = ", ".join(f"{k} {float(m[k]):.4g}" for k in ("loss", "grad_norm", "kl") if k in m)
        if self.bad_steps > self.max_bad_steps:
            raise NonFiniteError(
                f"step {step}: {what}: not finite, so its update was not applied and nothing "
                f"of it was saved. The newest checkpoint in {self.run.dir}/checkpoints is the "
                f"last good state; a rerun resumes from it. Likely causes: a learning rate too "
                f"high ({self.flag}.lr), an overflow in bfloat16 (--model.dtype float32 tells), "
                f"a bad batch. {self.flag}.max-bad-steps N skips up to N such updates "
                f"({self.bad_steps - 1} skipped in this run, of {self.max_bad_steps}).")
        log(f"step {step}: {what}: not finite; update skipped ({self.bad_steps} of "
            f"{self.flag}.max-bad-steps {self.max_bad_steps})")

    def summary(self, end: int, per_step: str, rows=()) -> dict:
        """The run on one screen, and its figures for the caller: how far (to step `end`), how
        well (the losses, when logged, and the trainer's rows), how long, how fast, where."""
        fmt, start = observe.fmt, self.start
        evals = [(s, e["eval_loss"]) for s, e in self.evals if "eval_loss" in e]
        best = min((e for _, e in evals), default=None)
        if self.first_loss is not None:
            rows = [("loss", f"{fmt(self.first_loss)} -> {fmt(self.last_loss)} | best eval "
                             f"loss {fmt(best)} | last eval loss "
                             f"{fmt(evals[-1][1] if evals else None)}"), *rows]
        ms = observe.mean_ms_per_step(self.run.metrics_log.records, start)
        tok_s = self.tokens_per_step / ms * 1e3
        util = mfu(self.fpt, tok_s, self.peak)
        timing = observe.duration(time.perf_counter() - self.run.t_start)
        if self.compile_s is not None:
            timing += f" (compile {self.compile_s:.1f} s, steps {observe.duration(self.seconds)})"
        observe.print_summary(f"run {self.run.dir}: done", [
            ("steps", f"{start} -> {end} ({end - start} this run, of {self.flag}.steps "
                      f"{self.steps})"),
            ("tokens", f"{(end - start) * self.tokens_per_step:,} this run ({per_step} per "
                       "step)"), *rows, ("wall time", timing),
            ("throughput", f"{fmt(tok_s / 1e3, '.1f')}k tok/s, {mfu_text(util)}, "
                           f"{fmt(ms, '.0f')} ms/step (mean over logged steps after the first)"),
        ] + observe.where_rows(self.run.dir, self.run.metrics_log, self.run.profiler))
        return {"start_step": start, "final_step": end, "first_loss": self.first_loss,
                "last_loss": self.last_loss, "compile_s": self.compile_s, "evals": evals,
                "best_eval": best} | (self.evals[-1][1] if self.evals else {})


# --- export-hf and the command line -----------------------------------------------------------
ExportDtype = Literal["float32", "bfloat16"]
# A trainer's `export_hf(run_dir, out, step, dtype, model_type, max_shard_gb)`: what tyro shows.
EXPORT_HF_DOC = """\
Write a run's checkpoint as a HuggingFace folder (config.json, safetensors, tokenizer).

Args:
    run_dir: The run directory: its config.json and checkpoints/.
    out: The folder to create (new or empty).
    step: The checkpoint to export; -1 = the latest.
    dtype: Of the weights written (checkpoints hold float32).
    model_type: The family; "" = the run's source's, else the one its knobs say.
    max_shard_gb: The largest safetensors file.
"""


@contextlib.contextmanager
def run_config(run_dir: str):
    """export-hf: the run's saved config.json, for the trainer to read its configs from inside
    the block; a key it lacks or one it does not know (KeyError, TypeError) is a ConfigError."""
    saved = read_run_config(run_dir, "--run-dir")
    try:
        yield saved
    except (KeyError, TypeError) as e:
        raise ConfigError(f"{run_path(run_dir, 'config.json')} is not a run config this trainer "
                          f"reads ({e}).") from None


@dataclasses.dataclass
class Export:
    """A run's checkpoint on its way to a HuggingFace folder (see `export`): the trainer's
    save_hf(params, model, out, model_type=..., **hf_args) writes it, `written` reports."""
    run_dir: str
    step: int
    params: dict                # float32, the buffers joined in
    hf_args: dict               # base_config (the source's keys, or the tokenizer's ids), dtype
    tokenizer_dir: str | None   # the folder to copy tokenizer files from
    lora: LoRAConfig | None = None
    adapters: dict | None = None  # a LoRA run's, unmerged (`params` holds them merged)

    def written(self, files: list[str], out: str) -> list[str]:
        """save_hf wrote `files` to `out`: the tokenizer joins them; one line says what."""
        if self.tokenizer_dir:
            files += hf.copy_tokenizer(self.tokenizer_dir, out)
        size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
        print(f"export-hf: step {self.step} of {self.run_dir} -> {out} ({len(files)} files, "
              f"{size / 1e9:.2f} GB, {self.hf_args['dtype']}): {', '.join(files)}", flush=True)
        return files


def export(run_dir: str, step: int, saved: dict, tables: dict, dtype: str, max_shard_gb: float,
           *, tokenizer_run: str = "", data=None, dims: dict | None = None) -> Export:
    """The checkpoint `step` (-1 the latest) of the run whose config.json is `saved`, shaped
    by `tables` ({"params": table[, "buffers": table]}) and read split over every local device
    (fsdp) when the model's sizes allow; what its export keeps: a run started from a
    HuggingFace folder keeps that folder's config keys and tokenizer files, else the tokenizer
    of the run `tokenizer_run` (following its --init-from) or of the data config `data` ships."""
    tables = {k: v for k, v in tables.items() if v}  # no buffers: none saved
    lora = LoRAConfig(**saved.get("lora", {}))
    if lora.rank:  # a LoRA run saved its frozen model and the adapters (`dims`: their axes)
        tables |= {"base": tables["params"], "params": lora_table(tables["params"], dims, lora)}
    mesh = make_mesh(MeshConfig(fsdp=len(jax.devices())))
    try:
        check_divides(tables, mesh, run_dir)
    except ConfigError:
        mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    abstract = jax.tree.map(
        lambda e, sh: jax.ShapeDtypeStruct(e[0], jnp.float32, sharding=sh), tables,
        named(mesh, table_specs(tables)), is_leaf=is_entry)
    state, at = read_checkpoint(run_dir, abstract, f"--run-dir {run_dir} has no checkpoint to "
                                "export.", step)
    src, tok, base, tokenizer_dir = hf_origin(saved), None, {}, None
    # The data may be gone: then the export ships no tokenizer.
    with contextlib.suppress(FileNotFoundError, ValueError, OSError):
        if not src and tokenizer_run:
            tok = run_tokenizer(tokenizer_run)
        elif not src and data is not None:
            tok = load_dataset(data).tokenizer_path
    if src and os.path.isfile(os.path.join(src, hf.CONFIG)):  # its config: token ids, chat
        base, tokenizer_dir = hf.read_config(src), src
    elif tok and os.path.isfile(tok):  # one trained from scratch: its data's tokenizer and ids
        sp = open_tokenizer(tok)
        base = {"bos_token_id": sp.bos_id() if sp.bos_id() >= 0 else None,
                "eos_token_id": sp.eos_id()}
        tokenizer_dir = os.path.dirname(tok)
    return Export(run_dir, at, join(merged(weights(state, lora)), state.get("buffers", {})), dict(
        base_config=base, dtype=dtype, max_shard_bytes=int(max_shard_gb * 2**30)), tokenizer_dir,
        lora, state["params"] if lora.rank else None)


def hf_origin(saved: dict) -> str:
    """The HuggingFace folder a run descends from, through its --init-from runs (an SFT or GRPO
    run of a fine-tune of it), or "": its export keeps that folder's config and tokenizer."""
    seen = set()
    while not saved.get("init_from_hf") and saved.get("init_from") not in (None, "", *seen):
        seen.add(saved["init_from"])
        try:
            saved = read_run_config(saved["init_from"], "--init-from")
        except (FileNotFoundError, ValueError, OSError):  # moved or deleted since
            return ""
    return saved.get("init_from_hf") or ""


def hf_params(ckpt: hf.Checkpoint, mesh, table: dict, mapping: dict, sizes: dict,
              unused=lambda name: False) -> dict:
    """The float32 parameters of an opened HuggingFace folder, placed as the parameter `table`
    says on `mesh` (default the first device); `mapping` and `sizes` are the family's names and
    layouts (common/hf.py), `unused` says which tensors its releases carry that its model
    never reads. Each device reads only its own block."""
    mesh = mesh or make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    check_divides(table, mesh, ckpt.path)
    mt = ckpt.config["model_type"]
    # Some exports keep lm_head.weight although it is tied (so the mapping has none), older ones
    # rotary tables; layers past num_hidden_layers that the mapping does not read are DeepSeek-
    # V3's multi-token-prediction module, which the model we train leaves out (config says 0).
    layer = lambda n: int(m[1]) if (m := re.match(r"model\.layers\.(\d+)\.", n)) else -1
    last = max([layer(n) for t, p in jax.tree.leaves(mapping, is_leaf=hf._is_entry) for _, n in
                hf._file_names(t, hf.parse_layout(p, sizes), sizes)] + [
        ckpt.config["num_hidden_layers"] - 1])
    extra = lambda n: layer(n) > last
    ignore = lambda n: (n == "lm_head.weight" or n.endswith("rotary_emb.inv_freq") or extra(n)
                        or unused(n))
    if ckpt.other_towers:
        log(f"{ckpt.path}: a multimodal folder: its language model is loaded, and not the "
            f"{len(ckpt.other_towers)} tensors of its other towers ({ckpt.other_towers[0]}, ...)")
    if skipped := sorted(n for n in ckpt.names() if extra(n)):
        log(f"{ckpt.path}: {len(skipped)} tensors of layers past num_hidden_layers (a multi-"
            f"token-prediction module) are not loaded, e.g. {skipped[0]}")
    return hf.load(ckpt, mapping, sizes, named(mesh, table_specs(table)),
                   what=f"{mt} model of this config", ignore=ignore)


def cli(presets: dict, args: list[str] | None = None):
    """A preset by name, any field as a flag (tyro). With --init-from-hf the model's shape is
    the folder's config.json: a --model.* flag other than a `how` field (common/config.py)
    would contradict it, and is refused."""
    cfg = tyro.extras.overridable_config_cli(presets, args=args)
    allowed = compute_fields(type(cfg.model))
    names = [a.split("=")[0] for a in (sys.argv[1:] if args is None else args)]
    for name in names if getattr(cfg, "init_from_hf", "") else ():
        field = name.removeprefix("--model.").replace("-", "_").removeprefix("no_")
        if name.startswith("--model.") and field not in allowed:
            flags = ", ".join("--model." + f.replace("_", "-") for f in allowed)
            raise ConfigError(f"{name} conflicts with --init-from-hf: the model's shape comes "
                              f"from that folder's config.json. Drop the flag (only {flags} may "
                              "be set).")
    return cfg


def run_cli(main: Callable, cli: Callable, export: Callable | None = None) -> None:
    """`python train_x.py PRESET [--flags]`, or `python train_x.py export-hf --run-dir R
    --out O`. Bad input prints a one-paragraph reason and the fix and exits 2."""
    prog = os.path.basename(sys.argv[0])
    try:
        if export is not None and sys.argv[1:2] == ["export-hf"]:
            tyro.cli(export, args=sys.argv[2:], prog=f"{prog} export-hf")
        else:
            main(cli())
    except (*INPUT_ERRORS, NonFiniteError) as e:  # 3: not bad input, yet as sure to fail again
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3 if isinstance(e, NonFiniteError) else 2)
