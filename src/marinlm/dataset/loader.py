"""Packing token datasets into training rows, mixing them, and resuming exactly.

Shape legend: B rows in a batch, L sequence length.

**Packing.** Each epoch of a source is a seeded permutation of its documents laid end to end,
each as `[BOS] tokens [EOS]`. Row j of the epoch is stream positions `[j*L, j*L + L]`: the first
L are `input_ids`, the last L are the next-token `labels`. Any row is computed directly from the
epoch's cumulative lengths, so the loader is a pure function of (source, row index).

**Boundaries.** `segment_ids` number the documents within a row, so attention and SConv stay
inside a document. A label that belongs to a different document than its input (EOS -> next
BOS) is masked (-100) unless `cross_document_loss` is set.

**Mixture.** The global batch is assigned to sources by the Webster/Sainte-Laguë divisor rule
(row goes to the source maximising weight / (rows_so_far + 0.5)): the counts track the weights
within one row at every prefix and never go backwards. `mixture_phases` change the weights at given
steps (the hero run's mixture changed after step 108,000); within a phase the rule counts only that
phase's rows, so each phase tracks its own weights from its first batch.

**Memory.** Token files and document indexes are memory-mapped (shards.TokenDataset), and in
training each shuffled epoch's order is stored once under `index_dir` and mapped by every rank
and worker (PackedSource): a process's own memory does not grow with the number of documents.

**State.** The state is the number of global rows consumed and the per-source counts. A data-
parallel rank takes its contiguous slice of each global batch. Because batches are computed
from that state alone, a restore yields exactly the batches an uninterrupted run would have,
with any number of worker processes, and even with a different world size.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from marinlm.config import check
from marinlm.dataset.shards import ShardError, TokenDataset
from marinlm.utils.io import atomic_path, exclusive, reserve_space, sha256_bytes

IGNORE_INDEX = -100
_CHUNK = 1 << 22  # documents per step when an epoch's stream ends are computed


@dataclass(kw_only=True)
class SourceConfig:
    path: str  # a `marinlm tokenize` output folder
    weight: float = 1.0

    def __post_init__(self):
        check(self.weight > 0, "weight", f"must be positive, got {self.weight}")


@dataclass(kw_only=True)
class MixturePhaseConfig:
    start_step: int  # the first optimizer step (0-based) drawn with these weights
    weights: list[float]  # one per source, in the order of data.sources; 0 leaves a source out

    def __post_init__(self):
        check(
            self.start_step > 0, "start_step", f"must be > 0 (phase 0 is the sources' weights), got {self.start_step}"
        )
        check(
            all(w >= 0 for w in self.weights) and sum(self.weights) > 0,
            "weights",
            f"must be >= 0 with a positive sum, got {self.weights}",
        )


@dataclass(kw_only=True)
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    # Later phases of the mixture: from each start_step on, these weights replace the sources'.
    mixture_phases: list[MixturePhaseConfig] = field(default_factory=list)
    seq_len: int = 256
    add_bos: bool = True
    add_eos: bool = True
    cross_document_loss: bool = False  # also predict the first token of the next document
    seed: int = 0
    num_workers: int = 0  # DataLoader worker processes building batches
    verify: str = "size"  # or "full": sha256 and id-range check of every shard at start-up
    # Where training stores each shuffled epoch's document order, shared by the processes of a
    # machine (16 bytes a document, two epochs); "" = RUN_DIR/data-index.
    index_dir: str = ""

    def __post_init__(self):
        check(self.seq_len > 0, "seq_len", f"must be positive, got {self.seq_len}")
        check(self.num_workers >= 0, "num_workers", f"must be >= 0, got {self.num_workers}")
        check(self.verify in ("size", "full"), "verify", f"must be 'size' or 'full', got {self.verify!r}")
        for i, phase in enumerate(self.mixture_phases):
            check(
                len(phase.weights) == len(self.sources),
                f"mixture_phases[{i}].weights",
                f"must give one weight per source ({len(self.sources)}), got {len(phase.weights)}",
            )
            check(
                i == 0 or phase.start_step > self.mixture_phases[i - 1].start_step,
                f"mixture_phases[{i}].start_step",
                f"must be after the previous phase's ({self.mixture_phases[i - 1].start_step if i else 0}), "
                f"got {phase.start_step}",
            )


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
    ):
        self.data, self.seq_len, self.seed, self.shuffle = data, seq_len, seed, shuffle
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


def webster_assign(weights: np.ndarray, counts: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Assign the next n rows to sources by the Webster divisor rule; returns (choices, new counts)."""
    counts = counts.copy()
    choices = np.zeros(n, dtype=np.int64)
    if len(weights) == 1:
        counts[0] += n
        return choices, counts
    for i in range(n):
        s = int(np.argmax(weights / (counts + 0.5)))
        choices[i] = s
        counts[s] += 1
    return choices, counts


