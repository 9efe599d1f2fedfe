"""Checkpoints: async save, keep the last N, resume onto any mesh, survive preemption.

A run directory looks like this:

    <run_dir>/config.json                the run's config; a resume must match it
    <run_dir>/checkpoints/<step>/        one Orbax checkpoint per saved step
    <run_dir>/checkpoints/<step>.orbax-checkpoint-tmp/   a save still in flight (or cut off)

Orbax does the heavy lifting. Each process writes only the shards it holds, and a restore
reads only the slices the *target* shardings ask for, so a checkpoint resumes on any mesh
(4x2 -> 8x1, many hosts -> one CPU). A save that is cut off never hides the last good one:
it is a folder with the temporary suffix (or, in a bucket, which has no atomic rename, one
without `commit_success.txt`), which is never taken for a checkpoint.

The run directory may be local, a mount every host sees, or a `gs://` bucket (a TPU pod has
no shared disk); files go through `etils.epath`, as Orbax's do, and a bucket needs `gcsfs`
(`pip install '.[gcs]'`). What this module adds is mostly refusal (someone else's files, a
changed model, a failed background save), each saying what is wrong and what to do.
"""
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from common.config import knob
from common.observe import is_remote, progress, write_json

# Orbax logs about fifty absl INFO lines per save, which drown the training log under
# `logging.basicConfig(level=INFO)`; warnings and errors still pass. Only an unset level is
# touched: whoever configures "absl" on purpose (`--verbosity`) still wins.
_absl_logger = logging.getLogger("absl")
if _absl_logger.level == logging.NOTSET:
    _absl_logger.setLevel(logging.WARNING)

# The one item a checkpoint holds: named, so that siblings (data-loader state) could join it.
_ITEM = "state"
# A step folder being written: `12.orbax-checkpoint-tmp` (older releases add `-<timestamp>`),
# as orbax's private TMP_DIR_SUFFIX says.
_TMP_STEP = re.compile(r"^\d+\.orbax-checkpoint-tmp(-\d+)?$")
# Written into a step folder before any array data: every step folder of ours has it.
_STEP_METADATA_FILE = "_CHECKPOINT_METADATA"
_COMMIT_FILE = "commit_success.txt"  # written last into a bucket's step folder
_ROOT_METADATA_DIR = "metadata"  # Orbax's own folder, when asked for: not foreign


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = knob(100, ">= 0")  # save every N steps (0 = only at the end / on preemption)
    keep: int = 3  # keep the last K checkpoints
    async_save: bool = True  # write in the background while training continues
    restore_step: int = knob(-1, "-1 or >= 0")  # -1 = the latest complete checkpoint

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"--checkpoint.every must be >= 0 (0 = only at the end), got {self.every}")
        if self.keep < 1:
            raise ValueError(f"--checkpoint.keep must be >= 1, got {self.keep}")
        if self.restore_step < -1:
            raise ValueError(f"--checkpoint.restore-step must be a step or -1 (latest), got {self.restore_step}")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says why and what to do."""


class ConfigConflictError(ValueError):
    """The run directory belongs to a run with a different config."""


class RunConfigError(ValueError):
    """A run's saved config.json cannot be read: not JSON, or not a JSON object."""


def run_path(run_dir: str | os.PathLike, *parts: str) -> epath.Path:
    """`run_dir/parts...`: made absolute if local (Orbax wants that), as given if a bucket."""
    root = os.fspath(run_dir)
    return epath.Path(root if is_remote(root) else os.path.abspath(root)).joinpath(*parts)


