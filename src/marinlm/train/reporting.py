"""What the Trainer says while it runs, as a part it holds (`trainer.report`): the notes before
training, the header line, the logged metrics and events, the summary and loss plot, MFU, the
profiler."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

from marinlm.dataset.loader import TokenLoader, source_names
from marinlm.parallel.expert_parallel import expert_traffic
from marinlm.train.metrics import plot_loss, read_metrics, router_metrics
from marinlm.train.replicas import replica_scalars, replica_summary
from marinlm.train.step import (
    StepResult,
    param_norm,
)
from marinlm.utils.device import emulated_bf16
from marinlm.utils.io import write_json_atomic


class Reporter:
    """The reporting part of `trainer`; it keeps what it logged last (expert traffic and mixture
    counts since the previous log, the mixture phase it announced)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def event(self, message: str) -> None:
        t = self.trainer
        if t.info.is_main:
            tqdm.write(f"[step {t.step}] {message}")

    def log(self, result: StepResult) -> None:
        t = self.trainer
        norm = param_norm(t.model)  # a collective under FSDP: every rank takes part
        traffic = expert_traffic(t.model)  # since the last log: a collective too
        steps = t.step - getattr(self, "_traffic_from_step", 0)
        self._traffic_from_step = t.step
        if t.sinks is None:
            return
        for key in ("ep/a2a_bytes", "ep/a2a_calls"):
            if key in traffic:
                traffic[key] /= max(steps, 1)  # per step
        r = result
        elapsed = t._step_time
        tokens_per_s = r.tokens / max(elapsed, 1e-9)
        scalars = {
            "train/loss": r.loss,
            "train/z_loss": r.z_loss,
            "train/aux_loss": r.aux_loss,
            "train/lr": t.optimizer.param_groups[0]["lr"],
            "train/grad_norm": r.grad_norm,
            "train/param_norm": norm,
            "perf/tokens_per_s": tokens_per_s,
            "perf/mfu": self.mfu(tokens_per_s),  # against the peak measured at the start
            "perf/step_time_s": elapsed,
            "perf/data_wait_s": t._data_wait,
            "train/skipped": float(r.skipped),
            "mem/rss_gb": psutil.Process().memory_info().rss / 1e9,
        }
        if t.config.parallel.compile:  # graphs compiled so far in this process: a recompile adds one
            from torch._dynamo.utils import counters  # here: a run that does not compile never loads dynamo

            scalars["compile/graphs"] = float(counters["stats"]["unique_graphs"])
        if t.device.type == "cuda":
            scalars["mem/cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
        if t.replicas:
            scalars |= replica_scalars(t, r)
        router_scalars, histograms = router_metrics(r.router_stats, r.router_layers)
        t.sinks.log(t.step, scalars | router_scalars | traffic | self.mixture_scalars(), histograms)

    def notes_before_training(self) -> None:
        """What the settings will do that a person may not expect, said once before training."""
        t = self.trainer
        c = t.config
        if not t.info.is_main:
            return
        if t.precision == "bf16" and emulated_bf16(t.device):
            print(
                "note: this CPU has no bf16 matrix unit (AVX512-BF16 or AMX), so bf16 autocast runs its products "
                "as fp32 GEMMs with bf16 rounding (kernels/bf16.py): no faster than fp32, usually slower. "
                "train.precision auto (fp32 on a CPU without bf16 units) is the faster choice here",
                flush=True,
            )
        warmup = c.schedule.warmup_steps
        if warmup is not None and warmup >= c.train.steps:
            print(
                f"note: schedule.warmup_steps {warmup:,} is not shorter than the run's {c.train.steps:,} steps "
                f"(train.steps): the warmup is cut to {c.schedule.warmup(c.train.steps):,} steps, so the learning rate "
                "rises all run, peaks at the last step and never decays; shorten the warmup or lengthen the run",
                flush=True,
            )

    def mark_data_position(self) -> None:
        """Where the run stands as the loop starts (after a resume): mixture metrics and the expert
        traffic per step count from here."""
        t = self.trainer
        self._traffic_from_step = t.step
        if isinstance(t.loader, TokenLoader):
            self._counts_logged = t.loader.counts.copy()
            self._phase_said = t.loader.phase_at(t.loader.rows_consumed)

    def mixture_scalars(self) -> dict[str, float]:
        """With several sources: each one's share of the rows drawn since the last log, and how many
        passes over it have been read, so that a weighted or phased mixture is seen doing as told."""
        t = self.trainer
        loader = t.loader
        if not isinstance(loader, TokenLoader) or len(loader.sources) < 2:
            return {}
        counts = loader.counts.copy()
        since = counts - self._counts_logged
        self._counts_logged = counts
        scalars, names = {}, source_names(t.config.data)
        for name, drawn, total, source in zip(names, since, counts, loader.sources, strict=True):
            if since.sum() > 0:  # not after a rollback to an earlier position
                scalars[f"data/{name}/share"] = drawn / since.sum()
            scalars[f"data/{name}/epochs"] = total / source.rows_per_epoch
        return scalars

    def phase(self, result: StepResult) -> None:
        """Says when `data.mixture_phases` switches the weights, after the last step of the old ones."""
        t = self.trainer
        loader = t.loader
        if not isinstance(loader, TokenLoader) or len(loader.phases) == 1:
            return
        phase = loader.phase_at(loader.rows_consumed)
        if phase != self._phase_said:
            weights = loader.phases[phase][1] / loader.phases[phase][1].sum()
            shares = ", ".join(f"{n} {w:.0%}" for n, w in zip(source_names(t.config.data), weights, strict=True))
            which = f"data.mixture_phases[{phase - 1}]" if phase else "data.sources' weights"
            self.event(f"data: the mixture of {which} from here on: {shares}")
            t.state.events.append(
                {"step": t.step, "event": "mixture_phase", "phase": phase, "weights": weights.tolist()}
            )
        self._phase_said = phase

    def summary(self, start_time: float, first_step: int, stopped_early: bool) -> dict:
        """What fit() returns, also written to RUN/summary.json with the loss plot (main rank)."""
        t = self.trainer
        summary = {
            "steps": t.step,
            "first_step": first_step,  # where this call started: a resumed run's earlier steps were timed elsewhere
            "stopped_early": stopped_early,
            "signal": t._signal,
            "seconds": time.perf_counter() - start_time,
            "final_loss": t._last_result.loss if t._last_result else None,
            "events": t.state.events,
            "validation": t.state.last_validation,
        }
        if t.replicas:
            summary["fault_tolerance"] = replica_summary(t, summary["seconds"])
        if t.info.is_main:
            records = read_metrics(t.run_dir)
            rates = [r["perf/tokens_per_s"] for r in records if "perf/tokens_per_s" in r and r["step"] > first_step]
            summary["median_tokens_per_s"] = statistics.median(rates) if rates else None
            summary["peak_flops"] = t.peak_flops
            summary["peak_source"] = "given" if t.config.logging.peak_flops else "measured"
            summary["peak_dtype"] = "bf16" if t.peak_dtype == torch.bfloat16 else "fp32"
            summary["median_mfu"] = self.mfu(summary["median_tokens_per_s"]) if rates else None
            if records:
                summary["loss_plot"] = str(self.plot_loss(records))
            write_json_atomic(t.run_dir / "summary.json", summary)
        return summary

    def plot_loss(self, records: list[dict]) -> Path:
        """RUN/loss.png, marking the steps where the run's mixture phases began."""
        t = self.trainer
        phases = t.config.data.mixture_phases if isinstance(t.loader, TokenLoader) else []
        marks = [(f"mixture_phases[{i}]", p.start_step) for i, p in enumerate(phases) if p.start_step <= t.step]
        return plot_loss(records, t.run_dir / "loss.png", f"marinlm: {t.run_dir}", marks=marks)

    def mfu(self, tokens_per_s: float) -> float:
        """Model FLOPs utilisation at `tokens_per_s` (all ranks together) against the measured peak."""
        t = self.trainer
        return t.flops_per_token * tokens_per_s / (t.peak_flops * t.world)

    def header(self) -> str:
        t = self.trainer
        c, s = t.config, t.model_summary
        start = f"from step {t.step} " if t.step else ""
        return (
            f"train: {s.total / 1e6:,.1f}M parameters ({s.active / 1e6:,.1f}M active in the blocks), "
            f"{c.train.global_batch} x {c.data.seq_len} tokens a step, {start}to step {c.train.steps}; "
            f"{t.device.type} {t.precision}, {t.world} process{'es' if t.world > 1 else ''}; {t.run_dir}"
        )

    def profiler(self):
        t = self.trainer
        p = t.config.profile
        if not p.num_steps or not t.info.is_main:
            return None
        trace_dir = t.run_dir / "profile"
        gap = max(0, p.start_step - t.step)
        warmup = min(gap, 1)  # the step before the window warms the profiler up, when there is one
        profiler = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=gap - warmup, warmup=warmup, active=p.num_steps, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir)),
            record_shapes=False,
        )
        profiler.start()
        return profiler

    def stop_profiler(self, profiler) -> None:
        """Stop `profiler` (None: none ran) and say where its trace is."""
        if profiler is None:
            return
        profiler.stop()
        traces = sorted((self.trainer.run_dir / "profile").glob("*.pt.trace.json"), key=lambda f: f.stat().st_mtime)
        if traces:
            print(f"profile: {traces[-1]} (open it in https://ui.perfetto.dev or chrome://tracing)", flush=True)
