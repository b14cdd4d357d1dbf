"""HF models' key/value cache, off in pipelined training steps.

With ``config.use_cache`` (HF's default), a transformers 5 decoder builds a cache object and hands it
to every block, which appends its keys and values. Under pipeline parallelism every block called on
another rank would carry that object, with every earlier layer's keys and values, in its request, and
the cache the parent returns would miss the layers that ran elsewhere. A training step never reads it
(it serves generation), so mp turns it off for the steps of a model in training mode, as HF's own
gradient checkpointing does, and restores the configs afterwards. Evaluation steps and calls outside
steps keep the user's setting; an explicit ``use_cache=True`` argument still wins.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

from torch import nn

log = logging.getLogger("mp")


@contextlib.contextmanager
def training_without_kv_cache(module: nn.Module, pipeline_parallel_degree: int) -> Iterator[None]:
    """Within the block, every HF config of `module` that asks for a cache does not, where `module`
    trains under pipeline parallelism."""
    if pipeline_parallel_degree <= 1 or not module.training:
        yield
        return
    configs: dict[int, Any] = {}
    for m in module.modules():
        config = getattr(m, "config", None)
        if getattr(config, "use_cache", False):
            configs[id(config)] = config
    if not configs:
        yield
        return
    _tell()
    for config in configs.values():
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs.values():
            config.use_cache = True


@functools.cache
def _tell() -> None:
    log.info(
        "mp: use_cache is off in the training steps of this HF model under pipeline parallelism (a cache "
        "of every layer's keys and values would travel with each call to another rank, and a training "
        "step never reads it)"
    )
