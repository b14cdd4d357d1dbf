"""A partition decision as a file: the ``partition_file`` and ``load_partition`` config keys.

Automatic partitioning weighs traced execution times, which vary between runs, so two runs of one
script may split a model differently, and a partial checkpoint only loads under the split it was saved
with. With ``partition_file`` set, global rank 0 writes the decision there once the model is
partitioned; with ``load_partition`` as well, the decision is read from that file instead of being
computed (no tracing), so every later run splits the model the same way.

The file is JSON: ``{"format": "mp-partition/1", "pipeline_parallel_degree": 2,
"partition": {"module.path": pp_rank, ...}}``, where ``""`` is the root module and a module not listed
goes where its closest listed ancestor goes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mp.checkpoint import atomic_write
from mp.errors import PartitionFileError

__all__ = ["check_assignment", "read_partition", "write_partition"]

FORMAT = "mp-partition/1"


def check_assignment(
    assignment: object,
    modules: Iterable[str],
    pp: int,
    *,
    source: str,
    fix: str,
    error: type[Exception] = PartitionFileError,
) -> dict[str, int]:
    """``assignment`` as a {module path: pp_rank} dict, after checking that it fits a model with these
    module paths at ``pp`` pipeline ranks; otherwise ``error`` with a message naming ``source`` and
    ``fix``."""
    if not isinstance(assignment, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in assignment.items()
    ):
        raise error(
            f"{source} holds a {type(assignment).__name__} as its partition; expected a "
            f"{{module path: pp_rank}} dict. Fix: {fix}"
        )
    known = set(modules)
    unknown = sorted(k for k in assignment if k not in known)
    ranks = sorted({v for v in assignment.values() if not 0 <= v < pp})
    if unknown or ranks:
        raise error(
            f"{source} holds a partition that does not fit this job: "
            + (f"modules {unknown[:5]} are not in this model; " if unknown else "")
            + (f"pp_ranks {ranks} do not exist at pipeline_parallel_degree={pp}; " if ranks else "")
            + f"Fix: {fix}"
        )
    return dict(assignment)


def read_partition(path: str, modules: Iterable[str], pp: int) -> dict[str, int]:
    """The partition saved in ``path``, checked against the model's module paths and ``pp``."""
    fix = (
        "run once with 'partition_file' set and 'load_partition' false to write it, or set "
        "'load_partition' to false"
    )
    try:
        with open(path, encoding="utf-8") as f:
            data: Any = json.load(f)
    except FileNotFoundError:
        raise PartitionFileError(
            f"partition_file {path!r} does not exist (load_partition is true). Fix: {fix}"
        ) from None
    except (OSError, ValueError) as exc:
        raise PartitionFileError(
            f"partition_file {path!r} cannot be read as JSON: {exc}. Fix: {fix}"
        ) from exc
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise PartitionFileError(
            f"partition_file {path!r} is not a partition written by mp (expected a JSON object with "
            f'"format": {FORMAT!r}). Fix: {fix}'
        )
    saved_pp = data.get("pipeline_parallel_degree")
    if saved_pp != pp:
        raise PartitionFileError(
            f"partition_file {path!r} was written with pipeline_parallel_degree={saved_pp!r}; this job "
            f"runs with {pp}. Fix: use the same pipeline_parallel_degree, or {fix}"
        )
    return check_assignment(data.get("partition"), modules, pp, source=f"partition_file {path!r}", fix=fix)


def write_partition(path: str, assignment: Mapping[str, int], pp: int) -> None:
    """Write the decision atomically (a reader never sees half a file)."""
    text = json.dumps(
        {"format": FORMAT, "pipeline_parallel_degree": pp, "partition": dict(sorted(assignment.items()))},
        indent=1,
    )
    atomic_write(path, lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"), os.getpid())
