"""Fast mode's plan (mp_pipeline.fast), without processes: what the first step learns about the outputs
of remote calls, and which of them later steps hand from child to child."""

from __future__ import annotations

import threading

import torch

from mp_pipeline.fast import CallKey, FastPlan

A: CallKey = (("<step>", "a"), 0, 0)
B: CallKey = (("<step>", "b"), 0, 0)


def learning() -> FastPlan:
    plan = FastPlan()
    plan.begin_step()
    assert plan.learning
    return plan


def test_an_output_passed_on_to_one_module_is_handed_off() -> None:
    plan = learning()
    out = torch.ones(2, 3, requires_grad=True)
    other = torch.ones(2, 3, requires_grad=True)
    plan.produced(A, (out, other))
    with plan.watching():
        # metadata reads are what a placeholder can answer too
        assert out.shape == (2, 3) and out.size(0) == 2 and out.dtype == torch.float32 and out.requires_grad
        assert out.dim() == 2 and out.numel() == 6 and out.grad_fn is None
    plan.consumed([out, other], (True, True), dest=2)
    plan.consumed([other], (True,), dest=3)  # a second consumer: stays with the parent
    plan.end_step(completed=True)
    assert plan.learned and not plan.learning
    assert plan.handoff(A) == ((0, 2),)
    assert plan.handoff(B) == ()
    assert plan.planned == 1
    plan.begin_step()
    assert not plan.learning  # learned once, in the first completed step


def test_what_the_parent_reads_or_returns_stays_with_it() -> None:
    plan = learning()
    read, device, changed, returned, plain = (torch.ones(3, requires_grad=True) for _ in range(5))
    plan.produced(A, (read, device, changed, returned, plain))
    with plan.watching():
        torch.cat([read, torch.zeros(3)])  # nested in a list
        _ = device.device  # a placeholder's device is meta: reading it counts as use
        with torch.no_grad():
            changed.add_(1)
    plan.touched({"out": [returned]})  # returned from the step or to the parent's own caller
    for t in (read, device, changed, returned, plain):
        plan.consumed([t], (True,), dest=1)
    plan.end_step(completed=True)
    assert plan.handoff(A) == ((4, 1),)


def test_an_input_that_needs_no_grad_at_its_consumer_is_not_handed_off() -> None:
    plan = learning()
    out = torch.ones(3, requires_grad=True)
    plan.produced(A, (out,))
    plan.consumed([out], (False,), dest=1)  # consumed under no_grad: no gradient path to send back
    plan.end_step(completed=True)
    assert plan.handoff(A) == ()


def test_the_watch_is_per_thread_and_only_while_learning() -> None:
    plan = learning()
    out = torch.ones(3, requires_grad=True)
    plan.produced(A, (out,))
    with plan.watching():
        worker = threading.Thread(target=lambda: out + 1)  # another thread's use is not this parent's
        worker.start()
        worker.join()
    plan.consumed([out], (True,), dest=1)
    plan.end_step(completed=True)
    assert plan.handoff(A) == ((0, 1),)
    plan.begin_step()
    with plan.watching():  # a no-op once learned
        assert torch.overrides._get_current_function_mode() is None  # type: ignore[attr-defined]


def test_a_failed_first_step_teaches_nothing() -> None:
    plan = learning()
    out = torch.ones(3, requires_grad=True)
    plan.produced(A, (out,))
    plan.consumed([out], (True,), dest=1)
    plan.end_step(completed=False)
    assert not plan.learned and plan.handoff(A) == ()
    plan.begin_step()
    assert plan.learning  # the next step learns instead


def test_only_the_output_object_itself_counts_as_passed_on() -> None:
    plan = learning()
    out = torch.ones(3, requires_grad=True)
    plan.produced(A, (out,))
    plan.consumed([out.view(3)], (True,), dest=1)  # a view is another tensor: the data would be needed
    plan.end_step(completed=True)
    assert plan.handoff(A) == ()
