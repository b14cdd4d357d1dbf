"""Full optimizer state keyed by the original model's parameter names, for tensor-parallel models.

smp refused full optimizer state under tensor parallelism. Its index numbering cannot survive a layout
change: a TP model has other parameters (a GPT-2 block's fused ``c_attn`` is three TP ``query``/``key``/
``value`` shards) than the same model at tp = 1. So under TP the full optimizer state names each
parameter as the original module does and holds full tensors: each per-parameter state tensor
(``exp_avg``, ``momentum_buffer``, ...) is gathered over the TP group and translated with the same
``to_original`` as the weights; loading runs ``from_original`` and keeps this rank's shard. The result
loads under any pp, tp and dp; an index-numbered full state (saved without TP) converts to it by the
parameter names it carries.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mp.errors import IncompatibleCheckpointFoundError
from mp_memory import Header, write_header
from mp_partition import Placement
from mp_tensor import ORIGINAL_ATTR, DistributedModule, Replacement, distributed_roots, param_spec

__all__ = ["has_tp_roots", "load_named_state", "named_state", "param_names_by_id"]

Roots = list[tuple[str, DistributedModule]]


def has_tp_roots(module: nn.Module) -> bool:
    """Whether ``module`` holds tensor-parallel modules (its full optimizer state is then name-keyed)."""
    return any(True for _ in distributed_roots(module))


def param_names_by_id(module: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in module.named_parameters()}


def _root(name: str, roots: Roots) -> tuple[str, DistributedModule] | None:
    return next(((p, m) for p, m in roots if name.startswith(p)), None)


def _to_original(root: DistributedModule, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    found = root.__dict__.get(ORIGINAL_ATTR)
    return found.to_original(sd) if isinstance(found, Replacement) else dict(sd)


def _from_original(root: DistributedModule, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    found = root.__dict__.get(ORIGINAL_ATTR)
    return found.from_original(sd) if isinstance(found, Replacement) else dict(sd)


def _full_shape(root: DistributedModule, p: torch.Tensor) -> list[int]:
    shape = list(p.shape)
    spec = param_spec(p)
    if spec is not None and spec.split_dim is not None:
        shape[spec.split_dim % p.dim()] *= root.tp.size
    return shape


def _original_param_names(prefix: str, root: DistributedModule) -> list[str]:
    """The original names of a root's parameters (translated on the meta device: no data, no comm)."""
    meta = {n: torch.empty(_full_shape(root, p), device="meta") for n, p in root.named_parameters()}
    return [prefix + k for k in _to_original(root, meta)]


