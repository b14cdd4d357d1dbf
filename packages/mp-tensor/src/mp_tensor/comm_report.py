"""``python -m mp_tensor.comm_report``: bytes moved by tensor-parallel collectives per layer in one
training step of a small Hugging Face model, against the analytic (Megatron) count.

It starts ``--tp`` local processes (gloo), builds the model from a config (nothing is downloaded; needs
``transformers``), distributes its blocks, runs one forward and backward and prints, per layer and per
(phase, collective), the count and bytes measured and counted. For a model of your own, call
:func:`mp_tensor.comm_volume.measure` in your script and :func:`format_table` on its result.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Sequence
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from mp_tensor.comm_volume import LayerVolume, measure

__all__ = ["FAMILIES", "build_model", "format_table", "main"]

FAMILIES = ("gpt2", "bert", "llama", "neox", "gptneo", "gptj", "t5", "vit")


def build_model(
    family: str, layers: int, hidden: int, heads: int, *, vocab: int = 64, decoder_layers: int | None = None
) -> tuple[nn.Module, Any]:
    """(a small HF model of ``family``, its blocks): dropout off, 4x MLP, ``vocab`` tokens (T5:
    ``layers`` encoder blocks and ``decoder_layers``, by default as many, decoder blocks)."""
    import transformers

    tf: Any = transformers  # configs built by keyword, as their docs show

    ff = 4 * hidden
    m: Any
    if family == "gpt2":
        m = tf.GPT2LMHeadModel(
            tf.GPT2Config(
                n_embd=hidden,
                n_layer=layers,
                n_head=heads,
                vocab_size=vocab,
                n_positions=64,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )
        return m, m.transformer.h
    if family == "bert":
        m = tf.BertForMaskedLM(
            tf.BertConfig(
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                intermediate_size=ff,
                vocab_size=vocab,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                max_position_embeddings=64,
            )
        )
        return m, m.bert.encoder.layer
    if family == "t5":
        m = tf.T5ForConditionalGeneration(
            tf.T5Config(
                d_model=hidden,
                d_kv=hidden // heads,
                d_ff=ff,
                num_layers=layers,
                num_decoder_layers=decoder_layers,
                num_heads=heads,
                vocab_size=vocab,
                dropout_rate=0.0,
                decoder_start_token_id=0,
                use_cache=False,
            )
        )
        return m, [*m.encoder.block, *m.decoder.block]
    if family == "vit":
        m = tf.ViTForImageClassification(
            tf.ViTConfig(
                image_size=16,
                patch_size=4,
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                intermediate_size=ff,
                num_labels=5,
            )
        )
        return m, m.vit.layers
    common: dict[str, Any] = {
        "hidden_size": hidden,
        "intermediate_size": ff,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "vocab_size": vocab,
        "max_position_embeddings": 64,
    }
    if family == "llama":
        m = tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=heads))
        return m, m.model.layers
    if family == "neox":
        m = tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**common))
        return m, m.gpt_neox.layers
    if family == "gptneo":
        cfg = tf.GPTNeoConfig(
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            intermediate_size=ff,
            vocab_size=vocab,
            max_position_embeddings=64,
            attention_types=[[["global"], layers]],
            embed_dropout=0.0,
            attention_dropout=0.0,
            resid_dropout=0.0,
        )
        cfg._attn_implementation = "eager"
        m = tf.GPTNeoForCausalLM(cfg)
        return m, m.transformer.h
    if family == "gptj":
        m = tf.GPTJForCausalLM(
            tf.GPTJConfig(
                n_embd=hidden,
                n_layer=layers,
                n_head=heads,
                n_inner=ff,
                rotary_dim=hidden // heads // 2,
                vocab_size=vocab,
                n_positions=64,
            )
        )
        return m, m.transformer.h
    raise ValueError(f"comm_report got family={family!r}; expected one of {', '.join(FAMILIES)}.")


def model_inputs(family: str, batch: int, seq: int, vocab: int = 64) -> dict[str, Any]:
    """One batch for ``build_model(family, ...)``'s model."""
    gen = torch.Generator().manual_seed(0)
    if family == "vit":
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=gen)}
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    if family == "t5":
        return {"input_ids": ids, "decoder_input_ids": ids}
    return {"input_ids": ids} if family == "bert" else {"input_ids": ids, "use_cache": False}


