"""``DistributedEmbedding``: ``nn.Embedding`` split along ``embedding_dim`` (seed 001 §5.3).

The input indices are all-gathered over the TP group, each rank looks up its slice of the embedding
vectors for every index, and an all-to-all returns each rank its own samples with all slices
concatenated. With ``prescaled_batch`` the indices are already the same on every rank, so the lookup is
followed by an all-gather of the slices. ``_skip_allgather`` says the indices are already the TP group's
(no gather); ``_skip_scatter_and_merge`` returns the ``sharded`` layout ``[T*B, ..., D/T]`` instead
(what the transformer modules take in "memory" mode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mp_tensor.context import TPContext
from mp_tensor.dist_ops import gather_samples, leave
from mp_tensor.errors import DistEmbeddingConfigError, TPInputError
from mp_tensor.nn.base import DistributedModule, ParamSpec, set_param_spec

__all__ = ["DistributedEmbedding"]


class DistributedEmbedding(DistributedModule):
    """Tensor-parallel ``nn.Embedding``; its full state dict is that of ``nn.Embedding``.

    Initialization is N(0, ``initializer_range``) (row ``padding_idx`` zero). ``max_norm`` and
    ``_weight`` are not supported (as in smp).
    """

    def __init__(  # noqa: PLR0917
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Tensor | None = None,
        initializer_range: float = 0.02,
        _skip_allgather: bool = False,
        _skip_scatter_and_merge: bool = False,
        *,
        tp: TPContext | None = None,
    ) -> None:
        super().__init__(tp=tp)
        if max_norm is not None:
            raise DistEmbeddingConfigError(
                f"DistributedEmbedding got max_norm={max_norm}; renormalizing distributed rows is not "
                "supported. Pass max_norm=None (or leave this embedding undistributed)."
            )
        if _weight is not None:
            raise DistEmbeddingConfigError(
                "DistributedEmbedding got an initial _weight; pass _weight=None and load the weight with "
                "load_full_state_dict({'weight': w}) instead."
            )
        if embedding_dim % self.tp_size:
            raise DistEmbeddingConfigError(
                f"DistributedEmbedding got embedding_dim={embedding_dim}, which the tensor-parallel degree "
                f"{self.tp_size} does not divide; use a multiple of {self.tp_size}."
            )
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise DistEmbeddingConfigError(
                    f"DistributedEmbedding got padding_idx={padding_idx} for "
                    f"num_embeddings={num_embeddings}; "
                    f"pass an index in [-{num_embeddings}, {num_embeddings - 1}] or None."
                )
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx, self.norm_type = padding_idx, norm_type
        self.scale_grad_by_freq, self.sparse = scale_grad_by_freq, sparse
        self.skip_allgather, self.skip_scatter_and_merge = _skip_allgather, _skip_scatter_and_merge
        full = torch.empty(num_embeddings, embedding_dim).normal_(0.0, initializer_range)
        if padding_idx is not None:
            full[padding_idx].zero_()
        weight = self.shard(full, 1).clone()
        self.weight = nn.Parameter(weight.to(self.tp.dtype or weight.dtype))
        set_param_spec(self.weight, ParamSpec(split_dim=1, scaled_batch=True))

    def lookup(self, ids: Tensor) -> Tensor:
        """This rank's slice of the embedding of every index in ``ids`` (no communication)."""
        return F.embedding(
            ids, self.weight, self.padding_idx, None, self.norm_type, self.scale_grad_by_freq, self.sparse
        )

    def forward(self, ids: Tensor) -> Tensor:
        ctx = self.tp
        if not ctx.distributed:
            return self.lookup(ids)
        if ids.dim() < 1:
            raise TPInputError(
                "DistributedEmbedding got a 0-dimensional index; tensor parallelism across data-parallel "
                "ranks needs a leading sample dimension. Pass ids of shape [N, ...]."
            )
        all_ids = ids if self.skip_allgather else gather_samples(ids, ctx)
        assert all_ids is not None
        local = self.lookup(all_ids)
        if self.skip_scatter_and_merge:
            return local
        return leave(local, ctx, "sharded")

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, " + super().extra_repr()
