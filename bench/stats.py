"""The one statistic every side-by-side bench reports, read the same way from each side's log.

A step's figure is its wall time. From a log we take the seconds of each step by its index
(step 0 is the first step run; in MaxText's log it includes compilation, in ours it is the
untimed warm-up after it), keep the steps FIRST..LAST of both sides (the warm-up dropped),
and report their median; tokens/s is tokens per step / that median, for both sides alike.

    ours    (common/train.py bench):  "bench moe | step seconds 1-12: 0.8123 0.8090 ..."
    MaxText (metric_logger.py):       "completed step: 7, seconds: 0.811, TFLOP/s/device: ..."
    GRPO, ours (metrics.jsonl):       {"step": 3, "ms_per_step": 812.3, ...} (step 1 first)
    GRPO, TRL (bench/peers/trl_grpo.py): "trl step 3 | seconds 0.8123 | rollout ..."
"""
import json
import re
import statistics

WARMUP = 5  # steps 0-4 are dropped on every side: compilation, first-touch allocations


def ours_step_seconds(log: str) -> dict[int, float]:
    """{step: seconds} from our `--bench` output (its last bench line; step 0 untimed). Never
    the MoE's dense twin's ("bench dense |"), which train_moe.py times after the MoE itself."""
    found = re.findall(r"bench(?: moe)? \| step seconds 1-(\d+): ([0-9. ]+)", log)
    if not found:
        raise ValueError("no 'step seconds' line in our bench output")
    n, values = found[-1]
    times = [float(v) for v in values.split()]
    if len(times) != int(n):
        raise ValueError(f"'step seconds 1-{n}' line holds {len(times)} values")
    return dict(enumerate(times, start=1))


def maxtext_step_seconds(log: str) -> dict[int, float]:
    """{step: seconds} from MaxText's 'completed step' lines."""
    found = re.findall(r"completed step: (\d+), seconds: ([0-9.]+)", log)
    if not found:
        raise ValueError("no 'completed step' line in MaxText's log")
    return {int(s): float(t) for s, t in found}


def metrics_step_seconds(jsonl: str, key: str = "ms_per_step", scale: float = 1e-3
                         ) -> dict[int, float]:
    """{step: value * scale} from a run's metrics.jsonl (train_grpo.py: steps from 1)."""
    out = {}
    for line in jsonl.splitlines():
        r = json.loads(line)
        if key in r and "step" in r:
            out[int(r["step"])] = float(r[key]) * scale
    return out


def trl_step_seconds(log: str, field: str = "seconds") -> dict[int, float]:
    """{step: value} of one field of bench/peers/trl_grpo.py's per-step lines (steps from 1)."""
    found = re.findall(rf"trl step (\d+) \|.*?\b{field} ([0-9.]+)", log)
    if not found:
        raise ValueError("no 'trl step' line in the TRL peer's output")
    return {int(s): float(v) for s, v in found}


def median_over(times: dict[int, float], first: int, last: int) -> float:
    """The median of steps first..last; every one of them must be in the log."""
    missing = [s for s in range(first, last + 1) if s not in times]
    if missing:
        raise ValueError(f"steps {missing} missing from the log (it has {sorted(times)})")
    return statistics.median(times[s] for s in range(first, last + 1))


def tokens_per_s(times: dict[int, float], first: int, last: int, tokens_per_step: int) -> float:
    return tokens_per_step / median_over(times, first, last)
