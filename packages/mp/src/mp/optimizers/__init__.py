"""``smp.optimizers``: smp's fused optimizers (apex's, which smp re-exported) on torch's own kernels.

- :class:`FusedAdam` is ``torch.optim.Adam`` (decoupled weight decay under ``adam_w_mode``, apex's
  default) with ``fused=True`` where torch has a fused kernel for the parameters' device, else torch's
  default (foreach) implementation.
- :class:`FusedLAMB` is LAMB as apex computes it, written on torch tensors; its global gradient norm and
  trust ratios cover the whole model across pipeline stages and tensor-parallel shards, so it updates
  like LAMB on the unpartitioned model.
- :class:`FusedNovoGrad` is not built: constructing it raises, naming the alternatives.
"""

from mp.optimizer import DistributedOptimizer
from mp.optimizers.fused import FusedAdam, FusedNovoGrad
from mp.optimizers.lamb import FusedLAMB

FusedLamb = FusedLAMB  # smp's documentation's spelling; smp's source spells it FusedLAMB

__all__ = ["DistributedOptimizer", "FusedAdam", "FusedLAMB", "FusedLamb", "FusedNovoGrad"]
