"""Enumeration of the modules of a model: one entry per distinct module, with every path that reaches it."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

__all__ = ["ModuleEntry", "join_path", "walk_modules"]


def join_path(prefix: str, name: str) -> str:
    """The dotted path of child ``name`` under ``prefix`` (the root's path is ``""``)."""
    return f"{prefix}.{name}" if prefix else name


@dataclass(eq=False)
class ModuleEntry:
    """One distinct module of a model.

    ``path`` is its canonical path, the first one met in the pre-order that ``named_modules()`` uses;
    ``aliases`` holds every path that reaches it (the canonical one first). ``children`` are the indices
    of its distinct direct submodules, in registration order.
    """

    index: int
    module: nn.Module
    path: str
    aliases: list[str] = field(default_factory=list)
    children: list[int] = field(default_factory=list)


def walk_modules(model: nn.Module) -> list[ModuleEntry]:
    """Every distinct module of ``model`` in ``named_modules()`` order; entry 0 is ``model`` itself.

    A module registered under several parents (or several names) yields one entry whose ``aliases`` list
    all its paths. A module that contains itself (a cycle) is followed only once along any path.
    """
    entries: list[ModuleEntry] = []
    index_of: dict[int, int] = {}
    # Iterative pre-order: (module, path, ids of the modules on the path from the root, parent index).
    stack: list[tuple[nn.Module, str, frozenset[int], int | None]] = [(model, "", frozenset(), None)]
    while stack:
        module, path, ancestors, parent = stack.pop()
        key = id(module)
        known = index_of.get(key)
        if known is None:
            known = len(entries)
            index_of[key] = known
            entries.append(ModuleEntry(known, module, path))
        entry = entries[known]
        entry.aliases.append(path)
        if parent is not None and known not in entries[parent].children and known != parent:
            entries[parent].children.append(known)
        inner = ancestors | {key}
        pending = [
            (child, join_path(path, name), inner, known)
            for name, child in module._modules.items()
            if child is not None and id(child) not in inner
        ]
        stack.extend(reversed(pending))
    return entries
