"""Fast layouts of the routed experts: fused dispatch and combine, padded batched GEMMs.

Shape legend: N tokens, k experts per token, S = N*k token-major slots, A = S assignments in
expert order, P rows of the experts' layout (S for `grouped_mm` and `loop`, plus padding for
`chunked` and `bmm`), E experts, D expert input width, F expert hidden width, C chunks, R rows
per chunk.

The same maths as `marinlm.model.experts.RoutedExperts`, laid out for speed:
- every shape is fixed by N, k and E (dropped assignments become zero rows), so no host sync;
- dispatch and combine are autograd Functions whose backward is a gather or one `embedding_bag`
  over each token's own rows: no accumulating scatter (slow on CPU, non-deterministic on GPU);
- each row's combine weight scales its hidden activations before the (linear) down projection;
- four interchangeable kernels compute the sorted rows:
  - `grouped_mm`: `torch._grouped_mm`, registered as a custom op with its own backward and shape
    rules, so torch.compile traces it; on CPU it stays fp32 under bf16 autocast, as torch's CPU
    autocast leaves it (oneDNN builds a bf16 kernel for every new row count);
  - `chunked`: each expert's rows padded to whole chunks of R rows, one batched matmul over the
    chunks with each chunk's expert matrices gathered beside it; `_chunk_plan` picks R per forward;
  - `bmm`: one chunk per expert, as wide as the capacity or the largest load;
  - `loop`: one matmul per expert.
`auto` picks `chunked` on a CPU with bf16 GEMMs under bf16, `grouped_mm` elsewhere wherever the
widths meet its 16-byte stride rule, and `bmm` otherwise (measured by `bench/experts.py` and
`bench/train_step.py`; docs/performance.md). `tests/test_kernels.py` checks every kernel
against the reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from marinlm.model.experts import RoutedExperts, grouped_mm_aligned
from marinlm.model.layers import bincount
from marinlm.utils.device import emulated_bf16


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


# torch._grouped_mm's fake-tensor rule demands bf16 (torch.compile fails on fp32 operands) and its
# own backward has failed on CPU ("Invalid strides/sizes"), so the op is registered with our own
# autograd and shape rules for the operands torch does not cover.
grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _grouped(x_AD: torch.Tensor, w_EDF: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """`grouped_mm`, through torch's own op and autograd where they cover the operands (bf16): a
    custom op's Python dispatch and backward cost host time on every forward and backward, which a
    GPU step bound by its host pays three times a layer."""
    if x_AD.dtype == torch.bfloat16 and w_EDF.dtype == torch.bfloat16:
        return torch._grouped_mm(x_AD, w_EDF, offs=offsets_E)
    return grouped_mm(x_AD, w_EDF, offsets_E)


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
    writes and reads them again; it too adds in fp32 and rounds once, so its result is the same.
    """
    dtype = dtype or rows_PD.dtype
    if not dropped and dtype == rows_PD.dtype:
        return F.embedding_bag(row_S.view(-1, k), rows_PD, mode="sum")
    rows_SD = _take(rows_PD, row_S, pad=dropped)
    return rows_SD.view(-1, k, rows_SD.shape[1]).sum(1, dtype=torch.promote_types(dtype, torch.float32)).to(dtype)


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
    one chunk, and in fp32). It reads each chunk once. Deterministic: each sum is over one
    expert's own chunks, in order.
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
# costs, in rows of expert compute (its matrix copies forward and its gradient sums backward),
# fitted with bench/experts.py on a CPU in bf16 (docs/performance.md).
CHUNK_ROWS = (64, 128, 256, 512)
CHUNK_COST_ROWS = 48


def compute_dtype(x: torch.Tensor, impl: str = "bmm") -> torch.dtype:
    """The dtype the expert matmuls run in: the autocast dtype when autocast is on and covers the
    kernel (see the module docstring), else the input's."""
    device = x.device.type
    if not torch.is_autocast_enabled(device) or (impl == "grouped_mm" and device == "cpu"):
        return x.dtype
    return torch.get_autocast_dtype(device)


