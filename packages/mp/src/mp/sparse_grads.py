"""Sparse embedding gradients over a data-parallel group.

``sparse=True`` on ``nn.Embedding``, ``nn.EmbeddingBag`` or ``smp.nn.DistributedEmbedding`` makes the
weight's gradient a sparse tensor holding only the rows the step looked up: no full-table gradient is
written, and an optimizer that takes sparse gradients (SGD, SparseAdam) updates only those rows. Such
gradients cannot join the flat buckets the dense ones travel in, so each is coalesced and summed on
its own by the group's sparse all-reduce (torch.distributed's; gloo has one, MPI none), then divided as
its dense peers are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from mp_pipeline import agree_any
from mp_tensor import DistributedEmbedding

__all__ = ["reduce_sparse_gradients", "sparse_grad_parameters"]


def sparse_grad_parameters(module: nn.Module) -> set[int]:
    """``id``s of the weights of ``module``'s embeddings built with ``sparse=True``."""
    kinds = (nn.Embedding, nn.EmbeddingBag, DistributedEmbedding)
    return {id(m.weight) for m in module.modules() if isinstance(m, kinds) and m.sparse}


@torch.no_grad()
def reduce_sparse_gradients(params: Sequence[nn.Parameter], group: dist.ProcessGroup, divisor: float) -> None:
    """Sum the gradients of ``params`` over ``group`` and divide them by ``divisor``.

    A parameter with a gradient on some member and none on others counts as zero there (an empty sparse
    gradient joins the sum); one with none anywhere keeps None.
    """
    size = dist.get_world_size(group)
    have = agree_any([p.grad is not None for p in params], group) if size > 1 else []
    for k, p in enumerate(params):
        if size > 1 and have[k] and p.grad is None:
            rows = torch.empty(1, 0, dtype=torch.long, device=p.device)
            values = torch.empty(0, *p.shape[1:], dtype=p.dtype, device=p.device)
            p.grad = torch.sparse_coo_tensor(rows, values, p.shape)
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
        if size > 1:
            dist.all_reduce(p.grad, group=group)  # in place, sparse or dense
        if divisor != 1:
            p.grad.div_(divisor)
