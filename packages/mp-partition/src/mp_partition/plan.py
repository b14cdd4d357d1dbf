"""The partition plan: which pipeline rank owns each module, with per-partition totals; saved as JSON."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

from torch import nn

from ._walk import walk_modules
from .errors import PlanFormatError, PlanMismatchError, UnknownModulePathError

__all__ = ["PartitionPlan", "PartitionStats", "PlanInputs", "PlanNode", "model_fingerprint"]

FORMAT = "mp_partition.plan"
FORMAT_VERSION = 1


def model_fingerprint(model: nn.Module) -> str:
    """A hash of the model's structure: module paths and classes, parameter and buffer names and shapes."""
    digest = hashlib.sha256()
    for entry in walk_modules(model):
        digest.update(f"{','.join(entry.aliases)}:{type(entry.module).__qualname__}\n".encode())
        for name, p in entry.module._parameters.items():
            if p is not None:
                digest.update(f"  p {name} {tuple(p.shape)} {p.dtype}\n".encode())
        for name, b in entry.module._buffers.items():
            if b is not None:
                digest.update(f"  b {name} {tuple(b.shape)} {b.dtype}\n".encode())
    return digest.hexdigest()[:32]


@dataclass(frozen=True)
class PartitionStats:
    """Totals of one partition (pipeline rank). Costs are normalized: all partitions sum to 1."""

    index: int
    cost: float
    """Sum of the own normalized costs of the nodes on this partition."""
    num_modules: int
    num_parameters: int
    parameter_bytes: int
    buffer_bytes: int
    activation_bytes: int
    """Activation memory of one traced forward pass (the trace's batch), 0 when not traced."""
    predicted_time_s: float | None = None
    """Forward + backward seconds of one microbatch on this stage, from the timed step, with the
    remote-call overhead the stage carries; None when times were not measured."""
    measured_time_s: float | None = None
    """The same, measured by the pipeline timeline of the first steps (filled in by the runtime)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "predicted_time_s": self.predicted_time_s,
            "measured_time_s": self.measured_time_s,
            "index": self.index,
            "cost": self.cost,
            "num_modules": self.num_modules,
            "num_parameters": self.num_parameters,
            "parameter_bytes": self.parameter_bytes,
            "buffer_bytes": self.buffer_bytes,
            "activation_bytes": self.activation_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PartitionStats:
        return cls(
            index=int(d["index"]),
            cost=float(d["cost"]),
            num_modules=int(d["num_modules"]),
            num_parameters=int(d["num_parameters"]),
            parameter_bytes=int(d["parameter_bytes"]),
            buffer_bytes=int(d["buffer_bytes"]),
            activation_bytes=int(d["activation_bytes"]),
            predicted_time_s=_opt_float(d.get("predicted_time_s")),
            measured_time_s=_opt_float(d.get("measured_time_s")),
        )


@dataclass(frozen=True)
class PlanInputs:
    """What a plan was computed from."""

    method: str
    """``auto`` or ``manual``."""
    num_partitions: int
    memory_weight: float
    effective_memory_weight: float
    """The α actually used (1.0 or 0.0 when the model has no compute or no memory to weigh)."""
    compute_unit: str
    """``seconds`` (measured forward times), ``calls`` (traced) or ``modules`` (not traced)."""
    traced: bool
    trace_device: str | None
    skip_tracing: bool
    default_partition: int | None
    model_class: str
    model_fingerprint: str
    num_modules: int
    num_parameters: int
    total_memory_bytes: int
    example_inputs: tuple[str, ...]
    """Shapes, dtypes and devices of the traced inputs."""
    library_version: str
    memory_weight_auto: bool = False
    """No memory_weight was given: time was balanced, or memory where the time-balanced plan did not
    fit the memory limit (``memory_weight`` then says which α was used)."""
    call_overhead_s: float | None = None
    """Seconds one remote call costs its caller's stage (forward + backward), when times were measured."""

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["example_inputs"] = list(self.example_inputs)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanInputs:
        return cls(
            method=str(d["method"]),
            num_partitions=int(d["num_partitions"]),
            memory_weight=float(d["memory_weight"]),
            effective_memory_weight=float(d["effective_memory_weight"]),
            compute_unit=str(d["compute_unit"]),
            traced=bool(d["traced"]),
            trace_device=None if d["trace_device"] is None else str(d["trace_device"]),
            skip_tracing=bool(d["skip_tracing"]),
            default_partition=None if d["default_partition"] is None else int(d["default_partition"]),
            model_class=str(d["model_class"]),
            model_fingerprint=str(d["model_fingerprint"]),
            num_modules=int(d["num_modules"]),
            num_parameters=int(d["num_parameters"]),
            total_memory_bytes=int(d["total_memory_bytes"]),
            example_inputs=tuple(str(x) for x in d["example_inputs"]),
            library_version=str(d["library_version"]),
            memory_weight_auto=bool(d.get("memory_weight_auto", False)),
            call_overhead_s=_opt_float(d.get("call_overhead_s")),
        )


