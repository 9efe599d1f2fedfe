"""Our trainers and MaxText 0.2.5 on the same TPU chip and shapes: `make bench-tpu`.

From a fresh clone on one TPU host: installs each side's packages into a folder of its own
(`--deps`/ours, `--deps`/maxtext: the two want different optax and orbax builds), each with
`pip install --target`, appended to PYTHONPATH so that the host's JAX stays first; pip reads
the host's index, or `--index URL`, and/or `--wheels DIR` (a folder of wheels, for hosts with
no index: `--wheels` alone means --no-index). MaxText 0.2.5 declares Python >= 3.12; on 3.11
with JAX 0.10 it trains after two source edits made here (`patch_maxtext`), its packages
pinned by bench/peers/maxtext-py311-pins.txt, every one installed with --no-deps.

Then, for each row and repeat: MaxText's setting 0, our settings, MaxText's setting 1, ...:
the sides alternate, so drift on the host spreads over both. Each MaxText setting is a process
(its trainer takes one config); ours run one after another in one process (`--apart`: one
each), which saves opening the chip (~15 s) and importing for each. Both go through this
file's `--run` (the program via runpy, or our trainer's main on each set of flags, then the
chip's memory_stats: `peak_bytes_in_use`, a process's high-water mark, which nothing resets;
where a later setting of ours did not raise it, the table says "<= x": its own peak is at
most x), so both sides' peak HBM is read the same way. Each side's step times come from its
own log (bench/stats.py): MaxText's steps 0..S-1 (0 compiles), ours 1..S-1 after an untimed
warm-up step 0; both keep steps D..S-1 (--discard D) and take their median; tokens/s =
batch x seq / that median. MFU is given on two formulas, for both sides alike: MaxText's
(causal attention counted as half, as its TFLOP/s/device does since July 2025) and ours (the
trainers' flops_per_token: every key of every query, as XLA computes them); the peak is the
chip's data-sheet figure (common/train.py PEAK_TFLOPS). Per row, "best" sets each side's
fastest setting that ran against the other's. The table goes to stdout at the end and, as
markdown and JSON, to --out after every process (with each process's log): a run cut short
(or stopped by --budget) leaves what it measured.

    python bench/tpu.py                                   # install once, every row, both sides
    python bench/tpu.py --rows qwen3-0.6b-2k --sides ours --steps 12 --repeats 2
    python bench/tpu.py --print                           # the commands, nothing run
    python bench/tpu.py --wheels .whl-tpu --index file:///opt/pypi/simple   # the borrowed v5e
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ)  # the runs' environment: taken before anything here touches JAX
PINS = os.path.join(ROOT, "bench", "peers", "maxtext-py311-pins.txt")
# MaxText and what the index of a host may lack (omegaconf 2.4 bundles the antlr runtime;
# tokamax pins typeguard 2.13.3), every one --no-deps beside the pins.
MAXTEXT_WHEELS = ["maxtext==0.2.5", "aqtp==0.9.0", "array_record==0.8.6", "grain==0.2.18",
                  "tokamax==0.0.12", "omegaconf==2.4.0", "pathwaysutils==0.1.13", "qwix==0.1.8",
                  "drjax==0.2.1", "einshape==1.0", "typeguard==2.13.3", "portpicker==1.6.0"]
MAXTEXT_MAIN = "maxtext.trainers.pre_train.train"
PEAK_LINE = "bench-tpu peak_bytes_in_use"

# A row: our trainer, preset and model fields changed; batch x seq; MaxText's model as its
# base.yml overrides (no model_name: that would fetch a tokenizer from the network).
_QWEN3 = ("decoder_block=qwen3 head_dim=128 use_qk_norm=true normalization_layer_epsilon=1e-6 "
          "rope_max_timescale=1000000 mlp_activations=[silu,linear]")
ROWS = {
    "qwen3-0.6b-2k": dict(trainer="train_dense.py", preset="qwen3-0.6b", model={}, batch=8,
                          seq=2048, maxtext=f"{_QWEN3} base_emb_dim=1024 base_num_query_heads=16 "
                          "base_num_kv_heads=8 base_mlp_dim=3072 base_num_decoder_layers=28 "
                          "vocab_size=151936 logits_via_embedding=true"),
    "qwen3-0.6b-8k": dict(trainer="train_dense.py", preset="qwen3-0.6b", model={}, batch=2,
                          seq=8192, maxtext=f"{_QWEN3} base_emb_dim=1024 base_num_query_heads=16 "
                          "base_num_kv_heads=8 base_mlp_dim=3072 base_num_decoder_layers=28 "
                          "vocab_size=151936 logits_via_embedding=true"),
    # Qwen3-30B-A3B's block (d 2048, 32 heads of 128, 4 KV heads, experts 768 wide, top-8,
    # renormalised), 2 layers, 32 experts, vocab 32000, untied: 470,952,448 parameters.
    "moe-2k": dict(trainer="train_moe.py", preset="qwen3-30b-a3b", batch=8, seq=2048,
                   model=dict(n_layers=2, n_experts=32, vocab_size=32000),
                   maxtext=f"{_QWEN3.replace('qwen3 ', 'qwen3_moe ')} base_emb_dim=2048 "
                   "base_num_query_heads=32 base_num_kv_heads=4 base_mlp_dim=768 "
                   "base_moe_mlp_dim=768 num_experts=32 num_experts_per_tok=8 "
                   "norm_topk_prob=true base_num_decoder_layers=2 vocab_size=32000"),
    "llama3.2-1b-2k": dict(trainer="train_dense.py", preset="llama3.2-1b", model={}, batch=4,
                           seq=2048, maxtext="decoder_block=llama2 base_emb_dim=2048 "
                           "base_num_query_heads=32 base_num_kv_heads=8 head_dim=64 "
                           "base_mlp_dim=8192 base_num_decoder_layers=16 vocab_size=128256 "
                           "logits_via_embedding=true normalization_layer_epsilon=1e-5 "
                           "rope_max_timescale=500000 mlp_activations=[silu,linear]"),
}
# Each side's settings per row: its default (""), the one thought best, then more candidates
# (`--settings all` runs them too; "best" in the table is the fastest that ran). Words:
# batch=N (per chip), remat=POLICY (ours: --model.remat, MaxText's remat_policy), flags='...'
# (more flags for that side). Ours: `auto` keeps the most that fits; bfloat16 weights and Adam
# moments (--train.weight-dtype, --train.mu-dtype, --train.nu-dtype: MaxText's weight_dtype,
# whose moments follow it) or Adam's state in host memory fit the 1B. After a measurement on
# the chip, the fastest that fit goes second.
_BF16_OURS = ("flags='--train.weight-dtype bfloat16 --train.mu-dtype bfloat16 "
              "--train.nu-dtype bfloat16'")
SETTINGS = {
    "qwen3-0.6b-2k": dict(ours=["", "remat=auto", "remat=proj", "remat=dots batch=4"],
                          maxtext=["", "remat=save_qkv_proj batch=4", "remat=minimal batch=4"]),
    "qwen3-0.6b-8k": dict(ours=["", "remat=auto", "remat=attn", "remat=dots batch=1"],
                          maxtext=["", "remat=save_qkv_proj batch=1", "remat=minimal batch=1"]),
    "moe-2k": dict(ours=["", "remat=auto", "remat=proj", "remat=dots"],
                   maxtext=["", "remat=minimal", "remat=save_qkv_proj"]),
    # f32 weights and Adam moments alone are 19.8 GB: neither default fits 16 GiB.
    "llama3.2-1b-2k": dict(ours=["", f"remat=auto {_BF16_OURS}",
                                 "remat=auto flags='--train.offload-opt-state'"],
                           maxtext=["", "flags='weight_dtype=bfloat16'",
                                    "flags='optimizer_memory_host_offload=true'"]),
}
SIDES = ("ours", "maxtext")


# ---- installing ------------------------------------------------------------------------------
def pip(target: str, names: list[str], *, index: str, wheels: str, no_deps: bool) -> list[str]:
    """`pip install --target` of names (or -r FILE) from the host's index, `index`, `wheels`."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--upgrade", "--target", target,
           "--only-binary=:all:"]
    if index:   # an index named here: the host's pip configuration is not read
        cmd += ["--isolated", "--index-url", index]
    elif wheels:
        cmd += ["--no-index"]
    if wheels:
        cmd += ["--find-links", os.path.abspath(wheels)]
    if no_deps:
        cmd += ["--no-deps", "--ignore-requires-python"]
    return cmd + names


