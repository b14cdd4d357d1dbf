"""Exceptions raised by mp_comm.

Every user-facing error names the value it received, what was expected, and how to fix it.
"""

from __future__ import annotations

__all__ = ["MPCommError", "TopologyError", "WorldError"]


class MPCommError(Exception):
    """Base class of every error raised by mp_comm."""


class TopologyError(ValueError, MPCommError):
    """An impossible rank layout: bad world size, parallel degrees, placement strategy or ranks per node."""


class WorldError(RuntimeError, MPCommError):
    """The process world cannot be started: launcher variables, backend or an existing group disagree."""