def read_run_config(run_dir: str | os.PathLike, what: str, trained: bool = False) -> dict:
    """The config.json a run saved, for `what` (the flag that named the run: "--init-from").
    `trained`: the run must also have checkpoints/ (to start from its weights)."""
    path = run_path(run_dir, "config.json")
    if trained and not (path.exists() and run_path(run_dir, "checkpoints").is_dir()):
        raise FileNotFoundError(f"{what} {os.fspath(run_dir)!r}: not a train_dense.py run directory "
                                f"(it needs config.json and checkpoints/); train one first, "
                                f"e.g. `make train` for runs/tiny.")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {run_dir}: no config.json there, so not a run directory. "
                                "Fix: pass the --run-dir of a run that has started.") from None
    try:
        saved = json.loads(text)
    except ValueError as e:
        raise RunConfigError(f"{what} {run_dir}: {path} is not valid JSON ({e}). Fix: repair or "
                             "remove it.") from None
    if not isinstance(saved, dict):
        raise RunConfigError(f"{what} {run_dir}: {path} does not hold a config (a JSON object).")
    return saved


def _reason(e: BaseException) -> str:
    """One readable line from an exception raised inside Orbax or TensorStore, whose
    messages end in a JSON spec of kilobytes; the part before it names file and fault."""
    first = (str(e).split(" [tensorstore_spec=")[0].strip() or repr(e)).splitlines()[0]
    return f"{type(e).__name__}: {first[:400] + '...' if len(first) > 400 else first}"


