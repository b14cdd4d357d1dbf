"""``python -m mp_tensor.atp``: the mesh search as a command.

* ``search``: cost every 2-D mesh of N devices on a topology (a JSON file or a preset) for a model shape
  and print the table (or JSON);
* ``preset``: write a preset topology as JSON, to edit or to pass to ``search``;
* ``calibrate``: measure every mesh's all-reduce bandwidths on this machine (run it under ``mpiexec``) and
  write the calibrated topology as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence

from mp_tensor.atp.comm_matrix import (
    CommMatrix,
    dual_nvlink_node,
    ethernet_cluster,
    fully_connected,
    infiniband_cluster,
    nvswitch_node,
    pcie_tree,
    torus_2d,
)
from mp_tensor.atp.errors import ATPError
from mp_tensor.atp.search import ModelShape, choose_mesh

__all__ = ["PRESETS", "main"]

log = logging.getLogger(__name__)

#: Preset topologies by name; each takes the parsed arguments (``gpus``, ``nodes``, ``rows``, ``cols``).
PRESETS: dict[str, Callable[[argparse.Namespace], CommMatrix]] = {
    "nvswitch": lambda a: nvswitch_node(a.gpus),
    "dual-nvlink": lambda a: dual_nvlink_node(a.gpus),
    "pcie": lambda a: pcie_tree(gpus_per_switch=max(a.gpus // 4, 1)),
    "ib-cluster": lambda a: infiniband_cluster(a.nodes, nvswitch_node(a.gpus)),
    "eth-cluster": lambda a: ethernet_cluster(a.nodes, nvswitch_node(a.gpus)),
    "fig7a": lambda a: infiniband_cluster(4, fully_connected(4, 200.0, 600.0, name="nvlink-4gpu"), 200.0),
    "torus": lambda a: torus_2d(a.rows, a.cols),
    "nvlink-switch": lambda a: fully_connected(a.gpus, 900.0, name=f"nvlink-network-{a.gpus}"),
}


def _topology_args(p: argparse.ArgumentParser, required: bool) -> None:
    source = p.add_mutually_exclusive_group(required=required)
    source.add_argument("--topology", help="hierarchical communication matrix as JSON (see `preset`)")
    source.add_argument("--preset", choices=sorted(PRESETS), help="a built-in topology")
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node for presets (default 8)")
    p.add_argument("--nodes", type=int, default=2, help="nodes for cluster presets (default 2)")
    p.add_argument("--rows", type=int, default=4, help="torus rows (default 4)")
    p.add_argument("--cols", type=int, default=4, help="torus columns (default 4)")


def _matrix(args: argparse.Namespace) -> CommMatrix | None:
    if args.topology:
        return CommMatrix.load(args.topology)
    if args.preset:
        return PRESETS[args.preset](args)
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mp_tensor.atp", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    search = sub.add_parser("search", help="cost every 2-D mesh and print the table")
    _topology_args(search, required=True)
    search.add_argument("--devices", type=int, help="tensor-parallel degree N (default: all devices)")
    search.add_argument("--layers", type=int, required=True, help="transformer layers L")
    search.add_argument("--batch", type=int, required=True, help="micro-batch size b")
    search.add_argument("--seq", type=int, required=True, help="sequence length s")
    search.add_argument("--hidden", type=int, required=True, help="hidden size h")
    search.add_argument("--bytes", type=int, default=2, help="bytes per element (default 2)")
    search.add_argument("--json", action="store_true", help="print the result as JSON")
    preset = sub.add_parser("preset", help="write a preset topology as JSON")
    _topology_args(preset, required=True)
    preset.add_argument("-o", "--output", help="file to write (default: stdout)")
    cal = sub.add_parser("calibrate", help="measure this machine's mesh bandwidths (under mpiexec)")
    _topology_args(cal, required=False)
    cal.add_argument("-o", "--output", required=True, help="file to write the calibrated topology to")
    cal.add_argument("--message-bytes", type=int, default=1 << 22, help="all-reduce size (default 4 MiB)")
    cal.add_argument("--iters", type=int, default=5, help="all-reduces per timing (default 5)")
    return parser


def _calibrate(args: argparse.Namespace) -> int:
    from mp_comm.world import init_world
    from mp_tensor.atp.calibrate import calibrate

    world = init_world()
    try:
        matrix = calibrate(_matrix(args), nbytes=args.message_bytes, iters=args.iters)
        if world.rank == 0:
            matrix.save(args.output)
            print(matrix.describe())
    finally:
        world.shutdown()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "calibrate":
            return _calibrate(args)
        matrix = _matrix(args)
        assert matrix is not None
        if args.command == "preset":
            text = matrix.to_json()
            if args.output:
                matrix.save(args.output)
            else:
                print(text)
            return 0
        model = ModelShape(
            layers=args.layers,
            batch=args.batch,
            seq=args.seq,
            hidden=args.hidden,
            bytes_per_element=args.bytes,
        )
        result = choose_mesh(args.devices or matrix.num_devices, matrix, model)
        print(json.dumps(result.to_dict(), indent=2) if args.json else result.format_table())
        return 0
    except (ATPError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
