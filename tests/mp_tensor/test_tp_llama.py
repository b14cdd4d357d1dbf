"""Hugging Face Llama (rotary, RMSNorm, SwiGLU, grouped-query attention), Mistral, Qwen2/3 and GPT-NeoX
built inside ``tensor_parallelism()`` at tp=2: whole decoder layers become ``DistributedLlamaLayer`` /
``DistributedGPTNeoXLayer``; logits, loss, gradients, the full state dict and training steps equal the
single-process model in both layouts (optimize "speed" and "memory"); collectives per block counted;
key/value heads the TP degree does not divide are refused with a reason."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mp_tensor.context import TPContext
from mp_tensor.enable import set_tensor_parallelism, tensor_parallelism
from mp_tensor.grads import reduce_gradients
from mp_tensor.replace import replace_modules
from mp_tensor.state_dict import gather_state_dict, load_original_state_dict
from tests.mp_tensor._tp_probe import count_collectives, tally
from tests.mp_tensor._tp_util import with_group

B, S, V = 2, 6, 48  # local batch, sequence, vocabulary
TOL = 3e-5


def _model(
    layers: int = 2, kv_heads: int = 2, impl: str = "sdpa", family: str = "llama", **extra: Any
) -> nn.Module:
    import transformers as tf

    common = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": layers, "num_attention_heads": 4,
        "vocab_size": V, "max_position_embeddings": 32, "bos_token_id": 0, "eos_token_id": 0,
        "pad_token_id": 0, "tie_word_embeddings": False,
    }  # fmt: skip
    if family == "gptneo":
        cfg = tf.GPTNeoConfig(
            hidden_size=32, num_layers=layers, num_heads=4, intermediate_size=64, vocab_size=V,
            max_position_embeddings=32, attention_types=[[["global", "local"], max(layers // 2, 1)]],
            window_size=3, embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0, bos_token_id=0,
            eos_token_id=0, pad_token_id=0, tie_word_embeddings=False, **extra,
        )  # fmt: skip
        cfg._attn_implementation = "eager"
        return tf.GPTNeoForCausalLM(cfg)  # type: ignore[no-any-return]
    if family == "gptj":
        cfg = tf.GPTJConfig(
            n_embd=32, n_layer=layers, n_head=4, n_inner=64, rotary_dim=4, vocab_size=V, n_positions=32,
            bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False, **extra,
        )  # fmt: skip
        cfg._attn_implementation = impl
        return tf.GPTJForCausalLM(cfg)  # type: ignore[no-any-return]
    if family == "neox":
        cfg = tf.GPTNeoXConfig(**common, **extra)
        cfg._attn_implementation = impl
        return tf.GPTNeoXForCausalLM(cfg)  # type: ignore[no-any-return]
    config_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[family]
    extra.setdefault("head_dim", 8)
    cfg = config_cls(**common, num_key_value_heads=kv_heads, **extra)
    cfg._attn_implementation = impl
    return model_cls(cfg)  # type: ignore[no-any-return]


def _blocks(model: nn.Module) -> Any:
    if hasattr(model, "gpt_neox"):
        return model.gpt_neox.layers
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers  # type: ignore[union-attr]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _replace(model: nn.Module, ctx: TPContext) -> tuple[nn.Module, list[str]]:
    handler, logger = _Records(), logging.getLogger("mp_tensor")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        return replace_modules(model, ctx), handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def _llama_case(world: Any, impl: str, prescaled: bool, extra: dict[str, Any]) -> dict[str, Any]:
    optimize = extra.pop("optimize", "speed")

    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx = TPContext(group=group, optimize=optimize, prescaled_batch=prescaled)
        torch.manual_seed(0)
        ref = _model(impl=impl, **extra)
        torch.manual_seed(0)
        with tensor_parallelism(whole_stack=False):  # the blocks, not smp's whole GPT-J (test_tp_stack_gpt)
            tp_model = _model(impl=impl, **extra)
        tp_model, log = _replace(tp_model, ctx)
        gen = torch.Generator().manual_seed(5)
        total = B if prescaled else B * n
        ids = torch.randint(1, V, (total, S), generator=gen)
        mask = torch.ones(total, S, dtype=torch.long)
        mask[1, -2:] = 0  # right padding on one sample
        local = slice(0, total) if prescaled else slice(rank * B, (rank + 1) * B)
        out: dict[str, Any] = {
            "replaced": sorted(
                {type(m).__name__ for m in tp_model.modules() if "mp_tensor" in type(m).__module__}
            ),
            "log": log,
        }
        opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
        opt_tp = torch.optim.SGD(tp_model.parameters(), lr=0.1)
        labels = ids.masked_fill(mask == 0, -100)
        for step in range(2):
            ref_out = ref(input_ids=ids, attention_mask=mask, use_cache=False)
            tp_out = tp_model(input_ids=ids[local], attention_mask=mask[local], use_cache=False)
            keep = mask[local].bool()
            out[f"logits{step}"] = (tp_out.logits - ref_out.logits[local])[keep].abs().max().item()
            # loss: summed token cross entropy, so that the data-parallel sum of the ranks' losses is the
            # single-process loss
            ref_loss = F.cross_entropy(
                ref_out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum"
            )
            tp_loss = F.cross_entropy(
                tp_out.logits[:, :-1].flatten(0, 1), labels[local][:, 1:].flatten(), reduction="sum"
            )
            summed = tp_loss.detach().clone()
            if not prescaled:
                dist.all_reduce(summed, group=group)
            out[f"loss{step}"] = abs(summed.item() - ref_loss.item()) / ref_loss.item()
            opt_ref.zero_grad()
            opt_tp.zero_grad()
            ref_loss.backward()
            tp_loss.backward()
            if not prescaled:
                reduce_gradients(
                    tp_model.parameters(), dp_group=group, rdp_group=None, tp_size=n, average=False
                )
            if step == 0:
                with torch.no_grad():
                    saved = {id(p): p.detach().clone() for p in tp_model.parameters()}
                    for p in tp_model.parameters():
                        p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
                    grads = gather_state_dict(tp_model)
                    for p in tp_model.parameters():
                        p.copy_(saved[id(p)])
                ref_grads = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
                out["grads"] = {k: (grads[k] - g).abs().max().item() for k, g in ref_grads.items()}
            opt_ref.step()
            opt_tp.step()
        weights = gather_state_dict(tp_model)
        ref_sd = ref.state_dict()
        out["keys_equal"] = sorted(weights) == sorted(ref_sd)
        out["weights"] = max((weights[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
        load_original_state_dict(tp_model, ref_sd)
        again = tp_model(input_ids=ids[local], attention_mask=mask[local], use_cache=False).logits
        want = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits[local]
        out["reloaded"] = (again - want)[mask[local].bool()].abs().max().item()
        return out

    return with_group(run)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("impl", "prescaled", "extra"),
    [
        ("sdpa", False, {}),
        ("eager", True, {"attention_bias": True, "mlp_bias": True}),
        ("sdpa", False, {"num_key_value_heads": 4, "head_dim": 6}),
        ("sdpa", False, {"family": "mistral", "sliding_window": 3}),
        ("eager", False, {"family": "qwen2"}),
        ("sdpa", True, {"family": "qwen3"}),
        ("sdpa", False, {"optimize": "memory"}),
        ("eager", True, {"optimize": "memory", "attention_bias": True, "mlp_bias": True}),
        ("sdpa", False, {"optimize": "memory", "family": "qwen3"}),
        ("sdpa", False, {"family": "neox"}),
        ("eager", True, {"family": "neox", "use_parallel_residual": False, "optimize": "memory"}),
        ("sdpa", False, {"family": "neox", "optimize": "memory", "hidden_act": "gelu_new"}),
        ("eager", False, {"family": "gptneo"}),
        ("eager", True, {"family": "gptneo", "optimize": "memory"}),
        ("sdpa", False, {"family": "gptj"}),
        ("eager", False, {"family": "gptj", "optimize": "memory"}),
    ],
    ids=[
        "llama-gqa-sdpa",
        "llama-biases-eager-prescaled",
        "llama-mha-head_dim",
        "mistral-window",
        "qwen2",
        "qwen3",
        "memory",
        "memory-biases-prescaled",
        "memory-qwen3",
        "neox",
        "neox-sequential-memory-prescaled",
        "neox-memory",
        "gptneo",
        "gptneo-memory-prescaled",
        "gptj",
        "gptj-memory",
    ],
)
def test_llama_blocks_train_like_the_plain_model(
    worlds: Any, impl: str, prescaled: bool, extra: dict[str, Any]
) -> None:
    kv = extra.pop("num_key_value_heads", 2)
    results = worlds.run(2, _llama_case, impl, prescaled, {"kv_heads": kv, **extra}, timeout=240)
    for rank, res in enumerate(results):
        want = {
            "neox": "DistributedGPTNeoXLayer",
            "gptneo": "DistributedGPTNeoLayer",
            "gptj": "DistributedGPTJLayer",
        }.get(extra.get("family", ""), "DistributedLlamaLayer")
        assert want in res["replaced"], res["replaced"]
        for step in (0, 1):
            assert res[f"logits{step}"] < TOL, (rank, step, res[f"logits{step}"])
            assert res[f"loss{step}"] < 1e-5, (rank, step, res[f"loss{step}"])
        bad = {k: v for k, v in res["grads"].items() if not v < TOL}
        assert not bad, (rank, bad)
        assert res["keys_equal"] and res["weights"] < TOL
        assert res["reloaded"] < TOL


def _counts(world: Any, optimize: str, prescaled: bool, family: str = "llama") -> dict[str, Any]:
    def run(group: dist.ProcessGroup) -> dict[str, Any]:
        ctx = TPContext(group=group, optimize=optimize, prescaled_batch=prescaled)  # type: ignore[arg-type]
        phases: dict[int, dict[str, Any]] = {}
        for layers in (1, 2):
            torch.manual_seed(0)
            model = _model(layers=layers, family=family)
            for block in _blocks(model):  # only the blocks (the difference cancels the rest anyway)
                set_tensor_parallelism(block, True)
            model, _ = _replace(model, ctx)
            ids = torch.randint(1, V, (B, S))
            with count_collectives() as fwd:
                logits = model(input_ids=ids, use_cache=False).logits
            with count_collectives() as bwd:
                logits.sum().backward()
            phases[layers] = {"fwd": tally(fwd), "bwd": tally(bwd)}
        per_block = {}
        for phase in ("fwd", "bwd"):
            two, one = phases[2][phase], phases[1][phase]
            per_block[phase] = {k: two.get(k, 0) - one.get(k, 0) for k in set(one) | set(two)}
            per_block[phase] = {k: v for k, v in per_block[phase].items() if v}
        return per_block

    return with_group(run)  # type: ignore[no-any-return]


# Per block, beyond the attention and MLP reductions: with a per-rank batch each block gathers its
# group's samples on the way in (speed: hidden, mask, cos, sin; memory: an all-to-all of the hidden
# states and the three gathers) and hands them back on the way out (memory: an all-to-all); with
# prescaled_batch, memory mode splits the channels on the way in and all-gathers them on the way out.
EXPECTED = {
    ("speed", True): ({"all_reduce": 2}, {"all_reduce": 2}),
    ("speed", False): ({"all_reduce": 2, "all_gather": 4}, {"all_reduce": 2, "all_gather": 1}),
    ("memory", True): (
        {"reduce_scatter": 4, "all_reduce": 2, "all_gather": 1},
        {"all_gather": 5, "all_reduce": 2},
    ),
    ("memory", False): (
        {"reduce_scatter": 4, "all_reduce": 2, "all_gather": 3, "all_to_all": 2},
        {"all_gather": 4, "all_reduce": 2, "all_to_all": 2},
    ),
}


@pytest.mark.parametrize("prescaled", [False, True], ids=["per-rank-batch", "prescaled"])
@pytest.mark.parametrize("optimize", ["speed", "memory"])
def test_collectives_per_llama_block(worlds: Any, optimize: str, prescaled: bool) -> None:
    per_block = worlds.run(2, _counts, optimize, prescaled)[0]
    fwd, bwd = EXPECTED[(optimize, prescaled)]
    assert per_block == {"fwd": fwd, "bwd": bwd}, per_block


@pytest.mark.parametrize(
    ("optimize", "fwd", "bwd"),
    [
        ("speed", {"all_reduce": 1}, {"all_reduce": 1}),
        (
            "memory",
            {"reduce_scatter": 2, "all_reduce": 1, "all_gather": 1},
            {"all_gather": 3, "all_reduce": 1},
        ),
    ],
)
def test_gptj_parallel_block_reduces_once(worlds: Any, optimize: str, fwd: Any, bwd: Any) -> None:
    # attention and MLP share the input exchange and the output reduction
    assert worlds.run(2, _counts, optimize, True, "gptj")[0] == {"fwd": fwd, "bwd": bwd}


def test_neox_parallel_residual_reduces_once_forward(worlds: Any) -> None:
    # two layer norms feed attention and MLP (two input exchanges backward), one output reduction
    counts = worlds.run(2, _counts, "speed", True, "neox")[0]
    assert counts == {"fwd": {"all_reduce": 1}, "bwd": {"all_reduce": 2}}, counts


def _refusals(world: Any) -> list[str]:
    def run(group: dist.ProcessGroup) -> list[str]:
        logs: list[str] = []
        for optimize, kv, extra in (("speed", 1, {}), ("memory", 2, {"hidden_act": "gelu"})):
            ctx = TPContext(group=group, optimize=optimize)  # type: ignore[arg-type]
            with tensor_parallelism():
                model = _model(layers=1, kv_heads=kv, **extra)
            model, log = _replace(model, ctx)
            assert not any(type(m).__name__ == "DistributedLlamaLayer" for m in model.modules())
            assert any(type(m).__name__ == "DistributedLinear" for m in model.modules())  # Linear-level TP
            logs += [m for m in log if "LlamaDecoderLayer" in m]
        return logs

    return with_group(run)  # type: ignore[no-any-return]


def test_indivisible_kv_heads_and_other_activations_are_refused_with_a_reason(worlds: Any) -> None:
    logs = worlds.run(2, _refusals)[0]
    assert any("num_key_value_heads=1" in m and "tensor-parallel degree 2" in m for m in logs), logs
    assert any("hidden_act='gelu'" in m for m in logs), logs
