"""Resuming a partial checkpoint under another layout: the model-side half (the parts are merged and
resharded by :mod:`mp_memory.checkpoint.reshard`).

Another pipeline degree, same tensor-parallel degree: each rank reads every stage's part of its own
tp_rank. Together they are the whole model at this rank's TP shards, under mp's names, so no translation
is needed. The model keeps what its own partition assigns it; the optimizer state is matched to
parameters by name (each local optimizer part carries its parameters' names).

Another tensor-parallel degree: each rank reads every part, concatenates the TP shards along the split
dimension each part records (its TP layout), and, where this model has the original module instead of
the saving job's TP block, translates the block back with its registration's ``to_original``. The
result is a full state (and a name-keyed full optimizer state) that loads under any layout.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mp.errors import IncompatibleCheckpointFoundError
from mp.state_dicts import local_layout_check
from mp_memory import read_header
from mp_partition import Placement
from mp_tensor import default_registry

__all__ = ["load_merged_model", "original_names"]


def load_merged_model(module: nn.Module, placement: Placement, merged: dict[str, Any], strict: bool) -> None:
    """Load the whole-model state at this rank's TP shards into ``module``: all of it before
    partitioning (pp > 1: the partition then frees what other stages own), this rank's stage after."""
    header, sd = read_header(merged)
    local_layout_check(module, placement, header.tp_layout)
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module.") :]: v for k, v in sd.items()}
    keys = list(module.state_dict(keep_vars=True))
    if placement.pipelined:
        keys = [k for k in keys if placement.holds(k)]
        sd = {k: v for k, v in sd.items() if k in set(keys)}
    missing = sorted(set(keys) - set(sd))
    if strict and missing:
        raise IncompatibleCheckpointFoundError(
            f"the partial checkpoint's parts lack {len(missing)} keys of this model {missing[:6]}: it was "
            "saved from another model; load the model it was saved from (or pass strict=False)"
        )
    module.load_state_dict(sd, strict=False)


def original_names(model: nn.Module, full: dict[str, Any]) -> dict[str, Any]:
    """``full`` with the saving job's TP blocks translated back where ``model`` has the original
    module (a tp = 1 job without them); unchanged where this model has the same TP blocks.

    The model itself counts: smp's whole-stack layout replaces the whole Hugging Face model (GPT-2,
    GPT-J, GPT-NeoX...), so a job that builds the plain model finds the saved state under the
    replacement's names at the root, and the root's registration translates all of it."""
    if set(full) <= set(model.state_dict(keep_vars=True)):
        return full
    out = dict(full)
    done: list[str] = []
    for path, module in model.named_modules():
        prefix = path + "." if path else ""
        if any(prefix.startswith(p) for p in done):
            continue  # inside a module already translated: its keys are the original ones now
        found = default_registry.lookup(module)
        if found is None:
            continue
        registration = found.for_module(module)  # GPT-NeoX's translations need its head count
        part = {k[len(prefix) :]: v for k, v in full.items() if k.startswith(prefix)}
        if not part or set(part) <= set(module.state_dict(keep_vars=True)):
            continue
        for key in part:
            out.pop(prefix + key, None)
        translated = part if registration.to_original is None else registration.to_original(part)
        out.update({prefix + k: v for k, v in translated.items()})
        done.append(prefix)
    return out
