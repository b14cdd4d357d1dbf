"""The mailbox: complete messages waiting to be taken, by (source, tag), in each sender's order.

Transports deliver into a :class:`Mailbox` from their progress threads; any number of threads take from
it with timeouts. The transports of a router share one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Protocol

import torch

from mp_comm import waits
from mp_comm.errors import PeerTimeoutError
from mp_comm.message import Tag

if TYPE_CHECKING:
    from mp_comm.transport.config import TransportConfig


class Bell(Protocol):
    """What a waiting thread sleeps on instead of the mailbox's condition (mp_comm.transport.doorbell)."""

    def wait(self, timeout: float) -> None: ...

    def drain(self) -> None: ...

    def ring_self(self) -> None: ...

    def arm(self) -> None: ...

    def disarm(self) -> None: ...


__all__ = ["ANY_SOURCE", "ANY_TAG", "Arrival", "Mailbox"]

log = logging.getLogger(__name__)

#: Receive from whichever rank's message comes first.
ANY_SOURCE: Final = -1


class _AnyTag:
    _instance: _AnyTag | None = None

    def __new__(cls) -> _AnyTag:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ANY_TAG"

    def __reduce__(self) -> str:
        return "ANY_TAG"


#: Receive a message of any tag.
ANY_TAG: Final = _AnyTag()


@dataclass(slots=True)
class Arrival:
    """A message that reached this rank: its body still pickled, its tensors filled (or its error)."""

    source: int
    tag: Tag
    order: int
    body: bytes = b""
    tensors: list[torch.Tensor] = field(default_factory=list)
    error: BaseException | None = None


def _matches(a: Arrival, source: int, tag: object) -> bool:
    return source in (ANY_SOURCE, a.source) and (tag is ANY_TAG or a.tag == tag)


