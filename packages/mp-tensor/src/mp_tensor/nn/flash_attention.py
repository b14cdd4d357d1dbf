"""``FlashAttentionLayer`` (smp >= 1.15): attention over packed query/key/value, on torch's fused
``scaled_dot_product_attention`` (which picks the flash / memory-efficient kernel the device has).

It has no parameters and no communication: it attends over the heads it is given (a rank's heads
under tensor parallelism).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mp_tensor.errors import DistTransformerConfigError, TPInputError

__all__ = ["FlashAttentionLayer"]


class FlashAttentionLayer(nn.Module):
    """smp's ``FlashAttentionLayer``.

    ``forward(qkv [B, S, 3, heads, head_size], attn_mask=None, causal=False)`` returns
    ``[B, heads, S, head_size]``. ``attn_mask`` broadcasts to ``[B, heads, S, S]`` (smp passes
    ``[B, 1, 1, S]``): a float mask is added to the scores, a bool mask keeps the True positions.
    The scores are scaled by ``scale`` when given, else by ``1/sqrt(attention_head_size)`` (with
    ``scale_attention_scores``) divided by ``layer_idx + 1`` (with ``scale_attn_by_layer_idx``).
    ``attention_dropout_prob`` applies in training. smp's Triton kernel (``triton_flash_attention``)
    and ALiBi (``use_alibi``, which needed it) are not available in mp and raise.
    """

    def __init__(  # noqa: PLR0917
        self,
        attention_dropout_prob: float = 0.1,
        attention_head_size: int | None = None,
        scale_attention_scores: bool = True,
        scale_attn_by_layer_idx: bool = False,
        layer_idx: int | None = None,
        scale: float | None = None,
        triton_flash_attention: bool = False,
        use_alibi: bool = False,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if triton_flash_attention or use_alibi:
            raise DistTransformerConfigError(
                f"{name} got triton_flash_attention={triton_flash_attention}, use_alibi={use_alibi}; mp "
                "has no Triton kernel (it runs torch's scaled_dot_product_attention), and smp's ALiBi "
                "needed it. Pass triton_flash_attention=False and use_alibi=False."
            )
        if not 0.0 <= attention_dropout_prob < 1.0:
            raise DistTransformerConfigError(
                f"{name} got attention_dropout_prob={attention_dropout_prob}; expected a probability "
                "in [0, 1)."
            )
        if scale is None:
            scale = 1.0
            if scale_attention_scores:
                if attention_head_size is None or attention_head_size < 1:
                    raise DistTransformerConfigError(
                        f"{name} got attention_head_size={attention_head_size} with scale_attention_scores="
                        "True; pass the head size (the scores are scaled by 1/sqrt(head size)), or scale=."
                    )
                scale /= math.sqrt(attention_head_size)
            if scale_attn_by_layer_idx:
                if layer_idx is None or layer_idx < 0:
                    raise DistTransformerConfigError(
                        f"{name} got layer_idx={layer_idx} with scale_attn_by_layer_idx=True; pass the "
                        "layer's index (0-based), or scale=."
                    )
                scale /= layer_idx + 1
        self.attention_dropout_prob = attention_dropout_prob
        self.attention_head_size = attention_head_size
        self.scale = scale

    def forward(self, qkv: Tensor, attn_mask: Tensor | None = None, causal: bool = False) -> Tensor:
        if qkv.dim() != 5 or qkv.shape[2] != 3:
            raise TPInputError(
                f"{type(self).__name__} got qkv of shape {tuple(qkv.shape)}; expected "
                "[batch, seq, 3, heads, head_size]."
            )
        if self.attention_head_size is not None and qkv.shape[-1] != self.attention_head_size:
            raise TPInputError(
                f"{type(self).__name__} got heads of size {qkv.shape[-1]}; it was built with "
                f"attention_head_size={self.attention_head_size}."
            )
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, heads, S, hd]
        mask = attn_mask
        if causal and mask is not None:  # SDPA takes one of the two: fold the causal mask in
            s = q.shape[-2]
            keep = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
            if mask.dtype == torch.bool:
                mask = mask & keep
            else:
                mask = mask.to(q.dtype).masked_fill(~keep, float("-inf"))
            causal = False
        elif mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        p = self.attention_dropout_prob if self.training else 0.0
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal, scale=self.scale
        )

    def extra_repr(self) -> str:
        return f"scale={self.scale:g}, attention_dropout_prob={self.attention_dropout_prob}"
