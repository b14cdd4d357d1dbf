"""Settings shared by every transport (`TransportConfig`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["POOL_MIN_BYTES", "TransportConfig"]


POOL_MIN_BYTES: Final = 4 << 20
"""Received CPU tensors from this size come from the transport's HostPool. Smaller ones are allocated
fresh: measured interleaved here, the pool's bookkeeping (~10 µs a tensor, more inside a stream) cost
1 MB streams 10-20% of their bandwidth, while malloc mostly reuses memory it has already faulted in;
from 4 MiB fresh memory's page faults cost more (16 MB messages up to 2x slower without the pool)."""


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """Settings shared by every transport."""

    timeout: float = 300.0
    """Seconds a receive, a send handle's wait or a close waits before raising PeerTimeoutError, when the
    call gives no timeout of its own. Must be positive and finite: nothing waits forever."""
    static_shapes: bool = False
    """Static mode: a message whose (destination, tag) repeats with the same tensor metadata sends no
    metadata; the receiver reuses what it cached. Safe to leave on when shapes change: a changed
    message sends its metadata again. `send(..., static=...)` overrides it per message."""
    static_slots: int = 1024
    """Metadata cache slots per sender at each receiver (least recently used tags give theirs up)."""
    recv_pool_bytes: int = 256 << 20
    """Idle host memory kept to recycle for received CPU tensors of at least 4 MiB (`POOL_MIN_BYTES`;
    see buffers.HostPool: fresh memory that large costs a page fault per page, up to several times the
    copy); 0 turns the pool off. Tensors received into it cannot be resized in place (`resize_`)."""
    spin_time: float = 1e-3
    """Seconds a thread waiting in `recv` keeps polling (yielding the CPU between polls) after its last
    progress before it starts to nap, so that a quick reply (a ping-pong, a pipeline hand-off) is seen
    at once."""
    inline_bytes: int = 4096
    """Tensors of at most this many bytes travel inside the header instead of as messages of their
    own (one small copy instead of a message round; 0 turns it off)."""
    poll_min: float = 20e-6
    """Shortest sleep, in seconds, of a polling progress thread between rounds while it has work in
    flight or a thread waits on a receive."""
    poll_max: float = 1e-3
    """Longest sleep of a polling progress thread when nothing is in flight and nobody waits: the
    latency a message sees when it reaches an idle rank."""
    poll_busy: float = 5e-3
    """Sleep of a polling progress thread between rounds while the rank is marked busy
    (`Transport.set_busy`; the pipeline runtime marks it while a module-server worker runs, and
    between steps while the script runs): what arrives then waits for that work anyway, and where
    the compute threads use every core, each round preempts one (benchmarks/pipeline_vs_torch.py:
    pp_rank 0's stage computed 1.12-1.18x its single-process time with polls up to every
    millisecond, 1.07-1.11x with busy marking). Larger values defer more of the transfers that need
    this rank's help to that work's end. This applies while the rank has transfers in flight (one of
    its own sends or receives may need its progress); with none, `poll_busy_idle` does."""
    poll_busy_idle: float = 50e-3
    """Sleep of a polling progress thread between rounds while the rank is busy and has no transfer in
    flight: a round could then only take new arrivals, which wait for the work anyway, and each round
    costs the computing thread on the same core far more than its own CPU (a GPT microbatch's forward
    and backward beside its busy transport, one core: 2.3-2.9% slower with a round every 5 ms, 0-1.1%
    every 50 ms; measured with a one-off probe). The rank still looks in now and then, so a peer's
    send to it completes within this time."""
    oversubscribed: bool | None = None
    """Whether the host runs more ranks than it has cores. A thread waiting in `recv` then sleeps
    `poll_min` between its polls instead of only yielding the CPU, which on Linux leaves it to the
    waiter again: the ranks that compute need those cores (4 ranks of a pipeline on 2 cores ran their
    steps 1.5x faster). None: decided from the world where a transport is made from one (`for_world`),
    else False."""

    def __post_init__(self) -> None:
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(
                f"timeout={self.timeout!r}; expected a positive, finite number of seconds (nothing may "
                "wait forever). Use a large value, e.g. 3600, for very long steps."
            )
        if self.static_slots < 1:
            raise ValueError(f"static_slots={self.static_slots}; expected at least 1")
        if self.recv_pool_bytes < 0:
            raise ValueError(f"recv_pool_bytes={self.recv_pool_bytes}; expected >= 0 (0 turns the pool off)")
        if self.inline_bytes < 0:
            raise ValueError(f"inline_bytes={self.inline_bytes}; expected >= 0 (0 turns inlining off)")
        if self.spin_time < 0:
            raise ValueError(f"spin_time={self.spin_time}; expected >= 0 seconds")
        if not (0 <= self.poll_min <= self.poll_max):
            raise ValueError(
                f"poll_min={self.poll_min}, poll_max={self.poll_max}; expected 0 <= poll_min <= poll_max"
            )
        for name in ("poll_busy", "poll_busy_idle"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(
                    f"{name}={value!r}; expected a positive, finite number of seconds (a busy rank still "
                    "looks in now and then)"
                )

    def for_world(self, world: Any) -> TransportConfig:
        """This config with `oversubscribed` decided from the world's processes on this host."""
        if self.oversubscribed is not None:
            return self
        info = getattr(world, "info", None)  # a bare world (one rank, no launcher) has none
        return dataclasses.replace(self, oversubscribed=bool(getattr(info, "oversubscribed", False)))
