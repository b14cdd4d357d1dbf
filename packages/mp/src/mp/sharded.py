"""``sharded_data_parallel_degree`` > 1: smp's sharded data parallelism, wired from ``mp_memory.sharded``
(FSDP2's ``fully_shard``).

``smp.DistributedModel`` shards the model at wrap time (``shard_model``); the optimizer must be made
afterwards on ``model.parameters()`` (smp's order). ``smp.DistributedOptimizer`` then clips gradients by
``sdp_gradient_clipping`` inside ``optimizer.step()`` (smp's behaviour under sharding), and its state
dicts go through torch.distributed.checkpoint: ``state_dict()`` is the full state keyed by parameter
names, ``local_state_dict()`` this rank's shards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mp.config_combinations import REFUSED_USES
from mp.errors import IncompatibleCheckpointFoundError, SMPValidationError
from mp.optimizer_chain import ModelView, OptimizerPart, chain_of
from mp.state import state
from mp_comm import GroupKind
from mp_memory import (
    HALF_DTYPES,
    Bit16Optimizer,
    Header,
    SDPLayout,
    ShardedDataParallel,
    ShardingConfig,
    ShardingError,
    TensorParallel,
    as_like,
    clip_grad_norm,
    load_local_optimizer_state,
    local_optimizer_state,
    read_header,
    write_header,
)
from mp_partition import Placement

__all__ = [
    "ShardedPart",
    "check_layout",
    "clip_sharded",
    "layout_of",
    "partial_file_names",
    "refuse_under_sharding",
    "shard_model",
    "sharding_of",
]


def sharding_of(model: object) -> ShardedDataParallel | None:
    """The sharding of a DistributedModel under sharded data parallelism (else None; None for an object
    that is not a DistributedModel, e.g. a model passed to ``smp.save_checkpoint``)."""
    found = getattr(model, "sharding", None)
    return found if isinstance(found, ShardedDataParallel) else None


def shard_model(module: nn.Module, placement: Callable[[], Placement]) -> ShardedDataParallel | None:
    """Shard ``module`` in place if the config asks for it (collective over the world); ``placement()``
    is the model's placement when a full state is gathered."""
    cfg, world, topo = state.require()
    degree = cfg.sharded_data_parallel_degree
    if degree == 1:
        return None
    # under tensor parallelism each TP rank shards its own TP shards over the ranks holding the same ones
    kind = GroupKind.RDP if cfg.tp > 1 else GroupKind.DP
    dp = topo.size(kind)
    info = world.info
    if info.num_nodes > 1 and info.local_size % degree != 0:
        # FSDP2 all-gathers flat over the shard group (consecutive ranks); smp all-gathered within each
        # node first. A degree dividing the ranks per node keeps every shard group inside one node.
        raise SMPValidationError(
            f"sharded_data_parallel_degree={degree} makes shard groups that span nodes of {info.local_size} "
            "ranks: mp's all-gather (FSDP2's) runs flat over the shard group, not node-local first as "
            f"'sdp_hierarchical_allgather' asks. Expected a divisor of {info.local_size} (ranks per node), "
            "so that each shard group's all-gather stays within a node and only replicas talk across nodes. "
            f"Fix: set 'sharded_data_parallel_degree' to a divisor of {info.local_size}"
        )
    if dp % degree:  # under TP the data-parallel size checked at init is the world's, not the RDP group's
        raise SMPValidationError(
            f"sharded_data_parallel_degree={degree} does not divide the {dp} ranks that hold the same "
            f"tensor-parallel shards (world size / tensor_parallel_degree {cfg.tp}): each TP rank shards "
            f"its own shards over them. Expected a divisor of {dp}. Fix: set 'sharded_data_parallel_degree' "
            f"to a divisor of {dp}, or launch a multiple of {degree * cfg.tp} processes"
        )
    devices = {t.device.type for t in [*module.parameters(), *module.buffers()]}  # "meta": delayed init
    config = ShardingConfig(
        degree=degree,
        replicas=dp // degree,
        persistence_threshold=cfg.sdp_param_persistence_threshold,
        max_live_parameters=None
        if cfg.sdp_max_live_parameters == 1_000_000_000
        else cfg.sdp_max_live_parameters,
        device_type="cuda" if "cuda" in devices else "cpu",
        param_dtype=HALF_DTYPES.get(cfg.precision),
        scaled_batch_divisor=1 if cfg.prescaled_batch else cfg.tp,
        block_classes=("DistributedTransformerLayer",),  # smp.nn's layers (a whole-stack model's blocks)
    )
    tp = None
    if cfg.tp > 1:
        from mp.delayed_init import delayed, own_draws
        from mp_tensor import is_distributed_parameter, is_scaled_batch_parameter

        tp = TensorParallel(
            group=state.process_groups[GroupKind.TP],
            split=is_distributed_parameter,
            scaled_batch=is_scaled_batch_parameter,
            ranks=tuple(
                tuple(topo.rank_of(pp_rank=0, tp_rank=t, rdp_rank=d) for d in range(dp))
                for t in range(cfg.tp)
            ),
            draw=own_draws(module) if delayed(module) else None,  # each TP shard drawn as its module does
        )
    try:
        sharding = ShardedDataParallel(module, config, state.process_groups[kind], tp)
    except ShardingError as exc:
        raise SMPValidationError(str(exc)) from None
    if tp is not None:  # the full state in the original model's names, as without sharding
        from mp.state_dicts import full_state_dict

        sharding.gather_tp_state = lambda: dict(full_state_dict(module, placement(), True))
        sharding.local_tp_state = lambda sd: _tp_values(module, sd)
    return sharding


