"""`import mp` is lazy: it loads no torch, each smp name is imported on first use and is the same object
as before (the names the package's TYPE_CHECKING block imports), and importing a submodule never hides the
smp name of the same spelling (smp.init the function, not the module mp.init)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Any

import mp as smp

INIT = Path(smp.__file__)


def _typing_block_names() -> dict[str, Any]:
    """Run the imports and assignments of mp/__init__.py's `if TYPE_CHECKING:` block for real."""
    tree = ast.parse(INIT.read_text())
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    )
    namespace: dict[str, Any] = {}
    exec(compile(ast.Module(body=block.body, type_ignores=[]), str(INIT), "exec"), namespace)
    return namespace


def test_every_smp_name_resolves_to_the_object_the_typing_block_names() -> None:
    expected = _typing_block_names()
    differ = [name for name in smp.__all__ if getattr(smp, name) is not expected[name]]
    assert not differ, f"smp names whose lazy value is not the typed import: {differ}"
    assert set(smp.__all__) <= set(dir(smp))


def test_submodules_are_attributes_and_an_unknown_name_is_an_attribute_error() -> None:
    assert smp.model.DistributedModel is smp.DistributedModel  # as transformers' isinstance checks write it
    assert smp.config_schema.__name__ == "mp.config_schema"
    try:
        smp.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("smp.no_such_name did not raise")


def _fresh(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_import_mp_and_mp_launch_load_no_torch() -> None:
    out = _fresh(
        "import sys, mp, mp.launch; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    assert out == "[]", f"`import mp, mp.launch` loaded torch modules: {out}"


def test_smp_init_installs_the_tp_context_and_submodules_do_not_hide_smp_names() -> None:
    # `import mp` used to install mp_tensor's context provider; now importing smp.init does (mp.init
    # imports mp.tensor_api). mp.init, mp.state, mp.step, mp.memory_report and mp.checkpoint are modules
    # and smp names at once: importing the module first must leave the smp name as it was.
    out = _fresh(
        "import mp.init\n"
        "from mp_tensor import context\n"
        "print(len(context._provider))\n"
        "import mp.state, mp.step, mp.memory_report, mp.checkpoint, mp.model\n"
        "import mp as smp\n"
        "names = ('init', 'state', 'step', 'memory_report', 'checkpoint')\n"
        "print(' '.join(type(getattr(smp, n)).__name__ for n in names))\n"
        "print(smp.checkpoint.__module__, smp.state.__class__.__module__)"
    )
    assert out.splitlines() == [
        "1",
        "function State function function function",
        "mp.activation_checkpointing mp.state",
    ], out
