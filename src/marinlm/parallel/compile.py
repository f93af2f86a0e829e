"""Regional compilation: each block compiled on its own, as torchtitan does (repeated blocks share
the compiled code, and compile time stays that of one block of each kind).

Blocks compile whole (`fullgraph=True`: a graph break is an error, not a silent split) where the
layout leaves a block free of collectives that are autograd functions of our own: under expert,
tensor and context parallel the exchanges (all-to-alls, gathers) may split a block's graph there.
`cuda_graphs` compiles with torch.compile's `reduce-overhead` mode, which captures each compiled
block's forward and backward as CUDA graphs (CUDA graph trees): the host launches one graph per
block instead of its hundreds of kernels. tests/test_compile.py checks that every block type
compiles whole; tests/test_train.py that a compiled run compiles nothing after its second step.
"""

from __future__ import annotations

from torch import nn

from marinlm.model.transformer import named_blocks


def apply_compile(model: nn.Module, *, fullgraph: bool, cuda_graphs: bool = False) -> None:
    """torch.compile each block of `model` in place (a stage's blocks under pipeline parallel)."""
    mode = "reduce-overhead" if cuda_graphs else None
    for _, block in named_blocks(model):
        block.compile(fullgraph=fullgraph, mode=mode)
