"""The smp v1 compatibility registry: every smp name with its status in mp, and the table the docs show.

The names come from ``smp_names.txt`` beside this file (smp v1's documented API; docs/compatibility.md).
Each gets a status, derived from the code where it can be:

- an API name is "built" only if it resolves in mp: ``smp.X.Y`` as an attribute or submodule,
  ``Owner(arg)`` as a parameter of the owner's signature, or one of :data:`INSTANCE_ATTRIBUTES` (set on
  each object at run time; tests/mp/test_compat_table.py checks them on real objects);
- a config key is "not built" when ``smp.init`` refuses it: unknown to ``ModelParallelConfig``, in
  config_rules' table of keys not built, or one of :data:`REFUSED_ENGINES`; "differs" when that table
  says mp builds part of it ("...; mp builds that for ..., not ...").

:data:`NOTES` adds what the code cannot say: where a built name differs from smp, and why a name is
missing. A name that does not resolve and has no note has no status, which the test refuses. Print the
table with ``python -m mp.compat``; ``nox -s docs`` renders it into docs/compatibility.md.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from importlib import resources
from types import ModuleType
from typing import Literal

import mp
from mp import _SOURCES as facade_table  # the facade's one table (this package's own)
from mp.config_model import ModelParallelConfig
from mp.config_rules import _NOT_BUILT

__all__ = [
    "CONFIG_GROUP",
    "INSTANCE_ATTRIBUTES",
    "NOTES",
    "REFUSED_ENGINES",
    "Entry",
    "Status",
    "mp_additions",
    "registry",
    "render_markdown",
    "resolves",
    "smp_names",
]

Status = Literal["built", "differs", "not built"]
CONFIG_GROUP = "config"
"""The group of smp_names.txt that holds config keys (the others hold API names)."""

INSTANCE_ATTRIBUTES = frozenset(
    {
        "DistributedModel.module",
        "StepOutput.outputs",
        "DistributedOptimizer.state_dict",
        "DistributedOptimizer.load_state_dict",
        "DistributedOptimizer.local_state_dict",
        "DistributedOptimizer.local_optimizer_state_dict",
        "DistributedOptimizer.param_name_to_index",
        "DistributedOptimizer.param_index_to_name",
        "DistributedOptimizer.clip_master_grads",
        "DistributedOptimizer.optimizer",
    }
)
"""Names set on each object at run time (``smp.DistributedOptimizer`` is a function that patches the
optimizer, as in smp), so they cannot resolve on the class."""

REFUSED_ENGINES = ("herring", "horovod")
"""Config keys whose ``true`` ``smp.init`` refuses in mp.dp_backend (smp's other data-parallel engines)."""

_PARTLY = "; mp builds that"
"""How config_rules' table marks a key mp builds in part (refused only in some combinations)."""
_LOSS_SCALE = "other than the default only with fp16 (raises otherwise: it would do nothing)"
_DDP = "ddp: true is not needed (mp always has its data-parallel groups)"
_TF = "TensorFlow only in smp"

NOTES: dict[str, tuple[Status, str]] = {
    # -- core
    "DistributedOptimizer": (
        "built",
        "fp16/bf16: returns smp's Bit16 optimizer (fp32 masters, loss scaling)",
    ),
    "nn.FusedLayerNorm": ("differs", "torch's LayerNorm under apex's arguments: same math, no fused kernel"),
    "optimizers.FusedNovoGrad": ("not built", "raises, naming FusedLAMB and FusedAdam"),
    "optimizers.FusedAdam": (
        "differs",
        "torch's fused/foreach Adam(W); amsgrad=True, bias_correction=False raise",
    ),
    "optimizers.FusedLAMB": ("built", "LAMB as apex computes it, norms across stages and TP shards"),
    "optimizers.FusedLamb": ("built", "same class as FusedLAMB"),
    "save_checkpoint(translate_if_full)": (
        "differs",
        "full checkpoints always hold the original (e.g. HF) key names; False is refused",
    ),
    "resume_from_checkpoint(load_sharded_optimizer_state)": (
        "built",
        "False leaves a sharded (sdp or shard_optimizer_state) optimizer state unloaded",
    ),
    "delay_param_initialization": ("built", "with pp and tp: each rank materializes its stage and TP shards"),
    "model_creation": ("built", "delayed init with pp and tp: each rank materializes its stage and shards"),
    # -- tensor parallelism, activation checkpointing
    "checkpoint": ("built", "smp's patches.checkpoint.checkpoint"),
    "patches.checkpoint.checkpoint": ("differs", "not importable by this path: use smp.checkpoint"),
    "patches.checkpoint.checkpoint_sequential": (
        "differs",
        "not importable by this path: use smp.checkpoint_sequential",
    ),
    # -- ranks and groups
    "get_world_process_group": ("built", _DDP),
    "get_mp_process_group": ("built", _DDP),
    "get_dp_process_group": ("built", _DDP),
    "get_tp_process_group": ("built", _DDP),
    "get_pp_process_group": ("built", _DDP),
    "get_rdp_process_group": ("built", _DDP),
    "param_shard_rank": (
        "not built",
        "smp's internal name; sharded data parallelism is built (sharded_data_parallel_degree)",
    ),
    "param_shard_size": (
        "not built",
        "smp's internal name; sharded data parallelism is built (sharded_data_parallel_degree)",
    ),
    # -- DistributedModel
    "DistributedModel(trace_device)": (
        "differs",
        "mp traces where the model is; 'cpu' turns off trace_execution_times",
    ),
    "DistributedModel(overlapping_allreduce)": (
        "differs",
        "overlaps the all-reduce with backward only without tensor parallelism",
    ),
    "DistributedModel(trace_memory_usage)": (
        "built",
        "each rank logs its memory report after the first step (mp's smp.memory_report() on request)",
    ),
    "DistributedModel(gradient_as_bucket_view)": ("differs", "True raises (the memory saving is not built)"),
    "DistributedModel(find_unused_parameters)": (
        "built",
        "no switch needed: unused parameters always handled",
    ),
    "DistributedModel.state_dict(gather_to_rank0)": ("differs", "every rank gets the full state either way"),
    "set_activation_checkpointing(pack_args_as_tuple)": ("built", "deprecated in smp: no effect, as there"),
    "DistributedModel.cuda": (
        "differs",
        "torch's Module.cuda: moves at once (smp ignored it before partitioning)",
    ),
    "DistributedModel.join": ("differs", "not with tensor_parallel_degree > 1 (raises)"),
    "DistributedModel.register_comm_hook": ("differs", "not with tensor_parallel_degree > 1 (raises)"),
    # -- DistributedOptimizer
    "DistributedOptimizer(static_loss_scale)": (
        "built",
        _LOSS_SCALE,
    ),
    "DistributedOptimizer(dynamic_loss_scale)": (
        "built",
        _LOSS_SCALE,
    ),
    "DistributedOptimizer(dynamic_loss_args)": ("built", "as a dict or as keywords"),
    "DistributedOptimizer.local_optimizer_state_dict": ("differs", "fp16/bf16: on optimizer.optimizer"),
    "DistributedOptimizer.param_name_to_index": ("differs", "fp16/bf16: on optimizer.optimizer"),
    "DistributedOptimizer.param_index_to_name": ("differs", "fp16/bf16: on optimizer.optimizer"),
    "DistributedOptimizer.local_fp16_state_dict": ("not built", "local_state_dict holds the fp32 masters"),
    "DistributedOptimizer.optimizer": ("built", "fp16/bf16 only; in fp32 the optimizer itself is returned"),
    # -- StepOutput
    "StepOutput.merge": ("not built", _TF),
    "StepOutput.accumulate": ("not built", _TF),
    # -- smp.nn
    "nn.FlashAttentionLayer(triton_flash_attention)": ("differs", "True raises (no Triton kernel)"),
    "nn.FlashAttentionLayer(use_alibi)": ("differs", "True raises (no ALiBi)"),
    "nn.DistributedTransformerLayer(use_alibi)": (
        "built",
        "on torch's SDPA (no Triton kernel); MPT's slopes, each TP rank its heads'",
    ),
    "nn.DistributedTransformerLayer(rotary_dim)": (
        "built",
        "with rotary_emb_base and gpt_neox_type_rotary (GPT-J or GPT-NeoX pairing); positions 0..S-1",
    ),
    "nn.DistributedTransformerLayer(window_size)": (
        "built",
        "sliding-window causal attention; needs causal_mask_size; per layer via attention_layers_type",
    ),
    "nn.FlashAttentionLayer": (
        "differs",
        "torch's scaled_dot_product_attention; triton_flash_attention and ALiBi raise",
    ),
    # -- exceptions
    "DDPNotEnabledError": ("differs", "never raised: the process groups do not need ddp"),
    "ModelTooSmallError": ("differs", "raised as mp_partition.ModelTooSmallError, not exported as smp.X"),
    "RecursionDepthExceededDuringSerializationError": (
        "not built",
        "no such class in mp",
    ),
    # -- config keys
    "ddp": ("differs", "informational: data and tensor parallelism never need it"),
    "ddp_port": ("built", "the rendezvous store's port; needs no ddp"),
    "ddp_dist_backend": ("built", "'auto', 'nccl', and mp's 'gloo'"),
    "optimize": ("differs", "default 'memory' as documented (smp's source: 'speed')"),
    "contiguous": ("differs", f"{_TF}: accepted, no effect"),
    "checkpoint_attentions": (
        "built",
        "every smp.nn.DistributedTransformerLayer's attention checkpointed; off when pp > 1, as in smp",
    ),
    "_match_weights": ("differs", "internal smp key: accepted, no effect"),
    "bf16": ("differs", "does not require sharded data parallelism"),
    "fp16_params": ("built", "deprecated in smp: logs a warning"),
    "tensor_parallel_degree": ("built", "does not need ddp"),
    "horovod": ("not built", "smp.init refuses true (mp has no Horovod)"),
    "herring": ("not built", "smp.init refuses true (SageMaker's data-parallel library)"),
    "_sharded_data_parallelism_config": ("not built", "refused at smp.init, pointing at the sdp_* keys"),
    "atp_mesh": ("built", "mp extension (not in smp): 2-D tensor-parallel meshes"),
    "atp_topology": ("built", "mp extension (not in smp): the interconnect atp_mesh 'auto' searches on"),
}
"""Per smp name: its status where the code alone would not say it, and a one-line note."""


@dataclass(frozen=True)
class Entry:
    """One row of the compatibility table. ``status`` None means the name has no status (an error)."""

    group: str
    name: str
    status: Status | None
    note: str


def smp_names() -> list[tuple[str, str]]:
    """``(group, name)`` for every smp name in smp_names.txt, in file order."""
    text = resources.files("mp").joinpath("smp_names.txt").read_text(encoding="utf-8")
    group, names = "", []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("## "):
            group = line[3:]
        elif line and not line.startswith("#"):
            names.append((group, line))
    return names


def _lookup(path: str) -> object | None:
    obj: object = mp
    for part in path.split("."):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, ModuleType):
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")
            except ImportError:
                return None
        else:
            return None
    return obj


