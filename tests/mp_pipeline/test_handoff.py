"""The per-request hand-offs of the module server: the Baton between threads, the execution state
(grad mode, autocast, task) a request carries and re-applies, and what pp_rank 0 does first."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mp_comm.transport import LoopbackHub, TransportConfig
from mp_pipeline.context import ExecState, TaskContext, applied, capture, current, task_context
from mp_pipeline.handoffs import Waiter
from mp_pipeline.messages import TAG, Failure, Handoff, Request, Response, StepId
from mp_pipeline.schedule import Phase, Task
from mp_pipeline.server import Server
from mp_pipeline.workers import MAIN, Baton, ServerClosed


def _start(target: object) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


def test_baton_runs_one_holder_at_a_time_in_hand_off_order() -> None:
    baton = Baton()
    tokens = [object() for _ in range(3)]
    order: list[int] = []

    def worker(i: int) -> None:
        for _ in range(20):
            baton.wait_for(tokens[i])
            order.append(i)
            baton.hand(MAIN)

    threads = [_start(lambda i=i: worker(i)) for i in range(3)]
    expected = []
    for rnd in range(20):
        for i in (rnd % 3, (rnd + 1) % 3, (rnd + 2) % 3):
            baton.switch(tokens[i], MAIN)  # returns only once worker i handed the baton back
            expected.append(i)
    for t in threads:
        t.join(timeout=5)
    assert order == expected


def test_baton_hand_off_before_the_waiter_arrives_is_kept() -> None:
    baton = Baton()
    token = object()
    baton.hand(token)  # nobody waits on it yet
    baton.wait_for(token)  # returns at once: the baton is already the token's
    done = threading.Event()

    def give_back() -> None:
        baton.hand(MAIN)
        done.set()

    _start(give_back)
    baton.wait_for(MAIN)
    assert done.wait(5)


def test_baton_close_wakes_every_waiter_with_the_error() -> None:
    baton = Baton()
    errors: list[BaseException] = []

    def waiter(token: object) -> None:
        try:
            baton.wait_for(token)
        except ServerClosed as exc:
            errors.append(exc)

    threads = [_start(lambda: waiter(object())) for _ in range(3)]
    time.sleep(0.05)
    baton.close(ServerClosed())
    for t in threads:
        t.join(timeout=5)
    assert len(errors) == 3 and not any(t.is_alive() for t in threads)


def test_baton_idle_waiter_gives_up_once_not_alive() -> None:
    baton = Baton()
    alive = threading.Event()
    alive.set()
    raised = threading.Event()

    def idle() -> None:
        try:
            baton.wait_for(object(), alive.is_set)
        except ServerClosed:
            raised.set()

    thread = _start(idle)
    alive.clear()
    thread.join(timeout=5)  # checked every second
    assert raised.is_set()


@pytest.mark.parametrize("grad", [True, False])
def test_applied_sets_and_restores_grad_mode(grad: bool) -> None:
    with torch.set_grad_enabled(not grad):
        with applied(ExecState(grad)):
            assert torch.is_grad_enabled() is grad
            assert capture() == ExecState(grad)
        assert torch.is_grad_enabled() is (not grad)


def test_applied_turns_autocast_on_and_off_as_the_requester_had_it() -> None:
    state = ExecState(True, (("cpu", torch.bfloat16),))
    with applied(state):
        assert capture() == state
        with applied(ExecState(True)):  # a requester without autocast: off here too
            assert not torch.is_autocast_enabled("cpu")
            assert capture() == ExecState(True)
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_task_context_nests_and_restores() -> None:
    outer, inner = TaskContext(1), TaskContext(2, ("a",))
    assert current() is None
    with task_context(outer) as got:
        assert got is outer and current() is outer
        with task_context(inner):
            assert current() is inner
        assert current() is outer
    assert current() is None


class _ScriptedDriver:
    """pp_rank 0's driver with a fixed script of tasks; `start` records what the server had not yet
    handled at that moment."""

    def __init__(self, server: Server, tasks: list[Task]) -> None:
        self.server = server
        self.tasks = tasks
        self.failure: BaseException | None = None
        self.unhandled_at_start: list[int] = []
        self.early_forwards = False
        """As the simple schedule: forwards may start before waiting responses are handled."""
        self.feeding = False
        """Its forwards feed another rank first (Scheduler.feed_first)."""
        self.started: list[Task] = []

    def next_task(self) -> Task | None:
        return self.tasks.pop(0) if self.tasks else None

    def has_task(self) -> bool:
        return bool(self.tasks)

    def has_urgent(self) -> bool:
        return bool(self.tasks) and (self.feeding or self.tasks[0].phase is Phase.BACKWARD)

    def has_early_forward(self) -> bool:
        return self.early_forwards and bool(self.tasks) and self.tasks[0].phase is Phase.FORWARD

    @property
    def done(self) -> bool:
        return not self.tasks

    def start(self, task: Task) -> None:
        self.unhandled_at_start.append(len(self.server._inbox))
        self.started.append(task)

    def peer_results(self) -> list[object]:
        return []


@pytest.mark.parametrize(
    ("phase", "feeding"), [(Phase.BACKWARD, False), (Phase.FORWARD, False), (Phase.FORWARD, True)]
)
def test_pp_rank0_starts_a_ready_backward_before_the_messages_that_wait(phase: Phase, feeding: bool) -> None:
    """A backward the schedule would start goes before any message waiting at pp_rank 0: its first act
    (the request that starts it on the last stage) must not wait for what those messages resume here. So
    does a forward that feeds another rank first; other forwards wait for them."""
    transport = LoopbackHub(1, config=TransportConfig(timeout=5.0)).transport(0)
    server = Server(
        transport=transport,
        rank=0,
        peers=(0,),
        step=StepId(0, 0),
        handle_request=lambda request: pytest.fail("no request expected"),  # type: ignore[arg-type,return-value]
        timeout=5.0,
        early=[],
    )
    key = ("act", 0, 0, 0)
    server._inbox.append(Handoff(StepId(0, 0), key, torch.ones(2)))  # stored when handled
    driver = _ScriptedDriver(server, [Task(0, phase)])
    driver.feeding = feeding
    server.serve(driver)
    assert driver.unhandled_at_start == ([1] if phase is Phase.BACKWARD or feeding else [0])
    assert key in server.handoffs  # the message was handled all the same
    transport.close()


@pytest.mark.parametrize("case", ["simple", "interleaved", "failure", "request"])
def test_simple_schedule_starts_its_forwards_before_the_responses_that_wait(case: str) -> None:
    """While the simple schedule may start a forward, a response to pp_rank 0's own request waits: it only
    resumes a microbatch already in flight, while the next forward's request is what the last stage waits
    for. The responses are handled once no forward may start. Other schedules, failed responses and requests
    from other ranks (someone waits on those) are handled first."""
    transport = LoopbackHub(1, config=TransportConfig(timeout=5.0)).transport(0)
    step = StepId(0, 0)
    served: list[int] = []  # how many tasks had started when the request was served

    def handle(request: Request) -> Response:
        served.append(len(driver.started))
        return Response(step, request.request_id, 0)

    server = Server(
        transport=transport, rank=0, peers=(0,), step=step, handle_request=handle, timeout=5.0, early=[]
    )
    driver = _ScriptedDriver(server, [Task(0, Phase.FORWARD), Task(1, Phase.FORWARD)])
    driver.early_forwards = case != "interleaved"
    slot = Waiter()
    server._pending[7] = slot
    resumed: list[int] = []  # how many tasks had started when the paused requester got its response

    def requester() -> None:
        server.baton.wait_for(slot)
        resumed.append(len(driver.started))
        server.baton.hand(MAIN)

    thread = _start(requester)
    if case == "request":  # another rank's request (from "itself": a one-rank loopback)
        transport.send(Request(step, 0, 0, Phase.FORWARD, "m", 0, (), None, [], (), capture()), 0, TAG)
    failure = Failure(0, "m", 0, "FWD", "ValueError", "boom", "") if case == "failure" else None
    transport.send(Response(step, 7, 0, failure=failure), 0, TAG)  # loopback: in the mailbox at once
    server.serve(driver)
    thread.join(timeout=5.0)
    assert resumed == ([2] if case in ("simple", "request") else [0])
    assert served == ([0] if case == "request" else [])
    assert driver.started == [Task(0, Phase.FORWARD), Task(1, Phase.FORWARD)]
    transport.close()
