"""mp-memory: the memory savers of mp.

Activation checkpointing and offloading, optimizer-state and parameter sharding, delayed parameter
initialization, mixed precision, and checkpoint save/load with resharding. Built so far:
``activation`` (activation checkpointing on torch.utils.checkpoint), ``precision`` and ``loss_scaler``
(fp16/bf16 with fp32 master weights and smp's loss scaling), ``zero`` (optimizer-state sharding on
torch's ZeroRedundancyOptimizer), ``delayed_init`` (parameters on the meta device, materialized per
rank), ``checkpoint`` (checkpoint files), ``offload`` (checkpointed activations to host memory, loaded
back ahead of their backward), ``sharded`` (sharded data parallelism, ZeRO-3 and HSDP, on FSDP2).

The public API is the names below (``__all__``), importable from this root; each is loaded on first use
(PEP 562), so that a caller needing the checkpoint header does not pay for FSDP2's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names as _SOURCES, for type checkers (tests/mp_memory/test_api.py)
    from mp_memory.activation import Mark as Mark
    from mp_memory.activation import checkpoint_module as checkpoint_module
    from mp_memory.activation import checkpoint_run as checkpoint_run
    from mp_memory.activation import checkpoint_sequential as checkpoint_sequential
    from mp_memory.activation import group_size as group_size
    from mp_memory.activation import mark_module as mark_module
    from mp_memory.activation import mark_of as mark_of
    from mp_memory.activation import mark_sequential as mark_sequential
    from mp_memory.activation import run_children as run_children
    from mp_memory.activation import segments as segments
    from mp_memory.checkpoint import BackgroundSave as BackgroundSave
    from mp_memory.checkpoint import CheckpointFolder as CheckpointFolder
    from mp_memory.checkpoint import Layout as Layout
    from mp_memory.checkpoint import is_trusted as is_trusted
    from mp_memory.checkpoint import load_full as load_full
    from mp_memory.checkpoint import load_partial as load_partial
    from mp_memory.checkpoint import read_newest as read_newest
    from mp_memory.checkpoint import save_folder as save_folder
    from mp_memory.checkpoint import save_full as save_full
    from mp_memory.checkpoint import save_partial as save_partial
    from mp_memory.checkpoint.collective import agree as agree
    from mp_memory.checkpoint.errors import CheckpointCorruptError as CheckpointCorruptError
    from mp_memory.checkpoint.errors import CheckpointError as CheckpointError
    from mp_memory.checkpoint.errors import CheckpointLayoutError as CheckpointLayoutError
    from mp_memory.checkpoint.errors import CheckpointMissingError as CheckpointMissingError
    from mp_memory.checkpoint.errors import CheckpointWriteError as CheckpointWriteError
    from mp_memory.checkpoint.errors import UntrustedCheckpointError as UntrustedCheckpointError
    from mp_memory.checkpoint.publish import TMP_MARK as TMP_MARK
    from mp_memory.checkpoint.publish import publish_file as publish_file
    from mp_memory.checkpoint.publish import tmp_name as tmp_name
    from mp_memory.checkpoint.reshard import full_model_from_parts as full_model_from_parts
    from mp_memory.checkpoint.reshard import full_optimizer_from_parts as full_optimizer_from_parts
    from mp_memory.checkpoint.reshard import merge_model_parts as merge_model_parts
    from mp_memory.checkpoint.reshard import merge_optimizer_parts as merge_optimizer_parts
    from mp_memory.checkpoint.schema import Header as Header
    from mp_memory.checkpoint.schema import SDPLayout as SDPLayout
    from mp_memory.checkpoint.schema import TPLayout as TPLayout
    from mp_memory.checkpoint.schema import read_header as read_header
    from mp_memory.checkpoint.schema import write_header as write_header
    from mp_memory.delayed_init import DelayedInitError as DelayedInitError
    from mp_memory.delayed_init import has_meta_parameters as has_meta_parameters
    from mp_memory.delayed_init import materialize as materialize
    from mp_memory.delayed_init import parameters_on_meta as parameters_on_meta
    from mp_memory.errors import CheckpointArgumentError as CheckpointArgumentError
    from mp_memory.errors import MemorySaverError as MemorySaverError
    from mp_memory.errors import PrecisionError as PrecisionError
    from mp_memory.loss_scaler import DynamicLossScaler as DynamicLossScaler
    from mp_memory.loss_scaler import LossScaler as LossScaler
    from mp_memory.loss_scaler import make_loss_scaler as make_loss_scaler
    from mp_memory.memory_report import ActivationTracker as ActivationTracker
    from mp_memory.memory_report import MemoryReport as MemoryReport
    from mp_memory.memory_report import tensor_bytes as tensor_bytes
    from mp_memory.offload import Offloader as Offloader
    from mp_memory.offload import TaskKey as TaskKey
    from mp_memory.offload import activate as activate
    from mp_memory.precision import HALF_DTYPES as HALF_DTYPES
    from mp_memory.precision import Bit16Optimizer as Bit16Optimizer
    from mp_memory.precision import cast_floats as cast_floats
    from mp_memory.precision import has_overflow as has_overflow
    from mp_memory.sharded import ShardedDataParallel as ShardedDataParallel
    from mp_memory.sharded import ShardingConfig as ShardingConfig
    from mp_memory.sharded import ShardingError as ShardingError
    from mp_memory.sharded import TensorParallel as TensorParallel
    from mp_memory.sharded import as_like as as_like
    from mp_memory.sharded import clip_grad_norm as clip_grad_norm
    from mp_memory.sharded import load_local_optimizer_state as load_local_optimizer_state
    from mp_memory.sharded import local_optimizer_state as local_optimizer_state
    from mp_memory.zero import ZeroSharding as ZeroSharding

__version__ = "0.1.0"

# module -> the public names it provides (the one list; __all__ and the lazy lookup come from it)
_SOURCES: dict[str, tuple[str, ...]] = {
    "mp_memory.activation": (
        "Mark",
        "checkpoint_module",
        "checkpoint_run",
        "checkpoint_sequential",
        "group_size",
        "mark_module",
        "mark_of",
        "mark_sequential",
        "run_children",
        "segments",
    ),
    "mp_memory.checkpoint": (
        "BackgroundSave",
        "CheckpointFolder",
        "Layout",
        "is_trusted",
        "load_full",
        "load_partial",
        "read_newest",
        "save_folder",
        "save_full",
        "save_partial",
    ),
    "mp_memory.checkpoint.collective": ("agree",),
    "mp_memory.checkpoint.errors": (
        "CheckpointCorruptError",
        "CheckpointError",
        "CheckpointLayoutError",
        "CheckpointMissingError",
        "CheckpointWriteError",
        "UntrustedCheckpointError",
    ),
    "mp_memory.checkpoint.publish": ("TMP_MARK", "publish_file", "tmp_name"),
    "mp_memory.checkpoint.reshard": (
        "full_model_from_parts",
        "full_optimizer_from_parts",
        "merge_model_parts",
        "merge_optimizer_parts",
    ),
    "mp_memory.checkpoint.schema": ("Header", "SDPLayout", "TPLayout", "read_header", "write_header"),
    "mp_memory.delayed_init": (
        "DelayedInitError",
        "has_meta_parameters",
        "materialize",
        "parameters_on_meta",
    ),
    "mp_memory.errors": ("CheckpointArgumentError", "MemorySaverError", "PrecisionError"),
    "mp_memory.loss_scaler": ("DynamicLossScaler", "LossScaler", "make_loss_scaler"),
    "mp_memory.memory_report": ("ActivationTracker", "MemoryReport", "tensor_bytes"),
    "mp_memory.offload": ("Offloader", "TaskKey", "activate"),
    "mp_memory.precision": ("HALF_DTYPES", "Bit16Optimizer", "cast_floats", "has_overflow"),
    "mp_memory.sharded": (
        "ShardedDataParallel",
        "ShardingConfig",
        "ShardingError",
        "TensorParallel",
        "as_like",
        "clip_grad_norm",
        "load_local_optimizer_state",
        "local_optimizer_state",
    ),
    "mp_memory.zero": ("ZeroSharding",),
}

_WHERE = {name: module for module, names in _SOURCES.items() for name in names}

__all__ = [name for names in _SOURCES.values() for name in names]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'mp_memory' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
