"""The per-key part of the config schema: what each key accepts, and the error messages.

A :class:`KeySpec` sits in each ``ModelParallelConfig`` field's metadata and says the key's type, whether
None is allowed, its bounds or choices and its smp name. :func:`check_value` checks one value against
one spec and returns it normalized; everything about several keys at once lives in ``config.py``.

Type checks follow smp (an exact type: a bool is not an int, a string is not a number) with two
deliberate relaxations:

- a float key accepts an int (JSON writes ``1.0`` as ``1``);
- the three sharded-data-parallel size keys accept an integral float, because smp documents their
  defaults as ``5e8``, ``1e6`` and ``1e9`` and Python and JSON read those as floats.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from mp.errors import ConfigError

__all__ = [
    "MODEL_KWARGS",
    "UNSUPPORTED_KEYS",
    "WRAPPER_KEYS",
    "KeySpec",
    "check_value",
    "config_error",
    "describe_allowed",
    "did_you_mean",
    "show",
]

Kind = Literal["bool", "int", "float", "str"]

# Keys that are arguments of smp.DistributedModel, not config keys (scripts sometimes put them in the config).
MODEL_KWARGS = frozenset(
    {
        "trace_device",
        "trace_execution_times",
        "overlapping_allreduce",
        "backward_passes_per_step",
        "average_grads_across_microbatches",
        "bucket_cap_mb",
        "trace_memory_usage",
        "broadcast_buffers",
        "gradient_as_bucket_view",
        "find_unused_parameters",
    }
)

# Internal smp keys that mp does not take, with why.
UNSUPPORTED_KEYS = {
    "_sharded_data_parallelism_config": "it is an internal smp (DeepSpeed) dict that mp does not use; "
    "use the sdp_* keys instead",
}

# Keys of the SageMaker 'distribution' nesting, which load_config unwraps but from_dict does not.
WRAPPER_KEYS = frozenset({"smdistributed", "modelparallel", "parameters", "enabled", "mpi"})

_MAX_SHOWN = 80


@dataclass(frozen=True, kw_only=True)
class KeySpec:
    """What one config key accepts."""

    kind: Kind
    """The value's type: bool, int, float or str."""
    key: str | None = None
    """The smp key when it differs from the field name (e.g. '_match_weights' for match_weights)."""
    aliases: tuple[str, ...] = ()
    """Other names accepted for the key in a dict (e.g. 'partitions')."""
    nullable: bool = False
    """Whether None is allowed (it means: derive the value, or: not given)."""
    minimum: float | None = None
    """Inclusive lower bound for numbers."""
    maximum: float | None = None
    """Inclusive upper bound for numbers."""
    exclusive_minimum: float | None = None
    """Exclusive lower bound for numbers."""
    choices: tuple[str, ...] = ()
    """The allowed strings for a str key (empty: any string)."""
    integral_float: bool = False
    """Whether an int key also takes a float with an integral value (5e8)."""
    example: str = ""
    """A valid value to show in a fix, as JSON text."""


def show(value: object) -> str:
    """``repr(value)`` cut to a readable length."""
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + "..."


