"""Your own task for train_grpo.py: prompts from a JSONL file, rewards from a Python file.

    {"prompt": "What is 2 + 3? Answer with the number.", "answer": "5"}
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Name a primary colour."}], "answer": "red"}

Each line holds a `prompt` string or chat `messages` (ending with a user turn), plus whatever
fields the rewards read. A model with a chat template (a HuggingFace folder's) sees either one
rendered by it, a `prompt` as a single user turn; without one a `prompt` is plain text after
the tokenizer's start token, and `messages` are refused. Every line has the same fields: a
reward receives each field as one list over the batch.

A reward function follows TRL's convention, `fn(completions: list[str], **fields) -> list[float]`:
the fields are the JSONL lines' own, each a list aligned with the completions (the G completions of
a prompt get G copies of its line's values), plus `finished` (each completion stopped by itself, EOS
within the budget). `--task.rewards my_rewards.py:correct,fmt` loads functions from a file; `exact`
and `format` are built in. Model-agnostic: the trainer brings the tokenizer and the rollouts.
"""
import importlib.util
import inspect
import math
import numbers
import os
import re
import traceback
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from common.data import ChatTemplate, DataError, check_messages, epoch_order, jsonl_file
from common.train import ConfigError, log

PASSED = ("completions", "finished")  # what every reward receives besides the lines' fields


class RewardError(DataError):
    """A reward function raised or returned something that is not one number per completion;
    the message names the function and its file."""


class Row(NamedTuple):
    """One prompt: its token ids as the model is given them, the fields its rewards receive,
    its text (for the log) and its answer (the warm start's target), if it has one."""
    ids: list[int]
    fields: dict
    text: str
    answer: str | None


def _show(row: Row, completion: str) -> str:
    expected = "" if row.answer is None else f" (expected {row.answer!r})"
    text = row.text if len(row.text) <= 60 else row.text[:57] + "..."
    return f"  {text!r} -> {completion!r}{expected}"


@dataclass
class Task:
    """What GRPO trains on: prompts drawn per step, fixed held-out ones, and the rewards."""
    rows_at: Callable[[int, int, int], list[Row]]  # (step, n, salt): a pure function of them
    eval_rows: list[Row]
    rewards: dict[str, tuple[Callable, float]]     # name -> (function, weight)
    width: int                                     # prompt columns: the longest prompt fits
    answer_tokens: int                             # the longest answer + EOS; 0 = no answers
    show: Callable[[Row, str], str] = field(default=_show)  # a held-out sample, for the log


def columns(rows: list[Row]) -> dict[str, list]:  # one list per field, aligned with the rows
    return {k: [r.fields[k] for r in rows] for k in (rows[0].fields if rows else {})}


