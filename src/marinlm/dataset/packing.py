"""Packing a token dataset into training rows: one pure function of (source, row index).

Shape legend: B rows in a batch, L sequence length.

**Packing.** Each epoch of a source is a seeded permutation of its documents laid end to end,
each as `[BOS] tokens [EOS]`. Row j of the epoch is stream positions `[j*L, j*L + L]`: the first
L are `input_ids`, the last L are the next-token `labels`. Any row is computed directly from the
epoch's cumulative lengths.

**Row order.** With `shuffle_rows` (training, by default) the rows of an epoch are drawn in a seeded
pseudo-random order (dataset/permutation.py, constant memory) rather than one after another: a batch
of consecutive rows would otherwise be a few thousand consecutive tokens, often of one long document
(72% of the quickstart's 8 x 256-token batches were a single file). `draw(i)` is the row handed out
i-th; the packing itself, and so the set of rows in an epoch, does not change.

**Boundaries.** `segment_ids` number the documents within a row, so attention and SConv stay
inside a document. A label that belongs to a different document than its input (EOS -> next
BOS) is masked (-100) unless `cross_document_loss` is set.

**Memory.** Token files and document indexes are memory-mapped (shards.TokenDataset), and in
training each shuffled epoch's order is stored once under `index_dir` and mapped by every rank
and worker (PackedSource): a process's own memory does not grow with the number of documents.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from marinlm.dataset.permutation import Permutation
from marinlm.dataset.shards import TokenDataset
from marinlm.utils.io import atomic_path, exclusive, reserve_space, sha256_bytes

IGNORE_INDEX = -100
_CHUNK = 1 << 22  # documents per step when an epoch's stream ends are computed
_ROW_ORDER = 0x726F77  # keeps the row order's seed apart from the document order's


class PackedSource:
    """Rows of L+1 tokens from one token dataset, epoch after epoch.

    An epoch's document order and cumulative stream ends take 16 bytes a document. With `index_dir`
    they are built once, by the first process to need them (the others wait on a file lock), saved
    there as .npy files and memory-mapped: every rank and loader worker of a machine shares one copy
    in the page cache instead of holding its own. The two newest epochs are kept. Without it (the
    unshuffled validation split, tests) each process computes them in memory. Either way the rows
    are the same.
    """

    def __init__(
        self,
        data: TokenDataset,
        seq_len: int,
        seed: int,
        add_bos=True,
        add_eos=True,
        shuffle=True,
        keep_partial=False,
        index_dir: str | Path | None = None,
        shuffle_rows=False,
    ):
        self.data, self.seq_len, self.seed, self.shuffle = data, seq_len, seed, shuffle
        self.shuffle_rows = shuffle_rows
        self.add_bos, self.add_eos = add_bos, add_eos
        self.extra = int(add_bos) + int(add_eos)
        total = data.num_tokens + self.extra * data.num_docs
        rows = (total - 1) // seq_len if not keep_partial else -(-(total - 1) // seq_len)
        if rows <= 0:
            raise ValueError(
                f"{data.folder} ({data.split}): {total} tokens are fewer than one row of seq_len+1 = {seq_len + 1}"
            )
        self.rows_per_epoch = rows
        self.stream_tokens = total
        self.index_dir = None if index_dir is None else Path(index_dir) / self._index_name()
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._row_orders: dict[int, Permutation] = {}

    def _index_name(self) -> str:
        """A folder name for what an epoch's order depends on: the dataset (its manifest, which holds
        every file's hash), the split, the seed and the BOS/EOS framing."""
        key = {"manifest": self.data.manifest, "split": self.data.split, "seed": self.seed}
        key |= {"extra": self.extra, "shuffle": self.shuffle}
        digest = sha256_bytes(json.dumps(key, sort_keys=True).encode())[:16]
        return f"{self.data.folder.name}-{self.data.split}-{digest}"

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Document order and cumulative stream ends of an epoch (the last two are cached)."""
        if epoch not in self._epochs:
            self._epochs[epoch] = self._build_epoch(epoch) if self.index_dir is None else self._stored_epoch(epoch)
            while len(self._epochs) > 2:
                self._epochs.pop(min(self._epochs))
        return self._epochs[epoch]

    def _order(self, epoch: int) -> np.ndarray:
        n = self.data.num_docs
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def _build_epoch(self, epoch: int, ends: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The epoch's order and cumulative stream ends, the ends written into `ends` when given (a
        memory-mapped file), computed a chunk at a time: besides the order (8 bytes a document), only
        the document lengths (4) are held, and the sums are taken in int64."""
        order = self._order(epoch)
        lengths = self.data.all_doc_lens()
        if ends is None:
            ends = np.empty(len(order), dtype=np.int64)
        carry = 0
        for lo in range(0, len(order), _CHUNK):
            part = np.cumsum(lengths[order[lo : lo + _CHUNK]] + self.extra, dtype=np.int64) + carry
            ends[lo : lo + len(part)] = part
            carry = int(part[-1])
        return order, ends

    def _epoch_paths(self, epoch: int) -> tuple[Path, Path]:
        assert self.index_dir is not None
        return self.index_dir / f"epoch-{epoch:06d}.order.npy", self.index_dir / f"epoch-{epoch:06d}.ends.npy"

    def _stored_epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        assert self.index_dir is not None
        stored = self._load_epoch(epoch)
        if stored is None:
            with exclusive(self.index_dir / f"epoch-{epoch:06d}.lock"):
                stored = self._load_epoch(epoch)  # another process may have built it meanwhile
                if stored is None:
                    start = time.perf_counter()
                    order_path, ends_path = self._epoch_paths(epoch)
                    with atomic_path(ends_path) as tmp:
                        ends = np.lib.format.open_memmap(tmp, "w+", np.int64, (self.data.num_docs,))
                        reserve_space(tmp)  # a full disk: an OSError here, not SIGBUS while writing
                        order, _ = self._build_epoch(epoch, ends)
                        ends.flush()
                        del ends
                    with atomic_path(order_path) as tmp, open(tmp, "wb") as f:
                        np.save(f, order)
                    del order
                    self._prune(epoch)
                    stored = self._load_epoch(epoch)
                    if self.data.num_docs >= 1_000_000:  # seconds to minutes: say what the pause was
                        print(
                            f"data: epoch {epoch} of {self.data.folder} shuffled and stored "
                            f"({self.data.num_docs:,} documents, {time.perf_counter() - start:.1f} s)",
                            file=sys.stderr,
                            flush=True,
                        )
        if stored is None:
            raise OSError(f"{self.index_dir}: cannot read back the epoch {epoch} index just written")
        return stored

    def _load_epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The stored epoch, memory-mapped; None if missing or not this dataset's (then it is rebuilt)."""
        try:
            order, ends = (np.load(path, mmap_mode="r") for path in self._epoch_paths(epoch))
        except (OSError, ValueError):
            return None
        n = self.data.num_docs
        if order.shape != (n,) or ends.shape != (n,) or int(ends[-1]) != self.stream_tokens:
            return None
        return order, ends

    def _prune(self, epoch: int) -> None:
        """Remove epochs before the previous one (a process still mapping one keeps its pages)."""
        assert self.index_dir is not None
        for path in self.index_dir.glob("epoch-*"):
            number = path.name.split(".")[0].removeprefix("epoch-")
            if number.isdigit() and int(number) < epoch - 1:
                path.unlink(missing_ok=True)

    def draw(self, index):
        """The row (an index for `row`) handed out `index`-th, an int or an int array: a row of the
        same epoch, each row of an epoch once per epoch."""
        if not self.shuffle_rows:
            return index
        epoch_N, j_N = np.divmod(np.asarray(index, dtype=np.int64), self.rows_per_epoch)
        out = np.empty(np.shape(epoch_N), dtype=np.int64)
        for epoch in np.unique(epoch_N).tolist():
            if epoch not in self._row_orders:  # a different order each epoch; the last two are kept
                self._row_orders[epoch] = Permutation(self.rows_per_epoch, [self.seed, epoch, _ROW_ORDER])
                while len(self._row_orders) > 2:
                    self._row_orders.pop(min(self._row_orders))
            here = epoch_N == epoch
            out[here] = epoch * self.rows_per_epoch + self._row_orders[epoch](j_N[here])
        return int(out) if np.ndim(index) == 0 else out

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [L+1] and global document index per position [L+1] (-1 for padding)."""
        epoch, j = divmod(index, self.rows_per_epoch)
        order, ends = self._epoch(epoch)
        L = self.seq_len
        start, stop = j * L, j * L + L + 1
        tokens = np.empty(L + 1, dtype=np.int64)
        docs = np.full(L + 1, -1, dtype=np.int64)
        k = int(np.searchsorted(ends, start, side="right"))
        pos = start
        while pos < stop and k < len(order):
            doc = int(order[k])
            doc_start = int(ends[k - 1]) if k else 0
            local = self._local_stream(doc)
            lo, hi = pos - doc_start, min(stop, int(ends[k])) - doc_start
            tokens[pos - start : pos - start + hi - lo] = local[lo:hi]
            docs[pos - start : pos - start + hi - lo] = doc
            pos += hi - lo
            k += 1
        if pos < stop:  # a padded final row (validation only)
            tokens[pos - start :] = self.data.eos_id
        return tokens, docs

    def _local_stream(self, doc: int) -> np.ndarray:
        parts = []
        if self.add_bos:
            parts.append(np.array([self.data.bos_id], dtype=np.int64))
        parts.append(np.asarray(self.data.document(doc), dtype=np.int64))
        if self.add_eos:
            parts.append(np.array([self.data.eos_id], dtype=np.int64))
        return np.concatenate(parts)

    def predicted_per_doc(self, docs: np.ndarray) -> np.ndarray:
        """How many of a document's tokens are ever predicted: all but its first stream token."""
        return self.data.doc_len(docs) + self.extra - 1


