"""The quickstart's report.md: each stage's time and outcome, validation loss and bits per byte
before and after training against a unigram baseline, the loss curve and a sample."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

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


# What the default quickstart (10 min, the built-in corpus) does on an idle 2-core host, as
# docs/training.md records it: the steps it fits, and the validation loss they end at.
USUAL_STEPS = (600, 3200)
USUAL_VAL_LOSS = (2.72, 3.9)


def short_run_note(
    steps: int, step_seconds: float | None, train_minutes: float, val_loss: float, built_in: bool, asked: bool
) -> str:
    """Why a quickstart trained far fewer steps than an idle 2-core host fits ("" when it did not, or
    when `asked` for its steps): a slow or busy host, or a short budget; and, on the `built_in`
    corpus, that its validation loss lands above the documented range for that reason."""
    if asked or steps >= USUAL_STEPS[0]:
        return ""
    pace = f" at a median {step_seconds:.2f} s/step" if step_seconds else ""
    cause = (
        f"the {train_minutes:.1f} min training budget is short"
        if train_minutes < 5
        else "this host ran its steps slowly (a slower CPU, or other jobs loading it)"
    )
    note = (
        f"This run trained {steps:,} steps{pace}, far fewer than the {USUAL_STEPS[0]:,}-{USUAL_STEPS[1]:,} that an "
        f"idle 2-core host fits in the default 10 minutes: {cause}."
    )
    if built_in and val_loss > USUAL_VAL_LOSS[1]:
        note += (
            f" Its validation loss, {val_loss:.3f} nats/token, is above the {USUAL_VAL_LOSS[0]}-{USUAL_VAL_LOSS[1]} "
            "that such runs end at because it trained less, not because something is broken."
        )
    return note + " `--minutes N` gives training more time, and `--steps N` trains a fixed number of steps."


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
) -> Path:
    """Write ROOT/report.md (`language` tags the sample's code block) and loss.png; returns its path."""
    from marinlm.train.metrics import plot_loss

    plot_loss(metrics, root / "loss.png", "marinlm quickstart: tiny hero-shaped MoE", ("unigram baseline", unigram[0]))
    # Over the whole run's logged steps: a resumed run's summary times only the steps after the resume.
    rates = [r["perf/tokens_per_s"] for r in metrics if "perf/tokens_per_s" in r]
    rate_kind = "median"
    if rates:
        tokens_per_s = statistics.median(rates)
    else:  # a run too short to log a rate: its mean over the training time
        rate_kind = "mean"
        trained = (summary["steps"] - summary["first_step"]) * trainer.config.train.global_batch
        tokens_per_s = trained * trainer.config.data.seq_len / max(summary["seconds"], 1e-9)
    mfu = trainer.mfu(tokens_per_s)  # against the higher of the peaks measured at the start and the end
    resumed = f", resumed at step {summary['first_step']}" if summary["first_step"] else ""
    source = trainer.loader.sources[0]
    epochs = trainer.loader.planned_epochs(summary["steps"] * trainer.config.train.global_batch)[0]
    train_tokens = source.rows_per_epoch * source.seq_len
    last_train = next((r["train/loss"] for r in reversed(metrics) if "train/loss" in r), math.nan)
    verdict = above_baseline_verdict(end_val["val/loss"], unigram[0], epochs, last_train)
    if verdict:
        print(f"warning: the validation loss ends above the unigram baseline. {verdict}")
    step_times = [r["perf/step_time_s"] for r in metrics if "perf/step_time_s" in r]
    short = short_run_note(
        summary["steps"],
        statistics.median(step_times) if step_times else None,
        trainer.config.train.max_minutes,
        end_val["val/loss"],
        language == "python",
        asked=not trainer.config.train.max_minutes,
    )
    if short:
        print(f"note: {short}")
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
        "| | loss (nats/token) | bits per byte |",
        "| --- | ---: | ---: |",
        f"| validation, before training | {start_val['val/loss']:.3f} | {start_val['val/bpb']:.3f} |",
        f"| validation, after training | {end_val['val/loss']:.3f} | {end_val['val/bpb']:.3f} |",
        f"| unigram baseline | {unigram[0]:.3f} | {unigram[1]:.3f} |",
        "",
        f"The validation loss fell by {start_val['val/loss'] - end_val['val/loss']:.3f} nats/token and ends "
        f"{abs(unigram[0] - end_val['val/loss']):.3f} nats/token "
        f"{'below' if end_val['val/loss'] < unigram[0] else 'above'} the unigram baseline."
        + (f" {verdict}" if verdict else ""),
        "",
        f"Training ({_PRECISION[trainer.precision]}): {summary['steps']} steps{resumed}, {_passes(epochs)} passes "
        f"over the {train_tokens:,} training tokens, {rate_kind} {tokens_per_s:,.0f} tokens/s, "
        f"{rate_kind} MFU {mfu:.1%} "
        f"against this machine's measured {summary['peak_dtype']} matmul peak "
        f"({trainer.peak_flops / 1e9:.0f} GFLOP/s)." + (f" {short}" if short else ""),
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
