"""The quickstart's report.md: each stage's time and outcome, validation loss and bits per byte
before and after training against a unigram baseline, the loss curve and a sample."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marinlm.quickstart.plan import REFERENCE_STEP_SECONDS, STEPS, TrainingPlan
from marinlm.utils.io import write_text_atomic

_PRECISION = {"fp32": "fp32", "bf16": "bf16 autocast, fp32 master weights"}


@dataclass
class Stage:
    name: str
    seconds: float
    detail: str


def unigram_baseline(train_dir: Path, vocab_size: int) -> tuple[float, float]:
    """Cross-entropy (nats/token) and bits/byte on the validation split of an add-one unigram model
    fitted on the training split: what a model that ignores context would score."""
    from marinlm.dataset.shards import TokenDataset

    counts = np.ones(vocab_size, dtype=np.float64)
    train = TokenDataset(train_dir, "train")
    for shard in train.shards:
        counts += np.bincount(np.asarray(shard.tokens), minlength=vocab_size)[:vocab_size]
    counts[train.eos_id] += train.num_docs  # the loader appends EOS to every document
    logp = np.log(counts / counts.sum())
    val = TokenDataset(train_dir, "val")
    nats, tokens = 0.0, 0
    for shard in val.shards:
        ids = np.asarray(shard.tokens)
        nats -= logp[ids].sum()
        tokens += len(ids)
    nats -= logp[val.eos_id] * val.num_docs
    tokens += val.num_docs
    return nats / tokens, nats / (math.log(2) * val.num_bytes)


def _passes(epochs: float) -> str:
    return f"{epochs:.2g}" if epochs < 10 else f"{epochs:,.0f}"


def above_baseline_verdict(val_loss: float, unigram_loss: float, epochs: float, train_loss: float) -> str:
    """What a run that ends above the unigram baseline means ("" for one that ends below it): with
    its training tokens read many times over, a model learns them and not the language (a 60 kB
    corpus: 14 passes, training loss far under the validation loss); read at most once, it has not
    over-fitted, so it trained too few steps or something is wrong."""
    if val_loss < unigram_loss:
        return ""
    if epochs > 1:
        return (
            f"The run read its training tokens {_passes(epochs)} times over and its last training loss is "
            f"{train_loss:.3f}: it learned those documents, not the language. There is too little text for "
            "this model; give it more."
        )
    return (
        f"The run read each training token at most once ({_passes(epochs)} passes), so it has not over-fitted: it "
        "trained too few steps to pass the baseline, or training is broken (the loss curve is loss.png)."
    )


# Where the default quickstart (`STEPS` steps on the built-in corpus) ends, as docs/training.md
# records its runs: validation loss on the whole split, nats/token.
USUAL_VAL_LOSS = (2.70, 3.05)


def plan_note(plan: TrainingPlan, steps: int, train_seconds: float, step_seconds: float | None) -> str:
    """How the run was planned and how it went: the steps planned and trained, the pace measured
    before training against the reference host, and the time estimated against the time taken."""
    if plan.how == "steps":
        return f"Trained {steps:,} steps, as `--steps` asked (the default is {STEPS:,}), with no time estimate."
    if plan.how == "resumed":
        budget = f" within a {plan.train_minutes:.1f} min budget" if plan.train_minutes else ""
        return f"Resumed a stopped run, to its own plan of {plan.steps:,} steps{budget}; trained to step {steps:,}."
    pace = (
        f"Before training this host measured {plan.step_seconds:.2f} s/step, {plan.slowdown:.1f}x the reference "
        f"2-core host's {REFERENCE_STEP_SECONDS:.2f}"
    )
    took = train_seconds / 60
    if plan.how == "minutes":
        return (
            f"Planned by a {plan.train_minutes:.1f} min training budget (`--minutes`): {pace}, so it planned "
            f"{plan.steps:,} steps, then planned again from its own steps and trained {steps:,} in {took:.1f} min."
        )
    note = (
        f"Planned {plan.steps:,} steps (the default) and trained {steps:,}. {pace}; it estimated "
        f"{plan.train_estimate_minutes:.1f} min of training and took {took:.1f} min"
    )
    if took > 1.25 * plan.train_estimate_minutes:
        pace = f" (a median {step_seconds:.2f} s/step)" if step_seconds else ""
        note += f": the host slowed during training{pace}, so it took longer, but trained every step"
    return note + "."


def range_note(val_loss: float, steps: int, built_in: bool) -> str:
    """A sentence for a built-in-corpus result outside the documented range, with its likely cause
    ("" inside it, or on another corpus, which has no documented range)."""
    low, high = USUAL_VAL_LOSS
    if not built_in or low <= val_loss <= high:
        return ""
    where = f"Its validation loss, {val_loss:.3f} nats/token, is {'above' if val_loss > high else 'below'} the "
    where += f"{low}-{high} that the default {STEPS:,} steps end at"
    if val_loss > high and steps < STEPS:
        return f"{where}, because it trained only {steps:,} steps, not because something is broken."
    if val_loss < low and steps > STEPS:
        return f"{where}, because it trained {steps:,} steps."
    if val_loss > high:
        return (
            f"{where}, with at least as many steps: something differs from the documented runs (another torch or "
            "CPU, a changed config or corpus, or a bug); docs/training.md lists the runs the range comes from."
        )
    return f"{where} with no more steps: a better result than the documented runs (docs/training.md lists them)."


def write_report(
    root,
    stages,
    metrics,
    start_val,
    end_val,
    unigram,
    prompt,
    sample,
    language,
    sampling,
    summary,
    peak_gb,
    total_s,
    trainer,
    plan: TrainingPlan,
) -> Path:
    """Write ROOT/report.md (`language` tags the sample's code block) and loss.png; returns its path.

    `start_val` is the training's own validation before its first step, on the rows it validates
    on (`validation.max_rows`); `end_val` scores the whole validation split after training. The
    report names which is which, and the training's last validation on the same rows as
    `start_val` (`summary["validation"]`) gives the fall on like data."""
    from marinlm.train.metrics import plot_loss

    last_val = summary.get("validation") or start_val
    steps = summary["steps"]
    full = f"whole validation split ({int(end_val['val/tokens']):,} tokens)"
    plot_loss(
        metrics,
        root / "loss.png",
        "marinlm quickstart: tiny hero-shaped MoE",
        ("unigram baseline, whole validation split", unigram[0]),
        points=[(full, steps, end_val["val/loss"])],
    )
    # Over the whole run's logged steps: a resumed run's summary times only the steps after the resume.
    rates = [r["perf/tokens_per_s"] for r in metrics if "perf/tokens_per_s" in r]
    rate_kind = "median"
    if rates:
        tokens_per_s = statistics.median(rates)
    else:  # a run too short to log a rate: its mean over the training time
        rate_kind = "mean"
        trained = (steps - summary["first_step"]) * trainer.config.train.global_batch
        tokens_per_s = trained * trainer.config.data.seq_len / max(summary["seconds"], 1e-9)
    mfu = trainer.report.mfu(tokens_per_s)  # against the higher of the peaks measured at the start and the end
    resumed = f", resumed at step {summary['first_step']}" if summary["first_step"] else ""
    source = trainer.loader.sources[0]
    epochs = trainer.loader.planned_epochs(steps * trainer.config.train.global_batch)[0]
    train_tokens = source.rows_per_epoch * source.seq_len
    last_train = next((r["train/loss"] for r in reversed(metrics) if "train/loss" in r), math.nan)
    verdict = above_baseline_verdict(end_val["val/loss"], unigram[0], epochs, last_train)
    if verdict:
        print(f"warning: the validation loss ends above the unigram baseline. {verdict}")
    step_times = [r["perf/step_time_s"] for r in metrics if "perf/step_time_s" in r]
    how = plan_note(plan, steps, summary["seconds"], statistics.median(step_times) if step_times else None)
    print(how)
    outside = range_note(end_val["val/loss"], steps, language == "python")
    if outside:
        print(f"note: {outside}")
    max_rows = trainer.config.validation.max_rows
    rows = sum(
        v.rows_per_epoch if max_rows is None else min(max_rows, v.rows_per_epoch) for v in trainer.val_sources.values()
    )
    subset = f"{rows} validation rows ({int(start_val['val/tokens']):,} tokens)"
    lines = [
        "# marinlm quickstart report",
        "",
        f"Total wall time {total_s / 60:.1f} min; peak memory (largest process) {peak_gb:.2f} GB.",
        "",
        "## Stages",
        "",
        "| stage | seconds | what |",
        "| --- | ---: | --- |",
        *[f"| {s.name} | {s.seconds:.1f} | {s.detail} |" for s in stages],
        "",
        "## Result",
        "",
        "| data | when | loss (nats/token) | bits per byte |",
        "| --- | --- | ---: | ---: |",
        f"| {subset}, as training validates | before training | {start_val['val/loss']:.3f} | "
        f"{start_val['val/bpb']:.3f} |",
        f"| the same rows | after training | {last_val['val/loss']:.3f} | {last_val['val/bpb']:.3f} |",
        f"| {full} | after training | {end_val['val/loss']:.3f} | {end_val['val/bpb']:.3f} |",
        f"| {full}, unigram baseline | | {unigram[0]:.3f} | {unigram[1]:.3f} |",
        "",
        f"On the same {rows} rows the validation loss fell by {start_val['val/loss'] - last_val['val/loss']:.3f} "
        f"nats/token; on the whole split it ends {abs(unigram[0] - end_val['val/loss']):.3f} nats/token "
        f"{'below' if end_val['val/loss'] < unigram[0] else 'above'} the unigram baseline."
        + (f" {verdict}" if verdict else "")
        + (f" {outside}" if outside else ""),
        "",
        f"Training ({_PRECISION[trainer.precision]}): {steps} steps{resumed}, {_passes(epochs)} passes "
        f"over the {train_tokens:,} training tokens, {rate_kind} {tokens_per_s:,.0f} tokens/s, "
        f"{rate_kind} MFU {mfu:.1%} "
        f"against this machine's measured {summary['peak_dtype']} matmul peak "
        f"({trainer.peak_flops / 1e9:.0f} GFLOP/s). {how}",
        "",
        f"The plot's validation points score the {subset} every {trainer.config.validation.every_steps} steps; "
        "the star scores the whole split, as the table's last rows do.",
        "",
        "![loss](loss.png)",
        "",
        "## Sample",
        "",
        f"Temperature {sampling.temperature}, top-k {sampling.top_k}, repetition penalty "
        f"{sampling.repetition_penalty}, seed {sampling.seed}; `marinlm generate {root / 'train'} --prompt ...` "
        "samples more (`--help` lists the settings).",
        "",
        f"```{language}",
        prompt + sample,
        "```",
        "",
        "Curation details: curated/report.md. Training run (checkpoints, metrics, TensorBoard): train/.",
        "",
    ]
    path = root / "report.md"
    write_text_atomic(path, "\n".join(lines))
    return path
