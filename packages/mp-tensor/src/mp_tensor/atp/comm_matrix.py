"""The hierarchical communication matrix (ATP §3.4, Figure 7): the interconnect as layers of P2P matrices.

Layer 1 is the coarsest (nodes of a cluster, or rings of a torus); the last layer holds single devices.
Layer ``k`` has ``R_k`` units per unit of layer ``k-1``, an ``R_k x R_k`` P2P matrix (the bandwidth
between two units, 0 where they have no direct link) and one group bandwidth per unit (its aggregate
bandwidth to the outside). All layers are homogeneous: every parent unit has the same sub-matrix. A
device's index is its mixed-radix path ``(u_1, ..., u_l)``, so devices ``0 .. N-1`` fill the first unit
before the second, as ranks fill nodes. Bandwidths are in GB/s; the paper counts both directions.

:meth:`CommMatrix.axis_bandwidth` is equation 3 evaluated on the actual groups of a mesh axis: at every
layer a group crosses (its members sit in at least two units of one parent), each unit it touches gives
``min(GroupBW[u], sum of P2P[u][v] over the other member units v)`` (a unit with no direct link to any of
them relays through its best link), divided by the number of the axis's groups that cross that unit at
once. ``B'`` is the minimum over layers and units. This is the paper's ``min(GroupBW/d2)`` whenever a
unit holds at least ``d2`` devices (Figure 7(a): ``B'1 = 25/2 = 12.5``, ``B'2 = min(600, 200) = 200`` for
``DeviceMesh(8, 2)``), and it leaves single-device units undivided, as §5.4 assumes (``B'1 = B'2 =
GroupBW`` on one-layer and torus topologies).

``calibration`` maps a mesh ``(d1, d2)`` to measured algorithm bandwidths ``(B1, B2)`` (equation 4's,
from timed all-reduces; :mod:`mp_tensor.atp.calibrate`); the search uses them instead of the estimate,
which the paper found necessary on PCIe. Constructors build the paper's example topologies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mp_tensor.atp.errors import CommMatrixError

__all__ = [
    "CommLayer",
    "CommMatrix",
    "cluster",
    "dual_nvlink_node",
    "ethernet_cluster",
    "fully_connected",
    "infiniband_cluster",
    "nvswitch_node",
    "pcie_tree",
    "torus_2d",
]


@dataclass(frozen=True, kw_only=True)
class CommLayer:
    """One layer: ``R`` units, their P2P matrix and their group bandwidths (GB/s)."""

    name: str
    """What the units are: ``"node"``, ``"gpu"``, ``"ring"``, ..."""
    p2p: tuple[tuple[float, ...], ...]
    """``R x R`` bandwidth between two units (0: no direct link; the diagonal is ignored)."""
    group_bw: tuple[float, ...]
    """Each unit's aggregate bandwidth to the other units."""

    def __post_init__(self) -> None:
        p2p = tuple(tuple(float(v) for v in row) for row in self.p2p)
        group = tuple(float(v) for v in self.group_bw)
        r = len(group)
        if r < 1 or len(p2p) != r or any(len(row) != r for row in p2p):
            raise CommMatrixError(
                f"layer {self.name!r}: p2p is {len(p2p)}x{[len(row) for row in p2p]} and group_bw has {r} "
                "entries; expected an R x R matrix and R group bandwidths."
            )
        bad = [v for v in (*group, *(v for row in p2p for v in row)) if not math.isfinite(v) or v < 0]
        if bad or any(v <= 0 for v in group):
            raise CommMatrixError(
                f"layer {self.name!r} has bandwidths {bad or [v for v in group if v <= 0]}: expected finite, "
                "non-negative P2P entries and positive group bandwidths in GB/s."
            )
        object.__setattr__(self, "p2p", p2p)
        object.__setattr__(self, "group_bw", group)

    @property
    def size(self) -> int:
        """Number of units ``R`` per parent unit."""
        return len(self.group_bw)

    def unit_bandwidth(self, unit: int, members: Sequence[int]) -> float:
        """What ``unit`` can give an all-reduce among the units ``members`` (which include it)."""
        direct = sum(self.p2p[unit][v] for v in members if v != unit)
        reach = (
            direct if direct > 0 else max((v for i, v in enumerate(self.p2p[unit]) if i != unit), default=0.0)
        )
        return min(self.group_bw[unit], reach) if reach > 0 else self.group_bw[unit]


