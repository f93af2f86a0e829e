"""The MoE feed-forward of a Marin block: router, optional latent projection, routed and shared experts.

Shape legend: B batch, T sequence, N = B*T tokens, D d_model, L latent width, E experts, k top-k.

    routed = W_up( experts( RMSNorm( W_down(m) ) ) )     # latent MoE; the router reads full-width m
    out    = routed + sum_i Shared_i(m)
"""

from __future__ import annotations

import torch
from torch import nn

from marinlm.model.config import MoEConfig
from marinlm.model.experts import RoutedExperts, expert_capacity
from marinlm.model.layers import RMSNorm, SwiGLU, trunc_normal_
from marinlm.model.router import Routing, build_router


class MoE(nn.Module):
    def __init__(self, config: MoEConfig, d_model: int, norm_eps: float, init_std: float):
        super().__init__()
        self.config, self.init_std = config, init_std
        self.router = build_router(config.router, d_model, config.num_experts, config.top_k, init_std)
        width = config.latent_dim or d_model
        if config.latent_dim is not None:
            self.latent_down = nn.Linear(d_model, width, bias=False)
            self.latent_norm = RMSNorm(width, norm_eps)
            self.latent_up = nn.Linear(width, d_model, bias=False)
        else:
            self.latent_down = self.latent_norm = self.latent_up = None
        self.experts = RoutedExperts(config.num_experts, width, config.expert_dim, init_std)
        self.shared = nn.ModuleList(
            SwiGLU(d_model, config.shared_expert_dim, init_std) for _ in range(config.num_shared_experts)
        )

    def reset_parameters(self) -> None:
        if self.latent_down is not None:
            trunc_normal_(self.latent_down.weight, self.init_std)
            trunc_normal_(self.latent_up.weight, self.init_std)

    def forward(self, m_BTD: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        B, T, D = m_BTD.shape
        m_ND = m_BTD.reshape(B * T, D)
        routing = self.router(m_ND)
        x_NL = m_ND
        if self.latent_down is not None:
            x_NL = self.latent_norm(self.latent_down(m_ND))
        # Capacity bounds expert-parallel traffic during training; evaluation stays dropless.
        c = self.config
        capacity = priority_N = keep_NK = None
        if self.training and c.capacity_factor is not None and c.capacity == "receiver_pooled":
            keep_NK = self.experts.keep_pooled(
                routing.experts_NK, B, c.capacity_factor, c.capacity_groups, c.capacity_domains, c.capacity_chunks
            )
        elif self.training and c.capacity_factor is not None:
            # Per-expert queues are ordered by sequence position (then row), so an assignment only
            # competes with assignments at the same or earlier positions: causality holds.
            capacity = expert_capacity(B * T, c.top_k, c.num_experts, c.capacity_factor)
            t_BT = torch.arange(T, device=m_BTD.device).expand(B, T)
            priority_N = (t_BT * B + torch.arange(B, device=m_BTD.device).unsqueeze(1)).reshape(-1)
        routed_NL, dropped = self.experts(x_NL, routing.experts_NK, routing.weights_NK, capacity, priority_N, keep_NK)
        routing.stats.dropped = dropped
        out_ND = self.latent_up(routed_NL) if self.latent_up is not None else routed_NL
        for shared in self.shared:
            out_ND = out_ND + shared(m_ND)
        return out_ND.view(B, T, D), routing
