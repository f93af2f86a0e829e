"""`marinlm tokenizer train`: a byte-level BPE tokenizer (marinlm.tokenizer's `new_bpe`) trained
with HF `tokenizers` on curated shards or text files, read through the curation's readers."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer

from marinlm.config import check
from marinlm.data.inputs import expand_inputs, refuse_other_output
from marinlm.data.readers import Document, read_documents
from marinlm.tokenizer import SPECIAL_TOKENS, MarinTokenizer, train_bpe
from marinlm.utils.io import OutputInUseError, sha256_bytes, write_text_atomic
from marinlm.utils.pool import call_in_child
from marinlm.utils.progress import is_terminal, progress_bar


@dataclass(kw_only=True)
class TokenizerTrainConfig:
    inputs: list[str] = field(default_factory=list)  # files, folders or globs: curated shards or text
    text_field: str = "text"
    output_dir: str = "runs/tokenizer"  # where configs/tokenize/default.yaml looks
    vocab_size: int = 32768  # the hero uses 128,256
    min_frequency: int = 2
    max_bytes: int = 0  # train on about this much text, a share of every input file (0 = all)

    def __post_init__(self):
        check(
            self.vocab_size >= 256 + len(SPECIAL_TOKENS),
            "vocab_size",
            f"must be at least {256 + len(SPECIAL_TOKENS)} (bytes + special tokens), got {self.vocab_size}",
        )
        check(self.min_frequency >= 1, "min_frequency", f"must be >= 1, got {self.min_frequency}")
        check(self.max_bytes >= 0, "max_bytes", f"must be >= 0, got {self.max_bytes}")
        check(bool(self.output_dir.strip()), "output_dir", "must name a folder")


def iter_training_texts(
    inputs: list[str], text_field: str, max_bytes: int, rejected: list | None = None
) -> Iterator[str]:
    """The documents' texts; unreadable records go to `rejected` (if given).

    With `max_bytes`, about that much text, drawn from every input file in proportion to its size
    on disk (each file's first documents), not the first files' alone: curated shards hold one
    source each, so a prefix of the list would leave whole sources, languages or code out of the
    vocabulary.
    """
    paths = expand_inputs(inputs)
    sizes = [os.path.getsize(path) for path in paths]
    total = max(sum(sizes), 1)
    # HF tokenizers draws its own bar on a terminal and nothing elsewhere: there (a log file, a
    # Slurm job) the reading, the long part of training, gets a bar over the input files' bytes.
    shown = not is_terminal(sys.stderr)
    bar = progress_bar(total=sum(sizes), desc="tokenizer: read", unit="B", unit_scale=True, disable=not shown)
    with bar:
        for path, size in zip(paths, sizes, strict=True):
            budget = max_bytes * size / total if max_bytes else float("inf")
            taken = 0
            for item in read_documents(path, text_field=text_field):
                if taken >= budget:
                    break
                if isinstance(item, Document):
                    yield item.text
                    taken += len(item.text.encode())
                elif rejected is not None:
                    rejected.append(item)
            bar.update(size)
    if shown:
        print("tokenizer: computing the merges", file=sys.stderr, flush=True)


SAMPLE_DOCS, SAMPLE_CHARS = 256, 16_384  # the report's compression: a seeded sample of the documents, each clipped


def _train_job(config: TokenizerTrainConfig) -> tuple[str, dict, list, list[str]]:
    """Child process: read the inputs and train; returns the tokenizer's JSON, counts, rejects and a
    seeded sample of the documents (reservoir sampling: any document equally likely)."""
    counted = {"bytes": 0, "docs": 0}
    rejected: list = []
    sample: list[str] = []
    rng = random.Random(0)

    def texts():
        for text in iter_training_texts(config.inputs, config.text_field, config.max_bytes, rejected):
            counted["bytes"] += len(text.encode())
            counted["docs"] += 1
            if len(sample) < SAMPLE_DOCS:
                sample.append(text[:SAMPLE_CHARS])
            elif (k := rng.randrange(counted["docs"])) < SAMPLE_DOCS:
                sample[k] = text[:SAMPLE_CHARS]
            yield text

    trained = train_bpe(texts(), config.vocab_size, config.min_frequency)
    return trained.to_str(), counted, rejected, sample


def train_tokenizer(
    config: TokenizerTrainConfig, replace: bool = False, in_child: bool = False
) -> tuple[MarinTokenizer, dict]:
    """Train and save a tokenizer; returns it and a small report (bytes, seconds, vocab).

    An output folder that already holds a tokenizer is refused before training: token shards made
    with it name it by hash and cannot be read without it. `replace` overwrites it instead.

    `in_child` (the command line does it) trains in a spawned process: HF tokenizers holds the main
    thread while it trains, so Ctrl-C would take effect only when training ends. It is off by
    default because a spawned child re-imports the caller's script, which then needs an
    `if __name__ == "__main__":` guard.
    """
    if not config.inputs:
        raise ValueError("inputs: give at least one file, folder or glob to train on")
    refuse_other_output(Path(config.output_dir), "tokenizer")
    existing = Path(config.output_dir) / "tokenizer.json"
    if existing.is_file() and not replace:
        raise OutputInUseError(
            f"{config.output_dir}: already holds a tokenizer (sha256 {sha256_bytes(existing.read_bytes())[:12]}…), "
            "which token shards made with it need; give another output_dir, or remove it to train a new one"
        )
    start = time.perf_counter()
    trained_json, counted, rejected, sample = call_in_child(_train_job, config) if in_child else _train_job(config)
    trained = Tokenizer.from_str(trained_json)
    if counted["bytes"] == 0:  # a wrong text_field, empty files: a bytes-only tokenizer is no result
        first = f" (first: {rejected[0].location}: {rejected[0].reason})" if rejected else ""
        what = "no document" if counted["docs"] == 0 else f"no text ({counted['docs']} empty document(s))"
        raise ValueError(f"inputs: {what} to train on in {config.inputs}; {len(rejected)} record(s) rejected{first}")
    tok = MarinTokenizer(trained)
    tok.save(config.output_dir)
    report = {
        "vocab_size": tok.vocab_size,
        "vocab_size_requested": config.vocab_size,
        "documents": counted["docs"],
        "rejected": len(rejected),
        "rejected_examples": [f"{r.location}: {r.reason}" for r in rejected[:5]],
        "bytes": counted["bytes"],
        # Compression on (a sample of) the text it was trained on: an upper bound for other text.
        "bytes_per_token": round(
            sum(len(t.encode()) for t in sample) / max(sum(map(len, tok.encode_batch(sample))), 1), 3
        ),
        "bytes_per_token_sample": {"documents": len(sample), "max_chars_each": SAMPLE_CHARS},
        "seconds": round(time.perf_counter() - start, 2),
        "hash": tok.hash,
        "output_dir": str(config.output_dir),
    }
    write_text_atomic(Path(config.output_dir) / "train_report.json", json.dumps(report, indent=2) + "\n")
    return tok, report