def resolves(name: str) -> bool:
    """Whether the smp API name ``name`` exists in mp (see the module docstring)."""
    if name.endswith(")"):
        owner, _, arg = name[:-1].partition("(")
        target = _lookup(owner)
        if target is None or not callable(target):
            return False
        try:
            return arg in inspect.signature(target).parameters
        except (TypeError, ValueError):
            return False
    if name in INSTANCE_ATTRIBUTES:
        return _lookup(name.rpartition(".")[0]) is not None
    return _lookup(name) is not None


def _entry(group: str, name: str, present: bool, default: Status | None, why: str) -> Entry:
    """Combine what the code says with NOTES: a name that is not present is never 'built'."""
    noted, note = NOTES.get(name, (None, ""))
    if present:
        return Entry(group, name, noted or "built", note)
    if noted == "built":
        return Entry(group, name, None, f"marked built, but {why}")
    return Entry(group, name, noted or default, note or why)


def _config_entries(spec_keys: list[str]) -> list[Entry]:
    keys = ModelParallelConfig.all_keys()
    accepted = set(keys) | set(ModelParallelConfig.aliases())
    refused = {key: does for key, _, does in _NOT_BUILT}
    rows = []
    for key in [*spec_keys, *(k for k in keys if k not in spec_keys)]:
        if key not in accepted:
            rows.append(
                _entry(CONFIG_GROUP, key, False, "not built", "smp.init refuses it as an unknown key")
            )
        elif key in refused and _PARTLY in refused[key]:
            part = "built " + refused[key].partition(_PARTLY)[2].strip()
            rows.append(_entry(CONFIG_GROUP, key, False, "differs", f"{part} (smp.init refuses the rest)"))
        elif key in refused:
            rows.append(_entry(CONFIG_GROUP, key, False, "not built", f"smp.init refuses it: {refused[key]}"))
        elif key in REFUSED_ENGINES:
            rows.append(_entry(CONFIG_GROUP, key, False, "not built", "smp.init refuses true"))
        else:
            rows.append(_entry(CONFIG_GROUP, key, True, None, ""))
    return rows


