"""Expert parallelism over the `ep` mesh axis: each rank holds E/ep experts and tokens travel to them.

Shape legend: N tokens on this rank, k experts per token, A = N*k assignments, E experts, El = E/ep
local experts, P = ep ranks, R rows received, D expert input width (the latent width), F hidden.

    route locally ─ sort assignments by expert ─ exchange per-expert counts (all_to_all)
      ─ rows to the ranks owning their experts (all_to_all_single, uneven splits, differentiable)
      ─ receiver capacity ─ local experts, by the module's `run_experts` (the kernel's padded
        chunks or grouped GEMM, or the reference's)
      ─ rows back the same way ─ weighted combine

Latent MoE sends latent-width rows (3,072 for the hero, half the model width).

Capacity (training only), by `moe.capacity`:

- `receiver_pooled` (Marin's hero): every rank decides its own drops before sending, from the
  (sender shard, expert) counts of the whole forward, summed over the data ranks
  (`DataParallelRows`, set on every layout with more than one data rank, EP or not); only kept
  rows travel, and one process and every layout drop the same assignments (model/experts.py).
- `per_expert` (GShard's): each local expert keeps ceil(factor · G / E) assignments at the
  receiver, G the assignments its expert group sent this forward; its queue is ordered by source
  rank, then by the source's own priority (position in the sequence, then row), so capacity never
  breaks causality. One process applies the rule to its own tokens alone, so these runs differ from
  one process's unless nothing is dropped (`receiver_keep` spells the EP rule in one process).

Expert weights are DTensors sharded on the expert dim over `ep`; FSDP2 shards them further over
the remaining data ranks of the expert mesh (`efsdp`) and averages their gradients over those. An
expert's gradient sums the contributions of every rank of its group, so it is scaled by 1/ep, and
the experts' gradients come out as the dense weights' do, averaged over all data ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from marinlm.model.experts import RoutedExperts, RowLayout, sort_assignments
from marinlm.model.layers import compute_dtype
from marinlm.parallel.tensor_parallel import _compute_on_local_shards, _waited


@dataclass
class Dispatch:
    """Where one forward's assignments went, to bring their results back."""

    slot_A: torch.Tensor  # this rank's assignments sorted by expert (token-major slot ids)
    send_P: list[int]  # rows sent to each rank
    recv_P: list[int]  # rows received from each rank
    order_K: torch.Tensor  # received rows kept, grouped by local expert (indices into the R received)
    counts_El: torch.Tensor  # kept rows per local expert
    num_received: int
    dropped: torch.Tensor  # assignments dropped here by capacity (scalar)


def group_capacity(factor: float, group_assignments: int, num_experts: int) -> int:
    """Assignments one expert keeps: the factor times its fair share of its group's."""
    return max(1, math.ceil(factor * group_assignments / num_experts))


