"""Atomic file writes and content hashes. Every long job writes through these, so a crash leaves
either the previous file or the complete new one, never a torn one."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def remove_stale_temporaries(root: str | Path) -> int:
    """Delete `.*.tmp` files a killed job left under `root` (only one job may own `root` at a time)."""
    removed = 0
    for path in Path(root).rglob(".*.tmp"):
        if path.is_file():
            path.unlink(missing_ok=True)
            removed += 1
    return removed


JOB_FILE = ".marinlm-job.json"


class OutputInUseError(ValueError):
    """An output folder holds the results of a job with other settings or inputs."""


def _shown(mapping: dict, key: Any) -> str:
    return repr(mapping[key]) if key in mapping else "absent"


def _first_difference(old: Any, new: Any, key: str = "") -> str | None:
    """The dotted key of the first place `old` and `new` differ, with both values; None if equal."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new), key=str):
            sub = f"{key}.{k}" if key else str(k)
            if k not in old or k not in new:
                return f"{sub}: {_shown(old, k)} -> {_shown(new, k)}"
            if (found := _first_difference(old[k], new[k], sub)) is not None:
                return found
        return None
    if isinstance(old, list) and isinstance(new, list):
        for i, (a, b) in enumerate(zip(old, new)):
            if (found := _first_difference(a, b, f"{key}[{i}]")) is not None:
                return found
        return None if len(old) == len(new) else f"{key}: {len(old)} items -> {len(new)} items"
    return None if old == new else f"{key}: {old!r} -> {new!r}"


def claim_output(folder: str | Path, settings: dict, *, restart: bool = False) -> bool:
    """Make `folder` the output of the job described by `settings` (JSON-able), or resume it there.

    A folder that already holds another job's outputs (other settings or inputs, or files without
    a job record) is an OutputInUseError naming the first difference, because resuming would mix
    the two and overwriting could destroy work; with `restart`, the folder is emptied instead (for
    drivers such as the quickstart that own their folders). Returns True when resuming.
    """
    folder = Path(folder)
    record = folder / JOB_FILE
    settings = json.loads(json.dumps(settings))  # the form it takes on disk (tuples -> lists)
    if record.is_file():
        try:
            old = json.loads(record.read_text())
        except json.JSONDecodeError:
            old = {"unreadable": str(record)}
        difference = _first_difference(old, settings)
        if difference is None:
            return True
        problem = f"holds the outputs of a job with other settings or inputs ({difference})"
    elif folder.is_dir() and any(folder.iterdir()):
        problem = f"is not empty and has no {JOB_FILE} recording what made its files"
    else:
        problem = None
    if problem is not None:
        if not restart:
            raise OutputInUseError(
                f"{folder}: {problem}; resuming there would mix two jobs. Give another output folder, "
                "or remove this one to start over"
            )
        print(f"{folder}: {problem}; starting it over", flush=True)
        shutil.rmtree(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(record, settings)
    return False
