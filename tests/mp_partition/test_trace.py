"""Tracing: order, calls, activation bytes, times, devices, side effects."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from mp_partition import Tracer, TraceResult, TracingError, is_tracing, trace_model

from .models import Stack


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(self.a(x)))


def test_calls_order_and_execution_order() -> None:
    trace = trace_model(Twice(), (torch.randn(2, 8),))
    assert trace.stats("a").calls == 2 and trace.stats("b").calls == 1
    assert trace.stats("").first_call == 0
    assert trace.stats("a").first_call == 1 and trace.stats("b").first_call == 2
    assert trace.execution_order[""] == ("a", "b")
    assert trace.device == "cpu" and not trace.measured_time


def test_activation_bytes_count_saved_tensors_not_parameters() -> None:
    model = nn.Sequential(nn.Linear(1000, 1000), nn.ReLU(), nn.Linear(1000, 10))
    trace = trace_model(model, (torch.randn(1, 1000),))
    assert trace.grad_recorded
    # Linear saves its input (4000 bytes), never its 4 MB weight; ReLU saves its output, which the second
    # Linear saves again: counted once.
    assert trace.activation_bytes("0") == 4000
    assert trace.activation_bytes("1") == 4000
    assert trace.activation_bytes("2") == 0
    assert trace.stats("2").output_bytes == 40


def test_without_autograd_outputs_stand_in() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    model.requires_grad_(False)
    trace = trace_model(model, (torch.randn(3, 4),))
    assert not trace.grad_recorded
    assert trace.activation_bytes("0") == 3 * 4 * 4


def test_measured_times_on_cpu() -> None:
    trace = trace_model(Stack(layers=4), (torch.randn(8, 16),), measure_time=True)
    assert trace.measured_time
    root = trace.stats("")
    assert root.forward_time_s is not None and root.forward_time_s > 0
    for path, s in trace.modules.items():
        assert s.self_time_s is not None and s.forward_time_s is not None
        assert 0 <= s.self_time_s <= s.forward_time_s + 1e-9, path
    children = sum(trace.stats(f"layers.{i}").forward_time_s or 0.0 for i in range(4))
    assert children <= root.forward_time_s + 1e-6


def test_meta_device_allocates_nothing_and_measures_no_time() -> None:
    with torch.device("meta"):
        model = Stack(layers=3, width=4096)
    trace = trace_model(model, (torch.empty(4, 4096, device="meta"),), measure_time=True)
    assert trace.device == "meta" and not trace.measured_time
    assert trace.stats("layers.0.up").calls == 1
    assert trace.activation_bytes("layers.0.up") > 0


def test_state_is_restored() -> None:
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Dropout(0.5))
    model.train()
    before = model[0].running_mean.clone()
    batch = torch.randn(6, 4) + 5
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    trace_model(model, (batch,))
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(model[0].running_mean, before)
    assert int(model[0].num_batches_tracked) == 0
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks


def test_is_tracing_and_errors_clean_up() -> None:
    seen: list[bool] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(is_tracing())
            if x.shape[0] == 0:
                raise RuntimeError("boom")
            return x * 2

    model = nn.Sequential(Probe())
    trace_model(model, (torch.randn(2, 2),))
    assert seen == [True] and not is_tracing()
    with pytest.raises(RuntimeError, match="boom"):
        trace_model(model, (torch.randn(0, 2),))
    assert not is_tracing()
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks


def test_tracer_context_and_backward_is_refused() -> None:
    model = nn.Linear(3, 3)
    with Tracer(model) as tracer:
        out = model(torch.randn(2, 3))
        with pytest.raises(TracingError, match="backward"):
            out.sum().backward()
    result = tracer.result()
    assert result.stats("").calls == 1
    with pytest.raises(TracingError):
        tracer.__enter__()


def test_other_threads_are_not_recorded() -> None:
    model = Twice()
    with Tracer(model) as tracer:
        worker = threading.Thread(target=lambda: model(torch.randn(1, 8)))
        worker.start()
        worker.join()
    assert tracer.result().stats("a").calls == 0


def test_trace_result_json_round_trip() -> None:
    trace = trace_model(Twice(), (torch.randn(2, 8),), measure_time=True)
    again = TraceResult.from_dict(trace.to_dict())
    assert again.to_dict() == trace.to_dict()


def test_rejects_non_modules() -> None:
    with pytest.raises(TracingError, match=r"expected a torch\.nn\.Module"):
        trace_model(lambda x: x)  # type: ignore[arg-type]
