"""What the planner knows about a model: per-module parameters, activations and FLOPs, from one sample.

The model is built on the meta device (nothing is allocated; T5-11B and GPT-3 175B build in seconds), as
``mp-partition`` builds it (:func:`mp_partition.build_hf_model` for HuggingFace names and configs,
:func:`mp_partition.load_factory` for ``package.module:factory``). Two forward passes of one sample
(batch 1 at the planned sequence length) then record, per module path:

* activation memory: what autograd saves for backward while the module is the innermost one running,
  from the partitioner's trace (:func:`mp_partition.trace_model`);
* forward FLOPs: every matrix product and attention op the module runs itself, counted by torch's
  FLOP formulas (``torch.utils.flop_counter``) on shapes alone;
* forward memory traffic: the bytes every other op it runs itself reads and writes (elementwise ops,
  norms, softmax, dropout), memory-bound work that FLOPs do not count.

Both grow linearly with the number of samples, so one profile serves every micro-batch size.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from mp.plan.errors import PlanError

__all__ = ["ModelProfile", "block_paths", "count_flops", "profile_model"]

_log = logging.getLogger(__name__)


class _FlopMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Adds each op's FLOPs to the innermost running module (forward hooks keep the stack), and the bytes
    that every other op (elementwise, norms, softmax, dropout, ...) reads and writes."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.stack: list[str] = [""]
        self.flops: dict[str, float] = {}
        self.traffic: dict[str, float] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counter = flop_registry.get(func._overloadpacket)
        path = self.stack[-1]
        if counter is not None:
            self.flops[path] = self.flops.get(path, 0.0) + float(counter(*args, **kwargs, out_val=out))
        elif not getattr(func, "is_view", False):  # a view moves nothing
            moved = sum(
                t.numel() * t.element_size()
                for t in tree_leaves((args, kwargs, out))
                if isinstance(t, torch.Tensor)
            )
            self.traffic[path] = self.traffic.get(path, 0.0) + float(moved)
        return out


def count_flops(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, float]:
    """Forward FLOPs of one call of ``model``, per module path (exclusive of submodules)."""
    return _count(model, args, kwargs).flops


def _count(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> _FlopMode:
    """One forward of ``model`` under :class:`_FlopMode`: FLOPs and other ops' bytes per module path."""
    mode = _FlopMode()
    handles = []
    for path, module in model.named_modules():

        def pre(_m: nn.Module, _a: Any, path: str = path) -> None:
            mode.stack.append(path)

        def post(_m: nn.Module, _a: Any, _o: Any) -> None:
            if len(mode.stack) > 1:
                mode.stack.pop()

        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post, always_call=True))
    try:
        with mode, torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return mode


@dataclass(frozen=True)
class ModelProfile:
    """One sample's view of a model: per canonical module path, its own parameters, activation bytes
    (fp32, as traced) and forward FLOPs; plus the transformer shape that TP and p2p costs need."""

    name: str
    model: nn.Module
    example_args: tuple[Any, ...]
    example_kwargs: dict[str, Any]
    seq_len: int
    hidden: int
    """Width of the tensors sent between stages and all-reduced by tensor parallelism."""
    layers: int
    """Transformer layers (blocks of the model's ModuleLists) in the whole model."""
    block_paths: tuple[str, ...]
    """Module paths of those layers, in order."""
    params: dict[str, int] = field(default_factory=dict)
    param_tensors: dict[str, int] = field(default_factory=dict)
    """Parameter tensors per module path (each is one broadcast of torch's ZeroRedundancyOptimizer)."""
    activation_bytes: dict[str, int] = field(default_factory=dict)
    flops: dict[str, float] = field(default_factory=dict)
    traffic: dict[str, float] = field(default_factory=dict)
    """Bytes that the forward's operations other than matrix products read and write (each op reads its
    inputs and writes its outputs in device memory, unfused, as eager PyTorch runs them; views move
    nothing), as built (fp32)."""
    trace: Any = None
    """The partitioner's :class:`mp_partition.TraceResult` (reused for every pipeline degree)."""

    @property
    def num_parameters(self) -> int:
        return sum(self.params.values())

    @property
    def forward_flops(self) -> float:
        """Forward FLOPs of one sample."""
        return sum(self.flops.values())

    @property
    def activation_total(self) -> int:
        """Activation bytes of one sample (fp32)."""
        return sum(self.activation_bytes.values())


