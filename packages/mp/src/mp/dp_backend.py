"""The data-parallel engine keys: ``ddp_dist_backend`` and ``ddp_port`` choose how ``smp.init`` starts
torch.distributed; ``horovod`` and ``herring`` (smp's other engines) are refused.

- ``ddp_dist_backend``: "auto" is NCCL for CUDA tensors on GPUs (gloo beside it for CPU tensors and
  objects, which mp's control messages need) and gloo on CPU; "nccl" asks for that NCCL setup and fails
  without GPUs; "gloo" uses gloo for every tensor, CUDA ones included (staged through the host).
- ``ddp_port``: the TCP port of the rendezvous store (rank 0 listens on it; under torchrun, instead of
  MASTER_PORT). None or 0 leaves it to mp (a free port under mpiexec) or the launcher.
"""

from __future__ import annotations

import torch

from mp.config_model import ModelParallelConfig
from mp.config_schema import config_error

__all__ = ["check_engines", "world_backend", "world_port"]


def check_engines(cfg: ModelParallelConfig) -> None:
    """Refuse smp's data-parallel engines other than DDP and an NCCL backend without GPUs (on every rank
    alike, before any process group exists)."""
    for key, on, what in (
        ("horovod", cfg.horovod, "Horovod (smp's TensorFlow data parallelism)"),
        ("herring", cfg.herring, "SageMaker's data-parallel library (herring)"),
    ):
        if on:
            raise config_error(
                key,
                True,
                f": in smp this key reduces gradients with {what}, which mp does not have",
                "false; mp reduces gradients over its data-parallel groups with torch.distributed "
                "(backend set by 'ddp_dist_backend')",
                f"remove '{key}' (or set 'ddp': true, which is what mp does)",
            )
    if cfg.ddp_dist_backend == "nccl" and not torch.cuda.is_available():
        raise config_error(
            "ddp_dist_backend",
            "nccl",
            " on a machine without CUDA GPUs",
            "'auto' (NCCL on GPUs, gloo on CPU), 'gloo', or 'nccl' where CUDA is available",
            "set 'ddp_dist_backend' to 'auto' (or leave it out)",
        )


def world_backend(cfg: ModelParallelConfig) -> str | None:
    """The backend argument for mp_comm.init_world: None lets it choose ('auto')."""
    if cfg.ddp_dist_backend == "nccl":
        return "cpu:gloo,cuda:nccl"  # NCCL for every CUDA tensor; gloo for mp's CPU control messages
    if cfg.ddp_dist_backend == "gloo":
        return "gloo"
    return None


def world_port(cfg: ModelParallelConfig) -> int | None:
    """The rendezvous port for mp_comm.init_world (None: mp or the launcher chooses)."""
    return cfg.ddp_port or None
