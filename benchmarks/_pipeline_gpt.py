"""The GPT model of benchmarks/pipeline_vs_torch.py, built so that both pipelines hold the same split.

A GPT-2-style decoder (pre-LayerNorm blocks, causal ``scaled_dot_product_attention``, GELU MLP, learned
positions, untied LM head, no dropout) whose top level is two containers: ``front`` (token and position
embeddings, the first ``split`` blocks and, by default, the attention half of the next block) and
``back`` (the rest: that block's MLP half, the other blocks, the final LayerNorm, the head and the loss).
``GPT.forward(idx, targets)`` is ``back(front(idx), targets)``. Cutting inside a block balances the two
stages: the head and the loss make ``back`` the heavier stage of a whole-block split. The head is not
tied to the embedding: a shared weight would have to live on both stages, which
torch.distributed.pipelining's manual stages do not support.

* mp marks ``front`` with partition 0 and ``back`` with partition 1 (``smp.set_partition``; manual
  partitioning), so a microbatch makes one forward and one backward request to rank 1 carrying the
  activation and its gradient, and the loss (a scalar) comes back: the same traffic as
  torch.distributed.pipelining's stages.
* torch.distributed.pipelining gets ``model.front`` as stage 0 and ``BackStage(model.back)`` (the logits)
  as stage 1, with ``model.back.loss`` as the schedule's ``loss_fn``: the same modules, the same
  arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPT",
    "MLP",
    "Attention",
    "Back",
    "BackStage",
    "Block",
    "Front",
    "GPTConfig",
    "LMLoss",
    "lm_loss",
    "make_batch",
]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab: int = 2048
    """Vocabulary size (embedding rows, head outputs)."""
    seq: int = 128
    """Sequence length (positions)."""
    hidden: int = 256
    """Model width."""
    heads: int = 8
    """Attention heads (``hidden`` must divide by it)."""
    layers: int = 8
    """Transformer blocks."""
    split: int = 4
    """Whole blocks in ``front`` (stage 0); the rest of the model is in ``back``."""
    mid_block: bool = True
    """Also cut block ``split`` between its two residual halves: its attention goes to ``front``, its MLP
    to ``back``. Measured with 1 thread (8 layers, split 4, 2 sequences a microbatch), ``back``'s forward
    and backward took 1.18-1.20x ``front``'s with the cut between blocks and 0.98-0.99x with it inside
    block 4; a pipeline runs at the pace of its slower stage."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} does not divide into heads={self.heads}")
        top = self.layers - 1 if self.mid_block else self.layers
        if not 0 <= self.split <= top:
            raise ValueError(
                f"split={self.split}; expected 0 <= split <= {top} (layers={self.layers}, "
                f"mid_block={self.mid_block})"
            )


class Attention(nn.Module):
    """A block's first residual half: ``x + proj(attention(ln1(x)))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, t, c))  # type: ignore[no-any-return]


class MLP(nn.Module):
    """A block's second residual half: ``x + out(gelu(fc(ln2(x))))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.out = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.gelu(self.fc(self.ln2(x))))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.attn(x))  # type: ignore[no-any-return]


class Front(nn.Module):
    """Stage 0: embeddings, the first ``split`` blocks and (``mid_block``) the next block's attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.split))
        self.attn = Attention(cfg) if cfg.mid_block else None

    def layers(self) -> list[nn.Module]:
        """The stage's residual layers in order (whole blocks, then the attention half if any)."""
        return [*self.blocks, *([self.attn] if self.attn is not None else [])]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x: torch.Tensor = self.wte(idx) + self.wpe(pos)
        for layer in self.layers():
            x = layer(x)
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class LMLoss(nn.Module):
    """:func:`lm_loss` as a module, so that module hooks can time it (benchmarks/_pipeline_probe.py)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets)


class Back(nn.Module):
    """Stage 1: (``mid_block``) the MLP half of front's last block, the other blocks, the final LayerNorm,
    the head; the loss when targets are given."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.mlp = MLP(cfg) if cfg.mid_block else None
        whole = cfg.layers - cfg.split - (1 if cfg.mid_block else 0)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(whole))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.loss = LMLoss()

    def layers(self) -> list[nn.Module]:
        """The stage's residual layers in order (the MLP half if any, then whole blocks)."""
        return [*([self.mlp] if self.mlp is not None else []), *self.blocks]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers():
            x = layer(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(self.logits(x), targets)  # type: ignore[no-any-return]


class BackStage(nn.Module):
    """``back`` as torch.distributed.pipelining's last stage: logits out, the schedule applies the loss."""

    def __init__(self, back: Back) -> None:
        super().__init__()
        self.back = back

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.back.logits(x)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.front = Front(cfg)
        self.back = Back(cfg)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.back(self.front(idx), targets)  # type: ignore[no-any-return]


def make_batch(cfg: GPTConfig, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, (batch, seq) int64 each, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