@dataclass(frozen=True, kw_only=True)
class CommMatrix:
    """A hierarchical communication matrix: its layers, top (coarsest) first, and optional calibration."""

    name: str
    layers: tuple[CommLayer, ...]
    calibration: Mapping[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    """Measured algorithm bandwidths ``(B1, B2)`` in GB/s by mesh ``(d1, d2)``; ``inf`` for a size-1 axis."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise CommMatrixError(f"matrix {self.name!r} has no layers; give at least one CommLayer.")
        calibration = {}
        for mesh, bws in dict(self.calibration).items():
            d1, d2 = (int(d) for d in mesh)
            b1, b2 = (float(b) for b in bws)
            if d1 < 1 or d2 < 1 or not b1 > 0 or not b2 > 0:
                raise CommMatrixError(
                    f"matrix {self.name!r}: calibration {mesh} -> {bws} needs positive mesh dims and "
                    "positive bandwidths (inf for an axis of size 1)."
                )
            calibration[(d1, d2)] = (b1, b2)
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "calibration", calibration)

    @property
    def num_devices(self) -> int:
        """Number of devices: the product of the layer sizes."""
        return math.prod(layer.size for layer in self.layers)

    def device_path(self, device: int) -> tuple[int, ...]:
        """The unit index of ``device`` at every layer, top first."""
        if not 0 <= device < self.num_devices:
            raise CommMatrixError(
                f"device {device} is outside matrix {self.name!r} of {self.num_devices} devices."
            )
        path = []
        for layer in reversed(self.layers):
            device, unit = divmod(device, layer.size)
            path.append(unit)
        return tuple(reversed(path))

    def axis_bandwidth(self, groups: Sequence[Sequence[int]]) -> float:
        """``B'`` (equation 3) for one mesh axis whose ``groups`` (device indices) all-reduce at once.

        ``inf`` when no group has two members (nothing to communicate).
        """
        users: dict[tuple[int, tuple[int, ...]], set[int]] = {}
        capacity: dict[tuple[tuple[int, tuple[int, ...]], int], float] = {}
        for gid, members in enumerate(groups):
            paths = [self.device_path(d) for d in members]
            for k, layer in enumerate(self.layers):
                by_parent: dict[tuple[int, ...], set[int]] = {}
                for path in paths:
                    by_parent.setdefault(path[:k], set()).add(path[k])
                for parent, units in by_parent.items():
                    if len(units) < 2:
                        continue
                    for unit in units:
                        key = (k, (*parent, unit))
                        users.setdefault(key, set()).add(gid)
                        capacity[(key, gid)] = layer.unit_bandwidth(unit, sorted(units))
        if not capacity:
            return math.inf
        return min(cap / len(users[key]) for (key, _), cap in capacity.items())

    def crossed_layers(self, groups: Sequence[Sequence[int]]) -> tuple[str, ...]:
        """Names of the layers the groups' all-reduces cross, top first."""
        crossed = []
        for k, layer in enumerate(self.layers):
            for members in groups:
                paths = [self.device_path(d) for d in members]
                if len({p[: k + 1] for p in paths}) > len({p[:k] for p in paths}):
                    crossed.append(layer.name)
                    break
        return tuple(crossed)

    def with_calibration(self, mesh: tuple[int, int], b1: float, b2: float) -> CommMatrix:
        """A copy with measured algorithm bandwidths ``(b1, b2)`` recorded for ``mesh``."""
        return replace(self, calibration={**self.calibration, (int(mesh[0]), int(mesh[1])): (b1, b2)})

    # ------------------------------------------------------------------------------------- JSON

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``inf`` bandwidths written as ``null``)."""
        return {
            "name": self.name,
            "layers": [
                {
                    "name": layer.name,
                    "p2p": [list(row) for row in layer.p2p],
                    "group_bw": list(layer.group_bw),
                }
                for layer in self.layers
            ],
            "calibration": [
                {"mesh": list(mesh), "B1": _finite_or_none(b1), "B2": _finite_or_none(b2)}
                for mesh, (b1, b2) in sorted(self.calibration.items())
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CommMatrix:
        """The matrix from :meth:`to_dict`'s form; raises :class:`CommMatrixError` naming what is wrong."""
        try:
            layers = tuple(
                CommLayer(name=str(d["name"]), p2p=tuple(map(tuple, d["p2p"])), group_bw=tuple(d["group_bw"]))
                for d in data["layers"]
            )
            calibration = {
                (int(c["mesh"][0]), int(c["mesh"][1])): (_inf_if_none(c["B1"]), _inf_if_none(c["B2"]))
                for c in data.get("calibration", [])
            }
            return cls(name=str(data["name"]), layers=layers, calibration=calibration)
        except (KeyError, TypeError, IndexError) as exc:
            raise CommMatrixError(
                f"not a communication matrix: {exc!r}; expected {{'name', 'layers': [{{'name', 'p2p', "
                "'group_bw'}}, ...], 'calibration': [{'mesh', 'B1', 'B2'}, ...]}} (see docs/atp.md)."
            ) from None

    def to_json(self, indent: int | None = 2) -> str:
        """The matrix as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> CommMatrix:
        """The matrix from JSON text."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CommMatrixError(
                f"the topology is not valid JSON: {exc}; pass a file from save()."
            ) from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        """Write the matrix as JSON to ``path``."""
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CommMatrix:
        """Read a matrix written by :meth:`save`."""
        return cls.from_json(Path(path).read_text())

    def describe(self) -> str:
        """A short text description, one line per layer."""
        lines = [f"{self.name}: {self.num_devices} devices, {len(self.layers)} layer(s)"]
        for k, layer in enumerate(self.layers, 1):
            p2p = sorted({v for i, row in enumerate(layer.p2p) for j, v in enumerate(row) if i != j})
            group = sorted(set(layer.group_bw))
            lines.append(
                f"  layer {k} ({layer.name}): {layer.size} units, P2P {', '.join(f'{v:.4g}' for v in p2p)} "
                f"GB/s, group {', '.join(f'{v:.4g}' for v in group)} GB/s"
            )
        for mesh, (b1, b2) in sorted(self.calibration.items()):
            lines.append(f"  calibrated {mesh[0]}x{mesh[1]}: B1 {b1:.3g} GB/s, B2 {b2:.3g} GB/s")
        return "\n".join(lines)


