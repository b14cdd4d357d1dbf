"""Automatic and manual partitioning of any torch nn.Module tree into pipeline stages; usable standalone.

The partitioner of the SageMaker model parallelism library (docs/partition.md):
modules sharing parameters form ModuleNodes, a trace orders children and measures costs
(``C = α·memory + (1−α)·compute``), and a breadth-first walk splits each node's devices among its
children by optimal contiguous segmentation and D'Hondt allocation.

    import mp_partition
    plan = mp_partition.auto_partition(model, 4, example_args=(batch,))
    print(plan.report()); plan.save("plan.json"); plan.owner("encoder.block.3")
"""

from .algorithm import TreeAssignment, allocate_devices, partition_tree
from .api import auto_partition, describe_inputs, device_memory_bytes, manual_partition
from .cost import CostTotals, assign_costs
from .dhondt import dhondt_allocate, dhondt_seats
from .errors import (
    InvalidPartitionIDError,
    ModelTooSmallError,
    PartitionError,
    PlanFormatError,
    PlanMismatchError,
    SharedParameterPartitionError,
    TracingError,
    UnknownModulePathError,
)
from .factory import load_factory
from .hf import build_hf_model, partition_hf
from .manual import clear_partition, get_partition, partition, partition_marks, set_partition
from .nodes import ModuleNode, build_module_tree
from .placement import PLACEHOLDER_ATTR, Placement, module_path
from .plan import PartitionPlan, PartitionStats, PlanInputs, PlanNode, model_fingerprint
from .report import format_report, render_plan
from .segment import max_segment_cost, optimal_segments
from .timing import ModuleTimes, StepTimer, time_step
from .trace import ModuleStats, Tracer, TraceResult, is_tracing, trace_model

__version__ = "0.1.0"

__all__ = [
    "PLACEHOLDER_ATTR",
    "CostTotals",
    "InvalidPartitionIDError",
    "ModelTooSmallError",
    "ModuleNode",
    "ModuleStats",
    "ModuleTimes",
    "PartitionError",
    "PartitionPlan",
    "PartitionStats",
    "Placement",
    "PlanFormatError",
    "PlanInputs",
    "PlanMismatchError",
    "PlanNode",
    "SharedParameterPartitionError",
    "StepTimer",
    "TraceResult",
    "Tracer",
    "TracingError",
    "TreeAssignment",
    "UnknownModulePathError",
    "__version__",
    "allocate_devices",
    "assign_costs",
    "auto_partition",
    "build_hf_model",
    "build_module_tree",
    "clear_partition",
    "describe_inputs",
    "device_memory_bytes",
    "dhondt_allocate",
    "dhondt_seats",
    "format_report",
    "get_partition",
    "is_tracing",
    "load_factory",
    "manual_partition",
    "max_segment_cost",
    "model_fingerprint",
    "module_path",
    "optimal_segments",
    "partition",
    "partition_hf",
    "partition_marks",
    "partition_tree",
    "render_plan",
    "set_partition",
    "time_step",
    "trace_model",
]
