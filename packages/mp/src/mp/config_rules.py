"""The rules between config keys, and the errors for unknown keys and alias conflicts.

``check_rules`` runs the rules in sorted order of the key each is about, so that every rank raises the
same first error. The rules are smp's (docs/config.md), minus those that exist only because smp
needed DistributedDataParallel switched on (see the ``ddp`` field).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

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
    """The rules between keys, in sorted order of the key each is about."""
    if c.active_microbatches is not None and c.active_microbatches > c.microbatches:
        raise _rule_error(
            "active_microbatches",
            c.active_microbatches,
            f", more than 'microbatches' ({c.microbatches})",
            f"an int from 1 to microbatches ({c.microbatches}), or null for min(pp + 2, microbatches)",
            f"lower 'active_microbatches' to at most {c.microbatches}, raise 'microbatches' to at least "
            f"{c.active_microbatches}, or leave 'active_microbatches' out",
        )
    if c.atp_mesh is not None:
        _check_atp_mesh(c)
    if c.atp_topology is not None and c.atp_mesh != "auto":
        raise _rule_error(
            "atp_topology",
            c.atp_topology,
            f" with 'atp_mesh': {show(c.atp_mesh)}",
            "atp_topology only together with atp_mesh 'auto' (the topology is what the search runs on)",
            "set 'atp_mesh' to 'auto', or remove 'atp_topology'",
        )
    if not c.auto_partition and c.default_partition is None:
        raise _rule_error(
            "auto_partition",
            False,
            " without 'default_partition'",
            "auto_partition false only together with 'default_partition' (the partition of modules "
            "outside any smp.partition context)",
            "add 'default_partition': 0 (or another index below pipeline_parallel_degree), or set "
            "'auto_partition' to true",
        )
    if c.bf16 and (c.fp16 or c.fp16_params):
        other = "fp16" if c.fp16 else "fp16_params"
        raise _rule_error(
            "bf16",
            True,
            f" together with '{other}': true",
            "bf16 true only with fp16 false and fp16_params false (one half-precision type per run)",
            f"choose one: set '{other}' to false (or remove it) to train in bf16, or set 'bf16' to false",
        )
    if c.ddp and c.horovod:
        raise _rule_error(
            "ddp",
            True,
            " together with 'horovod': true",
            "at most one of ddp and horovod (two data-parallel frameworks)",
            "remove 'horovod' (mp does data parallelism itself; horovod is smp's TensorFlow option)",
        )
    if c.default_partition is not None and c.default_partition >= c.pipeline_parallel_degree:
        pp = c.pipeline_parallel_degree
        raise _rule_error(
            "default_partition",
            c.default_partition,
            f", not a partition index for pipeline_parallel_degree {pp}",
            f"a partition index from 0 to {pp - 1} (below pipeline_parallel_degree)",
            f"set 'default_partition' below {pp}, or raise 'pipeline_parallel_degree' to at least "
            f"{c.default_partition + 1}",
        )
    if c.load_partition and c.partition_file is None:
        raise _rule_error(
            "load_partition",
            True,
            " without 'partition_file'",
            "load_partition true only together with 'partition_file'",
            "add 'partition_file': the path of the saved partition, or set 'load_partition' to false",
        )
    if c.prescaled_batch and c.optimize != "speed":
        raise _rule_error(
            "prescaled_batch",
            True,
            f" with 'optimize': {c.optimize!r}",
            "prescaled_batch true only with optimize 'speed'",
            "add 'optimize': 'speed' (smp's documented default is 'memory'), "
            "or set 'prescaled_batch' to false",
        )
    sdp = c.sharded_data_parallel_degree
    if c.shard_optimizer_state and sdp > 1:
        raise _rule_error(
            "shard_optimizer_state",
            True,
            f" together with 'sharded_data_parallel_degree': {sdp}",
            "shard_optimizer_state true only with sharded_data_parallel_degree 1",
            "remove 'shard_optimizer_state' (sharded data parallelism shards optimizer state itself), or "
            "set 'sharded_data_parallel_degree' to 1",
        )
    pp = c.pipeline_parallel_degree
    if sdp > 1 and pp > 1:
        raise _rule_error(
            "sharded_data_parallel_degree",
            sdp,
            f" together with 'pipeline_parallel_degree': {pp}",
            "sharded_data_parallel_degree > 1 only with pipeline_parallel_degree 1 (smp's rule)",
            "set 'pipeline_parallel_degree' to 1 to use sharded data parallelism, or set "
            "'sharded_data_parallel_degree' to 1",
        )


ATP_PRESETS = ("nvswitch", "dual-nvlink", "pcie")


def parse_atp_mesh(text: str) -> tuple[int, int] | None:
    """``"2x4"`` -> (2, 4); None when the text is not of that form."""
    left, sep, right = text.lower().partition("x")
    if not sep or not left.isdigit() or not right.isdigit():
        return None
    return int(left), int(right)


def _check_atp_mesh(c: ModelParallelConfig) -> None:
    tp = c.tensor_parallel_degree
    shapes = [f"'{d}x{tp // d}'" for d in range(1, tp + 1) if tp % d == 0]
    allowed = "'auto' or 'D1xD2' with D1*D2 = tensor_parallel_degree" + (
        f" ({', '.join(shapes)})" if tp > 1 else ""
    )
    assert c.atp_mesh is not None
    if tp < 2:
        raise _rule_error(
            "atp_mesh",
            c.atp_mesh,
            " with 'tensor_parallel_degree': 1",
            "atp_mesh only with tensor_parallel_degree > 1 (the mesh arranges each TP group)",
            "set 'tensor_parallel_degree' to the number of ranks of one mesh, or remove 'atp_mesh'",
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
            name = c._specs[key][0]
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
