"""Split backward (mp_pipeline.split_backward): input gradients first, weight gradients later, equal to
one full backward on the same graph, for any module."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from mp_pipeline.errors import SplitBackwardError
from mp_pipeline.split_backward import WeightGrad, backward_input


class SharedMLP(nn.Module):
    """Shared parameters three ways: one Linear called twice, two Linears tied to one weight, and a
    parameter used directly by two ops (reachable from an op on the input side and from its child)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.scale = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = self.a(h) * self.scale
        return self.b(h) * self.scale


class WithBuffers(nn.Module):
    """BatchNorm's running statistics (buffers updated in the forward) and a registered constant."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.register_buffer("offset", torch.linspace(-1, 1, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)) + self.offset


class NoGradInputs(nn.Module):
    """A first stage: integer ids and a float mask that does not require grad; nothing to send back."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(self.emb(ids)) * mask.unsqueeze(-1)


class MixedOutputs(nn.Module):
    """Outputs some of which do not require grad, one that reaches a parameter without touching the
    input (a parameter-only branch), and one that is the parameter itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.extra = nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.lin(x) + y
        return h, h.detach().argmax(-1), torch.exp(self.extra) * 2, self.extra, (h * 3).sum(-1)


def _gpt2_block() -> nn.Module:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = GPT2Config(n_embd=32, n_head=4, n_layer=1, n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0)
    return GPT2Block(cfg, layer_idx=0)


Case = tuple[Callable[[], nn.Module], Callable[[torch.Generator], tuple[torch.Tensor, ...]]]


def _floats(*shape: int, grad: bool = True) -> Callable[[torch.Generator], torch.Tensor]:
    def make(g: torch.Generator) -> torch.Tensor:
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    return make


CASES: dict[str, Case] = {
    "gpt2_block": (_gpt2_block, lambda g: (_floats(2, 7, 32)(g),)),
    "shared": (SharedMLP, lambda g: (_floats(4, 8)(g),)),
    "buffers": (WithBuffers, lambda g: (_floats(5, 6)(g),)),
    "no_grad_inputs": (
        NoGradInputs,
        lambda g: (torch.randint(0, 20, (3, 4), generator=g), _floats(3, 4, grad=False)(g)),
    ),
    "mixed_outputs": (MixedOutputs, lambda g: (_floats(3, 5)(g), _floats(3, 5, grad=False)(g))),
}


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    if hasattr(out, "to_tuple"):
        return _tensors(out.to_tuple())
    return []


def _out_grads(outs: list[torch.Tensor], g: torch.Generator) -> list[torch.Tensor | None]:
    return [torch.randn(o.shape, generator=g) if o.requires_grad else None for o in outs]


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(x.requires_grad)


def _full(module: nn.Module, inputs: list[tuple[torch.Tensor, ...]], seed: int) -> list[list[Any]]:
    """Plain PyTorch: forward and full backward per microbatch; the input gradients of each."""
    g = torch.Generator().manual_seed(seed)
    found = []
    for args in inputs:
        xs = [_leaf(x) for x in args]
        outs = _tensors(module(*xs))
        grads = _out_grads(outs, g)
        pairs = [(o, d) for o, d in zip(outs, grads, strict=True) if d is not None]
        torch.autograd.backward([o for o, _ in pairs], [d for _, d in pairs])
        found.append([x.grad if x.requires_grad else None for x in xs])
    return found


def _split(
    module: nn.Module,
    inputs: list[tuple[torch.Tensor, ...]],
    seed: int,
    weights_in: Callable[[int], list[int]],
) -> list[list[Any]]:
    """Input halves in microbatch order, weight halves in the order ``weights_in(len)`` gives."""
    g = torch.Generator().manual_seed(seed)
    found, halves = [], []
    for args in inputs:
        xs = [_leaf(x) for x in args]
        outs = _tensors(module(*xs))
        grads = _out_grads(outs, g)
        dx, wg = backward_input(outs, grads, xs, module.parameters())
        assert all(x.grad is None for x in xs)  # input gradients are returned, not accumulated
        found.append(list(dx))
        halves.append(wg)
        assert all(p.grad is None for p in module.parameters())  # no weight gradient yet
    for i in weights_in(len(halves)):
        halves[i].run()
    return found


def _compare(ref: nn.Module, got: nn.Module) -> None:
    for (name, p), q in zip(ref.named_parameters(), got.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, msg=lambda m, n=name: f"{n}: {m}")
    for (name, b), c in zip(ref.named_buffers(), got.buffers(), strict=True):
        torch.testing.assert_close(c, b, msg=lambda m, n=name: f"buffer {n}: {m}")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("microbatches", [1, 3])
def test_split_equals_full_backward(case: str, microbatches: int) -> None:
    make, data = CASES[case]
    torch.manual_seed(0)
    ref = make()
    got = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    inputs = [data(g) for _ in range(microbatches)]
    full = _full(ref, inputs, seed=2)
    split = _split(got, inputs, seed=2, weights_in=lambda n: list(range(n)))
    for m, (a, b) in enumerate(zip(full, split, strict=True)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert (x is None) == (y is None), f"microbatch {m} input {i}"
            if x is not None:
                torch.testing.assert_close(y, x, msg=lambda s, m=m, i=i: f"microbatch {m} input {i}: {s}")
    _compare(ref, got)


def test_weight_halves_may_run_in_any_order() -> None:
    make, data = CASES["shared"]
    torch.manual_seed(0)
    ref = make()
    got = copy.deepcopy(ref)
    g = torch.Generator().manual_seed(1)
    inputs = [data(g) for _ in range(4)]
    _full(ref, inputs, seed=2)
    _split(got, inputs, seed=2, weights_in=lambda n: [2, 0, 3, 1])
    _compare(ref, got)


def test_weight_half_accumulates_like_autograd_including_hooks() -> None:
    """The parameters' own AccumulateGrad runs: post-accumulate hooks fire once per parameter and call."""
    torch.manual_seed(0)
    m = SharedMLP()
    fired: list[str] = []
    for name, p in m.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=name: fired.append(n))
    x = torch.randn(4, 8, requires_grad=True)
    out = m(x)
    _, wg = backward_input([out], [torch.ones_like(out)], [x], m.parameters())
    assert fired == []
    wg.run()
    assert sorted(fired) == sorted(n for n, _ in m.named_parameters())


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