def our_packages() -> list[str]:
    """pyproject.toml's dependencies but the host's JAX and numpy (pytest for make test-chip)."""
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    have = lambda m: subprocess.run([sys.executable, "-c", f"import {m}"], env=ENV,
                                    capture_output=True).returncode == 0
    names = [d for d in deps if re.match(r"[A-Za-z0-9_.-]+", d).group() not in ("jax", "numpy")]
    return names + ([] if have("pytest") else ["pytest"]) + ([] if have("jax") else ["jax[tpu]"])


def install_commands(a) -> list[tuple[str, list[str]]]:
    """(marker file, pip command) per side asked for; the marker names what was installed."""
    out = []
    if "ours" in a.sides:
        out.append(("ours", pip(os.path.join(a.deps, "ours"), our_packages(), index=a.index,
                                wheels=a.wheels, no_deps=False)))
    if "maxtext" in a.sides:
        out.append(("maxtext", pip(os.path.join(a.deps, "maxtext"), ["-r", PINS, *MAXTEXT_WHEELS],
                                   index=a.index, wheels=a.wheels, no_deps=True)))
    return out


def patch_maxtext(site: str) -> list[str]:
    """MaxText 0.2.5 on Python 3.11 and JAX 0.10 (idempotent): a missing fusion hint made a
    no-op, Python 3.12's `type X = ...` statements made assignments. Returns what it changed."""
    changed = []
    path = os.path.join(site, "maxtext", "kernels", "attention", "jax_flash_attention.py")
    hint = "from jax.experimental.xla_metadata import must_fuse_call\n"
    src = open(path).read()
    if src.startswith(hint) or "\n" + hint in src:
        src = src.replace(hint, "try:\n  " + hint + "except ImportError:  # JAX 0.10: a fusion "
                          "hint only (bench/tpu.py)\n  must_fuse_call = lambda name: lambda f: f\n",
                          1)
        open(path, "w").write(src)
        changed.append(path)
    for name in ("api.py", "common.py"):
        path = os.path.join(site, "maxtext", "kernels", "mhc", name)
        src = open(path).read()
        new = re.sub(r"(?m)^type ([A-Za-z_]\w*) = ", r"\1 = ", src)
        if new != src:
            open(path, "w").write(new)
            changed.append(path)
    return changed


