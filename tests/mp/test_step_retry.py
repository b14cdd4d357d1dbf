"""mp.step_retry: what a step taken back puts back (gradients, changed buffers, RNG), what makes a step
unrepeatable, and when mp's default pipeline stops retrying."""

from __future__ import annotations

import random

import torch
from torch import nn

from mp.step_retry import ShortcutRetry, StepSnapshot


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 1))


def _step(net: nn.Module, x: torch.Tensor) -> None:
    net(x).sum().backward()


def test_a_step_taken_back_and_run_again_equals_one_run() -> None:
    """Gradients carried over (accumulation), BatchNorm statistics and dropout's draws all come back, so
    the repeated step gives exactly what a single run gives."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    once, twice = _net(), _net()
    for net in (once, twice):
        torch.manual_seed(3)
        _step(net, x)  # gradients to accumulate onto
    # which buffers a step changes: learned from a step on the full path (by value: batch_norm's
    # kernel does not move the running statistics' version counters)
    params, buffers = list(twice.parameters()), list(twice.buffers())
    retry = ShortcutRetry()
    learn = retry.before_step(False, params, buffers, [x])
    assert learn is not None and not learn.restorable
    torch.manual_seed(7)
    _step(twice, x)
    retry.completed(learn, params)
    assert retry.mutable == {id(b) for b in twice[1].buffers()}  # running mean, var and count
    torch.manual_seed(7)
    _step(once, x)

    torch.manual_seed(11)
    _step(once, x)

    torch.manual_seed(11)
    snap = retry.before_step(True, params, buffers, [x])
    assert snap is not None and snap.restorable
    _step(twice, x)  # the attempt that "failed"
    assert snap.restore() is None
    _step(twice, x)  # the step run again
    for a, b in zip(once.state_dict().values(), twice.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(once.parameters(), twice.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad)


def test_gradients_that_were_none_are_none_again() -> None:
    net = _net()
    params, buffers = list(net.parameters()), list(net.buffers())
    snap = StepSnapshot.take(params, buffers, {id(b) for b in buffers}, [])
    _step(net, torch.randn(8, 4))
    assert snap.restore() is None
    assert all(p.grad is None for p in params)


def test_python_and_torch_random_state_come_back() -> None:
    net = _net()
    snap = StepSnapshot.take(list(net.parameters()), [], set(), [])
    drawn = (torch.rand(3), random.random())
    assert snap.restore() is None
    again = (torch.rand(3), random.random())
    assert torch.equal(drawn[0], again[0]) and drawn[1] == again[1]


def test_an_unexpected_in_place_change_makes_the_step_unrepeatable() -> None:
    """A buffer no earlier step changed, a parameter, or the step's input changed in place: the step
    cannot be run again from the snapshot, and restore says why."""
    net = _net()
    params, buffers = list(net.parameters()), list(net.buffers())
    x = torch.randn(8, 4)
    cases = [
        (lambda: buffers[0].add_(1), "buffer of shape (4,)"),
        (lambda: params[0].mul_(2), "parameter of shape (4, 4)"),
        (lambda: x.mul_(2), "changed its input of shape (8, 4)"),
    ]
    for change, said in cases:
        snap = StepSnapshot.take(params, buffers, set(), [x])
        with torch.no_grad():
            change()
        problem = snap.restore()
        assert problem is not None and said in problem, problem


def test_retrying_stops_when_the_flow_changes_too_often() -> None:
    """A flow that changes once in a while (an epoch's short last batch) keeps the shortcut; one that
    changes in more than 1 step in 20, after 3 repeats, gives it up."""
    rare = ShortcutRetry()
    rare.shortcut_steps = 1000
    assert not any(rare.give_up() for _ in range(10))
    often = ShortcutRetry()
    often.shortcut_steps = 9
    assert [often.give_up() for _ in range(3)] == [False, False, True]
