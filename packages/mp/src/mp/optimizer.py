"""`smp.DistributedOptimizer`: the user's optimizer, made to step only this rank's parameters.

As in smp's implementation, it returns the same optimizer object (so LR schedulers and
``isinstance`` checks keep working), registered with mp and given ``local_state_dict``, a gathered
``state_dict``, a ``load_state_dict`` that takes either, and ``clip_master_grads`` (clipping by the
norm of the whole model's gradient, across pipeline stages). Once the model
is partitioned its parameter groups keep only the parameters this rank holds; this works whether the
optimizer was built before or after ``smp.DistributedModel``, on the raw or the wrapped model's
parameters.

These methods are set once (``mp.optimizer_chain``); each runs the features the config turned on as an
ordered list of parts, built in :func:`_parts`, ending with :class:`PlainPart` (the behaviour above).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from mp.delayed_init import DelayedLoads
from mp.errors import DistributedModelNotWrappedError, IncompatibleCheckpointFoundError, SMPValidationError
from mp.optimizer_chain import ModelView, OptimizerPart, install, part_of
from mp.optimizer_state import has_tp_roots, load_named_state, named_state
from mp.state import state
from mp.state_dicts import layout_of, local_layout_check
from mp_comm import GroupKind
from mp_memory import Header, read_header, write_header
from mp_partition import Placement

if TYPE_CHECKING:
    from mp.model import DistributedModel

__all__ = ["DistributedOptimizer", "PlainPart", "keep_local_parameters"]


_ALL_PARAMS = "_mp_all_params"


def keep_local_parameters(optimizer: torch.optim.Optimizer, placement: Placement) -> None:
    """Drop the parameters another rank holds (by ``placement``) from every parameter group.

    The full groups are remembered first: the gathered ``state_dict()`` numbers parameters as the
    unpartitioned optimizer does, so full optimizer states load under any pipeline layout."""
    if not hasattr(optimizer, _ALL_PARAMS):
        setattr(optimizer, _ALL_PARAMS, [list(g["params"]) for g in optimizer.param_groups])
    for group in optimizer.param_groups:
        kept = [p for p in group["params"] if placement.is_local(p)]
        for p in group["params"]:
            if not placement.is_local(p):
                optimizer.state.pop(p, None)
        group["params"] = kept


def _all_params(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """Every group's parameters before partitioning dropped the remote ones."""
    saved: list[list[torch.Tensor]] | None = getattr(optimizer, _ALL_PARAMS, None)
    return saved if saved is not None else [list(g["params"]) for g in optimizer.param_groups]


