"""Document readers for .txt(.gz/.zst), .jsonl, .jsonl.gz, .jsonl.zst and .parquet, plus HF `datasets`.

Bad input never raises out of a reader: a malformed JSON line, invalid UTF-8, a missing or
non-string text field, or a truncated compressed stream becomes a `Rejected` record naming the
file and line, and reading goes on (or stops cleanly at a truncation); in a .txt file cut into
documents, only the documents holding bad bytes are rejected. A leading UTF-8 byte-order mark is
skipped. A missing input path is different: `inputs.expand_inputs` fails fast on it.

A big .jsonl(.gz/.zst) or .parquet file can be read in parts (`input_parts`): byte ranges that
start at a line, runs of lines of a compressed stream, or runs of row groups. Each part names its
lines and rows as the whole file does, so ids and error locations do not depend on how a file was
cut.
"""

from __future__ import annotations

import gzip
import itertools
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from marinlm.utils.io import json_error, strip_bom

# Plain-text files are one document each (prose, markup, source code).
TEXT_SUFFIXES = (
    ".txt",
    ".md",
    ".rst",
    ".py",
    ".js",
    ".ts",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".java",
    ".go",
    ".rs",
    ".rb",
    ".sh",
    ".php",
)
# Compressed plain text: decompressed whole, then read as the .txt file it holds.
COMPRESSED_TEXT_SUFFIXES = (".txt.gz", ".txt.zst")
SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet", ".json", *TEXT_SUFFIXES, *COMPRESSED_TEXT_SUFFIXES)


@dataclass
class Document:
    id: str
    text: str
    source: str
    metadata: dict[str, Any] = field(default_factory=dict)


def document_location(doc: Document) -> str:
    """Where a document was read, as a rejected record's location says it: "path:line" (JSON
    lines), "path:index" (a JSON array), "path:row" (Parquet), or the path of a whole text file."""
    meta = doc.metadata
    for key in ("line", "index", "row"):
        if key in meta:
            return f"{meta.get('file')}:{meta[key]}"
    return str(meta.get("file", doc.id))


@dataclass
class Rejected:
    """Input that could not become a document, with where it came from and why."""

    source: str
    location: str  # "path:line" or "path"
    reason: str
    raw: str = ""  # the offending content, clipped


class TruncatedStream(OSError):
    """A compressed input ended in the middle of a frame."""


# A compressed stream cannot be entered in the middle: each part decompresses (and skips) every line
# before its own, so a compressed file gets at most this many parts, which bounds that waste to
# about half the file's decompression per part (cheap beside the filters' cost per byte).
MAX_COMPRESSED_PARTS = 16


