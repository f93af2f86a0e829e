"""What the Trainer says while it runs: the header line, the logged metrics and events, MFU, the
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
from marinlm.utils.io import write_json_atomic


class Reporting:
    def _log_event(self, message: str) -> None:
        if self.info.is_main:
            tqdm.write(f"[step {self.step}] {message}")

    def _log_hook(self, result: StepResult) -> None:
        norm = param_norm(self.model)  # a collective under FSDP: every rank takes part
        traffic = expert_traffic(self.model)  # since the last log: a collective too
        steps = self.step - getattr(self, "_traffic_from_step", 0)
        self._traffic_from_step = self.step
        if self.sinks is None:
            return
        if "ep/a2a_bytes" in traffic:
            traffic["ep/a2a_bytes"] /= max(steps, 1)  # per step
        r = result
        elapsed = self._step_time
        tokens_per_s = r.tokens / max(elapsed, 1e-9)
        scalars = {
            "train/loss": r.loss,
            "train/z_loss": r.z_loss,
            "train/aux_loss": r.aux_loss,
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/grad_norm": r.grad_norm,
            "train/param_norm": norm,
            "perf/tokens_per_s": tokens_per_s,
            "perf/mfu": self.mfu(tokens_per_s),  # against the peak measured at the start
            "perf/step_time_s": elapsed,
            "perf/data_wait_s": self._data_wait,
            "train/skipped": float(r.skipped),
            "mem/rss_gb": psutil.Process().memory_info().rss / 1e9,
        }
        if self.device.type == "cuda":
            scalars["mem/cuda_max_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
        if self.replicas:
            scalars |= replica_scalars(self, r)
        router_scalars, histograms = router_metrics(r.router_stats, r.router_layers)
        self.sinks.log(self.step, scalars | router_scalars | traffic | self._mixture_scalars(), histograms)

    def _mark_data_position(self) -> None:
        """Where the run stands as the loop starts (after a resume): mixture metrics and the expert
        traffic per step count from here."""
        self._traffic_from_step = self.step
        if isinstance(self.loader, TokenLoader):
            self._counts_logged = self.loader.counts.copy()
            self._phase_said = self.loader.phase_at(self.loader.rows_consumed)

    def _mixture_scalars(self) -> dict[str, float]:
        """With several sources: each one's share of the rows drawn since the last log, and how many
        passes over it have been read, so that a weighted or phased mixture is seen doing as told."""
        loader = self.loader
        if not isinstance(loader, TokenLoader) or len(loader.sources) < 2:
            return {}
        counts = loader.counts.copy()
        since = counts - self._counts_logged
        self._counts_logged = counts
        scalars, names = {}, source_names(self.config.data)
        for name, drawn, total, source in zip(names, since, counts, loader.sources, strict=True):
            if since.sum() > 0:  # not after a rollback to an earlier position
                scalars[f"data/{name}/share"] = drawn / since.sum()
            scalars[f"data/{name}/epochs"] = total / source.rows_per_epoch
        return scalars

    def _phase_hook(self, result: StepResult) -> None:
        """Says when `data.mixture_phases` switches the weights, after the last step of the old ones."""
        loader = self.loader
        if not isinstance(loader, TokenLoader) or len(loader.phases) == 1:
            return
        phase = loader.phase_at(loader.rows_consumed)
        if phase != self._phase_said:
            weights = loader.phases[phase][1] / loader.phases[phase][1].sum()
            shares = ", ".join(f"{n} {w:.0%}" for n, w in zip(source_names(self.config.data), weights, strict=True))
            which = f"data.mixture_phases[{phase - 1}]" if phase else "data.sources' weights"
            self._log_event(f"data: the mixture of {which} from here on: {shares}")
            self.events.append(
                {"step": self.step, "event": "mixture_phase", "phase": phase, "weights": weights.tolist()}
            )
        self._phase_said = phase

    def _summary(self, start_time: float, first_step: int, stopped_early: bool) -> dict:
        """What fit() returns, also written to RUN/summary.json with the loss plot (main rank)."""
        summary = {
            "steps": self.step,
            "first_step": first_step,  # where this call started: a resumed run's earlier steps were timed elsewhere
            "stopped_early": stopped_early,
            "signal": self._signal,
            "seconds": time.perf_counter() - start_time,
            "final_loss": self._last_result.loss if self._last_result else None,
            "events": self.events,
            "validation": self.last_validation,
        }
        if self.replicas:
            summary["fault_tolerance"] = replica_summary(self, summary["seconds"])
        if self.info.is_main:
            records = read_metrics(self.run_dir)
            rates = [r["perf/tokens_per_s"] for r in records if "perf/tokens_per_s" in r and r["step"] > first_step]
            summary["median_tokens_per_s"] = statistics.median(rates) if rates else None
            summary["peak_flops"] = self.peak_flops
            summary["peak_source"] = "given" if self.config.logging.peak_flops else "measured"
            summary["peak_dtype"] = "bf16" if self.peak_dtype == torch.bfloat16 else "fp32"
            summary["median_mfu"] = self.mfu(summary["median_tokens_per_s"]) if rates else None
            if records:
                summary["loss_plot"] = str(self._plot_loss(records))
            write_json_atomic(self.run_dir / "summary.json", summary)
        return summary

    def _plot_loss(self, records: list[dict]) -> Path:
        """RUN/loss.png, marking the steps where the run's mixture phases began."""
        phases = self.config.data.mixture_phases if isinstance(self.loader, TokenLoader) else []
        marks = [(f"mixture_phases[{i}]", p.start_step) for i, p in enumerate(phases) if p.start_step <= self.step]
        return plot_loss(records, self.run_dir / "loss.png", f"marinlm: {self.run_dir}", marks=marks)

    def mfu(self, tokens_per_s: float) -> float:
        """Model FLOPs utilisation at `tokens_per_s` (all ranks together) against the measured peak."""
        return self.flops_per_token * tokens_per_s / (self.peak_flops * self.world)

    def _header(self) -> str:
        c, s = self.config, self.model_summary
        start = f"from step {self.step} " if self.step else ""
        return (
            f"train: {s.total / 1e6:,.1f}M parameters ({s.active / 1e6:,.1f}M active in the blocks), "
            f"{c.train.global_batch} x {c.data.seq_len} tokens a step, {start}to step {c.train.steps}; "
            f"{self.device.type} {self.precision}, {self.world} process{'es' if self.world > 1 else ''}; {self.run_dir}"
        )

    def _profiler(self):
        p = self.config.profile
        if not p.num_steps or not self.info.is_main:
            return None
        trace_dir = self.run_dir / "profile"
        gap = max(0, p.start_step - self.step)
        warmup = min(gap, 1)  # the step before the window warms the profiler up, when there is one
        profiler = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=gap - warmup, warmup=warmup, active=p.num_steps, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir)),
            record_shapes=False,
        )
        profiler.start()
        return profiler
