"""Our training step and MaxText's, compiled for a TPU slice on this CPU host: `make compile-tpu`.

For each row (a trainer and preset, a TPU topology, a per-chip batch, a sequence length, the
layers kept) libtpu compiles one training step ahead of time, as `--dry-run --compile-topology`
does, and the table shows what the compiled executable says about the slice: memory per chip,
XLA's FLOPs per chip, XLA's estimated step time (cost_analysis's `optimal_seconds`, its model
of the TPU, no hardware involved) and the MFU that estimate implies: the trainer's own model
FLOPs per step (`flops_per_token(cfg.model, seq_len)` x tokens per step, useful work only)
/ est. step time / (chips x the chip's peak, common/train.py PEAK_TFLOPS). Then MaxText 0.2.5
(bench/peers/maxtext_compile.py, its `train_compile` in its own venv) on the same model,
topology, per-chip batch and length, MFU from the same model FLOPs, and ours/MaxText ratios.

Layers: both sides keep the same first N layers of the model (`--model.n-layers N`,
MaxText's `base_num_decoder_layers=N`) so a large model compiles on a small host in minutes,
and both unroll them (`--model.no-scan-layers`, `scan_layers=false`): XLA's cost analysis
counts a loop body once, so with a scanned layer stack the FLOPs and the step time would
cover one layer, not N. Memory and time are for N layers: the full model's are larger.
Our chunked cross-entropy is a loop too: --model.no-scan-layers unrolls it with the layers,
so the default chunk size is compiled and every chunk counted. Any while loop still left in a
compiled step is counted and named under the table: its figures are then lower bounds.

Each compile runs in a subprocess of its own: a row that fails (out of HBM, a compiler
error, a timeout) is reported in its cell and the table goes on, and each compile's host
memory is returned when it ends. Ours runs in this interpreter's environment (it needs the
tpu extra: pip install -e '.[tpu]'); MaxText in the venv bench/peers/maxtext.sh installs on
first use. Both sides compile with one compiler: MaxText is pointed at our libtpu.so
(TPU_LIBRARY_PATH; --maxtext-libtpu own keeps its venv's, a newer one), since the libtpu
version alone moves the figures (MaxText's llama3.1-8b at 2k: 10.40 GiB per chip with libtpu
0.0.50.1, 8.95 with 0.0.52, the same est. step time). Estimates, not measurements: no TPU
is touched.

    python bench/compile_tpu.py                          # every row, ours and MaxText
    python bench/compile_tpu.py --rows llama8b-2k --no-maxtext --json out.json
    python bench/compile_tpu.py --row 'name=qwen trainer=dense preset=qwen3-8b topology=v5p-8
        batch=1 seq=4096 layers=4 maxtext=qwen3-8b'       # a row of your own
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The environment the compiles start from, taken before JAX is imported here: JAX sets
# TPU_LIBRARY_PATH to this venv's libtpu, which a child would inherit, silently.
ENV = dict(os.environ)
sys.path.insert(0, ROOT)
from common.mesh import MeshError, tpu_type  # noqa: E402
from common.train import PEAK_TFLOPS  # noqa: E402
from bench import schedule  # noqa: E402

PEER = os.path.join(ROOT, "bench", "peers")
OURS_PREFIX, PEER_PREFIX = "COMPILE_TPU_REPORT ", "MAXTEXT_COMPILE "
TRAINERS = {"dense": "train_dense.py", "moe": "train_moe.py"}

# One row per line: key=value words (shlex; quote a value with spaces). Required: name,
# trainer (dense or moe), preset, topology, batch (per chip), seq, layers. Optional:
# maxtext (MaxText's model_name; without it the row has no peer), ours (more flags for our
# trainer), theirs (more MaxText key=value overrides), context (C: the sequence split over C
# chips, --mesh.context and MaxText's ici_context_parallelism; batch then counts sequences
# per C chips), slices (N slices of the topology: --compile-slices and MaxText's
# compile_topology_num_slices; the chips are N x the topology's).
ROWS = [
    "name=llama8b-2k trainer=dense preset=llama3.1-8b topology=v5p-8 batch=1 seq=2048 "
    "layers=4 maxtext=llama3.1-8b",
    "name=llama8b-8k trainer=dense preset=llama3.1-8b topology=v5p-8 batch=1 seq=8192 "
    "layers=4 maxtext=llama3.1-8b",
    "name=llama70b-8k trainer=dense preset=llama3.1-70b topology=v5p-256 batch=1 seq=8192 "
    "layers=4 maxtext=llama3.1-70b",
    "name=mixtral trainer=moe preset=mixtral-8x7b topology=v5p-8 batch=1 seq=4096 layers=4 "
    "maxtext=mixtral-8x7b",
    # One dense layer then MoE layers (the full model has 3 dense of 61): mostly experts.
    "name=deepseek-v3 trainer=moe preset=deepseek-v3 topology=v5p-32 batch=1 seq=4096 "
    "layers=4 ours='--model.first-k-dense 1 --model.mtp-depth 0' maxtext=deepseek3-671b "
    "theirs='first_num_dense_layers=1'",
    # Six layers: Gemma 3's pattern once, five sliding-window (1024) layers and a global one.
    "name=gemma3-12b trainer=dense preset=gemma3-12b topology=v6e-8 batch=1 seq=4096 layers=6 "
    "maxtext=gemma3-12b",
    # The same on a v5p: for v6e this libtpu's cost model gives no step time (a negative one).
    "name=gemma3-12b-v5p trainer=dense preset=gemma3-12b topology=v5p-8 batch=1 seq=4096 "
    "layers=6 maxtext=gemma3-12b",
]
# --fit's rows: the models whole (layers scanned), at 8k, for the largest per-chip batch.
FIT_ROWS = [
    "name=llama8b-8k-fit trainer=dense preset=llama3.1-8b topology=v5p-8 batch=1 seq=8192 "
    "layers=32 maxtext=llama3.1-8b",
    "name=llama70b-8k-fit trainer=dense preset=llama3.1-70b topology=v5p-256 batch=1 seq=8192 "
    "layers=80 maxtext=llama3.1-70b"]
REQUIRED = ("name", "trainer", "preset", "topology", "batch", "seq", "layers")
OPTIONAL = ("maxtext", "ours", "theirs", "context", "slices")
# Long context (issue 34): llama3.1-8b's first 4 layers at 8k, 32k and 128k tokens on 16 v5p
# chips, the sequence whole on one chip or split over 4 or 16: `--rows context`.
CONTEXT_ROWS = [f"name=ctx{T // 1024}k-c{C} trainer=dense preset=llama3.1-8b topology=v5p-32 "
                f"batch=1 seq={T} layers=4 context={C} maxtext=llama3.1-8b"
                for T in (8192, 32768, 131072) for C in (1, 4, 16)]
# Pipeline stages (issue 35): two v5p-8 slices, the stage axis across them (dcn), fsdp inside;
# beside each model unpipelined (fsdp across the slices too), with the same accumulation.
# MaxText's layers per stage x stages x repeats = layers: 2 x 2 x 1 is GPipe, 1 x 2 x 2
# circular. MaxText scans the pipeline's iterations (its recommended scan_layers=false);
# our ticks are a scan too: the cost analysis counts one tick, so only memory compares.
_PP = "topology=v5p-8 slices=2 seq=4096"
_PP405 = "trainer=dense preset=llama3.1-405b batch=2 layers=4 maxtext=llama3.1-405b"
_PPDS = ("trainer=moe preset=deepseek-v3 batch=1 layers=3 maxtext=deepseek3-671b "
         "ours='--model.first-k-dense 1 --model.mtp-depth 0 --model.capacity-factor 1.25 {}' "
         "theirs='first_num_dense_layers=1 capacity_factor=1.25 ici_expert_parallelism=2 {}'")
PIPELINE_ROWS = [
    f"name=pp-405b-gpipe {_PP} {_PP405} ours='--mesh.dcn-stage 2 --mesh.fsdp 4 "
    "--train.microbatches 4' theirs='dcn_pipeline_parallelism=2 ici_fsdp_parallelism=4 "
    "num_pipeline_microbatches=4 num_layers_per_pipeline_stage=2'",
    # MaxText 0.2.5's circular pipeline with scan_layers=false fails in its own code
    # ("zeros_like requires ndarray or scalar arguments, got <class 'tuple'>"); scanned, it runs.
    f"name=pp-405b-circular {_PP} {_PP405} ours='--mesh.dcn-stage 2 --mesh.fsdp 4 "
    "--train.microbatches 4 --train.pipeline-repeats 2' theirs='dcn_pipeline_parallelism=2 "
    "ici_fsdp_parallelism=4 num_pipeline_microbatches=4 num_layers_per_pipeline_stage=1 "
    "scan_layers=true'",
    f"name=pp-405b-none {_PP} {_PP405} ours='--mesh.dcn-fsdp 2 --mesh.fsdp 4 "
    "--train.microbatches 2' theirs='dcn_fsdp_parallelism=2 ici_fsdp_parallelism=4 "
    "gradient_accumulation_steps=2'",
    f"name=pp-dsv3-gpipe {_PP} " + _PPDS.format(
        "--mesh.dcn-stage 2 --mesh.fsdp 2 --mesh.expert 2 --train.microbatches 2",
        "dcn_pipeline_parallelism=2 ici_fsdp_parallelism=2 num_pipeline_microbatches=2 "
        "num_layers_per_pipeline_stage=1"),
    f"name=pp-dsv3-none {_PP} " + _PPDS.format(
        "--mesh.dcn-fsdp 2 --mesh.fsdp 2 --mesh.expert 2",
        "dcn_fsdp_parallelism=2 ici_fsdp_parallelism=2")]


class RowError(ValueError):
    pass


def chips_and_peak(topology: str) -> tuple[int, float]:
    """(chips, peak FLOP/s of one chip) of an accelerator type such as v5p-256 (cores: a v5p
    or v4 chip has two)."""
    try:
        gen, chips, kind, cores_per_chip, _ = tpu_type(topology)
    except MeshError as e:
        raise RowError(f"topology {topology!r}: {e}") from None
    if chips < 1:
        raise RowError(f"topology {topology!r}: fewer cores than one {gen} chip has "
                       f"({cores_per_chip})")
    return chips, PEAK_TFLOPS[f"TPU {kind}"] * 1e12


def parse_row(spec: str) -> dict:
    """A row from its key=value words (see ROWS), checked."""
    try:
        words = shlex.split(spec)
    except ValueError as e:
        raise RowError(f"row {spec!r}: {e}") from e
    row = {}
    for w in words:
        k, eq, v = w.partition("=")
        if not eq or k not in REQUIRED + OPTIONAL:
            raise RowError(f"row {spec!r}: {w!r} is not one of "
                           f"{', '.join(f'{k}=...' for k in REQUIRED + OPTIONAL)}")
        if k in row:
            raise RowError(f"row {spec!r}: {k} given twice")
        row[k] = v
    if missing := [k for k in REQUIRED if k not in row]:
        raise RowError(f"row {spec!r}: missing {', '.join(missing)}")
    if row["trainer"] not in TRAINERS:
        raise RowError(f"row {row['name']}: trainer is one of {', '.join(TRAINERS)}, "
                       f"not {row['trainer']!r}")
    row.setdefault("context", "1")
    row.setdefault("slices", "1")
    for k in ("batch", "seq", "layers", "context", "slices"):
        if not row[k].isdigit() or int(row[k]) < 1:
            raise RowError(f"row {row['name']}: {k} is a positive whole number, "
                           f"not {row[k]!r}")
        row[k] = int(row[k])
    row["chips"], row["peak"] = chips_and_peak(row["topology"])
    row["chips"] *= row["slices"]
    return row


def select(rows: list[dict], names: str) -> list[dict]:
    """The rows named in a comma-separated list, in that order; every name must exist."""
    by_name = {r["name"]: r for r in rows}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    if unknown := [n for n in wanted if n not in by_name]:
        raise RowError(f"--rows: no row named {', '.join(unknown)}; the rows are "
                       f"{', '.join(by_name)}")
    return [by_name[n] for n in wanted]


def ours_argv(row: dict, extra: str = "") -> list[str]:
    """The trainer's flags for the row: the global batch is the per-chip batch x chips,
    sharded over every chip (fsdp)."""
    return [row["preset"], "--dry-run", "--compile-topology", row["topology"],
            "--mesh.fsdp", "-1", "--mesh.context", str(row["context"]),
            "--train.batch-size", str(row["batch"] * row["chips"] // row["context"]),
            "--train.seq-len", str(row["seq"]), "--model.n-layers", str(row["layers"]),
            "--model.no-scan-layers", "--compile-slices", str(row["slices"]),
            *shlex.split(row.get("ours", "")), *shlex.split(extra)]


def maxtext_args(row: dict, extra: str = "") -> list[str]:
    """MaxText's overrides for the row; its default mesh is fsdp over every chip too."""
    return [f"compile_topology={row['topology']}", f"model_name={row['maxtext']}",
            "override_model_config=True", f"base_num_decoder_layers={row['layers']}",
            f"per_device_batch_size={row['batch'] / row['context']:g}",
            f"ici_context_parallelism={row['context']}", f"max_target_length={row['seq']}",
            f"compile_topology_num_slices={row['slices']}",
            "scan_layers=false", *shlex.split(row.get("theirs", "")), *shlex.split(extra)]


