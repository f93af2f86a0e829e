"""`marinlm data run PIPELINE.yaml`: raw documents -> curated, deduplicated, decontaminated shards.

Three stages, each resumable through per-shard completion markers (outputs are written under a
temporary name and renamed, markers last):

1. **map** (one task per input file, or per `split_bytes` part of a big .jsonl(.gz/.zst) or
   .parquet file; in worker processes or on Ray): read, reject bad input, normalise, identify
   language, quality filters, PII masking, decontamination; keep the surviving documents plus
   their hashes (document, paragraphs, MinHash bands) and token counts.
2. **reduce** (one process, hashes only): exact document dedup, fuzzy dedup (connected components
   of LSH collisions), paragraph dedup, then the mixture plan (repeats per document).
3. **write** (one task per map task): apply the plan and write the output shard.

Everything dropped or rejected is written to a side output with its reason, and the report checks
`documents read = kept + dropped (by reason) + rejected`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from marinlm.data.classify import QualityScore, TopicAssign, cell_name, fit_models
from marinlm.data.config import OutputConfig, PipelineConfig, SourceSpec  # noqa: E402,F401  (the config API in one place)
from marinlm.data.decontam import Decontaminate, NgramIndex
from marinlm.data.dedup import minhash_bands, xxh3
from marinlm.data.executors import ray_map
from marinlm.data.filters import quality_steps
from marinlm.data.inputs import expand_inputs, input_note
from marinlm.data.normalize import LanguageId, Normalize
from marinlm.data.pii import MaskPII
from marinlm.data.readers import Document, document_location, input_parts, read_documents, whole_file_reason
from marinlm.data.records import doc_record, read_records, repeat_id, write_records  # noqa: E402,F401
from marinlm.data.steps import ShardContext
from marinlm.utils.io import atomic_path, job_output, sha256_file, write_json_atomic
from marinlm.utils.pool import process_map
from marinlm.utils.progress import progress_bar, resumed_line

PARAGRAPH = re.compile(r"\n{2,}")


# --- stage 1: map -------------------------------------------------------------------------------

_STEPS_CACHE: dict[str, list] = {}


def _build_steps(config: PipelineConfig, work: Path) -> list:
    key = json.dumps(str(work))
    if key not in _STEPS_CACHE:
        steps = []
        if config.normalize.enabled:
            steps.append(Normalize(config.normalize))
        if config.langid.enabled:
            steps.append(LanguageId(config.langid))
        steps += quality_steps(config.quality)
        if config.classifier.enabled:  # after the cheap heuristics: it scores only what they keep
            steps.append(QualityScore(config.classifier, work / "quality.bin"))
        if config.topic.enabled:
            steps.append(TopicAssign(work / "topics.npz"))
        if config.pii.enabled:
            steps.append(MaskPII(config.pii))
        if config.decontam.enabled and config.decontam.eval_paths:
            steps.append(Decontaminate(config.decontam, NgramIndex.load(work / "decontam_index.npz")))
        _STEPS_CACHE[key] = steps
    return _STEPS_CACHE[key]


def _read(task: dict, config: PipelineConfig, ctx: ShardContext, rejected_file):
    stats = ctx.stats["read"]
    source = task["source"]
    documents = read_documents(
        Path(task["path"]),
        task["text_field"],
        task["id_field"],
        source,
        task["split"],
        task.get("chunk_chars", 0),
        task.get("part"),
    )
    for item in documents:
        stats.docs_in[source] += 1
        if isinstance(item, Document):
            size = len(item.text.encode("utf-8"))
            stats.bytes_in[source] += size
            reason = None
            if len(item.text.strip()) < config.min_doc_chars:
                reason = "empty document"
            elif size > config.max_doc_bytes:
                reason = f"document too large ({size} bytes > max_doc_bytes {config.max_doc_bytes})"
            if reason is None:
                item.source = source
                stats.docs_out[source] += 1
                stats.bytes_out[source] += size
                yield item
                continue
            record = {"location": document_location(item), "reason": reason, "id": item.id}
        else:
            record = {"location": item.location, "reason": item.reason, "raw": item.raw}
        stats.dropped[source]["rejected: " + record["reason"].split(" (")[0].split(":")[0]] += 1
        rejected_file.write(json.dumps({"source": source, **record}, ensure_ascii=False) + "\n")


def _token_counter(config: PipelineConfig):
    if config.mixture.tokenizer:
        from marinlm.tokenizer import MarinTokenizer

        tok = MarinTokenizer.load(config.mixture.tokenizer)
        return lambda texts: [len(ids) for ids in tok.encode_batch(texts)]
    bpt = config.mixture.bytes_per_token
    return lambda texts: [max(1, round(len(t.encode("utf-8")) / bpt)) for t in texts]


def run_map(task: dict) -> dict:
    """Stage 1 on one input file or part. Returns the shard's stats (also written next to its outputs)."""
    from marinlm.config import from_dict

    config = from_dict(PipelineConfig, task["config"])
    out, work, shard = Path(config.output_dir), Path(task["work"]), task["shard"]
    ctx = ShardContext(shard, out / "dropped")
    (out / "rejected").mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "rejected" / f"{shard}.jsonl") as rejected_tmp, open(rejected_tmp, "w") as rejected:
        docs = _read(task, config, ctx, rejected)
        for step in _build_steps(config, work):
            docs = step(docs, ctx)
        kept = list(docs)
    ctx.close()
    texts = [d.text for d in kept]
    count_tokens = _token_counter(config)
    tokens = np.asarray(count_tokens(texts), dtype=np.int64) if kept else np.zeros(0, np.int64)
    para_doc, para_idx, para_hash, para_tokens, para_ok = [], [], [], [], []
    skip_langs = set(config.dedup.paragraph_skip_languages)
    for i, doc in enumerate(kept):
        paragraphs = PARAGRAPH.split(doc.text)
        eligible = doc.metadata.get("language") not in skip_langs
        per_byte = tokens[i] / max(1, len(doc.text.encode("utf-8")))
        for j, p in enumerate(paragraphs):
            para_doc.append(i)
            para_idx.append(j)
            para_tokens.append(round(len(p.encode("utf-8")) * per_byte))
            para_ok.append(eligible and len(p.split()) >= config.dedup.min_paragraph_words)
        para_hash += paragraphs
    arrays = {
        "doc_hash": xxh3(texts) if kept else np.zeros(0, np.uint64),
        "bands": minhash_bands(texts, config.dedup) if config.dedup.fuzzy else np.zeros((len(kept), 0), np.uint64),
        "tokens": tokens,
        "para_doc": np.asarray(para_doc, dtype=np.int64),
        "para_idx": np.asarray(para_idx, dtype=np.int64),
        "para_hash": xxh3(para_hash) if para_hash else np.zeros(0, np.uint64),
        "para_tokens": np.asarray(para_tokens, dtype=np.int64),
        "para_ok": np.asarray(para_ok, dtype=bool),
        "quality": np.asarray([d.metadata.get("quality_score", np.nan) for d in kept], dtype=np.float64),
        "topic": np.asarray([d.metadata.get("topic", -1) for d in kept], dtype=np.int64),
    }
    write_records(_stage1_docs(work, task), [doc_record(d) for d in kept], "jsonl.zst")
    with atomic_path(work / "stage1" / f"{shard}.index.npz") as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)
    order = ["read"] + [step.name for step in _build_steps(config, work)]
    result = {
        "shard": shard,
        "source": task["source"],
        "docs": len(kept),
        "ids": [d.id for d in kept],
        "stats": {name: ctx.stats[name].to_dict() for name in order},
    }
    write_json_atomic(work / "stage1" / f"{shard}.done.json", result)
    return result


