"""smp's fp16 and bf16 training (the ``fp16``/``bf16`` config keys), wired from ``mp_memory.precision``.

- ``smp.DistributedModel`` casts the model to fp16/bf16 (smp's FP16_Module): floating-point inputs are
  cast to that dtype, floating-point outputs back to fp32.
- ``smp.DistributedOptimizer`` returns a :class:`DistributedBit16Optimizer`: fp32 master weights for this
  rank's parameters, made once the model is partitioned; ``optimizer.optimizer`` is the user's optimizer
  (give it to LR schedulers, as smp's docs say).
- fp16: ``model.backward(loss)`` (or ``optimizer.backward(loss)``) multiplies the loss by the current
  loss scale; ``optimizer.step()`` skips the step on every rank when any rank's gradients overflowed
  (``optimizer.overflow``), and the dynamic scaler lowers its scale.
- ``optimizer.clip_master_grads(max_norm)`` clips the unscaled fp32 master gradients by the whole
  model's norm (across pipeline stages and tensor-parallel shards).
- Optimizer state dicts hold the masters, the optimizer state and the scaler, keyed by parameter name:
  ``local_state_dict()`` this rank's, ``state_dict()`` gathered over the pipeline; either loads under any
  pipeline layout (each rank takes its own parameters' entries).
- With ``shard_optimizer_state`` (ZeRO-1, mp.zero) the user's optimizer steps through a
  ZeroRedundancyOptimizer built over the fp32 masters: each rank of the reduced data-parallel group keeps
  the state of its share of the masters and steps them, and the updated masters are broadcast before they
  are copied into the half parameters. ``local_state_dict()`` then holds this rank's share of the state
  (and every master of its stage), loads only under the same layout, and ``state_dict()`` raises (smp).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mp.config_combinations import REFUSED_USES
from mp.errors import (
    IncompatibleCheckpointFoundError,
    SMPValidationError,
)
from mp.optimizer import clip_by_global_norm
from mp.optimizer_chain import ModelView
from mp.state import state
from mp.zero import sharding_of
from mp_comm import GroupKind
from mp_memory import (
    HALF_DTYPES,
    Bit16Optimizer,
    Header,
    PrecisionError,
    as_like,
    make_loss_scaler,
    read_header,
    write_header,
)

if TYPE_CHECKING:
    from mp_memory import ShardedDataParallel

__all__ = ["DistributedBit16Optimizer", "bit16_optimizer", "half_dtype"]


def half_dtype(precision: str) -> torch.dtype | None:
    """The parameters' dtype for a config's ``precision`` (None for fp32)."""
    return HALF_DTYPES.get(precision)


def _agree(flag: bool) -> bool:
    """One rank's overflow becomes every rank's: all skip the same steps and keep the same scale."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def _cpu(v: Any) -> Any:
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v


def _shard_of(v: Any) -> Any:
    """A tensor to save locally: a sharded DTensor's shard on this rank."""
    return _cpu(v.to_local() if isinstance(v, DTensor) else v)


def _gathered(v: Any) -> Any:
    """A tensor to save in a full state: a sharded DTensor gathered whole (collective)."""
    return _cpu(v.full_tensor() if isinstance(v, DTensor) else v)


def refuse_full_half_state_under_tp(
    what: str, precision: str, module: nn.Module, sharding: ShardedDataParallel | None
) -> None:
    """The full fp16/bf16 state holds each TP rank's masters of its own shards under mp's names, and a
    full checkpoint keeps rank 0's only: under tensor parallelism of ``module`` (with or without
    sharded data parallelism, ``sharding``) an error, not TP rank 0's shards loaded everywhere."""
    from mp.optimizer_state import has_tp_roots

    group = state.process_groups.get(GroupKind.TP)
    tp = dist.get_world_size(group) if group is not None else 1
    if (tp > 1 and has_tp_roots(module)) or (sharding is not None and sharding.tp is not None):
        raise REFUSED_USES["full_half_state_under_tp"].refusal(
            f"{what} under {precision} with tensor_parallel_degree {tp}"
        )


