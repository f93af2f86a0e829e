"""The curation config: sources, filters, dedup, decontamination, mixture and output (`marinlm data run`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from marinlm.config import ConfigError, check
from marinlm.data.classify import ClassifierConfig, TopicConfig
from marinlm.data.decontam import DecontamConfig
from marinlm.data.dedup import DedupConfig
from marinlm.data.executors import check_executor
from marinlm.data.filters import QualityConfig
from marinlm.data.mixture import MixtureConfig
from marinlm.data.normalize import LangIdConfig, NormalizeConfig
from marinlm.data.pii import PIIConfig


@dataclass(kw_only=True)
class SourceSpec:
    name: str
    inputs: list[str]
    text_field: str = "text"
    id_field: str = "id"
    split_pattern: str = ""  # regex splitting .txt files into documents ("" = one document per file)
    # .txt documents longer than this many characters are cut at paragraph breaks (0 = never): one
    # big file (a book, tinyshakespeare.txt) becomes documents the quality rules can judge.
    chunk_chars: int = 0
    weight: float = 1.0  # mixture weight
    tokens: int = 0  # explicit mixture budget in tokens (overrides the weight)

    def __post_init__(self):
        check(bool(self.name) and "/" not in self.name, "name", f"must be a plain name, got {self.name!r}")
        check(bool(self.inputs), "inputs", "give at least one file, folder or glob")
        check(self.weight > 0, "weight", f"must be positive, got {self.weight}")
        check(self.tokens >= 0, "tokens", f"must be >= 0 (0 = use the weight), got {self.tokens}")
        check(self.chunk_chars >= 0, "chunk_chars", f"must be >= 0 (0 = never), got {self.chunk_chars}")
        try:
            re.compile(self.split_pattern)
        except re.error as e:
            raise ConfigError("split_pattern", f"{self.split_pattern!r} is not a valid regex: {e}") from None


SPLIT_BY = ("none", "quality", "topic", "cell")
SPLIT_NEEDS = {"quality": "classifier.enabled", "topic": "topic.enabled", "cell": "classifier and topic enabled"}


@dataclass(kw_only=True)
class OutputConfig:
    format: str = "jsonl.zst"  # or parquet
    # Shards in a folder per quality level (shards/q4/), topic (shards/t07/) or topic x quality
    # cell (shards/t07-q4/): each tokenizes into a source that `data.mixture_phases` can weight.
    split_by: str = "none"

    def __post_init__(self):
        check(self.format in ("jsonl.zst", "parquet"), "format", f"must be jsonl.zst or parquet, got {self.format!r}")
        check(self.split_by in SPLIT_BY, "split_by", f"must be one of {', '.join(SPLIT_BY)}, got {self.split_by!r}")


@dataclass(kw_only=True)
class PipelineConfig:
    sources: list[SourceSpec] = field(default_factory=list)
    output_dir: str = "runs/curated"
    workers: int = 0  # local processes; 0 = one per core
    executor: str = "local"  # local (multiprocessing) or ray
    ray_address: str = ""  # "" = start Ray on this machine; "auto" or host:port to join a cluster
    min_doc_chars: int = 1
    max_doc_bytes: int = 2_000_000  # bigger documents are rejected (and counted), not processed
    # A .jsonl(.gz/.zst) or .parquet input bigger than this (uncompressed) is read in parts of
    # about this size, each a task: one big file then keeps every worker busy, moves the progress
    # bar and resumes part by part. A compressed file gets at most 16 parts. 0 = a task per file.
    split_bytes: int = 8_000_000
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    langid: LangIdConfig = field(default_factory=LangIdConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    classifier: ClassifierConfig = field(default_factory=ClassifierConfig)
    topic: TopicConfig = field(default_factory=TopicConfig)
    pii: PIIConfig = field(default_factory=PIIConfig)
    decontam: DecontamConfig = field(default_factory=DecontamConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    mixture: MixtureConfig = field(default_factory=MixtureConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    progress: bool = True

    def __post_init__(self):
        check_executor(self.executor, self.ray_address)
        check(bool(self.output_dir.strip()), "output_dir", "must name a folder")
        check(self.workers >= 0, "workers", f"must be >= 0, got {self.workers}")
        check(self.split_bytes >= 0, "split_bytes", f"must be >= 0 (0 = a task per file), got {self.split_bytes}")
        names = [s.name for s in self.sources]
        check(len(set(names)) == len(names), "sources", f"source names must be unique, got {names}")
        needs = {"quality": self.classifier.enabled, "topic": self.topic.enabled}
        needs["cell"] = needs["quality"] and needs["topic"]
        split = self.output.split_by
        check(
            split == "none" or needs[split],
            "output.split_by",
            f"{split} needs {SPLIT_NEEDS.get(split)}",
        )
        m = self.mixture
        check(
            not m.quality_weights or (self.classifier.enabled and len(m.quality_weights) == self.classifier.levels),
            "mixture.quality_weights",
            f"needs classifier.enabled and one weight per level ({self.classifier.levels}), got {m.quality_weights}",
        )
        check(
            not m.topic_weights
            or (self.topic.enabled and all(0 <= int(t) < self.topic.num_clusters for t in m.topic_weights)),
            "mixture.topic_weights",
            f"needs topic.enabled and topics in [0, {self.topic.num_clusters}), got {sorted(m.topic_weights)}",
        )


# --- record I/O ---------------------------------------------------------------------------------
