"""A training run's state, step and loop: the plumbing that no model changes, written once.

A trainer (train_*.py) keeps what a forker edits: config and presets, parameter table, model,
loss, `train_step` and a short loop in plain sight. This file holds the rest: parameter tables,
checks before compiling, the state on a mesh and its update, FLOPs and MFU, dry run and bench,
the loop's mechanics and the command line. It knows no model: it reads no ModelConfig field (the
trainer hands it tables, configs, logits and, on the command line, its own functions).
"""
import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from common import multislice, observe
from common.config import ConfigError, compute_fields, may_change, need
from common.checkpoint import (CheckpointError, Checkpointer, ConfigConflictError,
                               PreemptionGuard, RunConfigError, check_run_config, read_checkpoint,
                               run_path)
from common.data import DataError
from common.mesh import MeshConfig, MeshError, describe, tpu_topology_devices

log = observe.say  # process 0 prints; the others keep quiet


class NonFiniteError(RuntimeError):
    """Training diverged: a step's loss or gradient was not finite (exit code 3)."""


# Bad input of any kind: the command line prints the reason and exits 2, never a traceback.
INPUT_ERRORS = (ConfigError, MeshError, ConfigConflictError, CheckpointError, FileNotFoundError,
                DataError, multislice.DistributedInitError, RunConfigError)  # hf.HFError too


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
    """Float32 weights: std None = ones (norm gains), 0.0 = zeros (biases), else normal(0, std).
    One key per entry, in the table's (sorted) order."""
    entries, treedef = jax.tree.flatten(table, is_leaf=is_entry)
    keys = jax.random.split(key, len(entries))
    f32 = jnp.float32
    return jax.tree.unflatten(treedef, [
        jnp.ones(shape, f32) if std is None else std * jax.random.normal(k, shape, f32)
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


def cast_matrices(params: dict, dtype: str, matrices: set[str]) -> dict:
    """--train.weight-dtype: the master copy of the weights named in `matrices` in `dtype`. Norm
    gains, biases and scalars stay float32: their updates are small against their size, which
    bfloat16's 8 bits round away, and they are few."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(dtype) if path[-1].key in matrices else x, params)


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
    distillation teacher), placed by their specs, given to `from_params` by name.
    `cast(params)`: the master weights' dtypes (`cast_matrices`); `offload`: the optimiser state
    lives in host memory (pinned_host) between steps and is brought to the device inside each
    (MaxText's optimizer_memory_host_offload): only the weights and gradients stay in HBM."""

    def __init__(self, init: Callable, specs: dict, tx, mesh, *, ref: bool = False,
                 buffers: tuple[Callable, dict] | None = None, lora: tuple | None = None,
                 frozen: dict | None = None, cast: Callable = lambda p: p, offload: bool = False):
        self.init, self.tx, self.mesh, self.ref = init, tx, mesh, ref
        self.cast, self.offload = cast, offload
        self.buffers, self.lora, self.model = buffers, lora, "base" if lora else "params"
        self.frozen = frozen or {}
        p_sh = named(mesh, specs)
        if lora:  # the model frozen, the adapters trained: the optimiser sees only those
            p_sh, self.base_sh = named(mesh, table_specs(lora[0])), p_sh
        # No concrete key: with --compile-topology the mesh's devices do not exist here.
        abstract = jax.eval_shape(lambda: self._trained(cast(init(jax.random.key(0)))))
        replicated = NamedSharding(mesh, P())
        # Moments take their parameter's sharding; Muon's partition leaves MaskedNodes (no
        # state) where the other optimiser's parameters are.
        masked = lambda x: isinstance(x, optax.MaskedNode)
        opt_sh = optax.tree_map_params(tx, lambda v, s: v if masked(v) else s,
                                       jax.eval_shape(tx.init, abstract), p_sh, is_leaf=masked,
                                       transform_non_params=lambda _: replicated)
        optional = {"ref": p_sh if ref else None, "base": self.base_sh if lora else None,
                    "buffers": named(mesh, buffers[1]) if buffers else None}
        self.opt_on_device = opt_sh
        if offload:
            opt_sh = jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), opt_sh)
        self.shardings = {"params": p_sh, "opt_state": opt_sh, "step": replicated} | {
            k: v for k, v in optional.items() if v is not None} | {
            k: named(mesh, specs) for k, (_, specs) in self.frozen.items()}

    def _trained(self, params):
        return table_init(self.lora[0], jax.random.key(self.lora[1])) if self.lora else params

    def _make(self, params, buffers=None, frozen=None):
        params = self.cast(params)
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
        one copy of the state, not two. Offloaded, the optimiser state comes to the device for
        the step and goes back to the host as its output (out_shardings)."""
        if self.offload:
            step_fn = functools.partial(lambda f, state, *a: f(state | {"opt_state": jax.device_put(
                state["opt_state"], self.opt_on_device)}, *a), step_fn)
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


# --model.remat: what a layer's backward pass keeps of its forward pass; the rest is recomputed.
# The named policies keep the tensors a trainer's layer names (jax.ad_checkpoint.checkpoint_name):
# its projections' outputs and attention's, cheap to keep next to what they cost to recompute.
REMAT_NAMES = {"qkv": ("q", "k", "v"), "attn": ("q", "k", "v", "attn"),
               "proj": ("q", "k", "v", "attn", "o", "mlp_in", "mlp_out")}
REMAT_ORDER = ("none", "proj", "dots", "attn", "qkv", "full")  # `auto`'s: most kept first


def remat_policy(name: str):
    """jax.checkpoint's policy for --model.remat `name` (`auto` unresolved: `full`'s). offload:
    `proj`'s tensors go to host memory in the forward pass and come back for the backward."""
    cp = jax.checkpoint_policies
    if name == "offload":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(REMAT_NAMES["proj"]),
            offload_src="device", offload_dst="pinned_host")
    if name in REMAT_NAMES:
        return cp.save_only_these_names(*REMAT_NAMES[name])
    return cp.dots_with_no_batch_dims_saveable if name == "dots" else cp.nothing_saveable


