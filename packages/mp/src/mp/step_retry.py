"""Taking a pipelined step back, so that a step that failed under the fast-mode plan can run again.

mp's default pipeline follows fast mode's plan (outputs handed child to child, calls posted without
waiting for their responses: mp_pipeline.fast, mp_pipeline.posted) from the second step on. The plan
assumes the flow of the step it was learned from; a step whose flow differs fails part-way. Rather than
raise, as smp's ``fast_mode`` did, mp takes the step back on every rank and runs it again on the full
path, where every output returns to its caller, so the result is exact whatever the flow.

A failed attempt has changed the rank's state in three places, and :class:`StepSnapshot` restores each:

* the parameters' ``.grad`` (the backward of some microbatches ran): ``None`` is put back as ``None``; a
  gradient carried over from an earlier step (accumulation) is cloned before the step;
* buffers that a forward changes in place (BatchNorm's running statistics). Only the buffers whose
  values changed in a step on the full path (the first one, and the first after each retry) are
  cloned; any other parameter or buffer whose version counter moved makes the step unrepeatable, and
  the original error is raised. (A native kernel that changes a buffer without moving its version
  counter, as batch_norm does with its running statistics, and does so only in later steps, goes
  unseen: keep such a layer in the first step's flow, or set ``fast_mode: false``);
* the random number generators (torch's CPU and CUDA default generators, ``random``, and numpy's when
  imported), so dropout draws the same numbers in the retried step.

What the step function itself does besides running the model (printing, appending to a list) happens
twice for a retried step.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["StepSnapshot", "changed_buffers"]


def _rng_state() -> tuple[Any, ...]:
    initialized = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda = torch.cuda.get_rng_state_all() if initialized else None
    numpy = sys.modules.get("numpy")
    return (
        torch.get_rng_state(),
        cuda,
        random.getstate(),
        numpy.random.get_state() if numpy is not None else None,
    )


def _set_rng_state(saved: tuple[Any, ...]) -> None:
    cpu, cuda, py, np_state = saved
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    numpy = sys.modules.get("numpy")
    if np_state is not None and numpy is not None:
        numpy.random.set_state(np_state)


@dataclass
class StepSnapshot:
    """One rank's state before a step, enough to run the step again from it (module docstring)."""

    grads: list[tuple[nn.Parameter, torch.Tensor | None]]
    saved: list[tuple[torch.Tensor, torch.Tensor]]
    """(buffer, its clone) for the buffers known to change in a step."""
    versions: list[tuple[torch.Tensor, int]]
    """Every local parameter and buffer with its version counter before the step."""
    rng: tuple[Any, ...]
    inputs: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    """The step's input tensors with their version counters (the step function may change them)."""
    restorable: bool = True
    """False for a snapshot of versions only (a step on the full path, never run again)."""

    @classmethod
    def take(
        cls,
        params: list[nn.Parameter],
        buffers: list[torch.Tensor],
        mutable: set[int],
        inputs: list[torch.Tensor],
    ) -> StepSnapshot:
        """``mutable``: ids of the buffers that an earlier step changed (see :func:`changed_buffers`)."""
        grads = [(p, None if p.grad is None else p.grad.detach().clone()) for p in params]
        saved = [(b, b.detach().clone()) for b in buffers if id(b) in mutable]
        versions = [(t, t._version) for t in (*params, *buffers)]
        return cls(grads, saved, versions, _rng_state(), [(t, t._version) for t in inputs])

    def restore(self) -> str | None:
        """Put the state back; returns what could not be put back (then the step cannot run again)."""
        if not self.restorable:
            return "the step ran on the full path"
        kept = {id(b) for b, _ in self.saved}
        for t, version in self.inputs:
            if t._version != version:
                return f"the step function changed its input of shape {tuple(t.shape)} in place"
        for t, version in self.versions:
            if t._version != version and id(t) not in kept:
                kind = "parameter" if isinstance(t, nn.Parameter) else "buffer"
                return f"a {kind} of shape {tuple(t.shape)} was changed in place during the step"
        for p, grad in self.grads:
            if grad is None:
                p.grad = None
            elif p.grad is not None and p.grad.shape == grad.shape:
                with torch.no_grad():
                    p.grad.copy_(grad)
            else:
                p.grad = grad
        with torch.no_grad():
            for b, value in self.saved:
                b.copy_(value)
        _set_rng_state(self.rng)
        return None


def changed_buffers(snapshot: StepSnapshot, params: list[nn.Parameter]) -> set[int]:
    """Ids of the buffers that changed since ``snapshot`` (after a completed step): by value for the
    buffers it cloned (a native kernel may not move the version counter), else by version counter."""
    ids = {id(p) for p in params}
    changed = {id(b) for b, value in snapshot.saved if not torch.equal(b, value)}
    changed |= {id(t) for t, version in snapshot.versions if id(t) not in ids and t._version != version}
    return changed


class ShortcutRetry:
    """When mp's default pipeline takes a step back and runs it again, and when it stops trying.

    A flow that changes now and then (the short last batch of an epoch, an evaluation step between
    training steps) costs one repeated step each time, after which the plan is learned again. A flow
    that changes in more than one step in ``GIVE_UP_RATIO`` (after ``GIVE_UP_AFTER`` repeats) would
    cost more than the shortcut saves, so every later step runs on the full path.
    """

    GIVE_UP_AFTER = 3
    GIVE_UP_RATIO = 20

    def __init__(self) -> None:
        self.mutable: set[int] = set()
        """Ids of the local buffers that a completed step changed (cloned before each shortcut step)."""
        self.repeated = 0
        self.shortcut_steps = 0

    def before_step(
        self,
        shortcut: bool,
        params: list[nn.Parameter],
        buffers: list[torch.Tensor],
        inputs: list[torch.Tensor],
    ) -> StepSnapshot | None:
        """A snapshot before a step that follows the plan (``shortcut``), or one that learns which
        buffers change (the first steps), else None."""
        if not shortcut:  # a step on the full path: learn which buffers a step changes
            saved = [(b, b.detach().clone()) for b in buffers]
            return StepSnapshot(
                [], saved, [(t, t._version) for t in (*params, *buffers)], (), restorable=False
            )
        self.shortcut_steps += 1
        return StepSnapshot.take(params, buffers, self.mutable, inputs)

    def completed(self, snapshot: StepSnapshot, params: list[nn.Parameter]) -> None:
        self.mutable |= changed_buffers(snapshot, params)

    def give_up(self) -> bool:
        """After a repeated step: whether to stop following the plan."""
        self.repeated += 1
        return (
            self.repeated >= self.GIVE_UP_AFTER and self.repeated * self.GIVE_UP_RATIO > self.shortcut_steps
        )