@torch.no_grad()
def _gather(root: DistributedModule, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors from this TP rank's shards (collective over the root's TP group, in name order)."""
    params = dict(root.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shards):
        value = shards[name].detach()
        spec = param_spec(params[name])
        if spec is None or spec.split_dim is None or not root.tp.distributed:
            out[name] = value.cpu().clone()
            continue
        parts = [torch.empty_like(value) for _ in range(root.tp.size)]
        dist.all_gather(parts, value.contiguous(), group=root.tp.group)
        out[name] = torch.cat(parts, dim=spec.split_dim % value.dim()).cpu()
    return out


def named_state(
    optimizer: torch.optim.Optimizer, module: nn.Module, placement: Placement, all_groups: list[list[Any]]
) -> dict[str, Any]:
    """The full optimizer state of ``module``'s parameters, placed by ``placement``, by original
    parameter names (collective over the TP and PP groups)."""
    roots: Roots = list(distributed_roots(module))
    names = param_names_by_id(module)
    mine: dict[str, dict[str, Any]] = {}
    by_root: dict[str, dict[str, dict[str, Any]]] = {}
    # A root the pipeline split over stages (the whole GPT-2's LM head) is translated once every stage's
    # part is in: its translation needs the whole module (prefix -> state key -> own name -> tensor).
    split = _split_roots(placement, roots)
    deferred: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if not st:
                continue
            name = names[id(p)]
            found = _root(name, roots)
            if found is None:
                mine[name] = {
                    k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()
                }
            else:
                by_root.setdefault(found[0], {})[name[len(found[0]) :]] = st
    for prefix, root in roots:
        states = by_root.get(prefix)
        if not states:
            continue
        shapes = {n: p.shape for n, p in root.named_parameters()}
        keys = sorted({k for st in states.values() for k in st})
        for key in keys:
            tensors = {
                n: st[key]
                for n, st in states.items()
                if isinstance(st.get(key), torch.Tensor) and st[key].shape == shapes[n]
            }
            if tensors and prefix in split:
                deferred.setdefault(prefix, {}).setdefault(key, {}).update(_gather(root, tensors))
            elif tensors:  # per-element state: gathered and translated like the weights
                for orig, value in _to_original(root, _gather(root, tensors)).items():
                    mine.setdefault(prefix + orig, {})[key] = value
            elif prefix in split:
                deferred.setdefault(prefix, {})[key] = next(st[key] for st in states.values() if key in st)
            else:  # per-parameter scalars (Adam's step): the same for every parameter of the module
                value = next(st[key] for st in states.values() if key in st)
                for orig in _original_param_names(prefix, root):
                    mine.setdefault(orig, {})[key] = (
                        value.clone() if isinstance(value, torch.Tensor) else value
                    )
    if placement.pipelined:
        placement.enter("optimizer.state_dict()")
        parts: list[Any] = [None] * placement.pp_size
        dist.all_gather_object(parts, (mine, deferred), group=placement.pp_group)
        deferred = {}
        for part, later in parts:
            mine.update(part)
            for prefix, keys in later.items():
                for key, value in keys.items():
                    into = deferred.setdefault(prefix, {})
                    if isinstance(value, dict):
                        into.setdefault(key, {}).update(value)
                    else:
                        into[key] = value
        _translate_deferred(mine, deferred, roots)
    full = {"state": mine, "param_groups": _named_groups(optimizer, all_groups, roots, names)}
    return write_header(full, Header(keyed_by_name=True))


def _translate_deferred(
    mine: dict[str, dict[str, Any]], deferred: dict[str, dict[str, Any]], roots: Roots
) -> None:
    """Add the split roots' states (every stage's, own names) to ``mine`` under the original names."""
    for prefix, keys in deferred.items():
        root = dict(roots)[prefix]
        for key, value in keys.items():
            if isinstance(value, dict):  # per-element tensors
                for orig, full in _to_original(root, value).items():
                    mine.setdefault(prefix + orig, {})[key] = full
                continue
            for orig in _original_param_names(prefix, root):  # a scalar of every parameter
                mine.setdefault(orig, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value


def _split_roots(placement: Placement, roots: Roots) -> set[str]:
    """The roots whose parameters lie on several pipeline stages."""
    if not placement.pipelined:
        return set()
    return {p for p, root in roots if len({placement.owner(p + n) for n, _ in root.named_parameters()}) > 1}


def _named_groups(
    optimizer: torch.optim.Optimizer,
    all_groups: list[list[Any]],
    roots: Roots,
    names: dict[int, str],
) -> list[dict[str, Any]]:
    out = []
    seen: set[str] = set()
    for group, params in zip(optimizer.param_groups, all_groups, strict=True):
        listed: list[str] = []
        for p in params:
            name = names[id(p)]
            found = _root(name, roots)
            if found is None:
                listed.append(name)
            elif found[0] not in seen:
                seen.add(found[0])
                listed += _original_param_names(*found)
        out.append({**{k: v for k, v in group.items() if k != "params"}, "params": listed})
    return out


def load_named_state(
    optimizer: torch.optim.Optimizer,
    module: nn.Module,
    sd: dict[str, Any],
    all_groups: list[list[Any]],
    *,
    translate: bool = True,
) -> None:
    """Load a name-keyed state into the optimizer of ``module``'s parameters: this rank's parameters
    (those its groups hold), TP shards cut from the full tensors
    (``translate=False``: the state already holds this rank's shards under mp's names)."""
    saved_groups = sd["param_groups"]
    if len(saved_groups) != len(all_groups):
        raise IncompatibleCheckpointFoundError(
            f"the optimizer state has {len(saved_groups)} parameter groups; this optimizer has "
            f"{len(all_groups)}: build the optimizer as in the saving job"
        )
    roots: Roots = list(distributed_roots(module)) if translate else []
    names = param_names_by_id(module)
    saved: dict[str, dict[str, Any]] = sd["state"]
    cache: dict[str, dict[str, dict[str, Any]]] = {}
    local: dict[int, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    index = 0
    for group, saved_group in zip(optimizer.param_groups, saved_groups, strict=True):
        params: list[int] = []
        for p in group["params"]:
            name = names[id(p)]
            found = _root(name, roots)
            if found is None:
                st = saved.get(name)
            else:
                if found[0] not in cache:
                    cache[found[0]] = _localize_root(found[0], found[1], saved)
                st = cache[found[0]].get(name[len(found[0]) :])
            if st:
                local[index] = st
            params.append(index)
            index += 1
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": params})
    torch.optim.Optimizer.load_state_dict(optimizer, {"state": local, "param_groups": groups})


def _localize_root(
    prefix: str, root: DistributedModule, saved: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per parameter of ``root`` (its own names), this rank's shard of each saved state entry."""
    originals = {k[len(prefix) :]: st for k, st in saved.items() if k.startswith(prefix)}
    if not originals:
        return {}
    params = dict(root.named_parameters())
    # Saved by a job with the same distributed module (another tp or pp degree): already its own names.
    own_names = set(originals) <= set(params)
    out: dict[str, dict[str, Any]] = {}
    keys = sorted({k for st in originals.values() for k in st})
    for key in keys:
        tensors = {
            n: st[key]
            for n, st in originals.items()
            if isinstance(st.get(key), torch.Tensor) and st[key].dim() > 0
        }
        if tensors and len(tensors) == len(originals):
            for name, full in (tensors if own_names else _from_original(root, tensors)).items():
                if name in params:
                    spec = param_spec(params[name])
                    shard = root.shard(full, None if spec is None else spec.split_dim)
                    out.setdefault(name, {})[key] = shard.clone()
        else:
            value = next(st[key] for st in originals.values() if key in st)
            for name in params:
                out.setdefault(name, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
    return out
