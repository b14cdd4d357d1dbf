"""``ModelParallelConfig``: every smp v1 configuration key, its type, default and rules.

The keys, types and defaults are smp's (docs/config.md). Where smp's
documentation [D] and its source [S] disagree, the documented value is taken and the field says so.
Values are checked on construction; the first problem raises :class:`~mp.errors.ConfigError` (a
ValueError). Checks run in a fixed order (each key in sorted key order, then the rules between keys
in sorted order of the key they are about), so every rank raises the identical error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from mp.config_rules import alias_conflict, check_rules, log_resolutions, unknown_key
from mp.config_schema import KeySpec, check_value, config_error, show

__all__ = ["MAX_MICROBATCHES", "ModelParallelConfig"]

_SPEC = "mp.spec"
MAX_MICROBATCHES = 2**20
"""The most microbatches a step may split into (a batch of one sample per microbatch, far beyond any
pipeline's use; a typo such as 10**12 is refused at smp.init instead of exhausting memory)."""
PLACEMENTS = ("cluster", "spread", "DPT", "DTP", "PDT", "PTD", "TDP", "TPD")
_NAMED_PLACEMENTS = {"cluster": "DPT", "spread": "TPD"}


def _key(default: object, spec: KeySpec) -> Any:
    return field(default=default, metadata={_SPEC: spec})


@dataclass(frozen=True, kw_only=True, repr=False)
class ModelParallelConfig:
    """The smp v1 configuration: pass it (or a dict of the same keys) to ``smp.init``.

    Build one from keyword arguments, from a dict with :meth:`from_dict` (which also takes smp's
    aliases such as ``partitions``), or from a file or the environment with ``mp.config.load_config``.
    """

    # ------------------------------------------------------------------------------- pipeline
    pipeline_parallel_degree: int = _key(
        1, KeySpec(kind="int", minimum=1, aliases=("partitions",), example="2")
    )
    """Number of pipeline stages (model partitions). Alias: ``partitions`` (its name before smp 1.6);
    giving both with different values is an error. smp's docs call it required, its source defaults
    to 1; mp defaults to 1 (no pipelining)."""
    microbatches: int = _key(1, KeySpec(kind="int", minimum=1, maximum=MAX_MICROBATCHES, example="4"))
    """Microbatches per step; 1 means no pipelining. The batch size must be divisible by it, so it is at
    most 2**20 (1048576): each microbatch holds at least one sample, and the per-step bookkeeping of a
    larger count would exhaust memory before the first step."""
    pipeline: Literal["interleaved", "simple", "zero_bubble"] = _key(
        "interleaved",
        KeySpec(kind="str", choices=("interleaved", "simple", "zero_bubble"), example='"interleaved"'),
    )
    """Pipeline schedule. "simple" runs all forwards then all backwards; when an explicit
    ``active_microbatches`` is below ``microbatches`` the schedule is forced to "interleaved" (smp's
    rule, logged at info level; see :attr:`resolved_pipeline`). "zero_bubble" (mp's addition, not in
    smp): "interleaved" with each remote call's backward split, its input gradients sent at once and its
    weight gradients computed when the rank would otherwise wait (docs/pipeline.md); not with
    tensor_parallel_degree > 1."""
    optimize: Literal["memory", "speed"] = _key(
        "memory", KeySpec(kind="str", choices=("memory", "speed"), example='"speed"')
    )
    """Tensor-parallel transformer implementation: "speed" communicates less and does not distribute
    layernorm, "memory" stores no duplicate activations. Default "memory" as documented; smp's source
    defaulted to "speed" (set it explicitly when porting a script that relied on that)."""
    placement_strategy: Literal["cluster", "spread", "DPT", "DTP", "PDT", "PTD", "TDP", "TPD"] = _key(
        "cluster", KeySpec(kind="str", choices=PLACEMENTS, example='"cluster"')
    )
    """Rank layout: "cluster" (= "DPT"), "spread" (= "TPD") or a permutation of D (reduced data), P
    (pipeline), T (tensor); the right-most letter varies fastest over consecutive ranks."""
    auto_partition: bool = _key(True, KeySpec(kind="bool", example="true"))
    """Partition the model automatically. If false, ``default_partition`` must be given."""
    default_partition: int | None = _key(None, KeySpec(kind="int", minimum=0, nullable=True, example="0"))
    """Partition for modules outside any ``smp.partition`` context, in [0, pipeline_parallel_degree).
    None means not given and resolves to 0, the documented default (smp's source kept None); it must
    be given when ``auto_partition`` is false."""
    contiguous: bool = _key(True, KeySpec(kind="bool", example="true"))
    """Whether each partition must be a connected part of the graph (a TensorFlow option in smp;
    accepted for compatibility)."""
    horovod: bool = _key(False, KeySpec(kind="bool", example="false"))
    """smp: data parallelism through Horovod (TensorFlow). mp has no Horovod: ``smp.init`` refuses true
    (mp.dp_backend); it may not be true together with ``ddp`` either (smp's rule)."""
    memory_weight: float | None = _key(
        None, KeySpec(kind="float", minimum=0.0, maximum=1.0, nullable=True, example="0.8")
    )
    """Weight of memory balance (vs compute balance) in auto-partitioning, in [0, 1]. None: the plan
    balances the stage times measured on the first microbatch, unless the largest stage would not fit
    in memory (then the smallest weight in 0.2..1.0 that fits; mp_partition). Without a timed step
    (manual partitioning, ``skip_tracing``) None resolves to the documented default, 0.2 if
    ``optimize`` is "speed" else 0.8 (smp's source: always 0.8). An int (0 or 1) is accepted as JSON
    writes it, unlike smp's exact type check."""

    # ---------------------------------------------------------------------- data parallelism
    ddp: bool = _key(False, KeySpec(kind="bool", example="true"))
    """smp: enables DistributedDataParallel, which smp required for any data parallelism and for tensor
    parallelism. Accepted and informational in mp: mp always reduces gradients over its data-parallel
    groups, so neither ``world size > pp*tp`` nor ``tensor_parallel_degree > 1`` requires it (a
    deliberate relaxation of smp's rules)."""
    ddp_port: int | None = _key(
        None, KeySpec(kind="int", minimum=0, maximum=65535, nullable=True, example="29500")
    )
    """TCP port for the torch.distributed rendezvous store (smp source only): rank 0 listens on it (under
    torchrun it replaces MASTER_PORT). None or 0 leaves the choice to mp (a free port under mpiexec) or
    the launcher. smp required ``ddp`` for it; mp does not (``ddp`` is informational)."""
    ddp_dist_backend: Literal["auto", "nccl", "gloo"] = _key(
        "auto", KeySpec(kind="str", choices=("auto", "nccl", "gloo"), example='"auto"')
    )
    """Collective backend. "auto" (documented default from smp 1.13; smp 1.12.1's source had "nccl" as
    the only choice) picks NCCL on GPUs and gloo on CPU; "nccl" asks for NCCL (an error without CUDA;
    gloo stays beside it for CPU tensors); mp adds "gloo", which carries CUDA tensors through the host."""

    # ----------------------------------------------------------------- pipeline runtime
    active_microbatches: int | None = _key(None, KeySpec(kind="int", minimum=1, nullable=True, example="2"))
    """Most microbatches in flight at once, in [1, microbatches]. None resolves to
    ``min(pipeline_parallel_degree + 2, microbatches)``, or to ``microbatches`` under the "simple"
    pipeline (mp's choice: smp would force such a config to "interleaved")."""
    deterministic_server: bool = _key(False, KeySpec(kind="bool", example="false"))
    """Execute pipeline requests in the same order on all data-parallel ranks (documented; absent
    from smp 1.12.1's schema)."""
    offload_activations: bool = _key(False, KeySpec(kind="bool", example="false"))
    """Offload checkpointed activations to CPU; has an effect only with activation checkpointing and
    more than one microbatch."""
    activation_loading_horizon: int = _key(4, KeySpec(kind="int", minimum=1, example="4"))
    """How many pipeline tasks ahead offloaded activations are loaded back; > 0 as the developer guide
    says (smp's source allowed 0)."""

    # --------------------------------------------------------------- tensor parallelism
    tensor_parallel_degree: int = _key(1, KeySpec(kind="int", minimum=1, example="2"))
    """Number of ranks a tensor-parallel module is split over. smp required ``ddp`` when it is > 1;
    mp does not (see ``ddp``)."""
    prescaled_batch: bool = _key(False, KeySpec(kind="bool", example="false"))
    """Tensor-parallel ranks receive the same batch (shard data by rdp_rank/rdp_size). Requires
    ``optimize`` "speed" (smp's rule; with the documented default "memory" that must now be explicit)."""
    tensor_parallel_seed: int = _key(0, KeySpec(kind="int", minimum=0, maximum=2**64 - 1, example="0"))
    """RNG seed for tensor-parallel modules (smp source only)."""
    atp_mesh: str | None = _key(None, KeySpec(kind="str", nullable=True, example='"auto"'))
    """mp extension (ATP, docs/atp.md): arrange each tensor-parallel group as a 2-D ``DeviceMesh(d1, d2)``
    for the ``mp_tensor.atp`` modules. None (default): no mesh. ``"auto"``: the mesh with the least
    predicted communication time on the topology of ``atp_topology`` (equations 2-4 of the ATP paper).
    ``"D1xD2"`` (e.g. ``"2x2"``; ``"4x1"`` is Megatron-style 1-D TP): that mesh, with D1*D2 equal to
    ``tensor_parallel_degree``. Needs ``tensor_parallel_degree`` > 1."""
    atp_topology: str | None = _key(None, KeySpec(kind="str", nullable=True, example='"calibrate"'))
    """mp extension: the interconnect that ``atp_mesh: "auto"`` searches on. None or ``"calibrate"``:
    measure it at ``smp.init`` (all-reduces timed on every mesh's axis groups of this machine); a preset
    (``"nvswitch"``, ``"dual-nvlink"``, ``"pcie"``); or the path of a JSON file written by
    ``mp_tensor.atp.CommMatrix.save``. Only with ``atp_mesh: "auto"``."""

    # ---------------------------------------------------------------------- precision
    fp16: bool = _key(False, KeySpec(kind="bool", example="true"))
    """FP16 training: the model is wrapped for fp16 and the optimizer gets loss scaling."""
    fp16_params: bool = _key(False, KeySpec(kind="bool", example="false"))
    """Initialize distributed-module parameters in fp16. Deprecated in smp in favour of ``fp16``
    (a warning is logged)."""
    bf16: bool = _key(False, KeySpec(kind="bool", example="true"))
    """BF16 training; requires ``fp16`` and ``fp16_params`` false. The developer guide says bf16 works
    only with sharded data parallelism; mp does not require that."""

    # ------------------------------------------------------------------------- memory
    shard_optimizer_state: bool = _key(False, KeySpec(kind="bool", example="true"))
    """Shard optimizer state over the reduced-data-parallel group (save partial optimizer state).
    Conflicts with ``sharded_data_parallel_degree`` > 1, which shards it already. smp also required
    ``ddp``; mp does not."""
    skip_tracing: bool = _key(False, KeySpec(kind="bool", example="false"))
    """Skip the tracing step (for models too large to trace even on CPU)."""
    delayed_parameter_initialization: bool = _key(False, KeySpec(kind="bool", example="true"))
    """Delay parameter allocation and initialization until after partitioning (used by
    ``smp.model_creation``). Absent from smp's docs table, present in its source and AWS examples."""
    checkpoint_attentions: bool = _key(False, KeySpec(kind="bool", example="false"))
    """Internal smp key: checkpoint the attention of every ``smp.nn.DistributedTransformerLayer``
    (mp.activation_checkpointing.checkpoint_attentions). Automatically disabled when
    ``pipeline_parallel_degree`` > 1 (logged; see :attr:`resolved_checkpoint_attentions`)."""

    # ------------------------------------------------------------ sharded data parallelism
    sharded_data_parallel_degree: int = _key(1, KeySpec(kind="int", minimum=1, example="2"))
    """Sharded data parallelism (parameters, gradients and optimizer state split over this many
    ranks); 1 disables it. It must divide the data-parallel size, and > 1 is incompatible with
    pipeline and tensor parallelism and with ``shard_optimizer_state``."""
    sdp_reduce_bucket_size: int = _key(
        500_000_000, KeySpec(kind="int", minimum=1, integral_float=True, example="500000000")
    )
    """Gradient bucket size in elements under sharded data parallelism (default 5e8; an integral
    float such as 5e8 is accepted)."""
    sdp_param_persistence_threshold: int = _key(
        1_000_000, KeySpec(kind="int", minimum=0, integral_float=True, example="1000000")
    )
    """Parameters with fewer elements than this are not sharded (default 1e6)."""
    sdp_max_live_parameters: int = _key(
        1_000_000_000, KeySpec(kind="int", minimum=1, integral_float=True, example="1000000000")
    )
    """Most parameters recombined (all-gathered) at once (default 1e9)."""
    sdp_hierarchical_allgather: bool = _key(True, KeySpec(kind="bool", example="true"))
    """All-gather within each node first, then across nodes."""
    sdp_gradient_clipping: float = _key(1.0, KeySpec(kind="float", minimum=0.0, example="1.0"))
    """L2-norm gradient clipping threshold applied under sharded data parallelism; 0 disables clipping
    (the DeepSpeed convention smp's implementation followed). An int is accepted."""

    # ----------------------------------------------------------------------- static graph
    fast_mode: bool | None = _key(None, KeySpec(kind="bool", nullable=True, example="true"))
    """Internal smp key: send tensors child-to-child rather than through the parent. True: smp's fast
    mode, where a step whose flow changed raises NotSupportedByFastModeError. None (mp's default,
    unless ``static_mode`` is set): the same shortcut, and a step whose flow changed is taken back and
    run again on the full path (mp.step_retry). False: every output returns through the parent."""
    static_mode: bool = _key(False, KeySpec(kind="bool", example="false"))
    """Internal smp key: for a static graph, skip the request/response exchange and post receives
    early. No rule ties it to other keys."""

    # ------------------------------------------------------------- other internal smp keys
    fp32_grad_accumulation: bool = _key(
        False, KeySpec(kind="bool", key="_fp32_grad_accumulation", example="false")
    )
    """Internal smp key ``_fp32_grad_accumulation``: accumulate half-precision gradients in fp32."""
    match_weights: bool = _key(False, KeySpec(kind="bool", key="_match_weights", example="false"))
    """Internal smp key ``_match_weights`` (seen in AWS example configs); accepted for compatibility."""
    shard_offloaded_activations: bool = _key(
        False, KeySpec(kind="bool", key="_shard_offloaded_activations", example="false")
    )
    """Internal smp key ``_shard_offloaded_activations``: shard offloaded activations over
    tensor-parallel ranks. smp's default is not documented; mp's is False."""
    task_level_activation_loading_horizon: int | None = _key(
        None, KeySpec(kind="int", minimum=0, nullable=True, example="4")
    )
    """Internal smp key: a per-task activation loading horizon; None leaves it to the runtime."""
    herring: bool = _key(False, KeySpec(kind="bool", example="false"))
    """Internal smp key: use SageMaker's data-parallel library (herring), which mp does not have:
    ``smp.init`` refuses true."""
    load_partition: bool = _key(False, KeySpec(kind="bool", example="false"))
    """Internal smp key: read the partition decision from ``partition_file`` instead of computing it
    (no tracing); requires ``partition_file``."""
    partition_file: str | None = _key(None, KeySpec(kind="str", nullable=True, example='"partition.json"'))
    """Internal smp key: a JSON file for the partition decision. Global rank 0 writes the decision there
    once the model is partitioned, unless ``load_partition`` reads it from there (mp.partition_file)."""

    def __post_init__(self) -> None:
        for key, (name, spec) in sorted(_SPECS.items()):
            value = getattr(self, name)
            normalized = check_value(key, spec, value)
            if normalized is not value:
                object.__setattr__(self, name, normalized)
        check_rules(self)
        log_resolutions(self)

    def __repr__(self) -> str:
        """Only the fields that differ from their defaults, in declaration order."""
        changed = (
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default or type(getattr(self, f.name)) is not type(f.default)
        )
        return f"{type(self).__name__}({', '.join(changed)})"

    # -------------------------------------------------------------------- derived values
    @property
    def pp(self) -> int:
        """Pipeline parallel degree."""
        return self.pipeline_parallel_degree

    @property
    def partitions(self) -> int:
        """smp's old name of ``pipeline_parallel_degree``."""
        return self.pipeline_parallel_degree

    @property
    def tp(self) -> int:
        """Tensor parallel degree."""
        return self.tensor_parallel_degree

    @property
    def sdp(self) -> int:
        """Sharded data parallel degree."""
        return self.sharded_data_parallel_degree

    @property
    def mp_size(self) -> int:
        """Ranks holding one model replica: pp * tp."""
        return self.pipeline_parallel_degree * self.tensor_parallel_degree

    @property
    def placement_order(self) -> str:
        """The placement strategy as a permutation of "DPT" ("cluster" -> "DPT", "spread" -> "TPD")."""
        return _NAMED_PLACEMENTS.get(self.placement_strategy, self.placement_strategy)

    @property
    def resolved_memory_weight(self) -> float:
        """``memory_weight``, or its documented default: 0.2 if optimize == "speed" else 0.8."""
        if self.memory_weight is not None:
            return self.memory_weight
        return 0.2 if self.optimize == "speed" else 0.8

    @property
    def resolved_active_microbatches(self) -> int:
        """``active_microbatches``, or min(pp + 2, microbatches) (all microbatches under "simple")."""
        if self.active_microbatches is not None:
            return self.active_microbatches
        if self.pipeline == "simple":
            return self.microbatches
        return min(self.pipeline_parallel_degree + 2, self.microbatches)

    @property
    def resolved_pipeline(self) -> Literal["interleaved", "simple", "zero_bubble"]:
        """The schedule that runs: "simple" becomes "interleaved" when fewer microbatches are active."""
        if self.pipeline == "simple" and self.resolved_active_microbatches != self.microbatches:
            return "interleaved"
        return self.pipeline

    @property
    def resolved_default_partition(self) -> int:
        """``default_partition``, or 0 when not given."""
        return 0 if self.default_partition is None else self.default_partition

    @property
    def resolved_checkpoint_attentions(self) -> bool:
        """``checkpoint_attentions``, disabled when pipeline parallelism is on."""
        return self.checkpoint_attentions and self.pipeline_parallel_degree == 1

    @property
    def precision(self) -> Literal["fp32", "fp16", "bf16"]:
        """Training precision: "bf16", "fp16" or "fp32"."""
        if self.bf16:
            return "bf16"
        return "fp16" if self.fp16 else "fp32"

    # ------------------------------------------------------------------ dict conversion
    @classmethod
    def specs(cls) -> Mapping[str, tuple[str, KeySpec]]:
        """Per smp key: the field name and the spec, in declaration order."""
        return MappingProxyType(_SPECS)

    @classmethod
    def all_keys(cls) -> tuple[str, ...]:
        """Every config key (smp's names, no aliases), in declaration order."""
        return tuple(_SPECS)

    @classmethod
    def aliases(cls) -> dict[str, str]:
        """Every other accepted name, mapped to its config key."""
        return {
            alias: key
            for key, (name, spec) in _SPECS.items()
            for alias in (*spec.aliases, *((name,) if name != key else ()))
        }

    def to_dict(self) -> dict[str, object]:
        """The config as a JSON-serializable dict of smp keys (None for keys left to derive)."""
        return {key: getattr(self, name) for key, (name, _) in _SPECS.items()}

    @classmethod
    def from_dict(cls, params: Mapping[str, object]) -> ModelParallelConfig:
        """Build a config from a flat dict of smp keys (aliases accepted), checking everything.

        The SageMaker nesting ({"smdistributed": {"modelparallel": ...}}) is unwrapped by
        ``mp.config.load_config``, not here. Raises :class:`ConfigError`.
        """
        if not isinstance(params, Mapping):
            raise config_error(
                None,
                params,
                " where a dict of config keys was expected",
                "a dict (mapping) from config keys to values",
                "pass a dict such as {'pipeline_parallel_degree': 2, 'microbatches': 4}",
            )
        for raw in sorted((k for k in params if not isinstance(k, str)), key=repr):
            raise config_error(
                None, raw, " as a config key", "string keys only", f"write the key {show(raw)} as a string"
            )
        names = {key: key for key in _SPECS} | cls.aliases()
        for key in sorted(params):
            if key not in names:
                raise unknown_key(key, params[key], names, len(_SPECS))
        given: dict[str, list[tuple[str, Any]]] = {}
        for key in sorted(params):
            canonical = names[key]
            name, spec = _SPECS[canonical]
            given.setdefault(name, []).append((key, check_value(key, spec, params[key])))
        for entries in given.values():
            (key_a, val_a), *rest = entries
            for key_b, val_b in rest:
                if val_a != val_b or type(val_a) is not type(val_b):
                    raise alias_conflict(key_a, val_a, key_b, val_b)
        return cls(**{name: entries[0][1] for name, entries in given.items()})


_SPECS: dict[str, tuple[str, KeySpec]] = {
    (f.metadata[_SPEC].key or f.name): (f.name, f.metadata[_SPEC])
    for f in dataclasses.fields(ModelParallelConfig)
}
"""Per smp key: the field name and the spec, in declaration order (``ModelParallelConfig.specs``)."""