class Mailbox:
    """Complete messages waiting to be taken, delivered in each sender's order.

    Transports deliver into it from their progress threads; any number of threads take from it by
    (source, tag) with a timeout. Arrivals carry the sender's per-destination order number, so a
    message that overtakes an earlier one of the same sender (over another transport, or because its
    payload was shorter) is held back until the earlier one is delivered.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._ready: list[Arrival] = []
        self._early: dict[int, dict[int, Arrival]] = {}
        self._expect: dict[int, int] = {}
        self._peer_errors: dict[int, BaseException] = {}
        self._fatal: BaseException | None = None
        self.waiters = 0
        """Threads blocked in `take` now (progress threads poll faster while it is non-zero)."""
        self._sleepers = 0  # threads of `take` inside `self._cond.wait` now: only they need a notify
        self.bell: Bell | None = None
        """Where a waiting thread that drives progress sleeps (a transport's doorbell), if any."""
        self._bell_sleepers = 0  # threads of `take` waiting on the bell now: a delivery rings it

    def deliver(self, arrival: Arrival) -> None:
        with self._cond:
            src = arrival.source
            expect = self._expect.get(src, 0)
            if arrival.order != expect:
                if arrival.order < expect:
                    log.error("dropping a duplicate message %d from rank %d", arrival.order, src)
                    return
                self._early.setdefault(src, {})[arrival.order] = arrival
                return
            self._ready.append(arrival)
            expect += 1
            early = self._early.get(src)
            while early and expect in early:
                self._ready.append(early.pop(expect))
                expect += 1
            self._expect[src] = expect
            self._wake()

    def _wake(self) -> None:
        # called with the condition held
        if self._sleepers:
            self._cond.notify_all()
        if self._bell_sleepers and self.bell is not None:
            self.bell.ring_self()

    def fail_peer(self, peer: int, error: BaseException) -> None:
        """Receives from `peer` (and from any source) raise `error` once its delivered messages are taken."""
        with self._cond:
            self._peer_errors.setdefault(peer, error)
            self._cond.notify_all()
            self._wake()

    def fail(self, error: BaseException) -> None:
        """Every present and future take raises `error` (the transport stopped)."""
        with self._cond:
            if self._fatal is None:
                self._fatal = error
            self._cond.notify_all()
            self._wake()

    def pending(self) -> list[tuple[int, Tag]]:
        """(source, tag) of the messages delivered and not yet taken."""
        with self._cond:
            return [(a.source, a.tag) for a in self._ready]

    def take(
        self,
        source: int,
        tag: object,
        timeout: float,
        *,
        drive: Callable[[], bool] | None = None,
        config: TransportConfig | None = None,
    ) -> Arrival:
        """The first delivered message matching (source, tag); waits at most `timeout` seconds.

        `drive`, when given, makes progress on the transport from this thread (returns whether it did
        any work, or has requests in flight that need polling): a waiting thread then sees its message
        without a hand-off from the progress thread. While `drive` returns True, or for
        `config.spin_time` after, it polls (yielding the CPU between polls); then it sleeps on the
        mailbox (woken by deliveries), from `config.poll_min` up to `config.poll_max` at a time, driving
        between naps so that it keeps helping. With a `bell` (a transport's doorbell) it naps on the bell
        instead, which a message sent to this rank or delivered by another thread rings (senders ring only
        while a thread of the rank is armed on its bell: see mp_comm.transport.doorbell).
        """
        now = time.monotonic()
        deadline = now + timeout
        with self._cond:
            found = self._find(source, tag, timeout, deadline)
            if found is not None:  # already here: no waiting, no polling
                return found
            self.waiters += 1
        token = 0  # registered for the heartbeat's report at the first nap (_register_wait)
        spin = config.spin_time if config is not None else 0.0
        first_nap = config.poll_min if config is not None else 1e-3
        longest_nap = config.poll_max if config is not None else 1e-3
        nap = first_nap
        last_work = now
        try:
            while True:
                if drive is not None and drive():
                    last_work = time.monotonic()
                    nap = first_nap
                    with self._cond:
                        found = self._find(source, tag, timeout, deadline)
                    if found is not None:
                        return found
                    # Poll again at once, but let the other processes on this core run first: on an
                    # oversubscribed host, a waiter that never yields keeps its peer (the rank that must
                    # answer) off the CPU; measured 2-3x slower ping-pongs at 256 KB-4 MB without it.
                    _pause(config)
                    continue
                bell = self.bell if drive is not None else None
                with self._cond:
                    found = self._find(source, tag, timeout, deadline)
                    if found is not None:
                        return found
                    sleep = drive is None or time.monotonic() - last_work >= spin
                    if sleep and not token:
                        token = _register_wait(source, tag)
                    if sleep and bell is None:
                        left = deadline - time.monotonic()
                        self._sleepers += 1
                        try:
                            self._cond.wait(min(left, nap) if drive is not None else left)
                        finally:
                            self._sleepers -= 1
                        nap = min(longest_nap, nap * 2)  # a long wait polls less and less often
                        continue
                    if sleep:
                        self._bell_sleepers += 1
                if not sleep:
                    _pause(config)
                    continue
                assert bell is not None and drive is not None
                # On the bell: a message sent here, or delivered by another thread, ends the nap at once.
                # Senders ring only while it is armed, so look once more after arming: a message posted
                # before that was not rung for, and is found here instead of after the nap.
                bell.arm()
                try:
                    bell.drain()  # rings from before: what comes from now on rings again
                    if drive():
                        last_work = time.monotonic()
                        nap = first_nap
                        continue
                    bell.wait(max(0.0, min(deadline - time.monotonic(), nap)))
                finally:
                    bell.disarm()
                    with self._cond:
                        self._bell_sleepers -= 1
                nap = min(longest_nap, nap * 2)
        finally:
            if token:
                waits.leave(token)
            with self._cond:
                self.waiters -= 1

    def _find(self, source: int, tag: object, timeout: float, deadline: float) -> Arrival | None:
        # Called with the condition held: a match, or raise the failure / timeout that applies.
        for i, a in enumerate(self._ready):
            if _matches(a, source, tag):
                return self._ready.pop(i)
        if self._fatal is not None:
            raise self._fatal
        lost = self._lost(source)
        if lost is not None:
            raise lost
        if time.monotonic() >= deadline:
            raise self._timeout(source, tag, timeout)
        return None

    def _lost(self, source: int) -> BaseException | None:
        if source == ANY_SOURCE:
            return next(iter(self._peer_errors.values()), None)
        return self._peer_errors.get(source)

    def _timeout(self, source: int, tag: object, waited: float) -> PeerTimeoutError:
        who = "any rank" if source == ANY_SOURCE else f"rank {source}"
        others = [(a.source, a.tag) for a in self._ready][:8]
        held = sum(len(v) for v in self._early.values())
        extra = f"; messages waiting here: {others}" if others else "; no other message is waiting here"
        if held:
            extra += f" ({held} more held back behind an earlier message of their sender)"
        return PeerTimeoutError(
            f"no message from {who} with tag {tag!r} within {waited:g} s{extra}. Is the sender alive, "
            "and does it send this tag? Raise TransportConfig.timeout for longer steps.",
            peer=None if source == ANY_SOURCE else source,
            tag=tag,
            waited=waited,
        )


def _register_wait(source: int, tag: object) -> int:
    """Register a waiting take for the heartbeat's report (mp_comm.waits): what it waits for, and from
    whom. Only once it naps: a message found while polling (within `spin_time`) costs no record."""
    what = "a message" if tag is ANY_TAG else f"a message with tag {tag!r}"
    return waits.enter(what, None if source == ANY_SOURCE else source)


def _pause(config: TransportConfig | None) -> None:
    """Between two polls of a waiting thread: yield the CPU, or sleep where ranks outnumber cores.

    A yield releases the GIL and costs no timer-slack period; but where the host is oversubscribed the
    scheduler hands the core straight back to the yielding waiter, starving the ranks that compute.
    """
    if config is not None and config.oversubscribed:
        time.sleep(config.poll_min)
    else:
        os.sched_yield()
