"""The rank topology: every rank's coordinates and every process group, as a pure function.

Given the world size, the pipeline-parallel degree ``pp``, the tensor-parallel degree ``tp`` and smp's
``placement_strategy``, :func:`build_topology` lays out the ``rdp = world_size // (pp * tp)`` replicas.
Nothing here communicates: every rank computes the same :class:`Topology` and can create its
``torch.distributed`` groups from :meth:`Topology.groups` in the same order.

Layout (smp v1's): the placement string is a permutation of ``D`` (reduced data parallelism), ``P``
(pipeline) and ``T`` (tensor); ``"cluster"`` is ``"DPT"`` and ``"spread"`` is ``"TPD"``. The right-most
letter varies fastest across consecutive global ranks, so for a string ``abc``::

    rank = (a_rank * size_b + b_rank) * size_c + c_rank

A rank's index inside any group is its position in the group's ascending list of global ranks. For the
two combined groups this is the formula of smp's Ranker: ``dp_rank`` (over T × D) is
``rdp_rank + rdp_size * tp_rank`` when T comes before D in the string and ``tp_rank + tp_size * rdp_rank``
otherwise; ``mp_rank`` (over P × T) is built the same way from pp and tp.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, TypeGuard

from mp_comm.errors import TopologyError

__all__ = [
    "PLACEMENT_ALIASES",
    "GroupKind",
    "RankCoords",
    "Topology",
    "build_topology",
    "normalize_placement",
]

#: The named placement strategies and the permutation each stands for.
PLACEMENT_ALIASES: Final[Mapping[str, str]] = {"cluster": "DPT", "spread": "TPD"}

_LETTERS: Final = "DPT"
_PERMUTATIONS: Final[frozenset[str]] = frozenset("".join(p) for p in itertools.permutations(_LETTERS))
_LETTER_NAMES: Final[Mapping[str, str]] = {"D": "rdp", "P": "pp", "T": "tp"}


class GroupKind(enum.Enum):
    """The six process groups of smp, with the values of smp's ``CommGroup``."""

    WORLD = 0
    PP = 1
    TP = 2
    RDP = 3
    DP = 4
    MP = 5

    @property
    def smp_name(self) -> str:
        """The smp ``CommGroup`` member name: ``"WORLD"``, ``"PP_GROUP"``, ..."""
        return "WORLD" if self is GroupKind.WORLD else f"{self.name}_GROUP"


# The placement letters whose coordinate varies inside a group of each kind; the others are fixed.
_VARYING: Final[Mapping[GroupKind, frozenset[str]]] = {
    GroupKind.WORLD: frozenset("DPT"),
    GroupKind.PP: frozenset("P"),
    GroupKind.TP: frozenset("T"),
    GroupKind.RDP: frozenset("D"),
    GroupKind.DP: frozenset("TD"),
    GroupKind.MP: frozenset("PT"),
}


