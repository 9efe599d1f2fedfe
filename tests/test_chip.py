"""`make test-chip`: what only a real accelerator can show, each test marked `chip` and skipped,
with its reason, where jax.default_backend() is the CPU (CI, `make test`). On the chip (one
process: a TPU takes one program at a time, so no pytest -n, and every helper process here is
JAX_PLATFORMS=cpu):

- splash attention (compiled by Mosaic, not interpreted) and megablox's grouped matmul, values
  and gradients, against float32 references computed on the host's CPU at 'highest' matmul
  precision. Criterion: their largest error, relative to the reference's largest magnitude,
  within twice that of XLA's own plain version of the same function on the same chip in the
  same dtype (XLA:TPU's default precision multiplies float32 in bfloat16 passes, so the chip's
  float32 is not the CPU's), or under a floor (1e-3 float32, 1e-2 bfloat16); a wrong mask, cap
  or group shows as errors of 1e-1 and more.
- train_dense.py's step on `tiny` (float32, 'highest' precision) for 5 steps on fixed tokens,
  against the same steps in a CPU process: losses within 2e-3 and gradient norms within 1e-2,
  relative (splash against the CPU's blocked kernel, XLA:TPU against XLA:CPU).
- a checkpoint written on the chip, restored by a CPU process onto the host: every leaf bit for bit.
- `make bench-tpu`'s table, made from sample logs in both sides' formats, parsed back (this one
  runs on the CPU too).
"""
import dataclasses
import json
import os
import subprocess
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import tpu as bt
from common import attention as A

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOOR = {jnp.float32: 1e-3, jnp.bfloat16: 1e-2}


@pytest.fixture
def chip():
    if jax.default_backend() == "cpu":
        pytest.skip("needs a real accelerator: jax.default_backend() is 'cpu' here (run `make "
                    "test-chip` on a TPU host)")
    return jax.devices()[0]


def on_cpu(f, *args):
    """f(*args) on the host's CPU in float32 at 'highest' matmul precision: the reference."""
    up = lambda x: (np.asarray(x, np.float32) if hasattr(x, "dtype") and jnp.issubdtype(
        x.dtype, jnp.floating) else x)   # segment ids stay integers
    with jax.default_device(jax.devices("cpu")[0]), jax.default_matmul_precision("highest"):
        return jax.device_get(jax.jit(f)(*jax.tree.map(up, args)))


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def assert_as_close_as_xla(got, xla, want, dtype, what):
    """Each leaf of `got` (the kernel on the chip) at most twice as far from `want` (the CPU's
    float32) as `xla` (XLA's plain version on the chip), or under the dtype's floor."""
    for (path, g), x, w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(xla),
                               jax.tree.leaves(want)):
        e, e_xla = rel_err(g, w), rel_err(x, w)
        assert e <= max(2 * e_xla, FLOOR[dtype]), (
            f"{what}{jax.tree_util.keystr(path)}: error {e:.2e}, XLA's {e_xla:.2e}")


# ---- splash attention ------------------------------------------------------------------------
CASES = {  # name: (dtype, head width, knobs)
    "causal-f32": (jnp.float32, 128, {}),
    "causal-bf16": (jnp.bfloat16, 128, {}),
    "causal-bf16-h64": (jnp.bfloat16, 64, {}),   # llama3.2-1b's heads
    "all-f32": (jnp.float32, 128, dict(window=100, cap=5.0, sinks=True, packed=True)),
    "all-bf16": (jnp.bfloat16, 128, dict(window=100, cap=5.0, sinks=True, packed=True)),
}


