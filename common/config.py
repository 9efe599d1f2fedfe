"""What common/ needs to know of a config field, declared on the field itself.

    lr: float = resumable(2e-3)                      # a resumed run may change it
    b1: float = knob(0.9, "[0, 1)")                  # its allowed range (see `check_ranges`)
    dtype: str = how("float32")                      # how to compute, not what

A field without a range keeps its default's sign (> 0, or >= 0 when the default is 0). A
`how` field may change on resume, and with --init-from or --init-from-hf stays this run's
flag while the rest of the model is the source's. A section (`mesh`) may be a knob as a whole.
"""
import dataclasses
import math


class ConfigError(ValueError):
    """A flag's value cannot work; the message names the flag, the value and the fix."""


def need(ok, message: str) -> None:  # the message names the flag and the fix
    if not ok:
        raise ConfigError(message)


def knob(default, range: str = "", *, resume: bool = False, compute: bool = False,
         added: bool = False):
    """A dataclass field with its range and what a resumed or initialised run may change
    (`added`: a part of the model that --init-from-hf may add where the folder lacks it).
    `default` may be a dataclass (a section), made afresh for each config."""
    kind = {"default_factory": default} if isinstance(default, type) else {"default": default}
    return dataclasses.field(**kind, metadata={"range": range, "resume": resume,
                                               "compute": compute, "added": added})


def resumable(default, range: str = ""):
    """A knob that a resumed run may change: how long, how often, where, what it prints."""
    return knob(default, range, resume=True)


def how(default, range: str = ""):
    """A knob that says how to compute, not what (dtype, remat, kernels): see the module."""
    return knob(default, range, resume=True, compute=True)


def _fields(cls, prefix: str = ""):
    """(dotted path, field) of every field of `cls`, into its sections (dataclass defaults)."""
    for f in dataclasses.fields(cls):
        yield prefix + f.name, f
        sub = f.default_factory if f.default_factory is not dataclasses.MISSING else f.default
        sub = getattr(sub, "func", sub)  # a section made with a few fields set (a partial)
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            yield from _fields(sub, f"{prefix}{f.name}.")


def may_change(cls) -> frozenset[str]:
    """Dotted keys of a saved run config (config.json) that a resumed run may change: how
    long, how often, on what mesh and how it computes. Anything else must match."""
    return frozenset(p for p, f in _fields(cls) if f.metadata.get("resume"))


def compute_fields(model_cls) -> tuple[str, ...]:
    """The model fields that say how to compute: kept from this run's flags (see `how`)."""
    return tuple(f.name for f in dataclasses.fields(model_cls) if f.metadata.get("compute"))


def check_ranges(cfg) -> None:
    """Every number in the config is finite and in its field's range, else a ConfigError
    naming the flag. Ranges: "> 0", ">= 0", "[0, 1)", ..., or "v or RANGE" (v meaning
    something, as -1 "the paper's"). Integers stay below 2^31: int32 on the device. The
    mesh's sizes are checked where they are resolved (common/mesh.py)."""
    for path, f in _fields(type(cfg)):
        if path.startswith("mesh."):
            continue
        v = cfg
        for name in path.split("."):
            v = getattr(v, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        rule = f.metadata.get("range") or (">= 0" if f.default == 0 else "> 0"
                                           if f.default > 0 else None)
        if rule is None:
            continue
        if not _within(v, rule) or (isinstance(v, int) and v >= 2**31):
            raise ConfigError(f"--{path.replace('_', '-')} {v}: must be {rule}" + (
                " and below 2^31" if isinstance(v, int) else ", a finite number")
                + f" (the default is {f.default}).")


def _within(v: float, rule: str) -> bool:
    if " or " in rule:
        special, rule = rule.split(" or ")
        if v == float(special):
            return True
    if not math.isfinite(v):
        return False
    if rule[0] in "[(":
        lo, hi = (float(x) for x in rule[1:-1].split(","))
        return (lo <= v if rule[0] == "[" else lo < v) and (v <= hi if rule[-1] == "]" else v < hi)
    op, x = rule.split()
    return v > float(x) if op == ">" else v >= float(x)
