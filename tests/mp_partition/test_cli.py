"""The standalone command: HuggingFace configs, config files, factories, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mp_partition import PartitionPlan
from mp_partition.cli import main

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
