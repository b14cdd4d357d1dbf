"""``DistributedEmbedding``: ``nn.Embedding`` split along ``embedding_dim`` (docs/tensor.md).

The input indices are all-gathered over the TP group, each rank looks up its slice of the embedding
vectors for every index, and an all-to-all returns each rank its own samples with all slices
concatenated. With ``prescaled_batch`` the indices are already the same on every rank, so the lookup is
followed by an all-gather of the slices. ``_skip_allgather`` says the indices are already the TP group's
(no gather); ``_skip_scatter_and_merge`` returns the ``sharded`` layout ``[T*B, ..., D/T]`` instead
(what the transformer modules take in "memory" mode).

Models often look one index tensor up in several tables (NCF: the user ids in its MLP and its GMF
table). The gathered indices of the last gathered tensor are kept (per thread), so the second lookup of
the same tensor object, unmodified (same ``_version``), in the same group costs no collective. The
decision depends only on tensor identity, which the same code reproduces on every rank of the group.

``vocab_parallel=True`` (smp's, Megatron's vocab-parallel embedding) splits the rows instead: rank j
holds rows ``[j*V/T, (j+1)*V/T)``, looks up the gathered indices that fall in its rows (zeros for the
others), and a reduce-scatter over the samples (an all-reduce with ``prescaled_batch``; a reduce-scatter
over the channels with ``_skip_scatter_and_merge``) sums the parts.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from mp_comm import collectives as col
from mp_tensor.context import TPContext
from mp_tensor.dist_ops import gather_samples
from mp_tensor.errors import DistEmbeddingConfigError, TPInputError
from mp_tensor.nn.base import DistributedModule, ParamInit, ParamSpec, set_param_init, set_param_spec

__all__ = ["DistributedEmbedding"]


class _LastGather(threading.local):
    """The last index tensor this thread gathered (weakly), its version and group, and the result."""

    ids: weakref.ref[Tensor] | None = None
    version: int = -1
    group: dist.ProcessGroup | None = None
    gathered: Tensor | None = None


_last = _LastGather()


def _gathered_ids(ids: Tensor, ctx: TPContext) -> Tensor:
    """The TP group's indices (``gather_samples``), reusing the last gather of this very tensor."""
    if not ctx.distributed or ctx.prescaled_batch:
        return ids
    if ids.is_inference():  # no version counter: cannot tell whether it changed
        return gather_samples(ids, ctx)
    if (
        _last.gathered is not None
        and _last.ids is not None
        and _last.ids() is ids
        and _last.version == ids._version
        and _last.group is ctx.group
    ):
        return _last.gathered
    gathered = gather_samples(ids, ctx)
    _last.ids, _last.version = weakref.ref(ids), ids._version
    _last.group, _last.gathered = ctx.group, gathered
    return gathered


