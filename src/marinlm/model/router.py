"""Routers: QB (Marin), aux-loss-free (DeepSeek-V3) and softmax top-k (Mixtral/Qwen3-MoE).

Shape legend: N tokens, D router input width, E experts, k experts per token.

All routers score in fp32. Each forward returns the selection, the combine weights and a
`RouterStats` for the layer. QB and aux-free carry a per-expert bias that gradients never touch;
the trainer reduces the step's statistics (over micro-batches and data-parallel ranks) and calls
`update_bias()` once per optimizer step. The bias is a persistent buffer, so a checkpoint taken
after step t carries the bias that step t+1 will use.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from marinlm.model.config import AuxFreeRouterConfig, QBRouterConfig, RouterConfig, SoftmaxTopKRouterConfig
from marinlm.model.layers import bincount, compute_dtype, trunc_normal_


@dataclass
class RouterStats:
    """One MoE layer's routing statistics for one forward.

    `load` counts assignments per expert before capacity drops; `dropped` counts assignments lost
    to capacity. `beta` is QB's per-expert threshold estimate, None for other routers.
    """

    load: torch.Tensor  # [E] float
    z_loss: torch.Tensor  # mean(logsumexp(logits)^2), logged only
    dropped: torch.Tensor  # scalar float
    num_tokens: torch.Tensor  # scalar float
    beta: torch.Tensor | None = None  # [E]
    hist: torch.Tensor | None = None  # [E, bins] QB margin counts (histogram estimator)
    # The QB margins [N, E] of each forward, kept for a histogram over their live range (binned
    # once the step's range across ranks is known: `bin_live`); `bins` its bin count.
    margins: list[torch.Tensor] | None = None
    bins: int = 0
    hist_lo: torch.Tensor | None = None  # the range `hist` spans (0-dim)
    hist_hi: torch.Tensor | None = None

    @property
    def entropy(self) -> torch.Tensor:
        """Entropy (nats) of the assignment distribution over experts; log(E) is perfect balance."""
        p = self.load / self.load.sum().clamp_min(1.0)
        return -(p * torch.log(p.clamp_min(1e-12))).sum()

    @property
    def dropped_fraction(self) -> torch.Tensor:
        return self.dropped / self.load.sum().clamp_min(1.0)

    @staticmethod
    def merge(stats: list[RouterStats], weights: list[float] | None = None) -> RouterStats:
        """Combine micro-batches: sum counts, average the per-forward means and beta (weighted by
        `weights`, e.g. how many forwards an already-merged entry stands for)."""
        w = weights or [1.0] * len(stats)
        total = sum(w)
        return RouterStats(
            load=sum(s.load for s in stats),
            z_loss=sum(wi * s.z_loss for wi, s in zip(w, stats)) / total,
            dropped=sum(s.dropped for s in stats),
            num_tokens=sum(s.num_tokens for s in stats),
            beta=None if stats[0].beta is None else sum(wi * s.beta for wi, s in zip(w, stats)) / total,
            hist=None if stats[0].hist is None else sum(s.hist for s in stats),
            margins=None if stats[0].margins is None else [m for s in stats for m in s.margins],
            bins=stats[0].bins,
            hist_lo=stats[0].hist_lo,
            hist_hi=stats[0].hist_hi,
        )

    def detach(self) -> RouterStats:
        return RouterStats(**{f.name: _detach(getattr(self, f.name)) for f in fields(self)})


def _detach(t):
    if isinstance(t, list):
        return [m.detach() for m in t]
    return t.detach() if isinstance(t, torch.Tensor) else t


def margin_range(margins: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) over every margin of the given forwards (0-dim tensors: no wait for the device)."""
    lo = torch.stack([m.min() for m in margins]).min()
    hi = torch.stack([m.max() for m in margins]).max()
    return lo, hi


def bin_margins(margins: list[torch.Tensor], lo: torch.Tensor, hi: torch.Tensor, bins: int) -> torch.Tensor:
    """Per-expert counts [E, bins] of the margins in `bins` equal bins over [lo, hi] (a margin
    outside lands in the end bin), as Marin's `_bincount_upper_quantile` bins them."""
    E = margins[0].shape[-1]
    width = (hi - lo) / bins
    counts = 0
    for m in margins:
        index = ((m - lo) / width).floor().long().clamp_(0, bins - 1)
        flat = (index + torch.arange(E, device=index.device) * bins).reshape(-1)
        counts = counts + bincount(flat, E * bins).float()
    return counts.view(E, bins)


