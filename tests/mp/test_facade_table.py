"""The smp facade's names live in one table, ``mp._SOURCES``: ``mp.__all__`` and the lazy lookup come from
it at run time, and the block that type checkers read (``if TYPE_CHECKING:`` in mp/__init__.py) is
generated from it. This test fails when that block is stale; ``python tests/mp/test_facade_table.py``
rewrites it. It also checks that every name of the table resolves to what its module holds."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

INIT = Path(__file__).resolve().parents[2] / "packages" / "mp" / "src" / "mp" / "__init__.py"
BEGIN = "if TYPE_CHECKING:  # generated from _SOURCES by tests/mp/test_facade_table.py: do not edit\n"
END = "\n__version__"


def render(sources: dict[str, str]) -> str:
    """The ``if TYPE_CHECKING:`` block for ``sources`` (module -> "name" / "name=attr" entries)."""
    imports: list[str] = []
    aliases: list[str] = []
    for module, names in sources.items():
        for entry in names.split():
            name, eq, attr = entry.partition("=")
            if eq and not attr:  # the module itself (smp.amp is mp.amp)
                parent, _, leaf = module.rpartition(".")
                imports.append(f"    from {parent} import {leaf} as {name}")
            elif eq:  # an attribute of one of the module's names (smp.WORLD is CommGroup.WORLD)
                aliases.append(f"    {name} = {attr}")
            elif name == "checkpoint" and module != "mp.checkpoint":
                # smp.checkpoint is a function, mp.checkpoint a module: mypy keeps the module's name
                imports.append(f"    from {module} import checkpoint as _checkpoint_call")
                aliases.append("    checkpoint = _checkpoint_call")
            else:
                imports.append(f"    from {module} import {name} as {name}")
    return BEGIN + "\n".join(imports) + "\n\n" + "\n".join(aliases) + "\n"


def _current() -> tuple[str, str, str]:
    text = INIT.read_text(encoding="utf-8")
    start = text.index(BEGIN)
    end = text.index(END, start)
    return text[:start], text[start:end], text[end:]


def test_the_type_checking_block_is_generated_from_the_table() -> None:
    import mp

    _, block, _ = _current()
    assert block.rstrip() == render(mp._SOURCES).rstrip(), (
        "mp/__init__.py's TYPE_CHECKING block is stale: run python tests/mp/test_facade_table.py"
    )


def test_all_is_the_table_and_every_name_resolves() -> None:
    import mp

    names = [e.partition("=")[0] for entries in mp._SOURCES.values() for e in entries.split()]
    assert len(names) == len(set(names)), "a name is in two modules' entries"
    assert sorted(mp.__all__) == sorted(names)
    for module, entries in mp._SOURCES.items():
        for entry in entries.split():
            name, eq, attr = entry.partition("=")
            want: object = importlib.import_module(module)
            for part in (attr if eq else name).split(".") if (attr or not eq) else ():
                want = getattr(want, part)
            assert getattr(mp, name) is want, name


if __name__ == "__main__":
    sys.path.insert(0, str(INIT.parents[1]))
    import mp

    head, _, tail = _current()
    INIT.write_text(head + render(mp._SOURCES) + tail, encoding="utf-8")
    print(f"rewrote the TYPE_CHECKING block of {INIT}")
