"""Starting the process world: under mpiexec, under torchrun, or as one plain process.

`init_world` finds out how the processes were started, groups them by host, sets torch's thread
count, and brings up torch.distributed (gloo on CPU; NCCL for CUDA tensors with gloo beside it for
CPU objects). The user never provides MASTER_ADDR/MASTER_PORT under MPI: across hosts the job's
addresses are chosen and checked first (:mod:`mp_comm.network`), then rank 0 opens a TCPStore on a free
port of the address every rank reached and shares it over MPI.

Where this process sits (its launcher, rank and host, `WorldInfo`) is worked out in
:mod:`mp_comm.world_info`, re-exported here.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from mp_comm import gloo_workers  # noqa: F401 (registers the last exit stage: waiting for gloo's workers)
from mp_comm.errors import NetworkError, WorldError
from mp_comm.network import JobAddress, address_towards, choose_job_address, preflight_timeout
from mp_comm.teardown import Stage, at_exit
from mp_comm.world_info import (  # noqa: F401 (tests import _check_launched_size, _placement, _usable_cores here)
    Launcher,
    WorldInfo,
    _check_launched_size,
    _env_int,
    _mpi_coordinates,
    _placement,
    _set_thread_count,
    _slurm_coordinates,
    _usable_cores,
    detect_launcher,
    first_slurm_host,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "Launcher",
    "World",
    "WorldInfo",
    "detect_launcher",
    "init_world",
    "mpi_comm_of",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
_REPORT_GRACE = 1.0  # seconds for the launcher to forward a dying rank's traceback before MPI_Abort

# The MPI twin of a torch process group: a communicator over the same ranks, in the same order, so that
# CPU-tensor collectives can run on MPICH (several times faster than gloo here) instead of gloo.
# Written only by `World` (which creates, owns and frees the communicators) and read through
# `mpi_comm_of`. It is keyed by the group because the collectives API takes nothing but a
# ProcessGroup (smp's signatures), and torch's ProcessGroup has no room for an attribute of ours;
# the keys are weak, so a group that is gone takes its entry with it.
_MPI_TWINS: weakref.WeakKeyDictionary[dist.ProcessGroup, Any] = weakref.WeakKeyDictionary()


def mpi_comm_of(group: dist.ProcessGroup | None) -> Any | None:
    """The MPI communicator a World created beside `group` (same ranks, same order), or None.

    None when the world was not started under MPI (torchrun, one process), when the group was made
    by `dist.new_group` instead of `World.new_groups`, or once the World has been shut down.
    """
    if group is None:
        group = dist.group.WORLD
    if group is None:
        return None
    comm = _MPI_TWINS.get(group)
    if comm is None or not comm:  # a freed communicator is MPI_COMM_NULL, which is falsy
        return None
    return comm


def _listener(host: str, port: int) -> tuple[int, int]:
    """A TCP socket listening on ``host``'s address only, as (file descriptor for TCPStore to own, port):
    TCPStore itself would listen on every interface of rank 0's host."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
        chosen = int(sock.getsockname()[1])
    except OSError:
        sock.close()
        raise
    return sock.detach(), chosen


def _free_port_store(
    host: str, world_size: int, timeout: datetime.timedelta, port: int | None = None
) -> dist.TCPStore:
    try:
        fd, chosen = _listener(host, port or 0)
        return dist.TCPStore(
            host, chosen, world_size, True, timeout=timeout, wait_for_workers=False, master_listen_fd=fd
        )
    except (RuntimeError, OSError) as exc:
        if not port:
            raise
        raise WorldError(
            f"rank 0 cannot listen on port {port} for the rendezvous store ({exc}); expected a free TCP "
            "port. Fix: choose another port, or none (a free one is picked)"
        ) from exc