def model_flops_per_step(row: dict, extra: str = "") -> float:
    """The trainer's own count (its flops_per_token) for the row's model x tokens per step."""
    import importlib
    mod = importlib.import_module(TRAINERS[row["trainer"]].removesuffix(".py"))
    cfg = mod.cli(ours_argv(row, extra))
    sequences = row["batch"] * row["chips"] / row["context"]
    return mod.flops_per_token(cfg.model, row["seq"]) * sequences * row["seq"]


def mfu(flops_per_step: float, step_s: float | None, chips: int, peak: float) -> float:
    """Model FLOPs utilisation the estimated step time implies; NaN without an estimate."""
    if not step_s or not peak:
        return math.nan
    return flops_per_step / step_s / (chips * peak)


def run_one(cmd: list[str], prefix: str, log_path: str, timeout: float, env=None) -> dict:
    """One compile in a subprocess: its report (the JSON after `prefix` on stdout), or
    {"error": the reason} when it fails; "wall_s" either way. The whole output goes to log_path."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
        text, rc = out.stdout + out.stderr, out.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(
            errors="replace")
        rc = f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    with open(log_path, "w") as f:
        f.write(" ".join(map(shlex.quote, cmd)) + "\n\n" + text)
    for line in reversed(text.splitlines()):
        if line.startswith(prefix):
            return json.loads(line[len(prefix):]) | {"wall_s": wall}
    return {"error": failure_reason(text, rc), "wall_s": wall}


def failure_reason(text: str, rc) -> str:
    """The line of a failed compile's output that says why: the compiler's out-of-memory or
    error line if there is one, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for key in ("RESOURCE_EXHAUSTED", "Ran out of memory", "error:", "Error:", "Error"):
        hits = [ln for ln in lines if key in ln]
        if hits:
            return hits[-1][:300]
    return (lines[-1][:300] if lines else "no output") + f" (exit {rc})"


