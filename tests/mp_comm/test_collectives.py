"""The autograd-aware collectives: forward and backward equal the single-process computation.

For every op, every rank builds the inputs of all ranks from one seed, runs the op on its own input,
back-propagates its own output gradient, and compares output and input gradient with plain PyTorch
autograd on the global computation (float64). A replicated consumer is modelled by one loss term for
all ranks; a sharded one by one term per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from mp_comm import collectives as C
from mp_comm.errors import CollectiveError

Op = Callable[[Tensor, Any], Tensor]
Ref = Callable[[list[Tensor]], list[Tensor]]


@dataclass(frozen=True)
class Case:
    name: str
    op: Op
    ref: Ref
    shape: tuple[int, ...]
    replicated_in: bool = False  # every rank holds the same input (one leaf in the reference)
    replicated_out: bool = False  # every rank consumes the same output (one loss term)


def _cat(xs: list[Tensor], dim: int) -> Tensor:
    return torch.cat(xs, dim=dim)


def _sum(xs: list[Tensor]) -> Tensor:
    return torch.stack(xs).sum(0)


def _a2a_ref(split_dim: int, concat_dim: int) -> Ref:
    def ref(xs: list[Tensor]) -> list[Tensor]:
        n = len(xs)
        chunks = [x.chunk(n, dim=split_dim) for x in xs]
        return [torch.cat([chunks[r][k] for r in range(n)], dim=concat_dim) for k in range(n)]

    return ref


def _cases(n: int) -> list[Case]:
    return [
        Case(
            "all_reduce/g",
            C.all_reduce,
            lambda xs: [_sum(xs)] * len(xs),
            (3, 4),
            replicated_out=True,
        ),
        Case(
            "all_reduce/grad=all_reduce",
            lambda x, g: C.all_reduce(x, g, grad="all_reduce"),
            lambda xs: [_sum(xs)] * len(xs),
            (3, 4),
        ),
        Case("all_reduce_backward/f", C.all_reduce_backward, list, (3, 4), replicated_in=True),
        Case(
            "all_gather/dim1/slice",
            lambda x, g: C.all_gather(x, 1, g),
            lambda xs: [_cat(xs, 1)] * len(xs),
            (2, 3, 5),
            replicated_out=True,
        ),
        Case(
            "all_gather/dim0/reduce_scatter",
            lambda x, g: C.all_gather(x, 0, g, grad="reduce_scatter"),
            lambda xs: [_cat(xs, 0)] * len(xs),
            (2, 3),
        ),
        Case(
            "all_gather/dim-1",
            lambda x, g: C.all_gather(x, -1, g),
            lambda xs: [_cat(xs, -1)] * len(xs),
            (2, 3),
            replicated_out=True,
        ),
        Case(
            "reduce_scatter/dim0",
            lambda x, g: C.reduce_scatter(x, 0, g),
            lambda xs: list(_sum(xs).chunk(len(xs), 0)),
            (2 * n, 3),
        ),
        Case(
            "reduce_scatter/dim2",
            lambda x, g: C.reduce_scatter(x, 2, g),
            lambda xs: list(_sum(xs).chunk(len(xs), 2)),
            (2, 3, 3 * n),
        ),
        Case(
            "split/dim1",
            lambda x, g: C.split(x, 1, g),
            lambda xs: list(xs[0].chunk(len(xs), 1)),
            (3, 2 * n),
            replicated_in=True,
        ),
        Case("all_to_all/1->0", lambda x, g: C.all_to_all(x, 1, 0, g), _a2a_ref(1, 0), (2, 2 * n)),
        Case("all_to_all/0->2", lambda x, g: C.all_to_all(x, 0, 2, g), _a2a_ref(0, 2), (n, 3, 2)),
        Case("all_to_all/2->1", lambda x, g: C.all_to_all(x, 2, 1, g), _a2a_ref(2, 1), (2, 3, 2 * n)),
        Case(
            "all_reduce_async",
            lambda x, g: C.all_reduce_async(x, g).wait(),
            lambda xs: [_sum(xs)] * len(xs),
            (3, 4),
            replicated_out=True,
        ),
        Case(
            "all_gather_async",
            lambda x, g: C.all_gather_async(x, 1, g).wait(),
            lambda xs: [_cat(xs, 1)] * len(xs),
            (2, 3),
            replicated_out=True,
        ),
        Case(
            "reduce_scatter_async",
            lambda x, g: C.reduce_scatter_async(x, 1, g).wait(),
            lambda xs: list(_sum(xs).chunk(len(xs), 1)),
            (2, 2 * n),
        ),
        Case(
            "all_to_all_async", lambda x, g: C.all_to_all_async(x, 1, 0, g).wait(), _a2a_ref(1, 0), (2, 2 * n)
        ),
    ]


def _check(
    case: Case, group: Any, members: list[int], seed: int, layout: Callable[[Tensor], Tensor] | None = None
) -> None:
    n, me = len(members), members.index(dist.get_rank())
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(case.shape, generator=gen, dtype=torch.float64) for _ in range(n)]
    if case.replicated_in:
        xs = [xs[0]] * n
    probe = case.ref([x.clone() for x in xs])
    grads = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in probe]
    if case.replicated_out:
        grads = [grads[0]] * n
    # the global computation, one process
    leaves = (
        [xs[0].clone().requires_grad_()] * n
        if case.replicated_in
        else [x.clone().requires_grad_() for x in xs]
    )
    ys = case.ref(leaves)
    terms = [ys[0]] if case.replicated_out else ys
    loss = sum((y * g).sum() for y, g in zip(terms, grads, strict=False))
    assert isinstance(loss, Tensor)
    loss.backward()
    # the distributed computation, this rank's part
    x = (xs[me].clone() if layout is None else layout(xs[me])).requires_grad_()
    assert layout is None or not x.is_contiguous(), case.name
    y = case.op(x, group)
    torch.testing.assert_close(
        y, ys[me].detach(), rtol=1e-12, atol=1e-12, msg=lambda m: f"{case.name} out: {m}"
    )
    y.backward(grads[me])
    expected = leaves[me].grad
    assert x.grad is not None and expected is not None, case.name
    torch.testing.assert_close(
        x.grad, expected, rtol=1e-12, atol=1e-12, msg=lambda m: f"{case.name} grad: {m}"
    )


def _run_all(world: Any, fallback: bool) -> int:
    n = world.size
    groups: list[tuple[Any, list[int]]] = []
    whole = dist.new_group(list(range(n)))
    groups.append((whole, list(range(n))))
    if n == 4:  # pairs, as the axis groups of a 2x2 mesh
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        mine = [0, 1] if world.rank < 2 else [2, 3]
        groups.append((pairs[world.rank // 2], mine))
        strided = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups.append((strided[world.rank % 2], [world.rank % 2, world.rank % 2 + 2]))
    checked = 0
    C._unsupported.clear()
    try:
        for group, members in groups:
            for i, case in enumerate(_cases(len(members))):
                if fallback:
                    with C.use_fallback("all_gather", "reduce_scatter", "all_to_all"):
                        _check(case, group, members, seed=100 + i)
                else:
                    _check(case, group, members, seed=100 + i)
                checked += 1
    finally:
        for group, _ in groups:
            dist.destroy_process_group(group)
        if n == 4:
            for g in pairs + strided:
                if g not in [grp for grp, _ in groups]:
                    dist.destroy_process_group(g)
    assert not C._unsupported, f"gloo was expected to have every native op: {C._unsupported}"
    return checked


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("fallback", [False, True], ids=["native", "fallback"])
def test_forward_and_backward_match_single_process(worlds: Any, n: int, fallback: bool) -> None:
    counts = worlds.run(n, _run_all, fallback, timeout=60)
    assert counts[0] == len(_cases(2)) * (1 if n == 2 else 3)


def _overlap(world: Any) -> list[float]:
    group = dist.new_group([0, 1])
    try:
        x = torch.full((1 << 16,), float(world.rank + 1), dtype=torch.float64, requires_grad=True)
        handle = C.all_reduce_async(x, group)
        local = (x * 2).sum()  # computation issued while the all-reduce is in flight
        y = handle.wait()
        assert handle.is_completed()
        assert handle.wait() is y  # idempotent
        (y.sum() + local).backward()
        assert x.grad is not None
        return [float(y[0]), float(x.grad[0])]
    finally:
        dist.destroy_process_group(group)


def test_async_overlaps_and_keeps_autograd(worlds: Any) -> None:
    assert worlds.run(2, _overlap, timeout=30) == [[3.0, 3.0], [3.0, 3.0]]


def _uneven(world: Any) -> list[str]:
    group = dist.new_group([0, 1])
    messages = []
    try:
        x = torch.zeros(3, 5)
        for call in (
            lambda: C.reduce_scatter(x, 0, group),
            lambda: C.split(x, 1, group),
            lambda: C.all_to_all(x, 0, 1, group),
            lambda: C.all_gather(x, 2, group),
            lambda: C.all_reduce(x, group, grad="sum"),  # type: ignore[arg-type]
        ):
            try:
                call()
            except CollectiveError as exc:
                messages.append(str(exc))
        return messages
    finally:
        dist.destroy_process_group(group)


def test_uneven_sizes_raise_naming_dim_size_and_group(worlds: Any) -> None:
    messages = worlds.run(2, _uneven, timeout=30)[0]
    assert len(messages) == 5
    assert "dim 0" in messages[0] and "size 3" in messages[0] and "group size 2" in messages[0]
    assert "dim 1" in messages[1] and "size 5" in messages[1]
    assert "dim 0" in messages[2] and "size 3" in messages[2]
    assert "dim=2 is out of range" in messages[3]
    assert "'sum'" in messages[4]


def test_use_fallback_rejects_unknown_ops() -> None:
    with pytest.raises(CollectiveError, match="broadcast"), C.use_fallback("broadcast"):
        pass


# ------------------------------------------------------------------------------------ the MPI path


def _spy_mpi() -> tuple[dict[str, int], Callable[[], None]]:
    """Count the collectives that run over MPI (collectives_mpi's functions) until `restore()`."""
    from mp_comm import collectives_mpi

    calls: dict[str, int] = {}
    saved = {name: getattr(collectives_mpi, name) for name in collectives_mpi.__all__ if name != "usable"}

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)

        return run

    for name, fn in saved.items():
        if callable(fn) and not isinstance(fn, type):
            setattr(collectives_mpi, name, counting(name, fn))

    def restore() -> None:
        for name, fn in saved.items():
            setattr(collectives_mpi, name, fn)

    return calls, restore


