"""Attention for short rows on CPU: two batched GEMMs around an fp32 softmax.

Shape legend: B batch, H query heads, K KV heads, G = H / K query heads per KV head, T query
length, S key length, Dh head dim, X = B*K batched products.

Each KV head's G query heads are stacked into one [G*T, Dh] operand, so grouped-query attention
runs without repeating keys or values, and the scores of all heads come from one batched GEMM.
The scores are fp32, the softmax is fp32 and kept in fp32 for the backward, and the probabilities
are rounded to the input dtype only as operands of the products with V and dY. For bf16 inputs
the two fp32-result products (scores Q·Kᵀ and dP = dY·Vᵀ) have operands that hold bf16 values;
they run in oneDNN's bf16 fpmath mode (cpu_bf16.bf16_operand_products), which rounds nothing
such operands hold and returns fp32. At [8, 768, 64] x [8, 64, 256] on the 2-core EPYC, torch
2.13, best of 20: 0.44-0.49 against 1.04-1.26 ms as plain fp32 bmm, with the same error against
fp64 (1.50e-5 on random fp32 operands; the oneDNN kernel keeps fp32 accuracy here). This needs
the scale, which multiplies the queries and dY, to be a power of two (1/√Dh for Dh = 16, 64,
256...), so that the scaled operands still hold bf16 values; with any other scale the products
stay plain fp32 GEMMs, as before. (Moving such a scale onto the scores instead, to keep the mode,
bought nothing at the tiny preset's head dim of 32: a whole training step took 120.6 against
120.2 ms and 136.3 against 139.8 ms, best of 30 interleaved, and 600-step quickstart trainings
came out bitwise equal with the mode and without it.)
The backward is written out (dV = Pᵀ·dY, dP = dY·Vᵀ, dS = P·(dP − rowsum(dY·Y)),
dQ = dS·K, dK = dSᵀ·Q), with dP in fp32 and dS rounded to the input dtype for its two GEMMs.
Both passes run with autocast off: inside the model's `torch.autocast("cpu", bfloat16)` the fp32
products would otherwise run in bf16 and round the scores (as they did before 2026-12-02).

torch's CPU flash kernel works through queries and keys in blocks, which pays at long rows where
[T, S] scores would not fit in cache, and costs at short ones. At the bench/train_step.py shape
(4 x 256 tokens, 6 query and 2 KV heads of 64, causal), forward and backward together, on the
2-core AVX512-BF16 EPYC with torch 2.13: bf16 8.0 ms here against 10.9 ms for flash; in a whole
bench/train_step.py step under bf16 autocast, 334 against 374 ms (best of 12 interleaved,
2026-12-02, with the scores in fp32 as described here; median 354 against 381 ms). The bf16
fpmath products took it (best of 60 interleaved, 2026-12-03) from 5.04 to 3.53 ms against 8.73 ms
for flash; the whole bench step under bf16 autocast, four runs of 16-20 interleaved rounds, min:
317.2 / 319.3 / 298.5 against 329.3 / 339.8 / 311.0 ms, and in the first run 347.4 against 339.1
(medians 344.2 / 358.7 / 317.1 / 375.1 against 355.3 / 366.4 / 323.4 / 367.6).
torch's CPU kernel rounds only its outputs, so its error is lower: tests/test_cpu_attention.py
holds ours within 2x of it.

The mask enters as an additive fp32 bias broadcast over the heads, and the scale as a factor on
the queries (forward) and on dY (backward), never as a pass over the [G*T, S] scores; P is
rounded once in the forward and kept for dV. Against the boolean masked fill, the scaled scores
and P rounded twice (2026-12-02, same shape, minimum of 200 interleaved rounds on a noisy host,
/tmp scratch timing of `short_attention` forward and backward): 5.8 against 6.3 ms; in rounds
that also ran flash, 6.2-9.0 against 10.7-11.3 ms, flash 9.2-9.5 ms.
"""

from __future__ import annotations

import math

import torch

from marinlm.model.cpu_bf16 import bf16_operand_products, emulated_bf16
from marinlm.model.cpu_bf16 import scaled_dot_product_attention as _sdpa

# Where this path is taken: bf16 (in fp32 it ran no faster than flash: 15.9 against 16.0 ms at
# the shape above), keys up to 512 (at 2 x 512 tokens 15.7 against 18.4 ms; at 1 x 1,024, where
# flash's causal block skipping pays, 51.5 against 22.3 ms), and at most 32 MB of fp32 scores.
MAX_KEYS = 512
MAX_SCORES = 1 << 23


def use_short_attention(q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, attn_mask=None) -> bool:
    """True where `short_attention` is taken: native bf16 on CPU, a boolean mask or none, and
    short rows (MAX_KEYS, MAX_SCORES)."""
    B, H, T, _ = q_BHTD.shape
    S = k_BKSD.shape[2]
    return (
        q_BHTD.device.type == "cpu"
        and q_BHTD.dtype == torch.bfloat16
        and not emulated_bf16(q_BHTD.device)
        and (attn_mask is None or attn_mask.dtype == torch.bool)
        and S <= MAX_KEYS
        and B * H * T * S <= MAX_SCORES
    )


def _bf16_products(operand: torch.Tensor, scale: float) -> bool:
    """Whether the fp32 products of `operand` (queries or dY) scaled by `scale` may run in bf16
    fpmath mode: the operand is bf16 and the scale a power of two, so the scaled fp32 operand
    still holds bf16 values and nothing is rounded. Other scales keep plain fp32 products."""
    return operand.dtype == torch.bfloat16 and math.frexp(scale)[0] == 0.5


