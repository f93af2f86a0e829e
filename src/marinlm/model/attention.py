"""Marin attention: GQA with local/global layers, QK-norm, partial RoPE, XSA and a head gate.

Shape legend: B batch, T query length, S key length, D d_model, H query heads,
K KV heads in use on this layer, Dh head dim.

    q, k, v = W_q a, SConv_k(W_k a), SConv_v(W_v a)         # global layers read the first K KV heads
    q, k    = RoPE(QKNorm(q) * qk_mult), RoPE(QKNorm(k))     # RoPE on the first rope_dim dims, or none
    y       = softmax(q kᵀ / √Dh + mask) v                   # causal, document and window mask
    y       = y - (y·v / |v|²) v                             # XSA: drop the part along the own value
    out     = W_o (2 sigmoid(W_gate a) * y)                  # per-head gate
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from marinlm.model.config import AttentionConfig
from marinlm.model.context import ForwardContext, attention_mask
from marinlm.model.layers import ConvState, SConv, qk_transform, trunc_normal_


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


class HeadSlice(nn.Module):
    """The first `num_used` heads of a [..., heads * head_dim] tensor: Marin's global layers read 6
    of their 12 stored KV heads. A module of its own so that tensor parallelism, whose ranks each
    hold a slice of the stored heads, can fetch the used heads each rank needs
    (`marinlm.parallel.tensor_parallel`)."""

    def __init__(self, num_used: int, head_dim: int):
        super().__init__()
        self.num_used, self.head_dim = num_used, head_dim

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        return x_BTC[..., : self.num_used * self.head_dim]


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
        self.q_proj = nn.Linear(d_model, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, d_model, bias=False)
        kv_width = c.num_kv_heads * c.head_dim
        self.sconv_k = SConv(kv_width, sconv_kernel) if "k" in sconv_sites else None
        self.sconv_v = SConv(kv_width, sconv_kernel) if "v" in sconv_sites else None
        self.gate = nn.Linear(d_model, c.num_heads, bias=False) if c.head_gate else None
        self.kv_in_use = HeadSlice(self.num_kv, c.head_dim) if self.num_kv < c.num_kv_heads else None
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

    def qk(self, x_BTHD, gain, cos, sin, mult: float) -> torch.Tensor:
        """QK-norm, qk_mult and RoPE of the queries or the keys (`layers.qk_transform`)."""
        c = self.config
        interleaved = c.rope_pairs == "interleaved"
        return qk_transform(
            x_BTHD, normalize=c.qk_norm, gain=gain, cos_BTR=cos, sin_BTR=sin, mult=mult, interleaved=interleaved
        )

    def layer_mask(self, ctx: ForwardContext):
        """This layer's mask for a forward without a cache: `ctx.mask` (None is plain causal)."""
        return ctx.mask(self.is_global)

    def attend(self, q_BHTD, k_BKSD, v_BKSD, ctx: ForwardContext, mask) -> torch.Tensor:
        """softmax(q kᵀ / √Dh + mask) v with grouped KV heads; `mask` None is plain causal."""
        return F.scaled_dot_product_attention(
            q_BHTD,
            k_BKSD,
            v_BKSD,
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=q_BHTD.shape[1] != k_BKSD.shape[1],
        )

    def attend_causal_tail(self, q_BHTD, k_BKSD, v_BKSD) -> torch.Tensor:
        """`attend`, one document, the T queries at the S keys' last T positions (a context-parallel chunk)."""
        allowed_TS = torch.ones(q_BHTD.shape[2], k_BKSD.shape[2], dtype=torch.bool, device=q_BHTD.device)
        return Attention.attend(self, q_BHTD, k_BKSD, v_BKSD, None, allowed_TS.tril(k_BKSD.shape[2] - q_BHTD.shape[2]))

    def forward(self, a_BTD: torch.Tensor, ctx: ForwardContext, cache: LayerCache | None = None) -> torch.Tensor:
        B, T, _ = a_BTD.shape
        Dh = self.head_dim
        # Head counts come from the tensors: under tensor parallelism a rank holds a slice of the heads.
        q_BTHD = self.q_proj(a_BTD).view(B, T, -1, Dh)
        k_BTC = self.k_proj(a_BTD)
        v_BTC = self.v_proj(a_BTD)
        if self.sconv_k is not None:
            k_BTC, state = self.sconv_k(k_BTC, ctx, None if cache is None else cache.conv_k)
            if cache is not None:
                cache.conv_k = state
        if self.sconv_v is not None:
            v_BTC, state = self.sconv_v(v_BTC, ctx, None if cache is None else cache.conv_v)
            if cache is not None:
                cache.conv_v = state
        if self.kv_in_use is not None:  # global layers read the first K of the stored KV heads (Marin: 6 of 12)
            k_BTC, v_BTC = self.kv_in_use(k_BTC), self.kv_in_use(v_BTC)
        k_BTKD = k_BTC.view(B, T, -1, Dh)
        v_BTKD = v_BTC.view(B, T, -1, Dh)
        H, K = q_BTHD.shape[2], k_BTKD.shape[2]
        cos = sin = None
        if self.use_rope:
            cos, sin = ctx.rope(self.config.rope_dim, self.config.rope_theta)
        q_BHTD = self.qk(q_BTHD, self.q_norm_weight, cos, sin, self.config.qk_mult).transpose(1, 2)
        k_BKTD = self.qk(k_BTKD, self.k_norm_weight, cos, sin, 1.0).transpose(1, 2)
        v_BKTD = v_BTKD.transpose(1, 2)

        if cache is not None:
            cache.append(k_BKTD, v_BKTD, ctx.doc_BT, ctx.pos_BT)
            k_BKSD, v_BKSD = cache.k_BKSD, cache.v_BKSD
            mask = attention_mask(ctx.doc_BT, ctx.pos_BT, cache.doc_BS, cache.pos_BS, self.window)
        else:
            k_BKSD, v_BKSD = k_BKTD, v_BKTD
            mask = self.layer_mask(ctx)
        y_BHTD = self.attend(q_BHTD, k_BKSD.to(q_BHTD.dtype), v_BKSD.to(q_BHTD.dtype), ctx, mask)
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
