"""Sphinx configuration for the mp documentation (`nox -s docs`)."""

from typing import Any

project = "mp"
author = "mp developers"
extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
html_theme = "alabaster"
autodoc_typehints = "description"
autodoc_member_order = "bysource"

COMPAT_MARKER = "<!-- compat-table -->"


def _insert_compat_table(app: Any, docname: str, source: list[str]) -> None:
    """Render mp.compat's registry where a page holds the marker, so the table follows the code."""
    if COMPAT_MARKER in source[0]:
        from mp.compat import render_markdown

        source[0] = source[0].replace(COMPAT_MARKER, render_markdown())


API_MARKER = "<!-- api-rest -->"
ERRORS_MARKER = "<!-- api-errors -->"


def _insert_other_names(app: Any, docname: str, source: list[str]) -> None:
    """Document the exceptions of ``mp.__all__``, and every other name of it the API page does not
    already, so the page never falls behind the code."""
    if API_MARKER not in source[0]:
        return
    import inspect

    import mp

    errors, rest = [], []
    for name in mp.__all__:
        obj = getattr(mp, name)
        if f"mp.{name}\n" in source[0] or inspect.ismodule(obj):
            continue  # documented above; submodules have sections of their own
        if isinstance(obj, type) and issubclass(obj, BaseException):
            errors += [f".. autoexception:: mp.{name}", "   :show-inheritance:"]
        elif isinstance(obj, type):
            rest.append(f".. autoclass:: mp.{name}")
        elif callable(obj):
            rest.append(f".. autofunction:: mp.{name}")
        # constants (the CommGroup members) are described in the text

    def block(lines: list[str]) -> str:
        return "\n".join(["```{eval-rst}", *lines, "```"]) if lines else "None."

    source[0] = source[0].replace(ERRORS_MARKER, block(errors)).replace(API_MARKER, block(rest))


def setup(app: Any) -> None:
    app.connect("source-read", _insert_compat_table)
    app.connect("source-read", _insert_other_names)
