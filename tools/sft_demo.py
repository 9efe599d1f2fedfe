"""The `make sft` instruction set: questions about the Python standard library's own function
signatures, each answerable from the signature in its prompt.

    python tools/sft_demo.py --out data/sft-demo      # writes data/sft-demo/train.jsonl

No download: the material is the stdlib source the `tiny` model was pre-trained on, read with
`ast`. Every top-level function and method with a short signature gives one example of one
of three tasks, in both JSONL shapes the trainer reads:

    parameters  prompt/completion  "def split(s, comments=False, posix=True):\\n# parameters:"
                                   -> " s, comments, posix"
    required    chat               "Which arguments must a call give?\\ndef split(...):"
                                   -> "s"  (or "none")
    call        chat               "Call it with only the arguments it needs:\\ndef split(...):"
                                   -> "split(s)"

The answer is a function of the prompt alone, so a held-out function is as answerable as a
trained one: the held-out loss measures what was learnt, not what was memorised. The same
Python gives the same file.

    python tools/sft_demo.py --dpo --out data/dpo-demo  # the `make dpo` preference pairs

With --dpo each example becomes a pair (same prompts, same order: the same held-out split):
its answer chosen, and rejected the answer of the next function of the same task whose answer
differs (right for another signature, wrong for this one).
"""
import argparse
import ast
import json
import os
import random
import sys
import sysconfig

MAX_SIGNATURE_CHARS = 72
MAX_PARAMS = 5
SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}


def signatures() -> list[tuple[str, ast.arguments, str]]:
    """(name, arguments, "def name(...):") of every short stdlib function (top level, or a
    method of a top-level class), sorted, one per distinct signature line."""
    root = sysconfig.get_paths()["stdlib"]
    found = {}
    for folder, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS)
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            methods = [n for c in tree.body if isinstance(c, ast.ClassDef) for n in c.body]
            for node in tree.body + methods:
                if not isinstance(node, ast.FunctionDef):
                    continue
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(
                    a.kwarg)
                line = f"def {node.name}({ast.unparse(a)}):"
                if 1 <= n <= MAX_PARAMS and len(line) <= MAX_SIGNATURE_CHARS:
                    found.setdefault(line, (node.name, a, line))
    return [found[k] for k in sorted(found)]


def parameters(a: ast.arguments) -> list[str]:
    """Every parameter in order, *args and **kwargs with their stars (a bare * is no
    parameter)."""
    return ([x.arg for x in a.posonlyargs + a.args] + ([f"*{a.vararg.arg}"] if a.vararg else [])
            + [x.arg for x in a.kwonlyargs] + ([f"**{a.kwarg.arg}"] if a.kwarg else []))


def required(a: ast.arguments) -> tuple[list[str], list[str]]:
    """Positional parameters without a default, and keyword-only ones without a default."""
    positional = a.posonlyargs + a.args
    n_plain = len(positional) - len(a.defaults)
    keyword = [x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    return [x.arg for x in positional[:n_plain]], keyword


def example(task: str, name: str, a: ast.arguments, line: str) -> dict:
    if task == "parameters":
        return {"prompt": f"{line}\n# parameters:", "completion": " " + ", ".join(parameters(a))}
    pos, kw = required(a)
    if task == "required":
        question, answer = "Which arguments must a call give?", ", ".join(pos + kw) or "none"
    else:
        question = "Call it with only the arguments it needs:"
        answer = f"{name}({', '.join(pos + [f'{k}={k}' for k in kw])})"
    return {"messages": [{"role": "user", "content": f"{question}\n{line}"},
                         {"role": "assistant", "content": answer}]}


def pairs(rows: list[dict]) -> list[dict]:
    """Each row's prompt, its answer chosen, another same-task row's different answer rejected."""
    answer = lambda r: r["completion"] if "prompt" in r else r["messages"][-1]["content"]
    out = []
    for i, row in enumerate(rows):
        other = next((rows[j % len(rows)] for j in range(i + 3, i + len(rows), 3)
                      if answer(rows[j % len(rows)]) != answer(row)), None)
        if other is not None:
            prompt = {"prompt": row["prompt"]} if "prompt" in row else {
                "messages": row["messages"][:-1]}
            out.append(prompt | {"chosen": answer(row), "rejected": answer(other)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="data/sft-demo", help="folder for train.jsonl")
    ap.add_argument("--max-examples", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dpo", action="store_true", help="preference pairs, for `make dpo`")
    args = ap.parse_args()
    sigs = signatures()
    random.Random(args.seed).shuffle(sigs)
    sigs = sigs[:args.max_examples]
    tasks = ("parameters", "required", "call")
    rows = [example(tasks[i % 3], *s) for i, s in enumerate(sigs)]
    rows = pairs(rows) if args.dpo else rows
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "train.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    v = sys.version_info
    print(f"{'dpo' if args.dpo else 'sft'} demo: {len(rows):,} "
          f"{'pairs' if args.dpo else 'examples'} ({', '.join(tasks)}) from the signatures of the "
          f"Python {v.major}.{v.minor} standard library -> {path}")


if __name__ == "__main__":
    main()
