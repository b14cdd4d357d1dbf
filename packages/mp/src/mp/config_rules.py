"""The rules between config keys, and the errors for unknown keys and alias conflicts.

``check_rules`` runs the rules in sorted order of the key each is about, so that every rank raises the
same first error. The rules are smp's (docs/config.md), minus those that exist only because smp
needed DistributedDataParallel switched on (see the ``ddp`` field).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from mp.config_combinations import REFUSED, RefusedCombination
from mp.config_schema import MODEL_KWARGS, UNSUPPORTED_KEYS, WRAPPER_KEYS, config_error, did_you_mean, show
from mp.errors import ConfigError

if TYPE_CHECKING:
    from mp.config_model import ModelParallelConfig

__all__ = ["alias_conflict", "check_rules", "log_resolutions", "not_built", "refuse_not_built", "unknown_key"]

logger = logging.getLogger("mp.config")


# --------------------------------------------------------------------------- error builders
def unknown_key(key: str, value: object, names: Mapping[str, str], n_keys: int) -> ConfigError:
    """The error for a key that is not a config key or alias (with a suggestion where one fits)."""
    allowed = f"the {n_keys} config keys of ModelParallelConfig (docs/config.md)"
    if key in MODEL_KWARGS:
        problem = ", an argument of smp.DistributedModel, not a config key"
        fix = f"remove it from the config and pass smp.DistributedModel(model, {key}={show(value)})"
    elif key in UNSUPPORTED_KEYS:
        problem = ", an internal smp key that mp does not support"
        fix = f"remove it: {UNSUPPORTED_KEYS[key]}"
    elif key in WRAPPER_KEYS:
        problem = ", which belongs to the SageMaker 'distribution' nesting, not to the parameters"
        fix = (
            "pass the whole dict to smp.init / mp.config.load_config (which unwrap it), "
            "or only its 'parameters'"
        )
    else:
        close = did_you_mean(key, names)
        problem = ""
        if close is not None:
            problem = f": did you mean '{close}'?"
            fix = f"rename '{key}' to '{close}'"
        else:
            fix = f"remove '{key}'; the keys are listed in docs/config.md"
    end = "" if problem.endswith("?") else "."
    message = f"unknown config key '{key}' (value {show(value)}){problem}{end} Allowed: {allowed}. Fix: {fix}"
    return ConfigError(message, key=key, value=value, allowed=allowed, fix=fix)


def alias_conflict(key_a: str, val_a: object, key_b: str, val_b: object) -> ConfigError:
    """The error for two names of one key (e.g. partitions and pipeline_parallel_degree) that disagree."""
    allowed = f"only one of '{key_a}' and '{key_b}' (they are the same setting), or both with the same value"
    fix = f"remove '{key_a}' or '{key_b}'"
    message = (
        f"config keys '{key_a}' and '{key_b}' name the same setting but got different values: "
        f"'{key_a}' = {show(val_a)}, '{key_b}' = {show(val_b)}. Allowed: {allowed}. Fix: {fix}"
    )
    return ConfigError(message, key=key_a, value=val_a, allowed=allowed, fix=fix)


def _rule_error(key: str, value: object, problem: str, allowed: str, fix: str) -> ConfigError:
    return config_error(key, value, problem, allowed, fix)


# ---------------------------------------------------------------------------- cross-key rules
def check_rules(c: ModelParallelConfig) -> None:
    """The rules between keys, in sorted order of the key each is about: the refused combinations
    (mp.config_combinations) and the atp_mesh shape."""
    rules: list[tuple[str, Callable[[ModelParallelConfig], None]]] = [
        *((row.key, _refusing(row)) for row in REFUSED),
        ("atp_mesh", _check_atp_mesh),
    ]
    for _, rule in sorted(rules, key=lambda r: r[0]):  # stable: a key's rows before its value rule
        rule(c)


def _refusing(row: RefusedCombination) -> Callable[[ModelParallelConfig], None]:
    def rule(c: ModelParallelConfig) -> None:
        if row.applies(c):
            raise row.error(c)

    return rule


ATP_PRESETS = ("nvswitch", "dual-nvlink", "pcie")


def parse_atp_mesh(text: str) -> tuple[int, int] | None:
    """``"2x4"`` -> (2, 4); None when the text is not of that form."""
    left, sep, right = text.lower().partition("x")
    if not sep or not left.isdigit() or not right.isdigit():
        return None
    return int(left), int(right)


def _check_atp_mesh(c: ModelParallelConfig) -> None:
    """The mesh shape fits the TP degree (atp_mesh with tensor_parallel_degree 1 is a refused
    combination, checked before)."""
    if c.atp_mesh is None:
        return
    tp = c.tensor_parallel_degree
    shapes = [f"'{d}x{tp // d}'" for d in range(1, tp + 1) if tp % d == 0]
    allowed = "'auto' or 'D1xD2' with D1*D2 = tensor_parallel_degree" + (
        f" ({', '.join(shapes)})" if tp > 1 else ""
    )
    if c.atp_mesh == "auto":
        return
    shape = parse_atp_mesh(c.atp_mesh)
    if shape is None or shape[0] < 1 or shape[1] < 1 or shape[0] * shape[1] != tp:
        raise _rule_error(
            "atp_mesh",
            c.atp_mesh,
            f", not a mesh of tensor_parallel_degree {tp} ranks",
            allowed,
            f"use one of {', '.join(shapes)}, or 'auto' to let the search choose",
        )


# Keys whose feature mp has not built yet. A script that sets one must not train as if it had: smp.init
# refuses it (``refuse_not_built``). Each entry: the key, when it counts as set, what smp did with it.
# A key leaves this list when its feature is built.
_NOT_BUILT: tuple[tuple[str, Callable[[ModelParallelConfig], object], str], ...] = (
    (
        "_fp32_grad_accumulation",
        lambda c: c.fp32_grad_accumulation,
        "accumulates half-precision gradients in fp32",
    ),
    (
        "_shard_offloaded_activations",
        lambda c: c.shard_offloaded_activations,
        "shards offloaded activations over tensor-parallel ranks",
    ),
    (
        "sdp_reduce_bucket_size",
        lambda c: c.sdp_reduce_bucket_size != 500_000_000,
        "sets the gradient bucket size under sharded data parallelism; mp's sharding (FSDP2) reduce-scatters "
        "the gradients of each transformer block as one bucket and has no bucket-size setting",
    ),
    (
        "task_level_activation_loading_horizon",
        lambda c: c.task_level_activation_loading_horizon is not None,
        "sets a per-task loading horizon for offloaded activations",
    ),
)


def not_built(c: ModelParallelConfig) -> list[str]:
    """The keys set in ``c`` (to a value other than smp's default) whose feature mp does not build yet."""
    return [key for key, active, _ in _NOT_BUILT if active(c)]


def refuse_not_built(c: ModelParallelConfig) -> None:
    """Raise a :class:`ConfigError` for the first key (in sorted order) set to a feature mp does not build.

    ``smp.init`` calls it: the config object itself accepts every valid smp value (so configs can be read,
    compared and documented), but training must not start as if the feature were on."""
    for key, active, does in _NOT_BUILT:
        if active(c):
            name = c.specs()[key][0]
            value = getattr(c, name)
            others = [k for k in not_built(c) if k != key]
            also = f" (also set and not built: {', '.join(others)})" if others else ""
            default = c.__dataclass_fields__[name].default
            raise _rule_error(
                key,
                value,
                f": in smp this key {does}; mp does not build that yet{also}",
                f"{show(default)} (smp's default) until mp builds it; docs/memory.md lists what is built",
                f"remove '{key}' from the config (training then runs without that feature)",
            )


def log_resolutions(c: ModelParallelConfig) -> None:
    """Log what construction decided for the user (deprecations, forced or disabled options). Keys whose
    feature is not built are refused by ``smp.init`` (``refuse_not_built``), not logged."""
    if c.fp16_params:
        logger.warning("config key 'fp16_params' is deprecated in smp; use 'fp16': true instead")
    if c.resolved_pipeline != c.pipeline:
        logger.info(
            "pipeline 'simple' needs every microbatch active, but active_microbatches=%d < microbatches=%d: "
            "using the 'interleaved' pipeline",
            c.resolved_active_microbatches,
            c.microbatches,
        )
    if c.partition_file is not None and c.pipeline_parallel_degree == 1:
        logger.info("partition_file has no effect with pipeline_parallel_degree 1: nothing is partitioned")
    if c.checkpoint_attentions and c.pipeline_parallel_degree > 1:
        logger.info("checkpoint_attentions is disabled because pipeline_parallel_degree > 1")
