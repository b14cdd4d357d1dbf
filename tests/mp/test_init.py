"""smp.init, the rank API and the communication API on real multi-process worlds."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mp as smp
from mp_comm import GroupKind, build_topology


def _ranks_after_init(world: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    smp.init(cfg)
    out = {
        name: getattr(smp, name)()
        for name in (
            "rank",
            "size",
            "local_rank",
            "local_size",
            "pp_rank",
            "pp_size",
            "tp_rank",
            "tp_size",
            "rdp_rank",
            "rdp_size",
            "dp_rank",
            "dp_size",
            "mp_rank",
            "mp_size",
        )
    }
    for kind in ("pp", "tp", "rdp", "dp", "mp"):
        ranks = getattr(smp, f"get_{kind}_group")()
        pg = getattr(smp, f"get_{kind}_process_group")()
        # the torch group really contains exactly these ranks, in this order
        out[f"{kind}_group"] = ranks
        out[f"{kind}_pg_rank"] = dist.get_rank(pg)
        t = torch.tensor([float(smp.rank())])
        dist.all_reduce(t, group=pg)
        out[f"{kind}_sum"] = t.item()
    out["world_group"] = smp.get_world_group()
    return out


@pytest.mark.parametrize(
    ("n", "cfg"),
    [
        (2, {"pipeline_parallel_degree": 2}),
        (2, {"tensor_parallel_degree": 2, "ddp": True}),
        (4, {"pipeline_parallel_degree": 2, "ddp": True}),
        (4, {"pipeline_parallel_degree": 2, "placement_strategy": "spread", "ddp": True}),
        (4, {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "placement_strategy": "PTD"}),
        (4, {"tensor_parallel_degree": 2, "placement_strategy": "TDP"}),
    ],
)
def test_ranks_and_groups_match_the_topology(worlds: Any, n: int, cfg: dict[str, Any]) -> None:
    results = worlds.run(n, _ranks_after_init, cfg)
    pp, tp = cfg.get("pipeline_parallel_degree", 1), cfg.get("tensor_parallel_degree", 1)
    topo = build_topology(n, pp, tp, cfg.get("placement_strategy", "cluster"))
    for r, res in enumerate(results):
        c = topo.coords(r)
        assert res["rank"] == r and res["size"] == n
        assert res["local_rank"] == r and res["local_size"] == n
        assert (res["pp_rank"], res["tp_rank"], res["rdp_rank"]) == (c.pp_rank, c.tp_rank, c.rdp_rank)
        assert (res["dp_rank"], res["mp_rank"]) == (c.dp_rank, c.mp_rank)
        assert res["pp_size"] * res["tp_size"] * res["rdp_size"] == n
        assert res["mp_size"] * res["rdp_size"] == n and res["pp_size"] * res["dp_size"] == n
        assert set(res["tp_group"]) <= set(res["dp_group"])
        assert res["world_group"] == list(range(n))
        for kind, gk in (
            ("pp", GroupKind.PP),
            ("tp", GroupKind.TP),
            ("rdp", GroupKind.RDP),
            ("dp", GroupKind.DP),
            ("mp", GroupKind.MP),
        ):
            assert res[f"{kind}_group"] == list(topo.group(gk, r))
            assert res[f"{kind}_pg_rank"] == topo.rank_in_group(gk, r)
            assert res[f"{kind}_sum"] == sum(topo.group(gk, r))


def _comm_api(world: Any) -> dict[str, Any]:
    smp.init({"pipeline_parallel_degree": 2, "ddp": True})
    out: dict[str, Any] = {}
    out["allgather_dp"] = smp.allgather({"r": smp.rank()}, smp.DP_GROUP)
    out["allgather_world"] = smp.allgather(torch.tensor([smp.rank()]), smp.CommGroup.WORLD)
    out["gather_mp"] = smp.gather(smp.rank() * 2, smp.MP_GROUP, rank=1)
    # pp_rank 0 broadcasts to its pipeline group; the other stage receives by PP rank.
    if smp.pp_rank() == 0:
        smp.broadcast(("hello", smp.rank(), torch.ones(2) * smp.rank()), smp.PP_GROUP)
    else:
        msg = smp.recv_from(0, smp.RankType.PP_RANK)
        out["from_stage0"] = (msg[0], msg[1], msg[2].tolist())
    # point-to-point by data-parallel rank, then a reply back
    if smp.dp_rank() == 0:
        smp.send([smp.rank()], 1, smp.RankType.DP_RANK)
        out["reply"] = smp.recv_from(1, smp.RankType.DP_RANK)
    else:
        got = smp.recv_from(0, smp.RankType.DP_RANK)
        smp.send([*got, smp.rank()], 0, smp.RankType.DP_RANK)
    for barrier in (
        smp.barrier,
        smp.dp_barrier,
        smp.mp_barrier,
        smp.pp_barrier,
        smp.tp_barrier,
        smp.rdp_barrier,
    ):
        barrier()
    with pytest.raises(smp.CommGroupConfigError, match="is not a CommGroup"):
        smp.allgather(1, "dp")  # type: ignore[arg-type]
    with pytest.raises(smp.CommGroupConfigError, match="outside"):
        smp.send(1, 5, smp.RankType.DP_RANK)
    return out


def test_communication_api(worlds: Any) -> None:
    results = worlds.run(4, _comm_api)
    topo = build_topology(4, 2, 1, "cluster")
    for r, res in enumerate(results):
        dp = topo.group(GroupKind.DP, r)
        assert res["allgather_dp"] == [{"r": m} for m in dp]
        assert [t.item() for t in res["allgather_world"]] == [0, 1, 2, 3]
        mp_group = topo.group(GroupKind.MP, r)
        assert res["gather_mp"] == ([m * 2 for m in mp_group] if r == mp_group[1] else None)
        if topo.coords(r).pp_rank == 1:
            src = topo.group(GroupKind.PP, r)[0]
            assert res["from_stage0"] == ("hello", src, [float(src)] * 2)
        if topo.coords(r).dp_rank == 0:
            assert res["reply"] == [r, dp[1]]


def _bad_world(world: Any) -> str:
    try:
        smp.init({"pipeline_parallel_degree": 3})
    except smp.WorkerSizeError as exc:
        assert not smp.is_initialized()
        return str(exc)
    return "no error"


def test_world_that_does_not_fit_fails_identically_everywhere(worlds: Any) -> None:
    messages = worlds.run(2, _bad_world)
    assert messages[0] == messages[1]
    assert "world size 2" in messages[0] and "pipeline_parallel_degree (3)" in messages[0]


def _second_init_is_ignored(world: Any) -> tuple[int, int]:
    smp.init({"pipeline_parallel_degree": 2})
    smp.init({"pipeline_parallel_degree": 1})
    return smp.pp_size(), smp.state.cfg.pipeline_parallel_degree if smp.state.cfg else -1


def test_second_init_is_ignored(worlds: Any) -> None:
    assert worlds.run(2, _second_init_is_ignored) == [(2, 2), (2, 2)]


@pytest.mark.parametrize(
    "call",
    [
        smp.rank,
        smp.size,
        smp.pp_rank,
        smp.tp_size,
        smp.get_dp_group,
        smp.get_tp_process_group,
        smp.barrier,
        lambda: smp.allgather(1, smp.WORLD),
    ],
)
def test_everything_before_init_raises_not_initialized(call: Any) -> None:
    assert not smp.is_initialized()
    with pytest.raises(smp.NotInitializedError, match="smp is not initialized"):
        call()


def test_single_process_world_works_without_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    # Multi-rank tests run in their own processes; nothing in the pytest process may leave a group behind.
    assert not dist.is_initialized(), "an earlier test left torch.distributed initialized in this process"
    hook = sys.excepthook
    for _ in range(2):  # a second world in the same process starts as cleanly as the first
        smp.init({})
        try:
            assert (smp.rank(), smp.size(), smp.pp_size(), smp.dp_size()) == (0, 1, 1, 1)
            assert smp.allgather("x", smp.DP_GROUP) == ["x"]
            smp.barrier()
        finally:
            smp.shutdown()
        assert not smp.is_initialized() and not dist.is_initialized()
        # torch chains a rank-prefixing excepthook at every init_process_group; shutdown takes it off
        assert sys.excepthook is hook


def _atp_mesh_from_config(world: Any, atp_mesh: str, atp_topology: str | None) -> tuple[int, int]:
    from mp_tensor import atp

    cfg: dict[str, Any] = {"tensor_parallel_degree": 4, "atp_mesh": atp_mesh}
    if atp_topology is not None:
        cfg["atp_topology"] = atp_topology
    smp.init(cfg)
    mesh = atp.get_mesh()
    assert mesh is smp.state.atp_mesh
    # the mesh is usable: an ATPLinear on it matches the global layer
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 16)
    layer = atp.ATPLinear(8, 16, atp.COLUMN_FIRST, mesh=mesh)
    layer.load_global(ref.weight.detach(), ref.bias.detach())
    x = torch.randn(4, 8)
    out = atp.to_global(layer(atp.distribute(x, layer.input_spec, mesh)), layer.output_spec, mesh)
    torch.testing.assert_close(out, ref(x))
    return tuple(mesh.shape)  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("atp_mesh", "atp_topology", "expected"),
    [("2x2", None, (2, 2)), ("4x1", None, (4, 1)), ("auto", "nvswitch", None), ("auto", None, None)],
)
def test_atp_mesh_from_the_config(
    worlds: Any, atp_mesh: str, atp_topology: str | None, expected: Any
) -> None:
    shapes = worlds.run(4, _atp_mesh_from_config, atp_mesh, atp_topology, timeout=180)
    assert len(set(shapes)) == 1
    d1, d2 = shapes[0]
    assert d1 * d2 == 4
    if expected is not None:
        assert shapes[0] == expected
