"""`Attention` through FlexAttention: one block mask a forward for causal, window and documents.

Shape legend: B batch, T query length, S key length, H query heads, K KV heads, Dh head dim.

FlexAttention (`torch.nn.attention.flex_attention`) takes the mask as a rule, `mask_mod(b, h, q,
kv)`, evaluated per 128 x 128 tile when the block mask is built: tiles the rule rules out are
skipped, tiles it allows whole run without a mask, and only the tiles on an edge (the diagonal, a
window's edge, a document's edge) apply it element by element. The rule here is the reference's
(`model.context.attention_mask`): same document, key position <= query position, and on local
layers query position - key position < window, read from the forward's document ids and positions.
One block mask is built per forward for the global layers and one for the local ones
(`ForwardContext.memo`); XSA and the head gate stay outside the kernel, in `Attention.forward`.

FlexAttention is a template torch.compile fills in: it is fast only inside a compiled block. torch
2.13 runs its forward on CPU under torch.compile and has no CPU backward, so `apply_kernels` takes
it for compiled blocks on GPUs only; on CPU `tests/test_compile.py` checks its forward against the
reference, and `bench/gpu_check.py` its gradients on a GPU. Decoding with a KV cache keeps SDPA.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from marinlm.kernels.attention import FusedAttention
from marinlm.model.context import ForwardContext

BLOCK = 128  # FlexAttention's tile: queries and keys


def document_mask_mod(doc_BT: torch.Tensor, pos_BT: torch.Tensor, window: int | None):
    """The reference mask as FlexAttention's rule: True where query q of row b may see key kv."""

    def mask_mod(b, h, q, kv):
        distance = pos_BT[b, q] - pos_BT[b, kv]
        allowed = (doc_BT[b, q] == doc_BT[b, kv]) & (distance >= 0)
        if window is not None:
            allowed = allowed & (distance < window)
        return allowed

    return mask_mod


def block_mask(doc_BT: torch.Tensor, pos_BT: torch.Tensor, window: int | None) -> BlockMask:
    """The block mask of one forward's rows, for all heads alike."""
    B, T = doc_BT.shape
    block = min(BLOCK, T)
    return create_block_mask(
        document_mask_mod(doc_BT, pos_BT, window), B, None, T, T, device=doc_BT.device, BLOCK_SIZE=block
    )


class FlexAttention(FusedAttention):
    """The fused QK transform of `FusedAttention`, with the scores through FlexAttention."""

    def layer_mask(self, ctx: ForwardContext):
        window = self.window if self.window is not None and self.window < ctx.doc_BT.shape[1] else None
        return ctx.memo(("flex", window), lambda: block_mask(ctx.doc_BT, ctx.pos_BT, window))

    def attend(self, q_BHTD, k_BKSD, v_BKSD, ctx: ForwardContext, mask) -> torch.Tensor:
        if not isinstance(mask, BlockMask):  # a KV cache's mask (decoding)
            return super().attend(q_BHTD, k_BKSD, v_BKSD, ctx, mask)
        return flex_attention(q_BHTD, k_BKSD, v_BKSD, block_mask=mask, enable_gqa=q_BHTD.shape[1] != k_BKSD.shape[1])
