"""The data-parallel side of `DistributedModel`, held by it as a collaborator: keep the replicas'
parameters and buffers in sync before a step; after it, agree over the replicas on failure and on
reducing, then average gradients (overlapped buckets, a comm hook, or TP-aware reduction).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mp.errors import SMPRuntimeError
from mp.model_extras import JoinState, reduce_with_hook
from mp.sparse_grads import reduce_sparse_gradients, sparse_grad_parameters
from mp.state import state
from mp_comm import GroupKind, mpi_comm_of
from mp_partition import PLACEHOLDER_ATTR, Placement
from mp_pipeline import (
    RECORDER,
    EventKind,
    OverlappedReduction,
    PipelineRuntime,
    PipelineTimeoutError,
    agree_any,
    broadcast_tensors,
    default_timeout,
    reduce_gradients,
)
from mp_tensor import is_distributed_parameter, is_scaled_batch_parameter

if TYPE_CHECKING:
    from mp_memory import ShardedDataParallel

__all__ = ["ReplicaSync"]


class ReplicaSync:
    """Gradient reduction and replica sync over the data-parallel group of one DistributedModel.

    ``placement`` returns the model's current placement (it changes once, when the first step
    partitions the model); the other arguments are DistributedModel's own. The comm hook
    (``comm_hook``), ``model.join()`` (``joined``) and ``average_microbatches`` are set by
    mp.model_extras; ``overlap`` is the overlapped reduction in use (tests read its counters).
    """

    def __init__(
        self,
        *,
        module: nn.Module,
        placement: Callable[[], Placement],
        runtime: PipelineRuntime | None,
        sharded: ShardedDataParallel | None,
        rank: int,
        dp_size: int,
        backward_passes_per_step: int,
        bucket_bytes: int,
        broadcast_buffers: bool,
        overlap: bool,
        average_microbatches: bool,
    ) -> None:
        self.module = module
        self._placement = placement
        self._runtime = runtime
        self._sharded = sharded
        self.rank = rank
        self.dp_size = dp_size
        """The size of the data-parallel group (1: nothing to reduce or sync)."""
        self._bpps = backward_passes_per_step
        self.bucket_bytes = bucket_bytes
        """The gradient buckets' size in bytes (``bucket_cap_mb``)."""
        self._broadcast_buffers = broadcast_buffers
        self.overlap_enabled = overlap and sharded is None
        """Whether gradient buckets may be reduced during the backward (off under sharding, a comm
        hook, and while ``model.join()`` is active)."""
        self.overlap: OverlappedReduction | None = None
        """The overlapped reduction in use, made on the first reducing step where it applies."""
        self.average_microbatches = average_microbatches
        """Whether gradient seeds are divided by the number of microbatches (off under a comm hook)."""
        self.comm_hook: tuple[Callable[..., Any], Any] | None = None
        """(hook, state) of ``model.register_comm_hook``, run on each bucket instead of the all-reduce."""
        self.joined: JoinState | None = None
        """The active ``model.join()`` context's bookkeeping, else None."""

    def local_parameters(self) -> list[nn.Parameter]:
        """The parameters this rank holds (all of them until the model is partitioned)."""
        return self._placement().local_parameters(self.module)

    def local_buffers(self) -> list[torch.Tensor]:
        """The buffers this rank holds (all of them until the model is partitioned)."""
        placement = self._placement()
        return [b for b in self.module.buffers() if placement.is_local(b)]

    def seed_scale(self, microbatches: int) -> float:
        """At the start of a step (after :meth:`sync`): the factor on the step's gradient seeds. Under
        ``model.join()`` it counts the replicas still running (a collective over the group)."""
        scale = 1.0 / microbatches if self.average_microbatches else 1.0
        if self.joined is not None:
            scale *= self.joined.step_started()
        return scale

    def arm(self, step: int) -> None:
        """Before an attempt of step number ``step`` (1-based): let the overlapped reduction count the
        step's accumulations, so that a bucket launches after its parameters' last one."""
        if self.reduces(step):
            overlap = self.overlap_reduction()
            if overlap is not None:
                overlap.arm()

    def close_overlap(self) -> None:
        """Reduce synchronously from now on (a comm hook replaces the buckets' all-reduce)."""
        if self.overlap is not None:
            self.overlap.close()
            self.overlap = None
        self.overlap_enabled = False

    def drain(self) -> None:
        """After a failed attempt that is taken back: complete the gradient collectives that some
        data-parallel replica started (out of place: the local gradients stay as they are)."""
        overlap = self.overlap
        group = state.process_groups.get(GroupKind.DP)
        if group is None or dist.get_world_size(group) == 1:
            return
        launched = overlap is not None and overlap.launched > 0
        if agree_any([launched], group)[0] and overlap is not None:
            overlap.drain()
        elif overlap is not None:
            overlap.disarm()

    def after_step(self, error: BaseException | None, did_backward: bool, step: int) -> None:
        """After step number ``step`` (1-based): agree over the data-parallel group on failure and on
        whether to reduce gradients; reduce. Raises the step's error (or a replica's)."""
        group = state.process_groups.get(GroupKind.DP)
        if self.dp_size > 1 and group is not None:
            overlap = self.overlap
            launched = overlap is not None and overlap.launched > 0
            failed, any_backward, any_launched = self._agree_after_step(
                [error is not None, did_backward, launched], group, step
            )
            if failed:
                if any_launched:  # every member completes the collectives some member started
                    assert overlap is not None
                    overlap.drain()
                text = None
                if error is not None:
                    text = f"rank {self.rank}: {type(error).__name__}: {error}\n" + "".join(
                        traceback.format_exception(type(error), error, error.__traceback__)
                    )
                texts: list[Any] = [None] * self.dp_size
                dist.all_gather_object(texts, text, group=group)
                if error is not None:
                    raise error
                first = next(t for t in texts if t is not None)
                raise SMPRuntimeError(f"the step failed on a data-parallel replica:\n{first}")
            if any_backward and self.reduces(step):
                with RECORDER.span(EventKind.REDUCE, rank=self.rank, step=step, module="", microbatch=-1):
                    overlap = self.overlap_reduction()
                    if overlap is not None:
                        overlap.finish()
                    else:
                        self._reduce_gradients([p for p in self.local_parameters() if p.requires_grad], group)
            elif any_launched:
                assert overlap is not None
                overlap.drain()
        elif error is not None:
            raise error

    def _agree_after_step(self, flags: list[bool], group: dist.ProcessGroup, step: int) -> list[bool]:
        """The data-parallel replicas' first meeting after a step; a replica that never comes (it ran out
        of batches: S8's mis-sized sampler) is an error after the pipeline timeout, not a hang."""
        timeout = self._runtime.timeout if self._runtime is not None else default_timeout()
        try:
            return agree_any(flags, group, timeout=timeout)
        except (PipelineTimeoutError, RuntimeError) as exc:
            # RuntimeError: the all-reduce failed because a replica that finished its loop already left
            # (gloo: "Connection closed by peer"), which may come before the timeout
            members = state.require()[2].group(GroupKind.DP, self.rank)
            how = (
                f"within {timeout:g} s"
                if isinstance(exc, PipelineTimeoutError)
                else f"(one left the group: {str(exc).strip().splitlines()[0][:200]})"
            )
            raise SMPRuntimeError(
                f"rank {self.rank}: the data-parallel replicas {list(members)} did not all finish step "
                f"{step} {how}. Every replica must run the same number of "
                "steps: one that runs out of batches first (a data loader whose length differs between "
                "dp_ranks; use DistributedSampler(..., drop_last=True), or give every dp_rank the same "
                "number of batches) leaves the others waiting here. Raise MP_PIPELINE_TIMEOUT if a replica "
                "can legitimately lag that long."
            ) from None

    def reduces(self, step: int) -> bool:
        """Whether step number ``step`` (1-based) ends a backward_passes_per_step accumulation
        (gradients are reduced after it)."""
        return step % self._bpps == 0

    def overlap_reduction(self) -> OverlappedReduction | None:
        """The overlapped reduction of the local trainable parameters (made again when they change:
        every replica changes them alike), or None where it does not apply."""
        group = state.process_groups.get(GroupKind.DP)
        if not self.overlap_enabled or group is None:
            return None
        params = [p for p in self.local_parameters() if p.requires_grad]
        if sparse_grad_parameters(self.module):  # sparse gradients cannot join the buckets
            return None
        # Replicas may launch a bucket at different moments relative to the step's agreement (agree_any,
        # gloo on CPU tensors), so the buckets must travel on another channel than it: MPI for CPU
        # tensors, NCCL for CUDA ones. Otherwise (torchrun on CPU, ranks sharing a GPU) stay synchronous.
        devices = {p.device.type for p in params}
        if not (
            (devices == {"cpu"} and mpi_comm_of(group) is not None)
            or (devices == {"cuda"} and "nccl" in str(dist.get_backend(group)))
        ):
            return None
        if (
            self.overlap is None
            or len(params) != len(self.overlap.params)
            or any(p is not q for p, q in zip(params, self.overlap.params, strict=True))
        ):
            if self.overlap is not None:
                self.overlap.close()
            self.overlap = OverlappedReduction(params, group, self.bucket_bytes)
        return self.overlap

    def _reduce_gradients(self, params: list[nn.Parameter], dp_group: dist.ProcessGroup) -> None:
        cfg = state.require()[0]
        if self._sharded is not None:  # FSDP2 reduce-scattered the shards' gradients in backward
            self._sharded.reduce_persistent_grads()
            return
        if self.comm_hook is not None:  # model.register_comm_hook (tp == 1 only)
            hook, hook_state = self.comm_hook
            reduce_with_hook(hook, hook_state, params, dp_group, self.bucket_bytes)
            return
        sparse_ids = sparse_grad_parameters(self.module)
        if sparse_ids:  # only the rows the step looked up travel, outside the dense buckets
            sparse = [p for p in params if id(p) in sparse_ids]
            params = [p for p in params if id(p) not in sparse_ids]
            self._reduce_sparse_gradients(sparse, dp_group)
        if cfg.tp == 1:
            reduce_gradients(params, dp_group, bucket_bytes=self.bucket_bytes)
            return
        # Tensor-parallel shards (and what distributed modules apply to the TP group's exchanged
        # batch) already saw every TP rank's samples: they are summed over the reduced DP group only.
        scaled = [p for p in params if is_scaled_batch_parameter(p)]
        others = [p for p in params if not is_scaled_batch_parameter(p)]
        reduce_gradients(others, dp_group, bucket_bytes=self.bucket_bytes)
        rdp = state.process_groups[GroupKind.RDP]
        rdp_size = dist.get_world_size(rdp)
        divisor = rdp_size if cfg.prescaled_batch else rdp_size * cfg.tp
        reduce_gradients(scaled, rdp, bucket_bytes=self.bucket_bytes, divisor=divisor)

    def _reduce_sparse_gradients(self, params: list[nn.Parameter], dp_group: dist.ProcessGroup) -> None:
        """Sparse embedding gradients, over the groups and with the divisors of the dense ones."""
        cfg = state.require()[0]
        scaled = [p for p in params if cfg.tp > 1 and is_scaled_batch_parameter(p)]
        others = [p for p in params if not (cfg.tp > 1 and is_scaled_batch_parameter(p))]
        if others:
            reduce_sparse_gradients(others, dp_group, dist.get_world_size(dp_group))
        if scaled:
            rdp = state.process_groups[GroupKind.RDP]
            rdp_size = dist.get_world_size(rdp)
            reduce_sparse_gradients(scaled, rdp, rdp_size if cfg.prescaled_batch else rdp_size * cfg.tp)

    def sync(self, *, first: bool) -> None:
        """Before a step: broadcast the parameters (``first``: the first step) and the buffers (every
        step with ``broadcast_buffers``) from the group's first replica."""
        group = state.process_groups.get(GroupKind.DP)
        if self.dp_size == 1 or group is None:
            return
        tensors: list[torch.Tensor] = []
        if first and self._sharded is None:  # sharded: rank 0's parameters were broadcast at wrap time
            local = list(self.local_parameters())
            # Shards differ between TP ranks by design: only replicas of the same shard (RDP) agree.
            shards = [p.data for p in local if is_distributed_parameter(p)]
            if shards:
                broadcast_tensors(shards, state.process_groups[GroupKind.RDP], bucket_bytes=self.bucket_bytes)
            tensors += [p.data for p in local if not is_distributed_parameter(p)]
        if first or self._broadcast_buffers:
            tensors += [b for b in self.module.buffers() if not getattr(b, PLACEHOLDER_ATTR, False)]
        if tensors:
            broadcast_tensors(tensors, group, bucket_bytes=self.bucket_bytes)
