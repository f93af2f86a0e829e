"""What a config's `inputs` name: files, folders (walked recursively) and globs, expanded to the
files to read, with a clear error for a miss and a note for what is left out.

A folder's hidden files are no inputs, and its files of a type `readers` does not read are skipped
with a note that counts them. A folder that holds outputs rather than text is left out too, with a
note naming it: a finished curation stands for its shards, while token shards, a run, a tokenizer
or an unfinished curation are skipped (given by name, they are refused). File names must be UTF-8,
as document ids and reports name them.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import sys
from pathlib import Path

from marinlm.data.readers import SUFFIXES
from marinlm.utils.io import JOB_FILE, LOCK_FILE, QUICKSTART_FILE, OutputInUseError


def curated_shards(folder: Path) -> list[Path] | None:
    """The output shards of a finished `marinlm data run` folder, from its manifest; None if
    `folder` is not one."""
    manifest = folder / "manifest.json"
    if not (manifest.is_file() and (folder / "shards").is_dir()):
        return None
    try:
        listed = json.loads(manifest.read_text()).get("shards")
    except (json.JSONDecodeError, AttributeError):
        return None
    if not isinstance(listed, list) or not all(isinstance(s, dict) and "path" in s for s in listed):
        return None
    shards = [folder / s["path"] for s in listed]  # paths relative to the folder (absolute ones stay)
    for shard in shards:
        if not shard.is_file():
            raise FileNotFoundError(f"{shard}: listed in {manifest} but missing")
    return shards


def _kind(path: Path) -> str:
    """What a file is by its name, for a note: `.csv`, `.txt.bz2`, or `(no suffix)`."""
    if path.suffix in (".gz", ".zst", ".bz2", ".xz", ".zip") and len(path.suffixes) > 1:
        return "".join(path.suffixes[-2:])
    return path.suffix or "(no suffix)"


def output_kind(folder: Path) -> str | None:
    """Which marinlm output `folder` holds: `quickstart` (the folder of its stages), `tokenizer`,
    `run`, `curate` or `tokenize` (by the job record; a curation may have finished), `job` (another
    job's, or only its lock); None if none."""
    record = folder / JOB_FILE
    if (folder / QUICKSTART_FILE).is_file():
        return "quickstart"
    if not record.is_file():
        if (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file():
            return "tokenizer"
        if not (folder / LOCK_FILE).is_file():
            return None
        return "run" if (folder / "run_info.json").is_file() or (folder / "checkpoints").is_dir() else "job"
    try:
        job = json.loads(record.read_text()).get("job")
    except (OSError, ValueError, AttributeError):
        job = None
    return job if job in ("curate", "tokenize") else "job"


_KINDS = {
    "tokenizer": "a tokenizer",
    "run": "a training run",
    "curate": "a data curation's output",
    "tokenize": "token shards",
    "quickstart": "a quickstart's stages (each in its own folder inside it)",
}


def refuse_other_output(folder: Path, kind: str) -> None:
    """Before a job writes its `kind` of output (see `output_kind`) into `folder`: an OutputInUseError
    if the folder holds another kind (a tokenizer trained into a curation, a run into token shards),
    whose files the job's own would mix with. A bare lock (`job`: a job that stopped before it wrote
    anything, or one just starting there) is no other kind."""
    found = output_kind(folder) if folder.is_dir() else None
    if found not in (None, "job", kind):
        raise OutputInUseError(
            f"{folder}: holds {_KINDS[found]}; writing {_KINDS[kind]} there would mix the two. Give another folder"
        )


def _marinlm_output(folder: Path) -> str | None:
    """Why `folder`, which holds outputs other than a finished curation (a marinlm job's, or a
    tokenizer), is no text input (how the message goes on after its name); None if it holds none."""
    marker = JOB_FILE if (folder / JOB_FILE).is_file() else LOCK_FILE
    return {
        None: None,
        "tokenizer": "holds a tokenizer (tokenizer.json), not text",
        "run": "is a training run's folder (checkpoints, metrics, reports), not text",
        "curate": (
            "is a curation that has not finished (it has no manifest.json yet), so its report, dropped/ and "
            "rejected/ files would be read as documents beside its shards: rerun its `marinlm data run` to "
            "finish it, then give the folder again"
        ),
        "tokenize": "holds token shards written by `marinlm tokenize`, not text: give the text it was made from",
        "job": f"holds the outputs of a marinlm job (it has {marker}), not text",
        "quickstart": (
            f"is a quickstart's folder, which holds each of its stages, not text: give one, e.g. {folder / 'curated'} "
            f"(its curated text) or {folder / 'raw'} (its corpus)"
        ),
    }[output_kind(folder)]


def input_note(message: str, quiet: bool = False, notes: list[str] | None = None) -> None:
    """Say `message` on stderr as a note (unless `quiet`), and keep it in `notes` (for a report)."""
    if not quiet:
        print(f"note: {message}", file=sys.stderr, flush=True)
    if notes is not None:
        notes.append(message)


def _outside_marinlm_outputs(
    tops: list[Path], files: list[Path], key: str, spec: str, quiet: bool, notes: list[str] | None
) -> list[Path]:
    """`files` (sorted) less those in a folder that holds outputs rather than text, at or below one
    of the folders `tops`: a finished curation stands for its shards, as when it is given itself; a
    token folder, a run folder, a tokenizer or an unfinished curation is skipped, with a note naming
    it (its manifests, metrics and reports would otherwise be read as documents)."""
    folders: set[Path] = set()  # every folder at or below a top that holds one of the files
    for d in {f.parent for f in files}:
        while d not in folders and any(d.is_relative_to(t) for t in tops):
            folders.add(d)
            d = d.parent
    curated: dict[Path, set[Path]] = {}
    skipped: dict[Path, str] = {}
    for folder in sorted(folders):  # a folder before those inside it
        if any(folder.is_relative_to(d) for d in (*curated, *skipped)):
            continue  # inside one already found
        if (shards := curated_shards(folder)) is not None:
            curated[folder] = set(shards)
        elif why := _marinlm_output(folder):
            skipped[folder] = why
    if not curated and not skipped:
        return files
    if skipped:
        named = "; ".join(f"{d} {why.split(':')[0]}" for d, why in list(skipped.items())[:3])
        more = f"; and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        input_note(
            f"{key}: skipping {len(skipped)} folder(s) under {spec} of outputs, not text: {named}{more}", quiet, notes
        )
    kept = []
    for f in files:
        owner = next((d for d in (*curated, *skipped) if d in f.parents), None)
        if owner is None or f in curated.get(owner, ()):
            kept.append(f)
    return kept


def _files_under(
    folders: list[Path],
    given: list[Path],
    key: str,
    spec: str,
    quiet: bool,
    notes: list[str] | None,
    also_under: Path | None = None,
) -> list[Path]:
    """The files to read under `folders` (a folder input, or the folders a glob matched), with the
    files `given` by name (a glob's matches in `also_under`), in sorted order. Hidden files and
    folders are no inputs; folders of outputs are left out (`_outside_marinlm_outputs`); files of
    types not read are skipped with a note that counts them by type."""
    walked, nowhere = set(), []
    for d in folders:
        for f in d.rglob("*"):
            if _hidden_under(f, d):
                continue
            if f.is_file():
                walked.add(f)
            elif f.is_symlink() and not f.exists():  # dangling, or a loop
                nowhere.append(f)
    if nowhere:
        input_note(
            f"{key}: skipping {len(nowhere)} symbolic link(s) under {spec} that lead to no file (dangling or "
            f"looping; e.g. {sorted(nowhere)[0]})",
            quiet,
            notes,
        )
    tops = [*folders, also_under] if also_under is not None else folders
    files = _outside_marinlm_outputs(tops, sorted(walked | set(given)), key, spec, quiet, notes)
    named = set(given)
    skipped = [f for f in files if f in walked and f not in named and not f.name.endswith(SUFFIXES)]
    if skipped:
        kinds: dict[str, int] = {}
        for f in skipped:
            kinds[_kind(f)] = kinds.get(_kind(f), 0) + 1
        counts = ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
        message = (
            f"{key}: skipping {len(skipped)} file(s) under {spec} of types not read ({counts}; "
            f"e.g. {skipped[0]}); the types read are {', '.join(SUFFIXES)}"
        )
        input_note(message, quiet, notes)
    not_read = set(skipped)
    return [f for f in files if f not in not_read]


def _hidden_under(path: Path, folder: Path) -> bool:
    return any(n.startswith(".") for n in path.relative_to(folder).parts)


def glob_base(spec: str) -> Path:
    """The folder a glob searches: its path up to the first part with a wildcard (a plain path: itself)."""
    return Path(*itertools.takewhile(lambda part: not any(ch in part for ch in "*?["), Path(spec).parts))


def expand_inputs(
    inputs: list[str] | str, key: str = "inputs", quiet: bool = False, notes: list[str] | None = None
) -> list[Path]:
    """Expand files, directories (recursively, known suffixes) and globs (a folder a glob matches is
    read as a folder); fail fast on a miss, with an error that names the config `key` the inputs
    came from.

    A directory's hidden files and folders (`.git/`, `.DS_Store`) are not inputs. Its other files of
    a type this does not read are skipped with a note on stderr (unless `quiet`) that counts them by
    type, so that a folder of `.csv` or `.txt.bz2` files beside the `.txt` ones is not half read unseen.
    """
    if isinstance(inputs, str):
        inputs = [inputs]
    paths: list[Path] = []
    for spec in inputs:
        p = Path(spec)
        if any(ch in spec for ch in "*?["):
            matches = sorted(Path(m) for m in glob.glob(spec, recursive=True))
            if not matches:
                raise FileNotFoundError(f"{key}: input glob matched nothing: {spec}")
            folders, given = [m for m in matches if m.is_dir()], [m for m in matches if m.is_file()]
            # The folder the glob searches (before its first wildcard) is walked as a folder given is.
            base = glob_base(spec)
            found = _files_under(folders, given, key, spec, quiet, notes, also_under=base)
            if not found:
                raise FileNotFoundError(f"{key}: input glob matched no file to read: {spec}")
            paths.extend(found)
        elif p.is_dir() and (shards := curated_shards(p)) is not None:
            paths.extend(shards)  # a curation output: its shards, never its rejected/ and dropped/ files
        elif p.is_dir() and (why := _marinlm_output(p)):
            raise ValueError(f"{key}: {spec} {why}")
        elif p.is_dir():
            found = _files_under([p], [], key, spec, quiet, notes)
            if not found:
                raise FileNotFoundError(f"{key}: input directory has no {', '.join(SUFFIXES)} files: {spec}")
            paths.extend(found)
        elif p.is_file():
            paths.append(p)
        else:
            raise FileNotFoundError(f"{key}: input path does not exist: {spec}")
    for p in paths:
        if not p.name.endswith(SUFFIXES):
            raise ValueError(f"{key}: {p}: unsupported input type; supported suffixes: {', '.join(SUFFIXES)}")
    undecodable = [p for p in paths if not _utf8_path(p)]
    if undecodable:  # ids, rejected/ and reports name files in UTF-8 JSON: it failed part way, unnamed
        named = ", ".join(repr(os.fsencode(p)) for p in undecodable[:3])
        more = f" and {len(undecodable) - 3} more" if len(undecodable) > 3 else ""
        raise ValueError(
            f"{key}: {len(undecodable)} file name(s) not valid UTF-8: {named}{more}; rename them "
            "(document ids and reports name their files in UTF-8)"
        )
    return paths


def _utf8_path(path: Path) -> bool:
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:  # a name of bytes the file system's encoding could not decode
        return False
    return True
