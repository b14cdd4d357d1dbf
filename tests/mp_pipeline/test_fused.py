"""A run of programmed calls on one owner served as one graph (mp_pipeline.fused), on the owner's side of
mp_pipeline.remote without processes: three blocks on rank 1, each output handed to the next block there,
run from pp_rank 0's program (forwards, then the backwards in reverse). Joined, the run has one autograd
pass; the responses (what pp_rank 0 checks) and every gradient equal those of the calls served one by
one and of plain PyTorch. Where a boundary can be observed it stays."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from mp_pipeline.context import ExecState
from mp_pipeline.fused import Fusion, meta_like
from mp_pipeline.messages import Ref, Request, Response, StepId
from mp_pipeline.remote import Remote
from mp_pipeline.replay import REPLAY_BASE
from mp_pipeline.schedule import Phase
from mp_pipeline.structure import flatten

OWNER = 1
STEP = StepId(0, 5)


class _Server:
    """What the owner's side of Remote asks of its step's server: counters and handed tensors."""

    def __init__(self) -> None:
        self.stats: dict[str, int] = {"handoffs": 0}
        self.handed: dict[Any, torch.Tensor] = {}

    def wake(self, key: Any) -> None:
        pass

    def hand(self, dest: int, key: Any, tensor: torch.Tensor) -> None:
        assert dest == OWNER, dest
        self.handed[key] = tensor

    def take(self, key: Any) -> torch.Tensor:
        return self.handed.pop(key)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)))


def _request(i: int, phase: Phase, **fields: Any) -> Request:
    base: dict[str, Any] = {
        "step": STEP,
        "request_id": REPLAY_BASE + i,
        "requester": 0,
        "phase": phase,
        "module": str(i % 3),
        "microbatch": 0,
        "position": ("<step>", str(i % 3)),
        "payload": None,
        "tensors": [None],
        "requires_grad": (True,) if phase is Phase.FORWARD else (),
        "state": ExecState(True),
    }
    base.update(fields)
    return Request(**base)


def _run(
    model: nn.Sequential, x: torch.Tensor, g: torch.Tensor, *, checkpoint: bool = False, requester: int = 0
) -> tuple[list[Response], dict[str, int]]:
    """Blocks 0, 1, 2 on rank 1 as pp_rank 0's program has them: 0 takes ``x`` from rank 0 and hands its
    output to 1, 1 to 2, 2's output goes back; then the backwards of 2 (gradient ``g``), 1 and 0."""
    remote = Remote(OWNER, (0, OWNER))
    remote.shortcut = True
    remote.install(model, {"": 0, **{str(i): OWNER for i in range(3)}})
    remote.fusion.begin_step()  # (the runtime's Remote.begin_step: global hooks looked up per step)
    if checkpoint:
        remote.checkpointed.add("1")
    server = _Server()
    remote.server = server
    payload = flatten(((x,), {}))[0]
    ids = [REPLAY_BASE + i for i in range(3)]

    def forward(i: int, **fields: Any) -> Request:
        return _request(
            i, Phase.FORWARD, payload=payload, requester=requester, checkpoint=checkpoint and i == 1, **fields
        )

    requests = [
        forward(0, tensors=[x], handoff=((0, OWNER),)),
        forward(1, refs=(Ref(0, OWNER, ids[0], 0, True),), handoff=((0, OWNER),)),
        forward(2, refs=(Ref(0, OWNER, ids[1], 0, True),)),
        _request(3, Phase.BACKWARD, module="2", forward_id=ids[2], tensors=[g], requester=requester),
        _request(4, Phase.BACKWARD, module="1", forward_id=ids[1], handed=(0,), requester=requester),
        _request(5, Phase.BACKWARD, module="0", forward_id=ids[0], handed=(0,), requester=requester),
    ]
    responses = [remote.handle(r) for r in requests]
    remote.uninstall()
    return responses, server.stats


