"""The run config: one dataclass per component, nested the way configs/train/*.yaml is."""

from __future__ import annotations

from dataclasses import dataclass, field

from marinlm.config import check
from marinlm.dataset.loader import DataConfig
from marinlm.kernels.config import KernelConfig, move_model_keys
from marinlm.model.config import MarinConfig
from marinlm.optim import MarinOptimizerConfig, OptimizerConfig, ScheduleConfig
from marinlm.parallel import ParallelConfig


@dataclass(kw_only=True)
class LoopConfig:
    steps: int = 100
    global_batch: int = 8  # sequences per optimizer step, all ranks together
    micro_batch: int = 0  # sequences per forward on one rank; 0 = global_batch / world_size
    # auto: bf16 where matmuls have bf16 hardware (GPUs; CPUs with AVX512-BF16 or AMX), else fp32;
    # fp32; bf16 (autocast, fp32 master weights); fp64 (weights and compute in float64: for parity
    # tests between layouts and kernels, where rounding must not flip routing)
    precision: str = "auto"
    # FP8 GEMMs (torchao, dynamic per-tensor scaling) in the dense projections (kernels/fp8.py).
    fp8: bool = False
    grad_clip: float | None = 1.0  # global-norm clipping; null = off (the hero run used none)
    seed: int = 0
    deterministic: bool = True  # torch.use_deterministic_algorithms: bitwise-exact resume on CPU
    max_minutes: float = 0.0  # stop (with a checkpoint) after this much wall time; 0 = no limit
    max_consecutive_bad_steps: int = 3  # NaN/Inf steps in a row before rolling back to a checkpoint
    # Rollbacks to one checkpoint (each skipping other batches) before the run stops as diverged: a
    # learning rate too high fails again whatever the data, and would roll back for ever.
    max_rollbacks: int = 3
    # A step that runs out of memory is abandoned (weights and optimizer untouched) and, with
    # oom_retry, retried with half the rows per forward (more accumulation, the same global batch),
    # down to one row; otherwise the run stops naming the settings to try.
    oom_retry: bool = False
    device: str = "auto"
    init: str = "auto"  # full (every rank builds all weights, then shards), sharded (init on shards), auto
    # Refuse at start a model whose weights, gradients and optimizer state alone cannot fit in a
    # process's share of memory (it would otherwise allocate until the out-of-memory killer came).
    memory_check: bool = True

    def __post_init__(self):
        check(self.steps > 0, "steps", f"must be positive, got {self.steps}")
        check(self.global_batch > 0, "global_batch", f"must be positive, got {self.global_batch}")
        check(self.micro_batch >= 0, "micro_batch", f"must be >= 0, got {self.micro_batch}")
        check(
            self.precision in ("auto", "fp32", "bf16", "fp64"),
            "precision",
            f"must be auto, fp32, bf16 or fp64, got {self.precision!r}",
        )
        check(
            self.grad_clip is None or self.grad_clip > 0, "grad_clip", f"must be positive or null, got {self.grad_clip}"
        )
        check(self.max_minutes >= 0, "max_minutes", f"must be >= 0, got {self.max_minutes}")
        check(
            self.max_consecutive_bad_steps >= 1,
            "max_consecutive_bad_steps",
            f"must be >= 1, got {self.max_consecutive_bad_steps}",
        )
        check(self.max_rollbacks >= 0, "max_rollbacks", f"must be >= 0, got {self.max_rollbacks}")
        check(self.device in ("auto", "cpu", "cuda"), "device", f"must be auto, cpu or cuda, got {self.device!r}")
        check(self.init in ("auto", "full", "sharded"), "init", f"must be auto, full or sharded, got {self.init!r}")


@dataclass(kw_only=True)
class CheckpointConfig:
    every_steps: int = 100  # 0 = only at the end
    # Also save when this many minutes have passed since the last save (0 = off): a preempted
    # long run loses at most this much, whatever the step time. The hero saved hourly.
    every_minutes: float = 0.0
    keep_last: int = 3  # the newest ones kept; older ones are deleted after a successful save...
    keep_every_steps: int = 0  # ...except those at a multiple of this step (0 = none): permanent ones
    async_save: bool = False
    # Refuse at start a run whose checkpoints cannot fit in the free space, and a save that finds
    # no room before it writes. Off for a filesystem whose free space reads wrong (some FUSE mounts
    # of object stores); a save that fails still removes what it half-wrote and says why.
    space_check: bool = True
    # Continued training: a checkpoint (or run) folder whose model weights start this run; the
    # optimizer, schedule and data position start fresh. Unused once the run has checkpoints of its own.
    init_from: str | None = None

    def __post_init__(self):
        check(self.every_steps >= 0, "every_steps", f"must be >= 0, got {self.every_steps}")
        check(self.every_minutes >= 0, "every_minutes", f"must be >= 0 (0 = off), got {self.every_minutes}")
        check(self.keep_last >= 1, "keep_last", f"must be >= 1, got {self.keep_last}")
        check(self.keep_every_steps >= 0, "keep_every_steps", f"must be >= 0 (0 = none), got {self.keep_every_steps}")
        check(
            not self.keep_every_steps or (self.every_steps and self.keep_every_steps % self.every_steps == 0),
            "keep_every_steps",
            f"must be a multiple of every_steps ({self.every_steps}) so that those steps are saved, "
            f"got {self.keep_every_steps}",
        )


