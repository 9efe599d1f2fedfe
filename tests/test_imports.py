"""common/'s import graph, drawn from the source (issue 76): no cycle among its modules and no
import of a trainer (train_*.py), counting every import, those inside functions too; and each
module opens with a docstring saying what it is for. Read with ast, nothing imported."""
import ast
import os

import pytest

COMMON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "common")


def imports(source: str, modules: set[str]) -> set[str]:
    """The modules of common/ (`modules`) and the trainers (train_*) that `source` imports,
    anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            # from common import x, y: the modules x and y; from common.x import f: x
            names = ([f"common.{a.name}" for a in node.names] if node.module == "common"
                     else [node.module or ""])
        else:
            continue
        out |= {m for n in names if (m := n.removeprefix("common.").split(".")[0]) in modules
                or m.startswith("train_")}
    for node in ast.walk(ast.parse(source)):  # importlib.import_module("train_x") as well
        if (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)) and
                getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "import_module", "__import__") and node.args and
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            name = node.args[0].value.removeprefix("common.").split(".")[0]
            out |= {name} & modules | ({name} if name.startswith("train_") else set())
    return out


def graph(sources: dict[str, str]) -> dict[str, set[str]]:
    return {m: imports(s, set(sources)) - {m} for m, s in sources.items()}


def cycle(g: dict[str, set[str]]) -> list[str]:
    """One cycle of `g` as the path of modules around it, or []."""
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(g.get(m, ())):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n, path + [n])):
                return found
        state[m] = "done"
        return []
    for m in sorted(g):
        if m not in state and (found := visit(m, [m])):
            return found
    return []


def sources() -> dict[str, str]:
    return {f[:-3]: open(os.path.join(COMMON, f)).read() for f in sorted(os.listdir(COMMON))
            if f.endswith(".py") and f != "__init__.py"}


def test_common_is_acyclic_and_imports_no_trainer():
    g = graph(sources())
    assert {"train", "hf", "data", "eval", "optim"} <= set(g) and g["eval"]  # the graph is read
    assert not (found := cycle(g)), "import cycle in common/: " + " -> ".join(found)
    bad = {m: sorted(n for n in ns if n.startswith("train_")) for m, ns in g.items()}
    assert not any(bad.values()), f"common/ imports trainers: {bad}"


def test_each_module_says_what_it_is_for():
    for m, s in sources().items():
        doc = ast.get_docstring(ast.parse(s))
        assert doc and len(doc.split()) >= 8, f"common/{m}.py: no opening docstring saying what for"


@pytest.mark.parametrize("extra, found", [
    ({"train": "import jax\nfrom common import eval\n"}, "cycle"),       # train -> eval -> train
    ({"task": "def f():\n    from common.train import log\n"}, None),  # acyclic: allowed
    ({"task": "def f():\n    from common import data as d\n", "data": "import common.task\n"},
     "cycle"),                                                         # inside a function too
    ({"hf": "import importlib\nm = importlib.import_module('train_dense')\n"}, "trainer"),
    ({"eval": "import train_moe as tm\n"}, "trainer")])
def test_the_checks_fail_where_they_should(extra, found):
    """The two checks above on common/ with a line added: a cycle (also through an import inside
    a function) and a trainer import are caught; an acyclic import inside a function is not."""
    src = sources()
    g = graph({m: s + ("\n" + extra[m] if m in extra else "") for m, s in src.items()})
    trainer = any(n.startswith("train_") for ns in g.values() for n in ns)
    assert (("cycle" if cycle(g) else "trainer" if trainer else None) == found), (extra, cycle(g))
