"""Routed SwiGLU experts over tokens sorted by expert.

Shape legend: N tokens, k experts per token, A assignments (N*k, fewer after capacity drops),
E experts, D expert input width (d_model or the latent width), F expert hidden width, C slots
per expert in the padded layout.

Dispatch sorts the N*k assignments by expert (stable, so token order within an expert), runs
the experts on the sorted rows, puts each row back in its token-major slot and sums each token's
k slots weighted by the combine weights. Every assignment owns one slot, so neither direction
needs an accumulating scatter (slow on CPU, non-deterministic on GPU): gradients are bitwise
reproducible.
Three interchangeable kernels compute the sorted rows:

- `grouped_mm`: `torch._grouped_mm` with offsets, registered as a custom op with our own
  backward (its own fails on CPU with "Invalid strides/sizes").
- `bmm`: rows scattered into an [E, C, D] buffer and batched matmuls; pays for padding.
- `loop`: one matmul per expert; the reference, and needs a host sync for the counts.

`auto` picks `grouped_mm` wherever the widths meet its 16-byte stride rule (on the 2-core AVX2
CPU, inside a full training step, it ran 1.9 s against 2.3 s for `loop` and 2.9 s for `bmm`),
and `bmm` otherwise.

Under autocast the expert matmuls run in the autocast dtype, with one exception: `grouped_mm`
on CPU stays in the input dtype. That is what torch's CPU autocast itself does with
`torch._grouped_mm` (its output stays fp32 under bf16 autocast), and what HF's experts, which
call it directly, get. A CPU without AVX512/AMX emulates bf16 matmuls (~1 GFLOP/s against
~170 fp32 on the 2-core dev VM); the model's linear layers and attention avoid that through
model/cpu_bf16.py. A CPU with them (a 2-core AVX512-BF16 EPYC: bf16 GEMMs at 405 GFLOP/s against
184 in fp32) is no better served by bf16 experts: oneDNN builds a kernel for every new row count,
and each expert's count changes every step, so one grouped product of varying loads took 11.5 ms
in bf16 against 2.7 ms in fp32 (1.7 ms in bf16 with the same loads each time), and a bench/
train_step.py step under bf16 autocast took 967 ms with bf16 grouped experts against 715 ms with
fp32 ones; `bmm` (padded to the largest load, 4-6x the mean at initialisation) took 816 ms.
On CUDA, grouped GEMM is the production bf16 kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from marinlm.model.cpu_bf16 import gemm_dtype
from marinlm.model.layers import trunc_normal_


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


def _to_slots(rows_AD: torch.Tensor, row_S: torch.Tensor) -> torch.Tensor:
    """rows_AD[row_S], where row index A (one past the end) stands for a zero row."""
    if row_S.shape[0] != rows_AD.shape[0]:  # some assignments were dropped
        rows_AD = torch.cat([rows_AD, rows_AD.new_zeros(1, rows_AD.shape[1])])
    return rows_AD.index_select(0, row_S)


class _Dispatch(torch.autograd.Function):
    """x_AD = x_ND[order_A // k]: the token row of each kept assignment, in expert-sorted order.

    `row_S` inverts `order_A`: the sorted row of each token-major slot (S = N*k), or A where the
    assignment was dropped. The backward gathers each slot's gradient row and sums each token's
    k slots.
    """

    @staticmethod
    def forward(ctx, x_ND, order_A, row_S, k):
        ctx.save_for_backward(row_S)
        ctx.k = k
        return x_ND.index_select(0, order_A // k)

    @staticmethod
    def backward(ctx, dx_AD):
        (row_S,) = ctx.saved_tensors
        dx_SD = _to_slots(dx_AD, row_S)
        return dx_SD.view(-1, ctx.k, dx_SD.shape[1]).sum(1), None, None, None


class _Undispatch(torch.autograd.Function):
    """y_SD = y_AD put back in token-major slot order; a dropped assignment's slot is zero."""

    @staticmethod
    def forward(ctx, y_AD, order_A, row_S):
        ctx.save_for_backward(order_A)
        return _to_slots(y_AD, row_S)

    @staticmethod
    def backward(ctx, dy_SD):
        (order_A,) = ctx.saved_tensors
        return dy_SD.index_select(0, order_A), None, None


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
            "use impl auto, bmm or loop"
        )
    if impl != "auto":
        return impl
    return "grouped_mm" if aligned else "bmm"


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
        counts_E = torch.bincount(flat_A, minlength=E)
        expert_sorted_A = flat_A[order_A]
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        rank_A = torch.arange(flat_A.numel(), device=flat_A.device) - starts_E[expert_sorted_A]
        dropped = torch.zeros((), device=x_ND.device)
        if capacity is not None:
            keep_A = rank_A < capacity
            dropped = (~keep_A).sum().float()
            order_A, expert_sorted_A, rank_A = order_A[keep_A], expert_sorted_A[keep_A], rank_A[keep_A]
            counts_E = counts_E.clamp(max=capacity)
        # Alignment is checked at the autocast width: aligned in bf16 implies aligned in fp32.
        impl = resolve_impl(self.impl, x_ND.device, tuple(self.down_proj.shape[1:]), compute_dtype(x_ND))
        dtype = compute_dtype(x_ND, impl)
        A = order_A.shape[0]
        row_S = torch.full((N * k,), A, dtype=order_A.dtype, device=order_A.device)
        row_S[order_A] = torch.arange(A, device=order_A.device)
        x_AD = _Dispatch.apply(x_ND, order_A, row_S, k).to(dtype)
        w_gate, w_up, w_down = (w.to(dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))
        if impl == "grouped_mm":
            offsets_E = torch.cumsum(counts_E, 0).to(torch.int32)
            h_AF = F.silu(grouped_mm(x_AD, w_gate, offsets_E)) * grouped_mm(x_AD, w_up, offsets_E)
            y_AD = grouped_mm(h_AF, w_down, offsets_E)
        elif impl == "bmm":
            slots = capacity if capacity is not None else int(counts_E.max())
            x_ECD = x_AD.new_zeros(E, slots, x_AD.shape[1])
            x_ECD = x_ECD.index_put((expert_sorted_A, rank_A), x_AD)
            h_ECF = F.silu(torch.bmm(x_ECD, w_gate)) * torch.bmm(x_ECD, w_up)
            y_AD = torch.bmm(h_ECF, w_down)[expert_sorted_A, rank_A]
        elif impl == "loop":
            pieces, start = [], 0
            for e, count in enumerate(counts_E.tolist()):
                xe = x_AD[start : start + count]
                pieces.append((F.silu(xe @ w_gate[e]) * (xe @ w_up[e])) @ w_down[e])
                start += count
            y_AD = torch.cat(pieces)
        else:
            raise ValueError(f"unknown expert impl {impl!r}; valid: auto, grouped_mm, bmm, loop")
        y_NKD = _Undispatch.apply(y_AD, order_A, row_S).view(N, k, -1)
        # The weighted sum over each token's k slots as one batched [1, k] @ [k, D] product in
        # the experts' dtype; bf16 on a CPU without a bf16 GEMM runs it in fp32 (model/cpu_bf16.py).
        gemm = gemm_dtype(dtype, x_ND.device)
        with torch.autocast(x_ND.device.type, enabled=False):
            w_N1K = weights_NK.to(dtype).to(gemm).unsqueeze(1)
            out_ND = torch.bmm(w_N1K, y_NKD.to(gemm)).squeeze(1).to(dtype)
        return out_ND, dropped


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Receiver capacity per expert: ceil(factor * assignments / experts)."""
    return max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))
