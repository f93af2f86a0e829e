"""Marin attention: GQA with local/global layers, QK-norm, partial RoPE, XSA and a head gate.

Shape legend: B batch, T query length, S key length, D d_model, H query heads,
K KV heads in use on this layer, Dh head dim.

Masking works from two per-token integers, the packed-document id and the position inside the
document, so one rule covers training on packed rows, left-padded batches and a KV cache:
a query attends to a key iff same document, key position <= query position, and (local layers)
query position - key position < window.

Local layers of long rows attend block by block (`banded_attention`): one masked SDPA over the
whole row computes all T x T scores although each query may see at most `window` keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from marinlm.model.config import AttentionConfig
from marinlm.model.cpu_attention import scaled_dot_product_attention
from marinlm.model.cpu_bf16 import Linear
from marinlm.model.layers import ConvState, SConv, qk_transform, rope_cos_sin, trunc_normal_


def attention_mask(
    doc_q_BT: torch.Tensor,
    pos_q_BT: torch.Tensor,
    doc_k_BS: torch.Tensor,
    pos_k_BS: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Boolean mask [B, 1, T, S], True where the query may attend to the key."""
    same_doc = doc_q_BT.unsqueeze(-1) == doc_k_BS.unsqueeze(-2)
    distance = pos_q_BT.unsqueeze(-1) - pos_k_BS.unsqueeze(-2)
    allowed = same_doc & (distance >= 0)
    if window is not None:
        allowed &= distance < window
    return allowed.unsqueeze(1)


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

    Measured on the 2-core AVX2 CPU, torch 2.13 fp32, forward and backward of one local layer
    against masked SDPA over the whole row (torch's flash kernel), best of 7:
    - `tiny` (8 x 256 tokens, window 64, 4 heads of 32): blocks of 16 / 32 / 64 / 128 took 8.4 /
      7.4 / 8.7 / 10.2 ms against 9.9;
    - `small` (2 x 1,024, window 256, 6 heads of 64): 32 / 64 / 128 / 256 took 36.1 / 34.2 / 38.3 /
      48.2 ms against 87-90;
    - the hero's window (1 x 4,096, window 2,048, 4 heads of 64): 64 / 128 / 256 / 512 took 357 /
      324 / 294 / 330 ms against 502.
    Hence a block near 4·sqrt(window), a power of two (32, 64, 256 above), taken where it computes
    at most 80% of the T x T scores. Not measured on GPUs, where the whole-row SDPA is kept.
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
    `window`): a few strided copies and adds, where `unfold` + `reshape` left its backward to
    torch's generic `unfold_backward`. For one key tensor of the `tiny` quickstart model (8 x 256
    tokens, 2 heads of 32, window 64, blocks of 32), forward and backward on the 2-core EPYC, best
    of 100: bf16 135 against 599 us, fp32 134 against 382 us.
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


def banded_attention(q_BHTD: torch.Tensor, k_BKTD: torch.Tensor, v_BKTD: torch.Tensor, mask: BandedMask):
    """Sliding-window attention as one SDPA over the [B * blocks] query blocks of `mask`, each
    against its `window + block` keys: T x (window + block) scores instead of T x T."""
    B, H, T, Dh = q_BHTD.shape
    K = k_BKTD.shape[1]
    block, window = mask.block, mask.window
    blocks = mask.allowed_X1QS.shape[0] // B
    pad = blocks * block - T
    q_XHQD = F.pad(q_BHTD, (0, 0, 0, pad)).view(B, H, blocks, block, Dh).transpose(1, 2)

    y_XHQD = scaled_dot_product_attention(
        q_XHQD.reshape(B * blocks, H, block, Dh),
        _KeyWindows.apply(k_BKTD, window, block, blocks),
        _KeyWindows.apply(v_BKTD, window, block, blocks),
        attn_mask=mask.allowed_X1QS,
        enable_gqa=H != K,
    )
    return y_XHQD.view(B, blocks, H, block, Dh).transpose(1, 2).reshape(B, H, blocks * block, Dh)[:, :, :T]