def resolve_impl(impl: str, device: torch.device, dims: tuple[int, ...], dtype: torch.dtype) -> str:
    aligned = grouped_mm_aligned(dims, dtype)
    if impl == "grouped_mm" and not aligned:
        raise ValueError(
            f"expert impl grouped_mm needs widths {dims} to be multiples of 16 bytes in {dtype}; "
            "use impl auto, chunked, bmm or loop"
        )
    if impl != "auto":
        return impl
    # The padded kernels plan their chunks on the host: under torch.compile, a graph break.
    cpu_bf16 = device.type == "cpu" and dtype == torch.bfloat16 and not emulated_bf16(device)
    if cpu_bf16 and not torch.compiler.is_compiling():
        return "chunked"
    return "grouped_mm" if aligned and dtype != torch.float64 else "bmm"  # no float64 grouped GEMM


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


def _chunk_rows(chunks_E: torch.Tensor, expert_A: torch.Tensor, rank_A: torch.Tensor, R: int):
    """The padded kernels' layout: (the row of each assignment, its expert's chunks first, then by
    its rank in its expert's queue; the expert of each chunk; the P rows of all chunks)."""
    row_A = (torch.cumsum(chunks_E, 0) - chunks_E)[expert_A] * R + rank_A
    expert_C = torch.repeat_interleave(torch.arange(chunks_E.shape[0], device=chunks_E.device), chunks_E)
    return row_A, expert_C, expert_C.shape[0] * R


