"""smp's ``offload_activations`` and ``activation_loading_horizon`` on a DistributedModel: the inputs kept
by checkpointed modules move to host memory until their microbatch's backward (mechanism:
``mp_memory.offload``). The task of a thread is the pipeline's (mp_pipeline.context): pp_rank 0's step
function and every rank's module servers alike, so each rank offloads what its own modules keep."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mp.state import state
from mp_memory import Offloader, TaskKey, activate, checkpoint_module
from mp_pipeline import current

if TYPE_CHECKING:
    from mp.model import DistributedModel

__all__ = ["install_offloading"]


def install_offloading(model: DistributedModel) -> Offloader | None:
    """With ``offload_activations``: an offloader for ``model``, used by every checkpoint call (local
    ones, and those a pipeline rank runs for a remote caller). Without it: offloading off."""
    cfg = state.require()[0]
    if not cfg.offload_activations:
        activate(None)
        return None

    def task() -> TaskKey | None:
        ctx = current()
        if ctx is None or state.model is not model or not model.in_step:
            return None
        return int(model.step_count), int(ctx.microbatch)

    offloader = Offloader(cfg.activation_loading_horizon, task)
    activate(offloader)
    runtime = model.runtime
    if runtime is not None:  # a checkpoint call a pipeline rank runs for a remote caller offloads too
        runtime.remote.checkpoint_call = checkpoint_module
    return offloader