@dataclass(frozen=True)
class PlanNode:
    """One ModuleNode of the plan's tree, for reports: normalized costs and partition decisions."""

    label: str
    paths: tuple[str, ...]
    class_names: tuple[str, ...]
    cost: float
    """c(n): normalized cost of the subtree."""
    own_cost: float
    partition: int
    """d(n)."""
    devices: tuple[int, ...]
    """P(n): the partitions that share the subtree (one element unless the algorithm split it)."""
    num_parameters: int
    """Parameters of the subtree."""
    children: tuple[PlanNode, ...] = ()

    @property
    def path(self) -> str:
        return self.paths[0]

    def walk(self) -> list[PlanNode]:
        """This node and its descendants, depth first."""
        out: list[PlanNode] = []
        stack = [self]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "paths": list(self.paths),
            "class_names": list(self.class_names),
            "cost": self.cost,
            "own_cost": self.own_cost,
            "partition": self.partition,
            "devices": list(self.devices),
            "num_parameters": self.num_parameters,
            "children": [c.to_dict() for c in self.children],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanNode:
        return cls(
            label=str(d["label"]),
            paths=tuple(str(p) for p in d["paths"]),
            class_names=tuple(str(c) for c in d["class_names"]),
            cost=float(d["cost"]),
            own_cost=float(d["own_cost"]),
            partition=int(d["partition"]),
            devices=tuple(int(x) for x in d["devices"]),
            num_parameters=int(d["num_parameters"]),
            children=tuple(cls.from_dict(c) for c in d["children"]),
        )


def _opt_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def _parent_path(path: str) -> str | None:
    if path == "":
        return None
    return path.rsplit(".", 1)[0] if "." in path else ""


