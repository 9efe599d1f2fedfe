"""libtpu's other step-time estimate: the timeline its latency-hiding scheduler builds.

`compiled.cost_analysis()["optimal_seconds"]` (bench/compile_tpu.py's est. s/step) is one
model of a step. The scheduler that orders the TPU program has its own: it places every
instruction of the step's entry computation on a simulated clock, collectives overlapping the
compute they were scheduled beside, and XLA writes that timeline out with
`--xla_dump_latency_hiding_schedule` (`bench/compile_tpu.py --schedule` sets it for both sides).
This reads one or two such dumps (a `*.schedule.txt`, or the folder holding it) and prints the
timeline's span, in seconds at the clock the file names, split by what each instruction is
(a fusion, a Pallas kernel, a collective left waiting), and with two files their ratio.
Each instruction's time is its own on the timeline, and they do not overlap there (the
scheduler's collectives run beside compute as async pairs of no length), so the kinds add up
to the span.

    python bench/schedule.py runs/compile-tpu/mixtral.ours.dump \
        runs/compile-tpu/mixtral.maxtext.dump
"""
from __future__ import annotations

import collections
import glob
import os
import re
import sys


def read(path: str) -> dict:
    """{span_s, by_opcode: {opcode: (seconds, count)}, top: [(seconds, opcode, name)]} of the
    entry computation's scheduled instructions."""
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, "*.schedule.txt")), key=os.path.getmtime)
        if not found:
            raise SystemExit(f"{path}: no *.schedule.txt (compile with "
                             "--xla_dump_latency_hiding_schedule=true and --xla_dump_to there)")
        path = found[-1]
    at: list[str] = []           # the enclosing message names, outermost first
    what: dict[str, tuple[str, str]] = {}   # instruction id -> (name, opcode)
    comp_id: dict[str, str] = {}
    spans: dict[str, list[tuple[str, float, float]]] = {}   # the last schedule of each
    entry, rate, cur, item, timeline = "", 0.0, {}, {}, []
    for line in open(path):
        s = line.strip()
        if s.endswith("{"):
            at.append(s[:-1].strip())
            item = {} if at[-1] == "instructions" else item
            continue
        if s == "}":
            done = at.pop()
            if done == "instructions" and at == ["hlo_module", "computations"]:
                what[item["id"]] = (item.get("name", "?"), item.get("opcode", "?"))
            elif done == "instructions" and at == ["computation_schedules"]:
                timeline.append((item["id"], float(item.get("start_timestamp_cycles", 0)),
                                 float(item.get("end_timestamp_cycles", 0))))
            elif done == "computation_schedules":   # a rerun of the scheduler replaces it
                spans[cur["computation_id"]], timeline = timeline, []
            elif done == "computations" and at == ["hlo_module"]:
                comp_id[cur["name"]] = cur["id"]
            if done in ("computations", "computation_schedules"):
                cur = {}
            continue
        key, _, value = s.partition(": ")
        value = value.strip('"')
        if key == "cycles_per_microsecond":   # the clock the timeline's cycles are of
            rate = float(value) * 1e6
        elif at == ["hlo_module"] and key == "entry_computation_name":
            entry = value
        elif at in (["hlo_module", "computations"], ["computation_schedules"]):
            cur.setdefault(key, value)
        elif at[-1:] == ["instructions"] and len(at) in (2, 3):
            item.setdefault(key, value)
    rows = spans.get(comp_id.get(entry, ""), [])
    if not rows or not rate:
        raise SystemExit(f"{path}: no schedule of the entry computation {entry!r} in it")
    by: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    top = []
    for i, start, end in rows:
        name, op = what.get(i, ("?", "?"))
        by[op][0] += (end - start) / rate
        by[op][1] += 1
        top.append(((end - start) / rate, op, name))
    return {"path": path, "span_s": max(e for _, _, e in rows) / rate,
            "by_opcode": {k: tuple(v) for k, v in by.items()}, "top": sorted(top, reverse=True)}


def main(paths: list[str]) -> None:
    runs = [read(p) for p in paths]
    for r in runs:
        print(f"{r['path']}: span {r['span_s']:.4f} s")
    ops = sorted({k for r in runs for k in r["by_opcode"]},
                 key=lambda k: -max(r["by_opcode"].get(k, (0, 0))[0] for r in runs))
    print(f"{'instruction':<16}" + "".join(f"{'s':>10}{'count':>7}" for _ in runs))
    for op in ops:
        cells = [r["by_opcode"].get(op, (0.0, 0)) for r in runs]
        if max(s for s, _ in cells) >= 1e-5:
            print(f"{op:<16}" + "".join(f"{s:10.4f}{n:7d}" for s, n in cells))
    if len(runs) == 2:
        print(f"span ratio (first / second): {runs[0]['span_s'] / runs[1]['span_s']:.3f}")
    for r in runs:
        print(f"longest in {r['path']}:")
        for sec, op, name in r["top"][:8]:
            print(f"  {1e3 * sec:8.3f} ms  {op} {name}")


if __name__ == "__main__":
    if not 1 <= len(sys.argv) - 1 <= 2:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
