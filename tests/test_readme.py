"""Every command in README.md's code blocks works as written, and every link in README.md and
docs/ reaches a file (and a heading) that exists. A command is checked without running it:
`make TARGET VAR=...` names a target and variables the Makefile has, and `make -n` of it prints
trainer commands that parse; `python train_*.py PRESET --flags` names a preset and flags the
trainer's tyro CLI accepts (its `cli`, which compiles and trains nothing); `python -m
common.{data,eval,launch}` parse with their own entry points, the work itself replaced by a
recorder. A failure names the README line."""
import contextlib
import functools
import importlib
import io
import os
import re
import shlex
import subprocess
from unittest import mock

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = ("train_dense.py", "train_moe.py", "train_grpo.py")
MODULES = ("common.data", "common.launch")
MAKEFILE = open(os.path.join(ROOT, "Makefile")).read()
TARGETS = set(re.findall(r"^([a-z][\w.-]*)\s*:(?!=)", MAKEFILE, re.M))
VARIABLES = set(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*[?:+]?=", MAKEFILE, re.M)) | set(
    re.findall(r"\$[({]([A-Z_][A-Z0-9_]*)[)}]", MAKEFILE))


def readme_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of each line of README's ```bash blocks, continuations joined."""
    out, fence, pending = [], False, None
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            fence = line.strip() in ("```bash", "```sh")
            continue
        if not fence or not (line.strip() or pending):
            continue
        start, cmd = pending or (n, "")
        cmd += line.rstrip()
        if cmd.endswith("\\"):
            pending = (start, cmd[:-1])
            continue
        pending = None
        out.append((start, " ".join(cmd.split())))
    return out


def words(command: str) -> list[str]:
    lex = shlex.shlex(command, posix=True, punctuation_chars=True)
    lex.whitespace_split, lex.commenters = True, "#"
    return list(lex)


def separator(word: str) -> bool:
    return word in ("then", "else", "fi", "do", "done") or not word.strip("();<>|&")


def invocations(ws: list[str]) -> list[tuple[str, list[str]]]:
    """Our programs started in a shell command: (train_*.py or common.*, its arguments). Quoted
    commands inside it (`gcloud ... --command="..."`) are searched too."""
    out = []
    for i, w in enumerate(ws):
        if " " in w:
            out += invocations(words(w.split("=", 1)[1] if w.startswith("--") else w))
        before = os.path.basename(ws[i - 1]) if i else ""
        runner = before in ("python", "python3") or before.endswith(".sbatch")
        if runner and os.path.basename(w) in TRAINERS:
            prog, args = os.path.basename(w), ws[i + 1:]
        elif before in ("python", "python3") and w == "-m" and ws[i + 1:i + 2] and \
                ws[i + 1] in MODULES:
            prog, args = ws[i + 1], ws[i + 2:]
        else:
            continue
        end = next((j for j, a in enumerate(args) if separator(a)), len(args))
        out.append((prog, args[:end]))
    return out


def recorder(f):
    """`f`'s signature and docs (what tyro reads) without its work."""
    return functools.wraps(f)(lambda *a, **k: "")


def parse_problem(prog: str, args: list[str]) -> str:
    """Why `prog args` would not start (the CLI's own message), or ""."""
    out, calls = io.StringIO(), []
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if prog in TRAINERS:
                mod = importlib.import_module(prog[:-3])
                sub = args[0].replace("-", "_") if args else ""
                if args[:1] == ["eval"]:  # the trainer's eval subcommand, run_cli's route
                    import common.eval as m
                    with mock.patch.object(m, "evaluate", lambda cfg, mod: calls.append(cfg)):
                        m.run_eval(mod, args[1:], f"{prog} eval")
                elif args and args[0] not in mod.PRESETS and callable(getattr(mod, sub, None)):
                    import tyro
                    tyro.cli(recorder(getattr(mod, sub)), args=args[1:])  # export-hf
                else:
                    mod.cli(args)
            elif prog == "common.data":
                import common.data as m
                with mock.patch.object(m, "prepare", recorder(m.prepare)):
                    m.main(args)
            elif prog == "common.launch":
                import common.launch as m
                with mock.patch.object(m, "run", lambda cmd, *a: calls.append(cmd) or 0):
                    if m.main(args):
                        return f"python -m common.launch {shlex.join(args)} was refused"
                return "; ".join(filter(None, (
                    parse_problem(p, a) for c in calls for p, a in invocations(c))))
    except SystemExit as e:
        if e.code:
            return f"{prog} {shlex.join(args)}: exit {e.code}: {out.getvalue()[-1500:]}"
    except Exception as e:  # a ConfigError from the CLI's own checks, say
        return f"{prog} {shlex.join(args)}: {type(e).__name__}: {e}"
    return ""


