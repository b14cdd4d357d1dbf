"""ModuleNode tree construction: shared parameters, reused modules, execution order."""

from __future__ import annotations

import torch
from torch import nn

from mp_partition import build_module_tree, trace_model
from mp_partition._walk import walk_modules

from .models import Stack, TiedLM


def by_path(root):  # type: ignore[no-untyped-def]
    return {p: n for n in root.walk() for p in n.paths}


def test_one_node_per_module_following_the_hierarchy() -> None:
    model = Stack(layers=3)
    root = build_module_tree(model)
    nodes = list(root.walk())
    assert len(nodes) == len(list(model.modules()))
    assert all(len(n.modules) == 1 for n in nodes)
    index = by_path(root)
    assert index["layers.1.up"].parent is index["layers.1"]
    assert [c.path for c in index["layers"].children] == ["layers.0", "layers.1", "layers.2"]
    assert root.path == "" and root.parent is None
    assert [n.index for n in nodes] == list(range(len(nodes)))


def test_tied_modules_form_one_node_at_the_shallowest_parent() -> None:
    model = TiedLM()
    root = build_module_tree(model)
    index = by_path(root)
    tied = index["embed"]
    assert tied is index["head.1"]
    assert set(tied.paths) == {"embed", "head.1"}
    assert tied.parent is root  # `embed` sits under the root, `head.1` one level deeper
    assert tied not in index["head"].children
    assert tied.num_parameters == model.embed.weight.numel()  # the shared weight counts once
    total = sum(n.num_parameters for n in root.walk())
    assert total == sum(p.numel() for p in model.parameters())


def test_module_reused_under_two_parents_is_attached_once() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Module()
    model.a = nn.Sequential(nn.ReLU(), shared)
    model.b = nn.Sequential(shared, nn.Tanh())
    entries = walk_modules(model)
    entry = next(e for e in entries if e.module is shared)
    assert entry.path == "a.1" and entry.aliases == ["a.1", "b.0"]
    root = build_module_tree(model)
    index = by_path(root)
    node = index["a.1"]
    assert node.aliases == ("a.1", "b.0")
    assert node.parent is index["a"]
    assert [c.path for c in index["b"].children] == ["b.1"]
    assert sum(1 for n in root.walk() if shared in n.modules) == 1


def test_parent_and_child_sharing_a_parameter_merge() -> None:
    model = nn.Module()
    model.inner = nn.Linear(3, 3)
    model.alias = model.inner.weight  # the root itself holds the child's weight
    root = build_module_tree(model)
    assert set(root.paths) == {"", "inner"}
    assert root.children == []


def test_cycle_in_module_graph_terminates() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    model.add_module("again", model)
    entries = walk_modules(model)
    assert [e.path for e in entries] == ["", "0"]
    assert len(list(build_module_tree(model).walk())) == 2


class Reversed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 4)
        self.container = nn.ModuleList([nn.Linear(4, 4)])
        self.never = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(self.container[0](self.second(x)))


def test_children_follow_execution_order_and_unexecuted_come_last() -> None:
    model = Reversed()
    trace = trace_model(model, (torch.randn(2, 4),))
    root = build_module_tree(model, trace)
    # `container` never runs itself, but its child does: the subtree's first call orders it.
    assert [c.path for c in root.children] == ["second", "container", "first", "never"]
    assert by_path(root)["never"].calls == 0
    untraced = build_module_tree(model)
    assert [c.path for c in untraced.children] == ["first", "second", "container", "never"]
