"""`marinlm eval RUN_OR_CKPT --tasks ...`: run tasks, write results JSON + a markdown table.

Task specs: the names in `marinlm.eval.tasks` (hellaswag, arc_easy, arc_challenge, piqa,
winogrande, lambada_openai, mmlu), `bpb:PATH` for bits per byte with rolling windows of a text file
(any name; .txt.gz/.txt.zst too) or of the "text" of each record of a .jsonl(.gz/.zst), .json or
.parquet file (a curated shard), and `val` for the run's held-out token split.
Every task file is read and validated before any scoring starts, and results are written once,
atomically, at the end: a bad file fails the run instead of producing partial results.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

from marinlm.config import check
from marinlm.config.typed import did_you_mean
from marinlm.data.inputs import expand_inputs
from marinlm.data.readers import COMPRESSED_TEXT_SUFFIXES, Rejected, decompressed, read_documents
from marinlm.eval.lm import Scorer
from marinlm.eval.tasks import MMLU, TaskDataError, TaskFileMissing, read_text, score, subset, task_registry
from marinlm.loading import document_start_id
from marinlm.parallel.distributed import rank_and_world
from marinlm.utils.io import sha256_file, write_json_atomic, write_text_atomic

# Where task files are found without --data-dir: $MARINLM_EVAL_DATA, else ../shared/data/eval beside
# a source checkout (an installed package has no such folder).
DATA_ENV = "MARINLM_EVAL_DATA"
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[4] / "shared" / "data" / "eval"


# `bpb:` files of many texts (each scored from its own start); any other file is one text.
BPB_RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".parquet")


@dataclass(kw_only=True)
class EvalOptions:
    tasks: list[str]
    data_dir: str = ""
    limit: int | None = None  # the first N items of each task, as lm-eval's --limit
    sample: int | None = None  # N items of each task drawn by a fixed seed (multiple-choice tasks)
    batch_size: int = 32
    num_fewshot: int = 0
    predictions: bool = False
    hf_datasets: dict[str, str] | None = None  # task file name -> HF datasets "NAME[:CONFIG]:SPLIT"
    progress: bool = False  # a bar per task on stderr (`marinlm eval` turns it on)

    def __post_init__(self):
        check(len(self.tasks) > 0, "tasks", "give at least one task")
        check(self.limit is None or self.limit >= 1, "limit", f"must be >= 1 items per task, got {self.limit}")
        check(self.sample is None or self.sample >= 1, "sample", f"must be >= 1 items per task, got {self.sample}")
        check(self.batch_size >= 1, "batch_size", f"must be >= 1, got {self.batch_size}")
        check(self.num_fewshot >= 0, "num_fewshot", f"must be >= 0, got {self.num_fewshot}")
        check(
            not self.num_fewshot or "mmlu" in self.tasks,
            "num_fewshot",
            f"is MMLU's number of dev examples in the prompt, and the tasks {self.tasks} do not include mmlu (the "
            "others are scored 0-shot; for few-shot on them, run lm-evaluation-harness with "
            "marinlm.eval.harness.MarinHarnessLM)",
        )


def _data_dir(options: EvalOptions) -> Path:
    if options.data_dir:
        return Path(options.data_dir)
    return Path(os.environ[DATA_ENV]) if os.environ.get(DATA_ENV) else DEFAULT_DATA_DIR


def prepare(options: EvalOptions) -> list[tuple[str, object, list]]:
    """Load and validate every requested task up front."""
    from marinlm.eval import tasks as task_module

    task_module.HF_SOURCES.clear()
    task_module.HF_SOURCES.update(options.hf_datasets or {})
    registry = task_registry(options.num_fewshot)
    wanted = {Path(f).name: spec for spec in options.tasks if spec in registry for f in registry[spec].files}
    for name in options.hf_datasets or {}:  # one that no task reads would be ignored without a word
        known = ", ".join(f"{f} ({spec})" for f, spec in wanted.items()) or "none: no downstream task was asked for"
        check(name in wanted, "hf_datasets", f"{name!r} is no file of the tasks asked for; their files: {known}")
    prepared = []
    for spec in options.tasks:
        if spec == "val":
            prepared.append((spec, None, []))
        elif spec.startswith("bpb:"):
            path = Path(spec[4:])
            if path.is_dir():  # one file per task: name some of those it holds (a curation's shards)
                try:
                    files = expand_inputs([str(path)], key="bpb", quiet=True)
                except (OSError, ValueError) as e:  # none to read, or outputs (token shards, a run): say so
                    raise TaskDataError(f"{path}: is a folder; bpb:PATH scores one file of text ({e})") from None
                examples = f", e.g. {' '.join(f'bpb:{f}' for f in files[:3])}"
                raise TaskDataError(
                    f"{path}: is a folder; bpb:PATH scores one file (a text file, or a .jsonl(.gz/.zst), .json or "
                    f".parquet file of records){examples}; give several bpb: tasks for several files"
                )
            if not path.is_file():
                raise TaskDataError(f"{path}: text file for bits-per-byte not found")
            if path.name.endswith(BPB_RECORD_SUFFIXES):  # as curation reads them
                texts = []
                for item in read_documents(path, text_field="text", id_field=None):
                    if isinstance(item, Rejected):
                        raise TaskDataError(
                            f"{item.location}: {item.reason}; bits per byte scores each record's 'text'"
                        )
                    texts.append(item.text)
            elif path.name.endswith(COMPRESSED_TEXT_SUFFIXES):  # the text file it holds, byte for byte
                try:
                    data = decompressed(path)
                except ValueError as e:
                    raise TaskDataError(str(e)) from None
                texts = [read_text(path, data)]
            else:  # any other file is one text, as it is on disk
                texts = [read_text(path)]
            if not any(t.strip() for t in texts):
                raise TaskDataError(f"{path}: no text to score")
            prepared.append((spec, path, texts[: options.limit] if options.limit else texts))
        elif spec in registry:
            task = registry[spec]
            try:
                items = task.load(_data_dir(options))
            except TaskFileMissing:
                if _data_dir(options) != DEFAULT_DATA_DIR or DEFAULT_DATA_DIR.is_dir():
                    raise
                # Not the path that was tried: it lies inside the installed package, not a place to fill.
                raise TaskDataError(
                    f"task {spec!r} needs {', '.join(task.files)}: no --data-dir was given, {DATA_ENV} is not set, "
                    "and there is no ../shared/data/eval beside the source (an installed package has none); give "
                    "one of the first two, or load the task from HF datasets with --hf"
                ) from None
            if not items:
                raise TaskDataError(f"{_data_dir(options) / task.files[0]}: task {spec!r} has no items")
            if isinstance(task, MMLU) and (options.limit or options.sample):  # the harness limits each subject
                by_subject: dict[str, list] = {}
                for item in items:
                    by_subject.setdefault(item.meta["subject"], []).append(item)
                items = [i for group in by_subject.values() for i in subset(group, options.limit, options.sample)]
            else:
                items = subset(items, options.limit, options.sample)
            prepared.append((spec, task, items))
        else:
            hint = did_you_mean(spec, [*registry, "val"])
            raise TaskDataError(f"unknown task {spec!r}{hint or ';'} known: {sorted(registry)}, 'val', 'bpb:PATH'")
    return prepared


def run_eval(
    loaded, options: EvalOptions, output: str | Path | None = None, val_sources=None, prepared: list | None = None
) -> dict:
    """Score `loaded` (a marinlm.loading.LoadedModel) on the tasks; write results if `output` is given.

    `prepared` is `prepare(options)` done ahead (the training hook loads its tasks once, at start).
    """
    prepared = prepare(options) if prepared is None else prepared
    if not val_sources and any(spec == "val" for spec, _, _ in prepared):
        val_sources = _open_val(loaded)  # before any scoring: a missing split must not cost the other tasks
    scorer = Scorer(
        loaded.model,
        loaded.tokenizer,
        batch_size=options.batch_size,
        progress=options.progress,
        start_id=document_start_id(loaded),
    )
    results, predictions, files = {}, {}, {}
    start = time.perf_counter()
    for spec, task, items in prepared:
        t0 = time.perf_counter()
        if spec == "val":
            results.update(_val_metrics(loaded, val_sources, options.batch_size, options.limit))
        elif spec.startswith("bpb:"):
            if options.limit and not task.name.endswith(BPB_RECORD_SUFFIXES):  # one text: its first `limit` windows
                items = [scorer.leading_windows(items[0], options.limit)]
            ll = scorer.loglikelihood_rolling(items, desc=spec)
            total = sum(x for x, _ in ll)
            tokens = sum(n for _, n in ll)
            num_bytes = sum(len(t.encode("utf-8")) for t in items)
            results[spec] = {
                "bits_per_byte": -total / (math.log(2) * num_bytes),
                "token_perplexity": math.exp(-total / max(tokens, 1)),
                "tokens": tokens,
                "bytes": num_bytes,
            }
            files[str(task)] = sha256_file(task)
        else:
            flat = [r for item in items for r in item.requests]
            lls = scorer.loglikelihood(flat, desc=spec)
            grouped, k = [], 0
            for item in items:
                grouped.append(lls[k : k + len(item.requests)])
                k += len(item.requests)
            metrics, preds = score(task, items, grouped)
            metrics["n"] = len(items)
            results[spec] = metrics
            if options.predictions:
                predictions[spec] = preds
            data_dir = _data_dir(options)
            for rel in task.files:
                path = data_dir / rel
                if path.name in (options.hf_datasets or {}):
                    continue  # read from HF datasets: its source is in the config, not this file's hash
                if path.is_file():
                    files[str(path)] = sha256_file(path)
                elif path.is_dir():
                    for f in sorted(path.glob("*.csv")):
                        files[str(f)] = sha256_file(f)
        results[spec]["seconds"] = round(time.perf_counter() - t0, 2)
    report = {
        "results": results,
        "config": {
            "checkpoint": str(loaded.checkpoint),
            "tokenizer_hash": loaded.tokenizer_hash,
            "limit": options.limit,
            "sample": options.sample,
            "num_fewshot": options.num_fewshot,
            "batch_size": options.batch_size,
            "data_dir": str(_data_dir(options)),
            "task_file_sha256": files,
            "hf_datasets": dict(options.hf_datasets or {}),  # task files read from HF datasets instead
            "processes": rank_and_world()[1],  # under torchrun: the model sharded and the items dealt over them
            "seconds": round(time.perf_counter() - start, 2),
        },
    }
    if options.predictions:
        report["predictions"] = predictions
    if output is not None:
        output = Path(output)
        write_json_atomic(output, report)
        write_text_atomic(output.with_suffix(".md"), markdown_table(report))
    return report


def launch_dir(loaded) -> Path | None:
    """The folder training ran from, where the config gave the run folder relative to it and the run
    has not moved since: `/a/runs/tiny` trained as `run_dir: runs/tiny` ran from `/a`."""
    run_dir = Path(loaded.config.run_dir)
    run = loaded.checkpoint.resolve().parent.parent  # RUN/checkpoints/step-N
    n = len(run_dir.parts)
    if run_dir.is_absolute() or ".." in run_dir.parts or run.parts[-n:] != run_dir.parts:
        return None
    return Path(*run.parts[:-n])


def _open_val(loaded) -> dict:
    """The validation split of each of the run's training sources, by name (a TaskDataError naming
    the split if one is unreadable, or if none has one). Relative data paths are read from the
    current folder, else from the folder training ran from."""
    from marinlm.dataset import ShardError
    from marinlm.dataset.loader import validation_sources

    data, launch = loaded.config.data, launch_dir(loaded)
    if not data.sources:  # an imported checkpoint, or a fine-tune's SFT data
        raise TaskDataError(
            f"task 'val' scores the validation split of the run's training data, and {loaded.checkpoint} "
            "names no tokenized dataset (data.sources); score a text with bpb:PATH instead"
        )
    missing = [s for s in data.sources if not Path(s.path).is_absolute() and not Path(s.path).exists()]
    if launch is not None and missing and all((launch / s.path).exists() for s in missing):
        sources = [replace(s, path=str(launch / s.path)) if s in missing else s for s in data.sources]
        data = replace(data, sources=sources)
    try:
        found, empty = validation_sources(data, loaded.tokenizer_hash, loaded.config.model.vocab_size)
        if not found:
            raise ShardError(empty[0])
        return found
    except ShardError as e:
        where = ""
        if missing:
            where = f" (a relative path is read from the current folder, {Path.cwd()}"
            where += f", else from the folder training ran from, {launch})" if launch is not None else ")"
        raise TaskDataError(f"task 'val' scores the validation split of the run's training data: {e}{where}") from None


def _val_metrics(loaded, val_sources: dict, batch_size: int, limit: int | None = None) -> dict[str, dict]:
    """Loss and bits per byte over each source's split, or its first `limit` rows in the loader's
    draw order (spread over the split), as training's validation takes `validation.max_rows`:
    `val` over all the sources, and with several, `val:NAME` for each."""
    from marinlm.train.step import validate_sources

    device = next(loaded.model.parameters()).device
    rank, world = rank_and_world()  # under torchrun each rank takes its rows; validate_sources() sums them
    precision = "fp32" if device.type == "cpu" else "bf16"
    metrics = validate_sources(
        loaded.model,
        val_sources,
        batch_size,
        limit,
        rank,
        world,
        device=device,
        precision=precision,
        progress=rank == 0,
    )
    results = {}
    for name in ["", *val_sources] if len(val_sources) > 1 else [""]:
        key = f"val/{name}/" if name else "val/"
        # A count, like bpb's: an int in the JSON, and not a row of the markdown table ("260782.0000").
        results[f"val:{name}" if name else "val"] = {
            "loss": metrics[key + "loss"],
            "bits_per_byte": metrics[key + "bpb"],
            "tokens": int(metrics[key + "tokens"]),
        }
    return results


def markdown_table(report: dict) -> str:
    lines = ["| task | metric | value | stderr | n |", "| --- | --- | ---: | ---: | ---: |"]
    for task, metrics in report["results"].items():
        for name, value in metrics.items():
            if name.endswith("_stderr") or name in ("n", "seconds", "subjects") or not isinstance(value, float):
                continue
            stderr = metrics.get(f"{name}_stderr")
            se = f"{stderr:.4f}" if isinstance(stderr, float) and math.isfinite(stderr) else ""
            # Perplexity tasks count tokens (how much of the split `val` scored, for one).
            n = metrics.get("n", f"{metrics['tokens']:,} tokens" if "tokens" in metrics else "")
            cell = task.replace("|", "\\|")  # a file name may hold one: it would end the cell
            lines.append(f"| {cell} | {name} | {value:.4f} | {se} | {n} |")
    c = report["config"]
    shots = f"{c['num_fewshot']}-shot"
    if c["num_fewshot"] and set(report["results"]) - {"mmlu"}:
        shots = f"MMLU {shots}, the other tasks 0-shot"
    lines += [
        "",
        f"Checkpoint `{c['checkpoint']}`, tokenizer `{c['tokenizer_hash'][:12]}`, "
        + (f"limit {c['limit']}, " if c["limit"] else "no limit, ")
        + f"{shots}, {c['seconds']} s.",
    ]
    return "\n".join(lines) + "\n"
