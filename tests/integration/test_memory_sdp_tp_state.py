"""Full states under sharded data parallelism with tensor parallelism: tp=2 x sdp=2 on 4 ranks.

``optimizer.state_dict()`` gathers each state tensor over the sharding group and translates the TP shards
to the original model's names and full tensors, as under TP without sharding; ``model.load_state_dict``
and ``optimizer.load_state_dict`` of full states cut them back to each rank's shard of its TP shard.
Against plain single-process PyTorch on all four ranks' batches: the full optimizer state after 2 AdamW
steps within 1e-5; a full checkpoint (smp.save_checkpoint(partial=False)) resumes bitwise; the states
of the single-process run itself (another layout) load and train on like it, within 1e-5.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import mp as smp
from tests.integration.test_memory_sdp import STEPS, Stack, _batch, _config, _optimizer, _reference
from tests.mp_pipeline.models import first_difference

SAVED_AT = 2


def _setup(seed: int) -> tuple[Any, Any, Any]:
    smp.init(_config(2, tensor_parallel_degree=2, sdp_param_persistence_threshold=100))
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


def _run(opt: Any, train_step: Any, steps: range) -> None:
    for step in steps:
        train_step(*_batch(step, smp.dp_rank()))
        opt.step()
        opt.zero_grad()


def _flat(states: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    flat = {f"{n}/{k}": v for n, st in states.items() for k, v in st.items() if isinstance(v, torch.Tensor)}
    return dict(sorted(flat.items()))


def _keyed(ref: dict[str, Any]) -> dict[str, Any]:
    """The single-process optimizer's state keyed by parameter names (torch's own numbering replaced)."""
    group = _optimizer([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0]
    return {
        "state": ref["opt"],
        "param_groups": [{**group, "params": list(ref["params"])}],
        "_smp_keyed_by_name": True,
    }


def _full_states(world: Any, path: str) -> dict[str, Any]:
    replicas = 4  # the world: TP across DP, every rank trains on its own batch
    early, late = _reference(replicas, 1.0, SAVED_AT), _reference(replicas, 1.0, STEPS)
    out: dict[str, Any] = {}
    model, opt, train_step = _setup(0)
    _run(opt, train_step, range(SAVED_AT))
    full = opt.state_dict()
    out["keys"] = sorted(full["state"]) == sorted(early["opt"])
    out["opt_early"] = first_difference(_flat(full["state"]), _flat(early["opt"]))
    smp.save_checkpoint(path, "full", partial=False, model=model, optimizer=opt)
    _run(opt, train_step, range(SAVED_AT, STEPS))
    straight, straight_opt = model.state_dict(), _flat(opt.state_dict()["state"])
    out["opt_late"] = first_difference(straight_opt, _flat(late["opt"]))
    smp.reset()

    model, opt, train_step = _setup(7)  # other weights: the checkpoint must replace them
    smp.resume_from_checkpoint(path, "full", partial=False)
    _run(opt, train_step, range(SAVED_AT, STEPS))
    out["resumed"] = first_difference(model.state_dict(), straight, rtol=0, atol=0)
    out["resumed_opt"] = first_difference(_flat(opt.state_dict()["state"]), straight_opt, rtol=0, atol=0)
    smp.reset()

    model, opt, train_step = _setup(7)  # the one-process run's states: another layout
    model.load_state_dict(early["params"])
    opt.load_state_dict(_keyed(early))
    _run(opt, train_step, range(SAVED_AT, STEPS))
    out["from_one_process"] = first_difference(model.state_dict(), late["params"])
    out["from_one_process_opt"] = first_difference(_flat(opt.state_dict()["state"]), _flat(late["opt"]))
    return out


def test_full_states_gather_translate_and_load_across_layouts(worlds: Any, tmp_path: Any) -> None:
    for r in worlds.run(4, _full_states, str(tmp_path), timeout=500):
        assert r == {
            "keys": True,
            "opt_early": None,
            "opt_late": None,
            "resumed": None,
            "resumed_opt": None,
            "from_one_process": None,
            "from_one_process_opt": None,
        }, r