def download_commands(a) -> list[list[str]]:
    """`pip download` of every wheel both sides install, for Python --python-version on x86-64
    Linux: MaxText's and its pins without their dependencies, ours with theirs (two resolves:
    tokamax pins typeguard 2.13.3, tyro needs 4). --wheels DIR on the TPU host then needs no
    index (the host's JAX aside)."""
    base = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d",
            a.download, "--python-version", a.python_version, "--implementation", "cp",
            *(x for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",  # jaxlib's
                          "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
              for x in ("--platform", p))]
    return [base + ["--no-deps", "--ignore-requires-python", "-r", PINS, *MAXTEXT_WHEELS],
            base + [n for n in our_packages() if n != "jax[tpu]"]]


def install(a) -> None:
    for side, cmd in install_commands(a):
        marker = os.path.join(a.deps, side, ".installed")
        want = " ".join(cmd[cmd.index("--only-binary=:all:"):])
        if os.path.exists(marker) and open(marker).read() == want:
            continue
        print(f"bench-tpu: installing {side}'s packages into {os.path.join(a.deps, side)}",
              flush=True)
        env = dict(ENV, PIP_CONFIG_FILE=os.devnull) if a.index else ENV
        subprocess.run(cmd, check=True, env=env)
        if side == "maxtext":
            patch_maxtext(os.path.join(a.deps, "maxtext"))
        open(marker, "w").write(want)


