"""Every module of real architectures gets a partition; tied weights stay together.

RoBERTa and BERT (HuggingFace, built from configs), a CNN, and a model with a reused module and a
data-dependent branch, each traced on real example inputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mp_partition import auto_partition

transformers = pytest.importorskip("transformers")


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            *[
                nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())
                for c_in, c_out in [(3, 8), (8, 16), (16, 16), (16, 32), (32, 32), (32, 32)]
            ]
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.features(x)).flatten(1))


class ReuseAndBranch(nn.Module):
    """`shared` runs twice per forward; `rare` runs only when the batch mean is positive."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)
        self.mid = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.rare = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(torch.relu(self.inp(x)))
        h = self.shared(self.mid(h))
        if h.mean() > 1e9:  # never true here: `rare` is not executed in the trace
            h = self.rare(h)
        return self.out(h)


def _check_every_module_placed(model: nn.Module, plan: object, pp: int) -> set[int]:
    owners = set()
    for name, _ in model.named_modules():
        owner = plan.owner(name)  # type: ignore[attr-defined]
        assert 0 <= owner < pp, (name, owner)
        owners.add(owner)
    for name, _ in model.named_parameters():
        assert 0 <= plan.owner_of_parameter(name) < pp  # type: ignore[attr-defined]
    return owners


def test_roberta_and_bert_every_module_placed_and_tied_weights_together() -> None:
    for config_cls, model_cls in (
        (transformers.RobertaConfig, transformers.RobertaForMaskedLM),
        (transformers.BertConfig, transformers.BertForMaskedLM),
    ):
        config = config_cls(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=6,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
        )
        torch.manual_seed(0)
        model = model_cls(config)
        ids = torch.randint(0, 128, (2, 16))
        plan = auto_partition(model, 4, example_args=(ids,), memory_weight=0.5)
        owners = _check_every_module_placed(model, plan, 4)
        assert owners == {0, 1, 2, 3}
        base = "roberta" if "Roberta" in model_cls.__name__ else "bert"
        # the MLM decoder shares its weight with the word embeddings: same partition
        assert plan.owner(f"{base}.embeddings.word_embeddings") == plan.owner(
            "lm_head.decoder" if base == "roberta" else "cls.predictions.decoder"
        )


def test_cnn_every_module_placed_and_balanced() -> None:
    model = ConvNet()
    plan = auto_partition(model, 2, example_args=(torch.randn(2, 3, 16, 16),), memory_weight=0.5)
    assert _check_every_module_placed(model, plan, 2) == {0, 1}
    # a conv block never straddles two partitions
    for i in range(6):
        block = f"features.{i}"
        assert {plan.owner(f"{block}.{j}") for j in range(3)} == {plan.owner(block)}


def test_reused_module_and_untaken_branch_are_placed() -> None:
    model = ReuseAndBranch()
    plan = auto_partition(model, 2, example_args=(torch.randn(4, 8),))
    _check_every_module_placed(model, plan, 2)
    assert plan.owner("rare") in (0, 1)
