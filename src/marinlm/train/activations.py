"""Activation statistics, collected by forward hooks from outside the model on the steps that ask.

Per layer: the RMS and the largest magnitude of the residual stream after the block
(`act/layer_N/residual_rms`, `..._max_abs`) and of the two branch outputs added to it, attention
(`attn`) and the MoE or dense FFN (`mlp`), before their SConv where the config has one. A sample of
each tensor's values goes to TensorBoard as a histogram. On other steps no hook is registered, so
they cost nothing.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn

from marinlm.model.transformer import named_blocks
from marinlm.parallel.distributed import all_reduce_

SAMPLE = 4096  # values per tensor kept for a histogram


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, seen through activation-checkpoint wrappers."""
    return [getattr(block, "_checkpoint_wrapped_module", block) for _, block in named_blocks(model)]


class ActivationMonitor:
    def __init__(self, model: nn.Module, every: int, world_size: int = 1):
        self.model, self.every, self.world = model, every, world_size
        self._sums: dict[str, torch.Tensor] = {}  # name -> [sum of squares, count, max abs]
        self._samples: dict[str, torch.Tensor] = {}

    def due(self, step: int) -> bool:
        """Whether step `step` (1-based, the one about to run) collects statistics."""
        return self.every > 0 and step % self.every == 0

    def _record(self, name: str, output) -> None:
        x = output[0] if isinstance(output, tuple) else output
        x = x.detach().float()
        # A checkpointed block runs its forward twice (again in the backward pass): every tensor is
        # seen the same number of times, so the RMS and the maximum are unchanged.
        stats = torch.stack([x.square().sum(), torch.tensor(float(x.numel()), device=x.device), x.abs().max()])
        if name in self._sums:
            old = self._sums[name]
            stats = torch.stack([old[0] + stats[0], old[1] + stats[1], torch.maximum(old[2], stats[2])])
        self._sums[name] = stats
        if name not in self._samples:
            flat = x.reshape(-1)
            self._samples[name] = flat[:: max(1, flat.numel() // SAMPLE)][:SAMPLE].cpu()

    @contextlib.contextmanager
    def watch(self, step: int):
        """Collect during the step `step` when it is due; otherwise register nothing."""
        if not self.due(step):
            yield
            return
        handles = []
        for i, block in enumerate(_blocks(self.model)):
            targets = {"residual": block, "attn": block.attn, "mlp": block.mlp}
            for kind, module in targets.items():
                name = f"act/layer_{i}/{kind}"
                handles.append(module.register_forward_hook(lambda _m, _in, out, name=name: self._record(name, out)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def report(self) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """The collected scalars and histogram samples (reduced over ranks), then forgets them."""
        if not self._sums:
            return {}, {}
        names = sorted(self._sums)
        stats = torch.stack([self._sums[n] for n in names])  # [names, 3]
        if self.world > 1:
            sums = stats[:, :2].contiguous()
            peaks = stats[:, 2].contiguous()
            all_reduce_(sums)
            all_reduce_(peaks, op="max")
            stats = torch.cat([sums, peaks.unsqueeze(1)], 1)
        scalars = {}
        for name, (sum_sq, count, peak) in zip(names, stats.tolist()):
            scalars[f"{name}_rms"] = (sum_sq / max(count, 1.0)) ** 0.5
            scalars[f"{name}_max_abs"] = peak
        samples = {name: self._samples[name].numpy() for name in names}
        self._sums, self._samples = {}, {}
        return scalars, samples