# ---- running ---------------------------------------------------------------------------------
def words(setting: str) -> dict:
    out = dict(w.split("=", 1) for w in shlex.split(setting))
    if bad := set(out) - {"batch", "remat", "flags"}:
        raise ValueError(f"setting {setting!r}: unknown word(s) {sorted(bad)}: batch, remat, "
                         "flags")
    return out


def batch_of(row: str, setting: str) -> int:
    return int(words(setting).get("batch", ROWS[row]["batch"]))


def our_args(a, row: str, setting: str, run_dir: str) -> list[str]:
    r, w = ROWS[row], words(setting)
    model = [x for k, v in r["model"].items()
             for x in (f"--model.{k.replace('_', '-')}", str(v))]
    args = [r["preset"], "--bench", str(a.steps - 1), "--train.batch-size",
            str(batch_of(row, setting)), "--train.seq-len", str(r["seq"]), *model,
            "--run-dir", run_dir] + (["--no-bench-twin"] if r["trainer"] == "train_moe.py" else [])
    return args + (["--model.remat", w["remat"]] if "remat" in w else []) + shlex.split(
        w.get("flags", ""))


def maxtext_args(a, row: str, setting: str, tag: str) -> list[str]:
    r, w = ROWS[row], words(setting)
    args = [os.path.join(a.deps, "maxtext", "maxtext", "configs", "base.yml"), f"run_name={tag}",
            f"base_output_directory={os.path.join(a.out, 'maxtext')}", "dataset_type=synthetic",
            "enable_checkpointing=false", "skip_jax_distributed_system=true", f"steps={a.steps}",
            "attention=flash", f"per_device_batch_size={batch_of(row, setting)}",
            f"max_target_length={r['seq']}", *r["maxtext"].split()]
    return args + ([f"remat_policy={w['remat']}"] if "remat" in w else []) + shlex.split(
        w.get("flags", ""))


def command(a, row: str, side: str, todo: list[tuple[int, str]], tag: str
            ) -> tuple[list[str], dict]:
    """The command of one process and its environment: MaxText's one setting, or our
    settings `todo` one after the other (separated by ---)."""
    wrap = [sys.executable, os.path.abspath(__file__), "--run"]
    if side == "ours":
        cmd = [*wrap, os.path.join(ROOT, ROWS[row]["trainer"])]
        for n, (i, setting) in enumerate(todo):
            cmd += ["---"] * (n > 0) + our_args(a, row, setting, os.path.join(
                a.out, "runs", f"{tag}.{i}"))
    else:
        (i, setting), = todo
        cmd = [*wrap, "-m", MAXTEXT_MAIN, *maxtext_args(a, row, setting, f"{tag}.{i}")]
    path = [p for p in (ENV.get("PYTHONPATH", ""), ROOT if side == "ours" else "",
                        os.path.join(a.deps, side)) if p]
    env = dict(ENV, PYTHONPATH=os.pathsep.join(path))
    if side == "maxtext":
        env["DECOUPLE_GCLOUD"] = "TRUE"
    return cmd, env


def plan(a) -> list[tuple[int, str, str, list[tuple[int, str]]]]:
    """(repeat, row, side, [(setting index, setting)]) a process, in the order they run. Per
    row: MaxText's setting 0, our settings (one process: --apart, one each), MaxText's 1, ...:
    the sides alternate, so drift on the host spreads over both."""
    out = []
    for rep in range(a.repeats):
        for row in a.rows:
            todo = {s: [(i, x) for i, x in enumerate(SETTINGS[row][s])
                        if a.settings == "all" or i <= 1] for s in a.sides}
            ours = [[x] for x in todo.get("ours", [])] if a.apart else [todo.get("ours", [])]
            theirs = [[x] for x in todo.get("maxtext", [])]
            for n in range(max(len(ours), len(theirs))):
                out += [(rep, row, "maxtext", t) for t in theirs[n:n + 1]]
                out += [(rep, row, "ours", o) for o in ours[n:n + 1] if o]
    return out


