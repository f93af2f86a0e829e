"""QLoRA's routed experts in NF4: the frozen [E, in, out] stacks as 4-bit buffers.

bitsandbytes' `Linear4bit` wraps `nn.Linear` only, so the stacks (most of an MoE's weights) are
packed with its functional `quantize_4bit` (NF4, an fp32 absmax per block of 64: 4.5 bits a
weight) and dequantised for each forward. Autograd would keep every layer's dequantised stacks
from forward to backward, as much memory as bf16 experts; a saved-tensor hook stores a reference
to the packed stack instead and dequantises again in backward, as bitsandbytes' `MatMul4Bit` does
for its linear layers.
"""

from __future__ import annotations

import torch
from torch import nn

from marinlm.finetune.grouped_lora import EXPERT_PROJECTIONS, GroupedLoraExperts
from marinlm.model.experts import REFERENCE_IMPLS, RoutedExperts

BLOCK = 64


class NF4Experts:
    """Mixin ahead of an experts class: `gate_proj`, `up_proj` and `down_proj` are NF4 buffers
    (`{name}_nf4`, `{name}_absmax`), and reading `self.gate_proj` gives the dequantised stack: in
    the dtype of the forward in flight, else bf16 (the dtype QLoRA's base computes in)."""

    def quantize(self) -> None:
        import bitsandbytes.functional as bnbF

        self._nf4_shapes = {}
        for name in EXPERT_PROJECTIONS:
            weight = getattr(self, name).detach()
            packed, state = bnbF.quantize_4bit(
                weight.to(torch.bfloat16).contiguous(), blocksize=BLOCK, quant_type="nf4", compress_statistics=False
            )
            delattr(self, name)
            # Not persistent: a checkpoint holds what trains, and the base is the base run's.
            self.register_buffer(f"{name}_nf4", packed, persistent=False)
            self.register_buffer(f"{name}_absmax", state.absmax, persistent=False)
            self._nf4_shapes[name] = tuple(weight.shape)
        self._live = None

    def dequantize(self, name: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        import bitsandbytes.functional as bnbF

        state = bnbF.QuantState(
            getattr(self, f"{name}_absmax"),
            shape=torch.Size(self._nf4_shapes[name]),
            blocksize=BLOCK,
            quant_type="nf4",
            dtype=torch.bfloat16,
        )
        return bnbF.dequantize_4bit(getattr(self, f"{name}_nf4"), state).to(dtype)

    def __getattr__(self, name: str):
        shapes = self.__dict__.get("_nf4_shapes")
        if shapes and name in shapes:
            live = self.__dict__.get("_live")
            return live[name] if live else self.dequantize(name)
        return super().__getattr__(name)

    def resolve_impl(self, dtype: torch.dtype) -> str:
        # The reference reads only the stacks' shapes here: no need to dequantise them for that.
        self._live = {name: torch.empty(shape, device="meta") for name, shape in self._nf4_shapes.items()}
        try:
            return super().resolve_impl(dtype)
        finally:
            self._live = None

    def run_experts(self, x_AD: torch.Tensor, counts_E: torch.Tensor, impl: str) -> torch.Tensor:
        dtype = x_AD.dtype
        live = {name: self.dequantize(name, dtype) for name in EXPERT_PROJECTIONS}
        storage = {w.untyped_storage().data_ptr(): name for name, w in live.items()}
        again: dict[str, torch.Tensor] = {}

        def pack(t: torch.Tensor):
            name = storage.get(t.untyped_storage().data_ptr()) if t.device == x_AD.device else None
            return t if name is None else (name, t.shape, t.stride(), t.storage_offset())

        def unpack(saved):
            if isinstance(saved, torch.Tensor):
                return saved
            name, shape, stride, offset = saved
            if name not in again:  # the loop path saves one view an expert: dequantise once
                again[name] = self.dequantize(name, dtype)
            return again[name].as_strided(shape, stride, offset)

        if x_AD.requires_grad:  # once the input's gradient is out, backward is done with the stacks
            x_AD.register_hook(lambda grad: again.clear())
        self._live = live
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return super().run_experts(x_AD, counts_E, impl)
        finally:
            self._live = None

    def restore(self) -> None:
        """The stacks back as frozen bf16 parameters holding the dequantised weights: the base the
        adapters were trained on. The module becomes its plain experts class again."""
        stacks = {name: self.dequantize(name) for name in EXPERT_PROJECTIONS}
        for name, stack in stacks.items():
            delattr(self, f"{name}_nf4")
            delattr(self, f"{name}_absmax")
            setattr(self, name, nn.Parameter(stack, requires_grad=False))
        del self._nf4_shapes, self._live
        self.__class__ = next(c for c in type(self).__mro__ if c in (GroupedLoraExperts, RoutedExperts))


class NF4RoutedExperts(NF4Experts, RoutedExperts):
    pass


class NF4GroupedLoraExperts(NF4Experts, GroupedLoraExperts):
    def merge(self, fold: bool = True) -> None:
        self.restore()
        self.merge(fold)


def quantize_experts(model: nn.Module) -> int:
    """QLoRA: every routed experts module's stacks in NF4 (a kernel's experts back on the reference
    path, as LoRA's are); returns how many modules."""
    count = 0
    for module in model.modules():
        if isinstance(module, GroupedLoraExperts):
            module.__class__ = NF4GroupedLoraExperts
        elif isinstance(module, RoutedExperts):
            if module.impl not in REFERENCE_IMPLS:
                module.impl = "auto"
            module.__class__ = NF4RoutedExperts
        else:
            continue
        module.quantize()
        count += 1
    return count


def restore_experts(model: nn.Module) -> int:
    """Every NF4 experts module back to bf16 parameters (`NF4Experts.restore`); returns how many."""
    modules = [m for m in model.modules() if isinstance(m, NF4Experts)]
    for module in modules:
        module.restore()
    return len(modules)
