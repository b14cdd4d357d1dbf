"""The variants of benchmarks/pipeline_vs_torch.py: what is timed (:class:`Spec`, :func:`make_specs`),
shared by the runners that train them (_pipeline_runners.py) and the report (_pipeline_report.py)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ACTIVE_PLUS3", "BOTH_RANKS", "STAGES", "Spec", "make_specs", "mp_schedules"]

STAGES = 2
"""Pipeline stages (ranks) of the benchmark."""

ACTIVE_PLUS3 = "interleaved active 5"
"""The mp session with the interleaved schedule and ``active_microbatches`` = pp + 3 instead of smp's
default pp + 2 (run at m = 8; not one of the default-config pairs)."""

BOTH_RANKS = "accumulate, both ranks"
"""The single-process control run on both ranks at once (each its own copy, no communication): how much
two processes computing at the same time slow each other down on this host."""


@dataclass(frozen=True)
class Spec:
    """One variant of the benchmark: a system, its schedule and the microbatch count."""

    system: str
    """single, mp or torch."""
    schedule: str
    """single: full batch / accumulate; mp: simple / interleaved; torch: GPipe / 1F1B."""
    m: int
    """Microbatches."""
    threads: int = 1
    """torch threads (single process only)."""

    @property
    def key(self) -> str:
        return f"{self.system}/{self.schedule}/m{self.m}/t{self.threads}"


def mp_schedules(m: int) -> tuple[str, ...]:
    """The mp sessions run at ``m`` microbatches."""
    base = ("simple", "interleaved", "simple static", "interleaved static")
    return (*base, ACTIVE_PLUS3) if m > 5 else base  # where m leaves room for 5 in flight


def make_specs(micro: list[int]) -> list[Spec]:
    """Every variant the benchmark times, in the order of its table."""
    out = [Spec("single", "full batch", 1, 1), Spec("single", "full batch", 1, 2)]
    for m in micro:
        out += [
            Spec("single", "accumulate", m),
            Spec("single", BOTH_RANKS, m),
            *(Spec("mp", s, m) for s in mp_schedules(m)),
            Spec("torch", "GPipe", m),
            Spec("torch", "1F1B", m),
        ]
    return out
