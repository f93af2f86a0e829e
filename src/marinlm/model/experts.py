"""Routed SwiGLU experts over tokens sorted by expert.

Shape legend: N tokens, k experts per token, S = N*k token-major slots (slot n*k + j is token n's
j-th choice), A kept assignments in expert order, E experts, D expert input width (d_model or the
latent width), F expert hidden width.

    order   = the slots sorted by expert, each expert's queue in token order (or by `priority`)
    keep    = per_expert: the first `capacity` assignments of each expert's queue;
              receiver_pooled: what `pooled_accept` grants each (sender shard, expert) queue
              (all, when dropless)
    y[a]    = SwiGLU_e(x[token(a)]) for the kept assignments a of expert e
    out[n]  = sum over n's kept slots of weight(slot) * y

Two ways to run the experts, side by side (`impl`):

- `loop`: one matmul per expert, the plain reading of the maths (a host sync for the counts);
- `grouped_mm`: `F.grouped_mm` over the sorted rows with per-expert offsets, one call for all
  experts; needs every row stride to be a multiple of 16 bytes.

Faster layouts of the same maths (padded batched GEMMs, fused dispatch and combine) live in
`marinlm.kernels.experts`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from marinlm.model.layers import bincount, compute_dtype, trunc_normal_

REFERENCE_IMPLS = ("auto", "grouped_mm", "loop")


def grouped_mm_aligned(dims: tuple[int, ...], dtype: torch.dtype) -> bool:
    """`grouped_mm` needs every row stride to be a multiple of 16 bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return all(d * itemsize % 16 == 0 for d in dims)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Receiver capacity per expert: ceil(factor * assignments / experts)."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))


class RowLayout:
    """Local row j is forward row j * stride + offset; `sum` adds the other processes' counts
    (marinlm.parallel sets both under data parallelism; one process holds every row)."""

    stride, offset = 1, 0

    def sum(self, counts: torch.Tensor) -> torch.Tensor:
        return counts


