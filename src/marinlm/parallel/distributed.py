"""Process-group set-up from torchrun's environment: gloo on CPU, NCCL on GPU.

On GPU the group carries gloo for CPU tensors as well: with FSDP2 CPU offload the optimizer steps
on host memory, and MuonH's norm all-reduces and Newton-Schulz all-gathers then move CPU tensors,
which NCCL cannot (it fails with "No backend type associated with device type cpu").
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from marinlm.utils.device import resolve_device


@dataclass
class DistributedInfo:
    """This process: its rank, the world, its device. The layout's meshes and groups belong to
    `mesh.ParallelDims`, built from this once the layout is known."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    launched: bool = False  # a process group exists (torchrun, even with one rank)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str = "auto") -> DistributedInfo:
    """Start (or join) the default process group when launched by torchrun; single process otherwise.

    Args:
        device: "auto" (cuda when available), "cpu" or "cuda".
    """
    device = resolve_device(device).type
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device, local_rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    if world == 1 and "TORCHELASTIC_RUN_ID" not in os.environ:  # plain process; under torchrun even 1 rank
        return DistributedInfo(0, 1, 0, dev)  # gets a process group, so its FSDP/NCCL paths run
    if not dist.is_initialized():
        dist.init_process_group(backend="cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")
    return DistributedInfo(rank, world, local_rank, dev, launched=True)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size; (0, 1) without a process group."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """In-place all-reduce over `group` (default: every rank) when a process group exists; identity otherwise."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(tensor, op=ops[op], group=group)
    return tensor


def reduce_together(tensors: list[torch.Tensor], reduce_) -> None:
    """`reduce_(flat)` (an in-place reduction over ranks, returning `flat`) of every tensor in
    `tensors`, in place, through one flat buffer a dtype and device: one collective each, not one a
    tensor."""
    by_kind: dict = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for members in by_kind.values():
        flat = reduce_(torch.cat([t.reshape(-1) for t in members]))
        torch._foreach_copy_(members, [f.view_as(t) for f, t in zip(flat.split([t.numel() for t in members]), members)])


def all_gather_object(obj) -> list:
    """Every rank's `obj` (small, picklable), in rank order; `[obj]` without a process group."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
