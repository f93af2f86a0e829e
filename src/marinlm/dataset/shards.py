"""Token shards: flat memmapped token files plus a per-document index, with a manifest.

Layout of a tokenized dataset folder:

    manifest.json                 tokenizer hash, dtype, per-shard counts and sha256 of every file
    train/00000.tokens            uint16 (vocab <= 65536) or uint32 token ids, documents back to back
    train/00000.docs.npy          int64 [num_docs, 2]: (end offset in tokens, UTF-8 bytes of the text)
    val/00000.tokens, ...         the held-out split, chosen per document by hash(seed, id)
    .done/00000.json              completion marker of input shard 0 (lets a rerun skip it)
    rejected.jsonl                input records that could not be read: location and reason

Documents are stored without BOS/EOS; the loader adds them when packing.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marinlm.utils.io import sha256_file

SPLITS = ("train", "val")


class ShardError(ValueError):
    """A token dataset that is missing, truncated, corrupt or mismatched; the message names the file."""


class EmptySplitError(ShardError):
    """A well-formed token folder whose requested split holds no documents (e.g. val_fraction 0)."""


def not_token_shards(folder: Path) -> str:
    """Why `folder`, which has no usable token manifest, is not a `marinlm tokenize` output, and what
    to give instead (the error's text after the folder's name)."""
    from marinlm.data.inputs import curated_shards, output_kind
    from marinlm.data.readers import SUFFIXES

    tokenize = "marinlm tokenize configs/tokenize/default.yaml --inputs='[{}]' --tokenizer=TOKENIZER --output_dir=DIR"
    if not folder.exists():
        return "no such folder (token shards are made by `marinlm tokenize`, or by `marinlm quickstart`)"
    if not folder.is_dir():
        return "is a file, not a folder of token shards (the folder `marinlm tokenize` wrote)"
    try:
        curated = curated_shards(folder) is not None
    except OSError:
        curated = False
    if curated:
        return f"is a curation (`marinlm data run`), not token shards; tokenize it first: {tokenize.format(folder)}"
    kind = output_kind(folder)
    if kind == "tokenize" and not (folder / "manifest.json").exists():
        return "holds an unfinished `marinlm tokenize` (no manifest.json yet): rerun it to finish"
    if kind == "curate":
        return "holds an unfinished curation (no manifest.json yet): rerun its `marinlm data run`, then tokenize it"
    if kind == "run":
        return f"is a training run's folder, not token shards (its own data sources are in {folder / 'config.yaml'})"
    if kind == "tokenizer":
        return "holds a tokenizer, not token shards"
    inside = sorted(str(m.parent) for m in [*folder.glob("*/manifest.json"), *folder.glob("*/*/manifest.json")])
    inside = [f for f in inside if (Path(f) / "train").is_dir() or (Path(f) / "val").is_dir()]
    if inside:
        return f"holds no token shards itself; the token folders inside it: {', '.join(inside[:5])}"
    if any(f.name.endswith(SUFFIXES) for f in itertools.islice(folder.rglob("*"), 10_000)):
        return f"holds text, not token shards; tokenize it first: {tokenize.format(folder)}"
    return "no manifest.json; is this a finished `marinlm tokenize` output?"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass
class Shard:
    tokens: np.ndarray  # memmap [tokens]
    index: np.ndarray  # memmap int64 [D, 2]: (end offset in tokens, UTF-8 bytes)
    path: Path

    @property
    def num_docs(self) -> int:
        return len(self.index)

    @property
    def doc_ends(self) -> np.ndarray:
        return self.index[:, 0]

    @property
    def doc_bytes(self) -> np.ndarray:
        return self.index[:, 1]


_CHUNK = 1 << 22  # documents per read when a whole index is scanned: bounded memory at any size


class TokenDataset:
    """One split of a tokenized dataset, validated on open.

    Tokens and document indexes stay memory-mapped: a process holds O(shards) of its own memory
    whatever the number of documents, and the pages are shared by every rank and loader worker on
    a machine. Per-document lengths and byte counts are looked up by global document number.

    Args:
        folder: the dataset folder (with manifest.json).
        split: "train" or "val".
        verify: "size" checks every file's length against the manifest and that each document
            index is consistent (cheap, always on); "full" also recomputes sha256 and checks every
            id is below the vocabulary size.
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
            raise ShardError(f"{self.folder}: {not_token_shards(self.folder)}")
        try:
            self.manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as e:
            raise ShardError(f"{manifest_path}: corrupt manifest: {e}") from None
        m = self.manifest
        try:
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
            self.dtype = _token_dtype_of(m["dtype"], self.vocab_size, manifest_path)
            self.split = split
            self.shards = [self._open(entry, verify) for entry in m["splits"][split] if entry["num_docs"] > 0]
        except (KeyError, TypeError, IndexError) as e:  # hand-edited, or not written by `marinlm tokenize`
            from marinlm.data.inputs import output_kind

            tokens = str(m.get("format", "") if isinstance(m, dict) else "").startswith("marinlm-tokens")
            if not tokens and output_kind(self.folder) != "tokenize":  # another folder's manifest
                raise ShardError(f"{self.folder}: {not_token_shards(self.folder)}") from None
            what = f"missing key {e}" if isinstance(e, KeyError) else f"malformed ({e})"
            raise ShardError(f"{manifest_path}: {what}; is this a finished `marinlm tokenize` output?") from None
        self.num_docs = sum(s.num_docs for s in self.shards)
        self.num_tokens = sum(int(s.doc_ends[-1]) for s in self.shards)
        if self.num_docs == 0:
            raise EmptySplitError(f"{self.folder}: split {split!r} has no documents")
        # Global document d lives in shard i where first_doc[i] <= d < first_doc[i + 1].
        self.first_doc = np.cumsum([0] + [s.num_docs for s in self.shards], dtype=np.int64)

    def _open(self, entry: dict, verify: str) -> Shard:
        tokens_path = self.folder / entry["tokens"]
        docs_path = self.folder / entry["docs"]
        if entry["tokens_bytes"] != entry["num_tokens"] * self.dtype.itemsize:
            raise ShardError(
                f"{tokens_path}: the manifest lists {entry['num_tokens']} tokens in {entry['tokens_bytes']} bytes, "
                f"which is not {self.dtype.itemsize} bytes a token as its dtype {self.dtype.name} says: the manifest's "
                "dtype is not the one the shard was written in"
            )
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
            index = np.load(docs_path, mmap_mode="r")
        except Exception as e:
            raise ShardError(f"{docs_path}: unreadable document index: {e}") from None
        if index.ndim != 2 or index.shape != (entry["num_docs"], 2) or index.dtype != np.int64:
            raise ShardError(f"{docs_path}: index {index.dtype} {index.shape}, expected int64 ({entry['num_docs']}, 2)")
        _check_index(index, entry["num_tokens"], docs_path)
        tokens = np.memmap(tokens_path, dtype=self.dtype, mode="r") if entry["num_tokens"] else np.zeros(0, self.dtype)
        if verify == "full" and len(tokens) and int(tokens.max()) >= self.vocab_size:
            raise ShardError(f"{tokens_path}: token id {int(tokens.max())} >= vocab size {self.vocab_size}")
        return Shard(tokens, index, tokens_path)

    def _locate(self, docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.searchsorted(self.first_doc, docs, side="right") - 1
        return shard, docs - self.first_doc[shard]

    def _lookup(self, docs, column: str) -> np.ndarray:
        """Per-document `len` or `bytes` of global document numbers (any shape, int64)."""
        docs = np.asarray(docs, dtype=np.int64)
        unique, inverse = np.unique(docs, return_inverse=True)  # few distinct documents in a batch
        shard, local = self._locate(unique)
        out = np.empty(len(unique), dtype=np.int64)
        for i in np.unique(shard):
            here = shard == i
            index, rows = self.shards[i].index, local[here]
            if column == "bytes":
                out[here] = index[rows, 1]
            else:
                ends = index[rows, 0]
                out[here] = ends - np.where(rows > 0, index[np.maximum(rows - 1, 0), 0], 0)
        return out[inverse].reshape(docs.shape)

    def doc_len(self, docs) -> np.ndarray:
        """Tokens of each given document (stored without BOS/EOS)."""
        return self._lookup(docs, "len")

    def doc_bytes(self, docs) -> np.ndarray:
        """UTF-8 bytes of each given document's text."""
        return self._lookup(docs, "bytes")

    def all_doc_lens(self) -> np.ndarray:
        """Every document's length in global order, built on each call (for building a shuffled
        epoch): [num_docs] int32 (4 bytes a document), or int64 if a document is that long."""
        out = np.empty(self.num_docs, dtype=np.int32)
        for shard, first in zip(self.shards, self.first_doc):
            ends = shard.doc_ends
            for lo in range(0, len(ends), _CHUNK):
                chunk = np.asarray(ends[max(lo - 1, 0) : lo + _CHUNK])
                lengths = np.diff(chunk) if lo else np.concatenate([chunk[:1], np.diff(chunk)])
                if len(lengths) and int(lengths.max()) >= 2**31 - 16 and out.dtype == np.int32:  # room for BOS/EOS
                    out = out.astype(np.int64)
                out[first + lo : first + lo + len(lengths)] = lengths
        return out

    # A read error of network storage (EIO, a stale handle) is often transient: retried this many
    # times, waiting read_backoff_s, then twice that, and so on (`data.read_retries`).
    read_retries: int = 3
    read_backoff_s: float = 0.5

    def document(self, index: int) -> np.ndarray:
        i = int(np.searchsorted(self.first_doc, index, side="right")) - 1
        shard, local = self.shards[i], index - int(self.first_doc[i])
        for attempt in range(self.read_retries + 1):
            try:
                start = int(shard.index[local - 1, 0]) if local else 0
                tokens = np.array(shard.tokens[start : int(shard.index[local, 0])])  # read now, where it can fail
                break
            except OSError as e:
                if attempt == self.read_retries:
                    raise ShardError(
                        f"{shard.path}: reading document {local} failed {attempt + 1} times ({e}); check the "
                        "storage, then resume with the same command"
                    ) from None
                time.sleep(self.read_backoff_s * 2**attempt)
        # Every id below the vocabulary, checked as it is read (`verify: full` checks them all at the
        # start): a corrupt shard would otherwise fail inside the embedding, naming no file.
        if len(tokens) and int(tokens.max()) >= self.vocab_size:
            raise ShardError(
                f"{shard.path}: document {local} holds token id {int(tokens.max())}, not below the vocabulary "
                f"size {self.vocab_size}: the shard is corrupt (re-tokenize it; --data.verify=full checks every id "
                "at the start)"
            )
        return tokens

    @property
    def num_bytes(self) -> int:
        return sum(_chunked_sum(s.doc_bytes) for s in self.shards)


def _token_dtype_of(name, vocab_size: int, manifest: Path) -> np.dtype:
    """The manifest's token dtype, if it is one that `marinlm tokenize` writes and holds every id."""
    try:
        dtype = np.dtype(name)
    except TypeError:
        dtype = None
    if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)):
        raise ShardError(f"{manifest}: dtype {name!r} is not a token dtype (uint16 or uint32)")
    if vocab_size > np.iinfo(dtype).max + 1:
        raise ShardError(f"{manifest}: dtype {name} cannot hold the ids of a {vocab_size}-token vocabulary")
    return dtype


def _chunked_sum(column: np.ndarray) -> int:
    return sum(int(column[i : i + _CHUNK].sum()) for i in range(0, len(column), _CHUNK))


def _check_index(index: np.ndarray, num_tokens: int, path: Path) -> None:
    """Offsets start >= 0, never decrease and end at the manifest's token count; byte counts >= 0.
    Read in chunks: memory stays bounded however many documents the shard has."""
    if not len(index):
        return
    if int(index[-1, 0]) != num_tokens or int(index[0, 0]) < 0:
        raise ShardError(f"{path}: document offsets are inconsistent with {num_tokens} tokens")
    for lo in range(0, len(index), _CHUNK):
        chunk = np.asarray(index[max(lo - 1, 0) : lo + _CHUNK])
        if np.any(np.diff(chunk[:, 0]) < 0):
            raise ShardError(f"{path}: document offsets are inconsistent with {num_tokens} tokens")
        if chunk[:, 1].min() < 0:
            first = max(lo - 1, 0) + int(np.argmin(chunk[:, 1]))
            raise ShardError(f"{path}: negative byte count for document {first}")
