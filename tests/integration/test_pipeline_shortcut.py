"""Fast mode's child-to-child shortcut (mp_pipeline.fast): outputs the parent only passes on go straight
from one child's rank to the next child's, under ``fast_mode: true`` and under mp's default config (a
step the shortcut cannot finish runs again there); training stays exactly plain PyTorch's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mp as smp
from mp import DistributedModel, step
from mp.errors import NotSupportedByFastModeError
from tests.integration._fast_mode import (
    RECORD_STEPS,
    RELAY_OWNERS,
    Relay,
    fast_trainer,
    plain_sgd,
)
from tests.mp_pipeline.models import first_difference


class Chain(torch.nn.Module):
    """Children on rank 1 called one after another from rank 0, with the parent also using (and, when
    ``inplace``, changing) what they return."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(6, 8)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Bilinear(8, 8, 8)
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = self.a(self.embed(x))
        if self.inplace:
            h1.mul_(0.5)  # the copy rank 1 kept is stale now: h1 must travel
        h2 = self.b(h1)  # h1 unchanged: the shortcut
        h3 = self.c(h1, h2)  # h1 again, and h2 (a shortcut too)
        return (torch.tanh(h3) * h1).sum(-1)  # the parent reads h1 itself as well


def chain_fast(world: Any, inplace: bool) -> dict[str, Any]:
    microbatches, steps = 2, RECORD_STEPS + 2
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, generator=g)) for _ in range(steps)]

    ref = Chain(inplace)
    ref_losses = plain_sgd(ref, data, microbatches)

    net = Chain(inplace)
    model, opt, train_step = fast_trainer(net, 2, {"a": 1, "b": 1, "c": 1}, microbatches)

    losses, shortcuts = [], 0
    for x, y in data:
        losses.append(train_step(x, y).reduce_mean().item())
        opt.step()
        opt.zero_grad()
        assert model._runtime is not None
        shortcuts += model._runtime.last_stats["shortcuts"]
    return {
        "rank": smp.rank(),
        "losses": losses,
        "ref_losses": ref_losses,
        "params": first_difference(model.state_dict(), ref.state_dict()),
        "shortcuts": shortcuts,
        "steps": steps,
    }


@pytest.mark.parametrize("inplace", [False, True])
def test_fast_mode_shortcut_is_taken_only_for_unchanged_tensors(worlds: Any, inplace: bool) -> None:
    """Fast mode's child-to-child shortcut trains exactly like plain PyTorch; a tensor the parent changed
    in place travels in full."""
    results = worlds.run(2, chain_fast, inplace, timeout=180)
    for r in results:
        assert r["params"] is None, f"rank {r['rank']}: {r['params']}"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6), r
    # per microbatch: h1 into b, h1 and h2 into c (unless h1 was changed in place: then h2 only)
    per_microbatch = 1 if inplace else 3
    assert results[0]["shortcuts"] == per_microbatch * 2 * results[0]["steps"], results[0]


class TouchesInput(torch.nn.Module):
    """Changes its input in place under no_grad (autograd allows it on a leaf)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h.clamp_(-10.0, 10.0)
        return self.lin(h)


def child_changes_shortcut_input(world: Any) -> dict[str, Any]:
    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 1,
            "fast_mode": True,
            "auto_partition": False,
            "default_partition": 0,
        }
    )
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 8), TouchesInput())
    smp.set_partition(net[1], 1)
    smp.set_partition(net[2], 1)
    model = DistributedModel(net)

    @step
    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        model.backward(loss)
        return loss

    try:
        train_step(torch.randn(4, 6))
    except Exception as exc:
        return {"rank": smp.rank(), "error": f"{type(exc).__name__}: {exc}"}
    return {"rank": smp.rank(), "error": None}


def test_fast_mode_refuses_a_child_that_changes_a_shortcut_input(worlds: Any) -> None:
    """The shortcut shares memory with the producer's kept output: a module changing that input in place
    stops the step on every rank with an error naming the module and the fix (never a wrong gradient)."""
    results = worlds.run(2, child_changes_shortcut_input, timeout=120)
    for r in results:
        assert r["error"] is not None, r
        assert "'2' changed its input 0 in place" in r["error"], r["error"]
        assert "'fast_mode' to False" in r["error"], r["error"]


def relay_fast(world: Any, rewire_at: int | None, rewire: str = "") -> dict[str, Any]:
    microbatches, steps = 2, RECORD_STEPS + 3
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, generator=g)) for _ in range(steps)]
    ref = Relay()
    ref_losses = plain_sgd(ref, data, microbatches)

    net = Relay()
    model, opt, train_step = fast_trainer(net, 4, RELAY_OWNERS, microbatches)

    losses, handoffs, posted, moved, error = [], [], [], [], None
    for s, (x, y) in enumerate(data):
        net.rewire = rewire if s == rewire_at else ""
        try:
            losses.append(train_step(x, y).reduce_mean().item())
        except NotSupportedByFastModeError as exc:
            error = (s, str(exc))
            break
        opt.step()
        opt.zero_grad()
        assert model._runtime is not None
        handoffs.append(model._runtime.last_stats["handoffs"])
        posted.append(model._runtime.last_stats["posted"])
        moved.append(model._runtime.last_stats["tensor_bytes"])
    return {
        "rank": smp.rank(),
        "losses": losses,
        "ref_losses": ref_losses,
        "params": first_difference(model.state_dict(), ref.state_dict()) if error is None else None,
        "handoffs": handoffs,
        "posted": posted,
        "moved": moved,
        "error": error,
    }


def test_fast_mode_hands_outputs_from_child_to_child_across_ranks(worlds: Any) -> None:
    """From the second step on, outputs the parent only passes on go straight from one child's rank to
    the next child's, and their gradients straight back (one transfer each instead of two); training is
    still exactly plain PyTorch's."""
    results = worlds.run(4, relay_fast, None, timeout=240)
    for r in results:
        assert r["error"] is None, r["error"]
        assert r["params"] is None, f"rank {r['rank']}: {r['params']}"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6), r
    # per microbatch: a's output 1 -> 2 and its gradient 2 -> 1; b's output 2 -> 1 and gradient 1 -> 2
    by_rank = {r["rank"]: r["handoffs"] for r in results}
    assert by_rank[0] == by_rank[3] == [0] * len(by_rank[0])
    assert by_rank[1] == by_rank[2] == [0] + [2 * 2] * (len(by_rank[1]) - 1)
    # from the third step (their responses carried no data in the second), rank 0 posts a's and b's
    # forwards and backwards instead of awaiting them; it awaits c (whose output it reads) and d
    posted = {r["rank"]: r["posted"] for r in results}[0]
    assert posted == [0, 0] + [2 * 4] * (len(posted) - 2), posted
    # every tensor is 4x8 floats: 16 of them per microbatch in the first step (each of the 4 calls: input,
    # output, output gradient, input gradient), 12 after it (a's and b's outputs and gradients move once)
    moved = [sum(step) for step in zip(*(r["moved"] for r in results), strict=True)]
    assert moved == [2 * 16 * 128] + [2 * 12 * 128] * (len(moved) - 1), moved


