"""smp's state-dict semantics under tensor and pipeline parallelism, and checkpoints that resume in
another layout exactly.

- ``model.state_dict()`` is full on every rank with Hugging Face's own key names: it loads into the
  unwrapped ``GPT2LMHeadModel`` with ``strict=True``, and back into a TP model each rank keeps its own
  shard; a rank's ``local_state_dict()`` is refused on another tp_rank.
- save_checkpoint at step 2 in one layout, resume in another, train to step 4: losses and parameters
  equal single-process PyTorch that never stopped (Adam, fp32, 1e-5 relative). Full and partial
  checkpoints, pp 1 -> 2 -> 4 -> 1, tp 2 -> 1 and 1 -> 2, tp x pp 4 ranks -> tp 2.
- A partial checkpoint of a model smp replaced whole (GPT-2, GPT-NeoX, GPT-J under
  ``smp.tensor_parallelism()``) resumes into the plain Hugging Face model at tp 1, pp 1 or 2: losses,
  parameters and the optimizer state equal the run that never stopped.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import mp as smp
from mp.errors import IncompatibleCheckpointFoundError

transformers = pytest.importorskip("transformers")

STEPS, SAVE_AT, BATCH, SEQ, VOCAB = 4, 2, 8, 16, 64


def _config() -> Any:
    return transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
    )


def _hf(family: str) -> Any:
    """A small Hugging Face causal LM of a family that smp replaces whole under tensor_parallelism()."""
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(_config())
    common = {"vocab_size": VOCAB, "use_cache": False, "bos_token_id": 0, "eos_token_id": 0}
    if family == "gptneox":
        cfg = transformers.GPTNeoXConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
            **common,
        )  # fmt: skip
        return transformers.GPTNeoXForCausalLM(cfg)
    assert family == "gptj", family
    cfg = transformers.GPTJConfig(
        n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, **common,
    )  # fmt: skip
    return transformers.GPTJForCausalLM(cfg)


def _data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _adam(params: Any) -> torch.optim.Optimizer:
    # eps keeps Adam from magnifying float rounding in near-zero gradients (which differs between layouts)
    return torch.optim.Adam(params, lr=1e-2, eps=1e-3)


def _reference(family: str = "gpt2") -> tuple[list[float], dict[str, torch.Tensor], dict[str, Any]]:
    """Losses, state dict and optimizer state (by parameter name) of one process that never stopped."""
    torch.manual_seed(0)
    model = _hf(family)
    opt = _adam(model.parameters())
    losses = []
    for ids in _data():
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    optim = {n: opt.state[p] for n, p in model.named_parameters()}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, optim


def _layout(tp: int, pp: int) -> dict[str, Any]:
    return {"tensor_parallel_degree": tp, "pipeline_parallel_degree": pp, "microbatches": 2, "ddp": True}


def _build(tp: int, pp: int, seed: int, family: str = "gpt2", plain: bool = False) -> tuple[Any, Any]:
    """The model under smp.tensor_parallelism() (replaced whole, at any tp), or ``plain``: as built."""
    smp.init(_layout(tp, pp))
    torch.manual_seed(seed)
    if plain:
        net = _hf(family)
    else:
        with smp.tensor_parallelism():
            net = _hf(family)
    model = smp.DistributedModel(net)
    return model, smp.DistributedOptimizer(_adam(model.parameters()))


@smp.step
def _step(model: Any, ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids).loss
    model.backward(loss)
    return loss


def _train(model: Any, opt: Any, steps: range) -> list[float]:
    dp, rank = smp.dp_size(), smp.dp_rank()
    per = BATCH // dp
    losses = []
    for i in steps:
        opt.zero_grad()
        out = _step(model, _data()[i][rank * per : (rank + 1) * per])
        opt.step()
        losses.append(float(sum(smp.allgather(out.reduce_mean().item(), smp.DP_GROUP)) / dp))
    return losses


# ------------------------------------------------------------------------------- state-dict forms
def _forms(world: Any) -> dict[str, Any]:
    model, opt = _build(2, 1, 0)
    _train(model, opt, range(SAVE_AT))
    full = model.state_dict()
    local = model.local_state_dict()
    out: dict[str, Any] = {"keys": list(full), "shapes": {k: tuple(v.shape) for k, v in full.items()}}
    hf = transformers.GPT2LMHeadModel(_config())
    hf.load_state_dict(full, strict=True)  # the unwrapped class, its own names
    out["partial_flag"] = local["_smp_is_partial"]
    out["local_has_shards"] = any(k.endswith("attention.query.weight") for k in local)
    out["name_to_index"] = opt.param_name_to_index()
    out["index_to_name"] = opt.param_index_to_name()
    parts: list[Any] = smp.allgather(local, smp.TP_GROUP)
    smp.reset()

    model, opt = _build(2, 1, 1)
    model.load_state_dict(full)  # each rank cuts its own shard
    again = model.state_dict()
    out["reloaded_equal"] = all(torch.equal(again[k], v) for k, v in full.items())
    try:
        model.load_state_dict(parts[1 - smp.tp_rank()])  # the other tp_rank's part
        out["other_part"] = "loaded"
    except IncompatibleCheckpointFoundError as exc:
        out["other_part"] = str(exc)
    smp.reset()
    return out


def test_state_dict_is_full_with_hf_names_under_tp(worlds: Any) -> None:
    reference = transformers.GPT2LMHeadModel(_config()).state_dict()
    for r in worlds.run(2, _forms, timeout=240):
        assert sorted(r["keys"]) == sorted(reference), r[
            "keys"
        ]  # (a TP block's keys in its translation's order)
        assert r["shapes"] == {k: tuple(v.shape) for k, v in reference.items()}
        assert r["partial_flag"] is True and r["local_has_shards"], r
        assert r["reloaded_equal"], "a full state loaded at tp=2 did not give each rank its own shard"
        assert "holds the tensor-parallel shards of tp_rank" in r["other_part"], r["other_part"]
        assert r["index_to_name"] == {i: n for n, i in r["name_to_index"].items()}
        assert len(r["name_to_index"]) > 0 and all(n.startswith("module.") for n in r["name_to_index"])


# ------------------------------------------------------------------------------- layout changes
def _save_phase(world: Any, tp: int, pp: int, folder: str, partial: bool) -> list[float]:
    model, opt = _build(tp, pp, 0)
    losses = _train(model, opt, range(SAVE_AT))
    smp.save_checkpoint(
        folder, "step2", partial=partial, model=model, optimizer=opt, user_content={"step": 2}
    )
    smp.reset()
    return losses


def _resume_phase(world: Any, tp: int, pp: int, folder: str, partial: bool) -> dict[str, Any]:
    model, opt = _build(tp, pp, 1)  # another init: only the checkpoint can make the runs equal
    user = smp.resume_from_checkpoint(folder, partial=partial)
    losses = _train(model, opt, range(user["step"], STEPS))
    state = model.state_dict()
    smp.reset()
    return {"losses": losses, "state": state}


CHANGES = [
    # (saving tp, pp), (resuming tp, pp), partial
    ((2, 1), (2, 1), True),
    ((2, 1), (1, 1), False),
    ((1, 1), (2, 1), False),
    ((1, 2), (1, 1), False),
    ((2, 1), (1, 2), False),
    ((1, 2), (1, 1), True),
    ((1, 1), (1, 2), True),
    ((2, 2), (2, 1), True),
    ((2, 1), (1, 1), True),
    ((1, 1), (2, 1), True),
    ((1, 2), (2, 1), True),
    ((1, 2), (1, 4), True),
    ((1, 4), (1, 1), False),
]


@pytest.mark.parametrize(("saved", "resumed", "partial"), CHANGES, ids=str)
def test_resume_in_another_layout_equals_training_that_never_stopped(
    worlds: Any, tmp_path: Any, saved: tuple[int, int], resumed: tuple[int, int], partial: bool
) -> None:
    folder = str(tmp_path)
    n = max(saved[0] * saved[1], resumed[0] * resumed[1], 2)
    first = worlds.run(n, _save_phase, *saved, folder, partial, timeout=240)
    names = sorted(os.listdir(folder))
    assert "newest" in names, names
    results = worlds.run(n, _resume_phase, *resumed, folder, partial, timeout=240)
    ref_losses, ref_state, _ = _reference()
    for rank, r in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(first[rank] + r["losses"]),
            torch.tensor(ref_losses),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, rank=rank: f"rank {rank} losses: {m}",
        )
        assert sorted(r["state"]) == sorted(ref_state)
        for key, value in ref_state.items():
            torch.testing.assert_close(
                r["state"][key],
                value,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, k=key, rank=rank: f"rank {rank} {k}: {m}",
            )


# ------------------------------------------------------- partial checkpoints of the whole-stack layout
def _save_whole_stack(world: Any, family: str, tp: int, pp: int, folder: str) -> list[float]:
    model, opt = _build(tp, pp, 0, family)
    assert type(model.module).__name__.endswith("DistributedLMHead"), type(model.module)  # replaced whole
    losses = _train(model, opt, range(SAVE_AT))
    smp.save_checkpoint(folder, "step2", partial=True, model=model, optimizer=opt, user_content={"step": 2})
    smp.reset()
    return losses


def _resume_plain(world: Any, family: str, tp: int, pp: int, folder: str) -> dict[str, Any]:
    """Resume into the plain Hugging Face model (built without smp.tensor_parallelism())."""
    model, opt = _build(tp, pp, 1, family, plain=True)
    user = smp.resume_from_checkpoint(folder, partial=True)
    losses = _train(model, opt, range(user["step"], STEPS))
    full = opt.state_dict()  # numbered over every parameter, with their names
    names = [n for group in full["_smp_param_names"] for n in group]
    out = {
        "losses": losses,
        "state": model.state_dict(),
        "optim": {names[i]: st for i, st in full["state"].items()},
    }
    smp.reset()
    return out


WHOLE_STACK_MOVES = [
    # family, saving (tp, pp), resuming (tp, pp) with the plain model
    ("gpt2", (2, 1), (1, 1)),
    ("gpt2", (2, 1), (1, 2)),
    ("gpt2", (2, 2), (1, 1)),
    ("gptneox", (2, 1), (1, 1)),
    ("gptneox", (2, 2), (1, 1)),
    ("gptj", (2, 1), (1, 2)),
]


@pytest.mark.parametrize(("family", "saved", "resumed"), WHOLE_STACK_MOVES, ids=str)
def test_partial_checkpoint_of_the_whole_stack_resumes_in_the_plain_model(
    worlds: Any, tmp_path: Any, family: str, saved: tuple[int, int], resumed: tuple[int, int]
) -> None:
    """A partial checkpoint of a model smp replaced whole (its own names, TP shards) resumes at tp = 1
    into the model as Hugging Face builds it: losses, parameters and the optimizer state equal one
    process that never stopped."""
    folder = str(tmp_path)
    n = max(saved[0] * saved[1], resumed[0] * resumed[1], 2)
    first = worlds.run(n, _save_whole_stack, family, *saved, folder, timeout=240)
    results = worlds.run(n, _resume_plain, family, *resumed, folder, timeout=240)
    ref_losses, ref_state, ref_optim = _reference(family)
    for rank, r in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(first[rank] + r["losses"]),
            torch.tensor(ref_losses),
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, rank=rank: f"rank {rank} losses: {m}",
        )
        assert sorted(r["state"]) == sorted(ref_state)
        for key, value in ref_state.items():
            torch.testing.assert_close(
                r["state"][key],
                value,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, k=key, rank=rank: f"rank {rank} {k}: {m}",
            )
        assert sorted(r["optim"]) == sorted(ref_optim)
        for name, entry in ref_optim.items():
            assert sorted(r["optim"][name]) == sorted(entry), name
            for key, value in entry.items():
                torch.testing.assert_close(
                    torch.as_tensor(r["optim"][name][key]),
                    value,
                    rtol=1e-4,
                    atol=1e-7,
                    msg=lambda m, n=name, k=key, rank=rank: f"rank {rank} optimizer {n}.{k}: {m}",
                )


def _hf_export(world: Any, folder: str) -> None:
    model, opt = _build(2, 1, 0)
    _train(model, opt, range(SAVE_AT))
    smp.save_checkpoint(folder, "export", partial=False, model=model, optimizer=opt)
    smp.reset()


def test_full_checkpoint_under_tp_loads_into_the_unwrapped_hf_model(worlds: Any, tmp_path: Any) -> None:
    worlds.run(2, _hf_export, str(tmp_path), timeout=240)
    state = torch.load(tmp_path / "export", weights_only=True)
    hf = transformers.GPT2LMHeadModel(_config())
    hf.load_state_dict(state, strict=True)
    torch.manual_seed(0)
    reference = transformers.GPT2LMHeadModel(_config())
    opt = _adam(reference.parameters())
    for ids in _data()[:SAVE_AT]:
        opt.zero_grad()
        reference(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(hf.state_dict()[key], value, rtol=1e-5, atol=1e-6)
    hf.save_pretrained(tmp_path / "hf")  # and on to from_pretrained, offline from the folder
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    for key, value in hf.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
