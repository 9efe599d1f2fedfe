"""A run or a HuggingFace folder scored by lm-evaluation-harness on our own JAX forward.

    make eval RUN=runs/tiny                        # the shipped task, evals/nextline
    python train_dense.py eval --hf ~/hf/Llama-3.2-1B --tasks arc_easy --include-path ~/tasks

`JaxLM` is an lm-eval model (registered as "jax-trainers"): loglikelihood, loglikelihood_rolling
and generate_until over the `forward` of the trainer whose `eval` subcommand runs (it hands its
module in: common/ imports no trainer), on the parameters as training shards them (read from
the checkpoint onto --mesh, never exported). Requests are padded on the right into length
buckets (powers of two), so each (batch, length) compiles once; a causal model's positions never
see the padding after them, so a padded row scores as it would alone. Generation is greedy and
reruns the whole forward for each token (no KV cache): a measurement, not an inference server.
Nothing is downloaded: lm-eval reads each task's YAML and data from local files (docs/eval.md).
"""
import dataclasses
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from jax.sharding import NamedSharding, PartitionSpec as P

from common.checkpoint import read_checkpoint, read_run_config
from common.config import ConfigError, check_ranges, knob
from common.hf import hf_origin
from common.data import open_tokenizer, run_tokenizer
from common.mesh import MeshConfig, make_mesh
from common.observe import MetricsLog
from common.train import join, log, put as place

EVALS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "evals")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    run_dir: str = ""
    """A run directory of this trainer: its checkpoint, model and tokenizer."""
    hf: str = ""
    """Or a HuggingFace folder, as --init-from-hf reads it, with its own tokenizer."""
    tasks: str = "nextline"
    """lm-eval task names, comma-separated; nextline is ours (evals/nextline)."""
    include_path: str = ""
    """A folder of further task YAMLs, whose data are local files (docs/eval.md)."""
    step: int = knob(-1, "-1 or >= 0")
    """The checkpoint to score; -1 = the latest."""
    limit: int = 0
    """Examples per task; 0 = all."""
    num_fewshot: int = knob(-1, "-1 or >= 0")
    """Examples shown before each question; -1 = the task's own choice."""
    batch_size: int = 32
    """Rows per forward (rounded up to a multiple of the batch shards)."""
    max_length: int = 0
    """The longest sequence scored (lm-eval cuts contexts from the left); 0 = the model's
    max_seq_len, at most 2048."""
    out: str = ""
    """Where eval/<task>.json go; "" = <run-dir>/eval, or <hf>/eval."""
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)


def load(cfg: EvalConfig, mesh, mod):
    """(ModelConfig, parameters sharded on `mesh` as training shards them, tokenizer path, step)
    of --run-dir or --hf, read by trainer `mod` (its ModelConfig, Config, train_state, load_hf)."""
    if bool(cfg.run_dir) == bool(cfg.hf):
        raise ConfigError("name what to score: --run-dir RUN (a run of this trainer) or --hf "
                          "FOLDER (a HuggingFace model folder), one of them.")
    if cfg.hf:
        m, params = mod.load_hf(cfg.hf, mesh)
        return m, params, folder_tokenizer(cfg.hf, "--hf"), 0
    saved = read_run_config(cfg.run_dir, "--run-dir", trained=True)
    if "grpo" in saved:
        raise ConfigError(f"--run-dir {cfg.run_dir} is a train_grpo.py run: export it "
                          "(python train_grpo.py export-hf --run-dir ... --out F) and pass --hf F.")
    fields = {f.name for f in dataclasses.fields(mod.ModelConfig)}
    if unknown := sorted(set(saved["model"]) - fields):
        raise ConfigError(f"--run-dir {cfg.run_dir}: its model has fields this trainer's lacks "
                          f"({', '.join(unknown[:3])}): score it with its own (train_moe.py eval).")
    m = dropless(mod.ModelConfig(**saved["model"]))
    want = {k: v for k, v in mod.train_state(mod.Config(model=m), mesh).abstract().items()
            if k in ("params", "buffers")}  # DeepSeek's router biases are buffers
    state, step = read_checkpoint(cfg.run_dir, want, f"--run-dir {cfg.run_dir} has no checkpoint "
                                  "yet: train it first.", cfg.step, ConfigError)
    src = hf_origin(saved)
    tok = folder_tokenizer(src, "--init-from-hf") if src else run_tokenizer(cfg.run_dir)
    return m, join(state["params"], state.get("buffers", {})), tok, step


def dropless(m):
    """An MoE model scores without expert capacity, so that a padded row cannot take a real
    row's place in an expert (a dense model as it is)."""
    return dataclasses.replace(m, capacity_factor=0.0) if hasattr(m, "capacity_factor") else m


