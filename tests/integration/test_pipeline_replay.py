"""Per-rank replay (mp_pipeline.replay): in the steady state of mp's default config pp_rank 0 sends no
request, forward or backward, to another rank (counted by message kind per step); owners run their own
program and only tensors travel. Training stays equal to plain PyTorch; a flow that changes falls back to
the full path (counted) and stays exact; under ``fast_mode: true`` it raises NotSupportedByFastModeError
naming the module."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import mp as smp
from mp import DistributedModel, DistributedOptimizer, step
from tests.integration._fast_mode import RECORD_STEPS, plain_sgd, record_steps
from tests.mp_pipeline.models import first_difference

REPLAYED_FROM = 4
"""The first replayed step (0-based): the plan is learned in step 0, the predictions in step 1, and
steps 2 and 3 are recorded and agree."""


class Looped(nn.Module):
    """A root that loops over its blocks, the user's model the issue measures (blocks placed by hand)."""

    def __init__(self, blocks: int, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks))
        self.head = nn.Linear(width, 1)
        self.branch_at: set[int] = set()
        """Steps whose forward takes the other branch (set on every rank; only rank 0's parent acts)."""
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            if i == 1 and self.step in self.branch_at:
                continue  # a data-independent change of the flow: block 1 skipped in this step
            h = block(h)  # straight to the next block (fast mode's plan)
        return self.head(h).squeeze(-1)


