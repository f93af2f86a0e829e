"""`marinlm tokenize`: curated shards -> token shards, in parallel worker processes, resumably.

Each input file is one unit of work, or each part of a big .jsonl(.gz/.zst) or .parquet file
(`split_bytes`, as curation cuts them). A worker tokenizes it with `encode_batch`, splits documents
into train/val by a seeded hash of the document id, writes both outputs under temporary names,
renames them, and then writes a completion marker. A rerun skips units whose marker matches the
input's size and mtime (and the part); the manifest is rebuilt from the markers at the end.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marinlm.config import check
from marinlm.data.executors import check_executor, ray_map
from marinlm.data.readers import input_parts
from marinlm.data.records import original_id
from marinlm.dataset.shards import SPLITS, token_dtype
from marinlm.utils.io import atomic_path, copy_folder_atomic, job_output, named, sha256_file, write_json_atomic
from marinlm.utils.pool import process_map
from marinlm.utils.progress import progress_bar, resumed_line

REJECTED_IN_MANIFEST = 100  # examples of rejected input records kept in manifest.json


@dataclass(kw_only=True)
class TokenizeConfig:
    inputs: list[str]  # curated shards or text files: files, folders, globs
    tokenizer: str  # folder with tokenizer.json
    output_dir: str
    text_field: str = "text"
    id_field: str = "id"
    val_fraction: float = 0.01
    seed: int = 0
    workers: int = 0  # processes; 0 = one per core (at most one per input file)
    batch_docs: int = 512
    # A .jsonl(.gz/.zst) or .parquet input bigger than this is tokenized in parts of about this
    # size, each a unit of progress and of resumption (a part's shards are named INPUT.PART).
    # 0 = a unit per file. Curated shards are smaller than the default.
    split_bytes: int = 64_000_000
    # local (worker processes) or ray: one Ray task per input file, for tokenizing on a cluster
    # (inputs, tokenizer and output_dir must then be on storage every node sees)
    executor: str = "local"
    ray_address: str = ""  # "" = start Ray on this machine; "auto" or host:port to join a cluster

    def __post_init__(self):
        check(0.0 <= self.val_fraction < 1.0, "val_fraction", f"must be in [0, 1), got {self.val_fraction}")
        check(bool(self.output_dir.strip()), "output_dir", "must name a folder")
        check(self.workers >= 0, "workers", f"must be >= 0, got {self.workers}")
        check(self.batch_docs > 0, "batch_docs", f"must be positive, got {self.batch_docs}")
        check(self.split_bytes >= 0, "split_bytes", f"must be >= 0 (0 = a unit per file), got {self.split_bytes}")
        check_executor(self.executor, self.ray_address)


def split_key(doc_id: str, seed: int) -> float:
    """hash(seed, id) as a uniform number in [0, 1): a document is held out when it is below the
    fraction. A mixture's repeated copies hash as their original, so they are held out together."""
    digest = hashlib.blake2b(f"{seed}\x00{original_id(doc_id)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def is_validation(doc_id: str, seed: int, fraction: float) -> bool:
    """Deterministic per-document split."""
    return fraction > 0 and split_key(doc_id, seed) < fraction


def fraction_holding_out_one(doc_ids: Iterable[str], seed: int, fraction: float) -> float:
    """`fraction`, or, where it holds out none of `doc_ids`, the smallest fraction that holds out
    one: the document with the lowest key (with a mixture's copies of it), and no other. A small
    corpus (a few dozen documents at 2%) then still has a validation document, chosen by the same
    hash, so the split stays deterministic. With fewer than two documents there is nothing to spare
    for it: `fraction`."""
    keys = sorted(split_key(doc_id, seed) for doc_id in {original_id(doc_id) for doc_id in doc_ids})
    if len(keys) < 2 or keys[0] < fraction:
        return fraction
    # A short decimal above the lowest key and not above the next (a document is held out when
    # its key is below the fraction), so that the value printed is the value used.
    low, high = keys[0], keys[1]
    for digits in range(2, 18):
        rounded = (math.floor(low * 10**digits) + 1) / 10**digits
        if low < rounded <= high:
            return rounded
    return math.nextafter(low, 1.0)


def split_note(config, manifest: dict) -> str | None:
    """What to tell the user of a finished `tokenize` (`config` a TokenizeConfig) whose split left
    a side empty, or None: no validation document (and the fraction that holds out one), or no
    training document (a one-document corpus whose hash fell below the fraction)."""
    train, val, fraction = manifest["train_docs"], manifest["val_docs"], config.val_fraction
    if val == 0 and fraction > 0 and train >= 2:
        one = fraction_holding_out_one(
            document_ids(config.inputs, config.text_field, config.id_field), config.seed, fraction
        )
        return (
            f"note: val_fraction {fraction:g} holds out none of the {train} documents, so training on these tokens "
            f"runs without validation; --val_fraction={one!r} holds out one (into another output_dir)"
        )
    if train == 0 and val > 0:
        return (
            f"note: val_fraction {fraction:g} held out every document (a document is held out when the hash of its "
            "id falls below it), so there is nothing to train on; tokenize into another output_dir with "
            "--val_fraction=0, or cut the text into more documents"
        )
    if val == 0 and fraction > 0 and train == 1:
        return (
            "note: one document cannot be split into train and val, so training on these tokens runs without "
            "validation; cut the text into documents first: `marinlm data run` with the source's chunk_chars "
            "(the quickstart cuts a .txt corpus so), or split the file"
        )
    return None


def document_ids(inputs: list[str], text_field: str = "text", id_field: str = "id") -> Iterator[str]:
    """The ids of the documents that `tokenize` reads from `inputs`, in order: the split hashes them."""
    from marinlm.data.inputs import expand_inputs
    from marinlm.data.readers import Document, read_documents

    for path in expand_inputs(inputs, quiet=True):
        yield from (doc.id for doc in read_documents(path, text_field, id_field) if isinstance(doc, Document))


def _input_stamp(path: Path) -> dict:
    stat = path.stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


class _SplitWriter:
    """Streams one split's tokens to a temporary file beside `final`; `close(True)` renames it."""

    def __init__(self, final: Path, dtype):
        self.final, self.dtype = final, dtype
        self.tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed in close(), which also renames
        self.ends: list[int] = []
        self.bytes: list[int] = []
        self.count = 0

    def add(self, ids: np.ndarray, num_bytes: int) -> None:
        try:
            self.file.write(ids.astype(self.dtype, copy=False).tobytes())
        except OSError as e:  # a full disk: a write's error names no file
            raise named(e, self.final) from None
        self.count += len(ids)
        self.ends.append(self.count)
        self.bytes.append(num_bytes)

    def close(self, ok: bool) -> np.ndarray:
        """Rename the finished file into place (`ok`), or remove it. Nothing is left behind either
        way: closing can fail too (the buffered tail on a full disk)."""
        try:
            self.file.close()
            if ok:
                os.replace(self.tmp, self.final)
        except OSError as e:
            if ok:  # when the job is failing already, its own error is the one to report
                raise named(e, self.final) from None
        finally:
            self.tmp.unlink(missing_ok=True)
        return np.asarray(list(zip(self.ends, self.bytes)), dtype=np.int64).reshape(-1, 2)


def tokenize_file(task: dict) -> dict:
    """Worker: tokenize one input file into train/val shards; return its completion record."""
    from marinlm.data.readers import Document, document_location, read_documents
    from marinlm.tokenizer import MarinTokenizer

    tok = MarinTokenizer.load(task["tokenizer"])
    dtype = token_dtype(tok.vocab_size)
    out, name = Path(task["output_dir"]), task["name"]
    writers = {s: _SplitWriter(out / s / f"{name}.tokens", dtype) for s in SPLITS}
    rejected: list[dict] = []
    docs = 0
    ok = False
    try:
        batch: list[Document] = []

        def flush():
            encodings = tok.backend.encode_batch_fast([d.text for d in batch], add_special_tokens=False)
            for doc, ids in zip(batch, encodings):
                split = "val" if is_validation(doc.id, task["seed"], task["val_fraction"]) else "train"
                writers[split].add(np.asarray(ids.ids, dtype=dtype), len(doc.text.encode("utf-8")))
            batch.clear()

        for item in read_documents(Path(task["path"]), task["text_field"], task["id_field"], part=task["part"]):
            if isinstance(item, Document) and not item.text:  # no token to train on: listed, as curation lists it
                rejected.append({"location": document_location(item), "reason": "empty document", "id": item.id})
            elif isinstance(item, Document):
                docs += 1
                batch.append(item)
                if len(batch) >= task["batch_docs"]:
                    flush()
            else:
                rejected.append({"location": item.location, "reason": item.reason})
        flush()
        ok = True
    finally:
        indexes = {}
        try:
            for split, writer in writers.items():
                indexes[split] = writer.close(ok)
        finally:  # a failed close still removes the other splits' files
            for writer in writers.values():
                if not writer.file.closed:
                    writer.close(False)
    record = {"name": name, "input": task["stamp"], "documents": docs, "rejected": rejected, "splits": {}}
    for split, index in indexes.items():
        docs_path = out / split / f"{name}.docs.npy"
        with atomic_path(docs_path) as tmp, open(tmp, "wb") as f:
            np.save(f, index)
        tokens_path = out / split / f"{name}.tokens"
        record["splits"][split] = {
            "tokens": f"{split}/{name}.tokens",
            "docs": f"{split}/{name}.docs.npy",
            "num_docs": int(len(index)),
            "num_tokens": int(index[-1, 0]) if len(index) else 0,
            "num_bytes": int(index[:, 1].sum()) if len(index) else 0,
            "tokens_bytes": tokens_path.stat().st_size,
            "docs_bytes": docs_path.stat().st_size,
            "tokens_sha256": sha256_file(tokens_path),
            "docs_sha256": sha256_file(docs_path),
        }
    # A part's record carries its file's hash, taken once by the parent rather than by every part.
    record["input"]["sha256"] = task.get("sha256") or sha256_file(task["path"])
    write_json_atomic(out / ".done" / f"{name}.json", record)
    return record


def _unit_bytes(stamp: dict) -> int:
    """The bytes on disk a unit reads (from its input stamp): its part's, or its whole file's."""
    return stamp["part"]["bytes"] if stamp.get("part") else stamp["size"]


def _worker_init(threads: int) -> None:
    os.environ["RAYON_NUM_THREADS"] = str(threads)  # tokenizers' Rust pool, read at first use


def _marker_valid(marker: Path, stamp: dict, out: Path) -> bool:
    if not marker.is_file():
        return False
    try:
        record = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    same_input = {k: record["input"].get(k) for k in stamp} == stamp
    files_there = all(
        (out / s[key]).is_file() and (out / s[key]).stat().st_size == s[f"{key}_bytes"]
        for s in record["splits"].values()
        for key in ("tokens", "docs")
    )
    return same_input and files_there


def _read_manifest(out: Path) -> dict | None:
    try:
        return json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def tokenize(config: TokenizeConfig, progress: bool = True, restart: bool = False) -> dict:
    """Run the job; returns the manifest (also written to OUTPUT_DIR/manifest.json).

    A rerun resumes input by input. An output folder made with another tokenizer, split or fields
    is an error (its shards would be mixed with, or mislabelled as, the new ones); `restart`
    empties it instead. One job at a time may write the folder.
    """
    from marinlm.data.inputs import expand_inputs
    from marinlm.tokenizer import MarinTokenizer

    try:  # inputs checked before anything is written
        tok = MarinTokenizer.load(config.tokenizer)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"tokenizer: {e}") from None
    paths = expand_inputs(config.inputs)
    settings = {
        "job": "tokenize",
        "tokenizer": {"hash": tok.hash, "vocab_size": tok.vocab_size, "special_token_strings": "text"},
        "text_field": config.text_field,
        "id_field": config.id_field,
        "seed": config.seed,
        "val_fraction": config.val_fraction,
    }
    with job_output(config.output_dir, settings, restart=restart):
        return _tokenize(config, progress, tok, paths)


