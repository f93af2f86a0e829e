"""Atomic file writes and content hashes. Every long job writes through these, so a crash leaves
either the previous file or the complete new one, never a torn one."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds.

    The file gets the mode a plain `open(path, "w")` would give it (0o666 less the umask), not
    mkstemp's private 0o600: curated data, token shards and checkpoints on shared storage must be
    readable by the team and by workers running as another user.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_umask())
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except OSError as e:  # a write that fails on a full disk names no file, or the temporary: say which
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise named(e, path, temporary=tmp) from None
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def named(error: OSError, path: str | Path, temporary: str | Path | None = None) -> OSError:
    """`error` naming `path`: a failed write or close (a full disk) names no file, or only the
    `temporary` being written in its place. Errors that name another file, or carry no errno, as
    they are."""
    if error.errno is None or (error.filename and str(error.filename) != (str(temporary) if temporary else None)):
        return error
    return OSError(error.errno, error.strerror or str(error), str(path))  # the errno's own subclass


def os_error_in(error: BaseException, path: str | Path) -> BaseException:
    """An error from a library that reports a failed write only in its message ("... os error 28
    ...": safetensors, tokenizers) as the OSError it stands for, naming `path`; others as they are."""
    if isinstance(error, OSError):
        return named(error, path)
    found = re.search(r"os error (\d+)|Os \{ code: (\d+)", str(error))  # io::Error's Display, or its Debug
    if found is None:
        return error
    code = int(found.group(1) or found.group(2))
    return OSError(code, os.strerror(code), str(path))


def make_shareable(path: str | Path) -> None:
    """Give a file that a library created private (0o600) the mode `open(path, "w")` would give it."""
    os.chmod(path, 0o666 & ~_umask())


def reserve_space(path: str | Path) -> None:
    """Allocate the disk blocks of a file made at its full size but sparse (a memory map's): on a
    full disk the first write into an unbacked page kills the process with SIGBUS; this makes it an
    OSError naming the file instead. A filesystem that cannot preallocate is left as it is."""
    if not hasattr(os, "posix_fallocate"):  # macOS
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, os.fstat(fd).st_size)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
            raise named(e, path) from None
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def copy_folder_atomic(source: str | Path, target: str | Path) -> None:
    """Copy a folder under a temporary name beside `target`, then rename it: a killed copy is never
    taken for the folder. The caller holds the parent folder (one writer)."""
    target = Path(target)
    partial = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial)
    os.replace(partial, target)


def refuse_overlap(
    output: str | Path, inputs: dict[str, str | Path], option: str = "the output", inside_ok: bool = False
) -> None:
    """Raise ValueError when folder `output` is, holds or lies inside one of a command's `inputs`
    (what each one is: its path): replacing it (`--overwrite`) would delete the input, and writing
    into it would change it. `inside_ok`: an output inside an input folder is fine (one whose
    reader skips marinlm's outputs). Paths are compared resolved, so a symlink or `..` cannot hide one."""
    out = Path(output).resolve()
    for what, given in inputs.items():
        source = Path(given).resolve()
        if out == source or out in source.parents or (source in out.parents and not inside_ok):
            where = "is" if out == source else ("holds" if out in source.parents else "lies inside")
            raise ValueError(
                f"{option} {output} {where} {what} {given}: writing there would change or delete it; "
                "give an output folder apart from the inputs"
            )


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# A byte-order mark opens files saved by some Windows tools: an encoding marker, not text (a JSON
# parser refuses it, and in a document it would be an invisible first character).
UTF8_BOM = b"\xef\xbb\xbf"


def strip_bom(data: bytes) -> bytes:
    return data[len(UTF8_BOM) :] if data.startswith(UTF8_BOM) else data


def read_utf8(
    path: str | Path, what: str = "invalid UTF-8", error: type[Exception] = ValueError, data: bytes | None = None
) -> str:
    """The file as UTF-8 text, without a leading byte-order mark; a bad byte raises `error` naming
    the file and line. `data`: the file's bytes, when they are not read from `path` as they are (a
    decompressed file)."""
    data = Path(path).read_bytes() if data is None else data
    text = strip_bom(data)
    try:
        return text.decode("utf-8")
    except UnicodeDecodeError as e:
        start = e.start + len(data) - len(text)
        line = data[:start].count(b"\n") + 1
        raise error(f"{path}:{line}: {what} (byte {start} of the file)") from None


def json_error(error: json.JSONDecodeError) -> str:
    """What is wrong with a line of JSON and where in it: json's own messages may end in "at"
    ("Unterminated string starting at"), which the column completes."""
    return f"{error.msg.removesuffix(' at')} at column {error.colno}"


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
LOCK_FILE = ".marinlm.lock"
QUICKSTART_FILE = ".marinlm-quickstart"  # marks a folder the quickstart owns (its stages' outputs)
_HELD: dict[str, list] = {}  # resolved folder -> [open lock file, holders in this process]