@dataclass
class World:
    """The started world: its coordinates, its torch.distributed backend and, under MPI, the communicator.

    `mpi_comm` is a duplicate of MPI_COMM_WORLD owned by mp (None unless started under MPI), so that
    mp's traffic never mixes with the user's own MPI messages.
    """

    info: WorldInfo
    backend: str
    device: torch.device
    mpi_comm: Any | None
    owns_process_group: bool
    network: JobAddress = field(default_factory=lambda: JobAddress("127.0.0.1", "127.0.0.1", "lo"))
    """This rank's address on the job's network and its interface, which every layer uses."""
    _group_comms: list[Any] = field(default_factory=list, init=False, repr=False)
    """The MPI twins this World created for its groups (freed by `shutdown`)."""
    _groups: list[dist.ProcessGroup] = field(default_factory=list, init=False, repr=False)
    """The process groups `new_groups` created here and nobody destroyed yet (destroyed by `shutdown`)."""
    previous_excepthook: Any = field(default=None, repr=False)
    """sys.excepthook before this World started torch.distributed (put back by `shutdown`)."""
    previous_exit: Any = field(default=None, repr=False)
    """sys.exit before this World wrapped it (put back by `shutdown`; see `_name_exit`)."""
    previous_os_exit: Any = field(default=None, repr=False)
    """os._exit before this World wrapped it (put back by `shutdown`; see `_name_os_exit`)."""
    _cancel_exit: Callable[[], None] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        world_pg = dist.group.WORLD if dist.is_initialized() else None
        if self.mpi_comm is not None and world_pg is not None:
            _MPI_TWINS[world_pg] = self.mpi_comm  # same ranks, same order as the default group
        # A script that never shuts down still tears down in order (see mp_comm.teardown).
        self._cancel_exit = at_exit(Stage.WORLD, self.shutdown)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def size(self) -> int:
        return self.info.size

    def new_groups(self, groups: Sequence[Sequence[int]]) -> list[dist.ProcessGroup | None]:
        """Create torch groups for a partition of some ranks; collective over the whole world.

        Every rank must pass the same list in the same order. Returns one entry per group: the
        ProcessGroup for groups this rank belongs to, None for the others. Under MPI, each group of
        this rank also gets an MPI communicator over the same ranks (see `mpi_comm_of`), which the
        collectives use for CPU tensors.
        """
        made: list[dist.ProcessGroup | None] = []
        for ranks in groups:
            members = sorted(ranks)
            pg = dist.new_group(members, use_local_synchronization=False)
            mine = self.rank in members
            made.append(pg if mine else None)
            if mine and pg is not None:
                self._groups.append(pg)
            if mine and pg is not None and self.mpi_comm is not None:
                # Collective over the members only; every member creates its groups in the same order.
                mpi_group = self.mpi_comm.Get_group()
                subset = mpi_group.Incl(members)
                comm = self.mpi_comm.Create_group(subset)
                subset.Free()
                mpi_group.Free()
                self._group_comms.append(comm)
                _MPI_TWINS[pg] = comm
        return made

    def destroy_groups(self, groups: Sequence[dist.ProcessGroup | None]) -> None:
        """Destroy groups made by `new_groups`, with their MPI twins; collective over their members."""
        for pg in groups:
            if pg is None:
                continue
            comm = _MPI_TWINS.pop(pg, None)
            if comm is not None and any(comm is c for c in self._group_comms):
                self._group_comms = [c for c in self._group_comms if c is not comm]
                comm.Free()
            self._groups = [g for g in self._groups if g is not pg]
            dist.destroy_process_group(pg)

    def _forget_twins(self) -> None:
        owned = {id(c) for c in self._group_comms}
        if self.mpi_comm is not None:
            owned.add(id(self.mpi_comm))
        for pg, comm in list(_MPI_TWINS.items()):
            if id(comm) in owned:
                del _MPI_TWINS[pg]

    def shutdown(self) -> None:
        """Tear down what init_world created: the groups `new_groups` made, the process group it
        started, the MPI communicators. Local (no rank waits for another); a second call does nothing.

        Runs at interpreter exit if the script did not call it (mp_comm.teardown), after the transports
        have closed: destroying a group joins its gloo worker threads, which must happen while the
        interpreter can still run the Python they may need.
        """
        if self._cancel_exit is not None:
            self._cancel_exit()
            self._cancel_exit = None
        self._forget_twins()
        groups, self._groups = self._groups, []
        for pg in reversed(groups):
            # Groups another owner destroyed first (smp.reset, the user) are no longer registered.
            with contextlib.suppress(ValueError):
                dist.destroy_process_group(pg)
        del groups  # the last references: the groups' C++ destructors join their threads now
        for comm in self._group_comms:
            if comm:
                comm.Free()
        self._group_comms.clear()
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            if self.previous_excepthook is not None:
                sys.excepthook = self.previous_excepthook
            if self.previous_exit is not None:
                sys.exit = self.previous_exit
            if self.previous_os_exit is not None:
                os._exit = self.previous_os_exit
        if self.mpi_comm is not None:
            self.mpi_comm.Free()
            self.mpi_comm = None