def compile_ours(row: dict, extra: str, log_dir: str, timeout: float, dumps=()) -> dict:
    # Another process may hold libtpu's lock file; compiling needs no exclusive TPU.
    env = dict(ENV, ALLOW_MULTIPLE_LIBTPU_LOAD="1") | dump_env(dumps, log_dir, row, "ours")
    cmd = [sys.executable, os.path.abspath(__file__), "--one", TRAINERS[row["trainer"]],
           *ours_argv(row, extra)]
    return run_one(cmd, OURS_PREFIX, os.path.join(log_dir, f"{row['name']}.ours.log"),
                   timeout, env)


def maxtext_python() -> str:
    """The MaxText venv's python: bench/peers/maxtext.sh's install (once), shared with
    `make bench-parity`."""
    out = subprocess.run(["bash", os.path.join(PEER, "maxtext.sh"), "install"],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"error: installing MaxText failed:\n{out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def our_libtpu() -> str:
    """The libtpu.so our compiles load (this environment's libtpu package)."""
    import importlib.util
    spec = importlib.util.find_spec("libtpu")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: libtpu is not installed here: pip install -e '.[tpu]' "
                         "(make compile-tpu does)")
    return os.path.join(spec.submodule_search_locations[0], "libtpu.so")


def compile_maxtext(row: dict, extra: str, python: str, log_dir: str, timeout: float,
                    libtpu: str = "", dumps=()) -> dict:
    """MaxText's compile, with the libtpu.so `maxtext_env` says."""
    cmd = [python, os.path.join(PEER, "maxtext_compile.py"), *maxtext_args(row, extra)]
    return run_one(cmd, PEER_PREFIX, os.path.join(log_dir, f"{row['name']}.maxtext.log"),
                   timeout, maxtext_env(libtpu) | dump_env(dumps, log_dir, row, "maxtext"))


