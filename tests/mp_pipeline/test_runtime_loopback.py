"""The runtime on two simulated ranks in one process (loopback transport, one thread per rank).

Every parameter a rank does not own is filled with NaN on that rank, so any use of it on the wrong
rank would show; gradients must equal plain PyTorch's, for both schedules.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mp_comm.transport import LoopbackHub, TransportConfig
from mp_pipeline import (
    ExecState,
    PipelineRuntime,
    RemoteExecutionError,
    Scheduler,
    pipelined_backward,
)
from mp_pipeline.schedule import Phase, Task
from tests.mp_pipeline._loopback import owner_of, run_two_ranks
from tests.mp_pipeline.models import ReuseBranch

ASSIGN = {
    "": 0,
    "embed": 0,
    "shared": 1,
    "shared.inner": 0,
    "shared.gate": 1,
    "pos": 0,
    "pos.inner": 0,
    "pos.gate": 0,
    "neg": 1,
    "neg.inner": 1,
    "neg.gate": 1,
    "head": 1,
    "head.proj": 1,
}


@pytest.mark.parametrize(
    ("kind", "microbatches", "checkpointed"),
    [
        ("simple", 4, frozenset()),
        ("interleaved", 2, frozenset()),
        ("interleaved", 1, frozenset({"shared", "head"})),  # the owner recomputes these in backward
    ],
)
def test_remote_autograd_matches_plain_pytorch(
    kind: str, microbatches: int, checkpointed: frozenset[str]
) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 16, (8, 5))
    target = torch.randint(0, 3, (8,))

    def make() -> nn.Module:
        torch.manual_seed(1)
        return ReuseBranch()

    def loss_for(model: nn.Module, mb: int) -> torch.Tensor:
        size = 8 // microbatches
        sl = slice(mb * size, (mb + 1) * size)
        out = model(ids[sl])
        assert out["rows"] == size and out["nothing"] is None and torch.equal(out["ids"], ids[sl])
        return F.cross_entropy(out["logits"], target[sl])

    def body(model: nn.Module, mb: int) -> torch.Tensor:
        loss = loss_for(model, mb)
        pipelined_backward(loss / microbatches)
        return loss.detach()

    models, results = run_two_ranks(make, ASSIGN, body, microbatches, kind, checkpointed=checkpointed)
    assert not isinstance(results[0], BaseException), results[0]
    assert not isinstance(results[1], BaseException), results[1]
    assert [t.item() for t in results[0]] == [t.item() for t in results[1]]  # rank 1 got the results

    ref = make()
    for mb in range(microbatches):
        (loss_for(ref, mb) / microbatches).backward()
    for name, p in ref.named_parameters():
        got = dict(models[owner_of(ASSIGN, name)].named_parameters())[name].grad
        if p.grad is None:
            assert got is None or not got.any(), name
            continue
        assert got is not None, f"{name}: no gradient on its owner"
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6, msg=name)


SEQ_SPLIT = {"": 0, "0": 1, "1": 1, "2": 0}
"""A three-layer nn.Sequential split across the two ranks: its first and middle layers on rank 1."""


def _sum_loss(x: torch.Tensor) -> Callable[[nn.Module, int], torch.Tensor]:
    """A step body: the sum of the model's output on microbatch ``mb`` (2 rows of ``x``), backward."""

    def body(model: nn.Module, mb: int) -> torch.Tensor:
        loss = model(x[mb * 2 : mb * 2 + 2]).sum()
        pipelined_backward(loss)
        return loss.detach()

    return body


def test_forward_only_step_under_no_grad_saves_nothing() -> None:
    x = torch.randn(4, 6)

    def make() -> nn.Module:
        torch.manual_seed(2)
        return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))

    def body(model: nn.Module, mb: int) -> torch.Tensor:
        with torch.no_grad():
            return model(x[mb * 2 : mb * 2 + 2])  # type: ignore[no-any-return]

    _, results = run_two_ranks(make, SEQ_SPLIT, body, 2, "interleaved")
    ref = make()
    torch.testing.assert_close(torch.cat(results[0]), ref(x).detach())
    torch.testing.assert_close(torch.cat(results[1]), ref(x).detach())


def test_workers_are_kept_across_steps_and_stopped_by_close() -> None:
    x = torch.randn(4, 6)

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))

    kept: list[PipelineRuntime] = []
    _, results = run_two_ranks(make, SEQ_SPLIT, _sum_loss(x), 2, "interleaved", steps=3, keep=kept)
    assert not any(isinstance(r, BaseException) for r in results), results
    threads = [w.thread for rt in kept for w in rt.pool.workers]
    assert all(rt.pool.created > 0 for rt in kept)
    assert [rt.last_stats["workers"] for rt in kept] == [0, 0]  # the third step started no thread
    assert threads and all(t.is_alive() for t in threads)
    for rt in kept:
        rt.close()
    assert not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("microbatches", [1, 3])
