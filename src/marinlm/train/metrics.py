"""Metric sinks: JSON lines (always), TensorBoard (default), Weights & Biases (optional, offline-capable)."""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import numpy as np

from marinlm.utils.io import atomic_path, json_error, named, write_text_atomic


class MetricSinks:
    """Write scalars (and histograms) from rank 0.

    On resume from step k, records after k are dropped from metrics.jsonl and TensorBoard purges
    its events after k, so the logs read as one uninterrupted run. A run that starts from scratch
    passes k = -1: records an earlier attempt left (one that died before its first checkpoint) go.
    """

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool = True,
        wandb: bool = False,
        wandb_project: str = "marinlm",
        wandb_mode: str = "offline",
        resume_step: int | None = None,
        config: dict | None = None,
    ):
        self.path = run_dir / "metrics.jsonl"
        if resume_step is not None and self.path.exists():
            self._keep_until(resume_step)
        self.file = open(self.path, "a")  # noqa: SIM115 - closed in close()
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(
                str(run_dir / "tensorboard"), purge_step=None if resume_step is None else resume_step + 1
            )
        self.wandb = None
        if wandb:
            try:
                import wandb as wandb_lib
            except ImportError:
                raise ValueError("logging.wandb: wandb is not installed; `pip install wandb` or set it false") from None
            self.wandb = wandb_lib.init(
                project=wandb_project, dir=str(run_dir), mode=wandb_mode, config=config, resume="allow"
            )

    def log(
        self,
        step: int,
        scalars: dict[str, float],
        histograms: dict[str, np.ndarray] | None = None,
        samples: dict[str, np.ndarray] | None = None,
    ) -> None:
        """`histograms` are counts per bucket (a router's load per expert); `samples` are values,
        binned by TensorBoard (activations)."""
        clean = {k: (float(v) if v is not None and math.isfinite(float(v)) else None) for k, v in scalars.items()}
        end = self.file.tell()
        try:
            self.file.write(json.dumps({"step": step, **clean}) + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: say which file, and leave no half line behind
            with contextlib.suppress(OSError):
                os.truncate(self.file.name, end)
            raise named(e, self.file.name) from None
        if self.tb is not None:
            for key, value in clean.items():
                if value is not None:
                    self.tb.add_scalar(key, value, step)
            for key, values in (histograms or {}).items():
                # a load histogram: bucket e holds expert e's share of assignments
                self.tb.add_histogram_raw(
                    key,
                    min=0,
                    max=len(values) - 1,
                    num=float(values.sum()),
                    sum=float((np.arange(len(values)) * values).sum()),
                    sum_squares=float((np.arange(len(values)) ** 2 * values).sum()),
                    bucket_limits=list(np.arange(len(values)) + 0.5),
                    bucket_counts=list(values),
                    global_step=step,
                )
            for key, values in (samples or {}).items():
                self.tb.add_histogram(key, values, step)
        if self.wandb is not None:
            payload = {k: v for k, v in clean.items() if v is not None}
            self.wandb.log(payload, step=step)

    def _keep_until(self, step: int) -> None:
        records, torn = read_records(self.path)
        if torn:
            print(f"note: {self.path}: dropped its torn last line (a crash or a full disk cut it short)", flush=True)
        kept = [r for r in records if r["step"] <= step]
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    def rolled_back(self, step: int) -> None:
        """The run went back to `step`: drop the later records, which it is about to redo (the
        rollback itself is in the run's events). Without this metrics.jsonl held the redone steps
        twice."""
        self.file.close()
        self._keep_until(step)
        self.file = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def close(self, quiet: bool = False) -> None:
        """Close every sink; `quiet`: on the way out of a failing run, whose own error is the one to
        see, errors of the sinks (a full disk again) are not raised. Idempotent."""
        if self.file.closed:
            return
        errors = []
        try:
            self.file.close()
        except OSError as e:
            errors.append(named(e, self.file.name))
        for sink in (self.tb and self.tb.close, self.wandb and self.wandb.finish):
            try:
                if sink:
                    sink()
            except Exception as e:
                errors.append(e)
        if errors and not quiet:
            raise errors[0]


def read_records(path: Path) -> tuple[list[dict], bool]:
    """(records, torn) of a JSON-lines log: a last line that a crash or a full disk cut short is
    dropped (`torn`); a bad line before it is a ValueError naming the file and line."""
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    records, torn = [], False
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):  # no newline after it: the write never finished
                torn = True
                continue
            raise ValueError(f"{path}:{n}: not a JSON record ({json_error(e)})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{n}: not a metrics record (an object with an integer step)")
        records.append(record)
    return records, torn


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return read_records(path)[0] if path.exists() else []


