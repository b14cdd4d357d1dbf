"""HF models' key/value cache, off in pipelined training steps.

With ``config.use_cache`` (HF's default), a transformers 5 decoder builds a cache object and hands it
to every block, which appends its keys and values. Under pipeline parallelism every block called on
another rank would carry that object, with every earlier layer's keys and values, in its request, and
the cache the parent returns would miss the layers that ran elsewhere. A training step never reads it
(it serves generation), so mp turns it off for the steps of a model in training mode, as HF's own
gradient checkpointing does, and restores the configs afterwards. Evaluation steps and calls outside
steps keep the user's setting; an explicit ``use_cache=True`` argument still wins.

The modules that hold a config are found by one walk over the model's modules, on its first pipelined
training step, and kept by the model (:class:`KvCacheSwitch`, one per DistributedModel); each step only
reads those modules' ``config``. A module registered anywhere since (torch's global module-registration
hook: a submodule assigned or added) makes the next step walk the model again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook
from torch.utils.hooks import RemovableHandle

log = logging.getLogger("mp")

__all__ = ["KvCacheSwitch"]


class KvCacheSwitch:
    """Turns ``use_cache`` off on the HF configs of ``module`` for each step in which it trains under
    pipeline parallelism (``pipeline_parallel_degree`` > 1), and back on afterwards."""

    def __init__(self, module: nn.Module, pipeline_parallel_degree: int) -> None:
        self._module = module
        self._pipelined = pipeline_parallel_degree > 1
        self._holders: list[nn.Module] | None = None  # the modules with a config; None: walk again
        self._watch: RemovableHandle | None = None  # the registration hook, while this switch lives
        self.walks = 0
        """How many times the model's modules were walked to find its configs: once, unless a module
        was registered since the last walk."""

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Within the block, every HF config of the model that asks for a cache does not, where the
        model trains under pipeline parallelism."""
        if not self._pipelined or not self._module.training:
            yield
            return
        configs: dict[int, Any] = {}
        for holder in self._find_holders():
            config = getattr(holder, "config", None)
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

    def forget(self) -> None:
        """Walk the model's modules again at the next step (a module was registered somewhere)."""
        self._holders = None

    def _find_holders(self) -> list[nn.Module]:
        if self._holders is None:
            if self._watch is None:
                hook = _forgetting(weakref.WeakMethod(self.forget))
                self._watch = register_module_module_registration_hook(hook)
                weakref.finalize(self, self._watch.remove)
            self.walks += 1
            self._holders = [m for m in self._module.modules() if getattr(m, "config", None) is not None]
        return self._holders


def _forgetting(
    forget: weakref.WeakMethod[Callable[[], None]],
) -> Callable[[nn.Module, str, nn.Module | None], None]:
    """torch's registration hook that calls ``forget`` while its switch lives (the hook must not keep
    the switch, and with it the model, alive)."""

    def hook(_parent: nn.Module, _name: str, _child: nn.Module | None) -> None:
        method = forget()
        if method is not None:
            method()

    return hook


@functools.cache
def _tell() -> None:
    log.info(
        "mp: use_cache is off in the training steps of this HF model under pipeline parallelism (a cache "
        "of every layer's keys and values would travel with each call to another rank, and a training "
        "step never reads it)"
    )
