"""smp's Hugging Face state-dict translations (``smp.nn.huggingface.<family>``), on full state dicts.

smp replaced a whole Hugging Face stack by its distributed modules and saved their layout; these
functions convert between that layout and Hugging Face's (both unsharded), exactly in both directions:

- GPT-2 (``GPT2LMHeadModel`` or ``GPT2Model`` keys) <-> a :class:`DistributedTransformerLMHead`
  (``word_embedding``, ``position_embedding``, ``transformer.seq_layers.<i>.*``, ``layernorm``; the LM
  head is tied to the word embedding, as in smp). :func:`gpt2_lm_head_kwargs` builds the matching module.
- BERT / RoBERTa (any model holding an ``encoder``) <-> the same keys with ``encoder.layer.<i>`` as a
  :class:`DistributedTransformer` (``encoder.seq_layers.<i>.*``); every other key is unchanged.
- GPT-J and GPT-Neo: :mod:`mp_tensor.hf.translate_gpt`.

``max_seq_len`` (to Hugging Face) adds the buffers that transformers < 4.31 saved in its state dicts
(GPT-2's causal ``attn.bias``/``attn.masked_bias``, BERT's ``embeddings.position_ids``); current
transformers keeps them out of the state dict, so leave it None there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from mp_tensor.errors import HFTranslationError
from mp_tensor.hf import gpt2
from mp_tensor.hf.common import ACTIVATION_MAP

__all__ = [
    "bert_from_smp",
    "bert_to_smp",
    "gpt2_from_smp",
    "gpt2_lm_head_kwargs",
    "gpt2_to_smp",
]

_GPT2_BLOCK = {
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
}
_GPT2_BUFFERS = {"attn.bias", "attn.masked_bias"}  # saved by transformers < 4.31; rebuilt from config
_GPT2_TOP = {"wte.weight": "word_embedding.weight", "wpe.weight": "position_embedding.weight"}
_GPT2_TOP.update({f"ln_f.{p}": f"layernorm.{p}" for p in ("weight", "bias")})

#: BertLayer submodules -> DistributedTransformerLayer submodules.
_BERT_NAMES = {
    "attention.self.query": "attention.query",
    "attention.self.key": "attention.key",
    "attention.self.value": "attention.value",
    "attention.output.dense": "attention.dense",
    "attention.output.LayerNorm": "attention.layernorm",
    "intermediate.dense": "output.dense1",
    "output.dense": "output.dense2",
    "output.LayerNorm": "output.layernorm",
}
_BERT_BACK = {v: k for k, v in _BERT_NAMES.items()}


def _fail(family: str, message: str) -> HFTranslationError:
    return HFTranslationError(f"smp.nn.huggingface.{family}: {message}")


def _layers(sd: Mapping[str, Tensor], pattern: str) -> dict[int, dict[str, Tensor]]:
    found: dict[int, dict[str, Tensor]] = {}
    for key, value in sd.items():
        m = re.fullmatch(pattern, key)
        if m:
            found.setdefault(int(m["i"]), {})[m["rest"]] = value
    return found


# ---------------------------------------------------------------------------------------------- GPT-2


def gpt2_lm_head_kwargs(config: Any) -> dict[str, Any]:
    """The :class:`DistributedTransformerLMHead` arguments equivalent to an HF ``GPT2LMHeadModel``."""
    kwargs = gpt2.layer_kwargs(config)
    kwargs.update(
        num_layers=config.n_layer,
        vocab_size=config.vocab_size,
        num_positions=config.n_positions,
        embedding_dropout_prob=config.embd_pdrop,
        final_layernorm=True,
    )
    if config.activation_function not in ACTIVATION_MAP:
        raise _fail("gpt2", f"activation_function={config.activation_function!r} has no equivalent")
    return kwargs


def gpt2_to_smp(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """An HF GPT-2 state dict -> the DistributedTransformerLMHead layout."""
    prefix = "transformer." if "transformer.wte.weight" in state_dict else ""
    if f"{prefix}wte.weight" not in state_dict:
        raise _fail(
            "gpt2",
            f"the state dict has no 'transformer.wte.weight' nor 'wte.weight' (got {sorted(state_dict)[:5]}"
            "...); pass a GPT2LMHeadModel's or GPT2Model's state_dict().",
        )
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for key, name in _GPT2_TOP.items():
        if f"{prefix}{key}" in state_dict:
            out[name] = state_dict[f"{prefix}{key}"]
            used.add(f"{prefix}{key}")
    blocks = _layers(state_dict, rf"{re.escape(prefix)}h\.(?P<i>\d+)\.(?P<rest>.+)")
    for i, block in sorted(blocks.items()):
        weights = {k: v for k, v in block.items() if k not in _GPT2_BUFFERS}
        if set(weights) != _GPT2_BLOCK:
            raise _fail(
                "gpt2",
                f"block {i} has keys {sorted(set(weights) ^ _GPT2_BLOCK)} beyond or short of a GPT2Block's "
                "(cross attention is not translated); pass a plain GPT-2 state dict.",
            )
        ref = gpt2.block_to_reference(weights)
        out.update({f"transformer.seq_layers.{i}.{k}": v for k, v in ref.items()})
        used.update(f"{prefix}h.{i}.{k}" for k in block)
    if "lm_head.weight" in state_dict:
        used.add("lm_head.weight")
        if not torch.equal(state_dict["lm_head.weight"], out["word_embedding.weight"]):
            raise _fail(
                "gpt2",
                "lm_head.weight differs from transformer.wte.weight; the distributed LM head is tied to the "
                "word embedding. Pass a model with tie_word_embeddings=True.",
            )
    rest = sorted(set(state_dict) - used)
    if rest:
        raise _fail("gpt2", f"keys {rest} have no place in the DistributedTransformerLMHead layout.")
    return out


def gpt2_from_smp(state_dict: Mapping[str, Tensor], max_seq_len: int | None = None) -> dict[str, Tensor]:
    """The DistributedTransformerLMHead layout -> an HF ``GPT2LMHeadModel`` state dict."""
    back = {v: k for k, v in _GPT2_TOP.items()}
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    for key, name in back.items():
        if key in state_dict:
            out[f"transformer.{name}"] = state_dict[key]
            used.add(key)
    if "word_embedding.weight" not in state_dict:
        raise _fail("gpt2", "the state dict has no 'word_embedding.weight'; pass a full LM-head state dict.")
    blocks = _layers(state_dict, r"transformer\.seq_layers\.(?P<i>\d+)\.(?P<rest>.+)")
    for i, block in sorted(blocks.items()):
        try:
            hf = gpt2.block_from_reference(block)
        except KeyError as exc:
            raise _fail("gpt2", f"layer {i} lacks {exc}; pass a full pre-layernorm GPT-2 layer.") from None
        extra = sorted(set(block) - set(gpt2.block_to_reference(hf)))
        if extra:
            raise _fail("gpt2", f"layer {i} has keys {extra} that a GPT2Block cannot hold.")
        out.update({f"transformer.h.{i}.{k}": v for k, v in hf.items()})
        if max_seq_len is not None:
            causal = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool).tril()
            out[f"transformer.h.{i}.attn.bias"] = causal.view(1, 1, max_seq_len, max_seq_len)
            out[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        used.update(f"transformer.seq_layers.{i}.{k}" for k in block)
    rest = sorted(set(state_dict) - used)
    if rest:
        raise _fail("gpt2", f"keys {rest} have no place in a GPT2LMHeadModel.")
    out["lm_head.weight"] = state_dict["word_embedding.weight"]
    return out


# ---------------------------------------------------------------------------------------- BERT/RoBERTa


def _map_layer(
    family: str, i: int, block: Mapping[str, Tensor], names: Mapping[str, str]
) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for key, value in block.items():
        module, _, leaf = key.rpartition(".")
        if module not in names:
            raise _fail(
                family, f"layer {i} has '{key}', which has no counterpart (cross attention is not mapped)."
            )
        out[f"{names[module]}.{leaf}"] = value
    return out


def bert_to_smp(state_dict: Mapping[str, Tensor], family: str = "bert") -> dict[str, Tensor]:
    """An HF BERT/RoBERTa state dict -> the same with each encoder's layers as a DistributedTransformer."""
    pattern = re.compile(r"(?P<pre>(?:.*\.)?encoder\.)layer\.(?P<i>\d+)\.(?P<rest>.+)")
    return _encoder(family, state_dict, pattern, "seq_layers", _BERT_NAMES)


