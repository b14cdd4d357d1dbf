"""No module under tests/ imports a test module: what tests share lives in helper modules whose names do
not start with ``test_`` (tests/integration/_sdp.py, tests/mp_comm/_payloads.py, ...), so that running or
changing one test module never runs or breaks another. Code that a test passes to a fresh interpreter as
text counts too."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# a dotted module whose last part is a test module: tests.x.test_y, .test_y, test_y
_TEST_MODULE = re.compile(r"(^|\.)test_\w+$")
# the same inside source text (scripts written to files or passed to `python -c`)
_IN_TEXT = re.compile(r"\bfrom\s+[\w.]*\btest_\w+\s+import\b|^\s*import\s+[\w.]*\btest_\w+", re.MULTILINE)


def imports_of_test_modules(path: Path) -> list[str]:
    """Where ``path`` imports a test module, as 'line: module'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names = [base] if _TEST_MODULE.search(base) else []
            names += [f"{base}.{a.name}" for a in node.names if a.name.startswith("test_")]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if _TEST_MODULE.search(a.name)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [m.group(0).strip() for m in _IN_TEXT.finditer(node.value)]
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names]
    return found


def test_no_module_under_tests_imports_a_test_module() -> None:
    offenders = [
        f"{path.relative_to(TESTS.parent)}:{hit}"
        for path in sorted(TESTS.rglob("*.py"))
        for hit in imports_of_test_modules(path)
    ]
    assert not offenders, (
        "these import a test module; move what they share into a helper module (a name without the "
        "test_ prefix, e.g. tests/integration/_sdp.py) and import it from there:\n" + "\n".join(offenders)
    )


def test_the_check_finds_each_form(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    lines = [  # T_ stands for the prefix, so that this module does not hold the forms itself
        "from tests.integration.T_tp_model import x",
        "from .T_algorithm import y",
        "from . import T_message",
        "import tests.mp_comm.T_router",
        "CODE = 'from tests.mp_pipeline.T_timeline import two_rank_trace'",
        "from tests.integration._sdp import config",
        "from tests.mp_tensor._tp_util import with_group",
    ]
    sample.write_text("\n".join(lines).replace("T_", "test_") + "\n")
    hits = imports_of_test_modules(sample)
    assert [h.split(":")[0] for h in hits] == ["1", "2", "3", "4", "5"], hits