class DistributedBit16Optimizer(Bit16Optimizer):
    """smp's fp16/bf16 optimizer (Bit16_Optimizer) over this rank's parameters (module docstring) of
    ``model``; ``backward(loss)`` is the model's backward (``optimizer.backward(loss)`` calls it)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        precision: str,
        scaler: Any,
        model: ModelView,
        backward: Callable[[torch.Tensor], None],
    ) -> None:
        super().__init__(optimizer, scaler, agree=_agree, check_overflow=precision == "fp16")
        self.precision = precision
        self._model = model
        self._backward = backward
        self._pending: dict[str, Any] | None = None

    def _ready(self, what: str) -> None:
        """Make the masters (once the groups hold only this rank's parameters) and load a pending state."""
        if self.masters_ready:
            return
        placement = self._model.placement
        if placement.pp_size > 1 and not placement.partitioned:
            raise SMPValidationError(
                f"optimizer.{what}() under {self.precision} needs the model partitioned (the fp32 master "
                "weights are made for this rank's parameters only); call it after the first @smp.step"
            )
        self.make_masters()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._apply(pending)

    # -- training --------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """``model.backward(loss)``: the loss is scaled there (smp scripts call either)."""
        self._backward(loss)

    def update_master_grads(self) -> None:
        """Unscale the gradients into the fp32 masters now (``step`` and ``clip_master_grads`` do it
        themselves; kept for scripts written for smp's FP16 optimizer)."""
        self._ready("update_master_grads")
        self.prepare_grads()

    def step(self, closure: Any = None) -> Any:
        self._ready("step")
        return super().step(closure)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the fp32 master gradients by the whole model's norm; returns the norm (inf when the step
        overflowed: nothing is clipped and ``step()`` will skip). Collective: every rank calls it."""
        self._ready("clip_master_grads")
        if self.prepare_grads():
            return torch.tensor(float("inf"))
        sharded = self._model.sharding
        if sharded is not None:  # DTensor gradients: the global norm over every shard (mp.sharded)
            from mp.sharded import clip_sharded

            return clip_sharded(sharded, max_norm, norm_type)
        pairs = [(p, m.grad) for p, m in self.pairs() if m.grad is not None]
        return clip_by_global_norm(pairs, max_norm, norm_type)

    # -- state -----------------------------------------------------------------------------------------
    def _zero_params(self) -> list[torch.Tensor] | None:
        """Under shard_optimizer_state: the masters whose state this rank keeps (ZeRO built over the
        masters, which exist by now); else None."""
        sharding = sharding_of(self.optimizer)
        return None if sharding is None else sharding.local_params()

    def _store(self) -> dict[Any, Any]:
        """Where the masters' optimizer state lives: ZeRO's local optimizer when sharded."""
        sharding = sharding_of(self.optimizer)
        return self.optimizer.state if sharding is None else sharding.build().optim.state

    def _names(self) -> dict[int, str]:
        by_param = self._model.param_names()
        return {id(m): by_param[id(p)] for p, m in self.pairs() if id(p) in by_param}

    def local_state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """This rank's masters, optimizer state and loss scaler, by parameter name."""
        return self._collect(full=False)

    def _collect(self, *, full: bool) -> dict[str, Any]:
        """Under sharded data parallelism the sharded masters and their state are this rank's shards, or
        (``full``) gathered whole: collective then, in the same order on every rank."""
        self._ready("local_state_dict")
        save = _gathered if full else _shard_of
        names = self._names()
        store = self._store()
        groups, states, masters = [], {}, {}
        for g in self.optimizer.param_groups:
            gnames = [names[id(m)] for m in g["params"]]
            groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": gnames})
            for m, n in zip(g["params"], gnames, strict=True):
                masters[n] = save(m)
                if m in store:
                    states[n] = {k: save(v) for k, v in store[m].items()}
        zero = self._zero_params()
        sharded = self._model.sharding
        sdp_layout = None
        if sharded is not None and not full:
            from mp.sharded import layout_of

            sdp_layout = layout_of(sharded)
        header = Header(
            partial=not full,
            sdp_layout=sdp_layout,
            zero_param_names=None if zero is None else [names[id(m)] for m in zero],
            precision=self.precision,
        )
        state_ = {
            "param_groups": groups,
            "state": states,
            "fp32_master_params": masters,
            "loss_scaler": self.loss_scaler.state_dict(),
            "overflow": self.overflow,
        }
        return write_header(state_, header)

    def state_dict(self) -> dict[str, Any]:
        """The whole model's (gathered over the pipeline: call it on every rank of the pipeline)."""
        self._ready("state_dict")
        if sharding_of(self.optimizer) is not None:
            raise REFUSED_USES["full_half_state_under_zero"].refusal(
                f"optimizer.state_dict() (the full optimizer state) under shard_optimizer_state with "
                f"{self.precision}"
            )
        self._refuse_under_tp("optimizer.state_dict()")
        sd = self._collect(full=True)
        placement = self._model.placement
        if placement.pp_size == 1:
            return sd
        placement.enter("optimizer.state_dict()")
        parts: list[Any] = [None] * placement.pp_size
        mine = (sd["param_groups"], sd["state"], sd["fp32_master_params"])
        dist.all_gather_object(parts, mine, group=placement.pp_group)
        order = {n: i for i, (n, _) in enumerate(self._model.module.named_parameters())}
        for gi, group in enumerate(sd["param_groups"]):
            names = {n for groups, _, _ in parts for n in groups[gi]["params"]}
            group["params"] = sorted(names, key=lambda n: order.get(n, len(order)))
        for _, states, masters in parts:
            sd["state"].update(states)
            sd["fp32_master_params"].update(masters)
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``local_state_dict()`` or ``state_dict()`` of an fp16/bf16 optimizer (any layout whose
        parameters include this rank's). Before the masters exist it is kept until they do."""
        if read_header(state_dict)[0].precision is None:
            raise IncompatibleCheckpointFoundError(
                f"the optimizer state (keys {sorted(state_dict)[:6]}) was not saved by an fp16/bf16 "
                f"optimizer; this one trains in {self.precision}. Load a state saved with the same "
                "'fp16'/'bf16' setting"
            )
        if self.masters_ready:
            self._apply(state_dict)
            return
        self._pending = dict(state_dict)
        # the scale is needed before the masters exist: the next backward multiplies the loss by it
        self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        placement = self._model.placement
        if placement.pp_size == 1 or placement.partitioned:
            self._ready("load_state_dict")

    def _refuse_under_tp(self, what: str) -> None:
        refuse_full_half_state_under_tp(what, self.precision, self._model.module, self._model.sharding)

    def _apply(self, state_dict: dict[str, Any]) -> None:
        header, sd = read_header(state_dict)
        names = self._names()
        masters, states = sd["fp32_master_params"], sd["state"]
        saved_groups = sd["param_groups"]
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise IncompatibleCheckpointFoundError(
                f"the optimizer state has {len(saved_groups)} parameter groups; this optimizer has "
                f"{len(self.optimizer.param_groups)}: build the optimizer as in the saving job"
            )
        missing = [
            names[id(m)]
            for g in self.optimizer.param_groups
            for m in g["params"]
            if names[id(m)] not in masters
        ]
        if missing:
            raise IncompatibleCheckpointFoundError(
                f"the optimizer state has no entries for parameters {missing[:6]} ({len(missing)} in all) "
                "that this rank holds: load a state_dict() (full), or a local_state_dict() saved with "
                "this layout"
            )
        zero = self._zero_params()
        if zero is not None and header.zero_param_names != [names[id(m)] for m in zero]:
            raise IncompatibleCheckpointFoundError(
                f"the {self.precision} optimizer state was not saved as this rank's share under "
                "shard_optimizer_state with this layout: load a local_state_dict() saved with the same "
                "layout, partition and data-parallel size"
            )
        sharded = self._model.sharding
        full = not header.partial
        if full:
            self._refuse_under_tp("optimizer.load_state_dict() of a full state")
        if sharded is not None and header.partial:
            from mp.sharded import check_layout

            check_layout(sharded, header.sdp_layout, "fp16/bf16 optimizer")
        store = self._store()
        pair_of = {id(m): p for p, m in self.pairs()}
        with torch.no_grad():
            for group, saved in zip(self.optimizer.param_groups, saved_groups, strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
                for m in group["params"]:
                    n = names[id(m)]
                    m.copy_(as_like(masters[n], m, full=full))
                    if pair_of[id(m)] is not m:
                        pair_of[id(m)].copy_(m)
                    store.pop(m, None)
                    if n in states:
                        store[m] = {
                            k: as_like(v, m, full=full) if isinstance(v, torch.Tensor) else v
                            for k, v in states[n].items()
                        }
        self.loss_scaler.load_state_dict(sd["loss_scaler"])
        self.overflow = bool(sd.get("overflow", False))


def bit16_optimizer(
    optimizer: torch.optim.Optimizer,
    precision: str,
    static_loss_scale: float | None,
    dynamic_loss_scale: bool,
    dynamic_loss_args: dict[str, Any],
    *,
    model: ModelView,
    backward: Callable[[torch.Tensor], None],
) -> DistributedBit16Optimizer:
    """The fp16/bf16 optimizer for smp's ``DistributedOptimizer`` arguments, over ``model``'s parameters
    (``backward``: the model's)."""
    if precision == "bf16" and (
        dynamic_loss_scale or dynamic_loss_args or static_loss_scale not in (None, 1.0)
    ):
        raise SMPValidationError(
            "smp.DistributedOptimizer got loss-scaling arguments under 'bf16': true; bf16 has fp32's "
            "exponent range and takes no loss scaling. Fix: remove static_loss_scale/dynamic_loss_scale/"
            "dynamic_loss_args, or train with 'fp16': true"
        )
    try:
        scaler = make_loss_scaler(static_loss_scale, dynamic_loss_scale, dynamic_loss_args)
    except PrecisionError as exc:
        raise SMPValidationError(f"smp.DistributedOptimizer: {exc}") from exc
    return DistributedBit16Optimizer(optimizer, precision, scaler, model, backward)
