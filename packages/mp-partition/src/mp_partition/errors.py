"""Errors raised by mp_partition.

Every user-facing error names the value it received, what was expected, and how to fix it. They all derive
from :class:`PartitionError`, itself a :class:`ValueError`, so ``except ValueError`` keeps working in
scripts written for smp.
"""

from __future__ import annotations

__all__ = [
    "InvalidPartitionIDError",
    "ModelTooSmallError",
    "PartitionError",
    "PlanFormatError",
    "PlanMismatchError",
    "SharedParameterPartitionError",
    "TracingError",
    "UnknownConfigFieldError",
    "UnknownModulePathError",
]


class PartitionError(ValueError):
    """Base class of every error raised by mp_partition."""


class InvalidPartitionIDError(PartitionError):
    """A partition index is not an integer in ``[0, num_partitions)``."""

    def __init__(self, index: object, num_partitions: int | None = None, where: str = "") -> None:
        self.index = index
        self.num_partitions = num_partitions
        self.where = where
        place = f" for {where}" if where else ""
        if num_partitions is None:
            expected = "a non-negative int"
            fix = "use 0 <= index < pipeline_parallel_degree"
        else:
            expected = f"an int in [0, {num_partitions})"
            fix = (
                f"use an index between 0 and {num_partitions - 1}, or raise pipeline_parallel_degree "
                f"above {index}"
                if isinstance(index, int) and not isinstance(index, bool) and index >= 0
                else f"use an index between 0 and {num_partitions - 1}"
            )
        super().__init__(f"partition index {index!r}{place} is invalid: expected {expected}; {fix}")


class SharedParameterPartitionError(PartitionError):
    """Two modules share parameters but were manually put on different partitions."""

    def __init__(self, first: str, first_index: int, second: str, second_index: int) -> None:
        self.first = first
        self.first_index = first_index
        self.second = second
        self.second_index = second_index
        super().__init__(
            f"modules {first!r} (partition {first_index}) and {second!r} (partition {second_index}) share "
            "parameters, so they must be on the same partition; put both in the same smp.partition(...) "
            "context or call set_partition() on one of them with the other's index"
        )


class ModelTooSmallError(PartitionError):
    """The model cannot be split into the requested number of partitions."""

    def __init__(self, num_partitions: int, detail: str) -> None:
        self.num_partitions = num_partitions
        super().__init__(
            f"Model is too small to split into {num_partitions} partitions! {detail}; use fewer partitions "
            "(pipeline_parallel_degree), pass allow_empty_partitions=True, or partition manually"
        )


class UnknownModulePathError(PartitionError, KeyError):
    """A module path is not part of a partition plan."""

    def __init__(self, path: str, suggestion: str | None = None) -> None:
        self.path = path
        hint = f" (the nearest module in the plan is {suggestion!r})" if suggestion is not None else ""
        super().__init__(
            f"module path {path!r} is not in this partition plan{hint}: expected a name from "
            "model.named_modules(); check that the plan was computed for this model"
        )

    def __str__(self) -> str:  # KeyError would otherwise print the repr of the message
        return str(self.args[0])


class PlanFormatError(PartitionError):
    """A saved plan cannot be read."""


class PlanMismatchError(PartitionError):
    """A saved plan does not describe the given model."""


class TracingError(PartitionError):
    """The tracing forward pass failed or was given unusable inputs."""


class UnknownConfigFieldError(PartitionError):
    """A config override names a field the architecture's config does not have."""

    def __init__(self, field: str, model_type: str, nearest: str | None) -> None:
        self.field = field
        self.model_type = model_type
        self.nearest = nearest
        fix = f"did you mean {nearest!r}? (--set {nearest}=...)" if nearest is not None else "fix the name"
        super().__init__(
            f"--set {field}: the {model_type} config has no field {field!r}; expected a field of "
            f"transformers' {model_type} config (a key of its config.json); {fix}"
        )