# --- stage 3: write -----------------------------------------------------------------------------


def run_write(task: dict) -> dict:
    """Stage 3 on one shard: apply the plan, write the output shard, report what happened."""
    from marinlm.config import from_dict
    from marinlm.data.reduce import ACTION_REASON, KEEP

    config = from_dict(PipelineConfig, task["config"])
    out, work, shard = Path(config.output_dir), Path(task["work"]), task["shard"]
    plan = np.load(work / "stage2" / f"{shard}.plan.npz")
    records = read_records(_stage1_docs(work, task))
    removal: dict[int, set[int]] = {}
    for d, p in plan["para_remove"]:
        removal.setdefault(int(d), set()).add(int(p))
    ctx = ShardContext(shard, out / "dropped")
    split = config.output.split_by  # the shard folder: "" unsplit, else the cell on the split's axes
    by_folder: dict[str, list[dict]] = {}  # one file per cell of the shard (one when not split)
    in_bytes: dict[str, int] = {}
    kept_bytes: dict[str, int] = {}
    for i, r in enumerate(records):
        doc = Document(id=r["id"], text=r["text"], source=r["source"], metadata=r["metadata"])
        in_bytes[doc.source] = in_bytes.get(doc.source, 0) + len(doc.text.encode("utf-8"))
        action = int(plan["action"][i])
        if action != KEEP:
            detail = {"keeper": int(plan["keeper"][i]), "cluster_size": int(plan["cluster_size"][i])}
            ctx.drop("dedup", doc, ACTION_REASON[action], detail)
            continue
        if i in removal:
            doc.text = "\n\n".join(p for j, p in enumerate(PARAGRAPH.split(doc.text)) if j not in removal[i])
        kept_bytes[doc.source] = kept_bytes.get(doc.source, 0) + len(doc.text.encode("utf-8"))
        level = int(plan["level"][i]) if config.classifier.enabled else None
        if level is not None:
            doc.metadata["quality_level"] = level
        topic = doc.metadata.get("topic")
        axes = (None if split == "quality" else topic, None if split == "topic" else level)
        folder = "" if split == "none" else cell_name(*axes)
        for k in range(int(plan["repeats"][i])):
            record = doc_record(doc)
            if k:
                record["id"] = repeat_id(doc.id, k)
            by_folder.setdefault(folder, []).append(record)
    ctx.close()
    output = [r for records in by_folder.values() for r in records]
    suffix = "parquet" if config.output.format == "parquet" else "jsonl.zst"
    files = []
    for folder in sorted(by_folder) or [""]:
        records = by_folder.get(folder, [])
        path = out / "shards" / folder / f"{shard}.{suffix}"
        write_records(path, records, config.output.format)
        files.append({"path": str(path.relative_to(out)), "docs": len(records), "by_source": _by_source(records)})
        files[-1].update(bytes=path.stat().st_size, sha256=sha256_file(path))
    result = {
        "shard": shard,
        "files": files,
        "docs": len(output),
        "by_source": _by_source(output),
        "dropped": {s: dict(r) for s, r in ctx.stats["dedup"].dropped.items()},
        "bytes_in": in_bytes,
        "bytes_kept": kept_bytes,
    }
    write_json_atomic(work / "stage3" / f"{shard}.done.json", result)
    return result


