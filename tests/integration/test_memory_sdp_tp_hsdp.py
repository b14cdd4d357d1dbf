"""sharded_data_parallel_degree below the reduced data-parallel size with tensor parallelism (HSDP):
tp=2 x 2 replicas x sdp=2 on 8 ranks.

Each TP rank's shards are split over 2 ranks and replicated over 2 such groups: a (tp, replicate, shard)
mesh, FSDP2's hybrid sharding over the last two dimensions. Against plain single-process PyTorch on all
eight ranks' batches: every loss, the parameters after 4 AdamW steps clipped by sdp_gradient_clipping (the
norm sums shards over one replica only) and the full optimizer state, within 1e-5; a partial checkpoint (one
file per shard and TP rank, written by the first replica) resumes bitwise. fp16 with a forced overflow
in one rank's shard: as at tp=2 x sdp=2 (test_memory_sdp_tp_precision), on the 8 ranks' batches.

The 8 ranks run under plain mpiexec (tests/_harness.run_script): the reused pool's listener takes its
ranks' connections one at a time and did not start 8 ranks within its 300 s on this host.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import mp as smp
from tests._harness import run_script
from tests.integration.test_memory_sdp import STEPS, Stack, _batch, _close, _config, _optimizer, _reference
from tests.integration.test_memory_sdp_tp_state import _flat
from tests.mp_pipeline.models import first_difference

RANKS = 8
CLIP = 0.5  # below the gradient norms (0.6-0.8): every step is clipped
# the clipped AdamW steps (eps 1e-8) move a few near-zero-gradient elements by up to 2.3e-6 with this
# world's reduction order (8 ranks); a norm summed over both replicas moved them by 2.8e-4
ATOL = 1e-5


def _setup(seed: int) -> tuple[Any, Any, Any]:
    smp.init(
        _config(2, tensor_parallel_degree=2, sdp_param_persistence_threshold=100, sdp_gradient_clipping=CLIP)
    )
    torch.manual_seed(seed)
    with smp.tensor_parallelism():
        net = Stack()
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(_optimizer(model.parameters()))

    @smp.step
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    return model, opt, train_step


def _hsdp(path: str) -> dict[str, Any]:
    model, opt, train_step = _setup(0)
    losses = []
    for step in range(STEPS):
        if step == 2:
            smp.save_checkpoint(path, "s2", partial=True, model=model, optimizer=opt)
        losses.append(train_step(*_batch(step, smp.dp_rank())).reduce_mean().item())
        opt.step()
        opt.zero_grad()
    ref = _reference(RANKS, CLIP)
    sharding = model._sharded
    out: dict[str, Any] = {
        "mesh": tuple(sharding.mesh.shape),
        "norms": ref["norms"],
        "loss_ok": all(_close(g, w[smp.dp_rank()]) for g, w in zip(losses, ref["losses"], strict=True)),
        "params": first_difference(model.state_dict(), ref["params"], atol=ATOL),
        "opt": first_difference(_flat(opt.state_dict()["state"]), _flat(ref["opt"])),
    }
    straight = model.state_dict()
    smp.reset()
    model, opt, train_step = _setup(7)  # other weights: the checkpoint must replace them
    smp.resume_from_checkpoint(path, "s2", partial=True)
    for step in range(2, STEPS):
        train_step(*_batch(step, smp.dp_rank()))
        opt.step()
        opt.zero_grad()
    out["resumed"] = first_difference(model.state_dict(), straight, rtol=0, atol=0)
    return out


SCRIPT = """
import importlib, os, pickle
import mp as smp
fn = getattr(importlib.import_module(MODULE), NAME)
result = fn(*ARGS)
with open(os.path.join(PATH, f"result{smp.rank()}.pkl"), "wb") as f:
    pickle.dump(result, f)
"""


def _on_8_ranks(tmp_path: Path, module: str, name: str, args: tuple[Any, ...]) -> list[Any]:
    """fn(*args) on every rank of an 8-rank job; the results in rank order."""
    script = tmp_path / "job.py"
    text = SCRIPT.replace("MODULE", repr(module)).replace("NAME", repr(name))
    script.write_text(text.replace("ARGS", repr(args)).replace("PATH", repr(str(tmp_path))))
    output, code, _ = run_script(script, RANKS, timeout=600)
    assert code == 0, output[-4000:]
    return [pickle.loads((tmp_path / f"result{rank}.pkl").read_bytes()) for rank in range(RANKS)]


def test_tp2_hsdp_2x2_trains_like_one_process(tmp_path: Path) -> None:
    for r in _on_8_ranks(tmp_path, __name__, "_hsdp", (str(tmp_path / "ckpt"),)):
        assert r["norms"] and min(r.pop("norms")) > CLIP, r
        assert r == {"mesh": (2, 2), "loss_ok": True, "params": None, "opt": None, "resumed": None}, r


def test_tp2_hsdp_2x2_fp16_with_a_forced_overflow(tmp_path: Path) -> None:
    """test_memory_sdp_tp_precision's forced-overflow run with 2 replicas: same tolerances."""
    from tests.integration.test_memory_sdp_tp_precision import _check

    module = "tests.integration.test_memory_sdp_tp_precision"
    for r in _on_8_ranks(tmp_path, module, "_train", (None, "fp16", 2)):
        _check(r, "fp16")
        assert r["skipped"][0] == [False, False, True, False, False], r
