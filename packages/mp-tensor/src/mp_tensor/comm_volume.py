"""Bytes moved by tensor-parallel collectives per distributed layer in one step, and the analytic count.

:func:`measure` runs a step (forward and backward) with every collective recorded and attributed to
the outermost distributed module that issued it: in forward, the module whose ``forward`` is running;
in backward, from the arrival of a module's output gradient to that of its input's (autograd runs
the blocks' backwards one after another); anything else is listed as ``"(outside)"``. Collectives of
the gloo/NCCL path (``torch.distributed``) and of the MPI path (:mod:`mp_comm.collectives_mpi`) are
both seen.

The volume of one collective is the size of its whole buffer: the tensor summed by an all-reduce, the
input of a reduce-scatter or an all-to-all, the output of an all-gather.

:func:`analytic` gives the Megatron count of a transformer block from its sizes, for ``t`` tokens over
the TP group (every rank's samples: ``T * local tokens``, or the local ones with ``prescaled_batch``):

- speed: forward, one all-reduce of ``t * h`` per output projection (two per sequential block, one per
  parallel attention+MLP block); backward, one per input exchange (each group of projections reading
  one input), plus the cross-attention keys/values of a T5 decoder block over the encoder's tokens;
- memory: forward, a reduce-scatter per input exchange (``t * sum of its output widths``) and per output
  projection (``t * h``), an all-reduce of 1 (RMSNorm) or 2 (LayerNorm) numbers per token per norm;
  backward, their mirrors (all-gathers of the same sizes, the same all-reduces). With
  ``prescaled_batch`` the layer also all-gathers its output channels forward (``t * h``) and the
  gradient of each input backward.

Without ``prescaled_batch``, layers also exchange samples (all-gathers or all-to-alls of their inputs
and masks); those are measured and listed, and compared only where the count models them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mp_comm import collectives_mpi as mpi_ops
from mp_tensor.nn.base import DistributedModule, param_spec

__all__ = ["LayerVolume", "analytic", "measure", "record_collectives"]

Key = tuple[str, str]  # (phase "fwd" | "bwd", kind)

# torch.distributed function -> (kind, which argument is the whole buffer, scaled by the group size)
_DIST = {
    "all_reduce": ("all_reduce", 0, False),
    "all_gather_single": ("all_gather", 0, False),
    "all_gather_into_tensor": ("all_gather", 0, False),
    "all_gather": ("all_gather", 1, True),
    "reduce_scatter_single": ("reduce_scatter", 1, False),
    "reduce_scatter_tensor": ("reduce_scatter", 1, False),
    "all_to_all_single": ("all_to_all", 1, False),
}
_MPI = {"all_reduce": False, "all_gather": True, "reduce_scatter": False, "all_to_all": False}


class _Recorder:
    """Where recorded collectives go: the current (phase, owner) and the tallies."""

    def __init__(self) -> None:
        self.phase, self.owner = "fwd", ""
        self.volumes: dict[str, dict[Key, list[int]]] = {}

    def add(self, kind: str, nbytes: int) -> None:
        tally = self.volumes.setdefault(self.owner, {}).setdefault((self.phase, kind), [0, 0])
        tally[0] += 1
        tally[1] += nbytes


_lock = threading.Lock()


@contextlib.contextmanager
def record_collectives() -> Iterator[_Recorder]:
    """Record every collective issued inside (``recorder.volumes[owner][(phase, kind)] = [count, bytes]``;
    set ``recorder.owner`` / ``recorder.phase`` to attribute them)."""
    rec = _Recorder()
    saved: list[tuple[Any, str, Any]] = []

    def dist_wrap(name: str, fn: Any) -> Any:
        kind, arg, gathered = _DIST[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            t = args[arg] if len(args) > arg else None
            if isinstance(t, Tensor):
                size = dist.get_world_size(kwargs.get("group")) if gathered else 1
                rec.add(kind, t.numel() * t.element_size() * size)
            return fn(*args, **kwargs)

        return counted

    def mpi_wrap(name: str, fn: Any) -> Any:
        def counted(x: Tensor, *args: Any) -> Any:
            comm = args[-2]  # (..., comm, async_op)
            size = comm.Get_size() if _MPI[name] else 1
            rec.add(name, x.numel() * x.element_size() * size)
            return fn(x, *args)

        return counted

    with _lock:
        for name in _DIST:
            fn = getattr(dist, name, None)
            if fn is not None:
                saved.append((dist, name, fn))
                setattr(dist, name, dist_wrap(name, fn))
        for name in _MPI:
            fn = getattr(mpi_ops, name)
            saved.append((mpi_ops, name, fn))
            setattr(mpi_ops, name, mpi_wrap(name, fn))
    try:
        yield rec
    finally:
        with _lock:
            for owner, name, fn in reversed(saved):
                setattr(owner, name, fn)


# ------------------------------------------------------------------------------ per-layer measure


@dataclass
class LayerVolume:
    """One distributed layer's collectives in one step: ``{(phase, kind): (count, bytes)}``."""

    name: str
    cls: str
    measured: dict[Key, tuple[int, int]] = field(default_factory=dict)
    analytic: dict[Key, tuple[int, int]] | None = None
    tokens: int = 0
    """Tokens the layer processed over its TP group (the ``t`` of the count)."""
    complete: bool = False
    """True when the count models every collective (``prescaled_batch``); else only the reductions."""

    def matches(self) -> bool | None:
        """Whether the count equals the measurement: all of it when ``complete``, else the modeled
        (phase, kind) pairs (None when the layer is not modeled)."""
        if self.analytic is None:
            return None
        if self.complete:
            return self.measured == self.analytic
        return all(self.measured.get(k, (0, 0)) == v for k, v in self.analytic.items())


