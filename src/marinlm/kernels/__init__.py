"""Fast paths for the reference model, swapped in by one converter before `parallelize`.

Each kernel subclasses one reference module of `marinlm.model` and keeps its parameters, buffers
and state-dict keys, so checkpoints, HF export and FSDP2 see the same model either way. The
converter changes the class of each module in place (on `meta` or on a device), as torchtitan's
model converters do: a run's `kernels.modules: reference` runs the plain model, `auto` the kernels below.
Every kernel is tested equal to its reference in `tests/test_kernels.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from marinlm.kernels.attention import FusedAttention
from marinlm.kernels.bf16 import EmulatedBf16Linear
from marinlm.kernels.config import KernelConfig
from marinlm.kernels.experts import FusedRoutedExperts
from marinlm.kernels.flex_attention import FlexAttention
from marinlm.kernels.layers import FusedRMSNorm, FusedSConv
from marinlm.kernels.loss import FusedNextTokenLoss
from marinlm.model.attention import Attention
from marinlm.model.experts import RoutedExperts
from marinlm.model.layers import RMSNorm, SConv
from marinlm.model.loss import NextTokenLoss
from marinlm.utils.device import emulated_bf16

# reference module -> kernel, for every device and precision
KERNELS: dict[type[nn.Module], type[nn.Module]] = {
    RMSNorm: FusedRMSNorm,
    SConv: FusedSConv,
    Attention: FusedAttention,
    RoutedExperts: FusedRoutedExperts,
    NextTokenLoss: FusedNextTokenLoss,
}


def apply_kernels(
    model: nn.Module,
    device: torch.device | str,
    precision: str,
    kernels: KernelConfig | None = None,
    *,
    compiled: bool = False,
) -> nn.Module:
    """Swap the kernels into `model` in place, unless `kernels` (a run's `kernels:` section; default:
    auto) says `modules: reference`; either way the routed experts take `kernels.experts` and the
    loss `kernels.loss_chunk_tokens`.

    `precision` is the one the model will run in (fp32, bf16, fp64): in bf16 on a CPU without bf16
    GEMMs the linear layers also become `EmulatedBf16Linear` (bf16 products through fp32 GEMMs).
    `compiled`: the blocks will run under torch.compile; on a GPU attention then goes through
    FlexAttention (kernels/flex_attention.py), which is fast only compiled. Returns the model.
    """
    kernels = kernels or KernelConfig()
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.impl = kernels.experts
        elif isinstance(module, NextTokenLoss):
            module.chunk_tokens = kernels.loss_chunk_tokens
    if kernels.modules == "reference":
        return model
    emulated = precision == "bf16" and emulated_bf16(device)
    flex = compiled and torch.device(device).type == "cuda" and precision != "fp64"
    for module in model.modules():
        kernel = FlexAttention if flex and type(module) is Attention else KERNELS.get(type(module))
        if kernel is None and emulated and type(module) is nn.Linear:
            kernel = EmulatedBf16Linear
        if kernel is not None:
            module.__class__ = kernel
    return model
