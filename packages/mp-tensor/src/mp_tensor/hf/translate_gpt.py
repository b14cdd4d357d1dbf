"""smp's state-dict translations for GPT-J and GPT-Neo (``smp.nn.huggingface.gptj`` / ``.gptneo``), on
full state dicts, exactly in both directions.

The distributed layout is that of the :class:`DistributedTransformerLMHead` standing in for the Hugging
Face ``GPTJForCausalLM`` / ``GPTNeoForCausalLM`` (:mod:`mp_tensor.hf.stack_gpt`), with smp's names:

- GPT-J: ``word_embedding``, ``transformer.seq_layers.<i>.pre_layernorm`` (``ln_1``, the one norm of a
  parallel block), ``...attention.{query,key,value,dense}``, ``...output.dense1/dense2`` (``fc_in``,
  ``fc_out``), ``layernorm`` (``ln_f``) and the untied ``lm_head`` with its bias.
- GPT-Neo: ``word_embedding``, ``position_embedding``, ``...attention.pre_layernorm`` (``ln_1``),
  ``...attention.{query,key,value,dense}``, ``...output.pre_layernorm`` (``ln_2``),
  ``...output.dense1/dense2`` (``c_fc``, ``c_proj``), ``layernorm`` (``ln_f``); the LM head is the word
  embedding.

- GPT-NeoX: ``word_embedding`` (``embed_in``), ``...attention.pre_layernorm`` (``input_layernorm``),
  ``...attention.{query,key,value}`` (the rows of ``query_key_value``, which holds each head's query,
  key and value side by side), ``...attention.dense``, ``...output.pre_layernorm``
  (``post_attention_layernorm``), ``...output.dense1/dense2`` (``dense_h_to_4h``, ``dense_4h_to_h``),
  ``layernorm`` (``final_layer_norm``) and ``lm_head`` (older transformers: ``embed_out``), or none when
  tied to the embedding.

``max_seq_len`` (to Hugging Face) adds the causal-mask buffers older transformers saved in these
models' state dicts; current transformers rebuilds them, so leave it None there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

from mp_tensor.errors import HFTranslationError

__all__ = [
    "gptj_from_smp",
    "gptj_to_smp",
    "gptneo_from_smp",
    "gptneo_to_smp",
    "gptneox_from_smp",
    "gptneox_to_smp",
]

_GPTJ_TOP = {
    "transformer.wte.weight": "word_embedding.weight",
    "transformer.ln_f.weight": "layernorm.weight",
    "transformer.ln_f.bias": "layernorm.bias",
    "lm_head.weight": "lm_head.weight",
    "lm_head.bias": "lm_head.bias",
}
_GPTJ_BLOCK = {
    "ln_1": "pre_layernorm",
    "attn.q_proj": "attention.query",
    "attn.k_proj": "attention.key",
    "attn.v_proj": "attention.value",
    "attn.out_proj": "attention.dense",
    "mlp.fc_in": "output.dense1",
    "mlp.fc_out": "output.dense2",
}
_GPTNEO_TOP = {
    "transformer.wte.weight": "word_embedding.weight",
    "transformer.wpe.weight": "position_embedding.weight",
    "transformer.ln_f.weight": "layernorm.weight",
    "transformer.ln_f.bias": "layernorm.bias",
}
_GPTNEO_BLOCK = {
    "ln_1": "attention.pre_layernorm",
    "attn.attention.q_proj": "attention.query",
    "attn.attention.k_proj": "attention.key",
    "attn.attention.v_proj": "attention.value",
    "attn.attention.out_proj": "attention.dense",
    "ln_2": "output.pre_layernorm",
    "mlp.c_fc": "output.dense1",
    "mlp.c_proj": "output.dense2",
}
# buffers older transformers saved; rebuilt from the config
_BUFFERS = ("attn.bias", "attn.masked_bias", "attn.attention.bias", "attn.attention.masked_bias")
_HF_BLOCK = re.compile(r"transformer\.h\.(?P<i>\d+)\.(?P<module>.+)\.(?P<leaf>[^.]+)")
_SMP_BLOCK = re.compile(r"transformer\.seq_layers\.(?P<i>\d+)\.(?P<module>.+)\.(?P<leaf>[^.]+)")


def _fail(family: str, message: str) -> HFTranslationError:
    return HFTranslationError(f"smp.nn.huggingface.{family}: {message}")


def _translate(
    family: str,
    state_dict: Mapping[str, Tensor],
    top: Mapping[str, str],
    blocks: tuple[re.Pattern[str], str, Mapping[str, str]],
    skip: tuple[str, ...] = (),
) -> dict[str, Tensor]:
    """Rename the keys of ``state_dict``: ``top`` whole keys, block keys by ``blocks`` = (pattern of a
    block key, the other side's block prefix, submodule names); keys ending in ``skip`` are dropped."""
    pattern, prefix, names = blocks
    out: dict[str, Tensor] = {}
    unknown = []
    for key, value in state_dict.items():
        if key in top:
            out[top[key]] = value
            continue
        m = pattern.fullmatch(key)
        if m is not None and m["module"] in names:
            out[f"{prefix}.{m['i']}.{names[m['module']]}.{m['leaf']}"] = value
        elif not key.endswith(skip) or m is None:
            unknown.append(key)
    if unknown:
        raise _fail(
            family, f"keys {sorted(unknown)[:6]} have no counterpart; pass a full {family} state dict."
        )
    return out


def _check_source(family: str, state_dict: Mapping[str, Tensor], key: str, what: str) -> None:
    if key not in state_dict:
        raise _fail(family, f"the state dict has no '{key}' (got {sorted(state_dict)[:4]}...); pass {what}.")


def _causal_buffers(
    out: dict[str, Tensor], layers: set[str], module: str, max_seq_len: int | None, masked: float
) -> None:
    if max_seq_len is None:
        return
    causal = (
        torch.ones(max_seq_len, max_seq_len, dtype=torch.bool).tril().view(1, 1, max_seq_len, max_seq_len)
    )
    for i in sorted(layers, key=int):
        out[f"transformer.h.{i}.{module}.bias"] = causal
        out[f"transformer.h.{i}.{module}.masked_bias"] = torch.tensor(masked)


def _layer_ids(state_dict: Mapping[str, Tensor]) -> set[str]:
    return {m["i"] for k in state_dict if (m := _SMP_BLOCK.fullmatch(k)) is not None}


# ----------------------------------------------------------------------------------------------- GPT-J


def gptj_to_smp(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An HF ``GPTJForCausalLM`` state dict -> the DistributedTransformerLMHead layout."""
    _check_source("gptj", state_dict, "transformer.wte.weight", "a GPTJForCausalLM's state_dict()")
    return _translate(
        "gptj", state_dict, _GPTJ_TOP, (_HF_BLOCK, "transformer.seq_layers", _GPTJ_BLOCK), _BUFFERS
    )


def gptj_from_smp(state_dict: Mapping[str, Tensor], max_seq_len: int | None = None) -> dict[str, Tensor]:
    """The DistributedTransformerLMHead layout -> an HF ``GPTJForCausalLM`` state dict."""
    _check_source("gptj", state_dict, "word_embedding.weight", "a full LM-head state dict")
    back = {v: k for k, v in _GPTJ_TOP.items()}
    names = {v: k for k, v in _GPTJ_BLOCK.items()}
    out = _translate("gptj", state_dict, back, (_SMP_BLOCK, "transformer.h", names))
    _causal_buffers(out, _layer_ids(state_dict), "attn", max_seq_len, -1e9)
    return out


# --------------------------------------------------------------------------------------------- GPT-Neo


def gptneo_to_smp(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An HF ``GPTNeoForCausalLM`` state dict -> the DistributedTransformerLMHead layout (LM head tied)."""
    _check_source("gptneo", state_dict, "transformer.wte.weight", "a GPTNeoForCausalLM's state_dict()")
    rest = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    head = state_dict.get("lm_head.weight")
    if head is not None and not torch.equal(head, state_dict["transformer.wte.weight"]):
        raise _fail(
            "gptneo",
            "lm_head.weight differs from transformer.wte.weight; the distributed LM head is the word "
            "embedding. Pass a model with tie_word_embeddings=True.",
        )
    return _translate(
        "gptneo", rest, _GPTNEO_TOP, (_HF_BLOCK, "transformer.seq_layers", _GPTNEO_BLOCK), _BUFFERS
    )


def gptneo_from_smp(state_dict: Mapping[str, Tensor], max_seq_len: int | None = None) -> dict[str, Tensor]:
    """The DistributedTransformerLMHead layout -> an HF ``GPTNeoForCausalLM`` state dict."""
    _check_source("gptneo", state_dict, "word_embedding.weight", "a full LM-head state dict")
    back = {v: k for k, v in _GPTNEO_TOP.items()}
    names = {v: k for k, v in _GPTNEO_BLOCK.items()}
    out = _translate("gptneo", state_dict, back, (_SMP_BLOCK, "transformer.h", names))
    out["lm_head.weight"] = state_dict["word_embedding.weight"]
    _causal_buffers(out, _layer_ids(state_dict), "attn.attention", max_seq_len, -1e9)
    return out


# -------------------------------------------------------------------------------------------- GPT-NeoX

_GPTNEOX_TOP = {
    "gpt_neox.embed_in.weight": "word_embedding.weight",
    "gpt_neox.final_layer_norm.weight": "layernorm.weight",
    "gpt_neox.final_layer_norm.bias": "layernorm.bias",
    "lm_head.weight": "lm_head.weight",
}
_GPTNEOX_BLOCK = {
    "input_layernorm": "attention.pre_layernorm",
    "attention.dense": "attention.dense",
    "post_attention_layernorm": "output.pre_layernorm",
    "mlp.dense_h_to_4h": "output.dense1",
    "mlp.dense_4h_to_h": "output.dense2",
}
_NEOX_HF_BLOCK = re.compile(r"gpt_neox\.layers\.(?P<i>\d+)\.(?P<module>.+)\.(?P<leaf>[^.]+)")
_NEOX_QKV = re.compile(r"gpt_neox\.layers\.(?P<i>\d+)\.attention\.query_key_value\.(?P<leaf>weight|bias)")
_SMP_QKV = "transformer.seq_layers.{i}.attention.{part}.{leaf}"
_NEOX_BUFFERS = ("attention.bias", "attention.masked_bias", "rotary_emb.inv_freq")


def gptneox_to_smp(
    state_dict: Mapping[str, Tensor], num_heads: int, tied: bool | None = None
) -> dict[str, Tensor]:
    """An HF ``GPTNeoXForCausalLM`` state dict -> the DistributedTransformerLMHead layout (``num_heads``:
    the attention heads, which order ``query_key_value``'s rows). ``tied``: the model ties its LM head to
    the embedding (then the layout has no ``lm_head``); None: when the two share their storage."""
    _check_source("gptneox", state_dict, "gpt_neox.embed_in.weight", "a GPTNeoXForCausalLM's state_dict()")
    rest: dict[str, Tensor] = {}
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        m = _NEOX_QKV.fullmatch(key)
        if m is None:
            rest["lm_head.weight" if key == "embed_out.weight" else key] = value
            continue
        # rows [head, (q|k|v), head_size] -> three [heads * head_size] blocks
        parts = value.reshape(num_heads, 3, -1, *value.shape[1:]).unbind(1)
        for part, rows in zip(("query", "key", "value"), parts, strict=True):
            out[_SMP_QKV.format(i=m["i"], part=part, leaf=m["leaf"])] = rows.reshape(-1, *value.shape[1:])
    head, embed = rest.get("lm_head.weight"), state_dict["gpt_neox.embed_in.weight"]
    if tied is None:
        tied = head is not None and head.data_ptr() == embed.data_ptr()
    if tied:
        rest.pop("lm_head.weight", None)  # the word embedding is the head
    blocks = (_NEOX_HF_BLOCK, "transformer.seq_layers", _GPTNEOX_BLOCK)
    out.update(_translate("gptneox", rest, _GPTNEOX_TOP, blocks, _NEOX_BUFFERS))
    return out


def gptneox_from_smp(state_dict: Mapping[str, Tensor], num_heads: int) -> dict[str, Tensor]:
    """The DistributedTransformerLMHead layout -> an HF ``GPTNeoXForCausalLM`` state dict (``lm_head``
    is the word embedding when the layout has none of its own)."""
    _check_source("gptneox", state_dict, "word_embedding.weight", "a full LM-head state dict")
    qkv: dict[tuple[str, str], dict[str, Tensor]] = {}
    rest: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        m = _SMP_BLOCK.fullmatch(key)
        part = m["module"].removeprefix("attention.") if m is not None else ""
        if m is not None and m["module"].startswith("attention.") and part in ("query", "key", "value"):
            qkv.setdefault((m["i"], m["leaf"]), {})[part] = value
        else:
            rest[key] = value
    back = {v: k for k, v in _GPTNEOX_TOP.items()}
    names = {v: k for k, v in _GPTNEOX_BLOCK.items()}
    out = _translate("gptneox", rest, back, (_SMP_BLOCK, "gpt_neox.layers", names))
    for (i, leaf), parts in qkv.items():
        if sorted(parts) != ["key", "query", "value"]:
            raise _fail(
                "gptneox", f"layer {i} has {sorted(parts)} of query/key/value {leaf}; pass all three."
            )
        stacked = torch.stack(
            [p.reshape(num_heads, -1, *p.shape[1:]) for p in (parts["query"], parts["key"], parts["value"])],
            1,
        )
        out[f"gpt_neox.layers.{i}.attention.query_key_value.{leaf}"] = stacked.reshape(-1, *stacked.shape[3:])
    out.setdefault("lm_head.weight", state_dict["word_embedding.weight"])
    return out
