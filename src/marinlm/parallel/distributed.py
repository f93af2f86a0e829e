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
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: object = None  # 1-D DeviceMesh over all ranks when world_size > 1, then the layout's (`use_layout`)
    # The data-parallel ranks, which hold different rows of a batch (tensor-parallel ranks share rows):
    batch_rank: int = 0
    batch_world: int = 1
    batch_group: object = None  # their process group; None where they are all the ranks
    router_group: object = None  # the ranks whose MoE layers route different tokens; None: as batch_group

    def __post_init__(self):
        self.batch_rank, self.batch_world = self.rank, self.world_size

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    expert_mesh: object = None  # the layout's expert mesh, with expert parallelism
    fsdp_mesh: object = None  # where FSDP2 shards and replicates: [dp_replicate, dp_shard(_cp)]
    dims: object = None  # the layout's ParallelDims, once adopted (`use_layout`); None before, and in one process

    def use_layout(self, meshes) -> None:
        """Adopt the layout's meshes (`mesh.ParallelDims.build_mesh`): batches split over its data-parallel ranks."""
        self.mesh, self.expert_mesh, batch, self.dims = meshes.dense, meshes.experts, meshes.batch, meshes.dims
        self.fsdp_mesh = meshes.fsdp
        # The ranks whose MoE layers see different tokens (`Meshes.router`), where more than the data ranks.
        self.router_group = meshes.router.get_group() if meshes.router is not None else None
        self.batch_rank, self.batch_world = batch.get_local_rank(), batch.size()
        self.batch_group = None if batch.size() == self.world_size else batch.get_group()


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
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp_shard",))
    return DistributedInfo(rank, world, local_rank, dev, mesh)


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
