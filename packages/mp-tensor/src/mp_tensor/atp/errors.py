"""Exceptions raised by ATP (mp_tensor.atp).

Every user-facing error names the value it received, what was expected, and how to fix it.
"""

from __future__ import annotations

__all__ = ["ATPError", "CommMatrixError", "MeshError", "SearchError", "ShardingError"]


class ATPError(Exception):
    """Base class of every error raised by mp_tensor.atp."""


class MeshError(ValueError, ATPError):
    """A device mesh that cannot be built: a shape that does not multiply to the group size, no mesh set."""


class ShardingError(ValueError, ATPError):
    """A sharding spec that does not fit: wrong length, a dim out of range, a size the mesh cannot divide."""


class CommMatrixError(ValueError, ATPError):
    """A hierarchical communication matrix that is malformed: bad shapes, negative bandwidths, bad JSON."""


class SearchError(ValueError, ATPError):
    """A mesh search that cannot run: a device count the matrix cannot hold, a bad model shape."""