def build_batch(sources: list[PackedSource], rows: list[tuple[int, int]], cross_document_loss: bool) -> dict:
    """Materialise rows [(source, row index)] into model inputs.

    Returns input_ids, labels (-100 where masked), segment_ids, loss_mask [B, L], and byte_weights
    [B, L]: UTF-8 bytes carried by each predicted token (the document's bytes spread evenly over its
    predicted tokens), for bits-per-byte.
    """
    B, L = len(rows), sources[0].seq_len
    inputs = np.empty((B, L), dtype=np.int64)
    labels = np.empty((B, L), dtype=np.int64)
    segments = np.empty((B, L), dtype=np.int64)
    mask = np.empty((B, L), dtype=bool)
    byte_weights = np.zeros((B, L), dtype=np.float32)
    for b, (s, index) in enumerate(rows):
        source = sources[s]
        tokens, docs = source.row(index)
        inputs[b], labels[b] = tokens[:L], tokens[1:]
        # Number documents within the row (contiguous runs), for attention/SConv masking.
        starts = np.concatenate([[True], docs[1:L] != docs[: L - 1]])
        segments[b] = np.cumsum(starts) - 1
        real = docs[1:] >= 0
        mask[b] = real if cross_document_loss else real & (docs[1:] == docs[:L])
        label_docs = np.where(mask[b], docs[1:], 0)
        per_token = source.data.doc_bytes(label_docs) / np.maximum(source.predicted_per_doc(label_docs), 1)
        byte_weights[b] = np.where(mask[b], per_token, 0.0)
    labels[~mask] = IGNORE_INDEX
    return {
        "input_ids": torch.from_numpy(inputs),
        "labels": torch.from_numpy(labels),
        "segment_ids": torch.from_numpy(segments),
        "loss_mask": torch.from_numpy(mask),
        "byte_weights": torch.from_numpy(byte_weights),
    }
