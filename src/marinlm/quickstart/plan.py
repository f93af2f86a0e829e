"""How long the quickstart trains: a fixed number of steps (`STEPS`) with a time estimate from a
step time measured before training (`TrainingPlan`), or, with `--minutes`, a time budget planned
again from the training's own steps (`Replan`); and whether a stopped quickstart's training may be
resumed (`interrupted_training`)."""

from __future__ import annotations

import collections
import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from marinlm.config import load_config

if TYPE_CHECKING:
    from marinlm.train.config import TrainConfig


# The default quickstart trains this many steps on every host, so its result does not depend on the
# host's speed; only its duration does.
STEPS = 2_000
# The step time of the host the README's "about 10 minutes" comes from (docs/performance.md names
# it), and those minutes.
REFERENCE_STEP_SECONDS = 0.20
README_MINUTES = 10.0
LONGER = 1.5  # an estimate past this many times README_MINUTES is said before training
OVERHEAD = 0.04  # validation, logging and checkpoints on top of the steps, as a share of their time


@dataclass
class TrainingPlan:
    """How the quickstart planned its training, for the terminal and the report. `how`: "default"
    (`STEPS`), "steps" (`--steps N`), "minutes" (`--minutes N`: as many steps as the time budget
    fits, planned again as the run goes) or "resumed" (a stopped run's own plan)."""

    how: str
    steps: int
    step_seconds: float | None = None  # measured before training
    train_minutes: float | None = None  # the time budget, for "minutes"
    eval_seconds: float = 0.0  # the estimated time of the evaluation and the sample

    @property
    def train_estimate_minutes(self) -> float | None:
        if self.step_seconds is None:
            return None
        return self.steps * self.step_seconds * (1 + OVERHEAD) / 60

    @property
    def slowdown(self) -> float | None:
        """This host's measured step time over the reference host's."""
        return None if self.step_seconds is None else self.step_seconds / REFERENCE_STEP_SECONDS

    def announce(self, elapsed_minutes: float) -> str:
        """What the quickstart says before training: the steps, the measured pace against the
        reference host, the time it will take and, if that is well past the README's, how to
        shorten it."""
        if self.how == "resumed" or self.step_seconds is None:
            return ""
        pace = (
            f"{self.step_seconds:.2f} s/step measured here against {REFERENCE_STEP_SECONDS:.2f} on the reference "
            f"2-core host"
        )
        if self.how == "minutes":
            return (
                f"{pace}: {self.steps:,} steps, about {self.train_estimate_minutes:.1f} min of the "
                f"{self.train_minutes:.1f} min training budget"
            )
        total = elapsed_minutes + self.train_estimate_minutes + self.eval_seconds / 60
        line = (
            f"{self.steps:,} steps; {pace}: about {self.train_estimate_minutes:.1f} min of training, "
            f"{total:.0f} min for the whole quickstart"
        )
        if self.how == "default" and total > LONGER * README_MINUTES:
            line += (
                f"\nnote: this host runs the training step {self.slowdown:.1f}x slower than the reference host "
                f"(a slower CPU, no bf16 units, or other jobs loading it), so the quickstart takes about "
                f"{total:.0f} min rather than the README's {README_MINUTES:.0f}. It trains all {self.steps:,} steps, "
                f"so its result is the documented one. To shorten it, stop it (Ctrl-C) and run "
                f"`marinlm quickstart --minutes {README_MINUTES:.0f}`, which trains what {README_MINUTES:.0f} minutes "
                "fit (fewer steps, a higher loss), or `--steps N`; it keeps the finished stages."
            )
        return line


