"""Optimizers (AdamW; the hero's MuonH/AdamH/Adam) and learning-rate schedules."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from marinlm.config import Choice, check
from marinlm.optim.marin import NS_SCHEDULES, MarinOptimizer, marin_param_kinds, newton_schulz, newton_schulz_many
from marinlm.utils.device import native_bf16

__all__ = [
    "AdamWConfig",
    "MarinOptimizer",
    "MarinOptimizerConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "build_optimizer",
    "build_scheduler",
    "lr_multiplier",
    "marin_param_kinds",
    "newton_schulz",
    "newton_schulz_many",
]


class OptimizerConfig(Choice):
    """Base of the optimizer variants; pick with `type:` (adamw, marin)."""


def _check_adam(config) -> None:
    check(config.lr > 0, "lr", f"must be positive, got {config.lr}")
    check(
        len(config.betas) == 2 and all(0 <= b < 1 for b in config.betas),
        "betas",
        f"must be two values in [0, 1), got {config.betas}",
    )
    check(config.eps > 0, "eps", f"must be positive, got {config.eps}")


@OptimizerConfig.register("adamw")
@dataclass(kw_only=True)
class AdamWConfig(OptimizerConfig):
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1

    def __post_init__(self):
        _check_adam(self)
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")


@OptimizerConfig.register("marin")
@dataclass(kw_only=True)
class MarinOptimizerConfig(OptimizerConfig):
    """MuonH (matrices) + AdamH (LM head) at `lr`, Adam (embeddings, router, gates, gains, SConv)
    at `adam_lr`. The learning rates, betas and eps default to the hero run's notes; the hero's
    config (configs/train/marin-535b-a23b.yaml) sets what its launcher computed, Marin's
    MoeHeuristic at its budget, and Newton-Schulz defaults to the hero's schedule."""

    lr: float = 0.003291
    adam_lr: float = 0.000759
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    # The Newton-Schulz coefficients (optim/marin.py NS_SCHEDULES): quintic_schedule, a triple per
    # iteration, as Marin's hero; simple, Keller Jordan's one triple, as most Muon code.
    newton_schulz: str = "quintic_schedule"
    # The dtype Newton-Schulz runs in. auto: float64 for float64 weights (a parity check), else
    # bfloat16 (as Marin, always) where matmuls have bf16 hardware (GPUs; CPUs with AVX512-BF16 or
    # AMX), float32 elsewhere, where bf16 would only be emulated.
    ns_dtype: str = "auto"
    ns_eps: float = 1e-8  # added to the Frobenius norm the iteration starts from (Marin's muon_eps)
    # muonh: the hero's norm-preserving hyperball step; muon: plain Muon (scaled to AdamW's update
    # RMS, with decoupled weight decay), the widely used variant
    matrix_update: str = "muonh"
    # decoupled (AdamW-style) weight decay of the Muon matrices and the Adam group's matrices; the
    # hyperball steps keep norms and take none. The hero run used none.
    weight_decay: float = 0.0

    def __post_init__(self):
        _check_adam(self)
        check(
            self.matrix_update in ("muonh", "muon"),
            "matrix_update",
            f"must be muonh or muon, got {self.matrix_update!r}",
        )
        check(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        check(self.adam_lr > 0, "adam_lr", f"must be positive, got {self.adam_lr}")
        check(0 <= self.momentum < 1, "momentum", f"must be in [0, 1), got {self.momentum}")
        check(self.ns_steps >= 1, "ns_steps", f"must be >= 1, got {self.ns_steps}")
        check(
            self.ns_dtype in ("auto", "float32", "bfloat16", "float64"),
            "ns_dtype",
            f"must be auto, float32, bfloat16 or float64, got {self.ns_dtype!r}",
        )
        check(
            self.newton_schulz in NS_SCHEDULES,
            "newton_schulz",
            f"must be one of {sorted(NS_SCHEDULES)}, got {self.newton_schulz!r}",
        )
        check(self.ns_eps > 0, "ns_eps", f"must be positive, got {self.ns_eps}")


def newton_schulz_dtype(config: MarinOptimizerConfig, device_type: str, float64: bool = False) -> str:
    """The dtype Newton-Schulz runs in (`ns_dtype`, "auto" resolved for `device_type` and, with
    `float64`, for float64 weights)."""
    if config.ns_dtype != "auto":
        return config.ns_dtype
    if float64:
        return "float64"
    return "bfloat16" if native_bf16(device_type) else "float32"


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig, device_type: str = "cpu"):
    if isinstance(config, AdamWConfig):
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and p.requires_grad]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 and p.requires_grad]
        groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # fused on CPU and CUDA alike; foreach would not apply to FSDP2 DTensors on CPU either way
        fused = not any(hasattr(p, "device_mesh") for p in decay)
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, fused=fused)
    if isinstance(config, MarinOptimizerConfig):
        ns_dtype = newton_schulz_dtype(config, device_type, any(p.dtype == torch.float64 for p in model.parameters()))
        kinds = marin_param_kinds(model)
        rename = {"muonh": config.matrix_update}  # plain Muon takes MuonH's matrices
        groups = [
            {"params": [p for _, p in params], "kind": rename.get(kind, kind), "names": [n for n, _ in params]}
            for kind, params in kinds.items()
            if params
        ]
        return MarinOptimizer(
            groups,
            lr=config.lr,
            adam_lr=config.adam_lr,
            betas=config.betas,
            eps=config.eps,
            momentum=config.momentum,
            nesterov=config.nesterov,
            ns_steps=config.ns_steps,
            ns_dtype=getattr(torch, ns_dtype),
            ns_schedule=config.newton_schulz,
            ns_eps=config.ns_eps,
            weight_decay=config.weight_decay,
        )
    raise TypeError(f"unknown optimizer config {type(config).__name__}")


