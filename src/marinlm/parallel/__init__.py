"""Parallelism applied to a model built on `meta`: one file per technique, composed by `parallelize`.

Order, as in torchtitan: context parallel, tensor parallel, expert parallel, activation
checkpointing, compile, activation offload, then FSDP2/HSDP; pipeline parallelism cuts the model into stages first and
applies the rest to each stage. The layout (`mesh.py`) is checked against the world and the model
before anything is built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from marinlm.config import check
from marinlm.parallel.distributed import DistributedInfo, init_distributed, shutdown_distributed
from marinlm.parallel.mesh import ParallelDims
from marinlm.parallel.offload import OFFLOADS

__all__ = [
    "DistributedInfo",
    "ParallelConfig",
    "ParallelDims",
    "init_distributed",
    "parallelize",
    "shutdown_distributed",
]


@dataclass(kw_only=True)
class FaultToleranceConfig:
    """Replica groups on torchft (parallel/fault_tolerance.py): `groups` torchrun jobs, this one `group`."""

    groups: int = 0  # 0: off
    group: int = 0  # this job's replica group, 0 .. groups-1
    lighthouse: str = ""  # http://HOST:PORT of torchft's lighthouse; empty: $TORCHFT_LIGHTHOUSE
    min_groups: int = 1  # a step commits with at least this many groups alive
    timeout_s: float = 60.0  # each collective, commit vote and state transfer
    quorum_timeout_s: float = 60.0  # waiting for a quorum before the run stops

    def __post_init__(self):
        check(self.groups >= 0, "groups", f"must be >= 0 (0: off), got {self.groups}")
        if self.groups:
            check(0 <= self.group < self.groups, "group", f"must be in 0..{self.groups - 1}, got {self.group}")
            check(
                1 <= self.min_groups <= self.groups, "min_groups", f"must be in 1..{self.groups}, got {self.min_groups}"
            )
        check(self.timeout_s > 0 and self.quorum_timeout_s > 0, "timeout_s", "timeouts must be > 0")


@dataclass(kw_only=True)
class ParallelConfig:
    # HSDP: FSDP2 shards over data_parallel_shard ranks and replicates over data_parallel_replicate
    # groups of them (Marin's racks are replicas); -1 fills the ranks the other degrees leave.
    data_parallel_replicate: int = 1
    data_parallel_shard: int = -1
    tensor_parallel: int = 1
    # Each row's sequence cut into 2N chunks over N ranks (parallel/context_parallel.py).
    context_parallel: int = 1
    expert_parallel: int = 1
    pipeline_parallel: int = 1
    reshard_after_forward: bool = True  # ZeRO-3-like; False keeps gathered params (ZeRO-2-like)
    # optimizer: the optimizer state in pinned host memory (parallel/offload.py); all: FSDP2's
    # CPUOffloadPolicy, parameters, gradients and optimizer state on the host; none.
    offload: str = "none"
    activation_checkpointing: str = "none"  # none | full (every block) | every_n
    # The checkpointed blocks' inputs in pinned host memory between forward and backward
    # (parallel/activation_checkpoint.py), as Marin offloads its remat residuals at long sequences.
    offload_activations: bool = False
    checkpoint_every_n: int = 2
    compile: bool = False  # torch.compile each block (regional compilation, parallel/compile.py)
    # With compile on a GPU: each compiled block's forward and backward captured as CUDA graphs.
    cuda_graphs: bool = False
    # Pipeline parallel (parallel/pipeline_parallel.py): the schedule, stages a rank for looped
    # schedules, microbatches a step (0: one row each), and a fixed split (else balanced by FLOPs).
    pipeline_schedule: str = "1F1B"
    stages_per_rank: int = 2
    microbatches: int = 0
    layers_per_stage: list[int] | None = None
    # Replica groups that survive each other's failures (parallel/fault_tolerance.py); off by default.
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    def __post_init__(self):
        for name in (
            "data_parallel_replicate",
            "tensor_parallel",
            "context_parallel",
            "expert_parallel",
            "pipeline_parallel",
        ):
            check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        check(
            self.data_parallel_shard == -1 or self.data_parallel_shard >= 1,
            "data_parallel_shard",
            f"must be >= 1, or -1 to fill the ranks the other degrees leave, got {self.data_parallel_shard}",
        )
        check(
            self.activation_checkpointing in ("none", "full", "every_n"),
            "activation_checkpointing",
            f"must be none, full or every_n, got {self.activation_checkpointing!r}",
        )
        check(
            not self.offload_activations or self.activation_checkpointing != "none",
            "offload_activations",
            "needs activation_checkpointing full or every_n: it keeps the checkpointed blocks' inputs on the host",
        )
        check(self.checkpoint_every_n >= 1, "checkpoint_every_n", f"must be >= 1, got {self.checkpoint_every_n}")
        check(self.offload in OFFLOADS, "offload", f"must be one of {', '.join(OFFLOADS)}, got {self.offload!r}")
        check(self.microbatches >= 0, "microbatches", f"must be >= 0 (0: one row each), got {self.microbatches}")
        check(self.stages_per_rank >= 1, "stages_per_rank", f"must be >= 1, got {self.stages_per_rank}")
        check(not self.cuda_graphs or self.compile, "cuda_graphs", "needs compile: true (it captures compiled blocks)")
        check(
            not (self.fault_tolerance.groups and self.data_parallel_replicate > 1),
            "data_parallel_replicate",
            "must be 1 under fault_tolerance: the replica groups are the replicas (fault_tolerance.groups)",
        )


def parallelize(
    model: nn.Module,
    config: ParallelConfig,
    dims: ParallelDims,
    *,
    device: torch.device | None = None,
    rows: int = 0,
    seq_len: int = 0,
) -> nn.Module:
    """Cut a model on `meta` or initialised into pipeline stages (under pipeline parallel), then
    apply to each stage, in order: context parallel, tensor parallel, expert parallel, activation
    checkpointing, compile and (under torchrun) FSDP2 or HSDP.

    `dims` is the layout, with its meshes built under torchrun (`mesh.ParallelDims.build_mesh`).
    With pipeline parallelism (`rows`: a step's rows on this data-parallel rank; `seq_len`: their
    length; `device`: where the stages run) the model is cut into stages, each parallelized alike,
    and the `PipelinedModel` holding this rank's stages is returned; otherwise `model`, changed in place.
    """
    from marinlm.parallel.pipeline_parallel import ZERO_BUBBLE, build_pipeline

    if dims.pp_enabled:
        stage_config = config
        if config.pipeline_schedule in ZERO_BUBBLE:
            # Zero-bubble schedules compute weight gradients in a pass of their own after the input
            # gradients; FSDP2 units resharded after forward then lose them (wrong weight gradients
            # for whole stages, which the layout tests catch), so the blocks keep their gathered weights.
            stage_config = dataclasses.replace(config, reshard_after_forward=False)
        stage = lambda s: _parallelize(s, stage_config, dims)  # noqa: E731 - the other techniques, stage by stage
        where = device if device is not None else torch.device("cpu")
        return build_pipeline(model, config, dims, where, rows=rows, seq_len=seq_len, parallelize_stage=stage)
    return _parallelize(model, config, dims)


def autocast_caches_weights(model: nn.Module) -> bool:
    """Whether the step's autocast may keep its bf16 copy of each weight until the forward ends:
    not when FSDP2 frees each block's gathered weights after its forward, nor when activation
    checkpointing drops a block's saved tensors; the cache would hold a copy of every block's
    weights in their place until the forward ends."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    return not any(isinstance(m, FSDPModule | CheckpointWrapper) for m in model.modules())


