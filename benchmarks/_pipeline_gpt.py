"""The GPT of benchmarks/pipeline_vs_torch.py, built so that both pipelines hold the same split, and its
stage probe, which times where a pipelined step's time goes.

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

Where a pipelined step's time goes: stage compute timed in place, and the same work without overhead.
:class:`StageProbe` puts module hooks on this GPT, the same hooks for every system, and records on each
rank when each stage's forward and backward of a microbatch ran:

* ``f0``: ``front.wte`` starts → front's last layer ends; ``b0``: the gradient reaches front's last
  layer's output → its first layer's input gradient is done (the embedding's backward is left out);
* ``f1``: back's first layer starts → ``back.loss`` ends; ``b1``: the gradient reaches ``back.loss``'s
  output → back's first layer's input gradient is done.

(Layers: ``Front.layers()`` and ``Back.layers()``, whole blocks and the halves of a block cut in two.)

Hooks run where a module runs (mp: on its owner, since ``front``/``back`` call their children locally),
so the intervals are the compute as it happened inside the pipeline, slowed by whatever else shared the
cores. :func:`analyse` then replays the same operations, in the order each rank ran them and with the
same durations, with no time between dependent operations (no communication, no runtime): the
makespan of that replay over the measured window (first operation's start to last one's end) is the
share of the window the pipeline runtime did not lose.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GAP_KINDS",
    "GPT",
    "MLP",
    "Attention",
    "Back",
    "BackStage",
    "Block",
    "Front",
    "GPTConfig",
    "LMLoss",
    "StageProbe",
    "analyse",
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
    """:func:`lm_loss` as a module, so that module hooks can time it (:class:`StageProbe`)."""

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


GAP_KINDS = ("FF", "FB", "BF", "BB")
"""Transitions between a rank's consecutive stage operations (forward or backward, then the next)."""

_DEPENDS = {"f1": "f0", "b1": "f1", "b0": "b1"}


class StageProbe:
    def __init__(self, model: GPT) -> None:
        self.events: list[tuple[str, float, float]] = []
        self._open: dict[str, float] = {}
        front, back = model.front.layers(), model.back.layers()
        if not front or not back:
            raise ValueError("the probe needs at least one layer in each stage")
        self._span("f0", model.front.wte, front[-1])
        self._span("f1", back[0], model.back.loss)
        self._backward_span("b0", front[-1], front[0])
        self._backward_span("b1", model.back.loss, back[0])

    def _begin(self, kind: str) -> None:
        self._open[kind] = time.perf_counter()

    def _finish(self, kind: str) -> None:
        start = self._open.pop(kind, None)
        if start is not None:
            self.events.append((kind, start, time.perf_counter()))

    def _span(self, kind: str, first: nn.Module, last: nn.Module) -> None:
        first.register_forward_pre_hook(lambda *_: self._begin(kind))
        last.register_forward_hook(lambda *_: self._finish(kind))

    def _backward_span(self, kind: str, first: nn.Module, last: nn.Module) -> None:
        first.register_full_backward_pre_hook(lambda *_: self._begin(kind))
        last.register_full_backward_hook(lambda *_: self._finish(kind))

    def take(self) -> list[tuple[str, float, float]]:
        events, self.events = self.events, []
        self._open.clear()
        return events


def analyse(per_rank: list[list[tuple[str, float, float]]]) -> dict[str, Any] | None:
    """Window, zero-overhead makespan and per-rank compute of one step (None if the events don't form
    a pipeline of f0 → f1 → b1 → b0 per microbatch)."""
    ops: list[list[tuple[str, int, float]]] = []
    counts: dict[str, int] = {}
    for events in per_rank:
        seq = []
        for kind, start, end in sorted(events, key=lambda e: e[1]):
            k = counts.get(kind, 0)
            counts[kind] = k + 1
            seq.append((kind, k, end - start))
        ops.append(seq)
    if len(set(counts.values())) != 1 or set(counts) != {"f0", "f1", "b0", "b1"}:
        return None
    done: dict[tuple[str, int], float] = {}
    pos = [0] * len(ops)
    clock = [0.0] * len(ops)
    progress = True
    while progress:
        progress = False
        for r, seq in enumerate(ops):
            while pos[r] < len(seq):
                kind, k, duration = seq[pos[r]]
                dep = _DEPENDS.get(kind)
                ready = 0.0
                if dep is not None:
                    if (dep, k) not in done:
                        break
                    ready = done[(dep, k)]
                clock[r] = max(clock[r], ready) + duration
                done[(kind, k)] = clock[r]
                pos[r] += 1
                progress = True
    if any(p < len(seq) for p, seq in zip(pos, ops, strict=True)):
        return None
    everything = [e for events in per_rank for e in events]
    window = max(e[2] for e in everything) - min(e[1] for e in everything)
    stages = {kind: sum(end - start for k, start, end in everything if k == kind) for kind in counts}
    return {
        "microbatches": counts["f0"],
        "window_s": window,
        "makespan_s": max(done.values()),
        "compute_s": [sum(d for _, _, d in seq) for seq in ops],
        "stage_compute_s": stages,
        "gaps_s": [_gaps(events) for events in per_rank],
    }


def _gaps(events: list[tuple[str, float, float]]) -> dict[str, float]:
    """One rank's idle time between consecutive operations, summed by transition: "FF" (a forward to the
    next), "FB" (a forward to a backward), "BF", "BB"."""
    out = dict.fromkeys(GAP_KINDS, 0.0)
    ordered = sorted(events, key=lambda e: e[1])
    for (kind, _, end), (nxt, start, _) in itertools.pairwise(ordered):
        out[kind[0].upper() + nxt[0].upper()] += max(0.0, start - end)
    return out
