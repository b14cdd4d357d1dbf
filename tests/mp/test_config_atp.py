"""The ATP keys of the config (mp's extension): atp_mesh and atp_topology."""

from __future__ import annotations

import pytest

from mp.config import ConfigError, ModelParallelConfig


@pytest.mark.parametrize("mesh", ["auto", "2x2", "4x1", "1x4", "1X4"])
def test_valid_meshes(mesh: str) -> None:
    cfg = ModelParallelConfig.from_dict({"tensor_parallel_degree": 4, "atp_mesh": mesh})
    assert cfg.atp_mesh == mesh
    assert ModelParallelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"tensor_parallel_degree": 4, "atp_mesh": "3x2"}, "'1x4', '2x2', '4x1'"),
        ({"tensor_parallel_degree": 4, "atp_mesh": "two"}, "not a mesh of tensor_parallel_degree 4"),
        ({"atp_mesh": "auto"}, "tensor_parallel_degree > 1"),
        ({"tensor_parallel_degree": 2, "atp_mesh": "2x1", "atp_topology": "pcie"}, "atp_mesh 'auto'"),
        ({"tensor_parallel_degree": 2, "atp_mesh": 2}, "atp_mesh"),
    ],
)
def test_invalid_meshes_are_explained(params: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelParallelConfig.from_dict(params)
    assert fragment in str(info.value)
    assert "Fix:" in str(info.value)
