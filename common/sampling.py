"""Sampling: tokens drawn from logits, in prompt buffers a decode loop fills column by column."""
import math

import jax
import jax.numpy as jnp
import numpy as np

from common.train import fetch, put

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
