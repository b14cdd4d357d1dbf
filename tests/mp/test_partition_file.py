"""mp.partition_file: the partition decision as a JSON file (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mp.errors import IncompatibleCheckpointFoundError, PartitionFileError
from mp.partition_file import check_assignment, read_partition, write_partition

MODULES = ["", "a", "b", "b.inner", "c"]


def test_round_trip(tmp_path: Path) -> None:
    path = str(tmp_path / "p.json")
    write_partition(path, {"b": 1, "": 0, "c": 1}, pp=2)
    assert read_partition(path, MODULES, 2) == {"": 0, "b": 1, "c": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # no temporary file left


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{not json", "cannot be read as JSON"),
        (json.dumps({"partition": {"a": 0}}), "not a partition written by mp"),
        (json.dumps([1, 2]), "not a partition written by mp"),
        (
            json.dumps({"format": "mp-partition/1", "pipeline_parallel_degree": 4, "partition": {}}),
            "pipeline_parallel_degree=4; this job runs with 2",
        ),
        (
            json.dumps({"format": "mp-partition/1", "pipeline_parallel_degree": 2, "partition": {"a": 2}}),
            "pp_ranks [2] do not exist at pipeline_parallel_degree=2",
        ),
        (
            json.dumps({"format": "mp-partition/1", "pipeline_parallel_degree": 2, "partition": {"z": 1}}),
            "modules ['z'] are not in this model",
        ),
        (
            json.dumps({"format": "mp-partition/1", "pipeline_parallel_degree": 2, "partition": {"a": True}}),
            "expected a {module path: pp_rank} dict",
        ),
    ],
)
def test_bad_files_name_the_file_and_the_fix(tmp_path: Path, content: str, words: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(PartitionFileError) as info:
        read_partition(str(path), MODULES, 2)
    message = str(info.value)
    assert words in message and str(path) in message and "Fix: " in message, message


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PartitionFileError, match=r"does not exist .*load_partition"):
        read_partition(str(tmp_path / "nope.json"), MODULES, 2)


def test_check_assignment_raises_the_callers_error() -> None:
    with pytest.raises(IncompatibleCheckpointFoundError, match="the state's entry holds a partition"):
        check_assignment(
            {"x": 0}, MODULES, 2, source="the state's entry", fix="f", error=IncompatibleCheckpointFoundError
        )