def _finite_or_none(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _inf_if_none(v: float | None) -> float:
    return math.inf if v is None else float(v)


# ----------------------------------------------------------------------------------- constructors


def _uniform_layer(name: str, units: int, p2p: float, group_bw: float) -> CommLayer:
    matrix = tuple(tuple(0.0 if i == j else p2p for j in range(units)) for i in range(units))
    return CommLayer(name=name, p2p=matrix, group_bw=(group_bw,) * units)


def fully_connected(
    devices: int, p2p_gbs: float, group_gbs: float | None = None, name: str = ""
) -> CommMatrix:
    """One layer of ``devices`` with ``p2p_gbs`` between every pair (e.g. an NVLink-Network switch, IC5)."""
    group = p2p_gbs if group_gbs is None else group_gbs
    return CommMatrix(
        name=name or f"fully-connected-{devices}", layers=(_uniform_layer("device", devices, p2p_gbs, group),)
    )


def nvswitch_node(gpus: int = 8, nvlink_gbs: float = 600.0) -> CommMatrix:
    """A node whose GPUs all hang off NVSwitches (Figure 2(a), IC3): any pair gets a GPU's full NVLink."""
    return fully_connected(gpus, nvlink_gbs, nvlink_gbs, name=f"nvswitch-{gpus}gpu")


def dual_nvlink_node(gpus: int = 8, nvlink_gbs: float = 600.0, pcie_gbs: float = 64.0) -> CommMatrix:
    """GPUs bridged in pairs by NVLink, the pairs joined over PCIe (Figure 2(b), IC2)."""
    if gpus % 2:
        raise CommMatrixError(f"dual_nvlink_node(gpus={gpus}) needs an even number of GPUs.")
    return CommMatrix(
        name=f"dual-nvlink-{gpus}gpu",
        layers=(
            _uniform_layer("pair", gpus // 2, pcie_gbs, pcie_gbs),
            _uniform_layer("gpu", 2, nvlink_gbs, nvlink_gbs),
        ),
    )


def pcie_tree(
    sockets: int = 2,
    switches_per_socket: int = 2,
    gpus_per_switch: int = 2,
    pcie_gbs: float = 64.0,
    socket_gbs: float = 64.0,
) -> CommMatrix:
    """A PCIe tree (Figure 2, IC1): GPUs under PCIe switches, switches under CPU sockets, sockets bridged.

    The estimate is rough on PCIe (the paper calibrates it, §5.3); record measurements with calibration.
    """
    n = sockets * switches_per_socket * gpus_per_switch
    return CommMatrix(
        name=f"pcie-tree-{n}gpu",
        layers=(
            _uniform_layer("socket", sockets, socket_gbs, socket_gbs),
            _uniform_layer("switch", switches_per_socket, pcie_gbs, pcie_gbs),
            _uniform_layer("gpu", gpus_per_switch, pcie_gbs, pcie_gbs),
        ),
    )


def cluster(nodes: int, node: CommMatrix, link_gbs: float, name: str = "") -> CommMatrix:
    """``nodes`` copies of ``node`` joined by a switched network giving each node ``link_gbs``."""
    return CommMatrix(
        name=name or f"{nodes}x{node.name}",
        layers=(_uniform_layer("node", nodes, link_gbs, link_gbs), *node.layers),
    )


def infiniband_cluster(nodes: int, node: CommMatrix, gbps: float = 200.0) -> CommMatrix:
    """Nodes over InfiniBand at ``gbps`` gigabits per second per node (HDR: 200; Figure 7(a), IC4)."""
    return cluster(nodes, node, gbps / 8, name=f"{nodes}x{node.name}-ib{gbps:g}")


def ethernet_cluster(nodes: int, node: CommMatrix, gbps: float = 100.0) -> CommMatrix:
    """Nodes over Ethernet at ``gbps`` gigabits per second per node."""
    return cluster(nodes, node, gbps / 8, name=f"{nodes}x{node.name}-eth{gbps:g}")


def _ring_layer(name: str, units: int, link_gbs: float) -> CommLayer:
    def links(i: int, j: int) -> int:
        if i == j:
            return 0
        return int((i - j) % units == 1) + int((j - i) % units == 1)

    p2p = tuple(tuple(link_gbs * links(i, j) for j in range(units)) for i in range(units))
    return CommLayer(name=name, p2p=p2p, group_bw=(2 * link_gbs if units > 1 else link_gbs,) * units)


def torus_2d(rows: int = 4, cols: int = 4, link_gbs: float = 25.0) -> CommMatrix:
    """A ``rows x cols`` 2-D torus (Figure 7(b), IC6): rings of ``cols`` devices, the rings in a ring.

    Inside a ring, neighbours share a link (P2P ``link_gbs``, group ``2 * link_gbs``); between two
    neighbouring rings run ``cols`` links (P2P ``cols * link_gbs``, group twice that).
    """
    return CommMatrix(
        name=f"torus-{rows}x{cols}",
        layers=(_ring_layer("ring", rows, cols * link_gbs), _ring_layer("device", cols, link_gbs)),
    )
