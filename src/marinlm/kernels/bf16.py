"""bf16 autocast on CPUs that have no bf16 matmul kernel: the same products, computed by fp32 GEMMs.

Under `torch.autocast("cpu", dtype=torch.bfloat16)` torch runs linear layers and attention in
bf16. On a CPU where oneDNN has no bf16 GEMM (no AVX512 or AMX; `torch.ops.mkldnn.
_is_mkldnn_bf16_supported()` is False) those calls fall to torch's reference loops, two orders of
magnitude slower than fp32 GEMMs (`bench/cpu_bf16.py`; docs/performance.md).

What a bf16 GEMM computes is: bf16 operands, products and sums in fp32, one rounding of the result
to bf16. A product of two bf16 numbers (8-bit significands) is exact in fp32 (24 bits), so
rounding the operands to bf16, multiplying them with an fp32 GEMM and rounding the result to bf16
gives the same numbers up to the order of the fp32 additions. That is what this module does on
such CPUs, with autocast's rounding points kept: operands, outputs and the gradients that leave
each product are bf16; the master weights and their gradients stay fp32, as under autocast.

Nothing changes on GPUs, on CPUs with a bf16 GEMM, or in fp32.
`tests/test_cpu_bf16.py` checks the results against torch's own bf16 kernels.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from marinlm.utils.device import emulated_bf16, gemm_dtype

BF16 = torch.bfloat16


@contextlib.contextmanager
def bf16_operand_products(enabled: bool = True):
    """fp32 matmuls inside run as bf16 GEMMs with fp32 results (oneDNN's bf16 fpmath mode,
    `torch.backends.mkldnn.matmul.fp32_precision = "bf16"`): oneDNN may round the operands to
    bf16, sums the products in fp32 and keeps the result in fp32. For operands that already hold
    bf16 values nothing is rounded, so this is the bf16-in, fp32-out GEMM that torch's CPU
    `mm`/`bmm` lack (their `out_dtype` has no CPU kernel). Only for CPUs with bf16 units; the
    setting is process-wide, so keep the block to the products that want it. `enabled=False`
    changes nothing, and neither does tracing by torch.compile (setting the mode is a graph break),
    where the products run as plain fp32 GEMMs."""
    if not enabled or torch.compiler.is_compiling():
        yield
        return
    backend = torch.backends.mkldnn.matmul
    before = backend.fp32_precision
    backend.fp32_precision = "bf16"
    try:
        yield
    finally:
        backend.fp32_precision = before


class _Bf16Linear(torch.autograd.Function):
    """y = x @ w.T as autocast's bf16 linear computes it, with fp32 GEMMs; saves bf16 operands."""

    @staticmethod
    def forward(ctx, x, weight):
        x_bf, w_bf = x.to(BF16), weight.to(BF16)
        ctx.save_for_backward(x_bf, w_bf)
        ctx.dtypes = x.dtype, weight.dtype
        with torch.autocast("cpu", enabled=False):
            return F.linear(x_bf.float(), w_bf.float()).to(BF16)

    @staticmethod
    def backward(ctx, grad_y):
        x_bf, w_bf = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        g = grad_y.to(BF16).float()
        grad_x = grad_w = None
        with torch.autocast("cpu", enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = (g @ w_bf.float()).to(BF16).to(x_dtype)
            if ctx.needs_input_grad[1]:
                g_NO = g.reshape(-1, g.shape[-1])
                x_NI = x_bf.reshape(-1, x_bf.shape[-1]).float()
                grad_w = (g_NO.t() @ x_NI).to(BF16).to(w_dtype)
        return grad_x, grad_w


class EmulatedBf16Linear(nn.Linear):
    """`nn.Linear` (no bias) that, in bf16 (autocast or bf16 inputs) on a CPU without a bf16 GEMM,
    runs `_Bf16Linear`. Same parameters and state-dict keys as `nn.Linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The cached device check first: off CPU (or with a bf16 GEMM) nothing else is looked at.
        if emulated_bf16(x.device) and (
            x.dtype == BF16 or (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == BF16)
        ):
            return _Bf16Linear.apply(x, self.weight)
        return F.linear(x, self.weight, self.bias)


def scaled_dot_product_attention(q, k, v, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention; bf16 inputs on a CPU without a bf16 GEMM run it in fp32 on
    their (exact) fp32 values and round the output to bf16. The gradients leaving it are rounded
    to bf16 by the casts' own backward, as a bf16 kernel's would be."""
    if gemm_dtype(q.dtype, q.device) != q.dtype:
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(BF16)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)
