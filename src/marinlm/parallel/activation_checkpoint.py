"""Activation checkpointing: recompute a block's activations in backward instead of storing them."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from marinlm.model.transformer import named_blocks


def apply_activation_checkpointing(model: nn.Module, mode: str, every_n: int = 2) -> None:
    """Wrap blocks in place. mode: none, full (every block) or every_n (blocks 0, n, 2n, ...).

    The wrapper's state-dict hooks keep parameter names unchanged, so checkpoints do not depend on
    this setting.
    """
    if mode == "none":
        return
    for key, block in named_blocks(model):
        if mode == "full" or int(key) % every_n == 0:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
            wrapped.is_global = block.is_global
            model.layers[key if isinstance(model.layers, nn.ModuleDict) else int(key)] = wrapped
