"""The mp demo: start a 4-rank world, show its layout and prove every group really communicates.

    mp-launch -n 4 examples/demo.py            # pp=2 x tp=2 (placement "cluster")
    mp-launch -n 4 examples/demo.py spread     # another placement strategy

Each rank all-reduces its global rank over each of its groups; the sums are checked against the
topology, which is computed independently from the config.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import mp as smp


def main() -> None:
    placement = sys.argv[1] if len(sys.argv) > 1 else "cluster"
    smp.init({"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "placement_strategy": placement})
    topology = smp.state.topology
    assert topology is not None
    if smp.rank() == 0:
        print(topology.describe(), flush=True)
    rows = []
    for name in ("pp", "tp", "rdp", "dp", "mp"):
        members = getattr(smp, f"get_{name}_group")()
        total = torch.tensor([float(smp.rank())])
        dist.all_reduce(total, group=getattr(smp, f"get_{name}_process_group")())
        ok = int(total.item()) == sum(members)
        rows.append(f"{name}{members}={int(total.item())}{'' if ok else ' WRONG'}")
        if not ok:
            raise RuntimeError(f"all-reduce over the {name} group {members} gave {total.item()}")
    lines = smp.allgather(f"rank {smp.rank()}: " + "  ".join(rows), smp.WORLD)
    if smp.rank() == 0:
        print("\nall-reduce of the global rank over each group (sum of the members):")
        print("\n".join(lines))
        print("\nall groups communicate correctly.", flush=True)
    smp.shutdown()


if __name__ == "__main__":
    main()