@dataclass(kw_only=True)
class ScheduleConfig:
    """Warmup then decay, as a multiplier of each group's peak lr.

    kind: `linear` (the hero: linear warmup, linear decay to min_lr_ratio), `cosine`, or `wsd`
    (warmup, stable at peak, then linear decay over the last `decay_fraction` of steps).
    Warmup is `warmup_steps` if set, else `warmup_fraction` of the run.

    `replan_step` and `replan_lr_ratio` (linear only) record where a running training was given a
    new length past its warmup (`Trainer.set_total_steps`, the quickstart's re-plans): from that
    step the multiplier, then `replan_lr_ratio`, decays linearly to min_lr_ratio at the new last
    step, so a new length bends the decay instead of making the learning rate jump. Between
    warmup and `replan_step` it runs linearly from 1 to `replan_lr_ratio`: the earlier plan
    exactly where that one was not bent itself (only the last bend is kept; a run resumed from
    before it follows this line there, without a jump at the bend).
    """

    kind: str = "linear"
    warmup_fraction: float = 0.01
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.05
    decay_fraction: float = 0.2  # wsd only
    replan_step: int | None = None
    replan_lr_ratio: float | None = None

    def __post_init__(self):
        check(self.kind in ("linear", "cosine", "wsd"), "kind", f"must be linear, cosine or wsd, got {self.kind!r}")
        check(0 <= self.warmup_fraction < 1, "warmup_fraction", f"must be in [0, 1), got {self.warmup_fraction}")
        check(
            self.warmup_steps is None or self.warmup_steps >= 0,
            "warmup_steps",
            f"must be >= 0, got {self.warmup_steps}",
        )
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        check(0 < self.decay_fraction <= 1, "decay_fraction", f"must be in (0, 1], got {self.decay_fraction}")
        replanned = (self.replan_step is not None, self.replan_lr_ratio is not None)
        check(
            replanned[0] == replanned[1],
            "replan_step" if replanned[1] else "replan_lr_ratio",
            "replan_step and replan_lr_ratio are set together (a re-planned run's config) or not at all",
        )
        if self.replan_step is not None:
            check(self.kind == "linear", "replan_step", f"is for kind linear only, got kind {self.kind!r}")
            check(self.replan_step >= 0, "replan_step", f"must be >= 0, got {self.replan_step}")
            check(
                self.min_lr_ratio <= self.replan_lr_ratio <= 1,
                "replan_lr_ratio",
                f"must be in [min_lr_ratio={self.min_lr_ratio}, 1], got {self.replan_lr_ratio}",
            )

    def warmup(self, total_steps: int) -> int:
        """Warmup steps of a run of `total_steps`: `warmup_steps`, else `warmup_fraction` of it."""
        steps = self.warmup_steps if self.warmup_steps is not None else round(self.warmup_fraction * total_steps)
        return min(steps, total_steps - 1)


def lr_multiplier(step: int, total_steps: int, config: ScheduleConfig) -> float:
    """Multiplier for 0-based `step` of `total_steps`: ramps over warmup to 1 at step `warmup`,
    and reaches exactly `min_lr_ratio` at the last step."""
    warmup = config.warmup(total_steps)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    last = total_steps - 1
    floor = config.min_lr_ratio
    if config.kind == "wsd":
        decay_start = max(warmup, last - round(config.decay_fraction * total_steps))
        if step <= decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, last - decay_start)
        return 1.0 - (1.0 - floor) * min(progress, 1.0)
    if config.replan_step is not None:  # linear, bent at a re-plan (see ScheduleConfig)
        at, ratio = config.replan_step, config.replan_lr_ratio
        if step >= last:
            return floor
        if step < at:
            return 1.0 - (1.0 - ratio) * (step - warmup) / max(1, at - warmup)
        return ratio - (ratio - floor) * (step - at) / (last - at)
    progress = min(1.0, (step - warmup) / max(1, last - warmup))
    if config.kind == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 - (1.0 - floor) * progress


def build_scheduler(optimizer, total_steps: int, config: ScheduleConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, config))


def replan_schedule(scheduler, config: ScheduleConfig, total_steps: int, new_steps: int) -> None:
    """Give a running schedule of `total_steps` a new length, in place (`config` too): the warmup
    stays as it was and the rest spreads over `new_steps`. Past warmup, a linear schedule bends
    where the run is (`ScheduleConfig.replan_step`): the next step keeps its learning rate, which
    then decays to the floor at the new last step; other kinds jump to their value at the new length."""
    if config.warmup_steps is None:  # keep the warmup a fraction of the old length gave
        config.warmup_steps = config.warmup(total_steps)
    at = scheduler.last_epoch  # the next step's 0-based index
    if config.kind == "linear" and at > config.warmup(total_steps):
        config.replan_lr_ratio = lr_multiplier(at, total_steps, config)
        config.replan_step = at
    groups = scheduler.optimizer.param_groups
    scheduler.lr_lambdas = [lambda step: lr_multiplier(step, new_steps, config)] * len(groups)
    for group, base in zip(groups, scheduler.base_lrs):  # the next step's, too
        group["lr"] = base * lr_multiplier(at, new_steps, config)