def remat(f, policy: str, scan: bool = True):
    """A layer under --model.remat. Inside a rolled scan the recomputation cannot be merged
    away; unrolled, XLA would merge it into the forward pass (and keep every activation)."""
    return f if policy == "none" else jax.checkpoint(f, policy=remat_policy(policy),
                                                     prevent_cse=not scan)


def step_bytes(compiled) -> dict:
    """A compiled step's memory per device (XLA's analysis), `per_device_bytes` their sum."""
    mem = compiled.memory_analysis()
    if mem is None:
        return {}
    out = {k: int(getattr(mem, k + "_in_bytes")) for k in
           ("argument_size", "output_size", "alias_size", "temp_size")}
    return out | {"per_device_bytes": out["argument_size"] + out["output_size"]
                  - out["alias_size"] + out["temp_size"]}


def memory_limit(device) -> int | None:
    """The bytes a device's programs may use (a TPU's HBM less what the runtime keeps), or None
    where it states none (the CPU, a --compile-topology device)."""
    try:
        return (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # a device without a client (a topology's) raises; the type varies
        return None


def auto_remat(step_for: Callable[[str], Callable], abstract_state, batch, mesh) -> str:
    """--model.remat auto: the policy that keeps the most (REMAT_ORDER) whose step, compiled on
    abstract inputs before training, fits the device's memory (`memory_limit`); where no limit is
    stated (the CPU), the first, `none`. `step_for(policy)`: the jitted step under it."""
    limit, gib = memory_limit(mesh.devices.flat[0]), lambda b: f"{b / 2**30:.2f} GiB"
    if limit is None:
        log(f"remat auto: {mesh.devices.flat[0].platform} devices state no memory limit: "
            f"{REMAT_ORDER[0]}")
        return REMAT_ORDER[0]
    for name in REMAT_ORDER:
        try:
            with jax.set_mesh(mesh):
                need = step_bytes(step_for(name).lower(abstract_state, batch).compile()).get(
                    "per_device_bytes", 0)
        except Exception as e:  # XLA refuses a program larger than the device's memory
            if "RESOURCE_EXHAUSTED" not in str(e) and "memory" not in str(e).lower():
                raise
            need = math.inf
        log(f"remat auto: {name} needs {gib(need)} of {gib(limit)} per device" + (
            ": chosen" if need <= limit else ""))
        if need <= limit:
            return name
    log("remat auto: no policy fits; full, the least kept (add devices or shrink the batch)")
    return "full"


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
    report = {"params": n_params, **extra, "devices": mesh.size, "compile_s": time.perf_counter()
              - t0, "platform": mesh.devices.flat[0].platform, **xla_cost(compiled)}
    log(f"dry run | {n_params:,} parameters | mesh {describe(mesh)} | compiled in "
        f"{report['compile_s']:.1f} s")
    if mem := step_bytes(compiled):
        report |= mem
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
            "step_seconds": times} | step_bytes(step)


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
        # Seconds of eval and checkpoint steps, kept out of the steps' timing: in all, and in the
        # interval the next log record covers; _t_aside: when the eval now due began.
        self.aside, self._aside_now, self._t_aside = {"eval": 0.0, "checkpoint": 0.0}, 0.0, None
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
        dt_s, self._t_log, self._pending = now - self._t_log - self._aside_now, now, None
        self._aside_now = 0.0
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
        """Whether to evaluate after this step; if so, the eval's time starts now, once the step
        is done (its time stays the training steps'), and ends at `eval`."""
        due = self.step % self.eval_every == 0 or self.step == self.steps
        if due:
            jax.block_until_ready(self._metrics)
            self._t_aside = time.perf_counter()
        return due

    def _set_aside(self, what: str, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.aside[what] += dt
        self._aside_now += dt

    def eval(self, figures: dict, write: bool = True) -> dict:
        """Held-out figures of this step: joined to its log record, else (unless the caller
        writes them itself) a record of their own."""
        self.evals.append((self.step, figures))
        if self._t_aside is not None:
            self._set_aside("eval", self._t_aside)
            self._t_aside = None
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
        t0 = None
        if force or self.run.ckpt.due(self.step):  # a save's time from when its step is done
            jax.block_until_ready(state)
            t0 = time.perf_counter()
        if self.run.ckpt.save(self.step, state, force=force):
            self.run.metrics_log.checkpointed()
        if t0:
            self._set_aside("checkpoint", t0)
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
            timing += (f" (compile {self.compile_s:.1f} s, steps "
                       f"{observe.duration(self.seconds - sum(self.aside.values()))}, eval "
                       f"{self.aside['eval']:.1f} s, checkpoints {self.aside['checkpoint']:.1f} s)")
        observe.print_summary(f"run {self.run.dir}: done", [
            ("steps", f"{start} -> {end} ({end - start} this run, of {self.flag}.steps "
                      f"{self.steps})"),
            ("tokens", f"{(end - start) * self.tokens_per_step:,} this run ({per_step} per "
                       "step)"), *rows, ("wall time", timing),
            ("throughput", f"{fmt(tok_s / 1e3, '.1f')}k tok/s, {mfu_text(util)}, "
                           f"{fmt(ms, '.0f')} ms/step (training steps: mean over logged steps "
                           "after the first, eval and checkpoints apart)"),
        ] + observe.where_rows(self.run.dir, self.run.metrics_log, self.run.profiler))
        return {"start_step": start, "final_step": end, "first_loss": self.first_loss,
                "last_loss": self.last_loss, "compile_s": self.compile_s, "evals": evals,
                "ms_per_step": ms, "eval_s": self.aside["eval"],
                "checkpoint_s": self.aside["checkpoint"],
                "best_eval": best} | (self.evals[-1][1] if self.evals else {})


# --- The command line ----------------------------------------------------------------------
def cli(presets: dict, args: list[str] | None = None):
    """A preset by name, any field as a flag (tyro). With --init-from-hf the model's shape is
    the folder's config.json: a --model.* flag other than a `how` field or an `added` one
    (common/config.py: what the trainer adds where the folder lacks it) would contradict it,
    and is refused."""
    cfg = tyro.extras.overridable_config_cli(presets, args=args)
    allowed = compute_fields(type(cfg.model)) + tuple(
        f.name for f in dataclasses.fields(cfg.model) if f.metadata.get("added"))
    names = [a.split("=")[0] for a in (sys.argv[1:] if args is None else args)]
    for name in names if getattr(cfg, "init_from_hf", "") else ():
        field = name.removeprefix("--model.").replace("-", "_").removeprefix("no_")
        if name.startswith("--model.") and field not in allowed:
            flags = ", ".join("--model." + f.replace("_", "-") for f in allowed)
            raise ConfigError(f"{name} conflicts with --init-from-hf: the model's shape comes "
                              f"from that folder's config.json. Drop the flag (only {flags} may "
                              "be set).")
    return cfg


def run_cli(main: Callable, cli: Callable, export: Callable | None = None,
            evaluate: Callable | None = None) -> None:
    """`python train_x.py PRESET [--flags]`, `... export-hf --run-dir R --out O`, or `... eval
    --run-dir R --tasks T` (`evaluate`: common/eval.py's run_eval, handed the trainer whose `main`
    this is). Bad input prints a one-paragraph reason and the fix and exits 2."""
    prog = os.path.basename(sys.argv[0])
    try:
        if export is not None and sys.argv[1:2] == ["export-hf"]:
            tyro.cli(export, args=sys.argv[2:], prog=f"{prog} export-hf")
        elif evaluate is not None and sys.argv[1:2] == ["eval"]:
            evaluate(sys.modules[main.__module__], sys.argv[2:], f"{prog} eval")
        else:
            main(cli())
    except (*INPUT_ERRORS, NonFiniteError) as e:  # 3: not bad input, yet as sure to fail again
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3 if isinstance(e, NonFiniteError) else 2)
