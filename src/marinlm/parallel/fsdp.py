"""FSDP2 (`fully_shard`): each transformer block is one communication unit, the root holds the rest."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from marinlm.model.experts import RoutedExperts
from marinlm.model.transformer import named_blocks


def apply_fsdp(
    model: nn.Module, mesh, *, reshard_after_forward: bool = True, cpu_offload: bool = False, experts=None
) -> None:
    """Shard parameters across `mesh`: 1-D is FSDP, 2-D `[dp_replicate, dp_shard]` is HSDP
    (sharded within each replica group, replicated across them).

    `experts`: under expert parallelism, the expert mesh's data axes `[dp_replicate, efsdp]`, where
    the routed experts are their own unit (their weights are already split over `ep`).

    `reshard_after_forward=True` frees each block's gathered parameters after its forward (ZeRO-3-like);
    False keeps them until backward (ZeRO-2-like: more memory, one all-gather fewer). The root unit
    (embedding, final norm, LM head) always keeps them.
    """
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    if experts is not None:
        for module in model.modules():
            if isinstance(module, RoutedExperts):
                fully_shard(module, mesh=experts, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    for _, block in named_blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    # The root group holds the embedding, final norm and LM head (tied weights stay together). It
    # is never resharded after forward: backward starts with those very weights. FSDP2 only
    # regathers a resharded unit when its pre-backward hook finds the unit's output tensors, and
    # torch 2.11 does not look inside our CausalLMOutput dataclass: with the root resharded, the
    # final norm's backward read freed memory (an "illegal memory access" on a GPU; on CPU it goes
    # unnoticed). This is also what FSDP2 does for the root when left to choose.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, offload_policy=offload)
