"""The data-parallel side of `DistributedModel`: after each step, agree over the replicas on failure and
on reducing, then average gradients (overlapped buckets, a comm hook, or TP-aware reduction); keep the
replicas' parameters and buffers in sync.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mp.errors import SMPRuntimeError
from mp.model_extras import reduce_with_hook
from mp.model_partition import _PLACEHOLDER, PartitionMixin
from mp.sparse_grads import reduce_sparse_gradients, sparse_grad_parameters
from mp.state import state
from mp_comm import GroupKind, mpi_comm_of
from mp_pipeline import (
    RECORDER,
    EventKind,
    OverlappedReduction,
    PipelineTimeoutError,
    agree_any,
    broadcast_tensors,
    default_timeout,
    reduce_gradients,
)
from mp_tensor import is_distributed_parameter, is_scaled_batch_parameter

if TYPE_CHECKING:
    from mp_memory import ShardedDataParallel

__all__ = ["DataParallelMixin"]


class DataParallelMixin(PartitionMixin):
    """Gradient reduction and replica sync over the data-parallel group (mixed into DistributedModel)."""

    _rank: int
    _dp_size: int
    _step_count: int
    _bpps: int
    _bucket_bytes: int
    _broadcast_buffers: bool
    _overlap_enabled: bool
    _overlap: OverlappedReduction | None
    _comm_hook: tuple[Callable[..., Any], Any] | None
    _sharded: ShardedDataParallel | None

    def _after_step(self, error: BaseException | None, did_backward: bool) -> None:
        """Agree over the data-parallel group on failure and on whether to reduce gradients; reduce."""
        group = state.process_groups.get(GroupKind.DP)
        if self._dp_size > 1 and group is not None:
            overlap = self._overlap
            launched = overlap is not None and overlap.launched > 0
            failed, any_backward, any_launched = self._agree_after_step(
                [error is not None, did_backward, launched], group
            )
            if failed:
                if any_launched:  # every member completes the collectives some member started
                    assert overlap is not None
                    overlap.drain()
                text = None
                if error is not None:
                    text = f"rank {self._rank}: {type(error).__name__}: {error}\n" + "".join(
                        traceback.format_exception(type(error), error, error.__traceback__)
                    )
                texts: list[Any] = [None] * self._dp_size
                dist.all_gather_object(texts, text, group=group)
                if error is not None:
                    raise error
                first = next(t for t in texts if t is not None)
                raise SMPRuntimeError(f"the step failed on a data-parallel replica:\n{first}")
            if any_backward and self._reduces_this_step():
                with RECORDER.span(
                    EventKind.REDUCE, rank=self._rank, step=self._step_count + 1, module="", microbatch=-1
                ):
                    overlap = self._overlap_reduction()
                    if overlap is not None:
                        overlap.finish()
                    else:
                        self._reduce_gradients([p for p in self._local_params() if p.requires_grad], group)
            elif any_launched:
                assert overlap is not None
                overlap.drain()
        elif error is not None:
            raise error

    def _agree_after_step(self, flags: list[bool], group: dist.ProcessGroup) -> list[bool]:
        """The data-parallel replicas' first meeting after a step; a replica that never comes (it ran out
        of batches: S8's mis-sized sampler) is an error after the pipeline timeout, not a hang."""
        timeout = self._runtime.timeout if self._runtime is not None else default_timeout()
        try:
            return agree_any(flags, group, timeout=timeout)
        except PipelineTimeoutError:
            members = state.require()[2].group(GroupKind.DP, self._rank)
            raise SMPRuntimeError(
                f"rank {self._rank}: the data-parallel replicas {list(members)} did not all finish step "
                f"{self._step_count + 1} within {timeout:g} s. Every replica must run the same number of "
                "steps: one that runs out of batches first (a data loader whose length differs between "
                "dp_ranks; use DistributedSampler(..., drop_last=True), or give every dp_rank the same "
                "number of batches) leaves the others waiting here. Raise MP_PIPELINE_TIMEOUT if a replica "
                "can legitimately lag that long."
            ) from None

    def _reduces_this_step(self) -> bool:
        """Whether this step ends a backward_passes_per_step accumulation (gradients are reduced)."""
        return (self._step_count + 1) % self._bpps == 0

    def _overlap_reduction(self) -> OverlappedReduction | None:
        """The overlapped reduction of the local trainable parameters (made again when they change:
        every replica changes them alike), or None where it does not apply."""
        group = state.process_groups.get(GroupKind.DP)
        if not self._overlap_enabled or group is None:
            return None
        params = [p for p in self._local_params() if p.requires_grad]
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
            self._overlap is None
            or len(params) != len(self._overlap.params)
            or any(p is not q for p, q in zip(params, self._overlap.params, strict=True))
        ):
            if self._overlap is not None:
                self._overlap.close()
            self._overlap = OverlappedReduction(params, group, self._bucket_bytes)
        return self._overlap

    def _reduce_gradients(self, params: list[nn.Parameter], dp_group: dist.ProcessGroup) -> None:
        cfg = state.require()[0]
        if self._sharded is not None:  # FSDP2 reduce-scattered the shards' gradients in backward
            self._sharded.reduce_persistent_grads()
            return
        if self._comm_hook is not None:  # model.register_comm_hook (tp == 1 only)
            hook, hook_state = self._comm_hook
            reduce_with_hook(hook, hook_state, params, dp_group, self._bucket_bytes)
            return
        sparse_ids = sparse_grad_parameters(self.module)
        if sparse_ids:  # only the rows the step looked up travel, outside the dense buckets
            sparse = [p for p in params if id(p) in sparse_ids]
            params = [p for p in params if id(p) not in sparse_ids]
            self._reduce_sparse_gradients(sparse, dp_group)
        if cfg.tp == 1:
            reduce_gradients(params, dp_group, bucket_bytes=self._bucket_bytes)
            return
        # Tensor-parallel shards (and what distributed modules apply to the TP group's exchanged
        # batch) already saw every TP rank's samples: they are summed over the reduced DP group only.
        scaled = [p for p in params if is_scaled_batch_parameter(p)]
        others = [p for p in params if not is_scaled_batch_parameter(p)]
        reduce_gradients(others, dp_group, bucket_bytes=self._bucket_bytes)
        rdp = state.process_groups[GroupKind.RDP]
        rdp_size = dist.get_world_size(rdp)
        divisor = rdp_size if cfg.prescaled_batch else rdp_size * cfg.tp
        reduce_gradients(scaled, rdp, bucket_bytes=self._bucket_bytes, divisor=divisor)

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

    def _sync_replicas(self, *, first: bool) -> None:
        group = state.process_groups.get(GroupKind.DP)
        if self._dp_size == 1 or group is None:
            return
        tensors: list[torch.Tensor] = []
        if first and self._sharded is None:  # sharded: rank 0's parameters were broadcast at wrap time
            local = list(self._local_params())
            # Shards differ between TP ranks by design: only replicas of the same shard (RDP) agree.
            shards = [p.data for p in local if is_distributed_parameter(p)]
            if shards:
                broadcast_tensors(
                    shards, state.process_groups[GroupKind.RDP], bucket_bytes=self._bucket_bytes
                )
            tensors += [p.data for p in local if not is_distributed_parameter(p)]
        if first or self._broadcast_buffers:
            tensors += [b for b in self.module.buffers() if not getattr(b, _PLACEHOLDER, False)]
        if tensors:
            broadcast_tensors(tensors, group, bucket_bytes=self._bucket_bytes)
