"""The hierarchical communication matrix and the mesh search against the paper's own numbers.

Equation 3 on Figure 7(a), §5.4's closed form on one-layer and torus topologies (Figure 12's trends),
§5.3's calibrated PCIe numbers (46 % lower for DeviceMesh(2, 4)), Megatron's cost for DeviceMesh(N, 1),
JSON round trips and the errors.
"""

from __future__ import annotations

import json
import math

import pytest

from mp_tensor.atp import (
    CommLayer,
    CommMatrix,
    CommMatrixError,
    ModelShape,
    SearchError,
    choose_mesh,
    dual_nvlink_node,
    ethernet_cluster,
    fully_connected,
    infiniband_cluster,
    nvswitch_node,
    pcie_tree,
    torus_2d,
)
from mp_tensor.atp.mesh import axis_groups
from mp_tensor.atp.search import algorithm_bandwidth, estimate_mesh, mesh_shapes, t_comm

MODEL = ModelShape(layers=24, batch=4, seq=2048, hidden=4096)
FIG_7A = infiniband_cluster(4, fully_connected(4, 200.0, 600.0, name="nvlink-4gpu"), 200.0)


def _delta_units(n: int, matrix: CommMatrix, group_bw: float) -> dict[tuple[int, int], float]:
    """T_comm of every mesh in units of Delta = 2 L b s h / GroupBW (§5.4)."""
    delta = (
        2 * MODEL.layers * MODEL.batch * MODEL.seq * MODEL.hidden * MODEL.bytes_per_element / (group_bw * 1e9)
    )
    return {(e.d1, e.d2): e.t_comm / delta for e in choose_mesh(n, matrix, MODEL).table}


def test_equation_3_on_figure_7a() -> None:
    # "considering DeviceMesh(8, 2) in Figure 7(a), B'2 ... is equal to 200 GB/s ... B'1 is equal to
    # 12.5 GB/s"
    e = estimate_mesh(8, 2, FIG_7A, MODEL)
    assert (e.bus_bw1, e.bus_bw2) == (12.5, 200.0)
    assert FIG_7A.crossed_layers(axis_groups((8, 2), range(16), 0)) == ("node", "device")
    assert FIG_7A.crossed_layers(axis_groups((8, 2), range(16), 1)) == ("device",)
    # A node's four GPUs all-reduce over all their NVLinks: the group bandwidth, 600 GB/s.
    assert estimate_mesh(4, 4, FIG_7A, MODEL).bus_bw2 == 600.0


def test_equation_4_and_megatron_cost() -> None:
    assert algorithm_bandwidth(100.0, 1) == math.inf
    assert algorithm_bandwidth(100.0, 2) == 100.0
    assert algorithm_bandwidth(100.0, 8) == pytest.approx(100.0 * 8 / 14)
    # DeviceMesh(N, 1) is Megatron: 4L all-reduces of [b, s, h] per step (§2.3), 4 L b s h / B.
    b1 = 37.0
    expected = 4 * MODEL.layers * MODEL.batch * MODEL.seq * MODEL.hidden * 2 / (b1 * 1e9)
    assert t_comm(MODEL, 8, 1, b1, math.inf) == pytest.approx(expected)
    assert t_comm(MODEL, 1, 1, math.inf, math.inf) == 0.0


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_one_layer_topologies_follow_the_closed_form_of_section_5_4(n: int) -> None:
    # IC5 (NVLink-Network switch): B'1 = B'2 = GroupBW, T = Delta (14 d2 + 4 d1 - 18) / (d1 d2).
    got = _delta_units(n, fully_connected(n, 900.0), 900.0)
    for (d1, d2), value in got.items():
        assert value == pytest.approx((14 * d2 + 4 * d1 - 18) / (d1 * d2)), (d1, d2)


def test_which_mesh_wins_on_one_layer_topologies() -> None:
    # "ATP selects ATP-1 when the number of devices is less than 8 and ATP-2 when it is greater than 8"
    for n in (2, 4):
        assert choose_mesh(n, fully_connected(n, 600.0), MODEL).mesh == (n, 1)
    assert choose_mesh(16, fully_connected(16, 600.0), MODEL).mesh == (8, 2)
    # Figure 12: ATP-1 (= Megatron) costs more as N grows; the optimum costs less from N = 8 on.
    atp1 = [_delta_units(n, fully_connected(n, 600.0), 600.0)[(n, 1)] for n in (4, 8, 16, 32, 64)]
    best = [min(_delta_units(n, fully_connected(n, 600.0), 600.0).values()) for n in (8, 16, 32, 64)]
    assert atp1 == sorted(atp1) and len(set(atp1)) == len(atp1)
    assert best == sorted(best, reverse=True) and len(set(best)) == len(best)


def test_torus_gives_every_axis_the_group_bandwidth() -> None:
    # Figure 7(b): 4x4 torus, 25 GB/s links; §5.4: "both B'1 and B'2 are also equal to GroupBW".
    torus = torus_2d(4, 4, 25.0)
    e = estimate_mesh(4, 4, torus, MODEL)
    assert (e.bus_bw1, e.bus_bw2) == (50.0, 50.0)
    assert torus.layers[0].p2p[0][1] == 100.0 and torus.layers[0].group_bw[0] == 200.0
    assert torus.layers[1].p2p[0][2] == 0.0 and torus.layers[1].group_bw[0] == 50.0
    assert choose_mesh(16, torus, MODEL).mesh == (4, 4)


