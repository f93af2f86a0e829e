"""bf16 and fp32 attention on CPU: two batched GEMMs around an fp32 softmax, in blocks of queries.

Shape legend: B batch, H query heads, K KV heads, G = H / K query heads per KV head, T query
length, S key length, Dh head dim, X = B*K batched products.

In bf16, rows of up to 256 queries are one block, longer ones are worked through in blocks of 128
queries; in fp32, rows of more than 64 queries in blocks of 64 (`block_rows`), and shorter ones by
torch's flash kernel, which is as fast there. Each block is attended against only the keys its
queries may see (`query_blocks`): a causal row computes about half its scores, and each block's
scores stay in cache. The kernel keeps its fp32 probabilities for the backward pass, so it is
taken up to MAX_SCORES of them; beyond that torch's flash kernel, which recomputes them.

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
from marinlm.model.layers import LastResult

# Where this path is taken: native bf16 and fp32, where the fp32 probabilities it keeps for the
# backward pass, summed over the query blocks, come to at most MAX_SCORES (32 MB; flash keeps none
# and recomputes them).
MAX_SCORES = 1 << 23
# bf16 rows longer than LONG_ROWS are cut into blocks of BLOCK_ROWS queries; fp32 rows longer than
# FP32_BLOCK_ROWS into blocks of it. See `block_rows`.
LONG_ROWS = 256
BLOCK_ROWS = 128
FP32_BLOCK_ROWS = 64


def block_rows(T: int, dtype: torch.dtype) -> int:
    """Queries per block of `query_blocks` by default, for rows of T queries in `dtype`.

    In fp32 the products cost 4-5x what they cost in bf16 and the softmax around them the same,
    so skipping the keys a block cannot see pays even at short rows. Forward and backward of one
    layer's causal attention on the 2-core AVX512-BF16 EPYC, torch 2.13 (2026-12-03, min of 30
    interleaved; 6 query and 2 KV heads of 64): fp32 in blocks of 32 / 64 / 96 / 128 / 256 rows
    at 4 x 256 tokens 5.68 / 5.51 / 5.53 / 6.12 / 7.61 ms against 7.96 for torch's flash kernel;
    at 1 x 1,024 19.5 / 18.6 / 17.9 / 18.7 / 20.3 against 23.0; the quickstart's `tiny` heads
    (4 and 2 of 32) at 8 x 256 5.26 / 4.64 / 4.80 / 5.34 / 6.64 against 6.19. In bf16 at
    4 x 256, 4.74 / 3.35 / 3.18 / 3.12 / 3.43 against 8.65 for flash.
    Whole fp32 training steps (forward, backward, AdamW) with this kernel in blocks of 64 against
    torch's flash kernel for every fp32 row, min (median) of 12 interleaved rounds, same host:
    qwen3-moe-style at 4 x 256 tokens 552.5 (567.9) against 570.0 (577.8) ms, at 1 x 1,024 652.0
    (675.1) against 678.1 (706.0), at 2 x 512 641.8 (649.3) against 700.2 (705.6); the hero-shaped
    `small` preset at 4 x 256 870.5 (882.3) against 895.2 (912.1) (10 rounds); the quickstart's
    `tiny` at 8 x 256 tokens packed with documents 198.7 (205.6) against 200.3 (205.6) (30 rounds).
    The price is the kept probabilities, 4 bytes each in fp32 (`saved_scores`: 13.4 MB a layer at
    1 x 1,024 tokens, where flash keeps none): the qwen3-moe-style step's peak resident memory there
    rose from 1,246 to 1,337 MB.
    """
    if dtype == torch.float32:
        return min(T, FP32_BLOCK_ROWS)
    return T if T <= LONG_ROWS else BLOCK_ROWS


def query_blocks(
    T: int,
    S: int,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    block: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> list[tuple[int, int, int, int]]:
    """(start, end, first key, end key) for each block of queries: rows [start, end) attend to
    keys [first key, end key) of the S keys at most.

    A causal row sees no key after its own, so the block of queries [s, e) needs only the first e
    keys: about half the T x S scores are never computed, and each block's scores are small enough
    to stay in cache. With a boolean mask the keys any row of the block may see are read off the
    mask (one pass over it, kept for the next call with the same mask: every global layer of a
    forward shares one): for rows packed with documents a block also skips the keys of the
    documents before its own. While torch.compile traces, reading the mask would be a graph break,
    and blocks take all keys. By default a block has `block_rows(T, dtype)` queries.

    Measured on the 2-core AVX512-BF16 EPYC, torch 2.13, bf16, 6 query and 2 KV heads of 64
    (2026-12-03): forward and backward of one layer's attention at 1 x 1,024 tokens in blocks of
    128 / 256 / 512 rows 11.9 / 10.0 / 16.1 ms against 26.6 in one block and 17.2 for torch's
    flash kernel; at 2 x 512 9.2 / 6.8 against 12.2 and 15.9; at 1 x 4,096 192 / 241 / 284
    against flash's 209. Whole bench/train_step.py steps (qwen3-moe-style, bf16 autocast) with
    blocks of 128 / 256 rows were within 1-6% of each other at 2 x 512, 1 x 1,024, 4 x 1,024 and
    1 x 2,048 tokens, and at 4 x 256 blocks of 128 bought nothing (298.4 against 297.4 ms), hence
    one block up to LONG_ROWS. This kernel against the one before it (one block up to 512 keys,
    flash beyond), whole steps, minimum (median) of 6-12 interleaved rounds: 1 x 1,024 tokens
    377.4 (382.8) against 427.5 (437.8) ms; 2 x 1,024 615.8 (631.0) against 752.8 (765.4); 2 x 512
    309.2 (315.2) against 320.6 (332.0); the hero-shaped `small` preset (two global layers of
    eight) at 1 x 1,024 421.9 (449.6) against 431.2 (456.2). Decoding one token against 1,024 /
    4,096 cached keys, forward only: 0.12 / 0.22 ms against flash's 0.28 / 1.30. The price is
    memory: the step's peak resident memory rose from 1,354 to 1,503 MB at 1 x 1,024 tokens and
    from 1,641 to 2,016 MB at 2 x 1,024 (the kept probabilities, 6 bytes each; MAX_SCORES bounds
    them per layer as before, at 50 MB). Skipping the keys of earlier documents, on rows packed
    with documents of ~300 tokens (bench/attention.py's), forward and backward of one layer, min
    (median) of 15 interleaved: 1 x 1,024 10.1 (11.5) against 12.9 (15.0) ms, 2 x 1,024 11.4
    (12.0) against 18.9 (23.7), 4 x 512 10.4 (10.7) against 10.9 (11.3); whole qwen3-moe-style
    training steps on such rows, bf16: 1 x 1,024 363.0 (389.1) against 373.7 (409.0) ms, 2 x
    1,024 558.9 (581.6) against 624.6 (644.8).
    """
    if block is None:
        block = block_rows(T, dtype)
    if block >= T:
        return [(0, T, 0, S)]
    starts = range(0, T, block)
    if attn_mask is None or torch.compiler.is_compiling():
        causal = attn_mask is None and is_causal
        return [(s, min(s + block, T), 0, min(s + block, S) if causal else S) for s in starts]

    def read_mask():
        seen_TS = attn_mask.reshape(-1, T, S).any(0)
        pad = -T % block
        seen_NS = torch.nn.functional.pad(seen_TS, (0, 0, 0, pad)).view(-1, block, S).any(1)  # per block
        first_N = seen_NS.int().argmax(1)  # 0 where a block's rows see no key
        end_N = S - seen_NS.flip(1).int().argmax(1)
        end_N = torch.where(seen_NS.any(1), end_N, first_N + 1)
        bounds = torch.stack([first_N, end_N], 1).tolist()  # one host sync
        return [(s, min(s + block, T), lo, hi) for s, (lo, hi) in zip(starts, bounds)]

    return _MASK_SPANS(attn_mask, (T, S, block), read_mask)


_MASK_SPANS = LastResult()  # the last mask `query_blocks` read, and its blocks


def saved_scores(B: int, H: int, spans: list[tuple[int, int, int, int]]) -> int:
    """How many fp32 probabilities `short_attention` keeps for the backward pass."""
    return sum(B * H * (e - s) * (hi - lo) for s, e, lo, hi in spans)


def use_short_attention(q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, attn_mask=None, spans=None) -> bool:
    """True where `short_attention` is taken: on CPU, native bf16, or fp32 rows of more than
    FP32_BLOCK_ROWS queries; a boolean mask shared by the heads or none; and at most MAX_SCORES
    probabilities kept over the query blocks `spans` (default one block).

    In fp32 the kernel pays by its blocks; in one block it is no faster than torch's flash kernel,
    and decoding is slower. One layer's causal attention at the bench shape's heads, 2-core EPYC,
    torch 2.13 (2026-12-03), min of 40 interleaved, forward and backward: 4 x 64 tokens 0.66
    against 0.62 ms for flash, 4 x 128 2.03 against 2.25; forward only, 4 queries each against 256
    cached keys 0.067 against 0.039 ms, 4 x 8 queries 0.129 against 0.112."""
    B, H, T, _ = q_BHTD.shape
    S = k_BKSD.shape[2]
    return (
        q_BHTD.device.type == "cpu"
        and (
            (q_BHTD.dtype == torch.float32 and block_rows(T, q_BHTD.dtype) < T)  # more than one block
            or (q_BHTD.dtype == torch.bfloat16 and not emulated_bf16(q_BHTD.device))
        )
        and (attn_mask is None or (attn_mask.dtype == torch.bool and (attn_mask.dim() < 4 or attn_mask.shape[1] == 1)))
        and saved_scores(B, H, spans or [(0, T, 0, S)]) <= MAX_SCORES
    )


def _bf16_products(operand: torch.Tensor, scale: float) -> bool:
    """Whether the fp32 products of `operand` (queries or dY) scaled by `scale` may run in bf16
    fpmath mode: the operand is bf16 and the scale a power of two, so the scaled fp32 operand
    still holds bf16 values and nothing is rounded. Other scales keep plain fp32 products."""
    return operand.dtype == torch.bfloat16 and math.frexp(scale)[0] == 0.5


def _probabilities(q_XMD, k32_XSD, bias_B11TS, G, scale):
    """Softmax probabilities [X, G*T, S] in fp32, from fp32 keys. `bias` is 0 where a query may
    attend and -inf elsewhere, [B or 1, 1, 1, T, S]: added by broadcasting over each KV head and
    its G query heads (faster than a masked fill through a broadcast boolean mask: 1.8 against
    2.7 ms for scores and softmax at the shape above). The scale multiplies the [X, G*T, Dh]
    queries, not the scores."""
    X, M, _ = q_XMD.shape
    with bf16_operand_products(_bf16_products(q_XMD, scale)):
        s_XMS = torch.bmm(q_XMD.to(torch.float32, copy=True).mul_(scale), k32_XSD.transpose(1, 2))
    B = bias_B11TS.shape[0]
    s_XMS.view(B, X // B, G, M // G, -1).add_(bias_B11TS)
    return torch.softmax(s_XMS, dim=-1)


def _rows(x_XGTD, s, e):
    """Query rows [s, e) of each of the G heads, as one [X, G*(e-s), Dh] operand."""
    X, G, _, Dh = x_XGTD.shape
    return x_XGTD[:, :, s:e].reshape(X, G * (e - s), Dh)


class _ShortAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHTD, k_BKSD, v_BKSD, spans, biases, scale):
        # Autocast would run the fp32 products below in bf16 (the model calls this inside it, and
        # the backward may run inside it too): the dtypes here are chosen by hand.
        with torch.autocast(q_BHTD.device.type, enabled=False):
            return _ShortAttention._forward(ctx, q_BHTD, k_BKSD, v_BKSD, spans, biases, scale)

    @staticmethod
    def backward(ctx, dy_BHTD):
        with torch.autocast(dy_BHTD.device.type, enabled=False):
            return _ShortAttention._backward(ctx, dy_BHTD)

    @staticmethod
    def _forward(ctx, q_BHTD, k_BKSD, v_BKSD, spans, biases, scale):
        B, H, T, Dh = q_BHTD.shape
        K, S = k_BKSD.shape[1], k_BKSD.shape[2]
        G = H // K
        q_XGTD = q_BHTD.reshape(B * K, G, T, Dh)
        k_XSD = k_BKSD.reshape(B * K, S, Dh)
        v_XSD = v_BKSD.reshape(B * K, S, Dh)
        k32_XSD = k_XSD.float()
        probabilities = []  # per block: P in fp32 (for dS), and rounded (the operand of P·V and Pᵀ·dY)
        y_XGTD = q_XGTD.new_empty(q_XGTD.shape) if len(spans) > 1 else None
        for (s, e, lo, hi), bias in zip(spans, biases):
            p_XMS = _probabilities(_rows(q_XGTD, s, e), k32_XSD[:, lo:hi], bias, G, scale)
            p_low_XMS = p_XMS.to(q_BHTD.dtype)
            y_XMD = torch.bmm(p_low_XMS, v_XSD[:, lo:hi])
            if y_XGTD is None:  # one block: its output is the whole output
                y_XGTD = y_XMD.view(q_XGTD.shape)
            else:
                y_XGTD[:, :, s:e] = y_XMD.view(B * K, G, e - s, Dh)
            if any(ctx.needs_input_grad[:3]):  # else (evaluation, decoding) each block's go at once
                probabilities += [p_XMS, p_low_XMS]
        ctx.save_for_backward(q_XGTD, k_XSD, v_XSD, y_XGTD, *probabilities)
        ctx.scale, ctx.spans, ctx.shapes = scale, spans, (q_BHTD.shape, k_BKSD.shape)
        return y_XGTD.view(B, H, T, Dh)

    @staticmethod
    def _backward(ctx, dy_BHTD):
        q_XGTD, k_XSD, v_XSD, y_XGTD, *probabilities = ctx.saved_tensors
        q_shape, k_shape = ctx.shapes
        dtype = y_XGTD.dtype
        dy_XGTD = dy_BHTD.reshape(y_XGTD.shape).to(dtype)
        v32_XSD = v_XSD.float()
        one = len(ctx.spans) == 1
        # Several blocks add into dK and dV: their bf16 products are summed in fp32, rounded once.
        dq_XGTD = None if one else torch.empty_like(q_XGTD)
        dk_XSD = None if one else torch.zeros(k_XSD.shape, dtype=torch.float32, device=k_XSD.device)
        dv_XSD = None if one else torch.zeros_like(dk_XSD)
        for i, (s, e, lo, hi) in enumerate(ctx.spans):
            p_XMS, p_low_XMS = probabilities[2 * i], probabilities[2 * i + 1]
            dy_XMD = _rows(dy_XGTD, s, e)
            dv_XnD = torch.bmm(p_low_XMS.transpose(1, 2), dy_XMD)
            # dP and rowsum(dY·Y) both come from dY: scaling it (Dh wide) scales dS (S wide) for free.
            dy_scaled_XMD = dy_XMD.to(torch.float32, copy=True).mul_(ctx.scale)
            with bf16_operand_products(_bf16_products(dy_XMD, ctx.scale)):
                dp_XMS = torch.bmm(dy_scaled_XMD, v32_XSD[:, lo:hi].transpose(1, 2))
            delta_XM1 = (dy_scaled_XMD * _rows(y_XGTD, s, e).float()).sum(-1, keepdim=True)
            ds_XMS = dp_XMS.sub_(delta_XM1).mul_(p_XMS).to(dtype)
            dq_XMD = torch.bmm(ds_XMS, k_XSD[:, lo:hi])
            dk_XnD = torch.bmm(ds_XMS.transpose(1, 2), _rows(q_XGTD, s, e))
            if one:
                return dq_XMD.view(q_shape), dk_XnD.view(k_shape), dv_XnD.view(k_shape), None, None, None
            dq_XGTD[:, :, s:e] = dq_XMD.view(dq_XGTD.shape[0], -1, e - s, dq_XGTD.shape[-1])
            dk_XSD[:, lo:hi] += dk_XnD
            dv_XSD[:, lo:hi] += dv_XnD
        return dq_XGTD.view(q_shape), dk_XSD.to(dtype).view(k_shape), dv_XSD.to(dtype).view(k_shape), None, None, None


def short_attention(q_BHTD, k_BKSD, v_BKSD, attn_mask=None, is_causal=False, scale=None, spans=None) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=..., enable_gqa=True)` for
    a boolean [B or 1, 1, T, S] mask (True = may attend) or a causal one, worked through in the
    query blocks `spans` (`query_blocks`; by default its own choice)."""
    B, H, T, Dh = q_BHTD.shape
    S = k_BKSD.shape[2]
    if spans is None:
        spans = query_blocks(T, S, attn_mask, is_causal, dtype=q_BHTD.dtype)
    biases = block_biases(attn_mask, is_causal, T, S, spans, q_BHTD.device)
    scale = Dh**-0.5 if scale is None else scale
    return _ShortAttention.apply(q_BHTD, k_BKSD, v_BKSD, spans, biases, scale)


def block_biases(attn_mask, is_causal: bool, T: int, S: int, spans, device: torch.device) -> list[torch.Tensor]:
    """The additive fp32 mask of each query block of `spans`, [B or 1, 1, 1, rows, keys]: 0 where the
    query may attend, -inf elsewhere.

    Every layer of a forward passes the same mask (or none), so the biases are built once a
    forward (`LastResult`) and only read by the kernel. Building them took 1.2 ms a layer at
    1 x 1,024 causal tokens (eight blocks of 128 queries; 0.05 ms at 256 tokens, one block), on the
    2-core AVX512-BF16 EPYC, torch 2.13; whole bench/train_step.py bf16 steps there, min (median)
    of 20 interleaved, two runs: 358.2 (371.9) and 398.1 (414.7) ms against 361.7 (379.3) and
    406.2 (421.6) built a layer.
    """

    def build():
        mask = attn_mask
        if mask is None:
            mask = torch.ones(T, S, dtype=torch.bool, device=device)
            if is_causal:  # aligned to the top left, as in SDPA
                mask = mask.tril()
        while mask.dim() < 4:  # [T, S] -> [1, 1, T, S]
            mask = mask.unsqueeze(0)
        biases = []
        for s, e, lo, hi in spans:
            allowed = mask[..., s:e, lo:hi]
            bias = torch.zeros(allowed.shape, dtype=torch.float32, device=device)
            biases.append(bias.masked_fill_(~allowed, float("-inf")).unsqueeze(1))
        return biases

    key = (T, S, attn_mask is None and is_causal, tuple(spans), device)
    return _BLOCK_BIASES(attn_mask, key, build)


_BLOCK_BIASES = LastResult()  # the last mask's (or causal rows') biases for `short_attention`


def scaled_dot_product_attention(q_BHTD, k_BKSD, v_BKSD, attn_mask=None, is_causal=False, enable_gqa=False):
    """The model's attention kernel: `short_attention` where `use_short_attention` holds for its
    query blocks, else `F.scaled_dot_product_attention` (through model/cpu_bf16.py where bf16 is
    emulated)."""
    B, H, T, _ = q_BHTD.shape
    S = k_BKSD.shape[2]
    causal = query_blocks(T, S, is_causal=True, dtype=q_BHTD.dtype)
    # A first check against causal blocks, which needs no pass over the mask; then the blocks the
    # mask allows are read off it and counted.
    if use_short_attention(q_BHTD, k_BKSD, attn_mask, causal):
        spans = (
            causal if attn_mask is None and is_causal else query_blocks(T, S, attn_mask, is_causal, dtype=q_BHTD.dtype)
        )
        if saved_scores(B, H, spans) <= MAX_SCORES:
            return short_attention(q_BHTD, k_BKSD, v_BKSD, attn_mask, is_causal, spans=spans)
    return _sdpa(q_BHTD, k_BKSD, v_BKSD, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
