"""Pipeline parallelism over the `pp` mesh axis, with `torch.distributed.pipelining` schedules.

The model is cut by layers into stages. Each stage is a copy of the model holding only its own
layers (kept under their original names, `layers.7...`, so checkpoints move between layouts), the
first stage the embedding and its norm, the last the final norm, the LM head and the loss. What
flows between stages is the hidden state and the segment ids: every stage rebuilds the
per-forward context (document ids, positions, masks, RoPE, SConv masks) from them.

Schedules (`parallel.pipeline_schedule`): `1F1B` and `GPipe` place one stage a rank; the looped
`Interleaved1F1B` and `LoopedBFS` place `stages_per_rank` stages on each rank, stage s on rank
s mod pp; the V schedules `ZBVZeroBubble` and `DualPipeV` place exactly two, rank r holding
stages r and 2·pp − 1 − r.

Stages are balanced by estimated FLOPs (`split_layers`): each block's forward FLOPs from the model
summary, and the LM head and loss (2·D·V a token, as heavy as several small blocks) on the last
stage; `parallel.layers_per_stage` fixes the split instead.

Gradient accumulation is the schedule's microbatch loop: each microbatch's loss is weighted by its
share of the global batch's loss tokens (as without pipelining), and the schedule does not rescale.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from marinlm.config import ConfigError
from marinlm.model.moe import MoE
from marinlm.model.transformer import MarinForCausalLM

ONE_STAGE_A_RANK = ("1F1B", "GPipe")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = ONE_STAGE_A_RANK + LOOPED + V_SHAPED
HIDDEN_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # sent between stages as an index
ZERO_BUBBLE = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")  # weight gradients in a pass of their own


def schedule_class(name: str):
    from torch.distributed.pipelining import schedules

    return {
        "1F1B": schedules.Schedule1F1B,
        "GPipe": schedules.ScheduleGPipe,
        "Interleaved1F1B": schedules.ScheduleInterleaved1F1B,
        "LoopedBFS": schedules.ScheduleLoopedBFS,
        "InterleavedZeroBubble": schedules.ScheduleInterleavedZeroBubble,
        "ZBVZeroBubble": schedules.ScheduleZBVZeroBubble,
        "DualPipeV": schedules.ScheduleDualPipeV,
    }[name]


def stages_per_rank(schedule: str, asked: int) -> int:
    """Stages each rank holds: 1, 2 for V schedules, `asked` (at least 2) for looped ones."""
    if schedule in ONE_STAGE_A_RANK:
        return 1
    if schedule in V_SHAPED:
        return 2
    return asked


def stage_ids(rank: int, pp: int, schedule: str, per_rank: int) -> list[int]:
    """The stages `rank` (its place on the pp axis) holds, in the order the schedule expects."""
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(per_rank)]


def check_pipeline(schedule: str, pp: int, per_rank: int, microbatches: int, num_layers: int) -> None:
    """Raise ConfigError, naming the key, for a split or schedule the pipeline cannot run."""
    if schedule not in SCHEDULES:
        raise ConfigError("parallel.pipeline_schedule", f"{schedule!r} is not one of {', '.join(SCHEDULES)}")
    if schedule in LOOPED and per_rank < 2:
        raise ConfigError("parallel.stages_per_rank", f"{schedule} needs at least 2 stages a rank, got {per_rank}")
    stages = pp * per_rank
    if stages > num_layers:
        raise ConfigError(
            "parallel.pipeline_parallel",
            f"{stages} stages ({pp} ranks x {per_rank} a rank for {schedule}) but model.num_layers = {num_layers}",
        )
    if microbatches < pp:
        raise ConfigError(
            "parallel.microbatches",
            f"{schedule} on {pp} ranks needs at least {pp} microbatches a step to fill the pipeline, "
            f"got {microbatches}",
        )
    if schedule in LOOPED and microbatches % pp:
        raise ConfigError(
            "parallel.microbatches",
            f"{schedule} needs a multiple of pipeline_parallel = {pp} microbatches, got {microbatches}",
        )


def layer_costs(config, seq_len: int) -> tuple[list[float], float]:
    """Training FLOPs a token of each block, and of the LM head (the model summary's counting)."""
    from marinlm.model.summary import layer_flops

    return layer_flops(config, seq_len), 6.0 * config.d_model * config.vocab_size


def split_layers(costs: list[float], head: float, num_stages: int) -> list[range]:
    """Contiguous layer ranges, one a stage, minimising the most expensive stage (the last also
    carries `head`). Every stage gets at least one layer."""
    L = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[s][i]: the lowest max-cost of splitting layers [0, i) into s stages; cut[s][i]: where the last begins.
    best = [[math.inf] * (L + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (L + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, L + 1):
            extra = head if (s == num_stages and i == L) else 0.0
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    ranges, end = [], L
    for s in range(num_stages, 0, -1):
        start = cut[s][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


def bubble_fraction(schedule: str, pp: int, microbatches: int, per_rank: int) -> float:
    """The analytic idle fraction of a step: (pp − 1) / (m·v + pp − 1) for 1F1B-like schedules with
    v stages a rank (GPipe and 1F1B: v = 1); the zero-bubble V schedules fill most of it, which this
    formula does not credit (the measured step time does)."""
    v = per_rank if schedule not in ONE_STAGE_A_RANK else 1
    return (pp - 1) / (microbatches * v + pp - 1)


class StageModel(MarinForCausalLM):
    """One pipeline stage of a `MarinForCausalLM`: the class of a stage copy, swapped in as the kernels
    are. `forward(x, segment_ids)` takes token ids (first stage) or hidden states, runs the layers it
    holds, and returns the hidden states and segment ids for the next stage; the last stage returns
    the final-normed hidden states, which `loss` turns into the loss outside the forward."""

    def forward(self, x, segment_ids):
        if self.embed is not None:
            ids = x
            x = self.embed(ids)
            if self.embed_norm is not None:
                x = self.embed_norm(x)
        else:
            ids = segment_ids  # only its shape and device are read
        ctx = self.context(ids, segment_ids, None, None, None)
        for index, layer in self.layers.items():
            x, routing = layer(x, ctx)
            if routing is not None:  # read by PipelinedModel after the schedule's step
                self.routing_log.append((int(index), routing.stats.detach()))
        if self.final_norm is not None:
            return self.final_norm(x)
        return x, segment_ids


def build_stage(model: MarinForCausalLM, layers: range, first: bool, last: bool) -> StageModel:
    """A copy of `model` (on meta or initialised) keeping only what the stage runs."""
    stage = copy.deepcopy(model)
    stage.layers = nn.ModuleDict({str(i): stage.layers[i] for i in layers})
    if not first:
        stage.embed = stage.embed_norm = None
    if not last:
        stage.final_norm = stage.lm_head = stage.loss = None
    stage.__class__ = StageModel
    stage.routing_log = []
    return stage


@dataclass
class PipelineLayout:
    schedule: str
    pp: int
    per_rank: int
    microbatches: int
    stages: list[range]  # the layers of every stage, in stage order


class PipelinedModel(nn.Module):
    """This rank's stages, seen as one model: its parameters, state-dict names and MoE layers are
    the stages', under the names they have in the whole model (`embed`, `layers.7`, `lm_head`), so
    the optimizer, checkpoints and router updates work on it as on the unsplit model."""

    def __init__(self, config, stages: list[StageModel], stage_modules: list, schedule, layout, pp_group):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleDict({k: v for s in stages for k, v in s.layers.items()})
        for name in ("embed", "embed_norm", "final_norm", "lm_head"):
            found = [getattr(s, name) for s in stages if getattr(s, name) is not None]
            setattr(self, name, found[0] if found else None)
        self.stages = stages  # plain list: the modules are registered above under their own names
        self.pipeline_stages, self.schedule, self.layout, self.pp_group = stage_modules, schedule, layout, pp_group
        self.has_last = any(s.lm_head is not None for s in stages)
        self.has_first = any(s.embed is not None for s in stages)
        self._records: list = []

    def update_router_biases(self, stats) -> None:
        routers = [m.router for m in self.modules() if isinstance(m, MoE)]
        if len(stats) != len(routers):
            raise ValueError(f"expected router stats for {len(routers)} MoE layers, got {len(stats)}")
        with torch.no_grad():
            for router, layer_stats in zip(routers, stats):
                router.update_bias(layer_stats)

    # --- training and evaluation through the schedule ----------------------------------------------

    def _last_loss(self, h_BTD, labels_BT):
        """The schedule's loss function, on the last stage: each microbatch's lm loss weighted by its
        share of the global batch's loss tokens, times the data-parallel ranks (FSDP2 averages)."""
        B, T, D = h_BTD.shape
        last = next(s for s in self.stages if s.lm_head is not None)
        labels_BT, ranks = self._my_labels(labels_BT), self._world
        if self.cp_mesh is not None:  # FSDP2 averages over the cp ranks too, each holding part of the rows
            ranks *= self.cp_mesh.size()
        lm_loss, ce, z, count, _ = last.loss(h_BTD.reshape(B * T, D), last.lm_head.weight, labels_BT.reshape(-1))
        self._records.append((ce.detach().double() * count, z.detach().double() * count))
        return lm_loss * (int(count) / max(self._global_tokens, 1) * ranks)  # a Python float: exact share

    def _my_labels(self, labels_BL):
        """The labels of this rank's chunks under context parallel; all of them otherwise."""
        if self.cp_mesh is None:
            return labels_BL
        from marinlm.parallel.context_parallel import ChunkLayout

        held = ChunkLayout(labels_BL.shape[1], self.cp_mesh.size()).held(self.cp_mesh.get_local_rank())
        return labels_BL[:, held.to(labels_BL.device)]

    def _run(self, ids, segment_ids, labels, train: bool) -> None:
        args = (ids, segment_ids) if self.has_first else ()
        target = labels if self.has_last else None
        if train:
            self.schedule.step(*args, target=target)
        else:
            self.schedule.eval(*args, target=target)

    def forward_backward(self, batches, *, device, precision, global_tokens: int, world_size: int):
        """`train.step.forward_backward` through the schedule: the micro-batches are its microbatches."""
        from marinlm.model.router import RouterStats
        from marinlm.utils.device import autocast_context

        self._global_tokens, self._world, self._records = global_tokens, world_size, []
        cat = {key: torch.cat([b[key] for b in batches]).to(device) for key in ("input_ids", "segment_ids", "labels")}
        for stage in self.stages:
            stage.routing_log.clear()
        with autocast_context(device, precision, cache=False):  # FSDP2 units (autocast_caches_weights)
            self._run(cat["input_ids"], cat["segment_ids"], cat["labels"], train=True)
        by_layer: dict[int, list] = {}
        for stage in self.stages:
            for index, layer_stats in stage.routing_log:
                by_layer.setdefault(index, []).append(layer_stats)
        # Each layer over the step's microbatches (the last ones: see the records below).
        stats = [RouterStats.merge(by_layer[i][-self.layout.microbatches :]) for i in sorted(by_layer)]
        self.router_layers = sorted(by_layer)  # the model's layer numbers of `stats`, for their names
        sums = torch.zeros(3, dtype=torch.float64)
        # The schedule's first step after a change of mode infers the stages' shapes with a forward
        # of its own, which also reaches the loss: the step's microbatches are the last records.
        for ce, z in self._records[len(self._records) - self.layout.microbatches :] if self.has_last else ():
            sums[0] += ce
            sums[1] += z
        torch.distributed.all_reduce(sums, group=self.pp_group)  # the last stage's sums, on every stage
        if self.cp_mesh is not None:  # over the rows' chunks
            torch.distributed.all_reduce(sums, group=self.cp_mesh.get_group())
        return sums, stats

    @torch.no_grad()
    def forward(self, input_ids, segment_ids=None, labels=None, **kwargs):
        """Evaluation (validation): the per-token cross-entropy and the counted tokens of the whole
        batch, on every stage. It walks the stages in order, sending the hidden states and segment
        ids from rank to rank, without the schedule (torch 2.13's zero-bubble schedules cannot
        evaluate)."""
        from marinlm.model.loss import IGNORE_INDEX
        from marinlm.model.transformer import CausalLMOutput

        if labels is None:
            raise ValueError("a pipelined model evaluates losses only: pass labels")
        B, T = input_ids.shape
        if segment_ids is None:
            segment_ids = torch.zeros_like(input_ids)
        mine = {stage_index: stage for stage_index, stage in zip(self.stage_indices, self.stages)}
        owner = self.stage_owner
        me = torch.distributed.get_rank(self.pp_group)
        num_stages = len(owner)
        x, seg, ce_BT = input_ids, segment_ids, torch.zeros(B, T, dtype=torch.float64, device=input_ids.device)
        self._reshard()  # a schedule may leave gathered weights from before the last optimizer step
        for s in range(num_stages):
            if s > 0 and owner[s] == me and owner[s - 1] != me:  # receive what stage s - 1 sent
                dtype = torch.empty(1, dtype=torch.int64, device=input_ids.device)
                torch.distributed.recv(dtype, group=self.pp_group, group_src=owner[s - 1])
                shape = (B, T // self.sequence_split, self.config.d_model)
                x = torch.empty(shape, dtype=HIDDEN_DTYPES[int(dtype)], device=input_ids.device)
                seg = torch.empty_like(segment_ids)
                torch.distributed.recv(x, group=self.pp_group, group_src=owner[s - 1])
                torch.distributed.recv(seg, group=self.pp_group, group_src=owner[s - 1])
            if owner[s] != me:
                continue
            out = mine[s](x, seg)
            if s == num_stages - 1:
                stage = mine[s]
                mine_BT = self._my_labels(labels)
                _, _, _, _, token_ce = stage.loss(
                    out.reshape(mine_BT.numel(), -1), stage.lm_head.weight, mine_BT.reshape(-1)
                )
                ce_BT = token_ce.view(mine_BT.shape).double()
                if self.cp_mesh is not None:
                    from marinlm.parallel.context_parallel import ChunkLayout, rows_in_order

                    ce_BT = rows_in_order(ce_BT, ChunkLayout(T, self.cp_mesh.size()), self.cp_mesh.get_group())
                break
            x, seg = out
            if owner[s + 1] != me:
                # The dtype first: the residual stream keeps the weights' dtype under autocast, which
                # the receiver cannot tell from its own autocast state.
                dtype = torch.tensor([HIDDEN_DTYPES.index(x.dtype)], device=x.device)
                torch.distributed.send(dtype, group=self.pp_group, group_dst=owner[s + 1])
                torch.distributed.send(x.contiguous(), group=self.pp_group, group_dst=owner[s + 1])
                torch.distributed.send(seg.contiguous(), group=self.pp_group, group_dst=owner[s + 1])
        self._reshard()
        torch.distributed.all_reduce(ce_BT, group=self.pp_group)  # the last stage's; the others add zeros
        count = int((labels != IGNORE_INDEX).sum())
        mean = ce_BT.sum() / max(count, 1)
        return CausalLMOutput(logits=None, loss=mean, lm_loss=mean, ce_loss=mean, num_tokens=count, token_ce=ce_BT)

    def _reshard(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for stage in self.stages:
            for module in stage.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def _moe(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def init_weights(self, seed: int | None = None) -> None:
        """Each stage's `init_weights` (a stage draws its own values: only `train.init: full`
        reproduces the unsplit model's initialisation)."""
        for stage in self.stages:
            stage.init_weights(seed)


def build_pipeline(model: MarinForCausalLM, config, dims, device, *, rows: int, seq_len: int, parallelize_stage):
    """Cut `model` into this rank's stages, apply `parallelize_stage` (the other techniques) to each,
    and wrap them with the schedule. `dims`: the layout (a built `ParallelDims`); `device`: where
    the stages run; `rows`: rows of a step on this data-parallel rank.

    Returns the `PipelinedModel` the trainer trains.
    """
    from torch.distributed.pipelining import PipelineStage

    mesh = dims.dense_mesh
    pp_mesh = mesh["pp"]
    pp, rank = pp_mesh.size(), pp_mesh.get_local_rank()
    layout = pipeline_layout(model.config, config, pp, rows, seq_len)
    ids = stage_ids(rank, pp, layout.schedule, layout.per_rank)
    last = pp * layout.per_rank - 1
    stages = [parallelize_stage(build_stage(model, layout.stages[s], s == 0, s == last)) for s in ids]
    group = pp_mesh.get_group()
    pipeline_stages = [PipelineStage(st, s, last + 1, device, group=group) for st, s in zip(stages, ids)]
    if dist.get_rank() == 0:
        bubble = bubble_fraction(layout.schedule, pp, layout.microbatches, layout.per_rank)
        print(
            f"pipeline: {layout.schedule}, {pp} ranks x {layout.per_rank} stage(s), layers a stage "
            f"{[len(r) for r in layout.stages]}, {layout.microbatches} microbatches a step, "
            f"analytic bubble {bubble:.1%}",
            flush=True,
        )
    holder = PipelinedModel(model.config, stages, pipeline_stages, None, layout, group)
    holder.stage_indices = ids
    # Under tensor and context parallel the stages pass T/(tp x cp) tokens of each row.
    holder.sequence_split = dims.tp * dims.cp
    holder.cp_mesh = mesh["cp"] if dims.cp_enabled else None
    holder.stage_owner = {s: r for r in range(pp) for s in stage_ids(r, pp, layout.schedule, layout.per_rank)}
    cls = schedule_class(layout.schedule)
    holder.schedule = cls(
        pipeline_stages[0] if layout.schedule in ONE_STAGE_A_RANK else pipeline_stages,
        n_microbatches=layout.microbatches,
        loss_fn=holder._last_loss,
        scale_grads=False,
    )
    return holder


def pipeline_layout(model_config, config, pp: int, rows: int, seq_len: int) -> PipelineLayout:
    """The checked schedule, stage split and microbatch count of `config` (a ParallelConfig)."""
    per_rank = stages_per_rank(config.pipeline_schedule, config.stages_per_rank)
    microbatches = config.microbatches or rows
    check_pipeline(config.pipeline_schedule, pp, per_rank, microbatches, model_config.num_layers)
    if rows % microbatches:
        raise ConfigError(
            "parallel.microbatches",
            f"{microbatches} does not divide the {rows} rows each data-parallel rank gets a step",
        )
    num_stages = pp * per_rank
    if config.layers_per_stage:
        counts = config.layers_per_stage
        if len(counts) != num_stages or sum(counts) != model_config.num_layers or min(counts) < 1:
            raise ConfigError(
                "parallel.layers_per_stage",
                f"{counts} must give each of the {num_stages} stages at least one layer, "
                f"{model_config.num_layers} in all",
            )
        starts = [sum(counts[:i]) for i in range(num_stages)]
        stages = [range(a, a + n) for a, n in zip(starts, counts)]
    else:
        stages = split_layers(*layer_costs(model_config, seq_len), num_stages)
    return PipelineLayout(config.pipeline_schedule, pp, per_rank, microbatches, stages)
