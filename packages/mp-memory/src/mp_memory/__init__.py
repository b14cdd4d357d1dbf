"""mp-memory: the memory savers of mp.

Activation checkpointing and offloading, optimizer-state and parameter sharding, delayed parameter
initialization, mixed precision, and checkpoint save/load with resharding. Built so far:
``activation`` (activation checkpointing on torch.utils.checkpoint), ``precision`` and ``loss_scaler``
(fp16/bf16 with fp32 master weights and smp's loss scaling), ``zero`` (optimizer-state sharding on
torch's ZeroRedundancyOptimizer), ``delayed_init`` (parameters on the meta device, materialized per
rank), ``checkpoint`` (checkpoint files), ``offload`` (checkpointed activations to host memory, loaded
back ahead of their backward), ``sharded`` (sharded data parallelism, ZeRO-3 and HSDP, on FSDP2).
"""

__version__ = "0.1.0"
