"""Every script in examples/ runs under the real launcher (``mp-launch -n N examples/X.py``) at a tiny
size: it exits 0, the loss lines it prints are finite and fall, and the scripts that compare themselves
with plain PyTorch (``--check``) pass that comparison. Each run starts a fresh MPI world (about 10 s
on a quiet 2-core host), so each example runs once, or twice where a resume needs it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
LOSS = re.compile(r"step (\d+) loss (\S+)")


def _launcher() -> str:
    beside = Path(sys.executable).parent / "mp-launch"
    found = str(beside) if beside.is_file() else shutil.which("mp-launch")
    if found is None:
        pytest.skip("mp-launch is not installed beside this Python")
    return found


def launch(n: int, script: str, *args: str, cwd: Path, expect: int = 0) -> tuple[str, dict[int, float]]:
    """Run an example on n ranks; its output and the losses it printed, by step."""
    env = {k: v for k, v in os.environ.items() if k not in ("SM_HP_MP_PARAMETERS", "SM_FRAMEWORK_PARAMS")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [_launcher(), "-n", str(n), str(EXAMPLES / script), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=cwd, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == expect, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-6000:]}"
    losses = {int(step): float(value) for step, value in LOSS.findall(proc.stdout)}
    assert losses, f"{script} printed no loss lines:\n{out[-3000:]}"
    assert all(math.isfinite(v) for v in losses.values()), losses
    return out, losses


def falls(losses: dict[int, float], last: int = 3) -> bool:
    """The mean of the last few steps' losses is below the first step's."""
    steps = sorted(losses)
    return sum(losses[s] for s in steps[-last:]) / last < losses[steps[0]]


def test_mnist_cnn_pp2_interleaved_ddp(tmp_path: Path) -> None:
    """pp=2 x dp=2 on 4 ranks (2 data-parallel replicas), and the loss plot."""
    plot = tmp_path / "mnist.png"
    args = ("--max-steps", "12", "--samples", "1024", "--hidden", "32", "--plot", str(plot))
    out, losses = launch(4, "mnist_cnn.py", *args, cwd=tmp_path)
    assert "pp=2 x dp=2 on 4 ranks" in out
    assert sorted(losses) == list(range(1, 13))
    assert falls(losses), losses
    assert plot.stat().st_size > 10_000  # a real PNG, written by matplotlib
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpt2_tp2_pp2_checkpoint_and_resume(tmp_path: Path) -> None:
    """tp=2 x pp=2 with activation checkpointing: 6 steps saving at 3 and 6; resumed from step 3, steps
    4-6 give the losses of the run that went on (model, optimizer and step counter restored)."""
    ckpt = tmp_path / "ckpt"
    size = ("--tp", "2", "--pp", "2", "--layers", "2", "--width", "32", "--steps", "6", "--ckpt", str(ckpt))
    out, whole = launch(4, "gpt2_pretrain.py", *size, "--save-every", "3", cwd=tmp_path)
    assert "tp=2 x pp=2 x rdp=1 on 4 ranks" in out
    assert falls(whole, last=2), whole
    assert (ckpt / "step_3_partial" / "model_1_1_0.pt").is_file()  # smp's partial file names
    out, resumed = launch(4, "gpt2_pretrain.py", *size, "--resume", "--tag", "step_3", cwd=tmp_path)
    assert "resumed from" in out and "at step 3" in out
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(whole[step], rel=1e-6, abs=1e-6), step


def test_bert_through_the_hf_trainer_pp2(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out, losses = launch(2, "bert_trainer.py", "--steps", "12", "--out", str(tmp_path / "bert"), cwd=tmp_path)
    assert "on sagemaker_model_parallel: pp=2" in out  # the Trainer took its smp path, through mp
    assert sorted(losses) == list(range(1, 13))
    assert falls(losses), losses
    assert (tmp_path / "bert" / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("prescaled", [False, True], ids=["tp-across-dp", "prescaled-batch"])
def test_ncf_tensor_parallel_equals_plain_pytorch(tmp_path: Path, prescaled: bool) -> None:
    args = ["--steps", "12", "--check"] + (["--prescaled"] if prescaled else [])
    out, losses = launch(2, "ncf_tp.py", *args, cwd=tmp_path)
    assert "distributed tables: 4" in out
    assert "-> OK" in out
    assert falls(losses), losses


def test_atp_on_a_2x2_mesh_equals_plain_pytorch(tmp_path: Path) -> None:
    out, losses = launch(4, "atp_mesh.py", "--steps", "10", "--check", cwd=tmp_path)
    assert "DeviceMesh(2, 2) over 4 ranks" in out
    assert "-> OK" in out
    assert falls(losses), losses


def test_the_demo_still_runs(tmp_path: Path) -> None:
    """The one-command demo (examples/demo.py), shortened: it checks itself against plain PyTorch."""
    env = {k: v for k, v in os.environ.items() if k not in ("SM_HP_MP_PARAMETERS", "SM_FRAMEWORK_PARAMS")}
    cmd = [_launcher(), "-n", "2", str(EXAMPLES / "demo.py"), "--steps", "3", "--timeline-step", "2"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=280, cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "-> OK" in proc.stdout
    assert (tmp_path / "loss_curve.png").is_file() and (tmp_path / "results.json").is_file()
