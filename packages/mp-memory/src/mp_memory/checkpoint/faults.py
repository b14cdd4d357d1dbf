"""A fault-injection hook for the crash tests: ``MP_CHECKPOINT_FAULT="<point>:<rank>"`` makes that global
rank exit at once (``os._exit``, like ``kill -9``: no cleanup, no ``finally``) when a save reaches that
point. Points: ``part-half`` (half of a part written), ``part-written`` (a part written, before the ranks
agree), ``agreed`` (after agreeing, before publishing), ``published`` (parts published, before
``newest``), ``newest`` (after ``newest``, before old checkpoints are pruned)."""

from __future__ import annotations

import logging
import os

__all__ = ["POINTS", "fault_point"]

log = logging.getLogger(__name__)

POINTS = ("part-half", "part-written", "agreed", "published", "newest")
_ENV = "MP_CHECKPOINT_FAULT"


def fault_point(point: str, rank: int) -> None:
    """Exit this process now if the environment asks for a fault at ``point`` on ``rank``."""
    assert point in POINTS, point
    if os.environ.get(_ENV) == f"{point}:{rank}":
        log.error("%s=%s: rank %d exits at %s", _ENV, os.environ[_ENV], rank, point)
        os._exit(137)