@dataclass
class LayerCache:
    """One layer's decoding state: keys/values after SConv, QK-norm and RoPE, with their doc ids
    and positions. Local layers keep only the last `window` entries."""

    k_BKSD: torch.Tensor
    v_BKSD: torch.Tensor
    doc_BS: torch.Tensor
    pos_BS: torch.Tensor
    window: int | None
    conv_k: ConvState | None = None
    conv_v: ConvState | None = None
    conv_attn: ConvState | None = None
    conv_mlp: ConvState | None = None

    def append(self, k_BKTD, v_BKTD, doc_BT, pos_BT) -> None:
        self.k_BKSD = torch.cat([self.k_BKSD, k_BKTD], dim=2)
        self.v_BKSD = torch.cat([self.v_BKSD, v_BKTD], dim=2)
        self.doc_BS = torch.cat([self.doc_BS, doc_BT], dim=1)
        self.pos_BS = torch.cat([self.pos_BS, pos_BT], dim=1)

    def select(self, rows: torch.Tensor) -> LayerCache:
        """A cache holding the given batch rows (repeats allowed): one context, many continuations."""

        def conv(state):
            return None if state is None else ConvState(state.x_BKC[rows], state.doc_BK[rows])

        return LayerCache(
            self.k_BKSD[rows],
            self.v_BKSD[rows],
            self.doc_BS[rows],
            self.pos_BS[rows],
            self.window,
            conv(self.conv_k),
            conv(self.conv_v),
            conv(self.conv_attn),
            conv(self.conv_mlp),
        )

    def trim(self) -> None:
        if self.window is not None and self.k_BKSD.shape[2] > self.window:
            self.k_BKSD = self.k_BKSD[:, :, -self.window :]
            self.v_BKSD = self.v_BKSD[:, :, -self.window :]
            self.doc_BS = self.doc_BS[:, -self.window :]
            self.pos_BS = self.pos_BS[:, -self.window :]


