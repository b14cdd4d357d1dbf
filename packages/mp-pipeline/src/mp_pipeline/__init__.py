"""Module servers, remote autograd across ranks, pipeline schedules and microbatching for mp."""

__version__ = "0.1.0"
