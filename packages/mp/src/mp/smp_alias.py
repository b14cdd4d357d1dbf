"""The ``smdistributed.modelparallel.torch`` import path, served by mp (``import mp`` under smp's name).

The umbrella ships a tiny ``smdistributed.modelparallel`` package (``src/smdistributed``, a namespace
``smdistributed`` without ``__init__.py``). Importing it installs :class:`AliasFinder` first on
``sys.meta_path``; the finder answers every ``smdistributed.modelparallel.torch[.X]`` import with the
module mp already has (``mp``, ``mp.nn``, ``mp.state``, ...), never a copy, so ``smp.state`` and
``mp.state`` are one object and ``isinstance(m, smp.model.DistributedModel)`` holds for mp's models.
A few smp-internal module names map onto mp's (``state_mod`` -> ``state``, ``exceptions`` -> ``errors``,
``optimizers.optimizer`` -> ``optimizer``).

A real smdistributed install is never shadowed silently: see :func:`check_no_real_install`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from mp.errors import RealSmdistributedError

__all__ = ["ALIAS_ENV", "PREFIX", "RENAMES", "SMP_VERSION", "AliasFinder", "check_no_real_install", "install"]

log = logging.getLogger(__name__)

SMP_VERSION = "1.15.0"
"""The smp v1 release whose documented behaviour mp follows (the last one, its documentation's
"latest"). ``smdistributed.modelparallel.__version__`` reports it, so that scripts and transformers
that compare it with "1.10" take the modern code paths."""

PREFIX = "smdistributed.modelparallel.torch"
ALIAS_ENV = "MP_SMDISTRIBUTED_ALIAS"
"""Set to 1 to let mp's alias take the import even where a real smdistributed.modelparallel exists."""

RENAMES = {"state_mod": "state", "exceptions": "errors", "optimizers.optimizer": "optimizer"}
"""smp's internal module names that scripts import, and mp's module holding the same names."""

_REAL_DISTRIBUTION = "smdistributed-modelparallel"
_MARK = "mp.smp_alias"  # what every copy of mp's shim imports, and no real smdistributed does


def target_of(fullname: str) -> str | None:
    """The mp module that serves ``fullname``, or None when ``fullname`` is outside the alias.

    Besides ``smdistributed.modelparallel.torch[.X]``, the renamed names under mp's own (``mp.state_mod``,
    ``mp.optimizers.optimizer``): ``from smdistributed.modelparallel.torch import state_mod`` looks the
    name up as an attribute of mp, and where mp has none the import system imports the submodule by
    the parent's own name, ``mp.state_mod``."""
    if fullname == PREFIX:
        return "mp"
    if fullname.startswith("mp."):
        renamed = RENAMES.get(fullname[len("mp.") :])
        return None if renamed is None else "mp." + renamed
    if not fullname.startswith(PREFIX + "."):
        return None
    rest = fullname[len(PREFIX) + 1 :]
    return "mp." + RENAMES.get(rest, rest)


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias by putting mp's module itself in ``sys.modules`` under the alias name.

    The import system returns whatever ``sys.modules[name]`` holds after ``exec_module``; the placeholder
    module it created is dropped, and mp's module keeps its own name and ``__spec__``."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # the default placeholder; replaced in exec_module

    def exec_module(self, module: ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(self.target)


class AliasFinder(importlib.abc.MetaPathFinder):
    """Serves ``smdistributed.modelparallel.torch`` and its submodules from mp's modules."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        mp_name = target_of(fullname)
        if mp_name is None:
            return None
        if importlib.util.find_spec(mp_name) is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: mp's smdistributed alias serves {PREFIX}.X from mp.X, and "
                f"mp has no {mp_name!r} (an smp-internal module, or a part mp does not build; "
                "docs/migrating.md lists what the alias covers)",
                name=fullname,
            )
        # The import system binds a loaded submodule as an attribute of its parent: an alias for a name
        # that mp's package binds to something else (mp.state is the State object, mp.step the
        # decorator) would overwrite it. smp had no such modules either ("state_mod" is the module).
        parent_name, _, child = fullname.rpartition(".")
        # (mp.state_mod and the like are never bound to anything else, and the lookup would ask mp's
        # __getattr__, which asks this finder again.)
        bound = None if fullname.startswith("mp.") else getattr(sys.modules.get(parent_name), child, None)
        if bound is not None and getattr(bound, "__name__", None) != mp_name:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: {parent_name}.{child} is a {type(bound).__name__}, not a "
                f"module (as in smp); use it as an attribute: smp.{child}",
                name=fullname,
            )
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(mp_name))


def _real_installs(shim_dir: Path) -> list[str]:
    """Where an smdistributed.modelparallel other than mp's shim is installed (sys.path, then metadata)."""
    found: list[str] = []
    here = shim_dir.resolve()
    for entry in sys.path:
        candidate = Path(entry or os.getcwd()) / "smdistributed" / "modelparallel"
        try:
            init = candidate / "__init__.py"
            if candidate.resolve() == here or not init.is_file():
                continue
            if _MARK in init.read_text(errors="replace"):
                continue  # another copy of mp's own shim (an installed mp beside a source tree)
        except OSError:
            continue
        found.append(str(candidate))
    try:
        dist = importlib.metadata.distribution(_REAL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        where = f"{_REAL_DISTRIBUTION} {dist.version} (pip metadata)"
        if not found:
            found.append(where)
    return found


def check_no_real_install(shim_dir: Path) -> None:
    """Refuse to serve the import path when a real smdistributed.modelparallel is installed too.

    mp's alias is only imported when it comes first for the name ``smdistributed.modelparallel``;
    a real install later on ``sys.path`` would then be shadowed. That raises
    :class:`RealSmdistributedError` unless ``MP_SMDISTRIBUTED_ALIAS=1`` (then a warning)."""
    real = _real_installs(shim_dir)
    if not real:
        return
    text = (
        f"a real smdistributed.modelparallel is installed ({'; '.join(real)}), and mp's alias at "
        f"{shim_dir} came first for the import, so it would shadow it"
    )
    if os.environ.get(ALIAS_ENV) == "1":
        warnings.warn(f"{text}; using mp because {ALIAS_ENV}=1", stacklevel=3)
        log.warning("%s; using mp because %s=1", text, ALIAS_ENV)
        return
    raise RealSmdistributedError(
        f"{text}. Expected at most one smdistributed.modelparallel on the import path. Fix: to run on "
        "mp, uninstall the real one (pip uninstall smdistributed-modelparallel) or set "
        f"{ALIAS_ENV}=1; to run on the real smp, remove mp's alias from the path before it "
        "(it is the 'src' folder of the mp distribution)."
    )


def install(shim_file: str) -> None:
    """Called by ``smdistributed/modelparallel/__init__.py``: check for a real install, add the finder."""
    check_no_real_install(Path(shim_file).parent)
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())