class Attention(nn.Module):
    def __init__(self, config: AttentionConfig, d_model: int, *, is_global: bool, sconv_sites, sconv_kernel, init_std):
        super().__init__()
        self.config = config
        self.init_std = init_std
        self.is_global = is_global
        c = config
        self.num_heads, self.head_dim = c.num_heads, c.head_dim
        self.num_kv_stored = c.num_kv_heads
        self.num_kv = c.global_kv_heads() if is_global else c.num_kv_heads
        self.window = None if is_global else c.sliding_window
        self.use_rope = (c.rope_global if is_global else c.rope_local) and c.rope_dim > 0
        self.q_proj = Linear(d_model, c.num_heads * c.head_dim)
        self.k_proj = Linear(d_model, c.num_kv_heads * c.head_dim)
        self.v_proj = Linear(d_model, c.num_kv_heads * c.head_dim)
        self.o_proj = Linear(c.num_heads * c.head_dim, d_model)
        kv_width = c.num_kv_heads * c.head_dim
        self.sconv_k = SConv(kv_width, sconv_kernel) if "k" in sconv_sites else None
        self.sconv_v = SConv(kv_width, sconv_kernel) if "v" in sconv_sites else None
        self.gate = Linear(d_model, c.num_heads) if c.head_gate else None
        if c.qk_norm_gain:
            self.q_norm_weight = nn.Parameter(torch.empty(c.head_dim))
            self.k_norm_weight = nn.Parameter(torch.empty(c.head_dim))
        else:
            self.q_norm_weight = self.k_norm_weight = None

    def reset_parameters(self) -> None:
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            trunc_normal_(linear.weight, self.init_std)
        if self.gate is not None:
            nn.init.zeros_(self.gate.weight)  # g = 2*sigmoid(0) = 1 at start
        if self.q_norm_weight is not None:
            nn.init.ones_(self.q_norm_weight)
            nn.init.ones_(self.k_norm_weight)

    def forward(
        self,
        a_BTD: torch.Tensor,
        doc_BT: torch.Tensor | None,
        pos_BT: torch.Tensor,
        mask: torch.Tensor | None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """Attend. `mask` is the precomputed [B,1,T,T] mask for this layer kind, a `BandedMask`, or
        None for plain causal attention; with `cache`, the mask is built against the cached keys."""
        B, T, _ = a_BTD.shape
        H, Dh, K = self.num_heads, self.head_dim, self.num_kv
        q_BTHD = self.q_proj(a_BTD).view(B, T, H, Dh)
        k_BTC = self.k_proj(a_BTD)
        v_BTC = self.v_proj(a_BTD)
        if self.sconv_k is not None:
            k_BTC, new_state = self.sconv_k(k_BTC, doc_BT, None if cache is None else cache.conv_k)
            if cache is not None:
                cache.conv_k = new_state
        if self.sconv_v is not None:
            v_BTC, new_state = self.sconv_v(v_BTC, doc_BT, None if cache is None else cache.conv_v)
            if cache is not None:
                cache.conv_v = new_state
        # Global layers read the first K of the stored KV heads (Marin: 6 of 12).
        k_BTKD = k_BTC.view(B, T, self.num_kv_stored, Dh)[:, :, :K]
        v_BTKD = v_BTC.view(B, T, self.num_kv_stored, Dh)[:, :, :K]
        # QK-norm (with Qwen3's gains where configured), RoPE and qk_mult: one fused node for the
        # queries and one for the keys.
        cos = sin = None
        if self.use_rope:
            cos, sin = rope_cos_sin(pos_BT, self.config.rope_dim, self.config.rope_theta)
        norm = self.config.qk_norm
        q_BTHD = qk_transform(
            q_BTHD, normalize=norm, gain=self.q_norm_weight, cos_BTR=cos, sin_BTR=sin, mult=self.config.qk_mult
        )
        k_BTKD = qk_transform(k_BTKD, normalize=norm, gain=self.k_norm_weight, cos_BTR=cos, sin_BTR=sin)
        q_BHTD = q_BTHD.transpose(1, 2)
        k_BKTD = k_BTKD.transpose(1, 2)
        v_BKTD = v_BTKD.transpose(1, 2)

        if cache is not None:
            cache.append(k_BKTD, v_BKTD, doc_BT, pos_BT)
            k_BKSD, v_BKSD = cache.k_BKSD, cache.v_BKSD
            mask = attention_mask(doc_BT, pos_BT, cache.doc_BS, cache.pos_BS, self.window)
        else:
            k_BKSD, v_BKSD = k_BKTD, v_BKTD
        k_BKSD, v_BKSD = k_BKSD.to(q_BHTD.dtype), v_BKSD.to(q_BHTD.dtype)
        if isinstance(mask, BandedMask):
            y_BHTD = banded_attention(q_BHTD, k_BKSD, v_BKSD, mask)
        else:
            y_BHTD = scaled_dot_product_attention(
                q_BHTD, k_BKSD, v_BKSD, attn_mask=mask, is_causal=mask is None, enable_gqa=H != K
            )
        if cache is not None:
            cache.trim()

        if self.config.xsa:
            # Exclusive self-attention: drop the part of each head's output along its own value.
            y_BKGTD = y_BHTD.view(B, K, H // K, T, Dh)
            v_BK1TD = v_BKTD.unsqueeze(2).to(y_BKGTD.dtype)
            dot = (y_BKGTD * v_BK1TD).sum(-1, keepdim=True)
            norm_sq = (v_BK1TD * v_BK1TD).sum(-1, keepdim=True)
            y_BHTD = (y_BKGTD - dot / (norm_sq + 1e-6) * v_BK1TD).view(B, H, T, Dh)
        y_BTHD = y_BHTD.transpose(1, 2)
        if self.gate is not None:
            g_BTH = 2.0 * torch.sigmoid(self.gate(a_BTD))
            y_BTHD = y_BTHD * g_BTH.unsqueeze(-1).to(y_BTHD.dtype)
        return self.o_proj(y_BTHD.reshape(B, T, H * Dh))

    def empty_cache(self, batch: int, device, dtype) -> LayerCache:
        shape = (batch, self.num_kv, 0, self.head_dim)
        empty_ids = torch.zeros(batch, 0, dtype=torch.long, device=device)
        cache = LayerCache(
            torch.zeros(shape, device=device, dtype=dtype),
            torch.zeros(shape, device=device, dtype=dtype),
            empty_ids,
            empty_ids.clone(),
            self.window,
        )
        if self.sconv_k is not None:
            cache.conv_k = self.sconv_k.empty_state(batch, device, dtype)
        if self.sconv_v is not None:
            cache.conv_v = self.sconv_v.empty_state(batch, device, dtype)
        return cache
