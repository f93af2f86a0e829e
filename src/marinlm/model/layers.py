"""Small building blocks of the Marin block: norms, short convolution, SwiGLU, RoPE.

Shape legend: B batch, T sequence, C channels, D d_model, F FFN width, R GatedNorm rank or RoPE
pairs, H heads, Dh head dim, K convolution taps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from marinlm.model.context import ForwardContext, sconv_keep_masks


def trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """The spec's matrix init: normal(0, std) truncated at +-3 std."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 (what gradcheck and fp64 parity runs use)."""
    return torch.promote_types(x.dtype, torch.float32)


def doc_ids_and_positions(segment_ids_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Number the contiguous runs of equal segment ids, and each token's position in its run.

    A run is one packed document. Numbering runs (not trusting the raw ids) means a repeated id
    further along the row still starts a new document.

    Returns:
        doc_BT: run index, increasing along each row.
        pos_BT: position within the run, restarting at 0 at every document start.
    """
    B, T = segment_ids_BT.shape
    starts = torch.ones_like(segment_ids_BT, dtype=torch.bool)
    starts[:, 1:] = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
    doc_BT = torch.cumsum(starts.long(), dim=1)
    index = torch.arange(T, device=segment_ids_BT.device).expand(B, T)
    start_index = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return doc_BT, index - start_index


def bincount(index_I: torch.Tensor, n: int) -> torch.Tensor:
    """`torch.bincount(index, minlength=n)` for indices below n, with the shape fixed at [n]:
    torch.compile traces it (bincount's data-dependent length is a graph break)."""
    return torch.zeros(n, dtype=torch.long, device=index_I.device).scatter_add_(0, index_I, torch.ones_like(index_I))


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain, computed in fp32 (the spec) and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ct = compute_dtype(x)
        return F.rms_norm(x.to(ct), (x.shape[-1],), self.weight.to(ct), self.eps).to(x.dtype)


class GatedNorm(nn.Module):
    """`x * sigmoid(silu(x @ W_down) @ W_up)`, a low-rank per-dimension gate (arXiv 2601.22966)."""

    def __init__(self, dim: int, rank: int, init_std: float):
        super().__init__()
        self.init_std = init_std
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)

    def reset_parameters(self) -> None:
        trunc_normal_(self.down.weight, self.init_std)
        trunc_normal_(self.up.weight, self.init_std)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        gate_BTD = torch.sigmoid(self.up(F.silu(self.down(x_BTD))))
        return x_BTD * gate_BTD.to(x_BTD.dtype)


@dataclass
class ConvState:
    """The last `kernel_size - 1` inputs of an SConv and their document ids, for decoding."""

    x_BKC: torch.Tensor
    doc_BK: torch.Tensor


class SConv(nn.Module):
    """Depthwise causal convolution over the sequence: `y[t] = sum_lag w[lag] * x[t - lag]`.

    Taps that reach into a previous packed document are zeroed (`keep`), so documents never mix.
    Identity-initialised (w[0] = 1, other taps 0), so it starts as a pass-through.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(kernel_size, channels))  # [K, C]; row lag is that tap

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()
            self.weight[0].fill_(1.0)

    def convolve(self, x_BTC: torch.Tensor, keep: list[torch.Tensor] | None) -> torch.Tensor:
        """The convolution of a whole sequence; `keep` from `sconv_keep_masks` (None: one document)."""
        w_KC = self.weight.to(x_BTC.dtype)
        y_BTC = x_BTC * w_KC[0]
        for lag in range(1, min(self.kernel_size, x_BTC.shape[1])):
            x_lag = x_BTC[:, :-lag] if keep is None else x_BTC[:, :-lag] * keep[lag - 1]
            y_BTC = y_BTC + F.pad(x_lag * w_KC[lag], (0, 0, lag, 0))
        return y_BTC

    def forward(
        self, x_BTC: torch.Tensor, ctx: ForwardContext, state: ConvState | None = None
    ) -> tuple[torch.Tensor, ConvState | None]:
        """Convolve; with `state`, the stored previous inputs precede `x` (incremental decoding).

        Returns the output and, when `state` was given, the updated state.
        """
        if state is None:
            return self.convolve(x_BTC, ctx.sconv_keep(self.kernel_size)), None
        # Decoding: convolve the stored inputs and the new ones (their ids are -1: never a
        # document's), and keep the new outputs.
        full_x = torch.cat([state.x_BKC.to(x_BTC.dtype), x_BTC], dim=1)
        full_doc = torch.cat([state.doc_BK, ctx.doc_BT], dim=1)
        y = self.convolve(full_x, sconv_keep_masks(full_doc, self.kernel_size))
        keep_last = self.kernel_size - 1
        new_state = ConvState(full_x[:, full_x.shape[1] - keep_last :], full_doc[:, full_doc.shape[1] - keep_last :])
        return y[:, full_x.shape[1] - x_BTC.shape[1] :], new_state

    def empty_state(self, batch: int, device, dtype) -> ConvState:
        keep = self.kernel_size - 1
        return ConvState(
            torch.zeros(batch, keep, self.weight.shape[1], device=device, dtype=dtype),
            torch.full((batch, keep), -1, device=device, dtype=torch.long),
        )


class SwiGLU(nn.Module):
    """Dense SwiGLU FFN: `W_down(silu(W_gate x) * W_up x)`. Used for shared experts and dense layers."""

    def __init__(self, dim: int, hidden: int, init_std: float):
        super().__init__()
        self.init_std = init_std
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def reset_parameters(self) -> None:
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            trunc_normal_(linear.weight, self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first 2R dims of each head by the angles, pair i by angle i; keep the rest
    (half-RoPE, NoPE). Pair i is dims (i, i + R) (split-half, as HF Llama/Qwen), or with
    `interleaved` dims (2i, 2i + 1) (Marin's fused RoPE). `sin` negated rotates back."""
    half = cos.shape[-1]
    if interleaved:
        pairs = x[..., : 2 * half].unflatten(-1, (half, 2))
        x1, x2 = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
        return torch.cat([rotated, x[..., 2 * half :]], -1)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half :]], -1)


def qk_transform(
    x_BTHD: torch.Tensor,
    *,
    normalize: bool,
    gain: torch.Tensor | None = None,
    cos_BTR: torch.Tensor | None = None,
    sin_BTR: torch.Tensor | None = None,
    mult: float = 1.0,
    eps: float = 1e-6,
    interleaved: bool = False,
) -> torch.Tensor:
    """What attention does to queries or keys between their projection and the scores, in fp32,
    rounded once to the input dtype:

    - `normalize`: gain-free RMS normalisation over each head (Marin's QK-norm), then times
      `gain` [Dh] where given (Qwen3's learned QK-norm gain);
    - times `mult` (Marin's qk_mult, on the queries);
    - RoPE on the first 2R dims of each head where `cos_BTR`/`sin_BTR` [B, T, R] are given
      (`apply_rope`'s pairing: `interleaved` or split-half).
    """
    rope = cos_BTR is not None and cos_BTR.shape[-1] > 0
    if not normalize and gain is None and mult == 1 and not rope:
        return x_BTHD
    y = x_BTHD.to(compute_dtype(x_BTHD))
    if normalize:
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)
    if gain is not None:
        y = y * (gain.to(y.dtype) * mult)
    elif mult != 1:
        y = y * mult
    if rope:
        y = apply_rope(y, cos_BTR.unsqueeze(2), sin_BTR.unsqueeze(2), interleaved)
    return y.to(x_BTHD.dtype)