@pytest.mark.parametrize("rewire", ["elsewhere", "twice"])
def test_fast_mode_refuses_a_handed_output_sent_elsewhere(worlds: Any, rewire: str) -> None:
    """A step that passes a handed-off output to another module than in the first step, or to a second
    one, stops on every rank with NotSupportedByFastModeError (its placeholder has no data to send; the
    data went to one consumer), no hang."""
    rewire_at = 2
    results = worlds.run(4, relay_fast, rewire_at, rewire, timeout=240)
    for r in results:
        assert r["error"] is not None, r
        assert r["error"][0] == rewire_at, r["error"]
        assert "'fast_mode' to False" in r["error"][1], r["error"][1]
        assert r["losses"] == pytest.approx(r["ref_losses"][:rewire_at], rel=1e-5, abs=1e-6), r


def relay_auto(world: Any, changes: dict[int, str]) -> dict[str, Any]:
    """The relay under mp's default config, rewired in the steps named in ``changes``."""
    microbatches, steps = 2, 10
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, generator=g)) for _ in range(steps)]
    ref = Relay()
    rewire = lambda s: setattr(ref, "rewire", changes.get(s, ""))  # noqa: E731
    ref_losses = plain_sgd(ref, data, microbatches, rewire, lr=0.01)  # 0.1 diverges within 10 steps
    net = Relay()
    model, opt, train_step = fast_trainer(net, 4, RELAY_OWNERS, microbatches, fast_mode=None, lr=0.01)
    losses, posted = [], []
    for s, (x, y) in enumerate(data):
        net.rewire = changes.get(s, "")
        losses.append(train_step(x, y).reduce_mean().item())
        opt.step()
        opt.zero_grad()
        assert model._runtime is not None
        posted.append(model._runtime.last_stats["posted"])
    assert model._runtime is not None
    return {
        "rank": smp.rank(),
        "losses": losses,
        "ref_losses": ref_losses,
        "params": first_difference(model.state_dict(), ref.state_dict()),
        "posted": posted,
        "relearned": model._runtime.relearned,
    }


def test_the_default_config_runs_a_step_again_when_the_shortcut_cannot_finish_it(worlds: Any) -> None:
    """mp's default config follows fast mode's plan; a step that hands an output elsewhere (step 2) or to
    two consumers (step 6) cannot finish under it, so every rank takes it back and runs it again on the
    full path: no error, training stays exactly plain PyTorch's, and the plan is learned again."""
    results = worlds.run(4, relay_auto, {2: "elsewhere", 6: "twice"}, timeout=240)
    for r in results:
        assert r["params"] is None, f"rank {r['rank']}: {r['params']}"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6), r
        assert r["relearned"] == 2, r
    # the step run again and the next (the plan learned anew) go on the full path; rank 0 posts again
    # from the step after those (its calls' responses then carried no data): steps 5 and 9
    posted = results[0]["posted"]
    assert [p > 0 for p in posted] == [False] * 5 + [True] + [False] * 3 + [True], posted
