"""Delayed parameter initialization with tensor parallelism, on real ranks: a Hugging Face GPT-2 built under
``smp.model_creation(tensor_parallelism=True)`` with ``delayed_parameter_initialization`` becomes the
whole-stack ``GPT2DistributedLMHead`` on the meta device; after partitioning each rank materializes only
its pipeline stage's parameters and, of those, its own tensor-parallel shards.

- The values come from the distributed modules' own init (word embedding N(0, initializer_range), linear
  weights U(+-1/sqrt(fan_in)), layer norms 1 and 0), not from Hugging Face's ``_init_weights`` that an
  eager build copies into the shards (docs/memory.md); training from them lowers the loss.
- Made equal (the eager build's initial Hugging Face state loaded into the delayed model before the
  first step), training equals the eager-built TP model's: losses and the gathered state dict after the
  steps, rtol 1e-5.
- At tp=2 and at tp=2 x pp=2.
- What a shard draws again (mp_tensor's ``ParamInit``) is what its module's constructor drew, sliced.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import mp as smp

transformers = pytest.importorskip("transformers")

SEQ, VOCAB, HIDDEN, LAYERS, STEPS, BATCH = 8, 64, 32, 4, 4, 4


def _config() -> Any:
    return transformers.GPT2Config(
        n_embd=HIDDEN, n_layer=LAYERS, n_head=4, n_positions=SEQ, vocab_size=VOCAB, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip


@smp.step
def _train_step(model: Any, ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids)["loss"]
    model.backward(loss)
    return loss


def _stats(module: torch.nn.Module) -> dict[str, tuple[float, float, float]]:
    """(min, max, std) of each materialized parameter, right after materialization."""
    return {
        n: (p.min().item(), p.max().item(), p.std().item() if p.numel() > 1 else 0.0)
        for n, p in module.named_parameters()
        if not p.is_meta and p.numel() > 0
    }


def _session(tp: int, pp: int, delay: bool, initial: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    smp.init(
        {
            "tensor_parallel_degree": tp,
            "pipeline_parallel_degree": pp,
            "microbatches": 2,
            "delayed_parameter_initialization": delay,
        }
    )
    torch.manual_seed(0)
    with smp.model_creation(tensor_parallelism=True):
        net = transformers.GPT2LMHeadModel(_config())
    out: dict[str, Any] = {"meta_built": all(p.is_meta for p in net.parameters())}
    out["full"] = sum(p.numel() for p in net.parameters())  # the whole model's elements
    if not delay:
        out["initial"] = {k: v.detach().clone() for k, v in net.state_dict().items()}
    model = smp.DistributedModel(net)
    module = model.get_module()
    out["type"] = type(module).__name__
    out["meta_wrapped"] = all(p.is_meta for p in module.parameters())
    out["shards"] = sum(p.numel() for p in module.parameters())  # every stage's, this rank's shards
    model.register_post_partition_hook(lambda m, _o: out.update(stats=_stats(m.get_module())))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3))
    if initial is not None:  # before the first step: applied right after materialization
        model.load_state_dict(initial)
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(smp.dp_rank()))
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = _train_step(model, ids).reduce_mean()
        if s == 0:
            out["real"] = sum(p.numel() for p in module.parameters() if not p.is_meta)
            out["local"] = sum(p.numel() for p in model.local_parameters())
        opt.step()
        losses.append(loss.item())
    out["losses"] = losses
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["pp_rank"] = smp.pp_rank()
    smp.reset()
    return out


def _job(world: Any, tp: int, pp: int) -> dict[str, Any]:
    eager = _session(tp, pp, False, None)
    delayed = _session(tp, pp, True, None)
    equal = _session(tp, pp, True, eager["initial"])
    return {"eager": eager, "delayed": delayed, "equal": equal, "pp_rank": eager["pp_rank"]}


def _check_own_init(stats: dict[str, tuple[float, float, float]]) -> None:
    """The distributed modules' own init: layer norms 1/0, the word embedding N(0, 0.02), a query
    projection U(+-1/sqrt(hidden)) (GPT2DistributedLMHead, use_normal_initialization=False)."""
    assert stats, "nothing materialized"
    for name, (low, high, _) in stats.items():
        if "layernorm" in name:
            assert (low, high) == ((1.0, 1.0) if name.endswith("weight") else (0.0, 0.0)), (name, low, high)
        if name == "word_embedding.weight":
            assert 0.017 < stats[name][2] < 0.023, (name, stats[name])
        if name.endswith("attention.query.weight"):
            bound = 1 / math.sqrt(HIDDEN)
            assert -bound <= low and high <= bound and high > 0.8 * bound, (name, low, high)


@pytest.mark.parametrize(("ranks", "tp", "pp"), [(2, 2, 1), (4, 2, 2)], ids=["tp2", "tp2xpp2"])
def test_delayed_tp_materializes_its_shards_and_trains_like_eager(
    worlds: Any, ranks: int, tp: int, pp: int
) -> None:
    results = worlds.run(ranks, _job, tp, pp, timeout=300)
    for r, res in enumerate(results):
        eager, delayed, equal = res["eager"], res["delayed"], res["equal"]
        assert not eager["meta_built"] and eager["type"] == "GPT2DistributedLMHead", eager["type"]
        for run in (delayed, equal):
            assert run["meta_built"] and run["meta_wrapped"], r  # nothing real before partitioning
            assert run["type"] == "GPT2DistributedLMHead", run["type"]
            assert run["real"] == run["local"] == eager["local"], (r, run["real"], run["local"])
            assert run["shards"] == eager["shards"] and run["full"] == eager["full"], r
        # this rank's shards only: about 1/tp of its stage's parameters (layer norms, biases replicated)
        assert eager["local"] < eager["full"] * (0.6 if pp == 1 else 0.45), (r, eager["local"], eager["full"])
        _check_own_init(delayed["stats"])
        losses = delayed["losses"]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.1, (r, losses)
        # made equal: the eager build's initial values loaded, then the same training
        torch.testing.assert_close(
            torch.tensor(equal["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-6,
            msg=lambda m, r=r: f"rank {r} losses: {m}",
        )  # fmt: skip
        assert sorted(equal["state"]) == sorted(eager["state"]), r
        for key, value in eager["state"].items():
            torch.testing.assert_close(
                equal["state"][key], value, rtol=1e-5, atol=1e-6,
                msg=lambda m, key=key, r=r: f"rank {r} {key}: {m}",
            )  # fmt: skip
    if pp > 1:
        assert {res["pp_rank"] for res in results} == {0, 1}


def test_each_shard_init_draws_what_its_constructor_drew() -> None:
    """mp_tensor's ParamInit (what delayed initialization draws again) reproduces the constructors' values
    from the same random state, and a shard is its slice of the full draw."""
    from mp_tensor.context import TPContext
    from mp_tensor.nn.base import ParamInit, param_init
    from mp_tensor.nn.embedding import DistributedEmbedding
    from mp_tensor.nn.linear import LinearShard

    ctx = TPContext(group=None)
    builds = {
        "uniform": lambda: LinearShard(ctx, 6, 10, weight_split=1),
        "normal": lambda: LinearShard(ctx, 6, 10, weight_split=0, use_normal=True, initializer_range=0.1),
        "embedding": lambda: DistributedEmbedding(9, 4, padding_idx=2, initializer_range=0.3, tp=ctx),
    }
    for kind, build in builds.items():
        torch.manual_seed(11)
        module = build()
        torch.manual_seed(11)
        for name, p in module.named_parameters():
            init = param_init(p)
            assert init is not None, (kind, name)
            assert torch.equal(init.draw(), p.detach()), (kind, name)
    torch.manual_seed(5)
    full = torch.empty(4, 6).normal_(0.0, 0.5)
    for rank in range(2):
        torch.manual_seed(5)
        shard = ParamInit((4, 6), "normal", 0.5, 1, rank, 2).draw()
        assert torch.equal(shard, full[:, rank * 3 : rank * 3 + 3])


def test_a_tensor_parallel_parameter_without_a_recorded_draw_is_refused() -> None:
    """A parameter of one of mp_tensor's modules (split or not) that does not record its draw (ATP's
    layers do not) is refused by name rather than initialized as if it were a whole parameter."""
    from mp.delayed_init import _own_draws
    from mp_memory.delayed_init import DelayedInitError
    from mp_tensor.context import TPContext
    from mp_tensor.nn.linear import LinearShard

    root = torch.nn.Sequential(
        LinearShard(TPContext(group=None), 4, 6, weight_split=None), torch.nn.Linear(2, 2)
    )
    own = _own_draws(root)
    shard, plain = root[0], root[1]
    assert own(shard.weight) is not None and own(plain.weight) is None  # recorded; torch's own init
    del shard.weight.__dict__["_mp_tp_init"]
    with pytest.raises(DelayedInitError, match=r"shape \(4, 6\).*Fix:"):
        own(shard.weight)