def problems(command: str) -> list[str]:
    """What is wrong with one README command, [] when nothing."""
    ws = words(command)
    if ws[:1] == ["make"]:
        target, *assigns = ws[1:]
        bad = [f"make has no target {target!r}"] if target not in TARGETS else []
        bad += [f"the Makefile reads no variable {a.split('=')[0]}" for a in assigns
                if "=" not in a or a.split("=")[0] not in VARIABLES]
        if bad:
            return bad
        # Under `make test ARGS=...` (CI) the outer make's variables, ARGS among them, reach
        # this one (MAKEFLAGS, and the environment it exports them in): the command as a user
        # types it sees none of them.
        env = {k: v for k, v in os.environ.items() if k not in VARIABLES and k not in (
            "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
        r = subprocess.run(["make", "-n", "-B", target, *assigns, "VENV=/nonexistent-venv"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
        if r.returncode:
            return [f"make -n {target}: {r.stderr.strip()}"]
        found = [i for line in r.stdout.replace("\\\n", " ").splitlines()
                 for i in invocations(words(line))]
    else:
        found = invocations(ws)
        if not found:
            return ["not a command this test can check: make, python train_*.py or "
                    f"python -m {'/'.join(MODULES)}"]
    return [p for prog, args in found if (p := parse_problem(prog, args))]


COMMANDS = readme_commands(open(os.path.join(ROOT, "README.md")).read())


def test_readme_has_its_commands():
    assert len(COMMANDS) >= 30
    firsts = [c for n, c in COMMANDS if n <= 40]
    assert "make train" in " ".join(firsts) and "make test" in " ".join(firsts)


@pytest.mark.parametrize("line,command", COMMANDS, ids=[f"L{n}" for n, _ in COMMANDS])
def test_readme_command_works(line, command):
    assert problems(command) == [], f"README.md:{line}: {command}"


# One case per path a command takes (most through the CLIs' cheap refusals: tyro's own message
# for an unknown flag takes seconds to compose).
@pytest.mark.parametrize("command,why", [
    ("make trian", "no target 'trian'"),
    ("make train PRESETT=tiny", "no variable PRESETT"),
    ('make train ARGS="--train.stepz 3"', "--train.stepz"),
    ('make tpu-vm PRESET=tiny ARGS="--init-from-hf x --model.n-layers 2"', "conflicts"),
    ('make gpu-node GPUS=8 ARGS="--init-from-hf x --model.d-model 8"', "conflicts"),
    ("python train_dense.py tiny --model.n-layerz 6", "--model.n-layerz"),
    ("python train_moe.py tiny-moe --init-from-hf x --model.n-experts 2", "conflicts"),
    ("python train_dense.py export-hf --run-dirr runs/x --out y", "--run-dirr"),
    ("python -m common.data prepare --inputs a --out b", "--inputs"),
    ("python train_dense.py eval --run-dir runs/x --taskz a", "--taskz"),
    ("python -m common.launch --nprocs 2 -- python train_dense.py tiny", "--nprocs"),
    ("python -m common.launch --nproc 2 -- python train_grpo.py tiny --init-from-hf x "
     "--model.n-layers 2", "conflicts"),
    ("XLA_FLAGS=--x python train_dense.py export-hf --outt y", "--outt"),
    ("pip install -e .", "not a command this test can check"),
])
def test_a_broken_command_is_caught(command, why):
    found = problems(command)
    assert found and why in " ".join(found), found


# --- links ----------------------------------------------------------------------------------
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def outside_code(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside ``` fences."""
    out, fence = [], False
    for n, line in enumerate(text.split("\n"), 1):
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            out.append((n, line))
    return out


def anchors(path: str) -> set[str]:
    seen, out = {}, set()
    for _, line in outside_code(open(path).read()):
        if m := re.match(r"#{1,6} (.*)", line):
            s = slug(m[1])
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


DOCS = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs"))
                              if f.endswith(".md"))


@pytest.mark.parametrize("doc", DOCS)
def test_links_reach_files_and_headings(doc):
    path = os.path.join(ROOT, doc)
    broken = []
    for n, line in outside_code(open(path).read()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            if not os.path.exists(dest) or not dest.startswith(ROOT + os.sep):
                broken.append(f"{doc}:{n}: {target} (no such file in the repository)")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                broken.append(f"{doc}:{n}: {target} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def test_every_doc_is_reachable_from_the_readme():
    """A page moved out of the README stays one link away from it."""
    linked = {os.path.normpath(t.partition("#")[0]) for t in LINK.findall(
        open(os.path.join(ROOT, "README.md")).read())}
    assert [d for d in DOCS[1:] if d not in linked] == []
