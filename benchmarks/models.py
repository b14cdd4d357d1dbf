"""The models of benchmarks/pipeline_users.py, as users write them, and torch's hand splits of them.

Each :class:`Case` holds a model class built from a seed, one global batch, the loss as a user's step
function computes it, and, for torch.distributed.pipelining (which needs stage modules), the model as
a chain of pieces (modules of that same model, each fed the previous one's outputs) with the loss on
the last piece's output. The hand split is the cut of that chain whose two stages take the closest
forward + backward time, measured (:func:`best_cut`; :func:`best_cuts` for ``p`` stages). Dropout is
off everywhere, so every system computes the same losses. The HF models' output embeddings are untied
from the input ones: torch's manual stages cannot share a weight between two stages.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "Case", "Chain", "best_cut", "best_cuts", "make_case"]

MODELS = ("gpt", "gpt2", "t5", "cnn")


# -- (a) a GPT whose forward loops over its blocks ----------------------------------------------------
class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))  # type: ignore[no-any-return]


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int, layers: int, heads: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]


# -- (d) a ResNet-style CNN whose forward loops over its stages ---------------------------------------
class Residual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


class ResNet(nn.Module):
    def __init__(self, widths: Sequence[int], blocks: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]))
        stages, cin = [], widths[0]
        for i, w in enumerate(widths):
            stages.append(
                nn.Sequential(
                    *(Residual(cin if j == 0 else w, w, 2 if i and not j else 1) for j in range(blocks))
                )
            )
            cin = w
        self.stages = nn.ModuleList(stages)
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        for stage in self.stages:
            x = stage(x)
        return self.fc(x.mean(dim=(2, 3)))  # type: ignore[no-any-return]


# -- pieces: the chain torch's stages are cut from -----------------------------------------------------
class _Fn(nn.Module):
    """A piece computing ``fn(*args)`` with ``mods`` as its parameters (the model's own modules)."""

    def __init__(self, fn: Callable[..., Any], *mods: nn.Module) -> None:
        super().__init__()
        self.mods = nn.ModuleList(mods)
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> Any:
        return self.fn(*args)


class Chain(nn.Module):
    """Pieces run in order, each given the previous one's output (a tuple is spread as arguments)."""

    def __init__(self, pieces: Sequence[nn.Module]) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(pieces)

    def forward(self, *args: torch.Tensor) -> Any:
        out: Any = args
        for piece in self.pieces:
            out = piece(*(out if isinstance(out, tuple) else (out,)))
        return out


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _shifted_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss: position t predicts token t + 1."""
    return _lm_loss(logits[:, :-1], labels[:, 1:])


@dataclass
class Case:
    """One model of the benchmark: how to build it, its batch, a user's loss and torch's pieces."""

    name: str
    build: Callable[[], nn.Module]
    """A fresh model (the caller loads the shared initial weights)."""
    batch: tuple[torch.Tensor, ...]
    """The global batch (dim 0: samples), as the user's step function takes it."""
    user_loss: Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor]
    """The loss as a user's step function computes it from the model and the batch."""
    pieces: Callable[[nn.Module], list[nn.Module]]
    """The model as a chain of pieces (its own modules) whose last output goes to ``loss_fn``."""
    stage_args: Callable[[Sequence[torch.Tensor]], tuple[torch.Tensor, ...]]
    """The first piece's inputs, from the batch."""
    target: Callable[[Sequence[torch.Tensor]], torch.Tensor]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    describe: str


def _sizes(defaults: dict[str, int], size: Mapping[str, int] | None) -> dict[str, int]:
    """``defaults`` with the keys of ``size`` replaced (``--size hidden=1024,seq=512`` on a command line)."""
    unknown = sorted(set(size or {}) - set(defaults))
    if unknown:
        raise ValueError(f"unknown size key(s) {unknown}; expected some of {sorted(defaults)}")
    return {**defaults, **(size or {})}


def _gpt(smoke: bool, seed: int, size: Mapping[str, int] | None = None) -> Case:
    keys = ("vocab", "seq", "hidden", "layers", "batch", "heads")
    sizes = (256, 32, 64, 4, 8, 8) if smoke else (1000, 128, 256, 8, 16, 8)
    d = _sizes(dict(zip(keys, sizes, strict=True)), size)
    vocab, seq, hidden, layers, batch, heads = (d[k] for k in keys)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)

    def pieces(model: nn.Module) -> list[nn.Module]:
        assert isinstance(model, GPT)

        def embed_fn(idx: torch.Tensor) -> torch.Tensor:
            return model.wte(idx) + model.wpe(torch.arange(idx.shape[1], device=idx.device))  # type: ignore[no-any-return]

        embed = _Fn(embed_fn, model.wte, model.wpe)
        head = _Fn(lambda x: model.head(model.ln_f(x)), model.ln_f, model.head)
        return [embed, *model.blocks, head]

    return Case(
        name="gpt",
        build=lambda: GPT(vocab, seq, hidden, layers, heads),
        batch=(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()),
        user_loss=lambda model, b: _lm_loss(model(b[0]), b[1]),
        pieces=pieces,
        stage_args=lambda b: (b[0],),
        target=lambda b: b[1],
        loss_fn=_lm_loss,
        describe=f"GPT, forward loops over {layers} blocks: hidden {hidden}, seq {seq}, vocab {vocab}, "
        f"batch {batch}",
    )


