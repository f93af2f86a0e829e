"""Small building blocks of the Marin block: norms, short convolution, SwiGLU, RoPE.

Shape legend: B batch, T sequence, C channels, D d_model, F FFN width, R GatedNorm rank,
H query heads, Dh head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from marinlm.model.cpu_bf16 import Linear


def trunc_normal_(weight: torch.Tensor, std: float) -> None:
    """The spec's matrix init: normal(0, std) truncated at +-3 std."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


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


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain, computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Gain-free RMS normalisation over the last dim in fp32 (Marin's per-head QK-norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class GatedNorm(nn.Module):
    """`x * sigmoid(silu(x @ W_down) @ W_up)`, a low-rank per-dimension gate (arXiv 2601.22966)."""

    def __init__(self, dim: int, rank: int, init_std: float):
        super().__init__()
        self.init_std = init_std
        self.down = Linear(dim, rank)
        self.up = Linear(rank, dim)

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
    """Depthwise causal convolution over the sequence: `y[t] = sum_j w[j] * x[t-j]`.

    Taps that reach into a previous packed document are zeroed, so documents never mix.
    Identity-initialised (w[0] = 1, other taps 0), so it starts as a pass-through.
    """

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(kernel_size, channels))  # [K, C]; row j is lag j

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()
            self.weight[0].fill_(1.0)

    def forward(
        self, x_BTC: torch.Tensor, doc_BT: torch.Tensor | None, state: ConvState | None = None
    ) -> tuple[torch.Tensor, ConvState | None]:
        """Convolve; with `state`, the stored previous inputs precede `x` (incremental decoding).

        Returns the output and, when `state` was given, the updated state.
        """
        T = x_BTC.shape[1]
        weight = self.weight.to(x_BTC.dtype)
        if state is not None:
            full_x = torch.cat([state.x_BKC.to(x_BTC.dtype), x_BTC], dim=1)
            full_doc = torch.cat([state.doc_BK, doc_BT], dim=1)
        else:
            full_x, full_doc = x_BTC, doc_BT
        past = full_x.shape[1] - T  # number of stored inputs in front of x
        y = weight[0] * x_BTC
        for lag in range(1, self.kernel_size):
            lo = past - lag
            if lo + T <= 0:  # no output has an input `lag` steps back (a sequence shorter than the kernel)
                break
            if lo >= 0:
                shifted = full_x[:, lo : lo + T]
                same = None if full_doc is None else full_doc[:, lo : lo + T] == full_doc[:, past:]
            else:  # the first `-lo` outputs have no input `lag` steps back
                shifted = F.pad(full_x[:, : lo + T], (0, 0, -lo, 0))
                same = None
                if full_doc is not None:
                    same = F.pad(full_doc[:, : lo + T], (-lo, 0), value=-1) == full_doc[:, past:]
            if same is not None:
                shifted = shifted * same.unsqueeze(-1).to(shifted.dtype)
            y = y + weight[lag] * shifted
        new_state = None
        if state is not None:
            keep = self.kernel_size - 1
            new_state = ConvState(full_x[:, full_x.shape[1] - keep :], full_doc[:, full_doc.shape[1] - keep :])
        return y, new_state

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
        self.gate_proj = Linear(dim, hidden)
        self.up_proj = Linear(dim, hidden)
        self.down_proj = Linear(hidden, dim)

    def reset_parameters(self) -> None:
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            trunc_normal_(linear.weight, self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(pos_BT: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, T, rope_dim/2] for integer positions, in fp32."""
    half = rope_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(half, device=pos_BT.device, dtype=torch.float32) / half))
    angles = pos_BT.float().unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x_BTHD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor) -> torch.Tensor:
    """Rotate the first `2R` dims of each head (split-half pairing, as in HF Llama/Qwen); keep the rest."""
    half = cos_BTR.shape[-1]
    if half == 0:
        return x_BTHD
    x1 = x_BTHD[..., :half].float()
    x2 = x_BTHD[..., half : 2 * half].float()
    cos, sin = cos_BTR.unsqueeze(2), sin_BTR.unsqueeze(2)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BTHD.dtype)
    if 2 * half == x_BTHD.shape[-1]:
        return rotated
    return torch.cat([rotated, x_BTHD[..., 2 * half :]], dim=-1)


def bincount(index_I: torch.Tensor, n: int) -> torch.Tensor:
    """`torch.bincount(index, minlength=n)` for indices below n, with the shape fixed at [n]:
    torch.compile traces it (bincount's data-dependent length is a graph break)."""
    return torch.zeros(n, dtype=torch.long, device=index_I.device).scatter_add_(0, index_I, torch.ones_like(index_I))