def dump_env(dumps, log_dir: str, row: dict, side: str) -> dict:
    """`dumps` "hlo" (--hlo): the compile writes its optimized module to LOG_DIR/ROW.SIDE.hlo;
    "schedule" (--schedule): XLA dumps the step's scheduled timeline in LOG_DIR/ROW.SIDE.dump."""
    path = os.path.join(log_dir, f"{row['name']}.{side}")
    env = {"COMPILE_TPU_HLO": path + ".hlo"} if "hlo" in dumps else {}
    if "schedule" in dumps:
        env["XLA_FLAGS"] = (ENV.get("XLA_FLAGS", "") + f" --xla_dump_to={path}.dump "
                            "--xla_dump_hlo_module_re=.*train_step.* "
                            "--xla_dump_latency_hiding_schedule=true").strip()
    return env


def schedule_notes(results: list[dict], log_dir: str) -> list[str]:
    """--schedule: each row's span on the scheduler's timeline (bench/schedule.py), per side."""
    notes = []
    for res in results:
        name, spans = res["row"]["name"], {}
        for side in ("ours", "maxtext"):
            folder = os.path.join(log_dir, f"{name}.{side}.dump")
            if (res.get(side) or {}).get("est_step_s") and os.path.isdir(folder):
                spans[side] = schedule.read(folder)["span_s"]
        if spans:
            pair = " / ".join(f"{spans[k]:.4f}" if k in spans else "-" for k in ("ours", "maxtext"))
            ratio = (f" ({spans['ours'] / spans['maxtext']:.3f})" if len(spans) == 2 else "")
            notes.append(f"- {name}: the latency-hiding scheduler's timeline, ours / MaxText: "
                         f"{pair} s{ratio} (bench/schedule.py {os.path.join(log_dir, name)}"
                         ".ours.dump ...)")
    return notes


