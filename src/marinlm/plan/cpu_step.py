"""A step on this machine priced from measurement (`marinlm plan --hardware cpu`): the compute of
the busiest rank from its operations (plan/ops.py) at costs measured here (plan/op_table.py),
slowed as much as the layout's ranks slow each other on these cores (plan/contention.py); what the
layout adds timed in a gloo group of the layout's size holding the model as the real `parallelize`
shards it (`measure_layout`): the real step on a short row, less that row's compute priced alike
(FSDP2's and tensor parallel's exchanges and hooks, the step's reductions, the optimizer); for
pipeline stages, each FSDP2 unit's gather and reduction and the optimizer's step, the other
collectives counted at gloo's latency and bandwidth measured here."""

from __future__ import annotations

import copy
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


def tensor_parallel_share(model, tp: int):
    """`model` as one of `tp` tensor-parallel ranks computes it (parallel/tensor_parallel.py): a tp-th
    of the query and KV heads, of the routed, shared and dense hidden widths and of the vocabulary
    (the LM head's rows), the router and latent projections whole. Its norms and elementwise work
    are priced on the whole sequence, where sequence parallel runs them on T/tp."""
    share = copy.deepcopy(model)
    a, m = share.attention, share.moe
    a.num_heads, a.num_kv_heads = a.num_heads // tp, a.num_kv_heads // tp
    a.num_global_kv_heads = a.num_global_kv_heads // tp if a.num_global_kv_heads else None
    m.expert_dim, m.shared_expert_dim, m.dense_ffn_dim = (
        m.expert_dim // tp,
        m.shared_expert_dim // tp,
        m.dense_ffn_dim // tp,
    )
    share.vocab_size //= tp
    return share


def measured_compute(
    train, dims, world, precision, stage_layers, stage_shards, rows, forwards, table, optimizer=True, experts=1.0
) -> float:
    """Seconds of the busiest pipeline stage's compute, `forwards` forwards of `rows` rows, its
    operations priced by a table measured here (plan/ops.py, plan/op_table.py) with one thread a
    rank, as torchrun gives each; without the optimizer's step unless `optimizer`; the routed
    experts' time times `experts`, the slowest receiver's rows over balanced (plan/routing.py)."""
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
            part["experts"] *= experts
            if not optimizer:
                part.pop("optimizer")
            seconds.append(step_seconds(part, table.device))
        return max(seconds)
    finally:
        torch.set_num_threads(threads)


def _gloo_worker(rank: int, world: int, store: str, result: str) -> None:
    import json
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
            bandwidth = large.nbytes * (world - 1) / max(seconds - latency, 1e-9)
            with open(result, "w") as f:
                json.dump([latency, bandwidth], f)
    finally:
        dist.destroy_process_group()


_GLOO: dict[int, tuple[float, float]] = {}