def folder_tokenizer(folder: str, flag: str) -> str:
    for name in ("tokenizer.json", "tokenizer.model"):
        if os.path.isfile(path := os.path.join(folder, name)):
            return path
    raise ConfigError(f"{flag} {folder}: no tokenizer.json or tokenizer.model there to "
                      "tokenize the tasks with; copy the model's tokenizer files in.")


def bucket(n: int, cap: int) -> int:
    """The padded length of an n-token row: a power of two from 16, at most `cap`."""
    return min(cap, max(16, 1 << math.ceil(math.log2(max(n, 1)))))


class Scorer:
    """Batches of right-padded token rows over the mesh's batch axes, one program per shape."""

    def __init__(self, forward, params, mesh, batch_size: int, max_length: int):
        axes = tuple(a for a in ("data", "fsdp", "expert") if mesh.shape[a] > 1)
        shards = math.prod(mesh.shape[a] for a in axes)
        self.params, self.mesh, self.max_length = params, mesh, max_length
        self.B = -(-batch_size // shards) * shards
        self.axes = axes or None  # what splits a batch's rows (`place`)
        self.shapes, self.requests, self.seconds = set(), 0, 0.0

        def score(params, x_BT, mask_BT):
            """Each row's sum of log p(x[t] | x[<t]) over its masked targets, and whether
            every one of them is the argmax."""
            z_BTV = forward(params, x_BT)[:, :-1]
            lp_BT = jnp.take_along_axis(jax.nn.log_softmax(z_BTV, -1), x_BT[:, 1:, None], -1)[..., 0]
            hit_BT = jnp.argmax(z_BTV, -1) == x_BT[:, 1:]
            m = mask_BT[:, 1:]
            return jnp.sum(jnp.where(m, lp_BT, 0.0), -1), jnp.all(hit_BT | ~m, -1)

        def greedy(params, x_BT, end_B, n: int):
            """n tokens appended after each row's end by argmax, all in one program."""
            rows = jnp.arange(x_BT.shape[0])

            def one(i, x_BT):
                z_BV = forward(params, x_BT)[rows, end_B + i - 1]
                return x_BT.at[rows, end_B + i].set(jnp.argmax(z_BV, -1).astype(x_BT.dtype))
            return jax.lax.fori_loop(0, n, one, x_BT)
        # Answers replicated, so that every process of a multi-process run can read them.
        whole = NamedSharding(mesh, P())
        self._score = jax.jit(score, out_shardings=whole)
        self._greedy = jax.jit(greedy, static_argnums=3, out_shardings=whole)

    def run(self, fn, *args):
        with jax.set_mesh(self.mesh):  # the model's sharding constraints name its axes
            return jax.device_get(fn(self.params, *args))

    def put(self, rows: list[list[int]], width: int) -> tuple[jax.Array, np.ndarray]:
        """Rows right-padded with 0 to `width` (spare rows repeat the last), and their lengths."""
        x = np.zeros((self.B, width), np.int32)
        n = np.array([len(rows[min(i, len(rows) - 1)]) for i in range(self.B)])
        for i in range(self.B):
            x[i, :n[i]] = rows[min(i, len(rows) - 1)]
        return place(x, self.mesh, self.axes), n

    def batches(self, lengths: list[int], cap: int):
        """Indices in batches of one bucket each, longest bucket first."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        for b in range(0, len(order), self.B):
            idx = order[b:b + self.B]
            yield idx, bucket(lengths[idx[0]], cap)

    def loglikelihoods(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log p(continuation | context), greedy?) of each (context, continuation) of ids;
        a context too long for max_length loses its first tokens, as lm-eval's hf model does."""
        t0, out = time.perf_counter(), [None] * len(pairs)
        whole = [(c + d)[-(self.max_length + 1):] for c, d in pairs]
        for idx, width in self.batches([len(w) for w in whole], self.max_length + 1):
            x, n = self.put([whole[i] for i in idx], width)
            k = np.array([len(pairs[idx[min(i, len(idx) - 1)]][1]) for i in range(self.B)])
            cols = np.arange(width)
            mask = (cols >= (n - k)[:, None]) & (cols < n[:, None])
            self.shapes.add(("score", *x.shape))
            lp, hit = self.run(self._score, x, place(mask, self.mesh, self.axes))
            for j, i in enumerate(idx):
                out[i] = (float(lp[j]), bool(hit[j]))
        self.requests, self.seconds = self.requests + len(pairs), self.seconds + time.perf_counter() - t0
        return out

    def generate(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """n greedy tokens after each prompt (cut from the left to leave room for them)."""
        t0, out, keep = time.perf_counter(), [None] * len(prompts), max(1, self.max_length - n)
        prompts = [p[-keep:] for p in prompts]
        for idx, width in self.batches([len(p) + n for p in prompts], self.max_length):
            x, lens = self.put([prompts[i] for i in idx], width)
            self.shapes.add(("generate", *x.shape, n))
            x = self.run(self._greedy, x, place(lens, self.mesh, self.axes), n)
            for j, i in enumerate(idx):
                out[i] = x[j, lens[j]:lens[j] + n].tolist()
        self.requests, self.seconds = self.requests + len(prompts), self.seconds + time.perf_counter() - t0
        return out


def open_model(cfg: EvalConfig, mod) -> tuple[Scorer, str, int]:
    """(a Scorer over trainer `mod`'s model of --run-dir or --hf on --mesh, its tokenizer path,
    the step)."""
    mesh = make_mesh(cfg.mesh)
    m, params, tok, step = load(cfg, mesh, mod)
    longest = cfg.max_length or min(m.max_seq_len, 2048)
    log(f"eval: {cfg.run_dir or cfg.hf} (step {step}) with {mod.__name__}.forward on mesh "
        f"{dict(mesh.shape)}, sequences up to {longest} tokens, tokenizer {tok}")
    return Scorer(lambda p, x: mod.forward(p, x, m), params, mesh, cfg.batch_size, longest), tok, step


@functools.cache
def lm_class():
    """lm-eval's model class for our forward, registered as "jax-trainers" (made on first
    use: lm_eval, an optional extra, is imported only here). lm-eval's TemplateLM splits each
    request into context and continuation ids; the Scorer scores them."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    @register_model("jax-trainers")
    class JaxLM(TemplateLM):
        def __init__(self, scorer: Scorer, tokenizer: str, step: int = 0):
            super().__init__()
            self.scorer, self.tok, self.step = scorer, open_tokenizer(tokenizer), step
            self.max_length = scorer.max_length

        eot_token_id = property(lambda self: self.tok.eos_id())
        # Empty contexts are scored after BOS where there is one, else EOS (what separates
        # the documents of our own corpora): lm-eval's hf model does the same.
        prefix_token_id = property(lambda self: self.tok.bos_id() if self.tok.bos_id() >= 0
                                   else self.tok.eos_id())

        def tok_encode(self, string: str, add_special_tokens=None, **kw) -> list[int]:
            return list(self.tok.encode(string))

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
            return self.scorer.loglikelihoods([(c, d) for _, c, d in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            """Each text's whole log-likelihood in windows of max_length tokens, each window
            after the last token of the one before (lm-eval's rule)."""
            windows = [[make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(r.args[0]), self.prefix_token_id, self.max_length, 1)]
                for r in requests]
            flat = iter(self.scorer.loglikelihoods([w for ws in windows for w in ws]))
            return [sum(next(flat)[0] for _ in ws) for ws in windows]

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            """Greedy continuations, cut before the first stop string (or EOS); requests
            with the same stops and length go together."""
            out, groups = [None] * len(requests), {}
            for i, r in enumerate(requests):
                kw = dict(r.args[1])
                if kw.get("do_sample") and kw.get("temperature", 1.0) > 0:
                    raise ConfigError("generate_until: this model decodes greedily only and the "
                                      "task asks for sampling; set its generation_kwargs to "
                                      "do_sample: false.")
                until = kw.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                groups.setdefault((tuple(until), int(kw.get("max_gen_toks", 256))), []).append(i)
            for (until, n), idx in groups.items():
                gen = self.scorer.generate([self.tok_encode(requests[i].args[0]) for i in idx], n)
                for i, ids in zip(idx, gen):
                    ids = ids[:ids.index(self.eot_token_id)] if self.eot_token_id in ids else ids
                    text = self.tok.decode(ids)
                    out[i] = min((text.split(s)[0] for s in until), key=len, default=text)
            return out

    return JaxLM


def task_manager(tasks: str, include_path: str = "", flag: str = "--tasks"):
    """(lm-eval's TaskManager, the task names of `tasks`), lm-eval's presence and every name
    checked first: a ConfigError, not a failure after training or loading."""
    # A task whose data are not on this machine fails at once instead of reaching for the Hub.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError(f"{flag} needs lm-evaluation-harness: pip install -e '.[eval]' "
                          "(make eval installs it).") from None
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    # lm-eval's own tasks are indexed (~10 s) only when a name is not one of ours.
    paths = [EVALS, *filter(None, [include_path])]
    tm = TaskManager(include_path=paths, include_defaults=False)
    if any(t not in tm.all_tasks for t in names):
        tm = TaskManager(include_path=paths)
    if unknown := [t for t in names if t not in tm.all_tasks]:
        raise ConfigError(f"{flag} {','.join(unknown)}: no such task here. Ours: "
                          f"{', '.join(sorted(os.listdir(EVALS)))}; a standard one (hellaswag, "
                          "arc_easy, gsm8k, mmlu) needs its data on this machine and a YAML "
                          "naming them, in --include-path (docs/eval.md).")
    return tm, names


def run_tasks(lm, tm, names: list[str], limit: int, num_fewshot: int) -> tuple[dict, dict]:
    """lm-eval's results for `names` on `lm`, and {task: {metric: value}} without the
    standard errors and sample counts."""
    import lm_eval
    res = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=tm, limit=limit or None,
                                  num_fewshot=None if num_fewshot < 0 else num_fewshot,
                                  log_samples=False, bootstrap_iters=1000)
    return res, {t: {k.split(",")[0]: v for k, v in m.items() if isinstance(v, float)
                     and "stderr" not in k} for t, m in res["results"].items()}


