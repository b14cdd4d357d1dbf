"""The one piece of global state the smp API needs: the config, the world and its groups.

smp's functions (`smp.rank()`, `smp.get_dp_process_group()`, ...) take no handle, so the facade
keeps what `smp.init` built here. Everything below the facade receives groups explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from mp.config import ModelParallelConfig
from mp.errors import NotInitializedError
from mp_comm import GroupKind, Topology, World

if TYPE_CHECKING:  # mp.model imports this module
    from mp.model import DistributedModel


@dataclass
class ModuleManager:
    """The part of smp's ``state.module_manager`` that clients read. ``translate_functions`` holds
    ``(smp_to_hf, hf_to_smp)`` state-dict translations for tensor-parallel HF models; transformers'
    ``save_pretrained`` applies each ``smp_to_hf`` on its smp path (empty: nothing to translate)."""

    translate_functions: list[tuple[Callable[[Any], Any], Callable[[Any], Any]]] = field(default_factory=list)


@dataclass
class State:
    """What `smp.init` built. `cfg` is public because smp scripts read `smp.state.cfg.fp16`."""

    cfg: ModelParallelConfig | None = None
    world: World | None = None
    topology: Topology | None = None
    process_groups: dict[GroupKind, dist.ProcessGroup] = field(default_factory=dict)
    created_groups: list[dist.ProcessGroup] = field(default_factory=list)
    atp_mesh: Any = None
    """The mp_tensor.atp DeviceMesh built from the config's atp_mesh, if any."""
    transport: Any = None
    """The point-to-point transport of the pipeline (mp_comm), opened by the first pipelined model."""
    model: DistributedModel | None = None
    """The one DistributedModel of this process (smp's facade functions read it once, at their top, and
    pass its placement and module down)."""
    optimizer: Any = None
    checkpoint_group: Any = None
    """The gloo group of every rank that background checkpoint saves agree over (mp.checkpoint; made by
    the first ``save_checkpoint(async_save=True)``), apart from the groups training uses."""
    module_manager: ModuleManager = field(default_factory=ModuleManager)

    @property
    def initialized(self) -> bool:
        return self.world is not None

    def require(self) -> tuple[ModelParallelConfig, World, Topology]:
        if self.cfg is None or self.world is None or self.topology is None:
            raise NotInitializedError("smp is not initialized! Call smp.init(config) first.")
        return self.cfg, self.world, self.topology


state = State()