class Checkpointer(contextlib.AbstractContextManager):
    """Saves and restores one pytree (the train state) under `<run_dir>/checkpoints/`. Every
    process must make the same calls in the same order (Orbax synchronises them with barriers):
    construct, `save` at the same steps, `restore`, `close`."""

    def __init__(self, run_dir: str, cfg: CheckpointConfig):
        self.cfg, self.directory = cfg, run_path(run_dir, "checkpoints")
        _refuse_foreign_directory(self.directory)
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add(_ITEM, ocp.args.StandardSave)
        registry.add(_ITEM, ocp.args.PyTreeRestore)  # which may restore a part (`partial`)
        options = ocp.CheckpointManagerOptions(
            # We decide when to save (see `save`); Orbax only keeps the last `keep`.
            preservation_policy=ocp.checkpoint_managers.LatestN(n=cfg.keep),
            enable_async_checkpointing=cfg.async_save,
            # Create the step's temporary folder before `save` returns, not in the background:
            # when that fails in the background (the disk is gone, the path became a file),
            # Orbax 0.12 leaves its writer threads waiting for a signal that never comes, and
            # the process hangs for five minutes at exit. A mkdir is cheap to wait for.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            # Orbax could delete the leftovers of cut-off saves on opening; we do it at the
            # first save (`_sweep_leftovers`), so that merely reading a run (to initialise
            # another from it) never deletes the folder of a save that run is writing now.
            cleanup_tmp_directories=False, create=True)
        try:
            self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        except Exception as e:
            raise CheckpointError(
                f"cannot open the checkpoint directory {self.directory}: {_reason(e)}. "
                "Fix: make sure the run directory is writable, or choose another --run-dir.") from e
        # _in_flight: the step of an async save not yet known to be on disk.
        self._in_flight, self._swept = None, False

    def all_steps(self) -> list[int]:
        """Steps with a complete (committed) checkpoint on disk, ascending. Read from the
        directory: Orbax's in-memory list counts a save as soon as it *starts*, so during an
        async save it names a step that a crash would still lose."""
        return sorted(m.step for m in ocp.path.step.standard_name_format().find_all(self.directory))

    def latest_step(self) -> int | None:
        return max(self.all_steps(), default=None)

    def resume_step(self) -> int | None:
        """The step a run should restore from: `cfg.restore_step`, else the latest; None if fresh."""
        if self.cfg.restore_step < 0:
            return self.latest_step()
        steps = self.all_steps()
        if self.cfg.restore_step not in steps:
            raise CheckpointError(
                f"restore_step={self.cfg.restore_step} requested, but {self.directory} has no complete "
                f"checkpoint for it (complete: {steps or 'none'}). "
                "Fix: pick one of those steps, or -1 for the latest.")
        return self.cfg.restore_step

    def due(self, step: int) -> bool:  # by --checkpoint.every
        return self.cfg.every > 0 and step % self.cfg.every == 0

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Saves `state` as `step` if due (or forced); returns whether it saved. With
        `async_save` it returns once the arrays are off the accelerator (`state` may then be
        donated); a failed background write raises at the next `save`, `wait` or `close`."""
        if not (force or self.due(step)):
            return False
        # A failure of the previous background save, named by *its* step (Orbax would raise
        # it from inside this save, as if this step had failed).
        self.wait()
        known = self._manager.all_steps()
        if step in known:  # already on disk (preempted right after resuming, say): nothing new
            return False
        if known and step < max(known):
            raise CheckpointError(
                f"cannot save step {step}: {self.directory} already holds a later step {max(known)}, "
                "so this run has gone back in time (restore_step below the latest?) and keep-N would "
                "mix two histories. Fix: continue from the latest checkpoint, or start a new --run-dir."
            )
        self._sweep_leftovers()
        with progress(f"checkpoint: saving step {step}") as p:
            try:
                self._manager.save(step, args=ocp.args.Composite(**{_ITEM: ocp.args.StandardSave(state)}), force=True)
            except Exception as e:
                raise CheckpointError(self._save_failed(step, e)) from e
            if self.cfg.async_save:
                p.note = "(writing in the background)"
                self._in_flight = step
        return True

    def _sweep_leftovers(self) -> None:
        """Deletes the folders of cut-off saves (each as big as a checkpoint), once, before our
        first save: a run that saves owns its directory, so none is a save in progress."""
        swept, self._swept = self._swept, True
        if swept or jax.process_index() != 0 or not self.directory.exists():
            return
        for path in self.directory.iterdir():
            if _is_leftover(path):  # half-deleted is as harmless as whole: nothing reads them
                with contextlib.suppress(OSError):
                    path.rmtree()

    def wait(self) -> None:
        """Blocks until a background save is on disk; raises CheckpointError if it failed."""
        step, self._in_flight = self._in_flight, None
        # Said only when it holds the run up: the write usually ends long before this.
        what = "the last save" if step is None else f"step {step}"
        with progress(f"checkpoint: waiting for {what} to be written", min_s=1.0):
            try:
                self._manager.wait_until_finished()
            except Exception as e:
                raise CheckpointError(self._save_failed(step, e, background=True)) from e

    def _save_failed(self, step: int | None, e: BaseException, background: bool = False) -> str:
        what = f"step {step}" if step is not None else "a checkpoint"
        where = "in the background " if background else ""
        last = self.latest_step() if self.directory.is_dir() else None
        kept = "" if last is None else f"The last complete checkpoint, step {last}, is untouched. "
        return (f"saving {what} {where}to {self.directory} failed: {_reason(e)}. {kept}"
                "Fix: check free disk space and that the directory is writable, then resume.")

    def restore(self, step: int, abstract_state: Any, partial: bool = False) -> Any:
        """Reads `step` into `abstract_state`, a pytree of jax.ShapeDtypeStruct whose shardings
        may be on any mesh: each process reads only the slices its devices hold. With `partial`
        it may name a part of the saved tree ({"params": ...}, to fine-tune another run's
        weights): only that part is read."""
        self.wait()  # an async save of this very step must land first
        step_dir = self.directory / str(step)
        steps = self.all_steps()
        if step not in steps:
            raise CheckpointError(
                f"no complete checkpoint for step {step} in {self.directory} (complete: {steps or 'none'}). "
                "Fix: restore one of those steps, or start a new --run-dir.")

        def corrupt(why: str) -> CheckpointError:
            return CheckpointError(f"checkpoint {step_dir} is damaged: {why}. Fix: delete that "
                                   f"folder (or move it out of {self.directory}) to resume from "
                                   "the checkpoint before it, or restore another step.")
        try:
            saved = self._manager.metadata(step).item_metadata
            saved = saved[_ITEM] if saved is not None and _ITEM in saved else None
        except Exception as e:
            raise corrupt(_reason(e)) from e
        if saved is None:
            raise corrupt(f"its '{_ITEM}' item or that item's metadata is missing")

        problems = _tree_mismatch(_flat(saved.tree), _flat(abstract_state), partial)
        if problems:
            shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
            raise CheckpointError(
                f"checkpoint {step_dir} does not match the state being restored:\n  "
                + "\n  ".join(shown)
                + f"\nFix: resume with the config the run was saved with (see {self.directory.parent / 'config.json'}), "
                "or start a new --run-dir for the new model.")

        args = ocp.args.PyTreeRestore(abstract_state, partial_restore=partial, restore_args=(
            ocp.checkpoint_utils.construct_restore_args(abstract_state)))
        with progress(f"checkpoint: restoring step {step} from {step_dir}"):
            try:
                restored = self._manager.restore(step, args=ocp.args.Composite(**{_ITEM: args}))
            except Exception as e:
                raise corrupt(_reason(e)) from e
        return restored[_ITEM]

    def close(self) -> None:  # waits for the last save, raising if it failed
        try:
            self.wait()
        finally:
            self._manager.close()

    __exit__ = lambda self, *exc: self.close()


def read_checkpoint(run_dir: str, abstract: Any, missing: str, step: int = -1,
                    error: type = CheckpointError) -> tuple[Any, int]:
    """(`abstract`, a part of the saved state, read from `run_dir`'s checkpoint `step` (-1:
    the latest), that step); error(missing) if there is none."""
    with Checkpointer(run_dir, CheckpointConfig(async_save=False, restore_step=step)) as ckpt:
        if (at := ckpt.resume_step()) is None:
            raise error(missing)
        return ckpt.restore(at, abstract, partial=True), at


def _is_leftover(path: epath.Path) -> bool:
    """A step folder of a save that was cut off: Orbax's temporary folder, or on an object
    store (no renames, so no temporary name) a step folder without its commit file."""
    return bool(_TMP_STEP.match(path.name)) or (
        is_remote(path) and path.name.isdigit() and not (path / _COMMIT_FILE).exists())


def _refuse_foreign_directory(directory: epath.Path) -> None:
    """Raises unless `directory` is absent, empty, or holds only what Orbax writes there: Orbax
    deletes old step folders to keep the last N and replaces a force-saved step's folder, so
    someone else's files there could be destroyed."""
    if not (directory.exists() or os.path.islink(directory)):
        return
    if not directory.is_dir():
        raise CheckpointError(f"{directory} exists but is not a directory. "
                              "Fix: use another --run-dir, or move that file aside.")
    # Ours: a step folder (complete or damaged: restore tells which), the leftover of a
    # cut-off save, or Orbax's metadata folder; never a file or a local symlink.
    ours = lambda path: path.is_dir() and (is_remote(path) or not os.path.islink(path)) and (
        (path.name.isdigit() and (path / _STEP_METADATA_FILE).exists())
        or _is_leftover(path) or path.name == _ROOT_METADATA_DIR)
    foreign = [path.name for path in sorted(directory.iterdir()) if not ours(path)]
    if foreign:
        listed = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise CheckpointError(
            f"{directory} holds files that are not checkpoints of this trainer ({listed}); "
            "refusing to write there, as keeping the last N checkpoints deletes old folders. "
            "Fix: use another --run-dir, or move those files aside.")


