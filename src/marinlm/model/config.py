"""Model configuration: the Marin MoE architecture and the plain Qwen3-MoE/Mixtral family.

Every element of `shared/docs/marin-535b-a23b.md` is a switch here, so one class covers the hero
shape (`configs/model/marin-535b-a23b.yaml`), its CPU-sized ladder and a plain softmax-top-k MoE.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from marinlm.config import Choice, check

SCONV_SITES = ("k", "v", "attn", "mlp")


@dataclass(kw_only=True)
class AttentionConfig:
    num_heads: int = 4
    head_dim: int = 32
    # K/V projections store `num_kv_heads` heads; local layers use all of them, global layers the
    # first `num_global_kv_heads` (Marin: 12 stored, 6 used on global layers). None = all.
    num_kv_heads: int = 2
    num_global_kv_heads: int | None = None
    # Local layers attend within `sliding_window` tokens; None makes every layer global.
    sliding_window: int | None = None
    # Layers 1-based multiples of `global_every` are global (full causal); 0 = none by schedule.
    global_every: int = 4
    last_layer_global: bool = True
    qk_norm: bool = True
    qk_norm_gain: bool = False  # Qwen3 learns a per-dim gain on its QK-norm; Marin does not.
    qk_mult: float = 1.0
    rope_theta: float = 10000.0
    rope_fraction: float = 1.0  # fraction of each head's dims that RoPE rotates (Marin: 0.5)
    rope_local: bool = True
    rope_global: bool = True  # Marin's global layers are NoPE
    # Which dims RoPE rotates together: half, (i, i + R/2) as HF Llama/Qwen checkpoints do;
    # interleaved, adjacent pairs (2i, 2i + 1), as Marin's hero (its fused path, rope_fused=True).
    rope_pairs: str = "half"
    xsa: bool = False  # exclusive self-attention: remove the output's component along own value
    head_gate: bool = False  # g = 2*sigmoid(x @ W_gate), zero-initialised

    def __post_init__(self):
        for name in ("num_heads", "head_dim", "num_kv_heads"):
            check(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        check(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"must divide num_heads={self.num_heads}; got {self.num_kv_heads}",
        )
        if self.num_global_kv_heads is not None:
            g = self.num_global_kv_heads
            check(
                0 < g <= self.num_kv_heads and self.num_heads % g == 0,
                "num_global_kv_heads",
                f"must be in [1, num_kv_heads={self.num_kv_heads}] and divide num_heads={self.num_heads}; got {g}",
            )
        check(
            self.sliding_window is None or self.sliding_window > 0,
            "sliding_window",
            f"must be positive or null, got {self.sliding_window}",
        )
        check(self.global_every >= 0, "global_every", f"must be >= 0, got {self.global_every}")
        check(0.0 <= self.rope_fraction <= 1.0, "rope_fraction", f"must be in [0, 1], got {self.rope_fraction}")
        rope_dim = int(self.head_dim * self.rope_fraction)
        check(
            rope_dim % 2 == 0,
            "rope_fraction",
            f"head_dim * rope_fraction = {rope_dim} must be even (RoPE rotates pairs)",
        )
        check(self.rope_theta > 0, "rope_theta", f"must be positive, got {self.rope_theta}")
        check(
            self.rope_pairs in ("half", "interleaved"),
            "rope_pairs",
            f"must be half or interleaved, got {self.rope_pairs!r}",
        )
        check(self.qk_mult > 0, "qk_mult", f"must be positive, got {self.qk_mult}")
        check(not self.qk_norm_gain or self.qk_norm, "qk_norm_gain", "requires qk_norm: true")

    @property
    def rope_dim(self) -> int:
        return int(self.head_dim * self.rope_fraction)

    def global_kv_heads(self) -> int:
        return self.num_global_kv_heads or self.num_kv_heads


class RouterConfig(Choice):
    """Base of the router variants; pick one with `type:` (qb, aux_free, softmax_topk)."""


@RouterConfig.register("qb")
@dataclass(kw_only=True)
class QBRouterConfig(RouterConfig):
    """Marin's quantile balancing: sigmoid weights, bias replaced each step by -beta + mean(beta)."""

    weight_sum: float = 2.5  # selected sigmoid weights are renormalised to sum to this
    # How beta, the (1 - k/E) upper quantile of each expert's margins, is estimated:
    # "histogram" counts margins in fixed bins; counts add up over micro-batches and ranks, so the
    #   estimate is of the whole global batch and does not depend on how it was split (the hero run);
    # "topk" takes each forward's N*k/E-th largest margin and averages (the spec's cheaper estimate).
    estimator: Literal["histogram", "topk"] = "histogram"
    hist_bins: int = 10_000
    # Where the bins lie. live: over the step's [min, max] of the margins across every rank that
    #   routes other tokens, as Marin's hero (experiments/grug/moe_hero_ep/model.py `_qb_beta_hist`,
    #   a pmin/pmax before the bincount); each rank keeps its step's margins ([tokens, E] a layer)
    #   until the step ends, so the bins are the whole step's whatever the micro-batches.
    # fixed: over [-hist_range, hist_range], counted as each forward runs (no margins kept; bins
    #   wider than the live range's wherever the margins span less than 2 * hist_range).
    hist_bounds: Literal["live", "fixed"] = "live"
    hist_range: float = 32.0  # fixed: bins cover margins in [-range, range]; outliers land in the end bins

    def __post_init__(self):
        check(self.weight_sum > 0, "weight_sum", f"must be positive, got {self.weight_sum}")
        check(self.hist_bins >= 2, "hist_bins", f"must be >= 2, got {self.hist_bins}")
        check(self.hist_range > 0, "hist_range", f"must be positive, got {self.hist_range}")


