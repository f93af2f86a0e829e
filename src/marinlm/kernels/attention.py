"""Fused QK transform, block-banded local attention and the CPU attention kernel, for `Attention`.

Shape legend: B batch, T query length, S key length, H query heads, K KV heads, Dh head dim,
R RoPE pairs, X = B * blocks query blocks.

`FusedAttention` keeps the reference's parameters and maths:
- queries and keys go through `_QKTransform` (QK-norm, gain, qk_mult and RoPE as one autograd
  node in fp32, rounded once), where autograd of the same maths builds ~20 nodes forward and
  ~25 backward;
- local layers of long rows on CPU attend block by block (`banded_attention`): one masked SDPA
  over the whole row computes all T x T scores although each query sees at most `window` keys;
- the scores go through `kernels.cpu_attention` on CPU (its docstring says where it is taken).
`tests/test_kernels.py` checks it against the reference `Attention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from marinlm.kernels import cpu_attention
from marinlm.model.attention import Attention
from marinlm.model.context import ForwardContext
from marinlm.model.layers import compute_dtype


def _leading_dims(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(t.dim() - 1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first 2R dims of each head by the angles (split-half pairing, as in HF
    Llama/Qwen, or `interleaved` adjacent pairs, as `model.layers.apply_rope`); keep the rest.
    `sin` negated rotates back (the backward's transpose)."""
    half = cos.shape[-1]
    if interleaved:
        pairs = x[..., : 2 * half].unflatten(-1, (half, 2))
        x1, x2 = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack([torch.addcmul(x1 * cos, x2, sin, value=-1), torch.addcmul(x2 * cos, x1, sin)], -1)
        return torch.cat([rotated.flatten(-2), x[..., 2 * half :]], -1)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat(
        [torch.addcmul(x1 * cos, x2, sin, value=-1), torch.addcmul(x2 * cos, x1, sin), x[..., 2 * half :]], -1
    )


class _QKTransform(torch.autograd.Function):
    """y = rope(rmsnorm(x) * gain * mult) in fp32, rounded once to x's dtype; each part optional."""

    @staticmethod
    def forward(ctx, x, gain, cos, sin, mult, normalize, eps, interleaved):
        ct = compute_dtype(x)
        n = x.to(ct)
        rstd = None
        if normalize:
            rstd = torch.rsqrt(n.square().mean(-1, keepdim=True).add_(eps))
            n = n * rstd
        factor = gain.to(ct) * mult if gain is not None else mult
        y = n * factor if gain is not None or mult != 1 else n
        if cos is not None:
            y = _rotate(y, cos, sin, interleaved)
        ctx.save_for_backward(x, rstd, gain, cos, sin)
        ctx.mult, ctx.normalize, ctx.interleaved = mult, normalize, interleaved
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, rstd, gain, cos, sin = ctx.saved_tensors
        ct = compute_dtype(x)
        g = dy.to(ct)
        if cos is not None:
            g = _rotate(g, cos, -sin, ctx.interleaved)
        n = x.to(ct) * rstd if ctx.normalize else x.to(ct)
        dgain = None
        if gain is not None:
            if ctx.needs_input_grad[1]:
                dgain = ((g * n).sum(_leading_dims(g)) * ctx.mult).to(gain.dtype)
            g = g * (gain.to(ct) * ctx.mult)
        elif ctx.mult != 1:
            g = g * ctx.mult
        if ctx.normalize:
            g = (g - n * (g * n).mean(-1, keepdim=True)).mul_(rstd)
        return g.to(x.dtype), dgain, None, None, None, None, None, None


@dataclass
class BandedMask:
    """A local layer's mask cut into query blocks for `banded_attention`: block j holds queries
    [j*block, (j+1)*block) and the `window + block` keys [j*block - window, (j+1)*block) that hold
    every key they may see (within a document, positions advance one per token)."""

    allowed_X1QS: torch.Tensor  # [B * blocks, 1, block, window + block]
    block: int
    window: int


