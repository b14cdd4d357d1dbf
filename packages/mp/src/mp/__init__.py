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

if TYPE_CHECKING:  # generated from _SOURCES by tests/mp/test_facade_table.py: do not edit
    from mp import amp as amp
    from mp import nn as nn
    from mp import optimizers as optimizers
    from mp import timeline as timeline
    from mp.activation_checkpointing import checkpoint as _checkpoint_call
    from mp.activation_checkpointing import checkpoint_sequential as checkpoint_sequential
    from mp.activation_checkpointing import set_activation_checkpointing as set_activation_checkpointing
    from mp.checkpoint import load as load
    from mp.checkpoint import resume_from_checkpoint as resume_from_checkpoint
    from mp.checkpoint import save as save
    from mp.checkpoint import save_checkpoint as save_checkpoint
    from mp.checkpoint import wait_checkpoint as wait_checkpoint
    from mp.comm import CommGroup as CommGroup
    from mp.comm import RankType as RankType
    from mp.comm import allgather as allgather
    from mp.comm import barrier as barrier
    from mp.comm import broadcast as broadcast
    from mp.comm import dp_barrier as dp_barrier
    from mp.comm import gather as gather
    from mp.comm import mp_barrier as mp_barrier
    from mp.comm import pp_barrier as pp_barrier
    from mp.comm import rdp_barrier as rdp_barrier
    from mp.comm import recv_from as recv_from
    from mp.comm import send as send
    from mp.comm import tp_barrier as tp_barrier
    from mp.config import ModelParallelConfig as ModelParallelConfig
    from mp.config import load_config as load_config
    from mp.errors import BwdExecutionNotInStepFnError as BwdExecutionNotInStepFnError
    from mp.errors import CheckpointingConfigError as CheckpointingConfigError
    from mp.errors import CommGroupConfigError as CommGroupConfigError
    from mp.errors import ConfigError as ConfigError
    from mp.errors import CorruptCheckpointError as CorruptCheckpointError
    from mp.errors import DDPNotEnabledError as DDPNotEnabledError
    from mp.errors import DelayedParamDeviceError as DelayedParamDeviceError
    from mp.errors import DistEmbeddingConfigError as DistEmbeddingConfigError
    from mp.errors import DistributedModelNotWrappedError as DistributedModelNotWrappedError
    from mp.errors import DistributedModelWrappedError as DistributedModelWrappedError
    from mp.errors import DistTransformerConfigError as DistTransformerConfigError
    from mp.errors import FwdExecutionNotInStepFnError as FwdExecutionNotInStepFnError
    from mp.errors import IncompatibleCheckpointFoundError as IncompatibleCheckpointFoundError
    from mp.errors import IncompatibleCheckpointRankFoundError as IncompatibleCheckpointRankFoundError
    from mp.errors import InvalidPartitionIDError as InvalidPartitionIDError
    from mp.errors import InvalidStepOutputError as InvalidStepOutputError
    from mp.errors import MissingCheckpointFilesError as MissingCheckpointFilesError
    from mp.errors import ModelNotPartitionedError as ModelNotPartitionedError
    from mp.errors import MultipleDistributedModelError as MultipleDistributedModelError
    from mp.errors import MultipleDtypeOptShardingError as MultipleDtypeOptShardingError
    from mp.errors import NotInitializedError as NotInitializedError
    from mp.errors import NotSupportedByFastModeError as NotSupportedByFastModeError
    from mp.errors import PartitionFileError as PartitionFileError
    from mp.errors import SMPCheckpointError as SMPCheckpointError
    from mp.errors import SMPConfigError as SMPConfigError
    from mp.errors import SMPInvalidArgumentError as SMPInvalidArgumentError
    from mp.errors import SMPRuntimeError as SMPRuntimeError
    from mp.errors import SMPUnsupportedError as SMPUnsupportedError
    from mp.errors import SMPValidationError as SMPValidationError
    from mp.errors import StepFunctionCalledError as StepFunctionCalledError
    from mp.errors import TensorSplitError as TensorSplitError
    from mp.errors import TPModuleRegisterError as TPModuleRegisterError
    from mp.errors import UnsupportedTPModuleError as UnsupportedTPModuleError
    from mp.errors import UntrustedCheckpointFileError as UntrustedCheckpointFileError
    from mp.errors import WorkerSizeError as WorkerSizeError
    from mp.init import init as init
    from mp.init import is_initialized as is_initialized
    from mp.init import reset as reset
    from mp.init import shutdown as shutdown
    from mp.memory_report import memory_report as memory_report
    from mp.model import DistributedModel as DistributedModel
    from mp.model_extras import num_microbatches as num_microbatches
    from mp.optimizer import DistributedOptimizer as DistributedOptimizer
    from mp.ranks import dp_rank as dp_rank
    from mp.ranks import dp_size as dp_size
    from mp.ranks import get_dp_group as get_dp_group
    from mp.ranks import get_dp_process_group as get_dp_process_group
    from mp.ranks import get_mp_group as get_mp_group
    from mp.ranks import get_mp_process_group as get_mp_process_group
    from mp.ranks import get_pp_group as get_pp_group
    from mp.ranks import get_pp_process_group as get_pp_process_group
    from mp.ranks import get_rdp_group as get_rdp_group
    from mp.ranks import get_rdp_process_group as get_rdp_process_group
    from mp.ranks import get_tp_group as get_tp_group
    from mp.ranks import get_tp_process_group as get_tp_process_group
    from mp.ranks import get_world_group as get_world_group
    from mp.ranks import get_world_process_group as get_world_process_group
    from mp.ranks import local_rank as local_rank
    from mp.ranks import local_size as local_size
    from mp.ranks import mp_rank as mp_rank
    from mp.ranks import mp_size as mp_size
    from mp.ranks import pp_rank as pp_rank
    from mp.ranks import pp_size as pp_size
    from mp.ranks import rank as rank
    from mp.ranks import rdp_rank as rdp_rank
    from mp.ranks import rdp_size as rdp_size
    from mp.ranks import size as size
    from mp.ranks import tp_rank as tp_rank
    from mp.ranks import tp_size as tp_size
    from mp.state import state as state
    from mp.step import step as step
    from mp.tensor_api import delay_param_initialization as delay_param_initialization
    from mp.tensor_api import model_creation as model_creation
    from mp.tensor_api import set_tensor_parallelism as set_tensor_parallelism
    from mp.tensor_api import tensor_parallelism as tensor_parallelism
    from mp.tensor_api import tp_register as tp_register
    from mp.tensor_api import tp_register_with_module as tp_register_with_module
    from mp_partition import is_tracing as is_tracing
    from mp_partition import partition as partition
    from mp_partition import set_partition as set_partition
    from mp_pipeline import PipelineAbortedError as PipelineAbortedError
    from mp_pipeline import PipelineTimeoutError as PipelineTimeoutError
    from mp_pipeline import RemoteExecutionError as RemoteExecutionError
    from mp_pipeline import StepOutput as StepOutput

    checkpoint = _checkpoint_call
    WORLD = CommGroup.WORLD
    PP_GROUP = CommGroup.PP_GROUP
    TP_GROUP = CommGroup.TP_GROUP
    RDP_GROUP = CommGroup.RDP_GROUP
    DP_GROUP = CommGroup.DP_GROUP
    MP_GROUP = CommGroup.MP_GROUP

__version__ = "0.1.0"

# THE list of smp names: module -> the names it provides ("name=attr" where they differ; "name=" is the
# module itself). __all__ and the lookup below come from it; the TYPE_CHECKING block above is generated
# from it (tests/mp/test_facade_table.py).
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

__all__ = [name for name in _EXPORTS]  # every smp name: _SOURCES is the one list
