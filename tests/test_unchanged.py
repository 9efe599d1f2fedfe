"""Each trainer's default model and optimiser, trained for 16 steps, give the trajectory they
gave when it was recorded: refactors move code, they do not change numbers.

The steps are long enough and the settings are such that every part of the optimiser moves the
result: a schedule with a warm-up and a cosine decay inside the 16 steps (so the warm-up's
off-by-one and the floor of the decay show), the preset's weight decay at the preset's learning
rate (seen in the parameters' norm), gradient norms above the clip (1.0) at the first steps, and
Muon as well as AdamW. What is compared: the sum of the squared parameters after the last step,
the loss at every step and the gradient norm at the first four. Random tokens, 8 simulated
devices. The GRPO warm start's first four losses are held as before (to 1e-6: no router).

Recorded on JAX 0.10.2 (Python 3.11). Compared with a tolerance, never bit for bit: another
CPU's XLA code differs in the last bits, and Adam on a router amplifies them (JAX 0.12.0.1
differs from 0.10.2 by up to 4e-6 in the squared parameters and 8e-5 in MoE AdamW's last
losses; 1e-7 elsewhere; an AMD EPYC with AVX2 and no AVX-512, by 3.7e-5 in MoE AdamW's squared
parameters and 4.2e-4 in its fourth gradient norm). The squared parameters, held to 1e-4,
move by at least 3.4e-4 under each mutation this guards against (measured): weight decay off
(1.5e-3 dense AdamW), clipping off (2.1e-3), the schedule's floor at 0 (2.8e-3) or its warm-up a step off, Muon's scale
doubled (1.2e-2). The losses are held to 2e-4; the gradient norms, chaotic later, at the first
four steps only, to 1e-3.
"""
import dataclasses
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
from common.data import encode_prompts
from common.mesh import BATCH_AXES, make_mesh

STEPS, B, T = 16, 8, 128
RTOL = 1e-6  # the GRPO warm start: 4 steps, no router
# (losses, grad norms, sum of squared parameters at the end)
BEFORE = {
    "dense-adamw": (
        [8.3778124, 8.3736649, 8.3664045, 8.3756523, 8.3836966, 8.3455505, 8.3877726,
         8.3886738, 8.3960419, 8.3921366, 8.3770723, 8.3875313, 8.3976173, 8.359046,
         8.3852024, 8.3930407],
        [2.5176699, 2.3401623, 1.9773395, 1.695186, 1.2530102, 1.1079051, 0.91087973,
         0.97589868, 1.0006201, 1.1017848, 0.88069332, 1.0154883, 0.74203795, 1.0427444,
         0.84372377, 0.84947342],
        4180.62771),
    "dense-muon": (
        [8.3778124, 8.3719501, 8.3600597, 8.3500614, 8.3731098, 8.3695583, 8.3816967,
         8.3741093, 8.3743582, 8.3684092, 8.4017992, 8.3785334, 8.3749857, 8.3937693,
         8.3655796, 8.385148],
        [2.5176699, 2.4784448, 2.4948425, 2.3759189, 2.4247935, 2.2975318, 2.26177, 2.2799625,
         2.2114055, 2.027602, 2.1461029, 2.1127491, 1.972145, 2.0588915, 2.0341392,
         2.1068015],
        4082.470868),
    "moe-adamw": (
        [8.354311, 8.3851099, 8.363081, 8.366375, 8.3890934, 8.3707991, 8.3932476, 8.3776112,
         8.381793, 8.3771448, 8.3733282, 8.3947401, 8.3668585, 8.3825941, 8.3985367,
         8.3939199],
        [2.4735844, 2.1463542, 1.9662156, 1.3292528, 1.0547763, 0.87519759, 0.82111347,
         1.1002079, 0.86690134, 0.87869251, 0.84989947, 0.76742929, 0.73520011, 0.96982974,
         0.96699786, 1.3390045],
        5429.511545),
    "moe-muon": (
        [8.354311, 8.3790045, 8.3747406, 8.3691101, 8.369957, 8.3661728, 8.3726311, 8.3528461,
         8.3848896, 8.3782463, 8.3772554, 8.3699627, 8.3755188, 8.3864822, 8.379509,
         8.3641558],
        [2.4735844, 2.2789662, 2.4528892, 2.3653975, 2.4107609, 2.2344685, 2.1125767,
         2.2035725, 2.1291456, 2.1127574, 2.0847366, 1.9814276, 2.0178831, 2.0784817,
         2.0419753, 1.9284065],
        5211.366481),
}
# The first four losses of the GRPO demo's SFT warm start, on its own examples.
GRPO_WARM = [2.8163464069366455, 2.6856915950775146, 2.5332283973693848, 2.4036786556243896]


def batches(vocab, n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, (B, T + 1), dtype=np.int32) for _ in range(n)]


def trajectory(mod, preset, axes, optimizer):
    cfg = mod.PRESETS[preset][1]
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, steps=STEPS, warmup_steps=4, batch_size=B, seq_len=T, optimizer=optimizer))
    mesh = make_mesh(cfg.mesh)
    st = train.TrainState(partial(mod._init, cfg.model), mod.param_specs(cfg.model),
                          mod.make_optimizer(cfg.train), mesh)
    losses, norms = [], []
    with jax.set_mesh(mesh):
        state = st.fresh(jax.random.key(cfg.train.seed))
        step = st.jit(partial(mod.train_step, cfg=cfg, tx=st.tx))
        for b in batches(cfg.model.vocab_size, STEPS):
            state, m = step(state, jax.device_put(b, NamedSharding(mesh, P(axes, None))))
            losses.append(m["loss"])
            norms.append(m["grad_norm"])
        sq = sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(state["params"]))
    return [float(x) for x in losses], [float(x) for x in norms], float(sq)


CASES = [(name, mod, preset, axes, opt) for name, mod, preset, axes in [
    ("dense", td, "tiny", BATCH_AXES), ("moe", tm, "tiny-moe", BATCH_AXES + ("expert",))]
    for opt in ("adamw", "muon")]


@pytest.mark.parametrize("name, mod, preset, axes, opt", CASES,
                         ids=[f"{c[0]}-{c[4]}" for c in CASES])
def test_a_default_run_trains_as_it_did(name, mod, preset, axes, opt):
    losses, norms, sq = trajectory(mod, preset, axes, opt)
    want_losses, want_norms, want_sq = BEFORE[f"{name}-{opt}"]
    np.testing.assert_allclose(sq, want_sq, rtol=1e-4, err_msg="sum of squared parameters")
    np.testing.assert_allclose(losses, want_losses, rtol=2e-4, err_msg="loss")
    assert min(norms[:4]) > 1.0  # above the clip: clipping is on at the first steps
    np.testing.assert_allclose(norms[:4], want_norms[:4], rtol=1e-3, err_msg="grad_norm")


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
            prompt, valid = encode_prompts(tok, [p for p, _ in items], width)
            comp, mask = tg.encode_completions(tok, [a for _, a in items],
                                               cfg.grpo.max_new_tokens)
            batch = {k: train.put(v, mesh, BATCH_AXES) for k, v in (
                ("prompt", prompt), ("prompt_valid", valid), ("completion", comp),
                ("mask", mask))}
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, GRPO_WARM, rtol=RTOL)
