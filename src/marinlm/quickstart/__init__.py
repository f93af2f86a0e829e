"""`marinlm quickstart`: the whole open recipe, end to end, on one machine with no network.

1. corpus: the Python standard library's sources and its bundled documentation topics (`pydoc_data`),
   which ship with every Python (or `--corpus PATH`);
2. curation (configs/data/python-corpus.yaml);   3. tokenizer;   4. token shards;
5. the hero-shaped `tiny` MoE, trained for `STEPS` steps (or a time budget);   6. validation loss and bits per byte,
   against a unigram baseline;   7. a generated sample;   8. report.md with the loss curve.
"""

from __future__ import annotations

import collections
import json
import os
import resource
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch

from marinlm.config import load_config, save_config
from marinlm.presets import preset
from marinlm.quickstart.plan import STEPS, Replan, TrainingPlan, calibrate_step_seconds, interrupted_training
from marinlm.quickstart.report import Stage, unigram_baseline, write_report
from marinlm.utils.io import QUICKSTART_FILE, refuse_overlap, write_text_atomic

VAL_FRACTION = 0.02  # of the documents, held out for validation
VAL_BATCH = 8  # rows a forward in the evaluation of the whole validation split
# The sample and the report, for the estimate said before training (a busy host samples slowly).
SAMPLE_SECONDS = 30.0


MARKER = QUICKSTART_FILE


def claim_run_dir(root: Path) -> None:
    """Make `root` the quickstart's own folder, whose stages it may start over.

    The quickstart replaces a finished earlier training run and restarts stages whose inputs changed, so
    it must never do that in a folder someone else's runs live in (`--run-dir runs` holding a real
    `runs/train`). A new or empty folder, or one an earlier quickstart made, is claimed with a
    marker file; anything else is an error.
    """
    if root.is_dir() and not (root / MARKER).exists():
        report = root / "report.md"
        legacy = report.is_file() and report.read_text(errors="replace").startswith("# marinlm quickstart report")
        if any(root.iterdir()) and not legacy:
            raise ValueError(
                f"{root}: exists and was not made by the quickstart, which replaces what it finds in its run "
                "folder; give --run-dir a new or empty folder"
            )
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).touch()


def build_default_corpus(folder: Path) -> dict[str, int]:
    """Write the stdlib sources and pydoc topics as jsonl shards; returns document counts."""
    from pydoc_data.topics import topics

    folder.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    shards = 4
    code: list[list[str]] = [[] for _ in range(shards)]
    for n, path in enumerate(files):
        text = path.read_text(encoding="utf-8", errors="replace")
        record = {"id": str(path.relative_to(stdlib)), "text": text, "path": str(path)}
        code[n % shards].append(json.dumps(record, ensure_ascii=False) + "\n")
    outputs = {f"python-code-{i}.jsonl": "".join(lines) for i, lines in enumerate(code)}
    outputs["python-docs.jsonl"] = "".join(
        json.dumps({"id": f"pydoc:{name}", "text": text}, ensure_ascii=False) + "\n"
        for name, text in sorted(topics.items())
    )
    for name, text in outputs.items():
        # Unchanged files keep their mtime, so a rerun's curation resumes instead of starting over.
        path = folder / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            write_text_atomic(path, text)
    return {"python_code": len(files), "python_docs": len(topics)}


DEFAULT_PROMPT = "def read_config(path):\n"
# A user's big .txt file (a book, tinyshakespeare.txt) is cut into documents of about 3,000 words at
# paragraph breaks: whole, it is one document that the quality rules drop as too long, and nothing
# would be left to hold out for validation.
USER_CHUNK_CHARS = 16_000


def _val_fraction(shards: Path, kept: int, seed: int) -> float:
    """VAL_FRACTION, or for a corpus so small that it might hold out no document at all, the
    fraction that holds out one (`fraction_holding_out_one`). Only small corpora are read for it:
    at 1,000 documents the chance that 2% holds out none is 0.98^1000 < 1e-8."""
    from marinlm.dataset.tokenize import document_ids, fraction_holding_out_one

    if kept * VAL_FRACTION >= 20:
        return VAL_FRACTION
    return fraction_holding_out_one(document_ids([str(shards)]), seed, VAL_FRACTION)


