"""The router: picks a transport for every message by smp's routing rules (docs/comm.md).

A message goes over the MPI transport when any of these holds, and over UCX (the device-to-device
path) otherwise:

* its tensors are all on the CPU (or it has none): then `RouterConfig.cpu_route` decides, MPI by
  default, the faster of the two for host memory here (benchmarks/results/comm_p2p.md);
* source and destination share a node, but their GPUs are not connected by NVLink;
* source and destination are on different nodes, but GPUDirect RDMA is not available;
* it holds more tensors than UCX's tags can name (`ucx.MAX_TENSORS`).

The last rule, not enough free space in the persistent D2D buffers, is decided per
message by the receiver inside the UCX transport, which then sends the payloads over MPI (its
fallback); sender and receiver agree on that outcome by a handshake.

The transports of a router share one mailbox and one per-destination order counter, so a receiver
takes messages by (source, tag) whatever route they took, and one sender's messages are delivered in
the order they were sent even when they took different routes.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mp_comm.errors import TransportClosedError, TransportUnavailableError
from mp_comm.message import Tag, encode_object
from mp_comm.transport.base import (
    ANY_SOURCE,
    ANY_TAG,
    Mailbox,
    MessageTransport,
    OrderCounter,
    Received,
    SendHandle,
    Transport,
    TransportConfig,
    rebuild,
)

__all__ = ["Route", "Router", "RouterConfig", "choose_route", "detect_nvlink", "detect_rdma"]

log = logging.getLogger(__name__)

_UCX_MAX_TENSORS = (1 << 16) - 1  # mirrors mp_comm.transport.ucx.MAX_TENSORS without importing ucx
_RDMA_TRANSPORTS = ("rc", "dc", "ud", "ib", "mlx5", "verbs")


class Route(enum.Enum):
    """A transport a message can take."""

    MPI = "mpi"
    UCX = "ucx"
    LOOPBACK = "loopback"


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """How the router chooses."""

    cpu_route: Route = Route.MPI
    """Route of messages without device tensors. MPI: measured faster than UCX for host memory on
    these machines (see docs/comm.md); the router falls back to whichever transport exists."""
    device_route: Route | None = None
    """Force a route for messages with device (CUDA) tensors; None applies the routing rules."""
    nvlink: bool | None = None
    """Whether the GPUs of one node are connected by NVLink (peer access); None detects it."""
    rdma: bool | None = None
    """Whether GPUDirect RDMA is available between nodes; None detects it from UCX's transports."""
    device_min_bytes: int = 4 << 20
    """Messages whose device tensors hold fewer bytes than this take MPI (host staging) even where
    the D2D path exists. Measured on an H100 with two ranks on one GPU: below 4 MB UCX's per-message
    cost made it 0.24-0.72x as fast as staging; at 4 MB they were even, at 16 MB UCX was 3.2x and at
    64 MB 13x faster (benchmarks/results/comm_p2p_cuda.md). 0 sends every device message over the
    D2D path."""

    def __post_init__(self) -> None:
        if not isinstance(self.cpu_route, Route):
            raise ValueError(f"cpu_route={self.cpu_route!r}; expected a Route (Route.MPI, Route.UCX)")
        if self.device_route is not None and not isinstance(self.device_route, Route):
            raise ValueError(f"device_route={self.device_route!r}; expected a Route or None")
        if type(self.device_min_bytes) is not int or self.device_min_bytes < 0:
            raise ValueError(f"device_min_bytes={self.device_min_bytes!r}; expected an int >= 0 (bytes)")