def _own_params(model: nn.Module) -> tuple[dict[str, int], dict[str, int]]:
    """Per module path, the elements and the number of the parameters it owns (a shared one counts once)."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    tensors: dict[str, int] = {}
    for path, module in model.named_modules():
        n = k = 0
        for p in module._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                n += int(p.numel())
                k += 1
        out[path] = n
        tensors[path] = k
    return out, tensors


def block_paths(model: nn.Module) -> tuple[str, ...]:
    """Children of every ModuleList with at least two children that hold parameters (the layers)."""
    paths: list[str] = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            kids = [
                f"{path}.{i}" if path else str(i)
                for i, c in enumerate(module)
                if any(True for _ in c.parameters())
            ]
            if len(kids) >= 2:
                paths.extend(kids)
    return tuple(paths)


def _hidden_from(model: nn.Module, config: Any, blocks: tuple[str, ...]) -> int:
    for key in ("d_model", "hidden_size", "n_embd", "dim"):
        value = getattr(config, key, None) if config is not None else None
        if isinstance(value, int) and value > 0:
            return value
    modules = dict(model.named_modules())
    first = modules.get(blocks[0]) if blocks else model
    for m in (first or model).modules():
        if isinstance(m, nn.Linear):
            return int(m.in_features)
        weight = getattr(m, "weight", None)
        if type(m).__name__ == "Conv1D" and isinstance(weight, torch.Tensor):
            return int(weight.shape[0])
    raise PlanError(
        f"cannot tell the hidden size of {type(model).__name__}: expected a config with d_model/hidden_size/"
        "n_embd or an nn.Linear in its layers; pass hidden=... to mp.plan"
    )


def profile_model(
    model: str,
    *,
    seq_len: int,
    overrides: Mapping[str, Any] | None = None,
    factory_kwargs: Mapping[str, Any] | None = None,
    task: str = "auto",
    decoder_seq_len: int | None = None,
    hidden: int | None = None,
    device: str = "meta",
) -> ModelProfile:
    """Builds ``model`` on meta and profiles one sample of ``seq_len`` tokens (see the module docstring).

    ``model`` is a HuggingFace preset/model_type/config path or ``package.module:factory`` (the factory
    returns the module and example inputs of one sample, as for ``mp-partition``). ``device``: where
    the model is built and traced (``meta`` allocates nothing; ``cpu`` for models whose forward reads
    values, e.g. a Hugging Face mask check that calls ``.item()``).
    """
    import mp_tensor  # noqa: F401  (its registrations record constructor arguments of models built after)
    from mp_partition import build_hf_model, load_factory, trace_model

    config: Any = None
    module, sep, attr = model.partition(":")
    if sep and module and attr and not model.endswith(".json"):
        made = load_factory(model, dict(factory_kwargs or {}), device=device)
        net, args, kwargs = made.model, made.args, dict(made.kwargs)
        if not (args or kwargs):
            raise PlanError(
                f"model factory {model!r} returned no example inputs: expected (module, args) with one "
                "sample's inputs, so that activations and FLOPs can be counted"
            )
    else:
        try:
            built = build_hf_model(
                model,
                task=task,
                overrides=dict(overrides or {}),
                device=device,
                seq_len=seq_len,
                decoder_seq_len=decoder_seq_len,
            )
        except Exception as exc:
            raise PlanError(
                f"cannot build model {model!r} ({exc}): expected a HuggingFace preset, model_type, "
                "config.json or package.module:factory"
            ) from exc
        net, args, kwargs, config = built.model, (), dict(built.example_kwargs), built.config
    net.train()
    trace = trace_model(net, args, kwargs)
    counted = _count(net, args, kwargs)
    blocks = block_paths(net)
    width = hidden if hidden is not None else _hidden_from(net, config, blocks)
    acts = {p: trace.activation_bytes(p) for p, _ in net.named_modules()}
    params, tensors = _own_params(net)
    prof = ModelProfile(
        name=model,
        model=net,
        example_args=args,
        example_kwargs=kwargs,
        seq_len=seq_len,
        hidden=width,
        layers=len(blocks),
        block_paths=blocks,
        params=params,
        param_tensors=tensors,
        activation_bytes=acts,
        flops=counted.flops,
        traffic=counted.traffic,
        trace=trace,
    )
    _log.info(
        "profiled %s: %.3gB parameters, %d layers, hidden %d, %.3g forward FLOPs and %.3g MB activations "
        "per sample",
        model,
        prof.num_parameters / 1e9,
        prof.layers,
        width,
        prof.forward_flops,
        prof.activation_total / 1e6,
    )
    return prof


def parse_json_object(text: str | None, what: str) -> dict[str, Any]:
    """A JSON object from the command line (``{}`` for None)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{what} {text!r} is not JSON ({exc}): expected a JSON object") from exc
    if not isinstance(value, dict):
        raise PlanError(f"{what} {text!r} is a {type(value).__name__}: expected a JSON object")
    return value
