"""Sharded data parallelism (smp's ``sharded_data_parallel_degree``) on FSDP2 (``fully_shard``).

Parameters, gradients and optimizer state are split over groups of ``degree`` data-parallel ranks
(ZeRO-3). With more data-parallel ranks than ``degree`` the groups are replicas of each other: a 2-D
DeviceMesh ``(replicate, shard)``, FSDP2's hybrid sharding (HSDP). The model is wrapped as FSDP2's users
wrap it: each transformer block (Hugging Face's ``_no_split_modules``, else the children of every
``nn.ModuleList``) is one unit, the root holds the rest.

smp's sdp_* keys map onto FSDP2 as follows:

- ``sdp_param_persistence_threshold``: parameters with fewer elements stay whole on every rank
  (FSDP2's ``ignored_params``); their gradients are averaged over the data-parallel group here.
- ``sdp_max_live_parameters``: how many blocks are all-gathered ahead (FSDP2's explicit forward and
  backward prefetch), so that the root's parameters plus the blocks gathered at once stay within it.
- ``sdp_gradient_clipping``: clip by the global L2 norm over all shards (DTensor gradients), 0 = off.

Tensor parallelism (``TensorParallel``): each TP rank shards its own TP shards (and its copy of the
other parameters) over the ranks holding the same ones, a ``(tp, shard)`` mesh, or ``(tp, replicate,
shard)`` with replicas; gradients are then finished as without sharding (TP-group sums for the
parameters that saw only this rank's batch), the clipping norm counts each TP shard once, the full state
is gathered by the caller's ``gather_tp_state`` from whole parameters (:meth:`ShardedDataParallel.gathered`)
and loaded through its ``local_tp_state``; under delayed initialization ``TensorParallel.draw`` draws
each TP shard. Half precision composes with it as below.

Half precision (``param_dtype``): the sharded parameters are kept in fp32 and are their own master
weights; FSDP2's ``MixedPrecisionPolicy`` all-gathers them in the half dtype for forward and backward and
reduce-scatters the gradients in fp32. The small (persistent) parameters stay in the half dtype, as the
rest of the model, and get fp32 masters from the fp16/bf16 optimizer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from mp_memory.errors import MemorySaverError
from mp_memory.sharded_clip import clip_grad_norm
from mp_memory.sharded_dicts import ShardedStateDicts
from mp_memory.sharded_state import (
    _local,
    _unique_params,
    as_like,
    load_local_optimizer_state,
    local_optimizer_state,
    local_part,
    state_bytes,
)

__all__ = [
    "ShardedDataParallel",
    "ShardingConfig",
    "ShardingError",
    "TensorParallel",
    "as_like",
    "block_modules",
    "clip_grad_norm",
    "load_local_optimizer_state",
    "local_optimizer_state",
    "local_part",
    "state_bytes",
]

log = logging.getLogger(__name__)


class ShardingError(MemorySaverError):
    """A sharded-data-parallel setting that cannot be applied to this model or world."""


@dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """How to shard: smp's config keys, resolved."""

    degree: int
    """Ranks that split each parameter (``sharded_data_parallel_degree``)."""
    replicas: int = 1
    """Groups of ``degree`` ranks that hold the same shards (data-parallel size / degree)."""
    persistence_threshold: int = 1_000_000
    """Parameters with fewer elements stay whole on every rank."""
    max_live_parameters: int | None = None
    """Parameters gathered at once (root + blocks); None keeps FSDP2's one-block prefetch."""
    device_type: str = "cpu"
    block_classes: tuple[str, ...] = ()
    """More block class names (beside a Hugging Face model's ``_no_split_modules``)."""
    scaled_batch_divisor: int = 1
    """Tensor parallelism: the extra divisor of a "scaled batch" parameter's gradient (one that already
    saw the whole TP group's batch: the TP degree, or 1 under ``prescaled_batch``)."""
    param_dtype: torch.dtype | None = None
    """fp16/bf16: the dtype forward and backward compute in (the sharded fp32 parameters are cast to it
    when gathered; gradients are reduced in fp32). None: the parameters' own dtype."""


def block_modules(model: nn.Module, block_classes: Iterable[str] = ()) -> list[nn.Module]:
    """The repeated blocks of ``model``, outermost first, in module order (never the root).

    A Hugging Face model names its block classes in ``_no_split_modules`` (``block_classes`` adds
    more); other models' blocks are the children of their ``nn.ModuleList``s (also when none of the
    named classes is found). Blocks nested in another block are not listed."""
    names = set(getattr(model, "_no_split_modules", None) or ()) | set(block_classes)
    found: list[nn.Module] = []

    def is_block(path: str, module: nn.Module) -> bool:
        if not path:
            return False
        if names:
            return type(module).__name__ in names
        parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
        return isinstance(parent, nn.ModuleList)

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if is_block(path, child):
                found.append(child)
            else:
                visit(path, child)

    visit("", model)
    if not found and names:  # the named classes are not in this model (a composite one): ModuleLists
        names = set()
        visit("", model)
    return found


