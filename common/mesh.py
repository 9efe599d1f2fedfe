"""Device mesh: six named axes, each with a size inside a slice (ici) and across slices (dcn).

| axis    | shards                                                           |
| ------- | ---------------------------------------------------------------- |
| stage   | the layer stack, in pipeline stages (train_dense.py, train_moe.py) |
| data    | the batch (pure data parallel)                                   |
| fsdp    | the batch and the model dimension of weights                     |
| context | the sequence of activations (long context: common/attention.py)  |
| tensor  | heads, MLP hidden, vocabulary                                    |
| expert  | experts and the batch (MoE only)                                 |

The mesh is validated against the device count before anything is compiled, so a wrong
launch fails in a second with the flag to change, not after minutes of compilation.
"""
import dataclasses
import math

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

# Stage first: the outermost axis gets the slowest links, and stages exchange only activations.
AXES = ("stage", "data", "fsdp", "context", "tensor", "expert")
_DCN_AXES = tuple("dcn_" + a for a in AXES)  # MeshConfig's field names for the dcn sizes
BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over these (plus "expert" in MoE)


class MeshError(ValueError):
    """A mesh that cannot be built on the devices at hand; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Axis sizes inside one slice (ICI, fast links) and across slices (DCN). One ici size may
    be -1: whatever the device count leaves. The product of all sizes is the device count."""

    data: int = 1
    fsdp: int = -1
    context: int = 1
    tensor: int = 1
    expert: int = 1
    stage: int = 1
    dcn_data: int = 1
    dcn_fsdp: int = 1
    dcn_context: int = 1
    dcn_tensor: int = 1
    dcn_expert: int = 1
    dcn_stage: int = 1

    def ici(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in AXES)

    def dcn(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in _DCN_AXES)


def _flags(names, sizes) -> str:  # a stage of 1, the usual, left unsaid
    return " x ".join(f"--mesh.{n.replace('_', '-')} {s}" for n, s in zip(names, sizes)
                      if not n.endswith("stage") or s != 1)