def _choose_backend(requested: str | None, local_size: int = 1) -> tuple[str, torch.device]:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so a node with more ranks than
    # GPUs cannot use it; gloo then carries the CUDA tensors too (it stages them through the host).
    shares_gpu = gpus > 0 and local_size > gpus
    if requested is not None:
        if requested not in ("gloo", "nccl", "cpu:gloo,cuda:nccl"):
            raise WorldError(
                f"backend={requested!r} is not supported; expected 'gloo', 'nccl' or "
                "'cpu:gloo,cuda:nccl'. Leave it unset to choose automatically (gloo on CPU, NCCL on GPU)."
            )
        wants_cuda = "nccl" in requested
        if wants_cuda and shares_gpu:
            raise WorldError(
                f"backend={requested!r} needs one GPU per rank, but {local_size} ranks share {gpus} GPU(s) "
                "on this node; start at most one rank per GPU, or ask for backend='gloo'."
            )
        return requested, torch.device("cuda", torch.cuda.current_device()) if wants_cuda else torch.device(
            "cpu"
        )
    if shares_gpu:
        log.warning(
            "%d ranks share %d GPU(s) on this node; NCCL needs one GPU per rank, so collectives use gloo",
            local_size,
            gpus,
        )
        return "gloo", torch.device("cuda", torch.cuda.current_device())
    if gpus > 0:
        # NCCL carries CUDA tensors, gloo carries CPU tensors and pickled objects, in one group.
        return "cpu:gloo,cuda:nccl", torch.device("cuda", torch.cuda.current_device())
    return "gloo", torch.device("cpu")


def init_world(
    *,
    backend: str | None = None,
    port: int | None = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    environ: Mapping[str, str] | None = None,
    validate: Callable[[WorldInfo], None] | None = None,
) -> World:
    """Start (or adopt) the process world. Collective: every rank of the job must call it.

    `validate` sees every rank's WorldInfo once the ranks are known and before any torch process
    group exists, so a configuration that does not fit the world fails identically on every rank
    without leaving a half-built world behind.

    If torch.distributed is already initialized (a user script that called init_process_group, or
    a second call), the existing default group is adopted and not torn down by `shutdown`.

    `port` fixes the rendezvous store's TCP port (rank 0 listens on it; under torchrun it replaces
    MASTER_PORT); None picks a free one under MPI and keeps the launcher's under torchrun.
    """
    env = os.environ if environ is None else environ
    launcher = detect_launcher(env)
    mpi_comm: Any | None = None
    if launcher is Launcher.MPI:
        mpi_comm, info = _mpi_coordinates()
    elif launcher is Launcher.TORCHRUN:
        size = _env_int(env, "WORLD_SIZE")
        local_size = _env_int(env, "LOCAL_WORLD_SIZE", size)
        info = WorldInfo(
            rank=_env_int(env, "RANK"),
            size=size,
            local_rank=_env_int(env, "LOCAL_RANK", 0),
            local_size=local_size,
            node=_env_int(env, "GROUP_RANK", 0),
            num_nodes=max(1, size // max(1, local_size)),
            launcher=Launcher.TORCHRUN,
        )
    elif launcher is Launcher.SLURM:
        info = _slurm_coordinates(env)
    else:
        info = WorldInfo(rank=0, size=1, local_rank=0, local_size=1, node=0, num_nodes=1, launcher=launcher)

    if validate is not None:
        try:
            _validate_everywhere(validate, info, mpi_comm)
        except BaseException:
            if mpi_comm is not None:
                mpi_comm.Free()
            raise
    _set_thread_count(info, env)
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    chosen, device = _choose_backend(backend, info.local_size)

    if dist.is_initialized():
        if dist.get_world_size() != info.size or dist.get_rank() != info.rank:
            raise WorldError(
                f"torch.distributed is already initialized with rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the launcher says rank {info.rank} of {info.size}; "
                "initialize torch.distributed with the launcher's ranks or let mp do it."
            )
        return World(info, str(dist.get_backend()), device, mpi_comm, owns_process_group=False)

    # init_process_group chains a rank-prefixing hook onto sys.excepthook every time: restored at shutdown,
    # so that a process that starts worlds repeatedly (tests, benchmark grids) prefixes tracebacks once.
    excepthook = sys.excepthook
    network = JobAddress("127.0.0.1", "127.0.0.1", "lo")
    if launcher is Launcher.MPI:
        assert mpi_comm is not None
        try:
            bound = preflight_timeout(env)
            network = choose_job_address(
                mpi_comm, info.rank, info.node, info.num_nodes, environ=env, timeout=bound
            )
            _use_interface(network, info.num_nodes, environ is None)
            store = _mpi_store(mpi_comm, info, network.rendezvous, port, timeout=timeout, bound=bound)
        except BaseException:
            mpi_comm.Free()
            raise
        dist.init_process_group(chosen, store=store, rank=info.rank, world_size=info.size, timeout=timeout)
    elif launcher is Launcher.TORCHRUN:
        if info.num_nodes > 1:  # torchrun chose the store; this rank's address is its end of a connection
            master_port = _env_int(env, "MASTER_PORT", 29500)
            network = address_towards(
                env.get("MASTER_ADDR", "127.0.0.1"), master_port, preflight_timeout(env)
            )
            _use_interface(network, info.num_nodes, environ is None)
        if port:  # a store of mp's own (torchrun's tcp:// handler would look for its agent's store there)
            master = env.get("MASTER_ADDR", "127.0.0.1")
            if info.rank == 0:
                store = _free_port_store(master, info.size, timeout, port)
            else:
                store = dist.TCPStore(master, port, info.size, False, timeout=timeout)
            dist.init_process_group(
                chosen, store=store, rank=info.rank, world_size=info.size, timeout=timeout
            )
        else:
            dist.init_process_group(chosen, init_method="env://", timeout=timeout)
    elif launcher is Launcher.SLURM:
        store, network = _slurm_store(env, info, port, timeout)
        _use_interface(network, info.num_nodes, environ is None)
        dist.init_process_group(chosen, store=store, rank=info.rank, world_size=info.size, timeout=timeout)
    else:
        dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    previous_exit = previous_os_exit = None
    if launcher is Launcher.MPI and info.size > 1:
        sys.excepthook = _abort_job_after(sys.excepthook, info.rank)
        previous_exit, sys.exit = sys.exit, _name_exit(info.rank)
        previous_os_exit = os._exit
        os._exit = _name_os_exit(info.rank, previous_os_exit)
    log.debug("rank %d/%d started by %s on node %d", info.rank, info.size, launcher.value, info.node)
    return World(
        info,
        chosen,
        device,
        mpi_comm,
        owns_process_group=True,
        network=network,
        previous_excepthook=excepthook,
        previous_exit=previous_exit,
        previous_os_exit=previous_os_exit,
    )


def _use_interface(network: JobAddress, num_nodes: int, own_environment: bool) -> None:
    """Point gloo and NCCL at the job's interface, unless the user chose theirs: left to themselves,
    they take whatever the host's name resolves to, which on a host with several networks is often
    not the one the others reach."""
    if num_nodes == 1 or network.interface is None or not own_environment:
        return
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, network.interface)


