"""Stage 2 of the curation pipeline: global dedup and the mixture plan, on hashes only.

Documents are numbered in corpus order (input shards in order, documents in order within a shard);
"first occurrence" and "cluster keeper" always mean the smallest such number, so the result does
not depend on how many workers ran stage 1.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from marinlm.data.classify import cell_name, level_edges, level_of
from marinlm.data.dedup import first_occurrence, fuzzy_clusters
from marinlm.data.mixture import plan_repeats, source_targets

KEEP, EXACT_DUP, FUZZY_DUP, PARAGRAPHS_EMPTIED = 0, 1, 2, 3
ACTION_REASON = {EXACT_DUP: "exact_duplicate", FUZZY_DUP: "fuzzy_duplicate", PARAGRAPHS_EMPTIED: "paragraphs_removed"}


def reduce(work: Path, shards: list[dict], config) -> dict:
    """Compute every shard's plan (written to WORK/stage2/SHARD.plan.npz); return the summary."""
    indexes = [np.load(work / "stage1" / f"{s['shard']}.index.npz") for s in shards]
    counts = [len(ix["doc_hash"]) for ix in indexes]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    n = int(offsets[-1])
    source_of = np.concatenate([np.full(c, i, dtype=np.int64) for i, c in enumerate(counts)]) if n else np.zeros(0, int)
    source_names = [s["source"] for s in shards]
    doc_source = np.array([source_names[i] for i in source_of], dtype=object)
    ids = [doc_id for s in shards for doc_id in s["ids"]]
    action = np.zeros(n, dtype=np.int8)
    keeper = np.arange(n, dtype=np.int64)
    cluster_size = np.ones(n, dtype=np.int64)
    cfg = config.dedup

    if cfg.exact and n:
        first = first_occurrence(np.concatenate([ix["doc_hash"] for ix in indexes]))
        dup = first != np.arange(n)
        action[dup], keeper[dup] = EXACT_DUP, first[dup]

    clusters_by_source: dict[str, Counter] = defaultdict(Counter)
    if cfg.fuzzy and n:
        alive = action == KEEP
        labels = fuzzy_clusters(np.concatenate([ix["bands"] for ix in indexes]), alive)
        sizes = np.bincount(labels[alive], minlength=n)
        dup = alive & (labels != np.arange(n))
        action[dup], keeper[dup] = FUZZY_DUP, labels[dup]
        cluster_size[alive] = sizes[labels[alive]]
        for root in np.flatnonzero(sizes > 1):
            clusters_by_source[doc_source[root]][int(sizes[root])] += 1

    tokens = np.concatenate([ix["tokens"] for ix in indexes]) if n else np.zeros(0, np.int64)
    para_remove: dict[int, list[int]] = defaultdict(list)
    if cfg.paragraphs and n:
        para_doc = np.concatenate([ix["para_doc"] + offsets[i] for i, ix in enumerate(indexes)])
        para_idx = np.concatenate([ix["para_idx"] for ix in indexes])
        para_hash = np.concatenate([ix["para_hash"] for ix in indexes])
        para_tokens = np.concatenate([ix["para_tokens"] for ix in indexes])
        eligible = np.concatenate([ix["para_ok"] for ix in indexes]) & (action[para_doc] == KEEP)
        first = first_occurrence(para_hash, eligible)
        repeat = eligible & (first != np.arange(len(para_hash)))
        for d, p in zip(para_doc[repeat], para_idx[repeat]):
            para_remove[int(d)].append(int(p))
        np.subtract.at(tokens, para_doc[repeat], para_tokens[repeat])
        paragraphs_per_doc = np.bincount(para_doc, minlength=n)
        emptied = np.array([d for d, ps in para_remove.items() if len(ps) == paragraphs_per_doc[d]], dtype=np.int64)
        action[emptied] = PARAGRAPHS_EMPTIED

    kept = action == KEEP
    repeats = kept.astype(np.int64)
    # Quality levels at the quantiles of the kept documents' scores, over the whole corpus.
    scores = np.concatenate([ix["quality"] for ix in indexes]) if n else np.zeros(0)
    topics = np.concatenate([ix["topic"] for ix in indexes]) if n else np.zeros(0, np.int64)
    classified, clustered = config.classifier.enabled, config.topic.enabled
    edges = level_edges(scores[kept], config.classifier.levels) if classified else np.zeros(0)
    levels = level_of(scores, edges) if classified else np.full(n, -1, dtype=np.int64)
    cells = np.array(
        [cell_name(int(t) if clustered else None, int(q) if classified else None) for t, q in zip(topics, levels)],
        dtype=object,
    )
    mixture_report, cell_report = {}, {}
    if config.mixture.enabled and n:
        available = {s.name: int(tokens[kept & (doc_source == s.name)].sum()) for s in config.sources}
        targets = source_targets(
            available,
            {s.name: s.weight for s in config.sources},
            {s.name: s.tokens for s in config.sources},
            config.mixture.total_tokens,
        )
        weight_of = _cell_weights(config, topics, levels)
        for s in config.sources:
            members = np.flatnonzero(kept & (doc_source == s.name))
            # Each cell's share of the source's target: its available tokens times its weight.
            in_source = {c: members[cells[members] == c] for c in sorted(set(cells[members]))}
            mass = {c: float(tokens[m].sum()) * weight_of[m[0]] for c, m in in_source.items()}
            total_mass = sum(mass.values()) or 1.0
            for c, m in in_source.items():
                target = int(round(targets[s.name] * mass[c] / total_mass))
                repeats[m] = plan_repeats(tokens[m], [ids[i] for i in m], target, config.mixture.seed)
                entry = cell_report.setdefault(c, {"available_tokens": 0, "target_tokens": 0, "achieved_tokens": 0})
                entry["available_tokens"] += int(tokens[m].sum())
                entry["target_tokens"] += target
                entry["achieved_tokens"] += int((repeats[m] * tokens[m]).sum())
            achieved = int((repeats[members] * tokens[members]).sum())
            mixture_report[s.name] = {
                "available_tokens": available[s.name],
                "target_tokens": targets[s.name],
                "achieved_tokens": achieved,
                "documents": int(len(members)),
                "emitted_documents": int(repeats[members].sum()),
            }

    (work / "stage2").mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(shards):
        lo, hi = offsets[i], offsets[i + 1]
        removal = [(d - lo, p) for d in range(lo, hi) for p in para_remove.get(d, [])]
        np.savez(
            work / "stage2" / f"{s['shard']}.plan.npz",
            action=action[lo:hi],
            keeper=keeper[lo:hi],
            cluster_size=cluster_size[lo:hi],
            repeats=repeats[lo:hi],
            level=levels[lo:hi],
            para_remove=np.asarray(removal, dtype=np.int64).reshape(-1, 2),
        )
    sources = sorted(set(source_names))
    fuzzy_loss = {}
    for name in sources:
        members = doc_source == name
        before = int((members & (action != EXACT_DUP)).sum())
        lost = int((members & (action == FUZZY_DUP)).sum())
        fuzzy_loss[name] = {
            "documents": before,
            "removed": lost,
            "fraction": lost / before if before else 0.0,
            "clusters_by_size": {int(k): v for k, v in sorted(clusters_by_source[name].items())},
        }
    return {
        "documents": n,
        "kept": int(kept.sum()),
        "exact_duplicates": int((action == EXACT_DUP).sum()),
        "fuzzy_duplicates": int((action == FUZZY_DUP).sum()),
        "paragraphs_removed": int(sum(len(v) for v in para_remove.values())),
        "paragraph_emptied_documents": int((action == PARAGRAPHS_EMPTIED).sum()),
        "fuzzy_by_source": fuzzy_loss,
        "mixture": mixture_report,
        "quality_levels": _level_summary(scores, levels, edges, kept) if classified else None,
        "topics": {str(t): int(c) for t, c in zip(*np.unique(topics[kept], return_counts=True))} if clustered else None,
        "cells": _cell_summary(cells, kept, tokens, cell_report) if classified or clustered else None,
    }


