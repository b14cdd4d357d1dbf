"""The smp configuration: :class:`ModelParallelConfig`, :func:`load_config` and :func:`validate_world`.

``load_config`` turns whatever a script or launcher provides (a dict, a JSON file, a JSON string, the
``MP_CONFIG`` or ``SM_HP_MP_PARAMETERS`` environment variables, SageMaker's ``distribution`` nesting)
into a checked :class:`ModelParallelConfig`. ``validate_world`` checks the config against the number
of processes before any process group exists. Both are pure and deterministic, so every rank raises
the same error for the same input.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TypeAlias

from mp.config_model import ModelParallelConfig
from mp.config_schema import config_error, did_you_mean, show
from mp.errors import ConfigError, WorkerSizeError

__all__ = [
    "ATP_TOPOLOGY_CHOICES",
    "ENV_MP_CONFIG",
    "ENV_SAGEMAKER",
    "ConfigError",
    "ConfigSource",
    "ModelParallelConfig",
    "WorkerSizeError",
    "check_paths",
    "load_config",
    "validate_world",
]

ENV_MP_CONFIG = "MP_CONFIG"
"""Environment variable with the config as JSON text or as the path of a JSON file."""
ENV_SAGEMAKER = "SM_HP_MP_PARAMETERS"
"""Environment variable in which SageMaker (and the HuggingFace Trainer's detection) puts the JSON."""

ConfigSource: TypeAlias = Mapping[str, object] | str | os.PathLike[str] | ModelParallelConfig | None

_SOURCES = "a dict, a ModelParallelConfig, a JSON file path, a JSON object string, or None (environment)"


def load_config(
    source: ConfigSource = None, *, environ: Mapping[str, str] | None = None
) -> ModelParallelConfig:
    """Build a checked config from ``source``; raise :class:`ConfigError` (a ValueError) on any problem.

    - a :class:`ModelParallelConfig` is returned as is;
    - a dict (Mapping) holds the config keys, or SageMaker's nesting
      ``{"smdistributed": {"modelparallel": {"enabled": true, "parameters": {...}}}, "mpi": {...}}``,
      ``{"modelparallel": {...}}`` or ``{"enabled": true, "parameters": {...}}``, which is unwrapped;
    - a str or path names a JSON file holding any of those (a str starting with ``{`` is read as JSON);
    - None reads the environment ``environ`` (default ``os.environ``): ``MP_CONFIG`` (JSON text or a
      file path), else ``SM_HP_MP_PARAMETERS`` (JSON text), else the defaults.
    """
    if isinstance(source, ModelParallelConfig):
        return source
    if source is None:
        return _from_environment(os.environ if environ is None else environ)
    if isinstance(source, Mapping):
        return _build(source, None)
    if isinstance(source, str) and source.lstrip().startswith("{"):
        return _build(_parse_json(source, "the config string"), "the config string")
    if isinstance(source, str | os.PathLike):
        try:
            path = Path(os.fsdecode(source))
        except (TypeError, ValueError) as exc:  # a PathLike returning something odd, or a NUL byte
            raise config_error(
                None, source, f" as a config path ({exc})", _SOURCES, "pass a valid path"
            ) from None
        return _build(_read_json_file(path), str(path))
    raise config_error(
        None,
        source,
        " as a config source",
        _SOURCES,
        "pass the config as a dict, e.g. smp.init({'pipeline_parallel_degree': 2, 'microbatches': 4})",
    )


def _from_environment(environ: Mapping[str, str]) -> ModelParallelConfig:
    text = environ.get(ENV_MP_CONFIG, "")
    if text.strip():
        origin = f"environment variable {ENV_MP_CONFIG}"
        if text.lstrip().startswith("{"):
            return _build(_parse_json(text, origin), origin)
        path = Path(text.strip())
        return _build(_read_json_file(path, origin), f"{path} (named by {origin})")
    text = environ.get(ENV_SAGEMAKER, "")
    if text.strip():
        origin = f"environment variable {ENV_SAGEMAKER}"
        return _build(_parse_json(text, origin), origin)
    return ModelParallelConfig()


def _parse_json(text: str, origin: str) -> object:
    def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
        # json.loads keeps the last of two equal keys without a word: a config edited in two places
        # would silently run with one of them.
        seen: dict[str, object] = {}
        for key, value in pairs:
            if key in seen:
                raise config_error(
                    key,
                    value,
                    f" twice in {origin} (first {show(seen[key])}, then {show(value)})",
                    "each key once per JSON object",
                    f"keep one '{key}' in {origin} and delete the other",
                )
            seen[key] = value
        return seen

    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise config_error(
            None,
            text,
            f" from {origin}, which is not valid JSON ({exc})",
            'a JSON object of config keys, e.g. {"pipeline_parallel_degree": 2, "microbatches": 4}',
            f"fix the JSON in {origin} (double-quoted keys, true/false in lower case, no trailing commas)",
        ) from None


def _read_json_file(path: Path, named_by: str | None = None) -> object:
    where = f" (named by {named_by})" if named_by else ""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise config_error(
            None,
            str(path),
            f": no such config file{where}",
            "the path of an existing JSON file",
            f"check the path (relative paths are read from {Path.cwd()}), or pass the config as a dict",
        ) from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise config_error(
            None,
            str(path),
            f": the config file cannot be read{where} ({exc})",
            "a readable UTF-8 JSON file",
            "check the file's permissions and encoding",
        ) from None
    return _parse_json(text, f"config file {path}")


def _build(data: object, origin: str | None) -> ModelParallelConfig:
    try:
        return ModelParallelConfig.from_dict(_unwrap(data))
    except ConfigError as exc:
        if origin is None:
            raise
        raise ConfigError(f"{exc} [config from {origin}]", exc.key, exc.value, exc.allowed, exc.fix) from None


def _unwrap(data: object) -> Mapping[str, object]:
    """The parameters dict inside SageMaker's ``distribution`` nesting (or ``data`` itself)."""
    if not isinstance(data, Mapping):
        raise config_error(
            None,
            data,
            " where a JSON object (dict) was expected",
            "a JSON object of config keys",
            'write the config as {"key": value, ...}',
        )
    if "smdistributed" in data:
        _only(data, ("smdistributed", "mpi"), "the distribution dict")
        smdistributed = data["smdistributed"]
        if not isinstance(smdistributed, Mapping) or "modelparallel" not in smdistributed:
            raise config_error(
                "smdistributed",
                smdistributed,
                " without a 'modelparallel' entry",
                '{"modelparallel": {"enabled": true, "parameters": {...}}}',
                "put the config under smdistributed.modelparallel.parameters",
            )
        _only(smdistributed, ("modelparallel",), "'smdistributed'")
        return _unwrap_block(smdistributed["modelparallel"])
    if "modelparallel" in data:
        _only(data, ("modelparallel", "mpi"), "the distribution dict")
        return _unwrap_block(data["modelparallel"])
    if data and set(data) <= {"enabled", "parameters"}:
        return _unwrap_block(data)
    return data


def _unwrap_block(block: object) -> Mapping[str, object]:
    """``{"enabled": true, "parameters": {...}}`` -> the parameters."""
    shape = '{"enabled": true, "parameters": {...config keys...}}'
    if not isinstance(block, Mapping):
        raise config_error("modelparallel", block, "", f"a dict {shape}", f"write 'modelparallel' as {shape}")
    _only(block, ("enabled", "parameters"), "'modelparallel'")
    enabled = block.get("enabled", True)
    if enabled is not True:
        raise config_error(
            "enabled",
            enabled,
            " in the 'modelparallel' block",
            "true (model parallelism on), or no 'enabled' key",
            'set "enabled": true, or do not call smp.init for a run without model parallelism',
        )
    params = block.get("parameters", {})
    if not isinstance(params, Mapping):
        raise config_error(
            "parameters", params, "", "a dict of config keys", f"write 'modelparallel' as {shape}"
        )
    return params


def _only(mapping: Mapping[object, object], allowed: tuple[str, ...], where: str) -> None:
    for key in sorted((k for k in mapping if k not in allowed), key=repr):
        raise config_error(
            key if isinstance(key, str) else None,
            mapping[key],
            f" as a key of {where}",
            "keys " + ", ".join(repr(a) for a in allowed),
            f"remove {show(key)} from {where}; config keys go in the 'parameters' dict",
        )


# ----------------------------------------------------------------------------- file checks
ATP_TOPOLOGY_CHOICES = ("calibrate", "nvswitch", "dual-nvlink", "pcie")
"""The names ``atp_topology`` takes besides the path of a JSON file written by CommMatrix.save."""


def check_paths(cfg: ModelParallelConfig, rank: int) -> None:
    """Check the files and folders ``cfg`` names, as rank ``rank`` will use them; raise ConfigError.

    ``smp.init`` runs this on every rank before any process group exists (rank 0 alone reads or
    writes ``partition_file``; every rank of an ``atp_mesh: "auto"`` job reads ``atp_topology``), so
    a typo fails at once instead of after the first step's tracing.
    """
    topology = cfg.atp_topology
    if cfg.atp_mesh == "auto" and topology is not None and topology not in ATP_TOPOLOGY_CHOICES:
        _check_topology_file(topology)
    path = cfg.partition_file
    if rank != 0 or path is None or cfg.pipeline_parallel_degree == 1:
        return  # with one stage nothing is partitioned, and partition_file has no effect
    if cfg.load_partition:
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise config_error(
                "partition_file",
                path,
                f": no readable file there (load_partition is true; rank 0 looked in {Path.cwd()})",
                "the path of a partition file written by an earlier run",
                "run once with 'load_partition' false to write it, or correct the path",
            )
        return
    folder = Path(path).parent
    problem = ""
    if not folder.is_dir():
        problem = f": its folder {str(folder)!r} does not exist"
    elif not os.access(folder, os.W_OK | os.X_OK):
        problem = f": its folder {str(folder)!r} is not writable"
    if problem:
        raise config_error(
            "partition_file",
            path,
            problem + " (rank 0 writes the partition there after the first step)",
            "a file path in an existing, writable folder",
            f"create {str(folder)!r} or point 'partition_file' at a writable folder",
        )


def _check_topology_file(path: str) -> None:
    from mp_tensor import CommMatrix  # only jobs that ask for a saved topology pay for the import

    allowed = (
        "one of " + ", ".join(repr(c) for c in ATP_TOPOLOGY_CHOICES) + ", or the path of a readable JSON "
        "file written by mp_tensor.atp.CommMatrix.save (python -m mp_tensor.atp calibrate)"
    )
    try:
        CommMatrix.load(path)
    except FileNotFoundError:
        close = did_you_mean(path, ATP_TOPOLOGY_CHOICES)
        hint = f"did you mean {close!r}? Otherwise " if close is not None else ""
        raise config_error(
            "atp_topology", path, ", neither a preset nor an existing file", allowed, f"{hint}correct it"
        ) from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise config_error(
            "atp_topology",
            path,
            f", a file that cannot be read as a saved topology ({type(exc).__name__}: {exc})",
            allowed,
            "write the file with python -m mp_tensor.atp calibrate, or name a preset",
        ) from None


# ----------------------------------------------------------------------------- world checks
def validate_world(
    cfg: ModelParallelConfig, world_size: int, local_size: int, local_gpus: int | None = None
) -> None:
    """Check that ``world_size`` processes (``local_size`` on this host) fit ``cfg``.

    ``local_gpus`` is the number of GPUs this host uses (None or 0: running on CPU). Raises
    :class:`WorkerSizeError` (a ValueError). Unlike smp, a world larger than pp*tp does not need
    ``ddp``: mp always does data parallelism over the data-parallel groups.
    """
    for name, value, low in (("world_size", world_size, 1), ("local_size", local_size, 1)):
        if type(value) is not int or value < low:
            raise WorkerSizeError(
                f"{name} must be an int >= {low}, got {show(value)}. Fix: pass the number of processes "
                "(the launcher's world size / processes on this host)"
            )
    if local_size > world_size:
        raise WorkerSizeError(
            f"local_size {local_size} is larger than world_size {world_size}: a host cannot run more "
            "processes than the whole job. Fix: pass the number of processes on this host as local_size"
        )
    if local_gpus is not None and (type(local_gpus) is not int or local_gpus < 0):
        raise WorkerSizeError(
            f"local_gpus must be None or an int >= 0, got {show(local_gpus)}. Fix: pass "
            "torch.cuda.device_count(), or None on CPU"
        )
    pp, tp, mp_size = cfg.pipeline_parallel_degree, cfg.tensor_parallel_degree, cfg.mp_size
    degrees = f"pipeline_parallel_degree ({pp}) x tensor_parallel_degree ({tp}) = {mp_size}"
    if world_size < mp_size or world_size % mp_size:
        below = world_size // mp_size * mp_size
        options = " or ".join(str(n) for n in (below, below + mp_size) if n > 0)
        problem = "is smaller than" if world_size < mp_size else "is not a multiple of"
        raise WorkerSizeError(
            f"world size {world_size} {problem} {degrees}. Allowed: a world size that is a multiple of "
            f"{mp_size} (one model replica is {mp_size} processes). Fix: launch {options} processes "
            f"(e.g. mp-launch -n {max(below, mp_size)} ...), or lower the degrees"
        )
    sdp = cfg.sharded_data_parallel_degree
    dp_size = world_size // pp
    if sdp > 1 and (sdp > dp_size or dp_size % sdp):
        divisors = [d for d in range(1, dp_size + 1) if dp_size % d == 0]
        shown = ", ".join(str(d) for d in divisors[:12]) + (", ..." if len(divisors) > 12 else "")
        raise WorkerSizeError(
            f"sharded_data_parallel_degree {sdp} does not divide the data-parallel size {dp_size} "
            f"(world size {world_size} / pipeline_parallel_degree {pp}). Allowed: a divisor of {dp_size} "
            f"({shown}). Fix: set 'sharded_data_parallel_degree' to one of those, or launch a multiple of "
            f"{sdp * pp} processes"
        )
    if local_gpus is not None and local_gpus > 0 and local_size > local_gpus:
        raise WorkerSizeError(
            f"{local_size} processes run on this host but it has only {local_gpus} GPUs. Allowed: at most "
            f"one process per GPU ({local_gpus} on this host). Fix: launch at most {local_gpus} processes "
            "per host (processes_per_host), hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on CPU, or set "
            "MP_SHARE_GPUS=1 to let processes share a GPU (for testing: collectives then go through gloo)"
        )