class _BatchDataset(torch.utils.data.Dataset):
    """Worker side: turns a batch spec into tensors (map-style, so any worker can build any spec)."""

    def __init__(self, sources, cross_document_loss):
        self.sources, self.cross_document_loss = sources, cross_document_loss

    def __getitem__(self, spec):
        rows, state_after = spec
        batch = build_batch(self.sources, rows, self.cross_document_loss)
        batch["state"] = state_after
        return batch


class TokenLoader:
    """Infinite training batches for one data-parallel rank.

    Args:
        sources, weights: packed sources and their mixture weights.
        global_batch: rows per batch handed out, across all ranks; must divide by world_size.
        rank, world_size: this process's slice of every global batch.
        phases: (first row, weights) of each later phase of the mixture, ascending; a batch that
            starts at or after a phase's first row draws with its weights.
    """

    def __init__(
        self,
        sources: list[PackedSource],
        weights: list[float],
        global_batch: int,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        cross_document_loss: bool = False,
        phases: list[tuple[int, list[float]]] = (),
    ):
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by world size {world_size}")
        if len({s.seq_len for s in sources}) != 1:
            raise ValueError("all sources must pack to the same seq_len")
        self.sources, self.weights = sources, np.asarray(weights, dtype=np.float64)
        self.global_batch, self.rank, self.world_size = global_batch, rank, world_size
        self.num_workers, self.cross_document_loss = num_workers, cross_document_loss
        self.phases = [(0, self.weights)] + [(row, np.asarray(w, dtype=np.float64)) for row, w in phases]
        self.rows_consumed = 0
        self.counts = np.zeros(len(sources), dtype=np.int64)
        self.phase_start_counts = np.zeros(len(sources), dtype=np.int64)  # the counts when the phase began

    def _phase(self, rows_done: int) -> int:
        return max(i for i, (row, _) in enumerate(self.phases) if row <= rows_done)

    def _specs(self) -> Iterator:
        rows_done, counts, base = self.rows_consumed, self.counts.copy(), self.phase_start_counts.copy()
        per_rank = self.global_batch // self.world_size
        phase = self._phase(rows_done)
        while True:
            if self._phase(rows_done) != phase:  # a new phase: its rule counts its own rows only
                phase, base = self._phase(rows_done), counts.copy()
            choices, new_in_phase = webster_assign(self.phases[phase][1], counts - base, self.global_batch)
            new_counts = base + new_in_phase
            index = np.empty(self.global_batch, dtype=np.int64)  # each row's index within its source
            for s in range(len(self.sources)):
                picked = choices == s
                index[picked] = counts[s] + np.arange(int(picked.sum()))
            lo = self.rank * per_rank
            rows = [(int(choices[i]), int(index[i])) for i in range(lo, lo + per_rank)]
            rows_done += self.global_batch
            counts = new_counts
            yield rows, {"rows_consumed": rows_done, "counts": counts.tolist(), "phase_start_counts": base.tolist()}

    def __iter__(self) -> Iterator[dict]:
        dataset = _BatchDataset(self.sources, self.cross_document_loss)
        if self.num_workers == 0:
            batches = (dataset[spec] for spec in self._specs())
        else:
            batches = iter(
                torch.utils.data.DataLoader(
                    dataset,
                    sampler=_SpecSampler(self._specs()),
                    batch_size=None,
                    num_workers=self.num_workers,
                    persistent_workers=False,
                    prefetch_factor=2,
                    worker_init_fn=_ignore_stop_signals,
                )
            )
        for batch in batches:
            state = batch.pop("state")
            self.rows_consumed, self.counts = state["rows_consumed"], np.asarray(state["counts"], dtype=np.int64)
            self.phase_start_counts = np.asarray(state["phase_start_counts"], dtype=np.int64)
            yield batch

    def state_dict(self) -> dict:
        """Position after the last batch handed out (not after prefetched ones)."""
        return {
            "rows_consumed": self.rows_consumed,
            "counts": self.counts.tolist(),
            "phase_start_counts": self.phase_start_counts.tolist(),
            "rows_per_epoch": [s.rows_per_epoch for s in self.sources],
            "seq_len": self.sources[0].seq_len,
        }

    def load_state_dict(self, state: dict) -> None:
        expected = [s.rows_per_epoch for s in self.sources]
        if state["rows_per_epoch"] != expected or state["seq_len"] != self.sources[0].seq_len:
            raise ValueError(
                f"loader state is for sources with rows/epoch {state['rows_per_epoch']} at seq_len {state['seq_len']}, "
                f"but this run has {expected} at seq_len {self.sources[0].seq_len}: the data changed"
            )
        self.rows_consumed = int(state["rows_consumed"])
        self.counts = np.asarray(state["counts"], dtype=np.int64)
        # A state saved before mixture phases existed is in phase 0, which began at zero counts.
        self.phase_start_counts = np.asarray(state.get("phase_start_counts", [0] * len(self.counts)), dtype=np.int64)