def bert_from_smp(
    state_dict: Mapping[str, Tensor], max_seq_len: int | None = None, family: str = "bert"
) -> dict[str, Tensor]:
    """The DistributedTransformer encoder layout -> an HF BERT/RoBERTa state dict."""
    pattern = re.compile(r"(?P<pre>(?:.*\.)?encoder\.)seq_layers\.(?P<i>\d+)\.(?P<rest>.+)")
    out = _encoder(family, state_dict, pattern, "layer", _BERT_BACK)
    if max_seq_len is not None:
        for key in [k for k in out if k.endswith("embeddings.word_embeddings.weight")]:
            ids = key[: -len("word_embeddings.weight")] + "position_ids"
            out.setdefault(ids, torch.arange(max_seq_len).unsqueeze(0))
    return out


def _encoder(
    family: str,
    state_dict: Mapping[str, Tensor],
    pattern: re.Pattern[str],
    container: str,
    names: Mapping[str, str],
) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    layers: dict[tuple[str, int], dict[str, Tensor]] = {}
    for key, value in state_dict.items():
        m = pattern.fullmatch(key)
        if m is None:
            out[key] = value
        else:
            layers.setdefault((m["pre"], int(m["i"])), {})[m["rest"]] = value
    if not layers:
        raise _fail(family, "the state dict has no encoder layers; pass the whole model's state_dict().")
    for (pre, i), block in sorted(layers.items()):
        mapped = _map_layer(family, i, block, names)
        out.update({f"{pre}{container}.{i}.{k}": v for k, v in mapped.items()})
    return out