def _global_indices(optimizer: torch.optim.Optimizer) -> list[list[int]]:
    """Per group, the full-optimizer index (torch's numbering) of each parameter the group holds now."""
    index: dict[int, int] = {}
    for p in (p for group in _all_params(optimizer) for p in group):
        index.setdefault(id(p), len(index))
    return [[index[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def _param_names(optimizer: torch.optim.Optimizer, model: ModelView) -> list[list[str | None]]:
    """Per group, the model's name of each parameter the group holds now (None if not the model's)."""
    names = model.param_names()
    return [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]


def _local_state_dict(self: torch.optim.Optimizer, model: ModelView) -> dict[str, Any]:
    """This rank's optimizer state, with the names of its parameters and the layout (checked when
    loading: a TP shard's state must not load on another tp_rank)."""
    layout = layout_of(model.module, model.placement)
    header = Header(
        partial=True,
        param_names=_param_names(self, model),
        tp_layout=layout if layout.split else None,
    )
    return write_header(torch.optim.Optimizer.state_dict(self), header)


NamedParameters = Callable[[], Iterator[tuple[str, nn.Parameter]]]


def _param_name_to_index(self: torch.optim.Optimizer, named: NamedParameters) -> dict[str, int]:
    """smp's extra: each local parameter's name (as ``model.named_parameters()`` gives it: ``named``)
    and its index in ``local_state_dict()``."""
    names = {id(p): n for n, p in named()}
    flat = [p for group in self.param_groups for p in group["params"]]
    return {names[id(p)]: i for i, p in enumerate(flat) if id(p) in names}


def _param_index_to_name(self: torch.optim.Optimizer, named: NamedParameters) -> dict[int, str]:
    """The inverse of ``param_name_to_index``."""
    return {i: n for n, i in _param_name_to_index(self, named).items()}


def _state_dict(self: torch.optim.Optimizer, model: ModelView) -> dict[str, Any]:
    """The full optimizer state, numbered as the unpartitioned optimizer numbers its parameters.

    With pp > 1 it is gathered over the pipeline group: call it on every rank of the pipeline. It
    carries the full groups' parameter names (in its header). Under tensor parallelism it is keyed
    by the original model's parameter names instead, with full tensors (``mp.optimizer_state``):
    collective over the TP group too."""
    placement = model.placement
    if has_tp_roots(model.module):
        return named_state(self, model.module, placement, _all_params(self))
    local = dict(torch.optim.Optimizer.state_dict(self))
    names = model.param_names()
    param_names = [[names.get(id(p)) for p in g] for g in _all_params(self)]
    if not placement.pipelined:
        return write_header(local, Header(param_names=param_names))
    flat = [i for group in _global_indices(self) for i in group]
    mine = {
        flat[i]: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in local["state"].items()
    }
    placement.enter("optimizer.state_dict()")
    parts: list[Any] = [None] * placement.pp_size
    dist.all_gather_object(parts, mine, group=placement.pp_group)
    merged: dict[int, Any] = {}
    for part in parts:
        merged.update(part)
    offsets = [0]
    for group in _all_params(self):
        offsets.append(offsets[-1] + len(group))
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(range(offsets[gi], offsets[gi + 1]))}
        for gi, g in enumerate(local["param_groups"])
    ]
    full = {"state": dict(sorted(merged.items())), "param_groups": groups}
    return write_header(full, Header(param_names=param_names))


def _localize(optimizer: torch.optim.Optimizer, full: dict[str, Any]) -> dict[str, Any]:
    """A full state dict (torch's numbering over all parameters) cut down to this rank's parameters."""
    saved_groups = full["param_groups"]
    all_groups = _all_params(optimizer)
    sizes = [len(g["params"]) for g in saved_groups]
    if sizes != [len(g) for g in all_groups]:
        raise IncompatibleCheckpointFoundError(
            f"the optimizer state has parameter groups of sizes {sizes}; this optimizer's groups have "
            f"{[len(g) for g in all_groups]} parameters: build the optimizer as in the saving job"
        )
    groups: list[dict[str, Any]] = []
    local_state: dict[int, Any] = {}
    n = 0  # torch numbers the local parameters consecutively over the groups
    for saved, every, group in zip(saved_groups, all_groups, optimizer.param_groups, strict=True):
        # The j-th parameter of a full group has the saved number saved["params"][j].
        position = {id(p): j for j, p in enumerate(every)}
        params: list[int] = []
        for p in group["params"]:
            saved_index = saved["params"][position[id(p)]]
            if saved_index in full["state"]:
                local_state[n] = full["state"][saved_index]
            params.append(n)
            n += 1
        groups.append({**saved, "params": params})
    return {"state": local_state, "param_groups": groups}


def _load_state_dict(self: torch.optim.Optimizer, state_dict: dict[str, Any], model: ModelView) -> None:
    """Load a local (``local_state_dict``) or full (``state_dict``) optimizer state.

    Before the model is partitioned (pp > 1) a local state is kept until partitioning has cut the
    groups down to this rank's parameters; a full state loads at once (the groups are still full)."""
    header, sd = read_header(state_dict)
    partial, names = header.partial, header.param_names
    placement = model.placement
    if header.keyed_by_name or (not partial and names is not None and has_tp_roots(model.module)):
        if not header.keyed_by_name:
            assert names is not None
            sd = _by_name(sd, names)  # saved without TP, loading with it
        # tp_shards: a partial state moved to another pp degree (this rank's shards, mp's names)
        load_named_state(self, model.module, sd, _all_params(self), translate=not header.tp_shards)
        return
    if partial:
        local_layout_check(model.module, placement, header.tp_layout)
    if partial and not placement.partitioned and placement.pp_size > 1:
        model.after_partition(lambda: _load_local(self, sd, names, model))
        return
    if partial:
        _load_local(self, sd, names, model)
    elif placement.pipelined:
        torch.optim.Optimizer.load_state_dict(self, _localize(self, sd))
    else:
        torch.optim.Optimizer.load_state_dict(self, sd)


def _by_name(sd: dict[str, Any], names: list[list[str | None]]) -> dict[str, Any]:
    """An index-numbered full state turned into the name-keyed form, by the names it carries."""
    flat = [n for group in names for n in group]
    groups = []
    for group, listed in zip(sd["param_groups"], names, strict=True):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(listed)})
    return {"state": {flat[i]: st for i, st in sd["state"].items()}, "param_groups": groups}