class FusedRoutedExperts(RoutedExperts):
    """The reference experts' parameters, run by the kernels above (`impl` any of auto,
    grouped_mm, chunked, bmm, loop)."""

    def forward(
        self,
        x_ND: torch.Tensor,
        experts_NK: torch.Tensor,
        weights_NK: torch.Tensor,
        capacity: int | None = None,
        priority_N: torch.Tensor | None = None,
        keep_NK: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        N, k = experts_NK.shape
        E = self.num_experts
        flat_A = experts_NK.reshape(-1)
        if keep_NK is not None:  # another rule chose the drops: they sort last, as expert E
            flat_A = torch.where(keep_NK.reshape(-1), flat_A, E)
        if priority_N is None:
            order_A = torch.argsort(flat_A, stable=True)
        else:
            order_A = torch.argsort(flat_A * N + priority_N.repeat_interleave(k))
        # Every shape below is fixed by N, k and E, not by the routing: no host sync and, under
        # torch.compile, no graph break (the padded kernels' plan aside). The cost, against
        # filtering the dropped assignments out as the reference does: a zero row computed per
        # drop (the hero run dropped 0.018%).
        counts_E = bincount(flat_A, E + 1)
        expert_sorted_A = flat_A[order_A]
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        rank_A = torch.arange(flat_A.numel(), device=flat_A.device) - starts_E[expert_sorted_A]
        counts_E = counts_E[:E]
        dropped = torch.zeros((), device=x_ND.device)
        keep_A = None
        if keep_NK is not None:
            keep_A = expert_sorted_A < E
            dropped = (~keep_A).sum().float()
            expert_sorted_A = expert_sorted_A.clamp(max=E - 1)  # a dropped assignment's row is P below
        elif capacity is not None:
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
            row_A, expert_C, P = _chunk_rows(chunks_E, expert_sorted_A, rank_A, R)
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
        # D-wide outputs, and the combine becomes a plain sum over each token's k slots.
        w_P1 = _take(weights_NK.reshape(-1, 1).to(dtype), slot_P, pad=has_padding)  # padding rows: weight 0
        if padded:
            y_PD = self._chunks(x_PD, R, expert_C, gathered, dtype, w_P1)
        elif impl == "grouped_mm":
            w_gate, w_up, w_down = (w.to(dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
            offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)
            if keep_A is not None:  # the zero rows after the kept ones go to the last expert
                offsets_E[-1:].fill_(P)
            h_PF = F.silu(_grouped(x_PD, w_gate, offsets_E)) * _grouped(x_PD, w_up, offsets_E) * w_P1
            y_PD = _grouped(h_PF, w_down, offsets_E)
        else:  # loop
            w_gate, w_up, w_down = (w.to(dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
            pieces, start = [], 0
            for e, count in enumerate(counts_E.tolist()):
                xe, we = x_PD[start : start + count], w_P1[start : start + count]
                pieces.append((F.silu(xe @ w_gate[e]) * (xe @ w_up[e]) * we) @ w_down[e])
                start += count
            y_PD = torch.cat([*pieces, w_down.new_zeros(P - start, w_down.shape[2])])
        out_ND = _Combine.apply(y_PD, token_P, row_S, k, has_padding, keep_A is not None)
        return out_ND, dropped

    def _chunks(self, x_PD, R, expert_C, gathered, dtype, w_P1=None) -> torch.Tensor:
        """The padded kernels' SwiGLU: one batched matmul over the P / R chunks of R rows, chunk c
        with expert expert_C[c]'s matrices (gathered beside it unless every expert has one chunk);
        `w_P1`, where given, scales each row's hidden activations."""
        experts = (self.gate_proj, self.up_proj, self.down_proj)
        if gathered:
            w_gate, w_up, w_down = (_ChunkWeights.apply(w, expert_C, dtype) for w in experts)
        else:
            w_gate, w_up, w_down = (w.to(dtype) for w in experts)
        P = x_PD.shape[0]
        x_CRD = x_PD.view(P // R, R, x_PD.shape[1])
        h_CRF = F.silu(torch.bmm(x_CRD, w_gate)) * torch.bmm(x_CRD, w_up)
        if w_P1 is not None:
            h_CRF = h_CRF * w_P1.view(P // R, R, 1)
        return torch.bmm(h_CRF, w_down).view(P, w_down.shape[-1])

    def resolve_impl(self, dtype: torch.dtype) -> str:
        """The kernel `run_experts` runs rows in `dtype` with (expert parallel asks for it)."""
        return resolve_impl(self.impl, self.down_proj.device, tuple(self.down_proj.shape[1:]), dtype)

    def run_experts(self, x_AD: torch.Tensor, counts_E: torch.Tensor, impl: str) -> torch.Tensor:
        """The experts over rows already grouped by expert, expert e's a block of counts_E[e] rows
        (what a rank receives under expert parallel). The padded kernels lay the blocks out in
        whole chunks and gather the results back, both ways a gather (a `_Dispatch` and a
        `_Combine` of one slot a row); `grouped_mm` and `loop` run as the reference's."""
        if impl not in ("chunked", "bmm"):
            return super().run_experts(x_AD, counts_E, impl)
        E, A, device = counts_E.shape[0], x_AD.shape[0], counts_E.device
        R, chunks_E, gathered = _chunk_plan(counts_E, None, impl == "bmm")
        expert_A = torch.repeat_interleave(torch.arange(E, device=device), counts_E, output_size=A)
        rank_A = torch.arange(A, device=device) - (torch.cumsum(counts_E, 0) - counts_E)[expert_A]
        row_A, expert_C, P = _chunk_rows(chunks_E, expert_A, rank_A, R)
        source_P = torch.full((P + 1,), A, dtype=row_A.dtype, device=device)
        source_P[row_A] = torch.arange(A, device=device)
        source_P = source_P[:P]  # A for a padding row: the zero row `_take` appends
        x_PD = _Dispatch.apply(x_AD, source_P, row_A, 1, True, False, x_AD.dtype)
        y_PD = self._chunks(x_PD, R, expert_C, gathered, x_AD.dtype)
        return _Combine.apply(y_PD, source_P, row_A, 1, True, False)
