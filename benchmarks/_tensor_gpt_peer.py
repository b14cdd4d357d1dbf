"""The peer of ``tensor_gpt_block.py``: seed 004's reference GPT block under PyTorch's own 1-D tensor
parallelism (``torch.distributed.tensor.parallel``).

:class:`PeerBlock` is ``mp_tensor.reference.TransformerLayer`` (pre-LayerNorm, causal, no dropout) with
its weights, written so that ``parallelize_module`` can split it the Megatron-LM way:

* ``qkv``: query, key and value fused into one linear map whose output rows are head-major
  (``[head, q|k|v, head_size]``), so ``ColwiseParallel`` gives every rank whole heads with their q, k
  and v, and the backward all-reduce of the input gradient happens once (three separate column-parallel
  modules would all-reduce it three times);
* ``proj`` (attention output) and ``fc2``: ``RowwiseParallel`` (one forward all-reduce each);
* ``fc1``: ``ColwiseParallel``;
* the layer norms are not parallelized (every rank applies them to the whole batch).

The attention core is the same sequence of tensor operations as ``mp_tensor.nn.attention.attend`` (scores
scaled by ``1/sqrt(head_size)``, the causal mask set to ``mask_value``, softmax, weighted sum), on the heads
this rank holds, so ours and the peer differ only in how they are parallelized.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from mp_tensor.reference import TransformerLayer

__all__ = ["PeerBlock", "parallelize_peer", "peer_full_grads"]


class PeerBlock(nn.Module):
    """``TransformerLayer`` (pre-LayerNorm, causal) with fused head-major q/k/v; ``forward(x)`` -> output."""

    def __init__(self, ref: TransformerLayer) -> None:
        super().__init__()
        a = ref.args
        if not a.pre_layernorm or a.post_layernorm or a.causal_mask_size is None:
            raise ValueError("PeerBlock mirrors a pre-LayerNorm causal block (GPT-2's); got another layout")
        att, mlp = copy.deepcopy(ref.attention), copy.deepcopy(ref.output)
        self.heads, self.head_size = a.num_attention_heads, a.attention_head_size
        self.mask_value, self.activation = a.mask_value, a.activation
        self.ln1, self.proj = att.pre_layernorm, att.dense
        self.ln2, self.fc1, self.fc2 = mlp.pre_layernorm, mlp.dense1, mlp.dense2
        self.qkv = nn.Linear(a.hidden_size, 3 * a.all_head_size)
        with torch.no_grad():
            for name in ("weight", "bias"):
                parts = torch.stack([getattr(m, name) for m in (att.query, att.key, att.value)])
                rest = parts.shape[2:]
                head_major = parts.reshape(3, self.heads, self.head_size, *rest).transpose(0, 1)
                getattr(self.qkv, name).copy_(head_major.reshape(3 * a.all_head_size, *rest))

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, -1, 3, self.head_size).unbind(3)  # local heads
        heads = q.shape[2]
        scores = torch.matmul(q.permute(0, 2, 1, 3), k.permute(0, 2, 3, 1)) / math.sqrt(self.head_size)
        keep = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = torch.where(keep, scores, torch.full_like(scores, self.mask_value))
        context = torch.matmul(F.softmax(scores, dim=-1), v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3)
        x = x + self.proj(context.reshape(b, s, heads * self.head_size))
        hidden = self.fc1(self.ln2(x))
        hidden = F.gelu(hidden, approximate="tanh") if self.activation == "gelu_new" else F.gelu(hidden)
        out: Tensor = x + self.fc2(hidden)
        return out


def parallelize_peer(ref: TransformerLayer, mesh: DeviceMesh) -> PeerBlock:
    """A :class:`PeerBlock` of ``ref``'s weights, split over ``mesh`` by ``parallelize_module``."""
    peer = PeerBlock(ref)
    plan: dict[str, ParallelStyle] = {
        "qkv": ColwiseParallel(),
        "proj": RowwiseParallel(),
        "fc1": ColwiseParallel(),
        "fc2": RowwiseParallel(),
    }
    parallelize_module(peer, mesh, plan)
    return peer


def _full(t: Tensor | None) -> Tensor:
    assert t is not None
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def peer_full_grads(peer: PeerBlock) -> dict[str, Tensor]:
    """Every parameter gradient of ``peer`` (shards gathered), under the reference's parameter names."""
    out = {
        "attention.pre_layernorm.weight": _full(peer.ln1.weight.grad),
        "attention.pre_layernorm.bias": _full(peer.ln1.bias.grad),
        "attention.dense.weight": _full(peer.proj.weight.grad),
        "attention.dense.bias": _full(peer.proj.bias.grad),
        "output.pre_layernorm.weight": _full(peer.ln2.weight.grad),
        "output.pre_layernorm.bias": _full(peer.ln2.bias.grad),
        "output.dense1.weight": _full(peer.fc1.weight.grad),
        "output.dense1.bias": _full(peer.fc1.bias.grad),
        "output.dense2.weight": _full(peer.fc2.weight.grad),
        "output.dense2.bias": _full(peer.fc2.bias.grad),
    }
    for name in ("weight", "bias"):
        fused = _full(getattr(peer.qkv, name).grad)
        rest = fused.shape[1:]
        q, k, v = fused.reshape(peer.heads, 3, peer.head_size, *rest).transpose(0, 1).unbind(0)
        for key, part in zip(("query", "key", "value"), (q, k, v), strict=True):
            out[f"attention.{key}.{name}"] = part.reshape(peer.heads * peer.head_size, *rest)
    return out