@dataclass(frozen=True)
class TensorParallel:
    """The tensor parallelism the sharded model runs inside (each TP rank shards its own TP shards)."""

    group: dist.ProcessGroup
    split: Callable[[torch.Tensor], bool]
    """Whether a parameter is one TP shard of a larger one (its gradient norm sums over the TP group)."""
    scaled_batch: Callable[[torch.Tensor], bool]
    """Whether a parameter's gradient already covers the TP group's whole batch."""
    ranks: tuple[tuple[int, ...], ...]
    """The world's global ranks by (tp_rank, index in the sharding group)."""
    draw: Callable[[nn.Parameter], Callable[[], torch.Tensor] | None] | None = None
    """Delayed initialization: what draws a TP shard's own initial value (``materialize``'s ``own``)."""


class ShardedDataParallel(ShardedStateDicts):
    """``module`` wrapped in place by ``fully_shard`` over ``group``: the data-parallel group, or under
    tensor parallelism (``tp``) the reduced data-parallel group (the ranks holding the same TP shards);
    together with the TP group it must span the world (no pipeline parallelism).

    Every rank must pass the same model; rank 0's parameters and buffers are broadcast first, so that
    every replica starts equal (as smp's data parallelism does)."""

    def __init__(
        self,
        module: nn.Module,
        config: ShardingConfig,
        group: dist.ProcessGroup,
        tp: TensorParallel | None = None,
    ) -> None:
        size = dist.get_world_size(group)
        tp_size = dist.get_world_size(tp.group) if tp is not None else 1
        if config.degree * config.replicas != size or size * tp_size != dist.get_world_size():
            raise ShardingError(
                f"sharded data parallelism over {config.replicas} x {config.degree} ranks needs a data-"
                f"parallel group of that size spanning the world with the TP group; got {size} x {tp_size} "
                f"of {dist.get_world_size()} ranks. Fix: use pipeline_parallel_degree 1"
            )
        self.config = config
        self.group = group
        self.tp = tp
        self.module = module
        self.gather_tp_state: Callable[[], dict[str, Any]] | None = None
        self.local_tp_state: Callable[[dict[str, Any]], dict[str, torch.Tensor]] | None = None
        """Under tensor parallelism, set by the caller: a full state (original names) turned into this TP
        rank's values under the module's own names, each whole over the sharding group."""
        self._source = dist.get_global_rank(group, 0)
        self._broadcast([b for b in module.buffers() if not b.is_meta])
        # attributes set on parameters (a TP shard's layout) survive fully_shard's new parameter objects
        self._attrs = {n: dict(vars(p)) for n, p in module.named_parameters() if vars(p)}
        if tp is not None:  # a (tp, replicate, shard) mesh over the world, as init_device_mesh makes them
            ranks = torch.tensor(tp.ranks).reshape(tp_size, config.replicas, config.degree)
            full = DeviceMesh(config.device_type, ranks, mesh_dim_names=("tp", "replicate", "shard"))
            self.mesh: DeviceMesh = full["replicate", "shard"] if config.replicas > 1 else full["shard"]
        elif config.replicas > 1:
            self.mesh = init_device_mesh(
                config.device_type, (config.replicas, config.degree), mesh_dim_names=("replicate", "shard")
            )
        else:
            self.mesh = init_device_mesh(config.device_type, (config.degree,), mesh_dim_names=("shard",))
        self.persistent: list[nn.Parameter] = [
            p for p in _unique_params([module]) if p.numel() < config.persistence_threshold
        ]
        ignored = set(self.persistent)
        self._policy = MixedPrecisionPolicy()
        if config.param_dtype is not None:  # the sharded parameters are the fp32 masters (module docstring)
            self._policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=torch.float32)
        units = [
            b
            for b in block_modules(module, config.block_classes)
            if any(p not in ignored for p in b.parameters())
        ]
        self.blocks: list[FSDPModule] = []
        self.peak_unsharded = 0
        """Delayed initialization: the most parameter elements materialized whole at once."""
        if any(p.is_meta for p in module.parameters()):
            self._materialize_and_shard(units)
        else:
            self._set_dtypes(list(_unique_params([module])))
            self._broadcast(list(_unique_params([module])))
            self.blocks = [self._shard(b) for b in units]
        self.root: FSDPModule = self._shard(module)
        self._restore_attrs()
        self._set_prefetch()
        log.info(
            "sharded data parallelism: %d blocks + root over a %s mesh; %d small parameters kept whole",
            len(self.blocks),
            "x".join(str(s) for s in self.mesh.shape),
            len(self.persistent),
        )

    def _restore_attrs(self) -> None:
        """Give the module's current parameter objects (shards, or whole while gathered) the attributes
        their originals had."""
        for name, p in self.module.named_parameters():
            for k, v in self._attrs.get(name, {}).items():
                if not hasattr(p, k):
                    setattr(p, k, v)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """The module holds whole (plain) parameters meanwhile, with their attributes, so that code
        written for the unsharded module (a TP module's gathered state dict) reads them; collective over
        the sharding group. FSDP2 is not told: its units stay resharded (as after every step), so its
        state-dict hooks leave these parameters in place."""
        whole: dict[int, nn.Parameter] = {}
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        for module in self.module.modules():
            for name, p in list(module._parameters.items()):
                if isinstance(p, DTensor):
                    if id(p) not in whole:
                        full = nn.Parameter(p.full_tensor().detach(), requires_grad=p.requires_grad)
                        full.__dict__.update(vars(p))
                        whole[id(p)] = full
                    module._parameters[name] = whole[id(p)]
                    swapped.append((module, name, p))
        try:
            yield
        finally:
            for module, name, p in swapped:
                module._parameters[name] = p

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values on every rank (every replica starts equal, as under smp's data parallelism)."""
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t.data, src=self._source, group=self.group)

    def _set_dtypes(self, params: list[nn.Parameter]) -> None:
        """Half precision: the parameters to shard back to fp32 (exact: they were cast from it)."""
        if self.config.param_dtype is None:
            return
        whole = set(self.persistent)
        with torch.no_grad():
            for p in params:
                if p not in whole and p.is_floating_point():
                    p.data = p.data.float()

    def _shard(self, module: nn.Module) -> FSDPModule:
        return fully_shard(
            module, mesh=self.mesh, ignored_params=set(self.persistent), mp_policy=self._policy
        )

    def _materialize_and_shard(self, units: list[nn.Module]) -> None:
        """A model on the meta device (delayed initialization): its parameters are materialized in module
        order, each unit sharded as soon as its last parameter is initialized, so at most the root's
        parameters and one block exist whole at once. Each module's own init runs as in eager
        construction (``mp_memory.delayed_init.materialize``), in fp32 then rounded to the half dtype
        like a model built eagerly and cast, so the values equal eager initialization under the same
        seed wherever the model draws its random numbers in module order (see docs/memory.md)."""
        from mp_memory.delayed_init import materialize

        real = [t for t in [*self.module.parameters(), *self.module.buffers()] if not t.is_meta]
        device = real[0].device if real else torch.device(self.config.device_type)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        half = self.config.param_dtype
        whole = set(self.persistent)
        with torch.no_grad():
            for p in _unique_params([self.module]):
                if p.is_meta and p.is_floating_point():
                    p.data = p.data.float()
        owner: dict[int, int] = {}  # parameter id -> index of the unit holding it
        for i, unit in enumerate(units):
            for p in unit.parameters():
                owner.setdefault(id(p), i)
        runs: list[tuple[int, list[nn.Parameter]]] = []  # (unit index or -1 for the root, parameters)
        for p in _unique_params(m for m in self.module.modules()):
            u = owner.get(id(p), -1)
            if not runs or runs[-1][0] != u:
                runs.append((u, []))
            runs[-1][1].append(p)
        last_run = {u: k for k, (u, _) in enumerate(runs)}
        live = 0
        for k, (u, params) in enumerate(runs):
            ids = {id(p) for p in params}
            own = self.tp.draw if self.tp is not None else None
            live += materialize(self.module, lambda p, ids=ids: id(p) in ids, device, own)  # type: ignore[misc]
            self.peak_unsharded = max(self.peak_unsharded, live)
            with torch.no_grad():
                for p in params:
                    if half is not None and p.is_floating_point():  # as built in fp32, cast to half
                        p.data = p.data.to(half) if p in whole else p.data.to(half).float()
            self._broadcast(list(params))
            if u >= 0 and last_run[u] == k:
                self.blocks.append(self._shard(units[u]))
                live -= sum(p.numel() for p in units[u].parameters() if p not in whole)
        log.info(
            "delayed initialization under sharding: %d parameter elements at most whole at once",
            self.peak_unsharded,
        )

    def _set_prefetch(self) -> None:
        """``max_live_parameters``: prefetch as many blocks ahead as fit beside the root's parameters
        and the block running (FSDP2 always prefetches at least one block in backward)."""
        budget = self.config.max_live_parameters
        if budget is None or not self.blocks:
            return
        in_blocks = {id(p) for b in self.blocks for p in b.parameters()}  # type: ignore[attr-defined]
        root = sum(p.numel() for p in self.module.parameters() if id(p) not in in_blocks)
        block = max(sum(p.numel() for p in b.parameters()) for b in self.blocks)  # type: ignore[attr-defined]
        ahead = (budget - root) // block - 1
        if ahead < 1:
            need = root + 2 * block
            raise ShardingError(
                f"sdp_max_live_parameters={budget} is below what FSDP2 gathers at once on this model: the "
                f"root's {root} parameters plus two blocks of up to {block} (the running one and the one "
                f"prefetched). Expected at least {need}. Fix: raise 'sdp_max_live_parameters' to {need} or "
                "more, or remove it (FSDP2's default prefetch of one block)"
            )
        n = len(self.blocks)
        for i, b in enumerate(self.blocks):
            b.set_modules_to_forward_prefetch(self.blocks[i + 1 : i + 1 + ahead])
            b.set_modules_to_backward_prefetch(self.blocks[max(0, i - ahead) : i][::-1])
        log.info("sdp_max_live_parameters=%d: %d of %d blocks prefetched ahead", budget, min(ahead, n), n)

    @property
    def prefetch_depth(self) -> int:
        """Blocks all-gathered ahead in forward by explicit prefetch (0: FSDP2's default)."""
        if not self.blocks:
            return 0
        return len(self.blocks[0]._get_fsdp_state()._states_to_forward_prefetch)

    @property
    def shard_group(self) -> dist.ProcessGroup:
        """The ranks that split each parameter (one replica of the sharding group)."""
        return self.mesh.get_group("shard")

    @property
    def shard_index(self) -> int:
        """This rank's index in ``shard_group`` (which shard it holds)."""
        return self.mesh.get_local_rank("shard")

    @property
    def replica_index(self) -> int:
        """Which replica of the shards this rank belongs to (0 without replicas)."""
        return self.mesh.get_local_rank("replicate") if self.config.replicas > 1 else 0

    def reduce_persistent_grads(self) -> None:
        """Average the gradients of the unsharded (small) parameters over the data-parallel group, in
        one flat all-reduce. A gradient missing on some ranks counts as zero there. Under tensor
        parallelism, also finish the sharded gradients (:meth:`_finish_tp_grads`)."""
        if self.tp is not None:
            self._finish_tp_grads()
        if not self.persistent:
            return
        have = torch.tensor([p.grad is not None for p in self.persistent], dtype=torch.int32)
        dist.all_reduce(have, op=dist.ReduceOp.MAX, group=self.group)
        params = [p for p, h in zip(self.persistent, have.tolist(), strict=True) if h]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])  # half gradients are summed in fp32
        dist.all_reduce(flat, group=self.group)
        flat.div_(dist.get_world_size(self.group))
        if self.tp is not None:  # as the sharded ones (_finish_tp_grads)
            scaled = torch.cat(
                [
                    torch.full((g.numel(),), self.tp.scaled_batch(p), dtype=torch.bool, device=flat.device)
                    for p, g in zip(params, grads, strict=True)
                ]
            )
            tp_sum = torch.where(scaled, torch.zeros_like(flat), flat)
            dist.all_reduce(tp_sum, group=self.tp.group)
            flat = torch.where(
                scaled, flat / self.config.scaled_batch_divisor, tp_sum / dist.get_world_size(self.tp.group)
            )
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g).to(dtype=g.dtype, copy=True)
            offset += g.numel()

    def _finish_tp_grads(self) -> None:
        """FSDP2 averaged each sharded gradient over the reduced data-parallel group. A gradient that
        covers only this rank's batch is summed over the TP group too and divided by the TP degree (the
        data-parallel average); a "scaled batch" one (it saw the TP group's whole batch) is divided by
        ``scaled_batch_divisor``."""
        assert self.tp is not None
        whole = set(self.persistent)
        tp_size = dist.get_world_size(self.tp.group)
        own = [
            p.grad
            for p in self.module.parameters()
            if p not in whole and p.grad is not None and not self.tp.scaled_batch(p)
        ]
        scaled = [
            p.grad
            for p in self.module.parameters()
            if p not in whole and p.grad is not None and self.tp.scaled_batch(p)
        ]
        with torch.no_grad():
            if own:
                local = [_local(g) for g in own]
                flat = torch.cat([t.reshape(-1) for t in local])
                dist.all_reduce(flat, group=self.tp.group)
                flat.div_(tp_size)
                offset = 0
                for t in local:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()
            if self.config.scaled_batch_divisor != 1:
                for g in scaled:
                    _local(g).div_(self.config.scaled_batch_divisor)
