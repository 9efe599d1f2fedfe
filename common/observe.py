"""Seeing a run: its metrics on disk, progress on long waits, a profile of chosen steps, and a
one-screen summary at the end. Model-agnostic: every trainer uses it the same way.

    <run_dir>/metrics.jsonl     one JSON object per logged step: what the log line shows
    <run_dir>/tensorboard/      the same figures as TensorBoard scalars, and the config as text
    <run_dir>/profile/          a jax.profiler trace of the steps named by --*.profile-steps

TensorBoard files are written with tensorboardX (an optional extra: `pip install -e .[viz]`),
whose writer thread does the file work, so a log step costs the loop a queue put per figure.
Without it a run writes metrics.jsonl only and says once how to get the rest. Only process 0
writes; the others keep quiet. A bucket (gs://) has no append: see `Mirror`.
"""
import contextlib
import json
import math
import os
import pathlib
import shutil
import sys
import tempfile
import threading
import time
import uuid

import jax

_QUIET = False
_TBX_HINT_SHOWN = False
CONFIG_TAG = "config"  # the one TensorBoard tag that shows a trainer's config.json-like dict


def configure(*, quiet: bool) -> None:
    """quiet: no progress lines (data, compilation, checkpoints, profiles); the step lines,
    evals, warnings and the end-of-run summary still print."""
    global _QUIET
    _QUIET = quiet


def is_main_process() -> bool:
    # jax.process_index() would start a backend, which the data CLI must not do (on a TPU
    # VM it would take the chips); without jax.distributed every process is "the" process.
    return not jax.distributed.is_initialized() or jax.process_index() == 0


def say(*a, **kw) -> None:
    if is_main_process():
        print(*a, **kw, flush=True)


def note(*a, **kw) -> None:  # a progress line: said unless quiet
    if not _QUIET:
        say(*a, **kw)


def is_remote(path: str | os.PathLike) -> bool:  # an object store's URL (gs://, s3://)
    return "://" in os.fspath(path)


def write_json(path: str | os.PathLike, obj) -> None:
    """`obj` as indented JSON with sorted keys at `path`, a file or a bucket's object: a reader
    sees the old version or the new one whole, never a part."""
    text = json.dumps(obj, indent=2, sort_keys=True) + "\n"
    if is_remote(path):  # an object is replaced whole
        from etils import epath  # orbax's dependency; imported here so the data CLI stays light
        epath.Path(path).write_text(text)
        return
    # A unique temporary name per writer: several processes of one run may write the
    # same file at once, and each rename is atomic, so a reader sees one whole version.
    tmp = f"{os.fspath(path)}.{uuid.uuid4().hex}.tmp"
    try:
        pathlib.Path(tmp).write_text(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):  # replaced, else cut off: not left behind
            os.remove(tmp)