def test_a_thread_holding_the_rank_takes_the_next_message_itself_when_nothing_else_could_run(
    microbatches: int,
) -> None:
    """pp_rank 0's step thread takes its own response when the schedule has nothing to start meanwhile,
    and pp_rank 1's worker takes the next request after answering one; with several microbatches the
    schedule has forwards to start, so pp_rank 0 hands back to its main thread (as before)."""
    x = torch.randn(2 * microbatches, 6)

    def make() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))

    kept: list[PipelineRuntime] = []
    models, results = run_two_ranks(make, SEQ_SPLIT, _sum_loss(x), microbatches, "simple", keep=kept)
    assert not any(isinstance(r, BaseException) for r in results), results
    ref = make()
    ref(x).sum().backward()
    for name, p in ref.named_parameters():
        got = dict(models[owner_of(SEQ_SPLIT, name)].named_parameters())[name].grad
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    front, back = (rt.last_stats for rt in kept)
    # rank 1 owns two of the layers: 2 FWD and 2 BWD requests per microbatch. Its worker takes every
    # request after the first itself (the main thread takes the first, and the step's end).
    assert back["requests"] == 4 * microbatches and back["in_place"] == 4 * microbatches - 1, back
    if microbatches == 1:  # nothing else to start: rank 0's step thread takes all of its responses
        assert front["responses"] == front["in_place"] == 4, front
    else:  # while a forward may start, a response goes through the main thread, which starts it
        assert front["responses"] == 12 and front["in_place"] < 12, front
    for rt in kept:
        rt.close()


class _BusyProbe(nn.Linear):
    """Records, in forward and in backward, whether its rank's transport is marked busy."""

    seen: list[tuple[int, str, bool]]
    rank = -1
    transport: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.transport is not None:
            rank, t = self.rank, self.transport
            self.seen.append((rank, "forward", t.busy))
            out.register_hook(lambda g: self.seen.append((rank, "backward", t.busy)))
        return out


def test_a_rank_is_busy_except_while_its_server_waits_for_messages() -> None:
    # The transport's progress thread polls rarely while busy (TransportConfig.poll_busy): every module
    # runs on a worker thread, the rank's main thread serves messages in between (and drives progress
    # itself while it waits), and between steps the script runs its own code.
    x = torch.randn(4, 6)
    seen: list[tuple[int, str, bool]] = []
    waits: list[bool] = []

    def make() -> nn.Module:
        return nn.Sequential(_BusyProbe(6, 6), nn.Tanh(), _BusyProbe(6, 2))

    def watch(models: list[nn.Module], transports: list[Any]) -> None:
        for r, model in enumerate(models):
            for module in model:
                if isinstance(module, _BusyProbe):
                    module.seen, module.rank, module.transport = seen, r, transports[r]
            recv = transports[r].recv

            def recording(*args: Any, t: Any = transports[r], recv: Any = recv, **kwargs: Any) -> Any:
                waits.append(t.busy)
                return recv(*args, **kwargs)

            transports[r].recv = recording

    kept: list[PipelineRuntime] = []
    _, results = run_two_ranks(
        make, SEQ_SPLIT, _sum_loss(x), 2, "interleaved", steps=2, keep=kept, before=watch
    )
    assert not any(isinstance(r, BaseException) for r in results), results
    assert {(r, phase) for r, phase, _ in seen} == {(r, p) for r in (0, 1) for p in ("forward", "backward")}
    assert all(busy for *_, busy in seen), seen
    assert waits and not any(waits), waits  # the server's waits drive progress: not busy
    assert all(rt.transport.busy for rt in kept)  # back to the script after the step
    for rt in kept:
        rt.close()


class Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyError("no such thing")


def test_an_error_on_the_owner_reaches_both_ranks() -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(2, 2), Boom())

    def body(model: nn.Module, mb: int) -> torch.Tensor:
        return model(torch.ones(1, 2))  # type: ignore[no-any-return]

    _, results = run_two_ranks(make, {"": 0, "0": 0, "1": 1}, body, 2, "simple")
    assert isinstance(results[0], RemoteExecutionError), results[0]
    assert results[0].rank == 1 and results[0].module == "1" and "no such thing" in str(results[0])
    assert "raise KeyError" in results[0].remote_traceback
    assert "rank 1" in str(results[1]) and "no such thing" in str(results[1])