def band_block(T: int, window: int, device: torch.device) -> int | None:
    """The query block `banded_attention` uses for rows of T tokens, or None where one masked SDPA
    over the whole row is kept.

    A block near 4·sqrt(window), a power of two, measured fastest on CPU (`bench/attention.py`;
    docs/performance.md), taken where it computes at most 80% of the T x T scores. Not measured
    on GPUs, where the whole-row SDPA is kept.
    """
    if device.type != "cpu":
        return None
    block = 1 << max(4, round(math.log2(4 * math.sqrt(window))))
    blocks = -(-T // block)
    return block if blocks * block * (window + block) <= 0.8 * T * T else None


def banded_mask(doc_BT: torch.Tensor, pos_BT: torch.Tensor, window: int, block: int) -> BandedMask:
    """`attention_mask(doc, pos, doc, pos, window)` in the blocks of `BandedMask`.

    The row is padded at the end to whole blocks and the keys also at the front by `window`; no
    real query sees a padding key, and each padding query sees only its own (zero) key, so that
    no softmax row is empty."""
    B, T = doc_BT.shape
    blocks = -(-T // block)
    pad = blocks * block - T
    real_BT = torch.ones_like(doc_BT, dtype=torch.bool)

    def queries(x_BT, value):  # [B, blocks, block]
        return F.pad(x_BT, (0, pad), value=value).view(B, blocks, block)

    def keys(x_BT, value):  # [B, blocks, window + block]
        return F.pad(x_BT, (window, pad), value=value).unfold(1, window + block, block)

    distance_BNQS = queries(pos_BT, 0).unsqueeze(-1) - keys(pos_BT, 0).unsqueeze(-2)
    allowed_BNQS = (
        (queries(doc_BT, 0).unsqueeze(-1) == keys(doc_BT, 0).unsqueeze(-2))
        & (distance_BNQS >= 0)
        & (distance_BNQS < window)
        & keys(real_BT, False).unsqueeze(-2)
    )
    slot = torch.arange(window + block, device=doc_BT.device)
    own_QS = slot == window + torch.arange(block, device=doc_BT.device).unsqueeze(-1)
    allowed_BNQS = torch.where(queries(real_BT, False).unsqueeze(-1), allowed_BNQS, own_QS)
    return BandedMask(allowed_BNQS.reshape(B * blocks, 1, block, window + block), block, window)


class _KeyWindows(torch.autograd.Function):
    """[B, K, T, Dh] -> [B * blocks, K, window + block, Dh]: query block j's keys, padded positions
    [j*block, j*block + window + block) of the row with `window` zeros in front, copied out.

    The windows overlap, so the backward sums each key's gradient over the windows that hold it.
    Built from whole blocks of the padded row (and a part block when `block` does not divide
    `window`): a few strided copies and adds, where `unfold` leaves its backward to torch's slower
    generic `unfold_backward`.
    """

    @staticmethod
    def forward(ctx, x_BKTD, window: int, block: int, blocks: int):
        B, K, T, Dh = x_BKTD.shape
        whole, part = divmod(window + block, block)
        padded = blocks + whole - 1 + (part > 0)  # blocks of the padded row that the windows read
        x_BKPQD = F.pad(x_BKTD, (0, 0, window, padded * block - window - T)).view(B, K, padded, block, Dh)
        out_BNKWD = x_BKTD.new_empty(B, blocks, K, window + block, Dh)
        for j in range(whole):
            out_BNKWD[:, :, :, j * block : (j + 1) * block] = x_BKPQD[:, :, j : j + blocks].transpose(1, 2)
        if part:
            out_BNKWD[:, :, :, whole * block :] = x_BKPQD[:, :, whole : whole + blocks, :part].transpose(1, 2)
        ctx.shape = (B, K, T, Dh, window, block, blocks, whole, part, padded)
        return out_BNKWD.view(B * blocks, K, window + block, Dh)

    @staticmethod
    def backward(ctx, dy_XKWD):
        B, K, T, Dh, window, block, blocks, whole, part, padded = ctx.shape
        dy_BNKWD = dy_XKWD.reshape(B, blocks, K, window + block, Dh)
        dx_BKPQD = dy_XKWD.new_zeros(B, K, padded, block, Dh)
        for j in range(whole):
            dx_BKPQD[:, :, j : j + blocks] += dy_BNKWD[:, :, :, j * block : (j + 1) * block].transpose(1, 2)
        if part:
            dx_BKPQD[:, :, whole : whole + blocks, :part] += dy_BNKWD[:, :, :, whole * block :].transpose(1, 2)
        return dx_BKPQD.view(B, K, padded * block, Dh)[:, :, window : window + T], None, None, None


def banded_attention(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, mask: BandedMask, memo=None):
    """Sliding-window attention as one SDPA over the [B * blocks] query blocks of `mask`, each
    against its `window + block` keys: T x (window + block) scores instead of T x T."""
    B, H, T, Dh = q_BHTD.shape
    K = k_BKTD.shape[1]
    block, window = mask.block, mask.window
    blocks = mask.allowed_X1QS.shape[0] // B
    pad = blocks * block - T
    q_XHQD = F.pad(q_BHTD, (0, 0, 0, pad)).view(B, H, blocks, block, Dh).transpose(1, 2)

    y_XHQD = cpu_attention.scaled_dot_product_attention(
        q_XHQD.reshape(B * blocks, H, block, Dh),
        _KeyWindows.apply(k_BKTD, window, block, blocks),
        _KeyWindows.apply(v_BKTD, window, block, blocks),
        attn_mask=mask.allowed_X1QS,
        enable_gqa=H != K,
        memo=memo,
    )
    return y_XHQD.view(B, blocks, H, block, Dh).transpose(1, 2).reshape(B, H, blocks * block, Dh)[:, :, :T]


def _split_keys(t_BHSD: torch.Tensor, P: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first P keys (or values) and the rest, each contiguous for torch's flash kernel."""
    return t_BHSD[:, :, :P].contiguous(), t_BHSD[:, :, P:].contiguous()


class _CausalTail(torch.autograd.Function):
    """`Attention.attend_causal_tail` on CPU from torch's flash kernel: the S - T keys every query
    sees without a mask, the last T causally, and the two merged by their log-sum-exp; the backward
    runs the flash backward on each part against the merged output and log-sum-exp. One masked
    attention over all S keys instead falls to torch's path that builds the T x S bias (the flash
    kernel takes a causal flag, not a shifted causal mask). Heads repeated for grouped KV heads."""

    @staticmethod
    def forward(ctx, q_BHTD, k_BHSD, v_BHSD):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        P = k_BHSD.shape[2] - q_BHTD.shape[2]
        (k0, k1), (v0, v1) = _split_keys(k_BHSD, P), _split_keys(v_BHSD, P)
        y_BHTD, lse_BHT = flash(q_BHTD, k1, v1, 0.0, True)[:2]
        if P:
            y0_BHTD, lse0_BHT = flash(q_BHTD, k0, v0, 0.0, False)[:2]
            lse = torch.logaddexp(lse0_BHT, lse_BHT)
            w0, w1 = (lse0_BHT - lse).exp().unsqueeze(-1), (lse_BHT - lse).exp().unsqueeze(-1)
            y = y0_BHTD.float() * w0 + y_BHTD.float() * w1
            y_BHTD, lse_BHT = y.to(q_BHTD.dtype), lse
        ctx.save_for_backward(q_BHTD, k_BHSD, v_BHSD, y_BHTD, lse_BHT)
        return y_BHTD

    @staticmethod
    def backward(ctx, dy_BHTD):
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k, v, y, lse = ctx.saved_tensors
        P = k.shape[2] - q.shape[2]
        (k0, k1), (v0, v1) = _split_keys(k, P), _split_keys(v, P)
        dy = dy_BHTD.contiguous()
        dq, dk, dv = backward(dy, q, k1, v1, y, lse, 0.0, True)
        if P:
            dq0, dk0, dv0 = backward(dy, q, k0, v0, y, lse, 0.0, False)
            dq, dk, dv = dq + dq0, torch.cat([dk0, dk], 2), torch.cat([dv0, dv], 2)
        return dq, dk, dv


def causal_tail_attention(q_BHTD, k_BKSD, v_BKSD) -> torch.Tensor:
    """`Attention.attend_causal_tail` through `_CausalTail` (CPU, no autocast inside)."""
    H, K = q_BHTD.shape[1], k_BKSD.shape[1]
    dtype = q_BHTD.dtype
    k, v = (t.to(dtype).repeat_interleave(H // K, 1) if H != K else t.to(dtype) for t in (k_BKSD, v_BKSD))
    with torch.autocast("cpu", enabled=False):
        return _CausalTail.apply(q_BHTD.contiguous(), k, v)


def fused_qk_transform(
    x_BTHD, *, normalize: bool, gain=None, cos_BTR=None, sin_BTR=None, mult=1.0, eps=1e-6, interleaved=False
):
    """`model.layers.qk_transform` as one autograd node."""
    rope = cos_BTR is not None and cos_BTR.shape[-1] > 0
    if not normalize and gain is None and mult == 1 and not rope:
        return x_BTHD
    cos = cos_BTR.unsqueeze(2) if rope else None
    sin = sin_BTR.unsqueeze(2) if rope else None
    return _QKTransform.apply(x_BTHD, gain, cos, sin, mult, normalize, eps, interleaved)


class FusedAttention(Attention):
    def qk(self, x_BTHD, gain, cos, sin, mult: float) -> torch.Tensor:
        c = self.config
        interleaved = c.rope_pairs == "interleaved"
        return fused_qk_transform(
            x_BTHD, normalize=c.qk_norm, gain=gain, cos_BTR=cos, sin_BTR=sin, mult=mult, interleaved=interleaved
        )

    def layer_mask(self, ctx: ForwardContext):
        """A `BandedMask` for a local layer of a long row on CPU, else the reference's mask."""
        T = ctx.doc_BT.shape[1]
        if self.window is not None and ctx.derived and (ctx.packed or self.window < T):
            block = band_block(T, self.window, ctx.doc_BT.device)
            if block is not None:
                return ctx.memo(
                    ("banded", self.window, block), lambda: banded_mask(ctx.doc_BT, ctx.pos_BT, self.window, block)
                )
        return super().layer_mask(ctx)

    def attend_causal_tail(self, q_BHTD, k_BKSD, v_BKSD) -> torch.Tensor:
        if q_BHTD.device.type != "cpu":
            return super().attend_causal_tail(q_BHTD, k_BKSD, v_BKSD)
        return causal_tail_attention(q_BHTD, k_BKSD, v_BKSD)

    def attend(self, q_BHTD, k_BKSD, v_BKSD, ctx: ForwardContext, mask) -> torch.Tensor:
        memo = None
        if not ctx.decoding:  # this forward's masks are shared by the layers of one kind

            def memo(key, build, kind=("global",) if self.is_global else ("local", self.window)):
                return ctx.memo((kind, key), build)

        if isinstance(mask, BandedMask):
            return banded_attention(q_BHTD, k_BKSD, v_BKSD, mask, memo)
        return cpu_attention.scaled_dot_product_attention(
            q_BHTD,
            k_BKSD,
            v_BKSD,
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=q_BHTD.shape[1] != k_BKSD.shape[1],
            memo=memo,
        )
