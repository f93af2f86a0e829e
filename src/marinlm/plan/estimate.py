"""Per-rank memory and per-step time of one layout of a training config on one kind of hardware.

Memory, per rank (the first rank of each pipeline stage; the others of a stage hold the same):
- weights, gradients: the local shards `parallelize()` makes (plan/shards.py), fp32 (a fine-tuning config:
  gradients and optimizer state of what trains only, plan/finetune.py); optimizer state: per local weight,
  MuonH's momentum (1 copy) or Adam's two moments, fp32; in host memory under `parallel.offload: optimizer`
  (and weights and gradients too under `all`);
- activations: what autograd saves (plan/activations.py) for the rank's tokens (under context parallel a 1/cp
  share of each row, with the keys and values each layer gathers and the masks of the keys its chunks reach),
  divided by tp (sequence parallel), times the microbatches a pipeline stage holds at once (1F1B: pp - stage),
  with full activation checkpointing only the blocks' inputs and the forward's context (ids, positions, RoPE
  tables, masks) plus one block; the blocks' inputs in host memory under `parallel.offload_activations`;
- buffers: FSDP2's gathered block (fp32) with one prefetched, its unsharded gradient; the expert all-to-all's
  send and receive rows; tensor parallel's gathered activations; torch's pipeline stage's receive buffers and
  kept outputs; the QB router's margins, kept for the step;
- temporaries: one block's activations again (their gradients in backward).
A GPU's verdict weighs the reserved peak: the weights and optimizer state, and the rest times the caching
allocator's overhead on the step's allocations (plan/allocator.py); a CPU's allocator returns what is freed.

Time, per step: the rank's model FLOPs at `Efficiency.compute` of peak (given a routing histogram, the routed
experts' at the slowest receiver's kept rows, plan/routing.py); the expert all-to-all (5 calls a layer:
the counts, dispatch and combine forward, and the two gradients' exchanges; 3 more in a checkpointed block's
recomputed forward; `expert_exchanges`) over NVLink when its group fits in an NVLink domain, else the network,
not overlapped; context parallel's exchanges of keys, values and SConv halos (forward, their gradients back, and
again in a recomputed forward), not overlapped (the exchange waits before attention); FSDP/HSDP traffic of which
`overlap` is hidden; tensor-parallel collectives; optimizer-state copies to the host and back, and offloaded
activations' each forward (on the compute stream: not overlapped); all divided by
(1 - bubble) under pipelining (gloo ranks sharing cores: the bubble's compute at the stage's ranks' contention).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field

from marinlm.config import ConfigError
from marinlm.model.summary import layer_flops, summarize
from marinlm.parallel import FaultToleranceConfig, ParallelConfig
from marinlm.parallel.mesh import ParallelDims
from marinlm.plan.activations import activation_bytes, context_bytes_a_token, inventory, weight_key
from marinlm.plan.allocator import overhead, reserved_bytes
from marinlm.plan.contention import measure_contention
from marinlm.plan.cpu_step import (
    SHORT_TOKENS,
    collective_seconds,
    measurable_here,
    measure_here,
    measured_compute,
    short_step_parts,
    tensor_parallel_exchanges,
    tensor_parallel_share,
)
from marinlm.plan.exchanges import context_exchange_bytes, expert_exchanges
from marinlm.plan.finetune import Training, training
from marinlm.plan.hardware import Efficiency, Hardware
from marinlm.plan.routing import RoutingLoads, capacity_notes, expert_rows, route, routing_note
from marinlm.plan.shards import local_shards, tensor_parallel_activations

FP32 = 4
GiB = 2**30


@dataclass
class RankPlan:
    """One rank's memory (bytes) by category, on the device and on its host."""

    rank: int
    stage: int
    device: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    local_parameters: int = 0
    local_experts: int = 0
    trained_fraction: float = 1.0  # of the local weights, LoRA factors counted in (fine-tuning)

    @property
    def device_total(self) -> float:
        return sum(self.device.values())


