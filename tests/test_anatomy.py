"""The shape issues 31 and 76 ask of each trainer, measured by tools/anatomy.py: a line budget, the
share of the file that is model, attention in the first quarter, the step in the first half,
at most two calls from `train_step` to the loss's arithmetic, and common/ within its budget.
A trainer not yet redesigned is marked xfail(strict): it fails the day it meets the shape, so
the mark cannot outlive the work."""
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))
import anatomy  # noqa: E402

# Issue 76's budgets (wc -l), each later family adding its own model code: int8/fp8 matmuls
# (issue 72) 80 in a trainer that has them, GPT-3's learned positions (73) 60 in one that holds
# GPT-2's block, DeepSeek V4's hyper-connections (74) 300. The least model share as before.
def _budget(name: str, lines: int) -> int:
    src = (anatomy.ROOT / name).read_text().lower()
    return lines + 80 * ("int8" in src) + 60 * ("gpt2" in src) + 300 * ("sinkhorn" in src)


BUDGETS = {"train_dense.py": (_budget("train_dense.py", 1750), 0.60),
           "train_moe.py": (_budget("train_moe.py", 2350), 0.65),
           "train_grpo.py": (_budget("train_grpo.py", 1740), 0.60)}
# Over their budgets today (issue 76 open): this round's merges (common/'s split, remat
# policies, bf16 optimiser state, int8, GPT-3, refill rollouts) came in above what the HF
# tables saved. xfail(strict): the mark fails the day a file meets its budget.
NOT_YET = {"train_dense.py", "train_moe.py", "train_grpo.py"}
COMMON_BUDGET = 6100


def shape(name: str) -> list[str]:
    a = anatomy.anatomy(anatomy.ROOT / name)
    lines, share = BUDGETS[name]
    return [problem for ok, problem in [
        (a["lines"] <= lines, f"{a['lines']} lines > {lines}"),
        (a["model"] >= share, f"model share {a['model']:.1%} < {share:.0%}"),
        (0 < a["attention"] <= a["lines"] / 4, f"attention at line {a['attention']}"),
        (0 < a["step"] <= a["lines"] / 2, f"train_step at line {a['step']}"),
        (0 <= a["hops"] <= 2, f"{a['hops']} hops from train_step to the loss"),
    ] if not ok]


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="issue 76: over budget")) if n in NOT_YET
    else n for n in BUDGETS])
def test_trainer_reads_model_first(name):
    assert not shape(name), f"{name}: {'; '.join(shape(name))}"


def test_sections_come_in_reading_order():
    """Config before parameters before the model before the loss; HF at the end."""
    for name in BUDGETS:
        titles = [t.lower() for _, t in anatomy.sections(
            (anatomy.ROOT / name).read_text().splitlines())]
        at = {w: next(i for i, t in enumerate(titles) if w in t)
              for w in ("config", "parameters", "model", "loss", "huggingface")}
        assert list(at.values()) == sorted(at.values()), (name, titles)
        assert at["huggingface"] == len(titles) - 1, (name, titles)


@pytest.mark.xfail(strict=True, reason="issue 76: common/ over its 6,100 lines")
def test_common_within_budget():
    n = sum(len(p.read_text().splitlines()) for p in (anatomy.ROOT / "common").glob("*.py"))
    assert n <= COMMON_BUDGET, f"common/ has {n} lines > {COMMON_BUDGET}"


def test_anatomy_measures_what_it_says(tmp_path):
    """The yardstick itself: a toy trainer with known sections and call chain."""
    src = "\n".join(["# 1. Config", "x = 1", "# 2. Model", "def block():", "    pass",
                     "def train_step():", "    return loss_fn()", "def loss_fn():",
                     "    return ce()", "def ce():", "    return lse - tgt",
                     "# 3. Main and the loop", "def main():", "    pass"])
    (tmp_path / "t.py").write_text(src + "\n")
    a = anatomy.anatomy(tmp_path / "t.py")
    assert (a["lines"], a["attention"], a["step"], a["loop"], a["hops"]) == (14, 4, 6, 13, 2)
    assert a["model"] == pytest.approx(11 / 14)
