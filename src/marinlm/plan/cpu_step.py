"""A step on this machine priced from measurement (`marinlm plan --hardware cpu`): the compute of
the busiest rank from its operations (plan/ops.py) at costs measured here (plan/op_table.py)."""

from __future__ import annotations

import math

from marinlm.optim.marin import param_kind

# The largest step whose operations are measured here: a forward's activations of one layer and its
# logits chunk stay under a few hundred MiB, and the model's weights under a few GB.
MEASURABLE_BYTES = 2**28
MEASURABLE_PARAMETERS = 2e9


def measurable_here(model, tokens: int) -> bool:
    """Whether a forward of `tokens` tokens of `model` is small enough to time its operations here."""
    from marinlm.model.summary import summarize

    widest = max(
        model.d_model, model.moe.expert_dim * model.moe.top_k, model.attention.num_heads * model.attention.head_dim
    )
    return tokens * widest * 4 <= MEASURABLE_BYTES and summarize(model).total <= MEASURABLE_PARAMETERS


def measured_compute(train, dims, world, precision, stage_layers, stage_shards, rows, forwards, table) -> float:
    """Seconds of the busiest pipeline stage's compute, `forwards` forwards of `rows` rows, its
    operations priced by a table measured here (plan/ops.py, plan/op_table.py) with one thread a
    rank, as torchrun gives each."""
    import torch

    from marinlm.plan.op_table import measured_table
    from marinlm.plan.ops import price_step, step_seconds, trace_ops

    model = train.model
    threads = torch.get_num_threads()
    if world > 1:
        torch.set_num_threads(1)
    try:
        table = table or measured_table(model, precision, train.kernels, model.moe.num_experts // dims.ep)
        inv = trace_ops(model, train.optim, precision, train.kernels)
        recompute = {"full": 1.0, "every_n": 1.0 / train.parallel.checkpoint_every_n}
        recompute = recompute.get(train.parallel.activation_checkpointing, 0.0)
        seconds = []
        for s, shards in enumerate(stage_shards):
            layers = stage_layers[s] if dims.pp > 1 else range(model.num_layers)
            matrices = [
                tuple(v["shape"] if len(v["full"]) == 3 else v["full"])
                for name, v in shards.items()
                if param_kind(name, len(v["full"])) == "muonh"
            ]
            part = price_step(
                train,
                table,
                inv,
                rows=rows,
                forwards=forwards,
                layers=layers,
                recompute=recompute,
                head=s == dims.pp - 1,
                weights=sum(math.prod(v["shape"]) for v in shards.values()),
                tensors=len(shards),
                matrices=matrices,
            )
            seconds.append(step_seconds(part, table.device))
        return max(seconds)
    finally:
        torch.set_num_threads(threads)


def _gloo_worker(rank: int, world: int, store: str, out) -> None:
    import time

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as torchrun runs each rank
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        small, large = torch.zeros(1), torch.zeros(2**20)  # 4 MiB a rank
        gathered = [torch.empty_like(large) for _ in range(world)]
        for _ in range(5):
            dist.all_reduce(small)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(50):
            dist.all_reduce(small)
        latency = (time.perf_counter() - start) / 50
        dist.all_gather(gathered, large)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(5):
            dist.all_gather(gathered, large)
        seconds = (time.perf_counter() - start) / 5
        if rank == 0:
            out["gloo"] = (latency, large.nbytes * (world - 1) / max(seconds - latency, 1e-9))
    finally:
        dist.destroy_process_group()


_GLOO: dict[int, tuple[float, float]] = {}


def measure_gloo(world: int) -> tuple[float, float]:
    """(seconds a small collective takes, bytes a second a rank receives in a large all-gather) of
    `world` gloo processes on this machine, one thread each, measured once a process."""
    import tempfile

    import torch.multiprocessing as mp

    if world not in _GLOO:
        with tempfile.TemporaryDirectory() as tmp:
            out = mp.Manager().dict()
            mp.spawn(_gloo_worker, args=(world, f"{tmp}/store", out), nprocs=world)
            _GLOO[world] = out["gloo"]
    return _GLOO[world]


def collective_seconds(
    train, dims, world: int, shards: dict, forwards: int, fsdp_bytes: float, a2a_calls: float, a2a_bytes: float
) -> dict[str, float]:
    """The gloo collectives of one rank's step, each at the latency and bandwidth measured here
    (`measure_gloo`), none overlapped (the ranks' compute shares the cores): FSDP2's all-gather of
    each unit (the blocks and the root) a forward and again in backward when resharded, and one
    reduce-scatter a unit; the Marin optimizer's all-gather of each matrix sharded along its own
    dims and the three all-reduces of its norms; the expert all-to-alls; the loss, the gradient
    norm and each MoE layer's router statistics."""
    latency, bandwidth = measure_gloo(world)
    fsdp = dims.dp_shard * dims.cp
    parts: dict[str, float] = {}
    if fsdp > 1:
        blocks = len({name.split(".")[1] for name in shards if name.startswith("layers.")})
        passes = forwards * (2 if train.parallel.reshard_after_forward else 1) + 1
        calls = (blocks + 1) * forwards + blocks * forwards * train.parallel.reshard_after_forward + (blocks + 1)
        parts["fsdp"] = calls * latency + passes * fsdp_bytes * blocks * (fsdp - 1) / fsdp / bandwidth
        if train.optim.type_name == "marin":
            sharded = [v for n, v in shards.items() if len(v["full"]) == 2 and param_kind(n, 2) == "muonh"]
            gathered = sum(math.prod(v["full"]) for v in sharded) * 4 * (fsdp - 1) / fsdp
            parts["optimizer_collectives"] = 4 * len(sharded) * latency + gathered / bandwidth
    if a2a_calls:
        parts["expert_all_to_all"] = a2a_calls * latency + a2a_bytes / bandwidth
    moe_layers = sum(1 for n in shards if n.endswith("router.weight"))
    parts["step_reductions"] = (3 + 2 * moe_layers) * latency
    return parts