@RouterConfig.register("aux_free")
@dataclass(kw_only=True)
class AuxFreeRouterConfig(RouterConfig):
    """DeepSeek-V3 bias nudging (arXiv 2408.15664): b_e += rate * sign(mean_load - load_e)."""

    bias_update_rate: float = 1e-3
    scaling: float = 1.0  # DeepSeek-V3's routed_scaling_factor

    def __post_init__(self):
        check(self.bias_update_rate >= 0, "bias_update_rate", f"must be >= 0, got {self.bias_update_rate}")


@RouterConfig.register("softmax_topk")
@dataclass(kw_only=True)
class SoftmaxTopKRouterConfig(RouterConfig):
    """Softmax then top-k (Mixtral, Qwen3-MoE), with the Switch/Mixtral load-balancing loss."""

    normalize_topk: bool = True  # Qwen3's norm_topk_prob
    aux_loss_weight: float = 1e-3

    def __post_init__(self):
        check(self.aux_loss_weight >= 0, "aux_loss_weight", f"must be >= 0, got {self.aux_loss_weight}")


CapacityRule = Literal["per_expert", "receiver_pooled"]


@dataclass(kw_only=True)
class MoEConfig:
    num_experts: int = 8
    top_k: int = 2
    expert_dim: int = 64  # routed expert SwiGLU intermediate width
    latent_dim: int | None = None  # routed experts work in this width; None = full d_model
    num_shared_experts: int = 0
    shared_expert_dim: int = 64
    first_k_dense: int = 0  # DeepSeek-style: the first k layers use a dense SwiGLU FFN
    dense_ffn_dim: int = 0
    # Capacity during training (evaluation is dropless), None = dropless; `capacity` picks the rule
    # (model/experts.py): per_expert (GShard's) or receiver_pooled (Marin's hero, pooled per
    # receiver over capacity_groups x capacity_domains sender shards, in capacity_chunks parts).
    capacity_factor: float | None = None
    capacity: CapacityRule = "per_expert"
    capacity_groups: int = 1
    capacity_domains: int = 1
    capacity_chunks: int = 1
    router: RouterConfig = field(default_factory=QBRouterConfig)

    def __post_init__(self):
        check(self.num_experts > 0, "num_experts", f"must be positive, got {self.num_experts}")
        # QB reads the (k+1)-th largest logit, so k must leave at least one expert unselected.
        check(
            0 < self.top_k < self.num_experts,
            "top_k",
            f"must be in [1, num_experts-1={self.num_experts - 1}], got {self.top_k}",
        )
        check(self.expert_dim > 0, "expert_dim", f"must be positive, got {self.expert_dim}")
        check(self.num_shared_experts >= 0, "num_shared_experts", f"must be >= 0, got {self.num_shared_experts}")
        check(
            self.num_shared_experts == 0 or self.shared_expert_dim > 0,
            "shared_expert_dim",
            f"must be positive when num_shared_experts > 0, got {self.shared_expert_dim}",
        )
        check(self.first_k_dense >= 0, "first_k_dense", f"must be >= 0, got {self.first_k_dense}")
        check(
            self.first_k_dense == 0 or self.dense_ffn_dim > 0,
            "dense_ffn_dim",
            f"must be positive when first_k_dense > 0, got {self.dense_ffn_dim}",
        )
        check(
            self.capacity_factor is None or self.capacity_factor > 0,
            "capacity_factor",
            f"must be positive or null, got {self.capacity_factor}",
        )
        for key in ("capacity_groups", "capacity_domains", "capacity_chunks"):
            check(getattr(self, key) >= 1, key, f"must be >= 1, got {getattr(self, key)}")
        if self.capacity == "receiver_pooled":  # each group receives an equal block of experts, in chunks
            E, G, C = self.num_experts, self.capacity_groups, self.capacity_chunks
            check(E % G == 0, "capacity_groups", f"{G} must divide num_experts = {E}")
            check(E // G % C == 0, "capacity_chunks", f"{C} must divide the {E // G} experts of each capacity group")


@dataclass(kw_only=True)
class SConvConfig:
    """Short depthwise causal convolution (Marin's SConv), kernel taps at the listed sites."""

    kernel_size: int = 4
    sites: list[str] = field(default_factory=list)  # subset of k, v, attn, mlp

    def __post_init__(self):
        check(self.kernel_size >= 1, "kernel_size", f"must be >= 1, got {self.kernel_size}")
        bad = [s for s in self.sites if s not in SCONV_SITES]
        check(not bad, "sites", f"unknown site(s) {bad}; valid sites: {list(SCONV_SITES)}")
        check(len(set(self.sites)) == len(self.sites), "sites", f"repeated site in {self.sites}")


@dataclass(kw_only=True)
class MarinConfig:
    """The whole model. Defaults give a tiny Marin-shaped model; see configs/model/ for presets."""

    vocab_size: int = 512
    d_model: int = 128
    num_layers: int = 4
    max_seq_len: int = 256
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    gated_norm_rank: int = 0  # 0 turns GatedNorm off; Marin uses 128
    embed_norm: bool = False  # Marin normalises the embedding output: GatedNorm(RMSNorm(embed))
    init_std: float = 0.02
    z_loss_weight: float = 0.0  # output-logit z-loss: weight * logsumexp(logits)^2 (Marin: 1e-4)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    sconv: SConvConfig = field(default_factory=SConvConfig)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "num_layers", "max_seq_len"):
            check(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        check(self.norm_eps > 0, "norm_eps", f"must be positive, got {self.norm_eps}")
        check(
            0 <= self.gated_norm_rank <= self.d_model,
            "gated_norm_rank",
            f"must be in [0, d_model={self.d_model}], got {self.gated_norm_rank}",
        )
        check(self.init_std > 0, "init_std", f"must be positive, got {self.init_std}")
        check(self.z_loss_weight >= 0, "z_loss_weight", f"must be >= 0, got {self.z_loss_weight}")
        latent = self.moe.latent_dim
        check(
            latent is None or 0 < latent <= self.d_model,
            "moe.latent_dim",
            f"must be in [1, d_model={self.d_model}] or null, got {latent}",
        )
        check(
            self.moe.first_k_dense <= self.num_layers,
            "moe.first_k_dense",
            f"must be <= num_layers={self.num_layers}, got {self.moe.first_k_dense}",
        )

    def is_global_layer(self, layer: int) -> bool:
        """Layer index is 0-based. Global = full causal attention, local = sliding window."""
        attn = self.attention
        if attn.sliding_window is None:
            return True
        if attn.last_layer_global and layer == self.num_layers - 1:
            return True
        return attn.global_every > 0 and (layer + 1) % attn.global_every == 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.moe.first_k_dense

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.moe.first_k_dense
