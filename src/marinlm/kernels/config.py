"""How a run computes its model (the `kernels:` section of a train config): choices of
implementation, each computing the same maths as the reference in `marinlm.model`. They are the
run's, not the model's: the same weights run under any of them, and an export carries none."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from marinlm.config import check
from marinlm.model.experts import REFERENCE_IMPLS

# The routed experts' implementations: the reference model's own (model/experts.py), and the
# kernels' (kernels/experts.py): 64-row chunks batched, padded bmm.
EXPERT_IMPLS = ("auto", "grouped_mm", "chunked", "bmm", "loop")


@dataclass(kw_only=True)
class KernelConfig:
    # auto: the fast paths of marinlm.kernels, swapped in before parallelize; reference: the plain
    # modules of marinlm.model everywhere.
    modules: str = "auto"
    experts: str = "auto"  # the routed experts' GEMMs: one of EXPERT_IMPLS
    # > 0: training steps compute the LM head and loss in chunks of this many tokens, never holding
    # the whole [tokens, vocab] logits (model/loss.py); 0: materialise them. On GPUs the fused
    # kernel takes more tokens a chunk where their fp32 logits fit in 512 MiB (kernels/loss.py).
    loss_chunk_tokens: int = 1024

    def __post_init__(self):
        check(self.modules in ("auto", "reference"), "modules", f"must be auto or reference, got {self.modules!r}")
        check(self.experts in EXPERT_IMPLS, "experts", f"must be one of {list(EXPERT_IMPLS)}, got {self.experts!r}")
        check(
            self.modules == "auto" or self.experts in REFERENCE_IMPLS,
            "experts",
            f"{self.experts!r} is a kernel; with modules: reference use {', '.join(REFERENCE_IMPLS)}",
        )
        check(
            self.loss_chunk_tokens >= 0,
            "loss_chunk_tokens",
            f"must be >= 0 (0 = off), got {self.loss_chunk_tokens}",
        )

    def reference(self) -> KernelConfig:
        """These choices on the plain modules (an expert kernel becomes the reference's `auto`)."""
        experts = self.experts if self.experts in REFERENCE_IMPLS else "auto"
        return dataclasses.replace(self, modules="reference", experts=experts)


def move_model_keys(data: dict) -> dict:
    """A train config's mapping with the keys older configs kept under `model:` (run folders'
    config.yaml, checkpoints) moved to `kernels:`: model.kernels to kernels.modules,
    model.loss_chunk_tokens and model.moe.impl to kernels.loss_chunk_tokens and kernels.experts.
    A value given under `kernels:` wins."""
    if not isinstance(data.get("model"), dict):
        return data
    data, model = dict(data), dict(data["model"])
    kernels = dict(data.get("kernels") or {})
    moe = dict(model["moe"]) if isinstance(model.get("moe"), dict) else {}
    for where, old, new in ((model, "kernels", "modules"), (model, "loss_chunk_tokens", "loss_chunk_tokens")):
        if old in where:
            kernels.setdefault(new, where.pop(old))
    if "impl" in moe:
        kernels.setdefault("experts", moe.pop("impl"))
        model["moe"] = moe
    data["model"] = model
    if kernels:
        data["kernels"] = kernels
    return data
