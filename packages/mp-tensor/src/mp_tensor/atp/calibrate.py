"""Calibration: measure each mesh's all-reduce bandwidths on this machine (ATP §5.3).

For ``DeviceMesh(d1, d2)`` over a tensor-parallel group, all ``d2`` axis-1 groups all-reduce a message
at once (as they do in training), timed by the slowest rank, then all ``d1`` axis-2 groups do; the
algorithm bandwidth is ``bytes / time`` (equation 4's ``B``). The axes are measured alternately,
``repeats`` times each, and the median kept, since a shared host is noisy. :func:`calibrate` does this
for every mesh of the group and records the results in the communication matrix, where the search
prefers them to the estimate.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from mp_tensor.atp.comm_matrix import CommMatrix, fully_connected
from mp_tensor.atp.errors import CommMatrixError
from mp_tensor.atp.mesh import create_mesh
from mp_tensor.atp.search import mesh_shapes

__all__ = ["calibrate", "measure_mesh"]

log = logging.getLogger(__name__)


def _timed_all_reduce(buf: torch.Tensor, group: dist.ProcessGroup, iters: int) -> float:
    """Seconds per all-reduce on ``group``, as the slowest rank of the world saw it."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf, group=group)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def measure_mesh(
    shape: tuple[int, int],
    groups: Sequence[Sequence[int]] | None = None,
    *,
    nbytes: int = 1 << 22,
    iters: int = 5,
    repeats: int = 3,
) -> tuple[float, float]:
    """Measured algorithm bandwidths ``(B1, B2)`` in GB/s of ``DeviceMesh(shape)`` (inf: a size-1 axis).

    Collective over the default group, like :func:`mp_tensor.atp.mesh.create_mesh`.
    """
    mesh = create_mesh(shape, groups)
    try:
        buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32)
        if torch.cuda.is_available() and dist.get_backend() == "nccl":
            buf = buf.cuda()
        samples: list[list[float]] = [[], []]
        for axis in (0, 1):  # warm-up: connections, buffers
            if mesh.axis_size(axis) > 1:
                _timed_all_reduce(buf, mesh.group(axis), 1)
        for _ in range(repeats):
            for axis in (0, 1):
                if mesh.axis_size(axis) > 1:
                    samples[axis].append(_timed_all_reduce(buf, mesh.group(axis), iters))
        bws = tuple(
            buf.numel() * buf.element_size() / statistics.median(s) / 1e9 if s else math.inf for s in samples
        )
        log.info("mesh %s: B1 %.3g GB/s, B2 %.3g GB/s (%d bytes)", shape, bws[0], bws[1], nbytes)
        return bws[0], bws[1]
    finally:
        mesh.destroy()


def calibrate(
    matrix: CommMatrix | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    *,
    nbytes: int = 1 << 22,
    iters: int = 5,
    repeats: int = 3,
) -> CommMatrix:
    """``matrix`` with the measured ``(B1, B2)`` of every mesh of the tensor-parallel group recorded.

    Without a matrix, the result is a one-layer matrix of the group whose bandwidth is the bus bandwidth
    of the whole group's all-reduce (equation 4 inverted on the ``(N, 1)`` measurement). The group is
    ``groups``' first (default: the world). Collective over the default group.
    """
    size = len(groups[0]) if groups is not None else dist.get_world_size()
    if matrix is None and size < 2:
        raise CommMatrixError(
            f"cannot measure a matrix of {size} device; calibrate a group of 2 or more ranks."
        )
    measured = {
        shape: measure_mesh(shape, groups, nbytes=nbytes, iters=iters, repeats=repeats)
        for shape in mesh_shapes(size)
    }
    if matrix is None:
        bus = measured[(size, 1)][0] * 2 * (size - 1) / size
        matrix = fully_connected(size, bus, name=f"measured-{size}")
    for shape, (b1, b2) in measured.items():
        matrix = matrix.with_calibration(shape, b1, b2)
    return matrix
