"""Checkpoints of a run: saving them, where a run starts (its own newest checkpoint with `--resume
auto`, a named one, another run's weights with `checkpoint.init_from`, or nothing), and the
roll-back after too many bad steps.

A part of `Trainer` (train/trainer.py), `trainer.checkpointing`, given what it saves and loads:
the model, optimizer, scheduler and loader, the run's `RunState` (step, bad-step streak, events),
the checkpoint manager that writes the folders (train/checkpoint.py), the layout and the data and
model parts (which say what a checkpoint holds). It keeps the rollbacks' count itself.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import yaml
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from marinlm.config import ConfigError, dump_config, load_config, to_dict
from marinlm.parallel.distributed import DistributedInfo, all_reduce_, barrier
from marinlm.parallel.mesh import ParallelDims
from marinlm.parallel.pipeline_parallel import PipelinedModel
from marinlm.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointMismatch,
    is_checkpoint_folder,
    list_checkpoints,
    load_tensors,
    step_of,
)
from marinlm.train.config import TrainConfig
from marinlm.train.run_state import RunState
from marinlm.train.signals import TrainingDiverged
from marinlm.utils.io import differences


class Checkpointing:
    def __init__(
        self,
        manager: CheckpointManager,
        *,
        model,
        optimizer,
        scheduler,
        loader,
        state: RunState,
        config: TrainConfig,
        dims: ParallelDims,
        info: DistributedInfo,
        data,
        model_part,
        precision: str,
        micro_batch: int,
        event: Callable[[str], None],
    ):
        """`data`: the data source (its tokenizer hash is checked on load); `model_part`: how the
        model was made (its state-dict options and trainer-state additions); `precision` and
        `micro_batch`: as the trainer resolved them (recorded, and compared on resume); `event`:
        where notes of skipped steps and rollbacks go."""
        self.manager, self.model, self.optimizer = manager, model, optimizer
        self.scheduler, self.loader = scheduler, loader
        self.state, self.config, self.dims, self.info = state, config, dims, info
        self.data, self.model_part, self.precision, self.micro_batch = data, model_part, precision, micro_batch
        self.event = event
        self.run_dir = manager.root.parent
        self.good_steps = 0  # successful steps since the last rollback
        self.recent_rollbacks = 0

    @property
    def forward_rows(self) -> int:
        """Rows in one forward over all data-parallel ranks: a micro-batch, or under pipeline
        parallelism one of its microbatches. Capacity is decided over these rows."""
        microbatches = self.model.layout.microbatches if isinstance(self.model, PipelinedModel) else 1
        return self.micro_batch // microbatches * self.dims.batch_world

    def config_changes(self, folder: Path, sections=("model", "optim", "data", "schedule", "train")) -> list[str]:
        """The model, optimizer, data, schedule and training-loop settings that differ from the
        checkpoint's config.yaml, model first (logging, checkpointing and the like change freely).

        Compared as the file has them: a key written before it existed is "absent", not its
        default of today, which need not be what that run did (data.shuffle_rows)."""
        try:
            load_config(TrainConfig, folder / "config.yaml")  # a file this code can read at all
            saved = yaml.safe_load((folder / "config.yaml").read_text())
        except (ConfigError, OSError, yaml.YAMLError):
            return []
        return [
            f"{section}.{change}"
            for section in sections
            for change in differences(saved.get(section, {}), to_dict(getattr(self.config, section)))
        ]

    def load(self, folder: Path | None = None) -> tuple[Path, dict] | None:
        """Load `folder` (a checkpoint, or a run folder's newest good one; default: this run's newest
        good one) into model, optimizer and scheduler."""
        if folder is None and not list_checkpoints(self.manager.root):
            # Nothing to load: leave the optimizer untouched. get_state_dict() fills an empty one's
            # state by stepping it once with zero gradients and lr 0, which leaves Adam's step count
            # at 1: a fresh `--resume auto` run took its first real step as step 2 (bias correction).
            return None
        tensors = self.state_tensors()
        try:
            if folder is None:
                loaded = self.manager.load_latest(tensors)
                if loaded is None:
                    return None
            elif not is_checkpoint_folder(folder) and (folder / "checkpoints").is_dir():
                # A run folder stands for its newest good checkpoint, as in generate, eval and init_from.
                loaded = self.manager.load_latest(tensors, folder / "checkpoints")
                if loaded is None:
                    raise CheckpointError(f"{folder}: a run folder without checkpoints; nothing to resume")
            elif not is_checkpoint_folder(folder) and list_checkpoints(folder):
                loaded = self.manager.load_latest(tensors, folder)  # a run's checkpoints/ folder: never None
            else:
                loaded = (folder, self.manager.load(folder, tensors))
        except CheckpointMismatch as e:
            hint = _differences_hint(self.config_changes(e.folder))
            advice = "Resume with the run's own settings, or start a new run_dir"
            raise CheckpointMismatch(e.folder, f"{e.detail}{hint}. {advice}") from None
        folder, state = loaded
        self.set_aside_checkpoints_after(state["step"])
        if self.info.is_main and (changes := self.config_changes(folder)):
            settings = "setting" if len(changes) == 1 else "settings"
            print(f"warning: resuming {folder.name} with changed {settings}: {'; '.join(changes)}", flush=True)
        # The groups' settings are this run's config, not the checkpoint's. DCP lists the saved
        # param groups by index, so under another layout (a pipeline stage without the LM head has
        # no AdamH group) the i-th saved group's settings would land on another kind of parameter.
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=tensors["model"],
            optim_state_dict=tensors["optim"],
            options=self.model_part.state_dict_options,
        )
        for group, own in zip(self.optimizer.param_groups, settings, strict=True):
            group.update(own)
        self.load_schedule_position(state["scheduler"])
        self.state.step, self.state.bad_steps = state["step"], state["bad_steps"]
        self.state.last_checkpoint_step = self.state.step
        return folder, state

    def load_schedule_position(self, saved: dict) -> None:
        """The scheduler at the saved step. Only the step is taken: the peak learning rates are the
        config's, one per parameter group of this layout, and a pipeline stage without the LM head
        has no AdamH group, so another layout's list of them need not line up."""
        scheduler = self.scheduler
        scheduler.last_epoch = saved["last_epoch"]
        for group, base, multiplier in zip(self.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * multiplier(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def set_aside_checkpoints_after(self, step: int) -> None:
        """Move the run's checkpoints newer than the one just loaded out of `checkpoints/`: the
        abandoned branch of a `--resume` from an older step, or saves that would not load. Left
        there, retention (which keeps the newest steps) would prune this run's new saves instead,
        and `--resume auto`, `generate` and `eval` would pick the stale ones up."""
        newer = [f for f in list_checkpoints(self.manager.root) if step_of(f) > step]
        if newer and self.info.is_main:
            aside = self.run_dir / "checkpoints-set-aside" / time.strftime("%Y%m%d-%H%M%S")
            aside.mkdir(parents=True, exist_ok=True)
            for folder in newer:
                folder.rename(aside / folder.name)
            names = ", ".join(f.name for f in reversed(newer))
            print(
                f"note: the run goes on from step {step}; its later checkpoints ({names}) are moved to {aside} "
                "so that nothing mixes them with the new ones (delete them when they are no longer needed)",
                flush=True,
            )
        barrier()

    def init_from(self) -> None:
        """Load the model weights of `checkpoint.init_from` (continued training); the optimizer,
        schedule, data position and step start fresh."""
        source = self.config.checkpoint.init_from
        if not source:
            return None
        from marinlm.train.checkpoint import resolve_checkpoint

        folder = resolve_checkpoint(source, self.info.rank, self.info.world_size)
        trained_with = json.loads((folder / "trainer_state.json").read_text()).get("tokenizer_hash")
        if trained_with is not None and trained_with != self.data.tokenizer_hash:
            raise ValueError(
                f"checkpoint.init_from: {folder} was trained with tokenizer {trained_with[:12]}…, this run's data "
                f"uses {self.data.tokenizer_hash[:12]}…: its embeddings would mean other tokens"
            )
        tensors = {"model": get_model_state_dict(self.model)}
        try:
            load_tensors(folder, tensors)
        except CheckpointMismatch as e:
            changes = self.config_changes(folder, ("model",))
            hint = _differences_hint(changes)
            if changes:  # a model of another shape: train that model instead
                hint += f"; to train the checkpoint's own model, add --model={folder / 'config.yaml'}"
            raise CheckpointMismatch(folder, f"checkpoint.init_from: {e.detail}{hint}") from None
        set_model_state_dict(self.model, tensors["model"])
        self.state.initialized_from = str(folder)
        if self.info.is_main:
            print(f"model initialised from {folder}; optimizer, schedule and data start fresh", flush=True)
        return None

    def resume(self, resume: str) -> Path | None:
        if resume == "none":
            if earlier := list_checkpoints(self.run_dir / "checkpoints"):
                # Starting over here would mix two runs: retention keeps the old run's newer steps,
                # and `--resume auto` or `generate` would later pick them up.
                raise ValueError(
                    f"{self.run_dir}: holds checkpoints of an earlier run (newest {earlier[0].name}); continue "
                    "it with --resume auto, or give a new run_dir (or move this one aside) to start over"
                )
            return self.init_from()
        loaded = self.load(None if resume == "auto" else Path(resume))
        if loaded is None:
            return self.init_from()
        if self.config.checkpoint.init_from and self.info.is_main:
            print(f"note: checkpoint.init_from is not used: {self.run_dir} resumes from its own checkpoint", flush=True)
        folder, state = loaded
        if state["tokenizer_hash"] != self.data.tokenizer_hash:
            raise ValueError(
                f"{folder}: trained with tokenizer {state['tokenizer_hash'][:12]}…, data now uses "
                f"{self.data.tokenizer_hash[:12]}…"
            )
        self.loader.load_state_dict(state["loader"])
        if self.info.is_main:
            saved_world = state.get("world_size", 1)
            regrid = f" (saved by {saved_world} processes, resharded onto {self.info.world_size})"
            saved = state.get("layout")  # the degrees; checkpoints before layouts had only FSDP
            saved = None if saved is None else ParallelDims(**saved)  # a degree added since defaults to 1
            but_shard = dict(dp_shard=0)  # data_parallel_shard: -1 fills what the launch brings
            if saved is not None and saved.degrees() | but_shard != self.dims.degrees() | but_shard:
                regrid = f" (saved under {saved.describe()}, resharded onto {self.dims.describe()})"
            elif saved_world == self.info.world_size:
                regrid = ""
            print(f"resumed from {folder} at step {self.state.step}{regrid}", flush=True)
            saved_rows = state.get("forward_rows", self.forward_rows)
            if saved_rows != self.forward_rows and self.config.model.moe.capacity_factor is not None:
                # Capacity is per forward: other rows per forward drop other assignments.
                print(
                    f"note: {folder} ran {saved_rows} rows per forward (over all data-parallel ranks), this run "
                    f"{self.forward_rows} (train.micro_batch {self.config.train.micro_batch or 'auto'} on each of "
                    f"{self.dims.batch_world}): with moe.capacity_factor set, other assignments are dropped and the "
                    "losses differ from an unchanged run's; set train.micro_batch to keep them",
                    flush=True,
                )
            saved_precision = state.get("precision", self.precision)
            if saved_precision != self.precision:  # e.g. `auto` on another machine
                print(
                    f"note: {folder} trained in {saved_precision}, this run goes on in {self.precision} "
                    f"(train.precision {self.config.train.precision}); set train.precision={saved_precision} "
                    "to keep the precision it started with",
                    flush=True,
                )
        self.validation_logged_at(self.state.step)
        return folder

    def validation_logged_at(self, step: int) -> None:
        """Take the validation the run already logged at `step` (a finished run run again) as done:
        it is not repeated at the end, so the log keeps one record of it. Every rank reads the log
        (validation is collective, so all must agree)."""
        from marinlm.train.metrics import read_metrics

        try:
            records = read_metrics(self.run_dir)
        except (OSError, ValueError):
            return
        for record in records:
            if record["step"] == step and any(k.startswith("val/") for k in record):
                self.state.last_validation_step = step
                self.state.last_validation = {k: v for k, v in record.items() if k.startswith("val/")}

    def state_tensors(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.model_part.state_dict_options)
        return {"model": model_sd, "optim": optim_sd}

    def trainer_state(self) -> dict:
        return {
            "step": self.state.step,
            "bad_steps": self.state.bad_steps,
            "scheduler": self.scheduler.state_dict(),
            "loader": self.loader.state_dict(),
            "tokenizer_hash": self.data.tokenizer_hash,
            "world_size": self.info.world_size,
            "layout": self.dims.degrees(),
            "micro_batch": self.micro_batch,
            "forward_rows": self.forward_rows,
            "precision": self.precision,
            **self.model_part.trainer_state(),
        }

    def save(self) -> Path | None:
        """Save this step, unless it is in a streak of skipped steps or its weights are not finite:
        a rollback must land before the trouble, not on a checkpoint written during it."""
        if self.state.bad_steps or not self.weights_finite():
            return None
        path = self.manager.save(
            self.state.step,
            self.state_tensors(),
            self.trainer_state(),
            dump_config(self.config),
            tokenizer=self.run_dir / "tokenizer",
        )
        self.state.last_checkpoint_step, self.state.last_checkpoint_time = self.state.step, time.perf_counter()
        self.state.events.append({"step": self.state.step, "event": "checkpoint", "path": str(path)})
        return path

    def weights_finite(self) -> bool:
        """Whether every weight is finite on every rank (the ranks decide together: a save is collective)."""
        local = [p.to_local() if isinstance(p, DTensor) else p for p in self.model.parameters()]
        bad = torch.tensor(float(not all(bool(torch.isfinite(t).all()) for t in local)))
        return not all_reduce_(bad, op="max").item()

    def count_bad_step(self, result) -> bool:
        """Count a skipped (non-finite) step or reset the streak; True when the streak reached
        `train.max_consecutive_bad_steps` and the run rolled back to its last checkpoint (its
        metric records past the step it went back to are then the caller's to drop)."""
        if not result.skipped:
            self.state.bad_steps = 0
            self.good_steps += 1
            return False
        self.state.bad_steps += 1
        self.state.events.append({"step": self.state.step, "event": "nan_skip", "loss": result.loss})
        what = "loss" if not math.isfinite(result.loss) else "gradient"
        self.event(
            f"non-finite {what} (loss={result.loss:.6g}, grad norm={result.grad_norm:.6g}); update "
            f"skipped ({self.state.bad_steps} in a row)"
        )
        if self.state.bad_steps < self.config.train.max_consecutive_bad_steps:
            return False
        self.rollback()
        return True

    def rollback(self) -> None:
        """Too many bad steps in a row: reload the last checkpoint, keep the loader where it is."""
        position = self.loader.state_dict()
        bad_from, bad_count = self.state.step, self.state.bad_steps
        self.manager.finalize()  # an asynchronous save still in flight is the newest checkpoint
        loaded = self.load()
        lr = getattr(self.config.optim, "lr", None)
        advice = (
            "lower the learning rate" + (f" (optim.lr={lr:g})" if lr is not None else "") + " or lengthen the warmup"
        )
        stopped = f"training diverged: {bad_count} non-finite steps in a row at step {bad_from}"
        if loaded is None:
            raise TrainingDiverged(f"{stopped}, and no checkpoint to roll back to; {advice}, and start again")
        folder, _ = loaded
        # Rollbacks in a row: one counts unless the run trained well (twice the bad-step limit of
        # good steps) since the previous one, whichever checkpoint it lands on. Counted per
        # checkpoint, a run saving every step rolled back for ever onto checkpoints of its bad streak.
        if self.good_steps >= 2 * self.config.train.max_consecutive_bad_steps:
            self.recent_rollbacks = 0
        tries = self.recent_rollbacks
        if tries >= self.config.train.max_rollbacks:
            again = (
                f", again after {tries} rollback(s) in a row (the last to {folder.name}), each past other "
                "batches, so the data is not the cause"
                if tries
                else ""
            )
            raise TrainingDiverged(
                f"{stopped}{again} (train.max_rollbacks={self.config.train.max_rollbacks}); {advice}, and resume "
                f"from the last good checkpoint: --resume {folder}"
            )
        self.loader.load_state_dict(position)  # skip the offending batches
        self.state.bad_steps, self.good_steps = 0, 0
        self.recent_rollbacks += 1
        self.state.events.append({"step": bad_from, "event": "rollback", "to": str(folder)})
        self.event(f"rolled back from step {bad_from} to {folder.name}; skipping the batches in between")


def _differences_hint(changes: list[str]) -> str:
    """'; its config.yaml differs at ...': up to three of a checkpoint's config differences, a
    changed type (optimizer, router) first, as the keys it brings or drops would hide it."""
    if not changes:
        return ""
    changes = sorted(changes, key=lambda change: not change.split(":")[0].endswith(".type"))
    more = f" (and {len(changes) - 3} more)" if len(changes) > 3 else ""
    return f"; its config.yaml differs at {'; '.join(changes[:3])}{more}"
