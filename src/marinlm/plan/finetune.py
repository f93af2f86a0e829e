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
VOCAB_ROWS = ("embed.weight", "lm_head.weight")


@dataclass
class Training:
    """What trains in a plan: `trains(name, shape)` of a model weight, the LoRA factors' total, and
    the bytes a weight is stored in (fp32 unless QLoRA quantises it)."""

    method: str
    adapter_parameters: int
    frozen_linears: frozenset[str]  # QLoRA's 4-bit linear weights, by parameter name (and the experts)
    config: object

    def trains(self, name: str, shape: tuple) -> bool:
        method, c = self.method, self.config
        if method == "full":
            return True
        if method == "freeze":
            from marinlm.finetune.adapters import freeze_patterns, matches

            return matches(name, freeze_patterns(c))
        lora = c.lora
        return bool(
            lora.train_router
            and ".router." in name
            or lora.train_norms
            and "norm" in name
            and len(shape) == 1
            or lora.train_embeddings
            and name in VOCAB_ROWS
        )

    def weight_bytes(self, name: str, shape: tuple) -> float:
        if self.method != "qlora":
            return FP32
        if name in self.frozen_linears or "experts." in name and len(shape) == 3:
            return NF4_BYTES
        return FP32


def training(train) -> Training:
    """The Training of a TrainConfig (everything trains) or a FinetuneConfig."""
    method = getattr(train, "method", "full")
    if method in ("full", "freeze"):
        return Training(method, 0, frozenset(), train)
    from marinlm.finetune.adapters import lora_targets
    from marinlm.model import MarinForCausalLM
    from marinlm.model.experts import RoutedExperts

    with torch.device("meta"):
        model = MarinForCausalLM(train.model)
    lora = train.lora
    modules = dict(model.named_modules())
    targets = lora_targets(model, train)
    count = sum(lora.r * (modules[n].in_features + modules[n].out_features) for n in targets)
    if lora.experts:
        for module in model.modules():
            if isinstance(module, RoutedExperts):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    E, d_in, d_out = getattr(module, proj).shape
                    count += E * lora.r * (d_in + d_out)
    skip = set() if lora.lm_head else {"lm_head"}
    frozen = frozenset(f"{n}.weight" for n, m in modules.items() if type(m) is nn.Linear and n not in skip)
    return Training(method, count, frozen if method == "qlora" else frozenset(), train)