@dataclass(frozen=True, kw_only=True)
class RankCoords:
    """Where one global rank sits: its index in each group, and its node."""

    rank: int
    """Global rank, ``0 <= rank < world_size``."""
    pp_rank: int
    """Index in the pipeline-parallel group (the pipeline stage)."""
    tp_rank: int
    """Index in the tensor-parallel group."""
    rdp_rank: int
    """Index in the reduced-data-parallel group (ranks holding the very same shard)."""
    dp_rank: int
    """Index in the data-parallel group (same stage, spans TP × RDP)."""
    mp_rank: int
    """Index in the model-parallel group (one full replica, spans PP × TP)."""
    node: int
    """Index of the node (host) holding the rank: ``rank // ranks_per_node``."""
    local_rank: int
    """Index on its node: ``rank % ranks_per_node``."""


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Every rank's coordinates and every process group of one world. Build it with :func:`build_topology`."""

    world_size: int
    """Number of ranks, ``pp_size * tp_size * rdp_size``."""
    pp_size: int
    """Pipeline-parallel degree (number of partitions)."""
    tp_size: int
    """Tensor-parallel degree."""
    rdp_size: int
    """Reduced-data-parallel degree: number of model replicas, ``world_size // (pp_size * tp_size)``."""
    dp_size: int
    """Data-parallel group size, ``tp_size * rdp_size``."""
    mp_size: int
    """Model-parallel group size, ``pp_size * tp_size``."""
    placement: str
    """Normalized placement string, a permutation of ``"DPT"``; its right-most letter varies fastest."""
    ranks_per_node: int
    """Ranks on each node; ``world_size`` when all ranks share one node."""
    _groups_cache: dict[GroupKind, tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        for name in ("world_size", "pp_size", "tp_size", "rdp_size", "ranks_per_node"):
            _check_positive_int(name, getattr(self, name))
        if self.placement not in _PERMUTATIONS:
            raise TopologyError(
                f"Topology.placement={self.placement!r} is not normalized: expected a permutation of "
                f"'DPT'; build the topology with build_topology(), which normalizes the strategy."
            )
        expected = {
            "world_size": self.pp_size * self.tp_size * self.rdp_size,
            "dp_size": self.tp_size * self.rdp_size,
            "mp_size": self.pp_size * self.tp_size,
        }
        for name, value in expected.items():
            if getattr(self, name) != value:
                raise TopologyError(
                    f"Topology.{name}={getattr(self, name)} is inconsistent with pp_size={self.pp_size}, "
                    f"tp_size={self.tp_size}, rdp_size={self.rdp_size}: expected {value}; build the "
                    f"topology with build_topology(), which derives the sizes."
                )
        if self.world_size % self.ranks_per_node:
            raise TopologyError(_ranks_per_node_message(self.ranks_per_node, self.world_size))

    # ----------------------------------------------------------------------------------------- ranks

    @property
    def num_nodes(self) -> int:
        """Number of nodes (hosts)."""
        return self.world_size // self.ranks_per_node

    def coords(self, rank: int) -> RankCoords:
        """All coordinates of global ``rank``."""
        self._check_rank(rank)
        digits = self._digits(rank)
        return RankCoords(
            rank=rank,
            pp_rank=digits["P"],
            tp_rank=digits["T"],
            rdp_rank=digits["D"],
            dp_rank=self._position(_VARYING[GroupKind.DP], digits),
            mp_rank=self._position(_VARYING[GroupKind.MP], digits),
            node=rank // self.ranks_per_node,
            local_rank=rank % self.ranks_per_node,
        )

    def all_coords(self) -> tuple[RankCoords, ...]:
        """The coordinates of every rank, by global rank."""
        return tuple(self.coords(rank) for rank in range(self.world_size))

    def rank_of(self, *, pp_rank: int, tp_rank: int, rdp_rank: int) -> int:
        """The global rank at the given pipeline, tensor and reduced-data-parallel coordinates."""
        digits = {"P": pp_rank, "T": tp_rank, "D": rdp_rank}
        for letter, value in digits.items():
            size = self._size_of(letter)
            if not _is_int(value) or not 0 <= value < size:
                name = _LETTER_NAMES[letter]
                raise TopologyError(
                    f"{name}_rank={value!r} is out of range: expected an int in [0, {size}) since "
                    f"{name}_size={size}; pass a coordinate below the {name} degree."
                )
        return self._position(_VARYING[GroupKind.WORLD], digits)

    def local_size(self, rank: int) -> int:
        """Number of ranks on the node of ``rank``."""
        self._check_rank(rank)
        return self.ranks_per_node

    # ---------------------------------------------------------------------------------------- groups

    def size(self, kind: GroupKind) -> int:
        """Size of every group of ``kind``."""
        return {
            GroupKind.WORLD: self.world_size,
            GroupKind.PP: self.pp_size,
            GroupKind.TP: self.tp_size,
            GroupKind.RDP: self.rdp_size,
            GroupKind.DP: self.dp_size,
            GroupKind.MP: self.mp_size,
        }[_check_kind(kind)]

    def groups(self, kind: GroupKind) -> tuple[tuple[int, ...], ...]:
        """All groups of ``kind``, each an ascending tuple of global ranks, ordered by their lowest rank.

        The order is the same on every rank, so ranks can create their process groups in this order.
        """
        return self._groups_and_index(kind)[0]

    def group(self, kind: GroupKind, rank: int) -> tuple[int, ...]:
        """The group of ``kind`` that holds ``rank``: an ascending tuple of global ranks."""
        self._check_rank(rank)
        groups, index = self._groups_and_index(kind)
        return groups[index[rank]]

    def group_index(self, kind: GroupKind, rank: int) -> int:
        """Which of :meth:`groups` (``kind``) holds ``rank``: its index in that tuple."""
        self._check_rank(rank)
        return self._groups_and_index(kind)[1][rank]

    def rank_in_group(self, kind: GroupKind, rank: int) -> int:
        """Index of ``rank`` in its group of ``kind``: its position in the ascending list of members.

        This is the rank a ``torch.distributed`` group built from :meth:`group` gives the process, and
        equals the matching coordinate (``pp_rank``, ``tp_rank``, ``rdp_rank``, ``dp_rank``, ``mp_rank``).
        """
        self._check_rank(rank)
        return self._position(_VARYING[_check_kind(kind)], self._digits(rank))

    def group_member(self, kind: GroupKind, rank: int, index: int) -> int:
        """The global rank at position ``index`` in the group of ``kind`` holding ``rank``.

        This translates a group-relative rank (smp's ``RankType``) into a global one.
        """
        members = self.group(kind, rank)
        if not _is_int(index) or not 0 <= index < len(members):
            raise TopologyError(
                f"index={index!r} is out of range for the {kind.name} group of rank {rank}: expected an "
                f"int in [0, {len(members)}); pass a rank relative to that group of {len(members)} ranks."
            )
        return members[index]

    # -------------------------------------------------------------------------------------- describe

    def describe(self, *, with_groups: bool = True) -> str:
        """A human-readable table of every rank's coordinates, followed by the groups of each kind."""
        fastest = self.placement[-1]
        nodes = "node" if self.num_nodes == 1 else "nodes"
        lines = [
            f"{self.world_size} ranks = pp {self.pp_size} x tp {self.tp_size} x rdp {self.rdp_size}; "
            f"placement {self.placement!r} ({_LETTER_NAMES[fastest]} varies fastest); "
            f"{self.ranks_per_node} ranks per node, {self.num_nodes} {nodes}",
        ]
        header = ("rank", "node", "local", "pp", "tp", "rdp", "dp", "mp")
        rows = [
            (c.rank, c.node, c.local_rank, c.pp_rank, c.tp_rank, c.rdp_rank, c.dp_rank, c.mp_rank)
            for c in self.all_coords()
        ]
        widths = [max(len(h), *(len(str(row[i])) for row in rows)) for i, h in enumerate(header)]
        lines.append("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
        lines.extend("  ".join(str(v).rjust(w) for v, w in zip(row, widths, strict=True)) for row in rows)
        if with_groups:
            for kind in (GroupKind.PP, GroupKind.TP, GroupKind.RDP, GroupKind.DP, GroupKind.MP):
                shown = ", ".join(_format_group(g) for g in self.groups(kind))
                lines.append(f"{kind.name + ' groups:':<12} {shown}")
        return "\n".join(lines)

    # --------------------------------------------------------------------------------------- private

    def _size_of(self, letter: str) -> int:
        return {"D": self.rdp_size, "P": self.pp_size, "T": self.tp_size}[letter]

    def _digits(self, rank: int) -> dict[str, int]:
        """The (D, P, T) coordinates of ``rank``: mixed radix, right-most placement letter fastest."""
        digits: dict[str, int] = {}
        rest = rank
        for letter in reversed(self.placement):
            rest, digits[letter] = divmod(rest, self._size_of(letter))
        return digits

    def _position(self, letters: Iterable[str], digits: Mapping[str, int]) -> int:
        """Position of ``digits`` among the ranks that differ only in ``letters``, in ascending order.

        Letters further left in the placement are more significant, as in the global rank itself.
        """
        chosen = frozenset(letters)
        position = 0
        for letter in self.placement:
            if letter in chosen:
                position = position * self._size_of(letter) + digits[letter]
        return position

    def _groups_and_index(self, kind: GroupKind) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
        cached = self._groups_cache.get(_check_kind(kind))
        if cached is None:
            fixed = [letter for letter in self.placement if letter not in _VARYING[kind]]
            buckets: dict[tuple[int, ...], list[int]] = {}
            for rank in range(self.world_size):
                digits = self._digits(rank)
                buckets.setdefault(tuple(digits[letter] for letter in fixed), []).append(rank)
            # Ranks are visited in ascending order, so each bucket is ascending and the buckets are
            # ordered by their lowest member.
            groups = tuple(tuple(members) for members in buckets.values())
            index = [0] * self.world_size
            for i, members in enumerate(groups):
                for rank in members:
                    index[rank] = i
            cached = (groups, tuple(index))
            self._groups_cache[kind] = cached
        return cached

    def _check_rank(self, rank: int) -> None:
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise TopologyError(
                f"rank={rank!r} is out of range: expected an int in [0, {self.world_size}) for a world of "
                f"{self.world_size} ranks; pass a global rank of this world."
            )


def normalize_placement(strategy: str) -> str:
    """``"cluster"`` -> ``"DPT"``, ``"spread"`` -> ``"TPD"``; a permutation of ``"DPT"`` is returned as is.

    Case-sensitive, as in smp. Anything else raises :class:`TopologyError`.
    """
    if isinstance(strategy, str):
        if strategy in PLACEMENT_ALIASES:
            return PLACEMENT_ALIASES[strategy]
        if strategy in _PERMUTATIONS:
            return strategy
    valid = "'cluster', 'spread' or a permutation of 'DPT' (" + ", ".join(sorted(_PERMUTATIONS)) + ")"
    hint = "pass one of these, e.g. 'cluster' (the default) to keep each model replica on neighbouring ranks"
    if isinstance(strategy, str):
        if strategy.lower() in PLACEMENT_ALIASES:
            hint = f"the names are case-sensitive: pass {strategy.lower()!r}"
        elif strategy.upper() in _PERMUTATIONS:
            hint = f"the letters are case-sensitive: pass {strategy.upper()!r}"
    raise TopologyError(
        f"placement_strategy={strategy!r} is not a placement strategy: expected {valid}; {hint}."
    )


def build_topology(
    world_size: int,
    pp: int = 1,
    tp: int = 1,
    placement_strategy: str = "cluster",
    ranks_per_node: int | None = None,
) -> Topology:
    """The topology of ``world_size`` ranks with ``pp``-way pipeline and ``tp``-way tensor parallelism.

    The remaining factor ``world_size // (pp * tp)`` is the reduced-data-parallel degree. ``ranks_per_node``
    is the number of ranks on each host (``None``: all ranks on one host); ranks fill hosts in order.
    """
    _check_positive_int("world_size", world_size, fix="launch at least one process")
    _check_positive_int("pp", pp, fix="set pipeline_parallel_degree (partitions) to 1 or more")
    _check_positive_int("tp", tp, fix="set tensor_parallel_degree to 1 or more")
    placement = normalize_placement(placement_strategy)
    model = pp * tp
    if world_size % model:
        raise TopologyError(
            f"world_size={world_size} is not divisible by pp*tp={model} (pp={pp}, tp={tp}): every model "
            f"replica needs pp*tp ranks. Launch a multiple of {model} processes, or choose pp and tp whose "
            f"product divides {world_size} (one of {_divisors_text(world_size)})."
        )
    if ranks_per_node is None:
        ranks_per_node = world_size
    else:
        _check_positive_int(
            "ranks_per_node", ranks_per_node, fix="pass the number of processes per host, or None"
        )
        if world_size % ranks_per_node:
            raise TopologyError(_ranks_per_node_message(ranks_per_node, world_size))
    rdp = world_size // model
    return Topology(
        world_size=world_size,
        pp_size=pp,
        tp_size=tp,
        rdp_size=rdp,
        dp_size=tp * rdp,
        mp_size=model,
        placement=placement,
        ranks_per_node=ranks_per_node,
    )


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_positive_int(name: str, value: object, *, fix: str | None = None) -> None:
    if not _is_int(value) or value < 1:
        raise TopologyError(
            f"{name}={value!r} is invalid: expected an int >= 1; {fix or f'pass a positive int as {name}'}."
        )


def _check_kind(kind: GroupKind) -> GroupKind:
    if not isinstance(kind, GroupKind):
        raise TopologyError(
            f"kind={kind!r} is not a group kind: expected a GroupKind "
            f"({', '.join(k.name for k in GroupKind)}); pass e.g. GroupKind.DP."
        )
    return kind


def _ranks_per_node_message(ranks_per_node: int, world_size: int) -> str:
    return (
        f"ranks_per_node={ranks_per_node} does not divide world_size={world_size}: every node must hold the "
        f"same number of ranks. Pass the number of processes per host (one of "
        f"{_divisors_text(world_size)}), or None when all ranks share one node."
    )


def _divisors_text(n: int, limit: int = 16) -> str:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, divisors[:limit])) + (", ..." if len(divisors) > limit else "")


def _format_group(group: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, group)) + "]"