@pytest.mark.chip
@pytest.mark.parametrize("case", CASES)
def test_splash_on_the_chip_equals_the_reference_softmax(chip, case):
    """Values and gradients (q, k, v, sinks) of splash on the chip: 2 rows of 512 tokens, 4 query
    heads over 2 KV heads; packed rows hold three examples each, of other lengths per row."""
    dtype, H, knobs = CASES[case]
    B, T, N, K = 2, 512, 4, 2
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, T, n, H), np.float32) + s for n, s in
               ((N, 0.3), (K, 0.3), (K, 0.0)))
    ct = rng.standard_normal((B, T, N, H), np.float32)
    sinks = rng.standard_normal(N).astype(np.float32) if knobs.get("sinks") else None
    seg = (np.stack([np.repeat([1, 2, 3], [200, 150, 162]), np.repeat([1, 2, 3], [37, 400, 75])])
           .astype(np.int32) if knobs.get("packed") else None)
    kw = dict(scale=H ** -0.5 * 2, causal=True, window=knobs.get("window", 0),
              cap=knobs.get("cap", 0.0))

    def loss_and_grads(f):
        def loss(q, k, v, s, seg):
            return jnp.sum(f(q, k, v, sinks_N=s, segment_ids=seg, **kw).astype(jnp.float32) * ct)
        return jax.value_and_grad(loss, argnums=(0, 1, 2) if sinks is None else (0, 1, 2, 3))

    cast = lambda x: jnp.asarray(x, dtype)
    args = (cast(q), cast(k), cast(v), sinks, seg)
    want = on_cpu(loss_and_grads(A.reference), *args)
    got = jax.jit(loss_and_grads(A.splash))(*args)
    xla = jax.jit(loss_and_grads(A.reference))(*args)
    outs = lambda f, q, k, v, s, seg: f(q, k, v, sinks_N=s, segment_ids=seg, **kw)
    assert_as_close_as_xla(jax.jit(partial(outs, A.splash))(*args),
                           jax.jit(partial(outs, A.reference))(*args),
                           on_cpu(partial(outs, A.reference), *args), dtype, "output")
    assert_as_close_as_xla(got[1], xla[1], want[1], dtype, "gradient")


# ---- megablox --------------------------------------------------------------------------------
@pytest.mark.chip
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_megablox_on_the_chip_equals_the_naive_expert_loop(chip, dtype):
    """The MoE layer with megablox's kernel (compiled) against the per-token loop of
    tests/test_moe.py: 8 experts, top-2, d 256, 128 tokens, uneven loads; values and gradients."""
    import train_moe as tm
    from tests.test_moe import SMALL, naive_moe, one_layer, perturbed_params
    model = dataclasses.replace(SMALL, d_model=256, d_ff=256, n_heads=4, head_dim=64, top_k=2,
                                grouped_matmul="megablox")
    lp = one_layer(perturbed_params(model))
    keys = ("w_router", "w_gate", "w_up", "w_down")
    rng = np.random.default_rng(3)
    # Tokens whose k-th and (k+1)-th router logits are apart by 5% of the logits' range: the
    # chip's rounding (bfloat16 passes) then chooses the experts the CPU does.
    h = np.asarray(jnp.asarray(rng.standard_normal((1024, model.d_model)), dtype), np.float64)
    z = np.sort(h @ np.asarray(jnp.asarray(lp["w_router"], dtype), np.float64), axis=-1)
    gap = z[:, -model.top_k] - z[:, -model.top_k - 1]
    h = h[gap > 0.05 * np.ptp(z)][:128].reshape(2, 64, model.d_model).astype(np.float32)
    ct = rng.standard_normal(h.shape, np.float32)

    def grads(layer):
        def loss(h, ws):
            return jnp.sum(layer(h, dict(lp, **ws)).astype(jnp.float32) * ct)
        return jax.value_and_grad(loss, argnums=(0, 1))

    cast = lambda x: jnp.asarray(x, dtype)
    args = (cast(h), {k: cast(lp[k]) for k in keys})
    mine = lambda h, lp: tm.moe(h, lp, model)[0]
    want = on_cpu(grads(lambda h, lp: naive_moe(h, lp, model)), *args)
    got = jax.jit(grads(mine))(*args)
    xla = jax.jit(grads(lambda h, lp: naive_moe(h, lp, model)))(*args)
    assert_as_close_as_xla(jax.jit(mine)(*args), jax.jit(partial(naive_moe, cfg=model))(*args),
                           on_cpu(partial(naive_moe, cfg=model), *args), dtype, "output")
    assert_as_close_as_xla(got[1], xla[1], want[1], dtype, "gradient")
    _, e, _ = jax.jit(partial(tm.router, cfg=model))(args[0], args[1]["w_router"])
    assert len(set(np.bincount(np.asarray(e).ravel(), minlength=8).tolist())) > 2  # ragged


@pytest.mark.chip
def test_the_chip_reports_its_peak_memory(chip):
    """What `make bench-tpu` reads on both sides: memory_stats' high-water mark, in bytes."""
    x = jax.device_put(np.ones((64, 2**20), np.float32), chip).block_until_ready()   # 256 MiB
    stats = chip.memory_stats()
    assert stats["peak_bytes_in_use"] >= stats["bytes_in_use"] >= x.nbytes
    assert stats["bytes_limit"] > 2**30


