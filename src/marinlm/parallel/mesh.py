"""The parallel layout: degrees from `ParallelConfig`, checked against the world and the model, and
the device mesh cut into named views.

    world = pipeline_parallel × data_parallel_replicate × data_parallel_shard × context_parallel
            × tensor_parallel

Expert parallelism borrows its ranks from data_parallel_shard × context_parallel × tensor_parallel,
as in torchtitan: it adds no axis. One flat mesh of the world is cut three ways. The dense mesh
`[pp, dp_replicate, dp_shard, cp, tp]` has the views:
- `dp`: the data-parallel ranks, which hold different rows of each batch (flattened);
- `cp`: the context-parallel ranks, which hold different chunks of the same rows;
- `tp`: the tensor-parallel ranks, which hold the same rows and split the weights.
FSDP2 shards over dp_shard × cp and replicates over dp_replicate (HSDP): the view `[dp_replicate,
dp_shard_cp]` of the mesh `[pp, dp_replicate, dp_shard_cp, tp]`.
The expert mesh `[pp, dp_replicate, efsdp, ep]` holds the routed experts: split over `ep`, FSDP2 on
`[dp_replicate, efsdp]` (efsdp = dp_shard × cp × tp / ep).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from marinlm.config import ConfigError

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EXPERT_AXES = ("pp", "dp_replicate", "efsdp", "ep")


@dataclass(frozen=True)
class ParallelDims:
    """The layout's degrees and, once built (`build_mesh`, under torchrun), every mesh and process
    group of it: the one owner that parallelize, the step and the checkpointer are given. In one
    process (no process group) nothing is built and every degree is 1."""

    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    pp: int
    cp: int = 1
    meshes: Meshes | None = field(default=None, compare=False, repr=False, kw_only=True)

    @staticmethod
    def one_process() -> ParallelDims:
        return ParallelDims(1, 1, 1, 1, 1)

    @staticmethod
    def data_parallel(world: int) -> ParallelDims:
        """Every rank one FSDP2 shard (loading a model to evaluate or generate under torchrun)."""
        return ParallelDims(1, world, 1, 1, 1)

    def degrees(self) -> dict[str, int]:
        """The six degrees, as a checkpoint records them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "meshes"}

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def launched(self) -> bool:
        """Meshes built: a process group exists (torchrun, even with one rank) and FSDP2 applies."""
        return self.meshes is not None

    @property
    def dense_mesh(self):
        """`[pp, dp_replicate, dp_shard, cp, tp]`; None in one process."""
        return self.meshes.dense if self.meshes else None

    @property
    def fsdp_mesh(self):
        return self.meshes.fsdp if self.meshes else None

    @property
    def expert_mesh(self):
        """`[pp, dp_replicate, efsdp, ep]` under expert parallel; None otherwise."""
        return self.meshes.experts if self.meshes else None

    @property
    def batch_rank(self) -> int:
        """This rank's place among the data-parallel ranks (which hold different rows of a batch)."""
        return self.meshes.batch.get_local_rank() if self.meshes else 0

    @property
    def batch_world(self) -> int:
        return self.meshes.batch.size() if self.meshes else 1

    @property
    def batch_group(self):
        """The data-parallel ranks' process group; None where they are all the ranks (or one process)."""
        if self.meshes is None or self.meshes.batch.size() == self.world:
            return None
        return self.meshes.batch.get_group()

    @property
    def router_group(self):
        """The ranks whose MoE layers route different tokens, where more than the data ranks; else None."""
        return self.meshes.router.get_group() if self.meshes and self.meshes.router is not None else None

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each holds different rows of a batch."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        sizes = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        parts = [f"{name} {size}" for name, size in zip(AXES, sizes) if name != "cp" or size > 1]
        return " x ".join(parts) + (f", ep {self.ep}" if self.ep > 1 else "")

    @staticmethod
    def resolve(config, world_size: int) -> ParallelDims:
        """The degrees of `config` (a `ParallelConfig`) on `world_size` ranks, `data_parallel_shard:
        -1` filling the rest. Raises ConfigError naming the key and what would be valid."""
        cp = config.context_parallel
        fixed = config.pipeline_parallel * config.data_parallel_replicate * cp * config.tensor_parallel
        shard = config.data_parallel_shard
        if shard == -1:
            if world_size % fixed:
                key = "parallel.context_parallel" if world_size % cp else "parallel"
                raise ConfigError(
                    key,
                    f"pipeline_parallel x data_parallel_replicate x context_parallel x tensor_parallel = {fixed} "
                    f"does not divide the {world_size} ranks; valid tensor_parallel and context_parallel "
                    f"degrees here: {_divisors(world_size)}",
                )
            shard = world_size // fixed
        dims = ParallelDims(
            config.data_parallel_replicate,
            shard,
            config.tensor_parallel,
            config.expert_parallel,
            config.pipeline_parallel,
            cp,
        )
        if dims.world != world_size:
            raise ConfigError(
                "parallel",
                f"{dims.describe()} makes {dims.world} ranks, but {world_size} were launched; set "
                "data_parallel_shard: -1 to fill the rest",
            )
        if (dims.dp_shard * dims.cp * dims.tp) % dims.ep:
            raise ConfigError(
                "parallel.expert_parallel",
                f"{dims.ep} must divide data_parallel_shard x context_parallel x tensor_parallel = "
                f"{dims.dp_shard * dims.cp * dims.tp} (experts borrow those ranks)",
            )
        return dims

    def check_model(self, model, seq_len: int | None = None) -> None:
        """Raise ConfigError, naming the key, where the model's widths (or the rows' `seq_len`, which
        sequence parallelism splits) do not split over the degrees."""
        if self.cp > 1 and seq_len is not None:
            from marinlm.parallel.context_parallel import check_cut

            check_cut(seq_len, self.cp)
        if self.tp > 1:
            seq_len = None if seq_len is None else seq_len // self.cp  # sequence parallel splits a rank's chunks
            for key, count in _tp_counts(model, seq_len):
                if count % self.tp:
                    raise ConfigError(
                        "parallel.tensor_parallel",
                        f"{self.tp} must divide {key} = {count}; "
                        f"valid degrees: {_common_divisors(model, self, seq_len)}",
                    )
        if model.moe.num_experts % self.ep:
            raise ConfigError(
                "parallel.expert_parallel",
                f"{self.ep} must divide model.moe.num_experts = {model.moe.num_experts}; "
                f"valid degrees: {_divisors(model.moe.num_experts)}",
            )
        if self.pp > model.num_layers:
            raise ConfigError(
                "parallel.pipeline_parallel", f"{self.pp} stages but model.num_layers = {model.num_layers}"
            )

    def check_capacity(self, model) -> None:
        """Raise ConfigError where the model's pooled capacity rule cannot run on this layout."""
        moe = model.moe
        if self.cp > 1 and moe.capacity_factor is not None:
            raise ConfigError(
                "model.moe.capacity_factor",
                f"{moe.capacity_factor}: context parallel splits each row over {self.cp} ranks, and which "
                "assignments a capacity drops depends on the whole row's order; set capacity_factor: null "
                "(dropless) with parallel.context_parallel > 1",
            )
        if moe.capacity == "receiver_pooled" and moe.capacity_factor is not None:
            shards = moe.capacity_groups * moe.capacity_domains
            if shards % self.dp:
                raise ConfigError(
                    "model.moe.capacity_groups",
                    f"capacity_groups x capacity_domains = {shards} sender shards must be a multiple of the "
                    f"{self.dp} data-parallel ranks (each rank holds whole shards); set capacity_domains "
                    "so that it is, or use fewer data-parallel ranks",
                )
            if self.tp > 1 and self.ep > 1:
                raise ConfigError(
                    "model.moe.capacity",
                    "receiver_pooled capacity under tensor x expert parallel is not supported (each tp "
                    "rank routes part of a row); use per_expert, or drop one of the two",
                )

    @property
    def efsdp(self) -> int:
        """The data ranks left in each expert-parallel group's FSDP axis: dp_shard x cp x tp / ep."""
        return self.dp_shard * self.cp * self.tp // self.ep

    def build_mesh(self, device_type: str) -> ParallelDims:
        """These degrees with the layout's meshes, all cut once from one flat mesh of the world
        (FSDP2 needs them to share it to combine the experts' sharding with the rest)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.meshes is not None:
            raise RuntimeError(f"the meshes of {self.describe()} are built already: build them once")
        world = init_device_mesh(device_type, (self.world,), mesh_dim_names=("world",))
        dense = world._unflatten(0, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp), AXES)
        batch = dense["dp_replicate", "dp_shard"]._flatten("dp")
        fsdp = dense["dp_replicate", "dp_shard"]
        if self.cp > 1:  # FSDP2 shards over the cp ranks too (they hold the same weights)
            shape = (self.pp, self.dp_replicate, self.dp_shard * self.cp, self.tp)
            flat = world._unflatten(0, shape, ("pp", "dp_replicate", "dp_shard_cp", "tp"))
            fsdp = flat["dp_replicate", "dp_shard_cp"]
        experts = None
        if self.ep > 1:
            experts = world._unflatten(0, (self.pp, self.dp_replicate, self.efsdp, self.ep), EXPERT_AXES)
        # The ranks whose MoE layers route different tokens: data ranks, cp ranks (other chunks),
        # and with expert parallel the tp ranks (each routes its own share of the sequence).
        routing = ["dp_replicate", "dp_shard"] + ["cp"] * (self.cp > 1) + ["tp"] * (self.ep > 1 and self.tp > 1)
        router = dense[tuple(routing)]._flatten("routing") if len(routing) > 2 else None
        return dataclasses.replace(self, meshes=Meshes(dense, batch, fsdp, experts, router))


@dataclass(frozen=True)
class Meshes:
    """dense: `[pp, dp_replicate, dp_shard, cp, tp]`; batch: the data-parallel ranks, flattened
    (each holds other rows of a batch); fsdp: `[dp_replicate, dp_shard]`, or `[dp_replicate,
    dp_shard_cp]` under context parallel; experts: `[pp, dp_replicate, efsdp, ep]`, None without
    expert parallelism."""

    dense: object
    batch: object
    fsdp: object
    experts: object = None
    router: object = None  # the ranks routing different tokens, when more than the data ranks


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_counts(model, seq_len: int | None) -> list[tuple[str, int]]:
    """What tensor parallelism splits: heads, KV heads (the global layers' too), widths, the sequence."""
    attn, moe = model.attention, model.moe
    counts = [
        ("model.attention.num_heads", attn.num_heads),
        ("model.attention.num_kv_heads", attn.num_kv_heads),
        ("model.attention.num_global_kv_heads", attn.global_kv_heads()),
        ("model.vocab_size", model.vocab_size),
        ("model.moe.expert_dim", moe.expert_dim),
    ]
    if moe.num_shared_experts:
        counts.append(("model.moe.shared_expert_dim", moe.shared_expert_dim))
    if moe.first_k_dense:
        counts.append(("model.moe.dense_ffn_dim", moe.dense_ffn_dim))
    if seq_len is not None:
        counts.append(("data.seq_len", seq_len))
    return counts


def _common_divisors(model, dims: ParallelDims, seq_len: int | None = None) -> list[int]:
    counts = [count for _, count in _tp_counts(model, seq_len)]
    world = dims.world // (dims.pp * dims.dp_replicate * dims.cp)
    return [d for d in _divisors(world) if all(c % d == 0 for c in counts)]