def _noncontiguous_cases(n: int) -> list[tuple[Case, Callable[[Tensor], Tensor]]]:
    """Cases whose input is a transposed view (strides not contiguous), by the layout that makes it."""

    def transposed(x: Tensor) -> Tensor:
        return x.transpose(0, -1).contiguous().transpose(0, -1)

    return [
        (case, transposed)
        for case in _cases(n)
        if case.name in ("all_reduce/g", "all_gather/dim1/slice", "reduce_scatter/dim2", "all_to_all/2->1")
    ]


def _run_all_mpi(world: Any) -> dict[str, int]:
    from mp_comm.world import mpi_comm_of

    n = world.size
    layouts = [[list(range(n))]]
    if n == 4:  # pairs, as the axis groups of a 2x2 mesh, and strided pairs
        layouts += [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]
    made = [(world.new_groups(layout), layout) for layout in layouts]
    calls, restore = _spy_mpi()
    try:
        for groups, layout in made:
            (group, members) = next((g, m) for g, m in zip(groups, layout, strict=True) if g is not None)
            assert mpi_comm_of(group) is not None, "World.new_groups made no MPI twin"
            for i, case in enumerate(_cases(len(members))):
                _check(case, group, members, seed=200 + i)
            for i, (case, layout_fn) in enumerate(_noncontiguous_cases(len(members))):
                _check(case, group, members, seed=300 + i, layout=layout_fn)
    finally:
        restore()
        for groups, _ in made:
            world.destroy_groups(groups)
    return calls