def show(summary: dict, head: str = "eval") -> str:
    return "\n".join(f"{head} {t} | " + " | ".join(f"{k} {v:.4f}" for k, v in d.items())
                     for t, d in summary.items())


def flat(summary: dict) -> dict:  # {task: {metric: v}} as metrics.jsonl's keys
    return {f"lm_eval/{t}/{k}": v for t, d in summary.items() for k, v in d.items()}


class DuringTraining:
    """--train.eval-tasks: the harness on the parameters being trained, at each eval (nothing
    when the flag is empty). One Scorer for the whole run, so that each batch shape compiles
    once, not once per eval; rows as `make eval` pads them, so both score a step alike."""

    def __init__(self, t, m, forward, mesh, tokenizer: str):
        """t: a trainer's TrainConfig, m: its ModelConfig, forward(params, tokens_BT, m)."""
        self.on, self.limit = bool(t.eval_tasks), t.eval_tasks_limit
        if self.on:
            self.tm, self.names = task_manager(t.eval_tasks, flag="--train.eval-tasks")
            self.scorer = Scorer(lambda p, x: forward(p, x, dropless(m)), None, mesh,
                                 t.batch_size, min(m.max_seq_len, 2048))
            self.lm = lm_class()(self.scorer, tokenizer)

    def __call__(self, params, step: int) -> dict:
        if not self.on:
            return {}
        self.scorer.params, self.lm.step, t0 = params, step, time.perf_counter()
        summary = run_tasks(self.lm, self.tm, self.names, self.limit, -1)[1]
        log(show(summary, f"eval step {step} |") + f" | {time.perf_counter() - t0:.1f} s")
        return flat(summary)


