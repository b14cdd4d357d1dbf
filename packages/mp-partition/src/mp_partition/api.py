"""The entry points: automatic and manual partitioning of a model into a :class:`PartitionPlan`."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .algorithm import partition_tree
from .balance import CallCosts, refine, stage_loads, subtree_devices
from .cost import CostTotals, assign_costs, check_memory_weight
from .errors import ModelTooSmallError, PartitionError
from .manual import resolve_manual
from .nodes import ModuleNode, build_module_tree
from .plan import PartitionPlan, PartitionStats, PlanInputs, PlanNode, model_fingerprint
from .timing import ModuleTimes
from .trace import TraceResult, trace_model

__all__ = [
    "DEFAULT_CALLEE_OVERHEAD_S",
    "DEFAULT_CALL_OVERHEAD_S",
    "auto_partition",
    "describe_inputs",
    "device_memory_bytes",
    "manual_partition",
]

DEFAULT_CALL_OVERHEAD_S = 0.5e-3
"""Seconds a call to a module on another rank costs the caller's rank, forward and backward request
together: busy time per call in mp's pipeline timeline (benchmarks/partition_stage_times.py measured
0.35-0.71 ms on a loaded 2-core CPU host; docs/partition.md)."""
DEFAULT_CALLEE_OVERHEAD_S = 1.0e-3
"""Seconds such a call costs the rank that serves it (measured 0.75-1.8 ms there)."""
SMP_MEMORY_WEIGHT = 0.8
"""smp's default α, used when no time was measured and no memory_weight was given."""
_MEMORY_STEPS = (0.2, 0.4, 0.6, 0.8, 1.0)

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
    predicted_s: Sequence[float] | None = None,
    call_overhead_s: float | None = None,
    memory_weight_auto: bool = False,
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
            "predicted_time_s": None if predicted_s is None else float(predicted_s[i]),
        }
        for i in range(num_partitions)
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
        memory_weight_auto=memory_weight_auto,
        call_overhead_s=call_overhead_s,
    )
    return PartitionPlan(
        num_partitions=num_partitions,
        assignment=assignment,
        partitions=partitions,
        tree=_plan_tree(root, device, devices),
        inputs=inputs,
    )


def _call_costs(
    root: ModuleNode, times: ModuleTimes | None, totals: CostTotals, caller_s: float, callee_s: float
) -> tuple[CallCosts, CallCosts] | None:
    """The calls between nodes priced in seconds, and in the normalized cost units of ``totals``."""
    if times is None:
        return None
    node_of = {p: n.index for n in root.walk() for p in n.paths}
    calls: dict[tuple[int, int], int] = {}
    for (caller, callee), n in times.call_counts.items():
        a, b = node_of.get(caller), node_of.get(callee)
        if a is not None and b is not None and a != b:
            calls[(a, b)] = calls.get((a, b), 0) + n
    seconds = CallCosts(calls, caller_s, callee_s)
    scale = 0.0
    if totals.compute_unit == "seconds" and totals.compute > 0:
        scale = (1.0 - totals.effective_memory_weight) / totals.compute
    return seconds, CallCosts(calls, caller_s * scale, callee_s * scale)


def _stage_memory(
    root: ModuleNode, device: Mapping[int, int], num_partitions: int, in_flight: int
) -> list[int]:
    """Training memory of each stage: parameters x 4 (weights, gradients, two optimizer states),
    buffers, and the traced activations of ``in_flight`` microbatches."""
    out = [0] * num_partitions
    for node in root.walk():
        out[device[node.index]] += (
            4 * node.parameter_bytes + node.buffer_bytes + in_flight * node.activation_bytes
        )
    return out