def _slurm_store(
    env: Mapping[str, str], info: WorldInfo, port: int | None, timeout: datetime.timedelta
) -> tuple[dist.Store, JobAddress]:
    """The rendezvous of an srun step: rank 0's store on the step's first host (MASTER_ADDR when set)
    at a port every task derives alike (the config's, MASTER_PORT, else one from the job id)."""
    if info.num_nodes == 1:
        host = env.get("MASTER_ADDR", "127.0.0.1")
    else:
        host = env.get("MASTER_ADDR") or first_slurm_host(_env_str(env, "SLURM_STEP_NODELIST"))
    if port is None:
        port = _env_int(env, "MASTER_PORT", 20000 + _env_int(env, "SLURM_JOB_ID", 0) % 20000)
    bound = preflight_timeout(env)
    if info.rank == 0:
        address = socket.gethostbyname(host)
        store: dist.Store = _free_port_store(address, info.size, timeout, port)
    else:
        try:
            store = _client_store(host, port, info.size, bound=bound, timeout=timeout)
        except (RuntimeError, OSError) as exc:
            raise NetworkError(
                f"rank {info.rank} on {socket.gethostname()} could not connect to the rendezvous store of "
                f"rank 0 at {host}:{port} within {bound:g} s ({str(exc).splitlines()[0]}). Fix: set "
                "MASTER_ADDR to rank 0's address on the network the hosts share (and MASTER_PORT to a free "
                "port), or raise MP_PREFLIGHT_TIMEOUT"
            ) from None
    if info.num_nodes == 1:
        return store, JobAddress("127.0.0.1", "127.0.0.1", "lo")
    return store, address_towards(host, port, bound)


