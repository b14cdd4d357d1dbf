"""The ATP mesh search (§3.3-3.5): every ``DeviceMesh(d1, d2)`` with ``d1 * d2 = N``, costed by equation 2.

For each mesh, the hierarchical communication matrix gives the bus bandwidths ``B'1, B'2`` of the two
axes' grouped all-reduces (equation 3, :meth:`CommMatrix.axis_bandwidth`), Rabenseifner's cost model
turns them into algorithm bandwidths (equation 4)::

    B1 = d1 / (2 (d1 - 1)) * B'1        B2 = d2 / (2 (d2 - 1)) * B'2      (an axis of size 1: no traffic)

and equation 2 gives the tensor-parallel communication time of an L-layer transformer on ``[b, s, h]``::

    T_comm = 2 L b s * (7 h / (d1 B2) + 2 h / (d2 B1)) * bytes_per_element

A mesh with a calibrated ``(B1, B2)`` in the matrix uses the measurement instead. The result is the
whole table and the mesh with the smallest ``T_comm`` (ties go to the smaller ``d2``, the 1-D layout).
All of it is pure: every rank computes the same answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from mp_tensor.atp.comm_matrix import CommMatrix
from mp_tensor.atp.errors import SearchError
from mp_tensor.atp.mesh import axis_groups

__all__ = [
    "MeshEstimate",
    "ModelShape",
    "SearchResult",
    "algorithm_bandwidth",
    "choose_mesh",
    "estimate_mesh",
    "mesh_shapes",
    "t_comm",
]

_GB = 1e9


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The transformer whose tensor-parallel communication is costed."""

    layers: int
    """Number of transformer layers ``L``."""
    batch: int
    """Micro-batch size ``b``."""
    seq: int
    """Sequence length ``s``."""
    hidden: int
    """Hidden size ``h``."""
    bytes_per_element: int = 2
    """Bytes per activation element (2: fp16/bf16, as in the paper's runs)."""

    def __post_init__(self) -> None:
        for name in ("layers", "batch", "seq", "hidden", "bytes_per_element"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SearchError(f"ModelShape.{name}={value!r} is not a positive int; pass one.")


@dataclass(frozen=True, kw_only=True)
class MeshEstimate:
    """One row of the search table."""

    d1: int
    d2: int
    bus_bw1: float
    """``B'1`` (GB/s) from the matrix (``inf``: axis of size 1; ``nan``: calibrated, not estimated)."""
    bus_bw2: float
    """``B'2`` (GB/s)."""
    algo_bw1: float
    """``B1`` (GB/s), equation 4 or calibrated."""
    algo_bw2: float
    """``B2`` (GB/s)."""
    t_comm: float
    """Equation 2, seconds per training step."""
    calibrated: bool
    """Whether ``B1, B2`` are measurements."""

    @property
    def label(self) -> str:
        """The paper's name: ``ATP-i`` is ``DeviceMesh(N/i, i)``."""
        return f"ATP-{self.d2}"


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """The best mesh and the whole table, in order of ``d2``."""

    n_devices: int
    matrix: str
    model: ModelShape
    table: tuple[MeshEstimate, ...]
    best: MeshEstimate

    @property
    def mesh(self) -> tuple[int, int]:
        """The chosen ``(d1, d2)``."""
        return (self.best.d1, self.best.d2)

    def format_table(self) -> str:
        """The table as aligned text, the best mesh marked with ``*``."""
        m = self.model
        head = (
            f"ATP search: {self.n_devices} devices on {self.matrix}; L={m.layers} b={m.batch} s={m.seq} "
            f"h={m.hidden} ({m.bytes_per_element} B/element)"
        )
        rows = [("", "mesh", "name", "B'1 GB/s", "B'2 GB/s", "B1 GB/s", "B2 GB/s", "T_comm ms", "vs best")]
        for e in self.table:
            rows.append(
                (
                    "*" if e is self.best else "",
                    f"({e.d1}, {e.d2})",
                    e.label,
                    _bw(e.bus_bw1),
                    _bw(e.bus_bw2),
                    _bw(e.algo_bw1) + ("c" if e.calibrated else ""),
                    _bw(e.algo_bw2) + ("c" if e.calibrated else ""),
                    f"{e.t_comm * 1e3:.3f}",
                    f"{e.t_comm / self.best.t_comm:.2f}x" if self.best.t_comm > 0 else "-",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [head] + ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        if any(e.calibrated for e in self.table):
            lines.append("c: calibrated (measured) bandwidth")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (infinite bandwidths as ``null``)."""

        def clean(d: dict[str, Any]) -> dict[str, Any]:
            return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}

        return {
            "n_devices": self.n_devices,
            "matrix": self.matrix,
            "model": asdict(self.model),
            "best": [self.best.d1, self.best.d2],
            "table": [clean(asdict(e)) for e in self.table],
        }


def _bw(v: float) -> str:
    if math.isnan(v):
        return "-"
    return "inf" if math.isinf(v) else f"{v:.4g}"


def mesh_shapes(n: int) -> list[tuple[int, int]]:
    """Every 2-D mesh of ``n`` devices, ``(n, 1)`` first."""
    if not isinstance(n, int) or n < 1:
        raise SearchError(f"n_devices={n!r} is not a positive int; pass the tensor-parallel degree.")
    return [(n // d2, d2) for d2 in range(1, n + 1) if n % d2 == 0]


def algorithm_bandwidth(bus_bw: float, d: int) -> float:
    """Equation 4: the all-reduce algorithm bandwidth of ``d`` ranks on bus bandwidth ``B'`` (inf if d=1)."""
    return math.inf if d == 1 else d / (2 * (d - 1)) * bus_bw


def t_comm(model: ModelShape, d1: int, d2: int, b1: float, b2: float) -> float:
    """Equation 2 in seconds, with ``b1, b2`` the algorithm bandwidths in GB/s."""
    h = model.hidden
    per_token = 7 * h / (d1 * b2 * _GB) + 2 * h / (d2 * b1 * _GB)
    return 2 * model.layers * model.batch * model.seq * per_token * model.bytes_per_element


def estimate_mesh(
    d1: int, d2: int, matrix: CommMatrix, model: ModelShape, devices: Sequence[int] | None = None
) -> MeshEstimate:
    """The table row of ``DeviceMesh(d1, d2)`` laid over ``devices`` (matrix device indices, mesh order)."""
    placed = list(range(d1 * d2)) if devices is None else list(devices)
    if len(placed) != d1 * d2 or len(set(placed)) != len(placed):
        raise SearchError(
            f"devices {placed} do not fill DeviceMesh({d1}, {d2}); pass {d1 * d2} distinct device indices."
        )
    if (d1, d2) in matrix.calibration:
        b1, b2 = matrix.calibration[(d1, d2)]
        bus1 = bus2 = math.nan
        calibrated = True
    else:
        bus1 = matrix.axis_bandwidth(axis_groups((d1, d2), placed, 0))
        bus2 = matrix.axis_bandwidth(axis_groups((d1, d2), placed, 1))
        b1, b2 = algorithm_bandwidth(bus1, d1), algorithm_bandwidth(bus2, d2)
        calibrated = False
    time = t_comm(model, d1, d2, b1, b2)
    return MeshEstimate(
        d1=d1, d2=d2, bus_bw1=bus1, bus_bw2=bus2, algo_bw1=b1, algo_bw2=b2, t_comm=time, calibrated=calibrated
    )


def choose_mesh(
    n_devices: int,
    comm_matrix: CommMatrix,
    model_shape: ModelShape,
    *,
    devices: Sequence[int] | None = None,
) -> SearchResult:
    """Cost every 2-D mesh of ``n_devices`` and return the table and the cheapest mesh.

    ``devices`` are the matrix's device indices of the tensor-parallel group in mesh order (default
    ``0 .. n_devices-1``: consecutive ranks on consecutive devices).
    """
    shapes = mesh_shapes(n_devices)
    if n_devices > comm_matrix.num_devices:
        raise SearchError(
            f"n_devices={n_devices} exceeds the {comm_matrix.num_devices} devices of {comm_matrix.name!r}; "
            "pass a matrix of the whole machine or a smaller tensor-parallel degree."
        )
    table = tuple(estimate_mesh(d1, d2, comm_matrix, model_shape, devices) for d1, d2 in shapes)
    best = min(table, key=lambda e: (e.t_comm, e.d2))
    return SearchResult(
        n_devices=n_devices, matrix=comm_matrix.name, model=model_shape, table=table, best=best
    )