# ---- a train step, a checkpoint: the chip against a CPU process --------------------------------
def tiny_steps(steps: int, save_to: str = "") -> list[list[float]]:
    """[loss, grad_norm] of each of `steps` train_dense.py steps of `tiny` (float32, 'highest'
    precision, lr 1e-3 from the first step) on fixed tokens; with save_to, the state after
    them is checkpointed there and its leaves written to save_to/leaves.npz."""
    import train_dense as td
    from common import train
    from common.checkpoint import Checkpointer, CheckpointConfig
    from common.mesh import BATCH_AXES, MeshConfig, make_mesh
    cfg = td.PRESETS["tiny"][1]
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="float32"),
                              train=dataclasses.replace(cfg.train, batch_size=8, seq_len=256,
                                                        lr=1e-3, warmup_steps=0))
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    st = td.train_state(cfg, mesh)
    step = st.jit(partial(td.train_step, cfg=cfg, tx=st.tx))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (8, 257), np.int32)
    out = []
    with jax.set_mesh(mesh), jax.default_matmul_precision("highest"):
        state, batch = st.fresh(jax.random.key(0)), train.put(tokens, mesh, BATCH_AXES)
        for _ in range(steps):
            state, m = step(state, batch)
            out.append([float(m["loss"]), float(m["grad_norm"])])
    if save_to:
        with Checkpointer(save_to, CheckpointConfig(async_save=False)) as ckpt:
            assert ckpt.save(steps, state, force=True)
        np.savez(os.path.join(save_to, "leaves.npz"), **{
            jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(state)})
    return out


def restored_bytes_equal(run_dir: str, step: int) -> int:
    """On this host (the CPU): `tiny_steps`' checkpoint restored onto one CPU device, each leaf
    compared byte for byte with the chip's copy in leaves.npz; returns how many leaves."""
    import train_dense as td
    from common.checkpoint import Checkpointer, CheckpointConfig
    from common.mesh import MeshConfig, make_mesh
    cfg = td.PRESETS["tiny"][1]
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="float32"))
    st = td.train_state(cfg, make_mesh(MeshConfig(), jax.devices()[:1]))
    with Checkpointer(run_dir, CheckpointConfig()) as ckpt:
        restored = ckpt.restore(step, st.abstract())
    saved = np.load(os.path.join(run_dir, "leaves.npz"))
    leaves = jax.tree_util.tree_leaves_with_path(restored)
    assert sorted(saved.files) == sorted(jax.tree_util.keystr(p) for p, _ in leaves)
    for p, x in leaves:
        x, want = np.asarray(x), saved[jax.tree_util.keystr(p)]
        assert x.dtype == want.dtype and x.shape == want.shape, jax.tree_util.keystr(p)
        assert x.tobytes() == want.tobytes(), jax.tree_util.keystr(p)
    return len(leaves)


