"""Figures of a run, drawn from its metrics.jsonl:

    python -m common.plot runs/tiny                    # -> runs/tiny/plots/*.png
    python -m common.plot runs/a runs/b --log-y        # both on every figure -> runs/compare-a-b/
    make plot RUN="runs/a runs/b" ARGS=--log-y

Which figures depends on what the records hold: loss.png (train and eval loss), lr.png
(learning rate and gradient norm), throughput.png (tokens/s and MFU, or rollout tokens/s);
for train_moe.py expert_load.png; for train_grpo.py reward.png, kl.png, lengths.png and
warm_start.png. matplotlib is an optional extra (`pip install -e '.[viz]'`).

A resumed run logs again the steps after its checkpoint; as TensorBoard does, a record whose
step is not past the previous one starts over from there, so each step shows its last value.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
from dataclasses import dataclass, field

from etils import epath  # local folders and gs:// buckets alike (gs:// needs the gcs extra)

from common.observe import is_remote

# Every figure has this size, so figures of different runs line up side by side.
FIGSIZE_IN, DPI = (11, 7), 100
PIXELS = (FIGSIZE_IN[0] * DPI, FIGSIZE_IN[1] * DPI)


@dataclass
class Run:
    name: str
    steps: list[dict]                          # one merged record per step, in step order
    warm: list[dict] = field(default_factory=list)  # train_grpo.py's warm-start records
    config: dict = field(default_factory=dict)

    def has(self, key: str) -> bool:
        return any(key in r for r in self.steps)

    def series(self, key: str, scale: float = 1.0, records=None):
        pts = [(r.get("step", r.get("warm_step")), r[key]) for r in
               (self.steps if records is None else records) if key in r]
        return [p[0] for p in pts], [scale * _num(p[1]) for p in pts]


def _num(v) -> float:
    return float("nan") if v is None else float(v)


def _norm(d: str) -> str:
    return d.rstrip("/") if is_remote(d) else os.path.normpath(d)  # normpath eats gs://'s "/"


def read_run(run_dir: str, name: str | None = None) -> Run:
    path = epath.Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl here; is it a run directory "
                                f"(--run-dir of a trainer) that has logged a step?")
    by_step: dict[int, dict] = {}
    warm, last = [], None
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            # A run killed mid-write leaves half a line; everything before it still counts.
            print(f"plot: {path}, line {line_no}: not JSON, skipped", file=sys.stderr)
            continue
        if "step" not in rec:
            warm += [rec] if "warm_step" in rec else []
            continue
        step = rec["step"]
        if last is not None and step < last:  # a resume: what follows replaces the rest
            for s in [s for s in by_step if s >= step]:
                del by_step[s]
        by_step.setdefault(step, {}).update(rec)
        last = step
    config_file = epath.Path(run_dir) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return Run(name or os.path.basename(_norm(run_dir)),
               [by_step[s] for s in sorted(by_step)], warm, config)


# ----------------------------------------------------------------------------------------------
# Figures: each takes the runs and returns a matplotlib Figure, or None when no run has its data


def _figure(title: str, rows: int, cols: int = 1):
    from matplotlib.figure import Figure
    fig = Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, cols, sharex=True, squeeze=False).ravel()
    fig.suptitle(title)
    from matplotlib.ticker import MaxNLocator
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    for ax in axes[-cols:]:
        ax.set_xlabel("step")
    return fig, axes


def _color(i: int) -> str:
    return f"C{i % 10}"


def _lines(ax, runs, keys, *, ylabel, scale=1.0, styles=("-", "--", ":", "-.")):
    """One line per (run, key): colour says the run, line style the key."""
    drawn = 0
    for i, run in enumerate(runs):
        for (key, label), style in zip(keys, styles):
            x, y = run.series(key, scale)
            if not x:
                continue
            marker = "o" if len(x) < 30 else None
            parts = ([run.name] if len(runs) > 1 else []) + ([label] if len(keys) > 1 else [])
            ax.plot(x, y, style, color=_color(i), marker=marker, markersize=3,
                    label=", ".join(parts) or None)
            drawn += 1
    ax.set_ylabel(ylabel)
    if drawn > 1:
        ax.legend(fontsize="small")
    return drawn


def loss_figure(runs, log_y=False):
    if not any(r.has("loss") or r.has("eval_loss") for r in runs):
        return None
    fig, (ax,) = _figure("loss", 1)
    _lines(ax, runs, [("loss", "train"), ("eval_loss", "eval")], ylabel="cross-entropy (nats)")
    if log_y:
        ax.set_yscale("log")
    return fig


def lr_figure(runs, log_y=False):
    lr_key = "lr" if any(r.has("lr") for r in runs) else "learning_rate"
    if not any(r.has(lr_key) or r.has("grad_norm") for r in runs):
        return None
    fig, (a, b) = _figure("optimiser", 2)
    _lines(a, runs, [(lr_key, "lr")], ylabel="learning rate")
    _lines(b, runs, [("grad_norm", "grad norm")], ylabel="gradient norm (before clipping)")
    if log_y:
        b.set_yscale("log")
    return fig


def throughput_figure(runs, log_y=False):
    if any(r.has("tokens_per_s") for r in runs):
        fig, (a, b) = _figure("throughput", 2)
        _lines(a, runs, [("tokens_per_s", "tok/s")], ylabel="tokens / s")
        _lines(b, runs, [("mfu", "MFU")], ylabel="MFU (%)", scale=100)
    elif any(r.has("rollout_tokens_per_s") for r in runs):
        fig, (a, b) = _figure("throughput", 2)
        _lines(a, runs, [("rollout_tokens_per_s", "rollout tok/s")],
               ylabel="rollout tokens / s")
        _lines(b, runs, [("ms_per_step", "ms/step")], ylabel="ms / step")
    else:
        return None
    for ax in (a, b):  # from zero: a 5% wobble should look like one
        ax.set_ylim(bottom=0)
    return fig


def _per_layer(run, key, reduce):
    x, y = [], []
    for r in run.steps:
        if isinstance(r.get(key), list) and r[key]:
            x.append(r["step"])
            y.append(reduce(r[key]))
    return x, y


def expert_load_figure(runs, log_y=False):
    """The most and least loaded expert's share of the routing assignments: with one run and
    few layers, one line per layer; otherwise the extremes over layers per run."""
    if not any(r.has("load_max") for r in runs):
        return None
    fig, axes = _figure("expert load (share of routing assignments per layer)", 2, 2)
    per_layer = len(runs) == 1 and max(len(r.get("load_max", [])) for r in runs[0].steps) <= 8
    for ax, key, title, extreme in ((axes[0], "load_max", "most-loaded expert", max),
                                    (axes[1], "load_min", "least-loaded expert", min)):
        for i, run in enumerate(runs):
            if per_layer:
                n = max(len(r.get(key, [])) for r in run.steps)
                for layer in range(n):
                    x, y = _per_layer(run, key, lambda v: v[layer] if layer < len(v) else math.nan)
                    ax.plot(x, y, color=_color(layer), label=f"layer {layer}")
            else:
                x, y = _per_layer(run, key, extreme)
                ax.plot(x, y, color=_color(i), label=f"{run.name} ({extreme.__name__} over layers)")
            e = run.config.get("model", {}).get("n_experts")
            if e:
                ax.axhline(1 / e, color="grey", ls=":", label=f"even (1/{e})" if i == 0 else None)
        ax.set_title(title, fontsize="medium")
        ax.set_ylabel("share")
        ax.legend(fontsize="x-small", ncol=2)
    _lines(axes[2], runs, [("aux_loss", "load-balancing loss")], ylabel="load-balancing loss")
    ks = {r.config.get("model", {}).get("top_k") for r in runs} - {None}
    if len(ks) == 1:  # Switch's loss is k for an even load, E for a collapse onto k experts
        axes[2].axhline(ks.pop(), color="grey", ls=":")
    _lines(axes[3], runs, [("router_z", "router z-loss")], ylabel="router z-loss")
    return fig


def _bands(ax, runs, bounds) -> None:
    """A shaded band per run, in its line's colour, between the lower and upper series that
    `bounds(run)` returns as (x, lower, upper); skipped where they do not line up."""
    for i, run in enumerate(runs):
        x, lo, hi = bounds(run)
        if x and len(x) == len(lo) == len(hi):
            ax.fill_between(x, lo, hi, color=_color(i), alpha=0.15, linewidth=0)


def reward_figure(runs, log_y=False):
    if not any(r.has("reward") for r in runs):
        return None
    fig, (a, b) = _figure("reward", 2)

    def mean_std(run):
        x, y = run.series("reward")
        _, sd = run.series("reward_std")
        return x, [m - s for m, s in zip(y, sd)], [m + s for m, s in zip(y, sd)]

    _bands(a, runs, mean_std)
    _lines(a, runs, [("reward", "sampled (mean, ± std)"), ("eval_reward", "held-out (greedy)")],
           ylabel="reward")
    _lines(b, runs, [("rewards/correctness/mean", "correct"), ("rewards/format/mean", "format")],
           ylabel="reward part")
    return fig


def kl_figure(runs, log_y=False):
    if not any(r.has("entropy") or r.has("kl") for r in runs):
        return None
    fig, (a, b, c) = _figure("policy: KL to the reference, clipping, entropy", 3)
    if not _lines(a, runs, [("kl", "KL")], ylabel="KL (k3)"):
        a.text(0.5, 0.5, "no KL term in these runs (--grpo.beta 0)", ha="center",
               transform=a.transAxes)
    _lines(b, runs, [("clip_ratio/region_mean", "clipped"), ("clip_ratio/low_mean", "low"),
                     ("clip_ratio/high_mean", "high")], ylabel="clipped token share")
    _lines(c, runs, [("entropy", "entropy")], ylabel="entropy (nats)")
    if log_y:
        a.set_yscale("log")
    return fig


def lengths_figure(runs, log_y=False):
    if not any(r.has("completions/mean_length") for r in runs):
        return None
    fig, (a, b) = _figure("completions", 2)

    def min_max(run):
        x, lo = run.series("completions/min_length")
        return x, lo, run.series("completions/max_length")[1]

    _bands(a, runs, min_max)
    _lines(a, runs, [("completions/mean_length", "mean (band: min-max)")], ylabel="tokens")
    _lines(b, runs, [("completions/clipped_ratio", "unfinished")],
           ylabel="share cut at --grpo.max-new-tokens")
    return fig


def warm_start_figure(runs, log_y=False):
    if not any(r.warm for r in runs):
        return None
    fig, (a, b) = _figure("warm start (supervised, before GRPO)", 2)
    for ax, key, label in ((a, "sft_loss", "SFT loss"), (b, "reward", "sampled reward")):
        for i, run in enumerate(runs):
            x, y = run.series(key, records=run.warm)
            ax.plot(x, y, color=_color(i), marker="o", markersize=3,
                    label=run.name if len(runs) > 1 else None)
        ax.set_ylabel(label)
        if len(runs) > 1:
            ax.legend(fontsize="small")
    axes = fig.get_axes()
    axes[-1].set_xlabel("warm-start step")
    return fig


FIGURES = {"loss": loss_figure, "lr": lr_figure, "throughput": throughput_figure,
           "expert_load": expert_load_figure, "reward": reward_figure, "kl": kl_figure,
           "lengths": lengths_figure, "warm_start": warm_start_figure}


def figures(runs: list[Run], log_y: bool = False) -> dict:
    """{name: Figure} of every figure the runs have data for."""
    out = {}
    for name, make in FIGURES.items():
        fig = make(runs, log_y)
        if fig is not None:
            out[name] = fig
    return out


def default_out(run_dirs: list[str]) -> str:
    if len(run_dirs) == 1:
        return os.path.join(run_dirs[0], "plots")
    names = [os.path.basename(_norm(d)) for d in run_dirs]
    parent = os.path.dirname(_norm(run_dirs[0]))
    return os.path.join(parent, "compare-" + "-".join(names))


def plot(run_dirs: list[str], out: str = "", log_y: bool = False) -> list[str]:
    """Write the PNGs of `run_dirs` into `out` (default: see default_out); returns their paths."""
    names = [os.path.basename(_norm(d)) for d in run_dirs]
    if len(set(names)) < len(names):  # runs/a/x and runs/b/x: tell them apart by full path
        names = [_norm(d) for d in run_dirs]
    runs = [read_run(d, n) for d, n in zip(run_dirs, names)]
    if not any(r.steps or r.warm for r in runs):
        raise ValueError(f"{' '.join(run_dirs)}: metrics.jsonl holds no records yet")
    out = out or default_out(run_dirs)
    epath.Path(out).mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figures(runs, log_y).items():
        png = io.BytesIO()
        fig.savefig(png, dpi=DPI, format="png")
        path = os.path.join(out, f"{name}.png")
        epath.Path(path).write_bytes(png.getvalue())
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m common.plot", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="RUN", help="run directories (--run-dir)")
    ap.add_argument("--out", default="", help="folder for the PNGs (default: RUN/plots, or "
                                               "compare-A-B beside the first run)")
    ap.add_argument("--log-y", action="store_true", help="log-scale loss (and grad norm, KL)")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("error: plotting needs matplotlib: `pip install matplotlib` (or "
                 "`pip install -e '.[viz]'`); `make plot` installs it for you")
    try:
        paths = plot(args.runs, args.out, args.log_y)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    if not paths:
        sys.exit(f"error: {' '.join(args.runs)}: no figure has data in these records")
    print(f"wrote {len(paths)} figures to {os.path.dirname(paths[0])}: "
          + ", ".join(os.path.basename(p) for p in paths))


if __name__ == "__main__":
    main()