def maxtext_env(libtpu: str) -> dict:
    """MaxText's environment: with `libtpu` (a libtpu.so) it compiles with that one
    (TPU_LIBRARY_PATH), one compiler for both sides; without, with its venv's own."""
    env = {k: v for k, v in ENV.items() if k != "TPU_LIBRARY_PATH"}
    return env | {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"} | ({"TPU_LIBRARY_PATH": libtpu}
                                                         if libtpu else {})


def one(trainer: str, argv: list[str]) -> None:
    """The subprocess: our trainer's dry run for the TPU, its report as one JSON line."""
    import importlib
    from importlib.metadata import version
    import jax
    # The trainers keep compiled steps on disk; a hit would time a load, not a compile.
    jax.config.update("jax_enable_compilation_cache", False)
    mod = importlib.import_module(trainer.removesuffix(".py"))
    if path := os.environ.get("COMPILE_TPU_HLO"):   # --hlo: the step, the largest module
        import jax.stages
        lower, size = jax.stages.Lowered.compile, [0]

        def compile(self, *a, **k):
            c = lower(self, *a, **k)
            if len(text := c.as_text()) > size[0]:
                size[0] = len(text)
                with open(path, "w") as f:
                    f.write(text)
            return c
        jax.stages.Lowered.compile = compile
    report = mod.main(mod.cli(argv))
    report["versions"] = {p: version(p) for p in ("jax", "jaxlib", "libtpu")}
    report["versions"]["libtpu_path"] = os.environ.get("TPU_LIBRARY_PATH", "")
    print(OURS_PREFIX + json.dumps(report), flush=True)


# ---- the table

GIB = 2**30


def _pair(a, b, fmt: str) -> str:
    f = lambda x: "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)
    return f"{f(a)} / {f(b)}"


def _ratio(a, b) -> str:
    ok = lambda x: isinstance(x, (int, float)) and not math.isnan(x) and x > 0
    return f"{a / b:.2f}" if ok(a) and ok(b) else "-"


def _secs(report: dict | None) -> str:
    """A compile's wall seconds (lowering and compiling); a failed one's, its process's."""
    if not report:
        return "-"
    if "compile_s" in report:
        return f"{report['compile_s']:.0f}"
    return f"{report['wall_s']:.0f} (failed)" if "wall_s" in report else "-"


