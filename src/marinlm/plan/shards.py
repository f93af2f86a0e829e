"""Every parameter's local shard on one rank of a layout, read off the real `parallelize()`.

The model is built on `meta` under torch's fake process group of the cluster's world size (no
memory, no communication), the layout's meshes are cut as in training, and `parallelize` applies
tensor, expert and FSDP2 sharding; the local shapes are then those of the DTensors it made. The
fake group cannot run a pipeline schedule, so pipeline stages are cut by the same split code and
each is parallelized alone.
"""

from __future__ import annotations

import contextlib
import sys

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

    hook = sys.excepthook  # init_process_group wraps it to prefix [rank#]: put back after
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


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


def tensor_parallel_activations(
    train, tp: int, rows: int, seq_len: int, precision: str, kernels_device: str = "cpu"
) -> dict[str, float]:
    """Bytes one rank of a `tp`-way tensor-parallel layout keeps from a forward of `rows` rows of
    `seq_len` tokens, read off the real thing: the model (its weights initialised) sharded by
    `apply_tensor_parallel` under a fake process group, run forward with the step's autocast (no
    cache: a launched layout has FSDP2 units), each saved tensor's storage counted once, local
    shards as they are, in the block that saved it, or outside the blocks (what they or several
    blocks saved, as the tables a forward shares, which a checkpointed block's inputs keep too):
    {"layers": {block index: bytes}, "outside": bytes}. The fake group's collectives move nothing,
    so the values are garbage; the shapes, which are all this counts, are those of a real run.
    `kernels_device` "cuda" keeps the reference modules, as the activation inventory does."""
    from marinlm.kernels import apply_kernels
    from marinlm.parallel.tensor_parallel import apply_tensor_parallel
    from marinlm.plan.op_table import packed_segments

    config = train.model
    with fake_world(tp, 0):
        dims = ParallelDims.resolve(ParallelConfig(tensor_parallel=tp, data_parallel_shard=1), tp).build_mesh("cpu")
        with torch.device("meta"):
            model = MarinForCausalLM(config)
        kernels = train.kernels if kernels_device == "cpu" else train.kernels.reference()
        apply_kernels(model, torch.device("cpu"), precision, kernels)
        model.to_empty(device="cpu")
        model.init_weights(seed=0)
        apply_tensor_parallel(model, dims.dense_mesh["tp"], expert_parallel=False)
        params = {_storage(p)[0] for p in model.parameters()}
        where, saved = ["outside"], {}

        def pack(t):
            key, nbytes = _storage(t)
            if key not in params:
                saved.setdefault(key, (set(), nbytes))[0].add(where[0])
            return t

        for name, block in model.layers.named_children():
            block.register_forward_pre_hook(lambda m, args, i=int(name): where.__setitem__(0, i))
            block.register_forward_hook(lambda m, args, out: where.__setitem__(0, "outside"))
        ids = torch.zeros(rows, seq_len, dtype=torch.long)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16", cache_enabled=False)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            model(ids, packed_segments(rows, seq_len), labels=ids, return_logits=False)  # as a step
    found: dict = {"layers": {}, "outside": 0.0}
    for regions, nbytes in saved.values():
        if len(regions) == 1 and "outside" not in regions:
            (layer,) = regions
            found["layers"][layer] = found["layers"].get(layer, 0.0) + nbytes
        else:  # saved outside the blocks, or by several (the forward's shared tables): kept either way
            found["outside"] += nbytes
    return found


def _storage(t: torch.Tensor) -> tuple:
    """(a key for the storage of `t`'s local data, its bytes); a collective's output under the fake
    group may have no storage to read: then the tensor itself, by its elements."""
    local = t.to_local() if isinstance(t, DTensor) else t
    try:
        storage = local.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:
        return ("tensor", id(local)), local.numel() * local.element_size()
