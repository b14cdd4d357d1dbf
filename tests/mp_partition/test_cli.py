"""The standalone command: HuggingFace configs, config files, factories, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mp_partition import PartitionPlan
from mp_partition.cli import main
from mp_partition.errors import UnknownConfigFieldError

pytest.importorskip("transformers")

TINY_GPT2 = ["--set", "n_layer=8", "--set", "n_embd=32", "--set", "n_head=2", "--set", "vocab_size=128"]


def test_hf_model_type_with_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    status = main(
        ["gpt2", "-n", "4", "--memory-weight", "0.5", *TINY_GPT2, "--seq-len", "16", "--out", str(out)]
    )
    assert status == 0
    printed = capsys.readouterr().out
    assert "Partition plan: GPT2LMHeadModel" in printed and "into 4 partitions" in printed
    assert "memory_weight 0.5" in printed
    plan = PartitionPlan.load(out / "plan.json")
    assert [plan.owner(f"transformer.h.{i}") for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert (out / "report.txt").read_text() in printed
    assert (out / "plan.png").stat().st_size > 1000


def test_set_takes_config_aliases_and_the_config_files_own_keys(tmp_path: Path) -> None:
    from mp_partition.hf import load_hf_config

    assert load_hf_config("gpt2", {"hidden_size": 48, "n_layer": 3}).n_embd == 48  # GPT-2's alias
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "my_extra_key": 1}))
    assert load_hf_config(str(config), {"my_extra_key": 2}).my_extra_key == 2
    with pytest.raises(UnknownConfigFieldError, match="did you mean 'my_extra_key'"):
        load_hf_config(str(config), {"my_extra_kye": 2})


def test_config_json_and_skip_tracing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "t5",
                "d_model": 32,
                "d_ff": 64,
                "d_kv": 8,
                "num_heads": 4,
                "num_layers": 4,
                "vocab_size": 64,
            }
        )
    )
    status = main([str(tmp_path), "-n", "2", "--skip-tracing", "--save", str(tmp_path / "p.json"), "--full"])
    assert status == 0
    plan = PartitionPlan.load(tmp_path / "p.json")
    assert plan.inputs.model_class == "T5ForConditionalGeneration"
    assert not plan.inputs.traced and plan.inputs.skip_tracing
    assert "not traced" in capsys.readouterr().out


def test_factory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(
        [
            "tests.mp_partition.models:build_stack",
            "-n",
            "2",
            "--factory-kwargs",
            '{"layers": 6}',
            "--picture",
            str(tmp_path / "p.svg"),
        ]
    )
    assert status == 0
    text = capsys.readouterr().out
    assert "layers[0:3] (Block x3)" in text and "arg0: float32[2, 16] on cpu" in text
    assert (tmp_path / "p.svg").exists()
    status = main(
        ["tests.mp_partition.models:build_stack_without_inputs", "-n", "2", "--device", "meta", "--quiet"]
    )
    assert status == 0
    assert "Partition plan" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no-such-architecture-xyz", "-n", "2"], "unknown architecture"),
        (["tests.mp_partition.models:nothing", "-n", "2"], "has no attribute"),
        (["no_such_module_xyz:build", "-n", "2"], "cannot import"),
        (["gpt2", "-n", "0", *TINY_GPT2], "num_partitions 0"),
        (["gpt2", "-n", "2", "-a", "3", *TINY_GPT2], "memory_weight 3.0"),
        # a misspelt field used to be kept as a stray attribute, and the unchanged model was planned
        (
            ["gpt2", "-n", "2", "--set", "n_layerz=4"],
            "no field 'n_layerz'; expected a field of transformers' gpt2 config (a key of its "
            "config.json); did you mean 'n_layer'?",
        ),
        (["t5-small", "-n", "2", "--set", "num_layer=2"], "did you mean 'num_layers'?"),
        (
            ["bert", "-n", "2", "--set", "zzzzzz=1"],
            "no field 'zzzzzz'; expected a field of transformers' bert config (a key of its "
            "config.json); fix the name",
        ),
    ],
)
def test_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_python_dash_m() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mp_partition", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0
    assert "mp-partition" in result.stdout and "t5-11b" in result.stdout
