"""Sphinx configuration for the mp documentation (`nox -s docs`)."""

project = "mp"
author = "mp developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
html_theme = "alabaster"
suppress_warnings = ["myst.xref_missing"]