def _gpt2(smoke: bool, seed: int, size: Mapping[str, int] | None = None) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    keys = ("vocab", "seq", "hidden", "layers", "batch", "heads")
    sizes = (256, 32, 64, 2, 8, 8) if smoke else (1000, 128, 256, 8, 16, 8)
    d = _sizes(dict(zip(keys, sizes, strict=True)), size)
    vocab, seq, hidden, layers, batch, heads = (d[k] for k in keys)
    cfg = GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))

    def pieces(model: nn.Module) -> list[nn.Module]:
        tr: Any = model.transformer

        def embed_fn(idx: torch.Tensor) -> torch.Tensor:
            return tr.wte(idx) + tr.wpe(torch.arange(idx.shape[1], device=idx.device)[None])  # type: ignore[no-any-return]

        embed = _Fn(embed_fn, tr.wte, tr.wpe)
        blocks = [_Fn(lambda x, blk=blk: _first(blk(x)), blk) for blk in tr.h]  # causal by sdpa, no mask
        m: Any = model
        head = _Fn(lambda x: m.lm_head(tr.ln_f(x)), tr.ln_f, m.lm_head)
        return [embed, *blocks, head]

    return Case(
        name="gpt2",
        build=lambda: GPT2LMHeadModel(cfg),
        batch=(ids,),
        user_loss=lambda model, b: model(input_ids=b[0], labels=b[0]).loss,
        pieces=pieces,
        stage_args=lambda b: (b[0],),
        target=lambda b: b[0],
        loss_fn=_shifted_lm_loss,
        describe=f"HF GPT2LMHeadModel: {layers} layers, n_embd {hidden}, seq {seq}, vocab {vocab}, "
        f"batch {batch}, untied head",
    )


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]


def _shift_right(labels: torch.Tensor) -> torch.Tensor:
    """T5's decoder inputs for ``labels``: the start token (0) then the labels but the last."""
    return torch.cat([torch.zeros_like(labels[:, :1]), labels[:, :-1]], dim=1)