def summarize(result: dict) -> dict:
    """One row's figures for the table from its reports: ours, theirs, the ratios."""
    row, flops = result["row"], result["model_flops_per_step"]
    out = {}
    for side in ("ours", "maxtext"):
        r = result.get(side) or {}
        out[side] = {
            "mem_gib": r["per_device_bytes"] / GIB if "per_device_bytes" in r else None,
            "xla_tflop": r["xla_flops"] / 1e12 if "xla_flops" in r else None,
            # XLA's count over the model's: remat's recomputed forward makes it ~1.3; below 1,
            # the cost analysis left work out (a loop body counted once).
            "xla_over_model": r["xla_flops"] * row["chips"] / flops if "xla_flops" in r
            else None,
            "est_s": r.get("est_step_s"),
            "mfu": mfu(flops, r.get("est_step_s"), row["chips"], row["peak"]),
            "error": r.get("error")}
    return out


def table(results: list[dict]) -> str:
    """Markdown: one line per row, each cell `ours / MaxText`, then the ratios ours/MaxText
    (step time and memory: below 1 is ours smaller), then any failure's reason."""
    head = ("| row | model (layers kept) | TPU (chips) | batch/chip x seq | GiB per chip | "
            "XLA TFLOP per chip | XLA/model FLOPs | est. s/step | MFU | compile s | "
            "step ours/MT | mem ours/MT |")
    lines = [head, "|" + " --- |" * head.count(" | ") + " --- |"]
    notes = []
    for res in results:
        row, s = res["row"], summarize(res)
        o, m = s["ours"], s["maxtext"]
        lines.append(
            f"| {row['name']} | {row['preset']} ({row['layers']}) | {row['topology']}"
            f"{' x %d' % row['slices'] if row['slices'] > 1 else ''} ({row['chips']}) | "
            f"{row['batch']}{'/%d' % row['context'] if row['context'] > 1 else ''}"
            f" x {row['seq']} | "
            f"{_pair(o['mem_gib'], m['mem_gib'], '{:.2f}')} | "
            f"{_pair(o['xla_tflop'], m['xla_tflop'], '{:.1f}')} | "
            f"{_pair(o['xla_over_model'], m['xla_over_model'], '{:.2f}')} | "
            f"{_pair(o['est_s'], m['est_s'], '{:.4f}')} | "
            f"{_pair(100 * o['mfu'], 100 * m['mfu'], '{:.1f}%')} | "
            f"{_secs(res.get('ours'))} / {_secs(res.get('maxtext'))} | "
            f"{_ratio(o['est_s'], m['est_s'])} | {_ratio(o['mem_gib'], m['mem_gib'])} |")
        for side, who in (("ours", "ours"), ("maxtext", "MaxText")):
            if s[side]["error"]:
                notes.append(f"- {row['name']}, {who}: {s[side]['error']}")
                continue
            r = res.get(side) or {}
            if n := r.get("xla_while_loops"):
                notes.append(f"- {row['name']}, {who}: {n} while loop(s) in the step, each "
                             "body counted once by the cost analysis (XLA/model FLOPs below 1 "
                             "would show work left out)")
            if r and "est_step_s" not in r:
                notes.append(f"- {row['name']}, {who}: XLA gave no step time (optimal_seconds "
                             "absent or negative)")
            elif res.get(side) is None and side == "maxtext":
                notes.append(f"- {row['name']}, MaxText: not run")
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="", help="comma-separated row names (default: all of "
                    "ROWS): " + ", ".join(shlex.split(r)[0].removeprefix("name=") for r in ROWS
                                         + CONTEXT_ROWS + PIPELINE_ROWS)
                    + "; or context, every ctx row; or pipeline, every pp row")
    ap.add_argument("--row", action="append", default=[], metavar="SPEC",
                    help="another row, as key=value words (see ROWS in this file)")
    ap.add_argument("--no-maxtext", action="store_true", help="ours only, no peer")
    ap.add_argument("--json", default="", metavar="PATH", help="write every report here")
    ap.add_argument("--ours-flags", default="", help="more flags for every one of our compiles")
    ap.add_argument("--maxtext-flags", default="", help="more MaxText key=value overrides")
    ap.add_argument("--log-dir", default=os.path.join(ROOT, "runs", "compile-tpu"),
                    help="each compile's whole output, ROW.ours.log / ROW.maxtext.log")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per compile")
    ap.add_argument("--hlo", action="store_true", help="also each compile's optimized HLO, "
                    "ROW.ours.hlo / ROW.maxtext.hlo in --log-dir, for bench/hlo_bytes.py")
    ap.add_argument("--schedule", action="store_true", help="also the step time on libtpu's "
                    "other model, its latency-hiding scheduler's timeline (bench/schedule.py), "
                    "from a dump of each compile in --log-dir")
    ap.add_argument("--maxtext-libtpu", choices=("ours", "own"), default="ours",
                    help="the compiler MaxText uses: ours (default: the libtpu our side "
                    "loads, so both sides have one compiler) or own (its venv's)")
    ap.add_argument("--fit", action="store_true", help="instead of the table: the largest "
                    "per-chip batch that fits the chip's HBM for each row, its layers scanned, "
                    "on each side (a few compiles per side; give a row its full layer count)")
    args = ap.parse_args(argv)
    dumps = [k for k in ("hlo", "schedule") if getattr(args, k)]
    if dumps:
        os.makedirs(args.log_dir, exist_ok=True)
    try:
        named = ROWS + CONTEXT_ROWS + PIPELINE_ROWS + FIT_ROWS
        groups = {"context": CONTEXT_ROWS, "pipeline": PIPELINE_ROWS, "fit": FIT_ROWS}
        rows = [parse_row(s) for s in named + args.row]
        if args.rows in groups:
            rows = [parse_row(s) for s in groups[args.rows]]
        elif args.rows:
            rows = select(rows, args.rows)
        elif args.row:   # only the rows given
            rows = rows[len(named):]
        elif args.fit:
            rows = [parse_row(s) for s in FIT_ROWS]
        else:
            rows = rows[:len(ROWS)]
        for r in rows if args.fit else []:  # --fit needs each chip's HBM: refused here, not later
            hbm_gib(r["topology"])
        flops = {} if args.fit else {r["name"]: model_flops_per_step(r, args.ours_flags)
                                     for r in rows}
    except RowError as e:
        sys.exit(f"error: {e}")
    python = None if args.no_maxtext else maxtext_python()
    libtpu = our_libtpu() if args.maxtext_libtpu == "ours" else ""
    if args.fit:
        print(fit_rows(rows, args, python, libtpu))
        return
    results = []
    for row in rows:
        res = {"row": row, "model_flops_per_step": flops[row["name"]]}
        print(f"{row['name']}: compiling ours ...", file=sys.stderr, flush=True)
        res["ours"] = compile_ours(row, args.ours_flags, args.log_dir, args.timeout, dumps)
        print(f"{row['name']}: ours {_brief(res['ours'])}", file=sys.stderr, flush=True)
        if python and row.get("maxtext"):
            print(f"{row['name']}: compiling MaxText ...", file=sys.stderr, flush=True)
            res["maxtext"] = compile_maxtext(row, args.maxtext_flags, python, args.log_dir,
                                             args.timeout, libtpu, dumps)
            print(f"{row['name']}: MaxText {_brief(res['maxtext'])}", file=sys.stderr,
                  flush=True)
        results.append(res)
        if args.json:   # after every row, so a long run interrupted keeps what it has
            with open(args.json, "w") as f:
                json.dump({"command": sys.argv, "results": results}, f, indent=1)
    print(table(results))
    if args.schedule:
        print("\n".join(schedule_notes(results, args.log_dir)))