@dataclass
class LayoutPlan:
    layout: dict
    world: int
    ranks: list[RankPlan]
    step: dict[str, float]  # seconds by part, and "total"
    tokens_per_s: float
    mfu: float
    flops_per_step: float
    traffic: dict[str, float]  # bytes a step per rank by link class
    fits: bool
    headroom_bytes: float  # device memory left on the fullest rank by reserved bytes (negative: over)
    reserved_bytes: float  # the fullest rank's predicted reserved peak (plan/allocator.py)
    allocator_overhead: float  # the step's reserved peak over its live peak (1 on a CPU)
    host_per_node_bytes: float
    host_fits: bool
    notes: list[str] = field(default_factory=list)
    # Expert all-to-alls a step per rank, and the bytes they send to other ranks (in `traffic` too).
    all_to_all_calls: float = 0.0
    all_to_all_bytes: float = 0.0
    routing: dict | None = None  # plan/routing.py's `Routed`, when a routing histogram is given

    def to_json(self) -> dict:
        return asdict(self)


def _state_copies(name: str, optim_type: str) -> int:
    """fp32 optimizer-state copies a weight has: MuonH/Muon momentum 1, Adam(H) moments 2."""
    if optim_type != "marin":
        return 2
    if name.startswith("lm_head.") or name.startswith("embed.") or ".router." in name or ".sconv" in name:
        return 2
    if name.endswith("attn.gate.weight"):
        return 2
    return 1  # matrices under MuonH; 1-D gains are Adam's, but negligible, counted as 1 here


