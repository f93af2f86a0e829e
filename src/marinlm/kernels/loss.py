"""The LM head and loss fused, with the gradient in closed form: `NextTokenLoss` without recomputation.

Shape legend: N tokens, D model width, V vocabulary, C tokens in one chunk.

Per chunk of C tokens it computes the logits, one logsumexp that serves both losses, and the
gradient with respect to the logits in closed form,

    d(ce + w·lse²)/d logits = softmax · (1 + 2·w·lse) − onehot(label),

which it turns at once into the chunk's dh = g·W and its share of dW = gᵀ·h. The chunk's logits
are held transposed, [V, C], and worked through in blocks of vocabulary rows (8 MB on CPU; on
GPUs the whole vocabulary, with chunks grown to 512 MiB of logits by `chunk_tokens`): a first pass
computes each block, takes its target logits, folds it into an online logsumexp and leaves
exp(logits − running max) in its place (as exp2, faster on CPU); a second scales each block to
its softmax, turns it into its gradient in place and feeds it to both GEMMs while it is still in
cache. Only dh [N, D] and dW [V, D] are kept for the backward pass; the price is that dW (fp32,
the head's unsharded size) lives from the forward pass until the backward pass reaches the head.
The forward pass does the backward's matmuls, so the fused path is only taken when a backward
pass will follow; under `no_grad` the chunks compute the loss alone. `bench/lm_loss.py` measures
it against the reference.

The LM-head weight is read directly, so it must be a plain (unsharded) tensor in the calling
module's forward; with FSDP2 that holds while the head belongs to the root unit.
"""

from __future__ import annotations

import math

import torch

from marinlm.model.loss import IGNORE_INDEX, NextTokenLoss
from marinlm.utils.device import gemm_dtype

LOG2_E = 1 / math.log(2)


def _chunk_stats(logits_CV, labels_C, valid_C):
    """(per-token cross-entropy [C], 0 where not valid; sum of the valid tokens' logsumexp²).

    One fused log_softmax pass, with logsumexp recovered as target logit − target log-prob (a
    third of torch.logsumexp's time on CPU).
    """
    target_C1 = labels_C.clamp_min(0).unsqueeze(1)
    logp_C = torch.log_softmax(logits_CV, dim=-1).gather(1, target_C1).squeeze(1)
    lse_C = logits_CV.gather(1, target_C1).squeeze(1) - logp_C
    return -logp_C * valid_C, (lse_C.square() * valid_C).sum()


