"""Sphinx configuration for the mp documentation (`nox -s docs`)."""

from typing import Any

project = "mp"
author = "mp developers"
extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
html_theme = "alabaster"
suppress_warnings = ["myst.xref_missing"]
autodoc_typehints = "description"
autodoc_member_order = "bysource"

COMPAT_MARKER = "<!-- compat-table -->"


def _insert_compat_table(app: Any, docname: str, source: list[str]) -> None:
    """Render mp.compat's registry where a page holds the marker, so the table follows the code."""
    if COMPAT_MARKER in source[0]:
        from mp.compat import render_markdown

        source[0] = source[0].replace(COMPAT_MARKER, render_markdown())


def setup(app: Any) -> None:
    app.connect("source-read", _insert_compat_table)
