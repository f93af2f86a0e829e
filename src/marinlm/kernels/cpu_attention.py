"""bf16 and fp32 attention on CPU: two batched GEMMs around an fp32 softmax, in blocks of queries.

Shape legend: B batch, H query heads, K KV heads, G = H / K query heads per KV head, T query
length, S key length, Dh head dim, X = B*K batched products.

In bf16, rows of up to LONG_ROWS queries are one block, longer ones go in blocks of BLOCK_ROWS;
in fp32, rows of more than FP32_BLOCK_ROWS queries go in blocks of it, shorter ones to torch's
flash kernel, which is as fast there (`block_rows`). Each block attends only to the keys its
queries may see (`query_blocks`): a causal row computes about half its scores, and each block's
scores stay in cache. The kernel keeps its fp32 probabilities for the backward pass, so it is
taken up to MAX_SCORES of them; beyond that torch's flash kernel, which recomputes them.

Each KV head's G query heads are stacked into one [G*T, Dh] operand, so grouped-query attention
runs without repeating keys or values. Scores and softmax are fp32; probabilities are rounded to
the input dtype only as operands of the products with V and dY. For bf16 inputs the two
fp32-result products (Q·Kᵀ and dY·Vᵀ) have operands that hold bf16 values and run in oneDNN's
bf16 fpmath mode (`bf16_operand_products`), when the scale is a power of two so that the scaled
operands still hold bf16 values. The backward is written out (dV = Pᵀ·dY, dP = dY·Vᵀ,
dS = P·(dP − rowsum(dY·Y)), dQ = dS·K, dK = dSᵀ·Q). Both passes run with autocast off, so that
the fp32 products are not lowered to bf16. The mask enters as an additive fp32 bias broadcast
over the heads, and the scale as a factor on the queries and on dY.

`tests/test_cpu_attention.py` holds its error within 2x of torch's kernel; `bench/attention.py`
times it against torch's SDPA. The measurements behind every constant are in docs/performance.md.
"""

from __future__ import annotations

import math

import torch

from marinlm.kernels.bf16 import bf16_operand_products
from marinlm.kernels.bf16 import scaled_dot_product_attention as _sdpa
from marinlm.utils.device import emulated_bf16

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

    In fp32 the products cost 4-5x what they cost in bf16, so skipping the keys a block cannot see
    pays even at short rows; blocks of 64 measured fastest. The price is the kept probabilities,
    4 bytes each (`saved_scores`). Measured in docs/performance.md."""
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
    memo=None,
) -> list[tuple[int, int, int, int]]:
    """(start, end, first key, end key) for each block of queries: rows [start, end) attend to
    keys [first key, end key) of the S keys at most.

    A causal row sees no key after its own, so the block of queries [s, e) needs only the first e
    keys. With a boolean mask the keys any row of the block may see are read off the mask (one
    pass over it, and one host sync); with `memo` (a forward's `ForwardContext.memo`, keyed by the
    caller for this mask) that pass is made once a forward, since every layer of a kind shares its
    mask. For rows packed with documents a block also skips the keys of the documents before its
    own. While torch.compile traces, reading the mask would be a graph break, and blocks take all
    keys. By default a block has `block_rows(T, dtype)` queries."""
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

    return read_mask() if memo is None else memo(("query_blocks", T, S, block), read_mask)


def saved_scores(B: int, H: int, spans: list[tuple[int, int, int, int]]) -> int:
    """How many fp32 probabilities `short_attention` keeps for the backward pass."""
    return sum(B * H * (e - s) * (hi - lo) for s, e, lo, hi in spans)


def use_short_attention(q_BHTD: torch.Tensor, k_BKSD: torch.Tensor, attn_mask=None, spans=None) -> bool:
    """True where `short_attention` is taken: on CPU, native bf16, or fp32 rows of more than
    FP32_BLOCK_ROWS queries; a boolean mask shared by the heads or none; and at most MAX_SCORES
    probabilities kept over the query blocks `spans` (default one block). In one fp32 block the
    kernel is no faster than torch's flash kernel, and decoding is slower."""
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
    its G query heads (cheaper than a masked fill through a broadcast boolean mask, which writes
    the scores once more). The scale multiplies the [X, G*T, Dh] queries, not the scores."""
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


def short_attention(
    q_BHTD, k_BKSD, v_BKSD, attn_mask=None, is_causal=False, scale=None, spans=None, memo=None
) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal=..., enable_gqa=True)` for
    a boolean [B or 1, 1, T, S] mask (True = may attend) or a causal one, worked through in the
    query blocks `spans` (`query_blocks`; by default its own choice)."""
    B, H, T, Dh = q_BHTD.shape
    S = k_BKSD.shape[2]
    if spans is None:
        spans = query_blocks(T, S, attn_mask, is_causal, dtype=q_BHTD.dtype, memo=memo)
    biases = block_biases(attn_mask, is_causal, T, S, spans, q_BHTD.device, memo)
    scale = Dh**-0.5 if scale is None else scale
    return _ShortAttention.apply(q_BHTD, k_BKSD, v_BKSD, spans, biases, scale)


def block_biases(
    attn_mask, is_causal: bool, T: int, S: int, spans, device: torch.device, memo=None
) -> list[torch.Tensor]:
    """The additive fp32 mask of each query block of `spans`, [B or 1, 1, 1, rows, keys]: 0 where the
    query may attend, -inf elsewhere; built once a forward with `memo`."""

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

    key = ("block_biases", T, S, attn_mask is None and is_causal, tuple(spans), device)
    return build() if memo is None else memo(key, build)


def scaled_dot_product_attention(q_BHTD, k_BKSD, v_BKSD, attn_mask=None, is_causal=False, enable_gqa=False, memo=None):
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
            causal
            if attn_mask is None and is_causal
            else query_blocks(T, S, attn_mask, is_causal, dtype=q_BHTD.dtype, memo=memo)
        )
        if saved_scores(B, H, spans) <= MAX_SCORES:
            return short_attention(q_BHTD, k_BKSD, v_BKSD, attn_mask, is_causal, spans=spans, memo=memo)
    return _sdpa(q_BHTD, k_BKSD, v_BKSD, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa)
