"""The shape of each trainer as a forker meets it (issue 31): lines, the share that is model,
where attention, the step and the loop begin, and how many calls lie between `train_step` and
the arithmetic of the loss.

    python tools/anatomy.py            # a table for the three trainers and common/

Model share: the lines of the sections whose titles say config, parameters, model, experts,
rollouts, task, advantages, loss or step (a trainer's numbered `# N. Title` headers), over
`wc -l`.
Hops: the shortest chain of calls from `train_step` to a function whose body computes
`lse - tgt` (the cross-entropy) or, in GRPO, the clipped ratio (`ratio`), following names
defined in the same file.
"""
from __future__ import annotations

import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRAINERS = ("train_dense.py", "train_moe.py", "train_grpo.py")
MODEL_WORDS = ("config", "parameters", "model", "expert", "rollouts", "task", "advantages", "loss",
               "step")
HEADER = re.compile(r"^# (\d+)\. (.*)$")


def sections(lines: list[str]) -> list[tuple[int, str]]:
    """(first line, title) of each numbered section, 1-based."""
    return [(i + 1, m.group(2)) for i, s in enumerate(lines) if (m := HEADER.match(s))]


def model_lines(lines: list[str]) -> int:
    secs = sections(lines) + [(len(lines) + 1, "")]
    return sum(b - a for (a, t), (b, _) in zip(secs, secs[1:])
               if any(w in t.lower().split(" (")[0] for w in MODEL_WORDS))


def first_def(tree: ast.Module, *names: str) -> int:
    found = [n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
             and n.name in names]
    return min(found) if found else 0


def calls(fn: ast.AST) -> set[str]:
    """Names a function refers to (called, or passed on, e.g. to jax.value_and_grad)."""
    return {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}


def is_loss(fn: ast.FunctionDef) -> bool:
    src = ast.unparse(fn)
    return bool(re.search(r"\blse\w* - tgt", src) or re.search(r"\bratio\b", src))


def hops(tree: ast.Module, start: str = "train_step") -> int:
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    frontier, seen = [start], {start}
    for depth in range(12):
        if any(is_loss(defs[f]) for f in frontier if f in defs):
            return depth
        nxt = [c for f in frontier if f in defs for c in calls(defs[f])
               if c in defs and c not in seen]
        seen.update(nxt)
        frontier = nxt
    return -1


def anatomy(path: pathlib.Path) -> dict:
    text = path.read_text()
    lines, tree = text.splitlines(), ast.parse(text)
    n = len(lines)
    return {"file": path.name, "lines": n, "model": model_lines(lines) / n,
            "attention": first_def(tree, "attention", "block"),
            "step": first_def(tree, "train_step"), "loop": first_def(tree, "train_loop", "main"),
            "hops": hops(tree)}


def main() -> int:
    print(f"{'file':16} {'lines':>5} {'model':>6} {'attention':>10} {'step':>10} {'loop':>10} "
          f"{'hops':>4}")
    for name in TRAINERS:
        a = anatomy(ROOT / name)
        pos = {k: f"{a[k]} ({a[k] / a['lines']:.0%})" for k in ("attention", "step", "loop")}
        print(f"{a['file']:16} {a['lines']:5} {a['model']:6.1%} {pos['attention']:>10} "
              f"{pos['step']:>10} {pos['loop']:>10} {a['hops']:4}")
    common = sum(len(p.read_text().splitlines()) for p in sorted((ROOT / "common").glob("*.py")))
    print(f"{'common/':16} {common:5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