def _ignore_stop_signals(worker_id: int) -> None:
    """A scheduler's SIGTERM (or a terminal's Ctrl-C) reaches the loader's workers too. They leave it
    to the trainer, which finishes its step and saves; a worker that died of it would end the run
    at once ("DataLoader worker ... is killed by signal"), with no checkpoint. The loader stops
    them when the run ends."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class _SpecSampler(torch.utils.data.Sampler):
    def __init__(self, specs):
        self.specs = specs

    def __iter__(self):
        return self.specs


def open_dataset(
    config: DataConfig,
    i: int,
    split: str = "train",
    tokenizer_hash: str | None = None,
    model_vocab_size=None,
    verify=None,
) -> TokenDataset:
    """Source i's token dataset; its errors also name the config key (the path may be relative or a default).

    `verify` overrides `config.verify` (a quick look at the manifest need not hash every shard)."""
    try:
        path = config.sources[i].path
        return TokenDataset(path, split, verify or config.verify, tokenizer_hash, model_vocab_size)
    except ShardError as e:
        raise type(e)(f"data.sources[{i}].path: {e}") from None


def open_sources(
    config: DataConfig,
    split: str = "train",
    tokenizer_hash: str | None = None,
    model_vocab_size: int | None = None,
    index_dir: str | Path | None = None,
) -> list[PackedSource]:
    """The packed sources of a split; `index_dir` stores the shuffled epochs (see PackedSource)."""
    if not config.sources:
        raise ValueError("data.sources: give at least one tokenized dataset")
    sources = []
    for i in range(len(config.sources)):
        data = open_dataset(config, i, split, tokenizer_hash, model_vocab_size)
        sources.append(
            PackedSource(
                data,
                config.seq_len,
                config.seed + 1000 * i,
                config.add_bos,
                config.add_eos,
                shuffle=split == "train",
                keep_partial=split != "train",
                index_dir=index_dir if split == "train" else None,
            )
        )
    return sources


def build_loader(
    config: DataConfig,
    global_batch: int,
    rank: int = 0,
    world_size: int = 1,
    tokenizer_hash: str | None = None,
    model_vocab_size: int | None = None,
    index_dir: str | Path | None = None,
    rows_per_step: int | None = None,
) -> TokenLoader:
    """The training loader of one rank. The shuffled epochs are stored in `config.index_dir`, else in
    `index_dir` (the trainer gives RUN_DIR/data-index), else kept in memory. `rows_per_step` (the
    optimizer step's global batch, default `global_batch`) places the mixture phases' start steps."""
    index_dir = config.index_dir or index_dir or None
    sources = open_sources(config, "train", tokenizer_hash, model_vocab_size, index_dir)
    return TokenLoader(
        sources,
        [s.weight for s in config.sources],
        global_batch,
        rank,
        world_size,
        config.num_workers,
        config.cross_document_loss,
        [(p.start_step * (rows_per_step or global_batch), p.weights) for p in config.mixture_phases],
    )


def validation_batches(
    source: PackedSource, batch_size: int, max_rows: int | None = None, rank: int = 0, world_size: int = 1
) -> Iterator[dict]:
    """One pass over a source in document order (padded last row), rows dealt across ranks.

    Every rank yields the same number of batches (collectives in sharded models need that); rows
    past a rank's share are fully masked padding.
    """
    total = source.rows_per_epoch if max_rows is None else min(max_rows, source.rows_per_epoch)
    mine = list(range(rank, total, world_size))
    per_rank = -(-total // world_size)
    padding = per_rank - len(mine)
    rows = mine + [0] * padding
    for i in range(0, per_rank, batch_size):
        chunk = rows[i : i + batch_size]
        batch = build_batch([source], [(0, r) for r in chunk], cross_document_loss=False)
        pad_from = len(mine) - i
        if pad_from < len(chunk):
            batch["labels"][max(pad_from, 0) :] = IGNORE_INDEX
            batch["loss_mask"][max(pad_from, 0) :] = False
            batch["byte_weights"][max(pad_from, 0) :] = 0.0
        yield batch