@pytest.mark.parametrize("case", sorted(CASES))
def test_nothing_stays_alive_after_the_weight_half(case: str) -> None:
    make, data = CASES[case]
    torch.manual_seed(0)
    module = make()
    holders: list[weakref.ReferenceType[_Holder]] = []

    def pack(t: torch.Tensor) -> _Holder:
        h = _Holder(t.detach())  # a saved output holding itself would keep its own node alive
        holders.append(weakref.ref(h))
        return h

    xs = [_leaf(x) for x in data(torch.Generator().manual_seed(1))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t):
        outs = _tensors(module(*xs))
    grads = _out_grads(outs, torch.Generator().manual_seed(2))
    _, wg = backward_input(outs, grads, xs, module.parameters())
    del outs, xs
    gc.collect()
    kept = sum(h() is not None for h in holders)
    assert kept > 0  # what the weight half needs is still there
    wg.run()
    assert not wg.pending
    gc.collect()
    assert [h for h in holders if h() is not None] == []


def test_discard_frees_without_gradients() -> None:
    m = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    out = m(x)
    dx, wg = backward_input([out], [torch.ones_like(out)], [x], m.parameters())
    assert dx[0] is not None
    wg.discard()
    assert m.weight.grad is None
    with pytest.raises(SplitBackwardError, match=r"run\(\) called after discard\(\)"):
        wg.run()


def test_mismatched_gradients_name_the_counts() -> None:
    m = nn.Linear(3, 3)
    out = m(torch.randn(2, 3))
    with pytest.raises(SplitBackwardError, match="got 1 outputs and 2 gradients"):
        backward_input([out], [None, None], [], m.parameters())


def test_gradient_edges_as_outputs_and_inputs() -> None:
    """The runtime keeps gradient edges, not tensors: the same split from edges."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))
    got = copy.deepcopy(ref)
    x = torch.randn(3, 4, requires_grad=True)
    grad = torch.randn(3, 4)
    ref(x).backward(grad)
    x2 = x.detach().requires_grad_()
    out = got(x2)
    edge_in = torch.autograd.graph.get_gradient_edge(x2)
    dx, wg = backward_input(
        [torch.autograd.graph.get_gradient_edge(out)], [grad], [edge_in], got.parameters()
    )
    assert isinstance(wg, WeightGrad) and not wg.empty
    wg.run()
    torch.testing.assert_close(dx[0], x.grad)
    _compare(ref, got)


def test_weight_half_redoes_no_input_side_work() -> None:
    """Between two Linears the GELU's backward runs once (in the input half): the weight half starts at
    the Linears' matmuls with the gradients the input half saw, and asks them only for dW."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    h = nn.functional.gelu(lin1(x))
    calls = []
    h.register_hook(lambda g: calls.append(g.clone()))
    out = lin2(h)
    _, wg = backward_input([out], [torch.ones_like(out)], [x], [*lin1.parameters(), *lin2.parameters()])
    assert len(calls) == 1
    wg.run()
    assert len(calls) == 1
    assert lin1.weight.grad is not None and lin2.weight.grad is not None


class _SideEffect(torch.autograd.Function):
    """Stands for a call made to another rank inside the call: its backward acts (sends that call's
    backward request), so it must run once, in the input half."""

    @staticmethod
    def forward(ctx: Any, calls: list[int], anchor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx.calls = calls
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, torch.Tensor]:
        ctx.calls.append(1)
        return None, torch.zeros(0), grad * 2


@pytest.mark.parametrize("leads_to_params", [False, True])
def test_must_run_nodes_run_once_in_the_input_half(leads_to_params: bool) -> None:
    """Without a parameter below it the acting node runs in the input half and the weight half still
    defers; with one (it could be needed again) the whole backward runs at once."""
    torch.manual_seed(0)
    lin1, lin2 = nn.Linear(4, 4), nn.Linear(4, 4)
    ref1, ref2 = copy.deepcopy(lin1), copy.deepcopy(lin2)
    x, ids = torch.randn(3, 4), torch.randn(3, 4)
    grad = torch.randn(3, 4)

    def call(a: nn.Module, b: nn.Module, x: torch.Tensor, calls: list[int]) -> torch.Tensor:
        anchor = torch.empty(0, requires_grad=True)
        inner = a(x) if leads_to_params else ids
        return b(_SideEffect.apply(calls, anchor, inner) + x), anchor  # type: ignore[no-untyped-call,return-value]

    ref_calls: list[int] = []
    xr = x.clone().requires_grad_()
    out, _ = call(ref1, ref2, xr, ref_calls)
    out.backward(grad)
    calls: list[int] = []
    xs = x.clone().requires_grad_()
    out, anchor = call(lin1, lin2, xs, calls)
    params = [*lin1.parameters(), *lin2.parameters()]
    dx, wg = backward_input([out], [grad], [xs], params, must_run=[anchor])
    assert calls == [1] and ref_calls == [1]
    assert wg.empty is leads_to_params
    wg.run()
    assert calls == [1]
    torch.testing.assert_close(dx[0], xr.grad)
    _compare(ref1, lin1)
    _compare(ref2, lin2)