@dataclass(kw_only=True)
class LoggingConfig:
    every_steps: int = 10
    # > 0: every N steps, per layer, the RMS and max-abs of the residual stream and of the
    # attention and MLP branch outputs (train/activations.py); 0 = off
    activations_every: int = 0
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "marinlm"
    wandb_mode: str = "offline"  # offline works without network; "online" to sync
    progress: bool = True
    # The matmul FLOP/s of one rank that MFU is against: 0 = measured on the device at the start (a
    # second; again at the end of a long run); give the datasheet's to compare runs across hosts.
    peak_flops: float = 0.0

    def __post_init__(self):
        check(self.every_steps >= 1, "every_steps", f"must be >= 1, got {self.every_steps}")
        check(self.peak_flops >= 0, "peak_flops", f"must be >= 0 (0 = measure), got {self.peak_flops}")
        check(self.activations_every >= 0, "activations_every", f"must be >= 0 (0 = off), got {self.activations_every}")
        check(
            self.wandb_mode in ("offline", "online", "disabled"),
            "wandb_mode",
            f"must be offline, online or disabled, got {self.wandb_mode!r}",
        )


@dataclass(kw_only=True)
class ValidationConfig:
    every_steps: int = 0  # 0 = only at the end
    max_rows: int = 64  # sequences of each source's held-out split per evaluation
    batch_size: int = 8

    def __post_init__(self):
        check(self.every_steps >= 0, "every_steps", f"must be >= 0 (0 = only at the end), got {self.every_steps}")
        check(self.max_rows >= 1, "max_rows", f"must be >= 1, got {self.max_rows}")
        check(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")


@dataclass(kw_only=True)
class ProfileConfig:
    start_step: int = 0
    num_steps: int = 0  # 0 = no trace; else a torch.profiler trace of steps [start, start + num)

    def __post_init__(self):
        check(self.start_step >= 0, "start_step", f"must be >= 0, got {self.start_step}")
        check(self.num_steps >= 0, "num_steps", f"must be >= 0 (0 = no trace), got {self.num_steps}")


@dataclass(kw_only=True)
class EvalHookConfig:
    """Downstream tasks run as a training hook (see marinlm.eval)."""

    every_n_steps: int = 0  # 0 = off
    tasks: list[str] = field(default_factory=list)
    limit: int = 50
    data_dir: str = ""  # "" = $MARINLM_EVAL_DATA, else ../shared/data/eval beside the source

    def __post_init__(self):
        check(self.every_n_steps >= 0, "every_n_steps", f"must be >= 0 (0 = off), got {self.every_n_steps}")
        check(self.limit >= 1, "limit", f"must be >= 1 items per task, got {self.limit}")
        if self.every_n_steps:
            check(len(self.tasks) > 0, "tasks", "give at least one task when every_n_steps > 0")


@dataclass(kw_only=True)
class TrainConfig:
    run_dir: str = "runs/default"
    model: MarinConfig = field(default_factory=MarinConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimizerConfig = field(default_factory=MarinOptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: LoopConfig = field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    eval: EvalHookConfig = field(default_factory=EvalHookConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)  # how the model is computed

    @staticmethod
    def older_keys(data: dict) -> dict:
        """Configs written before `kernels:` kept its keys under `model:` (kernels/config.py)."""
        return move_model_keys(data)

    def __post_init__(self):
        check(bool(self.run_dir.strip()), "run_dir", "must name a folder")
        check(
            not (self.eval.every_n_steps and max(self.parallel.pipeline_parallel, self.parallel.tensor_parallel) > 1),
            "eval.every_n_steps",
            "the tasks score with the whole model's logits and decoding caches, which pipeline and tensor "
            "parallel do not give; set it 0 and run `marinlm eval RUN` on the checkpoints (validation runs "
            "under every layout)",
        )
        check(
            self.data.seq_len <= self.model.max_seq_len,
            "data.seq_len",
            f"must be <= model.max_seq_len={self.model.max_seq_len}, got {self.data.seq_len}",
        )
