"""mp: model parallelism for PyTorch behind the SageMaker model parallelism v1 API.

import mp as smp
smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})

Every smp name is imported on first use (PEP 562): ``import mp`` itself loads no torch, so ``mp-launch``
and tools that read the config start at once, and a rank loads only the parts its script uses.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, for type checkers and IDEs (the table below serves them at run time)
    from mp import amp, nn, optimizers, timeline
    from mp.activation_checkpointing import checkpoint as _checkpoint_call
    from mp.activation_checkpointing import checkpoint_sequential, set_activation_checkpointing
    from mp.checkpoint import load, resume_from_checkpoint, save, save_checkpoint, wait_checkpoint
    from mp.comm import (
        CommGroup,
        RankType,
        allgather,
        barrier,
        broadcast,
        dp_barrier,
        gather,
        mp_barrier,
        pp_barrier,
        rdp_barrier,
        recv_from,
        send,
        tp_barrier,
    )
    from mp.config import ModelParallelConfig, load_config
    from mp.errors import (  # smp's exception names, so scripts can catch them as smp.X
        BwdExecutionNotInStepFnError,
        CheckpointingConfigError,
        CommGroupConfigError,
        ConfigError,
        CorruptCheckpointError,
        DDPNotEnabledError,
        DelayedParamDeviceError,
        DistEmbeddingConfigError,
        DistributedModelNotWrappedError,
        DistributedModelWrappedError,
        DistTransformerConfigError,
        FwdExecutionNotInStepFnError,
        IncompatibleCheckpointFoundError,
        IncompatibleCheckpointRankFoundError,
        InvalidPartitionIDError,
        InvalidStepOutputError,
        MissingCheckpointFilesError,
        ModelNotPartitionedError,
        MultipleDistributedModelError,
        MultipleDtypeOptShardingError,
        NotInitializedError,
        NotSupportedByFastModeError,
        PartitionFileError,
        SMPCheckpointError,
        SMPConfigError,
        SMPInvalidArgumentError,
        SMPRuntimeError,
        SMPUnsupportedError,
        SMPValidationError,
        StepFunctionCalledError,
        TensorSplitError,
        TPModuleRegisterError,
        UnsupportedTPModuleError,
        UntrustedCheckpointFileError,
        WorkerSizeError,
    )
    from mp.init import init, is_initialized, reset, shutdown
    from mp.memory_report import memory_report
    from mp.model import DistributedModel
    from mp.model_extras import num_microbatches
    from mp.optimizer import DistributedOptimizer
    from mp.ranks import (
        dp_rank,
        dp_size,
        get_dp_group,
        get_dp_process_group,
        get_mp_group,
        get_mp_process_group,
        get_pp_group,
        get_pp_process_group,
        get_rdp_group,
        get_rdp_process_group,
        get_tp_group,
        get_tp_process_group,
        get_world_group,
        get_world_process_group,
        local_rank,
        local_size,
        mp_rank,
        mp_size,
        pp_rank,
        pp_size,
        rank,
        rdp_rank,
        rdp_size,
        size,
        tp_rank,
        tp_size,
    )
    from mp.state import state
    from mp.step import step
    from mp.tensor_api import (
        delay_param_initialization,
        model_creation,
        set_tensor_parallelism,
        tensor_parallelism,
        tp_register,
        tp_register_with_module,
    )
    from mp_partition import is_tracing, partition, set_partition
    from mp_pipeline import PipelineAbortedError, PipelineTimeoutError, RemoteExecutionError, StepOutput

    checkpoint = _checkpoint_call
    WORLD = CommGroup.WORLD
    PP_GROUP = CommGroup.PP_GROUP
    TP_GROUP = CommGroup.TP_GROUP
    RDP_GROUP = CommGroup.RDP_GROUP
    DP_GROUP = CommGroup.DP_GROUP
    MP_GROUP = CommGroup.MP_GROUP

__version__ = "0.1.0"

# module -> the smp names it provides ("name=attr" where they differ; "" is the module itself)
_SOURCES: dict[str, str] = {
    "mp.amp": "amp=",
    "mp.nn": "nn=",
    "mp.optimizers": "optimizers=",
    "mp.timeline": "timeline=",
    # smp.checkpoint is the activation-checkpointing call (smp's patches.checkpoint.checkpoint); the
    # save/load module mp.checkpoint stays importable by its full name (smp.save, smp.load, ...).
    "mp.activation_checkpointing": "checkpoint checkpoint_sequential set_activation_checkpointing",
    "mp.checkpoint": "load resume_from_checkpoint save save_checkpoint wait_checkpoint",
    # smp exposes every CommGroup member at top level too (smp.WORLD, smp.DP_GROUP, ...)
    "mp.comm": "CommGroup RankType allgather barrier broadcast dp_barrier gather mp_barrier pp_barrier "
    "rdp_barrier recv_from send tp_barrier WORLD=CommGroup.WORLD PP_GROUP=CommGroup.PP_GROUP "
    "TP_GROUP=CommGroup.TP_GROUP RDP_GROUP=CommGroup.RDP_GROUP DP_GROUP=CommGroup.DP_GROUP "
    "MP_GROUP=CommGroup.MP_GROUP",
    "mp.config": "ModelParallelConfig load_config",
    # smp's exception names, so scripts can catch them as smp.X
    "mp.errors": (
        "BwdExecutionNotInStepFnError CheckpointingConfigError CommGroupConfigError ConfigError "
        "CorruptCheckpointError DDPNotEnabledError DelayedParamDeviceError DistEmbeddingConfigError "
        "DistributedModelNotWrappedError DistributedModelWrappedError DistTransformerConfigError "
        "FwdExecutionNotInStepFnError IncompatibleCheckpointFoundError IncompatibleCheckpointRankFoundError "
        "InvalidPartitionIDError InvalidStepOutputError MissingCheckpointFilesError ModelNotPartitionedError "
        "MultipleDistributedModelError MultipleDtypeOptShardingError NotInitializedError "
        "NotSupportedByFastModeError PartitionFileError SMPCheckpointError SMPConfigError "
        "SMPInvalidArgumentError SMPRuntimeError SMPUnsupportedError SMPValidationError "
        "StepFunctionCalledError TensorSplitError TPModuleRegisterError UnsupportedTPModuleError "
        "UntrustedCheckpointFileError WorkerSizeError"
    ),
    "mp.init": "init is_initialized reset shutdown",
    "mp.memory_report": "memory_report",
    "mp.model": "DistributedModel",
    "mp.model_extras": "num_microbatches",
    "mp.optimizer": "DistributedOptimizer",
    "mp.ranks": (
        "dp_rank dp_size get_dp_group get_dp_process_group get_mp_group get_mp_process_group get_pp_group "
        "get_pp_process_group get_rdp_group get_rdp_process_group get_tp_group get_tp_process_group "
        "get_world_group get_world_process_group local_rank local_size mp_rank mp_size pp_rank pp_size rank "
        "rdp_rank rdp_size size tp_rank tp_size"
    ),
    "mp.state": "state",
    "mp.step": "step",
    "mp.tensor_api": "delay_param_initialization model_creation set_tensor_parallelism tensor_parallelism "
    "tp_register tp_register_with_module",
    "mp_partition": "is_tracing partition set_partition",
    "mp_pipeline": "PipelineAbortedError PipelineTimeoutError RemoteExecutionError StepOutput",
}


def _exports() -> dict[str, tuple[str, str]]:
    """name -> (module, attribute path; "" for the module itself)."""
    table: dict[str, tuple[str, str]] = {}
    for module, names in _SOURCES.items():
        for entry in names.split():
            name, eq, attr = entry.partition("=")
            table[name] = (module, attr if eq else name)
    return table


_EXPORTS = _exports()


def __getattr__(name: str) -> Any:
    try:
        module_name, attr = _EXPORTS[name]
    except KeyError:
        # a submodule (smp.model.DistributedModel, as transformers writes it): imported on first use too
        if name.startswith("_") or importlib.util.find_spec(f"mp.{name}") is None:
            raise AttributeError(f"module 'mp' has no attribute {name!r}") from None
        return importlib.import_module(f"mp.{name}")
    value: Any = importlib.import_module(module_name)
    for part in attr.split(".") if attr else ():
        value = getattr(value, part)
    globals()[name] = value  # resolved once; later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Facade(types.ModuleType):
    """Importing a submodule sets it as an attribute of its package: mp.init (the module) would then
    hide smp.init (the function). Eager imports used to rebind those names afterwards; here the
    package keeps its smp names instead (checkpoint, init, memory_report, state, step)."""

    def __setattr__(self, name: str, value: Any) -> None:
        target = _EXPORTS.get(name)
        if target is not None and target[1] and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Facade

__all__ = [
    "DP_GROUP",
    "MP_GROUP",
    "PP_GROUP",
    "RDP_GROUP",
    "TP_GROUP",
    "WORLD",
    "BwdExecutionNotInStepFnError",
    "CheckpointingConfigError",
    "CommGroup",
    "CommGroupConfigError",
    "ConfigError",
    "CorruptCheckpointError",
    "DDPNotEnabledError",
    "DelayedParamDeviceError",
    "DistEmbeddingConfigError",
    "DistTransformerConfigError",
    "DistributedModel",
    "DistributedModelNotWrappedError",
    "DistributedModelWrappedError",
    "DistributedOptimizer",
    "FwdExecutionNotInStepFnError",
    "IncompatibleCheckpointFoundError",
    "IncompatibleCheckpointRankFoundError",
    "InvalidPartitionIDError",
    "InvalidStepOutputError",
    "MissingCheckpointFilesError",
    "ModelNotPartitionedError",
    "ModelParallelConfig",
    "MultipleDistributedModelError",
    "MultipleDtypeOptShardingError",
    "NotInitializedError",
    "NotSupportedByFastModeError",
    "PartitionFileError",
    "PipelineAbortedError",
    "PipelineTimeoutError",
    "RankType",
    "RemoteExecutionError",
    "SMPCheckpointError",
    "SMPConfigError",
    "SMPInvalidArgumentError",
    "SMPRuntimeError",
    "SMPUnsupportedError",
    "SMPValidationError",
    "StepFunctionCalledError",
    "StepOutput",
    "TPModuleRegisterError",
    "TensorSplitError",
    "UnsupportedTPModuleError",
    "UntrustedCheckpointFileError",
    "WorkerSizeError",
    "allgather",
    "amp",
    "barrier",
    "broadcast",
    "checkpoint",
    "checkpoint_sequential",
    "delay_param_initialization",
    "dp_barrier",
    "dp_rank",
    "dp_size",
    "gather",
    "get_dp_group",
    "get_dp_process_group",
    "get_mp_group",
    "get_mp_process_group",
    "get_pp_group",
    "get_pp_process_group",
    "get_rdp_group",
    "get_rdp_process_group",
    "get_tp_group",
    "get_tp_process_group",
    "get_world_group",
    "get_world_process_group",
    "init",
    "is_initialized",
    "is_tracing",
    "load",
    "load_config",
    "local_rank",
    "local_size",
    "memory_report",
    "model_creation",
    "mp_barrier",
    "mp_rank",
    "mp_size",
    "nn",
    "num_microbatches",
    "optimizers",
    "partition",
    "pp_barrier",
    "pp_rank",
    "pp_size",
    "rank",
    "rdp_barrier",
    "rdp_rank",
    "rdp_size",
    "recv_from",
    "reset",
    "resume_from_checkpoint",
    "save",
    "save_checkpoint",
    "send",
    "set_activation_checkpointing",
    "set_partition",
    "set_tensor_parallelism",
    "shutdown",
    "size",
    "state",
    "step",
    "tensor_parallelism",
    "timeline",
    "tp_barrier",
    "tp_rank",
    "tp_register",
    "tp_register_with_module",
    "tp_size",
    "wait_checkpoint",
]
