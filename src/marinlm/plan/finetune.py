"""What a fine-tuning config changes in a plan: which weights train, and how the frozen base is stored.

`marinlm plan configs/finetune/gsm8k-lora.yaml --hardware h100-sxm` plans the run as `marinlm
finetune` would make it (finetune/adapters.py):
- gradients and optimizer state only for what trains: every weight (`full`), the matching ones
  (`freeze`), or the LoRA factors and what `lora.train_router/train_norms/train_embeddings` adds;
- the LoRA factors are sharded with the model, so a rank holds its share of them (their total over
  the model's, times the rank's local weights);
- QLoRA keeps the linear layers (not the LM head) and the routed experts in NF4 (half a byte a
  weight, plus a 4-byte scale per block of 64, counted in full); everything else stays fp32;
- frozen weights skip their weight-gradient GEMMs: a third of their training FLOPs;
- activations as in training: an upper bound, since a frozen layer need not keep its input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

FP32 = 4
NF4_BYTES = 0.5 + 4 / 64  # bitsandbytes' NF4: 4 bits a weight and an fp32 absmax per block of 64


@dataclass
class Training:
    """What trains in a plan: `trains(name, shape)` of a model weight, the LoRA factors' total, and
    the bytes a weight is stored in (fp32 unless QLoRA quantises it)."""

    method: str
    adapter_parameters: int
    nf4_weights: frozenset[str]  # QLoRA's 4-bit weights (linear layers and routed experts), by name
    config: object

    def trains(self, name: str, shape: tuple) -> bool:
        method, c = self.method, self.config
        if method == "full":
            return True
        if method == "freeze":
            from marinlm.finetune.adapters import freeze_patterns, matches

            return matches(name, freeze_patterns(c))
        from marinlm.finetune.adapters import trains_whole

        return trains_whole(name, len(shape), c)

    def weight_bytes(self, name: str) -> float:
        return NF4_BYTES if name in self.nf4_weights else FP32


def training(train) -> Training:
    """The Training of a TrainConfig (everything trains) or a FinetuneConfig."""
    method = getattr(train, "method", "full")
    if method in ("full", "freeze"):
        return Training(method, 0, frozenset(), train)
    from marinlm.finetune.adapters import lora_targets
    from marinlm.finetune.grouped_lora import EXPERT_PROJECTIONS
    from marinlm.model import MarinForCausalLM
    from marinlm.model.experts import RoutedExperts

    with torch.device("meta"):
        model = MarinForCausalLM(train.model)
    lora = train.lora
    modules = dict(model.named_modules())
    targets = lora_targets(model, train)
    count = sum(lora.r * (modules[n].in_features + modules[n].out_features) for n in targets)
    experts = {n: m for n, m in modules.items() if isinstance(m, RoutedExperts)}
    if lora.experts:
        for module in experts.values():
            for proj in EXPERT_PROJECTIONS:
                E, d_in, d_out = getattr(module, proj).shape
                count += E * lora.r * (d_in + d_out)
    if method != "qlora":
        return Training(method, count, frozenset(), train)
    skip = set() if lora.lm_head else {"lm_head"}
    linears = {f"{n}.weight" for n, m in modules.items() if type(m) is nn.Linear and n not in skip}
    stacks = {f"{n}.{proj}" for n in experts for proj in EXPERT_PROJECTIONS}
    return Training(method, count, frozenset(linears | stacks), train)