@pytest.mark.parametrize("n", [2, 4])
def test_mpi_path_forward_and_backward_match_single_process(worlds: Any, n: int) -> None:
    calls = worlds.run(n, _run_all_mpi, timeout=90)
    for rank_calls in calls:  # every kind of collective went over MPI
        assert set(rank_calls) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}, rank_calls


def _dtypes_mpi(world: Any) -> dict[str, Any]:
    """bfloat16/bool reductions fall back to gloo (never summed bytewise); byte-moving ops take them."""
    group = world.new_groups([[0, 1]])[0]
    plain = dist.new_group([0, 1])  # no MPI twin: gloo
    calls, restore = _spy_mpi()
    results: dict[str, Any] = {}
    try:
        gen = torch.Generator().manual_seed(7)
        xs = [torch.randn(4, 6, generator=gen).to(torch.bfloat16) for _ in range(2)]
        x = xs[world.rank]
        total = C.all_reduce(x, group)
        torch.testing.assert_close(total, C.all_reduce(x, plain), rtol=0, atol=0)
        results["reduce_calls"] = dict(calls)
        gathered = C.all_gather(x, 1, group)
        assert torch.equal(gathered, torch.cat(xs, 1))
        swapped = C.all_to_all(x, 1, 0, group)
        assert torch.equal(swapped, torch.cat([t.chunk(2, 1)[world.rank] for t in xs], 0))
        flags = torch.tensor([world.rank == 0, True, False])
        assert torch.equal(
            C.all_gather(flags, 0, group), torch.tensor([True, True, False, False, True, False])
        )
        ints = torch.arange(8, dtype=torch.int64).reshape(2, 4) * (world.rank + 1)
        assert torch.equal(
            C.reduce_scatter(ints, 1, group), (ints * 3 // (world.rank + 1)).chunk(2, 1)[world.rank]
        )
        results["all_calls"] = dict(calls)
    finally:
        restore()
        world.destroy_groups([group])
        dist.destroy_process_group(plain)
    return results


def test_mpi_path_dtypes_fall_back_where_mpi_cannot_reduce(worlds: Any) -> None:
    for res in worlds.run(2, _dtypes_mpi, timeout=60):
        assert res["reduce_calls"] == {}, "a bfloat16 sum must not go over MPI"
        assert res["all_calls"] == {"all_gather": 2, "all_to_all": 1, "reduce_scatter": 1}