def choose_route(
    devices: Collection[str],
    *,
    same_node: bool,
    nvlink: bool,
    rdma: bool,
    available: Collection[Route],
    config: RouterConfig,
    num_tensors: int = 0,
    device_bytes: int | None = None,
) -> Route:
    """The routing rules for a message whose tensors are on `devices` (device types) and
    hold `device_bytes` bytes of device memory (None: unknown, the size rule is not applied)."""
    if not available:
        raise TransportUnavailableError("the router has no transport")
    on_device = any(d not in ("cpu", "meta") for d in devices)
    if not on_device:
        wanted = config.cpu_route
    elif config.device_route is not None:
        wanted = config.device_route
    elif device_bytes is not None and device_bytes < config.device_min_bytes:
        wanted = Route.MPI
    elif (same_node and nvlink) or (not same_node and rdma):
        wanted = Route.UCX
    else:
        wanted = Route.MPI
    if wanted is Route.UCX and num_tensors > _UCX_MAX_TENSORS:
        wanted = Route.MPI
    if wanted in available:
        return wanted
    for route in (Route.MPI, Route.UCX, Route.LOOPBACK):
        if route in available:
            return route
    raise AssertionError("unreachable")


def detect_nvlink() -> bool:
    """Whether every pair of this node's GPUs has peer access (NVLink or NVSwitch).

    With a single GPU, the ranks of the node share it and reach each other's memory through CUDA
    IPC on that one device, which is the device-to-device path too.
    """
    if not torch.cuda.is_available():
        return False
    n = torch.cuda.device_count()
    if n == 1:
        return True
    return all(torch.cuda.can_device_access_peer(a, b) for a in range(n) for b in range(n) if a != b)


def detect_rdma() -> bool:
    """Whether UCX has an InfiniBand/RoCE transport here (GPUDirect RDMA then carries device memory)."""
    try:
        import ucxx

        active = ucxx.get_active_transports()
    except Exception:
        return False
    return any(name.startswith(_RDMA_TRANSPORTS) for name in active)