def bin_live(stats: RouterStats, lo: torch.Tensor, hi: torch.Tensor) -> None:
    """Replace `stats`' kept margins by their histogram over [lo, hi], in place; hi is widened to
    lo + 1e-6 where every margin was equal (Marin's guard)."""
    stats.hist_lo, stats.hist_hi = lo, torch.maximum(hi, lo + 1e-6)
    stats.hist = bin_margins(stats.margins, stats.hist_lo, stats.hist_hi, stats.bins)
    stats.margins = None


@dataclass
class Routing:
    experts_NK: torch.Tensor  # int64 expert ids
    weights_NK: torch.Tensor  # fp32 combine weights
    aux_loss: torch.Tensor | None
    stats: RouterStats


class Router(nn.Module):
    """Scores tokens against experts; subclasses choose and weight."""

    def __init__(self, d_in: int, num_experts: int, top_k: int, init_std: float):
        super().__init__()
        self.num_experts, self.top_k, self.init_std = num_experts, top_k, init_std
        self.weight = nn.Parameter(torch.empty(num_experts, d_in))
        # Not trained by gradients; replaced/nudged once per step by update_bias().
        self.register_buffer("bias", torch.empty(num_experts), persistent=True)

    def reset_parameters(self) -> None:
        trunc_normal_(self.weight, self.init_std)
        nn.init.zeros_(self.bias)

    def logits(self, x_ND: torch.Tensor) -> torch.Tensor:
        # fp32 even under autocast (fp64 in fp64 runs): top-k ties and sigmoid/softmax weights are
        # precision-sensitive.
        dtype = compute_dtype(self.weight)
        with torch.autocast(device_type=x_ND.device.type, enabled=False):
            return F.linear(x_ND.to(dtype), self.weight.to(dtype))

    def _stats(self, logits_NE, experts_NK, beta=None) -> RouterStats:
        load = bincount(experts_NK.reshape(-1), self.num_experts).float()
        z = torch.logsumexp(logits_NE.detach(), dim=-1)
        return RouterStats(
            load=load,
            z_loss=(z * z).mean(),
            dropped=torch.zeros((), device=logits_NE.device),
            # filled on the device: torch.tensor(..., device=cuda) would copy from the host and wait
            num_tokens=torch.full((), float(logits_NE.shape[0]), device=logits_NE.device),
            beta=beta,
        )

    @torch.no_grad()
    def update_bias(self, stats: RouterStats) -> None:
        """Apply the step's reduced statistics to the bias; a no-op for routers without one."""


