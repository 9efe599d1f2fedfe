"""The first steps of each trainer's default run give the losses they gave before the trainers
were cut down to their models (issue 14): the refactor moved code, it did not change numbers.

The reference losses were recorded from main at 6e63b53 (before the move) with the presets'
own model, optimiser and schedule, on fixed random batches (dense, MoE) and on the GRPO warm
start's own examples, 8 simulated devices. JAX 0.10.2 (Python 3.11) and 0.12.0.1 (3.12) agree
with each other to within 1.3e-7 relative, hence the tolerance.
"""
from functools import partial

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import train_dense as td
import train_grpo as tg
import train_moe as tm
from common import train
from common.mesh import BATCH_AXES, make_mesh

BEFORE = {
    "dense": [8.359647750854492, 8.374361991882324, 8.367570877075195, 8.377839088439941],
    "moe": [8.370279312133789, 8.373095512390137, 8.372302055358887, 8.367350578308105],
    # Since the demo's warm start takes batches of 256 (was 64): the same code, more rows.
    "grpo_warm": [2.8163464069366455, 2.6856915950775146, 2.5332283973693848, 2.4036786556243896],
}
RTOL = 1e-6


def batches(vocab, B, T, n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, (B, T + 1), dtype=np.int32) for _ in range(n)]


@pytest.mark.parametrize("name, mod, preset, axes", [
    ("dense", td, "tiny", BATCH_AXES), ("moe", tm, "tiny-moe", BATCH_AXES + ("expert",))])
def test_first_losses_of_the_default_run_are_unchanged(name, mod, preset, axes):
    cfg = mod.PRESETS[preset][1]
    mesh = make_mesh(cfg.mesh)
    st = train.TrainState(partial(mod._init, cfg.model), mod.param_specs(cfg.model),
                          mod.make_optimizer(cfg.train), mesh)
    with jax.set_mesh(mesh):
        state, losses = st.fresh(jax.random.key(cfg.train.seed)), []
        step = st.jit(partial(mod.train_step, cfg=cfg, tx=st.tx))
        for b in batches(cfg.model.vocab_size, cfg.train.batch_size, cfg.train.seq_len, 4):
            state, m = step(state, jax.device_put(b, NamedSharding(mesh, P(axes, None))))
            losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, BEFORE[name], rtol=RTOL)


def test_first_losses_of_the_grpo_warm_start_are_unchanged():
    cfg = tg.PRESETS["tiny"][1]
    mesh, tok, w = make_mesh(cfg.mesh), tg.CharTokenizer(), cfg.warm
    st = tg.train_state(cfg, mesh, tg.make_optimizer(cfg.grpo, w))
    width = tg.prompt_width(cfg.task)
    with jax.set_mesh(mesh):
        state = st.from_params(tg.init_params(cfg.model, jax.random.key(cfg.grpo.seed), mesh))
        step = st.jit(partial(tg.sft_step, cfg=cfg, n_valid=tok.vocab_size))
        losses = []
        for i in range(4):  # the warm start's own examples (train_grpo.warm_start)
            items = tg.problems(np.random.default_rng([cfg.grpo.seed, 1, i]), w.batch_size,
                                cfg.task)
            prompt, valid = tg.encode_prompts(tok, [p for p, _ in items], width)
            comp, mask = tg.encode_completions(tok, [a for _, a in items],
                                               cfg.grpo.max_new_tokens)
            batch = {k: train.put(v, mesh, BATCH_AXES) for k, v in (
                ("prompt", prompt), ("prompt_valid", valid), ("completion", comp),
                ("mask", mask))}
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, BEFORE["grpo_warm"], rtol=RTOL)
