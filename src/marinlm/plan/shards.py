"""Every parameter's local shard on one rank of a layout, read off the real `parallelize()`.

The model is built on `meta` under torch's fake process group of the cluster's world size (no
memory, no communication), the layout's meshes are cut as in training, and `parallelize` applies
tensor, expert and FSDP2 sharding; the local shapes are then those of the DTensors it made. The
fake group cannot run a pipeline schedule, so pipeline stages are cut by the same split code and
each is parallelized alone.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from marinlm.model.config import MarinConfig
from marinlm.model.transformer import MarinForCausalLM
from marinlm.parallel import ParallelConfig, _parallelize
from marinlm.parallel.mesh import ParallelDims


@contextlib.contextmanager
def fake_world(world: int, rank: int):
    """A fake process group of `world` ranks, this process being `rank`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def stage_of(rank: int, dims: ParallelDims) -> int:
    """The pipeline rank of `rank`: pp is the mesh's outermost axis."""
    return rank // (dims.world // dims.pp)


def local_shards(
    model_config: MarinConfig, parallel: ParallelConfig, world: int, rank: int, rows: int, seq_len: int
) -> dict[str, dict]:
    """{parameter name: {"shape": local shape, "full": full shape, "unsharded": elements the rank
    holds between FSDP2's all-gather and reshard}} on `rank` of a `world`-rank layout. `rows`: the
    rows a data-parallel rank trains on a step (the pipeline's microbatches come from them)."""
    dims = ParallelDims.resolve(parallel, world)
    dims.check_model(model_config, seq_len)
    with fake_world(world, rank):
        built = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = MarinForCausalLM(model_config)
        parts = [model]
        if dims.pp > 1:
            from marinlm.parallel.pipeline_parallel import build_stage, pipeline_layout, stage_ids

            layout = pipeline_layout(model_config, parallel, dims.pp, rows, seq_len)
            last = dims.pp * layout.per_rank - 1
            ids = stage_ids(stage_of(rank, dims), dims.pp, layout.schedule, layout.per_rank)
            parts = [build_stage(model, layout.stages[s], s == 0, s == last) for s in ids]
        shards = {}
        for part in parts:
            _parallelize(part, parallel, built)
            for name, p in part.named_parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                shards[name] = {
                    "shape": tuple(local.shape),
                    "full": tuple(p.shape),
                    "unsharded": _unsharded_elements(p),
                }
        return shards


def _unsharded_elements(p: torch.Tensor) -> int:
    """Elements of `p` on its rank once FSDP2 has gathered it: sharded only by tensor and expert
    parallelism (the mesh axes other than the data ones)."""
    if not isinstance(p, DTensor):
        return p.numel()
    elements = p.numel()
    for axis, placement in zip(p.device_mesh.mesh_dim_names, p.placements):
        if axis in ("tp", "ep") and placement.is_shard():
            elements //= p.device_mesh.size(p.device_mesh.mesh_dim_names.index(axis))
    return elements