def lock_folder(folder: str | Path) -> None:
    """Take this process's exclusive claim on writing `folder` (an advisory flock on a file in it).

    A second job writing the same folder (the same command started twice) would delete the first's
    temporaries and interleave outputs; it gets an OutputInUseError naming the holder instead.
    Re-entrant within a process; `unlock_folder` releases (process exit does too).
    """
    folder = Path(folder).resolve()
    key = str(folder)
    if key in _HELD:
        _HELD[key][1] += 1
        return
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / LOCK_FILE, "a+")  # noqa: SIM115 - held until unlock_folder
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise OutputInUseError(
            f"{folder}: another marinlm job is writing here ({holder}); wait for it to end, or use another folder"
        ) from None
    except OSError as e:  # a filesystem without flock (Lustre mounted without -o flock): go on unguarded
        print(f"warning: {folder}: cannot lock ({e.strerror}); make sure one job at a time writes here", flush=True)
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    _HELD[key] = [handle, 1]


def unlock_folder(folder: str | Path) -> None:
    key = str(Path(folder).resolve())
    if key not in _HELD:
        return
    _HELD[key][1] -= 1
    if _HELD[key][1] == 0:
        _HELD.pop(key)[0].close()  # closing the file releases the flock


@contextlib.contextmanager
def folder_lock(folder: str | Path):
    lock_folder(folder)
    try:
        yield
    finally:
        unlock_folder(folder)


@contextlib.contextmanager
def exclusive(path: str | Path):
    """Hold an exclusive flock on the file `path` (created if missing), waiting while another process
    holds it. On a filesystem without flock it goes on unguarded: callers write through atomic_path,
    so two processes doing the same work leave whole files either way."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


class OutputInUseError(ValueError):
    """An output folder belongs to another job: one with other settings or inputs, or one that is
    writing it now. The message names the folder and the difference or the holder."""


def _shown(mapping: dict, key: Any) -> str:
    return repr(mapping[key]) if key in mapping else "absent"


def differences(old: Any, new: Any, key: str = "") -> Iterator[str]:
    """Each place `old` and `new` differ, as its dotted key with both values, in key order."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new), key=str):
            sub = f"{key}.{k}" if key else str(k)
            if k not in old or k not in new:
                yield f"{sub}: {_shown(old, k)} -> {_shown(new, k)}"
            else:
                yield from differences(old[k], new[k], sub)
    elif isinstance(old, list) and isinstance(new, list):
        for i, (a, b) in enumerate(zip(old, new)):
            # An input file's record is named by its path too: "inputs[1] (/data/b.txt).mtime_ns".
            same_path = isinstance(a, dict) and isinstance(b, dict) and "path" in a and a.get("path") == b.get("path")
            yield from differences(a, b, f"{key}[{i}] ({a['path']})" if same_path else f"{key}[{i}]")
        if len(old) != len(new):
            yield f"{key}: {len(old)} items -> {len(new)} items"
    elif old != new:
        yield f"{key}: {old!r} -> {new!r}"


def first_difference(old: Any, new: Any, key: str = "") -> str | None:
    """The dotted key of the first place `old` and `new` differ, with both values; None if equal."""
    return next(differences(old, new, key), None)


def _holds_no_output(folder: Path) -> bool:
    return not any(p.is_file() and p.name not in (JOB_FILE, LOCK_FILE) for p in folder.rglob("*"))


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
        difference = first_difference(old, settings)
        if difference is None:
            return True
        # A job that stopped before writing anything (a bad eval path, say) leaves nothing to mix.
        empty = _holds_no_output(folder)
        problem = None if empty else f"holds the outputs of a job with other settings or inputs ({difference})"
    elif folder.is_dir() and not _holds_no_output(folder):
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
        for path in folder.iterdir():
            if path.name == LOCK_FILE:  # ours, held
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(record, settings)
    return False


@contextlib.contextmanager
def job_output(folder: str | Path, settings: dict, *, restart: bool = False):
    """The output folder of a resumable job, held for the duration of the block.

    Takes the folder's lock, claims it for `settings` (`claim_output`), and on a resume deletes the
    temporaries a killed run left. Yields True when resuming. A job that fails (a full disk, a bad
    input, Ctrl-C) deletes its own temporaries before it lets go, the stopped workers' too.
    """
    with folder_lock(folder):
        resuming = claim_output(folder, settings, restart=restart)
        if resuming:
            remove_stale_temporaries(folder)
        try:
            yield resuming
        except BaseException:
            remove_stale_temporaries(folder)
            raise
