"""Automatic and manual partitioning of any torch nn.Module tree into pipeline stages; usable standalone."""

__version__ = "0.1.0"
