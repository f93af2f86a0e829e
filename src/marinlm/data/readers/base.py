"""The record types every reader yields, the suffixes read, and the byte-level helpers they share."""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


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
