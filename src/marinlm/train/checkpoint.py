"""Sharded checkpoints with torch.distributed.checkpoint (DCP), written atomically, loaded safely.

A checkpoint is a folder `RUN/checkpoints/step-00000100/`:

    __0_0.distcp, ...     model and optimizer tensors, one file per rank (DCP)
    .metadata             DCP's index
    trainer_state.json    step, scheduler, loader position, pending router state, counters
    rng/rank-00000.pt     every rank's RNG state (tensors only)
    config.yaml           the resolved run config
    tokenizer/            the run's tokenizer, so a checkpoint copied anywhere still generates and evaluates
    COMPLETE.json         written last: size and sha256 of every file above

It is written under `step-00000100.tmp` and renamed once every rank has finished, so a killed job
leaves at most an ignorable `.tmp` folder. A folder whose COMPLETE.json is missing or disagrees
with the files is reported and skipped by `--resume auto`, which falls back to the previous one.

Nothing executable is unpickled on load, and a checkpoint of another model or optimizer is refused
by name (train/safe_load.py).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from marinlm.config import ConfigError
from marinlm.parallel.distributed import all_gather_object, barrier
from marinlm.train.safe_load import (  # noqa: F401  (re-exported: the checkpoint API in one place)
    CheckpointError,
    CheckpointMismatch,
    SafeFileSystemReader,
    check_same_structure,
    load_tensors,
)
from marinlm.utils.io import sha256_file, write_json_atomic, write_text_atomic

STEP_PREFIX = "step-"
# Free space under which a failed write is put down to a full disk (torch.save reports ENOSPC as
# "unexpected pos" from its zip writer, not as an OSError).
FULL_DISK_BYTES = 16 << 20


# DCP warns at every save and load without a process group that it assumes one process: that is
# the intended mode here (a single-process run, or inference), not a mistake to report. The filter is
# process-wide because an asynchronous save writes in DCP's own thread, after any `catch_warnings`
# block around the call has ended; it matches that one message only.
warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written (most often: no space left). Nothing half-written is
    left behind: the message names the folder, the space there and the newest good checkpoint."""


