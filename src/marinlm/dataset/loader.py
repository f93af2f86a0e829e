"""Mixing packed token datasets into training batches, and resuming exactly.

Packing a source into rows is dataset/packing.py. Shape legend: B rows in a batch, L sequence length.

**Mixture.** The global batch is assigned to sources by the Webster/Sainte-Laguë divisor rule
(row goes to the source maximising weight / (rows_so_far + 0.5)): the counts track the weights
within one row at every prefix and never go backwards. `mixture_phases` change the weights at given
steps (the hero run's mixture changed after step 108,000); within a phase the rule counts only that
phase's rows, so each phase tracks its own weights from its first batch.

**State.** The state is the number of global rows consumed and the per-source counts. A data-
parallel rank takes every world-th row of each global batch, starting at its rank. Because batches are computed
from that state alone, a restore yields exactly the batches an uninterrupted run would have,
with any number of worker processes, and even with a different world size.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from marinlm.config import check
from marinlm.dataset.packing import IGNORE_INDEX, PackedSource, build_batch
from marinlm.dataset.shards import EmptySplitError, ShardError, TokenDataset


@dataclass(kw_only=True)
class SourceConfig:
    path: str  # a `marinlm tokenize` output folder
    weight: float = 1.0  # 0 leaves it out until a mixture phase weights it (it is still validated on)

    def __post_init__(self):
        check(self.weight >= 0, "weight", f"must be >= 0, got {self.weight}")


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
    # Draw each epoch's rows in a seeded random order, so a batch mixes many documents (packing.py);
    # false hands out consecutive rows: a batch is then a stretch of the document stream.
    shuffle_rows: bool = True
    seed: int = 0
    num_workers: int = 0  # DataLoader worker processes building batches
    verify: str = "size"  # or "full": sha256 and id-range check of every shard at start-up
    # A shard read that fails with an OSError (EIO from network storage) is retried this many times,
    # after read_backoff_s, then twice that, and so on, before the run stops naming the shard.
    read_retries: int = 3
    read_backoff_s: float = 0.5
    # Where training stores each shuffled epoch's document order, shared by the processes of a
    # machine (16 bytes a document, two epochs); "" = RUN_DIR/data-index.
    index_dir: str = ""

    def __post_init__(self):
        check(self.seq_len > 0, "seq_len", f"must be positive, got {self.seq_len}")
        check(self.num_workers >= 0, "num_workers", f"must be >= 0, got {self.num_workers}")
        check(self.verify in ("size", "full"), "verify", f"must be 'size' or 'full', got {self.verify!r}")
        check(self.read_retries >= 0, "read_retries", f"must be >= 0, got {self.read_retries}")
        check(self.read_backoff_s >= 0, "read_backoff_s", f"must be >= 0, got {self.read_backoff_s}")
        check(
            not self.sources or sum(s.weight for s in self.sources) > 0,
            "sources",
            f"the weights must have a positive sum, got {[s.weight for s in self.sources]}",
        )
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
        self.sources = sources
        self.global_batch, self.rank, self.world_size = global_batch, rank, world_size
        self.num_workers, self.cross_document_loss = num_workers, cross_document_loss
        self.phases = [(row, np.asarray(w, dtype=np.float64)) for row, w in [(0, weights), *phases]]
        self.rows_consumed = 0
        self.counts = np.zeros(len(sources), dtype=np.int64)
        self.phase_start_counts = np.zeros(len(sources), dtype=np.int64)  # the counts when the phase began

    def planned_rows(self, total_rows: int) -> np.ndarray:
        """Rows each source gives over the first `total_rows` global rows, phase by phase (the
        divisor rule keeps the real counts within a row of these)."""
        rows = np.zeros(len(self.sources))
        bounds = [row for row, _ in self.phases[1:]] + [total_rows]
        for (start, weights), end in zip(self.phases, bounds, strict=True):
            rows += weights / weights.sum() * max(0, min(end, total_rows) - start)
        return rows

    def planned_epochs(self, total_rows: int) -> list[float]:
        """Passes over each source that the first `total_rows` global rows make."""
        return [float(n / s.rows_per_epoch) for n, s in zip(self.planned_rows(total_rows), self.sources, strict=True)]

    def phase_at(self, rows_done: int) -> int:
        """The phase (0 = `sources`' weights, k = `mixture_phases[k-1]`) that draws the next row."""
        return max(i for i, (row, _) in enumerate(self.phases) if row <= rows_done)

    def _specs(self) -> Iterator:
        rows_done, counts, base = self.rows_consumed, self.counts.copy(), self.phase_start_counts.copy()
        phase = self.phase_at(rows_done)
        while True:
            if (now := self.phase_at(rows_done)) != phase:  # a new phase: its rule counts its own rows only
                phase, base = now, counts.copy()
            choices, new_in_phase = webster_assign(self.phases[phase][1], counts - base, self.global_batch)
            new_counts = base + new_in_phase
            index = np.empty(self.global_batch, dtype=np.int64)  # each row's index within its source
            for s in range(len(self.sources)):  # the n-th row drawn from a source -> its packed row
                picked = choices == s
                index[picked] = self.sources[s].draw(counts[s] + np.arange(int(picked.sum())))
            # Dealt round the ranks (rank r: rows r, r + W, ...), so that any contiguous part of
            # every rank's share (a pipeline micro-batch) is a contiguous part of the global batch.
            rows = [(int(choices[i]), int(index[i])) for i in range(self.rank, self.global_batch, self.world_size)]
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
            "shuffle_rows": self.sources[0].shuffle_rows,
        }

    def load_state_dict(self, state: dict) -> None:
        expected = [s.rows_per_epoch for s in self.sources]
        if state["rows_per_epoch"] != expected or state["seq_len"] != self.sources[0].seq_len:
            raise ValueError(
                f"loader state is for sources with rows/epoch {state['rows_per_epoch']} at seq_len {state['seq_len']}, "
                f"but this run has {expected} at seq_len {self.sources[0].seq_len}: the data changed (data.sources "
                "or data.seq_len). A run resumes on its own data only; to go on from these weights with other "
                "data, start a new run_dir with --checkpoint.init_from=THIS_RUN (fresh optimizer, schedule and "
                "data position), or give the run data.mixture_phases from the start"
            )
        # Rows drawn in another order from the same position would repeat some rows of the epoch and
        # skip others. A state saved before the row order existed drew them in sequence.
        saved_order = bool(state.get("shuffle_rows", False))
        if saved_order != self.sources[0].shuffle_rows:
            raise ValueError(
                f"data.shuffle_rows: the loader state was saved with {str(saved_order).lower()}, this run has "
                f"{str(self.sources[0].shuffle_rows).lower()}; resume with --data.shuffle_rows="
                f"{str(saved_order).lower()} to draw the epoch's remaining rows exactly"
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
        dataset = TokenDataset(path, split, verify or config.verify, tokenizer_hash, model_vocab_size)
        dataset.read_retries, dataset.read_backoff_s = config.read_retries, config.read_backoff_s
        return dataset
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
    return [_packed(config, i, split, tokenizer_hash, model_vocab_size, index_dir) for i in range(len(config.sources))]


def _packed(config: DataConfig, i: int, split: str, tokenizer_hash, model_vocab_size, index_dir=None) -> PackedSource:
    return PackedSource(
        open_dataset(config, i, split, tokenizer_hash, model_vocab_size),
        config.seq_len,
        config.seed + 1000 * i,
        config.add_bos,
        config.add_eos,
        shuffle=split == "train",
        keep_partial=split != "train",
        index_dir=index_dir if split == "train" else None,
        shuffle_rows=config.shuffle_rows,
    )


def source_names(config: DataConfig) -> list[str]:
    """A short name per source for metrics (`val/NAME/loss`): its folder's name, with its index where
    two sources share one."""
    names = [Path(s.path).name or f"source{i}" for i, s in enumerate(config.sources)]
    return [f"{n}.{i}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def validation_sources(
    config: DataConfig, tokenizer_hash: str | None = None, model_vocab_size: int | None = None
) -> tuple[dict[str, PackedSource], list[str]]:
    """Every source's validation split by `source_names`, and the errors of the sources that have none
    (an empty split, e.g. tokenized with val_fraction 0). Any other problem with a split raises."""
    if not config.sources:
        raise ValueError("data.sources: give at least one tokenized dataset")
    found, empty = {}, []
    for i, name in enumerate(source_names(config)):
        try:
            found[name] = _packed(config, i, "val", tokenizer_hash, model_vocab_size)
        except EmptySplitError as e:
            empty.append(str(e))
    return found, empty


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
    """One pass over a source (padded last row), or its first `max_rows` rows in the source's draw
    order, rows dealt across ranks. With `shuffle_rows` (the default) those rows are spread over the
    whole split, not the first few documents of it.

    Every rank yields the same number of batches (collectives in sharded models need that); rows
    past a rank's share are fully masked padding.
    """
    total = source.rows_per_epoch if max_rows is None else min(max_rows, source.rows_per_epoch)
    mine = source.draw(np.arange(rank, total, world_size)).tolist()
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
