"""Pipeline steps and the per-shard accounting they share.

A step is `run(docs, ctx) -> docs`: a generator in, a generator out (datatrove style). A `Filter`
only decides keep or drop and names a reason; the base class counts, and writes what it dropped
to a side output, so nothing disappears silently. A `Transform` rewrites documents and may count
what it changed.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from marinlm.data.readers import Document


class StepStats:
    """Counts for one step of one shard, per source: documents/bytes in and out, drops by reason."""

    def __init__(self):
        self.docs_in: dict[str, int] = defaultdict(int)
        self.bytes_in: dict[str, int] = defaultdict(int)
        self.docs_out: dict[str, int] = defaultdict(int)
        self.bytes_out: dict[str, int] = defaultdict(int)
        self.dropped: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # source -> reason -> n
        self.counters: dict[str, int] = defaultdict(int)  # e.g. pii_email, lines_removed

    def to_dict(self) -> dict:
        return {
            "docs_in": dict(self.docs_in),
            "bytes_in": dict(self.bytes_in),
            "docs_out": dict(self.docs_out),
            "bytes_out": dict(self.bytes_out),
            "dropped": {s: dict(r) for s, r in self.dropped.items()},
            "counters": dict(self.counters),
        }


class ShardContext:
    """What a step sees of the shard being processed: its stats and the side-output writer."""

    def __init__(self, shard: str, side_dir: Path | None = None):
        self.shard = shard
        self.stats: dict[str, StepStats] = defaultdict(StepStats)
        self.side_dir = side_dir
        self._side_files = {}

    def drop(self, step: str, doc: Document, reason: str, detail: dict | None = None) -> None:
        self.stats[step].dropped[doc.source][reason] += 1
        if self.side_dir is not None:
            f = self._side_files.get(step)
            if f is None:
                path = self.side_dir / step / f"{self.shard}.jsonl"
                path.parent.mkdir(parents=True, exist_ok=True)
                f = self._side_files[step] = open(path, "w")  # noqa: SIM115 - closed in close()
            record = {"id": doc.id, "source": doc.source, "reason": reason, "text": doc.text}
            if detail:
                record["detail"] = detail
            f.write(json.dumps(record, ensure_ascii=False) + "\n")

    def close(self) -> None:
        for f in self._side_files.values():
            f.close()
        self._side_files.clear()

    def counted(self, step: str, docs: Iterator[Document]) -> Iterator[Document]:
        """Count documents flowing out of `step`."""
        stats = self.stats[step]
        return _tally(docs, stats.docs_out, stats.bytes_out)

    def entering(self, step: str, docs: Iterator[Document]) -> Iterator[Document]:
        """Count documents flowing into `step`."""
        stats = self.stats[step]
        return _tally(docs, stats.docs_in, stats.bytes_in)


def _tally(docs: Iterator[Document], n_docs: dict[str, int], n_bytes: dict[str, int]) -> Iterator[Document]:
    for doc in docs:
        n_docs[doc.source] += 1
        n_bytes[doc.source] += len(doc.text.encode("utf-8"))
        yield doc


class Step(ABC):
    name = "step"

    def applies_to(self, doc: Document) -> bool:
        return True

    def passed_over(self, doc: Document, ctx: ShardContext) -> None:  # noqa: B027 - optional hook
        """Called for each document that `applies_to` excludes, which passes through unjudged."""

    @abstractmethod
    def run(self, docs: Iterator[Document], ctx: ShardContext) -> Iterator[Document]: ...

    def __call__(self, docs: Iterator[Document], ctx: ShardContext) -> Iterator[Document]:
        return ctx.counted(self.name, self.run(ctx.entering(self.name, docs), ctx))


class Filter(Step):
    """Keep or drop; subclasses implement `decide` (None = keep, else the drop reason)."""

    @abstractmethod
    def decide(self, doc: Document) -> str | None: ...

    def run(self, docs, ctx):
        for doc in docs:
            applies = self.applies_to(doc)
            if not applies:
                self.passed_over(doc, ctx)
            reason = self.decide(doc) if applies else None
            if reason is None:
                yield doc
            else:
                ctx.drop(self.name, doc, reason)


class Transform(Step):
    """Rewrite documents; `apply` returns the new text (or None to drop as `emptied`)."""

    @abstractmethod
    def apply(self, doc: Document, ctx: ShardContext) -> str | None: ...

    def run(self, docs, ctx):
        for doc in docs:
            if not self.applies_to(doc):
                self.passed_over(doc, ctx)
                yield doc
                continue
            text = self.apply(doc, ctx)
            if text is None or not text.strip():
                ctx.drop(self.name, doc, "emptied")
                continue
            doc.text = text
            yield doc


def language_of(doc: Document) -> str:
    return doc.metadata.get("language", "unknown")
