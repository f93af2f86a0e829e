"""bf16 autocast on CPUs that have no bf16 matmul kernel: the same products, computed by fp32 GEMMs.

Under `torch.autocast("cpu", dtype=torch.bfloat16)` torch runs linear layers and attention in
bf16. On a CPU where oneDNN has no bf16 GEMM (no AVX512 or AMX; `torch.ops.mkldnn.
_is_mkldnn_bf16_supported()` is False) those calls fall to torch's reference loops. On the 2-core
AVX2 dev CPU, torch 2.13: a 2048^3 bf16 matmul runs at 0.92 GFLOP/s against 177 GFLOP/s in fp32,
a [1024, 384] x [384, 384] product takes 128 ms against 2.5 ms, and SDPA forward+backward at
4x6x256x64 takes 83 ms against 17 ms.

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

BF16 = torch.bfloat16


def _probe_bf16_gemm() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # the check moved: assume the kernels are there
        return True


# Probed once at import: inside a compiled block the probe (a torch op returning a bool) would be
# a graph break at every linear layer; a module constant is folded in.
_CPU_BF16_GEMM = _probe_bf16_gemm()


def _cpu_has_bf16_gemm() -> bool:
    return _CPU_BF16_GEMM


def _probe_bf16_units() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # the checks moved: assume no bf16 unit, as fp32 is never the slow choice
        return False


_CPU_BF16_UNITS = _probe_bf16_units()


def native_bf16(device: torch.device | str) -> bool:
    """True where bf16 matmuls run on bf16 hardware, several times faster than fp32: GPUs, and
    CPUs with AVX512-BF16 or AMX. What `train.precision: auto` and the Marin optimizer's
    `ns_dtype: auto` pick bf16 on; other CPUs keep fp32 (where bf16 is emulated it is far slower,
    above). On the 2-core AVX512-BF16 EPYC, torch 2.13: bf16 matmuls at 750-899 GFLOP/s against
    180-209 in fp32; the quickstart's training step (`tiny`, 8 x 256 tokens, MuonH) in 175 against
    269 ms, best of 15 interleaved."""
    device = torch.device(device)
    if device.type == "cpu":
        return _CPU_BF16_UNITS
    return device.type != "meta"


def emulated_bf16(device: torch.device | str) -> bool:
    """True on a CPU whose bf16 matmuls would be torch's reference loops."""
    return torch.device(device).type == "cpu" and not _cpu_has_bf16_gemm()


def gemm_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype to run a GEMM of `dtype` operands in: fp32 for bf16 where bf16 is emulated (the
    caller rounds operands and results to bf16), otherwise `dtype` itself."""
    return torch.float32 if dtype == BF16 and emulated_bf16(device) else dtype


@contextlib.contextmanager
def bf16_operand_products(enabled: bool = True):
    """fp32 matmuls inside run as bf16 GEMMs with fp32 results (oneDNN's bf16 fpmath mode,
    `torch.backends.mkldnn.matmul.fp32_precision = "bf16"`): oneDNN may round the operands to
    bf16, sums the products in fp32 and keeps the result in fp32. For operands that already hold
    bf16 values nothing is rounded, so this is the bf16-in, fp32-out GEMM that torch's CPU
    `mm`/`bmm` lack (their `out_dtype` has no CPU kernel). (On the AVX512-BF16 EPYC, torch 2.13,
    it kept random fp32 operands to about fp32 accuracy: the same error against fp64 for a
    [8, 768, 64] x [8, 64, 256] bmm, 8.0e-5 against 4.8e-5 for a 2,048 x 384 x 1,024 mm, at 2.3-2.6x
    the speed; callers must not rely on that.) Only for CPUs with bf16 units; the setting is
    process-wide, so keep the block to the products that want it. `enabled=False` changes nothing,
    and neither does tracing by torch.compile (setting the mode is a graph break: a compiled bf16
    tiny model went from 14 to 34 graphs), where the products run as plain fp32 GEMMs."""
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


class Linear(nn.Linear):
    """`nn.Linear` without bias; in bf16 (autocast or bf16 inputs) on a CPU without a bf16 GEMM it
    runs `_Bf16Linear`.

    Same parameters and state-dict keys as `nn.Linear`, so HF export, FSDP2 and LoRA see a plain
    linear layer.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        if bias:
            raise ValueError("marinlm's Linear has no bias (no layer of the Marin architecture has one)")
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The cached device check first: off CPU (or with a bf16 GEMM) nothing else is looked at.
        if emulated_bf16(x.device) and (
            x.dtype == BF16 or (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == BF16)
        ):
            return _Bf16Linear.apply(x, self.weight)
        return F.linear(x, self.weight)


def scaled_dot_product_attention(q, k, v, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention; bf16 inputs on a CPU without a bf16 GEMM run it in fp32 on
    their (exact) fp32 values and round the output to bf16. The gradients leaving it are rounded
    to bf16 by the casts' own backward, as a bf16 kernel's would be."""
    if gemm_dtype(q.dtype, q.device) != q.dtype:
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(BF16)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)