class Router(Transport):
    """A Transport over several transports, choosing one per message (see the module docstring)."""

    name = "router"

    def __init__(
        self,
        transports: Mapping[Route, MessageTransport],
        *,
        same_node: Sequence[bool] | None = None,
        config: RouterConfig | None = None,
    ) -> None:
        if not transports:
            raise ValueError("a router needs at least one transport")
        first = next(iter(transports.values()))
        for route, t in transports.items():
            if t.mailbox is not first.mailbox or (t.rank, t.size) != (first.rank, first.size):
                raise ValueError(
                    f"the {route.value} transport does not share the others' mailbox, rank or size; build "
                    "the transports with one Mailbox and one OrderCounter (Router.create does)"
                )
        self.transports = dict(transports)
        self.rank = first.rank
        self.size = first.size
        self.config = config or RouterConfig()
        self.mailbox = first.mailbox
        self._transport_config = first.config
        self._same_node = list(same_node) if same_node is not None else [True] * self.size
        self._nvlink = self.config.nvlink if self.config.nvlink is not None else detect_nvlink()
        self._rdma = (
            self.config.rdma
            if self.config.rdma is not None
            else (Route.UCX in self.transports and detect_rdma())
        )
        self._closed = False
        self.stats: Counter[str] = Counter()
        """Messages sent per route ("mpi", "ucx", "loopback")."""
        self._drives: list[Callable[[], bool]] = [
            t.drive for t in self.transports.values() if t.drives_progress
        ]
        # The route of host-memory messages depends on neither the destination nor the tensors: chosen
        # once, so that most messages skip the routing rules.
        self._host_route = choose_route(
            ("cpu",),
            same_node=True,
            nvlink=self._nvlink,
            rdma=self._rdma,
            available=self.transports.keys(),
            config=self.config,
        )

    @classmethod
    def create(
        cls,
        world: Any,
        *,
        config: RouterConfig | None = None,
        transport_config: TransportConfig | None = None,
        ucx_config: Any = None,
        use_ucx: bool | None = None,
    ) -> Router:
        """The transports this world supports, behind one router. Collective.

        MPI when the world was started by an MPI launcher; UCX when `use_ucx`, or (None) when ucxx
        imports and some message could be routed to it (CUDA is available, or `cpu_route` is UCX);
        loopback for a world of one rank without MPI.
        """
        from mp_comm.transport.loopback import LoopbackTransport
        from mp_comm.transport.mpi import MPITransport

        cfg = config or RouterConfig()
        tcfg = (transport_config or TransportConfig()).for_world(world)
        mailbox, orders = Mailbox(), OrderCounter()
        transports: dict[Route, MessageTransport] = {}
        if world.mpi_comm is not None:
            transports[Route.MPI] = MPITransport(world.mpi_comm, config=tcfg, mailbox=mailbox, orders=orders)
        if use_ucx is None:
            from mp_comm.transport.ucx import ucx_available

            wants = torch.cuda.is_available() or cfg.cpu_route is Route.UCX or not transports
            use_ucx = wants and world.size > 1 and ucx_available()
        same_node: list[bool] | None = None
        if use_ucx:
            from mp_comm.transport.ucx import UCXTransport

            ucx = UCXTransport.from_world(
                world,
                config=tcfg,
                ucx=ucx_config,
                fallback=transports.get(Route.MPI),
                mailbox=mailbox,
                orders=orders,
            )
            transports[Route.UCX] = ucx
            same_node = ucx.same_node
        if not transports:
            if world.size != 1:
                raise TransportUnavailableError(
                    f"no transport for this world of {world.size} ranks: it was not started by an MPI "
                    "launcher and ucxx is not installed; start it with mpiexec, or install `mp-comm[ucx]`."
                )
            transports[Route.LOOPBACK] = LoopbackTransport.single(config=tcfg)
        return cls(transports, same_node=same_node, config=cfg)

    @property
    def closed(self) -> bool:
        return self._closed

    def route(
        self, devices: Collection[str], dest: int, num_tensors: int = 0, device_bytes: int | None = None
    ) -> Route:
        """The route a message to `dest` with tensors on `devices` takes."""
        return choose_route(
            devices,
            same_node=self._same_node[dest],
            nvlink=self._nvlink,
            rdma=self._rdma,
            available=self.transports.keys(),
            config=self.config,
            num_tensors=num_tensors,
            device_bytes=device_bytes,
        )

    def send(
        self, obj: object, dest: int, tag: Tag = 0, *, static: bool | None = None, route: Route | None = None
    ) -> SendHandle:
        """Send over the route the rules choose, or over `route` when given (it must exist)."""
        transport = next(iter(self.transports.values()))
        transport.check_send(dest, tag)
        if route is not None and route not in self.transports:
            raise ValueError(f"route={route}; this router has {sorted(r.value for r in self.transports)}")
        body, tensors = encode_object(obj)
        if route is None and len(tensors) <= _UCX_MAX_TENSORS and all(t.is_cpu for t in tensors):
            route = self._host_route
        elif route is None:
            on_device = [t for t in tensors if t.device.type not in ("cpu", "meta")]
            nbytes = sum(t.numel() * t.element_size() for t in on_device)
            route = self.route({t.device.type for t in tensors}, dest, len(tensors), nbytes)
        self.stats[route.value] += 1
        return self.transports[route].send_encoded(body, tensors, dest, tag, static=static)

    def recv(self, source: int = ANY_SOURCE, tag: object = ANY_TAG, timeout: float | None = None) -> Received:
        transport = next(iter(self.transports.values()))
        if self._closed or transport.closed:
            raise TransportClosedError(f"recv on the closed router of rank {self.rank}")
        if source != ANY_SOURCE:
            transport.check_rank(source, "source")
        limit = self._transport_config.timeout if timeout is None else timeout
        drive = self._drive if self._drives else None
        arrival = self.mailbox.take(source, tag, limit, drive=drive, config=self._transport_config)
        return rebuild(arrival, self.rank)

    def set_busy(self, busy: bool) -> None:
        for transport in self.transports.values():
            transport.set_busy(busy)

    def _drive(self) -> bool:
        worked = False
        for drive in self._drives:
            worked |= drive()
        return worked

    def close(self, timeout: float | None = None) -> None:
        """Collective: close UCX first (it may still send payloads over MPI), then the others."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for route in (Route.UCX, Route.MPI, Route.LOOPBACK):
            t = self.transports.get(route)
            if t is None:
                continue
            try:
                t.close(timeout)
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
