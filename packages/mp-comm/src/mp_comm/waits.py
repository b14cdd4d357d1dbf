"""What each thread of this rank waits for, from whom, and since when.

The blocking points of mp (an MPI collective's wait, a transport receive, a pipeline request waiting
for its response) register here while they block; the heartbeat (mp_comm.heartbeat) sends the list to
the other ranks, so that when a rank goes silent every rank's last wait can be named. Registering is
two dict operations (no lock: a dict's single operations are atomic under the GIL), cheap enough for
the waits that last; a wait that completes on its first test does not register at all.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

__all__ = ["Wait", "current", "describe", "enter", "leave", "main_frame", "waiting"]


@dataclass(frozen=True, slots=True)
class Wait:
    what: str
    """What is awaited, e.g. "the FWD response of module 'layer1' (microbatch 0)"."""
    peer: int | None
    """The global rank it is awaited from; None when any rank (or all of a group) may bring it."""
    since: float
    """time.monotonic() when the wait began."""
    thread: str


_active: dict[int, Wait] = {}
_tokens: Final = itertools.count(1)


def enter(what: str, peer: int | None = None) -> int:
    """Register a wait of this thread; returns the token that `leave` takes."""
    token = next(_tokens)
    _active[token] = Wait(what, peer, time.monotonic(), threading.current_thread().name)
    return token


def leave(token: int) -> None:
    _active.pop(token, None)


@contextlib.contextmanager
def waiting(what: str, peer: int | None = None) -> Iterator[None]:
    token = enter(what, peer)
    try:
        yield
    finally:
        leave(token)


def current() -> list[Wait]:
    """This rank's waits now, longest first."""
    return sorted(_active.copy().values(), key=lambda w: w.since)


def describe(wait: Wait, now: float | None = None) -> str:
    """``waiting for X from rank 3 for 12.0 s (thread T)``."""
    age = (time.monotonic() if now is None else now) - wait.since
    source = f" from rank {wait.peer}" if wait.peer is not None else ""
    return f"waiting for {wait.what}{source} for {age:.1f} s (thread {wait.thread})"


def main_frame() -> str:
    """Where the main thread is now (file:line in function), for a rank that registered no wait: it is
    computing, or blocked in a call mp does not wrap (a torch.distributed collective, user code)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "unknown"
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