class Branching(Looped):
    """The parent reads the data to pick a block: which one changes between steps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks[:-2]:
            h = block(h)
        pick = self.blocks[-1] if float(x[0, 0]) > 0.5 else self.blocks[-2]
        return self.head(pick(h)).squeeze(-1)


class LateHook(Looped):
    """In the steps of ``branch_at`` the parent adds a tensor hook (it only counts) to block 2's input
    after block 2 took it: under replay pp_rank 0 joined the two calls into one autograd node."""

    def __init__(self, blocks: int, width: int = 8) -> None:
        super().__init__(blocks, width)
        self.hooked = 0

    def _count(self, grad: torch.Tensor) -> None:
        self.hooked += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            taken, h = h, block(h)
            if i == 2 and self.step in self.branch_at:
                taken.register_hook(self._count)
        return self.head(h).squeeze(-1)


def _trainer(
    net: nn.Module, owners: dict[int, int], microbatches: int, fast_mode: bool | None
) -> tuple[Any, Any, Any]:
    with record_steps(RECORD_STEPS):
        smp.init(
            {
                "pipeline_parallel_degree": 2,
                "microbatches": microbatches,
                "fast_mode": fast_mode,
                "auto_partition": False,
                "default_partition": 0,
            }
        )
        for i, owner in owners.items():
            smp.set_partition(net.blocks[i], owner)  # type: ignore[index]
        model = DistributedModel(net)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    @step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    return model, opt, train_step


def train(  # noqa: PLR0917 - the harness passes a test's arguments by position
    world: Any, layout: str, blocks: int, steps: int, changes: list[int], fast_mode: bool | None = None
) -> dict[str, Any]:
    """``layout``: "chain" (every block on rank 1), "alternating" (block i on rank (i + 1) % 2) or
    "branching" (Branching, blocks on rank 1). ``changes``: steps whose flow differs (block 1 skipped)."""
    microbatches = 2
    owners = {i: 1 if layout != "alternating" else (i + 1) % 2 for i in range(blocks)}
    kind = {"branching": Branching, "late_hook": LateHook}.get(layout, Looped)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, generator=g)) for _ in range(steps)]
    if layout == "branching":  # the parent's pick reads the data: it flips in the steps named by changes
        for s, (x, _) in enumerate(data):
            x[:, 0] = -1.0 if s in changes else 1.0
    ref = kind(blocks)
    ref.branch_at = set(changes)
    ref_losses = plain_sgd(ref, data, microbatches, lambda s: setattr(ref, "step", s), lr=0.01)
    net = kind(blocks)
    net.branch_at = set(changes)
    model, opt, train_step = _trainer(net, owners, microbatches, fast_mode)
    assert model._runtime is not None
    losses, stats, sent = [], [], []
    error = None
    for s, (x, y) in enumerate(data):
        net.step = s
        relearned = model._runtime.relearned
        try:
            losses.append(train_step(x, y).reduce_mean().item())
        except Exception as exc:  # the failure under test (fast_mode: true)
            error = (s, type(exc).__name__, str(exc))
            break
        opt.step()
        opt.zero_grad()
        stats.append({**model._runtime.last_stats, "fell_back": model._runtime.relearned - relearned})
        sent.append(model._runtime.last_sent)
    return {
        "rank": smp.rank(),
        "losses": losses,
        "ref_losses": ref_losses,
        "params": None if error else first_difference(model.state_dict(), ref.state_dict()),
        "stats": stats,
        "sent": sent,
        "error": error,
        "hooked": getattr(net, "hooked", 0),
    }


def _exact(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["error"] is None, r
        assert r["params"] is None, f"rank {r['rank']}: {r['params']}"
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5, abs=1e-6), r


@pytest.mark.parametrize("layout", ["chain", "alternating"])
def test_pp_rank_0_sends_no_request_in_the_steady_state(worlds: Any, layout: str) -> None:
    """A root looping over 32 blocks on rank 1 (or alternating between the ranks): from the fifth step
    on rank 0 sends no Request, forward or backward; every remote call is replayed; training equals
    plain PyTorch. Before that it does (the learning steps), which the count must show."""
    blocks, steps = 32, REPLAYED_FROM + 3
    results = worlds.run(2, train, layout, blocks, steps, [], timeout=300)
    _exact(results)
    top, owner = results
    remote_blocks = blocks if layout == "chain" else blocks // 2
    calls = 2 * 2 * remote_blocks  # forward and backward, two microbatches
    for s in range(steps):
        stats, sent = top["stats"][s], top["sent"][s]
        assert stats["fell_back"] == 0, (s, stats)
        if s < REPLAYED_FROM:
            assert sent.get("Request", 0) == calls, (s, sent)
            assert stats["replayed"] == 0, (s, stats)
        else:
            assert sent.get("Request", 0) == 0, (s, sent)
            assert stats["replayed"] == calls, (s, stats)
            assert owner["stats"][s]["replayed"] == calls, (s, owner["stats"][s])
            assert owner["stats"][s]["requests"] == 0, (s, owner["stats"][s])
            if layout == "chain":  # only the first block's input and the last block's gradient
                assert sent.get("Handoff", 0) == 2 * 2, (s, sent)
            # the owner serves each microbatch's chain as one run (mp_pipeline.fused): every call but the
            # first takes the output of the one before as it is, and the run has one backward
            fused = 2 * (remote_blocks - 1) if layout == "chain" else 0
            assert owner["stats"][s].get("fused", 0) == fused, (s, owner["stats"][s])
            # pp_rank 0 (link.Run): the first block's call takes the root's output (data, its own node);
            # every later call joins the node of the calls before it from the second one on, so a
            # microbatch's backward runs two nodes for the 32 calls (alternating: one node per call)
            chained = 2 * (remote_blocks - 2) if layout == "chain" else 0
            assert stats.get("chained", 0) == chained, (s, stats)
            nodes = 2 * 2 if layout == "chain" else 2 * remote_blocks
            assert stats.get("chained_nodes", 0) == nodes, (s, stats)


def test_a_flow_change_in_a_replayed_step_runs_again_on_the_full_path(worlds: Any) -> None:
    """In step 5 (replayed) the parent skips block 1: the call of block 2 does not match the program,
    the step runs again on the full path and the flow is learned again (replayed from 4 steps later);
    training equals plain PyTorch."""
    change, steps = REPLAYED_FROM + 1, REPLAYED_FROM + 7
    results = worlds.run(2, train, "chain", 6, steps, [change], timeout=300)
    _exact(results)
    top = results[0]
    fell_back = [s for s in range(steps) if top["stats"][s]["fell_back"]]
    assert fell_back == [change], fell_back
    replayed = [s for s in range(steps) if top["stats"][s]["replayed"]]
    # the step run again learns nothing; the plan, predictions and two recordings take the next 4
    assert replayed == [REPLAYED_FROM, *range(change + 1 + REPLAYED_FROM, steps)], replayed
    # the change came inside a run that the owner served as one graph
    fused = [s for s in range(steps) if results[1]["stats"][s].get("fused", 0)]
    assert fused == replayed, fused


def test_a_hook_added_inside_a_run_of_rank_0_still_runs_and_training_stays_exact(worlds: Any) -> None:
    """From step 5 (replayed) the parent adds a hook to block 2's input after block 2 took it, the calls
    of blocks 1-5 one autograd node on pp_rank 0 (link.Run) in which block 1's node never runs: the run's
    backward runs the hook, once per microbatch as autograd would (on the placeholder's gradient, as
    under per-call replay); nothing falls back and training equals plain PyTorch."""
    change, steps = REPLAYED_FROM + 1, REPLAYED_FROM + 3
    results = worlds.run(2, train, "late_hook", 6, steps, [change, change + 1], timeout=300)
    _exact(results)
    top = results[0]
    for s in range(REPLAYED_FROM, steps):
        assert top["stats"][s]["replayed"] > 0, (s, top["stats"][s])
        assert top["stats"][s].get("chained", 0) == 2 * 4, (s, top["stats"][s])  # blocks 2-5 joined
    fell_back = [s for s in range(steps) if top["stats"][s]["fell_back"]]
    assert fell_back == [], fell_back
    assert top["hooked"] == 2 * 2, top  # two steps, two microbatches


def test_a_data_dependent_branch_falls_back_and_stays_exact(worlds: Any) -> None:
    """The parent picks one of two blocks by a value of its input: where the pick changes in a replayed
    step (step 6), the step runs again on the full path; every step equals plain PyTorch."""
    change, steps = REPLAYED_FROM + 2, REPLAYED_FROM + 4
    results = worlds.run(2, train, "branching", 4, steps, [change], timeout=300)
    _exact(results)
    top = results[0]
    fell_back = [s for s in range(steps) if top["stats"][s]["fell_back"]]
    replayed = [s for s in range(steps) if top["stats"][s]["replayed"]]
    assert fell_back == [change], fell_back
    assert replayed == [REPLAYED_FROM, REPLAYED_FROM + 1], replayed


def test_fast_mode_raises_on_a_flow_change_in_a_replayed_step(worlds: Any) -> None:
    """``fast_mode: true``: the same change raises NotSupportedByFastModeError on every rank, naming the
    module whose call differs."""
    change = REPLAYED_FROM + 1
    results = worlds.run(2, train, "chain", 6, change + 1, [change], True, timeout=300)
    for r in results:
        assert r["error"] is not None, r
        assert r["error"][0] == change, r
    top = results[0]
    assert top["stats"][REPLAYED_FROM]["replayed"] > 0, top["stats"]
    assert top["error"][1] == "NotSupportedByFastModeError", top["error"]
    assert "'blocks.2'" in top["error"][2] and "flow changed" in top["error"][2], top["error"]


class Outer(nn.Module):
    """A module on rank 1 that calls its own child, placed on rank 0 (a nested call)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.inner = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(torch.tanh(self.pre(h))))