def dispatch(
    x_ND: torch.Tensor, experts_NK: torch.Tensor, num_experts: int, group, priority_N=None, factor=None, keep_NK=None
) -> tuple[torch.Tensor, Dispatch]:
    """Send each assignment's row to the rank that owns its expert (experts in contiguous blocks of
    E/P). Returns the kept received rows grouped by local expert, and the `Dispatch` to `combine`.
    `factor`: the per-expert receiver capacity; `keep_NK`: the assignments a pooled rule kept,
    decided before sending (only those travel)."""
    P = dist.get_world_size(group)
    N, k = experts_NK.shape
    local_experts = num_experts // P
    slot_A, counts_E, sender_dropped = sort_assignments(experts_NK, num_experts, None, priority_N, keep_NK)
    # Per destination: the per-expert counts of its experts, and this rank's assignment total.
    header_PX = torch.cat([counts_E.view(P, local_experts), torch.full((P, 1), N * k, device=counts_E.device)], 1)
    received_PX = _waited(funcol.all_to_all_single(header_PX.reshape(-1).contiguous(), None, None, group)).view(P, -1)
    sent_Pe, totals_P = received_PX[:, :local_experts], received_PX[:, local_experts]  # [source, local expert]
    keep_Pe = sent_Pe
    if factor is not None:
        capacity = group_capacity(factor, int(totals_P.sum()), num_experts)
        before_Pe = torch.cumsum(sent_Pe, 0) - sent_Pe  # this expert's rows from lower source ranks
        keep_Pe = (capacity - before_Pe).clamp(min=0).minimum(sent_Pe)
    send_P = counts_E.view(P, local_experts).sum(1).tolist()  # host sync: the split sizes
    recv_P = sent_Pe.sum(1).tolist()
    rows_RD = _waited(funcol.all_to_all_single_autograd(x_ND[slot_A // k], recv_P, send_P, group))
    # Received rows come by source, then by expert; regroup the kept ones by expert, then source.
    R = rows_RD.shape[0]
    counts = sent_Pe.reshape(-1)
    expert_R = torch.arange(local_experts, device=counts.device).repeat(P).repeat_interleave(counts)
    chunk_start = torch.cumsum(counts, 0) - counts
    within_R = torch.arange(R, device=counts.device) - chunk_start.repeat_interleave(counts)
    kept_R = within_R < keep_Pe.reshape(-1).repeat_interleave(counts)
    order_K = torch.argsort(expert_R * R + torch.arange(R, device=counts.device))  # stable: by expert, source
    order_K = order_K[kept_R[order_K]]
    dropped = (sent_Pe - keep_Pe).sum().float() + sender_dropped
    plan = Dispatch(slot_A, send_P, recv_P, order_K, keep_Pe.sum(0), R, dropped)
    return rows_RD[order_K], plan


def combine(y_KD: torch.Tensor, plan: Dispatch, group) -> torch.Tensor:
    """The expert outputs back to the ranks that sent the rows, in this rank's `slot_A` order
    (dropped assignments come back as zero rows)."""
    y_RD = y_KD.new_zeros(plan.num_received, y_KD.shape[1]).index_copy(0, plan.order_K, y_KD)
    return _waited(funcol.all_to_all_single_autograd(y_RD, plan.send_P, plan.recv_P, group))


class ExpertParallelExperts(RoutedExperts):
    """`RoutedExperts` with its experts spread over the ranks of `ep_mesh` (set by
    `apply_expert_parallel`), each computing its own E/ep with the module's `run_experts`: on the
    fused kernel, the same padded chunks or grouped GEMM as one process."""

    ep_mesh = None
    capacity_factor: float | None = None

    def forward(self, x_ND, experts_NK, weights_NK, capacity=None, priority_N=None, keep_NK=None):
        N, k = experts_NK.shape
        device = x_ND.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_ND.dtype
        group = self.ep_mesh.get_group()
        factor = self.capacity_factor if capacity is not None else None  # capacity: training only
        x_KD, plan = dispatch(x_ND.to(dtype), experts_NK, self.num_experts, group, priority_N, factor, keep_NK)
        y_KD = self.run_experts(x_KD, plan.counts_El, self.resolve_impl(dtype))
        y_AD = combine(y_KD, plan, group)
        if self.training:  # the steps' traffic: validation and evaluation between them are not steps
            y_AD = self._count_traffic(y_AD, plan, x_KD.shape[1] * x_KD.element_size(), group)
        y_AD = y_AD * weights_NK.reshape(-1)[plan.slot_A].unsqueeze(-1).to(y_AD.dtype)
        y_SD = y_AD.new_zeros(N * k, y_AD.shape[-1]).index_copy(0, plan.slot_A, y_AD)
        return y_SD.view(N, k, y_SD.shape[-1]).sum(1, dtype=compute_dtype(y_SD)).to(dtype), plan.dropped

    def _count_traffic(self, y_AD: torch.Tensor, plan: Dispatch, row_bytes: int, group) -> torch.Tensor:
        """Add this forward's all-to-alls to `self.traffic`: the counts' exchange, dispatch and
        combine now (a checkpointed block's recomputed forward counts again), and the two
        exchanges of their gradients when the backward passes through `y_AD` (returned)."""
        P, me = dist.get_world_size(group), self.ep_mesh.get_local_rank()
        sent_away = sum(plan.send_P) - plan.send_P[me]
        # Rows leaving this rank for others, both ways: dispatch sends its rows, combine the results.
        remote = (sent_away + plan.num_received - plan.recv_P[me]) * row_bytes
        header = (P - 1) * (self.num_experts // P + 1) * 8  # int64 counts, to each other rank
        count = [sum(plan.send_P), plan.num_received, sent_away, remote + header, 3, plan.order_K.numel()]
        self.traffic += torch.tensor(count, dtype=torch.float64)
        if not y_AD.requires_grad:
            return y_AD
        return _CountBackward.apply(y_AD, self.traffic, torch.tensor([0, 0, 0, remote, 2, 0], dtype=torch.float64))


class _CountBackward(torch.autograd.Function):
    """Identity; its backward adds `count` to `traffic` (the gradients' all-to-alls)."""

    @staticmethod
    def forward(ctx, x, traffic, count):
        ctx.traffic, ctx.count = traffic, count
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.traffic += ctx.count
        return grad, None, None


_EP_CLASSES: dict[type, type] = {}


def expert_parallel_class(cls: type) -> type:
    """`ExpertParallelExperts` for plain `RoutedExperts`; for a subclass that computes its experts
    its own way (fine-tuning's grouped LoRA), one that dispatches as `ExpertParallelExperts` and
    runs the experts as `cls` does."""
    if cls is RoutedExperts:
        return ExpertParallelExperts
    if issubclass(cls, ExpertParallelExperts):
        return cls
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type(f"ExpertParallel{cls.__name__}", (ExpertParallelExperts, cls), {})
    return _EP_CLASSES[cls]


def apply_expert_parallel(model: nn.Module, ep_mesh, tensor_parallel: int = 1) -> None:
    """Spread every MoE layer's routed experts over the 1-D `ep_mesh`, in place (on meta or
    initialised). `tensor_parallel`: the tp degree, whose ranks each route their own tokens."""
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            for name, p in list(module.named_parameters(recurse=False)):
                dt = distribute_tensor(p.detach(), ep_mesh, [Shard(0)], src_data_rank=None if p.is_meta else 0)
                module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
            module.__class__ = expert_parallel_class(type(module))
            module.ep_mesh = ep_mesh
            module.capacity_factor = model.config.moe.capacity_factor
            # Rows sent, received and sent to other ranks, bytes to other ranks, all-to-all calls,
            # rows kept for the local experts (`_count_traffic`).
            module.traffic = torch.zeros(6, dtype=torch.float64)
            # An expert's gradient sums its whole group's tokens, where a dense weight's holds one
            # data rank's (summed over its tp ranks), and FSDP2 then averages each over its own data
            # ranks: tp/ep puts them level.
            _compute_on_local_shards(module, grad_scale=tensor_parallel / ep_mesh.size())


class DataParallelRows(RowLayout):
    """The rows of one forward dealt over the data-parallel ranks, as the loaders deal them: rank r
    holds forward rows r, r + W, r + 2W, ... Pooled capacity counts sum over `group`."""

    def __init__(self, group, rank: int, world: int):
        self.group, self.offset, self.stride = group, rank, world

    def sum(self, counts: torch.Tensor) -> torch.Tensor:
        return _waited(funcol.all_reduce(counts, "sum", self.group or dist.group.WORLD))


def apply_data_parallel_rows(model: nn.Module, group, rank: int, world: int) -> None:
    """Tell every routed-experts module where this rank's rows sit among a forward's (in place)."""
    rows = DataParallelRows(group, rank, world)
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.rows = rows


def expert_traffic(model: nn.Module, group=None) -> dict[str, float]:
    """MoE traffic of the training steps since the last call, reduced over `group`: the bytes all
    ranks sent to other ranks in all-to-alls (dispatch, combine and the expert counts, forward,
    recomputed forward and backward), this rank's all-to-all calls, the share of assignments sent
    to another rank, and the load imbalance: each MoE layer's busiest rank's kept rows (those its
    experts compute) over the mean rank's, averaged over the layers (`marinlm plan --routing`'s
    slowest receiver). Empty without expert parallelism."""
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    if not layers or not dist.is_initialized():
        return {}
    per_layer = torch.stack([m.traffic for m in layers])
    for m in layers:
        m.traffic.zero_()
    mine = per_layer.sum(0)
    total = mine.clone()
    dist.all_reduce(total, group=group)
    kept, busiest = per_layer[:, 5].clone(), per_layer[:, 5].clone()
    dist.all_reduce(kept, group=group)
    dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=group)
    world = dist.get_world_size(group)
    return {
        "ep/a2a_bytes": float(total[3]),
        "ep/a2a_calls": float(mine[4]),
        # Of the assignments sent, the share whose expert sits on another rank: the routing's part
        # in the bytes (marinlm plan's `remote_share`).
        "ep/remote_share": float(total[2] / total[0].clamp_min(1)),
        "ep/kept_rows_max_over_mean": float((busiest * world / kept.clamp_min(1)).mean()),
    }


def receiver_keep(experts_per_source: list[torch.Tensor], priority_per_source, num_experts: int, factor: float):
    """The receiver-capacity rule in one process, for tests: which assignments each source keeps.

    Args:
        experts_per_source: per source rank, its [N, k] expert ids.
        priority_per_source: per source, its [N] priorities (lower first), or None for token order.

    Returns per source a boolean [N, k]: True where the assignment is kept.
    """
    total = sum(e.numel() for e in experts_per_source)
    capacity = group_capacity(factor, total, num_experts)
    taken = [0] * num_experts
    kept = []
    for experts_NK, priority_N in zip(experts_per_source, priority_per_source):
        N, k = experts_NK.shape
        order = torch.arange(N) if priority_N is None else torch.argsort(priority_N)
        keep = torch.zeros(N, k, dtype=torch.bool)
        for e in range(num_experts):  # each expert's queue: this source's tokens in priority order
            for n in order.tolist():
                for j in range(k):
                    if int(experts_NK[n, j]) == e and taken[e] < capacity:
                        keep[n, j] = True
                        taken[e] += 1
        kept.append(keep)
    return kept
