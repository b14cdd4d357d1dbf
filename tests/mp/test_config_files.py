"""The config checks that concern files and JSON text: duplicate keys, atp_topology, partition_file,
and the bound on microbatches. Each fails at smp.init, before any process group, naming the value."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mp.config import ATP_TOPOLOGY_CHOICES, ModelParallelConfig, check_paths, load_config
from mp.config_model import MAX_MICROBATCHES
from mp.errors import ConfigError

AUTO = {"tensor_parallel_degree": 2, "atp_mesh": "auto"}


def test_microbatches_beyond_the_bound_are_refused_naming_the_value() -> None:
    assert load_config({"microbatches": MAX_MICROBATCHES}).microbatches == 2**20
    with pytest.raises(ConfigError) as info:
        load_config({"microbatches": 10**12})
    text = str(info.value)
    assert "'microbatches'" in text and "1000000000000" in text and "<= 1048576" in text, text


DUPLICATE = '{"pipeline_parallel_degree": 2, "microbatches": 2, "microbatches": 4}'
NESTED = '{"smdistributed": {"modelparallel": {"enabled": true, "parameters": {"ddp": true, "ddp": false}}}}'


@pytest.mark.parametrize("where", ["string", "file", "MP_CONFIG", "MP_CONFIG file", "SM_HP_MP_PARAMETERS"])
def test_a_key_given_twice_in_json_is_refused_naming_it(where: str, tmp_path: Path) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(DUPLICATE)
    with pytest.raises(ConfigError) as info:
        if where == "string":
            load_config(DUPLICATE)
        elif where == "file":
            load_config(str(path))
        elif where == "MP_CONFIG":
            load_config(environ={"MP_CONFIG": DUPLICATE})
        elif where == "MP_CONFIG file":
            load_config(environ={"MP_CONFIG": str(path)})
        else:
            load_config(environ={"SM_HP_MP_PARAMETERS": DUPLICATE})
    text = str(info.value)
    assert info.value.key == "microbatches"
    assert "'microbatches'" in text and "twice" in text and "first 2, then 4" in text, text


def test_a_duplicate_inside_sagemakers_nesting_is_refused_too() -> None:
    with pytest.raises(ConfigError, match=r"'ddp'.*twice.*first True, then False"):
        load_config(NESTED)


def test_the_same_key_in_different_objects_is_not_a_duplicate() -> None:
    text = '{"smdistributed": {"modelparallel": {"parameters": {"microbatches": 2}}}, "mpi": {"a": 1}}'
    assert load_config(text).microbatches == 2


@pytest.mark.parametrize("topology", [None, *ATP_TOPOLOGY_CHOICES])
def test_atp_topology_presets_pass(topology: str | None) -> None:
    check_paths(ModelParallelConfig.from_dict({**AUTO, "atp_topology": topology}), rank=0)


@pytest.mark.parametrize("topology", ["infiniband", "/nope.json"])
def test_an_unknown_atp_topology_lists_the_choices(topology: str) -> None:
    cfg = ModelParallelConfig.from_dict({**AUTO, "atp_topology": topology})  # a path: known only at init
    with pytest.raises(ConfigError) as info:
        check_paths(cfg, rank=1)
    text = str(info.value)
    assert f"got {topology!r}" in text and "neither a preset nor an existing file" in text, text
    assert all(repr(choice) in text for choice in ATP_TOPOLOGY_CHOICES), text


def test_a_saved_atp_topology_is_read_and_a_broken_one_refused(tmp_path: Path) -> None:
    from mp_tensor import atp

    good = tmp_path / "topology.json"
    atp.nvswitch_node(2).save(good)
    check_paths(ModelParallelConfig.from_dict({**AUTO, "atp_topology": str(good)}), rank=0)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"layers": "none"}))
    cfg = ModelParallelConfig.from_dict({**AUTO, "atp_topology": str(broken)})
    with pytest.raises(ConfigError, match="cannot be read as a saved topology"):
        check_paths(cfg, rank=0)


def test_partition_file_in_a_missing_folder_is_refused_on_rank_0(tmp_path: Path) -> None:
    path = str(tmp_path / "missing" / "partition.json")
    cfg = ModelParallelConfig.from_dict({"pipeline_parallel_degree": 2, "partition_file": path})
    with pytest.raises(ConfigError) as info:
        check_paths(cfg, rank=0)
    text = str(info.value)
    folder = str(tmp_path / "missing")
    assert "'partition_file'" in text and f"its folder {folder!r} does not exist" in text, text
    check_paths(cfg, rank=1)  # only rank 0 writes it
    one_stage = ModelParallelConfig.from_dict({"partition_file": path})
    check_paths(one_stage, rank=0)  # nothing is partitioned with one stage


def test_partition_file_under_a_file_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    params = {"pipeline_parallel_degree": 2, "partition_file": f"{blocker}/p.json"}
    cfg = ModelParallelConfig.from_dict(params)
    with pytest.raises(ConfigError, match="does not exist"):
        check_paths(cfg, rank=0)


def test_partition_file_in_a_writable_folder_passes(tmp_path: Path) -> None:
    cfg = ModelParallelConfig.from_dict(
        {"pipeline_parallel_degree": 2, "partition_file": str(tmp_path / "p.json")}
    )
    check_paths(cfg, rank=0)


def test_load_partition_needs_a_readable_file(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    cfg = ModelParallelConfig.from_dict(
        {"pipeline_parallel_degree": 2, "partition_file": str(path), "load_partition": True}
    )
    with pytest.raises(ConfigError, match="no readable file there"):
        check_paths(cfg, rank=0)
    path.write_text("{}")
    check_paths(cfg, rank=0)  # its content is checked against the model when it is read