def measure_gloo(world: int) -> tuple[float, float]:
    """(seconds a small collective takes, bytes a second a rank receives in a large all-gather) of
    `world` gloo processes on this machine, one thread each, measured once a process."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    if world not in _GLOO:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_gloo_worker, args=(world, f"{tmp}/store", f"{tmp}/result.json"), nprocs=world)
            with open(f"{tmp}/result.json") as f:
                _GLOO[world] = tuple(json.load(f))
    return _GLOO[world]


def tensor_parallel_exchanges(shards: dict, recompute: float) -> float:
    """A micro-batch's sequence gathers (each with its reduce-scatter) under tensor parallel: each
    block's two a forward, as many in backward and again in a recomputed forward, and the head's."""
    blocks = len({n.split(".")[1] for n in shards if n.startswith("layers.")})
    return blocks * 2 * (2 + recompute) + 1


def collective_seconds(
    dims,
    world: int,
    shards: dict,
    forwards: int,
    a2a_calls: float,
    a2a_bytes: float,
    layout: dict,
    recompute: float = 0.0,
) -> dict[str, float]:
    """The gloo collectives of one rank's step, none overlapped (the ranks' compute shares the
    cores): FSDP2's gathers and reductions and the optimizer's whole step (its matrix gathers and
    norm all-reduces) as `measure_layout` timed them: each unit gathered a forward and again in
    backward when resharded (not under pipeline parallel), and reduced once; under tensor
    parallel, each block's two gathers and two reduce-scatters of the sequence a forward, as many
    in backward and again in a recomputed forward (`recompute` of the blocks), the head's gather,
    and the replicated weights' gradients summed a backward; the expert all-to-alls, the loss, the
    gradient norm and the router statistics (every layer's ranges, then sums) at the latency and bandwidth of
    `measure_gloo`."""
    latency, bandwidth = measure_gloo(world)
    parts: dict[str, float] = {"fsdp": 0.0}
    # Under pipeline parallel the stage keeps its units gathered through backward
    # (torch.distributed.pipelining sets reshard_after_backward False) and reduces once a step.
    for gather, reduce, resharded in layout["units"]:
        again = resharded and dims.pp == 1
        parts["fsdp"] += gather * forwards * (2 if again else 1) + reduce
    parts["optimizer"] = layout["optimizer"]
    if "tensor_parallel" in layout:
        gather, scatter, replicated = layout["tensor_parallel"]
        exchanges = tensor_parallel_exchanges(shards, recompute)
        parts["tensor_parallel"] = forwards * (exchanges * (gather + scatter) + replicated)
    if a2a_calls:
        parts["expert_all_to_all"] = a2a_calls * latency + a2a_bytes / bandwidth
    routed = any(n.endswith("router.weight") for n in shards)  # every layer's statistics in two reductions
    parts["step_reductions"] = (3 + 2 * routed) * latency
    return parts


def _group_seconds(fn, group=None, repeats: int = 3, alone: bool = False) -> float:
    """Median seconds of `fn()` run in step by every rank of `group` (a collective: they run it
    alike), after one warm-up; the slowest rank's. `alone`: this process only, no group to wait for."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(repeats):
        if not alone:
            dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    if alone:
        return statistics.median(times)
    slowest = torch.tensor([statistics.median(times)])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return slowest.item()


def _own_parameters(unit, units) -> list:
    """The parameters FSDP2 unit `unit` manages: its own, less those of the units inside it."""
    inner = {id(p) for u in units if u is not unit and any(u is m for m in unit.modules()) for p in u.parameters()}
    return [p for p in unit.parameters() if id(p) not in inner]


def _shards(p) -> int:
    """How many pieces the DTensor `p` is cut into (its mesh axes that shard it)."""
    return math.prod(p.device_mesh.size(axis) for axis, pl in enumerate(p.placements) if pl.is_shard())


def _unit_reduce(params) -> object:
    """FSDP2's gradient reduction of one unit's parameters: a reduce-scatter of the gathered
    gradients over the axes that shard them and an all-reduce of the shard over those that
    replicate them (HSDP), as flat fp32 buffers."""
    import torch
    import torch.distributed as dist

    if not params:  # a unit holding nothing of its own (a middle pipeline stage's root)
        return lambda: None
    mesh, placements = params[0].device_mesh, params[0].placements
    # FSDP2 pads dim 0 to a multiple of the shards: every rank reduces the same bytes.
    shard = sum(-(-p.shape[0] // _shards(p)) * math.prod(p.shape[1:]) for p in params)
    steps = []
    for axis, placement in enumerate(placements):
        if mesh.mesh_dim_names and mesh.mesh_dim_names[axis] in ("tp", "ep"):  # FSDP2's axes only
            continue
        group, size = mesh.get_group(axis), mesh.size(axis)
        if placement.is_shard():
            out, full = torch.empty(shard), torch.empty(shard * size)
            steps.append(lambda out=out, full=full, group=group: dist.reduce_scatter_single(out, full, group=group))
        else:
            buffer = torch.empty(shard)
            steps.append(lambda buffer=buffer, group=group: dist.all_reduce(buffer, group=group))
    return lambda: [step() for step in steps]


def _layout_worker(rank: int, world: int, store: str, result: str, train, parallel, rows: int) -> None:
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from marinlm.parallel import _parallelize
    from marinlm.parallel.mesh import ParallelDims

    torch.set_num_threads(1)  # as torchrun runs each rank
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        dims = ParallelDims.resolve(parallel, world).build_mesh("cpu")
        model, precision = _built(train)
        parts, group, per_stage = [model], None, world // dims.pp
        if dims.pp > 1:  # this rank's stages, as shards.py cuts them; collectives timed within a stage
            from marinlm.parallel.pipeline_parallel import build_stage, pipeline_layout, stage_ids

            layout = pipeline_layout(train.model, parallel, dims.pp, rows, train.data.seq_len)
            last = dims.pp * layout.per_rank - 1
            ids = stage_ids(rank // per_stage, dims.pp, layout.schedule, layout.per_rank)
            parts = [build_stage(model, layout.stages[s], s == 0, s == last) for s in ids]
            groups = [dist.new_group(list(range(s * per_stage, (s + 1) * per_stage))) for s in range(dims.pp)]
            group = groups[rank // per_stage]
        measured = {"units": []}
        for part in parts:
            _parallelize(part, parallel, dims)
            units = [m for m in part.modules() if isinstance(m, FSDPModule)]
            for unit in units:
                gather = _group_seconds(lambda unit=unit: (unit.unshard(), unit.reshard()), group)
                reduce = _group_seconds(_unit_reduce(_own_parameters(unit, units)), group)
                measured["units"].append([gather, reduce, unit is not part and parallel.reshard_after_forward])
        optimizers = [_optimizer(train, part) for part in parts]
        measured["optimizer"] = _group_seconds(lambda: [o.step() for o in optimizers], group)
        if dims.pp == 1:
            measured |= _short_step_seconds(train, model, dims, precision, rows, optimizers[0])
        if dims.tp > 1:
            measured["tensor_parallel"] = _tensor_parallel_seconds(train, dims, parts, rows, precision)
        if rank == 0:
            with open(result, "w") as f:
                json.dump(measured, f)
    finally:
        dist.destroy_process_group()


def _built(train):
    """(the model of `train`, initialised on this CPU with the run's kernels, the compute precision),
    in a process whose allocator is set as the trainer sets it."""
    import torch

    from marinlm.kernels import apply_kernels
    from marinlm.model.transformer import MarinForCausalLM
    from marinlm.utils.perf import tune_cpu_allocator

    tune_cpu_allocator()
    with torch.device("meta"):
        model = MarinForCausalLM(train.model)
    precision = "bf16" if train.train.precision in ("bf16", "auto") else train.train.precision
    apply_kernels(model, torch.device("cpu"), precision, train.kernels)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model, precision


def _optimizer(train, part):
    """The run's optimizer over `part`, its gradients set (a step has something to apply)."""
    from marinlm.optim import build_optimizer

    for p in part.parameters():
        p.grad = p.detach() * 1e-3
    return build_optimizer(part, train.optim, "cpu")


def measure_here(train, parallel, world: int, rows: int) -> dict:
    """`measure_layout` in `world` gloo processes; one process: `measure_alone`."""
    return measure_layout(train, parallel, world, rows) if world > 1 else measure_alone(train, parallel, rows)


def measure_alone(train, parallel, rows: int) -> dict:
    """`measure_layout` for one process with this process's threads, as `marinlm train` runs
    without torchrun: the optimizer's step and the real step on a short row ("short_step"),
    timed here. Measured once a process for a config."""
    from marinlm.parallel.mesh import ParallelDims

    key = repr((train.model, train.optim, train.kernels, train.train.precision, parallel, 1, rows))
    if key not in _LAYOUTS:
        from marinlm.parallel.activation_checkpoint import apply_activation_checkpointing

        model, precision = _built(train)
        apply_activation_checkpointing(model, parallel.activation_checkpointing, parallel.checkpoint_every_n)
        optimizer = _optimizer(train, model)
        measured = {"optimizer": _group_seconds(optimizer.step, alone=True)}
        measured |= _short_step_seconds(train, model, ParallelDims.resolve(parallel, 1), precision, rows, optimizer)
        _LAYOUTS[key] = measured
    return _LAYOUTS[key]


# Tokens in the row of the short step: its compute is a small part of the step it is timed beside.
SHORT_TOKENS = 8


def _short_step_seconds(train, model, dims, precision: str, rows: int, optimizer) -> dict:
    """{"short_step": seconds of the real step (train/step.py's `train_step`: forward and backward
    of each micro-batch, the token and loss reductions, the gradient norm, the router statistics,
    clipping, the optimizer) on the step's micro-batches, each cut to one row of SHORT_TOKENS
    tokens, on every rank at once: what the layout costs a step apart from its tokens' compute}."""
    import torch

    from marinlm.plan.op_table import packed_segments
    from marinlm.train.step import train_step

    forwards = rows // (train.train.micro_batch or rows)
    ids = torch.randint(0, train.model.vocab_size, (1, SHORT_TOKENS + 1), generator=torch.Generator().manual_seed(0))
    row = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(1, SHORT_TOKENS)}
    row["segment_ids"] = packed_segments(1, SHORT_TOKENS)
    how = dict(device=torch.device("cpu"), precision=precision, grad_clip=train.train.grad_clip)
    how |= dict(world_size=dims.batch_world, group=dims.batch_group, router_group=dims.router_group)
    step = lambda: train_step(model, optimizer, [row] * forwards, **how)  # noqa: E731
    return {"short_step": _group_seconds(step, alone=dims.world == 1)}


def short_step_parts(
    layout: dict, short_compute: float, a2a_bytes: float, world: int, tp_exchanges: float = 0.0
) -> dict[str, float]:
    """The step's parts apart from its tokens' compute, from `_short_step_seconds` in `world`
    processes: the optimizer as timed alone, the rest of the short step less its own compute
    (`short_compute`, priced as the step's is and slowed as the ranks slow each other) as "layout"
    (FSDP2's and tensor parallel's exchanges and hooks, the reductions, the all-to-alls' calls; one
    process: "host", Python's, autograd's and the trainer's own work beside the operations), and
    what grows with the tokens beyond the short row's: the expert all-to-alls' bytes, and, where
    the layout timed them (tensor parallel), `tp_exchanges` sequence gathers and reduce-scatters
    at a micro-batch's size, less the latency of each that the short row's own exchanges paid."""
    latency, bandwidth = measure_gloo(world) if world > 1 else (0.0, 0.0)
    parts = {"optimizer": layout["optimizer"]}
    parts["layout" if world > 1 else "host"] = max(layout["short_step"] - layout["optimizer"] - short_compute, 0)
    if a2a_bytes:
        parts["expert_all_to_all"] = a2a_bytes / bandwidth
    if "tensor_parallel" in layout:  # timed under tensor parallel only
        gather, scatter, _ = layout["tensor_parallel"]
        parts["tensor_parallel"] = tp_exchanges * max(gather + scatter - 2 * latency, 0.0)
    return parts


def _tensor_parallel_seconds(train, dims, parts, rows: int, precision: str) -> list[float]:
    """[a gather of a micro-batch's sequence over tp, a reduce-scatter of it back, the all-reduce of
    a backward's replicated weight gradients], each timed in this rank's tp group."""
    import torch
    import torch.distributed as dist

    group, tp = dims.dense_mesh["tp"].get_group(), dims.tp
    tokens = (train.train.micro_batch or rows) * train.data.seq_len
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    whole = torch.empty(tokens * train.model.d_model, dtype=dtype)
    piece = torch.empty(tokens * train.model.d_model // tp, dtype=dtype)
    replicated = 0
    for p in (p for part in parts for p in part.parameters()):
        names = p.device_mesh.mesh_dim_names or ()
        if "tp" in names and p.placements[names.index("tp")].is_replicate():
            replicated += p.to_local().numel()
    grads = torch.empty(replicated)
    return [
        _group_seconds(lambda: dist.all_gather_single(whole, piece, group=group), group),
        _group_seconds(lambda: dist.reduce_scatter_single(piece, whole, group=group), group),
        _group_seconds(lambda: dist.all_reduce(grads, group=group), group),
    ]


_LAYOUTS: dict[str, dict] = {}


def measure_layout(train, parallel, world: int, rows: int) -> dict:
    """FSDP2's gather and reduction of each unit, and the optimizer's step, timed in `world` gloo
    processes on this machine (one thread each) holding the model sharded as `parallel` lays it
    out, by the real `parallelize` and optimizer: {"units": [[gather + reshard seconds, gradient
    reduction seconds, resharded after forward]], "optimizer": seconds}, each the median of a few
    runs on the slowest rank (of the first pipeline stage: `rows`, a data-parallel rank's rows a
    step, cut its microbatches); under tensor parallel also its collectives ("tensor_parallel":
    `_tensor_parallel_seconds`). Measured once a process for a config and layout; not for context
    parallel layouts."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    key = repr((train.model, train.optim, train.kernels, train.train.precision, parallel, world, rows))
    if key not in _LAYOUTS:
        with tempfile.TemporaryDirectory() as tmp:
            args = (world, f"{tmp}/store", f"{tmp}/result.json", train, parallel, rows)
            mp.spawn(_layout_worker, args=args, nprocs=world)
            with open(f"{tmp}/result.json") as f:
                _LAYOUTS[key] = json.load(f)
    return _LAYOUTS[key]