def registry() -> list[Entry]:
    """Every smp name (API names in file order, then config keys, then mp's own config keys)."""
    names = smp_names()
    rows = [
        _entry(group, name, resolves(name), None, "not found in mp")
        for group, name in names
        if group != CONFIG_GROUP
    ]
    return rows + _config_entries([name for group, name in names if group == CONFIG_GROUP])


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown() -> str:
    """The compatibility table as markdown: a summary, then one table per group."""
    rows = registry()
    counts = {s: sum(r.status == s for r in rows) for s in ("built", "differs", "not built")}
    lines = [
        f"{len(rows)} names: {counts['built']} built, {counts['differs']} differ from smp, "
        f"{counts['not built']} not built.",
    ]
    for group in dict.fromkeys(r.group for r in rows):
        title = "Configuration keys" if group == CONFIG_GROUP else group
        lines += ["", f"## {title}", "", "| name | status | note |", "|---|---|---|"]
        for r in (r for r in rows if r.group == group):
            shown = f"`{r.name}`" if group == CONFIG_GROUP else f"`smp.{r.name}`"
            lines.append(f"| {shown} | {r.status or 'NO STATUS'} | {_cell(r.note)} |")
    added = mp_additions()
    lines += [
        "",
        "## Names mp adds",
        "",
        f"{len(added)} names of `import mp as smp` that smp v1 does not have (generated from the facade's "
        "table, `mp._SOURCES`).",
        "",
        "| name | provided by |",
        "|---|---|",
    ]
    lines += [f"| `smp.{name}` | `{module}` |" for name, module in added]
    return "\n".join(lines) + "\n"


def mp_additions() -> list[tuple[str, str]]:
    """(name, module) for each name of mp's facade (``mp._SOURCES``) that is not an smp name."""
    smp = {name.split("(")[0] for group, name in smp_names() if group != CONFIG_GROUP}
    smp |= {name.rpartition(".")[2] for name in smp if name.startswith("patches.")}
    smp |= {name.split(".")[0] for name in smp}  # smp.nn, smp.amp: modules whose members smp lists
    found = []
    for module, entries in facade_table.items():
        for entry in entries.split():
            name = entry.partition("=")[0]
            if name not in smp:
                found.append((name, module))
    return sorted(found)


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
