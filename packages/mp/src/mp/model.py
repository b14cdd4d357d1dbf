"""`smp.DistributedModel`: partition on the first step, pipeline the step, average over replicas.

    model = smp.DistributedModel(MyModel())
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters()))

The first ``@smp.step`` call partitions the model (automatically with mp_partition, tracing the step
function on its first microbatch on rank 0, or by the ``smp.partition`` marks), shares the decision
with every rank, and frees on each rank the parameters that other pipeline stages own (they stay as
shape-only placeholders, so the optimizer and ``named_parameters`` keep working). Each step then runs
through mp_pipeline's module servers; after it, gradients are averaged over each partition's
data-parallel group.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from mp.activation_checkpointing import checkpoint_attentions
from mp.delayed_init import check as check_delayed_init
from mp.delayed_init import delayed
from mp.delayed_init import prepare as prepare_delayed_init
from mp.errors import (
    BwdExecutionNotInStepFnError,
    FwdExecutionNotInStepFnError,
    IncompatibleCheckpointFoundError,
    ModelNotPartitionedError,
    MultipleDistributedModelError,
    NotSupportedByFastModeError,
    SMPRuntimeError,
    SMPValidationError,
)
from mp.memory_report import install_memory_trace
from mp.model_extras import JoinState, check_constructor_args, join, reduce_with_hook, register_comm_hook
from mp.offload import install_offloading
from mp.optimizer import keep_local_parameters
from mp.partition_file import check_assignment, read_partition, write_partition
from mp.precision import half_dtype
from mp.sharded import load_local_state_dict as load_sharded_local_state_dict
from mp.sharded import local_state_dict as sharded_local_state_dict
from mp.sharded import refuse_under_sharding, shard_model
from mp.state import state
from mp.state_dicts import full_state_dict, layout_of, load_full_state_dict, local_layout_check
from mp.tensor_api import pin_tp_internals, replace_tp_modules
from mp_comm import GroupKind, LoopbackTransport, Router, Transport, TransportConfig, World
from mp_comm.world import mpi_comm_of
from mp_memory.precision import cast_floats
from mp_partition import (
    ModuleTimes,
    PartitionPlan,
    StepTimer,
    Tracer,
    auto_partition,
    device_memory_bytes,
    manual_partition,
    time_step,
)
from mp_pipeline import (
    FlowChangedError,
    PipelineRuntime,
    PipelineTimeoutError,
    Scheduler,
    TaskContext,
    agree_any,
    broadcast_tensors,
    capture,
    caused_by,
    current,
    default_timeout,
    pipelined_backward,
    reduce_gradients,
    task_context,
)
from mp_pipeline.dp import OverlappedReduction
from mp_pipeline.structure import flatten
from mp_pipeline.timeline import RECORDER, EventKind, Timeline
from mp_tensor import is_distributed_parameter, is_scaled_batch_parameter
from mp_tensor.nn.base import DistributedModule

__all__ = ["DistributedModel"]

log = logging.getLogger(__name__)

_MODEL_IDS = itertools.count(1)
_PLACEHOLDER = "_mp_remote_placeholder"


_FULL_STATE_FIX = (
    "save the full model.state_dict() (smp.save(..., partial=False)), which loads under any layout"
)


def _module_path(key: str) -> str:
    return key.rsplit(".", 1)[0] if "." in key else ""


def _free(t: torch.Tensor) -> None:
    """Keep the tensor object (the optimizer may hold it) but drop its memory: a zero-stride view."""
    t.data = torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)
    setattr(t, _PLACEHOLDER, True)
    if isinstance(t, nn.Parameter):
        t.grad = None


def _placement_error(model_devices: set[str], input_devices: set[str]) -> str | None:
    """Why the first step cannot run with the model on these device types and these step inputs.

    smp moved each rank's partition to its GPU after partitioning, so its scripts put only the batch
    on CUDA. mp does not move the model (not built yet): such a script would fail deep in the forward
    with a device mismatch, after tracing, so it is stopped here with the fix instead.
    """
    if "cuda" in input_devices and model_devices == {"cpu"}:
        return (
            "the first step's inputs are on CUDA but every parameter of the model is on the CPU. smp moved "
            "each rank's partition to its GPU after partitioning; mp does not move the model yet. Fix: "
            "move the model before wrapping it, e.g. torch.cuda.set_device(smp.local_rank()); "
            "model.to(torch.device('cuda', smp.local_rank())); model = smp.DistributedModel(model)"
        )
    return None


def _pipeline_transport(world: World) -> Transport:
    """The transport pipelined models run on: opened by the first one (collective), closed by smp.reset.

    A router over MPI and, where CUDA and ucxx exist, UCX (device tensors then move GPU to GPU);
    on CPU only MPI remains and is used directly.
    """
    transport: Transport | None = state.transport
    if transport is None or transport.closed:
        config = TransportConfig(timeout=3600.0)
        if world.size == 1:
            transport = LoopbackTransport.single(config=config)
        else:
            router = Router.create(world, transport_config=config)
            transport = router if len(router.transports) > 1 else next(iter(router.transports.values()))
        state.transport = transport
    return transport


class DistributedModel(nn.Module):
    """The smp model wrapper (reference §2.1); ``module`` is the user's model."""

    def __init__(
        self,
        module: nn.Module,
        *,
        trace_device: str = "gpu",
        trace_execution_times: bool = False,
        overlapping_allreduce: bool = True,
        backward_passes_per_step: int = 1,
        average_grads_across_microbatches: bool = True,
        bucket_cap_mb: float = 25,
        trace_memory_usage: bool = False,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = False,
        find_unused_parameters: bool = False,
    ) -> None:
        cfg, world, topo = state.require()
        if state.model is not None:
            raise MultipleDistributedModelError(
                "a DistributedModel already exists in this process; smp supports one per process. "
                "Wrap the whole model once (call smp.reset() to start over)."
            )
        if not isinstance(module, nn.Module):
            raise SMPValidationError(f"DistributedModel needs a torch.nn.Module; got {type(module).__name__}")
        if trace_device not in ("cpu", "gpu"):
            raise SMPValidationError(f"trace_device={trace_device!r}; expected 'cpu' or 'gpu'")
        if (
            isinstance(backward_passes_per_step, bool)
            or not isinstance(backward_passes_per_step, int)
            or (backward_passes_per_step < 1)
        ):
            raise SMPValidationError(
                f"backward_passes_per_step={backward_passes_per_step!r}; expected an int >= 1"
            )
        check_constructor_args(gradient_as_bucket_view, find_unused_parameters, trace_memory_usage)
        super().__init__()
        # Tensor parallelism: marked modules become their distributed versions now, at wrap time
        # (smp's order), copying the original weights into this rank's shards.
        check_delayed_init(module, cfg.tp)
        self.module = replace_tp_modules(module)  # at tp=1: whole models only (smp's GPT-2 LM head)
        # fp16/bf16 (smp's FP16_Module): the parameters in half precision; inputs cast in forward
        self._half = half_dtype(cfg.precision)
        if self._half is not None:
            self.module.to(self._half)
        self._pp: int = cfg.pipeline_parallel_degree
        self._rank = world.rank
        self._pp_rank = topo.coords(world.rank).pp_rank
        self._pp_peers = tuple(topo.group(GroupKind.PP, world.rank))
        self._dp_size = topo.size(GroupKind.DP)
        self._trace_times = trace_execution_times and trace_device == "gpu"  # smp: no timing on a CPU trace
        self._bpps = backward_passes_per_step
        self._average_mb = average_grads_across_microbatches
        self._bucket_bytes = max(1, int(bucket_cap_mb * (1 << 20)))
        self._broadcast_buffers = broadcast_buffers
        self._partitioned = False
        self._assignment: dict[str, int] = {}
        self.plan: PartitionPlan | None = None
        """The partition plan (on global rank 0, where it is computed; None elsewhere and with pp=1)."""
        self._pinned: dict[str, int] | None = None
        """The partition a partial checkpoint was saved with (loaded before the first step): used
        instead of computing one, so that the checkpoint's parts land where they were saved."""
        self._tracing = False
        self._timer: StepTimer | None = None  # the timed step before auto-partitioning (mp_partition)
        self._in_step = False
        self._grad_scale = 1.0
        self._backward_calls = 0
        self._step_count = 0
        self._post_partition_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._post_step_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._model_id = next(_MODEL_IDS)
        self._runtime: PipelineRuntime | None = None
        self._size_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters())
        self._comm_hook: tuple[Callable[..., Any], Any] | None = None  # model.register_comm_hook
        self._join: JoinState | None = None  # set inside model.join()
        # tp == 1: each gradient bucket's all-reduce starts once the step's last accumulation into its
        # parameters is done (on a pipeline stage: while other stages still run their backward).
        self._overlap_enabled = overlapping_allreduce and cfg.tp == 1 and self._dp_size > 1
        self._overlap: OverlappedReduction | None = None
        self._microbatches = 1
        self._fast_mode = cfg.fast_mode
        # sharded_data_parallel_degree > 1: FSDP2 shards the model now and reduces its gradients itself
        self._sharded = shard_model(self.module)
        if self._sharded is not None:
            self._overlap_enabled = False
        if self._pp > 1:
            transport = _pipeline_transport(world)
            # static_mode: record the first steps' messages, then send them compact (mp_pipeline.static);
            # fast_mode: the same, plus the child-to-child path (mp_pipeline.remote, mp_pipeline.fast); a
            # flow that changes after the recording raises NotSupportedByFastModeError.
            self._runtime = PipelineRuntime(
                transport=transport,
                rank=world.rank,
                peers=self._pp_peers,
                model_id=self._model_id,
                static=cfg.static_mode or cfg.fast_mode,
                strict=cfg.fast_mode,
                # TP modules issue collectives in the TP group: its servers run one order of events
                tp_group=tuple(topo.group(GroupKind.TP, world.rank)) if cfg.tp > 1 else (),
            )
        state.model = self
        if cfg.resolved_checkpoint_attentions:  # smp's key: each distributed layer's attention recomputed
            checkpoint_attentions(self)
        self._offloader = install_offloading(self)  # offload_activations (mp.offload)
        self._memory_trace = install_memory_trace(self, trace_memory_usage)  # mp.memory_report
        prepare_delayed_init(self)  # a model built on the meta device: materialized after partitioning

    # ------------------------------------------------------------------------------ the nn.Module side
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._runtime is not None and not self._tracing and not self._in_step:
            raise FwdExecutionNotInStepFnError(
                "the DistributedModel's forward ran outside an @smp.step function with "
                f"pipeline_parallel_degree={self._pp}; call the model inside the step function"
            )
        if self._half is not None:  # as smp's FP16_Module: half inputs, fp32 outputs
            args, kwargs = cast_floats((args, kwargs), self._half)
            return cast_floats(self.module(*args, **kwargs), torch.float32)
        return self.module(*args, **kwargs)

    def backward(
        self,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        grad_tensors: torch.Tensor | Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Use instead of ``loss.backward()`` inside the step function."""
        if self._tracing:
            if self._timer is not None:  # the timed step runs a real backward
                self._timer.backward(tensors, grad_tensors)
            return
        if not self._in_step or current() is None:
            raise BwdExecutionNotInStepFnError(
                "model.backward ran outside an @smp.step function; call it inside the step function "
                "(smp replaces loss.backward() with model.backward(loss) there)"
            )
        outs = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if grad_tensors is None:
            grads: list[torch.Tensor | None] = [None] * len(outs)
        elif isinstance(grad_tensors, torch.Tensor):
            grads = [grad_tensors]
        else:
            grads = list(grad_tensors)
        # average over microbatches, and the fp16 loss scale: scale the gradient seeds
        seed_scale = self._grad_scale * float(getattr(state.optimizer, "loss_scale", 1.0))
        if seed_scale != 1.0:
            scaled: list[torch.Tensor | None] = []
            for t, g in zip(outs, grads, strict=True):
                if g is not None:
                    scaled.append(g * seed_scale)
                elif t.numel() == 1:
                    scaled.append(torch.full_like(t, seed_scale))
                else:
                    scaled.append(None)  # torch raises its own "grad can be implicitly created" error
            grads = scaled
        self._backward_calls += 1
        pipelined_backward(outs, grads)

    @property
    def partitioned(self) -> bool:
        """False until the first step has partitioned the model."""
        return self._partitioned

    def get_module(self) -> nn.Module:
        """The user's model inside the wrapper."""
        return self.module

    # ------------------------------------------------------------------------------------------- step
    def _run_step(
        self, func: Callable[..., Any], inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]
    ) -> list[Any]:
        cfg, _, _ = state.require()

        def body(mb: int) -> Any:
            args, kwargs = inputs[mb]
            return func(*args, **kwargs)

        exec_state = capture()
        if not self._partitioned:
            _, first = flatten(inputs[0]) if inputs else (None, [])
            problem = _placement_error(
                {p.device.type for p in self.module.parameters() if not p.is_meta},
                {t.device.type for t in first},
            )
            if problem is not None:
                raise SMPValidationError(problem)
            self._partition(body)
        self._sync_replicas(first=self._step_count == 0)
        self._grad_scale = 1.0 / len(inputs) if self._average_mb else 1.0
        self._microbatches = len(inputs)
        if self._join is not None:  # model.join(): count the replicas still running (mp.model_extras)
            self._join.step_started(self)
        if self._reduces_this_step():
            overlap = self._overlap_reduction()
            if overlap is not None:
                overlap.arm()  # counts the step's accumulations: a bucket launches after its params' last
        calls_before = self._backward_calls
        remote_before = self._runtime.remote.backward_requests if self._runtime is not None else 0
        error: BaseException | None = None
        results: list[Any] = []
        self._in_step = True
        try:
            if self._runtime is None:
                for mb in range(len(inputs)):
                    with task_context(TaskContext(mb, ("<step>",))):
                        results.append(body(mb))
            else:
                scheduler = Scheduler(
                    cfg.resolved_pipeline,
                    len(inputs),
                    min(cfg.resolved_active_microbatches, len(inputs)),
                    # TP ranks agree on one order of events through their servers, whatever the schedule
                    deterministic=cfg.deterministic_server,
                    # two stages: the last one starts its backward without a round trip to pp_rank 0
                    eager_backward=cfg.pipeline_parallel_degree == 2,
                )
                name = getattr(func, "__qualname__", "")
                results = self._runtime.run_step(body, scheduler, exec_state, name=name)
        except BaseException as exc:
            error = exc
        finally:
            self._in_step = False
        if self._fast_mode and self._runtime is not None:
            error = self._fast_mode_check(error)
        did_backward = self._backward_calls > calls_before or (
            self._runtime is not None and self._runtime.remote.backward_requests > remote_before
        )
        self._after_step(error, did_backward)
        self._step_count += 1
        if self._step_count == 1:
            self._run_hooks(self._post_step_hooks)
        return results

    def _fast_mode_check(self, error: BaseException | None) -> BaseException | None:
        """Fast mode: a flow that changed after the recording fails the step on every pipeline rank with
        NotSupportedByFastModeError. A change found while sending aborted the step everywhere already;
        one found only at its end (recorded messages left unsent) is agreed on over the pipeline."""
        assert self._runtime is not None
        if self._runtime.replaying_static:  # on every pipeline rank alike: the collective is safe
            group = state.process_groups.get(GroupKind.PP)
            mismatch = self._runtime.flow_mismatch if error is None else None
            changed = mismatch is not None
            if group is not None:
                changed = agree_any([changed], group)[0]
            if changed and error is None:
                error = FlowChangedError(mismatch or "another rank of the pipeline sent other messages")
        if error is not None and caused_by(error, FlowChangedError):
            fast = NotSupportedByFastModeError(
                f"the execution flow of the step changed after static mode recorded it: {error}. Fast "
                "mode needs the same flow in every step: set 'fast_mode' to False (with static_mode the "
                "runtime then falls back to full messages when the flow changes)."
            )
            fast.__cause__ = error
            return fast
        return error

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

    def _enter_collective(self, what: str) -> None:
        """Before a collective over the pipeline between steps: a clear error, not a hang, when a rank
        of the pipeline does not come (PipelineRuntime.enter); nothing to check without a pipeline."""
        if self._runtime is not None:
            self._runtime.enter(what)

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

    # ------------------------------------------------------------------------------------ partitioning
    def _partition(self, body: Callable[[int], Any]) -> None:
        world = state.require()[1]
        if self._pp > 1:
            cfg = state.require()[0]
            payload: tuple[str, Any] = ("error", "rank 0 did not compute a partition")
            # The trace runs the model's forward: with tensor parallelism its distributed modules run
            # collectives in rank 0's TP group, so every member of that group traces (its own first
            # microbatch) and rank 0's plan is the one everybody uses.
            tracers = state.require()[2].group(GroupKind.TP, 0)
            # Whether rank 0 takes a given partition decides whether anybody traces: agreed first.
            pinned: list[Any] = [self._pinned is not None or cfg.load_partition]
            dist.broadcast_object_list(pinned, src=0)
            if world.rank in tracers and world.rank != 0 and not pinned[0]:
                try:
                    self._compute_plan(body)
                except Exception:
                    log.exception("tracing on rank %d (a TP peer of rank 0) failed", world.rank)
            if world.rank == 0:
                try:
                    assignment = self._decide_partition(body)
                    if cfg.partition_file is not None and not cfg.load_partition:
                        write_partition(cfg.partition_file, assignment, self._pp)
                    payload = ("ok", assignment)
                except Exception as exc:
                    payload = (
                        "error",
                        "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                    )
                    dist.broadcast_object_list([payload], src=0)
                    raise
            box: list[Any] = [payload]
            dist.broadcast_object_list(box, src=0)
            kind, value = box[0]
            if kind == "error":
                raise SMPRuntimeError(f"partitioning the model failed on rank 0:\n{value}")
            self._assignment = dict(value)
            self._assignment.update(pin_tp_internals(self.module, self._module_owner))
            self._apply_assignment()
            log.info(
                "rank %d (pp_rank %d) holds %d of %d parameters after partitioning",
                world.rank,
                self._pp_rank,
                sum(p.numel() for p in self._local_params()),
                sum(p.numel() for p in self.module.parameters()),
            )
        self._partitioned = True
        optimizer = state.optimizer
        if optimizer is not None:
            keep_local_parameters(optimizer, self._is_remote)
        self._run_hooks(self._post_partition_hooks)

    def _decide_partition(self, body: Callable[[int], Any]) -> dict[str, int]:
        """On global rank 0: the partition of a partial checkpoint loaded before the first step, else the
        one in ``partition_file`` (``load_partition``), else a computed one."""
        cfg = state.require()[0]
        if self._pinned is not None:
            log.info("partition taken from the partial checkpoint loaded before the first step")
            return dict(self._pinned)
        if cfg.load_partition:
            assert cfg.partition_file is not None  # the config requires it
            assignment = read_partition(cfg.partition_file, self._module_paths(), self._pp)
            log.info("partition read from partition_file %r", cfg.partition_file)
            return assignment
        self.plan = self._compute_plan(body)
        return dict(self.plan.assignment)

    def _compute_plan(self, body: Callable[[int], Any]) -> PartitionPlan:
        cfg = state.require()[0]
        alpha = cfg.resolved_memory_weight
        if not cfg.auto_partition:
            return manual_partition(
                self.module, self._pp, cfg.resolved_default_partition, memory_weight=alpha
            )
        if cfg.skip_tracing or delayed(self.module):  # a model on the meta device cannot run yet
            return auto_partition(self.module, self._pp, memory_weight=alpha, skip_tracing=True)
        with Tracer(self.module, measure_time=self._trace_times) as tracer:
            self._tracing = True
            try:
                with task_context(TaskContext(0, ("<step>",))):
                    body(0)
            finally:
                self._tracing = False
        # Time balances the stages unless memory_weight is set (None: time, or memory where it binds).
        return auto_partition(
            self.module,
            self._pp,
            memory_weight=cfg.memory_weight,
            trace=tracer.result(),
            times=self._time_step(body),
            memory_limit_bytes=device_memory_bytes(self.module, state.require()[1].info.local_size),
            microbatches_in_flight=cfg.resolved_active_microbatches,
        )

    def _time_step(self, body: Callable[[int], Any]) -> ModuleTimes | None:
        """Forward and backward time of every module on the first microbatch (mp_partition.timing), or
        None if the timed step fails (the plan then balances the trace's costs)."""

        def step(timer: StepTimer) -> None:
            self._tracing, self._timer = True, timer
            try:
                with task_context(TaskContext(0, ("<step>",))):
                    body(0)
            finally:
                self._tracing, self._timer = False, None

        try:
            return time_step(self.module, step)
        except Exception:
            log.warning("timing the step for auto-partitioning failed; balancing traced costs", exc_info=True)
            return None

    def note_timeline(self, timeline: Timeline) -> None:
        """Adds each stage's measured seconds per microbatch (from a merged pipeline timeline) to the
        plan, beside the predicted ones (smp.timeline.stop calls it on the rank holding the plan)."""
        if self.plan is None or self.plan.num_partitions != self._pp:
            return
        topo = state.require()[2]
        per_stage: list[list[float]] = [[] for _ in range(self._pp)]
        for rank in timeline.ranks:
            seconds = timeline.stage_time_s(rank)
            if seconds is not None:
                per_stage[topo.coords(rank).pp_rank].append(seconds)
        measured = [sum(v) / len(v) if v else None for v in per_stage]
        self.plan = self.plan.with_measured_times(measured)

    def _apply_assignment(self) -> None:
        for name, p in self.module.named_parameters():
            if self._owner(name) != self._pp_rank:
                _free(p)
        for name, b in self.module.named_buffers():
            if self._owner(name) != self._pp_rank:
                _free(b)
        assert self._runtime is not None
        self._runtime.install(self.module, self._assignment)

    def _owner(self, key: str) -> int:
        """The pp_rank holding a parameter, buffer or state-dict entry named ``key``."""
        return self._module_owner(_module_path(key))

    def _module_owner(self, path: str) -> int:
        if not self._assignment:
            return 0
        while path not in self._assignment and path:
            path = _module_path(path)
        return self._assignment.get(path, 0)

    def _is_remote(self, t: torch.Tensor) -> bool:
        return bool(getattr(t, _PLACEHOLDER, False))

    def _local_params(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if not self._is_remote(p)]

    def _require_partitioned(self, what: str) -> None:
        if not self._partitioned:
            raise ModelNotPartitionedError(
                f"model.{what}() needs the model partitioned, which happens in the first @smp.step call; "
                "call it after the first step (or in a post-partition hook)"
            )

    # ------------------------------------------------------------------------------- local views
    def local_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) for the parameters this rank holds (names as ``named_parameters()``)."""
        self._require_partitioned("local_named_parameters")
        return ((n, p) for n, p in self.named_parameters() if not self._is_remote(p))

    def local_parameters(self) -> Iterator[nn.Parameter]:
        self._require_partitioned("local_parameters")
        return (p for _, p in self.local_named_parameters())

    def local_named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._require_partitioned("local_named_buffers")
        return ((n, b) for n, b in self.named_buffers() if not self._is_remote(b))

    def local_buffers(self) -> Iterator[torch.Tensor]:
        self._require_partitioned("local_buffers")
        return (b for _, b in self.local_named_buffers())

    def local_named_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """(path, module) for the modules this rank owns (paths relative to the user's model)."""
        self._require_partitioned("local_named_modules")
        return ((n, m) for n, m in self.module.named_modules() if self._module_owner(n) == self._pp_rank)

    def local_modules(self) -> Iterator[nn.Module]:
        self._require_partitioned("local_modules")
        return (m for _, m in self.local_named_modules())

    def is_local_parameter(self, param: torch.Tensor) -> bool:
        return not self._is_remote(param)

    def is_local_buffer(self, buf: torch.Tensor) -> bool:
        return not self._is_remote(buf)

    def get_param_name(self, param: torch.Tensor) -> str:
        """The name of ``param`` among ``named_parameters()`` (smp's helper, e.g. for optimizer groups)."""
        for name, p in self.named_parameters():
            if p is param:
                return name
        raise SMPValidationError(
            f"get_param_name: the tensor of shape {tuple(param.shape)} is not a parameter of this "
            "DistributedModel (a parameter of another model, or a copy made before wrapping?)"
        )

    def display_partition(self) -> None:
        """Print which pp_rank holds which modules: the partition report on the rank that computed the
        partition, the assignment (module path: pp_rank) on the others."""
        self._require_partitioned("display_partition")
        if self.plan is not None:
            print(self.plan.report())
        elif self._pp == 1:
            print(f"pipeline_parallel_degree=1: rank {self._rank} holds the whole model")
        else:
            for path, pp_rank in sorted(self._assignment.items()):
                print(f"{path or '(root)'}: pp_rank {pp_rank}")

    # -------------------------------------------------------------- tensor parallelism (smp v1.6)
    def distributed_modules(self) -> Iterator[nn.Module]:
        """The tensor-parallel modules of the model (those smp.tensor_parallelism replaced)."""
        return (m for m in self.module.modules() if isinstance(m, DistributedModule))

    def is_distributed_parameter(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is this rank's shard of a parameter split over the TP group."""
        return is_distributed_parameter(param)

    def is_distributed_buffer(self, buf: torch.Tensor) -> bool:
        return is_distributed_parameter(buf)

    def is_scaled_batch_parameter(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient already covers the TP group's whole batch (it is then averaged
        over the reduced data-parallel group only)."""
        return is_scaled_batch_parameter(param)

    def is_scaled_batch_buffer(self, buf: torch.Tensor) -> bool:
        return is_scaled_batch_parameter(buf)

    def default_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The local parameters whose gradients are averaged over the data-parallel group."""
        return ((n, p) for n, p in self.local_named_parameters() if not is_scaled_batch_parameter(p))

    def scaled_batch_reducer_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The local parameters whose gradients are averaged over the reduced data-parallel group."""
        return ((n, p) for n, p in self.local_named_parameters() if is_scaled_batch_parameter(p))

    # -------------------------------------------------------------------------------- state dicts
    def local_state_dict(self, *args: Any, cast_to_cpu: bool = True, **kwargs: Any) -> dict[str, Any]:
        """This rank's part of the model's state (its stage, its TP shards), with ``_smp_is_partial``,
        the partition (``_smp_partition``, pp > 1) and, with TP shards, the layout (``_smp_layout``)."""
        if self._sharded is not None:  # this rank's shards (mp.sharded)
            return sharded_local_state_dict(self._sharded)
        out: dict[str, Any] = OrderedDict()
        for key, value in self.module.state_dict(keep_vars=False).items():
            if self._owner(key) != self._pp_rank:
                continue
            out[key] = value.detach().cpu() if cast_to_cpu and isinstance(value, torch.Tensor) else value
        out["_smp_is_partial"] = True
        if self._pp > 1 and self._assignment:
            # The partition travels with the parts: loaded before the first step of another run, it
            # replaces that run's own partitioning (which could differ: traced times vary).
            out["_smp_partition"] = dict(self._assignment)
        layout = layout_of(self)
        if layout["split"]:  # TP shards: which tp_rank's they are, so no other rank loads them
            out["_smp_layout"] = layout
        return out

    def state_dict(  # type: ignore[override]
        self,
        *args: Any,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        cast_to_cpu: bool = True,
        gather_to_rank0: bool = True,
    ) -> dict[str, Any]:
        """The full state of the user's model on every rank: the original module's key names (a
        Hugging Face model's own, even under tensor parallelism) and full tensors, TP shards and
        pipeline stages gathered. Collective over the TP and pipeline groups: call it on every rank
        (or every ``rdp_rank() == 0`` rank, as smp asks). ``keep_vars`` returns the live tensors when
        nothing needs gathering (pp = 1 or not yet partitioned, no TP)."""
        gathers = any(True for _ in self.distributed_modules()) or (self._partitioned and self._pp > 1)
        if keep_vars and not gathers:
            return OrderedDict((prefix + k, v) for k, v in self.module.state_dict(keep_vars=True).items())
        merged = (
            full_state_dict(self, cast_to_cpu) if self._sharded is None else self._sharded.full_state_dict()
        )
        out: dict[str, Any] = destination if destination is not None else OrderedDict()
        out.update((prefix + k, v) for k, v in merged.items())
        return out

    def load_state_dict(  # type: ignore[override]
        self,
        state_dict: Any,
        strict: bool = True,
        translate_function: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        same_partition_load: bool = True,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """Load a full (``state_dict``) or partial (``local_state_dict``) state; keys with or without
        ``module.``; ``translate_function`` is applied to the state first.

        A full state loads under any layout: each rank keeps its own TP shards and its stage. A partial
        state must be this rank's part under the layout it was saved with (else
        IncompatibleCheckpointFoundError); ``same_partition_load`` (pp > 1) makes this run use the
        partition it was saved with. Before partitioning (pp > 1) a partial state loads into the whole
        module now and is checked, on every pipeline rank, once the model is partitioned."""
        sd = dict(state_dict)
        if translate_function is not None:
            sd = dict(translate_function(sd))
        partial = bool(sd.pop("_smp_is_partial", False))
        saved_partition = sd.pop("_smp_partition", None)
        saved_layout = sd.pop("_smp_layout", None)
        if sd and all(k.startswith("module.") for k in sd):
            sd = {k[len("module.") :]: v for k, v in sd.items()}
        if self._sharded is not None:
            if partial:
                sd["_smp_layout"] = saved_layout  # the shard layout, checked by mp.sharded
                return load_sharded_local_state_dict(self._sharded, sd)
            return self._sharded.load_full_state_dict(sd, strict)
        if not partial:
            return load_full_state_dict(self, sd, strict)
        if isinstance(saved_layout, dict):
            local_layout_check(self, saved_layout)
        if not self._partitioned and self._pp > 1:
            if saved_partition is not None and same_partition_load:
                self._pin_partition(saved_partition)
            loaded = set(sd)
            if strict:
                self.register_post_partition_hook(lambda m, _opt: m._check_partial_keys(loaded, True))
            return self.module.load_state_dict(sd, strict=False)
        if strict:
            self._check_partial_keys(set(sd), False)
        return self.module.load_state_dict(sd, strict=False)

    def _module_paths(self) -> Iterator[str]:
        """The paths of the wrapped model's modules (what a partition assigns)."""
        return (name for name, _ in self.module.named_modules())

    def _pin_partition(self, saved: Any) -> None:
        """Use the partition a partial state was saved with, after checking that it fits this model."""
        self._pinned = check_assignment(
            saved,
            self._module_paths(),
            self._pp,
            source="the partial state's '_smp_partition' entry",
            fix="load it into the model and layout it was saved with, or " + _FULL_STATE_FIX,
            error=IncompatibleCheckpointFoundError,
        )

    def _check_partial_keys(self, loaded: set[str], collective: bool) -> None:
        """Raise IncompatibleCheckpointFoundError unless ``loaded`` is exactly this rank's part;
        ``collective``: agree over the pipeline group so that every pipeline rank raises."""
        local = {k for k in self.module.state_dict(keep_vars=True) if self._owner(k) == self._pp_rank}
        missing, unexpected = sorted(local - loaded), sorted(loaded - local)
        problem = None
        if missing or unexpected:
            problem = (
                f"pp_rank {self._pp_rank} of {self._pp}: the partial state lacks {len(missing)} of this "
                f"rank's keys {missing[:5]} and has {len(unexpected)} keys of other ranks {unexpected[:5]}"
            )
        problems: list[Any] = [problem]
        if collective and self._pp > 1:
            problems = [None] * self._pp
            dist.all_gather_object(problems, problem, group=state.process_groups[GroupKind.PP])
        found = [p for p in problems if p is not None]
        if found:
            raise IncompatibleCheckpointFoundError(
                "a partial state dict (local_state_dict) does not match this layout: "
                + "; ".join(found)
                + ". It was saved with another pipeline_parallel_degree or partition: load it with the "
                "layout it was saved with, or " + _FULL_STATE_FIX
            )

    # ------------------------------------------------------------------------------------- hooks
    def register_post_partition_hook(self, hook: Callable[..., Any]) -> RemovableHandle | None:
        """``hook(model, optimizer)`` after partitioning, before the first forward; runs at once (and
        returns None) if the model is already partitioned and an optimizer exists."""
        if self._partitioned and state.optimizer is not None:
            hook(self, state.optimizer)
            return None
        handle = RemovableHandle(self._post_partition_hooks)
        self._post_partition_hooks[handle.id] = hook
        return handle

    def register_post_step_hook(self, hook: Callable[..., Any]) -> RemovableHandle | None:
        """``hook(model, optimizer)`` after the first step (at once if that has passed)."""
        if self._step_count > 0 and state.optimizer is not None:
            hook(self, state.optimizer)
            return None
        handle = RemovableHandle(self._post_step_hooks)
        self._post_step_hooks[handle.id] = hook
        return handle

    def cpu(self) -> DistributedModel:
        """smp's ``cpu()``: gather every stage's parameters and buffers and move the whole model to
        the CPU, so that ``get_module()`` is a complete copy on every rank (e.g. to save or export it).
        Collective over the pipeline group once partitioned. Stages keep running their own modules:
        the gathered copies of other stages' tensors are not trained further."""
        if self._partitioned and self._pp > 1:
            full = self.state_dict(cast_to_cpu=True)
            with torch.no_grad():
                tensors = itertools.chain(self.module.named_parameters(), self.module.named_buffers())
                for key, t in tensors:
                    if getattr(t, _PLACEHOLDER, False) and key in full:
                        t.data = full[key].to(dtype=t.dtype)  # still marked: its owner stays remote
        self.module.cpu()
        return self

    def _run_hooks(self, hooks: OrderedDict[int, Callable[..., Any]]) -> None:
        for hook in list(hooks.values()):
            hook(self, state.optimizer)

    # ------------------------------------------------------- smp's DDP-side API (mp.model_extras)
    def size(self) -> int:
        """Bytes of the wrapped module's parameters when it was wrapped, after tensor-parallel
        replacement (smp's ``size()``: "size of the full model in bytes")."""
        return self._size_bytes

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True
    ) -> contextlib.AbstractContextManager[None]:
        """Context manager for replicas with different numbers of batches (DDP's ``join``): a replica
        that leaves it early shadows the others' steps until all have left. Enter it on every rank."""
        if enable:
            refuse_under_sharding(self, "join")
        return join(self, divide_by_initial_world_size, enable)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """torch DDP's communication hook, run on each data-parallel gradient bucket instead of the
        all-reduce; it receives gradients summed over microbatches and must average them itself."""
        refuse_under_sharding(self, "register_comm_hook")
        register_comm_hook(self, state, hook)
