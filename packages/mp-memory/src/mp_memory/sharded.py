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

Half precision (``param_dtype``): the sharded parameters are kept in fp32 and are their own master
weights; FSDP2's ``MixedPrecisionPolicy`` all-gathers them in the half dtype for forward and backward and
reduce-scatters the gradients in fp32. The small (persistent) parameters stay in the half dtype, as the
rest of the model, and get fp32 masters from the fp16/bf16 optimizer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from mp_memory.errors import MemorySaverError

__all__ = [
    "ShardedDataParallel",
    "ShardingConfig",
    "ShardingError",
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
    param_dtype: torch.dtype | None = None
    """fp16/bf16: the dtype forward and backward compute in (the sharded fp32 parameters are cast to it
    when gathered; gradients are reduced in fp32). None: the parameters' own dtype."""


def block_modules(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``, outermost first, in module order (never the root).

    A Hugging Face model names its block classes in ``_no_split_modules``; other models' blocks are
    the children of their ``nn.ModuleList``s (also when none of the named classes is found). Blocks
    nested in another block are not listed."""
    names = set(getattr(model, "_no_split_modules", None) or ())
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


def _unique_params(modules: Iterable[nn.Module]) -> Iterator[nn.Parameter]:
    seen: set[int] = set()
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p


class ShardedDataParallel:
    """``module`` wrapped in place by ``fully_shard`` over ``group`` (the data-parallel group, which
    must be the whole world: sharding composes with neither pipeline nor tensor parallelism here).

    Every rank must pass the same model; rank 0's parameters and buffers are broadcast first, so that
    every replica starts equal (as smp's data parallelism does)."""

    def __init__(self, module: nn.Module, config: ShardingConfig, group: dist.ProcessGroup) -> None:
        size = dist.get_world_size(group)
        if config.degree * config.replicas != size or size != dist.get_world_size():
            raise ShardingError(
                f"sharded data parallelism over {config.replicas} x {config.degree} ranks needs a data-"
                f"parallel group of that size spanning the world; got {size} of {dist.get_world_size()} "
                "ranks. Fix: use pipeline_parallel_degree 1 and tensor_parallel_degree 1"
            )
        self.config = config
        self.group = group
        self.module = module
        self._source = dist.get_global_rank(group, 0)
        self._broadcast([b for b in module.buffers() if not b.is_meta])
        if config.replicas > 1:
            self.mesh: DeviceMesh = init_device_mesh(
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
        units = [b for b in block_modules(module) if any(p not in ignored for p in b.parameters())]
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
        self._set_prefetch()
        log.info(
            "sharded data parallelism: %d blocks + root over a %s mesh; %d small parameters kept whole",
            len(self.blocks),
            "x".join(str(s) for s in self.mesh.shape),
            len(self.persistent),
        )

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
            live += materialize(self.module, lambda p, ids=ids: id(p) in ids, device)  # type: ignore[misc]
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

    def reduce_persistent_grads(self) -> None:
        """Average the gradients of the unsharded (small) parameters over the data-parallel group, in
        one flat all-reduce. A gradient missing on some ranks counts as zero there."""
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
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g).to(dtype=g.dtype, copy=True)
            offset += g.numel()

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's state under its own key names, full tensors, on every rank (collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        half = self.config.param_dtype  # the model's dtype, as without sharding (the masters: optimizer)
        return {
            k: (v.detach().cpu().to(half) if half is not None and v.is_floating_point() else v.detach().cpu())
            if isinstance(v, torch.Tensor)
            else v
            for k, v in sd.items()
        }

    def load_full_state_dict(self, sd: dict[str, Any], strict: bool = True) -> Any:
        """Load a full state (each rank keeps its shards)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        return set_model_state_dict(
            self.module, sd, options=StateDictOptions(full_state_dict=True, strict=strict)
        )

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shards (plain tensors) and the whole small parameters and buffers."""
        return {k: _local(v).detach().cpu().clone() for k, v in self.module.state_dict().items()}

    def load_local_state_dict(self, sd: dict[str, Any]) -> None:
        """Copy this rank's saved shards into the model (saved under the same layout)."""
        live = self.module.state_dict()
        missing, unexpected = sorted(set(live) - set(sd)), sorted(set(sd) - set(live))
        if missing or unexpected:
            raise ShardingError(
                f"the sharded state does not match this model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}. Fix: load it into the model it was saved from"
            )
        with torch.no_grad():
            for k, v in live.items():
                target = _local(v)
                if tuple(target.shape) != tuple(sd[k].shape):
                    raise ShardingError(
                        f"{k}: saved shard of shape {tuple(sd[k].shape)}, this rank holds "
                        f"{tuple(target.shape)}. Fix: load it with the sharded_data_parallel_degree it "
                        "was saved with, or save a full checkpoint"
                    )
                target.copy_(sd[k])

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter names, full tensors, on every rank (collective)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(
            self.module, optimizer, options=StateDictOptions(full_state_dict=True)
        )

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.module, optimizer, sd, options=StateDictOptions(full_state_dict=True))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_part(value: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of ``value``, a full tensor of ``like``'s global shape, as ``like`` holds it
    (no communication: every rank holds the full value)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if tuple(value.shape) != tuple(like.shape):
        raise ShardingError(
            f"a full tensor of shape {tuple(value.shape)} for a sharded parameter of shape "
            f"{tuple(like.shape)}. Fix: load a state saved from the same model"
        )
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    return value[index]


def as_like(value: torch.Tensor, like: torch.Tensor, *, full: bool) -> torch.Tensor:
    """``value`` (a full tensor when ``full``, else this rank's shard) in ``like``'s form: a DTensor
    sharded as ``like`` when it is one, on its device."""
    if not isinstance(like, DTensor) or value.dim() == 0:
        return value.to(like.device)
    local = local_part(value, like) if full else value
    return DTensor.from_local(
        local.to(like.device), like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's optimizer state dict with every DTensor replaced by this rank's shard."""
    sd = torch.optim.Optimizer.state_dict(optimizer)
    state = {
        i: {k: _local(v).detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Load what :func:`local_optimizer_state` saved: shards become DTensors like their parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, Any] = {}
    for i, s in sd["state"].items():
        p = params[int(i)]
        entry: dict[str, Any] = {}
        for k, v in s.items():
            entry[k] = v
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0:
                entry[k] = DTensor.from_local(
                    v.to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
        state[i] = entry
    torch.optim.Optimizer.load_state_dict(optimizer, {"state": state, "param_groups": sd["param_groups"]})


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients so that the global L2 norm over every shard is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does on the unsharded model; returns that norm (float64).
    Collective over the mesh of the DTensor gradients: call it on every rank."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    square = torch.zeros((), dtype=torch.float64)
    if sharded:
        norm = torch.nn.utils.get_total_norm(sharded, 2.0)
        assert isinstance(norm, DTensor)
        square += norm.full_tensor().double().cpu() ** 2
    if plain:
        square += torch.nn.utils.get_total_norm(plain, 2.0).double().cpu() ** 2
    total = square.sqrt()
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0 and math.isfinite(coef):
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
    return total


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (shards counted locally)."""
    params = list(_unique_params([module]))
    out = {
        "params": sum(_local(p).numel() * p.element_size() for p in params),
        "grads": sum(_local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        for s in optimizer.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor):
                    out["optimizer"] += _local(v).numel() * v.element_size()
    return out
