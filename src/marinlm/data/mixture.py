"""Mixture planning: per-source token budgets met by repeating (up-sampling) or sub-sampling documents.

Each source's target is its explicit `tokens`, or its share `weight / sum(weights)` of the total.
A source with fewer tokens than its target repeats every document `floor(target / available)`
times; the remainder, and any down-sampling, takes documents in a seeded hash order until the
target is reached, so the achieved count overshoots by less than one document. Tokens are counted
with a tokenizer when one is given, otherwise estimated as UTF-8 bytes / `bytes_per_token`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from marinlm.config import check


@dataclass(kw_only=True)
class MixtureConfig:
    enabled: bool = False
    total_tokens: int = 0  # 0 = all available tokens, re-weighted by the source weights
    bytes_per_token: float = 4.0
    tokenizer: str = ""  # a tokenizer folder: count real tokens instead of estimating
    seed: int = 0
    # Within each source, a topic x quality cell's share of the source's tokens is its available
    # tokens times quality_weights[level] times topic_weights[topic] (1 where not given), normalised:
    # e.g. [0, 0.5, 1, 1, 2] drops the lowest quality level and doubles the highest.
    quality_weights: list[float] = field(default_factory=list)
    topic_weights: dict[int, float] = field(default_factory=dict)

    def __post_init__(self):
        check(self.total_tokens >= 0, "total_tokens", f"must be >= 0, got {self.total_tokens}")
        check(all(w >= 0 for w in self.quality_weights), "quality_weights", f"must be >= 0, got {self.quality_weights}")
        check(all(w >= 0 for w in self.topic_weights.values()), "topic_weights", "must be >= 0")
        check(self.bytes_per_token > 0, "bytes_per_token", f"must be positive, got {self.bytes_per_token}")


def _order(ids: list[str], seed: int) -> np.ndarray:
    keys = [hashlib.blake2b(f"{seed}\x00{i}".encode(), digest_size=8).digest() for i in ids]
    return np.array(sorted(range(len(ids)), key=keys.__getitem__), dtype=np.int64)


def plan_repeats(tokens: np.ndarray, ids: list[str], target: int, seed: int) -> np.ndarray:
    """How many times each document is emitted so the source totals about `target` tokens."""
    repeats = np.zeros(len(tokens), dtype=np.int64)
    available = int(tokens.sum())
    if available == 0 or target <= 0:
        return repeats
    full, remainder = divmod(target, available)
    repeats[:] = full
    if remainder:
        order = _order(ids, seed)
        cumulative = np.cumsum(tokens[order])
        take = int(np.searchsorted(cumulative, remainder)) + 1  # the first prefix reaching the remainder
        repeats[order[:take]] += 1
    return repeats


def source_targets(
    available: dict[str, int], weights: dict[str, float], explicit: dict[str, int], total: int
) -> dict[str, int]:
    total = total or sum(available.values())
    weighted = {s: w for s, w in weights.items() if not explicit.get(s)}
    left = max(0, total - sum(explicit.values()))
    norm = sum(weighted.values()) or 1.0
    targets = {s: int(explicit[s]) for s in explicit if explicit[s]}
    targets.update({s: int(round(left * w / norm)) for s, w in weighted.items()})
    return targets