def _by_source(records: list[dict]) -> dict[str, dict[str, int]]:
    by_source: dict[str, dict[str, int]] = {}
    for r in records:
        s = by_source.setdefault(r["source"], {"docs": 0, "bytes": 0})
        s["docs"] += 1
        s["bytes"] += len(r["text"].encode("utf-8"))
    return by_source


# --- orchestration ------------------------------------------------------------------------------


def _tasks(config: PipelineConfig, work: Path, notes: list[str] | None = None) -> list[dict]:
    """One task per input file or part of one. Notes on the inputs (files skipped, a big file read
    whole) are printed, and kept in `notes` for the report."""
    from marinlm.config import to_dict

    if not config.sources:
        raise ValueError("sources: give at least one source with inputs")
    tasks = []
    out = Path(config.output_dir).resolve()
    for i, spec in enumerate(config.sources):
        for given in spec.inputs:
            if Path(given).is_dir() and out.is_relative_to(Path(given).resolve()):
                raise ValueError(
                    f"output_dir {config.output_dir} is inside input folder {given} of source {spec.name!r}: "
                    "a rerun would read its own outputs; put the output elsewhere"
                )
        # A miss fails here, before any work.
        for path in expand_inputs(spec.inputs, f"sources[{i}].inputs", notes=notes):
            parts = input_parts(path, config.split_bytes)
            size = path.stat().st_size
            if parts == [None] and 0 < 4 * config.split_bytes < size:
                message = (
                    f"{path} ({tqdm.format_sizeof(size, 'B')}) is read whole, by one worker: "
                    f"{whole_file_reason(path)}, to have it read in parts of split_bytes={config.split_bytes:,} "
                    "on every worker"
                )
                input_note(message, notes=notes)
            for part in parts:
                tasks.append(
                    {
                        "shard": f"{len(tasks):05d}",
                        "source": spec.name,
                        "path": str(path),
                        "part": part,
                        "bytes": part["bytes"] if part else size,
                        "text_field": spec.text_field,
                        "id_field": spec.id_field,
                        "split": spec.split_pattern,
                        "chunk_chars": spec.chunk_chars,
                        "config": to_dict(config),
                        "work": str(work),
                    }
                )
    return tasks


def _run_tasks(fn, tasks: list[dict], config: PipelineConfig, desc: str, size_of, units: int) -> list[dict]:
    """Run `fn` over `tasks`, those of the stage's `units` not done by an earlier run, locally
    (processes) or on Ray.

    Progress counts the bytes each task reads (`size_of(task)`), so the bar has a total and an ETA
    (a count of documents has neither before the end); the documents kept so far ride along. A
    rerun says how much an earlier run did, rather than show a bar of nothing.
    """
    results = []
    if len(tasks) < units:
        _say(config, resumed_line(desc, units - len(tasks), len(tasks)))
    if not tasks:
        return results
    sizes = {task["shard"]: size_of(task) for task in tasks}
    bar = progress_bar(total=sum(sizes.values()), desc=desc, unit="B", unit_scale=True, disable=not config.progress)
    docs, start = 0, time.perf_counter()
    try:
        if not tasks:
            return results
        if config.executor == "ray":
            outcomes = ray_map(fn, tasks, config.ray_address, config.workers or os.cpu_count())
        else:
            outcomes = process_map(fn, tasks, min(config.workers or os.cpu_count() or 1, len(tasks)))
        for result in outcomes:
            results.append(result)
            docs += result["docs"]
            rate = docs / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix(docs_out=f"{docs:,}", docs_per_s=f"{rate:,.0f}", refresh=False)
            bar.update(sizes[result["shard"]])
    finally:
        bar.close()
    return sorted(results, key=lambda r: r["shard"])