def plot_loss(
    metrics: list[dict],
    path: str | Path,
    title: str,
    baseline: tuple[str, float] | None = None,
    marks: list[tuple[str, int]] = (),
    points: list[tuple[str, int, float]] = (),
) -> Path:
    """Train and validation loss (and each source's, where several) against step, as a PNG, with an
    optional labelled horizontal line, labelled steps (where a mixture phase began) and labelled
    single points (a score on other data, such as a whole split). The validation curve's label says
    how many tokens each of its points scored."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(m["step"], m["train/loss"]) for m in metrics if "train/loss" in m]
    val = [(m["step"], m["val/loss"]) for m in metrics if "val/loss" in m]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", alpha=0.7)
    if val:
        scored = {int(m["val/tokens"]) for m in metrics if "val/tokens" in m}
        what = f" ({scored.pop():,} tokens a point)" if len(scored) == 1 else ""
        ax.plot(*zip(*val), marker="o", label=f"validation loss{what}")
    for label, step, loss in points:
        ax.plot([step], [loss], marker="*", markersize=12, linestyle="none", label=f"{label} ({loss:.2f})")
    answers = [(m["step"], m["val/answer_loss"]) for m in metrics if "val/answer_loss" in m]  # fine-tuning
    if answers:
        ax.plot(*zip(*answers), marker="o", label="held-out answer loss")
    # With several sources, each one's validation loss too (`val/NAME/loss`).
    names = dict.fromkeys(
        k.split("/")[1]
        for m in metrics
        for k in m
        if k.startswith("val/") and k.count("/") == 2 and k.endswith("/loss")
    )
    for name in names:
        points = [(m["step"], m[f"val/{name}/loss"]) for m in metrics if f"val/{name}/loss" in m]
        ax.plot(*zip(*points), marker=".", linestyle=":", label=f"validation loss: {name}")
    if baseline is not None:
        ax.axhline(baseline[1], color="grey", linestyle="--", label=f"{baseline[0]} ({baseline[1]:.2f})")
    for label, step in marks:
        ax.axvline(step, color="grey", linestyle="-.", linewidth=0.8)
        ax.annotate(label, (step, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


def router_metrics(router_stats, layers: list[int] | None = None) -> tuple[dict[str, float], dict]:
    """Per-layer routing scalars (entropy, dropped fraction, z-loss, max load relative to a perfect
    balance of 1.0, and the spread of the QB beta) and the per-expert load histograms, named by
    the model's layer numbers (`layers`: those of a pipeline stage's stats; default 0, 1, ...)."""
    scalars, histograms = {}, {}
    for i, s in zip(layers or range(len(router_stats)), router_stats, strict=True):
        scalars[f"router/layer_{i}/entropy"] = s.entropy.item()
        scalars[f"router/layer_{i}/dropped_fraction"] = s.dropped_fraction.item()
        scalars[f"router/layer_{i}/z_loss"] = s.z_loss.item()
        load = s.load / s.load.sum().clamp_min(1)
        scalars[f"router/layer_{i}/max_load"] = (load.max() * len(load)).item()
        if s.beta is not None:
            scalars[f"router/layer_{i}/beta_std"] = s.beta.std().item()
        histograms[f"router/layer_{i}/load"] = s.load.cpu().numpy()
    return scalars, histograms
