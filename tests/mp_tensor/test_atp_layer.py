"""The ATP transformer layer on every mesh of 4 ranks equals the single-device layer: output, input
gradient and every parameter gradient; chunks 1, 2 and 4 give bitwise the same results (ordered
all-reduce); the layer fits the shapes it promises and rejects those it cannot shard."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mp_tensor.atp import ATPTransformerLayer, ShardingError, TransformerLayer, create_mesh, distribute
from mp_tensor.atp.layer import ACTIVATION_SPEC
from tests.mp_tensor._atp_util import assert_all_same, assert_same

MESHES = [(1, 4), (2, 2), (4, 1)]


def _run(mesh: Any, chunks: int, deterministic: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)
    ref = TransformerLayer(32, 4, 64, dtype=torch.float64)
    x = torch.randn(4, 8, 32, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(4, 8, 32, dtype=torch.float64)
    out_ref = ref(x)
    out_ref.backward(grad_out)

    layer = ATPTransformerLayer.from_reference(ref, mesh=mesh, chunks=chunks, deterministic=deterministic)
    x_local = distribute(x.detach(), ACTIVATION_SPEC, mesh).clone().requires_grad_()
    out = layer(x_local)
    out.backward(distribute(grad_out, ACTIVATION_SPEC, mesh))
    tag = f"{mesh.shape} chunks={chunks} det={deterministic}"
    assert_same(f"{tag} output", out, distribute(out_ref.detach(), ACTIVATION_SPEC, mesh))
    assert_same(f"{tag} grad input", x_local.grad, distribute(x.grad, ACTIVATION_SPEC, mesh))
    expected = layer.shard_reference({n: p.grad for n, p in ref.named_parameters() if p.grad is not None})
    got = {n: p.grad for n, p in layer.named_parameters()}
    assert_all_same(
        {f"{tag} grad {n}": g for n, g in got.items()}, {f"{tag} grad {n}": g for n, g in expected.items()}
    )
    return {"output": out.detach(), "grad input": x_local.grad, **{f"grad {n}": g for n, g in got.items()}}


def _layer_on_every_mesh(world: Any) -> int:
    checked = 0
    for shape in MESHES:
        mesh = create_mesh(shape)
        try:
            runs = {(c, d): _run(mesh, c, d) for c in (1, 2, 4) for d in (False, True)}
            for c in (2, 4):
                assert_all_same(
                    {f"{shape} chunks={c} {k}": v for k, v in runs[(c, True)].items()},
                    {f"{shape} chunks={c} {k}": v for k, v in runs[(1, True)].items()},
                    exact=True,
                )
                assert_all_same(runs[(c, False)], runs[(1, False)], exact=max(shape) <= 2)
            checked += 1
        finally:
            mesh.destroy()
    return checked


def test_layer_equals_single_device_on_every_mesh(worlds: Any) -> None:
    assert worlds.run(4, _layer_on_every_mesh, timeout=120) == [3] * 4


def _shapes_and_errors(world: Any) -> list[Any]:
    mesh = create_mesh((2, 2))
    try:
        layer = ATPTransformerLayer(32, 4, mesh=mesh)
        shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
        with pytest.raises(ShardingError) as info:
            ATPTransformerLayer(32, 2, mesh=mesh)
        layer.chunks = 2
        return [shapes, str(info.value), layer.fc2.chunks]
    finally:
        mesh.destroy()


def test_local_shapes_follow_the_specs(worlds: Any) -> None:
    shapes, message, chunks = worlds.run(4, _shapes_and_errors, timeout=60)[0]
    assert shapes == {
        "ln1.weight": (16,),
        "ln1.bias": (16,),
        "qkv.weight": (48, 16),  # column-first: [3h/d1, h/d2]
        "qkv.bias": (48,),
        "proj.weight": (16, 16),  # row-first: [h/d2, h/d1]
        "proj.bias": (16,),
        "ln2.weight": (16,),
        "ln2.bias": (16,),
        "fc1.weight": (64, 16),
        "fc1.bias": (64,),
        "fc2.weight": (16, 64),
        "fc2.bias": (16,),
    }
    assert "heads=2 must be divisible by d1*d2=4" in message
    assert chunks == 2