def _merge_channels(parts: Tensor, t: int) -> Tensor:
    """``[T*N, ..., D/T]`` in rank-major blocks (block j: channels j) -> ``[N, ..., D]``."""
    return parts.reshape(t, parts.shape[0] // t, *parts.shape[1:]).movedim(0, -2).flatten(-2)


def _to_local(local: Tensor, ctx: TPContext) -> Tensor:
    """This rank's channels of the TP group's samples -> this rank's samples, every channel.

    The ``sharded`` -> ``local`` move of ``dist_ops.leave``, with both collectives on contiguous dim-0
    blocks and the channels merged by a local copy. On an embedding's narrow rows MPI's strided
    datatypes along the channels cost more here: 1.8x for the prescaled all-gather, 1.1x for the
    backward all-to-all in benchmarks/tensor_ncf.py's paired timing (4x and 12x at a higher load).
    """
    assert ctx.group is not None
    if ctx.prescaled_batch:
        return _merge_channels(col.all_gather(local, 0, ctx.group), ctx.size)
    return _merge_channels(col.all_to_all(local, 0, 0, ctx.group), ctx.size)


def _check_vocab_parallel(
    rows: int, dim: int, scale_grad_by_freq: bool, sharded_out: bool, tp_size: int
) -> None:
    if rows % tp_size:
        raise DistEmbeddingConfigError(
            f"DistributedEmbedding(vocab_parallel=True) got num_embeddings={rows}, which the tensor-parallel "
            f"degree {tp_size} does not divide; pad the vocabulary to a multiple of {tp_size}."
        )
    if scale_grad_by_freq:
        raise DistEmbeddingConfigError(
            "DistributedEmbedding(vocab_parallel=True) got scale_grad_by_freq=True; the frequencies would "
            "count the indices other ranks own. Pass scale_grad_by_freq=False or vocab_parallel=False."
        )
    if sharded_out and dim % tp_size:
        raise DistEmbeddingConfigError(
            "DistributedEmbedding(vocab_parallel=True, _skip_scatter_and_merge=True) got "
            f"embedding_dim={dim}, "
            f"which the tensor-parallel degree {tp_size} does not divide; use a multiple of {tp_size}."
        )


class DistributedEmbedding(DistributedModule):
    """Tensor-parallel ``nn.Embedding``; its full state dict is that of ``nn.Embedding``.

    Initialization is N(0, ``initializer_range``) (row ``padding_idx`` zero). ``max_norm`` and
    ``_weight`` are not supported (as in smp). ``vocab_parallel`` splits the rows (see the module doc).
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
        vocab_parallel: bool = False,
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
        if vocab_parallel:
            _check_vocab_parallel(
                num_embeddings, embedding_dim, scale_grad_by_freq, _skip_scatter_and_merge, self.tp_size
            )
        elif embedding_dim % self.tp_size:
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
        self.vocab_parallel = vocab_parallel
        split = 0 if vocab_parallel else 1
        weight = self.shard(full, split).clone()
        self.weight = nn.Parameter(weight.to(self.tp.dtype or weight.dtype))
        set_param_spec(self.weight, ParamSpec(split_dim=split, scaled_batch=True))
        shape = (num_embeddings, embedding_dim)
        init = ParamInit(shape, "normal", initializer_range, split, self.tp_rank, self.tp_size, padding_idx)
        set_param_init(self.weight, init)  # drawn again by delayed initialization

    def lookup(self, ids: Tensor) -> Tensor:
        """This rank's slice of the embedding of every index in ``ids`` (no communication)."""
        return F.embedding(
            ids, self.weight, self.padding_idx, None, self.norm_type, self.scale_grad_by_freq, self.sparse
        )

    def lookup_rows(self, ids: Tensor) -> Tensor:
        """Vocab-parallel: the embedding of the indices among this rank's rows, zeros for the others."""
        rows = self.weight.shape[0]
        start = self.tp_rank * rows
        inside = (ids >= start) & (ids < start + rows)
        pad = self.padding_idx
        local_pad = pad - start if pad is not None and start <= pad < start + rows else None
        out = F.embedding(
            torch.where(inside, ids - start, 0),
            self.weight,
            local_pad,
            None,
            self.norm_type,
            False,
            self.sparse,
        )
        return out * inside.unsqueeze(-1).to(out.dtype)

    def forward(self, ids: Tensor) -> Tensor:
        ctx = self.tp
        if not ctx.distributed:
            return self.lookup(ids)
        if ids.dim() < 1:
            raise TPInputError(
                "DistributedEmbedding got a 0-dimensional index; tensor parallelism across data-parallel "
                "ranks needs a leading sample dimension. Pass ids of shape [N, ...]."
            )
        all_ids = ids if self.skip_allgather else _gathered_ids(ids, ctx)
        if self.vocab_parallel:
            assert ctx.group is not None
            part = self.lookup_rows(all_ids)
            if self.skip_scatter_and_merge:
                return col.reduce_scatter(part, -1, ctx.group)
            if ctx.prescaled_batch:
                return col.all_reduce(part, ctx.group)
            return col.reduce_scatter(part, 0, ctx.group)
        local = self.lookup(all_ids)
        if self.skip_scatter_and_merge:
            return local
        return _to_local(local, ctx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, " + super().extra_repr()