def test_calibrated_pcie_reproduces_section_5_3() -> None:
    # "For DeviceMesh(2, 4), B1 is calibrated to 1.20 GB/s and B2 to 4.95 GB/s. For DeviceMesh(8, 1), B1 is
    # calibrated to 0.97 GB/s ... the T_comm of ATP-4 was theoretically 46% lower than that of ATP-1."
    pcie = pcie_tree().with_calibration((2, 4), 1.20, 4.95).with_calibration((8, 1), 0.97, math.inf)
    atp4, atp1 = estimate_mesh(2, 4, pcie, MODEL), estimate_mesh(8, 1, pcie, MODEL)
    assert atp4.calibrated and atp1.calibrated
    assert 1 - atp4.t_comm / atp1.t_comm == pytest.approx(0.46, abs=0.01)


def test_hierarchical_topologies_pick_hierarchical_meshes() -> None:
    # Nodes over InfiniBand: slow links carry the small axis, NVLink the large one.
    assert choose_mesh(16, FIG_7A, MODEL).mesh == (4, 4)
    assert choose_mesh(16, infiniband_cluster(2, nvswitch_node(8)), MODEL).mesh == (2, 8)
    assert choose_mesh(16, ethernet_cluster(2, nvswitch_node(8)), MODEL).mesh == (2, 8)
    # Inside one NVSwitch node of 8, equations 2-4 put DeviceMesh(4, 2) 7 % ahead of (8, 1); the paper
    # measured ATP-1 on its 8-GPU NVSwitch machine, and its crossover (N > 7) sits right there.
    nvswitch = choose_mesh(8, nvswitch_node(8), MODEL)
    assert nvswitch.mesh == (4, 2)
    assert nvswitch.table[0].t_comm / nvswitch.best.t_comm == pytest.approx(3.5 / 3.25)
    # Dual NVLink (IC2): with equation 4's d/(2(d-1)) the NVLink pairs make DeviceMesh(4, 2) cheaper
    # than (8, 1); §5.3's argument for ATP-1 drops that factor.
    dual = choose_mesh(8, dual_nvlink_node(8), MODEL)
    assert dual.mesh == (4, 2) and dual.table[0].t_comm > dual.best.t_comm


def test_devices_place_a_group_anywhere_in_the_matrix() -> None:
    # A tensor-parallel group spread over two nodes (placement "spread") sees the node link on axis 2.
    spread = estimate_mesh(1, 2, FIG_7A, MODEL, devices=[0, 4])
    packed = estimate_mesh(1, 2, FIG_7A, MODEL, devices=[0, 1])
    assert (spread.bus_bw2, packed.bus_bw2) == (25.0, 200.0)
    with pytest.raises(SearchError, match="do not fill DeviceMesh"):
        estimate_mesh(2, 2, FIG_7A, MODEL, devices=[0, 1, 1, 2])


def test_table_is_printable_and_serializable() -> None:
    result = choose_mesh(16, FIG_7A, MODEL)
    text = result.format_table()
    assert "ATP-4" in text and "*" in text and "T_comm ms" in text
    assert len(text.splitlines()) == 2 + len(mesh_shapes(16))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["best"] == [4, 4] and data["table"][0]["algo_bw2"] is None


@pytest.mark.parametrize(
    "matrix",
    [
        FIG_7A,
        torus_2d(),
        pcie_tree().with_calibration((8, 1), 0.97, math.inf),
        dual_nvlink_node(),
        nvswitch_node(),
        ethernet_cluster(3, dual_nvlink_node(4)),
    ],
    ids=lambda m: m.name,
)
def test_json_round_trip(matrix: CommMatrix, tmp_path: object) -> None:
    assert CommMatrix.from_json(matrix.to_json()) == matrix
    path = f"{tmp_path}/m.json"
    matrix.save(path)
    assert CommMatrix.load(path) == matrix


def test_malformed_matrices_are_rejected() -> None:
    with pytest.raises(CommMatrixError, match="expected an R x R matrix"):
        CommLayer(name="x", p2p=((0.0, 1.0),), group_bw=(1.0, 1.0))
    with pytest.raises(CommMatrixError, match="positive group bandwidths"):
        CommLayer(name="x", p2p=((0.0,),), group_bw=(0.0,))
    with pytest.raises(CommMatrixError, match="not valid JSON"):
        CommMatrix.from_json("{")
    with pytest.raises(CommMatrixError, match="not a communication matrix"):
        CommMatrix.from_json('{"name": "x"}')
    with pytest.raises(SearchError, match="exceeds the 8 devices"):
        choose_mesh(16, nvswitch_node(8), MODEL)
    with pytest.raises(SearchError, match=r"ModelShape\.hidden=0"):
        ModelShape(layers=1, batch=1, seq=1, hidden=0)