def _plain(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model = _model()
    leaf = x.clone().requires_grad_()
    out = model(leaf)
    out.backward(g)
    assert leaf.grad is not None
    return (
        out.detach(),
        leaf.grad,
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    )


def _shapes(response: Response) -> list[tuple[Any, ...] | None]:
    return [None if t is None else (tuple(t.shape), t.dtype, t.is_meta) for t in response.tensors]


def _check(responses: list[Response], model: nn.Sequential, x: torch.Tensor, g: torch.Tensor) -> None:
    out, grad_x, grads = _plain(x, g)
    assert torch.equal(responses[2].tensors[0], out)  # type: ignore[arg-type]
    got = responses[5].tensors[0]
    assert got is not None and not got.is_meta and torch.equal(got, grad_x)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, grads[name]), name
    # what pp_rank 0 gets (and checks): placeholders of handed-back gradients and of handed-off outputs
    meta = [((2, 4), torch.float32, True)]
    assert [_shapes(r) for r in responses] == [meta, meta, [((2, 4), torch.float32, False)], meta, meta,
                                               [((2, 4), torch.float32, False)]]  # fmt: skip


def test_a_run_is_one_graph_with_one_backward_and_equals_plain_pytorch() -> None:
    x, g = torch.randn(2, 4), torch.randn(2, 4)
    model = _model()
    responses, stats = _run(model, x, g)
    assert stats["fused"] == 2  # blocks 1 and 2 joined the graph of the block before them
    _check(responses, model, x, g)


@pytest.mark.parametrize(
    "why", ["hook inside", "module hook", "global hook", "checkpointed", "not programmed"]
)
def test_an_observable_boundary_stays_and_the_result_is_the_same(why: str) -> None:
    """A forward hook inside block 1 (or on it, or on every module), block 1 checkpointed, or calls not
    from pp_rank 0's program: served call by call (nothing joined), with the same responses."""
    x, g = torch.randn(2, 4), torch.randn(2, 4)
    model = _model()
    handles = []
    if why == "hook inside":
        handles.append(model[1][0].register_forward_hook(lambda m, a, o: None))
    elif why == "module hook":
        handles.append(model[1].register_full_backward_hook(lambda m, gi, go: None))
    elif why == "global hook":
        handles.append(nn.modules.module.register_module_forward_hook(lambda m, a, o: None))
    requester = 2 if why == "not programmed" else 0  # 2: another rank's calls (nested ones)
    try:
        responses, stats = _run(model, x, g, checkpoint=why == "checkpointed", requester=requester)
    finally:
        for h in handles:
            h.remove()
    assert stats.get("fused", 0) == 0, stats
    _check(responses, model, x, g)


def test_produces_only_one_output_with_a_graph_and_no_nested_call() -> None:
    a = torch.ones(2, requires_grad=True)
    made = a * 2
    assert Fusion.produces([made], [])
    assert not Fusion.produces([made, made * 3], [])  # two outputs that require grad
    assert not Fusion.produces([a], [])  # a leaf: no graph to join
    assert not Fusion.produces([made], [torch.empty(0, requires_grad=True)])  # it called another rank


@pytest.mark.parametrize(
    "t",
    [
        torch.ones(2, 3),
        torch.ones(3, 2).t(),
        torch.ones(2, 3, dtype=torch.float16),
        torch.ones(()),
        torch.ones(0, 4),
        torch.ones(2, 3, 4, 4).to(memory_format=torch.channels_last),
    ],
    ids=["contiguous", "transposed", "half", "scalar", "empty", "channels_last"],
)
def test_meta_like_is_empty_like_on_meta(t: torch.Tensor) -> None:
    """The placeholders of answered gradients and handed-off outputs: what empty_like(meta) gives, each
    a tensor of its own (two calls' placeholders are not one object)."""
    a, b, want = meta_like(t), meta_like(t), torch.empty_like(t, device="meta")
    for got in (a, b):
        assert (got.shape, got.dtype, got.stride(), got.device, got.requires_grad, got.layout) == (
            want.shape,
            want.dtype,
            want.stride(),
            want.device,
            want.requires_grad,
            want.layout,
        )
    assert a is not b
