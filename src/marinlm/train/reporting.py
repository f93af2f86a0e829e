"""What the Trainer says while it runs: the header line, the logged metrics and events, MFU, the
profiler."""

from __future__ import annotations

import psutil
import torch
from tqdm import tqdm

from marinlm.parallel.expert_parallel import expert_traffic
from marinlm.train.metrics import router_metrics
from marinlm.train.step import (
    StepResult,
    param_norm,
)

# A run whose training loop lasted this long measures the matmul peak again at its end and takes
# MFU against the higher of the two measurements: a 1 s measurement at the start can fall on a
# moment when the host is busy (on the 2-core dev VM one start measured ~112 GFLOP/s against
# 175-193 in every other run, and the run reported 58% MFU where 33% was true).
REMEASURE_PEAK_AFTER_S = 60.0


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
        router_scalars, histograms = router_metrics(r.router_stats)
        self.sinks.log(self.step, scalars | router_scalars | traffic, histograms)

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
