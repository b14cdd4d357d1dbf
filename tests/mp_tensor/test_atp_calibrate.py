"""Calibration on this machine: every mesh of 4 ranks measured, recorded in the matrix, used by the search."""

from __future__ import annotations

import math
from typing import Any

from mp_tensor.atp import CommMatrix, ModelShape, calibrate, choose_mesh


def _calibrate(world: Any) -> str:
    return calibrate(nbytes=1 << 16, iters=2, repeats=1).to_json()


def test_calibration_measures_every_mesh(worlds: Any) -> None:
    texts = worlds.run(4, _calibrate, timeout=60)
    matrix = CommMatrix.from_json(texts[0])
    assert set(matrix.calibration) == {(4, 1), (2, 2), (1, 4)}
    assert matrix.calibration[(4, 1)][1] == math.inf and matrix.calibration[(1, 4)][0] == math.inf
    for b1, b2 in matrix.calibration.values():
        assert b1 > 0 and b2 > 0 and (math.isfinite(b1) or math.isfinite(b2))
    # The uncalibrated layer is the bus bandwidth of the whole group, from the (4, 1) measurement.
    assert matrix.layers[0].group_bw[0] == matrix.calibration[(4, 1)][0] * 2 * 3 / 4
    result = choose_mesh(4, matrix, ModelShape(layers=2, batch=2, seq=128, hidden=256))
    assert all(row.calibrated for row in result.table)
    assert CommMatrix.from_json(matrix.to_json()) == matrix
