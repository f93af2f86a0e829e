"""Parameter and FLOP accounting, computed on a `meta` model (no weights are allocated).

Counting conventions:
- **total**: every trainable parameter once (a tied embedding/head counts once). Buffers, such
  as router biases, are not parameters.
- **active**: parameters a token touches inside the transformer blocks and the final norm; of the
  routed experts only the top-k. The input embedding (a lookup) and the LM head are listed
  separately and excluded, matching how Marin reports 22.76B for the hero.
- **FLOPs per token** (training, forward + backward) = 6 * (active matmul parameters + LM head)
  + 12 * sum over layers of heads * head_dim * mean attended context, where the mean context is
  (T+1)/2 for full causal attention and the mean of min(t+1, window) for sliding-window layers.
  Norm gains and SConv taps are elementwise and not counted as matmul FLOPs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from marinlm.model.config import MarinConfig
from marinlm.model.transformer import MarinForCausalLM

COMPONENTS = (
    "embedding",
    "lm_head",
    "attention",
    "norms",
    "sconv",
    "router",
    "latent",
    "routed_experts",
    "shared_experts",
    "dense_ffn",
)


def _component(name: str) -> str:
    """Classify a parameter by its name in MarinForCausalLM."""
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("lm_head."):
        return "lm_head"
    if ".sconv" in name:
        return "sconv"
    if ".attn." in name:
        return "attention"
    if ".mlp.router." in name:
        return "router"
    if ".mlp.latent" in name:
        return "latent"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared." in name:
        return "shared_experts"
    if ".mlp." in name:
        return "dense_ffn"
    return "norms"  # RMSNorm gains and GatedNorm matrices (block, embedding and final norms)


@dataclass
class ModelSummary:
    total_by_component: dict[str, int]
    active_by_component: dict[str, int]
    total: int
    active: int  # blocks + final norm, top-k experts only; excludes embedding and LM head
    flops_per_token: float  # training (fwd + bwd)
    attention_flops_per_token: float
    seq_len: int

    def table(self) -> str:
        rows = [f"{'component':<16}{'total':>18}{'active/token':>18}"]
        for name in COMPONENTS:
            total = self.total_by_component.get(name, 0)
            if total:
                active = self.active_by_component.get(name, 0)
                rows.append(f"{name:<16}{_fmt(total):>18}{_fmt(active):>18}")
        rows.append(f"{'TOTAL':<16}{_fmt(self.total):>18}{_fmt(self.active):>18}")
        rows.append("")
        rows.append("active = per-token parameters in the blocks and final norm (top-k experts only),")
        rows.append("         excluding the input embedding and the LM head (Marin's convention).")
        rows.append(
            f"training FLOPs/token at seq_len {self.seq_len}: {self.flops_per_token:.4g} "
            f"(attention {self.attention_flops_per_token:.4g})"
        )
        return "\n".join(rows)


def _fmt(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.3f}B"
    if n >= 1e6:
        return f"{n / 1e6:.3f}M"
    return f"{n:,}"


def mean_context(seq_len: int, window: int | None) -> float:
    """Mean number of keys a query attends to over a full causal sequence."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    # positions 0..w-1 attend to t+1 keys, the remaining seq_len-w attend to w keys
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def summarize(config: MarinConfig, seq_len: int | None = None) -> ModelSummary:
    """Count parameters and FLOPs of `config` without allocating weights."""
    seq_len = seq_len or config.max_seq_len
    with torch.device("meta"):
        model = MarinForCausalLM(config)
    total = OrderedDict((c, 0) for c in COMPONENTS)
    matmul_active = 0
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total[_component(name)] += p.numel()
    fraction = config.moe.top_k / config.moe.num_experts
    active = OrderedDict((c, n) for c, n in total.items() if c not in ("embedding", "lm_head"))
    active["routed_experts"] = round(total["routed_experts"] * fraction)
    for name, p in model.named_parameters():
        component = _component(name)
        if component in ("embedding", "sconv") or (component == "norms" and p.ndim == 1):
            continue
        if component == "attention" and p.ndim == 1:  # QK-norm gains
            continue
        n = p.numel() * (fraction if component == "routed_experts" else 1)
        matmul_active += n
    if config.tie_embeddings:
        matmul_active += total["embedding"]  # the tied head still multiplies
    attn = config.attention
    attn_flops = sum(
        12 * attn.num_heads * attn.head_dim * mean_context(seq_len, None if block.is_global else attn.sliding_window)
        for block in model.layers
    )
    return ModelSummary(
        total_by_component=dict(total),
        active_by_component=dict(active),
        total=sum(total.values()),
        active=sum(active.values()),
        flops_per_token=6 * matmul_active + attn_flops,
        attention_flops_per_token=attn_flops,
        seq_len=seq_len,
    )


def layer_flops(config: MarinConfig, seq_len: int | None = None) -> list[float]:
    """Training FLOPs a token of each block (forward + backward), counted as `summarize` counts:
    6 x its active matmul parameters, plus its attention scores and values."""
    seq_len = seq_len or config.max_seq_len
    with torch.device("meta"):
        model = MarinForCausalLM(config)
    fraction = config.moe.top_k / config.moe.num_experts
    attn = config.attention
    flops = []
    for i, block in enumerate(model.layers):
        matmul = 0.0
        for name, p in block.named_parameters():
            component = _component(f"layers.{i}.{name}")
            if component == "sconv" or p.ndim == 1:
                continue
            matmul += p.numel() * (fraction if component == "routed_experts" else 1)
        window = None if block.is_global else attn.sliding_window
        flops.append(6 * matmul + 12 * attn.num_heads * attn.head_dim * mean_context(seq_len, window))
    return flops