def median_step_seconds(step, min_seconds: float = 5.0, min_steps: int = 4, max_steps: int = 40) -> float:
    """Median seconds of `step()` after one warm-up call, over at least `min_steps` calls and at
    least `min_seconds` (at most `max_steps` calls).

    A window of seconds, not a fixed few steps: on a shared host a few slow seconds would set
    the estimate, or the plan, for the whole run.
    """
    step()
    times: list[float] = []
    began = time.perf_counter()
    while len(times) < max_steps and (len(times) < min_steps or time.perf_counter() - began < min_seconds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def calibrate_step_seconds(train_config) -> tuple[float, float]:
    """Seconds per optimizer step of this config on this machine (`median_step_seconds`), in the
    precision the run will train in; and seconds per token of a forward without gradients in fp32,
    as the quickstart's evaluation runs."""
    from marinlm.kernels import apply_kernels
    from marinlm.model import MarinForCausalLM
    from marinlm.optim import build_optimizer
    from marinlm.utils.device import autocast_context, resolve_device, resolve_precision

    device = resolve_device(train_config.train.device)
    precision = resolve_precision(train_config.train.precision, device)
    model = apply_kernels(MarinForCausalLM(train_config.model), device, precision, train_config.kernels).to(device)
    model.init_weights(seed=0)
    optimizer = build_optimizer(model, train_config.optim, device.type)
    shape = (train_config.train.global_batch, train_config.data.seq_len)
    ids = torch.randint(0, train_config.model.vocab_size, shape, device=device)

    def step():
        with autocast_context(device, precision):
            loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()

    def forward():
        with torch.no_grad():
            model(ids, labels=ids)

    step_seconds = median_step_seconds(step)
    forward_seconds = median_step_seconds(forward, min_seconds=1.0, min_steps=3, max_steps=10)
    return step_seconds, forward_seconds / ids.numel()


class Replan:
    """A hook that plans the run's length again from the training's own step time: once after 5%
    of the planned steps (at least 30, and at least the warmup), longer or shorter; then, every as
    many steps, shorter again wherever the host has slowed so much that the rest of the run would
    no longer fit in the time left, and longer again where it has sped up so much that the rest
    would leave more than UNUSED of the budget unused, beyond the slack the last plan kept. Past
    the warmup, a new length bends the linear decay where the run is (`Trainer.set_total_steps`):
    the learning rate never jumps, up or down. A resumed run is only ever shortened: it carries on
    to the plan it had.

    Why again and again: the calibration measures a few seconds, which a shared host can make slow
    (a plan too short, ending minutes early and well above the usual loss); the host can slow down
    later (a run stopped by its budget before its learning rate decayed); and a slowdown can pass
    (a run shortened for it would leave its budget unused). Time kept back for slowdowns goes
    unused on a steady host, so the later checks lengthen as well as shorten.
    """

    # Of the time left, planned for steps: the rest is for logging, validation and checkpoints, and
    # for a host's slowdowns until the next check.
    SLACK = 0.9
    OVERRUN = 0.98  # a later check shortens the run when the steps left would take more of the time left
    UNUSED = 0.05  # and lengthens it when, beyond that slack, over 5% of the training budget would go unused
    WINDOWS = 3  # a later check measures over its last 3 windows: a validation or checkpoint is a blip

    def __init__(self, trainer, train_minutes: float):
        self.trainer, self.train_minutes = trainer, train_minutes
        planned, self.start = trainer.config.train.steps, trainer.step
        self.every = max(30, round(0.05 * planned), trainer.config.schedule.warmup(planned))
        self.at = self.start + self.every
        if self.start == 0 and self.every > planned // 2:
            self.at = None  # later: the LR has decayed most of the way
        self.began = time.perf_counter()  # fit()'s clock, for the time budget, starts now too
        self.marks: collections.deque[tuple[int, float]] = collections.deque(maxlen=self.WINDOWS)
        # A resumed run keeps the plan it was stopped in: only shortened, if the time left is short.
        self.resumed = self.replanned = self.start > 0
        self.reserve = 0.0  # seconds the last plan kept back: (1 - SLACK) of the time it had left

    def __call__(self, result) -> None:
        step, now = self.trainer.step, time.perf_counter()
        if step == self.start + 1:  # the first step warms up caches and allocator: timed from its end
            self.marks.append((step, now))
        if self.at is None or not self.marks or step != self.at:
            return
        self.at = step + self.every
        since, then = self.marks[0]  # step 1, the last re-plan, or WINDOWS checks back
        step_seconds = (now - then) / (step - since)
        self.marks.append((step, now))
        left = self.train_minutes * 60 - (now - self.began)
        planned = self.trainer.config.train.steps
        steps = step + int(left * self.SLACK / step_seconds)
        if self.replanned:  # a later check: a new plan only where this one is off course
            fits = (planned - step) * step_seconds <= self.OVERRUN * left
            # Longer only where the schedule bends without a jump (linear), not for a resumed run,
            # and on a rate measured over WINDOWS checks since the last plan: a window without a
            # validation or a checkpoint in it is not a faster host.
            unused = left - (planned - step) * step_seconds - self.reserve
            room = unused > self.UNUSED * self.train_minutes * 60 and step - since >= self.WINDOWS * self.every
            if fits and not (room and not self.resumed and self.trainer.config.schedule.kind == "linear"):
                return
        if steps <= step:
            return
        self.trainer.set_total_steps(steps)
        self.reserve = (1 - self.SLACK) * left
        self.marks.clear()
        self.marks.append((step, now))
        if not self.replanned:
            what = f"{step_seconds:.2f} s/step over steps {since + 1}-{step}: re-planned"
        elif steps > planned:
            what = f"the host sped up to {step_seconds:.2f} s/step over steps {since + 1}-{step}: lengthened"
        else:
            what = f"the host slowed to {step_seconds:.2f} s/step over steps {since + 1}-{step}: shortened"
        self.replanned = True
        tqdm.write(f"[step {step}] {what} from {planned} to {steps} steps, to end in the {left / 60:.1f} min left")


# What each quickstart plans for its own training (in run_quickstart, then Replan through
# Trainer.set_total_steps, which also fixes the warmup and bends the decay): everything else must
# match for a resume.
PLAN_FIELDS = (
    ("train", "steps"),
    ("train", "max_minutes"),
    ("schedule", "warmup_steps"),
    ("schedule", "replan_step"),
    ("schedule", "replan_lr_ratio"),
    ("checkpoint", "every_steps"),
    ("validation", "every_steps"),
)


def interrupted_training(run: Path, fresh: TrainConfig) -> tuple[TrainConfig, int, dict] | None:
    """(its config, its newest checkpoint's step, its validation before training) if `run` holds
    a quickstart training whose quickstart did not finish (stopped by Ctrl-C, a SIGTERM or a crash,
    in training or after it: no report.md was written after its newest checkpoint) and that is the
    same job as `fresh` would be: same model, optimizer, data and token shards, only its plan
    (length, schedule, checkpoint and validation cadence, time limit) set by the earlier run.
    Otherwise None: a finished quickstart, or another job, starts over."""
    from marinlm.config import ConfigError, to_dict
    from marinlm.train.checkpoint import list_checkpoints, step_of
    from marinlm.train.config import TrainConfig
    from marinlm.train.metrics import read_metrics
    from marinlm.utils.io import sha256_file

    checkpoints = list_checkpoints(run / "checkpoints")
    report = run.parent / "report.md"
    try:
        if not checkpoints or (report.exists() and report.stat().st_mtime >= checkpoints[0].stat().st_mtime):
            return None
        saved = load_config(TrainConfig, run / "config.yaml")
        record = json.loads((run / "run_info.json").read_text())
        same_data = [d["manifest_sha256"] for d in record["data"]] == [
            sha256_file(Path(source.path) / "manifest.json") for source in fresh.data.sources
        ]
        # The report's loss before training: logged at step 0, before the first step.
        before = next((r for r in read_metrics(run) if r["step"] == 0 and "val/loss" in r), None)
    except (ConfigError, OSError, ValueError, KeyError, TypeError):
        return None
    if not same_data or before is None:
        return None
    planned = copy.deepcopy(fresh)
    for section, key in PLAN_FIELDS:
        setattr(getattr(planned, section), key, getattr(getattr(saved, section), key))
    if to_dict(planned) != to_dict(saved):
        return None
    return saved, step_of(checkpoints[0]), before