def run_one(cmd, env, log_path: str, timeout: int) -> int:
    """The process in a session of its own, killed whole after `timeout` seconds, or when this
    one is ended (SIGTERM, ^C): none may go on holding the chip."""
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            return p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.write(f"\nbench-tpu: killed after {timeout} s\n")
            return -9
        finally:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()


OOM = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|ran out of memory")


def read_run(log: str, side: str, steps: int, discard: int) -> dict:
    """One run's figures from its log: status, median step seconds of steps discard..steps-1,
    peak HBM, device kind; MaxText's own FLOPs per step and parameter count where printed."""
    from bench import stats
    out = {}
    if m := re.search(PEAK_LINE + r": (-?\d+) device: (.*)", log):
        out["device"] = m.group(2).strip()
        if int(m.group(1)) >= 0:  # -1: the backend keeps no memory_stats (the CPU)
            out["peak_bytes"] = int(m.group(1))
    if side == "maxtext" and (m := re.search(r"number parameters: ([0-9.]+) billion", log)):
        out["maxtext_params_b"] = float(m.group(1))
    try:
        times = (stats.ours_step_seconds if side == "ours" else stats.maxtext_step_seconds)(log)
        out |= {"status": "ok", "step_s": stats.median_over(times, discard, steps - 1)}
    except ValueError as e:   # no steps: the log's last error line says why
        why = re.findall(r"(?m)^\S*(?:Error|error)\b:? ?(.*)$", log)
        out["status"] = ("out of memory" if OOM.search(log) else "killed (timeout)"
                         if "bench-tpu: killed" in log else f"failed: {(why or [e])[-1]}"[:120])
        return out
    if side == "maxtext":  # its TFLOP/s/device x seconds: the FLOPs it counts a step
        tf = {int(s): float(f) * float(t) for s, t, f in re.findall(
            r"completed step: (\d+), seconds: ([0-9.]+), TFLOP/s/device: ([0-9.]+)", log)}
        out["maxtext_tflop_per_step"] = stats.median_over(tf, discard, steps - 1)
    return out


def read_process(log: str, side: str, settings: list[tuple[int, str]], steps: int,
                 discard: int) -> list[dict]:
    """read_run of each setting a process ran: our settings' parts of its log (each ends with
    the chip's peak so far), or MaxText's whole log."""
    parts = re.split(r"(?m)^bench-tpu setting \d+: .*$", log)[1:] if side == "ours" else [log]
    parts += [log[-2000:]] * (len(settings) - len(parts))  # killed before their turn
    out, prev = [], None
    for (i, setting), part in zip(settings, parts):
        r = {"side": side, "i": i, "setting": setting, **read_run(part, side, steps, discard)}
        # A high-water mark that did not rise: this setting's own peak is at most that.
        r["peak_at_most"] = prev is not None and r.get("peak_bytes") == prev
        prev = r.get("peak_bytes")
        out.append(r)
    return out


# ---- the table -------------------------------------------------------------------------------
def model_of(row: str):
    """(our ModelConfig of the row, the trainer module): for parameter counts and FLOPs."""
    import dataclasses
    import importlib
    mod = importlib.import_module(ROWS[row]["trainer"][:-3])
    m = mod.PRESETS[ROWS[row]["preset"]][1].model
    return dataclasses.replace(m, **ROWS[row]["model"]), mod


def flops_per_token(row: str) -> dict:
    """FLOPs per trained token on both formulas: ours (every key) and MaxText's (causal half).
    No row has windows, so attention is linear in T and f(T) - f(0) is all of it."""
    m, mod = model_of(row)
    assert not getattr(m, "sliding_window", 0), row
    T = ROWS[row]["seq"]
    full, none = mod.flops_per_token(m, T), mod.flops_per_token(m, 0)
    return {"full": full, "causal": (full + none) / 2, "params": mod.count_params(m)}


def peak_flops(device: str) -> float:
    from common.train import PEAK_TFLOPS
    return next((tf * 1e12 for k, tf in PEAK_TFLOPS.items() if k.lower() in device.lower()), 0.0)


