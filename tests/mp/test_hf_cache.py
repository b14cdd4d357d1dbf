"""mp.hf_cache.KvCacheSwitch without processes: the model's modules are walked once to find its HF
configs, not at every step, and walked again only after the model changed.

(tests/integration/test_hf_cache.py checks the switch in pipelined training at pp=2.)
"""

from __future__ import annotations

from typing import Any

import pytest

from mp.hf_cache import KvCacheSwitch

transformers = pytest.importorskip("transformers")


def _gpt2(layers: int = 2) -> Any:
    config = transformers.GPT2Config(n_layer=layers, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    return transformers.GPT2LMHeadModel(config)


def _inside(switch: KvCacheSwitch, *configs: Any) -> list[bool]:
    """use_cache of each config inside one step."""
    with switch.step():
        return [bool(c.use_cache) for c in configs]


def test_configs_are_found_by_one_walk_across_steps() -> None:
    net = _gpt2()
    switch = KvCacheSwitch(net, pipeline_parallel_degree=2)
    assert switch.walks == 0  # nothing is walked before the first step
    for _ in range(5):
        assert _inside(switch, net.config) == [False]
        assert net.config.use_cache is True  # the user's value, back after each step
    assert switch.walks == 1


def test_a_changed_model_is_walked_again() -> None:
    """A submodule added after the first step (here a second HF model with a config of its own) is found
    at the next step; a config set by the user between steps is read at each step without a walk."""
    net = _gpt2()
    switch = KvCacheSwitch(net, pipeline_parallel_degree=2)
    _inside(switch, net.config)
    net.config.use_cache = False  # the user's choice: left alone, and not turned back on
    assert _inside(switch, net.config) == [False] and net.config.use_cache is False
    net.config.use_cache = True
    assert switch.walks == 1
    net.draft = _gpt2(layers=1)  # registered as a submodule: the next step walks again
    assert _inside(switch, net.config, net.draft.config) == [False, False]
    assert net.draft.config.use_cache is True
    assert switch.walks == 2
    _inside(switch, net.config)
    assert switch.walks == 2


def test_evaluation_and_pp1_steps_keep_the_cache_and_walk_nothing() -> None:
    net = _gpt2()
    assert _inside(KvCacheSwitch(net, pipeline_parallel_degree=1), net.config) == [True]
    switch = KvCacheSwitch(net.eval(), pipeline_parallel_degree=2)
    assert _inside(switch, net.config) == [True]
    assert switch.walks == 0


def test_a_dropped_switch_leaves_no_hook_behind() -> None:
    """The registration hook holds the switch weakly and goes with it."""
    import gc

    from torch.nn.modules import module as torch_module

    hooks = torch_module._global_module_registration_hooks
    before = len(hooks)
    switch = KvCacheSwitch(_gpt2(), pipeline_parallel_degree=2)
    _inside(switch)
    assert len(hooks) == before + 1
    del switch
    gc.collect()
    assert len(hooks) == before
