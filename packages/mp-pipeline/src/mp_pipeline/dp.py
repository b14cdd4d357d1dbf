"""Data parallelism across pipeline replicas: the first-step broadcast and bucketed gradient averaging.

Each rank reduces only what it holds (its partition's parameters) over its data-parallel group, whose
members hold the same partition. Tensors are packed per dtype into buckets of at most ``bucket_bytes``
and each bucket is one collective (``mp_comm.collectives``: MPI for CPU tensors when the group has an
MPI communicator, torch.distributed otherwise).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from mp_comm.collectives import CollectiveHandle, all_reduce_, all_reduce_async, broadcast_
from mp_comm.waits import collective_wait
from mp_pipeline.errors import PipelineTimeoutError

__all__ = ["OverlappedReduction", "agree_any", "broadcast_tensors", "buckets", "reduce_gradients"]


def buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype tensors of at most ``bucket_bytes`` (a larger tensor alone)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        if bucket:
            yield bucket


def _copy_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Write consecutive slices of ``flat`` into ``tensors`` (the inverse of concatenating them)."""
    for t, part in zip(tensors, torch.split(flat, [t.numel() for t in tensors]), strict=True):
        t.copy_(part.view_as(t))


def broadcast_tensors(
    tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, *, bucket_bytes: int = 25 << 20
) -> None:
    """Overwrite ``tensors`` in place with those of the group's first member."""
    if dist.get_world_size(group) == 1:
        return
    with torch.no_grad():
        for bucket in buckets(tensors, bucket_bytes):
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
            broadcast_(flat, group, 0)  # over MPI when the group has an MPI twin (CPU), else torch's
            _copy_back(flat, bucket)


def agree_any(flags: Sequence[bool], group: dist.ProcessGroup, *, timeout: float | None = None) -> list[bool]:
    """Element-wise OR of ``flags`` over the group (every member passes the same number).

    With ``timeout``, a member that has not joined within that many seconds raises PipelineTimeoutError
    here instead of waiting for good (the all-reduce is left behind: the job is beyond repair).
    """
    if not flags:
        return []
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.uint8)
    if dist.get_world_size(group) > 1:
        with collective_wait("all_reduce", group):  # named in the heartbeat's report if a member stops
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=timeout is not None)
            if work is not None:
                _wait_within(work, timeout or 0.0)
    return [bool(x) for x in t.tolist()]


def _wait_within(work: dist.Work, timeout: float) -> None:
    # Polled, not work.wait(timeout): a timed-out wait can leave gloo's process group unusable. gloo
    # moves the data on its own threads, so polling does not slow the collective; a few yields first,
    # then naps of 1 ms at most, so that a member arriving late costs little latency.
    deadline = time.monotonic() + timeout
    spins = 0
    while not work.is_completed():
        now = time.monotonic()
        if now >= deadline:
            raise PipelineTimeoutError(f"the all-reduce did not complete within {timeout:g} s")
        if spins < 200:
            spins += 1
            os.sched_yield()
        else:
            time.sleep(min(1e-3, deadline - now))
    work.wait()  # raises the collective's own error, if it failed


def reduce_gradients(
    params: Sequence[nn.Parameter],
    group: dist.ProcessGroup,
    *,
    bucket_bytes: int = 25 << 20,
    divisor: float | None = None,
) -> None:
    """Sum the gradients of ``params`` over the group and divide by ``divisor`` (default: its size).

    A parameter that has a gradient on some member but not on others counts as zero there; one that
    has none anywhere keeps None (as plain PyTorch on the whole batch would). A divisor other than
    the group's size serves parameters whose gradients already cover several members' samples
    (tensor-parallel shards, reduced over a smaller group than the samples they saw).
    """
    size = dist.get_world_size(group)
    scale = float(size if divisor is None else divisor)
    if size == 1:
        if scale != 1.0:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.div_(scale)
        return
    have = agree_any([p.grad is not None for p in params], group)
    live: list[torch.Tensor] = []
    for p, h in zip(params, have, strict=True):
        if not h:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        live.append(p.grad)
    with torch.no_grad():
        for bucket in buckets(live, bucket_bytes):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            all_reduce_(flat, group)  # over MPI when the group has an MPI twin (CPU), else torch's
            flat /= scale
            _copy_back(flat, bucket)