def _roots(model: nn.Module, prefix: str = "") -> Iterator[tuple[str, DistributedModule]]:
    if isinstance(model, DistributedModule):
        yield prefix.rstrip(".") or "(model)", model
        return
    for name, child in model.named_children():
        yield from _roots(child, f"{prefix}{name}.")


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def measure(model: nn.Module, step: Callable[[], Any]) -> list[LayerVolume]:
    """Run ``step()`` (one forward and backward of ``model``) and return each outermost distributed
    layer's collectives, with the analytic count where the layer's family is modeled. Collectives
    issued outside any distributed layer are listed under ``"(outside)"``."""
    roots = list(_roots(model))
    shapes: dict[str, list[tuple[tuple[int, ...], torch.dtype]]] = {}
    handles: list[Any] = []
    # per tensor (by id, kept alive for the step): the layers whose backward ends when its gradient
    # is ready (it is their main input) and those whose backward starts (it is their output)
    events: dict[int, tuple[list[str], list[str]]] = {}
    alive: list[Tensor] = []
    with record_collectives() as rec:

        def on_grad(t: Tensor, ends: bool, name: str) -> None:
            entry = events.get(id(t))
            if entry is None:
                entry = events[id(t)] = ([], [])
                alive.append(t)

                def fire(grad: Tensor, entry: tuple[list[str], list[str]] = entry) -> None:
                    if rec.owner in entry[0]:
                        rec.owner = "(outside)"
                    for started in entry[1]:
                        rec.phase, rec.owner = "bwd", started

                t.register_hook(fire)  # type: ignore[no-untyped-call]
            entry[0 if ends else 1].append(name)

        def attach(name: str, module: DistributedModule) -> None:
            def pre(_: nn.Module, args: tuple[Any, ...]) -> None:
                rec.phase, rec.owner = "fwd", name
                shapes[name] = [(tuple(t.shape), t.dtype) for t in _tensors(args)]
                main = next(_tensors(args), None)  # the hidden states: its gradient ends the backward
                if main is not None and main.requires_grad:
                    on_grad(main, True, name)

            def post(_: nn.Module, args: tuple[Any, ...], out: Any) -> None:
                rec.owner = "(outside)"
                passed = {id(t) for t in _tensors(args)}  # handed through (T5's bias): not this layer's
                for t in _tensors(out):
                    if t.requires_grad and id(t) not in passed:
                        on_grad(t, False, name)

            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))

        for root_name, root in roots:
            attach(root_name, root)
        rec.owner = "(outside)"
        try:
            step()
        finally:
            for h in handles:
                h.remove()
    rows = []
    entries: list[tuple[str, DistributedModule | None]] = [*roots, ("(outside)", None)]
    for name, module in entries:
        measured = {k: (v[0], v[1]) for k, v in sorted(rec.volumes.get(name, {}).items())}
        if module is None:
            if measured:
                rows.append(LayerVolume(name, "", measured))
            continue
        row = LayerVolume(name, type(module).__name__, measured)
        inputs = shapes.get(name)
        if inputs:
            row.tokens, row.analytic = _model_of(module, inputs)
            row.complete = module.tp.prescaled_batch
        rows.append(row)
    return rows


def _model_of(
    module: DistributedModule, inputs: list[tuple[tuple[int, ...], torch.dtype]]
) -> tuple[int, dict[Key, tuple[int, int]] | None]:
    (shape, dtype), ctx = inputs[0], module.tp
    scale = 1 if ctx.prescaled_batch else ctx.size
    tokens = scale * int(torch.Size(shape[:-1]).numel())
    enc = None
    if type(module).__name__ == "DistributedT5Block" and len(inputs) > 2:
        # (hidden, mask, [bias], encoder_hidden, encoder_mask): the encoder states are 3-D
        enc_shapes = [s for s, _ in inputs[1:] if len(s) == 3]
        enc = scale * int(torch.Size(enc_shapes[0][:-1]).numel()) if enc_shapes else None
    return tokens, analytic(
        module, tokens, enc_tokens=enc, element_size=torch.empty((), dtype=dtype).element_size()
    )


# ------------------------------------------------------------------------------- analytic count


@dataclass(frozen=True)
class _Plan:
    """What a block exchanges, for ``t`` tokens: input exchanges ``(tokens, summed output width)``,
    output projections (tokens each), norms (numbers per token), inputs entered (tokens each)."""

    projects: list[tuple[int, int]]
    fan_ins: list[int]
    norms: list[int]
    entered: list[int]


