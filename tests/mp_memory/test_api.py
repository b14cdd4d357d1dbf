"""mp_memory's public API is its root: ``__all__`` comes from one table (module -> names), every name
resolves to what its module holds, and the TYPE_CHECKING block (what type checkers read) imports exactly
the table's names, each from the module the table says."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import mp_memory


def _type_checking_imports() -> set[tuple[str, str]]:
    tree = ast.parse(Path(mp_memory.__file__).read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    found = set()
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None, ast.unparse(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name}: import it 'as {alias.name}' (explicit export)"
            found.add((node.module, alias.name))
    return found


def test_the_root_lists_each_name_once_and_types_see_the_same_names() -> None:
    table = {(module, name) for module, names in mp_memory._SOURCES.items() for name in names}
    assert len(mp_memory.__all__) == len(set(mp_memory.__all__)) == len(table)
    assert _type_checking_imports() == table


def test_every_name_resolves_lazily_to_its_module_object() -> None:
    for module, names in mp_memory._SOURCES.items():
        for name in names:
            assert getattr(mp_memory, name) is getattr(importlib.import_module(module), name), name
