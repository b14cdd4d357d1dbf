"""The rank topology: coordinates, groups and errors, against an independent brute-force oracle and the
worked examples of the smp documentation."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mp_comm.errors import MPCommError, TopologyError
from mp_comm.topology import (
    PLACEMENT_ALIASES,
    GroupKind,
    RankCoords,
    Topology,
    build_topology,
    normalize_placement,
)

PERMUTATIONS = ["DPT", "DTP", "PDT", "PTD", "TDP", "TPD"]
STRATEGIES = ["cluster", "spread", *PERMUTATIONS]
SHAPES = [  # (world, pp, tp)
    (1, 1, 1),
    (2, 2, 1),
    (2, 1, 2),
    (4, 2, 2),
    (8, 2, 2),
    (8, 2, 1),
    (8, 1, 2),
    (8, 4, 2),
    (6, 1, 1),
    (12, 3, 2),
    (16, 2, 4),
    (16, 4, 1),
    (24, 2, 3),
    (30, 5, 3),
]
GROUP_KINDS = list(GroupKind)


# ------------------------------------------------------------------------------------------- oracle


def oracle(world: int, pp: int, tp: int, strategy: str) -> dict[int, dict[str, int]]:
    """Brute force, independent of the implementation: count ranks up through nested loops with the
    placement's left-most letter outermost, then apply smp's dp_rank/mp_rank formulas literally."""
    placement = {"cluster": "DPT", "spread": "TPD"}.get(strategy, strategy)
    rdp = world // (pp * tp)
    sizes = {"D": rdp, "P": pp, "T": tp}
    table: dict[int, dict[str, int]] = {}
    for rank, digits in enumerate(itertools.product(*(range(sizes[letter]) for letter in placement))):
        c = dict(zip(placement, digits, strict=True))
        t_before_d = placement.index("T") < placement.index("D")
        t_before_p = placement.index("T") < placement.index("P")
        dp = c["D"] + rdp * c["T"] if t_before_d else c["T"] + tp * c["D"]
        mp = c["P"] + pp * c["T"] if t_before_p else c["T"] + tp * c["P"]
        table[rank] = {"pp": c["P"], "tp": c["T"], "rdp": c["D"], "dp": dp, "mp": mp}
    assert len(table) == world
    return table


# Which coordinates are shared by all members of a group of each kind.
FIXED = {
    GroupKind.WORLD: (),
    GroupKind.PP: ("tp", "rdp"),
    GroupKind.TP: ("pp", "rdp"),
    GroupKind.RDP: ("pp", "tp"),
    GroupKind.DP: ("pp",),
    GroupKind.MP: ("rdp",),
}
COORD_OF = {
    GroupKind.WORLD: "rank",
    GroupKind.PP: "pp_rank",
    GroupKind.TP: "tp_rank",
    GroupKind.RDP: "rdp_rank",
    GroupKind.DP: "dp_rank",
    GroupKind.MP: "mp_rank",
}


def oracle_group(table: dict[int, dict[str, int]], kind: GroupKind, rank: int) -> tuple[int, ...]:
    keys = FIXED[kind]
    return tuple(r for r in sorted(table) if all(table[r][k] == table[rank][k] for k in keys))


# -------------------------------------------------------------------------------- full consistency


def check_topology(topo: Topology, world: int, pp: int, tp: int, strategy: str) -> None:
    table = oracle(world, pp, tp, strategy)
    rdp = world // (pp * tp)
    # sizes and identities of smp
    assert (topo.world_size, topo.pp_size, topo.tp_size, topo.rdp_size) == (world, pp, tp, rdp)
    assert topo.pp_size * topo.tp_size * topo.rdp_size == topo.world_size
    assert topo.dp_size == topo.tp_size * topo.rdp_size
    assert topo.mp_size == topo.pp_size * topo.tp_size
    assert topo.mp_size * topo.rdp_size == topo.world_size
    assert topo.pp_size * topo.dp_size == topo.world_size
    if tp == 1:
        assert topo.mp_size * topo.dp_size == topo.world_size
    assert [topo.size(k) for k in GROUP_KINDS] == [world, pp, tp, rdp, tp * rdp, pp * tp]

    for rank in range(world):
        c = topo.coords(rank)
        expected = table[rank]
        assert (c.rank, c.pp_rank, c.tp_rank, c.rdp_rank, c.dp_rank, c.mp_rank) == (
            rank,
            expected["pp"],
            expected["tp"],
            expected["rdp"],
            expected["dp"],
            expected["mp"],
        ), f"rank {rank} of {strategy} (world={world}, pp={pp}, tp={tp})"
        assert topo.rank_of(pp_rank=c.pp_rank, tp_rank=c.tp_rank, rdp_rank=c.rdp_rank) == rank
        for kind in GROUP_KINDS:
            group = topo.group(kind, rank)
            assert group == oracle_group(table, kind, rank), (kind, rank)
            assert list(group) == sorted(set(group))
            assert len(group) == topo.size(kind)
            # the rank within the group (what torch.distributed uses) is the position in the ascending
            # list, and it equals smp's coordinate formula
            position = group.index(rank)
            assert topo.rank_in_group(kind, rank) == position
            assert getattr(c, COORD_OF[kind]) == position, (kind, rank)
            assert topo.group_member(kind, rank, position) == rank
            assert topo.groups(kind)[topo.group_index(kind, rank)] == group
        # nesting: TP in DP and in MP; PP in MP; RDP in DP
        assert set(topo.group(GroupKind.TP, rank)) <= set(topo.group(GroupKind.DP, rank))
        assert set(topo.group(GroupKind.TP, rank)) <= set(topo.group(GroupKind.MP, rank))
        assert set(topo.group(GroupKind.PP, rank)) <= set(topo.group(GroupKind.MP, rank))
        assert set(topo.group(GroupKind.RDP, rank)) <= set(topo.group(GroupKind.DP, rank))
        # a DP group and an MP group meet exactly in a TP group
        meet = set(topo.group(GroupKind.DP, rank)) & set(topo.group(GroupKind.MP, rank))
        assert meet == set(topo.group(GroupKind.TP, rank))

    for kind in GROUP_KINDS:
        groups = topo.groups(kind)
        assert len(groups) == world // topo.size(kind)
        assert sorted(r for g in groups for r in g) == list(range(world)), f"{kind} does not partition"
        assert [g[0] for g in groups] == sorted(g[0] for g in groups), "groups not ordered by lowest rank"
        assert topo.groups(kind) == groups  # deterministic (and cached)
    assert topo.groups(GroupKind.WORLD) == (tuple(range(world)),)
    assert topo.all_coords() == tuple(topo.coords(r) for r in range(world))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("world", "pp", "tp"), SHAPES)
def test_every_placement_and_shape(world: int, pp: int, tp: int, strategy: str) -> None:
    topo = build_topology(world, pp=pp, tp=tp, placement_strategy=strategy)
    assert topo.placement == normalize_placement(strategy)
    check_topology(topo, world, pp, tp, strategy)


@settings(max_examples=60, deadline=None)
@given(
    pp=st.integers(1, 5),
    tp=st.integers(1, 5),
    rdp=st.integers(1, 5),
    strategy=st.sampled_from(STRATEGIES),
    data=st.data(),
)
def test_property_random_shapes(pp: int, tp: int, rdp: int, strategy: str, data: st.DataObject) -> None:
    world = pp * tp * rdp
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    per_node = data.draw(st.sampled_from([None, *divisors]))
    topo = build_topology(world, pp=pp, tp=tp, placement_strategy=strategy, ranks_per_node=per_node)
    check_topology(topo, world, pp, tp, strategy)
    n = world if per_node is None else per_node
    assert topo.num_nodes * topo.ranks_per_node == world
    for rank in range(world):
        c = topo.coords(rank)
        assert (c.node, c.local_rank) == divmod(rank, n)
        assert topo.local_size(rank) == n


def test_right_most_letter_varies_fastest() -> None:
    for strategy in PERMUTATIONS:
        topo = build_topology(8, pp=2, tp=2, placement_strategy=strategy)
        fastest = {"D": "rdp_rank", "P": "pp_rank", "T": "tp_rank"}[strategy[-1]]
        slowest = {"D": "rdp_rank", "P": "pp_rank", "T": "tp_rank"}[strategy[0]]
        assert [getattr(topo.coords(r), fastest) for r in range(8)] == [0, 1] * 4
        assert [getattr(topo.coords(r), slowest) for r in range(8)] == [0] * 4 + [1] * 4


# ---------------------------------------------------------------------------- documented examples


def test_seed_spread_example() -> None:
    """Seed 003, Ranking Basics: 8 processes, partitions=2, placement_strategy "spread"."""
    topo = build_topology(8, pp=2, placement_strategy="spread")
    assert topo.groups(GroupKind.MP) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert topo.groups(GroupKind.DP) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert [topo.coords(r).mp_rank for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert topo.coords(6).dp_rank == 2
    assert topo.rank_in_group(GroupKind.DP, 6) == 2


def test_seed_cluster_example() -> None:
    """Seed 003, Ranking Basics: 8 processes, partitions=2, placement_strategy "cluster"."""
    topo = build_topology(8, pp=2, placement_strategy="cluster")
    assert topo.groups(GroupKind.MP) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert topo.groups(GroupKind.DP) == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert [topo.coords(r).mp_rank for r in range(8)] == [0, 1] * 4
    assert [topo.coords(r).dp_rank for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_tp_is_a_subset_of_dp_with_pp_1() -> None:
    """With pp == 1 the TP group equals the MP group (AWS developer guide, "Ranking Mechanism")."""
    topo = build_topology(8, tp=4)
    for rank in range(8):
        assert topo.group(GroupKind.TP, rank) == topo.group(GroupKind.MP, rank)
        assert topo.group(GroupKind.DP, rank) == tuple(range(8))


def _table(topo: Topology) -> list[tuple[int, int, int]]:
    return [(c.rdp_rank, c.pp_rank, c.tp_rank) for c in topo.all_coords()]


def test_seed_tp_example_dpt() -> None:
    """Seed 003, Placement Strategy with Tensor Parallelism: 8 devices, tp=pp=rdp=2, "DPT".

    The seed's tables are images lost in extraction; this is the table its rule gives (T fastest, D slowest).
    """
    topo = build_topology(8, pp=2, tp=2, placement_strategy="DPT")
    # (rdp_rank, pp_rank, tp_rank) of ranks 0..7
    assert _table(topo) == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]
    assert topo.groups(GroupKind.TP) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert topo.groups(GroupKind.PP) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert topo.groups(GroupKind.RDP) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert topo.groups(GroupKind.DP) == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert topo.groups(GroupKind.MP) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert [topo.coords(r).dp_rank for r in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    assert [topo.coords(r).mp_rank for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_seed_tp_example_ptd() -> None:
    """Same example with "PTD": D fastest, P slowest."""
    topo = build_topology(8, pp=2, tp=2, placement_strategy="PTD")
    assert _table(topo) == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 0, 1),
        (1, 0, 1),
        (0, 1, 0),
        (1, 1, 0),
        (0, 1, 1),
        (1, 1, 1),
    ]
    assert topo.groups(GroupKind.TP) == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert topo.groups(GroupKind.PP) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert topo.groups(GroupKind.RDP) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert topo.groups(GroupKind.DP) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topo.groups(GroupKind.MP) == ((0, 2, 4, 6), (1, 3, 5, 7))
    # T before D: dp_rank = rdp_rank + rdp_size * tp_rank; P before T: mp_rank = tp_rank + tp_size * pp_rank
    assert [topo.coords(r).dp_rank for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [topo.coords(r).mp_rank for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_developer_guide_listing_is_dtp() -> None:
    """The AWS developer guide ("Ranking Mechanism", 8 GPUs, tp=2, pp=2) lists every GPU's ranks; the
    listing is exactly placement "DTP" (P fastest), a check of the dp_rank/mp_rank formulas."""
    listing = [  # pp_rank, tp_rank, rdp_rank, dp_rank, mp_rank of GPU0..GPU7
        (0, 0, 0, 0, 0),
        (1, 0, 0, 0, 1),
        (0, 1, 0, 1, 2),
        (1, 1, 0, 1, 3),
        (0, 0, 1, 2, 0),
        (1, 0, 1, 2, 1),
        (0, 1, 1, 3, 2),
        (1, 1, 1, 3, 3),
    ]
    topo = build_topology(8, pp=2, tp=2, placement_strategy="DTP")
    assert [(c.pp_rank, c.tp_rank, c.rdp_rank, c.dp_rank, c.mp_rank) for c in topo.all_coords()] == listing
    # "pipeline parallelism occurs across the GPU pairs (0,1); (2,3); (4,5) and (6,7)"
    assert topo.groups(GroupKind.PP) == ((0, 1), (2, 3), (4, 5), (6, 7))
    # "data parallelism takes place across GPUs 0, 2, 4, 6, and independently over GPUs 1, 3, 5, 7"
    assert topo.groups(GroupKind.DP) == ((0, 2, 4, 6), (1, 3, 5, 7))
    # "tensor parallelism ... across the GPU pairs (0,2); (1,3); (4,6) and (5,7)"
    assert topo.groups(GroupKind.TP) == ((0, 2), (1, 3), (4, 6), (5, 7))


# ----------------------------------------------------------------------------------- nodes, misc


def test_nodes_and_local_ranks() -> None:
    topo = build_topology(16, pp=2, tp=2, ranks_per_node=8)
    assert topo.num_nodes == 2
    assert [topo.coords(r).node for r in range(16)] == [0] * 8 + [1] * 8
    assert [topo.coords(r).local_rank for r in range(16)] == list(range(8)) * 2
    assert topo.local_size(15) == 8
    single = build_topology(4)
    assert single.ranks_per_node == 4
    assert single.num_nodes == 1
    assert [single.coords(r).local_rank for r in range(4)] == [0, 1, 2, 3]


def test_group_kind_values_match_smp_comm_group() -> None:
    assert {k.name: k.value for k in GroupKind} == {"WORLD": 0, "PP": 1, "TP": 2, "RDP": 3, "DP": 4, "MP": 5}
    assert [k.smp_name for k in GroupKind] == [
        "WORLD",
        "PP_GROUP",
        "TP_GROUP",
        "RDP_GROUP",
        "DP_GROUP",
        "MP_GROUP",
    ]


def test_normalize_placement() -> None:
    assert normalize_placement("cluster") == "DPT"
    assert normalize_placement("spread") == "TPD"
    assert dict(PLACEMENT_ALIASES) == {"cluster": "DPT", "spread": "TPD"}
    for p in PERMUTATIONS:
        assert normalize_placement(p) == p


@pytest.mark.parametrize(
    ("strategy", "hint"),
    [
        ("Cluster", "'cluster'"),
        ("SPREAD", "'spread'"),
        ("dpt", "'DPT'"),
        ("tDp", "'TDP'"),
        ("DPP", "permutation"),
        ("DP", "permutation"),
        ("DPTX", "permutation"),
        ("", "permutation"),
        ("packed", "permutation"),
        (None, "permutation"),
        (3, "permutation"),
    ],
)
def test_bad_placement(strategy: object, hint: str) -> None:
    with pytest.raises(TopologyError) as info:
        normalize_placement(strategy)  # type: ignore[arg-type]
    message = str(info.value)
    assert f"placement_strategy={strategy!r}" in message
    assert hint in message
    with pytest.raises(TopologyError):
        build_topology(8, placement_strategy=strategy)  # type: ignore[arg-type]


def test_topology_is_frozen_hashable_and_comparable() -> None:
    a = build_topology(8, pp=2, tp=2, placement_strategy="cluster")
    b = build_topology(8, pp=2, tp=2, placement_strategy="DPT")
    a.groups(GroupKind.DP)  # fills a's cache only
    assert a == b
    assert hash(a) == hash(b)
    assert a != build_topology(8, pp=2, tp=2, placement_strategy="spread")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.world_size = 4  # type: ignore[misc]
    assert isinstance(a.coords(0), RankCoords)


def test_describe() -> None:
    text = build_topology(8, pp=2, tp=2, placement_strategy="cluster", ranks_per_node=4).describe()
    lines = text.splitlines()
    assert "8 ranks = pp 2 x tp 2 x rdp 2" in lines[0]
    assert "'DPT'" in lines[0]
    assert "tp varies fastest" in lines[0]
    assert "2 nodes" in lines[0]
    assert lines[1].split() == ["rank", "node", "local", "pp", "tp", "rdp", "dp", "mp"]
    assert lines[2 + 5].split() == ["5", "1", "1", "0", "1", "1", "3", "1"]
    assert "TP groups:   [0, 1], [2, 3], [4, 5], [6, 7]" in text
    assert "DP groups:   [0, 1, 4, 5], [2, 3, 6, 7]" in text
    short = build_topology(2, tp=2).describe(with_groups=False)
    assert "groups" not in short
    assert len(short.splitlines()) == 4


def test_import_does_not_start_mpi() -> None:
    # Importing mp_comm must not import mpi4py (which initializes MPI): that happens only when a
    # world is started under an MPI launcher.
    code = "import sys, mp_comm, mp_comm.topology; assert 'mpi4py' not in sys.modules, 'mpi4py imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


# ----------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"world_size": 0}, ["world_size=0", "int >= 1", "launch at least one process"]),
        ({"world_size": -3}, ["world_size=-3", "int >= 1"]),
        ({"world_size": 2.0}, ["world_size=2.0", "int >= 1"]),
        ({"world_size": True}, ["world_size=True", "int >= 1"]),
        ({"world_size": 8, "pp": 0}, ["pp=0", "int >= 1", "pipeline_parallel_degree"]),
        ({"world_size": 8, "tp": -1}, ["tp=-1", "int >= 1", "tensor_parallel_degree"]),
        (
            {"world_size": 6, "pp": 2, "tp": 2},
            ["world_size=6", "pp*tp=4", "multiple of 4", "one of 1, 2, 3, 6"],
        ),
        ({"world_size": 3, "pp": 2}, ["world_size=3", "pp*tp=2"]),
        (
            {"world_size": 8, "ranks_per_node": 3},
            ["ranks_per_node=3", "world_size=8", "one of 1, 2, 4, 8", "or None"],
        ),
        ({"world_size": 8, "ranks_per_node": 0}, ["ranks_per_node=0", "int >= 1"]),
        ({"world_size": 8, "ranks_per_node": 16}, ["ranks_per_node=16", "does not divide"]),
    ],
)
def test_build_errors(kwargs: dict[str, object], fragments: list[str]) -> None:
    with pytest.raises(TopologyError) as info:
        build_topology(**kwargs)  # type: ignore[arg-type]
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_error_classes() -> None:
    assert issubclass(TopologyError, ValueError)
    assert issubclass(TopologyError, MPCommError)
    assert issubclass(MPCommError, Exception)


def test_query_errors() -> None:
    topo = build_topology(8, pp=2, tp=2)
    for bad in (-1, 8, 1.0, None):
        with pytest.raises(TopologyError, match=r"rank=.* is out of range: expected an int in \[0, 8\)"):
            topo.coords(bad)  # type: ignore[arg-type]
    with pytest.raises(TopologyError, match="rank=9"):
        topo.group(GroupKind.DP, 9)
    with pytest.raises(TopologyError, match="rank=-1"):
        topo.rank_in_group(GroupKind.DP, -1)
    with pytest.raises(TopologyError, match="rank=8"):
        topo.local_size(8)
    with pytest.raises(TopologyError, match=r"tp_rank=2 is out of range: expected an int in \[0, 2\)"):
        topo.rank_of(pp_rank=0, tp_rank=2, rdp_rank=0)
    with pytest.raises(TopologyError, match="rdp_rank=-1"):
        topo.rank_of(pp_rank=0, tp_rank=0, rdp_rank=-1)
    with pytest.raises(TopologyError, match=r"index=4 is out of range for the DP group of rank 0"):
        topo.group_member(GroupKind.DP, 0, 4)
    with pytest.raises(TopologyError, match="kind='DP' is not a group kind"):
        topo.groups("DP")  # type: ignore[arg-type]


def test_inconsistent_direct_construction() -> None:
    good = build_topology(8, pp=2, tp=2)
    with pytest.raises(TopologyError, match=r"Topology\.dp_size=3 is inconsistent"):
        dataclasses.replace(good, dp_size=3)
    with pytest.raises(TopologyError, match=r"Topology\.world_size=16 is inconsistent"):
        dataclasses.replace(good, world_size=16)
    with pytest.raises(TopologyError, match=r"Topology\.placement='cluster' is not normalized"):
        dataclasses.replace(good, placement="cluster")
    with pytest.raises(TopologyError, match="ranks_per_node=3"):
        dataclasses.replace(good, ranks_per_node=3)
