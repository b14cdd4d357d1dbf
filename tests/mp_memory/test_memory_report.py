"""mp_memory.memory_report in one process: the activation tracker's live and peak bytes against the tensors
autograd keeps (in closed form), and tensor_bytes counting each tensor once."""

from __future__ import annotations

import torch
from torch import nn

from mp_memory.memory_report import ActivationTracker, MemoryReport, tensor_bytes


def test_tracker_counts_the_inputs_kept_and_frees_them_after_backward() -> None:
    torch.manual_seed(0)
    chain = nn.Sequential(nn.Linear(8, 32, bias=False), nn.Linear(32, 64, bias=False))
    tracker = ActivationTracker()
    x = torch.randn(4, 8)
    with tracker.hooks():
        loss = chain(x).sum()  # keeps x and the hidden 4 x 32 (the weights are parameters)
    assert tracker.live == tracker.peak == 4 * (8 + 32) * 4
    loss.backward()
    del loss
    assert tracker.live == 0 and tracker.peak == 4 * (8 + 32) * 4
    tracker.reset_peak()
    assert tracker.peak == 0


def test_a_storage_kept_twice_counts_once() -> None:
    tracker = ActivationTracker()
    a = torch.randn(16, requires_grad=True)
    with tracker.hooks():
        h = a * 2.0
        out = (h * h).sum() + (h[:8] * h[:8]).sum()  # h and a view of it, each kept twice
    assert tracker.live == 16 * 4
    out.backward()
    del out, h
    assert tracker.live == 0


def test_tensor_bytes_counts_each_tensor_once_and_meta_as_nothing() -> None:
    t = torch.zeros(10)
    assert tensor_bytes([t, t, torch.zeros(3, dtype=torch.float16), torch.empty(5, device="meta")]) == 46
    report = MemoryReport(rank=0, parameters=2**20, gradients=0, optimizer_state=0, peak_activations=None)
    assert report.format().startswith("rank 0 memory: parameters 1.00 MiB") and "n/a" in report.format()
