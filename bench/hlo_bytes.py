"""Where a compiled step's bytes go: each top-level instruction of an optimized HLO module
(`make compile-tpu ARGS=--hlo` writes runs/compile-tpu/ROW.ours.hlo and ROW.maxtext.hlo), its
operands' and output's bytes, summed by opcode and by the JAX op that made it. A stand-in for
XLA's `bytes accessed`, which gives only the total (llama8b-2k: 8-11% above it, each side);
with two modules, side by side, to find what one side moves that the other does not.

    python bench/hlo_bytes.py runs/compile-tpu/llama8b-2k.ours.hlo \\
        runs/compile-tpu/llama8b-2k.maxtext.hlo --top 20

Top level: the entry computation and what it calls (async calls, loops), not the inside of a
fusion, which reads its operands and writes its output once. Found with it: the vocabulary-
parallel loss had XLA move the f32 unembedding, Adam's mu and nu to the vocabulary split and
back for the update (six f32 all-to-alls a step; 20% of the 8B step's bytes).
"""
import argparse
import collections
import math
import re

SIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
        "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
ARRAY = re.compile(r"\b(" + "|".join(SIZE) + r")\[([0-9,]*)\]")
INSTR = re.compile(r"^(?:ROOT )?%([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
        "partition-id", "replica-id", "opt-barrier"}   # move no data of their own


def nbytes(shape: str) -> int:
    return sum(SIZE[dt] * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in
               ARRAY.findall(shape))


def instructions(text: str) -> list[dict]:
    """The top-level instructions: {name, op, bytes, shape, source (the JAX op's name)}."""
    comps, lines = {}, None
    for line in text.splitlines():
        if head := re.match(r"^(?:ENTRY )?%([\w.\-]+)", line):
            comps[head.group(1)] = lines = []
        elif line.strip() == "}":
            lines = None
        elif lines is not None and (m := INSTR.match(line.strip())):
            lines.append((m, line))
    shape = {m.group(1): m.group(2) for body in comps.values() for m, _ in body}
    inner = {c for body in comps.values() for m, line in body if m.group(3) in (
        "fusion", "custom-call") or "to_apply=" in line
        for c in re.findall(r"(?:calls|to_apply)=%([\w.\-]+)", line)}
    rows = []
    for name, body in comps.items():
        for m, line in (() if name in inner else body):
            if m.group(3) in FREE:
                continue
            args = re.split(r"\), \w+=", m.group(4))[0]
            src = re.search(r'op_name="([^"]*)"', line)
            kind = re.search(r"kind=(\w+)", line)
            rows.append({"name": m.group(1), "shape": m.group(2).split("{")[0],
                         "op": m.group(3) + (":" + kind.group(1) if kind else ""),
                         "bytes": nbytes(m.group(2)) + sum(nbytes(shape.get(a, "")) for a in
                                                           re.findall(r"%([\w.\-]+)", args)),
                         "source": src.group(1) if src else ""})
    return rows


def source(op_name: str) -> str:
    """The JAX op behind an instruction, without the transformation wrappers."""
    keep = [p for p in op_name.split("/") if p and not re.match(
        r"(jit|jvp|transpose|checkpoint|eval_jaxpr|rematted_computation)\b", p)]
    return "/".join(keep[-2:]) or "(none)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hlo", nargs="+", help="optimized HLO text files (one or two)")
    ap.add_argument("--top", type=int, default=15, help="rows per table")
    a = ap.parse_args()
    sides = {path: instructions(open(path).read()) for path in a.hlo}
    for path, rows in sides.items():
        print(f"{path}: {len(rows)} instructions, {sum(r['bytes'] for r in rows):.3e} bytes")
    for title, key in (("by opcode", lambda r: r["op"]), ("by JAX op", lambda r: source(
            r["source"]))):
        sums = [collections.Counter() for _ in sides]
        for c, rows in zip(sums, sides.values()):
            for r in rows:
                c[key(r)] += r["bytes"]
        print(f"\n{title} (GB{', each side' if len(sides) > 1 else ''})")
        for k, _ in (sums[0] + (sums[1] if len(sums) > 1 else collections.Counter())
                     ).most_common(a.top):
            print("  " + "  ".join(f"{c[k] / 1e9:8.2f}" for c in sums) + f"  {k}")
    for path, rows in sides.items():
        print(f"\nlargest in {path} (GB, opcode, output, JAX op)")
        for r in sorted(rows, key=lambda r: -r["bytes"])[:a.top]:
            print(f"  {r['bytes'] / 1e9:8.2f}  {r['op']:16s} {r['shape'][:44]:44s} "
                  f"{source(r['source'])}")


if __name__ == "__main__":
    main()
