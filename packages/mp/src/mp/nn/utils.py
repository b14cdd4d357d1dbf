"""``smp.nn.utils``: parameter creation scopes and TP collectives for custom distributed modules."""

from mp_tensor import (
    bwd_allreduce_for_tp,
    fused_allgather_for_tp,
    fwd_allreduce_for_tp,
    initialize_with_input_partition,
    initialize_with_output_partition,
    parameter_creation_scope,
    reduce_scatter_for_tp,
    scatter_and_merge_for_tp,
)

__all__ = [
    "bwd_allreduce_for_tp",
    "fused_allgather_for_tp",
    "fwd_allreduce_for_tp",
    "initialize_with_input_partition",
    "initialize_with_output_partition",
    "parameter_creation_scope",
    "reduce_scatter_for_tp",
    "scatter_and_merge_for_tp",
]