def evaluate(cfg: EvalConfig, mod) -> dict:
    """Every task of --tasks on trainer `mod`'s model: eval/<task>.json, a line each, and (for
    a run) one record in its metrics.jsonl at the checkpoint's step. Returns {task: {metric:
    value}}."""
    check_ranges(cfg)
    tm, names = task_manager(cfg.tasks, cfg.include_path)
    lm = lm_class()(*open_model(cfg, mod))
    res, summary = run_tasks(lm, tm, names, cfg.limit, cfg.num_fewshot)
    sc, out_dir = lm.scorer, cfg.out or os.path.join(cfg.run_dir or cfg.hf, "eval")
    speed = {"requests": sc.requests, "seconds": round(sc.seconds, 3), "requests_per_s":
             sc.requests / max(sc.seconds, 1e-9), "programs_compiled": len(sc.shapes)}
    os.makedirs(out_dir, exist_ok=True)
    for t, metrics in res["results"].items():
        path = os.path.join(out_dir, f"{t}.json")
        with open(path, "w") as f:
            json.dump({"task": t, "model": cfg.run_dir or cfg.hf, "step": lm.step,
                       "examples": res["n-samples"].get(t), "metrics": metrics, "speed": speed,
                       "limit": cfg.limit, "num_fewshot": cfg.num_fewshot}, f, indent=1)
        log(show({t: summary[t]}) + f" | {path}")
    log(f"eval: {sc.requests:,} requests in {sc.seconds:.1f} s, {speed['requests_per_s']:.1f} "
        f"requests/s ({len(sc.shapes)} programs compiled, one per batch shape)")
    if cfg.run_dir:
        with MetricsLog(cfg.run_dir) as metrics_log:
            metrics_log.write({"step": lm.step} | flat(summary), run="lm_eval")
    return summary | {"speed": speed}


def run_eval(mod, args: list[str], prog: str) -> dict:
    """`python train_x.py eval --run-dir R --tasks T`: trainer `mod` (its run_cli's) scored."""
    return evaluate(tyro.cli(EvalConfig, args=args, prog=prog), mod)
