"""Exact and fuzzy deduplication on hashes only (no texts in memory).

- Exact: xxh3-64 of each document, and of each paragraph (blank-line separated). The first
  occurrence in corpus order (shard, then position) is kept.
- Fuzzy: MinHash over character 5-grams with 286 permutations in 26 bands of 11 rows (Marin's
  defaults), computed by `marin-dupekit` (Marin's Rust kernels). Documents sharing a band value are
  linked; connected components are clusters, and the member earliest in corpus order is kept.

Per cluster and per source the sizes are reported: MinHash LSH over templated sources can merge
most of a source (Marin saw 90-99% losses), and the report makes that loud instead of silent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from marinlm.config import check


@dataclass(kw_only=True)
class DedupConfig:
    exact: bool = True
    paragraphs: bool = True
    paragraph_skip_languages: list[str] = field(default_factory=lambda: ["code"])  # never cut code blocks
    min_paragraph_words: int = 5  # shorter paragraphs are never removed as duplicates
    fuzzy: bool = True
    num_perms: int = 286
    num_bands: int = 26
    ngram: int = 5  # characters
    seed: int = 42
    warn_source_loss: float = 0.5  # flag sources losing more than this share to fuzzy dedup

    def __post_init__(self):
        check(
            self.num_perms > 0 and self.num_bands > 0 and self.num_perms % self.num_bands == 0,
            "num_bands",
            f"must divide num_perms={self.num_perms}, got {self.num_bands}",
        )
        check(self.ngram >= 1, "ngram", f"must be >= 1, got {self.ngram}")


def minhash_bands(texts: list[str], config: DedupConfig) -> np.ndarray:
    """[len(texts), num_bands] uint64 LSH band hashes (cleaned text, char n-gram MinHash)."""
    import dupekit

    if not texts:
        return np.zeros((0, config.num_bands), dtype=np.uint64)
    T = dupekit.Transformation
    batch = pa.RecordBatch.from_pydict({"id": [str(i) for i in range(len(texts))], "text": texts})
    out = dupekit.transform(
        batch,
        [
            T.CleanText("text", "clean"),
            T.MinHash("clean", "signature", config.num_perms, config.ngram, config.seed),
            T.MinHashLSH("signature", "bands", config.num_bands),
        ],
    )
    bands = out.column("bands")
    return np.asarray(bands.values.to_numpy(zero_copy_only=False), dtype=np.uint64).reshape(len(texts), -1)


def xxh3(texts: list[str]) -> np.ndarray:
    import dupekit

    return np.asarray(dupekit.hash_xxh3_64_batch([t.encode("utf-8") for t in texts]), dtype=np.uint64)


def first_occurrence(hashes: np.ndarray, alive: np.ndarray | None = None) -> np.ndarray:
    """Index of the first alive item with the same hash, for every item (-1 for dead items)."""
    n = len(hashes)
    alive = np.ones(n, dtype=bool) if alive is None else alive
    idx = np.flatnonzero(alive)
    keeper = np.full(n, -1, dtype=np.int64)
    if len(idx) == 0:
        return keeper
    order = idx[np.argsort(hashes[idx], kind="stable")]  # equal hashes stay in corpus order
    sorted_hashes = hashes[order]
    starts = np.concatenate([[True], sorted_hashes[1:] != sorted_hashes[:-1]])
    group_first = order[np.flatnonzero(starts)]
    group_id = np.cumsum(starts) - 1
    keeper[order] = group_first[group_id]
    return keeper


def connected_components(n: int, edges_u: np.ndarray, edges_v: np.ndarray) -> np.ndarray:
    """Label every node with the smallest node index in its component (min-label propagation with
    pointer jumping, vectorised)."""
    labels = np.arange(n, dtype=np.int64)
    if len(edges_u) == 0:
        return labels
    while True:
        before = labels.copy()
        low = np.minimum(labels[edges_u], labels[edges_v])
        np.minimum.at(labels, edges_u, low)
        np.minimum.at(labels, edges_v, low)
        labels = labels[labels]  # jump towards the root
        while True:
            jumped = labels[labels]
            if np.array_equal(jumped, labels):
                break
            labels = jumped
        if np.array_equal(labels, before):
            return labels


def fuzzy_clusters(bands: np.ndarray, alive: np.ndarray) -> np.ndarray:
    """Cluster label (smallest member index) of each alive document; -1 for dead ones."""
    n = len(bands)
    idx = np.flatnonzero(alive)
    us, vs = [], []
    for b in range(bands.shape[1]):
        column = bands[idx, b]
        order = np.argsort(column, kind="stable")
        same = column[order][1:] == column[order][:-1]
        us.append(idx[order][:-1][same])
        vs.append(idx[order][1:][same])
    labels = connected_components(
        n, np.concatenate(us) if us else np.zeros(0, np.int64), np.concatenate(vs) if vs else np.zeros(0, np.int64)
    )
    labels[~alive] = -1
    return labels
