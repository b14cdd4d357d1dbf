"""`smp.DistributedModel`: partition on the first step, pipeline the step, average over replicas.

    model = smp.DistributedModel(MyModel())
    optimizer = smp.DistributedOptimizer(torch.optim.Adam(model.parameters()))

The first ``@smp.step`` call partitions the model (automatically with mp_partition, tracing the step
function on its first microbatch on rank 0, or by the ``smp.partition`` marks), shares the decision
with every rank, and frees on each rank the parameters that other pipeline stages own (they stay as
shape-only placeholders, so the optimizer and ``named_parameters`` keep working). Each step then runs
through mp_pipeline's module servers; after it, gradients are averaged over each partition's
data-parallel group.

The model holds plain collaborators, each made in ``__init__`` with explicit arguments: partitioning
and the placement (mp.model_partition.Partitioner), the data-parallel side (mp.model_dp.ReplicaSync:
replica sync, gradient reduction), the take-back of a failed step (mp.model_retry.StepRetry) and the
state dicts (mp.model_state.ModelStateDicts). :meth:`DistributedModel.run_step` calls them in the
order a step runs; smp's methods of the model delegate to them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from mp.activation_checkpointing import checkpoint_attentions
from mp.delayed_init import check as check_delayed_init
from mp.delayed_init import prepare as prepare_delayed_init
from mp.errors import (
    BwdExecutionNotInStepFnError,
    FwdExecutionNotInStepFnError,
    ModelNotPartitionedError,
    MultipleDistributedModelError,
    SMPValidationError,
)
from mp.hf_cache import KvCacheSwitch
from mp.init import pipeline_transport
from mp.memory_report import install_memory_trace
from mp.model_dp import ReplicaSync
from mp.model_extras import check_constructor_args, join, register_comm_hook
from mp.model_partition import Partitioner
from mp.model_retry import StepRetry, fast_mode_check
from mp.model_state import ModelStateDicts
from mp.offload import install_offloading
from mp.optimizer import keep_local_parameters
from mp.precision import half_dtype
from mp.sharded import refuse_under_sharding, shard_model
from mp.state import state
from mp.step_retry import ShortcutRetry
from mp.tensor_api import replace_tp_modules
from mp_comm import GroupKind
from mp_memory import cast_floats
from mp_partition import PartitionPlan, Placement
from mp_pipeline import (
    PipelineRuntime,
    Scheduler,
    TaskContext,
    Timeline,
    capture,
    current,
    flatten,
    pipelined_backward,
    task_context,
)
from mp_tensor import DistributedModule, is_distributed_parameter, is_scaled_batch_parameter

if TYPE_CHECKING:
    from mp_memory import ActivationTracker, ShardedDataParallel

__all__ = ["DistributedModel"]

log = logging.getLogger(__name__)

_MODEL_IDS = itertools.count(1)


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


class DistributedModel(nn.Module):
    """The smp model wrapper (docs/api.md); ``module`` is the user's model."""

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
        dp_size = topo.size(GroupKind.DP)
        self._in_step = False
        self._grad_scale = 1.0
        self._backward_calls = 0
        self._step_count = 0
        self._post_partition_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._post_step_hooks: OrderedDict[int, Callable[..., Any]] = OrderedDict()
        self._model_id = next(_MODEL_IDS)
        self._runtime: PipelineRuntime | None = None
        self._size_bytes = sum(p.numel() * p.element_size() for p in self.module.parameters())
        self._microbatches = 1
        self._fast_mode = cfg.fast_mode is True
        # fast_mode unset (mp's default, unless static_mode is set): fast mode's shortcut, and a step
        # whose flow changed is taken back and run again on the full path (mp.model_retry)
        auto = cfg.fast_mode is None and not cfg.static_mode
        # sharded_data_parallel_degree > 1: FSDP2 shards the model now and reduces its gradients itself
        self._sharded = shard_model(self.module, placement=lambda: self.placement)
        if self._pp > 1:
            transport = pipeline_transport(world)
            # static_mode: record the first steps' messages, then send them compact (mp_pipeline.static);
            # fast_mode: the same, plus the child-to-child path (mp_pipeline.remote, mp_pipeline.fast); a
            # flow that changes after the recording raises NotSupportedByFastModeError.
            self._runtime = PipelineRuntime(
                transport=transport,
                rank=world.rank,
                peers=self._pp_peers,
                model_id=self._model_id,
                static=cfg.static_mode or cfg.fast_mode is True or auto,
                strict=cfg.fast_mode is True or auto,
                retry=auto,
                # TP modules issue collectives in the TP group: its servers run one order of events
                tp_group=tuple(topo.group(GroupKind.TP, world.rank)) if cfg.tp > 1 else (),
                split_backward=cfg.pipeline == "zero_bubble",
            )
        self._partitioner = Partitioner(
            module=self.module,
            # unpartitioned until the first step replaces it (mp.model_partition)
            placement=Placement(
                pp_size=self._pp,
                pp_rank=self._pp_rank,
                pp_group=state.process_groups.get(GroupKind.PP),
                enter=self._enter_collective,
            ),
            runtime=self._runtime,
            rank=self._rank,
            trace_times=trace_execution_times and trace_device == "gpu",  # smp: no timing on a CPU trace
        )
        self._replicas = ReplicaSync(
            module=self.module,
            placement=lambda: self._partitioner.placement,
            runtime=self._runtime,
            sharded=self._sharded,
            rank=self._rank,
            dp_size=dp_size,
            backward_passes_per_step=backward_passes_per_step,
            bucket_bytes=max(1, int(bucket_cap_mb * (1 << 20))),
            broadcast_buffers=broadcast_buffers,
            # tp == 1: each gradient bucket's all-reduce starts once the step's last accumulation into
            # its parameters is done (on a pipeline stage: while other stages still run their backward)
            overlap=overlapping_allreduce and cfg.tp == 1 and dp_size > 1,
            average_microbatches=average_grads_across_microbatches,
        )
        self._step_retry = StepRetry(
            runtime=self._runtime,
            retry=ShortcutRetry() if auto and self._pp > 1 else None,
            replicas=self._replicas,
            rank=self._rank,
        )
        self._state_dicts = ModelStateDicts(
            module=self.module,
            partitioner=self._partitioner,
            sharded=self._sharded,
            after_partition=self.after_partition,
        )
        self._kv_cache = KvCacheSwitch(self.module, self._pp)  # HF's use_cache, off in pipelined training
        state.model = self
        if cfg.resolved_checkpoint_attentions:  # smp's key: each distributed layer's attention recomputed
            checkpoint_attentions(self.module, lambda: self.placement, self.after_partition)
        self._offloader = install_offloading(self)  # offload_activations (mp.offload)
        self._memory_trace = install_memory_trace(self, trace_memory_usage)  # mp.memory_report
        # a model built on the meta device: this rank's parameters materialized after partitioning
        prepare_delayed_init(self.module, lambda: self.placement, self.after_partition)

    # ------------------------------------------------------------------------------ the nn.Module side
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._runtime is not None and not self._partitioner.tracing and not self._in_step:
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
        if self._partitioner.tracing:
            timer = self._partitioner.timer
            if timer is not None:  # the timed step runs a real backward
                timer.backward(tensors, grad_tensors)
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
        return self._partitioner.placement.partitioned

    @property
    def placement(self) -> Placement:
        """Where the model lives: the pp degree and rank, the module -> pp_rank assignment (empty and
        ``partitioned=False`` until the first step), which tensors this rank holds, the collective entry
        (mp_partition.Placement). State dicts, optimizer state, checkpoints and the memory features take
        it instead of asking the model."""
        return self._partitioner.placement

    @property
    def plan(self) -> PartitionPlan | None:
        """The partition plan (on global rank 0, where it is computed; None elsewhere and with pp=1)."""
        return self._partitioner.plan

    @property
    def in_step(self) -> bool:
        """Whether a step function is running now."""
        return self._in_step

    @property
    def step_count(self) -> int:
        """The number of steps completed."""
        return self._step_count

    @property
    def runtime(self) -> PipelineRuntime | None:
        """The pipeline runtime (mp_pipeline) installed under pp > 1, else None."""
        return self._runtime

    @property
    def kv_cache(self) -> KvCacheSwitch:
        """HF's ``use_cache``, off in the model's pipelined training steps (mp.hf_cache)."""
        return self._kv_cache

    @property
    def replicas(self) -> ReplicaSync:
        """The data-parallel side (mp.model_dp): replica sync and gradient reduction."""
        return self._replicas

    @property
    def sharding(self) -> ShardedDataParallel | None:
        """The model's sharded data parallelism (mp_memory, under sharded_data_parallel_degree > 1)."""
        return self._sharded

    @property
    def memory_trace(self) -> ActivationTracker | None:
        """The activation tracker of ``trace_memory_usage`` (mp.memory_report), else None."""
        return self._memory_trace

    def get_module(self) -> nn.Module:
        """The user's model inside the wrapper."""
        return self.module

    # ------------------------------------------------------------------------------------------- step
    def run_step(
        self, func: Callable[..., Any], inputs: list[tuple[tuple[Any, ...], dict[str, Any]]]
    ) -> list[Any]:
        """Run one step: ``func`` once per microbatch with ``inputs[mb]`` (args, kwargs), pipelined;
        the per-microbatch results. What ``@smp.step`` calls (mp.step); call the step function instead.

        The order: partition (first step), sync the replicas, snapshot for a take-back, the attempt,
        the take-back and second attempt on the full path if the first failed under fast mode's plan,
        then the replicas' agreement and gradient reduction."""
        state.require()

        def body(mb: int) -> Any:
            args, kwargs = inputs[mb]
            return func(*args, **kwargs)

        exec_state = capture()
        if not self.partitioned:
            _, first = flatten(inputs[0]) if inputs else (None, [])
            problem = _placement_error(
                {p.device.type for p in self.module.parameters() if not p.is_meta},
                {t.device.type for t in first},
            )
            if problem is not None:
                raise SMPValidationError(problem)
            self._partitioner.partition(body)
            optimizer = state.optimizer
            if optimizer is not None:
                keep_local_parameters(optimizer, self.placement)
            self._run_hooks(self._post_partition_hooks)
        number = self._step_count + 1
        self._replicas.sync(first=number == 1)
        # model.join(): seed_scale also counts the replicas still running (mp.model_extras)
        self._grad_scale = self._replicas.seed_scale(len(inputs))
        self._microbatches = len(inputs)
        # mp's default pipeline: a step that fails under fast mode's plan runs again (mp.model_retry)
        snapshot = self._step_retry.before_attempt(inputs)
        results, error, did_backward = self._attempt(func, body, inputs, exec_state)
        again, error = self._step_retry.after_attempt(snapshot, error, number)
        if again is not None:
            results, error, did_backward = self._attempt(func, body, inputs, exec_state)
            if error is not None:
                error.add_note(f"(raised on the full path, where the step ran again after: {again!r})")
        self._replicas.after_step(error, did_backward, number)
        self._step_count += 1
        if self._step_count == 1:
            self._run_hooks(self._post_step_hooks)
        return results

    def _attempt(
        self,
        func: Callable[..., Any],
        body: Callable[[int], Any],
        inputs: list[tuple[tuple[Any, ...], dict[str, Any]]],
        exec_state: Any,
    ) -> tuple[list[Any], BaseException | None, bool]:
        """Run the step's microbatches once: (results, the error or None, whether a backward ran)."""
        cfg, _, _ = state.require()
        self._replicas.arm(self._step_count + 1)
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
            error = fast_mode_check(self._runtime, error)
        did_backward = self._backward_calls > calls_before or (
            self._runtime is not None and self._runtime.remote.backward_requests > remote_before
        )
        return results, error, did_backward

    def _enter_collective(self, what: str) -> None:
        """Before a collective over the pipeline between steps: a clear error, not a hang, when a rank
        of the pipeline does not come (PipelineRuntime.enter); nothing to check without a pipeline."""
        if self._runtime is not None:
            self._runtime.enter(what)

    # -------------------------------------------------------------------------- partition (smp's API)
    def display_partition(self) -> None:
        """Print which pp_rank holds which modules: the partition report on the rank that computed the
        partition, the assignment (module path: pp_rank) on the others."""
        self._require_partitioned("display_partition")
        self._partitioner.display()

    def note_timeline(self, timeline: Timeline) -> None:
        """Adds each stage's measured seconds per microbatch (from a merged pipeline timeline) to the
        plan, beside the predicted ones (smp.timeline.stop calls it on the rank holding the plan)."""
        self._partitioner.note_timeline(timeline)

    def _local_params(self) -> list[nn.Parameter]:
        return self.placement.local_parameters(self.module)

    def _is_remote(self, t: torch.Tensor) -> bool:
        return not self.placement.is_local(t)

    def _require_partitioned(self, what: str) -> None:
        if not self.partitioned:
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
        return self.placement.local_named_modules(self.module)

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

    # ------------------------------------------------------------------------------------- hooks
    def register_post_partition_hook(self, hook: Callable[..., Any]) -> RemovableHandle | None:
        """``hook(model, optimizer)`` after partitioning, before the first forward; runs at once (and
        returns None) if the model is already partitioned and an optimizer exists."""
        if self.partitioned and state.optimizer is not None:
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
        if self.partitioned and self._pp > 1:
            full = self.state_dict(cast_to_cpu=True)
            with torch.no_grad():
                tensors = itertools.chain(self.module.named_parameters(), self.module.named_buffers())
                for key, t in tensors:
                    if not self.placement.is_local(t) and key in full:
                        t.data = full[key].to(dtype=t.dtype)  # still marked: its owner stays remote
        self.module.cpu()
        return self

    def _run_hooks(self, hooks: OrderedDict[int, Callable[..., Any]]) -> None:
        for hook in list(hooks.values()):
            hook(self, state.optimizer)

    def after_partition(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the model is partitioned (a post-partition hook): what the collaborators that
        need the partition get as ``after_partition`` (docs/architecture.md)."""
        self.register_post_partition_hook(lambda _model, _optimizer: fn())

    # ------------------------------------------------------------------ state dicts (mp.model_state)
    def local_state_dict(self, *args: Any, cast_to_cpu: bool = True, **kwargs: Any) -> dict[str, Any]:
        """This rank's part of the model's state (its stage, its TP shards), with a partial header
        (``mp_memory.checkpoint.schema``): the partition (pp > 1) and, with TP shards, their layout."""
        return self._state_dicts.local_state_dict(cast_to_cpu=cast_to_cpu)

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
        return self._state_dicts.state_dict(destination, prefix, keep_vars, cast_to_cpu)

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
        return self._state_dicts.load_state_dict(state_dict, strict, translate_function, same_partition_load)

    def pin_partition(self, saved: Any) -> None:
        """Before the first step: partition this model as ``saved`` (a partial state's module path ->
        pp_rank) instead of computing a partition, after checking that it fits this model."""
        self._state_dicts.pin_partition(saved)

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
            refuse_under_sharding(self._sharded, "join")
        return join(self, self._replicas, self._shadow_step, divide_by_initial_world_size, enable)

    def _shadow_step(self) -> None:
        """What a joined replica does for each step the others run: their data-parallel collectives,
        with zero gradients; it counts as a step."""
        for p in self._local_params():
            p.grad = None
        self._replicas.after_step(None, did_backward=False, step=self._step_count + 1)
        self._step_count += 1

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """torch DDP's communication hook, run on each data-parallel gradient bucket instead of the
        all-reduce; it receives gradients summed over microbatches and must average them itself."""
        refuse_under_sharding(self._sharded, "register_comm_hook")
        register_comm_hook(self._replicas, state, hook)
