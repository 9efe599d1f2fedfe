"""LoRA (Hu et al. 2021): the adapters' table, frozen weights adapted in place, merged."""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from common.config import knob, need


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
