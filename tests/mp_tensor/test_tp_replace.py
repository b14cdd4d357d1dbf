"""Marking (``tensor_parallelism``, ``set_tensor_parallelism``), registration with hooks, and the
replacement conditions of seed 001 §5.2 with the log line that says why a module was left alone."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mp_tensor import nn as tnn
from mp_tensor import reference as ref
from mp_tensor.context import TPContext
from mp_tensor.enable import mark_of, set_tensor_parallelism, tensor_parallelism
from mp_tensor.errors import TPModuleRegisterError
from mp_tensor.grads import reduce_gradients
from mp_tensor.registry import Registry, tp_register, tp_register_with_module
from mp_tensor.replace import replace_modules
from mp_tensor.state_dict import gather_state_dict
from tests.mp_tensor._tp_util import SMALL, with_group


def test_context_manager_marks_created_modules_innermost_wins() -> None:
    with tensor_parallelism(fused_softmax=False):
        outer = nn.Linear(4, 4)
        with tensor_parallelism(enabled=False):
            inner = nn.Linear(4, 4)
            with tensor_parallelism(initializer_range=0.1):
                deepest = nn.Linear(4, 4)
        seq = nn.Sequential(nn.Linear(4, 4))
    after = nn.Linear(4, 4)
    assert mark_of(outer) is not None and mark_of(outer).enabled  # type: ignore[union-attr]
    assert not mark_of(inner).enabled  # type: ignore[union-attr]
    assert mark_of(deepest).enabled  # type: ignore[union-attr]
    assert dict(mark_of(deepest).kwargs) == {"fused_softmax": False, "initializer_range": 0.1}  # type: ignore[union-attr]
    assert mark_of(seq[0]).enabled  # type: ignore[union-attr]
    assert mark_of(after) is None
    assert nn.Module.__init__.__name__ == "__init__" and "marking" not in nn.Module.__init__.__qualname__


def test_set_tensor_parallelism_marks_the_subtree() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    set_tensor_parallelism(model, True)
    set_tensor_parallelism(model[1], False)
    assert mark_of(model[0]).enabled  # type: ignore[union-attr]
    assert all(not mark_of(m).enabled for m in model[1].modules())  # type: ignore[union-attr]


def test_tp_register_rejects_non_distributed_modules() -> None:
    with pytest.raises(TPModuleRegisterError, match="DistributedModule"):
        tp_register(nn.Linear)  # type: ignore[arg-type]
    with pytest.raises(TPModuleRegisterError, match="callable"):
        tp_register_with_module(nn.Linear, tnn.DistributedLinear, init_hook=3)  # type: ignore[arg-type]


# A user's transformer layer, functionally the reference TransformerLayer, with its own interface: built
# from a config object, called with (hidden, mask), returns the hidden states only. Its submodules follow
# the reference naming, so its weights copy over without translation.
class MyLayer(nn.Module):
    def __init__(self, config: Any, scale: float = 1.0) -> None:
        super().__init__()
        kw = {k: getattr(config, k) for k in SMALL}
        self.attention = ref.AttentionLayer(**kw, causal_mask_size=config.max_len)
        self.output = ref.TransformerOutputLayer(**kw)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.attention((hidden, mask)))  # type: ignore[no-any-return]


def _init_hook(config: Any, scale: float = 1.0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (), {**{k: getattr(config, k) for k in SMALL}, "causal_mask_size": config.max_len}


def _forward_hook(hidden: torch.Tensor, mask: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return ((hidden, mask),), {}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        cfg = SimpleNamespace(**SMALL, max_len=8)
        self.embed = nn.Embedding(30, 16)
        self.block = MyLayer(cfg)
        self.odd = nn.Linear(16, 15)  # in_features 16: distributable
        self.bad = nn.Linear(15, 16)  # in_features 15: not divisible by 2
        self.head = nn.Linear(16, 30, bias=False)
        self.head.weight = self.embed.weight  # tied: both stay undistributed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.block(self.embed(ids), torch.zeros(ids.shape[0], 1, 1, ids.shape[1]))
        return self.head(h + self.bad(self.odd(h)).relu())  # type: ignore[no-any-return]


def _registered_model(world: Any) -> dict[str, Any]:
    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        registry = Registry()
        from mp_tensor.builtin import register_builtins

        register_builtins(registry)
        tp_register_with_module(
            MyLayer,
            tnn.DistributedTransformerLayer,
            _init_hook,
            _forward_hook,
            lambda out: out[0],
            registry=registry,
        )
        torch.manual_seed(0)
        original = Net()
        torch.manual_seed(0)
        with tensor_parallelism():
            model = Net()
        records: list[str] = []
        handler = logging.Handler(logging.INFO)
        handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
        logger = logging.getLogger("mp_tensor.replace")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            model = replace_modules(model, TPContext(group=group), registry=registry)
        finally:
            logger.removeHandler(handler)
        kinds = {name: type(m).__name__ for name, m in model.named_children()}
        ids = torch.randint(0, 30, (2 * n, 5), generator=torch.Generator().manual_seed(1))
        w = torch.randn(2 * n, 5, 30, generator=torch.Generator().manual_seed(2))
        local = slice(2 * rank, 2 * rank + 2)
        ref_out = original(ids)
        (ref_out * w).sum().backward()
        out = model(ids[local])
        (out * w[local]).sum().backward()
        reduce_gradients(model.parameters(), dp_group=group, rdp_group=None, tp_size=n, average=False)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.grad)
        grads = gather_state_dict(model)
        grad_diff = max(
            (grads[k] - p.grad).abs().max().item()
            for k, p in original.named_parameters()
            if p.grad is not None
        )
        return {
            "kinds": kinds,
            "inner_untouched": type(model.block.attention.query).__name__,  # inside a replaced module
            "out": (out - ref_out[local]).abs().max().item(),
            "grads": grad_diff,
            "log": records,
        }

    return with_group(run)  # type: ignore[no-any-return]


def test_registered_user_module_and_skip_conditions(worlds: Any) -> None:
    res = worlds.run(2, _registered_model)[0]
    assert res["kinds"] == {
        "embed": "Embedding",
        "block": "DistributedTransformerLayer",
        "odd": "DistributedLinear",
        "bad": "Linear",
        "head": "Linear",
    }
    assert res["inner_untouched"] == "LinearShard"
    assert res["out"] < 2e-5 and res["grads"] < 2e-5
    log = "\n".join(res["log"])
    assert "not distributing embed (Embedding): its parameter 'weight' is shared with 'head'" in log
    assert "not distributing head (Linear): its parameter 'weight' is shared with 'embed'" in log
    assert (
        "not distributing bad (Linear): in_features=15 is not divisible by the tensor-parallel degree 2"
        in log
    )
    assert "block (MyLayer) -> DistributedTransformerLayer" in log


def test_module_created_before_registration_is_skipped_with_reason() -> None:
    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

    with tensor_parallelism():
        early = nn.Sequential(Late())
    registry = Registry()
    tp_register_with_module(Late, tnn.DistributedLinear, registry=registry)
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("mp_tensor.replace")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        replace_modules(early, TPContext(), registry=registry)
    finally:
        logger.removeHandler(handler)
    assert any("created before" in r for r in records), records


def test_decorator_registers_and_records_init_args() -> None:
    registry_before = len(Registry().entries())

    @tp_register(tnn.DistributedLinear, init_hook=lambda d: ((d, d), {}))
    class Square(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(d, d))
            self.bias = nn.Parameter(torch.randn(d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.t() + self.bias

    with tensor_parallelism():
        model = nn.Sequential(Square(4))
    x = torch.randn(3, 4)
    expected = model(x)
    replaced = replace_modules(model, TPContext())
    assert type(replaced[0]).__name__ == "DistributedLinear"
    torch.testing.assert_close(replaced(x), expected)
    assert registry_before == 0


def _replaced_dtypes(world: Any) -> dict[str, Any]:
    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for dtype in (torch.float64, torch.bfloat16):
            torch.manual_seed(0)
            with tensor_parallelism():
                original = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).to(dtype)
            full = {k: v.clone() for k, v in original.state_dict().items()}
            model = replace_modules(original, TPContext(group=group))
            gathered = gather_state_dict(model)
            out[str(dtype)] = {
                "kinds": [type(m).__name__ for m in model],
                "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                "exact": all(torch.equal(gathered[k], v) for k, v in full.items()),
            }
        with tensor_parallelism():
            plain = nn.Sequential(nn.Linear(8, 8))
        fp16 = replace_modules(plain, TPContext(group=group, dtype=torch.float16))
        out["fp16_params"] = sorted({str(p.dtype) for p in fp16.parameters()})
        out["default_after"] = str(torch.get_default_dtype())
        return out

    return with_group(run)  # type: ignore[no-any-return]


def test_replaced_modules_keep_the_original_dtype(worlds: Any) -> None:
    """A model built in float64 or bfloat16 gets distributed modules in that dtype, holding exactly the
    original's values (they are created in it, not cast after the copy); fp16_params still wins."""
    for res in worlds.run(2, _replaced_dtypes):
        for dtype in ("torch.float64", "torch.bfloat16"):
            assert res[dtype]["kinds"] == ["DistributedLinear", "ReLU", "DistributedLinear"], res
            assert res[dtype]["dtypes"] == [dtype] and res[dtype]["exact"], res
        assert res["fp16_params"] == ["torch.float16"] and res["default_after"] == "torch.float32", res