def _tree_and_trace(
    model: nn.Module,
    *,
    example_args: Sequence[Any],
    example_kwargs: Mapping[str, Any] | None,
    skip_tracing: bool,
    trace: TraceResult | None,
    measure_time: bool,
    times: ModuleTimes | None = None,
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
    return build_module_tree(model, trace, times), trace, described


def device_memory_bytes(model: nn.Module, processes_per_host: int = 1) -> int | None:
    """Memory one stage of ``model`` may use: its GPU's memory, or on CPU the host's physical memory
    shared by ``processes_per_host`` processes; None on the meta device or when unknown."""
    tensor = next(iter(model.parameters()), None)
    kind = tensor.device.type if tensor is not None else "cpu"
    if kind == "cuda":
        return int(torch.cuda.get_device_properties(tensor.device).total_memory)  # type: ignore[union-attr]
    if kind != "cpu":
        return None
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return int(total) // max(1, processes_per_host)


def auto_partition(
    model: nn.Module,
    num_partitions: int,
    *,
    example_args: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    memory_weight: float | None = None,
    skip_tracing: bool = False,
    trace: TraceResult | None = None,
    times: ModuleTimes | None = None,
    measure_time: bool = False,
    allow_empty_partitions: bool = True,
    call_overhead_s: float = DEFAULT_CALL_OVERHEAD_S,
    callee_overhead_s: float = DEFAULT_CALLEE_OVERHEAD_S,
    memory_limit_bytes: int | None = None,
    microbatches_in_flight: int = 1,
    refine_balance: bool | None = None,
) -> PartitionPlan:
    """Partitions ``model`` into ``num_partitions`` pipeline stages.

    The model is traced once on ``example_args``/``example_kwargs`` (on whatever device it lives on; on
    the meta device nothing is allocated), unless a ``trace`` is given or ``skip_tracing`` is set, in
    which case costs come from parameter sizes and module counts. ``times`` (from
    :func:`mp_partition.time_step`: forward + backward per module) make compute a time; without them,
    ``measure_time`` uses the trace's forward times.

    ``memory_weight`` (α) weighs memory against compute, as in smp. None (the default) balances time
    (α = 0) when times were measured, unless the time-balanced plan's largest stage needs more than
    ``memory_limit_bytes`` (parameters x 4 for weights, gradients and two optimizer states, buffers,
    and ``microbatches_in_flight`` traced activations): then the smallest α in 0.2, 0.4, ..., 1.0 whose
    plan fits. Without times, None means smp's 0.8.

    The seed's algorithm (tree segmentation, D'Hondt) gives a first plan; with ``refine_balance`` (None:
    when ``times`` are given) subtrees (whole blocks, or the children of a pure container such as an
    ``nn.Sequential`` of blocks) then move across stage boundaries while that lowers the largest
    stage load, counting what the other stages already carry and ``call_overhead_s`` /
    ``callee_overhead_s`` per call between modules on different stages (:mod:`mp_partition.balance`);
    the plan then predicts each stage's seconds per microbatch. A model with fewer ModuleNodes than
    partitions raises :class:`ModelTooSmallError`; partitions left without modules (a huge leaf module
    takes several devices) are logged, and raise :class:`ModelTooSmallError` if
    ``allow_empty_partitions`` is False.
    """
    model = _check_model(model)
    num_partitions = _check_num_partitions(num_partitions)
    auto_alpha = memory_weight is None
    root, used_trace, described = _tree_and_trace(
        model,
        example_args=example_args,
        example_kwargs=example_kwargs,
        skip_tracing=skip_tracing,
        trace=trace,
        measure_time=measure_time,
        times=times,
    )
    nodes = list(root.walk())
    if len(nodes) < num_partitions:
        raise ModelTooSmallError(
            num_partitions,
            f"{type(model).__name__} has {len(nodes)} ModuleNode(s) (modules sharing parameters count once), "
            f"fewer than the {num_partitions} partitions",
        )
    timed = any(n.self_time_s is not None for n in nodes)
    if memory_weight is not None:
        candidates: tuple[float, ...] = (check_memory_weight(memory_weight),)
    else:
        candidates = (0.0, *_MEMORY_STEPS) if timed else (SMP_MEMORY_WEIGHT,)
    for alpha in candidates:
        totals = assign_costs(root, alpha)
        seed = partition_tree(root, num_partitions)
        device, devices = seed.device, seed.devices
        calls = _call_costs(root, times, totals, call_overhead_s, callee_overhead_s)
        if refine_balance or (refine_balance is None and times is not None):
            device = refine(root, device, num_partitions, calls[1] if calls is not None else None)
            if device != seed.device:
                devices = subtree_devices(root, device)
        if auto_alpha and len(set(device.values())) < num_partitions and alpha != candidates[-1]:
            # time concentrated in a few modules left a stage without any: the user asked for every
            # stage to hold part of the model (its memory), so weigh memory more, as for the limit below
            _log.info("memory_weight %g leaves a partition empty; weighing memory more", alpha)
            continue
        if memory_limit_bytes is None or not auto_alpha:
            break
        worst = max(_stage_memory(root, device, num_partitions, microbatches_in_flight))
        if worst <= memory_limit_bytes:
            break
        _log.info(
            "memory_weight %g: the largest stage needs %.1f MiB, over the limit of %.1f MiB; "
            "weighing memory more",
            alpha,
            worst / 2**20,
            memory_limit_bytes / 2**20,
        )
    predicted = None
    if times is not None:
        calls_s = calls[0] if calls is not None else None
        predicted = stage_loads(nodes, device, num_partitions, calls_s, seconds=True)
    plan = _make_plan(
        model,
        root,
        num_partitions,
        device=device,
        devices=devices,
        totals=totals,
        method="auto",
        trace=used_trace,
        skip_tracing=skip_tracing,
        default_partition=None,
        example_inputs=described,
        predicted_s=predicted,
        call_overhead_s=call_overhead_s if calls is not None else None,
        memory_weight_auto=auto_alpha,
    )
    empty = plan.empty_partitions
    if empty:
        holders = [n for n in nodes if len(seed.devices[n.index]) > 1 and not n.children]
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
