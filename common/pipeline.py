"""Pipeline parallelism on the `stage` axis: GPipe/circular ticks in one SPMD program."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from common.config import need
from common.mesh import MeshConfig
from common.train import is_max, log


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