# ---- --fit: the largest per-chip batch that fits a chip's HBM

# HBM a chip's program may use, GiB: v5p as libtpu 0.0.52 says when a step does not fit
# ("exceeds available HBM (95.73G)"; 95 GB on the data sheet), the others the data sheets'.
# A compile libtpu refuses as out of HBM counts as not fitting whatever the figure here.
HBM_GIB = {"v4": 32, "v5e": 16, "v5litepod": 16, "v5p": 95.73, "v6e": 32}


def hbm_gib(topology: str) -> float:
    gen = tpu_type(topology)[0]
    if gen not in HBM_GIB:
        raise RowError(f"topology {topology!r}: no HBM figure for {gen} (HBM_GIB)")
    return HBM_GIB[gen]


def largest_batch(mem_at, hbm: float, most: int = 256) -> tuple[int, dict]:
    """(the largest per-chip batch b whose compiled step fits `hbm` GiB, {b: GiB or None}).
    mem_at(b) compiles at batch b and gives its GiB per chip (None: the compile failed, taken
    as not fitting). Memory grows about linearly in b, a little more slowly at large b
    (buffers are reused): until a batch fails, the next try is one past the line through the
    two largest that fit; then the line between the largest that fits and the smallest that
    does not, or the middle of that gap. About five compiles."""
    seen = {}

    def fits(b):
        if b not in seen:
            seen[b] = mem_at(b)
        return seen[b] is not None and seen[b] <= hbm

    def on_line(b1, b2):   # the batch at which the line through b1 and b2 meets hbm
        m1, m2 = seen[b1], seen[b2]
        return b1 + math.floor((hbm - m1) * (b2 - b1) / (m2 - m1)) if m2 > m1 else b1
    if not fits(1):
        return 0, seen
    lo, hi, b = 1, most + 1, 2
    while hi - lo > 1:
        if fits(b):
            lo = b
        else:
            hi = b
        if hi > most:
            ok = sorted(k for k in seen if fits(k))
            guess = on_line(ok[-2], ok[-1]) + 1 if len(ok) > 1 else 2 * lo
        else:
            guess = on_line(lo, hi) if seen[hi] is not None else 0
        b = guess if lo < guess < hi else (lo + hi) // 2
    return lo, seen


