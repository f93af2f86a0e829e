"""Next-token loss: cross-entropy plus the output-logit z-loss, and the LM head in chunks.

Shape legend: N tokens, D model width, V vocabulary, C tokens in one chunk.

    ce = mean over counted tokens of -log softmax(logits)[label]
    z  = z_weight * mean over counted tokens of logsumexp(logits)²

`NextTokenLoss` with `chunk_tokens > 0` never holds the [N, V] logits of a training step: each
chunk of C tokens computes its logits and losses under activation checkpointing, so only the
chunk's input is kept and the logits are recomputed, one chunk at a time, in the backward pass.
For Marin's 128k vocabulary and 4,096-token rows that is 2 GB of fp32 logits per row never held.
`marinlm.kernels.loss` computes the same with the gradient in closed form (one pass, no
recomputation); `bench/lm_loss.py` measures both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from marinlm.model.layers import compute_dtype

IGNORE_INDEX = -100


def reference_loss(
    logits_NV: torch.Tensor, labels_N: torch.Tensor, z_weight: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ce, z, number of counted tokens, per-token cross-entropy [N]); ce and z are means over
    tokens whose label is kept, and the per-token values are 0 at the others."""
    logits_NV = logits_NV.to(compute_dtype(logits_NV))
    valid_N = labels_N != IGNORE_INDEX
    count = valid_N.sum()
    denominator = count.clamp_min(1)
    nll_N = F.cross_entropy(logits_NV, labels_N, ignore_index=IGNORE_INDEX, reduction="none")
    ce = nll_N.sum() / denominator
    z = torch.zeros((), device=ce.device)
    if z_weight > 0:
        z = z_weight * (torch.logsumexp(logits_NV, dim=-1).square() * valid_N).sum() / denominator
    return ce, z, count, nll_N


def _chunk_sums(h_CD, weight_VD, labels_C):
    """(per-token cross-entropy [C], sum of logsumexp² over counted tokens) of one chunk."""
    logits_CV = F.linear(h_CD, weight_VD)
    logits_CV = logits_CV.to(compute_dtype(logits_CV))
    valid_C = labels_C != IGNORE_INDEX
    nll_C = F.cross_entropy(logits_CV, labels_C, ignore_index=IGNORE_INDEX, reduction="none")
    return nll_C, (torch.logsumexp(logits_CV, dim=-1).square() * valid_C).sum()


class NextTokenLoss(nn.Module):
    """The LM head and the loss over chunks of `chunk_tokens` tokens (see the module docstring).

    No parameters: the head's weight is passed in, so it stays the `lm_head` module's (and the
    embedding's, when tied).
    """

    def __init__(self, z_weight: float, chunk_tokens: int = 1024):
        super().__init__()
        self.z_weight, self.chunk_tokens = z_weight, chunk_tokens

    def forward(self, h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor):
        """(ce + z with a gradient, ce, z, counted tokens, per-token cross-entropy [N])."""
        count = (labels_N != IGNORE_INDEX).sum()
        denominator = count.clamp_min(1).float()
        checkpointed = torch.is_grad_enabled() and (h_ND.requires_grad or weight_VD.requires_grad)
        nll, z_sums = [], []
        for start in range(0, h_ND.shape[0], self.chunk_tokens):
            args = (h_ND[start : start + self.chunk_tokens], weight_VD, labels_N[start : start + self.chunk_tokens])
            nll_C, z_C = checkpoint(_chunk_sums, *args, use_reentrant=False) if checkpointed else _chunk_sums(*args)
            nll.append(nll_C)
            z_sums.append(z_C)
        nll_N = torch.cat(nll)
        ce = nll_N.sum() / denominator
        z = self.z_weight * torch.stack(z_sums).sum() / denominator
        return ce + z, ce, z, count, nll_N
