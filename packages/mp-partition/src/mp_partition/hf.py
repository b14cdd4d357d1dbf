"""HuggingFace architectures for the standalone tool: built from a config on the meta device.

Nothing is downloaded: a model is named by a preset below (the published sizes of well-known
checkpoints), by a ``model_type`` that transformers knows (its default config), or by a config JSON file
(or a directory holding ``config.json``). ``transformers`` is imported only here, lazily.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import PartitionError, UnknownConfigFieldError

__all__ = ["PRESETS", "TASKS", "HFModel", "build_hf_model", "load_hf_config", "partition_hf"]

# Published architecture sizes of well-known checkpoints (only what differs from the model type's defaults).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("gpt2", {}),
    "gpt2-medium": ("gpt2", {"n_embd": 1024, "n_layer": 24, "n_head": 16}),
    "gpt2-large": ("gpt2", {"n_embd": 1280, "n_layer": 36, "n_head": 20}),
    "gpt2-xl": ("gpt2", {"n_embd": 1600, "n_layer": 48, "n_head": 25}),
    "t5-small": ("t5", {"d_model": 512, "d_ff": 2048, "d_kv": 64, "num_layers": 6, "num_heads": 8}),
    "t5-base": ("t5", {"d_model": 768, "d_ff": 3072, "d_kv": 64, "num_layers": 12, "num_heads": 12}),
    "t5-large": ("t5", {"d_model": 1024, "d_ff": 4096, "d_kv": 64, "num_layers": 24, "num_heads": 16}),
    "t5-3b": ("t5", {"d_model": 1024, "d_ff": 16384, "d_kv": 128, "num_layers": 24, "num_heads": 32}),
    "t5-11b": ("t5", {"d_model": 1024, "d_ff": 65536, "d_kv": 128, "num_layers": 24, "num_heads": 128}),
    "bert-base-uncased": ("bert", {}),
    "bert-large-uncased": (
        "bert",
        {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096},
    ),
}

TASKS = ("auto", "causal-lm", "seq2seq-lm", "masked-lm", "base")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "partitioning a HuggingFace architecture needs transformers: pip install transformers "
            "(mp-partition itself depends on torch only)"
        ) from exc
    return transformers


def load_hf_config(spec: str, overrides: Mapping[str, Any] | None = None) -> Any:
    """A transformers config from a preset name, a ``model_type`` or a JSON file/directory, plus overrides."""
    tf = _transformers()
    extra = dict(overrides or {})
    if os.path.isdir(spec):
        spec = os.path.join(spec, "config.json")
    if spec.endswith(".json") or os.path.isfile(spec):
        try:
            with open(spec, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise PartitionError(
                f"cannot read config {spec!r} ({exc}): expected a HuggingFace config.json"
            ) from exc
        model_type = data.pop("model_type", None)
        if not model_type:
            raise PartitionError(
                f"config {spec!r} has no 'model_type': expected a HuggingFace config.json; add e.g. "
                '"model_type": "gpt2"'
            )
        _check_overrides(tf, model_type, extra, also=data)
        data.update(extra)
        return tf.AutoConfig.for_model(model_type, **data)
    if spec in PRESETS:
        model_type, sizes = PRESETS[spec]
        _check_overrides(tf, model_type, extra)
        return tf.AutoConfig.for_model(model_type, **{**sizes, **extra})
    try:
        _check_overrides(tf, spec, extra)
        return tf.AutoConfig.for_model(spec, **extra)
    except ValueError as exc:
        if isinstance(exc, PartitionError):
            raise
        raise PartitionError(
            f"unknown architecture {spec!r}: expected a preset ({', '.join(sorted(PRESETS))}), a model_type "
            "that transformers knows (e.g. gpt2, t5, bert, llama), or a path to a config.json"
        ) from exc


def _check_overrides(
    tf: Any, model_type: str, overrides: Mapping[str, Any], also: Mapping[str, Any] | None = None
) -> None:
    """Refuse an override naming no field of the model type's config (transformers would keep it as a
    stray attribute and build the unchanged model). Fields are the default config's keys, their aliases
    (``hidden_size`` for GPT-2's ``n_embd``) and the keys of the config file being read (``also``)."""
    if not overrides:
        return
    default = tf.AutoConfig.for_model(model_type)  # ValueError for an unknown model_type
    fields = {*default.to_dict(), *getattr(default, "attribute_map", {}), *(also or {})}
    for key in overrides:
        if key not in fields:
            nearest = difflib.get_close_matches(key, sorted(fields), n=1)
            raise UnknownConfigFieldError(key, model_type, nearest[0] if nearest else None)


def _auto_class(config: Any, task: str) -> Any:
    tf = _transformers()
    mappings = {
        "causal-lm": tf.AutoModelForCausalLM,
        "seq2seq-lm": tf.AutoModelForSeq2SeqLM,
        "masked-lm": tf.AutoModelForMaskedLM,
        "base": tf.AutoModel,
    }
    if task != "auto":
        if task not in mappings:
            raise PartitionError(f"task {task!r} is invalid: expected one of {', '.join(TASKS)}")
        return mappings[task], task
    from transformers.models.auto import modeling_auto as names

    model_type = config.model_type
    # Encoder-decoder first; then masked LM, since encoder families (BERT, RoBERTa, ...) also have a
    # causal-LM head class while decoder-only models have no masked-LM one.
    if model_type in names.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return mappings["seq2seq-lm"], "seq2seq-lm"
    if model_type in names.MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        return mappings["masked-lm"], "masked-lm"
    if model_type in names.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return mappings["causal-lm"], "causal-lm"
    return mappings["base"], "base"


@dataclass(frozen=True)
class HFModel:
    """A HuggingFace model built from a config, with example inputs for tracing it."""

    model: nn.Module
    config: Any
    task: str
    example_kwargs: dict[str, torch.Tensor]


def _ids(batch_size: int, length: int, vocab: int, device: str | torch.device) -> torch.Tensor:
    if torch.device(device).type == "meta":
        return torch.zeros(batch_size, length, dtype=torch.long, device=device)
    return torch.randint(0, vocab, (batch_size, length), device=device)


def build_hf_model(
    spec: str | Any,
    *,
    task: str = "auto",
    overrides: Mapping[str, Any] | None = None,
    device: str | torch.device = "meta",
    batch_size: int = 1,
    seq_len: int = 128,
    decoder_seq_len: int | None = None,
) -> HFModel:
    """Builds a HuggingFace model from ``spec`` (preset, model_type, config path, or a config object)
    on ``device`` (meta by default: no memory is allocated) with ``input_ids`` (and
    ``decoder_input_ids`` for sequence-to-sequence models) of shape ``(batch_size, seq_len)``;
    ``decoder_seq_len`` gives the decoder inputs a length of their own (T5 pretrains on 512 source and
    114 target tokens)."""
    config = load_hf_config(spec, overrides) if isinstance(spec, str) else spec
    auto_cls, chosen = _auto_class(config, task)
    with torch.device(device):
        model = auto_cls.from_config(config)
    vocab = int(getattr(config, "vocab_size", 2) or 2)
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    length = min(seq_len, int(limit)) if limit else seq_len
    ids = _ids(batch_size, length, vocab, device)
    kwargs: dict[str, torch.Tensor] = {"input_ids": ids}
    if chosen == "seq2seq-lm" or getattr(config, "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = (
            ids.clone() if decoder_seq_len is None else _ids(batch_size, decoder_seq_len, vocab, device)
        )
    return HFModel(model=model, config=config, task=chosen, example_kwargs=kwargs)


def partition_hf(
    spec: str | Any,
    num_partitions: int,
    *,
    memory_weight: float = 0.8,
    task: str = "auto",
    overrides: Mapping[str, Any] | None = None,
    skip_tracing: bool = False,
    batch_size: int = 1,
    seq_len: int = 128,
    device: str | torch.device = "meta",
    allow_empty_partitions: bool = True,
    decoder_seq_len: int | None = None,
) -> Any:
    """Builds a HuggingFace architecture (meta device by default) and auto-partitions it.

    Returns the :class:`~mp_partition.PartitionPlan`. ``spec`` is a preset (``t5-11b``), a model_type
    (``gpt2``), a config.json path or a transformers config object; ``overrides`` change config fields.
    """
    from .api import auto_partition

    built = build_hf_model(
        spec,
        task=task,
        overrides=overrides,
        device=device,
        batch_size=batch_size,
        seq_len=seq_len,
        decoder_seq_len=decoder_seq_len,
    )
    return auto_partition(
        built.model,
        num_partitions,
        example_kwargs=built.example_kwargs,
        memory_weight=memory_weight,
        skip_tracing=skip_tracing,
        allow_empty_partitions=allow_empty_partitions,
    )
