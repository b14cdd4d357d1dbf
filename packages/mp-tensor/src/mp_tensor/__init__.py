"""Tensor parallelism for mp: distributed modules (smp.nn), the replacement registry, and ATP 2-D device meshes."""

__version__ = "0.1.0"