def _client_store(
    host: str, port: int, size: int, *, bound: float, timeout: datetime.timedelta
) -> dist.Store:
    """A client of rank 0's store that gives up connecting after `bound` seconds (torch raises then),
    and then waits on keys as long as any collective (`timeout`)."""
    store = dist.TCPStore(host, port, size, False, timeout=datetime.timedelta(seconds=bound))
    store.set_timeout(timeout)
    return store


def _env_str(env: Mapping[str, str], name: str) -> str:
    if not env.get(name):
        raise WorldError(f"{name} is not set; srun sets it. Start the job's tasks with srun.")
    return env[name]


def _mpi_store(
    comm: Any, info: WorldInfo, host: str, port: int | None, *, timeout: datetime.timedelta, bound: float
) -> dist.Store:
    """Rank 0 opens the rendezvous store on `host` and broadcasts address and port together; every
    other rank connects to exactly that. A rank that cannot connect within `bound` seconds makes every
    rank raise, naming it and the address it tried."""
    opened: tuple[str, int] | str
    store: dist.Store | None = None
    if info.rank == 0:
        try:
            store = _free_port_store(host, info.size, timeout, port)
            opened = (host, store.port)
        except (WorldError, RuntimeError, OSError) as exc:
            opened = str(exc)
        opened = comm.bcast(opened, root=0)
    else:
        opened = comm.bcast(None, root=0)
    if isinstance(opened, str):
        raise WorldError(f"rank 0 could not open the rendezvous store: {opened}")
    address, chosen = opened
    failure = ""
    if info.rank != 0:
        try:
            store = _client_store(address, chosen, info.size, bound=bound, timeout=timeout)
        except (RuntimeError, OSError) as exc:  # torch raises DistStoreError (a RuntimeError) on timeout
            failure = f"rank {info.rank} on {socket.gethostname()}: {str(exc).splitlines()[0]}"
    failures = [f for f in comm.allgather(failure) if f]
    if failures:
        raise NetworkError(
            f"{len(failures)} rank(s) could not connect to the rendezvous store at {address}:{chosen} "
            f"within {bound:g} s: " + "; ".join(failures[:8]) + ". Fix: set MP_IFNAME (or MASTER_ADDR) to "
            "the interface (address) of rank 0's host on the network the hosts share, or raise "
            "MP_PREFLIGHT_TIMEOUT"
        )
    assert store is not None
    return store


def _validate_everywhere(validate: Callable[[WorldInfo], None], info: WorldInfo, comm: Any | None) -> None:
    """Run `validate` here; under MPI, also learn whether it failed on another rank, so that every rank
    stops with the first failing rank's reason. Checks that only some ranks can fail (a file that one
    host lacks, a folder only rank 0 writes to) would otherwise end that rank alone while the others
    wait for it at the rendezvous until its timeout."""
    try:
        validate(info)
    except Exception as exc:
        if comm is not None and info.size > 1:
            comm.allgather(f"{type(exc).__name__}: {exc}")
        raise
    if comm is None or info.size == 1:
        return
    failures = [(rank, reason) for rank, reason in enumerate(comm.allgather(None)) if reason is not None]
    if failures:
        rank, reason = failures[0]
        raise WorldError(
            f"rank {rank} of {info.size} refused to start, so this rank ({info.rank}) stops too: {reason}"
        )


def _name_peers(exc: BaseException) -> None:
    """Add to `exc` which hosts and ranks the addresses in its message are (mp_comm.heartbeat knows)."""
    from mp_comm.heartbeat import who_is_at

    with contextlib.suppress(Exception):
        note = who_is_at(str(exc))
        if note:
            exc.add_note(f"mp: {note}")


class _RankExit(SystemExit):
    """The SystemExit of `_name_exit`'s sys.exit. Dropped while Python code still runs, it was caught
    (the script goes on): the record is cleared. Dropped by the interpreter itself, with no Python
    frame left, it ends the process: the record stays for `_abort_after_teardown`."""

    def __del__(self) -> None:
        try:
            sys._getframe(1)
        except ValueError:  # no caller: the interpreter is exiting with this status
            return
        _EXIT_STATUS.clear()


