"""Attention ops over q/k/v arrays, like jax.nn.dot_product_attention: they name no weight, so
the model's projections, RoPE and norms stay in each trainer, and they sit in common/ (README,
design notes) because three copies of a custom-VJP kernel would drift. `reference` is the tested
oracle; `blocked` the same function as a flash-style kernel in pure JAX (no [T, T] array: what
long sequences run on the CPU, and the fallback wherever a fused kernel does not apply);
`splash` the TPU's fused kernel; `attend`, what the trainers call, runs the kernel `choose`
picks for the devices the step compiles for (the mesh's, not the host's).

Shapes: q [B, T, N, H], k [B, S, K, H], v [B, S, K, V] (V may differ from H: MLA's 192/128);
query head n reads key/value head n // (N // K). Logits are (q . k) scale, accumulated in
float32 whatever the inputs' dtype; with cap > 0 they are soft-capped, cap tanh(s / cap)
(Gemma 2). Query t may read key s when (not causal or s <= t), (not window or t - s < window)
and, with segment_ids [B, T] (packed rows), both carry the same id. sinks_N (GPT-OSS) adds
one learned logit per query head to the softmax's denominator, with no value. The softmax is
float32, the output has v's dtype, and a row with no allowed key outputs 0, NaN-free.
"""
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from common.config import ConfigError
from common.mesh import target_platform

F32 = jnp.float32
NEG = -1e30   # a masked logit: finite, so max and exp over a row with nothing allowed stay finite


def _check(q_BTNH, k_BSKH, v_BSKV):
    (B, _, N, H), (Bk, S, K, Hk) = q_BTNH.shape, k_BSKH.shape
    if (Bk, Hk) != (B, H) or v_BSKV.shape[:3] != (B, S, K) or N % K:
        raise ValueError(f"attention shapes q {q_BTNH.shape}, k {k_BSKH.shape}, "
                         f"v {v_BSKV.shape}: want [B, T, N, H], [B, S, K, H], [B, S, K, V] "
                         "with N a multiple of K")


def _allowed(t, s, causal: bool, window: int):
    """What the causal and window knobs allow, for broadcastable query and key positions."""
    ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(t), jnp.shape(s)), bool)
    if causal:
        ok &= s <= t
    if window:
        ok &= t - s < window
    return ok


def reference(q_BTNH, k_BSKH, v_BSKV, *, scale: float, causal: bool = True, window: int = 0,
              cap: float = 0.0, sinks_N=None, segment_ids=None, mask_BTS=None):
    """Attention as one softmax over the [T, S] scores (module docstring). With S > T the
    queries are the last T positions (a KV cache's prefix before them): causal is then
    s <= t + S - T. segment_ids [B, T] needs S == T; mask_BTS (True = may attend) is and-ed in."""
    _check(q_BTNH, k_BSKH, v_BSKV)
    B, T, N, H = q_BTNH.shape
    S, K = k_BSKH.shape[1:3]
    G = N // K
    s_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTNH.reshape(B, T, K, G, H), k_BSKH,
                         preferred_element_type=F32) * scale
    if cap:
        s_BKGTS = cap * jnp.tanh(s_BKGTS / cap)
    ok = _allowed(jnp.arange(T)[:, None] + S - T, jnp.arange(S)[None], causal, window)
    if segment_ids is not None:
        if S != T:
            raise ValueError(f"segment_ids need as many keys as queries, got S={S}, T={T}")
        ok = ok & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
    if mask_BTS is not None:
        ok = ok & mask_BTS[:, None, None]
    ok = jnp.broadcast_to(ok, s_BKGTS.shape)
    if sinks_N is not None:   # one more logit per row, always allowed, dropped after the softmax
        sink = jnp.broadcast_to(sinks_N.astype(F32).reshape(K, G, 1, 1), (B, K, G, T, 1))
        s_BKGTS = jnp.concatenate([s_BKGTS, sink], axis=-1)
        ok = jnp.concatenate([ok, jnp.ones(sink.shape, bool)], axis=-1)
    p_BKGTS = _softmax(s_BKGTS, ok)[..., :S]
    o = jnp.einsum("bkgts,bskv->btkgv", p_BKGTS.astype(v_BSKV.dtype), v_BSKV,
                   preferred_element_type=F32)
    return o.reshape(B, T, N, -1).astype(v_BSKV.dtype)


def _softmax(s, ok):
    """Softmax over the last axis of the allowed entries; 0 in a row where none is allowed."""
    s = jnp.where(ok, s, NEG)
    m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
    # Masked entries are zeroed rather than left to exp(NEG - m), which is 1 when nothing is
    # allowed; the row's sum is then 0 (else >= 1, its maximum counting exp(0)).
    e = jnp.where(ok, jnp.exp(s - m), 0.0)
    den = e.sum(-1, keepdims=True)
    return e / jnp.where(den > 0, den, 1.0)