def local_bytes(tree) -> int:
    """Bytes of tensor data this rank writes for a (nested) DCP state dict: a DTensor's local shard."""
    if isinstance(tree, dict):
        return sum(local_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(local_bytes(v) for v in tree)
    if isinstance(tree, DTensor):
        return tree.to_local().nbytes
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    return 0


def estimate_local_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """What this rank's share of a checkpoint will take: its weights, buffers and optimizer state.
    Before the first step the optimizer holds no state yet; a Muon(H) group then counts one
    momentum per parameter and any other (Adam, AdamW, AdamH) two moments."""
    tensors = local_bytes(dict(model.state_dict()))
    if any(optimizer.state.values()):
        return tensors + local_bytes({i: dict(st) for i, st in enumerate(optimizer.state.values())})
    for group in optimizer.param_groups:
        tensors += local_bytes(list(group["params"])) * (1 if group.get("kind") in ("muonh", "muon") else 2)
    return tensors


def free_bytes(path: Path) -> int:
    """Free space on the filesystem that holds `path` (or would: its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def _root_cause(error: BaseException) -> str:
    """One line for why a save failed: DCP wraps each rank's error (with its traceback) in a
    CheckpointException; an OSError says which file and why."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(failures.items()))
        inner = inner[0] if isinstance(inner, tuple) else inner  # DCP's (exception, traceback) pair
        return f"rank {rank}: {_root_cause(inner)}"
    if isinstance(error, OSError) and error.strerror:
        return f"{error.filename}: {error.strerror}" if error.filename else error.strerror
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if "inline_container" in first or "unexpected pos" in first:  # torch's zip writer, cut short
        return "a file was cut short while being written (torch's writer: " + first.split("] ")[-1].strip(". ") + ")"
    return f"{type(error).__name__}: {first}"[:300]


def step_dir(root: Path, step: int) -> Path:
    return root / f"{STEP_PREFIX}{step:08d}"


def step_of(folder: Path) -> int:
    """The step of a checkpoint folder (`step-00000100` or its `.tmp`)."""
    return int(folder.name.removeprefix(STEP_PREFIX).removesuffix(".tmp"))


def is_checkpoint_folder(path: Path) -> bool:
    """A checkpoint folder (finished, or named as one), not a run folder holding `checkpoints/`."""
    return (path / "COMPLETE.json").exists() or path.name.startswith(STEP_PREFIX)


def list_checkpoints(root: Path) -> list[Path]:
    """Finished-looking checkpoint folders, newest first (temporary folders excluded)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX) and not p.name.endswith(".tmp")]
    return sorted(found, key=lambda p: p.name, reverse=True)


def checkpoints_beside(missing: Path) -> str:
    """For the error about a checkpoint folder that is not there: the ones its parent holds, if any."""
    there = [p.name for p in reversed(list_checkpoints(missing.parent))]
    return f"; {missing.parent} holds {', '.join(there)}" if there else ""


def validate(folder: Path, rank: int = 0, world_size: int = 1) -> None:
    """Raise CheckpointError unless COMPLETE.json exists and every listed file has its size and hash.

    Under torchrun every rank calls it, and the ranks split the hashing (rank r reads every
    world_size-th file): a hero checkpoint is terabytes, which each of thousands of ranks would
    otherwise read whole. All ranks then raise, or not, together.
    """
    if world_size == 1:
        _validate_share(folder, 0, 1)
        return
    problem = None
    try:
        _validate_share(folder, rank, world_size)
    except CheckpointError as e:
        problem = str(e)
    problems = [p for p in all_gather_object(problem) if p is not None]
    if problems:
        raise CheckpointError(problems[0])


def _validate_share(folder: Path, rank: int, world_size: int) -> None:
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder{checkpoints_beside(folder)}")
    marker = folder / "COMPLETE.json"
    if not marker.is_file():
        raise CheckpointError(f"{folder}: no COMPLETE.json, the save did not finish")
    try:
        listing = json.loads(marker.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{marker}: unreadable completion marker: {e}") from None
    listing = listing.get("files") if isinstance(listing, dict) else None
    well_formed = isinstance(listing, dict) and all(
        isinstance(info, dict) and isinstance(info.get("size"), int) and isinstance(info.get("sha256"), str)
        for info in listing.values()
    )
    if not well_formed:
        raise CheckpointError(
            f'{marker}: a completion marker of the wrong shape (expected {{"files": {{path: {{"size", "sha256"}}}}}})'
        )
    for needed in ("trainer_state.json", "config.yaml"):
        if needed not in listing:
            raise CheckpointError(f"{marker}: lists no {needed}: not a finished checkpoint")
    for i, (rel, info) in enumerate(sorted(listing.items())):
        path = folder / rel
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        if path.stat().st_size != info["size"]:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, expected {info['size']}: truncated")
        if i % world_size == rank and sha256_file(path) != info["sha256"]:
            raise CheckpointError(f"{path}: sha256 mismatch: corrupt")


def file_listing(folder: Path, rank: int = 0, world_size: int = 1) -> dict[str, dict]:
    """Size and sha256 of every file under `folder`, the hashing split across ranks as in validate()."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    mine = {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in files[rank::world_size]
    }
    shares = all_gather_object(mine) if world_size > 1 else [mine]
    return {k: v for share in shares for k, v in share.items()}


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointManager:
    """Saves and restores the full training state.

    Args:
        root: the run's checkpoints folder.
        rank, world_size: this process; rank 0 writes the shared files and renames.
        keep_last: finished checkpoints to keep (older ones are deleted after a successful save).
        keep_every: older ones at a multiple of this step are kept too (0 = none): permanent ones.
        async_save: stage tensors and write them in the background (`dcp.async_save`); the folder
            is finalised (marker, rename) at the next save or at `finalize()`.
        check_space: refuse a save that the free space cannot hold, before writing (off for a
            filesystem whose free space reads wrong, as some FUSE mounts of object stores do).
    """

    def __init__(
        self,
        root: str | Path,
        rank: int = 0,
        world_size: int = 1,
        keep_last: int = 3,
        async_save: bool = False,
        check_space: bool = True,
        keep_every: int = 0,
    ):
        self.root, self.rank, self.world_size = Path(root), rank, world_size
        self.check_space, self.keep_every = check_space, keep_every
        self.keep_last, self.async_save = keep_last, async_save
        self._pending = None  # (future, tmp_folder, final_folder)

    def save(
        self, step: int, tensors: dict, trainer_state: dict, config_yaml: str, tokenizer: Path | None = None
    ) -> Path:
        """Write checkpoint `step`. `tensors` is a DCP state dict (model and optimizer); `tokenizer`
        a folder copied in as `tokenizer/`.

        Raises CheckpointWriteError, on every rank, when the checkpoint would not fit in the free
        space (nothing is written) or its writing fails (the partial folder is removed).
        """
        self.finalize()
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        if self.check_space:
            self._check_space(step, local_bytes(tensors))

        def make_folder():
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)

        def small_files():
            (tmp / "rng").mkdir(exist_ok=True)
            torch.save(rng_state(), tmp / "rng" / f"rank-{self.rank:05d}.pt")
            if self.rank == 0:
                write_json_atomic(tmp / "trainer_state.json", trainer_state)
                write_text_atomic(tmp / "config.yaml", config_yaml)
                if tokenizer is not None and tokenizer.is_dir():
                    shutil.copytree(tokenizer, tmp / "tokenizer")

        try:
            # The folder, then the small files: every rank learns of a failure in either (a full
            # disk) before it goes on, instead of waiting forever in a collective the failed rank left.
            for part in (make_folder, small_files):
                failed = None
                try:
                    part()
                except OSError as e:
                    failed = e
                if errors := [e for e in all_gather_object(failed) if e is not None]:
                    raise errors[0]
            if self.async_save:
                future = dcp.async_save(tensors, checkpoint_id=str(tmp))
                self._pending = (future, tmp, final)
            else:
                dcp.save(tensors, checkpoint_id=str(tmp))
                self._finish(tmp, final)
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            raise self._write_failed(step, tmp, e) from e
        return final

    def finalize(self) -> None:
        """Complete a pending asynchronous save (no-op otherwise)."""
        if self._pending is not None:
            future, tmp, final = self._pending
            self._pending = None
            try:
                future.result()
                self._finish(tmp, final)
            except (Exception, CheckpointException) as e:
                raise self._write_failed(step_of(final), tmp, e) from e

    def _check_space(self, step: int, nbytes: int) -> None:
        """Refuse, before writing anything and alike on every rank, a checkpoint that cannot fit."""
        total, free = self._total_and_free(nbytes)
        need = total + (1 << 20)  # + the small files
        if need > free:
            digits = next(d for d in (1, 2, 3, 6) if round(need / 1e6, d) != round(free / 1e6, d) or d == 6)
            raise CheckpointWriteError(
                f"{self.root}: checkpoint at step {step} needs about {need / 1e6:,.{digits}f} MB and the disk has "
                f"{free / 1e6:,.{digits}f} MB free; nothing was written. {self._newest()} Free some space (or "
                "lower checkpoint.keep_last) and resume with the same command; checkpoint.space_check=false "
                "skips this check where the free space reads wrong"
            )

    def permanent(self, step: int) -> bool:
        """Whether pruning keeps the checkpoint of `step`: a multiple of `keep_every`."""
        return bool(self.keep_every) and step % self.keep_every == 0

    def _most_on_disk(self, existing: list[int], saves) -> int:
        """The most checkpoint folders on disk at once while `saves` (ascending steps) are written
        after the `existing` ones: the finished ones plus the one in flight, pruned after each save."""
        window: collections.deque[int] = collections.deque()  # the newest keep_last
        kept_older = 0  # permanent ones older than the window
        peak = len(existing) + 1 if saves else 0  # nothing is pruned before the first save finishes

        def add(s: int) -> None:
            nonlocal kept_older
            window.append(s)
            if len(window) > self.keep_last:
                kept_older += self.permanent(window.popleft())

        for s in existing:
            add(s)
        for s in saves:
            peak = max(peak, len(window) + kept_older + 1)
            add(s)
        return peak

    def _prunable(self) -> list[Path]:
        """Finished checkpoints past the newest keep_last that are not permanent."""
        return [f for f in list_checkpoints(self.root)[self.keep_last :] if not self.permanent(step_of(f))]

    def check_room_for_run(
        self, step: int, last_step: int, every: int, local_estimate: int, *, every_minutes: float = 0.0
    ) -> None:
        """Refuse to start a run whose checkpoints cannot fit: a ConfigError naming
        checkpoint.space_check, before any training time is spent.

        The saves from `step` to `last_step` (every `every` steps, and at the end) are played out
        with the pruning rule to find the most folders on disk at once; those already there count.
        Timed saves (`every_minutes`) could come at any step, so every step is taken for one. A
        checkpoint's size is the newest existing one's, else the ranks' `local_estimate`s summed.
        """
        if step >= last_step:  # nothing left to train: nothing to save (alike on every rank)
            return
        done = list_checkpoints(self.root)
        total, free = self._total_and_free(local_estimate)
        size = sum(f.stat().st_size for f in done[0].rglob("*") if f.is_file()) if done else total + (1 << 20)
        if every_minutes:
            saves = range(step + 1, last_step + 1)
        else:
            saves = [*range((step // every + 1) * every, last_step + 1, every)] if every else []
            saves += [last_step] if not saves or saves[-1] != last_step else []
        steps = sorted(step_of(f) for f in done)
        peak = self._most_on_disk(steps, saves)
        more = max(peak - len(done), 1)  # a save always needs room for itself before pruning
        if more * size > free:
            kept = f"checkpoint.keep_last={self.keep_last}" + (
                f", keep_every_steps={self.keep_every}" if self.keep_every else ""
            )
            raise ConfigError(
                "checkpoint.space_check",
                f"{self.root}: this run's checkpoints need about {more * size / 1e6:,.1f} MB more ({more} "
                f"x {size / 1e6:,.1f} MB, with {kept}) and the disk has "
                f"{free / 1e6:,.1f} MB free. Free some space, lower checkpoint.keep_last, point run_dir elsewhere, "
                "or set checkpoint.space_check=false to start anyway",
            )

    def _total_and_free(self, nbytes: int) -> tuple[int, int]:
        """The ranks' `nbytes` summed, and the least free space any rank sees: alike on every rank."""
        shares = all_gather_object((nbytes, free_bytes(self.root)))
        return sum(n for n, _ in shares), min(f for _, f in shares)

    def _write_failed(self, step: int, tmp: Path, error: BaseException) -> CheckpointWriteError:
        free = free_bytes(self.root)  # before the partial folder goes: a full disk reads (nearly) 0
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        full = ": the disk is full" if free < FULL_DISK_BYTES else ""
        # Rank 0 removes it; where rank 0 died, it stays (ignored) until the run's next save removes it.
        left = "was removed" if not tmp.exists() else "is left, ignored; the run's next save removes it"
        return CheckpointWriteError(
            f"{tmp}: checkpoint at step {step} could not be written ({_root_cause(error)}); "
            f"{free / 1e6:,.1f} MB were free when it failed{full}. The partial folder {left}. "
            f"{self._newest()} Fix the cause and resume with the same command"
        )

    def _newest(self) -> str:
        done = list_checkpoints(self.root)
        return f"The newest good checkpoint is {done[0]}." if done else "The run has no checkpoint yet."

    def _finish(self, tmp: Path, final: Path) -> None:
        barrier()
        listing = file_listing(tmp, self.rank, self.world_size)
        if self.rank == 0:
            write_json_atomic(tmp / "COMPLETE.json", {"files": listing, "world_size": self.world_size})
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in self._prunable():
                shutil.rmtree(old, ignore_errors=True)
            # Half-written saves of a killed job (one save is in flight at a time, and it just ended).
            for stale in self.root.glob(f"{STEP_PREFIX}*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        barrier()

    def load(self, folder: Path, tensors: dict) -> dict:
        """Validate `folder`, load tensors in place into `tensors`, restore this rank's RNG; return
        the trainer state."""
        validate(folder, self.rank, self.world_size)
        load_tensors(folder, tensors)
        # Another world size is fine: DCP reshards the tensors, and the data position is global. A
        # rank the saving job did not have keeps the RNG seeded at start (training draws no random
        # numbers; the state is kept for code that does).
        rng = folder / "rng" / f"rank-{self.rank:05d}.pt"
        if rng.is_file():
            set_rng_state(torch.load(rng, weights_only=True))
        return json.loads((folder / "trainer_state.json").read_text())

    def load_latest(self, tensors: dict, root: Path | None = None) -> tuple[Path, dict] | None:
        """Load the newest checkpoint under `root` (default: this run's) that validates, falling
        back past broken ones.

        None when there is no checkpoint at all; a CheckpointError when there are some and none
        loads (starting over would bury the run, so the person decides).
        """
        root = self.root if root is None else root
        folders = list_checkpoints(root)
        for folder in folders:
            try:
                return folder, self.load(folder, tensors)
            except CheckpointError as e:
                if self.rank == 0:
                    print(f"warning: skipping unusable checkpoint: {e}", flush=True)
        if folders:
            raise CheckpointError(
                f"{root}: none of its {len(folders)} checkpoint(s) is usable (reasons above); repair "
                "one, or move the folder aside to start the run over"
            )
        return None


def resolve_checkpoint(path: str | Path, rank: int = 0, world_size: int = 1) -> Path:
    """A checkpoint folder as given, or the newest valid one of a run folder (or of its checkpoints/
    folder); validated either way (a CheckpointError if the given one is not), so callers need not
    hash it again. Under torchrun the ranks share the hashing and agree on the folder."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such run or checkpoint folder{checkpoints_beside(path)}")
    if is_checkpoint_folder(path):
        validate(path, rank, world_size)
        return path
    candidates = list_checkpoints(path / "checkpoints") or list_checkpoints(path)  # a run, or its checkpoints/
    for folder in candidates:
        try:
            validate(folder, rank, world_size)
            return folder
        except CheckpointError as e:
            if rank == 0:
                print(f"warning: skipping unusable checkpoint: {e}", file=sys.stderr)
    if not candidates:
        # A folder of runs given for a run (the quickstart's runs/quickstart holds its run in train/):
        # name the runs inside rather than report this one as broken.
        runs = sorted(str(p.parent) for p in path.glob("*/checkpoints") if list_checkpoints(p))
        if runs:
            raise FileNotFoundError(f"{path}: not a run folder; the runs inside it: {', '.join(runs)}")
    raise FileNotFoundError(f"{path}: no usable checkpoint (looked in {path / 'checkpoints'})")


def checkpoint_tokenizer(folder: Path) -> Path:
    """The tokenizer of a checkpoint: its own copy, else (a checkpoint saved before it kept one) its
    run's, RUN/checkpoints/step-N/../../tokenizer."""
    places = [folder / "tokenizer"]
    if folder.parent.name == "checkpoints":
        places.append(folder.parent.parent / "tokenizer")
    for place in places:
        if place.is_dir():
            return place
    raise FileNotFoundError(
        f"{folder}: no tokenizer (looked in {' and '.join(map(str, places))}); copy the tokenizer folder "
        f"of the run that saved it to {places[0]}"
    )
