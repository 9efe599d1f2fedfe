"""Figures of a run, drawn from its metrics.jsonl:

    python -m tools.plot runs/tiny                    # -> runs/tiny/plots/*.png
    python -m tools.plot runs/a runs/b --log-y        # both on every figure -> runs/compare-a-b/
    make plot RUN="runs/a runs/b" ARGS=--log-y

Which figures depends on what the records hold: loss.png (train and eval loss), lr.png (learning
rate and gradient norm), throughput.png (tokens/s and MFU, or rollout tokens/s); for train_moe.py
expert_load.png; with --train.qk-clip-threshold max_logit.png; for train_grpo.py reward.png, kl.png, lengths.png and warm_start.png.
matplotlib is an optional extra (`pip install -e '.[viz]'`).

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
        pts = [(r.get("step", r.get("warm_step")), r[key])
               for r in (self.steps if records is None else records) if key in r]
        return [x for x, _ in pts], [scale * float(math.nan if y is None else y) for _, y in pts]


def _norm(d: str) -> str:
    return d.rstrip("/") if is_remote(d) else os.path.normpath(d)  # normpath eats gs://'s "/"


def read_run(run_dir: str, name: str | None = None) -> Run:
    path = epath.Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl here; is it a run directory "
                                f"(--run-dir of a trainer) that has logged a step?")
    by_step, warm, last = {}, [], None  # by_step: step -> that step's records merged
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
            by_step = {s: r for s, r in by_step.items() if s < step}
        by_step.setdefault(step, {}).update(rec)
        last = step
    config_file = epath.Path(run_dir) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    return Run(name or os.path.basename(_norm(run_dir)),
               [by_step[s] for s in sorted(by_step)], warm, config)


# --- Figures: each takes the runs, returns a Figure or None (no run has its data) -------------
def _figure(title: str, rows: int, cols: int = 1):
    from matplotlib import figure, ticker
    fig = figure.Figure(figsize=FIGSIZE_IN, dpi=DPI, layout="constrained")
    axes = fig.subplots(rows, cols, sharex=True, squeeze=False).ravel()
    fig.suptitle(title)
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))  # steps are whole
    for ax in axes[-cols:]:
        ax.set_xlabel("step")
    return fig, axes


def _lines(ax, runs, keys, *, ylabel, scale=1.0, log=False, ymin=None, band=None, empty="",
           styles=("-", "--", ":", "-.")):
    """One line per (run, key): colour says the run, line style the key. `band(run)` gives
    (x, lower, upper) for a shaded band in the run's colour (skipped where they do not line
    up); `empty` is written on the panel if it has no line. Returns how many lines it drew."""
    drawn = 0
    for i, run in enumerate(runs):
        x, lo, hi = band(run) if band else ([], [], [])
        if x and len(x) == len(lo) == len(hi):
            ax.fill_between(x, lo, hi, color=f"C{i % 10}", alpha=0.15, linewidth=0)
        for (key, label), style in zip(keys, styles):
            x, y = run.series(key, scale)
            if not x:
                continue
            parts = ([run.name] if len(runs) > 1 else []) + ([label] if len(keys) > 1 else [])
            ax.plot(x, y, style, color=f"C{i % 10}", marker="o" if len(x) < 30 else None,
                    markersize=3, label=", ".join(parts) or None)
            drawn += 1
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    if ymin is not None:
        ax.set_ylim(bottom=ymin)
    if empty and not drawn:
        ax.text(0.5, 0.5, empty, ha="center", transform=ax.transAxes)
    if drawn > 1:
        ax.legend(fontsize="small")
    return drawn


def _panels(runs, title, needs, panels):
    """A figure of panels one above the other, each drawn by `_lines` with the arguments in
    `panels`; None when no run has any of the keys in `needs`."""
    if not any(r.has(k) for r in runs for k in needs):
        return None
    fig, axes = _figure(title, len(panels))
    for ax, panel in zip(axes, panels):
        _lines(ax, runs, **panel)
    return fig


def loss_figure(runs, log_y=False):
    return _panels(runs, "loss", ["loss", "eval_loss"], [
        dict(keys=[("loss", "train"), ("eval_loss", "eval")], ylabel="cross-entropy (nats)",
             log=log_y)])


def lr_figure(runs, log_y=False):
    lr_key = "lr" if any(r.has("lr") for r in runs) else "learning_rate"
    return _panels(runs, "optimiser", [lr_key, "grad_norm"], [
        dict(keys=[(lr_key, "lr")], ylabel="learning rate"),
        dict(keys=[("grad_norm", "grad norm")], ylabel="gradient norm (before clipping)",
             log=log_y)])


def throughput_figure(runs, log_y=False):
    # The y axes start at zero: a 5% wobble should look like one.
    if any(r.has("tokens_per_s") for r in runs):
        return _panels(runs, "throughput", ["tokens_per_s"], [
            dict(keys=[("tokens_per_s", "tok/s")], ylabel="tokens / s", ymin=0),
            dict(keys=[("mfu", "MFU")], ylabel="MFU (%)", scale=100, ymin=0)])
    return _panels(runs, "throughput", ["rollout_tokens_per_s"], [
        dict(keys=[("rollout_tokens_per_s", "tok/s")], ylabel="rollout tokens / s", ymin=0),
        dict(keys=[("ms_per_step", "ms/step")], ylabel="ms / step", ymin=0)])


def _per_layer(run, key, reduce):
    pts = [(r["step"], reduce(r[key])) for r in run.steps
           if isinstance(r.get(key), list) and r[key]]
    return [x for x, _ in pts], [y for _, y in pts]


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
                for layer in range(max(len(r.get(key, [])) for r in run.steps)):
                    x, y = _per_layer(run, key, lambda v: v[layer] if layer < len(v) else math.nan)
                    ax.plot(x, y, color=f"C{layer % 10}", label=f"layer {layer}")
            else:
                ax.plot(*_per_layer(run, key, extreme), color=f"C{i % 10}",
                        label=f"{run.name} ({extreme.__name__} over layers)")
            if e := run.config.get("model", {}).get("n_experts"):
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


def reward_figure(runs, log_y=False):
    def mean_std(run):
        (x, y), sd = run.series("reward"), run.series("reward_std")[1]
        return x, [m - s for m, s in zip(y, sd)], [m + s for m, s in zip(y, sd)]

    return _panels(runs, "reward", ["reward"], [
        dict(keys=[("reward", "sampled (mean, ± std)"), ("eval_reward", "held-out (greedy)")],
             ylabel="reward", band=mean_std),
        dict(keys=[("rewards/correctness/mean", "correct"), ("rewards/format/mean", "format")],
             ylabel="reward part")])


def kl_figure(runs, log_y=False):
    return _panels(runs, "policy: KL to the reference, clipping, entropy", ["entropy", "kl"], [
        dict(keys=[("kl", "KL")], ylabel="KL (k3)", log=log_y,
             empty="no KL term in these runs (--grpo.beta 0)"),
        dict(keys=[("clip_ratio/region_mean", "clipped"), ("clip_ratio/low_mean", "low"),
                   ("clip_ratio/high_mean", "high")], ylabel="clipped token share"),
        dict(keys=[("entropy", "entropy")], ylabel="entropy (nats)")])


def lengths_figure(runs, log_y=False):
    def min_max(run):
        return *run.series("completions/min_length"), run.series("completions/max_length")[1]

    return _panels(runs, "completions", ["completions/mean_length"], [
        dict(keys=[("completions/mean_length", "mean")], ylabel="tokens", band=min_max),
        dict(keys=[("completions/clipped_ratio", "unfinished")],
             ylabel="share cut at --grpo.max-new-tokens")])


def warm_start_figure(runs, log_y=False):
    if not any(r.warm for r in runs):
        return None
    fig, (a, b) = _figure("warm start (supervised, before GRPO)", 2)
    for ax, key, label in ((a, "sft_loss", "SFT loss"), (b, "reward", "sampled reward")):
        for i, run in enumerate(runs):
            ax.plot(*run.series(key, records=run.warm), color=f"C{i % 10}", marker="o",
                    markersize=3, label=run.name if len(runs) > 1 else None)
        ax.set_ylabel(label)
        if len(runs) > 1:
            ax.legend(fontsize="small")
    b.set_xlabel("warm-start step")
    return fig


def max_logit_figure(runs, log_y=False):
    """MuonClip (--train.qk-clip-threshold): the largest attention logit of the step, and the
    threshold each run clipped at (a threshold past every logit only records them)."""
    fig = _panels(runs, "attention logits", ["max_attn_logit"], [
        dict(keys=[("max_attn_logit", "largest q.k logit")], ylabel="largest attention logit",
             log=True),
        dict(keys=[("loss", "train")], ylabel="cross-entropy (nats)", log=log_y)])
    for i, run in enumerate(runs):
        tau = run.config.get("train", {}).get("qk_clip_threshold", 0)
        if fig is not None and 0 < tau < 1e6:
            fig.axes[0].axhline(tau, color=f"C{i % 10}", ls=":", label=f"{run.name}: threshold")
            fig.axes[0].legend(fontsize="small")
    return fig


FIGURES = {"loss": loss_figure, "lr": lr_figure, "throughput": throughput_figure,
           "expert_load": expert_load_figure, "reward": reward_figure, "kl": kl_figure,
           "lengths": lengths_figure, "warm_start": warm_start_figure,
           "max_logit": max_logit_figure}


def figures(runs: list[Run], log_y: bool = False) -> dict:
    """{name: Figure} of every figure the runs have data for."""
    return {name: fig for name, make in FIGURES.items() if (fig := make(runs, log_y)) is not None}


def default_out(run_dirs: list[str]) -> str:
    if len(run_dirs) == 1:
        return os.path.join(run_dirs[0], "plots")
    names = "-".join(os.path.basename(_norm(d)) for d in run_dirs)
    return os.path.join(os.path.dirname(_norm(run_dirs[0])), f"compare-{names}")


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
        paths.append(os.path.join(out, f"{name}.png"))
        epath.Path(paths[-1]).write_bytes(png.getvalue())
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.plot", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="RUN", help="run directories (--run-dir)")
    ap.add_argument("--out", default="", help="folder for the PNGs (default: RUN/plots, or "
                                               "compare-A-B beside the first run)")
    ap.add_argument("--log-y", action="store_true", help="log-scale loss (and grad norm, KL)")
    args = ap.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        sys.exit("error: plotting needs matplotlib: `pip install matplotlib` (or "
                 "`pip install -e '.[viz]'`); `make plot` installs it for you")
    del matplotlib  # imported only to see that it is there: the figures import their parts
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