def _weight(shard: nn.Module) -> Tensor:
    weight = shard.weight
    assert isinstance(weight, Tensor)
    return weight


def _plan(module: DistributedModule, t: int, te: int | None) -> _Plan | None:
    m: Any = module
    name = type(module).__name__

    def w(*shards: nn.Module) -> int:
        total = 0
        for s in shards:
            weight = _weight(s)
            spec = param_spec(weight)
            total += int(weight.shape[0]) * (
                module.tp_size if spec is not None and spec.split_dim == 0 else 1
            )
        return total

    if name == "DistributedViTLayer":
        a = m.attention
        return _Plan([(t, w(a.q_proj, a.k_proj, a.v_proj)), (t, w(m.mlp.fc1))], [t, t], [2, 2], [t])
    if name == "DistributedT5Block":
        sa, ff = m.layer[0].SelfAttention, m.layer[-1].DenseReluDense
        ffw = w(ff.wi_0, ff.wi_1) if m.gated else w(ff.wi)
        if not m.is_decoder or te is None:
            return _Plan([(t, w(sa.q, sa.k, sa.v)), (t, ffw)], [t, t], [1, 1], [t])
        ca = m.layer[1].EncDecAttention
        projects = [(t, w(sa.q, sa.k, sa.v)), (t, w(ca.q)), (te, w(ca.k, ca.v)), (t, ffw)]
        return _Plan(projects, [t, t, t], [1, 1, 1], [t, te])
    if name == "DistributedLlamaLayer":
        if m.qk_norm:
            return None
        a, mlp = m.self_attn, m.mlp
        return _Plan(
            [(t, w(a.q_proj, a.k_proj, a.v_proj)), (t, w(mlp.gate_proj, mlp.up_proj))], [t, t], [1, 1], [t]
        )
    if name == "DistributedGPTJLayer":
        a = m.attn
        return _Plan([(t, w(a.q_proj, a.k_proj, a.v_proj, m.mlp.fc_in))], [t], [2], [t])
    if name == "DistributedGPTNeoXLayer":
        projects = [(t, w(m.attention.query_key_value)), (t, w(m.mlp.dense_h_to_4h))]
        return _Plan(projects, [t] if m.parallel else [t, t], [2, 2], [t])
    if name == "DistributedGPTNeoLayer":
        a = m.attn.attention
        return _Plan([(t, w(a.q_proj, a.k_proj, a.v_proj)), (t, w(m.mlp.c_fc))], [t, t], [2, 2], [t])
    if name == "DistributedTransformerLayer" and module.tp.optimize == "speed":
        if getattr(m, "cross_attention", None) is not None:
            return None
        return _Plan([(t, 0), (t, 0)], [t, t], [], [t])  # speed mode needs no widths
    return None


def analytic(
    module: DistributedModule, tokens: int, *, enc_tokens: int | None = None, element_size: int = 4
) -> dict[Key, tuple[int, int]] | None:
    """The Megatron count ``{(phase, kind): (count, bytes)}`` of one step of ``module`` over ``tokens``
    tokens of its TP group (see the module doc), or None for a layer this count does not model."""
    ctx = module.tp
    if not ctx.distributed:
        return {}
    plan = _plan(module, tokens, enc_tokens)
    if plan is None:
        return None
    h = _hidden(module)
    out: dict[Key, list[int]] = {}

    def add(key: Key, elements: int, size: int = element_size) -> None:
        tally = out.setdefault(key, [0, 0])
        tally[0] += 1
        tally[1] += elements * size

    if ctx.optimize == "speed":
        for n in plan.fan_ins:
            add(("fwd", "all_reduce"), n * h)
        for n, _ in plan.projects:
            add(("bwd", "all_reduce"), n * h)
        return {k: (v[0], v[1]) for k, v in out.items()}
    for n, width in plan.projects:
        add(("fwd", "reduce_scatter"), n * width)
        add(("bwd", "all_gather"), n * width)
    for n in plan.fan_ins:
        add(("fwd", "reduce_scatter"), n * h)
        add(("bwd", "all_gather"), n * h)
    for per_token in plan.norms:
        add(("fwd", "all_reduce"), tokens * per_token, 4)  # the moments are summed in fp32
        add(("bwd", "all_reduce"), tokens * per_token, 4)
    if ctx.prescaled_batch:
        add(("fwd", "all_gather"), tokens * h)  # the output's channels
        for n in plan.entered:
            add(("bwd", "all_gather"), n * h)  # each input's gradient channels
    return {k: (v[0], v[1]) for k, v in out.items()}


def _hidden(module: DistributedModule) -> int:
    m: Any = module
    size = getattr(getattr(m, "args", None), "hidden_size", None)
    if isinstance(size, int):
        return size
    for norm_name in ("layernorm_before", "input_layernorm", "ln_1"):
        norm = getattr(m, norm_name, None)
        if norm is not None:
            return int(norm.hidden)
    if type(module).__name__ == "DistributedT5Block":
        return int(m.layer[0].layer_norm.hidden)
    raise ValueError(f"comm_volume: no hidden size known for {type(module).__name__}")