class Nesting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 8)
        self.outer = Outer()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.outer(self.embed(x))).squeeze(-1)


def train_nested(world: Any, steps: int) -> dict[str, Any]:
    microbatches = 2
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, generator=g)) for _ in range(steps)]
    ref = Nesting()
    ref_losses = plain_sgd(ref, data, microbatches, lr=0.01)
    net = Nesting()
    with record_steps(RECORD_STEPS):
        smp.init(
            {
                "pipeline_parallel_degree": 2,
                "microbatches": microbatches,
                "auto_partition": False,
                "default_partition": 0,
            }
        )
        smp.set_partition(net.outer, 1)
        smp.set_partition(net.outer.inner, 0)
        model = DistributedModel(net)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))

    @step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    assert model._runtime is not None
    losses, stats, sent = [], [], []
    for x, y in data:
        losses.append(train_step(x, y).reduce_mean().item())
        opt.step()
        opt.zero_grad()
        stats.append(model._runtime.last_stats)
        sent.append(model._runtime.last_sent)
    return {
        "rank": smp.rank(),
        "losses": losses,
        "ref_losses": ref_losses,
        "params": first_difference(model.state_dict(), ref.state_dict()),
        "stats": stats,
        "sent": sent,
        "error": None,
    }


def test_nested_calls_keep_their_requests_under_replay(worlds: Any) -> None:
    """outer (rank 1) calls its child inner (rank 0): pp_rank 0's calls of outer are replayed (no
    Request from rank 0), the nested calls of inner stay on the posted path (rank 1 sends a Request for
    each, forward and backward); training equals plain PyTorch."""
    steps = REPLAYED_FROM + 2
    results = worlds.run(2, train_nested, steps, timeout=300)
    _exact(results)
    top, owner = results
    for s in range(REPLAYED_FROM, steps):
        assert top["sent"][s].get("Request", 0) == 0, (s, top["sent"][s])
        assert top["stats"][s]["replayed"] == 2 * 2, (s, top["stats"][s])  # outer: forward, backward
        assert owner["sent"][s].get("Request", 0) == 2 * 2, (s, owner["sent"][s])  # inner, nested


