"""Regional compilation: each block compiled on its own, as torchtitan does (repeated blocks share
the compiled code, and compile time stays that of one block of each kind).

Blocks compile whole (`fullgraph=True`: a graph break is an error, not a silent split) where the
layout leaves a block free of collectives that are autograd functions of our own: under expert,
tensor and context parallel the exchanges (all-to-alls, gathers) may split a block's graph there.
`cuda_graphs` compiles with torch.compile's `reduce-overhead` mode, which captures each compiled
block's forward and backward as CUDA graphs (CUDA graph trees): the host launches one graph per
block instead of its hundreds of kernels. tests/test_compile.py checks that every block type
compiles whole, checkpointed or not; tests/test_train.py that a compiled run compiles nothing after
its second step.

Checkpointed blocks are compiled with their checkpoint (the wrapper is what is compiled), which
dynamo traces as one higher-order operator. The first block of a forward to ask for a rope table or
a mask writes it into the forward's context (`ForwardContext.memo`), and dynamo refuses a write to
state outside a checkpoint by default, because eager checkpointing would repeat it in the
recompute. The memo's values are functions of the context alone, so the write need not be
repeated: the recompute rebuilds the same value inside the graph and leaves the memo as it is.
`skip_fwd_side_effects_in_bwd_under_checkpoint` says exactly that, and is set for the process.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from marinlm.model.transformer import named_blocks


def apply_compile(model: nn.Module, *, fullgraph: bool, cuda_graphs: bool = False, backend: str = "inductor") -> None:
    """torch.compile each block of `model` in place (a stage's blocks under pipeline parallel).
    `backend`: torch.compile's (tests trace with `aot_eager`, which builds no kernels)."""
    mode = "reduce-overhead" if cuda_graphs else None
    blocks = [block for _, block in named_blocks(model)]
    if any(isinstance(block, CheckpointWrapper) for block in blocks):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for block in blocks:
        block.compile(fullgraph=fullgraph, mode=mode, backend=backend)
