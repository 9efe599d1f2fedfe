"""The optimisers: AdamW (moments kept on a skipped step), Muon, lr schedules, QK-clip."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from common.config import need


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
              specs: dict | None = None, mu_dtype: str = "float32", nu_dtype: str = "float32"):
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
    keep AdamW. The momentum is sharded like its parameter. Adam's moments are kept in `mu_dtype`
    and `nu_dtype` (MaxText's mu_dtype): bfloat16 halves their 8 bytes a parameter."""
    mask = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key in decayed, params)
    adam = optax.chain(scale_by_adam_kept(b1, b2, mu_dtype=mu_dtype, nu_dtype=nu_dtype),
                       optax.add_decayed_weights(weight_decay, mask),
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


def scale_by_adam_kept(b1: float, b2: float, eps: float = 1e-8, *, mu_dtype: str = "float32",
                       nu_dtype: str = "float32"):
    """optax.scale_by_adam, whose state stays as it was where `update`'s verdict `ok` is False,
    and whose update reads the moments so kept: the same numbers. Selected only after Adam, the
    moments made XLA split each weight's update into two passes over it (Mixtral's v5p-8 step:
    est. 0.2204 s, 0.2166 so, as with no check at all). The moments are stored in their dtypes
    (optax updates them in float32, then rounds) and read back in float32: with bfloat16 ones
    the update differs from optax's (mu_dtype) by their rounding only."""
    adam, f32 = optax.scale_by_adam(b1, b2, eps, mu_dtype=jnp.dtype(mu_dtype)), jnp.float32
    init = lambda params: (s := adam.init(params))._replace(nu=optax.tree.cast(s.nu, nu_dtype))

    def update(g, state, params=None, *, ok=True, **_):
        new = jax.tree.map(lambda a, b: jnp.where(ok, a, b), adam.update(g, state)[1], state)
        mu, nu = (optax.tree.bias_correction(optax.tree.cast(m, f32), b, new.count)
                  for m, b in ((new.mu, b1), (new.nu, b2)))
        return jax.tree.map(lambda m, v: m / (jnp.sqrt(v + 0.0) + eps), mu, nu), new  # 0: eps_root
    return optax.GradientTransformationExtraArgs(init, update)


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
