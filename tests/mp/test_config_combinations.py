"""Every refused combination of config keys (mp.config_combinations.REFUSED) raises its ConfigError,
naming its keys, from the config itself; docs/config.md lists every row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mp.config_combinations import REFUSED, REFUSED_USES
from mp.config_model import ModelParallelConfig
from mp.errors import ConfigError, SMPUnsupportedError, SMPValidationError

# One config per row that asks for that combination and nothing else refused (row key -> smp keys).
EXAMPLES: dict[str, dict[str, Any]] = {
    "active_microbatches above microbatches": {"microbatches": 2, "active_microbatches": 3},
    "atp_mesh with tensor_parallel_degree 1": {"atp_mesh": "1x1"},
    "atp_topology without atp_mesh 'auto'": {"tensor_parallel_degree": 2, "atp_topology": "pcie"},
    "auto_partition false without default_partition": {
        "pipeline_parallel_degree": 2,
        "auto_partition": False,
    },
    "bf16 with fp16 or fp16_params": {"bf16": True, "fp16": True},
    "ddp with horovod": {"ddp": True, "horovod": True},
    "default_partition not below pipeline_parallel_degree": {
        "pipeline_parallel_degree": 2,
        "default_partition": 2,
    },
    "load_partition without partition_file": {"load_partition": True},
    "pipeline 'zero_bubble' with tensor parallelism": {
        "pipeline": "zero_bubble",
        "tensor_parallel_degree": 2,
    },
    "prescaled_batch without optimize 'speed'": {"prescaled_batch": True, "optimize": "memory"},
    "shard_optimizer_state with sharded data parallelism": {
        "shard_optimizer_state": True,
        "sharded_data_parallel_degree": 2,
    },
    "sharded data parallelism with pipeline parallelism": {
        "sharded_data_parallel_degree": 2,
        "pipeline_parallel_degree": 2,
    },
}

ROOT = Path(__file__).resolve().parents[2]


def test_every_row_has_an_example_and_the_rows_are_in_key_order() -> None:
    assert sorted(row.combination for row in REFUSED) == sorted(EXAMPLES)
    assert [row.key for row in REFUSED] == sorted(row.key for row in REFUSED)


@pytest.mark.parametrize("row", REFUSED, ids=lambda row: row.combination)
def test_each_row_raises_its_error_naming_the_keys(row: Any) -> None:
    params = EXAMPLES[row.combination]
    with pytest.raises(ConfigError) as info:
        ModelParallelConfig.from_dict(params)
    message = str(info.value)
    assert info.value.key == row.key
    assert f"config key '{row.key}'" in message
    assert any(f"'{other}'" in message for other in row.others), (row.others, message)
    assert "Allowed:" in message and "Fix:" in message
    assert info.value.fix == row.fix(_unchecked(params))


def test_docs_list_every_row() -> None:
    text = (ROOT / "docs" / "config.md").read_text()
    rows = [row.combination for row in REFUSED] + [use.combination for use in REFUSED_USES.values()]
    missing = [combination for combination in rows if f"| {combination} |" not in text]
    assert not missing, f"docs/config.md's refused-combination tables lack {missing}"


@pytest.mark.parametrize("name", sorted(REFUSED_USES))
def test_each_refused_use_names_the_call_why_and_the_fix(name: str) -> None:
    use = REFUSED_USES[name]
    error = use.refusal("the call under the settings")
    assert isinstance(error, use.error) and isinstance(error, SMPUnsupportedError | SMPValidationError)
    assert str(error) == f"the call under the settings: {use.why}. Fix: {use.fix}"
    assert use.keys and all(key in ModelParallelConfig.specs() for key in use.keys), use.keys


def _unchecked(params: dict[str, Any]) -> ModelParallelConfig:
    """A config holding ``params`` without running the rules (to render a row's texts)."""
    cfg = object.__new__(ModelParallelConfig)
    for key, (name, _) in ModelParallelConfig.specs().items():
        default = ModelParallelConfig.__dataclass_fields__[name].default
        object.__setattr__(cfg, name, params.get(key, default))
    return cfg
