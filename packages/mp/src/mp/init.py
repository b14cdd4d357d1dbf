"""`smp.init`: read and check the config, start the world, build the topology and its groups; the
pipeline transport the first pipelined model opens; `smp.reset` releases them all."""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist

import mp.tensor_api  # noqa: F401  (installs mp_tensor's context provider, as `import mp` did eagerly)
from mp.atp_setup import setup_atp_mesh
from mp.config import ConfigSource, check_paths, load_config, validate_world
from mp.config_rules import refuse_not_built
from mp.dp_backend import check_engines, world_backend, world_port
from mp.state import State, state
from mp_comm import (
    EXIT_TIMEOUT,
    GroupKind,
    LoopbackTransport,
    Router,
    Stage,
    Transport,
    TransportConfig,
    World,
    WorldInfo,
    at_exit,
    build_topology,
    init_world,
    start_heartbeat,
    stop_heartbeat,
)

log = logging.getLogger(__name__)

_GROUP_KINDS = (GroupKind.PP, GroupKind.TP, GroupKind.RDP, GroupKind.DP, GroupKind.MP)


def _load_runtime() -> None:
    """Import every smp name's module now, before the world starts (`import mp` loads none of them).
    Imported later, they would compete with the world's threads (heartbeat, transports) for the GIL and,
    on a host with more ranks than cores, with the other ranks' busy waits: examples/mnist_cnn.py on 4
    ranks took 40 CPU-s instead of 24."""
    import mp

    for name in mp.__all__:
        getattr(mp, name)


def init(config: ConfigSource = None) -> None:
    """Initialize mp; must come before any other smp call. Collective over all ranks.

    `config` is a dict, a path to a JSON file, or None (then the JSON in MP_CONFIG, else in
    SM_HP_MP_PARAMETERS as SageMaker and the HuggingFace Trainer set it, else the defaults). Any
    problem with the config (including a key whose feature mp does not build yet), or a world size
    that does not fit it, raises the same ValueError on every rank before a process group is created.
    A second call logs a warning and is ignored, as in smp; call `smp.reset()` first to re-initialize
    with another config.
    """
    if state.initialized:
        log.warning("smp.init was called again; ignoring it (call smp.reset() first to re-initialize)")
        return
    cfg = load_config(config)
    refuse_not_built(cfg)  # a memory saver mp does not build must not train as if it were on
    _load_runtime()

    def check(info: WorldInfo) -> None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
        if os.environ.get("MP_SHARE_GPUS") == "1":
            gpus = None  # ranks may share GPUs (testing on one GPU); collectives then go through gloo
        validate_world(cfg, info.size, info.local_size, gpus)
        check_paths(cfg, info.rank)  # the files it names, as this rank uses them

    check_engines(cfg)  # ddp_dist_backend, ddp_port, horovod, herring (mp.dp_backend)
    world = init_world(validate=check, backend=world_backend(cfg), port=world_port(cfg))
    topology = build_topology(
        world.size,
        cfg.pipeline_parallel_degree,
        cfg.tensor_parallel_degree,
        cfg.placement_strategy,
        ranks_per_node=world.info.local_size
        if world.info.num_nodes * world.info.local_size == world.size
        else None,
    )
    world_pg = dist.group.WORLD
    assert world_pg is not None
    groups: dict[GroupKind, dist.ProcessGroup] = {GroupKind.WORLD: world_pg}
    created: list[dist.ProcessGroup] = []
    for kind in _GROUP_KINDS:
        # Collective: every rank creates every group, in the same order.
        for ranks, pg in zip(topology.groups(kind), world.new_groups(topology.groups(kind)), strict=True):
            if pg is None:
                continue
            created.append(pg)
            if world.rank in ranks:
                groups[kind] = pg
    state.cfg, state.world, state.topology = cfg, world, topology
    state.process_groups, state.created_groups = groups, created
    state.atp_mesh = setup_atp_mesh(cfg, world, topology)
    me = topology.coords(world.rank)
    start_heartbeat(world, f"pp_rank {me.pp_rank}, tp_rank {me.tp_rank}, rdp_rank {me.rdp_rank}")
    log.info("mp initialized: %s", topology.describe(with_groups=False).splitlines()[0])


def is_initialized() -> bool:
    """True once `smp.init` has run (and until `smp.reset`/`smp.shutdown`)."""
    return state.initialized


def reset() -> None:
    """Forget the current initialization: destroy mp's groups and release the world it started."""
    _release()


def pipeline_transport(world: World) -> Transport:
    """The transport pipelined models run on: opened by the first one (collective), closed by smp.reset.

    A router over MPI and, where CUDA and ucxx exist, UCX (device tensors then move GPU to GPU);
    on CPU only MPI remains and is used directly.
    """
    transport: Transport | None = state.transport
    if transport is None or transport.closed:
        config = TransportConfig(timeout=3600.0)
        if world.size == 1:
            transport = LoopbackTransport.single(config=config)
        else:
            router = Router.create(world, transport_config=config)
            transport = router if len(router.transports) > 1 else next(iter(router.transports.values()))
        state.transport = transport
    return transport


def _release(transport_timeout: float | None = None) -> None:
    from mp.checkpoint import finish_background

    failed = finish_background()  # a background checkpoint save ends before its group goes
    world = state.world
    runtime = state.model.runtime if state.model is not None else None
    if runtime is not None:
        runtime.close()  # stop the pipeline's worker threads now, not when they notice the closed transport
    if state.transport is not None:
        try:
            state.transport.close(transport_timeout)  # collective, like everything in reset
        except Exception:
            if transport_timeout is None:
                raise
            # Harmless at exit: usually another rank simply finished later than this one.
            log.info("the pipeline transport did not meet the other ranks at exit: %s", sys.exc_info()[1])
    if state.atp_mesh is not None:
        from mp_tensor import destroy_mesh

        destroy_mesh()
    for pg in state.created_groups:
        dist.destroy_process_group(pg)
    stop_heartbeat()  # before the world: its peers stop watching a rank that ends normally
    if world is not None:
        world.shutdown()
    fresh = State()
    for name in State.__dataclass_fields__:
        setattr(state, name, getattr(fresh, name))
    if failed is not None:
        raise failed


def shutdown() -> None:
    """Tear mp down at the end of a job (same as `reset`)."""
    reset()


def _release_at_exit() -> None:
    # A script that ends without smp.shutdown (smp scripts do): reset's teardown, before mp_comm's stages
    # close the transports and destroy the groups it no longer references. The transport's close meets
    # the other ranks for a few seconds at most, so a rank that leaves while others run does not hang.
    if not state.initialized:
        return
    from mp.checkpoint import finish_background

    rank = state.world.rank if state.world is not None else 0
    failed = finish_background()  # the last background save (Python joined its thread before atexit)
    if failed is not None:
        # Never silently, and before the teardown: when a rank ended mid-save (the ranks could not agree),
        # the teardown's meetings, then mpi4py's MPI_Finalize, would wait for that rank (for ever under a
        # launcher that does not end the job when one rank dies: `mpiexec -disable-auto-cleanup`). An exit
        # without MPI_Finalize is a failure every launcher sees and ends the job for. Printed, not logged:
        # the script's logging configuration may drop mp's records.
        sys.stdout.flush()
        print(
            f"[rank {rank}] mp: {failed}\nThe process exits with status 1: its last checkpoint was not saved",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
    _release(transport_timeout=EXIT_TIMEOUT)


at_exit(Stage.USERS, _release_at_exit)
