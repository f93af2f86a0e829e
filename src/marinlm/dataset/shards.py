"""Token shards: flat memmapped token files plus a per-document index, with a manifest.

Layout of a tokenized dataset folder:

    manifest.json                 tokenizer hash, dtype, per-shard counts and sha256 of every file
    train/00000.tokens            uint16 (vocab <= 65536) or uint32 token ids, documents back to back
    train/00000.docs.npy          int64 [num_docs, 2]: (end offset in tokens, UTF-8 bytes of the text)
    val/00000.tokens, ...         the held-out split, chosen per document by hash(seed, id)
    .done/00000.json              completion marker of input shard 0 (lets a rerun skip it)

Documents are stored without BOS/EOS; the loader adds them when packing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marinlm.utils.io import sha256_file

SPLITS = ("train", "val")


class ShardError(ValueError):
    """A token dataset that is missing, truncated, corrupt or mismatched; the message names the file."""


class EmptySplitError(ShardError):
    """A well-formed token folder whose requested split holds no documents (e.g. val_fraction 0)."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass
class Shard:
    tokens: np.ndarray  # memmap
    doc_ends: np.ndarray  # [D] int64
    doc_bytes: np.ndarray  # [D] int64
    path: Path

    @property
    def num_docs(self) -> int:
        return len(self.doc_ends)


class TokenDataset:
    """One split of a tokenized dataset, validated on open.

    Args:
        folder: the dataset folder (with manifest.json).
        split: "train" or "val".
        verify: "size" checks every file's length against the manifest (cheap, always on);
            "full" also recomputes sha256 and checks every id is below the vocabulary size.
        tokenizer_hash: when given, must equal the hash recorded at tokenization.
        model_vocab_size: when given, must be at least the tokenizer's vocabulary.
    """

    def __init__(
        self,
        folder: str | Path,
        split: str = "train",
        verify: str = "size",
        tokenizer_hash: str | None = None,
        model_vocab_size: int | None = None,
    ):
        self.folder = Path(folder)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if verify not in ("size", "full"):
            raise ValueError(f"verify must be 'size' or 'full', got {verify!r}")
        manifest_path = self.folder / "manifest.json"
        if not manifest_path.is_file():
            raise ShardError(f"{manifest_path}: no manifest; is this a finished `marinlm tokenize` output?")
        try:
            self.manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as e:
            raise ShardError(f"{manifest_path}: corrupt manifest: {e}") from None
        m = self.manifest
        if tokenizer_hash is not None and tokenizer_hash != m["tokenizer"]["hash"]:
            raise ShardError(
                f"{self.folder}: tokenized with tokenizer {m['tokenizer']['hash'][:12]}…, but the run uses "
                f"{tokenizer_hash[:12]}…; re-tokenize or point at the matching tokenizer"
            )
        self.vocab_size = int(m["tokenizer"]["vocab_size"])
        if model_vocab_size is not None and model_vocab_size < self.vocab_size:
            raise ShardError(
                f"{self.folder}: the model's vocab_size {model_vocab_size} is smaller than the tokenizer's "
                f"{self.vocab_size}; set model.vocab_size >= {self.vocab_size}"
            )
        self.bos_id, self.eos_id = m["tokenizer"]["bos_id"], m["tokenizer"]["eos_id"]
        self.dtype = np.dtype(m["dtype"])
        self.split = split
        self.shards = [self._open(entry, verify) for entry in m["splits"][split] if entry["num_docs"] > 0]
        self.num_docs = sum(s.num_docs for s in self.shards)
        self.num_tokens = sum(int(s.doc_ends[-1]) for s in self.shards)
        if self.num_docs == 0:
            raise EmptySplitError(f"{self.folder}: split {split!r} has no documents")
        # Flat per-document table across shards.
        self.doc_shard = np.concatenate([np.full(s.num_docs, i, dtype=np.int32) for i, s in enumerate(self.shards)])
        starts = [np.concatenate([[0], s.doc_ends[:-1]]) for s in self.shards]
        self.doc_start = np.concatenate(starts).astype(np.int64)
        self.doc_len = np.concatenate([s.doc_ends for s in self.shards]) - self.doc_start
        self.doc_bytes = np.concatenate([s.doc_bytes for s in self.shards])

    def _open(self, entry: dict, verify: str) -> Shard:
        tokens_path = self.folder / entry["tokens"]
        docs_path = self.folder / entry["docs"]
        for path, key in ((tokens_path, "tokens"), (docs_path, "docs")):
            if not path.is_file():
                raise ShardError(f"{path}: missing shard file listed in the manifest")
            size = path.stat().st_size
            if size != entry[f"{key}_bytes"]:
                raise ShardError(
                    f"{path}: {size} bytes on disk, manifest says {entry[f'{key}_bytes']}: truncated or overwritten"
                )
            if verify == "full" and sha256_file(path) != entry[f"{key}_sha256"]:
                raise ShardError(f"{path}: sha256 differs from the manifest: corrupt")
        try:
            docs = np.load(docs_path)
        except Exception as e:
            raise ShardError(f"{docs_path}: unreadable document index: {e}") from None
        if docs.ndim != 2 or docs.shape != (entry["num_docs"], 2):
            raise ShardError(f"{docs_path}: index shape {docs.shape}, expected ({entry['num_docs']}, 2)")
        ends = docs[:, 0]
        if len(ends) and (ends[-1] != entry["num_tokens"] or np.any(np.diff(ends) < 0) or ends[0] < 0):
            raise ShardError(f"{docs_path}: document offsets are inconsistent with {entry['num_tokens']} tokens")
        if len(docs) and docs[:, 1].min() < 0:
            raise ShardError(f"{docs_path}: negative byte count for document {int(np.argmin(docs[:, 1]))}")
        tokens = np.memmap(tokens_path, dtype=self.dtype, mode="r") if entry["num_tokens"] else np.zeros(0, self.dtype)
        if verify == "full" and len(tokens) and int(tokens.max()) >= self.vocab_size:
            raise ShardError(f"{tokens_path}: token id {int(tokens.max())} >= vocab size {self.vocab_size}")
        return Shard(tokens, ends.astype(np.int64), docs[:, 1].astype(np.int64), tokens_path)

    def document(self, index: int) -> np.ndarray:
        shard = self.shards[self.doc_shard[index]]
        start = self.doc_start[index]
        return shard.tokens[start : start + self.doc_len[index]]

    @property
    def num_bytes(self) -> int:
        return int(self.doc_bytes.sum())