def pack(prompt_BP, valid_BP, completion_BN, len_B, *, parts: int = 1, microbatches: int = 1,
         multiple: int = 1) -> dict[str, np.ndarray]:
    """Rollouts without their padding, for the forwards that score them: each sequence (the
    prompt's real tokens, then its completion but the last token, which predicts nothing) laid
    first-fit-decreasing into rows of P + N - 1 columns, so that a batch of short completions
    costs its tokens, not B x (P + N) (verl's remove-padding; TRL's GRPO pads to the longest).
    The rows of each of `parts` consecutive slices of the sequences (the updates of a rollout)
    and, within one, of each microbatch (sequences m, m + M, ...: common/train.py `accumulate`
    takes rows the same way) are packed apart, into the same number of rows, a multiple of
    `multiple` (the batch shards) rounded up to one of 16 sizes at most: few compiles.
    Returns tokens, positions and segment ids (0: padding) [R, C], `where` [B, N]: the flat
    index into one microbatch's rows of the position whose output predicts each completion
    token, and `where_all` the same into all R rows (positions past a completion's end point
    at its last: the loss masks them)."""
    B, N = completion_BN.shape
    C, U, M = prompt_BP.shape[1] + N - 1, B // parts, microbatches
    seqs = [np.concatenate([p[v], c[:max(int(n) - 1, 0)]])
            for p, v, c, n in zip(prompt_BP, valid_BP, completion_BN, len_B)]
    layouts = []  # per (part, microbatch): its rows, each a list of sequence indices
    for g in range(parts * M):
        rows, free = [], []
        for b in sorted(range(g // M * U + g % M, (g // M + 1) * U, M), key=lambda b: -len(seqs[b])):
            r = next((r for r, f in enumerate(free) if f >= len(seqs[b])), len(rows))
            rows, free = (rows, free) if r < len(rows) else (rows + [[]], free + [C])
            rows[r].append(b)
            free[r] -= len(seqs[b])
        layouts.append(rows)
    step = multiple * max(1, -(-U // M // (16 * multiple)))
    Rg = min(-(-max(map(len, layouts)) // step) * step, -(-(U // M) // multiple) * multiple)
    out = {k: np.zeros((parts * M * Rg, C), np.int32) for k in ("tokens", "positions", "segment")}
    where = np.zeros((2, B, N), np.int32)
    for g, rows in enumerate(layouts):
        for j, members in enumerate(rows):
            r, col = g // M * M * Rg + j * M + g % M, 0  # accumulate's strided microbatches
            for b in members:
                n, p = len(seqs[b]), int(valid_BP[b].sum())
                out["tokens"][r, col:col + n], out["segment"][r, col:col + n] = seqs[b], b + 1
                out["positions"][r, col:col + n] = np.arange(n)
                at = col + p - 1 + np.minimum(np.arange(N), max(int(len_B[b]) - 1, 0))
                where[:, b] = j * C + at, r * C + at
                col += n
    return out | {"where": where[0], "where_all": where[1]}


def draw(n_rows: int, n: int, *, seed: int, step: int, salt: int = 0) -> np.ndarray:
    """The n row indices of a step: every row once per epoch, as TRL's sampler, a pure function
    of (seed, salt, step), so a resumed run draws what an uninterrupted one would."""
    return epoch_order(n_rows, step * n, n, seed, salt)


# --- train_grpo.py's addition demo (its TaskConfig says why the sums are reversed) ----------------
def problems(rng: np.random.Generator, n: int, t) -> list[tuple[str, str]]:
    """n (prompt, answer) pairs: "a+b=" and the digits of a+b reversed (`t`: the TaskConfig)."""
    out = []
    for _ in range(n):
        a, b = (int(rng.integers(10 ** (d - 1) if d > 1 else 0, 10 ** d))
                for d in rng.integers(t.min_digits, t.max_digits + 1, size=2))
        out.append((f"{a}+{b}=", str(a + b)[::-1]))
    return out


def prompt_width(t) -> int:
    """Columns of every prompt batch: the longest prompt's characters, a begin token, and one
    more for a tokenizer's leading-space piece. Fixed, so every batch has one shape."""
    return 2 * t.max_digits + 2 + 2


# --- The prompts file -------------------------------------------------------------------------
SHAPE = ('{"prompt": "...", <fields>} or {"messages": [{"role": "user", "content": "..."}, ...], '
         '<fields>}')


def read_prompts(path: str, flag: str) -> list[tuple[str, dict]]:
    """("<path>, line N", object) of every line, each checked; a bad one is a DataError naming
    the file and line."""
    lines, keys = [], None
    for where, obj in jsonl_file(path, flag, "prompt", SHAPE):
        if not isinstance(obj, dict):
            raise DataError(f"{where}: a JSON {type(obj).__name__}, not an object; each line is "
                            f"{SHAPE}")
        if ("prompt" in obj) == ("messages" in obj):
            raise DataError(f'{where}: needs a "prompt" or a "messages" field (one of them); '
                            f"each line is {SHAPE}")
        if "prompt" in obj and not isinstance(obj["prompt"], str):
            raise DataError(f'{where}: "prompt" is a {type(obj["prompt"]).__name__}, not a string')
        if "messages" in obj:
            check_messages(obj["messages"], where)
            if (last := obj["messages"][-1]["role"]) != "user":
                raise DataError(f"{where}: the last message is the {last}'s; a prompt ends with "
                                "a user turn, which the policy answers")
        for name in PASSED:
            if name in obj:
                raise DataError(f"{where}: field {name!r} is what the trainer passes every reward "
                                "itself; rename it")
        if keys is None:
            keys, first = set(obj), where
        elif set(obj) != keys:
            raise DataError(f"{where}: fields {sorted(obj)} differ from {first}'s "
                            f"{sorted(keys)}; every line needs the same ones, since a reward "
                            "receives each field as a list over the batch")
        lines.append((where, obj))
    return lines


def prompt_row(obj: dict, where: str, tok, template: ChatTemplate | None) -> Row:
    """A line as the policy sees it. With a chat template, its rendering with the generation
    prompt, encoded whole as transformers encodes it (the template writes any BOS itself);
    without one, the tokenizer's start token and the prompt's text."""
    msgs = obj.get("messages") or [{"role": "user", "content": obj["prompt"]}]
    if "messages" in obj and template is None:
        raise DataError(f'{where}: chat "messages" need a chat template to be rendered, and this '
                        "run's tokenizer has none (only a HuggingFace folder, --init-from-hf, "
                        'brings one); give a plain "prompt" string instead, or start from a '
                        "folder with a chat template")
    try:
        ids = (tok.encode(template.render(msgs, add_generation_prompt=True, where=where))
               if template else tok.prompt(obj["prompt"]))
    except ValueError as e:  # a character the tokenizer cannot spell (the demo's char vocab)
        raise DataError(f"{where}: {e}") from None
    answer = obj.get("answer")
    return Row(list(ids), obj, msgs[-1]["content"], None if answer is None else str(answer))


def load_task(t, tok, template: ChatTemplate | None, seed: int) -> Task:
    """--task.path's prompts (`t`: train_grpo.TaskConfig), less the held-out ones (drawn with
    --task.eval-seed, or --task.eval-path's first --task.eval-prompts), and --task.rewards."""
    lines = read_prompts(t.path, "--task.path")
    rows = [prompt_row(obj, where, tok, template) for where, obj in lines]
    if t.eval_path:
        held = read_prompts(t.eval_path, "--task.eval-path")
        if set(held[0][1]) != set(lines[0][1]):
            raise DataError(f"{held[0][0]}: fields {sorted(held[0][1])} differ from "
                            f"{lines[0][0]}'s {sorted(lines[0][1])}; the same rewards score both")
        if len(held) < t.eval_prompts:
            raise DataError(f"--task.eval-path {t.eval_path!r} holds {len(held)} prompts, fewer "
                            f"than --task.eval-prompts {t.eval_prompts}; lower it")
        eval_rows = [prompt_row(obj, where, tok, template) for where, obj in held[:t.eval_prompts]]
    else:
        if len(rows) <= t.eval_prompts:
            raise DataError(f"--task.path {t.path!r} holds {len(rows)} prompts: holding out "
                            f"--task.eval-prompts {t.eval_prompts} leaves none to train on; "
                            "lower it, add prompts or give --task.eval-path")
        held = set(np.random.default_rng([t.eval_seed]).permutation(len(rows))[:t.eval_prompts])
        eval_rows, rows = ([r for i, r in enumerate(rows) if (i in held) == e]
                           for e in (True, False))
    rewards = load_rewards(t.rewards, t.reward_weights, t.format_regex, set(lines[0][1]))
    # Once before anything compiles, on two empty completions of a held-out prompt: a reward
    # that cannot score whatever the model writes fails in a second, not after the compile.
    try:
        score(rewards, [""] * 2, columns(eval_rows[:1] * 2), [False] * 2)
    except RewardError as e:
        raise RewardError(f"before training, on empty completions of a held-out prompt: {e}"
                          ) from e.__cause__
    answers = [r.answer for r in rows + eval_rows if r.answer is not None]
    width = max(len(r.ids) for r in rows + eval_rows)
    log(f"task: {t.path}: {len(rows)} prompts (+{len(eval_rows)} held out"
        f"{' from ' + t.eval_path if t.eval_path else ''}), up to {width} tokens"
        f"{', rendered by the chat template of ' + template.folder if template else ''} | "
        f"rewards {', '.join(f'{n} x{w:g}' for n, (_, w) in rewards.items())}")
    return Task(
        rows_at=lambda step, n, salt: [rows[i] for i in draw(len(rows), n, seed=seed, step=step,
                                                                salt=salt)],
        eval_rows=eval_rows, rewards=rewards, width=width,
        answer_tokens=max((len(tok.encode(a)) + 1 for a in answers), default=0))


# --- Reward functions -------------------------------------------------------------------------
def exact(completions: list[str], *, answer: list, **_) -> list[float]:
    """1 if the completion is the line's `answer` (surrounding whitespace aside), else 0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def format_reward(regex: str = "") -> Callable:
    """1 if the completion stopped by itself (EOS within the budget) and, with a regex, matches
    it whole (surrounding whitespace aside), else 0."""
    pattern = re.compile(regex, re.DOTALL) if regex else None

    def format(completions: list[str], *, finished: list[bool], **_) -> list[float]:
        return [float(bool(f) and (pattern is None or pattern.fullmatch(c.strip()) is not None))
                for c, f in zip(completions, finished)]
    return format


BUILT_IN = {"exact": "the line's `answer`, exactly", "format": "stopped by itself (and "
            "matches --task.format-regex, if given)"}


def load_rewards(specs: tuple[str, ...], weights: tuple[float, ...], format_regex: str,
                 fields: set[str], flag: str = "--task.rewards") -> dict[str, tuple]:
    """name -> (function, weight) from `specs`: "FILE.py:fn,fn" (functions defined in a file)
    or built-in names ("exact", "format", or "exact,format")."""
    if not specs:
        raise ConfigError(f"--task.path needs {flag}: built in, {', '.join(BUILT_IN)} (e.g. "
                          f"{flag} exact format), or your own as FILE.py:FUNCTION[,FUNCTION...], "
                          "each fn(completions, **fields) -> list[float]")
    try:
        re.compile(format_regex)
    except re.error as e:
        raise ConfigError(f"--task.format-regex {format_regex!r}: not a regular expression "
                          f"({e})") from None
    if format_regex and not any("format" in s.split(",") for s in specs if ".py:" not in s):
        raise ConfigError(f"--task.format-regex is the built-in format reward's; add format to "
                          f"{flag}")
    funcs: dict[str, Callable] = {}
    for spec in specs:
        m = re.fullmatch(r"(.+\.py):([\w,]+)", spec)
        if m:
            module = _import(m[1], flag)
            found = {n: getattr(module, n, None) for n in m[2].split(",") if n}
        elif all(n in BUILT_IN for n in spec.split(",")):
            found = {n: exact if n == "exact" else format_reward(format_regex)
                     for n in spec.split(",")}
            if "exact" in found and "answer" not in fields:
                raise ConfigError(f"{flag} exact: the built-in reward exact compares with each "
                                  "line's 'answer' field, which --task.path lacks")
        else:
            known = "; ".join(f"{k}: {v}" for k, v in BUILT_IN.items())
            raise ConfigError(f"{flag} {spec!r}: neither FILE.py:FUNCTION[,FUNCTION...] nor a "
                              f"built-in reward ({known})")
        for n, fn in found.items():
            if not callable(fn):
                defined = sorted(k for k, v in vars(module).items()
                                 if inspect.isfunction(v) and not k.startswith("_"))
                raise ConfigError(f"{flag} {spec}: {m[1]} defines no function {n!r} (it defines "
                                  f"{', '.join(defined) or 'none'})")
            if n in funcs:
                raise ConfigError(f"{flag}: two rewards are named {n!r}; each is logged as "
                                  f"rewards/<name>, so rename one")
            funcs[n] = fn
    if weights and len(weights) != len(funcs):
        raise ConfigError(f"--task.reward-weights {' '.join(map(str, weights))}: {len(weights)} "
                          f"weights for {len(funcs)} rewards ({', '.join(funcs)}); give one each")
    if bad := [w for w in weights if not math.isfinite(w)]:
        raise ConfigError(f"--task.reward-weights: {bad[0]} is not a finite number")
    return {n: (fn, float(w)) for (n, fn), w in zip(funcs.items(), weights or [1.0] * len(funcs))}


def _import(path: str, flag: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file (a Python file defining the reward "
                                "functions, named relative to the working directory)")
    spec = importlib.util.spec_from_file_location(
        "rewards_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0]), path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's code: any error, said with its line
        raise RewardError(f"{flag} {path}: importing it raised {type(e).__name__}: {e}"
                          f"{_line(e, path)}") from e
    return module


def _source(fn) -> str:
    try:
        path = inspect.getsourcefile(fn)
    except TypeError:
        path = None
    return "built in" if path == os.path.abspath(__file__) else (
        os.path.relpath(path) if path else "defined where its source cannot be found")


def _line(e: BaseException, path: str | None) -> str:
    """ ", at <file> line N" of the deepest frame of the traceback in the user's file."""
    at = [f for f in traceback.extract_tb(e.__traceback__)
          if path and os.path.abspath(f.filename) == os.path.abspath(path)]
    return f" (at {os.path.relpath(at[-1].filename)}, line {at[-1].lineno})" if at else ""


def score(rewards: dict[str, tuple[Callable, float]], completions: list[str],
          fields: dict[str, list], finished) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Total reward sum_f w_f r_f per completion, and each function's unweighted rewards. A
    function that raises or returns anything but one finite number per completion stops the
    run with a RewardError naming it."""
    n, each = len(completions), {}
    passed = dict(fields, finished=[bool(f) for f in finished])
    for name, (fn, _) in rewards.items():
        what = f"reward {name!r} ({_source(fn)})"
        try:
            out = fn(completions, **passed)
        except Exception as e:  # the user's code: any error, said with its name and line
            src = inspect.getsourcefile(fn) if inspect.isfunction(fn) else None
            raise RewardError(f"{what} raised {type(e).__name__}: {e}{_line(e, src)}, on a batch "
                              f"of {n} completions; fix it and rerun (a run resumes from its "
                              "last checkpoint)") from e
        each[name] = _checked(out, n, what)
    total = sum(w * each[name] for name, (_, w) in rewards.items())
    return np.asarray(total, np.float32), each


def _checked(out, n: int, what: str) -> np.ndarray:
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
        raise RewardError(f"{what} returned a {type(out).__name__}; it must return a list of "
                          f"{n} floats, one per completion")
    if len(out) != n:
        raise RewardError(f"{what} returned {len(out)} values for {n} completions; it must "
                          "return one float per completion, in their order")
    for i, v in enumerate(out):
        if not isinstance(v, (numbers.Real, np.bool_)) or not np.isfinite(np.float32(v)):
            raise RewardError(f"{what} returned {v!r} for completion {i}: not a finite number "
                              "(every completion needs a score; give 0.0 for no reward)")
    return np.asarray(out, np.float32)