def input_parts(path: Path, split_bytes: int) -> list[dict | None]:
    """The parts to read `path` in, about `split_bytes` each: `[None]` (the whole file) unless it is
    a .jsonl(.gz/.zst) or a .parquet file bigger than that. A .jsonl part is `{"start", "end",
    "line"}`: a byte range starting at a line, and that line's number; a compressed one is
    `{"lines": [first, end]}`; a .parquet part is `{"groups": [first, end], "row"}`: row groups,
    and the rows before them. Each has its `bytes` on disk, for progress."""
    size = path.stat().st_size
    if split_bytes <= 0:
        return [None]
    if path.name.endswith((".jsonl.gz", ".jsonl.zst")):
        return _compressed_parts(path, size, split_bytes)
    if size <= split_bytes:
        return [None]
    count = -(-size // split_bytes)
    if path.name.endswith(".jsonl"):
        return _jsonl_parts(path, size, count)
    if path.name.endswith(".parquet"):
        return _parquet_parts(path, size, count)
    return [None]


def whole_file_reason(path: Path) -> str:
    """Why `input_parts` reads `path` whole however big it is, and what would let it be cut."""
    if path.name.endswith((".jsonl.gz", ".jsonl.zst")):
        return "its compressed stream could not be read to the end (`rejected/` says where it breaks); repair it"
    if path.name.endswith(".parquet"):
        return "it has a single row group; write it with smaller row groups (pyarrow's row_group_size)"
    return "only .jsonl and .parquet files are read in parts; split it into several files, or convert it to .jsonl"


def _jsonl_parts(path: Path, size: int, count: int) -> list[dict]:
    starts = [0]
    with open(path, "rb") as f:
        for k in range(1, count):
            f.seek(size * k // count - 1)
            f.readline()  # to the end of the line that holds the byte before the cut
            if f.tell() > starts[-1] and f.tell() < size:
                starts.append(f.tell())
        # One pass counts the lines before each start (a line too long for one part spans several cuts).
        lines, newlines, pos = [], 0, 0
        f.seek(0)
        for start in starts:
            while pos < start:
                chunk = f.read(min(1 << 24, start - pos))
                newlines += chunk.count(b"\n")
                pos += len(chunk)
            lines.append(newlines + 1)
    ends = [*starts[1:], size]
    return [{"start": s, "end": e, "line": n, "bytes": e - s} for s, e, n in zip(starts, ends, lines, strict=True)]


def _parquet_parts(path: Path, size: int, count: int) -> list[dict] | list[None]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception:
        return [None]  # unreadable: the reader rejects it, whole
    groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
    if len(groups) < 2:
        return [None]
    total = sum(g.total_byte_size for g in groups) or 1
    parts, row, before = [], 0, 0
    for g, group in enumerate(groups):
        if not parts or before * count // total >= len(parts):  # this group begins the next part
            parts.append({"groups": [g, g + 1], "row": row, "bytes": 0})
        parts[-1]["groups"][1] = g + 1
        parts[-1]["bytes"] += group.total_byte_size
        row += group.num_rows
        before += group.total_byte_size
    for part in parts:  # progress counts the file's bytes on disk
        part["bytes"] = size * part["bytes"] // total
    return parts


def _compressed_parts(path: Path, size: int, split_bytes: int) -> list[dict] | list[None]:
    """Parts of equal line counts, from one pass that counts the lines and their bytes."""
    if size * 20 <= split_bytes:  # text rarely compresses 20-fold: too small to count
        return [None]
    lines = raw = 0
    try:
        for line in _open_lines(path):
            lines += 1
            raw += len(line)
    except Exception:  # truncated or corrupt: read whole, the reader rejects it where it breaks
        return [None]
    count = min(-(-raw // split_bytes), MAX_COMPRESSED_PARTS, lines)
    if count <= 1:
        return [None]
    firsts = [1 + lines * k // count for k in range(count)]
    ends = [*firsts[1:], lines + 1]
    return [{"lines": [a, b], "bytes": size * (b - a) // lines} for a, b in zip(firsts, ends, strict=True)]


def _jsonl_range_lines(path: Path, start: int, end: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(start)
        while start < end:
            line = f.readline()
            if not line:
                return
            start += len(line)
            yield line


def _zstd_lines(path: Path, chunk: int = 1 << 20) -> Iterator[bytes]:
    """Lines of a (multi-frame) .zst file. Raises TruncatedStream when the file ends inside a frame,
    which zstandard's stream reader would pass over in silence."""
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    dobj, in_frame = decompressor.decompressobj(), False
    pending = b""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            while block:
                pending += dobj.decompress(block)
                in_frame = True
                if dobj.eof:  # frame complete; whatever follows starts the next one
                    block = dobj.unused_data
                    dobj, in_frame = decompressor.decompressobj(), False
                else:
                    block = b""
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line + b"\n"
    if pending:
        yield pending
    if in_frame:
        raise TruncatedStream("zstd stream ended inside a frame")


def _stream_error(e: Exception) -> bool:
    """Whether `e` is a truncated or corrupt compressed stream's: gzip's, zlib's, our zstd reader's,
    or zstandard's own ZstdError (matched by module: zstandard is imported only where it is used)."""
    return isinstance(e, (EOFError, OSError, zlib.error)) or type(e).__module__.startswith("zstandard")


def decompressed(path: Path) -> bytes:
    """A .gz or .zst file's content; a truncated or corrupt stream raises ValueError naming the file."""
    try:
        return b"".join(_open_lines(path))
    except Exception as e:
        if not _stream_error(e):
            raise
        raise ValueError(f"{path}: truncated or corrupt stream: {e}") from None


def _open_lines(path: Path) -> Iterator[bytes]:
    if path.name.endswith(".zst"):
        yield from _zstd_lines(path)
        return
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        yield from f


# What `surrogateescape` makes of bytes that are not UTF-8.
_UNDECODABLE = re.compile("[\udc80-\udcff]")


def _clip(raw: bytes | str, n: int = 200) -> str:
    if isinstance(raw, bytes):
        raw = raw.decode("utf-8", errors="replace")
    return raw[:n]


def read_documents(
    path: str | Path,
    text_field: str = "text",
    id_field: str | None = "id",
    source: str | None = None,
    split_pattern: str = "",
    chunk_chars: int = 0,
    part: dict | None = None,
) -> Iterator[Document | Rejected]:
    """Yield the documents of one file in order; problems come out as `Rejected` records.

    A .txt file (or a .txt.gz/.txt.zst) is one document (its path is the id), or several when
    `split_pattern` (a regex) is given; with `chunk_chars`, a longer one is cut into pieces of at
    most that many characters at paragraph breaks (`chunk_text`); Windows line ends read as "\n".
    JSON records need `text_field` to be a string or a list of strings (joined by newlines), or are
    themselves a string (a .json list of texts); `id_field` falls back to "path:line" when absent.
    `part` (from `input_parts`) reads one part of a big .jsonl or .parquet file.
    """
    path = Path(path)
    source = source or path.stem.split(".")[0]
    name = path.name
    if name.endswith(".parquet"):
        yield from _read_parquet(path, text_field, id_field, source, part)
        return
    if name.endswith(TEXT_SUFFIXES + COMPRESSED_TEXT_SUFFIXES):
        try:
            data = path.read_bytes() if name.endswith(TEXT_SUFFIXES) else decompressed(path)
        except ValueError as e:
            yield Rejected(source, str(path), str(e).removeprefix(f"{path}: "))
            return
        # Undecodable bytes are carried as lone surrogates, so that a file cut into documents loses
        # only the documents that hold them.
        raw = strip_bom(data).decode("utf-8", errors="surrogateescape")
        # Windows line ends read as "\n", as Python's text mode reads them: `split_pattern` and the
        # paragraph breaks that `chunk_chars` cuts at see the same text whatever wrote the file.
        text = raw.replace("\r\n", "\n")
        parts = re.split(split_pattern, text) if split_pattern else [text]
        if chunk_chars:
            parts = [chunk for part in parts for chunk in chunk_text(part, chunk_chars)]
        whole = len(parts) == 1
        for i, part in enumerate(parts):
            where = str(path) if whole else f"{path}#{i}"
            if _UNDECODABLE.search(part):
                within = raw if whole else part  # a whole file: the offset on disk
                at = len(within[: _UNDECODABLE.search(within).start()].encode("utf-8", errors="surrogateescape"))
                of = "" if whole else " of this document"
                yield Rejected(
                    source, where, f"invalid UTF-8 at byte {at}{of}", _clip(part.encode(errors="surrogateescape"))
                )
            elif whole or part.strip():
                metadata = {"file": str(path)} if whole else {"file": str(path), "part": i}
                yield Document(id=where, text=part, source=source, metadata=metadata)
        return
    if name.endswith(".json"):
        yield from _read_json_array(path, text_field, id_field, source)
        return
    if part is None:
        first, lines = 1, _open_lines(path)
    elif "lines" in part:  # a compressed file's lines [first, end): decompress and skip the ones before
        first, end = part["lines"]
        lines = itertools.islice(_open_lines(path), first - 1, end - 1)
    else:
        first, lines = part["line"], _jsonl_range_lines(path, part["start"], part["end"])
    line_no = first - 1
    try:
        for line_no, line in enumerate(lines, start=first):
            if line_no == 1:
                line = strip_bom(line)
            if line.strip():
                yield _parse_line(line, path, line_no, text_field, id_field, source)
    except Exception as e:
        if not _stream_error(e):
            raise
        yield Rejected(source, f"{path}:{line_no + 1}", f"truncated or corrupt stream: {e}")


def chunk_text(text: str, max_chars: int) -> list[str]:
    """`text` in consecutive pieces of at most `max_chars` characters that join back to it exactly,
    each cut after a blank line where one falls in the window, else after a line end, else hard."""
    chunks = []
    while len(text) > max_chars:
        window, floor = text[:max_chars], max_chars // 4  # a cut leaves at least a quarter of a piece
        cut = next((window.rfind(sep) + len(sep) for sep in ("\n\n", "\n") if window.rfind(sep) >= floor), max_chars)
        chunks.append(text[:cut])
        text = text[cut:]
    return [*chunks, text] if text or not chunks else chunks


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _parse_line(line: bytes, path, line_no, text_field, id_field, source) -> Document | Rejected:
    where = f"{path}:{line_no}"
    try:
        text_line = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return Rejected(source, where, f"invalid UTF-8 at byte {e.start}", _clip(line))
    try:
        record = json.loads(text_line)
    except json.JSONDecodeError as e:
        return Rejected(source, where, f"malformed JSON: {json_error(e)}", _clip(text_line))
    except RecursionError:  # valid JSON nested deeper than Python's parser goes
        return Rejected(source, where, "malformed JSON: nested too deeply to parse", _clip(text_line))
    return _from_record(record, where, text_field, id_field, source, {"file": str(path), "line": line_no})


def _json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words (null, a number, an object with keys [...])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, dict):
        return f"an object with keys {list(value)[:8]}"
    return {str: "a string", list: "a list"}.get(type(value), type(value).__name__)


def _from_record(record, where, text_field, id_field, source, provenance) -> Document | Rejected:
    if isinstance(record, str):  # a list of texts (or a JSON string per line): each one a document
        return Document(id=where, text=record, source=source, metadata=dict(provenance))
    if not isinstance(record, dict):
        got = _json_kind(record)
        shown = _clip(json.dumps(record, ensure_ascii=False, default=str))
        return Rejected(source, where, f"expected a JSON object (a record) or a string (a text), got {got}", shown)
    if text_field not in record:
        return Rejected(source, where, f"missing field {text_field!r}", _clip(json.dumps(record, ensure_ascii=False)))
    text = record[text_field]
    if text is None:
        return Rejected(source, where, f"field {text_field!r} is null", _clip(json.dumps(record, ensure_ascii=False)))
    if isinstance(text, list) and all(isinstance(t, str) for t in text):
        text = "\n".join(text)
    if not isinstance(text, str):
        return Rejected(source, where, f"field {text_field!r} is {type(text).__name__}, not a string", "")
    # Valid JSON may escape a lone surrogate ("\ud800"), which no UTF-8 text can hold: it becomes
    # U+FFFD, as an undecodable byte would, so the document survives to be written.
    text = _LONE_SURROGATE.sub("\ufffd", text)
    doc_id = record.get(id_field) if id_field else None
    doc_id = str(doc_id) if doc_id is not None else where
    metadata = {k: v for k, v in record.items() if k not in (text_field, id_field)}
    metadata.update(provenance)  # provenance keys (file, line/row/index) never reuse a record's own field names
    return Document(id=doc_id, text=text, source=str(record.get("source", source)), metadata=metadata)


def _read_json_array(path: Path, text_field, id_field, source):
    try:
        records = json.loads(strip_bom(path.read_bytes()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        yield Rejected(source, str(path), f"unreadable JSON file: {e}")
        return
    except RecursionError:
        yield Rejected(source, str(path), "unreadable JSON file: nested too deeply to parse")
        return
    if not isinstance(records, list):
        got = _json_kind(records)
        yield Rejected(source, str(path), f"a .json input must hold a list of records or texts, got {got}")
        return
    for i, record in enumerate(records):
        yield _from_record(record, f"{path}:{i}", text_field, id_field, source, {"file": str(path), "index": i})


def _read_parquet(path: Path, text_field, id_field, source, part: dict | None = None):
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as e:
        yield Rejected(source, str(path), f"unreadable parquet: {e}")
        return
    if text_field not in table.schema_arrow.names:
        names = ", ".join(repr(n) for n in table.schema_arrow.names)  # a parenthesis: the report groups the rest
        yield Rejected(source, str(path), f"missing column {text_field!r} (its columns are {names})")
        return
    # A row group at a time: a corrupt one costs its own rows, not the rest of the file.
    row = part["row"] if part else 0
    for group in range(*(part["groups"] if part else [0, table.num_row_groups])):
        end = row + table.metadata.row_group(group).num_rows
        try:
            for batch in table.iter_batches(row_groups=[group]):
                for record in batch.to_pylist():
                    row += 1
                    provenance = {"file": str(path), "row": row}
                    yield _from_record(record, f"{path}:{row}", text_field, id_field, source, provenance)
        except Exception as e:
            where = f"{path}:{row + 1}-{end}"
            yield Rejected(source, where, f"corrupt parquet data (row group {group}, rows {row + 1}-{end}): {e}")
        row = end


def read_hf_dataset(
    name: str, split: str = "train", text_field: str = "text", id_field: str | None = "id", **kwargs
) -> Iterator[Document | Rejected]:
    """Stream documents from HF `datasets` (a hub name, or a local builder like "json" with
    data_files=...). Needs network for hub datasets; tested on local files."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"HF dataset {name!r}: needs HF datasets; `pip install datasets`") from None

    ds = datasets.load_dataset(name, split=split, streaming=True, **kwargs)
    source = kwargs.get("data_files") and Path(str(kwargs["data_files"])).stem or name.replace("/", "_")
    for i, record in enumerate(ds):
        yield _from_record(record, f"{name}:{split}:{i}", text_field, id_field, source, {"dataset": name, "index": i})
