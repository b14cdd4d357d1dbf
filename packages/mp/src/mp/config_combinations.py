"""The feature combinations mp refuses: one table per kind, one row per refusal.

``REFUSED``: combinations of config keys a config may not ask for. Each row names the combination (the
key the error is about, and the other keys involved), says why it is refused and how to fix it.
``mp.config_rules.check_rules`` raises the first row that applies (rows in sorted order of their key, as
every other rule, so that every rank raises the same first error); the error is a
:class:`~mp.errors.ConfigError` whose message names the keys and values, what is allowed and the fix.

``REFUSED_USES``: calls that a valid config does not support (the full fp16/bf16 optimizer state under
tensor parallelism, DDP's join under sharded data parallelism, ...), raised where the call runs, from
its row (the combination, why, the fix, the error class scripts catch).

docs/config.md lists the rows of both (a test keeps the lists complete).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mp.config_schema import config_error, show
from mp.errors import (
    ConfigError,
    FullHalfStateUnderTPError,
    SMPCheckpointError,
    SMPUnsupportedError,
)

if TYPE_CHECKING:
    from mp.config_model import ModelParallelConfig

__all__ = ["REFUSED", "REFUSED_USES", "RefusedCombination", "RefusedUse"]

Text = Callable[["ModelParallelConfig"], str]


@dataclass(frozen=True, kw_only=True)
class RefusedCombination:
    """One refused combination of config keys."""

    key: str
    """The key the error is about (its value is the one named)."""
    others: tuple[str, ...]
    """The other keys of the combination (named in the message)."""
    combination: str
    """The combination in words, for the docs' table."""
    applies: Callable[[ModelParallelConfig], bool]
    """Whether a config asks for this combination."""
    problem: Text
    """What is wrong with this config (follows "config key 'KEY': got VALUE (TYPE)")."""
    why: Text
    """What is allowed, and why."""
    fix: Text
    """How to fix the config."""

    def error(self, c: ModelParallelConfig) -> ConfigError:
        """The error for config ``c``, which asks for this combination."""
        return config_error(self.key, c.to_dict()[self.key], self.problem(c), self.why(c), self.fix(c))


def _half_other(c: ModelParallelConfig) -> str:
    return "fp16" if c.fp16 else "fp16_params"