def _load_local(optimizer: torch.optim.Optimizer, sd: dict[str, Any], names: Any, model: ModelView) -> None:
    """Load this rank's part, after checking it was saved for the same parameters."""
    if names is not None:
        running = _param_names(optimizer, model)
        if names != running:
            flat_saved = [n for g in names for n in g]
            flat_running = [n for g in running for n in g]
            raise IncompatibleCheckpointFoundError(
                f"the partial optimizer state was saved for parameters {_short(flat_saved)}; this rank "
                f"(pp_rank {model.placement.pp_rank}) holds {_short(flat_running)}: load it with the "
                "layout and partition it was saved with, or save the full optimizer.state_dict() to "
                "change layouts"
            )
    torch.optim.Optimizer.load_state_dict(optimizer, sd)


def _short(names: list[str | None]) -> str:
    return f"{names[:6]}{' ...' if len(names) > 6 else ''} ({len(names)} in all)"


def _clip_master_grads(self: torch.optim.Optimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale this rank's gradients so that the norm of the WHOLE model's gradient is at most
    ``max_norm``; returns that total norm (the same on every rank), like
    ``torch.nn.utils.clip_grad_norm_`` on the unpartitioned model. Collective over the pipeline and
    tensor-parallel groups: call it on every rank, after the step and before ``optimizer.step()``.

    Each stage only holds its own gradients, so ``clip_grad_norm_(model.parameters())`` would clip
    every stage by a different norm. Tensor-parallel shards count once each (summed over the TP
    group); parameters replicated across the TP group count once.
    """
    pairs = [(p, p.grad) for g in self.param_groups for p in g["params"] if p.grad is not None]
    return clip_by_global_norm(pairs, max_norm, norm_type)


def clip_by_global_norm(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip the gradients of (parameter, gradient) pairs by the whole model's norm (see
    ``clip_master_grads``; the parameter tells whether its gradient is a tensor-parallel shard)."""
    from mp_tensor import is_distributed_parameter

    if norm_type not in (2.0, float("inf")):
        raise SMPValidationError(f"norm_type={norm_type!r}; expected 2.0 or float('inf')")
    grads = [g for _, g in pairs]
    sharded = {id(g) for p, g in pairs if is_distributed_parameter(p)}
    inf = norm_type == float("inf")

    def combine(ts: list[torch.Tensor]) -> torch.Tensor:
        if not ts:
            return torch.zeros((), dtype=torch.float64)
        if inf:
            return torch.stack([t.detach().abs().max().double() for t in ts]).max()
        return torch.stack([t.detach().double().square().sum() for t in ts]).sum()

    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    shard_part = combine([g for g in grads if id(g) in sharded])
    groups = state.process_groups
    if GroupKind.TP in groups and dist.get_world_size(groups[GroupKind.TP]) > 1:
        dist.all_reduce(shard_part, op=op, group=groups[GroupKind.TP])
    rest = combine([g for g in grads if id(g) not in sharded])
    total = torch.maximum(shard_part, rest) if inf else shard_part + rest
    if GroupKind.PP in groups and dist.get_world_size(groups[GroupKind.PP]) > 1:
        dist.all_reduce(total, op=op, group=groups[GroupKind.PP])
    norm = total if inf else total.sqrt()
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
    return norm.float()


def _note_loss_scaling(static: float | None, dynamic: bool, dynamic_args: dict[str, Any]) -> None:
    """smp's loss scaling takes effect only under fp16 (its docs), and smp's own GPT-2 example passes
    ``dynamic_loss_scale=True`` in fp32 runs too: accepted without effect, as in smp, but said once."""
    given = []
    if static not in (None, 1.0):
        given.append(f"static_loss_scale={static!r}")
    if dynamic:
        given.append("dynamic_loss_scale=True")
    given += [f"{k}={v!r}" for k, v in dynamic_args.items()]
    if given:
        warnings.warn(
            f"smp.DistributedOptimizer got {', '.join(given)}: smp's fp16 loss scaling, which takes effect "
            "only with the config key 'fp16': true; this run trains in fp32, unscaled (as smp did). Set "
            "'fp16': true to scale the loss, or drop these arguments to silence this warning",
            UserWarning,
            stacklevel=3,
        )


def _loss_args(dynamic_loss_args: dict[str, Any]) -> dict[str, Any]:
    """smp's docs pass ``dynamic_loss_args={...}``, its signature took ``**dynamic_loss_args``: both."""
    args = dict(dynamic_loss_args)
    nested = args.pop("dynamic_loss_args", None)
    if nested is not None:
        if not isinstance(nested, dict):
            raise SMPValidationError(
                f"dynamic_loss_args={nested!r}; expected a dict such as {{'init_scale': 2**16}}"
            )
        args.update(nested)
    return args


class PlainPart(OptimizerPart):
    """The last part: torch's own step, and smp's state dicts and clipping over this rank's parameters
    (this module's docstring) of ``model``."""

    name = "plain"

    def __init__(
        self, optimizer: torch.optim.Optimizer, step: Callable[[Any], Any], model: ModelView
    ) -> None:
        self.optimizer = optimizer
        self.step_fn = step  # the optimizer's step as it was (a scheduler's wrapper, or torch's)
        self.model = model

    def step(self, inner: Callable[[Any], Any], closure: Any) -> Any:
        return self.step_fn(closure)

    def state_dict(self, inner: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return _state_dict(self.optimizer, self.model)

    def local_state_dict(self, inner: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        return _local_state_dict(self.optimizer, self.model)

    def load_state_dict(self, inner: Callable[[dict[str, Any]], None], state_dict: dict[str, Any]) -> None:
        _load_state_dict(self.optimizer, state_dict, self.model)

    def clip_master_grads(
        self, inner: Callable[[float, float], torch.Tensor], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        return _clip_master_grads(self.optimizer, max_norm, norm_type)


def _parts(optimizer: torch.optim.Optimizer, cfg: Any, model: ModelView) -> list[OptimizerPart]:
    """The optimizer's features over ``model``'s parameters, outermost first: each runs before the
    ones below it and decides whether they run (``mp.optimizer_chain``). Under fp16/bf16 smp's
    half-precision optimizer is returned over all of them (``DistributedOptimizer``)."""
    previous = part_of(optimizer, PlainPart)  # DistributedOptimizer called again: the same torch step
    parts: list[OptimizerPart] = []
    if model.sharding is not None:  # sharded data parallelism: clips in step(), DCP state dicts, refusals
        from mp.sharded import ShardedPart

        parts.append(ShardedPart(optimizer, model.sharding, model))
    if cfg.shard_optimizer_state:  # ZeRO-1 over the RDP group: its own step and per-rank state
        from mp.zero import ZeroPart

        parts.append(ZeroPart(optimizer, model))
    parts.append(DelayedLoads(model))  # a delayed model's parameters are on meta until partitioning
    parts.append(PlainPart(optimizer, previous.step_fn if previous is not None else optimizer.step, model))
    return parts


def model_view(model: DistributedModel) -> ModelView:
    """What the optimizer's parts get of ``model`` (``mp.optimizer_chain.ModelView``)."""
    return ModelView(
        module=model.module,
        where=lambda: model.placement,
        after_partition=model.after_partition,
        sharding=model.sharding,
    )


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    static_loss_scale: float | None = 1.0,
    dynamic_loss_scale: bool = False,
    **dynamic_loss_args: Any,
) -> Any:
    """Register ``optimizer`` with mp and return it (see the module docstring). Under ``fp16``/``bf16``
    it returns smp's half-precision optimizer instead (``mp.precision``: fp32 master weights, loss
    scaling with these arguments under fp16; ``.optimizer`` is the one passed in)."""
    cfg = state.require()[0]
    model = state.model
    if model is None:
        raise DistributedModelNotWrappedError(
            "smp.DistributedOptimizer needs the model wrapped first (its state dicts and sharding follow "
            "the model's partition): call smp.DistributedModel(model) before smp.DistributedOptimizer"
        )
    loss_args = _loss_args(dynamic_loss_args)
    if cfg.precision == "fp32":
        _note_loss_scaling(static_loss_scale, dynamic_loss_scale, loss_args)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise SMPValidationError(
            f"smp.DistributedOptimizer needs a torch.optim.Optimizer; got {type(optimizer).__name__}"
        )
    for name, fn in (  # smp's extras that no part changes
        ("param_name_to_index", _param_name_to_index),
        ("param_index_to_name", _param_index_to_name),
    ):
        setattr(optimizer, name, functools.partial(fn, optimizer, model.named_parameters))
    view = model_view(model)
    install(optimizer, _parts(optimizer, cfg, view))
    registered: Any = optimizer
    if cfg.precision != "fp32":  # smp's face over it all: fp32 masters, loss scaling (mp.precision)
        from mp.precision import bit16_optimizer

        registered = bit16_optimizer(
            optimizer,
            cfg.precision,
            static_loss_scale,
            dynamic_loss_scale,
            loss_args,
            model=view,
            backward=model.backward,
        )
    state.optimizer = registered
    if model.partitioned:
        keep_local_parameters(registered, model.placement)
    return registered