def _row_lines(row: LayerVolume) -> list[str]:
    keys = sorted(set(row.measured) | set(row.analytic or {}))
    lines = []
    for phase, kind in keys:
        mc, mb = row.measured.get((phase, kind), (0, 0))
        if row.analytic is None:
            counted, ok = "not modeled", ""
        elif (phase, kind) in row.analytic or row.complete:
            ac, ab = row.analytic.get((phase, kind), (0, 0))
            counted, ok = f"{ac} / {ab:,}", "yes" if (mc, mb) == (ac, ab) else "NO"
        else:
            counted, ok = "(sample exchange)", ""
        lines.append(f"| {row.name} | {row.cls} | {phase} {kind} | {mc} / {mb:,} | {counted} | {ok} |")
    return lines


def format_table(rows: Sequence[LayerVolume]) -> str:
    """A markdown table of :func:`mp_tensor.comm_volume.measure`'s rows."""
    head = [
        "| layer | class | collective | measured (count / bytes) | analytic (count / bytes) | equal |",
        "|---|---|---|---|---|---|",
    ]
    return "\n".join(head + [line for row in rows for line in _row_lines(row)])


def _worker(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.tp)
    try:
        from mp_tensor.context import TPContext
        from mp_tensor.enable import set_tensor_parallelism
        from mp_tensor.replace import replace_modules

        torch.manual_seed(0)
        model, blocks = build_model(args.family, args.layers, args.hidden, args.heads)
        for block in blocks:
            set_tensor_parallelism(block, True)
        ctx = TPContext(group=dist.group.WORLD, optimize=args.optimize, prescaled_batch=args.prescaled)
        model = replace_modules(model, ctx)
        inputs = model_inputs(args.family, args.batch, args.seq)

        def step() -> None:
            out = model(**inputs)
            logits = out.logits if hasattr(out, "logits") else out[0]
            logits.float().pow(2).mean().backward()

        rows = measure(model, step)
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def _result(queue: Any, procs: list[Any]) -> list[LayerVolume] | None:
    """Rank 0's rows, or None once a worker has died without them."""
    while True:
        try:
            return queue.get(timeout=2)  # type: ignore[no-any-return]
        except Empty:
            if any(p.exitcode not in (None, 0) for p in procs) or all(p.exitcode == 0 for p in procs):
                return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mp_tensor.comm_report", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--family", choices=FAMILIES, default="gpt2")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (local processes)")
    parser.add_argument("--optimize", choices=("speed", "memory"), default="speed")
    parser.add_argument(
        "--prescaled", action="store_true", help="prescaled_batch: every rank feeds the same batch"
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="samples per rank")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args, port, queue)) for r in range(args.tp)]
    for p in procs:
        p.start()
    rows = _result(queue, procs)
    for p in procs:
        p.join(timeout=60)
    if rows is None:
        print("comm_report: a worker failed before reporting (its error is above)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([_as_json(r) for r in rows], indent=1))
    else:
        print(format_table(rows))
    modeled = [r.matches() for r in rows if r.matches() is not None]
    return 0 if all(modeled) else 1


def _as_json(row: LayerVolume) -> dict[str, Any]:
    def flat(d: dict[tuple[str, str], tuple[int, int]] | None) -> Any:
        return None if d is None else {f"{p} {k}": {"count": c, "bytes": b} for (p, k), (c, b) in d.items()}

    return {
        "layer": row.name,
        "class": row.cls,
        "tokens": row.tokens,
        "measured": flat(row.measured),
        "analytic": flat(row.analytic),
        "equal": row.matches(),
    }


if __name__ == "__main__":
    sys.exit(main())