class QBRouter(Router):
    """Quantile balancing. Select top-k of `s + b`; weight by sigmoid(s) renormalised to sum to
    `weight_sum`; estimate beta_e = the (1 - k/E) upper quantile of margins `s_e - alpha`, alpha the
    (k+1)-th largest biased logit; the next step uses `b = -beta + mean(beta)` (a replacement)."""

    def __init__(self, config: QBRouterConfig, d_in, num_experts, top_k, init_std):
        super().__init__(d_in, num_experts, top_k, init_std)
        self.weight_sum = config.weight_sum
        self.estimator, self.bins, self.range = config.estimator, config.hist_bins, config.hist_range
        self.live = config.hist_bounds == "live"

    def forward(self, x_ND: torch.Tensor) -> Routing:
        s_NE = self.logits(x_ND)
        biased_NE = s_NE.detach() + self.bias
        top_vals, top_idx = torch.topk(biased_NE, self.top_k + 1, dim=-1)
        experts_NK = top_idx[:, : self.top_k]
        alpha_N1 = top_vals[:, self.top_k :]
        weights_NK = torch.sigmoid(torch.gather(s_NE, 1, experts_NK))
        weights_NK = weights_NK * (self.weight_sum / (weights_NK.sum(-1, keepdim=True) + 1e-9))
        margins_NE = s_NE.detach() - alpha_N1
        if self.estimator == "histogram" and self.live:  # binned when the step's range is known
            stats = self._stats(s_NE, experts_NK)
            stats.margins, stats.bins = [margins_NE], self.bins
        elif self.estimator == "histogram":
            stats = self._stats(s_NE, experts_NK)
            stats.hist = self.margin_histogram(margins_NE)
        else:
            stats = self._stats(s_NE, experts_NK, self.estimate_beta(margins_NE))
        return Routing(experts_NK, weights_NK, None, stats)

    def fixed_bounds(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return like.new_tensor(-self.range), like.new_tensor(self.range)

    def margin_histogram(self, margins_NE: torch.Tensor) -> torch.Tensor:
        """Per-expert counts of margins in `bins` equal bins over [-range, range] ([E, bins], fp32)."""
        return bin_margins([margins_NE], *self.fixed_bounds(margins_NE), self.bins)

    def beta_from_histogram(
        self,
        hist_EB: torch.Tensor,
        num_tokens: torch.Tensor,
        lo: torch.Tensor | None = None,
        hi: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The (1 - k/E) upper quantile of each expert's margins, interpolated inside its bin, of a
        histogram over [lo, hi] (default: the fixed [-range, range]). `num_tokens` stays a (0-dim)
        tensor: reading it on the host would wait for the device."""
        if lo is None:
            lo, hi = self.fixed_bounds(hist_EB)
        bins = hist_EB.shape[-1]
        width = (hi - lo) / bins
        target = num_tokens.double() * self.top_k / self.num_experts  # margins at or above beta, per expert
        from_top = hist_EB.flip(-1).cumsum(-1).flip(-1)  # [E, B]: count of margins in bins >= b
        b = ((from_top >= target).sum(-1) - 1).clamp(0, bins - 1)
        above = from_top.gather(1, b.unsqueeze(1)).squeeze(1)
        inside = hist_EB.gather(1, b.unsqueeze(1)).squeeze(1)
        lower_edge = lo + b.to(width.dtype) * width
        return lower_edge + width * (above - target) / inside.clamp_min(1.0)

    def estimate_beta(self, margins_NE: torch.Tensor) -> torch.Tensor:
        """Per expert, the `N*k/E`-th largest margin: the (1 - k/E) upper quantile over these tokens."""
        count = max(1, margins_NE.shape[0] * self.top_k // self.num_experts)
        return torch.topk(margins_NE.t(), count, dim=-1).values[:, -1]

    @torch.no_grad()
    def update_bias(self, stats: RouterStats) -> None:
        if stats.margins is not None:  # not reduced across ranks (one process): binned over its own range
            bin_live(stats, *margin_range(stats.margins))
        if stats.hist is not None:
            stats.beta = self.beta_from_histogram(stats.hist, stats.num_tokens, stats.hist_lo, stats.hist_hi)
        self.bias.copy_(-stats.beta + stats.beta.mean())


class AuxFreeRouter(Router):
    """DeepSeek-V3: sigmoid scores, top-k of score + bias, weights = normalised selected scores."""

    def __init__(self, config: AuxFreeRouterConfig, d_in, num_experts, top_k, init_std):
        super().__init__(d_in, num_experts, top_k, init_std)
        self.rate, self.scaling = config.bias_update_rate, config.scaling

    def forward(self, x_ND: torch.Tensor) -> Routing:
        s_NE = self.logits(x_ND)
        scores_NE = torch.sigmoid(s_NE)
        experts_NK = torch.topk(scores_NE.detach() + self.bias, self.top_k, dim=-1).indices
        weights_NK = torch.gather(scores_NE, 1, experts_NK)
        weights_NK = weights_NK / (weights_NK.sum(-1, keepdim=True) + 1e-20) * self.scaling
        return Routing(experts_NK, weights_NK, None, self._stats(s_NE, experts_NK))

    @torch.no_grad()
    def update_bias(self, stats: RouterStats) -> None:
        self.bias.add_(self.rate * torch.sign(stats.load.mean() - stats.load))


class SoftmaxTopKRouter(Router):
    """Softmax over experts, top-k, optional renormalisation; Switch/Mixtral balancing loss
    `E * sum_e f_e * P_e` with f_e the fraction of tokens sent to e (HF transformers' convention,
    so `aux_loss_weight` matches its `router_aux_loss_coef`)."""

    def __init__(self, config: SoftmaxTopKRouterConfig, d_in, num_experts, top_k, init_std):
        super().__init__(d_in, num_experts, top_k, init_std)
        self.normalize, self.aux_weight = config.normalize_topk, config.aux_loss_weight

    def forward(self, x_ND: torch.Tensor) -> Routing:
        s_NE = self.logits(x_ND)
        probs_NE = torch.softmax(s_NE, dim=-1)
        weights_NK, experts_NK = torch.topk(probs_NE, self.top_k, dim=-1)
        if self.normalize:
            weights_NK = weights_NK / weights_NK.sum(-1, keepdim=True)
        stats = self._stats(s_NE, experts_NK)
        fraction_E = stats.load / s_NE.shape[0]
        aux = self.aux_weight * self.num_experts * (fraction_E * probs_NE.mean(0)).sum()
        return Routing(experts_NK, weights_NK, aux, stats)


def build_router(config: RouterConfig, d_in: int, num_experts: int, top_k: int, init_std: float) -> Router:
    classes = {QBRouterConfig: QBRouter, AuxFreeRouterConfig: AuxFreeRouter, SoftmaxTopKRouterConfig: SoftmaxTopKRouter}
    return classes[type(config)](config, d_in, num_experts, top_k, init_std)