def cached(q_BTNH, k_BKSH, v_BKSV, *, scale: float, mask_BTS, cap: float = 0.0):
    """`reference` over a KV cache kept heads first, [B, K, S, H]: the layout of the batched
    matmuls (batch B and K, keys contracted on H), so each decoded token reads the cache where
    it lies. A [B, S, K, H] cache is transposed whole for both matmuls of every layer at every
    token (3.3x the attention's time at 128 rows x 266 columns). mask_BTS (True = may attend)
    holds causality, padding and the cache's empty tail."""
    B, T, N, H = q_BTNH.shape
    K = k_BKSH.shape[1]
    # XLA's CPU runtime has no bf16 x bf16 = f32 batched matmul in this layout: there the
    # operands are widened first (the products are exact in float32 either way).
    up = (lambda x: x.astype(F32)) if target_platform() == "cpu" else (lambda x: x)
    mm = lambda spec, a, b: jnp.einsum(spec, up(a), up(b), preferred_element_type=F32)
    s_BKGTS = mm("btkgh,bksh->bkgts", q_BTNH.reshape(B, T, K, N // K, H), k_BKSH) * scale
    if cap:
        s_BKGTS = cap * jnp.tanh(s_BKGTS / cap)
    p_BKGTS = _softmax(s_BKGTS, mask_BTS[:, None, None])
    o = mm("bkgts,bksv->btkgv", p_BKGTS.astype(v_BKSV.dtype), v_BKSV)
    return o.reshape(B, T, N, -1).astype(v_BKSV.dtype)


# ------------------------------------------------------------------------- the blocked kernel
# Layout inside: the sequence cut into n tiles of C positions, tile first, [n, B, K, G, C, X]
# for queries (G = N / K heads per key head) and [n, B, K, C, X] for keys and values, so that a
# loop picks a tile with a dynamic index on the leading axis. The running softmax statistics
# (max m, sum l) and the logsumexp are [n, B, K, G, C], float32.
def _tiles(x_BT_, C: int):
    """[B, T, ..., X] -> [n, B, ..., C, X]: T zero-padded to n tiles of C, the tile first."""
    B, T = x_BT_.shape[:2]
    n = -(-T // C)
    x = jnp.pad(x_BT_, [(0, 0), (0, n * C - T)] + [(0, 0)] * (x_BT_.ndim - 2))
    x = x.reshape(B, n, C, *x.shape[2:])
    r = x.ndim
    return x.transpose(1, 0, *range(3, r - 1), 2, r - 1)


def _untile(x, T: int):
    """The inverse of `_tiles`: [n, B, ..., C, X] -> [B, T, ..., X], the padding dropped."""
    r = x.ndim
    x = x.transpose(1, 0, r - 2, *range(2, r - 2), r - 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :T]


def _pairs(T: int, C: int, causal: bool, window: int):
    """The (query tile, key tile) pairs that hold an allowed (t, s) under the static knobs:
    the lower triangle when causal, a band of about W / C + 1 tiles with a window."""
    n = -(-T // C)
    last = lambda i: min(i * C + C, T) - 1
    ij = [(i, j) for i in range(n) for j in range(n)
          if not (causal and j * C > last(i)) and not (window and i * C - last(j) >= window)]
    return np.array(ij, np.int32)


def _while(n: int, visit, carry):
    """carry after visit(t, carry) for t = 0 .. n-1, as a while loop. The kernels' loops are
    not scans: a scan inside a custom VJP inside a scanned layer is still linearised by JAX,
    which then stacks every step's [C, C] scores as residuals (16 GiB a layer at 32k)."""
    return jax.lax.while_loop(lambda tc: tc[0] < n, lambda tc: (tc[0] + 1, visit(*tc)),
                              (jnp.int32(0), carry))[1]


_at = lambda x, i: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)
_put = lambda x, u, i: jax.lax.dynamic_update_index_in_dim(x, u, i, 0)


def _tile_scores(q_BKGCH, k_BKCH, i, j, segs, S, C, scale, causal, window, cap, offs):
    """Logits of query tile i against key tile j, [B, K, G, C, C] float32; which may be
    attended; and tanh(logits / cap) (the cap's derivative, in the backward) or None. offs:
    the sequence positions of the first query and the first key (None: both 0)."""
    s = jnp.einsum("bkgch,bksh->bkgcs", q_BKGCH, k_BKCH, preferred_element_type=F32) * scale
    th = jnp.tanh(s / cap) if cap else None
    s = cap * th if cap else s
    tq_C1, tk_1C = i * C + jnp.arange(C)[:, None], j * C + jnp.arange(C)[None]
    pad_1C = tk_1C < S   # padded keys: never
    if offs is not None:
        tq_C1, tk_1C = tq_C1 + offs[0], tk_1C + offs[1]
    ok = _allowed(tq_C1, tk_1C, causal, window) & pad_1C
    if segs is not None:
        ok = ok & (_at(segs[0], i)[:, :, None] == _at(segs[1], j)[:, None, :])[:, None, None]
    return s, ok, th


def _inputs(q_BTNH, k_BSKH, v_BSKV, segq_BT, segk_BS, C):
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    segs = None if segq_BT is None else tuple(_tiles(x[:, :, None], C)[..., 0]
                                              for x in (segq_BT, segk_BS))
    return _tiles(q_BTNH.reshape(B, T, K, N // K, H), C), _tiles(k_BSKH, C), _tiles(v_BSKV, C), segs


def _loop(body, carry, T, S, C, causal, window, offs):
    """carry after body(carry, i, j) over the tile pairs that may hold an allowed (t, s).
    Without offsets (self-attention) the pairs are known statically (`_pairs`); with them
    (context parallelism: a shard's queries against keys elsewhere in the sequence) every
    pair is visited and one whose position ranges exclude each other is skipped at run time."""
    if offs is None:
        pairs = _pairs(T, C, causal, window)
        if len(pairs) == 1:   # one tile: no loop, the plain softmax's program
            return body(carry, *(int(x) for x in pairs[0]))
        ij = jnp.asarray(pairs)
        return _while(len(pairs), lambda t, c: body(c, ij[t, 0], ij[t, 1]), carry)

    def live(i, j):
        q0, k0 = offs[0] + i * C, offs[1] + j * C
        q1, k1 = q0 + jnp.minimum(C, T - i * C) - 1, k0 + jnp.minimum(C, S - j * C) - 1
        return (k0 <= q1 if causal else True) & (q0 - k1 < window if window else True)
    nk = -(-S // C)
    return _while(-(-T // C) * nk, lambda t, c: jax.lax.cond(
        live(t // nk, t % nk), lambda c: body(c, t // nk, t % nk), lambda c: c, c), carry)


def _flash_core(scale, causal, window, cap, C, q_BTNH, k_BSKH, v_BSKV, sinks_N, segq_BT,
                segk_BS=None, offs=None):
    """(output, each head's largest logit [N] (what QK-clip reads: the row maxima the online
    softmax keeps anyway), what the backward saves)."""
    B, T, N, _ = q_BTNH.shape
    S, K, V = k_BSKH.shape[1], k_BSKH.shape[2], v_BSKV.shape[3]
    segk_BS = segq_BT if segk_BS is None else segk_BS
    q, k, v, segs = _inputs(q_BTNH, k_BSKH, v_BSKV, segq_BT, segk_BS, C)
    shape = (q.shape[0], B, K, N // K, C)
    m, l = jnp.full(shape, NEG, F32), jnp.zeros(shape, F32)

    def body(carry, i, j):   # online softmax: rescale what tile i has so far to the new max
        m_nBKGC, l_nBKGC, acc_nBKGCV = carry
        s, ok, _ = _tile_scores(_at(q, i), _at(k, j), i, j, segs, S, C, scale, causal, window,
                                cap, offs)
        s = jnp.where(ok, s, NEG)
        m_old = _at(m_nBKGC, i)
        m_new = jnp.maximum(m_old, s.max(-1))
        p = jnp.where(ok, jnp.exp(s - m_new[..., None]), 0.0)   # zeroed: see `reference`
        a = jnp.exp(m_old - m_new)
        pv = jnp.einsum("bkgcs,bksv->bkgcv", p.astype(v.dtype), _at(v, j),
                        preferred_element_type=F32)
        return (_put(m_nBKGC, m_new, i), _put(l_nBKGC, a * _at(l_nBKGC, i) + p.sum(-1), i),
                _put(acc_nBKGCV, a[..., None] * _at(acc_nBKGCV, i) + pv, i))
    m, l, acc = _loop(body, (m, l, jnp.zeros((*shape, V), F32)), T, S, C, causal, window, offs)
    row = (jnp.arange(q.shape[0] * C) < T).reshape(q.shape[0], 1, 1, 1, C)  # not the padding
    top_N = jnp.max(jnp.where(row & (l > 0), m, NEG), axis=(0, 1, 4)).reshape(N)
    if sinks_N is not None:   # the sink: one more logit in every row's softmax, its value 0
        s_KG1 = sinks_N.astype(F32).reshape(K, N // K, 1)
        new = jnp.maximum(m, s_KG1)
        a = jnp.exp(m - new)
        m, l, acc = new, a * l + jnp.exp(s_KG1 - new), a[..., None] * acc
    l = jnp.where(l > 0, l, 1.0)   # 0 only where nothing is allowed (and no sink): output 0
    o_BTNV = _untile(acc / l[..., None], T).reshape(B, T, N, V).astype(v_BSKV.dtype)
    return o_BTNV, top_N, (q_BTNH, k_BSKH, v_BSKV, sinks_N, segq_BT, segk_BS, offs, o_BTNV,
                           m + jnp.log(l))


def _flash_fwd(*args):
    o, _, res = _flash_core(*args)
    return o, res


def _flash_bwd(scale, causal, window, cap, C, res, do_BTNV):
    """FlashAttention-2's backward: per tile pair, P from the saved logsumexp, then
    dV += P^T dO, dS = P (dO V^T - D) with D = rowsum(dO O), dQ += dS K, dK += dS^T Q. With
    another softmax's o and logsumexp (ring attention's, over all keys) it gives this key
    block's share of that softmax's gradients."""
    q_BTNH, k_BSKH, v_BSKV, sinks_N, segq_BT, segk_BS, offs, o_BTNV, lse = res
    B, T, N, H = q_BTNH.shape
    S, K, V = k_BSKH.shape[1], k_BSKH.shape[2], v_BSKV.shape[3]
    q, k, v, segs = _inputs(q_BTNH, k_BSKH, v_BSKV, segq_BT, segk_BS, C)
    do, o = (_tiles(x.reshape(B, T, K, N // K, V), C) for x in (do_BTNV, o_BTNV))
    D_nBKGC = jnp.sum(do.astype(F32) * o.astype(F32), -1)   # 0 on padded rows: dO is 0 there

    def body(carry, i, j):
        dq, dk, dv = carry
        q_i, k_j, v_j, do_i = _at(q, i), _at(k, j), _at(v, j), _at(do, i)
        s, ok, th = _tile_scores(q_i, k_j, i, j, segs, S, C, scale, causal, window, cap, offs)
        p = jnp.exp(jnp.where(ok, s - _at(lse, i)[..., None], NEG))
        dv_j = jnp.einsum("bkgcs,bkgcv->bksv", p.astype(do.dtype), do_i, preferred_element_type=F32)
        dp = jnp.einsum("bkgcv,bksv->bkgcs", do_i, v_j, preferred_element_type=F32)
        ds = p * (dp - _at(D_nBKGC, i)[..., None])
        if cap:   # d(cap tanh(x / cap))/dx
            ds = ds * (1.0 - th * th)
        ds = (ds * scale).astype(q.dtype)
        dq_i = jnp.einsum("bkgcs,bksh->bkgch", ds, k_j, preferred_element_type=F32)
        dk_j = jnp.einsum("bkgcs,bkgch->bksh", ds, q_i, preferred_element_type=F32)
        return (_put(dq, _at(dq, i) + dq_i, i), _put(dk, _at(dk, j) + dk_j, j),
                _put(dv, _at(dv, j) + dv_j, j))
    zeros = lambda x: jnp.zeros(x.shape, F32)
    dq, dk, dv = _loop(body, (zeros(q), zeros(k), zeros(v)), T, S, C, causal, window, offs)
    dsinks = None
    if sinks_N is not None:   # o = sum_s P_s v_s, each P_s falls by P_sink: d sink = -P_sink D
        p_sink = jnp.exp(sinks_N.astype(F32).reshape(K, N // K, 1) - lse)
        dsinks = -(p_sink * D_nBKGC).sum((0, 1, 4)).reshape(N).astype(sinks_N.dtype)
    return (_untile(dq, T).reshape(B, T, N, H).astype(q_BTNH.dtype),
            _untile(dk, S).astype(k_BSKH.dtype), _untile(dv, S).astype(v_BSKV.dtype),
            dsinks, None, None, None)


_flash = jax.custom_vjp(lambda *args: _flash_fwd(*args)[0], nondiff_argnums=(0, 1, 2, 3, 4))
_flash.defvjp(_flash_fwd, _flash_bwd)
# The same with each head's largest logit beside the output (no gradient flows through it).
_flash_top = jax.custom_vjp(lambda *args: _flash_core(*args)[:2], nondiff_argnums=(0, 1, 2, 3, 4))
_flash_top.defvjp(lambda *args: (lambda o, t, r: ((o, t), r))(*_flash_core(*args)),
                  lambda *a: _flash_bwd(*a[:-1], a[-1][0]))


def blocked(q_BTNH, k_BSKH, v_BSKV, *, scale: float, causal: bool = True, window: int = 0,
            cap: float = 0.0, sinks_N=None, segment_ids=None, block: int = 512,
            with_max: bool = False):
    """`reference` without the [T, T] scores: an online softmax over key tiles of `block`
    positions forward, the scores recomputed per tile pair backward (saved: q, k, v, the
    output and a logsumexp per row). Only the tile pairs the causal and window structure can
    allow are visited: about half of them when causal, O(T window) with a window; segments
    are only masked. Self-attention (S == T) only; T need not be a multiple of the block.
    with_max: (output, each head's largest logit [N] float32, the sinks not among them)."""
    _check(q_BTNH, k_BSKH, v_BSKV)
    T, S = q_BTNH.shape[1], k_BSKH.shape[1]
    if S != T:
        raise ValueError(f"blocked attention is self-attention: S={S} keys for T={T} queries")
    if block < 1:
        raise ValueError(f"block must be a positive number of positions, got {block}")
    return (_flash_top if with_max else _flash)(
        float(scale), bool(causal), int(window), float(cap), min(int(block), T), q_BTNH, k_BSKH,
        v_BSKV, sinks_N, segment_ids, None, None)


# ---- context parallelism: the sequence split over the mesh's "context" axis ---------------
# With C context shards the sequence is cut into 2C chunks and shard d holds chunks d and
# 2C - 1 - d (load-balanced): under a causal mask a late chunk reads many keys and an early
# one few, so each shard pairs one of each and all do the same work. The trainers reorder
# tokens, targets, positions and segment ids so (`to_context`) before the model; everything
# per token is indifferent to the order, attention alone reads it (`context_attention`).
def context_size() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else dict(mesh.shape).get("context", 1)


def context_order(T: int, C: int, balanced: bool = True) -> np.ndarray:
    """The sequence positions in the order the C context shards hold them."""
    if C == 1 or not balanced:
        return np.arange(T)
    chunks = np.arange(T).reshape(2 * C, T // (2 * C))
    return np.concatenate([np.concatenate([chunks[d], chunks[2 * C - 1 - d]]) for d in range(C)])


def to_context(*xs_BT):
    """[B, T, ...] arrays (None passes) in the context shards' order; the identity without a
    context axis. A length that does not split into 2C chunks (a sample's growing prefix) is
    padded at the end first: causal, no real position reads the padding. `from_context`
    undoes both for what a user sees (logits)."""
    C = context_size()
    T = next(x.shape[1] for x in xs_BT if x is not None)
    if C == 1:
        return list(xs_BT)
    pad, order = -T % (2 * C), context_order(T + -T % (2 * C), C)
    return [None if x is None else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
            [:, order] for x in xs_BT]


def from_context(x_BT, T: int):
    C = context_size()
    return x_BT if C == 1 else x_BT[:, np.argsort(context_order(x_BT.shape[1], C))][:, :T]


def fold_context(*xs_BT):
    """[B, T, ...] -> [B C, T / C, ...]: each context shard's positions as rows of their own,
    so that a loop over sequence chunks (the loss) stays inside every shard."""
    C = context_size()
    return [x if x is None or C == 1 else x.reshape(x.shape[0] * C, -1, *x.shape[2:])
            for x in xs_BT]


def _chunk_starts(d, C: int, T: int, balanced: bool):
    """Sequence position of each chunk shard d (traced) holds."""
    L = T // (2 * C) if balanced else T // C
    return [d * L, (2 * C - 1 - d) * L] if balanced else [d * L]


def _split(x, n: int):
    return [None] * n if x is None else jnp.split(x, n, axis=1)


def _ring_fwd(statics, C, balanced, T, q, k, v, seg, sinks_N):
    """Ring attention's forward on one shard: its key/value block goes round the ring (one
    ppermute a step, sent before the step's compute so the two overlap), each visit's partial
    softmax (o, logsumexp) merged into the queries' running one."""
    n, d = 2 if balanced else 1, jax.lax.axis_index("context")
    qs, sqs, starts = _split(q, n), _split(seg, n), _chunk_starts(d, C, T, balanced)
    B, Tq, N, _ = qs[0].shape
    K = k.shape[2]
    lse_rows = lambda lse: _untile(lse[..., None], Tq)[..., 0].reshape(B, Tq, N, 1)
    o, lse, kv = [None] * n, [None] * n, (k, v, seg)
    for s in range(C):
        nxt = jax.lax.ppermute(kv, "context", [(i, (i + 1) % C) for i in range(C)]) \
            if s < C - 1 else None
        kstarts = _chunk_starts((d - s) % C, C, T, balanced)
        for a in range(n):
            for b, (kc, vc, sc) in enumerate(zip(*(_split(x, n) for x in kv))):
                o_ab, res = _flash_fwd(*statics, qs[a], kc, vc, None, sqs[a], sc,
                                       jnp.stack([starts[a], kstarts[b]]))
                o_ab, l_ab = o_ab.astype(F32), res[-1]
                if o[a] is None:
                    o[a], lse[a] = o_ab, l_ab
                    continue
                new = jnp.logaddexp(lse[a], l_ab)
                o[a] = (o[a] * jnp.exp(lse_rows(lse[a] - new)) +
                        o_ab * jnp.exp(lse_rows(l_ab - new)))
                lse[a] = new
        kv = nxt
    if sinks_N is not None:   # one more logit per row, with no value
        for a in range(n):
            new = jnp.logaddexp(lse[a], sinks_N.astype(F32).reshape(K, N // K, 1))
            o[a], lse[a] = o[a] * jnp.exp(lse_rows(lse[a] - new)), new
    out = jnp.concatenate(o, axis=1).astype(v.dtype)
    return out, (q, k, v, seg, sinks_N, out, lse)


def _ring_bwd(statics, C, balanced, T, res, do):
    """Each visiting key block's share of the gradient (`_flash_bwd` with the full softmax's
    logsumexp); its dk, dv travel with it and are home after the C-th step."""
    q, k, v, seg, sinks_N, out, lse = res
    n, d = 2 if balanced else 1, jax.lax.axis_index("context")
    qs, sqs, dos, os = (_split(x, n) for x in (q, seg, do, out))
    starts = _chunk_starts(d, C, T, balanced)
    dq, dsinks = [jnp.zeros(x.shape, F32) for x in qs], None
    kv, dkv = (k, v, seg), (jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32))
    ring = [(i, (i + 1) % C) for i in range(C)]
    for s in range(C):
        kstarts = _chunk_starts((d - s) % C, C, T, balanced)
        dk, dv = [], []
        for b, (kc, vc, sc) in enumerate(zip(*(_split(x, n) for x in kv))):
            dk_b, dv_b = 0.0, 0.0
            for a in range(n):
                first = s == 0 and b == 0 and sinks_N is not None   # the sinks' term, once
                dq_ab, dk_ab, dv_ab, ds, *_ = _flash_bwd(*statics, (
                    qs[a], kc, vc, sinks_N if first else None, sqs[a], sc,
                    jnp.stack([starts[a], kstarts[b]]), os[a], lse[a]), dos[a])
                dq[a], dk_b, dv_b = dq[a] + dq_ab, dk_b + dk_ab, dv_b + dv_ab
                dsinks = ds if dsinks is None else dsinks if ds is None else dsinks + ds
            dk, dv = dk + [dk_b], dv + [dv_b]
        dkv = (dkv[0] + jnp.concatenate(dk, 1), dkv[1] + jnp.concatenate(dv, 1))
        kv, dkv = (jax.lax.ppermute((kv, dkv), "context", ring) if s < C - 1 else
                   (kv, jax.lax.ppermute(dkv, "context", ring)))
    return (jnp.concatenate(dq, 1).astype(q.dtype), dkv[0].astype(k.dtype),
            dkv[1].astype(v.dtype), None, dsinks)


_ring = jax.custom_vjp(lambda *args: _ring_fwd(*args)[0], nondiff_argnums=(0, 1, 2, 3))
_ring.defvjp(_ring_fwd, _ring_bwd)


def _ulysses(statics, C, balanced, T, kernel, q, k, v, seg, sinks_N):
    """Ulysses (DeepSpeed-Ulysses, Jacobs et al. 2023) on one shard: an all-to-all trades the
    sequence split for a head split, so the shard runs the whole sequence's attention for N/C
    heads with the device's own kernel (splash on a TPU), and one more trades back. Key/value
    heads are repeated until C divides them (GQA with fewer than C)."""
    N, K = q.shape[2], k.shape[2]
    r = C // math.gcd(K, C)
    k, v = (jnp.repeat(x, r, axis=2) if r > 1 else x for x in (k, v))
    order = context_order(T, C, balanced)
    back = np.argsort(order)   # the gathered sequence, shard by shard -> sequence order
    q, k, v = (jax.lax.all_to_all(x, "context", 2, 1, tiled=True)[:, back] for x in (q, k, v))
    seg = None if seg is None else jax.lax.all_gather(seg, "context", axis=1, tiled=True)[:, back]
    sinks = None if sinks_N is None else jax.lax.dynamic_slice_in_dim(
        sinks_N, jax.lax.axis_index("context") * (N // C), N // C)
    o = kernel(q, k, v, seg, sinks, **dict(zip(("scale", "causal", "window", "cap"), statics)))
    return jax.lax.all_to_all(o[:, order], "context", 1, 2, tiled=True)


CONTEXT_IMPLS = ("allgather", "ring", "ulysses")


def context_attention(q_BTNH, k_BTKH, v_BTKV, *, strategy: str = "allgather", scale: float,
                      causal: bool = True, window: int = 0, cap: float = 0.0, sinks_N=None,
                      segment_ids=None, batch_axes=("data", "fsdp"), balanced: bool = True,
                      block: int = 512, impl: str = "auto"):
    """`reference` on a sequence split over the mesh's context axis, in `context_order`
    (`balanced`, else plain contiguous shards), positions global. allgather: each shard
    gathers every key and value (MaxText's default: simple, the whole K/V's memory); ring:
    the blocks pass from shard to shard (`_ring_fwd`), so a shard holds two at a time. Both
    run the blocked kernel on each (query chunk, key chunk) pair, skipping the tiles the
    causal mask or a window excludes. ulysses: the sequence whole, the heads split
    (`_ulysses`), in `impl`'s kernel where it is splash, else the blocked one."""
    _check(q_BTNH, k_BTKH, v_BTKV)
    B, T, N, H = q_BTNH.shape
    C, n = context_size(), 2 if balanced else 1
    if strategy not in CONTEXT_IMPLS:
        raise ValueError(f"context attention {strategy!r}: choose one of "
                         f"{', '.join(CONTEXT_IMPLS)}")
    if T % (n * C) or k_BTKH.shape[1] != T:
        raise ValueError(f"context attention: {T} queries, {k_BTKH.shape[1]} keys over "
                         f"--mesh.context {C}: self-attention on a multiple of {n * C} tokens")
    statics = (float(scale), bool(causal), int(window), float(cap), min(block, T // (n * C)))
    if strategy == "ulysses":
        kind = choose(impl, target_platform(), dtype=q_BTNH.dtype, T=T, H=H, V=v_BTKV.shape[-1],
                      context=(C, strategy))
        kernel = (partial(_splash_local, interpret=target_platform() != "tpu") if "splash" in
                  kind else lambda q, k, v, seg, sinks, **kw: blocked(
                      q, k, v, sinks_N=sinks, segment_ids=seg, block=block, **kw))
        tp = dict(jax.sharding.get_abstract_mesh().shape).get("tensor", 1)
        K = k_BTKH.shape[2] // tp
        if (N // tp) % (C * K // math.gcd(K, C)):
            raise ValueError(f"ulysses context attention: {N // tp} query and {K} key/value "
                             f"heads a tensor shard do not split over --mesh.context {C}")

    def one_shard(q, k, v, seg, sinks):
        if strategy == "ulysses":
            return _ulysses(statics[:4], C, balanced, T, kernel, q, k, v, seg, sinks)
        if strategy == "ring":
            return _ring(statics, C, balanced, T, q, k, v, seg, sinks)
        back = np.argsort(context_order(T, C, balanced))   # gathered -> sequence order
        k, v, sk = (None if x is None else jax.lax.all_gather(x, "context", axis=1, tiled=True)
                    [:, back] for x in (k, v, seg))
        starts = _chunk_starts(jax.lax.axis_index("context"), C, T, balanced)
        return jnp.concatenate([_flash(*statics, qc, k, v, sinks, sc, sk, jnp.stack([t0, 0]))
                                for qc, sc, t0 in zip(_split(q, n), _split(seg, n), starts)], 1)
    heads = P(batch_axes, "context", "tensor", None)
    return jax.shard_map(one_shard, in_specs=(heads, heads, heads, P(batch_axes, "context"),
                                               P("tensor")), out_specs=heads, check_vma=False)(
        q_BTNH, k_BTKH, v_BTKV, segment_ids, sinks_N)


# ---- choosing the kernel: by the devices the step compiles for ----------------------------
IMPLS = ("auto", "splash", "cudnn", "blocked", "xla", "einsum")


def choose(impl: str, platform: str, *, dtype, T: int, H: int, V: int, cap: float = 0.0,
           sinks: bool = False, segments: bool = False, context=(1, "allgather")) -> str:
    """The kernel `attend` runs. `auto`: splash on TPU, cuDNN on GPU where its fused kernel
    applies (16-bit inputs, equal q/v widths up to 128, no soft-cap, sinks or segments),
    blocked otherwise (the CPU's: one tile while T fits in a block). context: (the mesh's
    context size, the strategy): over a split sequence, `context_attention`'s."""
    if context[0] > 1:   # Ulysses runs the whole sequence's kernel: splash where it would
        whole = choose(impl, platform, dtype=dtype, T=T, H=H, V=V) == "splash"
        return (f"{context[1]} context x{context[0]} "
                f"({'splash' if whole and context[1] == 'ulysses' else 'blocked'})")
    if impl != "auto":
        return impl
    if platform == "tpu" and T % 128 == 0:
        return "splash"
    if (platform in ("gpu", "cuda", "rocm") and jnp.dtype(dtype).itemsize == 2 and H == V
            and H <= 128 and H % 8 == 0 and not (cap or sinks or segments)):
        return "cudnn"
    return "blocked"


def check_kernel(impl: str, platform: str, seq_len: int, flag: str = "--model.attention") -> None:
    """A kernel named on the command line that the compile target cannot run is refused
    before compiling (the Pallas or cuDNN error would come minutes later, and say less)."""
    if impl == "splash" and (platform != "tpu" or seq_len % 128):
        raise ConfigError(f"{flag} splash is the TPU's kernel, for a --train.seq-len that is a "
                          f"multiple of 128; this run compiles for {platform} at "
                          f"{seq_len}: use {flag} auto (or blocked).")
    if impl == "cudnn" and platform not in ("gpu", "cuda", "rocm"):
        raise ConfigError(f"{flag} cudnn is cuDNN's kernel (NVIDIA GPUs); this run compiles "
                          f"for {platform}: use {flag} auto (or blocked).")


def attend(q_BTNH, k_BSKH, v_BSKV, *, impl: str = "auto", scale: float, causal: bool = True,
           window: int = 0, cap: float = 0.0, sinks_N=None, segment_ids=None, mask_BTS=None,
           batch_axes=("data", "fsdp"), context: str = "allgather", with_max: bool = False):
    """Attention by the kernel `choose` picks for the compile target; every kernel computes
    `reference`'s function (tests/test_attention.py holds them to it). mask_BTS (True = may
    attend) replaces causal/window/segments where the pattern is not one of those. On a mesh
    with a context axis the sequence is split (`context_attention`, by `context`). with_max
    (QK-clip): (output, each head's largest logit [N]) from the blocked kernel, which keeps the
    row maxima anyway; (output, None) from the others (splash keeps a logsumexp, cuDNN
    nothing), whose callers make the maxima again (common/optim.py `max_logits`)."""
    T, H, V = q_BTNH.shape[1], q_BTNH.shape[3], v_BSKV.shape[-1]
    kind = choose(impl, target_platform(), dtype=q_BTNH.dtype, T=T, H=H, V=V, cap=cap,
                  sinks=sinks_N is not None, segments=segment_ids is not None)
    kw = dict(scale=scale, causal=causal, window=window, cap=cap, sinks_N=sinks_N,
              segment_ids=segment_ids)
    if with_max:
        if context_size() == 1 and mask_BTS is None and kind == "blocked":
            return blocked(q_BTNH, k_BSKH, v_BSKV, **kw, with_max=True)
        return attend(q_BTNH, k_BSKH, v_BSKV, impl=impl, mask_BTS=mask_BTS, batch_axes=batch_axes,
                      context=context, **kw), None
    if context_size() > 1 and mask_BTS is None:
        return context_attention(q_BTNH, k_BSKH, v_BSKV, strategy=context, batch_axes=batch_axes,
                                 impl=impl, **kw)
    if mask_BTS is not None:  # a KV cache's tail, left padding: XLA's masked softmax
        if window or sinks_N is not None or segment_ids is not None:
            raise ValueError("attend: an explicit mask_BTS takes no window, sinks or segments")
        if cap:  # beyond jax.nn's softmax: the same one, soft-capped
            return reference(q_BTNH, k_BSKH, v_BSKV, scale=scale, causal=False, cap=cap,
                             mask_BTS=mask_BTS)
        return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKV, mask=mask_BTS[:, None],
                                            scale=scale, implementation="xla")
    if kind in ("xla", "cudnn") and not (cap or sinks_N is not None or segment_ids is not None):
        # MLA's narrower values: padded to the query width these take
        v = jnp.pad(v_BSKV, ((0, 0),) * 3 + ((0, H - V),)) if V < H else v_BSKV
        return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v, scale=scale, is_causal=causal,
                                            implementation=kind, local_window_size=(
                                                window - 1, 0) if window else None)[..., :V]
    if kind == "splash":
        return splash(q_BTNH, k_BSKH, v_BSKV, batch_axes=batch_axes, **kw)
    if kind == "blocked":
        return blocked(q_BTNH, k_BSKH, v_BSKV, **kw)
    if kind in ("einsum", "xla", "cudnn"):  # what their call cannot express: the same softmax
        return reference(q_BTNH, k_BSKH, v_BSKV, **kw)
    raise ValueError(f"attention {impl!r}: choose one of {', '.join(IMPLS)}")


def _splash_local(q, k, v, seg, sinks, *, scale, causal, window, cap, interpret):
    """One device's splash call on [B, T, heads, H] (its share of the heads)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    T, n = q.shape[1], q.shape[2]
    # Blocks of 512 where T allows (MaxText's choice on v5p), at least the 128 lanes. The
    # backward's dq has its own kernel: the fused one writes a partial dq per key block,
    # [T / 512, N, T, H] (1 GiB per layer for 32 heads at 8k), which then are summed.
    b = next(b for b in (512, 256, 128) if T % b == 0)
    sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
                          block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    if window or not causal:
        pattern = sm.LocalMask((T, T), (window - 1 if window else None, 0 if causal else None),
                               offset=0)
    else:
        pattern = sm.CausalMask((T, T))
    kernel = sk.make_splash_mha(sm.MultiHeadMask([pattern] * n), block_sizes=sizes,
                                head_shards=1, q_seq_shards=1, interpret=interpret,
                                attn_logits_soft_cap=cap or None)
    heads_first = lambda x: x.transpose(0, 2, 1, 3)
    run = lambda q, k, v, s: kernel(q, k, v, segment_ids=None if s is None else
                                    sk.SegmentIds(s, s), sinks=sinks)
    return heads_first(jax.vmap(run)(heads_first(q * scale).astype(q.dtype), heads_first(k),
                                     heads_first(v), seg))


def splash(q_BTNH, k_BSKH, v_BSKV, *, scale: float, causal: bool = True, window: int = 0,
           cap: float = 0.0, sinks_N=None, segment_ids=None, batch_axes=("data", "fsdp"),
           interpret: bool = False):
    """The TPU's fused attention (JAX's Pallas splash kernel): masked-out blocks are skipped, not
    computed, so causal costs half and a window W costs O(T W). A Pallas call is one device's
    program, so under a mesh it runs in shard_map: rows split like the batch, heads like the weights
    (over "tensor"). `interpret` runs the kernel's Python on any backend (the CPU tests)."""
    one_device = partial(_splash_local, scale=scale, causal=causal, window=window, cap=cap,
                         interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return one_device(q_BTNH, k_BSKH, v_BSKV, segment_ids, sinks_N)
    heads = P(batch_axes, None, "tensor", None)
    specs = (heads, heads, heads, P(batch_axes, None), P("tensor"))
    return jax.shard_map(one_device, in_specs=specs, out_specs=heads, check_vma=False)(
        q_BTNH, k_BSKH, v_BSKV, segment_ids, sinks_N)
