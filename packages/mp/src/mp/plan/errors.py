"""Errors of the planner (``mp.plan``): each names the value received, what was expected and the fix."""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """An input of ``mp.plan`` / ``mp-plan`` cannot be planned for (model, cluster, batch or layout)."""