def _flat(tree: Any) -> dict[str, Any]:
    """{"params/layers/wq": leaf} for any pytree, including Orbax's metadata trees. Orbax
    stores tuples as lists and named tuples (optax states) as dicts keyed by field name; jax
    names a list and a tuple index alike, and a named-tuple field by its name, so a saved
    tree and the live one flatten to the same keys."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path, simple=True, separator="/"): leaf for path, leaf in leaves}


def _tree_mismatch(saved: dict[str, Any], wanted: dict[str, Any], partial: bool = False) -> list[str]:
    extra = [] if partial else sorted(saved.keys() - wanted)
    problems = [f"{k}: expected, but not in the checkpoint" for k in sorted(wanted.keys() - saved)]
    problems += [f"{k}: in the checkpoint, but not expected" for k in extra]
    # A dtype change would be cast silently on read; for a resume it means the config
    # changed (say, float32 master weights became bfloat16), which we refuse.
    for key in sorted(saved.keys() & wanted.keys()):
        for attr, norm in (("shape", tuple), ("dtype", str)):
            s, w = getattr(saved[key], attr, None), getattr(wanted[key], attr, None)
            if s is not None and w is not None and norm(s) != norm(w):
                problems.append(f"{key}: {attr} {norm(s)} in checkpoint, {norm(w)} expected")
                break  # a shape mismatch is enough said
    return problems


def _flatten_config(config: dict, prefix: str = "") -> dict[str, Any]:
    return {k: v for key, value in config.items() for k, v in (
        _flatten_config(value, f"{prefix}{key}.").items() if isinstance(value, dict)
        else [(f"{prefix}{key}", value)])}


def check_run_config(run_dir: str, config: dict, may_change: frozenset[str] = frozenset(),
                     defaults: dict | None = None, keep_weights: str = "") -> None:
    """Records the run's config on the first start and refuses a resume that changes it,
    except in `may_change`'s dotted keys or prefixes ("train.steps", "mesh"): anything else
    (the model, the data) would silently make it a different experiment. `defaults` (the
    field defaults, nested alike): a key absent from the saved file that is at its default now
    is no change (the run predates the field). `keep_weights`: how to start a new run from
    these weights, said when no model key conflicts (e.g. another optimizer)."""
    # Round-trip through JSON so that the live config compares as it will read back
    # (tuples become lists; values JSON cannot hold are recorded by their str()).
    now = json.loads(json.dumps(config, default=str))
    root = run_path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "config.json"
    if not path.exists():
        write_json(path, now)
        return
    try:
        saved = read_run_config(run_dir, "--run-dir")
    except (OSError, ValueError) as e:
        raise ConfigConflictError(f"{e} Or choose a new --run-dir.") from e

    old, new = _flatten_config(saved), _flatten_config(now)
    missing = "(absent)"
    if defaults is not None:
        added = _flatten_config(json.loads(json.dumps(defaults, default=str)))
        old |= {k: added[k] for k in new.keys() - old.keys() if k in added and new[k] == added[k]}
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k, missing) != new.get(k, missing))
    conflicts = [k for k in changed if not any(k == p or k.startswith(p + ".") for p in may_change)]
    if conflicts:
        lines = [f"{k}: {json.dumps(old[k]) if k in old else missing} (saved) -> "
                 f"{json.dumps(new[k]) if k in new else missing} (now)" for k in conflicts]
        # A new run can start from these weights only if the model's shape is the same.
        keep = "" if any(k.startswith("model.") for k in conflicts) else keep_weights
        raise ConfigConflictError(
            f"{run_dir} belongs to a run with a different config:\n  " + "\n  ".join(lines)
            + "\nFix: pass the same flags to resume this run, or choose a new --run-dir."
            + (f"\n{keep}" if keep else ""))
    if changed:
        # Keep the old file: the run's history (which steps ran with which budget) lives there.
        stamp = time.strftime("%Y%m%d-%H%M%S")
        backup, n = root / f"config.{stamp}.json", 1
        while backup.exists():
            backup, n = root / f"config.{stamp}-{n}.json", n + 1
        path.copy(backup)
        write_json(path, now)


class PreemptionGuard:
    """Turns SIGTERM (what schedulers send before preempting) into `requested`: the loop saves
    at the next step boundary, where the state is whole, and exits normally. Only the main
    thread may install a handler; elsewhere the guard never requests. The signal reaches
    processes at different steps while saving is collective: combine the flag across them."""

    def __init__(self):
        self._requested, self._previous, self._installed = threading.Event(), None, False

    requested = property(lambda self: self._requested.is_set())

    def __enter__(self) -> "PreemptionGuard":
        # ValueError: the main thread of a sub-interpreter, whose signals are not ours to take.
        with contextlib.suppress(ValueError):
            if threading.current_thread() is threading.main_thread():
                self._previous = signal.signal(signal.SIGTERM, lambda *_: self._requested.set())
                self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            # `None` means the previous handler was installed from C, and Python cannot
            # reinstall it; the default action (terminate) is the honest fallback.
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self._installed = False
