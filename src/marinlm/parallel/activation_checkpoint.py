"""Activation checkpointing: recompute a block's activations in backward instead of storing them;
and, with it, activation offload: the checkpointed blocks' inputs kept in host memory."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper,
    checkpoint_wrapper,
    offload_wrapper,
)

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
            _replace(model, key, checkpoint_wrapper(block, preserve_rng_state=False), block)


def apply_activation_offload(model: nn.Module) -> None:
    """Keep what each checkpointed block saves for backward, its input (the residual stream), in
    pinned host memory from its forward until its backward brings it back: torch's `offload_wrapper`
    (`save_on_cpu`) around the checkpoint, which saves its inputs under the hooks around it and its
    own forward's tensors under its own. The forward's context (positions, masks) is not a tensor
    argument and stays. Copies run on the compute stream, once out and once back a step."""
    for key, block in named_blocks(model):
        if isinstance(block, CheckpointWrapper):
            _replace(model, key, offload_wrapper(block), block)


def _replace(model: nn.Module, key: str, wrapped: nn.Module, block: nn.Module) -> None:
    wrapped.is_global = block.is_global
    model.layers[key if isinstance(model.layers, nn.ModuleDict) else int(key)] = wrapped