REFUSED: tuple[RefusedCombination, ...] = (
    RefusedCombination(
        key="active_microbatches",
        others=("microbatches",),
        combination="active_microbatches above microbatches",
        applies=lambda c: c.active_microbatches is not None and c.active_microbatches > c.microbatches,
        problem=lambda c: f", more than 'microbatches' ({c.microbatches})",
        why=lambda c: (
            f"an int from 1 to microbatches ({c.microbatches}), or null for min(pp + 2, microbatches)"
        ),
        fix=lambda c: (
            f"lower 'active_microbatches' to at most {c.microbatches}, raise 'microbatches' to at least "
            f"{c.active_microbatches}, or leave 'active_microbatches' out"
        ),
    ),
    RefusedCombination(
        key="atp_mesh",
        others=("tensor_parallel_degree",),
        combination="atp_mesh with tensor_parallel_degree 1",
        applies=lambda c: c.atp_mesh is not None and c.tensor_parallel_degree < 2,
        problem=lambda c: " with 'tensor_parallel_degree': 1",
        why=lambda c: "atp_mesh only with tensor_parallel_degree > 1 (the mesh arranges each TP group)",
        fix=lambda c: "set 'tensor_parallel_degree' to the number of ranks of one mesh, or remove 'atp_mesh'",
    ),
    RefusedCombination(
        key="atp_topology",
        others=("atp_mesh",),
        combination="atp_topology without atp_mesh 'auto'",
        applies=lambda c: c.atp_topology is not None and c.atp_mesh != "auto",
        problem=lambda c: f" with 'atp_mesh': {show(c.atp_mesh)}",
        why=lambda c: (
            "atp_topology only together with atp_mesh 'auto' (the topology is what the search runs on)"
        ),
        fix=lambda c: "set 'atp_mesh' to 'auto', or remove 'atp_topology'",
    ),
    RefusedCombination(
        key="auto_partition",
        others=("default_partition",),
        combination="auto_partition false without default_partition",
        applies=lambda c: not c.auto_partition and c.default_partition is None,
        problem=lambda c: " without 'default_partition'",
        why=lambda c: (
            "auto_partition false only together with 'default_partition' (the partition of modules "
            "outside any smp.partition context)"
        ),
        fix=lambda c: (
            "add 'default_partition': 0 (or another index below pipeline_parallel_degree), or set "
            "'auto_partition' to true"
        ),
    ),
    RefusedCombination(
        key="bf16",
        others=("fp16", "fp16_params"),
        combination="bf16 with fp16 or fp16_params",
        applies=lambda c: c.bf16 and (c.fp16 or c.fp16_params),
        problem=lambda c: f" together with '{_half_other(c)}': true",
        why=lambda c: (
            "bf16 true only with fp16 false and fp16_params false (one half-precision type per run)"
        ),
        fix=lambda c: (
            f"choose one: set '{_half_other(c)}' to false (or remove it) to train in bf16, or set 'bf16' to "
            "false"
        ),
    ),
    RefusedCombination(
        key="ddp",
        others=("horovod",),
        combination="ddp with horovod",
        applies=lambda c: c.ddp and c.horovod,
        problem=lambda c: " together with 'horovod': true",
        why=lambda c: "at most one of ddp and horovod (two data-parallel frameworks)",
        fix=lambda c: (
            "remove 'horovod' (mp does data parallelism itself; horovod is smp's TensorFlow option)"
        ),
    ),
    RefusedCombination(
        key="default_partition",
        others=("pipeline_parallel_degree",),
        combination="default_partition not below pipeline_parallel_degree",
        applies=lambda c: (
            c.default_partition is not None and c.default_partition >= c.pipeline_parallel_degree
        ),
        problem=lambda c: (
            f", not a partition index for pipeline_parallel_degree {c.pipeline_parallel_degree}"
        ),
        why=lambda c: (
            f"a partition index from 0 to {c.pipeline_parallel_degree - 1} (below pipeline_parallel_degree)"
        ),
        fix=lambda c: (
            f"set 'default_partition' below {c.pipeline_parallel_degree}, or raise "
            f"'pipeline_parallel_degree' to at least {(c.default_partition or 0) + 1}"
        ),
    ),
    RefusedCombination(
        key="load_partition",
        others=("partition_file",),
        combination="load_partition without partition_file",
        applies=lambda c: c.load_partition and c.partition_file is None,
        problem=lambda c: " without 'partition_file'",
        why=lambda c: "load_partition true only together with 'partition_file'",
        fix=lambda c: (
            "add 'partition_file': the path of the saved partition, or set 'load_partition' to false"
        ),
    ),
    RefusedCombination(
        key="pipeline",
        others=("tensor_parallel_degree",),
        combination="pipeline 'zero_bubble' with tensor parallelism",
        applies=lambda c: c.pipeline == "zero_bubble" and c.tensor_parallel_degree > 1,
        problem=lambda c: f" with 'tensor_parallel_degree': {c.tensor_parallel_degree}",
        why=lambda c: (
            "'zero_bubble' only with tensor_parallel_degree 1 (its deferred weight gradients run whenever "
            "a rank would wait, out of the TP group's one order of events)"
        ),
        fix=lambda c: "set 'pipeline' to 'interleaved', or 'tensor_parallel_degree' to 1",
    ),
    RefusedCombination(
        key="prescaled_batch",
        others=("optimize",),
        combination="prescaled_batch without optimize 'speed'",
        applies=lambda c: c.prescaled_batch and c.optimize != "speed",
        problem=lambda c: f" with 'optimize': {c.optimize!r}",
        why=lambda c: "prescaled_batch true only with optimize 'speed'",
        fix=lambda c: (
            "add 'optimize': 'speed' (smp's documented default is 'memory'), "
            "or set 'prescaled_batch' to false"
        ),
    ),
    RefusedCombination(
        key="shard_optimizer_state",
        others=("sharded_data_parallel_degree",),
        combination="shard_optimizer_state with sharded data parallelism",
        applies=lambda c: c.shard_optimizer_state and c.sharded_data_parallel_degree > 1,
        problem=lambda c: f" together with 'sharded_data_parallel_degree': {c.sharded_data_parallel_degree}",
        why=lambda c: "shard_optimizer_state true only with sharded_data_parallel_degree 1",
        fix=lambda c: (
            "remove 'shard_optimizer_state' (sharded data parallelism shards optimizer state itself), or set "
            "'sharded_data_parallel_degree' to 1"
        ),
    ),
    RefusedCombination(
        key="sharded_data_parallel_degree",
        others=("pipeline_parallel_degree",),
        combination="sharded data parallelism with pipeline parallelism",
        applies=lambda c: c.sharded_data_parallel_degree > 1 and c.pipeline_parallel_degree > 1,
        problem=lambda c: f" together with 'pipeline_parallel_degree': {c.pipeline_parallel_degree}",
        why=lambda c: "sharded_data_parallel_degree > 1 only with pipeline_parallel_degree 1 (smp's rule)",
        fix=lambda c: (
            "set 'pipeline_parallel_degree' to 1 to use sharded data parallelism, or set "
            "'sharded_data_parallel_degree' to 1"
        ),
    ),
)
"""Every refused combination, in sorted order of ``key`` (rows of one key in the order they are checked)."""


