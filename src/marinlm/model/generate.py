"""Incremental decoding with the model's KV cache: greedy, temperature, top-k and top-p sampling,
and a repetition penalty.

Prompts of different lengths are left-padded; padding forms its own "document", so the packed-
document masking that training uses keeps real tokens from ever seeing it, and positions start
at 0 at each prompt's first real token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from marinlm.config import check
from marinlm.model.transformer import MarinForCausalLM


@dataclass(kw_only=True)
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    # CTRL's penalty, as HF transformers' `repetition_penalty`: a token already in the prompt or the
    # output has its logit divided by this when positive, multiplied when negative. 1 = off.
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        check(self.max_new_tokens >= 0, "max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        check(self.temperature >= 0, "temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        check(self.top_k >= 0, "top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1] (1 = off), got {self.top_p}")
        check(
            self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be > 0 (1 = off, above 1 discourages repeats), got {self.repetition_penalty}",
        )


def penalize_repeats(logits_BV: torch.Tensor, seen_BV: torch.Tensor, penalty: float) -> torch.Tensor:
    """Make the tokens marked in `seen_BV` less likely by `penalty` (see SamplingConfig)."""
    if penalty == 1.0:
        return logits_BV
    penalized = torch.where(logits_BV > 0, logits_BV / penalty, logits_BV * penalty)
    return torch.where(seen_BV, penalized, logits_BV)


def filter_logits(logits_BV: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Scale by temperature and mask (to -inf) tokens outside the top-k / top-p nucleus."""
    logits_BV = logits_BV.float() / max(temperature, 1e-8)
    if top_k > 0 and top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits_BV, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the tokens before it already cover top_p; always keep the first.
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
        drop_sorted[..., 0] = False  # the most likely token, even when rounding says it covers top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_idx, drop_sorted)
        logits_BV = logits_BV.masked_fill(drop, float("-inf"))
    return logits_BV


@torch.no_grad()
def stream_generate(
    model: MarinForCausalLM,
    input_ids: torch.Tensor,
    sampling: SamplingConfig,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    vocab_size: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield one [B] tensor of new token ids per step.

    Args:
        input_ids: [B, T] prompts, left-padded when their lengths differ.
        attention_mask: [B, T] 1 for real tokens, 0 for left padding; None = no padding.
        eos_token_id: rows that emit it keep emitting it; generation stops when all rows have.
        vocab_size: only ids below it are produced: the tokenizer's size, where the model's
            vocabulary is padded past it (ids the tokenizer cannot decode would vanish from the text).
    """
    was_training = model.training
    model.eval()
    B, T = input_ids.shape
    device = input_ids.device
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    # Padding is document 0, the prompt document 1; positions count real tokens only.
    doc_BT = attention_mask.long()
    pos_BT = torch.where(attention_mask.bool(), attention_mask.long().cumsum(1) - 1, torch.arange(T, device=device))
    caches = model.empty_caches(B)
    out = model(input_ids, caches=caches, doc_ids=doc_BT, positions=pos_BT, logits_to_keep=1)
    logits_BV = out.logits[:, -1, :vocab_size]
    next_pos_B1 = attention_mask.long().sum(1, keepdim=True)
    finished_B = torch.zeros(B, dtype=torch.bool, device=device)
    seen_BV = None
    if sampling.repetition_penalty != 1.0:  # the prompt's real tokens, then each one generated
        counts_BV = torch.zeros(B, logits_BV.shape[-1], dtype=torch.long, device=device)
        seen_BV = counts_BV.scatter_add_(1, input_ids, attention_mask.long()) > 0  # padding counts 0
    try:
        for step in range(sampling.max_new_tokens):
            if seen_BV is not None:
                logits_BV = penalize_repeats(logits_BV.float(), seen_BV, sampling.repetition_penalty)
            if sampling.temperature == 0:
                token_B = logits_BV.argmax(-1)
            else:
                filtered = filter_logits(logits_BV, sampling.temperature, sampling.top_k, sampling.top_p)
                probs = torch.softmax(filtered, -1)
                token_B = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            if eos_token_id is not None:
                token_B = torch.where(finished_B, torch.full_like(token_B, eos_token_id), token_B)
                finished_B |= token_B == eos_token_id
            if seen_BV is not None:
                seen_BV[torch.arange(B, device=device), token_B] = True
            yield token_B
            if step == sampling.max_new_tokens - 1:  # the last token: nothing will read its logits
                break
            if eos_token_id is not None and bool(finished_B.all()):
                break
            out = model(
                token_B.unsqueeze(1), caches=caches, doc_ids=torch.ones_like(next_pos_B1), positions=next_pos_B1
            )
            logits_BV = out.logits[:, -1, :vocab_size]
            next_pos_B1 = next_pos_B1 + 1
    finally:
        model.train(was_training)


def generate(
    model: MarinForCausalLM,
    input_ids: torch.Tensor,
    sampling: SamplingConfig,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Return [B, T + new] ids: the prompts followed by the generated tokens."""
    steps = list(stream_generate(model, input_ids, sampling, attention_mask, eos_token_id, vocab_size))
    if not steps:
        return input_ids
    return torch.cat([input_ids, torch.stack(steps, dim=1)], dim=1)
