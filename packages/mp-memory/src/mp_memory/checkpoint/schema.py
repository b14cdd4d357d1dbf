"""Every entry mp writes into a state dict or checkpoint part besides the state itself, as typed records.

A model or optimizer state dict that mp returns (``local_state_dict()``, ``state_dict()``) carries a
:class:`Header`: whether it is one rank's part, the partition it was saved under, the parameters' names,
the tensor-parallel layout of its shards, the sharded-data-parallel layout of its shards, and so on. Each
field lives under its own key (:data:`KEYS`); :func:`write_header` puts a header into a state dict and
:func:`read_header` takes it out again, checking every entry's type, for the model and the optimizer
alike. Nothing else reads or writes these keys.

Checkpoints written before these records existed load unchanged: the keys are the ones mp always wrote,
and the sharded-data-parallel layout that a sharded model's parts kept under the tensor-parallel layout's
key (``_smp_layout`` with ``sdp_degree``) is read as an :class:`SDPLayout`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from mp_memory.checkpoint.errors import CheckpointCorruptError

__all__ = ["KEYS", "Header", "SDPLayout", "TPLayout", "read_header", "write_header"]


@dataclass(frozen=True)
class TPLayout:
    """Where a part's tensor-parallel shards belong: the pipeline and TP degrees and ranks of the rank
    that saved it, and each sharded tensor's split dimension (state-dict name -> dim)."""

    pp: int
    pp_rank: int
    tp: int
    tp_rank: int
    split: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "pp": self.pp,
            "pp_rank": self.pp_rank,
            "tp": self.tp,
            "tp_rank": self.tp_rank,
            "split": dict(self.split),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TPLayout:
        return cls(int(d["pp"]), int(d["pp_rank"]), int(d["tp"]), int(d["tp_rank"]), dict(d.get("split", {})))


@dataclass(frozen=True)
class SDPLayout:
    """Which shard of sharded data parallelism a part holds: the sharding degree, the shard index and,
    with tensor parallelism, the tp_rank."""

    degree: int
    shard: int
    tp_rank: int | None = None

    def to_dict(self) -> dict[str, int]:
        out = {"sdp_degree": self.degree, "sdp_shard": self.shard}
        if self.tp_rank is not None:
            out["tp_rank"] = self.tp_rank
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SDPLayout:
        tp_rank = d.get("tp_rank")
        return cls(int(d["sdp_degree"]), int(d["sdp_shard"]), None if tp_rank is None else int(tp_rank))


@dataclass(frozen=True)
class Header:
    """mp's entries of one state dict (all optional; the defaults are written as absent)."""

    partial: bool = False
    """One rank's part (``local_state_dict()``), not the full state."""
    partition: dict[str, int] | None = None
    """pp > 1: the module -> pp_rank assignment it was saved under."""
    param_names: list[list[str | None]] | None = None
    """Optimizer: the model's name of each parameter, per group, in the state's numbering."""
    tp_layout: TPLayout | None = None
    """The parts' tensor-parallel shards (only when it holds some)."""
    sdp_layout: SDPLayout | None = None
    """Sharded data parallelism: the shard it holds."""
    keyed_by_name: bool = False
    """Optimizer: ``state`` and ``param_groups`` name parameters instead of numbering them."""
    tp_shards: bool = False
    """Optimizer, keyed by name: it holds this rank's TP shards under mp's names (a partial state moved
    to another pipeline degree), not full tensors under the original names. Never written to a file."""
    zero_param_names: list[str | None] | None = None
    """``shard_optimizer_state``: the names of the parameters whose state this rank's share holds."""
    precision: str | None = None
    """fp16/bf16 optimizer: the half precision it was saved in."""


KEYS: dict[str, str] = {
    "partial": "_smp_is_partial",
    "partition": "_smp_partition",
    "param_names": "_smp_param_names",
    "tp_layout": "_smp_layout",
    "sdp_layout": "_mp_sdp_layout",
    "keyed_by_name": "_smp_keyed_by_name",
    "tp_shards": "_smp_tp_shards",
    "zero_param_names": "_mp_zero_param_names",
    "precision": "_mp_precision",
}
"""Header field -> its state-dict key (the names mp has always written)."""

_TYPES: dict[str, type | tuple[type, ...]] = {
    "partial": bool,
    "partition": dict,
    "param_names": list,
    "tp_layout": dict,
    "sdp_layout": dict,
    "keyed_by_name": bool,
    "tp_shards": bool,
    "zero_param_names": list,
    "precision": str,
}
_FIELD = {key: name for name, key in KEYS.items()}
_DEFAULT = Header()


def _bad(key: str, value: Any, expected: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"state-dict entry {key!r} is {type(value).__name__} {str(value)[:80]}; mp writes {expected} there. "
        "The file was not written by mp or is damaged: load the checkpoint it came from"
    )


def read_header(sd: Mapping[str, Any]) -> tuple[Header, dict[str, Any]]:
    """(the header of ``sd``, ``sd`` without it). Every entry is type-checked (CheckpointCorruptError);
    an unknown ``_smp_`` key is refused the same way, since mp never wrote one."""
    values: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in sd.items():
        name = _FIELD.get(key) if isinstance(key, str) else None
        if name is None:
            if isinstance(key, str) and key.startswith("_smp_"):
                raise _bad(key, value, f"only {sorted(KEYS.values())}")
            rest[key] = value
            continue
        if not isinstance(value, _TYPES[name]):
            raise _bad(key, value, f"a {getattr(_TYPES[name], '__name__', _TYPES[name])}")
        values[name] = value
    layout = values.pop("tp_layout", None)
    try:
        if layout is not None and "sdp_degree" in layout:  # a sharded part of mp before these records
            values.setdefault("sdp_layout", layout)
        elif layout is not None:
            values["tp_layout"] = TPLayout.from_dict(layout)
        if "sdp_layout" in values:
            values["sdp_layout"] = SDPLayout.from_dict(values["sdp_layout"])
    except (KeyError, TypeError, ValueError) as exc:
        raise _bad(KEYS["tp_layout"], layout, f"a layout record ({exc!r} missing or wrong)") from None
    return Header(**values), rest


def write_header(sd: Mapping[str, Any], header: Header) -> dict[str, Any]:
    """``sd`` with ``header``'s entries (those that differ from the defaults) added."""
    out = dict(sd)
    for f in fields(Header):
        value = getattr(header, f.name)
        if value == getattr(_DEFAULT, f.name):
            continue
        if isinstance(value, TPLayout | SDPLayout):
            value = value.to_dict()
        out[KEYS[f.name]] = value
    return out