@dataclass(frozen=True)
class PartitionPlan:
    """Which pipeline rank owns each module of a model.

    ``assignment`` maps every module path of the model (``""`` is the model itself; a module reachable
    under several names appears under each) to its partition. A module's submodules are on its
    partition unless the algorithm split its children across partitions.
    """

    num_partitions: int
    assignment: Mapping[str, int]
    partitions: tuple[PartitionStats, ...]
    tree: PlanNode
    inputs: PlanInputs

    def __post_init__(self) -> None:
        if not isinstance(self.assignment, MappingProxyType):
            object.__setattr__(self, "assignment", MappingProxyType(dict(self.assignment)))

    # -- queries ----------------------------------------------------------------------------------------
    def owner(self, path: str) -> int:
        """The partition (pipeline rank) that owns the module at ``path``."""
        try:
            return self.assignment[path]
        except KeyError:
            raise UnknownModulePathError(path, self._nearest(path)) from None

    def owner_of_parameter(self, name: str) -> int:
        """The partition owning a parameter or buffer, by its ``named_parameters()`` name."""
        module = name.rsplit(".", 1)[0] if "." in name else ""
        return self.owner(module)

    def _nearest(self, path: str) -> str | None:
        current = _parent_path(path)
        while current is not None:
            if current in self.assignment:
                return current
            current = _parent_path(current)
        return None

    def modules_on(self, index: int) -> tuple[str, ...]:
        """Every module path owned by partition ``index``."""
        return tuple(p for p, i in self.assignment.items() if i == index)

    def split_points(self) -> dict[str, int]:
        """Modules whose partition differs from their parent module's: where execution crosses ranks."""
        out: dict[str, int] = {}
        for path, index in self.assignment.items():
            parent = _parent_path(path)
            if parent is not None and self.assignment.get(parent, index) != index:
                out[path] = index
        return out

    @property
    def costs(self) -> tuple[float, ...]:
        """Normalized cost of each partition."""
        return tuple(p.cost for p in self.partitions)

    @property
    def predicted_times_s(self) -> tuple[float, ...] | None:
        """Predicted forward + backward seconds per microbatch of each stage (None when not timed)."""
        times = [p.predicted_time_s for p in self.partitions]
        return None if any(t is None for t in times) else tuple(t for t in times if t is not None)

    def with_measured_times(self, seconds: Sequence[float | None]) -> PartitionPlan:
        """A copy with each stage's measured forward + backward seconds per microbatch."""
        if len(seconds) != self.num_partitions:
            raise PlanFormatError(
                f"{len(seconds)} measured stage times for a plan of {self.num_partitions} partitions: "
                "expected one per partition"
            )
        parts = tuple(replace(p, measured_time_s=t) for p, t in zip(self.partitions, seconds, strict=True))
        return replace(self, partitions=parts)

    @property
    def empty_partitions(self) -> tuple[int, ...]:
        """Partitions that own no module."""
        return tuple(p.index for p in self.partitions if p.num_modules == 0)

    @property
    def imbalance(self) -> float:
        """Largest partition cost over the mean (1.0 is perfect balance)."""
        mean = sum(self.costs) / self.num_partitions
        return max(self.costs) / mean if mean > 0 else 1.0

    def check_model(self, model: nn.Module) -> None:
        """Raises :class:`PlanMismatchError` unless this plan was computed for a model like ``model``."""
        fingerprint = model_fingerprint(model)
        if fingerprint == self.inputs.model_fingerprint:
            return
        paths = {a for e in walk_modules(model) for a in e.aliases}
        missing = sorted(set(self.assignment) - paths)[:5]
        extra = sorted(paths - set(self.assignment))[:5]
        detail = []
        if missing:
            detail.append(f"modules in the plan but not in the model: {missing}")
        if extra:
            detail.append(f"modules in the model but not in the plan: {extra}")
        if not detail:
            detail.append("same module paths, different classes or parameter shapes/dtypes")
        raise PlanMismatchError(
            f"the plan (model {self.inputs.model_class}, fingerprint {self.inputs.model_fingerprint}) does "
            f"not match the given {type(model).__name__} (fingerprint {fingerprint}): {'; '.join(detail)}; "
            "expected the model the plan was computed for; recompute the plan for this model"
        )

    # -- reports ----------------------------------------------------------------------------------------
    def report(self, *, full: bool = False, max_depth: int | None = None) -> str:
        """The partition tree with normalized costs and partitions, and a per-partition table."""
        from .report import format_report

        return format_report(self, full=full, max_depth=max_depth)

    def render(
        self, path: str | os.PathLike[str], *, full: bool = False, max_depth: int | None = None
    ) -> None:
        """Draws the plan to a PNG or SVG file (needs matplotlib, the ``plot`` extra)."""
        from .report import render_plan

        render_plan(self, path, full=full, max_depth=max_depth)

    # -- JSON -------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "num_partitions": self.num_partitions,
            "assignment": dict(self.assignment),
            "partitions": [p.to_dict() for p in self.partitions],
            "inputs": self.inputs.to_dict(),
            "tree": self.tree.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PartitionPlan:
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise PlanFormatError(
                f"not a partition plan (format {got!r}): expected a JSON object with format {FORMAT!r}, "
                "as written by PartitionPlan.save()"
            )
        if data.get("version") != FORMAT_VERSION:
            raise PlanFormatError(
                f"plan format version {data.get('version')!r} is not supported: expected {FORMAT_VERSION}; "
                "recompute the plan with this version of mp-partition"
            )
        try:
            plan = cls(
                num_partitions=int(data["num_partitions"]),
                assignment={str(k): int(v) for k, v in data["assignment"].items()},
                partitions=tuple(PartitionStats.from_dict(p) for p in data["partitions"]),
                tree=PlanNode.from_dict(data["tree"]),
                inputs=PlanInputs.from_dict(data["inputs"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanFormatError(
                f"partition plan is malformed ({type(exc).__name__}: {exc}): expected the fields written by "
                "PartitionPlan.save(); recompute and save the plan again"
            ) from exc
        bad = {p: i for p, i in plan.assignment.items() if not 0 <= i < plan.num_partitions}
        if bad or len(plan.partitions) != plan.num_partitions:
            raise PlanFormatError(
                f"partition plan is inconsistent (num_partitions {plan.num_partitions}, "
                f"{len(plan.partitions)} partition entries, "
                f"out-of-range owners {dict(list(bad.items())[:3])}): "
                "expected owners in [0, num_partitions); recompute the plan"
            )
        return plan

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> PartitionPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanFormatError(
                f"partition plan is not valid JSON ({exc}): expected a file from save()"
            ) from exc
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the plan as JSON (atomically: a temporary file is renamed into place)."""
        target = os.fspath(path)
        tmp = f"{target}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(self.to_json())
            fh.write("\n")
        os.replace(tmp, target)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PartitionPlan:
        """Reads a plan written by :meth:`save`."""
        with open(os.fspath(path), encoding="utf-8") as fh:
            return cls.from_json(fh.read())