@dataclass(frozen=True, kw_only=True)
class RefusedUse:
    """A call refused under a combination of settings that is itself valid."""

    combination: str
    """The call and the settings, in words (the docs' table)."""
    keys: tuple[str, ...]
    """The config keys involved."""
    why: str
    """Why the call is refused under them."""
    fix: str
    """What to do instead."""
    error: type[Exception]
    """The exception raised (smp's class, where scripts catch one)."""

    def refusal(self, subject: str) -> Exception:
        """The error for ``subject`` (the call and the values that make this row apply, e.g.
        ``"optimizer.state_dict() under bf16 with tensor_parallel_degree 2"``)."""
        return self.error(f"{subject}: {self.why}. Fix: {self.fix}")


REFUSED_USES: dict[str, RefusedUse] = {
    "full_half_state_under_tp": RefusedUse(
        combination="the full fp16/bf16 optimizer state under tensor parallelism",
        keys=("fp16", "bf16", "tensor_parallel_degree"),
        why=(
            "the fp32 masters and their optimizer state are this TP rank's shards, not translated to the "
            "original model's names (smp refused the full optimizer state under tensor parallelism too), so "
            "a full checkpoint would load TP rank 0's shards on every TP rank"
        ),
        fix=(
            "save and load optimizer.local_state_dict() (smp.save_checkpoint(partial=True), "
            "smp.save(..., partial=True)); model.state_dict() gives the full weights"
        ),
        error=FullHalfStateUnderTPError,
    ),
    "full_half_state_under_zero": RefusedUse(
        combination="the full fp16/bf16 optimizer state under shard_optimizer_state",
        keys=("fp16", "bf16", "shard_optimizer_state"),
        why="each rank holds only its share of the optimizer state, as in smp",
        fix=(
            "save optimizer.local_state_dict() (smp.save(..., partial=True) or "
            "smp.save_checkpoint(partial=True))"
        ),
        error=SMPCheckpointError,
    ),
    "ddp_feature_under_sdp": RefusedUse(
        combination="model.join() or model.register_comm_hook() under sharded data parallelism",
        keys=("sharded_data_parallel_degree",),
        why=(
            "mp's sharded data parallelism (FSDP2) reduce-scatters gradients itself and runs neither DDP's "
            "join nor a communication hook"
        ),
        fix=(
            "remove the call, or set 'sharded_data_parallel_degree' to 1 (plain data parallelism supports it)"
        ),
        error=SMPUnsupportedError,
    ),
    "comm_hook_under_tp": RefusedUse(
        combination="model.register_comm_hook() under tensor parallelism",
        keys=("tensor_parallel_degree",),
        why=(
            "mp applies a communication hook to the data-parallel reduction of tensor_parallel_degree 1 only "
            "(with TP, shards are reduced over another group)"
        ),
        fix="drop the hook, or set 'tensor_parallel_degree' to 1",
        error=SMPUnsupportedError,
    ),
}
"""Every refused call, by name (callers raise ``REFUSED_USES[name].refusal(subject)``)."""
