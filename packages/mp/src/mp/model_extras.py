"""smp's DDP-side API of ``DistributedModel``: ``join()`` for uneven inputs, ``register_comm_hook()``, and
``smp.num_microbatches()``. ``DistributedModel`` binds thin methods to these functions, which act on its
data-parallel collaborator (mp.model_dp.ReplicaSync) and read the model through its public API.

``join``: a data-parallel replica that runs out of batches leaves the ``with model.join():`` block and
then shadows the steps the others still run (their per-step collectives: buffer broadcast, agreement,
gradient all-reduce, with zero gradients of its own), until every replica has left. Then parameters
and buffers are broadcast from the replica that ran the most steps, so all end equal (as DDP does).

``register_comm_hook``: torch DDP's communication-hook contract. The hook replaces the all-reduce of
each gradient bucket: ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``, with ``bucket``
offering ``buffer()``, ``gradients()``, ``parameters()``, ``index()``, ``is_last()``, ``set_buffer()``
like ``torch.distributed.GradBucket``, so torch's built-in hooks (``allreduce_hook``,
``fp16_compress_hook``, ...) run unchanged. As in smp, the gradients it receives are summed over the
step's microbatches (not averaged): the hook averages over replicas and microbatches itself.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mp.config_combinations import REFUSED_USES
from mp.errors import SMPRuntimeError, SMPUnsupportedError, SMPValidationError
from mp.state import state
from mp_comm import GroupKind, collective_wait

if TYPE_CHECKING:
    from mp.model import DistributedModel
    from mp.model_dp import ReplicaSync

__all__ = [
    "Bucket",
    "JoinState",
    "check_constructor_args",
    "join",
    "num_microbatches",
    "reduce_with_hook",
    "register_comm_hook",
]

log = logging.getLogger(__name__)


def num_microbatches() -> int:
    """The number of microbatches each ``@smp.step`` call splits its batch into (config ``microbatches``)."""
    return state.require()[0].microbatches


def check_constructor_args(
    gradient_as_bucket_view: bool, find_unused_parameters: bool, trace_memory_usage: bool
) -> None:
    """DistributedModel's DDP-style arguments. ``find_unused_parameters`` needs nothing: mp always
    handles parameters a step leaves unused (their gradient stays None, or zero where another replica
    used them). ``trace_memory_usage`` is checked here and acted on by mp.memory_report.
    ``gradient_as_bucket_view=True`` (gradients as views into the all-reduce buckets) is not built."""
    if gradient_as_bucket_view:
        raise SMPUnsupportedError(
            "DistributedModel(gradient_as_bucket_view=True): mp does not keep gradients as views into its "
            "all-reduce buckets (it copies them in and out; the results are the same, the memory saving "
            "is not built). Expected gradient_as_bucket_view=False (smp's documented default). Fix: "
            "remove the argument"
        )
    for name, value in (
        ("find_unused_parameters", find_unused_parameters),
        ("trace_memory_usage", trace_memory_usage),
    ):
        if not isinstance(value, bool):
            raise SMPValidationError(f"DistributedModel({name}={value!r}); expected True or False")


# ------------------------------------------------------------------------------------------- comm hooks
class Bucket:
    """One flat bucket of gradients, with torch.distributed.GradBucket's methods (what comm hooks call)."""

    def __init__(self, index: int, grads: Sequence[torch.Tensor], params: Sequence[nn.Parameter], last: bool):
        self._index = index
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._shapes = [g.shape for g in grads]
        self._params = list(params)
        self._last = last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        out, offset = [], 0
        for shape in self._shapes:
            n = shape.numel()
            out.append(self._buffer[offset : offset + n].view(shape))
            offset += n
        return out


def _buckets(grads: Sequence[torch.Tensor], bucket_bytes: int) -> Iterator[tuple[int, int]]:
    """(start, end) index ranges of consecutive gradients of at most ``bucket_bytes`` (at least one each)."""
    start, size = 0, 0
    for i, g in enumerate(grads):
        nbytes = g.numel() * g.element_size()
        if i > start and size + nbytes > bucket_bytes:
            yield start, i
            start, size = i, 0
        size += nbytes
    if start < len(grads):
        yield start, len(grads)


def reduce_with_hook(
    hook: Callable[[Any, Any], Any],
    hook_state: Any,
    params: Sequence[nn.Parameter],
    group: dist.ProcessGroup,
    bucket_bytes: int,
) -> None:
    """The data-parallel gradient reduction with each bucket's all-reduce replaced by ``hook``."""
    from mp_pipeline import agree_any

    have = agree_any([p.grad is not None for p in params], group)
    live: list[nn.Parameter] = []
    for p, h in zip(params, have, strict=True):
        if h:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            live.append(p)
    ranges = list(_buckets([p.grad for p in live if p.grad is not None], bucket_bytes))
    with torch.no_grad():
        for index, (start, end) in enumerate(ranges):
            members = live[start:end]
            grads = [p.grad for p in members if p.grad is not None]
            bucket = Bucket(index, grads, members, index == len(ranges) - 1)
            future = hook(hook_state, bucket)
            if not callable(getattr(future, "wait", None)):  # torch.futures.Future or torch._C.Future
                raise SMPValidationError(
                    f"the comm hook returned a {type(future).__name__}; expected a "
                    "torch.futures.Future[torch.Tensor] (as torch DDP's comm hooks return). Fix: return "
                    "e.g. dist.all_reduce(t, group=..., async_op=True).get_future().then(...)"
                )
            result = future.wait()
            flat = result[0] if isinstance(result, list | tuple) else result
            offset = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n