def _t5(smoke: bool, seed: int, size: Mapping[str, int] | None = None) -> Case:
    from transformers import T5Config, T5ForConditionalGeneration

    keys = ("vocab", "source", "target", "d_model", "layers", "batch")
    sizes = (256, 32, 16, 64, 2, 8) if smoke else (1000, 128, 64, 256, 4, 16)
    sz = _sizes(dict(zip(keys, sizes, strict=True)), size)
    vocab, src, tgt, d, layers, batch = (sz[k] for k in keys)
    cfg = T5Config(  # type: ignore[call-arg]  # (transformers' stubs lack the seq2seq keywords)
        vocab_size=vocab, d_model=d, d_kv=d // 8, d_ff=4 * d, num_layers=layers, num_decoder_layers=layers,
        num_heads=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    cfg.tie_word_embeddings = False  # (the constructor's keyword is overridden in transformers 5)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(2, vocab, (batch, src), generator=g)
    y = torch.randint(2, vocab, (batch, tgt), generator=g)

    def pieces(model: nn.Module) -> list[nn.Module]:
        m: Any = model
        scale = m.model_dim**-0.5 if m.config.scale_decoder_outputs else 1.0

        def encode(ids: torch.Tensor, dec_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return m.encoder(input_ids=ids)[0], m.decoder.embed_tokens(dec_ids)

        def decode(enc: torch.Tensor, dec_emb: torch.Tensor) -> torch.Tensor:
            out = m.decoder(inputs_embeds=dec_emb, encoder_hidden_states=enc, use_cache=False)[0]
            return m.lm_head(out * scale)  # type: ignore[no-any-return]

        return [_Fn(encode, m.encoder, m.decoder.embed_tokens), _Fn(decode, m.decoder, m.lm_head)]

    return Case(
        name="t5",
        build=lambda: T5ForConditionalGeneration(cfg),
        batch=(x, y),
        user_loss=lambda model, b: model(input_ids=b[0], labels=b[1]).loss,
        pieces=pieces,
        stage_args=lambda b: (b[0], _shift_right(b[1])),
        target=lambda b: b[1],
        loss_fn=_lm_loss,
        describe=f"HF T5ForConditionalGeneration: {layers}+{layers} layers, d_model {d}, source {src}, "
        f"target {tgt}, vocab {vocab}, batch {batch}, untied head (torch's split: encoder | decoder)",
    )


def _cnn(smoke: bool, seed: int, sizes: Mapping[str, int] | None = None) -> Case:
    widths, blocks, size, batch = ((8, 16), 1, 16, 8) if smoke else ((64, 128, 256, 512), 2, 32, 16)
    d = _sizes({"blocks": blocks, "image": size, "batch": batch}, sizes)
    blocks, size, batch = d["blocks"], d["image"], d["batch"]
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, size, size, generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)

    def pieces(model: nn.Module) -> list[nn.Module]:
        assert isinstance(model, ResNet)
        stem = _Fn(lambda x: F.relu(model.stem(x)), model.stem)
        head = _Fn(lambda x: model.fc(x.mean(dim=(2, 3))), model.fc)
        blocks: list[nn.Module] = [blk for stage in model.stages for blk in stage]  # type: ignore[attr-defined]
        return [stem, *blocks, head]

    return Case(
        name="cnn",
        build=lambda: ResNet(widths, blocks, 10),
        batch=(images, labels),
        user_loss=lambda model, b: F.cross_entropy(model(b[0]), b[1]),
        pieces=pieces,
        stage_args=lambda b: (b[0],),
        target=lambda b: b[1],
        loss_fn=F.cross_entropy,
        describe=f"ResNet-style CNN, forward loops over {len(widths)} stages of {blocks} residual "
        f"block{'s' * (blocks > 1)} (widths {list(widths)}, BatchNorm): {size}x{size} images, 10 classes, "
        f"batch {batch}",
    )


def make_case(name: str, *, smoke: bool, seed: int, size: Mapping[str, int] | None = None) -> Case:
    """Model ``name`` at its default (or ``smoke``) sizes, with the keys of ``size`` replaced."""
    makers = {"gpt": _gpt, "gpt2": _gpt2, "t5": _t5, "cnn": _cnn}
    if name not in makers:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    return makers[name](smoke, seed, size)


def _float_leaves(args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in args)


def piece_times(case: Case, model: nn.Module, m: int, reps: int = 5) -> list[float]:
    """Forward + backward seconds of each piece on one microbatch (of ``m``), the loss with the last:
    the fastest of ``reps`` runs, the one least disturbed by the other work of a shared host. On CUDA
    each piece's time includes a synchronize after it (its kernels, not only their launch)."""
    pieces = case.pieces(model)
    cuda = case.batch[0].is_cuda

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    mb = tuple(t.chunk(m)[0] for t in case.batch)
    samples: list[list[float]] = [[] for _ in pieces]
    for _ in range(reps + 1):  # the first is a warm-up
        ins, outs, times = [], [], []
        out: Any = case.stage_args(mb)
        for piece in pieces:
            args = _float_leaves(out if isinstance(out, tuple) else (out,))
            t0 = now()
            out = piece(*args)
            times.append(now() - t0)
            ins.append(args)
            outs.append(out if isinstance(out, tuple) else (out,))
        t0 = now()
        torch.autograd.backward(case.loss_fn(out, case.target(mb)))
        times[-1] += now() - t0
        for i in range(len(pieces) - 2, -1, -1):
            grads = [a.grad for a in ins[i + 1] if a.is_floating_point()]
            t0 = now()
            torch.autograd.backward([o for o in outs[i] if o.is_floating_point()], grads)
            times[i] += now() - t0
        for i, t in enumerate(times):
            samples[i].append(t)
        model.zero_grad(set_to_none=True)
    return [min(s[1:]) for s in samples]


def best_cut(times: Sequence[float]) -> int:
    """The cut (pieces before it go to stage 0) whose slower stage is fastest."""
    return min(range(1, len(times)), key=lambda k: max(sum(times[:k]), sum(times[k:])))


def best_cuts(times: Sequence[float], stages: int) -> list[int]:
    """The ``stages - 1`` cuts (piece indices where a stage starts) whose slowest stage is fastest; the
    first such in lexicographic order, so ``best_cuts(times, 2) == [best_cut(times)]``."""
    if not 2 <= stages <= len(times):
        raise ValueError(f"stages={stages}; expected between 2 and the {len(times)} pieces")

    def slowest(cuts: tuple[int, ...]) -> float:
        bounds = (0, *cuts, len(times))
        return max(sum(times[a:b]) for a, b in itertools.pairwise(bounds))

    candidates: list[tuple[int, ...]] = list(itertools.combinations(range(1, len(times)), stages - 1))
    best = min(range(len(candidates)), key=lambda i: slowest(candidates[i]))  # the first of the fastest
    return list(candidates[best])