class Flaky(nn.Sequential):
    """A block that raises when armed (set on every rank; its owner acts)."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(8, 8), nn.Tanh())
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise RuntimeError("flaky block failed on purpose")
        return super().forward(x)


def fail_in_replayed_call(world: Any, at: int) -> dict[str, Any]:
    net = Looped(6)
    torch.manual_seed(2)
    net.blocks[4] = Flaky()
    model, opt, train_step = _trainer(net, dict.fromkeys(range(6), 1), 2, None)
    assert model._runtime is not None
    g = torch.Generator().manual_seed(5)
    error, replayed = None, 0
    for s in range(at + 1):
        net.blocks[4].armed = s == at  # type: ignore[union-attr]
        try:
            train_step(torch.randn(8, 6, generator=g), torch.randn(8, generator=g))
        except Exception as exc:  # the failure under test
            error = (s, type(exc).__name__, str(exc))
            break
        opt.step()
        opt.zero_grad()
        replayed += model._runtime.last_stats["replayed"]
    return {"rank": smp.rank(), "error": error, "replayed": replayed}


def test_a_failure_in_a_replayed_call_ends_the_step_on_every_rank(worlds: Any) -> None:
    """Block 4 (rank 1) raises in a replayed step: every rank ends the step with its error, naming the
    module (the default config runs the step again on the full path, where it raises again), none
    hangs."""
    at = REPLAYED_FROM + 1
    results = worlds.run(2, fail_in_replayed_call, at, timeout=240)
    assert results[0]["replayed"] > 0, results[0]  # the step before was replayed
    for r in results:
        assert r["error"] is not None and r["error"][0] == at, r
    top = results[0]["error"]
    assert "flaky block failed on purpose" in top[2] and "'blocks.4'" in top[2], top


class Block(nn.Module):
    """Linear and tanh, as the chain's blocks, but not an nn.Sequential: activation checkpointing marks it
    as one call (an nn.Sequential's children would be marked instead)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Broken(Looped):
    """A chain of 8 blocks on rank 1 whose runs are broken three ways: a forward hook inside block 1,
    block 3 called through smp.checkpoint (its owner runs it under a checkpoint), and the parent reading
    block 5's output (it adds zero, so the output comes back to rank 0 as data). Block 5 is marked by
    set_activation_checkpointing, which checkpoints inside its own forward: no boundary. Joined: 4 -> 5
    and 6 -> 7."""

    READ_AT = 5

    def __init__(self) -> None:
        super().__init__(8)
        torch.manual_seed(1)
        self.blocks[3] = Block()
        self.blocks[5] = Block()
        self.hooked = 0
        self.blocks[1][0].register_forward_hook(self._count)
        self.distributed = False
        """Under smp: block 3 through smp.checkpoint (plain PyTorch: called as it is, same values)."""

    def _count(self, module: nn.Module, args: Any, out: Any) -> None:
        self.hooked += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, block in enumerate(self.blocks):
            h = smp.checkpoint(block, h) if i == 3 and self.distributed else block(h)
            if i == self.READ_AT:
                h = h + 0.0  # the parent reads it: it comes back as data
        return self.head(h).squeeze(-1)


def train_broken(world: Any, steps: int) -> dict[str, Any]:
    microbatches = 2
    g = torch.Generator().manual_seed(6)
    data = [(torch.randn(8, 6, generator=g), torch.randn(8, generator=g)) for _ in range(steps)]
    ref = Broken()
    ref_losses = plain_sgd(ref, data, microbatches, lr=0.01)
    net = Broken()
    net.distributed = True
    model, opt, train_step = _trainer(net, dict.fromkeys(range(8), 1), microbatches, None)
    smp.set_activation_checkpointing(net.blocks[5])
    assert model._runtime is not None
    losses, stats = [], []
    for x, y in data:
        losses.append(train_step(x, y).reduce_mean().item())
        opt.step()
        opt.zero_grad()
        stats.append({**model._runtime.last_stats, "fell_back": model._runtime.relearned})
    return {
        "rank": smp.rank(),
        "losses": losses,
        "ref_losses": ref_losses,
        "params": first_difference(model.state_dict(), ref.state_dict()),
        "stats": stats,
        "hooked": net.hooked,
        "error": None,
    }


def test_hooks_checkpointing_and_reads_break_runs_and_stay_exact(worlds: Any) -> None:
    """Runs stop where a boundary can be observed: at a module with a hook inside, at a call made through
    smp.checkpoint and at an output the parent reads; a module marked by set_activation_checkpointing
    joins. Only 4 -> 5 and 6 -> 7 are joined (per microbatch); the rest is served call by call, and
    training equals plain PyTorch."""
    steps = REPLAYED_FROM + 3
    results = worlds.run(2, train_broken, steps, timeout=300)
    _exact(results)
    top, owner = results
    assert owner["hooked"] > 0, owner  # the hook ran on the owner
    for s in range(steps):
        assert top["stats"][s]["fell_back"] == 0, (s, top["stats"][s])
        if s >= REPLAYED_FROM:
            assert top["stats"][s]["replayed"] > 0, (s, top["stats"][s])
            assert owner["stats"][s].get("fused", 0) == 2 * 2, (s, owner["stats"][s])


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("flaky block failed on purpose in its backward")


class FlakyBackward(Flaky):
    """A block whose backward raises when armed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.Sequential.forward(self, x)
        return _FailBackward.apply(out) if self.armed else out  # type: ignore[no-untyped-call]


def fail_in_run_backward(world: Any, at: int) -> dict[str, Any]:
    net = Looped(6)
    torch.manual_seed(2)
    net.blocks[2] = FlakyBackward()
    model, opt, train_step = _trainer(net, dict.fromkeys(range(6), 1), 2, None)
    assert model._runtime is not None
    g = torch.Generator().manual_seed(5)
    error, fused = None, 0
    for s in range(at + 1):
        net.blocks[2].armed = s == at  # type: ignore[union-attr]
        try:
            train_step(torch.randn(8, 6, generator=g), torch.randn(8, generator=g))
        except Exception as exc:  # the failure under test
            error = (s, type(exc).__name__, str(exc))
            break
        opt.step()
        opt.zero_grad()
        fused += model._runtime.last_stats.get("fused", 0)
    return {"rank": smp.rank(), "error": error, "fused": fused}


def test_a_failure_in_the_backward_of_a_run_ends_the_step_on_every_rank(worlds: Any) -> None:
    """Block 2 of a run of 6 (rank 1) raises in its backward, which runs inside the run's one backward:
    every rank ends the step with its error, none hangs."""
    at = REPLAYED_FROM + 1
    results = worlds.run(2, fail_in_run_backward, at, timeout=240)
    assert results[1]["fused"] > 0, results[1]  # the steps before served the chain as runs
    for r in results:
        assert r["error"] is not None and r["error"][0] == at, r
    assert "failed on purpose in its backward" in results[0]["error"][2], results[0]["error"]