def _name_exit(rank: int) -> Callable[..., NoReturn]:
    """A sys.exit that names the rank, and where it called sys.exit, when the main thread exits with a
    non-zero status under plain `mpiexec`, and ends the job with that status.

    Python reports no SystemExit (sys.excepthook never sees one), and Hydra prints nothing for an exit
    status of 1 and leaves the other ranks running: a rank that called ``sys.exit(1)`` (or a library
    that did) ended with no line from any rank (issue 47's symptom) while its peers waited for it.
    The exit goes on as usual (``finally`` blocks, atexit handlers, mp's teardown); then
    `_abort_after_teardown` prints the rank's line and calls MPI_Abort with the status. Under
    `mp-launch` the rank runner does this instead; a ``raise SystemExit(1)`` written out is not seen.
    """

    def exit(status: object = None) -> NoReturn:
        failed = status is not None and status != 0 and not os.environ.get("MP_LAUNCH_FAILURE_DIR")
        if failed and threading.current_thread() is threading.main_thread():
            caller = sys._getframe(1)
            where = f"{caller.f_code.co_filename}:{caller.f_lineno} in {caller.f_code.co_name}"
            code = status if isinstance(status, int) else 1
            _EXIT_STATUS[:] = [(rank, code, f"sys.exit({status!r}) at {where}")]
            raise _RankExit(status)
        raise SystemExit(status)

    return exit


def _name_os_exit(rank: int, os_exit: Callable[[int], NoReturn]) -> Callable[..., NoReturn]:
    """An os._exit that first says which rank ends, with what status and where it was called, under
    `mpiexec` while MPI is up.

    os._exit skips the rank's teardown and MPI_Finalize, and Hydra then ends every other rank of the job
    without a word: with status 1 mpiexec returns 1 silently, and with status 0 it returns 0 while the
    other ranks' work and unprinted output are lost. A library or script that calls it would leave no
    trace of which rank ended the job. A forked child (a DataLoader worker) exits as it always did.
    """
    pid = os.getpid()

    def _exit(status: int) -> NoReturn:
        if os.getpid() == pid:
            with contextlib.suppress(Exception):
                from mpi4py import MPI

                if MPI.Is_initialized() and not MPI.Is_finalized():
                    caller = sys._getframe(1)
                    where = f"{caller.f_code.co_filename}:{caller.f_lineno} in {caller.f_code.co_name}"
                    sys.stdout.flush()
                    print(
                        f"[rank {rank}] mp: os._exit({status!r}) at {where}; this rank ends now, without "
                        "MPI_Finalize, and mpiexec ends the other ranks",
                        file=sys.stderr,
                        flush=True,
                    )
        os_exit(status)

    return _exit


_EXIT_STATUS: list[tuple[int, int, str]] = []
"""(rank, status, the call) while the main thread exits through `_name_exit`'s sys.exit."""


def _abort_after_teardown() -> None:
    """Last at exit (after every World's shutdown): name the rank that called sys.exit with a non-zero
    status, and end the whole job with that status (mpiexec would leave the other ranks waiting)."""
    if not _EXIT_STATUS:
        return
    rank, code, call = _EXIT_STATUS[0]
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized():
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            print(
                f"[rank {rank}] mp: {call}; this rank ends with exit status {code}, and ends the MPI job "
                "so that no rank waits for it",
                file=sys.stderr,
                flush=True,
            )
        time.sleep(_REPORT_GRACE)  # the launcher forwards this rank's last lines before the abort
        MPI.COMM_WORLD.Abort(code)


# Registered at import, before any World's shutdown: within a stage the hook registered first runs last.
at_exit(Stage.WORLD, _abort_after_teardown)


def _abort_job_after(report: Callable[..., Any], rank: int) -> Callable[..., None]:
    """A sys.excepthook that reports an uncaught exception, then aborts the whole MPI job.

    Under plain `mpiexec` a rank that dies of an exception would otherwise exit normally (atexit,
    MPI_Finalize) while its peers wait for it, in a collective or in MPI_Finalize itself, until the job's
    time runs out: mpiexec tears a job down only when a rank exits non-zero or is killed. MPI_Abort
    stops every rank now, with this rank's traceback as the last word (`mp-launch` does the same).
    """

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            _name_peers(exc)
            report(exc_type, exc, tb)
            print(
                f"[rank {rank}] mp: uncaught {exc_type.__name__}; aborting the MPI job so that no rank "
                "waits for this one",
                file=sys.stderr,
                flush=True,
            )
            # MPI_Abort tears the job down at once, and the launcher drops what it has not yet forwarded
            # of the ranks' output: seen on a loaded host, where only an earlier line reached the user.
            time.sleep(_REPORT_GRACE)
        finally:
            from mpi4py import MPI

            MPI.COMM_WORLD.Abort(1)

    return hook
