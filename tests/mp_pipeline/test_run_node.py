"""pp_rank 0's node for a run of replayed calls (mp_pipeline.link.Run, Chained): the run's one
node makes each call's backward in turn, last call first, with the gradients a node per call would have
passed; the placeholders' hooks run on them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mp_pipeline.errors import FlowChangedError, PipelineError
from mp_pipeline.link import Chained, Run


class _Link:
    """A call's backward as Link.backward gives it: the input gradients for the output gradients."""

    def __init__(self, module: str, log: list[tuple[str, Any]], grad: torch.Tensor | None) -> None:
        self.module = module
        self.n_inputs = 1
        self.log = log
        self.grad = grad
        self.remote = type("R", (), {"server": None})()

    def backward(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        self.log.append((self.module, grads[0]))
        return [self.grad]


def _meta(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(2, 3, device="meta", dtype=dtype)


def _chain(links: list[_Link], joined: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The calls wired as Remote.call wires them: each joins the run (joined) or gets a node of its own."""
    x0 = torch.empty(2, 3, device="meta", requires_grad=True)
    x, run, taken = x0, None, []
    for link in links:
        if joined and run is not None:
            run.join(link, x)  # type: ignore[arg-type]
            inputs = run.inputs
        else:
            run, inputs = Run(link, [x]), (x,)  # type: ignore[arg-type]
        assert inputs is not None
        taken.append(x)
        (x,) = Chained.apply(run, len(run.links), [_meta()], *inputs)  # type: ignore[no-untyped-call]
    return x0, x, taken


@pytest.mark.parametrize("joined", [False, True])
def test_a_run_makes_each_backward_in_turn_with_the_gradients_nodes_per_call_pass(joined: bool) -> None:
    log: list[tuple[str, Any]] = []
    grads = [torch.full((2, 3), float(i), device="meta") for i in range(3)]
    links = [_Link(f"b{i}", log, grads[i]) for i in range(3)]
    x0, out, _ = _chain(links, joined)
    seed = _meta()
    got = torch.autograd.grad(out, x0, seed)
    assert [m for m, _ in log] == ["b2", "b1", "b0"]
    assert log[0][1] is seed
    assert log[1][1] is grads[2] and log[2][1] is grads[1]  # each call's input gradient, to the call before
    assert got[0] is grads[0]
    below = out.grad_fn.next_functions[0][0]  # joined: the run's input (a leaf here); else the call before
    assert (below.name() == "torch::autograd::AccumulateGrad") == joined


def test_a_hook_on_a_placeholder_inside_the_run_runs_on_its_gradient_also_when_registered_later() -> None:
    log: list[tuple[str, Any]] = []
    replaced = torch.empty(2, 3, device="meta")
    links = [_Link(f"b{i}", log, _meta()) for i in range(3)]
    _, out, taken = _chain(links, joined=True)
    seen: list[torch.Tensor] = []
    taken[2].register_hook(lambda g: seen.append(g) or replaced)  # after the last call took it
    del taken
    torch.autograd.backward(out, _meta())
    assert len(seen) == 1
    assert log[1][1] is replaced  # what the hook returned went on to the call that made the placeholder


def test_the_gradient_passed_on_is_cast_to_the_placeholder_dtype_and_a_wrong_shape_is_named() -> None:
    log: list[tuple[str, Any]] = []
    links = [_Link("b0", log, _meta()), _Link("b1", log, _meta(torch.float64))]
    _, out, _ = _chain(links, joined=True)
    torch.autograd.backward(out, _meta())
    assert log[1][1].dtype == torch.float32
    links = [_Link("b0", log, _meta()), _Link("b1", log, torch.empty(3, 2, device="meta"))]
    _, out, _ = _chain(links, joined=True)
    with pytest.raises(PipelineError, match="'b1' returned an input gradient of shape"):
        torch.autograd.backward(out, _meta())


def test_retain_grad_added_inside_a_run_is_a_flow_change() -> None:
    links = [_Link(f"b{i}", [], _meta()) for i in range(2)]
    _, out, taken = _chain(links, joined=True)
    taken[1].retain_grad()
    with pytest.raises(FlowChangedError, match="retain_grad"):
        torch.autograd.backward(out, _meta())
