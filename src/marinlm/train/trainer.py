"""The training loop: `marinlm train CONFIG`, one process or under torchrun.

Extras attach as hooks (`trainer.add_hook(fn, every=N)`): logging, validation, checkpoints,
downstream evaluation. Everything a resume needs is explicit state: model and optimizer (DCP),
scheduler, loader position, step, bad-step counter, every rank's RNG, and the router biases (a
model buffer holding the QB beta of the previous step).

The trainer is built from parts: where the run stands (`state`, train/run_state.py), the data it
trains on (`data`, train/data_source.py), how its model is made and saved (`model_part`,
train/model_part.py), its checkpoints, resume and rollbacks (`checkpointing`,
train/checkpointing.py), what it reports (`report`, train/reporting.py), the step itself
(train/step.py) and, with fault tolerance, its replica groups (`replicas`, train/replicas.py).
Fine-tuning gives it other data and model parts.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

from marinlm.config import ConfigError, dump_config, to_dict
from marinlm.model.summary import summarize
from marinlm.optim import build_optimizer, build_scheduler, replan_schedule
from marinlm.parallel import init_distributed
from marinlm.parallel.mesh import ParallelDims
from marinlm.parallel.offload import OffloadedOptimizer
from marinlm.train.activations import ActivationMonitor
from marinlm.train.checkpoint import CheckpointManager, estimate_local_bytes
from marinlm.train.checkpointing import Checkpointing
from marinlm.train.config import TrainConfig
from marinlm.train.data_source import TokenData, write_run_record
from marinlm.train.metrics import MetricSinks
from marinlm.train.model_part import FromScratch, build_model
from marinlm.train.provenance import check_training_memory
from marinlm.train.replicas import count_step, join_replica_groups
from marinlm.train.reporting import Reporter
from marinlm.train.run_folder import claim_run_folder
from marinlm.train.run_state import RunState
from marinlm.train.signals import catch_stop_signals
from marinlm.train.step import StepResult, StepWithinMemory
from marinlm.train.stopping import agree_to_stop
from marinlm.utils.device import gemm_dtype, resolve_precision
from marinlm.utils.io import unlock_folder, write_text_atomic
from marinlm.utils.perf import matmul_peak_flops, tune_cpu_allocator
from marinlm.utils.progress import progress_bar

# A run whose training loop lasted this long measures the matmul peak again at its end and takes
# MFU against the higher of the two: a 1 s measurement at the start can fall on a busy moment.
REMEASURE_PEAK_AFTER_S = 60.0


class Trainer:
    def __init__(self, config: TrainConfig, resume: str = "auto", data=None, model_part=None):
        self.config = c = config
        self.state = RunState()  # where the run stands (train/run_state.py)
        self.report = Reporter(self)  # what the run says: its events, metrics and summary
        self.data = TokenData() if data is None else data  # what it trains on (train/data_source.py)
        self.model_part = FromScratch() if model_part is None else model_part  # train/model_part.py
        try:
            self.info = init_distributed(c.train.device)
        except ValueError as e:  # a device this machine does not have
            raise ConfigError("train.device", str(e)) from None
        self.device = self.info.device
        if c.parallel.offload == "all" and self.device.type != "cuda":
            raise ValueError(
                "parallel.offload: all offloads from GPU to pinned host memory; a CPU run already "
                "keeps everything in host memory, set it to none"
            )
        tune_cpu_allocator()
        self.precision = resolve_precision(c.train.precision, self.device)
        torch.manual_seed(c.train.seed + self.info.rank)
        if c.train.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=self.device.type == "cuda")
        self.run_dir = Path(c.run_dir)
        if c.parallel.fault_tolerance.groups:  # each replica group keeps its own folder (train/replicas.py)
            self.run_dir = self.run_dir / f"replica-{c.parallel.fault_tolerance.group}"
        made = claim_run_folder(self.run_dir, self.info.is_main)  # train/run_folder.py
        self._locked = self.info.is_main
        try:
            self._set_up(resume)
        except BaseException:  # bad data, no memory, Ctrl-C: leave no half-made run folder behind
            self.close()
            if made is not None and self.info.is_main:
                shutil.rmtree(made, ignore_errors=True)
            raise

    def _set_up(self, resume: str) -> None:
        c = self.config
        self.world = self.info.world_size
        # The layout first: a degree that does not fit the ranks or the model fails before anything is built.
        dims = ParallelDims.resolve(c.parallel, self.world)
        dims.check_model(c.model, c.data.seq_len)
        dims.check_capacity(c.model)
        # The layout owns every mesh and group, built once (one process builds none).
        self.dims = dims.build_mesh(self.device.type) if self.info.launched else dims
        # Batches are split over the data-parallel ranks; tensor-parallel ranks read the same rows.
        # Replica groups each read their share, as data-parallel replicas would.
        self.data_rank, self.data_world = self.dims.batch_rank, self.dims.batch_world
        groups, group = max(c.parallel.fault_tolerance.groups, 1), c.parallel.fault_tolerance.group
        micro = c.train.micro_batch or c.train.global_batch // (self.data_world * groups)
        if c.train.global_batch % (micro * self.data_world * groups):
            raise ValueError(
                f"train.global_batch={c.train.global_batch} must be a multiple of micro_batch x data-parallel "
                f"ranks x replica groups = {micro} x {self.data_world} x {groups}"
            )
        self.micro_batch, self.accum = micro, c.train.global_batch // (micro * self.data_world * groups)

        self.data.open(c, self.info)
        self.report.notes_before_training()  # an emulated bf16, a warmup as long as the run
        self.model_summary = summarize(c.model, c.data.seq_len)
        if c.train.memory_check:
            where = torch.device("cpu") if c.parallel.offload == "all" else self.device  # offload: state on the host
            check_training_memory(self.model_summary.total, c.optim.type_name, self.world, where)
        rows = self.micro_batch * self.accum  # a data-parallel rank's rows a step (its group's share)
        self.model = build_model(c, self.device, self.precision, self.dims, self.model_part, rows)
        self.activations = ActivationMonitor(self.model, c.logging.activations_every, self.world)
        self.optimizer = build_optimizer(self.model, c.optim, self.device.type)
        # What steps: the optimizer, or it with its state kept in host memory between steps.
        stepper = self.optimizer
        if c.parallel.offload == "optimizer":
            stepper = OffloadedOptimizer(self.optimizer, self.device)
        self.scheduler = build_scheduler(self.optimizer, c.train.steps, c.schedule)
        share = group * self.data_world + self.data_rank, groups * self.data_world
        self.loader = self.data.loader(self.micro_batch * share[1], *share, self.run_dir)
        self.val_sources = self.data.val_sources()
        self.epochs_planned = self.data.planned_epochs(self.loader)
        self.checkpoints = CheckpointManager(
            self.run_dir / "checkpoints",
            self.info.rank,
            self.world,
            c.checkpoint.keep_last,
            c.checkpoint.async_save,
            c.checkpoint.space_check,
            c.checkpoint.keep_every_steps,
        )
        self.checkpointing = Checkpointing(  # saves, resumes, rolls back (train/checkpointing.py)
            self.checkpoints,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            loader=self.loader,
            state=self.state,
            config=c,
            dims=self.dims,
            info=self.info,
            data=self.data,
            model_part=self.model_part,
            precision=self.precision,
            micro_batch=self.micro_batch,
            event=self.report.event,
        )
        self._bar = None  # fit()'s progress bar, while it runs
        self.flops_per_token = self.model_summary.flops_per_token
        # Where bf16 GEMMs are emulated, the bf16 products run as fp32 GEMMs (kernels/bf16.py).
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        self.peak_dtype = gemm_dtype(dtype, self.device)
        self.peak_flops = c.logging.peak_flops or matmul_peak_flops(self.peak_dtype, self.device.type)
        self.replicas = join_replica_groups(self) if c.parallel.fault_tolerance.groups else None
        # A group that joins live peers takes their state in its first quorum, and no checkpoint.
        resumed_from = None if self.replicas and self.replicas.join() else self.checkpointing.resume(resume)
        if self.replicas and resumed_from:
            self.replicas.resumed(self.step)
        how = dict(device=self.device, precision=self.precision, grad_clip=c.train.grad_clip, replicas=self.replicas)
        self._run_step = StepWithinMemory(self.model, stepper, self.optimizer, c, self.dims, how)  # train/step.py
        if resumed_from and c.train.steps < self.step:  # before anything is written (config.yaml would say it)
            raise ConfigError(
                "train.steps",
                f"{c.train.steps} is before step {self.step}, which the run resumes from ({resumed_from}): nothing "
                f"would train; give train.steps past {self.step}, or start a new run_dir",
            )
        if c.checkpoint.space_check:
            estimate = estimate_local_bytes(self.model, self.optimizer)
            self.checkpoints.check_room_for_run(
                self.step, c.train.steps, c.checkpoint.every_steps, estimate, every_minutes=c.checkpoint.every_minutes
            )
        self.sinks = None
        if self.info.is_main:
            write_run_record(self, resumed_from)
            self.sinks = MetricSinks(
                self.run_dir,
                c.logging.tensorboard,
                c.logging.wandb,
                c.logging.wandb_project,
                c.logging.wandb_mode,
                resume_step=self.step if resumed_from or self.step else -1,  # self.step: a peer's
                config=to_dict(c),
            )
        self.hooks: list[tuple[int, Callable]] = []
        self.add_hook(self.report.log, every=c.logging.every_steps)
        if c.validation.every_steps:
            self.add_hook(self.validate, every=c.validation.every_steps)
        if c.checkpoint.every_steps:
            self.add_hook(lambda result: self.checkpointing.save(), every=c.checkpoint.every_steps)
        self.add_hook(self.report.phase, every=1)
        self._last_result: StepResult | None = None
        self._data_wait = 0.0

    # --- set-up ---------------------------------------------------------------------------------

    def _retried_smaller(self, rows: int, forwards: int) -> None:
        self.state.events.append({"step": self.step + 1, "event": "oom_retry", "rows": rows})
        self.report.event(
            f"out of memory at {rows} rows per forward in step {self.step + 1}: retrying the step at "
            f"{max(1, rows // 2)} rows, accumulating over {forwards} forwards"
        )

    # --- hooks ----------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The run's step (its RunState's)."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    def add_hook(self, fn: Callable[[StepResult], None], every: int) -> None:
        """Call `fn(step_result)` after every `every`-th step (and after the last step)."""
        self.hooks.append((every, fn))

    def set_total_steps(self, steps: int) -> None:
        """Lengthen or shorten the run while it trains (the quickstart re-plans from the step time
        it observes); every rank must call it alike. The schedule spreads over the new length
        (`optim.replan_schedule`); the run's config.yaml, later checkpoints and progress bar follow."""
        c = self.config
        if steps <= self.step:
            raise ValueError(f"train.steps: the run is at step {self.step}; a new length must be past it, got {steps}")
        replan_schedule(self.scheduler, c.schedule, c.train.steps, steps)
        c.train.steps = steps
        if self.info.is_main:
            write_text_atomic(self.run_dir / "config.yaml", dump_config(c))
        if self._bar is not None:
            self._bar.total = steps
            self._bar.refresh()

    def validate(self, result: StepResult | None = None) -> dict[str, float] | None:
        """The data's held-out scores (also a hook); logged at the current step."""
        where = dict(device=self.device, precision=self.precision, group=self.dims.batch_group)
        metrics = self.data.validate(self.model, self.val_sources, self.data_rank, self.data_world, **where)
        if metrics is None:
            return None
        self.state.last_validation_step, self.state.last_validation = self.step, metrics
        if self.sinks is not None:
            self.sinks.log(self.step, metrics)
        return metrics

    def close(self) -> None:
        """Close the metric sinks and give up the run folder (another job may write it now).
        Idempotent; also on collection. A trainer built and never fit left its TensorBoard writer's
        thread flushing into a folder that may be gone."""
        if getattr(self, "sinks", None) is not None:
            self.sinks.close(quiet=True)
        if getattr(self, "replicas", None) is not None:
            self.replicas.shutdown()
            self.replicas = None
        if getattr(self, "_locked", False):
            self._locked = False
            unlock_folder(self.run_dir)

    def __del__(self):
        self.close()

    # --- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict:
        c = self.config
        self.model_part.before_fit(self)
        start_time, first_step = time.perf_counter(), self.step
        batches = iter(self.loader)
        self.report.mark_data_position()
        bar = progress_bar(
            total=c.train.steps,
            initial=self.step,
            desc="train",
            unit="step",
            disable=not (self.info.is_main and c.logging.progress),
        )
        self._bar = bar
        profiler = self.report.profiler()
        stopped_early = False
        if self.info.is_main and c.logging.progress:
            print(self.report.header(), flush=True)
        self._signal = None
        self.state.last_checkpoint_time = start_time
        handlers = catch_stop_signals(self._on_stop_signal)
        try:
            while self.step < c.train.steps:
                t0 = time.perf_counter()
                if self.replicas and self.replicas.begin_step():  # behind the others: took a peer's state
                    batches = iter(self.loader)
                micro = [next(batches) for _ in range(self.accum)]
                self._data_wait = time.perf_counter() - t0
                with self.activations.watch(self.step + 1):
                    result = self._run_step(micro, self.step + 1, self._retried_smaller)
                if self.replicas and not count_step(self, result, t0):  # a group failed: its batch is skipped
                    continue
                if self.activations.due(self.step + 1):
                    scalars, samples = self.activations.report()  # every rank: a reduction
                    if self.sinks is not None:
                        self.sinks.log(self.step + 1, scalars, samples=samples)
                # A skipped (non-finite) step still moves the schedule on, by design; torch warns of
                # "lr_scheduler.step() before optimizer.step()" when the first steps are skipped. Only
                # then is the filter changed: each change makes once-only warnings print again.
                with warnings.catch_warnings() if result.skipped else contextlib.nullcontext():
                    if result.skipped:
                        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
                    self.scheduler.step()
                self.step += 1
                self._step_time = time.perf_counter() - t0
                self._last_result = result
                if self.checkpointing.count_bad_step(result):  # rolled back to the last checkpoint
                    if self.sinks is not None:
                        self.sinks.rolled_back(self.step)  # drop the records of the steps it redoes
                    bar.n = self.step
                    continue
                for every, fn in self.hooks:
                    if self.step % every == 0:
                        fn(result)
                if profiler is not None:
                    profiler.step()
                # The postfix rides on update()'s redraw, which the bar rate-limits (utils/progress.py).
                bar.set_postfix(
                    loss=f"{result.loss:.3f}", tok_s=f"{result.tokens / self._step_time:,.0f}", refresh=False
                )
                bar.update(1)
                now = time.perf_counter()
                over_budget = bool(c.train.max_minutes) and now - start_time > 60 * c.train.max_minutes
                save_due = (
                    bool(c.checkpoint.every_minutes)
                    and self.state.last_checkpoint_step != self.step
                    and now - self.state.last_checkpoint_time >= 60 * c.checkpoint.every_minutes
                )
                # Agreed by every rank: ranks stopping or saving at different steps would hang.
                self._signal, over_budget, save_due = agree_to_stop(
                    self._signal, over_budget, save_due, self.world, self.device
                )
                if self._signal or over_budget:
                    reason = self._signal or f"time budget of {c.train.max_minutes:.3g} min reached"
                    stopped_early = True
                    self.report.event(f"{reason}: stopping at step {self.step} with a checkpoint")
                    break
                if save_due and self.step < c.train.steps:  # the last step's save follows the loop
                    self.checkpointing.save()
            if self.state.last_checkpoint_step != self.step:
                self.checkpointing.save()
            self.checkpoints.finalize()
            if self.state.last_validation_step != self.step and not self._signal:  # a preempted job has seconds left
                self.validate()
        except BaseException:
            # A failing run still completes an asynchronous save that was written in full: the newest
            # checkpoint to resume from. Alone only: under torchrun the other ranks may never come.
            if self.world == 1:
                with contextlib.suppress(Exception, CheckpointException):  # the run's own error is the one to see
                    self.checkpoints.finalize()
            raise
        finally:
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            bar.close()
            self._bar = None
            self.report.stop_profiler(profiler)
            if self.sinks is not None:
                self.sinks.close(quiet=sys.exc_info()[1] is not None)  # a failing run's own error is the one to see
        if not (self._signal or c.logging.peak_flops) and time.perf_counter() - start_time >= REMEASURE_PEAK_AFTER_S:
            self.peak_flops = max(self.peak_flops, matmul_peak_flops(self.peak_dtype, self.device.type))
        return self.model_part.after_fit(self, self.report.summary(start_time, first_step, stopped_early))

    def _on_stop_signal(self, name: str) -> None:
        self._signal = name


__all__ = ["Trainer"]