def _cell_weights(config, topics: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Each document's cell weight: quality_weights[level] x topic_weights[topic] (1 where not given)."""
    m = config.mixture
    weight = np.ones(len(topics))
    if m.quality_weights:
        weight *= np.asarray(m.quality_weights, dtype=np.float64)[levels]
    for topic, w in m.topic_weights.items():
        weight[topics == int(topic)] *= w
    return weight


def _level_summary(scores, levels, edges, kept) -> dict:
    members = [(levels == q) & kept for q in range(len(edges) + 1)]
    return {
        "edges": [round(float(e), 6) for e in edges],
        "documents": [int(m.sum()) for m in members],
        "mean_score": [float(scores[m].mean()) if m.any() else None for m in members],
    }


def _cell_summary(cells, kept, tokens, planned: dict) -> dict:
    """Per cell: kept documents and tokens, and with a mixture its target and realised token share."""
    out = {}
    for c in sorted(set(cells[kept])):
        members = kept & (cells == c)
        out[c] = {"documents": int(members.sum()), "tokens": int(tokens[members].sum()), **planned.get(c, {})}
    target_total = sum(v.get("target_tokens", 0) for v in out.values())
    achieved_total = sum(v.get("achieved_tokens", 0) for v in out.values())
    for v in out.values():
        if planned:
            v["target_share"] = v.get("target_tokens", 0) / max(target_total, 1)
            v["realised_share"] = v.get("achieved_tokens", 0) / max(achieved_total, 1)
    return out
