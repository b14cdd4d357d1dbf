"""The entry points: automatic and manual partitioning of a model into a :class:`PartitionPlan`."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .algorithm import partition_tree
from .cost import CostTotals, assign_costs, check_memory_weight
from .errors import ModelTooSmallError, PartitionError
from .manual import resolve_manual
from .nodes import ModuleNode, build_module_tree
from .plan import PartitionPlan, PartitionStats, PlanInputs, PlanNode, model_fingerprint
from .trace import TraceResult, trace_model

__all__ = ["auto_partition", "describe_inputs", "manual_partition"]

_log = logging.getLogger(__name__)


def _check_num_partitions(num_partitions: object) -> int:
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int) or num_partitions < 1:
        raise PartitionError(
            f"num_partitions {num_partitions!r} is invalid: expected an int >= 1 "
            "(the pipeline parallel degree); pass e.g. 4"
        )
    return num_partitions


def _check_model(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise PartitionError(f"got {type(model).__name__} to partition: expected a torch.nn.Module")
    return model


def describe_inputs(args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> tuple[str, ...]:
    """Short descriptions (name, dtype, shape, device) of example inputs, as recorded in a plan."""

    def one(name: str, value: object) -> str:
        if isinstance(value, torch.Tensor):
            dtype = str(value.dtype).replace("torch.", "")
            return f"{name}: {dtype}{list(value.shape)} on {value.device.type}"
        return f"{name}: {type(value).__name__}"

    out = [one(f"arg{i}", v) for i, v in enumerate(args)]
    out += [one(k, v) for k, v in (kwargs or {}).items()]
    return tuple(out)


def _plan_tree(
    node: ModuleNode, device: Mapping[int, int], devices: Mapping[int, tuple[int, ...]]
) -> PlanNode:
    children = tuple(_plan_tree(c, device, devices) for c in node.children)
    return PlanNode(
        label=node.label,
        paths=node.paths,
        class_names=node.class_names,
        cost=node.cost,
        own_cost=node.own_cost,
        partition=device[node.index],
        devices=devices[node.index],
        num_parameters=node.num_parameters + sum(c.num_parameters for c in children),
        children=children,
    )


def _make_plan(
    model: nn.Module,
    root: ModuleNode,
    num_partitions: int,
    *,
    device: Mapping[int, int],
    devices: Mapping[int, tuple[int, ...]],
    totals: CostTotals,
    method: str,
    trace: TraceResult | None,
    skip_tracing: bool,
    default_partition: int | None,
    example_inputs: tuple[str, ...],
) -> PartitionPlan:
    from . import __version__

    nodes = list(root.walk())
    assignment: dict[str, int] = {}
    for node in nodes:
        for alias in node.aliases:
            assignment[alias] = device[node.index]
    stats: list[dict[str, Any]] = [
        {
            "cost": 0.0,
            "num_modules": 0,
            "num_parameters": 0,
            "parameter_bytes": 0,
            "buffer_bytes": 0,
            "activation_bytes": 0,
        }
        for _ in range(num_partitions)
    ]
    for node in nodes:
        s = stats[device[node.index]]
        s["cost"] += node.own_cost
        s["num_modules"] += len(node.modules)
        s["num_parameters"] += node.num_parameters
        s["parameter_bytes"] += node.parameter_bytes
        s["buffer_bytes"] += node.buffer_bytes
        s["activation_bytes"] += node.activation_bytes
    partitions = tuple(PartitionStats(index=i, **s) for i, s in enumerate(stats))
    inputs = PlanInputs(
        method=method,
        num_partitions=num_partitions,
        memory_weight=totals.memory_weight,
        effective_memory_weight=totals.effective_memory_weight,
        compute_unit=totals.compute_unit,
        traced=trace is not None,
        trace_device=trace.device if trace is not None else None,
        skip_tracing=skip_tracing,
        default_partition=default_partition,
        model_class=type(model).__name__,
        model_fingerprint=model_fingerprint(model),
        num_modules=sum(len(n.modules) for n in nodes),
        num_parameters=sum(n.num_parameters for n in nodes),
        total_memory_bytes=totals.memory_bytes,
        example_inputs=example_inputs,
        library_version=__version__,
    )
    return PartitionPlan(
        num_partitions=num_partitions,
        assignment=assignment,
        partitions=partitions,
        tree=_plan_tree(root, device, devices),
        inputs=inputs,
    )


def _tree_and_trace(
    model: nn.Module,
    *,
    example_args: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None,
    skip_tracing: bool,
    trace: TraceResult | None,
    measure_time: bool,
) -> tuple[ModuleNode, TraceResult | None, tuple[str, ...]]:
    described: tuple[str, ...] = ()
    if skip_tracing:
        trace = None
    elif trace is None:
        if example_args or example_kwargs:
            described = describe_inputs(example_args, example_kwargs)
            trace = trace_model(model, example_args, example_kwargs, measure_time=measure_time)
        else:
            _log.info(
                "no example inputs and no trace given: costs come from parameter counts and module counts "
                "(as with skip_tracing); pass example_args to trace"
            )
    return build_module_tree(model, trace), trace, described


def auto_partition(
    model: nn.Module,
    num_partitions: int,
    *,
    example_args: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    memory_weight: float = 0.8,
    skip_tracing: bool = False,
    trace: TraceResult | None = None,
    measure_time: bool = False,
    allow_empty_partitions: bool = True,
) -> PartitionPlan:
    """Partitions ``model`` into ``num_partitions`` pipeline stages with the seed's algorithm.

    The model is traced once on ``example_args``/``example_kwargs`` (on whatever device it lives on; on
    the meta device nothing is allocated), unless a ``trace`` is given or ``skip_tracing`` is set, in
    which case costs come from parameter sizes and module counts. ``memory_weight`` (α) weighs memory
    against compute. A model with fewer ModuleNodes than partitions raises :class:`ModelTooSmallError`;
    partitions left without modules by the algorithm (a huge leaf module takes several devices) are
    logged, and raise :class:`ModelTooSmallError` if ``allow_empty_partitions`` is False.
    """
    model = _check_model(model)
    num_partitions = _check_num_partitions(num_partitions)
    alpha = check_memory_weight(memory_weight)
    root, used_trace, described = _tree_and_trace(
        model,
        example_args=example_args,
        example_kwargs=example_kwargs,
        skip_tracing=skip_tracing,
        trace=trace,
        measure_time=measure_time,
    )
    nodes = list(root.walk())
    if len(nodes) < num_partitions:
        raise ModelTooSmallError(
            num_partitions,
            f"{type(model).__name__} has {len(nodes)} ModuleNode(s) (modules sharing parameters count once), "
            f"fewer than the {num_partitions} partitions",
        )
    totals = assign_costs(root, alpha)
    assignment = partition_tree(root, num_partitions)
    plan = _make_plan(
        model,
        root,
        num_partitions,
        device=assignment.device,
        devices=assignment.devices,
        totals=totals,
        method="auto",
        trace=used_trace,
        skip_tracing=skip_tracing,
        default_partition=None,
        example_inputs=described,
    )
    empty = plan.empty_partitions
    if empty:
        holders = [n for n in nodes if len(assignment.devices[n.index]) > 1 and not n.children]
        detail = f"partitions {list(empty)} got no module: " + (
            f"leaf module(s) {[n.path for n in holders][:3]} hold several partitions each"
            if holders
            else "the costs are too concentrated"
        )
        if not allow_empty_partitions:
            raise ModelTooSmallError(num_partitions, detail)
        _log.warning("%s (plan imbalance %.2f)", detail, plan.imbalance)
    return plan


def manual_partition(
    model: nn.Module,
    num_partitions: int,
    default_partition: int = 0,
    *,
    memory_weight: float = 0.8,
    example_args: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    trace: TraceResult | None = None,
) -> PartitionPlan:
    """The plan given by ``partition(i)`` contexts and ``set_partition`` marks.

    Unmarked modules go to ``default_partition``. Modules that share parameters must carry the same
    partition (:class:`SharedParameterPartitionError` otherwise); every index must lie in
    ``[0, num_partitions)`` (:class:`InvalidPartitionIDError`). Costs, for the report, follow
    ``memory_weight`` and the trace when example inputs or a trace are given.
    """
    model = _check_model(model)
    num_partitions = _check_num_partitions(num_partitions)
    alpha = check_memory_weight(memory_weight)
    root, used_trace, described = _tree_and_trace(
        model,
        example_args=example_args,
        example_kwargs=example_kwargs,
        skip_tracing=False,
        trace=trace,
        measure_time=False,
    )
    device = resolve_manual(root, num_partitions, default_partition)
    totals = assign_costs(root, alpha)
    devices = {index: (d,) for index, d in device.items()}
    return _make_plan(
        model,
        root,
        num_partitions,
        device=device,
        devices=devices,
        totals=totals,
        method="manual",
        trace=used_trace,
        skip_tracing=False,
        default_partition=default_partition,
        example_inputs=described,
    )
