"""FSDP2 (`fully_shard`): each transformer block is one communication unit, the root holds the rest."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard


def apply_fsdp(model: nn.Module, info, *, reshard_after_forward: bool = True, cpu_offload: bool = False) -> None:
    """Shard parameters across `info.mesh`.

    `reshard_after_forward=True` frees gathered parameters after each block's forward (ZeRO-3-like);
    False keeps them until backward (ZeRO-2-like: more memory, one all-gather fewer).
    """
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for block in model.layers:
        fully_shard(block, mesh=info.mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    # The root group holds the embedding, final norm and LM head (tied weights stay together).
    fully_shard(model, mesh=info.mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload)
