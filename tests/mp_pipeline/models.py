"""Models and data for the pipeline equivalence tests, and the plain single-process reference.

The reference is what smp promises to be equivalent to: plain PyTorch running the same step function
once per microbatch, each microbatch's loss scaled by 1/microbatches before backward, gradients summed
over the data-parallel replicas' batches and divided by their number, then the optimizer step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NAMES = ("mlp", "cnn", "reuse", "gpt2", "t5")
BATCH = 8  # per data-parallel replica
STEPS = 3


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.inner = nn.Linear(d, d)
        self.gate = nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(h)) * torch.sigmoid(self.gate(h))


class Head(nn.Module):
    """Takes kwargs and returns a dict with a tensor that needs grad, an integer tensor, None and an int."""

    def __init__(self, d: int, classes: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, classes)

    def forward(self, h: torch.Tensor, *, ids: torch.Tensor, scale: float = 1.0) -> dict[str, Any]:
        return {"logits": self.proj(h) * scale, "ids": ids, "nothing": None, "rows": int(h.shape[0])}


class ReuseBranch(nn.Module):
    """Module reuse (``shared`` runs twice), a branch that depends on the data (differs between
    microbatches), integer inputs, kwargs, dict outputs with non-tensors."""

    def __init__(self, d: int = 12, vocab: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.shared = Block(d)
        self.pos = Block(d)
        self.neg = Block(d)
        self.head = Head(d, classes)

    def forward(self, ids: torch.Tensor) -> dict[str, Any]:
        h = self.embed(ids).mean(1)
        h = self.shared(h)
        h = self.pos(h) if int(ids[0, 0]) % 2 == 0 else self.neg(h)
        h = self.shared(h)
        return self.head(h, ids=ids, scale=0.5)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def build(name: str, seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    if name == "mlp":
        return nn.Sequential(
            nn.Linear(10, 32),
            nn.ReLU(),
            nn.Linear(32, 32),
            nn.ReLU(),
            nn.Linear(32, 16),
            nn.ReLU(),
            nn.Linear(16, 4),
        )
    if name == "cnn":
        return SmallCNN()
    if name in {"reuse", "reuse_static"}:
        return ReuseBranch()
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=64,
            n_positions=16,
            n_embd=32,
            n_layer=layers,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        config._attn_implementation = "eager"
        return GPT2LMHeadModel(config)
    if name == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        # Tied embeddings (the default): `shared` is the encoder's and the decoder's embedding and the
        # LM head's weight, wherever the partition puts them.
        config = T5Config(
            vocab_size=64,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=layers,
            num_decoder_layers=layers,
            num_heads=4,
            relative_attention_num_buckets=8,
            dropout_rate=0.0,
            decoder_start_token_id=0,
            pad_token_id=0,
        )
        config._attn_implementation = "eager"
        return T5ForConditionalGeneration(config)
    raise ValueError(name)


def manual_marks(name: str, model: nn.Module, pp: int) -> None:
    """Partition marks for models partitioned by hand (the reuse model: nested calls back and forth)."""
    from mp_partition import set_partition

    if name not in {"reuse", "reuse_static"} or pp == 1:
        return
    assert isinstance(model, ReuseBranch)
    set_partition(model.shared, 1 % pp)
    set_partition(model.shared.inner, 0)  # called from rank 1 back on rank 0
    set_partition(model.neg, (pp - 1) % pp)
    set_partition(model.head, (2 % pp))


def batch(name: str, step: int, replica: int, size: int = BATCH) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1000 * step + replica)
    if name == "mlp":
        return torch.randn(size, 10, generator=g), torch.randn(size, 4, generator=g)
    if name == "cnn":
        return torch.randn(size, 1, 16, 16, generator=g), torch.randint(0, 5, (size,), generator=g)
    if name in {"reuse", "reuse_static"}:
        ids = torch.randint(0, 16, (size, 5), generator=g)
        if name == "reuse_static":  # the branch depends on the row, not the step: a static flow
            ids[:, 0] = 2 * (ids[:, 0] // 2) + torch.arange(size) * 2 // size % 2  # halves: pos, neg
        return ids, torch.randint(0, 3, (size,), generator=g)
    if name == "gpt2":
        return (torch.randint(0, 64, (size, 12), generator=g),)
    if name == "t5":
        return torch.randint(1, 64, (size, 10), generator=g), torch.randint(1, 64, (size, 6), generator=g)
    raise ValueError(name)


def loss_of(name: str, model: Callable[..., Any], data: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if name == "mlp":
        return F.mse_loss(model(data[0]), data[1])
    if name == "cnn":
        return F.cross_entropy(model(data[0]), data[1])
    if name in {"reuse", "reuse_static"}:
        out = model(data[0])
        assert out["rows"] == data[0].shape[0] and out["nothing"] is None
        assert torch.equal(out["ids"], data[0]) and not out["ids"].is_floating_point()
        return F.cross_entropy(out["logits"], data[1])
    if name == "gpt2":
        return model(input_ids=data[0], labels=data[0]).loss  # type: ignore[no-any-return]
    if name == "t5":
        return model(input_ids=data[0], labels=data[1]).loss  # type: ignore[no-any-return]
    raise ValueError(name)


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    """Adam, except for the transformers (SGD with momentum). The key part of GPT-2's attention bias has
    an exactly zero gradient (softmax ignores a shift of the scores), so its computed gradient is
    rounding noise, which Adam normalizes into O(lr) updates whose sign depends on summation order
    (data-parallel averaging sums in another order than one process). SGD with momentum keeps such
    noise at its own size (~1e-9)."""
    if name in {"gpt2", "t5"}:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.Adam(params, lr=1e-2)


def reference(
    name: str, *, microbatches: int, replicas: int, steps: int = STEPS, layers: int = 2
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Plain PyTorch: per step and replica the mean microbatch loss, and the final state_dict."""
    model = build(name, layers=layers)
    opt = make_optimizer(name, model.parameters())
    losses: list[list[float]] = []
    for step in range(steps):
        per_replica = []
        for r in range(replicas):
            data = batch(name, step, r)
            parts = [t.chunk(microbatches) for t in data]
            total = 0.0
            for mb in range(microbatches):
                loss = loss_of(name, model, tuple(p[mb] for p in parts))
                (loss / (microbatches * replicas)).backward()
                total += loss.item()
            per_replica.append(total / microbatches)
        losses.append(per_replica)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def first_difference(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6
) -> str | None:
    """None if equal, else a message naming the first tensor that differs."""
    if list(got) != list(want):
        missing, extra = sorted(set(want) - set(got))[:5], sorted(set(got) - set(want))[:5]
        return f"keys differ: missing {missing}, extra {extra}"
    for key, w in want.items():
        g = got[key]
        if g.shape != w.shape:
            return f"{key}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        if not torch.allclose(g.float(), w.float(), rtol=rtol, atol=atol):
            err = (g.float() - w.float()).abs().max().item()
            return f"{key}: max abs difference {err:.3g}"
    return None
