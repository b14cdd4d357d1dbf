"""``mp-plan``: rank the layouts of a model on a cluster and print the top one's mp config.

Examples::

    mp-plan gpt2-xl --global-batch 512 --seq-len 1024 --cluster a100-40gb --hosts 4
    mp-plan t5-11b --global-batch 256 --seq-len 512 --cluster h100 --hosts 2 --checkpointing
    mp-plan mypkg.models:build --global-batch 16 --seq-len 128 --cluster cpu --devices-per-host 2 \\
        --config-out plan.json --timeline plan.png
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from mp.plan.cluster import PRESETS

__all__ = ["build_parser", "main"]


def _override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _tristate(parser: argparse.ArgumentParser, name: str, help_on: str) -> None:
    group = parser.add_mutually_exclusive_group()
    dest = name.replace("-", "_")
    group.add_argument(f"--{name}", dest=dest, action="store_const", const=True, default=None, help=help_on)
    group.add_argument(f"--no-{name}", dest=dest, action="store_const", const=False, help="never " + help_on)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mp-plan",
        description=(
            "Choose a layout (pipeline, tensor and data-parallel degrees, microbatches, schedule, memory "
            "savers) for MODEL on a cluster and predict its step time and per-device memory. MODEL is a "
            "HuggingFace preset, model_type or config.json (built on the meta device; nothing is "
            "downloaded), or package.module:factory returning (module, example inputs of one sample)."
        ),
    )
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--global-batch", type=int, required=True, help="sequences (samples) per step")
    p.add_argument("--seq-len", type=int, default=1024, help="sequence length (default 1024)")
    p.add_argument(
        "--decoder-seq-len", type=int, default=None, help="target length of encoder-decoder models"
    )
    p.add_argument("--cluster", default="a100-40gb", choices=sorted(PRESETS), help="device preset")
    p.add_argument("--hosts", type=int, default=None, help="number of hosts (default 1)")
    p.add_argument("--devices-per-host", type=int, default=None, help="devices per host (preset's default)")
    p.add_argument("--no-calibrate", action="store_true", help="cpu preset: keep its FLOP/s, do not measure")
    p.add_argument(
        "--precision",
        choices=("fp32", "fp16", "bf16"),
        default=None,
        help="default: bf16 on GPUs, fp32 on cpu",
    )
    p.add_argument("--pp", type=int, default=None, help="pin the pipeline degree")
    p.add_argument("--tp", type=int, default=None, help="pin the tensor-parallel degree")
    p.add_argument("--microbatches", type=int, default=None, help="pin the number of microbatches")
    p.add_argument("--schedule", choices=("interleaved", "simple"), default=None, help="pin the schedule")
    _tristate(p, "checkpointing", "use activation checkpointing")
    _tristate(p, "offload", "offload checkpointed activations")
    _tristate(p, "shard-optimizer-state", "shard optimizer state")
    _tristate(p, "sdp", "use sharded data parallelism")
    p.add_argument("--memory-weight", type=float, default=None, help="partitioner's alpha (default 0.8)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        type=_override,
        default=[],
        metavar="KEY=VALUE",
        help="override a HuggingFace config field (JSON value), repeatable",
    )
    p.add_argument("--factory-kwargs", default=None, help="JSON object passed to the factory")
    p.add_argument(
        "--hidden", type=int, default=None, help="hidden size, when it cannot be read from the model"
    )
    p.add_argument("--top", type=int, default=10, help="layouts to show (default 10)")
    p.add_argument("--config-out", default=None, help="write the top layout's mp config JSON here")
    p.add_argument("--json", default=None, help="write every estimate as JSON here")
    p.add_argument("--timeline", default=None, help="draw the top layout's predicted step (.png/.svg)")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on a planning error)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    if os.getcwd() not in sys.path:  # package.module:factory from the current directory, as python -m does
        sys.path.insert(0, os.getcwd())
    from mp.plan import PlanError, calibrate_cpu, get_cluster, plan
    from mp.plan.profile import parse_json_object
    from mp.plan.report import checked_config, render_timeline, to_dict

    try:
        cluster = get_cluster(args.cluster, hosts=args.hosts, devices_per_host=args.devices_per_host)
        if cluster.name == "cpu" and not args.no_calibrate:
            cluster = calibrate_cpu(cluster)
        result = plan(
            args.model,
            global_batch=args.global_batch,
            seq_len=args.seq_len,
            cluster=cluster,
            precision=args.precision,
            pp=args.pp,
            tp=args.tp,
            microbatches=args.microbatches,
            schedule=args.schedule,
            checkpointing=args.checkpointing,
            offload=args.offload,
            shard_optimizer_state=args.shard_optimizer_state,
            sdp=args.sdp,
            memory_weight=args.memory_weight,
            overrides=dict(args.overrides),
            factory_kwargs=parse_json_object(args.factory_kwargs, "--factory-kwargs"),
            decoder_seq_len=args.decoder_seq_len,
            hidden=args.hidden,
        )
        sys.stdout.write(result.report(top=args.top))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump([to_dict(e) for e in result.estimates], fh, indent=1)
        best = result.best
        config = checked_config(best)
        text = json.dumps(config, indent=2)
        sys.stdout.write(
            f"\nmp config of the top layout ({best.layout.label()}), for mp-launch -n "
            f"{best.layout.world} --config:\n{text}\n"
        )
        if best.layout.checkpointing:
            sys.stdout.write(
                "activation checkpointing: apply smp.set_activation_checkpointing to each layer "
                "in the script (it is not a config key)\n"
            )
        if args.config_out:
            with open(args.config_out, "w", encoding="utf-8") as fh:
                fh.write(text + "\n")
        if args.timeline:
            drawn = render_timeline(best, args.timeline)
            if drawn is not None:
                sys.stdout.write(f"timeline written to {drawn}\n")
    except (PlanError, OSError, ValueError) as exc:
        sys.stderr.write(f"mp-plan: error: {exc}\n")
        return 2
    return 0