def corpus_prompt(tokens_dir: Path, tokenizer, max_chars: int = 60) -> str:
    """A prompt in the corpus's own language and style: the first line of the first validation
    document, at most `max_chars` characters (cut at a space where there is one)."""
    from marinlm.dataset.shards import TokenDataset

    text = tokenizer.decode(TokenDataset(tokens_dir, "val").document(0)[:128].tolist(), skip_special_tokens=True)
    line = next((line.strip() for line in text.replace("\ufffd", "").splitlines() if line.strip()), "")
    if len(line) > max_chars:
        cut = line.rfind(" ", 0, max_chars)
        line = line[: cut if cut > max_chars // 2 else max_chars]
    return line


def _why_nothing_was_kept(curation: dict, text_field: str, languages: list[str]) -> str:
    """The commonest reasons documents were dropped, and the quickstart flag that changes each."""
    reasons: collections.Counter = collections.Counter()
    for step in curation["steps"]:
        for source in step["by_source"].values():
            reasons.update(source["dropped"])
    hints = []
    for reason, _ in reasons.most_common(3):
        if reason.startswith(("rejected: missing field", "rejected: missing column")) or "not a string" in reason:
            hints.append(f"--text-field names the records' text field (now {text_field!r})")
        elif reason.startswith("language_") and reason != "language_low_confidence":
            hints.append(f"--languages lists the languages to keep (now {' '.join(languages)})")
    top = ", ".join(f"{reason} ({n:,})" for reason, n in reasons.most_common(3))
    if not hints:
        return f"{top}. The quickstart needs more (or longer) text"
    return top + "".join(f"; {hint}" for hint in dict.fromkeys(hints))


def run_quickstart(
    run_dir: str = "runs/quickstart",
    corpus: list[str] | None = None,
    minutes: float | None = None,
    seed: int = 0,
    text_field: str = "text",
    languages: list[str] | None = None,
    steps: int | None = None,
) -> Path:
    """Run every stage; returns the path of report.md.

    Training is `STEPS` steps on every host, with the time they will take said before training (and
    how to shorten it, where that is well past the README's 10 minutes). `steps`: train exactly this
    many instead, with no estimate; `minutes`: a time budget for the whole quickstart, in which
    training gets what the data stages leave and as many steps as the measured step time fits.

    `text_field` is the JSON field holding a user corpus's text (a list of strings is joined by
    lines); `languages` replaces the curation's allowed languages (default: English and code).
    """
    from marinlm.data.inputs import expand_inputs, glob_base
    from marinlm.data.pipeline import PipelineConfig, SourceSpec, run_pipeline
    from marinlm.dataset.tokenize import TokenizeConfig, tokenize
    from marinlm.dataset.tokenizer_training import TokenizerTrainConfig, train_tokenizer
    from marinlm.loading import generate_text, load_model
    from marinlm.model import SamplingConfig
    from marinlm.train.config import TrainConfig
    from marinlm.train.metrics import read_metrics
    from marinlm.train.signals import StoppedBySignal
    from marinlm.train.trainer import Trainer
    from marinlm.utils.perf import tune_cpu_allocator

    if steps and minutes is not None:
        raise ValueError("--steps and --minutes: give one (steps to train, or a time budget that plans them)")
    tune_cpu_allocator()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    root = Path(run_dir)
    if corpus:  # a missing or unreadable --corpus fails here, before the run folder is made
        expand_inputs(corpus, key="--corpus", quiet=True)
        for spec in corpus:  # the stages it replaces must not hold the corpus
            given = glob_base(spec)
            for stage in ("raw", "curated", "tokenizer", "tokens", "train"):
                refuse_overlap(root / stage, {"--corpus": given}, f"the quickstart's {stage} folder", inside_ok=True)
    claim_run_dir(root)
    began = time.perf_counter()
    stages: list[Stage] = []

    def stage(name: str):
        print(f"\n== {name}", flush=True)
        return time.perf_counter()

    t = stage("1/8 corpus")
    if corpus:
        sources = [SourceSpec(name="corpus", inputs=list(corpus), text_field=text_field, chunk_chars=USER_CHUNK_CHARS)]
        detail = f"user corpus: {', '.join(corpus)}"
    else:
        counts = build_default_corpus(root / "raw")
        sources = [
            SourceSpec(name="python_code", inputs=[str(root / "raw" / "python-code-*.jsonl")]),
            SourceSpec(name="python_docs", inputs=[str(root / "raw" / "python-docs.jsonl")]),
        ]
        detail = f"{counts['python_code']} standard-library source files, {counts['python_docs']} pydoc topics"
    stages.append(Stage("corpus", time.perf_counter() - t, detail))

    t = stage("2/8 curation")
    data_config = load_config(PipelineConfig, preset("data", "python-corpus"), [f"--output_dir={root / 'curated'}"])
    data_config.sources = sources
    if languages:
        data_config.langid.allowed = list(languages)
    save_config(data_config, root / "curation.yaml")
    curation = run_pipeline(data_config, restart=True)  # another corpus or recipe: curate again
    acc = curation["accounting"]
    if sum(a["kept"] for a in acc.values()) == 0:
        seen = sum(a["in"] for a in acc.values())
        why = _why_nothing_was_kept(curation, text_field, data_config.langid.allowed)
        raise ValueError(
            f"curation kept none of the {seen} documents read from {detail}: {why}. All the reasons are in "
            f"{root / 'curated' / 'report.md'}"
        )
    stages.append(
        Stage(
            "curation",
            time.perf_counter() - t,
            ("resumed: done by an earlier run; " if curation["units_run"] == 0 else "")
            + "; ".join(
                f"{s}: {a['in']} in, {a['kept']} kept ({a['dropped']} dropped, {a['rejected']} rejected)"
                for s, a in acc.items()
            ),
        )
    )

    t = stage("3/8 tokenizer")
    train_config = load_config(TrainConfig, preset("train", "quickstart"), [f"--run_dir={root / 'train'}"])
    tok_config = TokenizerTrainConfig(
        inputs=[str(root / "curated" / "shards")],
        output_dir=str(root / "tokenizer"),
        vocab_size=train_config.model.vocab_size,
    )
    # Deterministic: same data, same tokenizer. In a child process, so that Ctrl-C stops it at once.
    tok, tok_report = train_tokenizer(tok_config, replace=True, in_child=True)
    stages.append(
        Stage(
            "tokenizer",
            time.perf_counter() - t,
            f"byte-level BPE, vocab {tok.vocab_size}, trained on {tok_report['bytes'] / 1e6:.1f} MB; "
            f"{tok_report['bytes_per_token']:.2f} bytes a token on {tok_report['bytes_per_token_sample']['documents']} "
            "of its documents",
        )
    )

    t = stage("4/8 token shards")
    kept = sum(a["kept"] for a in acc.values())
    val_fraction = _val_fraction(root / "curated" / "shards", kept, seed)
    if val_fraction != VAL_FRACTION:
        print(
            f"note: {VAL_FRACTION:.0%} of the {kept} curated documents holds out none for validation; holding out "
            f"one instead (val_fraction {val_fraction:.4f})"
        )
    manifest = tokenize(
        TokenizeConfig(
            inputs=[str(root / "curated" / "shards")],
            tokenizer=str(root / "tokenizer"),
            output_dir=str(root / "tokens"),
            val_fraction=val_fraction,
            seed=seed,
        ),
        restart=True,  # a retrained tokenizer or another seed: tokenize again
    )
    if manifest["train_docs"] == 0 or manifest["val_docs"] == 0:
        raise ValueError(
            f"{root / 'tokens'}: {manifest['train_docs']} training and {manifest['val_docs']} validation documents; "
            "the quickstart needs at least one of each, so give it more documents (a .txt file is cut into "
            f"documents of at most {USER_CHUNK_CHARS:,} characters)."
        )
    bytes_per_token = sum(e["num_bytes"] for e in manifest["splits"]["train"]) / max(1, manifest["train_tokens"])
    stages.append(
        Stage(
            "tokenize",
            time.perf_counter() - t,
            ("resumed: done by an earlier run; " if manifest["inputs_tokenized"] == 0 else "")
            + f"train {manifest['train_tokens']:,} tokens / {manifest['train_docs']} docs, val "
            f"{manifest['val_tokens']:,} tokens / {manifest['val_docs']} docs; "
            f"{bytes_per_token:.2f} bytes/token",
        )
    )

    t = stage("5/8 training")
    train_config.data.sources[0].path = str(root / "tokens")
    elapsed_min = (time.perf_counter() - began) / 60
    budget_left = None if minutes is None else minutes - elapsed_min - 0.75  # time for evaluation and the report
    interrupted = interrupted_training(root / "train", train_config)
    if interrupted is not None:  # the same job, stopped before its end: carry on with its own plan
        train_config, stopped_at, start_val = interrupted
        # A run planned by time keeps its own plan, shortened (by Replan) to this command's budget if it has one.
        left = train_config.train.max_minutes if budget_left is None else max(1.0, budget_left)
        plan = TrainingPlan(
            "resumed", train_config.train.steps, train_minutes=left if train_config.train.max_minutes else None
        )
        print(
            f"resuming the training that was stopped at step {stopped_at} of {train_config.train.steps} "
            f"in {root / 'train'} (delete that folder to train from scratch)"
        )
    else:
        if budget_left is not None:  # a time budget: as many steps as it fits
            plan = TrainingPlan("minutes", 0, train_minutes=max(1.0, budget_left))
            if budget_left < 1.0:
                print(
                    f"note: the {minutes:g} min budget leaves {max(budget_left, 0.0):.1f} min for training after "
                    f"{elapsed_min:.1f} min of data stages and 0.75 min kept for evaluation and the report; "
                    "training for the minimum of 1 min, so the whole run takes longer"
                )
        else:
            plan = TrainingPlan("steps" if steps else "default", steps or STEPS)
        if plan.how != "steps":  # --steps N trains N however long they take: nothing to measure
            plan.step_seconds, forward_seconds = calibrate_step_seconds(train_config)
            plan.eval_seconds = forward_seconds * manifest["val_tokens"] + SAMPLE_SECONDS
        if plan.how == "minutes":
            # Plan for 80% of the budget: the calibration times a few seconds, which a shared host makes
            # noisy, and a run that hits the time limit stops before its learning rate has decayed. `Replan`
            # plans again from the run's own steps (90% of the time left) and shortens it if the host slows.
            plan.steps = max(20, int(plan.train_minutes * 60 * 0.8 / plan.step_seconds))
            train_config.train.max_minutes = plan.train_minutes
        else:
            train_config.train.max_minutes = 0.0
        train_config.train.steps = plan.steps
        train_config.checkpoint.every_steps = max(10 if steps else 50, plan.steps // 4)
        train_config.validation.every_steps = max(10, plan.steps // 10)
        print(
            f"{plan.steps} steps, as --steps asks (no time budget)"
            if plan.how == "steps"
            else plan.announce(elapsed_min)
        )
        if (root / "train").exists():  # a finished run, or another job's: this one starts over
            print(f"replacing the earlier training run in {root / 'train'}")
            shutil.rmtree(root / "train")
    trainer = Trainer(train_config, resume="auto" if interrupted else "none")
    if interrupted is None:
        start_val = trainer.validate()  # at step 0: the loss before training
    if train_config.train.max_minutes:  # planned by time: planned again from the steps' own time
        trainer.add_hook(Replan(trainer, plan.train_minutes), every=1)
    summary = trainer.fit()
    if summary["signal"]:  # Ctrl-C or a scheduler's SIGTERM: stop here, not evaluate half a run
        raise StoppedBySignal(summary["signal"], summary["steps"])
    stages.append(
        Stage(
            "training",
            time.perf_counter() - t,
            f"{summary['steps']} steps x {train_config.train.global_batch} x {train_config.data.seq_len} "
            f"tokens in {summary['seconds'] / 60:.1f} min"
            + (f" (resumed at step {summary['first_step']})" if summary["first_step"] else ""),
        )
    )

    t = stage("6/8 evaluation")
    loaded = load_model(root / "train")
    from marinlm.dataset.loader import open_sources
    from marinlm.train.step import validate_sources

    val_source = open_sources(train_config.data, "val", tok.hash, train_config.model.vocab_size)[0]
    end_val = validate_sources(
        loaded.model,
        {"val": val_source},
        VAL_BATCH,
        None,
        0,
        1,
        device=torch.device("cpu"),
        precision="fp32",
        progress=True,
    )
    uni_loss, uni_bpb = unigram_baseline(root / "tokens", tok.vocab_size)
    stages.append(
        Stage(
            "evaluation",
            time.perf_counter() - t,
            f"whole validation split: loss {end_val['val/loss']:.3f}, bpb {end_val['val/bpb']:.3f} over "
            f"{int(end_val['val/tokens']):,} tokens",
        )
    )

    t = stage("7/8 sample")
    prompt = corpus_prompt(root / "tokens", tok) if corpus else DEFAULT_PROMPT
    # CTRL's repetition penalty (HF's `repetition_penalty`) at 1.2: without it a model this small
    # at temperature 0.7 often loops on one word ("a list of a list of ...").
    sampling = SamplingConfig(max_new_tokens=120, temperature=0.7, top_k=40, repetition_penalty=1.2, seed=seed)
    print(prompt, end="", flush=True)
    sample = generate_text(loaded, prompt, sampling, stream=sys.stdout)  # the text as it comes is its progress
    print()
    stages.append(Stage("sample", time.perf_counter() - t, f"{len(sample)} characters"))

    t = stage("8/8 report")
    metrics = read_metrics(root / "train")
    peak = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    )
    report = write_report(
        root,
        stages,
        metrics,
        start_val,
        end_val,
        (uni_loss, uni_bpb),
        prompt,
        sample,
        "python" if prompt == DEFAULT_PROMPT else "",
        sampling,
        summary,
        peak / 1024 / 1024,
        time.perf_counter() - began,
        trainer,
        plan,
    )
    print(f"\nreport: {report}")
    return report