def on_cpu_process(code: str) -> str:
    """The last line python prints running `code` in a CPU-only process (the chip stays ours)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.chip
def test_tiny_train_steps_on_the_chip_match_the_cpu(chip):
    got = np.array(tiny_steps(5))
    want = np.array(json.loads(on_cpu_process(
        "import json; from tests.test_chip import tiny_steps; print(json.dumps(tiny_steps(5)))")))
    assert got[-1, 0] < got[0, 0] - 0.05   # it learns: the steps are not all alike
    np.testing.assert_allclose(got[:, 0], want[:, 0], rtol=2e-3)   # losses
    np.testing.assert_allclose(got[:, 1], want[:, 1], rtol=1e-2)   # gradient norms


@pytest.mark.chip
def test_a_checkpoint_written_on_the_chip_restores_on_the_cpu_bit_for_bit(chip, tmp_path):
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    tiny_steps(2, save_to=run_dir)
    n = on_cpu_process("from tests.test_chip import restored_bytes_equal; "
                       f"print(restored_bytes_equal({run_dir!r}, 2))")
    assert int(n) > 10   # params, both Adam moments, the step


# ---- make bench-tpu's bookkeeping (on the CPU too) ----------------------------------------------
def ours_log(seconds: list[float], peak: int) -> str:
    return (f"bench | 20000 tok/s | ...\nbench | step seconds 1-{len(seconds)}: "
            + " ".join(f"{s:.4f}" for s in seconds)
            + f"\n{bt.PEAK_LINE}: {peak} device: TPU v5 lite\n")


def maxtext_log(seconds: list[float], peak: int, tflops: float, params_b: str) -> str:
    steps = "".join(f"completed step: {i}, seconds: {s:.3f}, TFLOP/s/device: {tflops:.3f}, "
                    f"Tokens/s/device: {16384 / s:.3f}, total_weights: 16384, loss: 12.000\n"
                    for i, s in enumerate(seconds))
    return (f"number parameters: {params_b} billion\n{steps}"
            f"{bt.PEAK_LINE}: {peak} device: TPU v5 lite\n")


@pytest.mark.chip
def test_bench_tpu_table_from_both_sides_logs_parses_back():
    """Both sides' logs, in their real formats, through read_run, summarize, the markdown and
    parse_table: the figures come back as computed by hand."""
    row, tokens, steps = "qwen3-0.6b-2k", 8 * 2048, 12
    ours_s = [0.9] * 2 + [0.80, 0.82, 0.81, 0.79, 0.83, 0.80, 0.81, 0.84, 0.80]   # steps 1-11
    theirs_s = [40.0, 2.0, 0.9, 0.88, 0.87, 0.86, 0.88, 0.90, 0.86, 0.87, 0.89, 0.88]  # 0-11
    runs = [dict(row=row, side="ours", i=0, setting="", tokens=tokens,
                 **bt.read_run(ours_log(ours_s, 12 * 2**30), "ours", steps, 3)),
            dict(row=row, side="maxtext", i=0, setting="", tokens=tokens,
                 **bt.read_run(maxtext_log(theirs_s, 13 * 2**30, 80.0, "0.596"), "maxtext",
                               steps, 3)),
            dict(row=row, side="ours", i=1, setting=bt.SETTINGS[row]["ours"][1], tokens=tokens,
                 **bt.read_run("...RESOURCE_EXHAUSTED: Out of memory while trying to allocate\n"
                               f"{bt.PEAK_LINE}: {15 * 2**30} device: TPU v5 lite", "ours",
                               steps, 3))]
    assert runs[0]["step_s"] == 0.81 and runs[1]["step_s"] == 0.88   # medians of steps 3-11
    assert runs[2]["status"] == "out of memory"
    lines, notes = bt.summarize(runs, [row])
    table = bt.parse_table(bt.markdown(lines))
    ours, theirs, oom, best = table   # per setting: ours, MaxText's; then the best of each
    f = bt.flops_per_token(row)
    assert ours["tok/s"] == round(tokens / 0.81) and theirs["tok/s"] == round(tokens / 0.88)
    assert (ours["ms/step"], theirs["ms/step"]) == (810.0, 880.0)
    assert (ours["peak HBM GiB"], theirs["peak HBM GiB"], oom["peak HBM GiB"]) == (12, 13, 15)
    assert ours["MFU causal/2"] == round(100 * f["causal"] * tokens / 0.81 / 197e12, 1)
    assert ours["MFU full"] == round(100 * f["full"] * tokens / 0.81 / 197e12, 1)
    assert ours["ours/MaxText"] == round(0.88 / 0.81, 2) and theirs["ours/MaxText"] is None
    assert oom["status"] == "out of memory" and oom["setting"] == bt.SETTINGS[row]["ours"][1]
    assert best["side"] == "best" and best["ours/MaxText"] == round(0.88 / 0.81, 2)
    # MaxText's own count: 80 TFLOP/s x 0.88 s over 16384 tokens; its parameters agree with ours.
    assert f"MaxText counts {80 * 0.88e12 / tokens / 1e9:.3f} GFLOP a token" in notes[1]
    assert notes[0] == f"{row}: parameters ours 596,049,920, MaxText 0.596 billion"


def test_bench_tpu_alternates_sides_and_says_how_it_installs(tmp_path):
    out = subprocess.run([sys.executable, "bench/tpu.py", "--print", "--rows",
                          "qwen3-0.6b-2k,moe-2k", "--repeats", "2", "--wheels", "W", "--deps",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    pip = [ln for ln in lines if " pip install " in ln]
    assert len(pip) == 2 and all("--no-index --find-links" in ln for ln in pip)  # wheels alone
    assert "--no-deps --ignore-requires-python -r" in pip[1] and "maxtext==0.2.5" in pip[1]
    runs = [ln for ln in lines if "--run" in ln]
    sides = ["ours" if "train_" in ln else "maxtext" for ln in runs]
    # Per row: MaxText's default, our two settings in one process, MaxText's second.
    assert sides == ["maxtext", "ours", "maxtext"] * 4   # 2 repeats x 2 rows
    assert "--model.n-experts 32" in runs[4] and "num_experts=32" in runs[3]
    first, second = runs[1].split(" --- ")   # the default, then the one thought best
    assert "--train.batch-size 8" in first and "--train.batch-size 8" in second
    assert "--model.remat auto" in second and "--model.remat" not in first
    assert "per_device_batch_size=4" in runs[2] and "remat_policy=save_qkv_proj" in runs[2]
    assert "DECOUPLE_GCLOUD=TRUE" in runs[2] and "remat_policy" not in runs[0]
    index = bt.pip("T", ["x"], index="file:///opt/pypi/simple", wheels="", no_deps=False)
    assert "--isolated" in index and "--no-index" not in index


def test_maxtext_source_edits_apply_once(tmp_path):
    """patch_maxtext on the two files' lines as MaxText 0.2.5 ships them: made, then no change."""
    att = tmp_path / "maxtext" / "kernels" / "attention"
    mhc = tmp_path / "maxtext" / "kernels" / "mhc"
    att.mkdir(parents=True)
    mhc.mkdir(parents=True)
    (att / "jax_flash_attention.py").write_text(
        "import jax\nfrom jax.experimental.xla_metadata import must_fuse_call\nx = 1\n")
    (mhc / "api.py").write_text('type Implementation = Literal["mosaic", "xla"]\n')
    (mhc / "common.py").write_text("type KernelContext = tuple[int, int]\n  type = 3\n")
    assert len(bt.patch_maxtext(str(tmp_path))) == 3
    assert bt.patch_maxtext(str(tmp_path)) == []
    ns = {}   # as under JAX 0.10, which has no must_fuse_call: the hint becomes a no-op
    exec((att / "jax_flash_attention.py").read_text().replace("jax.experimental.xla_metadata",
                                                              "no_such_module"), ns)
    assert ns["must_fuse_call"]("qk")(len)("ab") == 2
    assert (mhc / "common.py").read_text() == "KernelContext = tuple[int, int]\n  type = 3\n"