def plan_layout(
    train,
    parallel: ParallelConfig,
    world: int,
    hardware: Hardware,
    eff: Efficiency,
    shards_of=local_shards,
    inv=None,
    remote_share: float | None = None,
    table=None,
    gloo_group: bool = True,
    routing: RoutingLoads | None = None,
) -> LayoutPlan:
    """Plan `train` (a TrainConfig) under `parallel` on `world` ranks of `hardware`. `shards_of`
    gives a rank's local shards (default: the real parallelize() under a fake process group).
    `remote_share`: the routing's share of assignments sent to another expert-parallel rank
    (`expert_exchanges`). `routing`: a routing histogram (plan/routing.py) for the capacity rule's
    drops and the slowest receiver; None keeps balanced load. `gloo_group`: on `--hardware cpu`,
    time here what a layout adds in a gloo group of its size, or one process's host work
    (`cpu_step.measure_here`). Fault-tolerant replica groups are planned as HSDP's replicas, plus
    what torchft adds."""
    model = train.model
    fault_tolerant = parallel.fault_tolerance.groups > 1
    if fault_tolerant:
        groups = parallel.fault_tolerance.groups
        parallel = dataclasses.replace(parallel, data_parallel_replicate=groups, fault_tolerance=FaultToleranceConfig())
    dims = ParallelDims.resolve(parallel, world)
    if hasattr(train, "method"):  # a fine-tuning config: QLoRA runs in one process
        from marinlm.finetune.config import check_processes

        check_processes(train, world)
    seq = train.data.seq_len
    rows = train.train.global_batch // dims.dp  # a data-parallel rank's rows a step
    if rows == 0 or train.train.global_batch % dims.dp:
        raise ConfigError(
            "train.global_batch",
            f"{train.train.global_batch} rows do not divide among {dims.dp} data-parallel ranks: give a multiple of "
            f"{dims.dp} (e.g. --train.global_batch={dims.dp * max(rows, 1)})",
        )
    micro_rows = train.train.micro_batch or rows
    precision = "bf16" if train.train.precision in ("bf16", "auto") else train.train.precision
    act_bytes = 2 if precision == "bf16" else FP32
    inv = inv or inventory(model, precision, train.kernels, kernels_device="cuda" if hardware.name != "cpu" else "cpu")
    per_layer_flops = layer_flops(model, seq)
    head_flops = 6.0 * model.d_model * model.vocab_size
    summary = summarize(model, seq)
    tokens_step = train.train.global_batch * seq
    notes = []

    microbatches, bubble, stage_layers = 1, 0.0, [range(model.num_layers)]
    if dims.pp > 1:
        from marinlm.parallel.pipeline_parallel import bubble_fraction, pipeline_layout

        layout = pipeline_layout(model, parallel, dims.pp, rows, seq)
        microbatches = layout.microbatches
        micro_rows = rows // microbatches
        bubble = bubble_fraction(layout.schedule, dims.pp, microbatches, layout.per_rank)
        stage_layers = layout.stages
    fit = training(train)
    moe = any(model.is_moe_layer(i) for i in range(model.num_layers))
    routed = route(model.moe, routing, micro_rows * seq // dims.cp, dims) if routing is not None and moe else None
    load = routed.slowest * (1 - routed.dropped) if routed else 1.0  # the slowest receiver's rows / balanced
    receiver = load if routed else None
    ranks, stage_shards = [], []
    for stage in range(dims.pp):
        rank = stage * (world // dims.pp)
        shards = shards_of(model, parallel, world, rank, rows, seq)
        how = (train, parallel, dims, hardware, inv, shards, rank, stage, micro_rows, act_bytes, fit, receiver)
        plan = _rank_memory(*how)
        ranks.append(plan)
        stage_shards.append(shards)
    if fit.method != "full":
        trained = max(r.trained_fraction for r in ranks)
        factors = " (LoRA factors counted in)" if fit.adapter_parameters else ""
        notes.append(f"fine-tuning ({fit.method}): {100 * trained:.2f}% of a rank's weights train{factors}")

    # --- time -------------------------------------------------------------------------------------
    tokens_rank = rows * seq // dims.cp  # a rank's tokens a step; pipeline stages share them
    stage_flops = []
    for s in range(dims.pp):
        layers = stage_layers[s] if dims.pp > 1 else range(model.num_layers)
        flops = sum(per_layer_flops[i] for i in layers) + (head_flops if s == dims.pp - 1 else 0.0)
        stage_flops.append(flops * tokens_rank / dims.tp)
    # Activation checkpointing runs the checkpointed blocks' forward again (a third of their FLOPs).
    recompute = {"full": 1.0, "every_n": 1.0 / parallel.checkpoint_every_n}.get(parallel.activation_checkpointing, 0.0)
    # Frozen weights skip their weight-gradient GEMMs, a third of their training FLOPs (fine-tuning).
    frozen = 1 - min(max(r.trained_fraction for r in ranks), 1.0)
    compute = max(stage_flops) * (1 + recompute / 3 - frozen / 3) / (hardware.peak_bf16_flops * eff.compute)
    local_layers = max(len(stage_layers[s]) for s in range(dims.pp)) if dims.pp > 1 else model.num_layers
    moe_layers = sum(1 for i in range(model.num_layers) if model.is_moe_layer(i)) * local_layers / model.num_layers
    if routed:  # the experts' GEMMs wait for the slowest receiver's kept rows
        expert_flops = 18 * model.moe.top_k * (model.moe.latent_dim or model.d_model) * model.moe.expert_dim
        extra = expert_flops * tokens_rank / dims.tp * moe_layers * (load - 1) * (1 + recompute / 3)
        compute += extra / (hardware.peak_bf16_flops * eff.compute)
        notes.append(routing_note(routed, dims.ep))
    accumulation = forwards_a_step(dims, rows, micro_rows, microbatches)
    gloo_tp = dims.tp > 1 and hardware.name == "cpu" and world > 1 and gloo_group  # its collectives timed
    measured = (hardware.name == "cpu" or table is not None) and (dims.tp == 1 or gloo_tp)
    measured = measured and dims.cp == 1 and fit.method == "full"
    if measured and table is None and not measurable_here(model, micro_rows * seq):
        measured = False
        notes.append("compute: too large to measure its operations on this machine; the roofline prices it")
    spot = measured and hardware.name == "cpu" and gloo_group and (world > 1 or table is None)  # timed here
    gloo = spot and world > 1
    layout, slowed = measure_here(train, parallel, world, rows) if spot else None, 1.0
    if measured:
        priced = dataclasses.replace(train, parallel=parallel, model=tensor_parallel_share(model, dims.tp))
        how = (priced, dims, world, precision, stage_layers, stage_shards, micro_rows, accumulation, table)
        compute = measured_compute(*how, layout is None, experts=load)
        comms = "one process: no communication" if hardware.name == "cpu" else None
        comms = f"{comms}; the host's work beside them timed on a short row" if spot else comms
        if gloo:  # one thread a rank, the ranks sharing the cores
            slowed = measure_contention(priced, world, micro_rows)
            compute *= slowed
            comms = (
                f"what the layout adds timed in {world} gloo processes holding the sharded model (the real step on "
                "a short row, less its compute; pipeline stages: FSDP2's gathers and reductions, the rest at gloo's "
                "latency and bandwidth); the ranks' compute slowed as much as they slow each other here"
            )
        notes.append(
            "compute: the step's operations priced from costs measured here (plan/op_table.py); "
            + (comms or "communication at the profile's bandwidths and efficiencies")
        )
    traffic = {"nvlink": 0.0, "network": 0.0, "host": 0.0}
    step = {"compute": compute}
    a2a_bytes = a2a_calls = 0.0
    if dims.ep > 1:
        how = (model, dims, tokens_rank, accumulation, act_bytes, recompute, moe_layers, remote_share)
        a2a_bytes, a2a_calls = expert_exchanges(*how, travels=routed.travels if routed else 1.0)
        link = "nvlink" if dims.ep * dims.tp <= hardware.gpus_per_nvlink_domain else "network"
        traffic[link] += a2a_bytes
        step["expert_all_to_all"] = a2a_bytes / (getattr(hardware, f"{link}_bandwidth") * eff.all_to_all)
    if dims.cp > 1:
        volume = rows * context_exchange_bytes(model, seq, dims.cp, act_bytes) * (2 + recompute) * local_layers
        volume /= model.num_layers * dims.tp  # the bytes above are the whole model's; tp ranks hold a share of heads
        link = "nvlink" if dims.cp * dims.tp <= hardware.gpus_per_nvlink_domain else "network"
        traffic[link] += volume
        step["context_exchange"] = volume / (getattr(hardware, f"{link}_bandwidth") * eff.all_to_all)
    fsdp_bytes = sum(r.device.get("fsdp_gathered_block", 0.0) for r in ranks[:1]) / 2  # one block, fp32
    fsdp = dims.dp_shard * dims.cp  # FSDP2 shards over the cp ranks too
    shard_group = fsdp * dims.tp
    if fsdp > 1:
        # Gathered for every forward and (resharded after forward) every backward; gradients once.
        passes = accumulation * (2 if parallel.reshard_after_forward else 1) + 1
        volume = passes * fsdp_bytes * local_layers * (fsdp - 1) / fsdp
        link = "nvlink" if shard_group <= hardware.gpus_per_nvlink_domain else "network"
        traffic[link] += volume
        step["fsdp"] = volume / (getattr(hardware, f"{link}_bandwidth") * eff.collectives) * (1 - eff.overlap)
    if dims.dp_replicate > 1:
        grads = ranks[0].device.get("gradients", 0.0)
        volume = 2 * grads * (dims.dp_replicate - 1) / dims.dp_replicate
        traffic["network"] += volume
        if fault_tolerant:  # torchft averages one flat copy of the shard after backward: not overlapped
            step["ft_all_reduce"] = volume / (hardware.network_bandwidth * eff.collectives)
            for r in ranks:
                r.device["ft_gradient_buffer"] = r.device.get("gradients", 0.0)
            notes.append(
                f"fault tolerance ({dims.dp_replicate} replica groups): the groups' gradient all-reduce runs after "
                "backward, not overlapped, and a flat copy of the gradient shard is held while it runs (both "
                "counted); a quorum a step (milliseconds) and a recovering group's state transfer are not counted"
            )
        else:
            step["hsdp_all_reduce"] = volume / (hardware.network_bandwidth * eff.collectives) * (1 - eff.overlap)
    if dims.tp > 1:
        volume = 8 * tokens_rank * model.d_model * act_bytes * (dims.tp - 1) / dims.tp * local_layers
        traffic["nvlink"] += volume
        step["tensor_parallel"] = volume / (hardware.nvlink_bandwidth * eff.collectives)
    if dims.pp > 1:
        volume = 2 * tokens_rank * model.d_model * act_bytes
        link = "nvlink" if world // dims.pp <= hardware.gpus_per_nvlink_domain else "network"
        traffic[link] += volume
        step["pipeline_sends"] = volume / (getattr(hardware, f"{link}_bandwidth") * eff.collectives)
    offloaded = sum(v for k, v in ranks[0].host.items() if k != "activations")
    if offloaded:
        traffic["host"] += 2 * offloaded
        step["host_copies"] = 2 * offloaded / (hardware.host_link_bandwidth * eff.host_link)
    if parallel.offload_activations:  # each forward's offloaded inputs out and back, on the compute stream
        a_forward = max(r.host.get("activations", 0.0) / (dims.pp - r.stage if dims.pp > 1 else 1) for r in ranks)
        volume = 2 * a_forward * accumulation
        traffic["host"] += volume
        step["activation_offload"] = volume / (hardware.host_link_bandwidth * eff.host_link)
    if layout is not None:
        for key in ("fsdp", "expert_all_to_all", "hsdp_all_reduce", "tensor_parallel"):  # timed here instead
            step.pop(key, None)
        if "short_step" in layout:  # the real step on a short row, less its compute priced alike
            short = dataclasses.replace(priced, data=dataclasses.replace(train.data, seq_len=SHORT_TOKENS))
            how = (short, dims, world, precision, stage_layers, stage_shards, 1, accumulation, table, False)
            exchanges = accumulation * tensor_parallel_exchanges(stage_shards[0], recompute)  # priced under tp
            short_compute = measure_contention(short, world, 1) * measured_compute(*how)  # slowed on its own work
            step |= short_step_parts(layout, short_compute, a2a_bytes, world, exchanges)
        else:
            how = (dims, world, stage_shards[0], accumulation, a2a_calls, a2a_bytes, layout, recompute)
            step |= collective_seconds(*how)
    # The stages idle in the schedule's bubble, where on shared cores the world / pp ranks still
    # computing slow each other less; the optimizer's step comes after it.
    stage = measure_contention(priced, world // dims.pp, micro_rows) if bubble and gloo else slowed
    shared = compute * (1 - stage / slowed)
    busy = sum(v for k, v in step.items() if k != "optimizer") - shared
    if bubble:
        step["pipeline_bubble"] = busy * bubble / (1 - bubble)
    step["total"] = sum(step.values())
    tokens_per_s = tokens_step / step["total"]
    flops_step = summary.flops_per_token * tokens_step
    mfu = flops_step / (step["total"] * world * hardware.peak_bf16_flops)

    # CUDA's caching allocator holds more than the live peak (plan/allocator.py); a CPU's returns what is freed.
    factor = 1.0
    if hardware.name != "cpu":
        factor = overhead(model, precision, train.kernels, "cuda", micro_rows * seq // dims.cp, seq, parallel)
    reserved = max(reserved_bytes(r.device, factor) for r in ranks)
    headroom = hardware.memory_bytes - reserved
    host_node = max(sum(r.host.values()) for r in ranks) * hardware.gpus_per_node
    if parallel.activation_checkpointing == "none" and headroom < 0:
        notes.append("does not fit without activation checkpointing: try --layout ...,ac=full")
    notes += capacity_notes(model.moe, micro_rows * seq, dims)
    return LayoutPlan(
        layout=describe(parallel, dims),
        world=world,
        ranks=ranks,
        step=step,
        tokens_per_s=tokens_per_s,
        mfu=mfu,
        flops_per_step=flops_step,
        traffic=traffic,
        all_to_all_calls=a2a_calls,
        all_to_all_bytes=a2a_bytes,
        fits=headroom >= 0,
        headroom_bytes=headroom,
        reserved_bytes=reserved,
        allocator_overhead=factor,
        host_per_node_bytes=host_node,
        host_fits=host_node <= hardware.host_memory_bytes,
        notes=notes,
        routing=routed.to_json() if routed else None,
    )


def forwards_a_step(dims, rows: int, micro_rows: int, microbatches: int) -> int:
    """Forwards a rank runs a step: its rows' micro-batches, or the pipeline's microbatches."""
    return rows // micro_rows if dims.pp == 1 else microbatches


def describe(parallel: ParallelConfig, dims: ParallelDims) -> dict:
    return {
        "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard,
        "tp": dims.tp,
        "cp": dims.cp,
        "ep": dims.ep,
        "pp": dims.pp,
        "pipeline_schedule": parallel.pipeline_schedule if dims.pp > 1 else None,
        "offload": parallel.offload,
        "offload_activations": parallel.offload_activations,
        "activation_checkpointing": parallel.activation_checkpointing,
    }


def _rank_memory(
    train, parallel, dims, hardware, inv, shards, rank, stage, micro_rows, act_bytes, fit: Training, load=None
) -> RankPlan:
    model = train.model
    local = {name: math.prod(s["shape"]) for name, s in shards.items()}
    full = {name: tuple(s["full"]) for name, s in shards.items()}
    weights = sum(n * fit.weight_bytes(name) for name, n in local.items())
    trained = {name: n for name, n in local.items() if fit.trains(name, full[name])}
    # The LoRA factors are sharded with the model: this rank's share of them, as of its weights.
    adapters = fit.adapter_parameters * sum(local.values()) / max(summarize(model).total, 1)
    copies = _state_copies("lora", train.optim.type_name)
    optimizer = sum(n * _state_copies(name, train.optim.type_name) for name, n in trained.items()) + adapters * copies
    plan = RankPlan(rank=rank, stage=stage, local_parameters=sum(local.values()))
    plan.trained_fraction = (sum(trained.values()) + adapters) / max(sum(local.values()), 1)
    experts = [s for name, s in shards.items() if name.endswith("mlp.experts.gate_proj")]
    plan.local_experts = experts[0]["shape"][0] if experts else 0
    where = plan.host if parallel.offload in ("optimizer", "all") else plan.device
    where["optimizer_state"] = optimizer * FP32
    weights_where = plan.host if parallel.offload == "all" else plan.device
    weights_where["weights"] = weights + adapters * FP32
    weights_where["gradients"] = (sum(trained.values()) + adapters) * FP32

    layers = sorted({int(name.split(".")[1]) for name in shards if name.startswith("layers.")})
    tokens = micro_rows * train.data.seq_len // dims.cp
    in_flight = dims.pp - stage if dims.pp > 1 else 1  # 1F1B keeps pp - stage microbatches' activations
    matrices = sum(s["unsharded"] for s in shards.values() if len(s["full"]) >= 2)
    gpu = hardware.name != "cpu"
    ends = {
        "embed": any(n.startswith("embed.") for n in shards),
        "head": any(n.startswith("final_norm.") for n in shards),
    }
    kw = dict(weights=matrices, gpu=gpu, cp=dims.cp, act_bytes=act_bytes, **ends)  # the stage's ends
    acts = activation_bytes(inv, model, tokens, train.data.seq_len, layers, **kw)
    one_block = (acts["blocks"] + acts["context_halo"]) / max(len(layers), 1)
    # Checkpointed blocks keep their input only (the residual stream, in the weights' dtype) until
    # the backward recomputes them one at a time.
    kept = len(layers)
    if parallel.activation_checkpointing == "full":
        kept = 0
    elif parallel.activation_checkpointing == "every_n":
        kept = len(layers) - math.ceil(len(layers) / parallel.checkpoint_every_n)
    inputs = (len(layers) - kept) * tokens * model.d_model * max(act_bytes, FP32)
    # Offloaded, they wait on the host (every microbatch in flight) and one comes back at a time.
    offloaded = inputs / dims.tp * in_flight if parallel.offload_activations else 0.0
    # Autocast's bf16 weight copies (`Inventory.weight_copies`): its cache is off under FSDP2 (any
    # launched layout) or checkpointing (`parallel.autocast_caches_weights`); on, it holds every
    # block's; checkpointed blocks save none.
    cache = dims.world == 1 and kept == len(layers)
    copied = {"block": 0.0, "outside": 0.0}
    for name, s in shards.items():
        key = weight_key(name)
        size, saved, cached = inv.weight_copies.get(key, (0, False, False))
        if saved or (cached and cache):
            block = key.startswith("layers.")
            copied["block" if block else "outside"] += s["unsharded"] * size / (max(len(layers), 1) if block else 1)
    copies = (copied["outside"] + copied["block"] * kept) * in_flight  # each microbatch's forward casts its own
    held = ((one_block * kept + inputs) / dims.tp + acts["outside"] + acts["masks"]) * in_flight
    recomputed = one_block / dims.tp + copied["block"]
    masks_counted = gpu  # `activation_bytes` counts the boolean masks for CUDA's fused attention
    if dims.tp > 1 and dims.pp == dims.ep == dims.cp == 1 and measurable_here(model, tokens):
        # Tensor parallel shards some saved tensors and not others (sequence parallel's gathered
        # inputs stay whole): read off a fake-group forward of this rank, weight copies included.
        precision = "bf16" if act_bytes == 2 else "fp32"
        where = "cuda" if hardware.name != "cpu" else "cpu"
        traced = tensor_parallel_activations(train, dims.tp, micro_rows, train.data.seq_len, precision, where)
        per_layer = sorted(traced["layers"].values())
        held = sum(per_layer[len(per_layer) - kept :] if kept else []) + inputs / dims.tp + traced["outside"]
        copies, recomputed, masks_counted = 0.0, per_layer[-1], False
    if kept < len(layers) and dims.cp == 1:  # the checkpoints keep the forward's context till backward:
        # its tables and, unless counted (CUDA), its boolean masks (unchecked, the CPU saves float copies)
        masks = len({model.is_global_layer(i) for i in layers}) * train.data.seq_len if not masks_counted else 0
        held += micro_rows * train.data.seq_len * (context_bytes_a_token(model) + masks) * in_flight
    if stage < dims.pp - 1:  # torch's stage keeps its output for the backward it sends back
        held += tokens * model.d_model * FP32 * in_flight
    if stage > 0:  # its first block's input is the buffer it received (`pipeline_buffers`)
        held -= tokens * model.d_model * FP32 * in_flight
    plan.device["activations"] = held + copies - offloaded  # what a forward leaves for the backward
    if offloaded:
        plan.host["activations"] = offloaded
    if kept < len(layers):  # one checkpointed block at a time, recomputed in backward
        plan.device["recomputed_block"] = recomputed
    # FSDP2's all-gathered block (fp32) and the next one prefetched; the block's unsharded gradients.
    block_unsharded = max(
        (sum(s["unsharded"] for n, s in shards.items() if n.startswith(f"layers.{i}.")) for i in layers), default=0
    )
    sharded = dims.dp_shard * dims.cp > 1
    plan.device["fsdp_gathered_block"] = 2 * block_unsharded * FP32 if sharded else 0.0
    unsharded_grads = block_unsharded * FP32 * min(plan.trained_fraction, 1.0)
    plan.device["fsdp_unsharded_gradients"] = unsharded_grads if sharded else 0.0
    if dims.ep > 1:
        latent = model.moe.latent_dim or model.d_model
        sent, received = expert_rows(model.moe, tokens, dims)
        if load is not None:  # a routing histogram: the slowest receiver's kept rows, at most the rule's
            received = min(sent * load, dims.ep * sent if model.moe.capacity_factor is None else received)
        plan.device["all_to_all_buffers"] = 2 * (sent + received) * latent * act_bytes
    if dims.tp > 1:
        plan.device["tensor_parallel_buffers"] = 2 * tokens * model.d_model * act_bytes
    forwards = train.train.global_batch // dims.dp // micro_rows
    if dims.pp > 1:  # torch's stage keeps a buffer a microbatch for what it receives: the residual
        # stream (fp32, the weights' dtype) from the stage before, its gradient from the stage after;
        # the last keeps every microbatch's output till the step ends
        ends = (stage > 0) + (stage < dims.pp - 1) + (stage == dims.pp - 1)
        # 1F1B's handle of the first microbatch's send keeps that output alive till the cooldown
        sent = stage < dims.pp - 1 and parallel.pipeline_schedule == "1F1B"
        plan.device["pipeline_buffers"] = (ends * forwards + sent) * tokens * model.d_model * FP32
    router = model.moe.router
    if getattr(router, "estimator", None) == "histogram" and getattr(router, "hist_bounds", None) == "live":
        # The QB router keeps each forward's margins [tokens, experts] (fp32) until the step's range
        # across ranks is known, after the last forward: every forward of the step, every MoE layer.
        moe_layers = sum(model.is_moe_layer(i) for i in layers)
        routed = tokens / (dims.tp if dims.ep > 1 else 1)  # tensor parallel routes all T, beside EP its T/tp
        plan.device["router_margins"] = forwards * moe_layers * routed * model.moe.num_experts * FP32
    plan.device["temporaries"] = one_block / dims.tp
    return plan