COLUMNS = ("row", "side", "setting", "tok/s", "spread", "ms/step", "peak HBM GiB",
           "MFU causal/2", "MFU full", "ours/MaxText")


def summarize(runs: list[dict], rows: list[str]) -> tuple[list[dict], list[str]]:
    """Table lines (medians over repeats) and notes from the runs' records."""
    lines, notes = [], []
    for row in rows:
        f = flops_per_token(row)
        best = {}
        for i in range(max(len(v) for v in SETTINGS[row].values())):
            for side in SIDES:
                if i >= len(SETTINGS[row][side]):
                    continue
                setting = SETTINGS[row][side][i]
                rs = [r for r in runs if (r["row"], r["side"], r["i"]) == (row, side, i)]
                if not rs:
                    continue
                ok = [r for r in rs if r["status"] == "ok"]
                tok = [r["tokens"] / r["step_s"] for r in ok]
                line = {"row": row, "side": side, "setting": setting or "default", "i": i,
                        "status": "ok" if ok else rs[0]["status"], "runs": len(rs)}
                peaks = [r["peak_bytes"] for r in rs if "peak_bytes" in r]
                line["peak_gib"] = max(peaks) / 2**30 if peaks else None
                line["peak_at_most"] = any(r.get("peak_at_most") for r in rs)
                if ok:
                    t, peak = statistics.median(tok), peak_flops(ok[0].get("device", ""))
                    line |= {"tok_s": t, "spread": (max(tok) - min(tok)) / t,
                             "ms_step": 1e3 * statistics.median(r["step_s"] for r in ok),
                             "mfu_causal": f["causal"] * t / peak if peak else None,
                             "mfu_full": f["full"] * t / peak if peak else None}
                    if best.get(side) is None or t > best[side]["tok_s"]:
                        best[side] = line
                lines.append(line)
        d = {s: next((x for x in lines if (x["row"], x["side"], x.get("i")) == (row, s, 0)), None)
             for s in SIDES}
        if d["ours"] and d["maxtext"] and "tok_s" in d["ours"] and "tok_s" in d["maxtext"]:
            d["ours"]["ratio"] = d["ours"]["tok_s"] / d["maxtext"]["tok_s"]
        if len(best) == 2:
            lines.append({"row": row, "side": "best", "status": "ok", "setting": f"ours: "
                          f"{best['ours']['setting']} / MaxText: {best['maxtext']['setting']}",
                          "tok_s": best["ours"]["tok_s"], "ratio": best["ours"]["tok_s"]
                          / best["maxtext"]["tok_s"]})
        mt = [r for r in runs if r["row"] == row and "maxtext_params_b" in r]
        if mt:
            said, ours = mt[0]["maxtext_params_b"], f["params"]
            notes.append(f"{row}: parameters ours {ours:,}, MaxText {said:.3f} billion"
                         + ("" if f"{ours / 1e9:.3f}" == f"{said:.3f}" else "  MISMATCH"))
        mf = [r["maxtext_tflop_per_step"] / r["tokens"] for r in runs if r["row"] == row and
              "maxtext_tflop_per_step" in r]
        if mf:
            notes.append(f"{row}: MaxText counts {1e12 * statistics.median(mf) / 1e9:.3f} GFLOP a "
                         f"token; the causal/2 formula here {f['causal'] / 1e9:.3f}, ours "
                         f"{f['full'] / 1e9:.3f}")
    return lines, notes


