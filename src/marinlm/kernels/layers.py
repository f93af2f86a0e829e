"""Fused RMSNorm and SConv: the reference maths as one autograd node each, backward written out.

Shape legend: B batch, T sequence, C channels, K convolution taps.
Each kernel subclasses its reference module in `marinlm.model.layers` and keeps its parameters;
`tests/test_kernels.py` checks values and gradients against the reference.
"""

from __future__ import annotations

import torch

from marinlm.model.context import ForwardContext
from marinlm.model.layers import RMSNorm, SConv, compute_dtype


def _leading_dims(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(t.dim() - 1))


class _RMSNorm(torch.autograd.Function):
    """y = x * rsqrt(mean(x²) + eps) * w in fp32, rounded once to x's dtype, with the backward
    written out: dx = rstd·(g·w − n·mean(g·w·n)), dw = Σ g·n, with n = x·rstd.

    It saves x and rstd (one value a row) and recomputes n, where autograd keeps eight nodes'
    inputs (measured in docs/performance.md)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ct = compute_dtype(x)
        x32 = x.to(ct)
        rstd = torch.rsqrt(x32.square().mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, rstd, weight)
        return (x32 * rstd).mul_(weight.to(ct)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, rstd, weight = ctx.saved_tensors
        ct = rstd.dtype
        n = x.to(ct) * rstd
        g = dy.to(ct)
        dw = (g * n).sum(_leading_dims(g)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gw = g * weight.to(ct)
        dx = (gw - n * (gw * n).mean(-1, keepdim=True)).mul_(rstd)
        return dx.to(x.dtype), dw, None


class FusedRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


class _CausalConv(torch.autograd.Function):
    """`y[t] = w[0]·x[t] + Σ_lag keep[lag][t]·w[lag]·x[t-lag]`, backward written out.

    `keep[lag - 1]` is [B, T - lag, 1] in x's dtype, 1 where tap t - lag lies in t's document
    (None: always). Each tap is one in-place multiply-add (`addcmul_`); the weight gradient is
    summed in fp32. Autograd of the same sum builds ~30 nodes."""

    @staticmethod
    def forward(ctx, x_BTC, weight_KC, *keep):
        w_KC = weight_KC.to(x_BTC.dtype)
        y_BTC = x_BTC * w_KC[0]
        for lag in range(1, min(weight_KC.shape[0], x_BTC.shape[1])):
            x_lag = x_BTC[:, :-lag] if keep[lag - 1] is None else x_BTC[:, :-lag] * keep[lag - 1]
            y_BTC[:, lag:].addcmul_(x_lag, w_KC[lag])
        ctx.save_for_backward(x_BTC, weight_KC, *keep)
        return y_BTC

    @staticmethod
    def backward(ctx, dy_BTC):
        x_BTC, weight_KC, *keep = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[:2]  # a frozen kernel (fine-tuning) needs no dw
        w_KC = weight_KC.to(x_BTC.dtype)
        dx_BTC = dy_BTC * w_KC[0] if need_dx else None
        dw_KC = torch.zeros_like(weight_KC) if need_dw else None
        if need_dw:
            dw_KC[0] = (dy_BTC * x_BTC).sum((0, 1), dtype=weight_KC.dtype)
        for lag in range(1, min(weight_KC.shape[0], x_BTC.shape[1])):
            g = dy_BTC[:, lag:] if keep[lag - 1] is None else dy_BTC[:, lag:] * keep[lag - 1]
            if need_dx:
                dx_BTC[:, :-lag].addcmul_(g, w_KC[lag])
            if need_dw:
                dw_KC[lag] = (g * x_BTC[:, :-lag]).sum((0, 1), dtype=weight_KC.dtype)
        return (dx_BTC, dw_KC, *[None] * len(keep))


class FusedSConv(SConv):
    def convolve(self, x_BTC, keep):
        """As the reference, with the masks in x's dtype (built once a forward where they come
        from the context) and one autograd node."""
        if keep is None:
            keep = [None] * (self.kernel_size - 1)
        else:
            keep = [m.to(x_BTC.dtype) for m in keep]
        return _CausalConv.apply(x_BTC, self.weight, *keep)

    def forward(self, x_BTC, ctx: ForwardContext, state=None):
        if state is not None:
            return super().forward(x_BTC, ctx, state)
        keep = ctx.sconv_keep(self.kernel_size)
        if keep is not None:
            keep = ctx.memo(("sconv_keep", self.kernel_size, x_BTC.dtype), lambda: [m.to(x_BTC.dtype) for m in keep])
        return self.convolve(x_BTC, keep), None
