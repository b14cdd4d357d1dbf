"""``mp-partition`` / ``python -m mp_partition``: partition a model and print (and save) the report.

Examples::

    mp-partition t5-11b -n 8 --memory-weight 1.0 --out plans/t5-11b
    mp-partition gpt2 -n 4 --set n_layer=48 --picture gpt2.svg
    mp-partition ./config.json -n 2 --save plan.json
    mp-partition mypkg.models:build -n 4 --factory-kwargs '{"layers": 24}'
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from .errors import PartitionError
from .plan import PartitionPlan

__all__ = ["build_parser", "main", "run"]


def _parse_override(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def build_parser() -> argparse.ArgumentParser:
    from .hf import PRESETS, TASKS

    parser = argparse.ArgumentParser(
        prog="mp-partition",
        description=(
            "Partition a model into pipeline stages with the SageMaker model parallelism algorithm and print "
            "the plan. MODEL is a HuggingFace preset ("
            + ", ".join(sorted(PRESETS))
            + "), a transformers model_type, a config.json (or a directory holding one), or "
            "package.module:factory. HuggingFace models are built on the meta device; nothing is downloaded."
        ),
    )
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("-n", "--partitions", type=int, default=2, help="number of partitions (default 2)")
    parser.add_argument("-a", "--memory-weight", type=float, default=0.8, help="α in [0, 1] (default 0.8)")
    parser.add_argument("--skip-tracing", action="store_true", help="costs from sizes, no forward pass")
    parser.add_argument("--measure-time", action="store_true", help="time modules (CPU/CUDA models only)")
    parser.add_argument("--task", choices=TASKS, default="auto", help="HuggingFace head (default: auto)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        type=_parse_override,
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (JSON value), repeatable",
    )
    parser.add_argument("--batch-size", type=int, default=1, help="tracing batch size (HF models)")
    parser.add_argument("--seq-len", type=int, default=128, help="tracing sequence length (HF models)")
    parser.add_argument(
        "--decoder-seq-len", type=int, default=None, help="decoder input length of encoder-decoder models"
    )
    parser.add_argument(
        "--device", default=None, help="device to build on (HF default: meta; factories: as they build)"
    )
    parser.add_argument("--factory-kwargs", default=None, help="JSON object passed to the factory")
    parser.add_argument("--full", action="store_true", help="show every node, not only split decisions")
    parser.add_argument("--max-depth", type=int, default=None, help="deepest tree level to show")
    parser.add_argument("--save", default=None, help="write the plan JSON here")
    parser.add_argument("--report", default=None, help="write the text report here")
    parser.add_argument(
        "--picture", default=None, help="draw the plan to a .png/.svg/.pdf (needs matplotlib)"
    )
    parser.add_argument("--out", default=None, help="directory for plan.json, report.txt and plan.png")
    parser.add_argument("--quiet", action="store_true", help="do not print the report")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    return parser


def _is_factory(spec: str) -> bool:
    if os.path.exists(spec):
        return False
    module, sep, attr = spec.partition(":")
    return bool(sep and module and attr)


def run(args: argparse.Namespace) -> PartitionPlan:
    """Computes the plan the parsed command line asks for."""
    from .api import auto_partition

    if _is_factory(args.model):
        from .factory import load_factory

        try:
            factory_kwargs = json.loads(args.factory_kwargs) if args.factory_kwargs else {}
        except json.JSONDecodeError as exc:
            raise PartitionError(f"--factory-kwargs {args.factory_kwargs!r} is not JSON ({exc})") from exc
        if not isinstance(factory_kwargs, dict):
            raise PartitionError(f"--factory-kwargs must be a JSON object, got {args.factory_kwargs!r}")
        made = load_factory(args.model, factory_kwargs, device=args.device)
        skip = args.skip_tracing or not (made.args or made.kwargs)
        if skip and not args.skip_tracing:
            logging.getLogger(__name__).info("the factory returned no example inputs: costs from sizes only")
        return auto_partition(
            made.model,
            args.partitions,
            example_args=made.args,
            example_kwargs=made.kwargs,
            memory_weight=args.memory_weight,
            skip_tracing=skip,
            measure_time=args.measure_time,
        )
    from .hf import build_hf_model

    built = build_hf_model(
        args.model,
        task=args.task,
        overrides=dict(args.overrides),
        device=args.device or "meta",
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        decoder_seq_len=args.decoder_seq_len,
    )
    return auto_partition(
        built.model,
        args.partitions,
        example_kwargs=built.example_kwargs,
        memory_weight=args.memory_weight,
        skip_tracing=args.skip_tracing,
        measure_time=args.measure_time,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    try:
        plan = run(args)
        text = plan.report(full=args.full, max_depth=args.max_depth)
        save, report, picture = args.save, args.report, args.picture
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            save = save or os.path.join(args.out, "plan.json")
            report = report or os.path.join(args.out, "report.txt")
            picture = picture or os.path.join(args.out, "plan.png")
        if save:
            plan.save(save)
        if report:
            with open(report, "w", encoding="utf-8") as fh:
                fh.write(text)
        if picture:
            try:
                plan.render(picture, full=args.full, max_depth=args.max_depth)
            except ImportError as exc:
                if args.picture:
                    raise
                sys.stderr.write(f"note: no picture written ({exc})\n")
                picture = None
    except (PartitionError, ImportError, OSError) as exc:
        sys.stderr.write(f"mp-partition: error: {exc}\n")
        return 2
    if not args.quiet:
        sys.stdout.write(text)
    for what, path in (("plan", save), ("report", report), ("picture", picture)):
        if path:
            sys.stdout.write(f"{what} written to {path}\n")
    return 0
