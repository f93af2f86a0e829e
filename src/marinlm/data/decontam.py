"""Decontamination: n-gram overlap with evaluation sets (GPT-3 / lm-eval-harness style, n = 13).

Text is lower-cased and split into `\\w+` words; each word is hashed (xxh3) and n-grams get a
polynomial rolling hash in numpy. Every text field of an item (question, each choice) is indexed
on its own; fields shorter than n words but at least `min_words` long contribute their
`min_words`-grams, so short questions are still caught. A document that shares any indexed
n-gram with a benchmark is dropped, or has the overlapping words cut out (`mode: remove_span`);
either way it is counted under that benchmark.
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from marinlm.config import check
from marinlm.data.steps import Step
from marinlm.utils.io import json_error, read_utf8

_WORD = re.compile(r"\w+")
_BASE = np.uint64(1_000_003)


@dataclass(kw_only=True)
class DecontamConfig:
    enabled: bool = True
    eval_paths: list[str] = field(default_factory=list)  # files or folders of .jsonl/.json/.csv/.txt
    ngram: int = 13
    min_words: int = 8  # shorter evaluation items are too generic to match on
    mode: str = "drop"  # or remove_span

    def __post_init__(self):
        check(self.ngram >= 1, "ngram", f"must be >= 1, got {self.ngram}")
        check(1 <= self.min_words <= self.ngram, "min_words", f"must be in [1, ngram], got {self.min_words}")
        check(self.mode in ("drop", "remove_span"), "mode", f"must be drop or remove_span, got {self.mode!r}")


def _word_hashes(words: list[str]) -> np.ndarray:
    import dupekit

    if not words:
        return np.zeros(0, dtype=np.uint64)
    return np.asarray(dupekit.hash_xxh3_64_batch([w.encode("utf-8") for w in words]), dtype=np.uint64)


def ngram_hashes(word_hashes: np.ndarray, n: int) -> np.ndarray:
    """Rolling hash of every window of n words (uint64 arithmetic wraps, which is fine for hashing)."""
    count = len(word_hashes) - n + 1
    if count <= 0:
        return np.zeros(0, dtype=np.uint64)
    acc = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            acc = acc * _BASE + word_hashes[j : j + count]
    return acc


def _item_texts(path: Path) -> list[str]:
    """The strings of each evaluation item: every string field of a JSON record (a question, each
    answer choice) separately, or each cell of a CSV row."""

    def strings(value):
        if isinstance(value, str):
            yield value
        elif isinstance(value, list):
            for v in value:
                yield from strings(v)
        elif isinstance(value, dict):
            for v in value.values():
                yield from strings(v)

    text = read_utf8(path, "decontamination eval file is not UTF-8")
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    texts.extend(strings(json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"{path}:{n}: malformed JSON in a decontamination eval file: {json_error(e)}"
                    ) from None
        return texts
    if path.suffix == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path}:{e.lineno}: malformed JSON in a decontamination eval file: {json_error(e)}"
            ) from None
        return [t for item in (records if isinstance(records, list) else [records]) for t in strings(item)]
    if path.suffix == ".csv":
        return [cell for row in csv.reader(io.StringIO(text, newline="")) for cell in row]
    return [p for p in text.split("\n\n") if p.strip()]


def _benchmark_name(path: Path, root: Path) -> str:
    rel = path.relative_to(root) if path.is_relative_to(root) else Path(path.name)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


class NgramIndex:
    """Sorted hash arrays per n-gram length, each hash tagged with its benchmark."""

    def __init__(self, lengths: dict[int, tuple[np.ndarray, np.ndarray]], benchmarks: list[str], ngram: int):
        self.lengths, self.benchmarks, self.ngram = lengths, benchmarks, ngram

    @classmethod
    def build(cls, paths: list[str], ngram: int = 13, min_words: int = 8) -> NgramIndex:
        files: list[tuple[Path, Path]] = []
        for spec in paths:
            root = Path(spec)
            if not root.exists():
                raise FileNotFoundError(f"decontamination eval path does not exist: {spec}")
            found = (
                [root]
                if root.is_file()
                else sorted(p for p in root.rglob("*") if p.suffix in (".jsonl", ".json", ".csv", ".txt"))
            )
            files += [(p, root if root.is_dir() else root.parent) for p in found]
        benchmarks: list[str] = []
        per_length: dict[int, list[tuple[np.ndarray, int]]] = {}
        for path, root in files:
            name = _benchmark_name(path, root)
            if name not in benchmarks:
                benchmarks.append(name)
            b = benchmarks.index(name)
            for text in _item_texts(path):
                words = _WORD.findall(text.lower())
                if len(words) < min_words:
                    continue
                n = ngram if len(words) >= ngram else min_words
                per_length.setdefault(n, []).append((ngram_hashes(_word_hashes(words), n), b))
        lengths = {}
        for n, parts in per_length.items():
            hashes = np.concatenate([h for h, _ in parts])
            owner = np.concatenate([np.full(len(h), b, dtype=np.int32) for h, b in parts])
            order = np.argsort(hashes, kind="stable")
            lengths[n] = (hashes[order], owner[order])
        return cls(lengths, benchmarks, ngram)

    def save(self, path: Path) -> None:
        arrays = {}
        for n, (h, o) in self.lengths.items():
            arrays[f"h{n}"], arrays[f"o{n}"] = h, o
        np.savez(path, benchmarks=np.array(self.benchmarks), ngram=np.array(self.ngram), **arrays)

    @classmethod
    def load(cls, path: Path) -> NgramIndex:
        data = np.load(path, allow_pickle=False)
        lengths = {int(k[1:]): (data[k], data[f"o{k[1:]}"]) for k in data.files if k.startswith("h")}
        return cls(lengths, [str(b) for b in data["benchmarks"]], int(data["ngram"]))

    def matches(self, text: str) -> tuple[list[tuple[int, int]], set[str]]:
        """Matched word spans [start, end) and the benchmarks they belong to."""
        words = _WORD.findall(text.lower())
        hashes = _word_hashes(words)
        spans, names = [], set()
        for n, (index, owner) in self.lengths.items():
            grams = ngram_hashes(hashes, n)
            if not len(grams):
                continue
            pos = np.searchsorted(index, grams)
            pos = np.minimum(pos, len(index) - 1)
            hit = index[pos] == grams
            for i in np.flatnonzero(hit):
                spans.append((int(i), int(i) + n))
                names.add(self.benchmarks[owner[pos[i]]])
        return spans, names


class Decontaminate(Step):
    """Drop a contaminated document, or cut its matched spans (mode `cut`)."""

    name = "decontaminate"

    def __init__(self, config: DecontamConfig, index: NgramIndex):
        self.config, self.index = config, index

    def run(self, docs, ctx):
        counters = ctx.stats[self.name].counters
        for doc in docs:
            spans, names = self.index.matches(doc.text)
            if not names:
                yield doc
                continue
            for name in names:
                counters[f"contaminated_{name}"] += 1
            if self.config.mode == "drop":
                ctx.drop(self.name, doc, "contaminated_" + "+".join(sorted(names)))
                continue
            doc.text = _cut_spans(doc.text, spans)
            counters["spans_removed"] += len(spans)
            if doc.text.strip():
                yield doc
            else:
                ctx.drop(self.name, doc, "emptied")


def _cut_spans(text: str, spans: list[tuple[int, int]]) -> str:
    """Remove the characters from the first to the last word of every matched span."""
    positions = [(m.start(), m.end()) for m in _WORD.finditer(text)]
    covered = np.zeros(len(positions) + 1, dtype=np.int32)
    for start, end in spans:
        covered[start] += 1
        covered[end] -= 1
    covered = np.cumsum(covered)[: len(positions)] > 0
    pieces, cursor, i = [], 0, 0
    while i < len(positions):
        if covered[i]:
            j = i
            while j + 1 < len(positions) and covered[j + 1]:
                j += 1
            pieces.append(text[cursor : positions[i][0]])
            cursor = positions[j][1]
            i = j + 1
        else:
            i += 1
    pieces.append(text[cursor:])
    return "".join(pieces)
