"""Writes evals/nextline/nextline.jsonl: the shipped lm-eval task, next-line multiple choice
on the embedded corpus's held-out documents (the Python standard library's source files that
`make train` never trains on).

Each example is eight lines of code and four candidates for the line after them: the true one
and three other lines of the same file, re-indented to the true line's indentation, so the
choice is about what the code says next, not its layout. Chance is 25%.

    python tools/nextline_task.py            # 500 examples; the file is committed
"""
import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from common import data  # noqa: E402

CONTEXT_LINES, CHOICES = 8, 4


def held_out_documents() -> list[str]:
    """The documents the embedded corpus holds out for eval, chosen as common/data.py does."""
    files = data._stdlib_files(data.STDLIB_MAX_BYTES)
    docs = list(data._documents(files, "text", errors="replace"))
    return [d for d, held in zip(docs, data._held_out(len(docs), data._STDLIB_EVAL_FRACTION, 0))
            if held]


def good(line: str) -> bool:
    """A line worth predicting: code of some length, not a comment, a docstring or a brace."""
    s = line.strip()
    return 12 <= len(s) <= 80 and not s.startswith(("#", '"', "'")) and s.isascii()


def examples(docs: list[str], n: int, seed: int) -> list[dict]:
    rng, out = np.random.default_rng(seed), []
    lines = [[l for l in d.split("\n")] for d in docs]
    sites = [(i, j) for i, ls in enumerate(lines) for j in range(CONTEXT_LINES, len(ls))
             if good(ls[j]) and sum(map(good, ls)) > 50]
    for k in rng.permutation(len(sites)):
        i, j = sites[k]
        true, pool = lines[i][j], [l.strip() for l in lines[i] if good(l)]
        indent = true[:len(true) - len(true.lstrip())]
        others = list(dict.fromkeys(p for p in rng.permutation(pool) if p != true.strip()))
        choices = [true] + [indent + o for o in others[:CHOICES - 1]]
        order = rng.permutation(CHOICES)
        out.append({"context": "\n".join(lines[i][j - CONTEXT_LINES:j]) + "\n",
                    "choices": [choices[o] for o in order],
                    "label": int(np.argmin(order))})
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} examples in the held-out documents, {n} asked")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "evals", "nextline", "nextline.jsonl"))
    a = ap.parse_args()
    rows = examples(held_out_documents(), a.n, a.seed)
    with open(a.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{a.out}: {len(rows)} examples")


if __name__ == "__main__":
    main()
