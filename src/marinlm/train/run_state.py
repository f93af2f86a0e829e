"""Where a run stands: the loop's own state, one object the trainer and its parts share.

What a checkpoint records of it (`Checkpointing.trainer_state`): the step and the bad-step streak;
with the model, optimizer, schedule, loader position and every rank's RNG beside them, a resume
is exact. The rest is this process's bookkeeping: the events the summary lists, and when the run
last saved and validated (so that the end of `fit` does neither twice).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunState:
    step: int = 0  # optimizer steps taken (skipped non-finite ones count)
    bad_steps: int = 0  # non-finite steps in a row, up to the last
    events: list[dict] = field(default_factory=list)  # skips, rollbacks, checkpoints, phases, failures
    last_checkpoint_step: int | None = None
    last_checkpoint_time: float = 0.0  # time.perf_counter() of the last save (timed checkpoints)
    last_validation_step: int | None = None
    last_validation: dict[str, float] | None = None  # its metrics
    initialized_from: str | None = None  # checkpoint.init_from's folder, when the weights came from one
