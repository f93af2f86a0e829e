"""The per-forward context: what every block of one forward needs, computed once and passed down.

Shape legend: B batch, T query length, S key length, R RoPE pairs, K convolution taps.

Masking works from two per-token integers, the packed-document id and the position inside the
document, so one rule covers training on packed rows, left-padded batches and a KV cache: a query
attends to a key iff same document, key position <= query position, and (local layers) query
position - key position < window. SConv taps stop at the same document boundaries.
"""

from __future__ import annotations

import torch


def attention_mask(
    doc_q_BT: torch.Tensor,
    pos_q_BT: torch.Tensor,
    doc_k_BS: torch.Tensor,
    pos_k_BS: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Boolean mask [B, 1, T, S], True where the query may attend to the key."""
    same_doc = doc_q_BT.unsqueeze(-1) == doc_k_BS.unsqueeze(-2)
    distance = pos_q_BT.unsqueeze(-1) - pos_k_BS.unsqueeze(-2)
    allowed = same_doc & (distance >= 0)
    if window is not None:
        allowed &= distance < window
    return allowed.unsqueeze(1)


def sconv_keep_masks(doc_BT: torch.Tensor, kernel_size: int) -> list[torch.Tensor]:
    """Per lag 1..K-1, a boolean [B, T - lag, 1]: True where tap t - lag lies in t's document."""
    return [(doc_BT[:, lag:] == doc_BT[:, :-lag]).unsqueeze(-1) for lag in range(1, kernel_size)]


def rope_cos_sin(pos_BT: torch.Tensor, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, T, rope_dim/2] for integer positions, in fp32."""
    half = rope_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(half, device=pos_BT.device, dtype=torch.float32) / half))
    angles_BTR = pos_BT.float().unsqueeze(-1) * inv_freq
    return angles_BTR.cos(), angles_BTR.sin()


class ForwardContext:
    """Document ids and positions of one forward, and the masks and tables derived from them.

    Built by `MarinForCausalLM.forward` and handed to every block. Derived values are built on
    first use and kept for the rest of the forward (`memo`), so each is computed once however many
    layers read it; kernels (marinlm.kernels) keep their own derived values here too. Nothing
    outlives the forward.

    Attributes:
        doc_BT, pos_BT: [B, T] document id and position inside the document of each token.
        packed: rows may hold several documents (or padding), so attention and SConv need masks.
        decoding: KV caches are in use; attention masks are built per layer against the cache.
        derived: positions advance one per token inside each document (they were derived from
            segment ids here, not passed in), which block-banded local attention relies on.
        window: the local layers' sliding window, None when every layer is global.
    """

    def __init__(self, doc_BT, pos_BT, *, packed: bool, decoding: bool, derived: bool, window: int | None):
        self.doc_BT, self.pos_BT = doc_BT, pos_BT
        self.packed, self.decoding, self.derived, self.window = packed, decoding, derived, window
        self._memo: dict = {}

    def memo(self, key, build):
        """`build()`, computed on the first call with `key` in this forward and given again after."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def rope(self, rope_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables [B, T, rope_dim/2] in fp32 for this forward's positions."""
        return self.memo(("rope", rope_dim, theta), lambda: rope_cos_sin(self.pos_BT, rope_dim, theta))

    def sconv_keep(self, kernel_size: int) -> list[torch.Tensor] | None:
        """`sconv_keep_masks` of this forward's documents; None for one document a row."""
        if not self.packed:
            return None
        return self.memo(("sconv_keep", kernel_size), lambda: sconv_keep_masks(self.doc_BT, kernel_size))

    def mask(self, is_global: bool) -> torch.Tensor | None:
        """The [B, 1, T, T] boolean mask of a global or local layer, or None for plain causal
        attention (one document a row, and any window at least the row's length)."""
        window = None if is_global else self.window
        T = self.doc_BT.shape[1]
        if window is not None and window >= T and not self.packed:
            window = None
        if window is None and not self.packed:
            return None
        return self.memo(
            ("mask", window), lambda: attention_mask(self.doc_BT, self.pos_BT, self.doc_BT, self.pos_BT, window)
        )
