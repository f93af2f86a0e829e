"""Small building blocks of the Marin block: norms, short convolution, SwiGLU, RoPE.

Shape legend: B batch, T sequence, C channels, D d_model, F FFN width, R GatedNorm rank,
H query heads, Dh head dim.
"""

from __future__ import annotations

import weakref
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


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 (what gradcheck runs)."""
    return torch.promote_types(x.dtype, torch.float32)


def _leading_dims(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(t.dim() - 1))


class _RMSNorm(torch.autograd.Function):
    """y = x * rsqrt(mean(x²) + eps) * w in fp32, rounded once to x's dtype, with the backward
    written out: dx = rstd·(g·w − n·mean(g·w·n)), dw = Σ g·n, with n = x·rstd.

    It saves x and rstd (one value a row) and recomputes n. Against the same maths left to
    autograd (eight forward ops, each with its backward node), forward and backward at
    [4, 256, 384] on the 2-core EPYC, best of 300 interleaved: fp32 0.69 against 0.85 ms, bf16
    input 0.88 against 1.14 ms. Every block has two of these, and the final norm one."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ct = _compute_dtype(x)
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


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain, computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNorm.apply(x, self.weight, self.eps)


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


class _CausalConv(torch.autograd.Function):
    """`y[t] = w[0]·x[t] + Σ_lag keep[lag][t]·w[lag]·x[t-lag]` over the sequence, backward written out.

    `keep[lag - 1]` is [B, T - lag, 1], 1 where tap t - lag lies in t's document (None: always).
    Each tap is one multiply-add (`addcmul_`, rounded once to x's dtype); the weight gradient is
    summed in fp32. Against the same sum left to autograd (~30 ops, each with its node), forward
    and backward at [8, 256, 128] with two documents a row on the 2-core EPYC, best of 100
    interleaved: bf16 606-632 against 767-797 us, fp32 475-481 against 792-860 us; the `tiny`
    quickstart model's bf16 training step 131.2 against 138.2 ms (best of 20).
    """

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
        if state is None:
            return _CausalConv.apply(x_BTC, self.weight, *sconv_keep(doc_BT, self.kernel_size, x_BTC.dtype)), None
        # Decoding: convolve the stored inputs and the new ones (their ids are -1: never a
        # document's), and keep the new outputs.
        full_x = torch.cat([state.x_BKC.to(x_BTC.dtype), x_BTC], dim=1)
        full_doc = torch.cat([state.doc_BK, doc_BT], dim=1)
        y = _CausalConv.apply(full_x, self.weight, *sconv_keep(full_doc, self.kernel_size, x_BTC.dtype))
        keep = self.kernel_size - 1
        new_state = ConvState(full_x[:, full_x.shape[1] - keep :], full_doc[:, full_doc.shape[1] - keep :])
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
        self.gate_proj = Linear(dim, hidden)
        self.up_proj = Linear(dim, hidden)
        self.down_proj = Linear(hidden, dim)

    def reset_parameters(self) -> None:
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            trunc_normal_(linear.weight, self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LastResult:
    """The result last computed from a tensor, given again while the same tensor object comes back
    unchanged (same version) with the same key: for values that every layer of a forward pass
    derives from one shared tensor (positions, a mask). A weak reference, so the tensor is never
    kept alive. With `tensor` None the key alone decides. While torch.compile traces, nothing is
    kept: the computation is traced instead.
    """

    def __init__(self):
        self._last = None  # (weak reference to the tensor or None, (key, version), result)

    def __call__(self, tensor: torch.Tensor | None, key: tuple, compute):
        if torch.compiler.is_compiling():
            return compute()
        key = (key, None if tensor is None else tensor._version)
        last = self._last
        # A result kept for a tensor never matches a call without one: their keys' versions differ.
        if last is not None and last[1] == key and (None if last[0] is None else last[0]()) is tensor:
            return last[2]
        result = compute()
        self._last = (None if tensor is None else weakref.ref(tensor), key, result)
        return result


_SCONV_KEEP = LastResult()  # the last forward's masks (every SConv of a forward has the same dtype)


def sconv_keep(doc_BT: torch.Tensor | None, kernel_size: int, dtype: torch.dtype) -> list[torch.Tensor | None]:
    """Per lag 1..K-1, [B, T - lag, 1] in `dtype`: 1 where tap t - lag is in t's document, else 0.

    Every SConv of a forward pass (up to four a layer) shares them, so they are built once.
    """

    def build():
        if doc_BT is None:
            return [None] * (kernel_size - 1)
        return [(doc_BT[:, lag:] == doc_BT[:, :-lag]).unsqueeze(-1).to(dtype) for lag in range(1, kernel_size)]

    return _SCONV_KEEP(doc_BT, (kernel_size, dtype), build)


def rope_cos_sin(pos_BT: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, T, rope_dim/2] for integer positions, in fp32.

    Every layer of a forward pass passes the same positions tensor, so the tables are computed
    once a forward, not once a layer (`LastResult`; the bench/train_step.py step's 8 layers: 0.39
    against 1.35 ms; in decoding a token's whole cost is such small ops).
    """

    def tables():
        half = rope_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(half, device=pos_BT.device, dtype=torch.float32) / half))
        angles = pos_BT.float().unsqueeze(-1) * inv_freq
        return angles.cos(), angles.sin()

    return _ROPE_TABLES(pos_BT, (rope_dim, theta), tables)


_ROPE_TABLES = LastResult()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2R dims of each head by the angles (split-half pairing, as in HF
    Llama/Qwen); keep the rest. `sin` negated rotates back (the backward's transpose)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat(
        [torch.addcmul(x1 * cos, x2, sin, value=-1), torch.addcmul(x2 * cos, x1, sin), x[..., 2 * half :]], -1
    )


class _QKTransform(torch.autograd.Function):
    """y = rope(rmsnorm(x) * gain * mult) in fp32, rounded once to x's dtype; each part optional."""

    @staticmethod
    def forward(ctx, x, gain, cos, sin, mult, normalize, eps):
        ct = _compute_dtype(x)
        n = x.to(ct)
        rstd = None
        if normalize:
            rstd = torch.rsqrt(n.square().mean(-1, keepdim=True).add_(eps))
            n = n * rstd
        factor = gain.to(ct) * mult if gain is not None else mult
        y = n * factor if gain is not None or mult != 1 else n
        if cos is not None:
            y = _rotate(y, cos, sin)
        ctx.save_for_backward(x, rstd, gain, cos, sin)
        ctx.mult, ctx.normalize = mult, normalize
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, rstd, gain, cos, sin = ctx.saved_tensors
        ct = _compute_dtype(x)
        g = dy.to(ct)
        if cos is not None:
            g = _rotate(g, cos, -sin)
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
        return g.to(x.dtype), dgain, None, None, None, None, None


def qk_transform(
    x_BTHD: torch.Tensor,
    *,
    normalize: bool,
    gain: torch.Tensor | None = None,
    cos_BTR: torch.Tensor | None = None,
    sin_BTR: torch.Tensor | None = None,
    mult: float = 1.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """What attention does to queries or keys between their projection and the scores, as one
    autograd node computed in fp32 and rounded once:

    - `normalize`: gain-free RMS normalisation over each head (Marin's QK-norm), then times
      `gain` [Dh] where given (Qwen3's learned QK-norm gain);
    - times `mult` (Marin's qk_mult, on the queries);
    - RoPE on the first 2R dims of each head where `cos_BTR`/`sin_BTR` [B, T, R] are given
      (`rope_cos_sin`), the rest kept (half-RoPE, NoPE).

    Left to autograd the same maths is ~20 small ops forward and ~25 backward; at the
    bench/train_step.py query shape ([4, 256, 6, 64], bf16, with gain and full RoPE) forward and
    backward took 0.94-1.14 ms against 1.29-1.46 ms (best of 300 interleaved, three runs). With
    the fused RMSNorm, the attention of one bench model layer (its input norm included, on the
    trained step's activations, forward and backward, best of 200) took 12.3 against 12.8 ms; the
    hero-shaped `small` preset's 16.1 against 16.6 ms.
    """
    rope = cos_BTR is not None and cos_BTR.shape[-1] > 0
    if not normalize and gain is None and mult == 1 and not rope:
        return x_BTHD
    cos = cos_BTR.unsqueeze(2) if rope else None
    sin = sin_BTR.unsqueeze(2) if rope else None
    return _QKTransform.apply(x_BTHD, gain, cos, sin, mult, normalize, eps)


def bincount(index_I: torch.Tensor, n: int) -> torch.Tensor:
    """`torch.bincount(index, minlength=n)` for indices below n, with the shape fixed at [n]:
    torch.compile traces it (bincount's data-dependent length is a graph break)."""
    return torch.zeros(n, dtype=torch.long, device=index_I.device).scatter_add_(0, index_I, torch.ones_like(index_I))
