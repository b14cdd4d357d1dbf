"""The core check: pipelined (and data-parallel) training equals plain single-process PyTorch.

Same model, seed and data: the loss of every step and every parameter after 3 optimizer steps agree
(fp32, rtol 1e-5, atol 1e-6; the first tensor that differs is named). The reference is plain PyTorch
running the step once per microbatch (tests/mp_pipeline/models.py). The larger grid lives in
benchmarks/pipeline_grid.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mp as smp
from mp import DistributedModel, DistributedOptimizer, step
from mp.errors import NotSupportedByFastModeError
from tests.mp_pipeline.models import (
    STEPS,
    batch,
    build,
    first_difference,
    loss_of,
    make_optimizer,
    manual_marks,
    reference,
)


def _reference_from_rank_0(name: str, **kwargs: Any) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """The plain PyTorch reference, run once (on rank 0) and sent to every rank: it is the same
    everywhere, and 4 ranks on a 2-core machine would otherwise run it 4 times over (~3 s each for T5)."""
    box = [reference(name, **kwargs) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def train_and_compare(
    world: Any,
    name: str,
    pp: int,
    microbatches: int,
    pipeline: str,
    *,
    optimizer_first: bool = True,
    layers: int = 2,
    deterministic: bool = False,
    mode: str = "dynamic",
    steps: int = STEPS,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "pipeline_parallel_degree": pp,
        "microbatches": microbatches,
        "pipeline": pipeline,
        "deterministic_server": deterministic,
    }
    if mode != "default":  # "default": static_mode and fast_mode unset, as users run it
        cfg.update(static_mode=mode == "static", fast_mode=mode == "fast")
    if name in {"reuse", "reuse_static"}:
        cfg.update(auto_partition=False, default_partition=0)
    smp.init(cfg)
    model = build(name, layers=layers)
    manual_marks(name, model, pp)
    opt = make_optimizer(name, model.parameters()) if optimizer_first else None
    model = DistributedModel(model)
    opt = DistributedOptimizer(opt if opt is not None else make_optimizer(name, model.parameters()))

    @step
    def train_step(*data: torch.Tensor) -> torch.Tensor:
        loss = loss_of(name, model, data)
        model.backward(loss)
        return loss

    losses = []
    compact = shortcuts = handoffs = posted = 0
    for s in range(steps):
        out = train_step(*batch(name, s, smp.dp_rank()))
        assert len(out.outputs) == microbatches
        losses.append(out.reduce_mean().item())
        opt.step()
        opt.zero_grad()
        if model._runtime is not None:
            compact += model._runtime.last_stats["compact_sent"]
            shortcuts += model._runtime.last_stats["shortcuts"]
            handoffs += model._runtime.last_stats["handoffs"]
            posted += model._runtime.last_stats["posted"]
    state = model.state_dict()
    ref_losses, ref_state = _reference_from_rank_0(
        name, microbatches=microbatches, replicas=smp.dp_size(), layers=layers, steps=steps
    )
    loss_error = None
    for s, (got, want) in enumerate(zip(losses, ref_losses, strict=True)):
        if abs(got - want[smp.dp_rank()]) > 1e-6 + 1e-5 * abs(want[smp.dp_rank()]):
            loss_error = f"step {s}: loss {got} != reference {want[smp.dp_rank()]}"
            break
    local = sum(p.numel() for p in model.local_parameters())
    return {
        "rank": smp.rank(),
        "loss": loss_error,
        "params": first_difference(state, ref_state),
        "local_params": local,
        "total_params": sum(v.numel() for v in ref_state.values()),
        "compact_sent": compact,
        "shortcuts": shortcuts,
        "handoffs": handoffs,
        "posted": posted,
        "relearned": model._runtime.relearned if model._runtime is not None else 0,
    }


CASES = [
    # (ranks, model, pp, microbatches, schedule, mode). "default": static_mode and fast_mode unset, as
    # users run it (fast mode's plan from the second step, a step it cannot finish run again), for the
    # cases whose plan takes shortcuts. "dynamic": fast_mode false (the full path, which a retry falls
    # back on), for the cases whose plan takes none (the default would change nothing there).
    (2, "mlp", 2, 2, "interleaved", "dynamic"),
    (2, "mlp", 1, 4, "simple", "default"),  # pp=1: pure data parallelism over 2 replicas
    (2, "cnn", 2, 4, "simple", "dynamic"),
    (2, "reuse", 2, 4, "interleaved", "default"),  # microbatches take different branches
    (2, "reuse", 2, 4, "deterministic", "dynamic"),  # interleaved with deterministic_server
    (2, "reuse", 2, 1, "simple", "default"),
    (2, "gpt2", 2, 2, "interleaved", "dynamic"),
    (4, "reuse", 2, 2, "simple", "default"),  # pp=2 with 2 data-parallel replicas
    (4, "gpt2", 2, 2, "simple", "dynamic"),  # GPT-2 on pp=2 with 2 data-parallel replicas
    (4, "gpt2", 4, 4, "interleaved", "default"),  # child to child across ranks, posted calls
    (2, "t5", 2, 2, "interleaved", "dynamic"),  # T5: shared embedding (encoder, decoder, tied LM head)
    (4, "t5", 4, 2, "simple", "default"),
]


@pytest.mark.parametrize(("n", "name", "pp", "microbatches", "pipeline", "mode"), CASES)
def test_pipeline_equals_plain_pytorch(  # noqa: PLR0917 - pytest parameters
    worlds: Any, n: int, name: str, pp: int, microbatches: int, pipeline: str, mode: str
) -> None:
    layers = 4 if pp == 4 else 2
    deterministic = pipeline == "deterministic"
    results = worlds.run(
        n,
        train_and_compare,
        name,
        pp,
        microbatches,
        "interleaved" if deterministic else pipeline,
        optimizer_first=microbatches != 2,
        layers=layers,
        deterministic=deterministic,
        mode=mode,
        timeout=180,
    )
    for r in results:
        assert r["loss"] is None, f"rank {r['rank']}: {r['loss']}"
        assert r["params"] is None, f"rank {r['rank']}: {r['params']}"
    if pp > 1:
        # each rank keeps only its partition's parameters
        assert all(r["local_params"] < r["total_params"] for r in results), results
    if mode == "default" and pp > 1:
        # the plan was followed (outputs passed child to child); all ranks ran the same steps again
        assert sum(r["shortcuts"] for r in results) > 0, results
        assert len({r["relearned"] for r in results}) == 1, results


# -- static and fast mode (seed 001 §4.4) -------------------------------------------------------------

RECORD_STEPS = 2
"""Steps static mode records before replaying in these tests (MP_PIPELINE_STATIC_STEPS; default 5)."""


@contextlib.contextmanager
def record_steps(n: int) -> Iterator[None]:
    before = os.environ.get("MP_PIPELINE_STATIC_STEPS")
    os.environ["MP_PIPELINE_STATIC_STEPS"] = str(n)
    try:
        yield
    finally:
        if before is None:
            del os.environ["MP_PIPELINE_STATIC_STEPS"]
        else:
            os.environ["MP_PIPELINE_STATIC_STEPS"] = before


def train_recorded(world: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    with record_steps(RECORD_STEPS):
        return train_and_compare(world, *args, **kwargs)


@pytest.mark.parametrize("mode", ["static", "fast"])
@pytest.mark.parametrize(
    ("name", "pipeline"), [("gpt2", "interleaved"), ("t5", "simple"), ("reuse_static", "simple")]
)
def test_static_and_fast_mode_equal_plain_pytorch(worlds: Any, mode: str, name: str, pipeline: str) -> None:
    """Steps replayed from the recording (compact messages) train exactly like plain PyTorch; under fast
    mode, blocks that follow each other on rank 1 pass their activations child to child."""
    results = worlds.run(
        2,
        train_recorded,
        name,
        2,
        2,
        pipeline,
        mode=mode,
        layers=4,
        # fast mode learns its plan in the first step and records from the second
        steps=RECORD_STEPS + 2 + (mode == "fast"),
        timeout=180,
    )
    for r in results:
        assert r["loss"] is None, f"rank {r['rank']}: {r['loss']}"
        assert r["params"] is None, f"rank {r['rank']}: {r['params']}"
        # both ranks send messages (requests, responses) and replayed them compact
        assert r["compact_sent"] > 0, r
    # rank 0 calls the modules on rank 1; the shortcut is fast mode's only
    shortcuts, handoffs = results[0]["shortcuts"], results[1]["handoffs"]
    if mode == "static":
        assert shortcuts == handoffs == results[0]["posted"] == 0, results
    elif name == "gpt2":  # blocks on rank 1 called one after another (T5's decoder is one call)
        assert shortcuts > 0, results[0]
        assert handoffs > 0, results[1]  # block outputs stay on rank 1 from the second step on
        # from the third step on, rank 0 posts those blocks' calls instead of awaiting each response
        assert results[0]["posted"] > 0, results[0]


def branch_change(world: Any, mode: str) -> dict[str, Any]:
    """The reuse model with a flow that is static for the recorded steps, then takes the other branch."""
    smp.init(
        {
            "pipeline_parallel_degree": 2,
            "microbatches": 2,
            "static_mode": mode == "static",
            # "auto": unset, mp's default (the fast-mode shortcut, with a changed step run again)
            "fast_mode": None if mode == "auto" else mode == "fast",
            "auto_partition": False,
            "default_partition": 0,
        }
    )
    steps = RECORD_STEPS + 2 + (mode != "static")  # fast mode records from the second step

    def data(s: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, target = batch("reuse", s, 0)
        ids[:, 0] = 2 * (ids[:, 0] // 2) + (s >= RECORD_STEPS + 1)  # even (pos), then odd (neg)
        return ids, target

    ref = build("reuse")
    ref_opt = make_optimizer("reuse", ref.parameters())
    ref_losses = []
    for s in range(steps):
        ids, target = data(s)
        loss = sum(loss_of("reuse", ref, (i, t)) for i, t in zip(ids.chunk(2), target.chunk(2), strict=True))
        ref_losses.append(float(loss) / 2)
        (loss / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    with record_steps(RECORD_STEPS):
        net = build("reuse")
        manual_marks("reuse", net, 2)
        model = DistributedModel(net)
        opt = DistributedOptimizer(make_optimizer("reuse", model.parameters()))

    @step
    def train_step(ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = loss_of("reuse", model, (ids, target))
        model.backward(loss)
        return loss

    losses: list[float] = []
    error = None
    for s in range(steps):
        try:
            out = train_step(*data(s))
        except NotSupportedByFastModeError as exc:
            error = (s, str(exc))
            break
        losses.append(out.reduce_mean().item())
        opt.step()
        opt.zero_grad()
    diff = None
    if error is None:
        diff = first_difference(model.state_dict(), ref.state_dict())
    assert model._runtime is not None
    relearned = model._runtime.relearned
    return {
        "rank": smp.rank(),
        "error": error,
        "losses": losses,
        "ref_losses": ref_losses,
        "params": diff,
        "relearned": relearned,
    }


@pytest.mark.parametrize("mode", ["static", "fast", "auto"])
def test_a_branch_change_after_the_recording(worlds: Any, mode: str) -> None:
    """Fast mode: NotSupportedByFastModeError on every rank (no hang); static mode: falls back to full
    messages and still trains exactly like plain PyTorch, and so does mp's default (fast_mode unset),
    whose shortcut this branch leaves intact (no step has to run again)."""
    results = worlds.run(2, branch_change, mode, timeout=180)
    replay = RECORD_STEPS + 1  # the step whose branch differs from the recording
    for r in results:
        want = r["ref_losses"]
        assert r["relearned"] == 0, r
        if mode == "fast":
            assert r["error"] is not None, f"rank {r['rank']}: no error"
            assert r["error"][0] == replay, r["error"]
            assert "'fast_mode' to False" in r["error"][1], r["error"][1]
            want = want[:replay]
        else:
            assert r["error"] is None, r["error"]
            assert r["params"] is None, f"rank {r['rank']}: {r['params']}"
        assert r["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6), r


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


Batches = list[tuple[torch.Tensor, torch.Tensor]]


def plain_sgd(
    ref: torch.nn.Module,
    data: Batches,
    microbatches: int,
    before: Callable[[int], None] | None = None,
    lr: float = 0.1,
) -> list[float]:
    """The losses of plain PyTorch training ``ref`` (MSE, SGD) on ``data`` split into microbatches
    (``before(step)`` runs before each step)."""
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    losses = []
    for s, (x, y) in enumerate(data):
        if before is not None:
            before(s)
        total = 0.0
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            loss = torch.nn.functional.mse_loss(ref(xs), ys) / microbatches
            loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return losses


def fast_trainer(
    net: torch.nn.Module,
    pp: int,
    owners: dict[str, int],
    microbatches: int,
    *,
    fast_mode: bool | None = True,
    lr: float = 0.1,
) -> tuple[Any, Any, Any]:
    """``net`` under fast mode (children named in ``owners`` on those pp_ranks, the rest on 0), its SGD
    optimizer and an MSE training step. ``fast_mode=None``: mp's default (the shortcut, with retries)."""
    with record_steps(RECORD_STEPS):
        smp.init(
            {
                "pipeline_parallel_degree": pp,
                "microbatches": microbatches,
                "fast_mode": fast_mode,
                "auto_partition": False,
                "default_partition": 0,
            }
        )
        for name, owner in owners.items():
            smp.set_partition(getattr(net, name), owner)
        model = DistributedModel(net)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr))

    @step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    return model, opt, train_step


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


class Relay(torch.nn.Module):
    """Children on ranks 1, 2, 1 and 3 called in turn from rank 0: what a and b return goes straight to
    the next child under fast mode; what c returns the parent also reads, so it comes back."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(6, 8)
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.c = torch.nn.Linear(8, 8)
        self.d = torch.nn.Linear(8, 8)
        self.rewire = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(self.embed(x))  # rank 1, handed to rank 2
        if self.rewire == "elsewhere":
            h = self.d(h)
        elif self.rewire == "twice":
            h = self.b(h) + self.b(h)
        else:
            h = self.b(h)  # rank 2, handed back to rank 1
        g = self.c(h)  # rank 1; the parent reads it too
        return self.d(torch.tanh(g)).sum(-1) + g.mean(-1)


RELAY_OWNERS = {"a": 1, "b": 2, "c": 1, "d": 3}


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