def vocab_block_rows(vocab: int, tokens: int, device: torch.device) -> int:
    """Vocabulary rows per block of a chunk's [V, C] logits: 8 MB of fp32 on CPU, so that a block
    is still in cache when the elementwise work and the next GEMM read it; the whole vocabulary
    on accelerators, where each block costs kernel launches."""
    if device.type != "cpu":
        return vocab
    return max(1, min(vocab, (1 << 21) // max(tokens, 1)))


# On accelerators a chunk's fp32 logits may take 512 MiB: about what the default 1,024 tokens take
# at Marin's 128k vocabulary (501 MiB).
ACCELERATOR_CHUNK_BYTES = 512 << 20


def chunk_tokens(chunk: int, vocab: int, device: torch.device) -> int:
    """Tokens per chunk: `kernels.loss_chunk_tokens` on CPU; on accelerators, more where a smaller
    vocabulary leaves room under ACCELERATOR_CHUNK_BYTES. A chunk costs ~70 torch ops forward and
    backward whatever its size, and a GPU running small chunks waits on their launches
    (bench/lm_loss.py; the numbers are in docs/performance.md)."""
    if device.type == "cpu":
        return chunk
    return max(chunk, ACCELERATOR_CHUNK_BYTES // (4 * vocab))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, weight_VD, labels_N, z_weight, chunk, compute_dtype):
        valid_N = labels_N != IGNORE_INDEX
        # fp32 accumulation (fp64 for fp64 parity runs)
        acc = torch.promote_types(compute_dtype, torch.float32)
        denominator = valid_N.sum().clamp_min(1).to(acc)
        # Where bf16 GEMMs are emulated, bf16 operands and results are held in fp32 (cpu_bf16.py).
        gemm = gemm_dtype(compute_dtype, h_ND.device)
        rounded = compute_dtype != gemm  # results must be rounded to compute_dtype by hand

        def cast(t):
            return t.to(compute_dtype).to(gemm)

        h_cd, w_cd = cast(h_ND), cast(weight_VD)
        V = w_cd.shape[0]
        dh_ND = torch.empty_like(h_cd)
        # The first chunk writes every row of dW, later ones add to it: no zero fill.
        dw_VD = torch.empty(weight_VD.shape, dtype=acc, device=weight_VD.device)
        ce_sum = torch.zeros((), dtype=acc, device=h_ND.device)
        z_sum = torch.zeros_like(ce_sum)
        for start in range(0, h_ND.shape[0], chunk):
            h_CD, labels_C = h_cd[start : start + chunk], labels_N[start : start + chunk]
            C = h_CD.shape[0]
            valid_C = valid_N[start : start + chunk].to(acc)
            # The logits are held transposed, [V, C], so that each vocabulary block is contiguous.
            rows = vocab_block_rows(V, C, h_ND.device)
            blocks = [(s, min(s + rows, V)) for s in range(0, V, rows)]
            logits_VC = torch.empty(V, C, dtype=acc, device=h_ND.device)
            max_C = torch.full((C,), float("-inf"), dtype=acc, device=h_ND.device)
            sumexp_C = torch.zeros(C, dtype=acc, device=h_ND.device)
            target_C = torch.zeros(C, dtype=acc, device=h_ND.device)
            done = []  # per block: its rows, the running max it was exponentiated against, its labels
            for s, e in blocks:  # logits, target logits and an online logsumexp, block by block
                block_BC = logits_VC[s:e]
                if gemm == acc:
                    torch.mm(w_cd[s:e], h_CD.t(), out=block_BC)
                else:
                    block_BC.copy_(w_cd[s:e] @ h_CD.t())
                if rounded:
                    block_BC.copy_(block_BC.to(compute_dtype))
                inside_C = (labels_C >= s) & (labels_C < e)
                in_block_1C = (labels_C - s).clamp(0, e - s - 1).unsqueeze(0)
                target_C = torch.where(inside_C, block_BC.gather(0, in_block_1C).squeeze(0), target_C)
                new_max_C = torch.maximum(max_C, block_BC.amax(0))
                # The block becomes exp(logits - running max) in place: the backward pass rescales
                # it to softmax with one multiply instead of a second exp. As 2^(x·log2 e): torch's
                # CPU exp2 is much cheaper than its exp, at relative error <= 4e-6 against fp64.
                exp_BC = block_BC.sub_(new_max_C).mul_(LOG2_E).exp2_()
                sumexp_C = sumexp_C * torch.exp(max_C - new_max_C) + exp_BC.sum(0)
                max_C = new_max_C
                done.append((s, e, max_C, inside_C, in_block_1C))
            lse_C = max_C + torch.log(sumexp_C)
            ce_sum += ((lse_C - target_C) * valid_C).sum()
            z_sum += (lse_C.square() * valid_C).sum()
            # The gradient of (ce + w·z) / count over each block's logits, in place, and at once
            # the block's share of dh = gᵀ·W and its rows of dW = g·h.
            scale_C = valid_C * (1 + 2 * z_weight * lse_C) / denominator
            dh_CD = torch.zeros(C, h_CD.shape[1], dtype=acc, device=h_ND.device)
            for s, e, block_max_C, inside_C, in_block_1C in done:
                # softmax = exp(logits - block max) · exp(block max - lse)
                grad_BC = logits_VC[s:e].mul_(torch.exp(block_max_C - lse_C) * scale_C)
                grad_BC.scatter_add_(0, in_block_1C, (-valid_C / denominator * inside_C).unsqueeze(0))
                grad_BC = cast(grad_BC)
                if gemm == acc:
                    dh_CD.addmm_(grad_BC.t(), w_cd[s:e])
                else:
                    dh_CD += (grad_BC.t() @ w_cd[s:e]).to(acc)
                if compute_dtype == acc and start == 0:
                    torch.mm(grad_BC, h_CD, out=dw_VD[s:e])
                elif compute_dtype == acc:
                    dw_VD[s:e].addmm_(grad_BC, h_CD)
                elif start == 0:
                    dw_VD[s:e].copy_(cast(grad_BC @ h_CD))
                else:
                    dw_VD[s:e] += cast(grad_BC @ h_CD).to(acc)
            dh_ND[start : start + chunk] = cast(dh_CD)
        ctx.save_for_backward(dh_ND.to(h_ND.dtype), dw_VD.to(weight_VD.dtype))
        ce, z = ce_sum / denominator, z_weight * z_sum / denominator
        ctx.mark_non_differentiable(ce, z)
        return ce + z, ce, z

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_z):
        dh_ND, dw_VD = ctx.saved_tensors
        # Scaled even where grad_loss is 1: testing for 1 would read it back to the host.
        return dh_ND * grad_loss.to(dh_ND.dtype), dw_VD * grad_loss.to(dw_VD.dtype), None, None, None, None


def fused_chunked_loss(
    h_ND: torch.Tensor, weight_VD: torch.Tensor, labels_N: torch.Tensor, z_weight: float, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(ce + z with a gradient, ce, z, counted tokens, per-token cross-entropy [N] or None) without
    holding the [N, V] logits. The per-token values (0 at ignored labels; what scoring needs) come
    from the pass without a gradient only; the fused training pass never forms them."""
    device = h_ND.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else h_ND.dtype
    count = (labels_N != IGNORE_INDEX).sum()
    chunk = chunk_tokens(chunk, weight_VD.shape[0], h_ND.device)
    if torch.is_grad_enabled() and (h_ND.requires_grad or weight_VD.requires_grad):
        with torch.autocast(device, enabled=False):
            loss, ce, z = _FusedLinearCrossEntropy.apply(h_ND, weight_VD, labels_N, z_weight, chunk, dtype)
        return loss, ce, z, count, None
    acc = torch.promote_types(dtype, torch.float32)
    denominator = count.clamp_min(1).to(acc)
    nll_N = torch.empty(h_ND.shape[0], dtype=acc, device=h_ND.device)
    z_sum = torch.zeros((), dtype=acc, device=h_ND.device)
    gemm = gemm_dtype(dtype, h_ND.device)
    w_cd = weight_VD.to(dtype).to(gemm)
    for start in range(0, h_ND.shape[0], chunk):
        labels_C = labels_N[start : start + chunk]
        with torch.autocast(device, enabled=False):
            logits_CV = (h_ND[start : start + chunk].to(dtype).to(gemm) @ w_cd.t()).to(dtype).to(acc)
        nll_N[start : start + chunk], z_c = _chunk_stats(logits_CV, labels_C, (labels_C != IGNORE_INDEX).to(acc))
        z_sum = z_sum + z_c
    ce, z = nll_N.sum() / denominator, z_weight * z_sum / denominator
    return ce + z, ce, z, count, nll_N


class FusedNextTokenLoss(NextTokenLoss):
    def forward(self, h_ND, weight_VD, labels_N):
        return fused_chunked_loss(h_ND, weight_VD, labels_N, self.z_weight, self.chunk_tokens)