def markdown(lines: list[dict]) -> str:
    """The table; a peak HBM "<= x": a setting after another in one process whose high-water
    mark it did not raise."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    peak = lambda x: ("<= " if x.get("peak_at_most") else "") + fmt(x.get("peak_gib"), ".2f")
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for x in lines:
        if x["status"] != "ok":
            cells = [x["row"], x["side"], x["setting"], x["status"], "-", "-",
                     peak(x), "-", "-", "-"]
        else:
            pct = lambda k: fmt(x.get(k) and 100 * x[k], ".1f") + ("%" if x.get(k) else "")
            cells = [x["row"], x["side"], x["setting"], f"{x['tok_s']:,.0f}",
                     "-" if x.get("runs", 1) < 2 else f"{100 * x['spread']:.1f}%",
                     fmt(x.get("ms_step"), ".1f"), peak(x),
                     pct("mfu_causal"), pct("mfu_full"), fmt(x.get("ratio"), ".2f")]
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(out)


def parse_table(md: str) -> list[dict]:
    """The markdown table back into one dict a line, numbers as numbers (None for '-')."""
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in md.splitlines()
            if ln.startswith("| ") and not ln.startswith(("| row |", "| --- |"))]
    num = lambda c: None if c == "-" else float(c.rstrip("%").replace(",", "").lstrip("<= "))
    out = []
    for cells in rows:
        x = dict(zip(COLUMNS, cells), status="ok")
        if not x["tok/s"][:1].isdigit():  # a run that did not finish: its status stands there
            x["status"], x["tok/s"] = x["tok/s"], "-"
        out.append(x | {k: num(x[k]) for k in COLUMNS[3:]})
    return out


# ---- the wrapper every run goes through --------------------------------------------------------
def peak_line(note: str = "") -> None:
    import jax
    d = jax.devices()[0]
    stats = d.memory_stats() or {}   # None on the CPU
    print(f"{PEAK_LINE}: {stats.get('peak_bytes_in_use', -1)} device: {d.device_kind}{note}",
          flush=True)


def run_wrapped(argv: list[str]) -> None:
    """argv: -m MODULE ARGS... (run as __main__), or TRAINER ARGS [--- ARGS ...]: the trainer's
    main on each set of flags in turn. After each, whatever way it ended, the chip's peak bytes
    in use so far, as JAX's memory_stats gives them: a process's high-water mark."""
    import runpy
    if argv[0] == "-m":
        try:
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        finally:
            if "jax" in sys.modules:
                peak_line()
        return
    import gc
    import importlib
    import traceback
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    mod, groups, failed = importlib.import_module(os.path.basename(argv[0])[:-3]), [[]], 0
    for x in argv[1:]:
        groups[-1:] = [groups[-1], []] if x == "---" else [groups[-1] + [x]]
    for i, args in enumerate(groups):
        print(f"bench-tpu setting {i}: {shlex.join(args)}", flush=True)
        try:
            mod.main(mod.cli(args))
        except BaseException:  # out of memory, bad flags: the next setting still runs
            traceback.print_exc()
            failed += 1
        gc.collect()   # the failed step's buffers, held by its traceback, let go
        peak_line()
    sys.exit(1 if failed else 0)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        return run_wrapped(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated: {', '.join(ROWS)}")
    ap.add_argument("--sides", default=",".join(SIDES), help="ours, maxtext or both")
    ap.add_argument("--settings", choices=("default-best", "all"), default="default-best",
                    help="each side's first two settings per row, or all of SETTINGS' candidates")
    ap.add_argument("--steps", type=int, default=12, help="steps a run (MaxText's 0 compiles)")
    ap.add_argument("--discard", type=int, default=3, help="steps 0..D-1 left out of the median")
    ap.add_argument("--repeats", type=int, default=1, help="the whole alternation, N times")
    ap.add_argument("--timeout", type=int, default=300, help="seconds a setting may take")
    ap.add_argument("--budget", type=int, default=0,
                    help="seconds: start no process after this (0: no limit); the table so far "
                    "is in --out after every process")
    ap.add_argument("--apart", action="store_true",
                    help="our settings each in a process of its own (exact peaks; + ~15 s each)")
    ap.add_argument("--deps", default=os.path.join(ROOT, ".bench-tpu"), help="install folder")
    ap.add_argument("--wheels", default="", help="a folder of wheels (alone: no index is read)")
    ap.add_argument("--index", default="", help="a pip index URL to read instead of the host's")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-tpu"),
                    help="logs, bench-tpu.md and bench-tpu.json")
    ap.add_argument("--print", action="store_true", help="print the commands; run nothing")
    ap.add_argument("--install-only", action="store_true", help="install, then stop")
    ap.add_argument("--download", default="", metavar="DIR",
                    help="on a host with an index: every wheel into DIR, for --wheels DIR on one "
                    "without; then stop")
    ap.add_argument("--python-version", default="3.11", help="the TPU host's, for --download")
    a = ap.parse_args()
    a.rows, a.sides = a.rows.split(","), a.sides.split(",")
    for name, got, known in (("--rows", a.rows, ROWS), ("--sides", a.sides, SIDES)):
        if bad := [x for x in got if x not in known]:
            ap.error(f"{name} {','.join(bad)}: choose from {', '.join(known)}")
    if not 0 < a.discard < a.steps - 1:
        ap.error(f"--discard {a.discard} must leave steps to time of --steps {a.steps}")
    a.deps, a.out = os.path.abspath(a.deps), os.path.abspath(a.out)
    todo = plan(a)
    if a.download:
        for cmd in download_commands(a):
            print(shlex.join(cmd), flush=True) if a.print else subprocess.run(cmd, check=True)
        return
    if a.print:
        for side, cmd in install_commands(a):
            print(f"# install {side}" + (" (then patch_maxtext)" if side == "maxtext" else ""))
            print(("PIP_CONFIG_FILE=/dev/null " if a.index else "") + shlex.join(cmd))
        for rep, row, side, settings in todo:
            cmd, env = command(a, row, side, settings, f"{row}.{side}.r{rep}")
            extra = "".join(f"{k}={shlex.quote(env[k])} " for k in ("PYTHONPATH", "DECOUPLE_GCLOUD")
                            if k in env)
            print(extra + shlex.join(cmd))
        return
    install(a)
    if a.install_only:
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # `timeout`: the run's child too
    # This process only reads configs and counts FLOPs: on the CPU, so the chip stays free.
    os.environ["JAX_PLATFORMS"] = "cpu"
    sys.path[1:1] = [ROOT]
    sys.path.append(os.path.join(a.deps, "ours"))
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    runs, t0 = [], time.perf_counter()
    for n, (rep, row, side, settings) in enumerate(todo):
        if a.budget and time.perf_counter() - t0 > a.budget:
            print(f"bench-tpu: --budget {a.budget} s spent: {len(todo) - n} process(es) not "
                  "started", flush=True)
            break
        tag = f"{row}.{side}.r{rep}"
        cmd, env = command(a, row, side, settings, tag)
        log_path = os.path.join(a.out, "logs", f"{tag}.{settings[0][0]}.log")
        t1 = time.perf_counter()
        run_one(cmd, env, log_path, a.timeout * len(settings))
        for r in read_process(open(log_path, errors="replace").read(), side, settings,
                              a.steps, a.discard):
            r |= {"row": row, "repeat": rep, "process_s": time.perf_counter() - t1,
                  "tokens": batch_of(row, r["setting"]) * ROWS[row]["seq"]}
            runs.append(r)
            got = f"{r['tokens'] / r['step_s']:,.0f} tok/s" if r["status"] == "ok" else r["status"]
            print(f"[{n + 1}/{len(todo)} {time.perf_counter() - t0:.0f} s] {tag}.{r['i']} "
                  f"({r['setting'] or 'default'}): {got}", flush=True)
        write(a, runs, time.perf_counter() - t0, final=n + 1 == len(todo))


def write(a, runs: list[dict], seconds: float, final: bool) -> None:
    """The table of the runs so far to --out (markdown and JSON); at the end, to stdout too."""
    lines, notes = summarize(runs, a.rows)
    md = (markdown(lines) + "\n\n" + "\n".join(f"- {x}" for x in notes) +
          f"\n- steps {a.discard}-{a.steps - 1} of {a.steps} a run, median; {a.repeats} "
          f"repeat(s); MFU on the chip's data-sheet peak; {seconds:.0f} s in all"
          + ("" if final else " (so far)") + "\n")
    if final:
        print(md)
    with open(os.path.join(a.out, "bench-tpu.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "bench-tpu.json"), "w") as f:
        json.dump({"runs": runs, "table": lines, "notes": notes, "steps": a.steps,
                   "discard": a.discard, "seconds": seconds}, f, indent=1)


if __name__ == "__main__":
    main()
