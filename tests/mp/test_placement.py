"""The first step refuses a model left on the CPU with a batch on CUDA (smp moved the model; mp does not).

The check runs on every first step; CUDA inputs only exist on a GPU machine, so here its rule is tested
directly on device types.
"""

from __future__ import annotations

from mp.model import _placement_error


def test_a_cpu_model_with_a_cuda_batch_is_refused_with_the_fix() -> None:
    message = _placement_error({"cpu"}, {"cuda", "cpu"})
    assert message is not None
    assert "every parameter of the model is on the CPU" in message
    assert "model.to(torch.device('cuda', smp.local_rank()))" in message


def test_models_already_placed_or_trained_on_the_cpu_pass() -> None:
    assert _placement_error({"cuda"}, {"cuda"}) is None  # moved before wrapping
    assert _placement_error({"cpu"}, {"cpu"}) is None  # CPU training
    assert _placement_error({"cpu", "cuda"}, {"cuda"}) is None  # placed by hand, partly: the user's call
    assert _placement_error({"cpu"}, set()) is None  # no tensor inputs