def _tp_values(module: nn.Module, sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A full state of ``module`` (the original model's names, as ``model.state_dict()`` gives it) as
    this TP rank's values under the module's own names: each distributed module's part translated from
    the original layout (when given so) and cut to this rank's TP shard, the rest as it is. No
    communication."""
    from mp_tensor import ORIGINAL_ATTR, Replacement, distributed_roots, param_spec

    roots = list(distributed_roots(module))
    out = {k: v for k, v in sd.items() if not any(k.startswith(p) for p, _ in roots)}
    for prefix, root in roots:
        part = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
        own = set(root.state_dict(keep_vars=True))
        replacement = root.__dict__.get(ORIGINAL_ATTR)
        if part and not set(part) <= own and isinstance(replacement, Replacement):
            part = replacement.from_original(part)
        specs = {n: param_spec(p) for n, p in root.named_parameters()}
        for name, value in part.items():
            spec = specs.get(name)
            out[prefix + name] = root.shard(value, None if spec is None else spec.split_dim)
    return out


def partial_file_names(sharding: ShardedDataParallel | None) -> tuple[str, str, bool] | None:
    """(model file, optimizer file, whether this rank writes them) of a partial checkpoint under
    ``sharding``: one pair per shard index, written by the first replica's ranks. None without it."""
    if sharding is None:
        return None
    layout = layout_of(sharding)
    name = f"sdp{layout.shard}of{layout.degree}"
    if layout.tp_rank is not None:
        name += f"_tp{layout.tp_rank}"
    return f"model_{name}.pt", f"optimizer_{name}.pt", sharding.replica_index == 0


def local_state_dict(sharding: ShardedDataParallel) -> dict[str, Any]:
    return write_header(sharding.local_state_dict(), Header(partial=True, sdp_layout=layout_of(sharding)))


def load_local_state_dict(sharding: ShardedDataParallel, sd: dict[str, Any], saved: SDPLayout | None) -> None:
    """Load this rank's shards (``sd`` without its header; ``saved``: the shard it was saved from)."""
    check_layout(sharding, saved, "model")
    try:
        sharding.load_local_state_dict(sd)
    except ShardingError as exc:
        raise IncompatibleCheckpointFoundError(str(exc)) from None


def layout_of(sharding: ShardedDataParallel) -> SDPLayout:
    """The sharding degree and this rank's shard index (saved with partial states, checked on load)."""
    _, world, topo = state.require()
    tp_rank = topo.coords(world.rank).tp_rank if sharding.tp is not None else None
    return SDPLayout(sharding.config.degree, sharding.shard_index, tp_rank)


def check_layout(sharding: ShardedDataParallel, saved: SDPLayout | None, what: str) -> None:
    """Refuse a partial state saved for another shard (IncompatibleCheckpointFoundError)."""
    here = layout_of(sharding)
    if saved != here:
        shown = None if saved is None else saved.to_dict()
        raise IncompatibleCheckpointFoundError(
            f"the partial {what} state holds the shards of {shown!r} (sharded_data_parallel_degree and "
            f"shard index); this rank holds {here.to_dict()}. Fix: load it with the degree it was saved "
            "with, or save and load the full state (model.state_dict(), optimizer.state_dict(), or "
            "partial=False)"
        )


def clip_targets(sharding: ShardedDataParallel) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """What smp clips under sharding: the whole model's gradient, in fp16/bf16 that of the fp32 masters
    (the sharded parameters are their own masters; the small unsharded ones have separate ones), and
    each separate master's parameter (its TP layout: a TP shard's norm sums over the TP group)."""
    params: list[torch.Tensor] = list(sharding.module.parameters())
    owners: dict[int, torch.Tensor] = {}
    registered = state.optimizer
    if isinstance(registered, Bit16Optimizer) and registered.masters_ready:
        master = {id(p): m for p, m in registered.pairs()}
        owners = {id(master[id(p)]): p for p in params if id(p) in master}
        params = [master.get(id(p), p) for p in params]
    return params, owners


def clip_sharded(sharding: ShardedDataParallel, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``clip_master_grads`` under sharding: the global L2 norm over every shard (collective)."""
    if norm_type != 2.0:
        raise SMPValidationError(
            f"clip_master_grads(norm_type={norm_type!r}) under sharded data parallelism: expected 2.0"
        )
    params, owners = clip_targets(sharding)
    return clip_grad_norm(params, max_norm, sharding, owners).float()


class ShardedPart(OptimizerPart):
    """Sharded data parallelism in the optimizer's chain (module docstring): clips by
    ``sdp_gradient_clipping`` before the parts below step, and saves and loads through
    torch.distributed.checkpoint (never through the parts below). ``model``: the model ``sharding``
    shards (its full state under TP is keyed by its parameter names)."""

    name = "sharded"

    def __init__(
        self, optimizer: torch.optim.Optimizer, sharding: ShardedDataParallel, model: ModelView
    ) -> None:
        live = {id(p) for p in sharding.module.parameters()}
        stale = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in live]
        if stale:
            raise SMPValidationError(
                f"smp.DistributedOptimizer got an optimizer over {len(stale)} tensors that are not the "
                "sharded model's parameters (made before smp.DistributedModel, which replaces them by their "
                "shards under sharded_data_parallel_degree > 1). Fix: build the optimizer after wrapping, on "
                "model.parameters()"
            )
        self.optimizer = optimizer
        self.sharding = sharding
        self.model = model
        self.max_norm = float(state.require()[0].sdp_gradient_clipping)

    def step(self, inner: Callable[[Any], Any], closure: Any) -> Any:
        if self.max_norm > 0:  # smp: under sharded data parallelism the library clips, inside step()
            params, owners = clip_targets(self.sharding)
            clip_grad_norm(params, self.max_norm, self.sharding, owners)
        return inner(closure)

    def clip_master_grads(
        self, inner: Callable[[float, float], torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        return clip_sharded(self.sharding, max_norm, norm_type)

    def state_dict(self, inner: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        if self.sharding.tp is not None:
            return _full_tp_state(self.optimizer, self.model.module, self.model.placement)
        with chain_of(self.optimizer).torch_methods():
            return self.sharding.full_optimizer_state_dict(self.optimizer)

    def local_state_dict(self, inner: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        header = Header(partial=True, sdp_layout=layout_of(self.sharding))
        return write_header(local_optimizer_state(self.optimizer), header)

    def load_state_dict(self, inner: Callable[[dict[str, Any]], None], state_dict: dict[str, Any]) -> None:
        header, sd = read_header(state_dict)
        if header.partial:
            check_layout(self.sharding, header.sdp_layout, "optimizer")
            load_local_optimizer_state(self.optimizer, sd)
            return
        if self.sharding.tp is not None:
            _load_full_tp_state(self.optimizer, self.model.module, sd, header.param_names)
            return
        # a name-keyed state (its header dropped) is what DCP's full state is too
        with chain_of(self.optimizer).torch_methods():
            self.sharding.load_full_optimizer_state_dict(self.optimizer, sd)


class _WholeStates:
    """An optimizer as ``mp.optimizer_state`` reads it, with each sharded state tensor gathered whole
    over the sharding group (collective, in parameter order)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups = optimizer.param_groups
        self.state: dict[torch.Tensor, dict[str, Any]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                st = optimizer.state.get(p)
                if st:
                    self.state[p] = {
                        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in st.items()
                    }


def _full_tp_state(
    optimizer: torch.optim.Optimizer, module: nn.Module, placement: Placement
) -> dict[str, Any]:
    """The full optimizer state under sharding and TP: keyed by the original model's parameter names
    with full tensors, as under TP without sharding (mp.optimizer_state); collective over the world."""
    from mp.optimizer_state import named_state

    groups = [list(g["params"]) for g in optimizer.param_groups]
    return named_state(cast(torch.optim.Optimizer, _WholeStates(optimizer)), module, placement, groups)


def _load_full_tp_state(
    optimizer: torch.optim.Optimizer,
    module: nn.Module,
    sd: dict[str, Any],
    names: list[list[str | None]] | None,
) -> None:
    """Load a full state (without its header) keyed by parameter names (``_full_tp_state``'s, TP's
    without sharding, FSDP2's full state of the model without TP), or an index-numbered one with the
    ``names`` its header carries: each rank keeps its TP shard's part of this rank's shard."""
    from mp.optimizer_state import load_named_state

    if names is not None:  # index-numbered (a job without TP or sharding): by the names it carries
        flat = [n for group in names for n in group]
        sd = {
            "state": {flat[int(i)]: st for i, st in sd["state"].items()},
            "param_groups": [
                {**{k: v for k, v in g.items() if k != "params"}, "params": list(listed)}
                for g, listed in zip(sd["param_groups"], names, strict=True)
            ],
        }
    if any(not isinstance(k, str) for k in sd.get("state", {})):
        raise IncompatibleCheckpointFoundError(
            "optimizer.load_state_dict() under sharded data parallelism with tensor parallelism got a full "
            "state numbered by parameter index without the parameter names (_smp_param_names). Expected "
            "optimizer.state_dict() of an smp.DistributedOptimizer (keyed or carrying names). Fix: save it "
            "with optimizer.state_dict() of a DistributedOptimizer"
        )
    groups = [list(g["params"]) for g in optimizer.param_groups]
    load_named_state(optimizer, module, sd, groups)
    for p in (p for g in optimizer.param_groups for p in g["params"]):  # full tensors -> shards
        st = optimizer.state.get(p)
        if st and isinstance(p, DTensor):
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.dim() > 0:
                    st[k] = as_like(v, p, full=True)


def refuse_under_sharding(sharding: ShardedDataParallel | None, what: str) -> None:
    """DDP-side features that the FSDP2 path does not run: an error instead of a silent no-op."""
    if sharding is not None:
        raise REFUSED_USES["ddp_feature_under_sdp"].refusal(
            f"model.{what}() under sharded_data_parallel_degree > 1"
        )
