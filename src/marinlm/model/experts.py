"""Routed SwiGLU experts over tokens sorted by expert.

Shape legend: N tokens, k experts per token, S = N*k token-major slots, A = S assignments in
expert order, P rows of the experts' layout (S for `grouped_mm` and `loop`, plus padding for
`chunked` and `bmm`), E experts, D expert input width (d_model or the latent width), F expert
hidden width, C chunks, R rows per chunk.

Dispatch sorts the assignments by expert (stable, so token order within an expert), runs the
experts on the sorted rows with each row's hidden activations scaled by its combine weight,
and sums each token's k rows, found through the inverse permutation (one `embedding_bag`).
Every assignment owns one row, so neither direction needs an accumulating scatter (slow on
CPU, non-deterministic on GPU): each sum is over one token's own rows, and gradients are
bitwise reproducible.
Four interchangeable kernels compute the sorted rows:

- `grouped_mm`: `torch._grouped_mm` with offsets, registered as a custom op with our own
  backward (its own fails on CPU with "Invalid strides/sizes").
- `chunked`: each expert's rows padded to whole chunks of R rows (64 to 512), and one batched
  matmul over the chunks with each chunk's expert matrix gathered beside it; the weight gradient
  sums each expert's chunks in fp32. Padding costs less than one chunk per expert, whatever the
  loads. Where loads are near balance, one chunk per expert as wide as the largest load, in
  32-row steps, which gathers and sums nothing. `_chunk_plan` picks, per forward, the plan
  of fewest rows plus a measured cost per gathered chunk (CHUNK_COST_ROWS).
- `bmm`: the same layout with one chunk per expert, as wide as the capacity or the largest load;
  batched matmuls over the stacked matrices, paying for the padding of every smaller load.
- `loop`: one matmul per expert; the reference, and needs a host sync for the counts.

`auto` picks `chunked` on a CPU with bf16 GEMMs under bf16, `grouped_mm` elsewhere wherever the
widths meet its 16-byte stride rule, and `bmm` otherwise. Measured on the 2-core AVX512-BF16 EPYC
(bf16 GEMMs at ~410 GFLOP/s, fp32 at ~185), torch 2.13:

- A grouped product is one oneDNN matmul per expert. In bf16 oneDNN builds a kernel for every
  new row count, and the counts change every step: one grouped product of varying loads took
  11.5 ms in bf16 against 2.7 ms in fp32 (1.7 ms in bf16 with the same loads each time). And
  products this small ([128, 384] x [384, 96]) split over two threads run at ~190 GFLOP/s in
  bf16, ~120 in fp32. So `grouped_mm` on CPU stays fp32 under bf16 autocast, as torch's CPU
  autocast leaves `torch._grouped_mm` (and as HF's experts, which call it directly, get).
- A batched product over 64-row chunks keeps the shapes fixed and splits the batch over the
  threads: [82, 64, 384] x [82, 384, 96] runs at ~305 GFLOP/s in bf16 (~105 in fp32). In a
  bench/train_step.py step (qwen3-moe-style, 4 x 256 tokens, 28% padding rows at
  initialisation), bf16 autocast took 580-620 ms with `chunked` against 660 ms with fp32
  `grouped_mm`; in fp32 `chunked` was slower (835 against 785 ms), so `auto` keeps `grouped_mm`.
  With loads near balance (bench/experts.py, max/mean 1.2), forward and backward in bf16:
  8,192 x 4 assignments, 192 -> 192: `chunked` 126 ms, `bmm` 124, `grouped_mm` 211; 1,024 x 4,
  384 -> 96: 17.3, 17.8 and 31.6 ms. In fp32 there: 233, 200 and 218 ms; 34.4, 30.9 and 35.3.

A CPU without AVX512/AMX emulates bf16 matmuls (~1 GFLOP/s against ~170 fp32 on the 2-core dev
VM): there `auto` keeps fp32 `grouped_mm`, and the model's linear layers and attention go
through model/cpu_bf16.py. On CUDA, grouped GEMM is the production bf16 kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from marinlm.model.cpu_bf16 import emulated_bf16
from marinlm.model.layers import bincount, trunc_normal_


@torch.library.custom_op("marinlm::grouped_mm", mutates_args=())
def grouped_mm(x_AD: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """y = x @ w[e] for each expert's contiguous block of rows; blocks end at `offsets`."""
    return torch._grouped_mm(x_AD, w_EDF, offs=offsets_E)


@grouped_mm.register_fake
def _(x_AD, w_EDF, offsets_E):
    return x_AD.new_empty(x_AD.shape[0], w_EDF.shape[2])