def test_our_settings_in_one_process_each_report_their_steps_and_peak(tmp_path):
    """bench/tpu.py --run TRAINER ARGS --- ARGS: each setting's bench and peak line in turn, a
    failing one (a bad flag) reported and the next still run; the log read back per setting."""
    tiny = ["tiny", "--bench", "6", "--train.batch-size", "2", "--train.seq-len", "64",
            "--run-dir", str(tmp_path / "r")]
    out = subprocess.run([sys.executable, "bench/tpu.py", "--run", "train_dense.py", *tiny,
                          "--model.remat", "bogus", "---", *tiny],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ[
                             "XLA_FLAGS"].replace("device_count=8", "device_count=1")))
    assert out.returncode == 1, out.stdout[-3000:]   # one setting failed
    bad, ok = bt.read_process(out.stdout, "ours", [(0, "remat=bogus"), (1, "")], 7, 2)
    assert bad["status"].startswith("failed") and ok["status"] == "ok"
    assert ok["device"] == "cpu" and "peak_bytes" not in ok   # the CPU keeps no memory_stats
    settings = [(0, ""), (1, "remat=dots"), (2, "")]
    peaks = [f"peak_bytes_in_use: {n} device: TPU" for n in (5, 5, 7)]
    log = "".join(f"bench-tpu setting {i}: x\nbench | step seconds 1-6: 1 1 1 1 1 1\n"
                  f"bench-tpu {p}\n" for i, p in enumerate(peaks))
    got = bt.read_process(log, "ours", settings, 7, 2)
    assert [r["peak_bytes"] for r in got] == [5, 5, 7]
    assert [r["peak_at_most"] for r in got] == [False, True, False]


def test_bench_tpu_moe_row_is_maxtexts_model():
    """The MoE row's model (qwen3-30b-a3b's block, 2 layers, 32 experts, vocab 32000) has the
    parameters MaxText's qwen3_moe layers hold: untied embeddings, q/k norms, a router, each
    expert's three matrices, two norms a layer (bench-tpu also checks MaxText's printed count)."""
    V, D, L, N, K, H, E, F = 32000, 2048, 2, 32, 4, 128, 32, 768
    layer = D * N * H + 2 * D * K * H + N * H * D + 2 * H + 2 * D + D * E + E * 3 * D * F
    assert bt.flops_per_token("moe-2k")["params"] == 2 * V * D + L * layer + D == 470_952_448
