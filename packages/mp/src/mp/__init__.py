"""mp: model parallelism for PyTorch behind the SageMaker model parallelism v1 API.

import mp as smp
smp.init({"pipeline_parallel_degree": 2, "microbatches": 4})
"""

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
from mp.errors import *  # noqa: F403  (smp's exception names, so scripts can catch them as smp.X)
from mp.errors import __all__ as _error_names
from mp.init import init, is_initialized, reset, shutdown
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

__version__ = "0.1.0"

# smp exposes every CommGroup member at top level too (smp.WORLD, smp.DP_GROUP, ...).
WORLD = CommGroup.WORLD
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP
DP_GROUP = CommGroup.DP_GROUP
MP_GROUP = CommGroup.MP_GROUP

__all__ = [
    "DP_GROUP",
    "MP_GROUP",
    "PP_GROUP",
    "RDP_GROUP",
    "TP_GROUP",
    "WORLD",
    "CommGroup",
    "ModelParallelConfig",
    "RankType",
    "allgather",
    "barrier",
    "broadcast",
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
    "load_config",
    "local_rank",
    "local_size",
    "mp_barrier",
    "mp_rank",
    "mp_size",
    "pp_barrier",
    "pp_rank",
    "pp_size",
    "rank",
    "rdp_barrier",
    "rdp_rank",
    "rdp_size",
    "recv_from",
    "reset",
    "send",
    "shutdown",
    "size",
    "state",
    "tp_barrier",
    "tp_rank",
    "tp_size",
    *_error_names,
]