def register_comm_hook(replicas: ReplicaSync, hook_state: object, hook: Callable[..., Any]) -> None:
    """``model.register_comm_hook(state, hook)`` (see the module docstring)."""
    cfg = state.require()[0]
    if not callable(hook):
        raise SMPValidationError(
            f"register_comm_hook got hook={hook!r}; expected a callable hook(state, bucket)"
        )
    if replicas.comm_hook is not None:
        raise SMPValidationError(
            "register_comm_hook was called twice; a DistributedModel takes one communication hook (as torch "
            "DDP does). Fix: register the hook once, before the first step"
        )
    if cfg.tp > 1:
        raise REFUSED_USES["comm_hook_under_tp"].refusal(
            f"register_comm_hook with tensor_parallel_degree={cfg.tp}"
        )
    replicas.comm_hook = (hook, hook_state)
    if replicas.dp_size == 1:
        log.info(
            "register_comm_hook: data-parallel size 1, so no gradient reduction runs the hook (as in smp)"
        )
        return
    # the hook gets each bucket of microbatch-summed gradients, synchronously after the step
    replicas.average_microbatches = False
    replicas.close_overlap()


# ----------------------------------------------------------------------------------------------- join
class JoinState:
    """Per-step bookkeeping of a ``join`` context on an active replica."""

    def __init__(self, group: dist.ProcessGroup, dp_size: int, divide_by_initial_world_size: bool):
        self.group = group
        self.dp_size = dp_size
        self.divide_by_initial = divide_by_initial_world_size

    def count_active(self, me: int) -> int:
        """How many replicas still run steps (``me`` is 1 on an active one, 0 on a joined one)."""
        t = torch.tensor([me], dtype=torch.int64)
        with collective_wait("all_reduce", self.group):
            dist.all_reduce(t, group=self.group)
        return int(t.item())

    def step_started(self) -> float:
        """On an active replica, at the start of each step: count the replicas. The factor on the
        step's gradient seeds: with ``divide_by_initial_world_size=False`` the gradients are averaged
        over the active replicas only, else 1."""
        active = self.count_active(1)
        if not self.divide_by_initial and active < self.dp_size:
            return self.dp_size / active
        return 1.0


def _sync_final(replicas: ReplicaSync, group: dist.ProcessGroup, joined_at: int) -> None:
    """Parameters and buffers from the replica that ran the most steps (the lowest dp rank of a tie)."""
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    with collective_wait("all_gather", group):
        dist.all_gather(counts, torch.tensor([joined_at], dtype=torch.int64), group=group)
    values = [int(c.item()) for c in counts]
    src = dist.get_global_rank(group, values.index(max(values)))
    tensors = [p.data for p in replicas.local_parameters()]
    tensors += replicas.local_buffers()
    with torch.no_grad():
        for t in tensors:
            flat = t.contiguous()
            with collective_wait("broadcast", group):
                dist.broadcast(flat, src=src, group=group)
            if flat.data_ptr() != t.data_ptr():
                t.copy_(flat)


@contextlib.contextmanager
def join(
    model: DistributedModel,
    replicas: ReplicaSync,
    shadow_step: Callable[[], None],
    divide_by_initial_world_size: bool = True,
    enable: bool = True,
) -> Iterator[None]:
    """``model.join()``: train with a different number of steps on the data-parallel replicas.
    ``shadow_step`` is what a joined replica does for each step the others run (the model's
    data-parallel collectives with zero gradients, counted as a step)."""
    cfg = state.require()[0]
    group = state.process_groups.get(GroupKind.DP)
    if not enable or replicas.dp_size == 1 or group is None:
        yield
        return
    if cfg.tp > 1:
        raise SMPUnsupportedError(
            f"model.join() with tensor_parallel_degree={cfg.tp}: a replica that ran out of batches cannot "
            "shadow the collectives of its tensor-parallel peers' forward. Expected tensor_parallel_degree "
            "1. Fix: give every replica the same number of batches (DistributedSampler(..., drop_last=True))"
        )
    if replicas.joined is not None:
        raise SMPValidationError("model.join() is already active; nested join contexts are not supported")
    join_state = JoinState(group, replicas.dp_size, divide_by_initial_world_size)
    overlap = replicas.overlap_enabled
    replicas.overlap_enabled = False  # the joined replica reduces synchronously: everyone does, alike
    replicas.joined = join_state
    try:
        yield
        if not model.partitioned:
            raise SMPRuntimeError(
                f"rank {state.require()[1].rank} left model.join() before its first step; every replica must "
                "run at least one step (the first step partitions the model on every rank)"
            )
        joined_at = model.step_count
        while True:  # an active replica's step begins: buffer broadcast, then the count (model.run_step)
            replicas.sync(first=False)
            if join_state.count_active(0) == 0:
                break
            shadow_step()
        _sync_final(replicas, group, joined_at)
    finally:
        replicas.joined = None
        replicas.overlap_enabled = overlap