def _tokenize(config: TokenizeConfig, progress: bool, tok, paths: list[Path]) -> dict:
    out = Path(config.output_dir)
    for split in SPLITS:
        (out / split).mkdir(parents=True, exist_ok=True)
    tasks, records = [], {}
    for i, path in enumerate(paths):
        parts = input_parts(path, config.split_bytes)
        todo = []
        for k, part in enumerate(parts):
            name = f"{i:05d}" if part is None else f"{i:05d}.{k:04d}"  # sorted: the file's order
            stamp = _input_stamp(path) if part is None else {**_input_stamp(path), "part": part}
            if _marker_valid(out / ".done" / f"{name}.json", stamp, out):
                records[name] = json.loads((out / ".done" / f"{name}.json").read_text())
                continue
            todo.append(
                {
                    "path": str(path),
                    "part": part,
                    "name": name,
                    "stamp": stamp,
                    "tokenizer": config.tokenizer,
                    "output_dir": str(out),
                    "text_field": config.text_field,
                    "id_field": config.id_field,
                    "seed": config.seed,
                    "val_fraction": config.val_fraction,
                    "batch_docs": config.batch_docs,
                }
            )
        if todo and parts != [None]:
            digest = sha256_file(path)
            for task in todo:
                task["sha256"] = digest
        tasks += todo
    cores = os.cpu_count() or 1
    workers = min(config.workers or cores, max(1, len(tasks)))
    start = time.perf_counter()
    if records and progress:  # a rerun says how much an earlier run did, rather than show a bar of nothing
        print(resumed_line("tokenize", len(records), len(tasks)), file=sys.stderr, flush=True)
    total_bytes = sum(_unit_bytes(t["stamp"]) for t in tasks)
    bar = progress_bar(total=total_bytes, unit="B", unit_scale=True, desc="tokenize", disable=not (progress and tasks))
    new_tokens = 0
    try:
        if config.executor == "ray":  # a task per CPU, so tokenizers' own thread pool gets one thread
            records_done = ray_map(tokenize_file, tasks, config.ray_address, workers, env={"RAYON_NUM_THREADS": "1"})
        else:
            # In one process (workers <= 1) tokenizers' own threads use every core.
            init = (_worker_init, (max(1, cores // workers),)) if workers > 1 else (None, ())
            records_done = process_map(tokenize_file, tasks, workers, *init)
        for record in records_done:
            records[record["name"]] = record
            new_tokens += sum(s["num_tokens"] for s in record["splits"].values())
            bar.set_postfix(tok_per_s=f"{new_tokens / max(time.perf_counter() - start, 1e-9):,.0f}", refresh=False)
            bar.update(_unit_bytes(record["input"]))
    finally:
        bar.close()
    rejected = [r for k in sorted(records) for r in records[k]["rejected"]]
    if not (out / "tokenizer").is_dir():  # the tokens carry their tokenizer wherever they are moved or read from
        if Path(config.tokenizer).is_dir():
            copy_folder_atomic(config.tokenizer, out / "tokenizer")
        else:  # a tokenizer.json given as a file
            tok.save(out / ".tokenizer.tmp")
            os.replace(out / ".tokenizer.tmp", out / "tokenizer")
    with atomic_path(out / "rejected.jsonl") as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rejected)
    manifest = {
        "format": "marinlm-tokens/1",
        "tokenizer": {
            "path": str(config.tokenizer),
            "hash": tok.hash,
            "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
        },
        "dtype": token_dtype(tok.vocab_size).name,
        "seed": config.seed,
        "val_fraction": config.val_fraction,
        "sources": [records[k]["input"] for k in sorted(records)],
        # Every reader of the dataset (each training rank) loads the manifest: it keeps a count and
        # the first examples; rejected.jsonl lists them all.
        "rejected_count": len(rejected),
        "rejected": rejected[:REJECTED_IN_MANIFEST],
        "splits": {s: [records[k]["splits"][s] for k in sorted(records)] for s in SPLITS},
    }
    for s in SPLITS:
        manifest[f"{s}_tokens"] = sum(e["num_tokens"] for e in manifest["splits"][s])
        manifest[f"{s}_docs"] = sum(e["num_docs"] for e in manifest["splits"][s])
    manifest["seconds"] = round(time.perf_counter() - start, 2)
    if not tasks and (earlier := _read_manifest(out)) and {**earlier, "seconds": 0} == {**manifest, "seconds": 0}:
        # A rerun with nothing left to do leaves the file as it was: its time, and the sha256 by which
        # a training run records (and the quickstart recognises) the data it was trained on.
        manifest = earlier
    else:
        write_json_atomic(out / "manifest.json", manifest)
    if manifest["train_docs"] + manifest["val_docs"] == 0:
        first = f" (first: {rejected[0]['location']}: {rejected[0]['reason']})" if rejected else ""
        raise ValueError(
            f"{out}: no document was tokenized from {config.inputs}; {len(rejected)} record(s) rejected{first}; "
            "all are listed in its rejected.jsonl"
        )
    return {**manifest, "inputs_tokenized": len(tasks)}  # this call's work; not in manifest.json
