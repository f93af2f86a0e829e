"""Optimizer-only offload, as the hero run: weights and gradients stay on the device, the optimizer
state (moments, momentum, step counts) lives in pinned host memory.

Each `step()` brings the state of a slice of the parameters to the device, steps that slice with
the wrapped optimizer, and copies its state back, so the device holds at most `slice_bytes` of
optimizer state at a time instead of all of it (`bench/gpu_check.py` measures the saving). The
wrapped optimizer is any `torch.optim.Optimizer` whose step reads `group["params"]`
(MarinOptimizer, AdamW): the slices are given to it by narrowing each group's parameter list, so
learning rates and schedules are untouched. On a CPU run the host is the device and nothing moves.

FSDP2's `CPUOffloadPolicy` (`parallel.offload: all`) moves parameters and gradients too, and runs
the optimizer on the host.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

OFFLOADS = ("none", "optimizer", "all")


def _moved(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """`t` (a DTensor keeps its layout) with its local data on `device`; pinned when on the host."""
    local = t.to_local() if isinstance(t, DTensor) else t
    if local.device == device:
        return t
    if device.type == "cpu" and pin:
        moved = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
        moved.copy_(local, non_blocking=True)
    else:
        moved = local.to(device, non_blocking=True)
    if isinstance(t, DTensor):
        return DTensor.from_local(moved, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return moved


class OffloadedOptimizer:
    """`optimizer` with its state kept on the host between steps (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, slice_bytes: int = 1 << 28):
        self.optimizer, self.device, self.slice_bytes = optimizer, device, slice_bytes
        self.pin = device.type == "cuda"

    def __getattr__(self, name):  # param_groups, state, state_dict, zero_grad, ... of the wrapped optimizer
        return getattr(self.optimizer, name)

    def _slices(self) -> list[set[int]]:
        """Parameters in order, cut into slices of about `slice_bytes` of state (2 fp32 copies each)."""
        slices, current, size = [], set(), 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                local = p.to_local() if isinstance(p, DTensor) else p
                current.add(id(p))
                size += 2 * local.numel() * 4
                if size >= self.slice_bytes:
                    slices.append(current)
                    current, size = set(), 0
        return slices + ([current] if current else [])

    def _move_state(self, params, device: torch.device) -> None:
        for p in params:
            state = self.optimizer.state.get(p)
            for key, value in (state or {}).items():
                if torch.is_tensor(value) and value.dim() > 0:  # step counts stay where the optimizer keeps them
                    state[key] = _moved(value, device, self.pin)

    @torch.no_grad()
    def step(self) -> None:
        if self.device.type == "cpu":
            self.optimizer.step()
            return
        groups = self.optimizer.param_groups
        full = [group["params"] for group in groups]
        try:
            for wanted in self._slices():
                chosen = [[p for p in params if id(p) in wanted] for params in full]
                for group, params in zip(groups, chosen):
                    group["params"] = params
                here = [p for params in chosen for p in params]
                self._move_state(here, self.device)
                self.optimizer.step()
                self._move_state(here, torch.device("cpu"))
            torch.cuda.current_stream(self.device).synchronize()  # the copies back are asynchronous
        finally:
            for group, params in zip(groups, full):
                group["params"] = params