@torch.library.custom_op("marinlm::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x_AD: torch.Tensor, dy_AF: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """dW_e = X_e^T dY_e: a grouped product whose groups run along the contraction dim."""
    return torch._grouped_mm(x_AD.t(), dy_AF, offs=offsets_E)


@grouped_mm_weight_grad.register_fake
def _(x_AD, dy_AF, offsets_E):
    return x_AD.new_empty(offsets_E.shape[0], x_AD.shape[1], dy_AF.shape[1])


def _grouped_mm_setup(ctx, inputs, output):
    x_AD, w_EDF, offsets_E = inputs
    ctx.save_for_backward(x_AD, w_EDF, offsets_E)


def _grouped_mm_backward(ctx, dy_AF):
    x_AD, w_EDF, offsets_E = ctx.saved_tensors
    dy_AF = dy_AF.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = grouped_mm(dy_AF, w_EDF.transpose(-2, -1), offsets_E)
    if ctx.needs_input_grad[1]:
        dw = grouped_mm_weight_grad(x_AD, dy_AF, offsets_E)
    return dx, dw, None


# torch._grouped_mm's own backward fails on CPU ("Invalid strides/sizes") and its fake-tensor
# rule demands bf16, so we register the op with our own autograd and shape rules; this also
# lets torch.compile trace through it.
grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _take(rows_RD: torch.Tensor, index_I: torch.Tensor, pad: bool) -> torch.Tensor:
    """rows_RD[index_I]; with `pad`, index R (one past the end) stands for a zero row."""
    if pad:
        rows_RD = torch.cat([rows_RD, rows_RD.new_zeros(1, rows_RD.shape[1])])
    return rows_RD.index_select(0, index_I)


def _sum_slots(
    rows_PD: torch.Tensor, row_S: torch.Tensor, k: int, dropped: bool, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """out_ND[n] = sum of rows_PD[row_S[n*k + j]] over j < k, added in fp32 and rounded once to
    `dtype` (default: the rows'); row P (a dropped assignment's) counts as zero.

    Without drops and in the rows' dtype this is one `embedding_bag` (sum mode): it reads each
    token's k rows and writes the sum, where gathering the [S, D] slots and then summing them
    writes and reads them again. On the 2-core EPYC, 1,024 x 4 rows of 384 in bf16: 0.06 against
    0.37 ms, with the same error against fp64 (it too adds in fp32 and rounds once); in fp32, with
    the cache flushed, 0.18-0.22 against 0.65-0.75 ms, with the same bits.
    """
    dtype = dtype or rows_PD.dtype
    if not dropped and dtype == rows_PD.dtype:
        return F.embedding_bag(row_S.view(-1, k), rows_PD, mode="sum")
    rows_SD = _take(rows_PD, row_S, pad=dropped)
    return rows_SD.view(-1, k, rows_SD.shape[1]).sum(1, dtype=torch.float32).to(dtype)


class _Dispatch(torch.autograd.Function):
    """x_PD = x_ND[token_P] in `dtype`: the token row of each row of the experts' layout.

    The layout holds the kept assignments sorted by expert, and zero rows: for the padded kernels
    (`chunked`, `bmm`), padding each expert to whole chunks; for `grouped_mm` and `loop`, one per
    dropped assignment, at the end, so that P = S whatever the routing. `token_P` is the token
    of each row (slot_P // k, with slot_P its token-major slot, S = N*k), or N for a padding row.
    `row_S` inverts slot_P: the layout row of each slot, or P where the assignment was dropped.
    The cast comes before the gather, so a bf16 kernel casts N rows, not P. The backward sums each
    token's k slot gradients in fp32 (`_sum_slots`) and rounds them once to the input's dtype:
    where the kernel ran in bf16 for fp32 inputs, the sums stay unrounded (an `embedding_bag`
    would round them to bf16; it bought nothing measurable in the bench's step).
    """

    @staticmethod
    def forward(ctx, x_ND, token_P, row_S, k, padded, dropped, dtype):
        ctx.save_for_backward(row_S)
        ctx.k, ctx.dropped, ctx.dtype = k, dropped, x_ND.dtype
        return _take(x_ND.to(dtype), token_P, pad=padded)

    @staticmethod
    def backward(ctx, dx_PD):
        (row_S,) = ctx.saved_tensors
        return _sum_slots(dx_PD, row_S, ctx.k, ctx.dropped, ctx.dtype), None, None, None, None, None, None


class _Combine(torch.autograd.Function):
    """y_ND = the sum of each token's k rows of y_PD (`_sum_slots`); a dropped assignment adds
    nothing. The backward is the dispatch's gather: each layout row gets its token's gradient."""

    @staticmethod
    def forward(ctx, y_PD, token_P, row_S, k, padded, dropped):
        ctx.save_for_backward(token_P)
        ctx.padded = padded
        return _sum_slots(y_PD, row_S, k, dropped)

    @staticmethod
    def backward(ctx, dy_ND):
        (token_P,) = ctx.saved_tensors
        return _take(dy_ND, token_P, pad=ctx.padded), None, None, None, None, None


class _ChunkWeights(torch.autograd.Function):
    """w_CIO = w_EIO[expert_C].to(dtype): each chunk's expert matrix, in the kernel's dtype;
    `expert_C` is sorted, so each expert's chunks are consecutive.

    The backward sums each expert's chunk gradients (bf16 GEMM outputs under bf16) with one
    `embedding_bag` over the chunks, a bag per expert: it adds in fp32 and rounds the sum once to
    the chunks' dtype, as one bf16 GEMM over all the expert's rows would (exact for an expert with
    one chunk, and in fp32). It reads each chunk once; casting every chunk to fp32 and adding it
    into a zeroed fp32 buffer (index_add_) took 10.7 ms of a bench/train_step.py bf16 step.
    Deterministic: each sum is over one expert's own chunks, in order.
    """

    @staticmethod
    def forward(ctx, w_EIO, expert_C, dtype):
        ctx.save_for_backward(expert_C)
        ctx.num_experts, ctx.dtype = w_EIO.shape[0], w_EIO.dtype
        return w_EIO.to(dtype).index_select(0, expert_C)

    @staticmethod
    def backward(ctx, dw_CIO):
        (expert_C,) = ctx.saved_tensors
        C, E = expert_C.shape[0], ctx.num_experts
        first_E = torch.searchsorted(expert_C, torch.arange(E, device=expert_C.device))  # an empty bag: 0
        chunks_C = torch.arange(C, device=expert_C.device)
        dw_EX = F.embedding_bag(chunks_C, dw_CIO.reshape(C, math.prod(dw_CIO.shape[1:])), first_E, mode="sum")
        return dw_EX.view(E, *dw_CIO.shape[1:]).to(ctx.dtype), None, None


# Rows per chunk the `chunked` kernel chooses from, and what one chunk with gathered matrices
# costs, in rows of expert compute: its three fp32 -> bf16 matrix copies in the forward pass, and
# in the backward its three gradients summed per expert. Fitted on the 2-core AVX512-BF16 EPYC in
# bf16 (2026-12-02, forward and backward, minima of 8-15 interleaved rounds; before that sum became
# one embedding_bag, which made chunks cheaper: a cost of 32 then gave 277.6 against 281.1 ms for
# the whole bench step, best of 16, and the same median, so 48 stays),
# where the cost per chunk came to 35-50 rows at both shapes below. At 1,024 x 4 assignments over
# 32 experts, 384 -> 96 (mean load 128), near balance (largest load 149): one chunk per expert
# (5,120 rows) 10.6 ms, 64-row chunks (79 chunks, 5,056 rows) 14.4, 128-row (47, 6,016) 12.8;
# largest load 297: 128-row chunks 12.6, 64-row 13.8, 256-row 14.8, one per expert (10,240
# rows) 16.1; largest 555: 13.9, 14.7, 16.5 and 26.6. At 8,192 x 4 over 32, 192 -> 192 (mean
# 1,024): near balance, one per expert 55.9 ms against 65.8 for 256-row chunks; largest 2,368:
# 256-row 63.0, 512-row 63.7, 128-row 69.3, one per expert 102.0; largest 4,407: 65.2, 66.0,
# 72.8 and 177.6. The plan of least estimated cost was the fastest, or within 2%, in each case.
CHUNK_ROWS = (64, 128, 256, 512)
CHUNK_COST_ROWS = 48


def compute_dtype(x: torch.Tensor, impl: str = "bmm") -> torch.dtype:
    """The dtype the expert matmuls run in: the autocast dtype when autocast is on and covers the
    kernel (see the module docstring), else the input's."""
    device = x.device.type
    if not torch.is_autocast_enabled(device) or (impl == "grouped_mm" and device == "cpu"):
        return x.dtype
    return torch.get_autocast_dtype(device)


def grouped_mm_aligned(dims: tuple[int, ...], dtype: torch.dtype) -> bool:
    """`torch._grouped_mm` needs every row stride to be a multiple of 16 bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return all(d * itemsize % 16 == 0 for d in dims)


def resolve_impl(impl: str, device: torch.device, dims: tuple[int, ...], dtype: torch.dtype) -> str:
    aligned = grouped_mm_aligned(dims, dtype)
    if impl == "grouped_mm" and not aligned:
        raise ValueError(
            f"expert impl grouped_mm needs widths {dims} to be multiples of 16 bytes in {dtype}; "
            "use impl auto, chunked, bmm or loop"
        )
    if impl != "auto":
        return impl
    if device.type == "cpu" and dtype == torch.bfloat16 and not emulated_bf16(device):
        return "chunked"
    return "grouped_mm" if aligned else "bmm"


def _chunk_plan(
    counts_E: torch.Tensor, capacity: int | None = None, one_per_expert: bool = False
) -> tuple[int, torch.Tensor, bool]:
    """(rows per chunk R, chunks per expert, whether each chunk needs its expert's matrices
    gathered) for the padded kernels.

    `bmm` (`one_per_expert`): one chunk per expert, as wide as the capacity or the largest load.
    `chunked`: of one chunk per expert as wide as the largest load (in 32-row steps) and the
    whole chunks of each size in CHUNK_ROWS, the plan with the fewest rows plus CHUNK_COST_ROWS
    per gathered chunk. Matrices are gathered unless every expert has exactly one chunk.
    """
    E = counts_E.shape[0]
    if one_per_expert:
        widest = capacity if capacity is not None else max(int(counts_E.max()), 1)
        return widest, torch.ones_like(counts_E), False
    sizes = torch.tensor(CHUNK_ROWS, device=counts_E.device)
    chunks_ZE = (counts_E + sizes[:, None] - 1) // sizes[:, None]
    single_Z = (chunks_ZE == 1).all(1)
    widest = (counts_E.max().clamp_min(1) + 31) // 32 * 32
    host = torch.cat([chunks_ZE.sum(1), single_Z.long(), widest.view(1)]).tolist()  # one host sync
    totals, singles = host[: len(CHUNK_ROWS)], host[len(CHUNK_ROWS) : -1]
    best = (E * host[-1], host[-1], None, False)  # (cost, R, plan index, gathered)
    for z, (R, C, single) in enumerate(zip(CHUNK_ROWS, totals, singles)):
        cost = C * R + (0 if single else CHUNK_COST_ROWS * C)
        if cost < best[0]:
            best = (cost, R, z, not single)
    _, R, z, gathered = best
    return R, torch.ones_like(counts_E) if z is None else chunks_ZE[z], gathered


class RoutedExperts(nn.Module):
    """E SwiGLU experts stored as stacked [E, in, out] matrices (one matrix per expert for Muon)."""

    def __init__(self, num_experts: int, dim: int, hidden: int, init_std: float, impl: str = "auto"):
        super().__init__()
        self.num_experts, self.init_std, self.impl = num_experts, init_std, impl
        self.gate_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def reset_parameters(self) -> None:
        for w in (self.gate_proj, self.up_proj, self.down_proj):
            trunc_normal_(w, self.init_std)

    def forward(
        self,
        x_ND: torch.Tensor,
        experts_NK: torch.Tensor,
        weights_NK: torch.Tensor,
        capacity: int | None = None,
        priority_N: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply the experts.

        Args:
            capacity: slots per expert; assignments past it are dropped. None = dropless.
            priority_N: distinct per-token ranks ordering each expert's queue (lower = kept
                first); None = token order.

        Returns:
            The weighted expert output [N, D] and the number of dropped assignments.
        """
        N, k = experts_NK.shape
        E = self.num_experts
        flat_A = experts_NK.reshape(-1)
        if priority_N is None:
            order_A = torch.argsort(flat_A, stable=True)
        else:
            order_A = torch.argsort(flat_A * N + priority_N.repeat_interleave(k))
        # Every shape below is fixed by N, k and E, not by the routing: no host sync and, under
        # torch.compile, no graph break (the padded kernels' plan aside). The cost, against
        # filtering the dropped assignments out (a host sync; 23 graph breaks in the 2-layer tiny
        # model): a zero row computed per drop, and the zero-row copies. Forward and backward of
        # one tiny-shaped layer (2,048 tokens, top-2 of 16, 64 -> 128, fp32, best of 40): 15.0
        # against 13.5 ms with 13.5% dropped, 15.6 against 15.2 ms with none. The hero run
        # dropped 0.018% (../shared/docs/marin-535b-a23b.md).
        counts_E = bincount(flat_A, E)
        expert_sorted_A = flat_A[order_A]
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        rank_A = torch.arange(flat_A.numel(), device=flat_A.device) - starts_E[expert_sorted_A]
        dropped = torch.zeros((), device=x_ND.device)
        keep_A = None
        if capacity is not None:
            keep_A = rank_A < capacity
            dropped = (~keep_A).sum().float()
            counts_E = counts_E.clamp(max=capacity)
        # Alignment is checked at the autocast width: aligned in bf16 implies aligned in fp32.
        impl = resolve_impl(self.impl, x_ND.device, tuple(self.down_proj.shape[1:]), compute_dtype(x_ND))
        dtype = compute_dtype(x_ND, impl)
        if impl not in ("grouped_mm", "chunked", "bmm", "loop"):
            raise ValueError(f"unknown expert impl {impl!r}; valid: auto, grouped_mm, chunked, bmm, loop")
        S = N * k
        padded = impl in ("chunked", "bmm")  # each expert's rows padded to whole chunks of R rows
        gathered = False  # whether each chunk gets its expert's matrices gathered beside it
        if padded:
            R, chunks_E, gathered = _chunk_plan(counts_E, capacity if impl == "bmm" else None, impl == "bmm")
            row_A = ((torch.cumsum(chunks_E, 0) - chunks_E)[expert_sorted_A]) * R + rank_A
            expert_C = torch.repeat_interleave(torch.arange(E, device=counts_E.device), chunks_E)
            P = expert_C.shape[0] * R
        else:  # the kept rows in expert order (all S without a capacity); then a zero row per drop
            row_A, P = (torch.cumsum(counts_E, 0) - counts_E)[expert_sorted_A] + rank_A, S
        has_padding = padded or keep_A is not None
        if keep_A is not None:
            row_A = torch.where(keep_A, row_A, P)  # a dropped assignment has no row: P
        slot_P = torch.full((P + 1,), S, dtype=order_A.dtype, device=order_A.device)
        slot_P[row_A] = order_A
        slot_P = slot_P[:P]  # row P collected the dropped assignments' slots
        row_S = torch.full((S,), P, dtype=order_A.dtype, device=order_A.device)
        row_S[order_A] = row_A
        token_P = slot_P // k  # N for a padding row: the zero row `_take` appends
        x_PD = _Dispatch.apply(x_ND, token_P, row_S, k, has_padding, keep_A is not None, dtype)
        # Each row's combine weight scales its hidden activations, before the (linear) down
        # projection: w * (h @ W_down) = (w * h) @ W_down. That scales F-wide rows instead of
        # D-wide outputs, and the combine becomes a plain sum over each token's k slots. In the
        # bf16 bench/train_step.py step (qwen3-moe-style, F = D/4), interleaved against scaling the
        # outputs: min 587 against 603 ms and 554 against 569 (10 rounds each); fp32 884 against 889.
        w_P1 = _take(weights_NK.reshape(-1, 1).to(dtype), slot_P, pad=has_padding)  # padding rows: weight 0
        experts = (self.gate_proj, self.up_proj, self.down_proj)
        if gathered:  # not exactly one chunk per expert: each chunk's matrices
            w_gate, w_up, w_down = (_ChunkWeights.apply(w, expert_C, dtype) for w in experts)
        else:  # otherwise the stacked matrices as they are
            w_gate, w_up, w_down = (w.to(dtype) for w in experts)
        if padded:
            x_CRD = x_PD.view(P // R, R, x_PD.shape[1])
            h_CRF = F.silu(torch.bmm(x_CRD, w_gate)) * torch.bmm(x_CRD, w_up) * w_P1.view(P // R, R, 1)
            y_PD = torch.bmm(h_CRF, w_down).view(P, w_down.shape[-1])
        elif impl == "grouped_mm":
            offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)
            if keep_A is not None:  # the zero rows after the kept ones go to the last expert
                offsets_E[-1] = P
            h_PF = F.silu(grouped_mm(x_PD, w_gate, offsets_E)) * grouped_mm(x_PD, w_up, offsets_E) * w_P1
            y_PD = grouped_mm(h_PF, w_down, offsets_E)
        else:  # loop
            pieces, start = [], 0
            for e, count in enumerate(counts_E.tolist()):
                xe, we = x_PD[start : start + count], w_P1[start : start + count]
                pieces.append((F.silu(xe @ w_gate[e]) * (xe @ w_up[e]) * we) @ w_down[e])
                start += count
            y_PD = torch.cat([*pieces, w_down.new_zeros(P - start, w_down.shape[2])])
        out_ND = _Combine.apply(y_PD, token_P, row_S, k, has_padding, keep_A is not None)
        return out_ND, dropped


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Receiver capacity per expert: ceil(factor * assignments / experts)."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))