def _type_name(value: object) -> str:
    if value is None:
        return "null"
    name = type(value).__name__
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def describe_allowed(spec: KeySpec) -> str:
    """What a key allows, in words ("an int >= 1", "one of 'memory', 'speed'", ...)."""
    if spec.kind == "bool":
        text = "true or false"
    elif spec.kind == "str":
        text = "one of " + ", ".join(repr(c) for c in spec.choices) if spec.choices else "a string"
    else:
        text = "an int" if spec.kind == "int" else "a number"
        bounds = []
        if spec.exclusive_minimum is not None:
            bounds.append(f"> {_num(spec.exclusive_minimum)}")
        if spec.minimum is not None:
            bounds.append(f">= {_num(spec.minimum)}")
        if spec.maximum is not None:
            bounds.append(f"<= {_num(spec.maximum)}")
        if bounds:
            text += " " + " and ".join(bounds)
    if spec.nullable:
        text += ", or null (derived / not given)"
    return text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def config_error(key: str | None, value: object, problem: str, allowed: str, fix: str) -> ConfigError:
    """A :class:`ConfigError` whose message names the key, the value, what is allowed and the fix."""
    subject = "config" if key is None else f"config key '{key}'"
    message = f"{subject}: got {show(value)} ({_type_name(value)}){problem}. Allowed: {allowed}. Fix: {fix}"
    return ConfigError(message, key=key, value=value, allowed=allowed, fix=fix)


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to ``word`` (case-insensitive), or None when nothing is close."""
    pool = sorted(set(candidates))
    lowered = {c.lower(): c for c in pool}
    if word.lower() in lowered:
        return lowered[word.lower()]
    hits = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[hits[0]] if hits else None


def _type_fix(key: str, spec: KeySpec, value: object) -> str:
    example = spec.example
    if spec.kind == "bool":
        if isinstance(value, int | float) and value in (0, 1):
            return f"write '{key}': {'true' if value else 'false'} (a JSON boolean), not {show(value)}"
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return f"write '{key}': {value.strip().lower()} without quotes"
        return f"set '{key}' to true or false, e.g. '{key}': {example}"
    if isinstance(value, bool):
        return f"'{key}' is a number, not a boolean: write e.g. '{key}': {example}"
    if isinstance(value, str) and spec.kind in ("int", "float"):
        try:
            float(value)
        except ValueError:
            pass
        else:
            return f"write the number without quotes, e.g. '{key}': {value.strip()}"
    if spec.kind == "int" and isinstance(value, float):
        return f"'{key}' counts something, so write a whole number, e.g. '{key}': {example}"
    return f"set '{key}' to {describe_allowed(spec)}, e.g. '{key}': {example}"


def check_value(key: str, spec: KeySpec, value: object) -> object:
    """Check ``value`` for the key ``key`` (as the user wrote it); return it normalized.

    Normalized means: a float for a float key, an int for an int key (integral floats where allowed),
    the value itself otherwise. Raises :class:`ConfigError` on the first problem.
    """
    allowed = describe_allowed(spec)
    if value is None:
        if spec.nullable:
            return None
        raise config_error(key, value, "", allowed, _type_fix(key, spec, value))
    if spec.kind == "bool":
        if type(value) is not bool:
            raise config_error(key, value, "", allowed, _type_fix(key, spec, value))
        return value
    if spec.kind == "str":
        if not isinstance(value, str):
            raise config_error(key, value, "", allowed, _type_fix(key, spec, value))
        if spec.choices and value not in spec.choices:
            close = did_you_mean(value, spec.choices)
            hint = f"did you mean {close!r}? " if close is not None else ""
            raise config_error(
                key, value, " which is not an allowed choice", allowed, f"{hint}set '{key}' to {allowed}"
            )
        return value
    number = _as_number(spec, value)
    if number is None:
        raise config_error(key, value, "", allowed, _type_fix(key, spec, value))
    _check_bounds(key, spec, value, number, allowed)
    return number


def _as_number(spec: KeySpec, value: object) -> int | float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    if spec.kind == "float":
        try:
            return float(value)
        except OverflowError:  # an int too large for a float: out of range either way
            return math.inf
    if isinstance(value, numbers.Integral):
        return int(value)
    if spec.integral_float and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _check_bounds(key: str, spec: KeySpec, value: object, number: float, allowed: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise config_error(
            key,
            value,
            " which is not finite",
            allowed,
            f"set '{key}' to a finite number, e.g. {spec.example}",
        )
    low_ok = (spec.minimum is None or number >= spec.minimum) and (
        spec.exclusive_minimum is None or number > spec.exclusive_minimum
    )
    high_ok = spec.maximum is None or number <= spec.maximum
    if not (low_ok and high_ok):
        raise config_error(
            key, value, " which is out of range", allowed, f"set '{key}' to {allowed}, e.g. {spec.example}"
        )