def _say(config: PipelineConfig, line: str) -> None:
    if config.progress:
        print(line, file=sys.stderr, flush=True)


def _stage1_docs(work: Path, task: dict) -> Path:
    return work / "stage1" / f"{task['shard']}.docs.jsonl.zst"


def _done(path: Path) -> dict | None:
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            return None
    return None


def job_settings(config: PipelineConfig, tasks: list[dict]) -> dict:
    """What the outputs depend on: every setting but where and how the work runs, and the inputs
    (path, size, mtime). A resume must see the same, or it would mix two curations."""
    from marinlm.config import to_dict

    settings = to_dict(config)
    for how in ("output_dir", "workers", "executor", "ray_address", "progress"):
        settings.pop(how)
    inputs = []
    for path in dict.fromkeys(task["path"] for task in tasks):  # a file read in parts is listed once
        stat = Path(path).stat()
        inputs.append({"path": str(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return {"job": "curate", "config": settings, "inputs": inputs}


def run_pipeline(config: PipelineConfig, restart: bool = False) -> dict:
    """Run (or resume) the pipeline; returns the report (also written as report.json/.md/.png).

    An output folder that holds a curation with other settings or inputs is an error (resuming
    would mix the two); `restart` empties it instead. One job at a time may write the folder.
    """
    notes: list[str] = []
    tasks = _tasks(config, Path(config.output_dir) / ".work", notes)  # inputs checked before anything is written
    with job_output(config.output_dir, job_settings(config, tasks), restart=restart):
        return _run_pipeline(config, tasks, notes)


def _run_pipeline(config: PipelineConfig, tasks: list[dict], notes: list[str]) -> dict:
    from marinlm.data.reduce import reduce
    from marinlm.data.report import write_report

    start = time.perf_counter()
    out = Path(config.output_dir)
    work = out / ".work"
    for sub in ("stage1", "stage2", "stage3"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    index_path = work / "decontam_index.npz"
    if config.decontam.enabled and config.decontam.eval_paths and not index_path.exists():
        _say(config, f"curate: indexing the evaluation sets' {config.decontam.ngram}-grams for decontamination")
        index = NgramIndex.build(config.decontam.eval_paths, config.decontam.ngram, config.decontam.min_words)
        with atomic_path(index_path) as tmp, open(tmp, "wb") as f:
            index.save(f)

    fitted = fit_models(config, tasks, work, lambda line: _say(config, line))
    todo = [t for t in tasks if _done(work / "stage1" / f"{t['shard']}.done.json") is None]
    units_run = len(todo)
    _run_tasks(run_map, todo, config, "curate: filter", lambda t: t["bytes"], len(tasks))
    stage1 = [_done(work / "stage1" / f"{t['shard']}.done.json") for t in tasks]

    summary_path = work / "stage2.done.json"
    summary = _done(summary_path)
    if summary is None:
        # One process over every document's hashes: no bar to show (it is not split into units), so
        # say what runs and how long it took.
        docs, began = sum(s["docs"] for s in stage1), time.perf_counter()
        _say(config, f"curate: dedup and mixture plan over {docs:,} documents")
        summary = reduce(work, stage1, config)
        _say(config, f"curate: dedup and mixture plan done in {time.perf_counter() - began:.1f} s")
        units_run += 1
        write_json_atomic(summary_path, summary)

    todo = [t for t in tasks if _done(work / "stage3" / f"{t['shard']}.done.json") is None]
    units_run += len(todo)
    _run_tasks(run_write, todo, config, "curate: write", lambda t: _stage1_docs(work, t).stat().st_size, len(tasks))
    stage3 = [_done(work / "stage3" / f"{t['shard']}.done.json") for t in tasks]

    manifest = {
        "format": config.output.format,
        "split_by": config.output.split_by,
        "shards": [f for s in stage3 for f in s["files"]],
        "docs": sum(s["docs"] for s in stage3),
    }
    # The fitted models travel with the curation: what scored and clustered its documents.
    for name in ("quality.bin", "topics.npz"):
        if (work / name).is_file():
            with atomic_path(out / name) as tmp:
                shutil.copyfile(work / name, tmp)
    write_json_atomic(out / "manifest.json", manifest)
    report = write_report(out, config, tasks, stage1, summary, stage3, time.perf_counter() - start, notes, fitted)
    report["units_run"] = units_run  # this call's work (0: all done by an earlier run); not in report.json
    return report
