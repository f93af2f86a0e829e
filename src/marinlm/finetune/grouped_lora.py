"""Grouped LoRA of the routed experts: a rank-r adapter per expert, run on each expert's own rows.

The routed experts are 3-D stacks [E, in, out]. peft's `target_parameters` adapts them by building
the whole delta stack B·A for every expert in every forward (E x in x out values per projection).
`GroupedLoraExperts` instead computes x·A·B for each expert's rows with the same grouped GEMM as
the experts, so its extra memory is the rows times the rank (bench/expert_lora.py compares the two).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from marinlm.model.experts import REFERENCE_IMPLS, RoutedExperts, grouped_mm_aligned

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class GroupedLoraExperts(RoutedExperts):
    """Routed experts plus a rank-r adapter per expert and projection: W_e + scale * A_e B_e, applied
    as (x A_e) B_e on the expert's own rows."""

    def add_lora(self, r: int, alpha: float, dropout: float) -> None:
        E = self.num_experts
        self.lora_r, self.lora_scale, self.lora_dropout = r, alpha / r, dropout
        if self.impl not in REFERENCE_IMPLS:
            self.impl = "auto"  # a kernel's name: the adapter runs on the reference grouped GEMM
        for name in EXPERT_PROJECTIONS:
            base = getattr(self, name)
            a = nn.Parameter(torch.empty(E, base.shape[1], r, device=base.device, dtype=base.dtype))
            nn.init.kaiming_uniform_(a.view(E * base.shape[1], r).t(), a=math.sqrt(5))  # as peft's lora_A
            setattr(self, f"lora_A_{name}", a)
            setattr(
                self,
                f"lora_B_{name}",
                nn.Parameter(torch.zeros(E, r, base.shape[2], device=base.device, dtype=base.dtype)),
            )

    def run_experts(self, x_AD, counts_E, impl):
        if impl == "grouped_mm" and not grouped_mm_aligned((self.lora_r,), x_AD.dtype):
            impl = "loop"
        offsets = torch.cumsum(counts_E, 0).to(torch.int32) if impl == "grouped_mm" else None
        splits = None if offsets is not None else counts_E.tolist()

        def mm(x, w):
            w = w.to(x.dtype)
            if offsets is not None:
                return F.grouped_mm(x, w, offs=offsets)
            return torch.cat([x_e @ w[e] for e, x_e in enumerate(x.split(splits))])

        def project(x, name):
            a, b = getattr(self, f"lora_A_{name}"), getattr(self, f"lora_B_{name}")
            x_in = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
            return mm(x, getattr(self, name)) + self.lora_scale * mm(mm(x_in, a), b)

        h_AF = F.silu(project(x_AD, "gate_proj")) * project(x_AD, "up_proj")
        return project(h_AF, "down_proj")

    @torch.no_grad()
    def merge(self, fold: bool = True) -> None:
        """Fold the adapters into the stacks (`fold=False`: drop them) and become plain RoutedExperts.
        The sum is fp32: rounding it to a QLoRA base's bf16 would lose most of a small delta."""
        for name in EXPERT_PROJECTIONS:
            a, b = getattr(self, f"lora_A_{name}"), getattr(self, f"lora_B_{name}")
            if fold:
                w = getattr(self, name)
                w.data = w.float() + self.lora_scale * torch.bmm(a.float(), b.float())
            delattr(self, f"lora_A_{name}")
            delattr(self, f"lora_B_{name}")
        self.__class__ = RoutedExperts