def pooled_chunk_rows(assignments, num_experts: int, groups: int, chunks: int, factor: float, shard_assignments: int):
    """Rows a chunk of a receiver keeps, its domain's `assignments` A given (see `pooled_accept`)."""
    El = num_experts // groups
    physical = max(El, math.ceil(factor * shard_assignments))
    capacity = torch.ceil(torch.as_tensor(assignments).double() * factor / groups).clamp(El, physical).long()
    return torch.maximum((capacity + chunks - 1) // chunks, torch.full_like(capacity, El // chunks))


def pooled_accept(counts_SE: torch.Tensor, groups: int, chunks: int, factor: float, shard_assignments: int):
    """Marin's receiver-pooled capacity (levanter's grug ragged all-to-all): how many of each
    (sender shard, expert) queue of `counts_SE` [S, E] are kept, [S, E]. Domains of `groups`
    consecutive shards; in each, receiver g holds experts g*El .. (g+1)*El - 1 (El = E / groups)
    and keeps clip(ceil(A * factor / groups), El, max(El, ceil(factor * shard_assignments))) rows,
    A the domain's assignments, in `chunks` equal parts of its experts of max(ceil(capacity /
    chunks), El / chunks) rows. A chunk accepts by local expert, then sender shard, until full.
    """
    S, E = counts_SE.shape
    Q, El = S // groups, E // groups
    c_QGE = counts_SE.view(Q, groups, E)
    chunk_Q = pooled_chunk_rows(c_QGE.sum((1, 2)), E, groups, chunks, factor, shard_assignments)
    total_QGHe = c_QGE.sum(1).view(Q, groups, chunks, El // chunks)  # receiver g, chunk h, expert in chunk
    before = torch.cumsum(total_QGHe, -1) - total_QGHe
    granted_QE = torch.minimum(total_QGHe, (chunk_Q.view(Q, 1, 1, 1) - before).clamp(min=0)).view(Q, 1, E)
    earlier_QGE = torch.cumsum(c_QGE, 1) - c_QGE  # the same expert's assignments from lower senders
    return torch.minimum(c_QGE, (granted_QE - earlier_QGE).clamp(min=0)).view(S, E)


def pooled_queues(experts_NK: torch.Tensor, shard_N: torch.Tensor, S: int, E: int):
    """Each slot's (sender shard, expert) queue id, shard * E + expert, and the queues' lengths [S * E]."""
    queue_S = shard_N.repeat_interleave(experts_NK.shape[1]) * E + experts_NK.reshape(-1)
    return queue_S, bincount(queue_S, S * E)


def pooled_keep(experts_NK: torch.Tensor, shard_N: torch.Tensor, accepted_SE: torch.Tensor, queues=None):
    """[N, k] True where an assignment is among the `accepted_SE` first of its (sender shard,
    expert) queue, queues in token order (`queues`: `pooled_queues`, when already built). Every row
    of a shard must be in `experts_NK`."""
    N, k = experts_NK.shape
    S, E = accepted_SE.shape
    queue_S, counts = queues or pooled_queues(experts_NK, shard_N, S, E)
    order_S = torch.argsort(queue_S, stable=True)
    rank_S = torch.empty_like(order_S)
    rank_S[order_S] = torch.arange(N * k, device=order_S.device) - (torch.cumsum(counts, 0) - counts)[queue_S[order_S]]
    return (rank_S < accepted_SE.reshape(-1)[queue_S]).view(N, k)


def sort_assignments(experts_NK: torch.Tensor, num_experts: int, capacity: int | None, priority_N=None, keep_NK=None):
    """The assignments in expert order, each expert's queue cut at `capacity` (or to `keep_NK`).

    Returns:
        slot_A: the token-major slot of each kept assignment, sorted by expert.
        counts_E: kept assignments per expert.
        dropped: how many assignments fell past capacity (a scalar tensor).
    """
    N, k = experts_NK.shape
    flat_S = experts_NK.reshape(-1)
    queue_S = torch.arange(N, device=flat_S.device) if priority_N is None else priority_N
    slot_A = torch.argsort(flat_S * N + queue_S.repeat_interleave(k))
    kept_S = None if keep_NK is None else keep_NK.reshape(-1)
    counts_E = bincount(flat_S if kept_S is None else flat_S[kept_S], num_experts)
    dropped = torch.zeros((), device=flat_S.device)
    if kept_S is not None:
        keep_A = kept_S[slot_A]
        dropped = (~keep_A).sum().float()
        slot_A = slot_A[keep_A]
    elif capacity is not None:
        expert_A = flat_S[slot_A]
        rank_A = torch.arange(slot_A.numel(), device=flat_S.device) - (torch.cumsum(counts_E, 0) - counts_E)[expert_A]
        keep_A = rank_A < capacity
        dropped = (~keep_A).sum().float()
        slot_A, counts_E = slot_A[keep_A], counts_E.clamp(max=capacity)
    return slot_A, counts_E, dropped


class RoutedExperts(nn.Module):
    """E SwiGLU experts stored as stacked [E, in, out] matrices (one matrix per expert for Muon)."""

    is_transposed = True  # says [E, in, out] to peft's `target_parameters` LoRA, which assumes [E, out, in]
    rows = RowLayout()

    def __init__(self, num_experts: int, dim: int, hidden: int, init_std: float, impl: str = "auto"):
        super().__init__()
        self.num_experts, self.init_std, self.impl = num_experts, init_std, impl
        self.gate_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def reset_parameters(self) -> None:
        for w in (self.gate_proj, self.up_proj, self.down_proj):
            trunc_normal_(w, self.init_std)

    def resolve_impl(self, dtype: torch.dtype) -> str:
        dims = tuple(self.down_proj.shape[1:])
        if self.impl not in REFERENCE_IMPLS:
            raise ValueError(
                f"kernels.experts {self.impl!r} is a kernel (marinlm.kernels); the reference model runs "
                f"{', '.join(REFERENCE_IMPLS)}; set kernels.modules: auto to use it"
            )
        if self.impl == "grouped_mm" and not grouped_mm_aligned(dims, dtype):
            raise ValueError(
                f"kernels.experts grouped_mm needs widths {dims} to be multiples of 16 bytes in {dtype}; "
                "use auto or loop"
            )
        if self.impl == "auto":  # grouped_mm has no float64 kernel, and compiles for bf16 only
            compiles = dtype == torch.bfloat16 or not torch.compiler.is_compiling()
            return "grouped_mm" if grouped_mm_aligned(dims, dtype) and dtype != torch.float64 and compiles else "loop"
        return self.impl

    def run_experts(self, x_AD: torch.Tensor, counts_E: torch.Tensor, impl: str) -> torch.Tensor:
        """SwiGLU of each expert over its contiguous block of sorted rows."""
        w_gate, w_up, w_down = (w.to(x_AD.dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
        if impl == "grouped_mm":
            offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)
            h_AF = F.silu(F.grouped_mm(x_AD, w_gate, offs=offsets_E)) * F.grouped_mm(x_AD, w_up, offs=offsets_E)
            return F.grouped_mm(h_AF, w_down, offs=offsets_E)
        pieces = []
        for e, x_eD in enumerate(x_AD.split(counts_E.tolist())):
            pieces.append((F.silu(x_eD @ w_gate[e]) * (x_eD @ w_up[e])) @ w_down[e])
        return torch.cat(pieces)

    def keep_pooled(self, experts_NK: torch.Tensor, rows: int, factor: float, groups: int, domains: int, chunks: int):
        """[N, k] True for the assignments `pooled_accept` keeps: this process's `rows` rows are
        forward rows j * stride + offset (`self.rows`); forward row i goes to sender shard
        i mod (domains x groups), so a shard's rows are never split between processes."""
        N, k = experts_NK.shape
        S, E, T = groups * domains, self.num_experts, N // rows
        forward_rows = rows * self.rows.stride
        shard_N = (torch.arange(rows, device=experts_NK.device) * self.rows.stride + self.rows.offset) % S
        shard_N = shard_N.repeat_interleave(T)
        queues = pooled_queues(experts_NK, shard_N, S, E)
        counts_SE = self.rows.sum(queues[1]).view(S, E)  # the whole forward's queues
        accepted_SE = pooled_accept(counts_SE, groups, chunks, factor, -(-forward_rows // S) * T * k)
        return pooled_keep(experts_NK, shard_N, accepted_SE, queues)

    def forward(
        self,
        x_ND: torch.Tensor,
        experts_NK: torch.Tensor,
        weights_NK: torch.Tensor,
        capacity: int | None = None,
        priority_N: torch.Tensor | None = None,
        keep_NK: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the experts.

        Args:
            capacity: slots per expert; assignments past it are dropped. None = dropless.
            priority_N: distinct per-token ranks ordering each expert's queue (lower = kept
                first); None = token order.
            keep_NK: the assignments to keep (another rule's choice, `pooled_keep`), instead of
                `capacity`.

        Returns:
            The weighted expert output [N, D] and the number of dropped assignments.
        """
        N, k = experts_NK.shape
        device = x_ND.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_ND.dtype
        slot_A, counts_E, dropped = sort_assignments(experts_NK, self.num_experts, capacity, priority_N, keep_NK)
        y_AD = self.run_experts(x_ND.to(dtype)[slot_A // k], counts_E, self.resolve_impl(dtype))
        y_AD = y_AD * weights_NK.reshape(-1)[slot_A].unsqueeze(-1).to(y_AD.dtype)
        # Each slot holds at most one row, so the combine is a plain sum over each token's k slots.
        y_SD = y_AD.new_zeros(N * k, y_AD.shape[-1]).index_copy(0, slot_A, y_AD)
        return y_SD.view(N, k, y_SD.shape[-1]).sum(1, dtype=compute_dtype(y_SD)).to(dtype), dropped
