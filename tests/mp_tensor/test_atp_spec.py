"""Device-mesh layout and sharding specs: pure shard/unshard round trips (the paper's Figure 4 among
them), errors that name the problem, and the collective ``to_global`` on live 2x2 meshes."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_tensor.atp import MeshError, Partial, Replicate, Shard, ShardingError, create_mesh
from mp_tensor.atp.mesh import axis_groups, mesh_coords, normalize_shape
from mp_tensor.atp.spec import distribute, local_shape, shard_tensor, to_global, unshard_tensors


def test_mesh_layout_is_row_major() -> None:
    assert [mesh_coords((2, 2), p) for p in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # DeviceMesh(2, 2) over ranks 0-3: axis 0 groups vary the first coordinate, d2 of them at once.
    assert axis_groups((2, 2), range(4), 0) == [(0, 2), (1, 3)]
    assert axis_groups((2, 2), range(4), 1) == [(0, 1), (2, 3)]
    assert axis_groups((4, 1), [4, 5, 6, 7], 0) == [(4, 5, 6, 7)]
    assert axis_groups((2, 4), range(8), 0) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    with pytest.raises(MeshError, match="holds 6 devices but the group has 4"):
        normalize_shape((2, 3), 4)
    with pytest.raises(MeshError, match="positive ints"):
        normalize_shape((2, 0))


def test_figure_4_replicate_then_shard() -> None:
    t = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    pieces = {
        c: shard_tensor(t, [Replicate(), Shard(0)], (2, 2), c) for c in itertools.product(range(2), range(2))
    }
    # "rank-0 and rank-2 get [1, 2, 3, 4], rank-1 and rank-3 get [5, 6, 7, 8]"
    assert pieces[(0, 0)].tolist() == pieces[(1, 0)].tolist() == [[1, 2, 3, 4]]
    assert pieces[(0, 1)].tolist() == pieces[(1, 1)].tolist() == [[5, 6, 7, 8]]
    # [Shard(1), Shard(0)]: columns split for ranks {0,1} / {2,3}, then rows.
    assert shard_tensor(t, [Shard(1), Shard(0)], (2, 2), (1, 0)).tolist() == [[3, 4]]
    assert shard_tensor(t, [Shard(1), Shard(0)], (2, 2), (0, 1)).tolist() == [[5, 6]]


placements = st.one_of(
    st.builds(Shard, st.integers(-2, 1)),
    st.just(Replicate()),
    st.sampled_from([Partial("sum"), Partial("max"), Partial("product")]),
)


@settings(max_examples=60, deadline=None)
@given(
    mesh=st.sampled_from([(2, 2), (4, 1), (1, 4), (2, 3), (2,), (2, 1, 2)]),
    data=st.data(),
)
def test_shard_then_unshard_is_the_identity(mesh: tuple[int, ...], data: Any) -> None:
    spec = [data.draw(placements) for _ in mesh]
    shape = [math.prod(mesh) * 2, math.prod(mesh) * 3]
    t = torch.arange(1, 1 + math.prod(shape), dtype=torch.float64).reshape(shape) / 7
    coords = list(itertools.product(*(range(d) for d in mesh)))
    pieces = {c: shard_tensor(t, spec, mesh, c) for c in coords}
    assert all(p.shape == local_shape(t.shape, spec, mesh) for p in pieces.values())
    torch.testing.assert_close(unshard_tensors(pieces, spec, mesh), t, rtol=1e-12, atol=0)


def test_spec_errors_name_the_problem() -> None:
    t = torch.zeros(6, 5)
    with pytest.raises(
        ShardingError, match=r"dim 1 has size 5 at mesh axis 0, which its 2 ranks do not divide"
    ):
        shard_tensor(t, [Shard(1), Replicate()], (2, 2), (0, 0))
    with pytest.raises(ShardingError, match="3 placements but the mesh has 2 axes"):
        local_shape(t.shape, [Replicate()] * 3, (2, 2))
    with pytest.raises(ShardingError, match=r"Shard\(2\) is out of range for a 2-d tensor"):
        local_shape(t.shape, [Shard(2), Replicate()], (2, 2))
    with pytest.raises(ShardingError, match="is not one of"):
        Partial("mean")
    assert Partial(dist.ReduceOp.MAX) == Partial("max")
    with pytest.raises(ShardingError, match=r"missing the pieces at \[\(1, 1\)\]"):
        unshard_tensors({(0, 0): t, (0, 1): t, (1, 0): t}, [Replicate(), Replicate()], (2, 2))


def _to_global(world: Any) -> None:
    mesh = create_mesh((2, 2))
    try:
        assert mesh.coord == (world.rank // 2, world.rank % 2)
        assert mesh.axis_ranks(0) == (world.rank % 2, world.rank % 2 + 2)
        t = torch.arange(48, dtype=torch.float64).reshape(4, 12)
        for spec in (
            [Shard(1), Shard(0)],
            [Shard(0), Shard(1)],
            [Shard(1), Shard(1)],
            [Replicate(), Shard(-1)],
            [Partial(), Shard(0)],
            [Partial("max"), Replicate()],
        ):
            local = distribute(t, spec, mesh).clone().requires_grad_()
            full = to_global(local, spec, mesh)
            assert torch.equal(full, t), spec
            if spec[0] != Partial("max"):
                full.sum().backward()  # replicated result: each piece's grad is its slice of ones
                assert local.grad is not None and torch.equal(local.grad, torch.ones_like(local)), spec
    finally:
        mesh.destroy()


def test_to_global_on_a_live_mesh(worlds: Any) -> None:
    worlds.run(4, _to_global, timeout=60)


def _groups(world: Any) -> list[int]:
    # Two tensor-parallel groups of two (as tp=2, rdp=2): each rank gets the mesh of its own group.
    mesh = create_mesh((2, 1), groups=[(0, 2), (1, 3)])
    try:
        return list(mesh.ranks)
    finally:
        mesh.destroy()


def test_meshes_over_several_tensor_parallel_groups(worlds: Any) -> None:
    assert worlds.run(4, _groups, timeout=60) == [[0, 2], [1, 3], [0, 2], [1, 3]]