def _parallelize(model: nn.Module, config: ParallelConfig, dims: ParallelDims) -> nn.Module:
    from marinlm.parallel.activation_checkpoint import apply_activation_checkpointing, apply_activation_offload
    from marinlm.parallel.compile import apply_compile
    from marinlm.parallel.context_parallel import apply_context_parallel
    from marinlm.parallel.expert_parallel import apply_data_parallel_rows, apply_expert_parallel
    from marinlm.parallel.fsdp import apply_fsdp
    from marinlm.parallel.tensor_parallel import apply_tensor_parallel

    if dims.cp_enabled:
        from marinlm.parallel.pipeline_parallel import StageModel

        apply_context_parallel(model, dims.dense_mesh["cp"], stage=isinstance(model, StageModel))
    if dims.tp_enabled:
        apply_tensor_parallel(model, dims.dense_mesh["tp"], expert_parallel=dims.ep_enabled)
    if dims.ep_enabled:
        apply_expert_parallel(model, dims.expert_mesh["ep"], tensor_parallel=dims.tp)
    if dims.batch_world > 1:  # pooled capacity counts a forward's rows over all data ranks
        apply_data_parallel_rows(model, dims.batch_group, dims.batch_rank, dims.batch_world)
    apply_activation_checkpointing(model, config.activation_checkpointing, config.checkpoint_every_n)
    if config.compile:
        # Our own exchanges (expert, tensor and context parallel) may split a block's graph.
        whole = not (dims.tp_enabled or dims.ep_enabled or dims.cp_enabled)
        apply_compile(model, fullgraph=whole, cuda_graphs=config.cuda_graphs)
    if config.offload_activations:
        apply_activation_offload(model)
    if dims.launched:  # under torchrun (any number of ranks)
        experts = None
        if dims.ep_enabled:  # experts shard over the data ranks left beside ep
            experts = dims.expert_mesh["dp_replicate", "efsdp"]
        apply_fsdp(
            model,
            dims.fsdp_mesh,
            reshard_after_forward=config.reshard_after_forward,
            cpu_offload=config.offload == "all",
            experts=experts,
        )
    return model
