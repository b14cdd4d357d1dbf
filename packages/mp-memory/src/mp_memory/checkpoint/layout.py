"""Where a rank sits in the layout, and the file names smp's versions gave each rank's part."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from mp_memory.checkpoint.publish import TMP_MARK

__all__ = ["Layout", "find_parts", "manifest_path", "part_name"]


@dataclass(frozen=True)
class Layout:
    """This rank's coordinates and the degrees of the job (a single process: all zeros and ones)."""

    rank: int = 0
    pp_rank: int = 0
    tp_rank: int = 0
    rdp_rank: int = 0
    pp: int = 1
    tp: int = 1
    rdp: int = 1

    def degrees(self) -> dict[str, int]:
        return {"pp": self.pp, "tp": self.tp, "rdp": self.rdp}


def part_name(base: str, pp_rank: int, tp_rank: int, rdp_rank: int = 0) -> str:
    """The name mp writes for a rank's part: smp's three-index form ``{base}_{pp}_{tp}_{rdp}`` (smp >=
    1.10; ``rdp_rank`` is 0 for state that is the same on every replica)."""
    return f"{base}_{pp_rank}_{tp_rank}_{rdp_rank}"


def manifest_path(path: str) -> str:
    """The manifest of ``smp.save(obj, path)`` (not matched by smp's ``{path}_*`` globs)."""
    return f"{path}.mp-manifest.json"


# smp's namings, newest first: v3 {f}_{pp}_{tp}_{rdp}; v2 {f}_{pp}_{tp}; v1 {f}_{mp_rank}; and the
# ``.pt``-suffixed v2/v3 names mp wrote before the manifest existed.
_SUFFIX = re.compile(r"_(\d+)(?:_(\d+))?(?:_(\d+))?(\.pt)?")


def find_parts(path: str) -> dict[str, dict[tuple[int, ...], str]]:
    """The saved parts of ``path`` by naming: ``{"v3"|"v2"|"v1"|"v3.pt"|"v2.pt": {indices: file}}``."""
    folder = os.path.dirname(path) or "."
    base = os.path.basename(path)
    found: dict[str, dict[tuple[int, ...], str]] = {}
    if not os.path.isdir(folder):
        return found
    for name in os.listdir(folder):
        if not name.startswith(base + "_") or TMP_MARK in name or ".sagemaker-" in name:
            continue
        m = _SUFFIX.fullmatch(name[len(base) :])
        if m is None:
            continue
        indices = tuple(int(g) for g in m.groups()[:3] if g is not None)
        kind = f"v{len(indices)}" + (".pt" if m.group(4) else "")
        if kind == "v1.pt":
            continue
        found.setdefault(kind, {})[indices] = os.path.join(folder, name)
    return found