def _probabilities(q_XMD, k_XSD, bias_B11TS, G, scale):
    """Softmax probabilities [X, G*T, S] in fp32. `bias` is 0 where a query may attend and -inf
    elsewhere, [B or 1, 1, 1, T, S]: added by broadcasting over each KV head and its G query heads
    (faster than a masked fill through a broadcast boolean mask: 1.8 against 2.7 ms for scores and
    softmax at the shape above). The scale multiplies the [X, G*T, Dh] queries, not the scores."""
    X, M, _ = q_XMD.shape
    with bf16_operand_products(_bf16_products(q_XMD, scale)):
        s_XMS = torch.bmm(q_XMD.to(torch.float32, copy=True).mul_(scale), k_XSD.float().transpose(1, 2))
    B = bias_B11TS.shape[0]
    s_XMS.view(B, X // B, G, M // G, -1).add_(bias_B11TS)
    return torch.softmax(s_XMS, dim=-1)


class _ShortAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHTD, k_BKSD, v_BKSD, bias_B11TS, scale):
        # Autocast would run the fp32 products below in bf16 (the model calls this inside it, and
        # the backward may run inside it too): the dtypes here are chosen by hand.
        with torch.autocast(q_BHTD.device.type, enabled=False):
            return _ShortAttention._forward(ctx, q_BHTD, k_BKSD, v_BKSD, bias_B11TS, scale)

    @staticmethod
    def backward(ctx, dy_BHTD):
        with torch.autocast(dy_BHTD.device.type, enabled=False):
            return _ShortAttention._backward(ctx, dy_BHTD)

    @staticmethod
    def _forward(ctx, q_BHTD, k_BKSD, v_BKSD, bias_B11TS, scale):
        B, H, T, Dh = q_BHTD.shape
        K, S = k_BKSD.shape[1], k_BKSD.shape[2]
        G = H // K
        q_XMD = q_BHTD.reshape(B * K, G * T, Dh)
        k_XSD = k_BKSD.reshape(B * K, S, Dh)
        v_XSD = v_BKSD.reshape(B * K, S, Dh)
        p_XMS = _probabilities(q_XMD, k_XSD, bias_B11TS, G, scale)
        p_low_XMS = p_XMS.to(q_BHTD.dtype)  # the operand of P·V here and of Pᵀ·dY in the backward
        y_XMD = torch.bmm(p_low_XMS, v_XSD)
        ctx.save_for_backward(q_XMD, k_XSD, v_XSD, p_XMS, p_low_XMS, y_XMD)
        ctx.scale, ctx.shapes = scale, (q_BHTD.shape, k_BKSD.shape)
        return y_XMD.view(B, H, T, Dh)

    @staticmethod
    def _backward(ctx, dy_BHTD):
        q_XMD, k_XSD, v_XSD, p_XMS, p_low_XMS, y_XMD = ctx.saved_tensors
        q_shape, k_shape = ctx.shapes
        dtype = y_XMD.dtype
        dy_XMD = dy_BHTD.reshape(y_XMD.shape).to(dtype)
        dv_XSD = torch.bmm(p_low_XMS.transpose(1, 2), dy_XMD)
        # dP and rowsum(dY·Y) both come from dY: scaling it (Dh wide) scales dS (S wide) for free.
        dy_scaled_XMD = dy_XMD.to(torch.float32, copy=True).mul_(ctx.scale)
        with bf16_operand_products(_bf16_products(dy_XMD, ctx.scale)):
            dp_XMS = torch.bmm(dy_scaled_XMD, v_XSD.float().transpose(1, 2))
        delta_XM1 = (dy_scaled_XMD * y_XMD.float()).sum(-1, keepdim=True)
        ds_XMS = dp_XMS.sub_(delta_XM1).mul_(p_XMS).to(dtype)
        dq_XMD = torch.bmm(ds_XMS, k_XSD)
        dk_XSD = torch.bmm(ds_XMS.transpose(1, 2), q_XMD)
        return dq_XMD.view(q_shape), dk_XSD.view(k_shape), dv_XSD.view(k_shape), None, None


def short_attention(q_BHTD, k_BKSD, v_BKSD, attn_mask=None, is_causal=False, scale=None) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=..., enable_gqa=True)` for
    a boolean [B or 1, 1, T, S] mask (True = may attend) or a causal one, on short rows."""
    B, H, T, Dh = q_BHTD.shape
    S = k_BKSD.shape[2]
    if attn_mask is None:
        attn_mask = torch.ones(T, S, dtype=torch.bool, device=q_BHTD.device)
        if is_causal:  # aligned to the top left, as in SDPA
            attn_mask = attn_mask.tril()
    while attn_mask.dim() < 4:  # [T, S] -> [1, 1, T, S]
        attn_mask = attn_mask.unsqueeze(0)
    bias_B11TS = torch.zeros(attn_mask.shape, device=q_BHTD.device).masked_fill_(~attn_mask, float("-inf"))
    return _ShortAttention.apply(q_BHTD, k_BKSD, v_BKSD, bias_B11TS.unsqueeze(1), Dh**-0.5 if scale is None else scale)


def scaled_dot_product_attention(q_BHTD, k_BKSD, v_BKSD, attn_mask=None, is_causal=False, enable_gqa=False):
    """The model's attention kernel: `short_attention` where `use_short_attention` holds, else
    `F.scaled_dot_product_attention` (through model/cpu_bf16.py where bf16 is emulated)."""
    if use_short_attention(q_BHTD, k_BKSD, attn_mask):
        return short_attention(q_BHTD, k_BKSD, v_BKSD, attn_mask, is_causal)
    return _sdpa(q_BHTD, k_BKSD, v_BKSD, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
