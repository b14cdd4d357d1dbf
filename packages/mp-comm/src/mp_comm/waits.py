"""What each thread of this rank waits for, from whom, and since when.

The blocking points of mp (an MPI collective's wait, a torch.distributed collective (gloo, NCCL) that
mp calls, a transport receive, a pipeline request waiting for its response) register here while they
block; the heartbeat (mp_comm.heartbeat) sends the list to the other ranks, so that when a rank goes
silent every rank's last wait can be named. Registering is a small record and two dict operations (no
lock: a dict's single operations are atomic under the GIL), cheap enough for the waits that last; an
MPI wait that completes on its first test does not register at all.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Final

import torch.distributed as dist

__all__ = [
    "Wait",
    "collective_label",
    "collective_wait",
    "current",
    "describe",
    "enter",
    "leave",
    "main_frame",
    "waiting",
]


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


class waiting:
    """Register the wait for the block. A small class, not a generator: one record per call, since it
    wraps every torch.distributed collective mp calls (`collective_wait`)."""

    __slots__ = ("_token", "peer", "what")

    def __init__(self, what: str, peer: int | None = None) -> None:
        self.what = what
        self.peer = peer
        self._token = 0

    def __enter__(self) -> None:
        self._token = enter(self.what, self.peer)

    def __exit__(self, *exc: object) -> None:
        leave(self._token)


_LABELS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, str]] = weakref.WeakKeyDictionary()


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    if len(ranks) > 8:
        return f"ranks [{', '.join(map(str, ranks[:8]))}, ...] ({len(ranks)} ranks)"
    return f"ranks {ranks}"


def collective_label(op: str, group: dist.ProcessGroup | None) -> str:
    """``the gloo all_reduce over ranks [0, 2]``, built once per group and op (weakly keyed: a destroyed
    group's entry goes with it)."""
    g = group if group is not None else dist.group.WORLD
    if g is None:
        return f"the torch.distributed {op}"
    labels = _LABELS.get(g)
    if labels is None:
        labels = _LABELS[g] = {}
    what = labels.get(op)
    if what is None:
        ranks = _ranks_text(dist.get_process_group_ranks(g))
        what = labels[op] = f"the {dist.get_backend(g)} {op} over {ranks}"
    return what


def collective_wait(op: str, group: dist.ProcessGroup | None = None) -> waiting:
    """Register the torch.distributed collective ``op`` over ``group`` (None: the default group) as this
    thread's wait for the block, for the heartbeat's report if a rank stops answering::

        with collective_wait("all_reduce", group):
            dist.all_reduce(t, group=group)

    One small record per call (the text is built once per group and op).
    """
    return waiting(collective_label(op, group))


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
    computing, or blocked in a call mp does not wrap (user code, a collective the script calls itself)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "unknown"
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"