class Mirror:
    """A local folder whose files are copied, whole, to `remote` (a bucket folder): object
    stores have no append, so a file that grows (metrics.jsonl, TensorBoard events) is
    uploaded again once it has changed, at most every `every_s` seconds and at the end. The
    files are small next to a checkpoint, so each upload costs little."""

    def __init__(self, remote: str, every_s: float = 30.0):
        from etils import epath  # orbax's dependency; imported here so the data CLI stays light
        self.remote, self.local = epath.Path(remote), tempfile.mkdtemp(prefix="run-staging-")
        self.every_s, self._last = every_s, time.monotonic()
        self._sent: dict[str, tuple[int, int]] = {}  # name -> (size, mtime) when uploaded

    def fetch(self, name: str) -> str:
        """The local copy of `remote/name`, downloaded if it exists (to append to it)."""
        local = os.path.join(self.local, name)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        if (self.remote / name).exists():
            pathlib.Path(local).write_bytes((self.remote / name).read_bytes())
            st = os.stat(local)
            self._sent[name] = (st.st_size, st.st_mtime_ns)
        return local

    def sync(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._last < self.every_s:
            return
        self._last = time.monotonic()
        for folder, _, files in os.walk(self.local):
            for f in files:
                local = os.path.join(folder, f)
                name, st = os.path.relpath(local, self.local), os.stat(local)
                if self._sent.get(name) != (st.st_size, st.st_mtime_ns):
                    dst = self.remote / name
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    dst.write_bytes(pathlib.Path(local).read_bytes())
                    self._sent[name] = (st.st_size, st.st_mtime_ns)

    def close(self) -> None:
        try:
            self.sync(force=True)
        finally:
            shutil.rmtree(self.local, ignore_errors=True)


# --- Progress ---------------------------------------------------------------------------------
class progress:
    """A wait a person can see: `with progress("data: tokenizing", total=n, unit="documents") as
    p`, `p.update()` per document, prints `data: tokenizing ... 563 documents, 2.1 s`, then
    `p.note` if set. A terminal's line is redrawn twice a second, so a long wait is visibly
    alive; a log gets one line, without carriage returns. `min_s`: say nothing for waits
    shorter than this (a save that is usually done)."""

    def __init__(self, what: str, *, total: int | None = None, unit: str = "", min_s: float = 0.0):
        self.what, self.total, self.unit, self.min_s = what, total, unit, min_s
        self.count, self.note = 0, ""
        self.shown = not _QUIET and is_main_process()
        self.live = self.shown and sys.stdout.isatty()
        self._stop, self._ticker = threading.Event(), None

    def update(self, n: int = 1) -> None:
        self.count += n

    def _counts(self) -> str:
        if not self.unit:
            return ""
        if not self.total:
            return f"{self.count:,} {self.unit}, "
        return f"{self.count:,}/{self.total:,} {self.unit} ({100 * self.count / self.total:.0f}%), "

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            if (elapsed := time.perf_counter() - self.t0) >= self.min_s:
                # \x1b[K clears what a longer previous draw left on the line.
                print(f"\r{self.what} ... {self._counts()}{elapsed:.0f} s {self.note}\x1b[K",
                      end="", flush=True)

    def __enter__(self) -> "progress":
        self.t0 = time.perf_counter()
        if self.live:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        elif self.shown and self.min_s <= 0:
            print(f"{self.what} ...", end="", flush=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.seconds = time.perf_counter() - self.t0
        if self._ticker is not None:  # joined: the last line below is drawn alone
            self._stop.set()
            self._ticker.join()
        if not self.shown or (self.seconds < self.min_s and exc_type is None):
            return
        end = ("failed" if exc_type is not None else
               f"{self._counts()}{self.seconds:.1f} s" + (f" {self.note}" if self.note else ""))
        # Live: redraw the line; min_s > 0: nothing was printed when the wait began; else end it.
        line = (f"\r{self.what} ... {end}\x1b[K" if self.live else
                f"{self.what} ... {end}" if self.min_s > 0 else f" {end}")
        print(line, flush=True)


# --- Metrics: metrics.jsonl and TensorBoard ---------------------------------------------------
def _tensorboardx():
    """The tensorboardX module, or None after saying (once per process) how to install it."""
    global _TBX_HINT_SHOWN
    try:
        import tensorboardX
        return tensorboardX
    except ImportError:
        if not _TBX_HINT_SHOWN:
            _TBX_HINT_SHOWN = True
            say("tensorboard: tensorboardX is not installed, so metrics go to metrics.jsonl only; "
                "`pip install tensorboardX` (or `pip install -e '.[viz]'`) adds TensorBoard files")
        return None


def scalars(rec: dict, skip: tuple[str, ...] = ()) -> dict[str, float]:
    """The numbers of a metrics record under TensorBoard tags: a list (one value per layer,
    say) becomes `name/layer_00`, `name/layer_01`, ...; anything not a number is left out."""
    out = {}
    for k, v in rec.items():
        if k in skip:
            continue
        if isinstance(v, (list, tuple)):
            width = len(str(len(v) - 1))
            for i, x in enumerate(v):
                if isinstance(x, (int, float)):
                    out[f"{k}/layer_{i:0{width}d}"] = float(x)
        elif isinstance(v, (bool, int, float)):
            out[k] = float(v)
    return out


class MetricsLog(contextlib.AbstractContextManager):
    """Where a trainer's log records go: metrics.jsonl, and TensorBoard when it can. A
    TensorBoard writer opens with `purge_step` at its first record's step: a run resumed from
    before its last logged step drops the old curve's tail, which it is about to log again.
    Records counted in other steps (a warm start's) go to a TensorBoard run of their own."""

    def __init__(self, run_dir: str, config: dict | None = None):
        self.config, self.main = config, is_main_process()
        self.tensorboard_dir = os.path.join(run_dir, "tensorboard")
        self.records: list[dict] = []  # this process's run, for the end-of-run summary
        self._tbx = _tensorboardx() if self.main else None
        self._writers, self._due = {}, False
        self._mirror = Mirror(run_dir) if self.main and is_remote(run_dir) else None
        self._file = (self._mirror.fetch("metrics.jsonl") if self._mirror
                      else os.path.join(run_dir, "metrics.jsonl"))
        self._tb_local = os.path.join(os.path.dirname(self._file), "tensorboard")  # beside it

    def checkpointed(self) -> None:
        """A checkpoint was just saved. A run resumed from it will not log the steps before
        it again, so in a bucket the rows up to it go up with the next record, not in 30 s."""
        self._due = True

    has_tensorboard = property(lambda self: bool(self._writers))

    def write(self, rec: dict, *, step_key: str = "step", run: str = "") -> None:
        """Append `rec` to metrics.jsonl as is; every number in it becomes a TensorBoard scalar
        at step rec[step_key], tagged `run/key` in the folder tensorboard/run if `run` is set."""
        self.records.append(rec)
        if not self.main:
            return
        with open(self._file, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self._tbx is not None:
            step = int(rec[step_key])
            if run not in self._writers:
                self._open(run, step)
            for tag, v in scalars(rec, skip=(step_key,)).items():
                self._writers[run].add_scalar(f"{run}/{tag}" if run else tag, v, step)
        if self._mirror is not None:
            self._mirror.sync(force=self._due)
            self._due = False

    def _open(self, run: str, step: int) -> None:
        # flush_secs: a person watching TensorBoard sees a point within ~10 s of its log line.
        writer = self._tbx.SummaryWriter(os.path.join(self._tb_local, run),
                                         purge_step=step, max_queue=1000, flush_secs=10)
        if self.config is not None and not run:
            text = json.dumps(self.config, indent=2, sort_keys=True, default=str)
            # Indented four spaces: a Markdown code block, which TensorBoard shows verbatim.
            writer.add_text(CONFIG_TAG, "\n".join("    " + l for l in text.splitlines()), step)
        self._writers[run] = writer

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()  # flushes and joins the writer thread
        self._writers.clear()
        if self._mirror is not None:
            self._mirror.close()
            self._mirror = None

    __exit__ = lambda self, *exc: self.close()


def mean_ms_per_step(records: list[dict], start_step: int) -> float:
    """Step-weighted mean of `ms_per_step` over the logged intervals after `start_step`,
    leaving out the first when there are others: it is the run's first step alone, which
    pays for first-touch allocations and warm caches. NaN when nothing was logged."""
    timed, prev = [], start_step
    for r in records:
        if "ms_per_step" in r:
            timed.append((r["step"] - prev, r["ms_per_step"]))
            prev = r["step"]
    timed = timed[1:] if len(timed) > 1 else timed
    steps = sum(n for n, _ in timed)
    return sum(n * ms for n, ms in timed) / steps if steps else float("nan")


# --- Profiles ---------------------------------------------------------------------------------
def profile_steps_problem(steps: tuple[int, ...], flag: str, last_step: int) -> str | None:
    """Why `steps` (from `flag`) cannot be profiled in a run of `last_step` steps, or None."""
    if steps and (len(steps) > 2 or not 1 <= steps[0] <= steps[-1] <= last_step):
        return (f"{flag} {' '.join(map(str, steps))}: give the first and last step to trace "
                f"(e.g. {flag} 10 15, or one step), with 1 <= first <= last <= the run's "
                f"{last_step} steps. Skip the first few: they pay for warm-up.")
    return None


class Profiler(contextlib.AbstractContextManager):
    """A jax.profiler trace of the steps first..last (as logged) into `<run_dir>/profile`
    (profile/process_<i> each, with several), for TensorBoard or Perfetto: `before(step)`
    dispatching a step, `after(step, outputs)` it. A resumed run traces the rest of the range."""

    def __init__(self, run_dir: str, steps: tuple[int, ...]):
        self.first, self.last = (steps[0], steps[-1]) if steps else (0, -1)
        self.dir = os.path.join(run_dir, "profile")
        if jax.process_count() > 1:
            self.dir = os.path.join(self.dir, f"process_{jax.process_index()}")
        self.active, self.traced, self._mirror = False, None, None  # traced: (first, last)
        self._step = contextlib.ExitStack()  # the running step's annotation

    def before(self, step: int) -> None:
        if not self.active and self.traced is None and self.first <= step <= self.last:
            note(f"profile: tracing steps {step}-{self.last} into {self.dir}")
            # The profiler writes through the local file system only: trace there, then upload.
            self._mirror = Mirror(self.dir) if is_remote(self.dir) else None
            jax.profiler.start_trace(self._mirror.local if self._mirror else self.dir,
                                     create_perfetto_trace=True)
            self.active, self._began = True, step
        if self.active:
            # Marks the step in the trace: the profile plugin's step-time view reads these.
            self._step.enter_context(jax.profiler.StepTraceAnnotation("train", step_num=step))

    def after(self, step: int, outputs) -> None:
        self._step.close()
        if self.active and step >= self.last:
            jax.block_until_ready(outputs)  # the device's part of the last step, too
            self.close(step)

    def close(self, step: int = -1) -> None:
        """Ends the trace after `step`; without one, a trace the loop left open (a run stopped
        by SIGTERM inside the range)."""
        self._step.close()
        if self.active:
            with progress("profile: writing the trace"):
                jax.profiler.stop_trace()
                if self._mirror is not None:
                    self._mirror.close()
            self.active, self.traced = False, (self._began, step)

    __exit__ = lambda self, *exc: self.close()


# --- The end of a run -------------------------------------------------------------------------
def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"


def where_rows(run_dir: str, log: MetricsLog, profiler: Profiler) -> list[tuple[str, str]]:
    """The summary's rows that say where a run's files are and how to look at them."""
    rows = [("checkpoints", os.path.join(run_dir, "checkpoints")),
            ("metrics", os.path.join(run_dir, "metrics.jsonl"))]
    if log.has_tensorboard:
        rows.append(("tensorboard", f"{log.tensorboard_dir}   (make tensorboard RUN={run_dir})"))
    rows.append(("plots", f"make plot RUN={run_dir}   (writes {os.path.join(run_dir, 'plots')})"))
    if profiler.traced is not None:
        a, b = profiler.traced
        rows.append(("profile", f"{profiler.dir}   (steps {a}-{b}; README: Seeing a run)"))
    return rows


def print_summary(title: str, rows: list[tuple[str, str]]) -> None:  # ends a run's log
    width, rule = max(len(k) for k, _ in rows), "=" * 78
    say("\n".join([f"{rule}\n{title}\n{'-' * 78}"] +
                  [f"{k:<{width}}  {v}" for k, v in rows] + [rule]))


def fmt(x: float, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)
