"""Tests of mp's configuration: the keys, their checks and rules, loading, and the world-size rules."""

from __future__ import annotations

import ast
import inspect
import json
import logging
import math
import pickle
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mp.config_model
import mp.config_rules
import mp.errors
from mp.config import ModelParallelConfig, load_config, validate_world
from mp.errors import (
    ConfigError,
    NotInitializedError,
    SMPConfigError,
    SMPInvalidArgumentError,
    SMPRuntimeError,
    SMPUnsupportedError,
    SMPValidationError,
    WorkerSizeError,
)

KEYS = ModelParallelConfig.all_keys()
SPECS = ModelParallelConfig.specs()
DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def build(**params: object) -> ModelParallelConfig:
    return ModelParallelConfig.from_dict(params)


def rejected(params: Mapping[str, object]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        ModelParallelConfig.from_dict(params)
    return info.value


def assert_message(err: ConfigError, key: str, value: object, *fragments: str) -> None:
    """The message names the key, the value received, what is allowed and the fix."""
    text = str(err)
    assert err.key == key
    assert err.value == value or (isinstance(value, float) and math.isnan(value))
    assert f"'{key}'" in text
    assert repr(value)[:40] in text
    assert "Allowed: " in text and "Fix: " in text
    assert err.allowed and err.allowed in text
    assert err.fix and err.fix in text
    for fragment in fragments:
        assert fragment in text, (fragment, text)


# ------------------------------------------------------------------------------ the key table
# Valid values per key, each with the other keys it needs.
VALID: dict[str, list[tuple[object, dict[str, object]]]] = {
    "pipeline_parallel_degree": [(1, {}), (2, {}), (16, {})],
    "microbatches": [(1, {}), (4, {}), (64, {})],
    "pipeline": [("interleaved", {}), ("simple", {})],
    "optimize": [("memory", {}), ("speed", {})],
    "placement_strategy": [(p, {}) for p in ("cluster", "spread", "DPT", "DTP", "PDT", "PTD", "TDP", "TPD")],
    "auto_partition": [(True, {}), (False, {"default_partition": 0})],
    "default_partition": [(None, {}), (0, {}), (3, {"pipeline_parallel_degree": 4})],
    "contiguous": [(True, {}), (False, {})],
    "horovod": [(True, {}), (False, {})],
    "memory_weight": [(None, {}), (0.0, {}), (0.5, {}), (1.0, {}), (0, {}), (1, {})],
    "ddp": [(True, {}), (False, {})],
    "ddp_port": [(None, {}), (0, {}), (29500, {}), (65535, {})],
    "ddp_dist_backend": [("auto", {}), ("nccl", {}), ("gloo", {})],
    "active_microbatches": [(None, {}), (1, {"microbatches": 4}), (4, {"microbatches": 4})],
    "deterministic_server": [(True, {}), (False, {})],
    "offload_activations": [(True, {}), (False, {})],
    "activation_loading_horizon": [(1, {}), (4, {}), (100, {})],
    "tensor_parallel_degree": [(1, {}), (2, {}), (8, {})],
    "prescaled_batch": [(False, {}), (True, {"optimize": "speed"})],
    "tensor_parallel_seed": [(0, {}), (1234, {}), (2**64 - 1, {})],
    "atp_mesh": [(None, {}), ("auto", {"tensor_parallel_degree": 2}), ("2x2", {"tensor_parallel_degree": 4})],
    "atp_topology": [
        (None, {}),
        ("calibrate", {"tensor_parallel_degree": 2, "atp_mesh": "auto"}),
        ("nvswitch", {"tensor_parallel_degree": 2, "atp_mesh": "auto"}),
    ],
    "fp16": [(True, {}), (False, {})],
    "fp16_params": [(True, {}), (False, {})],
    "bf16": [(True, {}), (False, {})],
    "shard_optimizer_state": [(True, {}), (False, {})],
    "skip_tracing": [(True, {}), (False, {})],
    "delayed_parameter_initialization": [(True, {}), (False, {})],
    "checkpoint_attentions": [(True, {}), (False, {})],
    "sharded_data_parallel_degree": [(1, {}), (2, {}), (8, {})],
    "sdp_reduce_bucket_size": [(1, {}), (500_000_000, {}), (5e8, {})],
    "sdp_param_persistence_threshold": [(0, {}), (1_000_000, {}), (1e6, {})],
    "sdp_max_live_parameters": [(1, {}), (1_000_000_000, {}), (1e9, {})],
    "sdp_hierarchical_allgather": [(True, {}), (False, {})],
    "sdp_gradient_clipping": [(0.0, {}), (1.0, {}), (0.5, {}), (2, {})],
    "fast_mode": [(True, {}), (False, {})],
    "static_mode": [(True, {}), (False, {})],
    "_fp32_grad_accumulation": [(True, {}), (False, {})],
    "_match_weights": [(True, {}), (False, {})],
    "_shard_offloaded_activations": [(True, {}), (False, {})],
    "task_level_activation_loading_horizon": [(None, {}), (0, {}), (4, {})],
    "herring": [(True, {}), (False, {})],
    "load_partition": [(False, {}), (True, {"partition_file": "partition.json"})],
    "partition_file": [(None, {}), ("partition.json", {})],
}
VALID_CASES = [(key, value, extra) for key, values in VALID.items() for value, extra in values]


def test_valid_table_covers_every_key() -> None:
    assert set(VALID) == set(KEYS)
    assert len(KEYS) == len(set(KEYS)) == 44


@pytest.mark.parametrize(
    ("key", "value", "extra"), VALID_CASES, ids=[f"{k}={v!r}" for k, v, _ in VALID_CASES]
)
def test_every_key_accepts_its_valid_values(key: str, value: object, extra: dict[str, object]) -> None:
    cfg = ModelParallelConfig.from_dict({key: value, **extra})
    stored = cfg.to_dict()[key]
    assert stored == value and (
        value is None or isinstance(stored, type(value)) or isinstance(value, int | float)
    )
    assert ModelParallelConfig.from_dict(cfg.to_dict()) == cfg
    name, _ = SPECS[key]
    kwargs: dict[str, Any] = {name: value, **{SPECS[k][0]: v for k, v in extra.items()}}
    assert ModelParallelConfig(**kwargs) == cfg


def test_defaults() -> None:
    cfg = ModelParallelConfig()
    assert cfg == ModelParallelConfig.from_dict({}) == load_config(environ={}) == load_config({})
    d = cfg.to_dict()
    assert list(d) == list(KEYS)
    assert json.loads(json.dumps(d)) == d
    assert (cfg.pp, cfg.tp, cfg.sdp, cfg.mp_size, cfg.partitions) == (1, 1, 1, 1, 1)
    assert (d["microbatches"], d["pipeline"], d["optimize"], d["placement_strategy"]) == (
        1,
        "interleaved",
        "memory",
        "cluster",
    )
    assert d["auto_partition"] is True and d["contiguous"] is True and d["sdp_hierarchical_allgather"] is True
    assert d["activation_loading_horizon"] == 4 and d["ddp_dist_backend"] == "auto"
    assert (
        d["sdp_reduce_bucket_size"],
        d["sdp_param_persistence_threshold"],
        d["sdp_max_live_parameters"],
    ) == (
        5 * 10**8,
        10**6,
        10**9,
    )
    assert d["sdp_gradient_clipping"] == 1.0 and d["tensor_parallel_seed"] == 0
    assert cfg.resolved_memory_weight == 0.8 and cfg.resolved_default_partition == 0
    assert cfg.resolved_active_microbatches == 1 and cfg.resolved_pipeline == "interleaved"
    assert cfg.precision == "fp32" and cfg.placement_order == "DPT"
    assert repr(cfg) == "ModelParallelConfig()"


def test_integral_floats_become_ints_and_ints_become_floats() -> None:
    cfg = build(sdp_reduce_bucket_size=5e8, memory_weight=1, sdp_gradient_clipping=2)
    assert type(cfg.sdp_reduce_bucket_size) is int and cfg.sdp_reduce_bucket_size == 500_000_000
    assert type(cfg.memory_weight) is float and type(cfg.sdp_gradient_clipping) is float
    assert repr(cfg) == (
        "ModelParallelConfig(memory_weight=1.0, sdp_gradient_clipping=2.0)"  # 5e8 is the default
    )


# ---------------------------------------------------------------------------- derived values
def test_memory_weight_default_follows_optimize() -> None:
    assert build(optimize="speed").resolved_memory_weight == 0.2
    assert build(optimize="memory").resolved_memory_weight == 0.8
    assert build(optimize="speed", memory_weight=0.5).resolved_memory_weight == 0.5
    assert build(optimize="speed").memory_weight is None


@pytest.mark.parametrize(
    ("pp", "mb", "expected"), [(1, 1, 1), (1, 8, 3), (2, 8, 4), (4, 4, 4), (4, 16, 6), (8, 2, 2)]
)
def test_active_microbatches_default_is_pp_plus_2_clamped(pp: int, mb: int, expected: int) -> None:
    assert build(pipeline_parallel_degree=pp, microbatches=mb).resolved_active_microbatches == expected


def test_simple_pipeline_is_forced_to_interleaved_when_fewer_microbatches_are_active(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="mp.config"):
        cfg = build(pipeline="simple", microbatches=8, active_microbatches=4)
    assert cfg.pipeline == "simple" and cfg.resolved_pipeline == "interleaved"
    assert any("interleaved" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)
    # Left to its default, active_microbatches covers all microbatches under "simple" (mp's choice).
    cfg = build(pipeline="simple", microbatches=8, pipeline_parallel_degree=2)
    assert cfg.resolved_active_microbatches == 8 and cfg.resolved_pipeline == "simple"
    assert build(pipeline="simple", microbatches=4, active_microbatches=4).resolved_pipeline == "simple"


def test_checkpoint_attentions_is_disabled_with_pipeline_parallelism(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert build(checkpoint_attentions=True).resolved_checkpoint_attentions is True
    with caplog.at_level(logging.INFO, logger="mp.config"):
        cfg = build(checkpoint_attentions=True, pipeline_parallel_degree=2)
    assert cfg.checkpoint_attentions is True and cfg.resolved_checkpoint_attentions is False
    assert any("checkpoint_attentions" in r.getMessage() for r in caplog.records)


def test_fp16_params_logs_a_deprecation(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="mp.config"):
        build(fp16_params=True)
    assert any("deprecated" in r.getMessage() for r in caplog.records)


def test_constructing_a_config_with_unbuilt_keys_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """The config object accepts every valid smp value (it can be read and compared); smp.init refuses."""
    with caplog.at_level(logging.WARNING, logger="mp.config"):
        build(fp16=True, shard_optimizer_state=True, offload_activations=True)
    assert not caplog.records


UNBUILT = [key for key, _, _ in mp.config_rules._NOT_BUILT]
UNBUILT_WITH: dict[str, dict[str, object]] = {
    "shard_optimizer_state": {"bf16": True},
    "sharded_data_parallel_degree": {"bf16": True},
}
"""Keys built only without some other key: the combination that is still refused."""


def test_unbuilt_keys_cover_the_sdp_bucket_size() -> None:
    # sharded data parallelism is built on FSDP2, whose per-block buckets have no size setting
    assert "sdp_reduce_bucket_size" in UNBUILT


@pytest.mark.parametrize("key", UNBUILT)
def test_smp_init_refuses_every_unbuilt_key_set_to_a_non_default(key: str) -> None:
    """Every valid value but smp's default raises a ConfigError at smp.init (before any process group),
    naming the key, what smp did with it and that mp does not build it; the default passes."""
    import mp

    name = SPECS[key][0]
    default = ModelParallelConfig.__dataclass_fields__[name].default
    refused = 0
    for value, needs in VALID[key]:
        extra = {**needs, **UNBUILT_WITH.get(key, {})}
        cfg = build(**{key: value, **extra})
        if getattr(cfg, name) == default:
            mp.config_rules.refuse_not_built(cfg)
            continue
        with pytest.raises(ConfigError) as info:
            mp.init({key: value, **extra})
        message = str(info.value)
        assert f"'{key}'" in message and "mp does not build that yet" in message and "in smp" in message
        assert info.value.key == key and not mp.is_initialized()
        refused += 1
    assert refused >= 1, f"no non-default value of {key} was tried"


def test_the_refusal_names_the_other_unbuilt_keys_too() -> None:
    with pytest.raises(ConfigError) as info:
        mp.config_rules.refuse_not_built(
            build(task_level_activation_loading_horizon=2, shard_offloaded_activations=True)
        )
    assert info.value.key == "_shard_offloaded_activations"
    assert "also set and not built: task_level_activation_loading_horizon" in str(info.value)


def test_derived_properties() -> None:
    cfg = build(partitions=2, tensor_parallel_degree=4, placement_strategy="spread", default_partition=1)
    assert (cfg.pp, cfg.tp, cfg.mp_size, cfg.partitions, cfg.placement_order) == (2, 4, 8, 2, "TPD")
    assert cfg.resolved_default_partition == 1
    assert build(placement_strategy="PTD").placement_order == "PTD"
    assert build(bf16=True).precision == "bf16" and build(fp16=True).precision == "fp16"


# ------------------------------------------------------------------------------ type checks
def _wrong_values(key: str) -> list[object]:
    spec = SPECS[key][1]
    wrong: list[object] = [[1], {"a": 1}]
    if not spec.nullable:
        wrong.append(None)
    if spec.kind == "bool":
        wrong += [1, 0, "true", "True", 1.0]
    elif spec.kind == "int":
        wrong += [True, False, "4", 2.5, "many"]
    elif spec.kind == "float":
        wrong += [True, "0.5", "high"]
    else:
        wrong += [1, True, 2.0]
    return wrong


TYPE_CASES = [(key, value) for key in KEYS for value in _wrong_values(key)]


@pytest.mark.parametrize(("key", "value"), TYPE_CASES, ids=[f"{k}={v!r}" for k, v in TYPE_CASES])
def test_wrong_types_are_rejected_with_the_key_value_and_fix(key: str, value: object) -> None:
    err = rejected({key: value})
    assert isinstance(err, ValueError)
    assert_message(err, key, value, type(value).__name__ if value is not None else "null")
    with pytest.raises(ConfigError) as direct:
        kwargs: dict[str, Any] = {SPECS[key][0]: value}
        ModelParallelConfig(**kwargs)
    assert str(direct.value) == str(err)


def test_type_fixes_are_specific() -> None:
    assert "without quotes" in rejected({"microbatches": "4"}).fix  # type: ignore[operator]
    assert "not a boolean" in rejected({"microbatches": True}).fix  # type: ignore[operator]
    assert "'fp16': true" in rejected({"fp16": 1}).fix  # type: ignore[operator]
    assert "'ddp': false" in rejected({"ddp": 0}).fix  # type: ignore[operator]
    assert "without quotes" in rejected({"ddp": "true"}).fix  # type: ignore[operator]
    assert "whole number" in rejected({"microbatches": 2.5}).fix  # type: ignore[operator]
    assert_message(rejected({"microbatches": 4.0}), "microbatches", 4.0, "an int >= 1")


# ----------------------------------------------------------------------------------- bounds
BOUND_CASES = [
    ("pipeline_parallel_degree", 0, ">= 1"),
    ("partitions", -1, ">= 1"),
    ("microbatches", 0, ">= 1"),
    ("tensor_parallel_degree", 0, ">= 1"),
    ("sharded_data_parallel_degree", 0, ">= 1"),
    ("active_microbatches", 0, ">= 1"),
    ("activation_loading_horizon", 0, ">= 1"),
    ("default_partition", -1, ">= 0"),
    ("memory_weight", -0.1, ">= 0 and <= 1"),
    ("memory_weight", 1.5, "<= 1"),
    ("memory_weight", 2, "<= 1"),
    ("memory_weight", 10**400, "<= 1"),
    ("memory_weight", float("nan"), "finite"),
    ("memory_weight", float("inf"), "finite"),
    ("ddp_port", -1, ">= 0"),
    ("ddp_port", 65536, "<= 65535"),
    ("tensor_parallel_seed", -1, ">= 0"),
    ("tensor_parallel_seed", 2**64, "<= 18446744073709551615"),
    ("sdp_reduce_bucket_size", 0, ">= 1"),
    ("sdp_reduce_bucket_size", 5.5, "an int"),
    ("sdp_reduce_bucket_size", float("inf"), "an int"),
    ("sdp_param_persistence_threshold", -1, ">= 0"),
    ("sdp_max_live_parameters", 0, ">= 1"),
    ("sdp_gradient_clipping", -1.0, ">= 0"),
    ("task_level_activation_loading_horizon", -1, ">= 0"),
]


@pytest.mark.parametrize(
    ("key", "value", "allowed"), BOUND_CASES, ids=[f"{k}={v!r}" for k, v, _ in BOUND_CASES]
)
def test_out_of_range_values_are_rejected(key: str, value: object, allowed: str) -> None:
    assert_message(rejected({key: value}), key, value, allowed)


CHOICE_CASES = [
    ("pipeline", "1f1b", "'interleaved', 'simple'", None),
    ("pipeline", "Simple", "'interleaved', 'simple'", "simple"),
    ("optimize", "sped", "'memory', 'speed'", "speed"),
    ("placement_strategy", "dpt", "'DPT'", "DPT"),
    ("placement_strategy", "DPP", "'cluster', 'spread'", None),
    ("placement_strategy", "clustr", "'TPD'", "cluster"),
    ("ddp_dist_backend", "mpi", "'auto', 'nccl', 'gloo'", None),
    ("ddp_dist_backend", "", "'auto', 'nccl', 'gloo'", None),
]


@pytest.mark.parametrize(("key", "value", "allowed", "close"), CHOICE_CASES)
def test_choices_are_enforced(key: str, value: str, allowed: str, close: str | None) -> None:
    err = rejected({key: value})
    assert_message(err, key, value, allowed, "not an allowed choice")
    if close is not None:
        assert f"did you mean '{close}'?" in str(err)


# ------------------------------------------------------------------------------------ rules
RULE_CASES: list[tuple[dict[str, object], str, object, tuple[str, ...]]] = [
    (
        {"active_microbatches": 5, "microbatches": 4},
        "active_microbatches",
        5,
        ("'microbatches' (4)", "from 1 to microbatches (4)", "at most 4"),
    ),
    (
        {"auto_partition": False},
        "auto_partition",
        False,
        ("'default_partition'", "add 'default_partition': 0"),
    ),
    ({"bf16": True, "fp16": True}, "bf16", True, ("'fp16': true", "set 'fp16' to false")),
    (
        {"bf16": True, "fp16_params": True},
        "bf16",
        True,
        ("'fp16_params': true", "set 'fp16_params' to false"),
    ),
    ({"ddp": True, "horovod": True}, "ddp", True, ("'horovod': true", "remove 'horovod'")),
    ({"default_partition": 2, "partitions": 2}, "default_partition", 2, ("from 0 to 1", "below 2")),
    ({"default_partition": 1}, "default_partition", 1, ("from 0 to 0", "at least 2")),
    ({"load_partition": True}, "load_partition", True, ("'partition_file'",)),
    ({"prescaled_batch": True}, "prescaled_batch", True, ("'optimize': 'memory'", "add 'optimize': 'speed'")),
    (
        {"prescaled_batch": True, "optimize": "memory"},
        "prescaled_batch",
        True,
        ("only with optimize 'speed'",),
    ),
    (
        {"shard_optimizer_state": True, "sharded_data_parallel_degree": 2},
        "shard_optimizer_state",
        True,
        ("'sharded_data_parallel_degree': 2", "remove 'shard_optimizer_state'"),
    ),
    (
        {"sharded_data_parallel_degree": 2, "pipeline_parallel_degree": 2},
        "sharded_data_parallel_degree",
        2,
        ("'pipeline_parallel_degree': 2", "set 'pipeline_parallel_degree' to 1"),
    ),
]


@pytest.mark.parametrize(("params", "key", "value", "fragments"), RULE_CASES, ids=[c[1] for c in RULE_CASES])
def test_rules_between_keys(
    params: dict[str, object], key: str, value: object, fragments: tuple[str, ...]
) -> None:
    assert_message(rejected(params), key, value, *fragments)


def test_deliberate_relaxations_of_smp_rules() -> None:
    # smp required ddp for tensor parallelism, for ddp_port and for shard_optimizer_state; mp does not.
    assert build(tensor_parallel_degree=4).ddp is False
    assert build(ddp_port=1234).ddp_port == 1234
    assert build(shard_optimizer_state=True).shard_optimizer_state
    # sharded data parallelism with tensor parallelism (smp >= 1.15 allowed it).
    assert build(sharded_data_parallel_degree=2, tensor_parallel_degree=2).sdp == 2
    # bf16 without sharded data parallelism; sdp_* keys without sdp; fast and static mode together.
    assert build(bf16=True, fast_mode=True, static_mode=True, sdp_gradient_clipping=0.0).bf16
    validate_world(ModelParallelConfig(), 8, 8, None)  # data parallelism without ddp


def test_first_error_is_deterministic() -> None:
    params: dict[str, object] = {"microbatches": 0, "bf16": "yes", "pipeline": "x", "zeta": 1, "alpha": 2}
    messages = {str(rejected(dict(order))) for order in (params.items(), reversed(params.items()))}
    assert len(messages) == 1 and "'alpha'" in messages.pop()  # unknown keys first, sorted
    params = {"pipeline": "x", "microbatches": 0, "bf16": "yes"}
    assert rejected(params).key == "bf16"  # then each key in sorted order
    assert (
        rejected(
            {"sharded_data_parallel_degree": 2, "shard_optimizer_state": True, "bf16": True, "fp16": True}
        ).key
        == "bf16"
    )


# ----------------------------------------------------------------------- aliases and misspellings
def test_partitions_alias() -> None:
    assert build(partitions=4).pipeline_parallel_degree == 4
    assert build(partitions=4, pipeline_parallel_degree=4).pp == 4
    err = rejected({"partitions": 2, "pipeline_parallel_degree": 4})
    assert err.key == "partitions" and err.value == 2
    for fragment in (
        "'partitions' = 2",
        "'pipeline_parallel_degree' = 4",
        "same setting",
        "remove 'partitions'",
    ):
        assert fragment in str(err)
    assert_message(rejected({"partitions": "2"}), "partitions", "2", "without quotes")
    assert "partitions" not in ModelParallelConfig().to_dict()


def test_internal_keys_take_field_names_too() -> None:
    assert build(_match_weights=True) == build(match_weights=True)
    assert build(fp32_grad_accumulation=True).to_dict()["_fp32_grad_accumulation"] is True
    err = rejected({"_match_weights": True, "match_weights": False})
    assert err.key == "_match_weights"
    assert ModelParallelConfig.aliases() == {
        "partitions": "pipeline_parallel_degree",
        "fp32_grad_accumulation": "_fp32_grad_accumulation",
        "match_weights": "_match_weights",
        "shard_offloaded_activations": "_shard_offloaded_activations",
    }


MISSPELLINGS = [
    ("microbatch", "microbatches"),
    ("Microbatches", "microbatches"),
    ("micro_batches", "microbatches"),
    ("pipeline_parallel_degre", "pipeline_parallel_degree"),
    ("pipeline_paralel_degree", "pipeline_parallel_degree"),
    ("partition", "partitions"),
    ("tensor_parallel_degre", "tensor_parallel_degree"),
    ("sharded_data_parallelism_degree", "sharded_data_parallel_degree"),
    ("activ_microbatches", "active_microbatches"),
    ("fp_16", "fp16"),
    ("placement", "placement_strategy"),
    ("delayed_param_initialization", "delayed_parameter_initialization"),
    ("offload_activation", "offload_activations"),
    ("auto_partitions", "auto_partition"),
]


@pytest.mark.parametrize(("typo", "key"), MISSPELLINGS)
def test_misspelt_keys_get_a_suggestion(typo: str, key: str) -> None:
    err = rejected({typo: 4})
    text = str(err)
    assert err.key == typo and err.value == 4
    assert f"unknown config key '{typo}'" in text
    assert f"did you mean '{key}'?" in text
    assert f"rename '{typo}' to '{key}'" in text
    assert "Allowed: " in text


def test_unknown_keys_without_suggestion_and_special_keys() -> None:
    err = rejected({"completely_unrelated": 1})
    assert "did you mean" not in str(err) and "docs/config.md" in str(err)
    err = rejected({"overlapping_allreduce": True})
    assert "smp.DistributedModel(model, overlapping_allreduce=True)" in str(err)
    err = rejected({"_sharded_data_parallelism_config": {}})
    assert "sdp_" in str(err)
    err = rejected({"smdistributed": {"modelparallel": {}}})
    assert "load_config" in str(err)
    err = rejected({"mpi": {"enabled": True}})
    assert "nesting" in str(err)


def test_bad_mappings() -> None:
    with pytest.raises(ConfigError, match="dict"):
        ModelParallelConfig.from_dict([("microbatches", 2)])  # type: ignore[arg-type]
    err = rejected({3: 4})  # type: ignore[dict-item]
    assert err.value == 3 and "string" in str(err)


# ------------------------------------------------------------------------------------ loading
def test_load_config_from_objects() -> None:
    cfg = ModelParallelConfig(microbatches=2)
    assert load_config(cfg) is cfg
    assert load_config({"partitions": 2}).pp == 2
    assert load_config('{"partitions": 2}').pp == 2
    with pytest.raises(ConfigError, match="config source"):
        load_config(42)  # type: ignore[arg-type]


NESTINGS: list[dict[str, Any]] = [
    {
        "smdistributed": {
            "modelparallel": {"enabled": True, "parameters": {"partitions": 2, "microbatches": 4}}
        }
    },
    {
        "smdistributed": {
            "modelparallel": {"enabled": True, "parameters": {"partitions": 2, "microbatches": 4}}
        },
        "mpi": {"enabled": True, "processes_per_host": 8, "custom_mpi_options": "-verbose"},
    },
    {"modelparallel": {"enabled": True, "parameters": {"partitions": 2, "microbatches": 4}}},
    {"modelparallel": {"parameters": {"partitions": 2, "microbatches": 4}}},
    {"enabled": True, "parameters": {"partitions": 2, "microbatches": 4}},
    {"parameters": {"partitions": 2, "microbatches": 4}},
]


@pytest.mark.parametrize("nested", NESTINGS)
def test_sagemaker_nesting_is_unwrapped(nested: dict[str, Any], tmp_path: Path) -> None:
    expected = ModelParallelConfig(pipeline_parallel_degree=2, microbatches=4)
    assert load_config(nested) == expected
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(nested))
    assert load_config(path) == expected
    assert load_config(environ={"SM_HP_MP_PARAMETERS": json.dumps(nested)}) == expected


BAD_NESTINGS: list[tuple[dict[str, Any], str | None, str]] = [
    ({"smdistributed": {"dataparallel": {"enabled": True}}}, "smdistributed", "'modelparallel'"),
    ({"smdistributed": {"modelparallel": {}, "dataparallel": {}}}, "dataparallel", "'smdistributed'"),
    (
        {"smdistributed": {"modelparallel": {}}, "torch_distributed": {}},
        "torch_distributed",
        "distribution dict",
    ),
    ({"modelparallel": {"enabled": False, "parameters": {}}}, "enabled", "true"),
    ({"modelparallel": {"enabled": "yes"}}, "enabled", "true"),
    ({"modelparallel": {"parameters": [1]}}, "parameters", "a dict"),
    ({"modelparallel": {"params": {}}}, "params", "'modelparallel'"),
    ({"modelparallel": 3}, "modelparallel", "a dict"),
    ({"modelparallel": {"parameters": {"microbatch": 2}}}, "microbatch", "did you mean 'microbatches'?"),
]


@pytest.mark.parametrize(("nested", "key", "fragment"), BAD_NESTINGS)
def test_bad_nesting_is_rejected(nested: dict[str, Any], key: str | None, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(nested)
    assert info.value.key == key and fragment in str(info.value)
    assert "Fix: " in str(info.value)


def test_load_config_from_files(tmp_path: Path) -> None:
    path = tmp_path / "mp.json"
    path.write_text('{"pipeline_parallel_degree": 2, "ddp": true, "memory_weight": 1}')
    expected = ModelParallelConfig(pipeline_parallel_degree=2, ddp=True, memory_weight=1.0)
    assert load_config(path) == load_config(str(path)) == expected

    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(missing) in str(info.value) and "no such config file" in str(info.value)
    assert info.value.value == str(missing)

    broken = tmp_path / "broken.json"
    broken.write_text('{"microbatches": 2,}')
    with pytest.raises(ConfigError) as info:
        load_config(broken)
    assert str(broken) in str(info.value) and "not valid JSON" in str(info.value)

    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(listed)

    bad_value = tmp_path / "bad.json"
    bad_value.write_text('{"microbatches": 0}')
    with pytest.raises(ConfigError) as info:
        load_config(bad_value)
    assert info.value.key == "microbatches" and str(bad_value) in str(info.value)

    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path)  # a directory


def test_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mp_json = '{"pipeline_parallel_degree": 4}'
    sm_json = '{"partitions": 2, "microbatches": 8}'
    assert load_config(environ={"MP_CONFIG": mp_json}).pp == 4
    assert load_config(environ={"MP_CONFIG": mp_json, "SM_HP_MP_PARAMETERS": sm_json}).pp == 4
    assert load_config(environ={"SM_HP_MP_PARAMETERS": sm_json}).microbatches == 8
    assert load_config(environ={"MP_CONFIG": "  ", "SM_HP_MP_PARAMETERS": sm_json}).pp == 2
    assert load_config(environ={"UNRELATED": "1"}) == ModelParallelConfig()

    path = tmp_path / "from_env.json"
    path.write_text('{"smdistributed": {"modelparallel": {"parameters": {"microbatches": 3}}}}')
    assert load_config(environ={"MP_CONFIG": str(path)}).microbatches == 3
    assert load_config(environ={"MP_CONFIG": f" {path}\n"}).microbatches == 3

    with pytest.raises(ConfigError) as info:
        load_config(environ={"MP_CONFIG": str(tmp_path / "missing.json")})
    assert "MP_CONFIG" in str(info.value) and "missing.json" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(environ={"SM_HP_MP_PARAMETERS": "{partitions: 2}"})
    assert "SM_HP_MP_PARAMETERS" in str(info.value) and "not valid JSON" in str(info.value)
    with pytest.raises(ConfigError) as info:
        load_config(environ={"MP_CONFIG": '{"microbatchs": 2}'})
    assert "MP_CONFIG" in str(info.value) and "did you mean 'microbatches'?" in str(info.value)

    monkeypatch.delenv("MP_CONFIG", raising=False)
    monkeypatch.setenv("SM_HP_MP_PARAMETERS", sm_json)
    assert load_config().microbatches == 8
    monkeypatch.setenv("MP_CONFIG", mp_json)
    assert load_config().pp == 4


def test_round_trips() -> None:
    cfg = build(partitions=2, microbatches=8, optimize="speed", prescaled_batch=True, _match_weights=True)
    assert ModelParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert ModelParallelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert load_config(json.dumps(cfg.to_dict())) == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert hash(cfg) == hash(ModelParallelConfig.from_dict(cfg.to_dict()))
    with pytest.raises(AttributeError):
        cfg.microbatches = 2  # type: ignore[misc]


# ------------------------------------------------------------------------------- world rules
@pytest.mark.parametrize(
    ("params", "world", "local", "gpus"),
    [
        ({}, 1, 1, None),
        ({}, 8, 8, 8),
        ({"partitions": 2, "tensor_parallel_degree": 2}, 4, 4, 0),
        ({"partitions": 2, "tensor_parallel_degree": 2}, 16, 8, 8),
        ({"partitions": 2}, 6, 6, None),
        ({"sharded_data_parallel_degree": 4}, 8, 8, 8),
        ({"sharded_data_parallel_degree": 8}, 8, 4, 4),
        ({}, 4, 4, 0),
        ({}, 16, 16, None),
    ],
)
def test_world_sizes_that_fit(params: dict[str, object], world: int, local: int, gpus: int | None) -> None:
    validate_world(ModelParallelConfig.from_dict(params), world, local, gpus)


WORLD_CASES: list[tuple[dict[str, object], int, int, int | None, tuple[str, ...]]] = [
    (
        {"partitions": 2, "tensor_parallel_degree": 2},
        2,
        2,
        None,
        ("world size 2 is smaller than", "= 4", "launch 4"),
    ),
    (
        {"partitions": 2, "tensor_parallel_degree": 2},
        6,
        6,
        None,
        ("not a multiple of", "launch 4 or 8 processes"),
    ),
    ({"partitions": 4}, 10, 10, None, ("not a multiple of", "launch 8 or 12")),
    (
        {"sharded_data_parallel_degree": 3},
        8,
        8,
        None,
        ("does not divide", "1, 2, 4, 8", "'sharded_data_parallel_degree'"),
    ),
    ({"sharded_data_parallel_degree": 16}, 8, 8, None, ("sharded_data_parallel_degree 16", "size 8")),
    ({}, 8, 8, 4, ("8 processes", "only 4 GPUs", "at most 4 processes per host")),
    ({}, 0, 1, None, ("world_size must be an int >= 1",)),
    ({}, 2, 0, None, ("local_size must be an int >= 1",)),
    ({}, 2, 4, None, ("local_size 4 is larger than world_size 2",)),
    ({}, 2, 2, -1, ("local_gpus must be None or an int >= 0",)),
    ({}, True, 1, None, ("world_size must be an int",)),
]


@pytest.mark.parametrize(("params", "world", "local", "gpus", "fragments"), WORLD_CASES)
def test_world_sizes_that_do_not_fit(
    params: dict[str, object], world: int, local: int, gpus: int | None, fragments: tuple[str, ...]
) -> None:
    with pytest.raises(WorkerSizeError) as info:
        validate_world(ModelParallelConfig.from_dict(params), world, local, gpus)
    assert isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    assert "Fix: " in str(info.value)


# ----------------------------------------------------------------------------------- errors
def test_exception_hierarchy() -> None:
    e = mp.errors
    assert issubclass(ConfigError, SMPInvalidArgumentError) and issubclass(ConfigError, SMPConfigError)
    assert issubclass(SMPInvalidArgumentError, SMPValidationError) and issubclass(
        SMPValidationError, ValueError
    )
    assert issubclass(SMPConfigError, ValueError) and issubclass(WorkerSizeError, SMPValidationError)
    for name in (
        "NotInitializedError",
        "CommGroupConfigError",
        "SMPCheckpointError",
    ):
        assert issubclass(getattr(e, name), SMPValidationError)
    for name in ("MissingCheckpointFilesError", "IncompatibleCheckpointRankFoundError"):
        assert issubclass(getattr(e, name), e.SMPCheckpointError)
    assert issubclass(e.IncompatibleCheckpointFoundError, e.SMPCheckpointError)
    for name in ("NotSupportedByFastModeError", "DelayedParamDeviceError"):
        assert issubclass(getattr(e, name), SMPUnsupportedError)
    # raised below the facade and re-exported under smp's names, with smp's builtin bases
    for name in ("UnsupportedTPModuleError", "TPModuleRegisterError"):
        assert issubclass(getattr(e, name), RuntimeError)
    for name in ("InvalidPartitionIDError", "DistEmbeddingConfigError", "DistTransformerConfigError"):
        assert issubclass(getattr(e, name), ValueError)
    assert issubclass(SMPUnsupportedError, RuntimeError) and issubclass(e.TensorSplitError, SMPRuntimeError)
    assert str(NotInitializedError()) == "smp is not initialized! Call smp.init(config) first."
    for name in e.__all__:
        cls = getattr(e, name)
        assert issubclass(cls, Exception) and cls.__doc__ and cls.__doc__.strip().splitlines()[0], name


def test_config_error_pickles_with_its_fields() -> None:
    err = rejected({"microbatches": 0})
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ConfigError and str(back) == str(err)
    assert (back.key, back.value, back.allowed, back.fix) == (err.key, err.value, err.allowed, err.fix)


# -------------------------------------------------------------------------- docs and schema
def test_every_field_has_an_attribute_docstring() -> None:
    tree = ast.parse(inspect.getsource(mp.config_model))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelParallelConfig")
    documented = set()
    for node, after in zip(cls.body, cls.body[1:], strict=False):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if (
            isinstance(target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
        ):
            documented.add(target.id)
    assert {name for name, _ in SPECS.values()} <= documented


def test_docs_page_lists_every_key() -> None:
    text = DOCS.read_text(encoding="utf-8")
    missing = [key for key in (*KEYS, *ModelParallelConfig.aliases()) if f"`{key}`" not in text]
    assert not missing


# ------------------------------------------------------------------------------- properties
_KEY_POOL = [*KEYS, *ModelParallelConfig.aliases()]


@st.composite
def _keys(draw: st.DrawFn) -> str:
    key = draw(st.sampled_from(_KEY_POOL))
    mutation = draw(st.sampled_from(["none", "none", "drop", "swap", "upper", "junk", "random"]))
    if mutation == "drop" and len(key) > 1:
        i = draw(st.integers(0, len(key) - 1))
        return key[:i] + key[i + 1 :]
    if mutation == "swap" and len(key) > 1:
        i = draw(st.integers(0, len(key) - 2))
        return key[:i] + key[i + 1] + key[i] + key[i + 2 :]
    if mutation == "upper":
        return key.upper()
    if mutation == "junk":
        return key + draw(st.sampled_from(["s", "_", "1", " "]))
    if mutation == "random":
        return draw(st.text(string.ascii_letters + "_", max_size=12))
    return key


_VALUES = st.one_of(
    st.booleans(),
    st.integers(-3, 20),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.2, 1.0, 5e8, 1e6, 2.5]),
    st.sampled_from(["interleaved", "simple", "memory", "speed", "cluster", "spread", "TPD", "auto", "gloo"]),
    st.text(max_size=8),
    st.none(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@st.composite
def _mostly_valid(draw: st.DrawFn) -> dict[str, object]:
    """Keys with values from their valid lists (so that many configs pass), now and then a random one."""
    keys = draw(st.lists(st.sampled_from(list(VALID)), unique=True, max_size=10))
    return {
        key: draw(st.one_of(st.sampled_from([v for v, _ in VALID[key]]), _VALUES))
        if draw(st.integers(0, 9)) == 0
        else draw(st.sampled_from([v for v, _ in VALID[key]]))
        for key in keys
    }


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.dictionaries(_keys(), _VALUES, max_size=8), _mostly_valid()))
def test_random_configs_raise_only_config_errors(params: dict[str, object]) -> None:
    try:
        cfg = ModelParallelConfig.from_dict(params)
    except ConfigError as err:
        assert isinstance(err, ValueError)
        assert "Allowed: " in str(err) and "Fix: " in str(err)
        with pytest.raises(ConfigError) as again:  # deterministic: the same input gives the same error
            ModelParallelConfig.from_dict(dict(reversed(list(params.items()))))
        assert str(again.value) == str(err)
        return
    data = cfg.to_dict()
    assert ModelParallelConfig.from_dict(data) == cfg
    assert ModelParallelConfig.from_dict(json.loads(json.dumps(data))) == cfg
    assert load_config({"modelparallel": {"parameters": params}}) == cfg


@settings(max_examples=200, deadline=None)
@given(
    degrees=st.tuples(st.integers(1, 8), st.integers(1, 8), st.integers(1, 8)),
    world=st.integers(-2, 70),
    local=st.integers(-1, 70),
    gpus=st.one_of(st.none(), st.integers(-1, 9)),
)
def test_world_rules_raise_only_worker_size_errors(
    degrees: tuple[int, int, int], world: int, local: int, gpus: int | None
) -> None:
    pp, tp, sdp = degrees
    try:
        cfg = build(pipeline_parallel_degree=pp, tensor_parallel_degree=tp, sharded_data_parallel_degree=sdp)
    except ConfigError:
        return
    try:
        validate_world(cfg, world, local, gpus)
    except WorkerSizeError as err:
        assert "Fix: " in str(err)
        return
    assert world % (pp * tp) == 0 and world >= pp * tp and (world // pp) % sdp == 0
    assert 1 <= local <= world and (not gpus or local <= gpus)