class OverlappedReduction:
    """The gradient all-reduces of :func:`reduce_gradients`, launched during the step's backward.

    The buckets (``bucket_bytes`` runs of same-dtype parameters, in reverse registration order as in
    DDP: backward produces the last layers' gradients first) are fixed, so every member launches the
    same collectives in the same order: a bucket is launched only after all earlier ones, once each of
    its parameters has accumulated as often as in the profiled pass (module reuse accumulates several
    times). :meth:`arm` starts a pass, :meth:`finish` launches what is left, waits and averages.

    The all-reduces are out of place, so the local gradients stay intact: a bucket whose parameter
    accumulated again after its launch (or whose launch missed a late gradient) is reduced once more,
    synchronously, from them. Results are those of :func:`reduce_gradients` (the same sums per element;
    bitwise for groups of two, where the sum of two addends has one order).
    """

    def __init__(self, params: Sequence[nn.Parameter], group: dist.ProcessGroup, bucket_bytes: int) -> None:
        self.params = list(params)
        self.group = group
        order = list(reversed(range(len(self.params))))
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.buckets: list[list[int]] = [
            [self._index[id(p)] for p in bucket]
            for bucket in buckets([self.params[i] for i in order], bucket_bytes)
        ]
        self._bucket_of = [0] * len(self.params)
        for b, members in enumerate(self.buckets):
            for i in members:
                self._bucket_of[i] = b
        self.expected: list[int] | None = None
        """Accumulations per parameter in the profiled pass (the first armed one); None before it."""
        self.early = 0
        """Buckets launched during a backward, over all passes (the rest were launched at the end)."""
        self.redone = 0
        """Buckets reduced a second time because a gradient accumulated after their launch."""
        self._lock = threading.Lock()
        self._armed = False
        self._seen = False  # armed at some point of this pass
        self._counts = [0] * len(self.params)
        self._remaining: list[int] = []
        self._handles: list[CollectiveHandle] = []
        self._invalid: list[bool] = []
        self._hooks: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._accumulated)  # type: ignore[no-untyped-call]
            for p in self.params
        ]

    def close(self) -> None:
        """Remove the gradient hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    @property
    def launched(self) -> int:
        """How many buckets have been launched in this pass."""
        return len(self._handles)

    def arm(self) -> None:
        """Start counting accumulations (a step that reduces begins); idempotent."""
        with self._lock:
            if self._armed:
                return
            self._armed = self._seen = True
            self._counts = [0] * len(self.params)
            self._invalid = [False] * len(self.buckets)
            if self.expected is not None:
                expected = self.expected
                self._remaining = [sum(1 for i in bucket if expected[i] > 0) for bucket in self.buckets]
                self._launch_ready()

    def _accumulated(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        with self._lock:
            i = self._index[id(p)]
            self._counts[i] += 1
            if self.expected is None:  # profiling pass: count only
                return
            b = self._bucket_of[i]
            if b < len(self._handles):
                self._invalid[b] = True  # launched without this accumulation: reduce it again at the end
            elif self._counts[i] == self.expected[i]:
                self._remaining[b] -= 1
                self._launch_ready()
            if self._handles:
                self._handles[-1].is_completed()  # lets MPI progress the collectives in flight

    def _launch_ready(self) -> None:
        while len(self._handles) < len(self.buckets) and self._remaining[len(self._handles)] == 0:
            self._launch(len(self._handles))

    def _flat(self, b: int) -> torch.Tensor:
        with torch.no_grad():
            parts = [self.params[i].grad for i in self.buckets[b]]
            return torch.cat(
                [
                    (g if g is not None else torch.zeros_like(self.params[i])).reshape(-1)
                    for i, g in zip(self.buckets[b], parts, strict=True)
                ]
            )

    def _launch(self, b: int) -> None:
        self._handles.append(all_reduce_async(self._flat(b), self.group))

    def finish(self, divisor: float | None = None) -> None:
        """Launch the remaining buckets, wait, divide (default: by the group's size) and write back.

        Every member calls it at the same point. Like :func:`reduce_gradients`, a parameter without
        gradient anywhere keeps None and one without gradient on some member counts as zero there.
        """
        with self._lock:
            self._armed = False
            self.early += len(self._handles)
            while len(self._handles) < len(self.buckets):
                self._launch(len(self._handles))
            if self.expected is None and self._seen:
                self.expected = list(self._counts)
            self._seen = False
            flags = agree_any([p.grad is not None for p in self.params] + self._invalid, self.group)
            have, invalid = flags[: len(self.params)], flags[len(self.params) :]
            self.redone += sum(invalid)
            scale = float(dist.get_world_size(self.group) if divisor is None else divisor)
            outs = [h.wait() for h in self._handles]
            self._handles = []
            with torch.no_grad():
                for b, (out, again) in enumerate(zip(outs, invalid, strict=True)):
                    # again: reduced anew from the local gradients, all members in the same bucket order
                    flat = all_reduce_(self._flat(b), self.group) if again else out
                    flat /= scale
                    parts = torch.split(flat, [self.params[i].numel() for i in self.buckets[b]])
                    for i, part in zip(self.buckets[b], parts, strict=True):
                        if have[i]:  # a parameter without gradient anywhere keeps None
                            p = self.params[i]
                            if p.grad is None:
                                p.grad = torch.zeros_like(p)
                            p.grad.copy_(part.view_as(p.grad))

    def disarm(self) -> None:
        """Abandon a pass in which no member launched anything (a step taken back to run again)."""
        with self._lock:
            if self._handles:
                raise RuntimeError(f"disarm() after {len(self._handles)} launched buckets: call drain()")
            self._armed = self._seen = False

    def drain(self) -> None:
        """Complete the collectives of a pass that is abandoned (a failed step), on every member."""
        with self._lock:
            self._armed = self._seen = False
            while len(self._handles) < len(self.buckets):
                self._launch(len(self._handles))
            for h in self._handles:
                h.wait()
            self._handles = []