def test_a_collective_entered_by_a_rank_that_finished_the_step_first_is_kept_for_it() -> None:
    """pp=3: rank 2 entered a gather (its Entered reaches ranks 0 and 1 while they still serve the step,
    as when rank 2 got the step's end first). The servers keep it instead of dropping it, and the
    gather's arrival check on ranks 0 and 1 then completes with it."""
    from mp_pipeline.messages import ENTERED_TAG, Entered

    hub = LoopbackHub(3, config=TransportConfig(timeout=30.0, spin_time=0.0, poll_min=5e-4, poll_max=5e-4))
    transports = [hub.transport(r) for r in range(3)]
    torch.manual_seed(1)
    model = ReuseBranch()
    runtimes = [
        PipelineRuntime(transport=transports[r], rank=r, peers=(0, 1, 2), model_id=1, timeout=10.0)
        for r in range(3)
    ]
    for r in range(3):
        runtimes[r].install(model if r == 0 else ReuseBranch(), ASSIGN)  # rank 2 owns nothing
    for dest in (0, 1):  # already waiting in their mailboxes when the step starts
        transports[2].send(Entered("model.state_dict()", 1), dest, ENTERED_TAG).wait()
    ids = torch.randint(0, 16, (4, 5))
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            runtimes[r].run_step(
                lambda mb: model(ids)["logits"].sum().detach(), Scheduler("simple", 1), ExecState(True)
            )
            if r < 2:
                runtimes[r].enter("model.state_dict()")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    assert runtimes[0]._entered == {2: []} and runtimes[1]._entered == {2: []}  # taken from the servers' keep


class _Watched(Scheduler):
    """Records, at each start, whether a backward was ready and whether a forward could start."""

    def __init__(self) -> None:
        super().__init__("interleaved", 4, 2)
        self.choices: list[tuple[Task, bool, bool]] = []

    def next_task(self) -> Task | None:
        forwards = sum(t.phase is Phase.FORWARD for t in self.issued)
        ready, room = bool(self.ready), forwards < self.microbatches and self.in_flight < self.active
        task = super().next_task()
        if task is not None:
            self.choices.append((task, ready, room))
        return task


@pytest.mark.parametrize("first", ["remote", "local"])
def test_replay_starts_a_forward_that_feeds_another_rank_before_a_ready_backward(first: str) -> None:
    """Under per-rank replay pp_rank 0 learns which forwards feed another rank first: the step function's
    first call to another rank came before any module of pp_rank 0 returned (the first layer on rank 1,
    as T5's encoder). Those start before a ready backward; where pp_rank 0 computes first (its layer 0, as
    the GPTs' first stage) a ready backward goes first (which one a run meets depends on its timing;
    test_schedule shows both orders). Gradients equal plain PyTorch's either way."""
    assignment = {"": 0, "0": 1, "1": 0, "2": 0} if first == "remote" else {"": 0, "0": 0, "1": 1, "2": 0}
    x = torch.randn(8, 6)
    steps = 6  # fast mode learns its plan in step 1, replay records steps 3 and 4 and replays from 5

    def make() -> nn.Module:
        torch.manual_seed(2)
        return nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3))

    made: list[_Watched] = []

    def scheduler() -> Scheduler:
        made.append(_Watched())
        return made[-1]

    kept: list[PipelineRuntime] = []
    models, results = run_two_ranks(
        make,
        assignment,
        _sum_loss(x),
        4,
        "interleaved",
        steps=steps,
        keep=kept,
        scheduler=scheduler,
        strict=True,
        retry=True,
    )
    assert not isinstance(results[0], BaseException), results[0]
    assert not isinstance(results[1], BaseException), results[1]
    replay = kept[0].replays[""]
    assert replay.active is not None, "the step never replayed"
    assert replay.leading == (frozenset(range(4)) if first == "remote" else frozenset())
    driven = [s for s in made if s.issued]  # pp_rank 0's (rank 1's is never asked)
    assert len(driven) == steps
    assert driven[-1].forward_first == replay.leading and not driven[0].forward_first
    for task, ready, room in driven[-1].choices:
        if first == "remote":  # never a backward while a forward could start
            assert task.phase is Phase.FORWARD or not room, driven[-1].choices
        else:  # never a forward while a backward was ready
            assert task.phase is Phase.BACKWARD or not ready, driven[-1].choices
    ref = make()
    for _ in range(steps):
        for mb in range(4):
            ref(x[mb * 2 : mb * 2 + 2]).sum().backward()
    for name, p in ref.named_parameters():
        got = dict(models[owner_of(assignment, name)].named_parameters())[name].grad
        assert got is not None, name
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6, msg=name)