def fit_rows(rows: list[dict], args, python: str | None, libtpu: str) -> str:
    """--fit: for each row (its model as given, layers scanned as the presets and MaxText's
    defaults run them) the largest per-chip batch that fits on each side, as a table."""
    lines = ["| row | model (layers) | TPU | seq | HBM GiB | ours: largest batch/chip (GiB) | "
             "MaxText: largest batch/chip (GiB) | ours/MT |", "|" + " --- |" * 8]
    done = {}
    for row in rows:
        hbm = hbm_gib(row["topology"])
        sides = {"ours": lambda b: compile_ours(
            dict(row, batch=b, name=f"{row['name']}-b{b}"),
            args.ours_flags + " --model.scan-layers", args.log_dir, args.timeout)}
        if python and row.get("maxtext"):
            sides["MaxText"] = lambda b: compile_maxtext(
                dict(row, batch=b, name=f"{row['name']}-b{b}"),
                args.maxtext_flags + " scan_layers=true", python, args.log_dir,
                args.timeout, libtpu)
        got = {}
        for side, compile_at in sides.items():
            def mem_at(b, compile_at=compile_at, side=side):
                r = compile_at(b)
                print(f"{row['name']}: {side} batch {b}: {_brief(r)}", file=sys.stderr,
                      flush=True)
                return r["per_device_bytes"] / GIB if "per_device_bytes" in r else None
            got[side] = largest_batch(mem_at, hbm)
        if args.json:   # {row: {side: {"largest": b, "gib": {batch: GiB or None}}}}, as it goes
            done[row["name"]] = {s: {"largest": b, "gib": seen} for s, (b, seen) in got.items()}
            with open(args.json, "w") as f:
                json.dump({"command": sys.argv, "hbm_gib": HBM_GIB, "fit": done}, f, indent=1)
        def cell(side):
            if side not in got:
                return "-"
            b, seen = got[side]
            return f"{b} ({seen[b]:.2f})" if b else "0 (batch 1 does not fit)"
        theirs = got["MaxText"][0] if "MaxText" in got else 0
        ratio = f"{got['ours'][0] / theirs:.2f}" if theirs else "-"
        lines.append(f"| {row['name']} | {row['preset']} ({row['layers']}) | {row['topology']} "
                     f"| {row['seq']} | {hbm:g} | {cell('ours')} | {cell('MaxText')} | {ratio} |")
    return "\n".join(lines)


def _brief(r: dict) -> str:
    if "error" in r:
        return f"failed after {r['wall_s']:.0f} s: {r['error']}"
    return (f"{r.get('per_device_bytes', 0) / GIB:.2f} GiB/chip, est "
            f"{r.get('est_step_s', math.nan):.4f} s/step, {r['wall_s']:.0f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        one(sys.argv[2], sys.argv[3:])
    else:
        main()