def resolve(cfg: MeshConfig, n_devices: int, n_slices: int = 1) -> MeshConfig:
    """Fill the -1 and check every product; returns a config with concrete sizes."""
    ici, dcn = list(cfg.ici()), list(cfg.dcn())
    for name, v in zip(AXES + _DCN_AXES, ici + dcn):
        if v == 0 or v < -1:
            raise MeshError(f"--mesh.{name.replace('_', '-')} {v}: an axis size is a positive "
                            "integer, or -1 for 'whatever is left'.")
    if -1 in dcn:
        raise MeshError("dcn sizes cannot be -1: give --mesh.dcn-* explicitly (their product is "
                        f"the number of slices, {n_slices} here).")
    if math.prod(dcn) != n_slices:
        raise MeshError(f"{_flags(_DCN_AXES, dcn)} = {math.prod(dcn)} slices, but this run has "
                        f"{n_slices} slice(s); make the dcn sizes multiply to {n_slices}.")
    if n_devices % n_slices:
        raise MeshError(f"{_flags(_DCN_AXES, dcn)}: {n_devices} devices do not split into "
                        f"{n_slices} equal slices.")
    per_slice = n_devices // n_slices
    if ici.count(-1) > 1:
        raise MeshError(f"{_flags(AXES, ici)}: at most one axis may be -1.")
    known = math.prod(v for v in ici if v != -1)
    if -1 in ici:
        if per_slice % known:
            raise MeshError(f"{_flags(AXES, ici)}: the fixed sizes multiply to {known}, which does "
                            f"not divide the {per_slice} devices per slice; pick sizes that divide "
                            f"{per_slice}.")
        ici[ici.index(-1)] = per_slice // known
    elif known != per_slice:
        raise MeshError(f"{_flags(AXES, ici)} = {known} devices, but {per_slice} are available "
                        f"per slice; make the product {per_slice}, or set one axis to -1 "
                        f"(e.g. --mesh.fsdp -1).")
    return dataclasses.replace(cfg, **dict(zip(AXES, ici)))


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """The device mesh for `cfg`. On TPU a slice is what `device.slice_index` says; on GPU and
    CPU each process is a slice (process_is_granule): how a multi-node GPU job maps onto dcn."""
    devices = list(jax.devices() if devices is None else devices)
    on_tpu = devices[0].platform == "tpu"
    # GPU/CPU processes with no dcn axes: one flat mesh over all devices.
    n_slices = (len({getattr(d, "slice_index", 0) for d in devices}) if on_tpu else
                len({d.process_index for d in devices}) if math.prod(cfg.dcn()) > 1 else 1)
    cfg = resolve(cfg, len(devices), n_slices)
    if n_slices == 1:
        # allow_split_physical_axes: on a CPU or odd topology the ideal physical layout may not
        # exist; falling back keeps a valid (if less optimal) assignment instead of failing.
        dev = mesh_utils.create_device_mesh(cfg.ici(), devices, allow_split_physical_axes=True)
    else:
        dev = mesh_utils.create_hybrid_device_mesh(cfg.ici(), cfg.dcn(), devices,
                                                   process_is_granule=not on_tpu,
                                                   allow_split_physical_axes=True)
    # Auto axes: shardings are propagated by XLA from the constraints we pin at block boundaries.
    return Mesh(dev, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def describe(mesh: Mesh) -> str:  # stage only where a run pipelines
    return " ".join(f"{a}={mesh.shape[a]}" for a in AXES if a != "stage" or mesh.shape[a] > 1)


# --- Ahead-of-time compilation for a TPU this machine does not have (MaxText's train_compile
# idea): libtpu describes the named topology's devices, and XLA compiles for them from a CPU host.
# generation -> (topology prefix, TensorCores per chip in the accelerator name, 3-D torus?)
_TPU_FAMILIES = {"v4": ("v4", 2, True), "v5p": ("v5p", 2, True), "v5e": ("v5e", 1, False),
                 "v5litepod": ("v5e", 1, False), "v6e": ("v6e", 1, False)}


def tpu_topology_shape(chips: int, torus_3d: bool) -> tuple[int, ...]:
    """The chip grid of a slice: start from one host's 2x2 (x1) and keep doubling the last of
    the shortest sides, which gives Cloud TPU's shapes (v5p-256 = 128 chips = 4x4x8)."""
    if chips < 4:
        return (1, chips)  # v5e-1: a single chip (3-D generations start at 4 chips, below)
    shape = [2, 2, 1] if torus_3d else [2, 2]
    while math.prod(shape) < chips:
        shape[len(shape) - 1 - shape[::-1].index(min(shape))] *= 2  # the last of the shortest
    return tuple(shape)


def tpu_topology_wrap(shape: tuple[int, ...], torus_3d: bool) -> tuple[bool, bool, bool]:
    """Which axes have wrap-around links (Cloud TPU's torus): on a 3-D slice every axis once
    all are at least 4 chips long (v5p-128 and up), on a 2-D one an axis as long as the pod's
    (16). Collectives are modelled (and routed) on them."""
    return (min(shape) >= 4,) * 3 if torus_3d else (*(s == 16 for s in shape), False)[:3]


def tpu_type(name: str) -> tuple[str, int, str, int, bool]:
    """(generation, chips, chip name, cores a chip, 3-D torus) of a TPU accelerator type such
    as v5p-256: Cloud TPU counts cores, and a v5p or v4 chip has two."""
    gen, _, n = name.lower().partition("-")
    if gen not in _TPU_FAMILIES or not n.isdigit() or int(n) < 1:
        raise MeshError(f"--compile-topology {name}: expected an accelerator type such as "
                        f"v5p-256, v4-128, v5e-64 or v6e-256 ({', '.join(_TPU_FAMILIES)}).")
    prefix, cores_per_chip, torus_3d = _TPU_FAMILIES[gen]
    return gen, int(n) // cores_per_chip, prefix, cores_per_chip, torus_3d


def tpu_topology_devices(name: str, n_slices: int = 1) -> list:
    """Abstract devices of `n_slices` slices of the TPU accelerator type `name` (e.g. v5p-256,
    v5e-64, v6e-256), for lowering and compiling without the hardware."""
    gen, chips, prefix, cores_per_chip, torus_3d = tpu_type(name)
    if chips < (4 if torus_3d else 1) or chips & (chips - 1):
        smallest = f"{gen}-{4 * cores_per_chip if torus_3d else 1}"
        raise MeshError(f"--compile-topology {name}: {chips} chips; supported here are "
                        f"power-of-two slices from {smallest}.")
    shape = tpu_topology_shape(chips, torus_3d)
    try:
        from jax.experimental.topologies import get_topology_desc
        topo = get_topology_desc(
            platform="tpu", topology_name=f"{prefix}:{'x'.join(map(str, shape))}",
            chip_config_name="megacore" if cores_per_chip == 2 else "default",
            chips_per_host_bounds=(2, 2, 1) if chips >= 4 else (1, chips, 1),
            num_slices=n_slices, wrap=tpu_topology_wrap(shape, torus_3d))
    except Exception as e:  # no libtpu, or a topology this libtpu does not know
        raise MeshError(f"--compile-topology {name}: could not describe the TPU topology "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
                        "Ahead-of-time TPU compilation needs libtpu: install the project with "
                        "the tpu extra (pip install -e '.[tpu]') on Linux.") from e
    return list(topo.devices)


def target_platform() -> str:
    """The platform the program being traced compiles for: the mesh's devices (a TPU's under
    --compile-topology, on a CPU host), else this process's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    dev = None if mesh.empty else getattr(mesh, "abstract_device", None)
    if getattr(dev, "platform", None):
        return dev.platform
    kind = (getattr(dev, "device_kind", None) or "").lower()  # JAX 0.10.0's: only the kind
    if not kind:
        return jax.default_backend()
    return "tpu" if kind.startswith("tpu") else "cpu" if kind == "cpu" else "gpu"
