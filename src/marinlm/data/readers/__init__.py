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

One module a format (as datatrove's `pipeline/readers/`); `read_documents` picks by suffix.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from marinlm.data.readers.base import (
    COMPRESSED_TEXT_SUFFIXES,
    SUFFIXES,
    TEXT_SUFFIXES,
    Document,
    Rejected,
    TruncatedStream,
    decompressed,
    document_location,
)
from marinlm.data.readers.hf import read_hf_dataset
from marinlm.data.readers.json_array import read_json_array
from marinlm.data.readers.jsonl import read_jsonl
from marinlm.data.readers.parquet import read_parquet
from marinlm.data.readers.parts import MAX_COMPRESSED_PARTS, input_parts, whole_file_reason
from marinlm.data.readers.text import chunk_text, read_text_file

__all__ = [
    "COMPRESSED_TEXT_SUFFIXES",
    "MAX_COMPRESSED_PARTS",
    "SUFFIXES",
    "TEXT_SUFFIXES",
    "Document",
    "Rejected",
    "TruncatedStream",
    "chunk_text",
    "decompressed",
    "document_location",
    "input_parts",
    "read_documents",
    "read_hf_dataset",
    "whole_file_reason",
]


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
        yield from read_parquet(path, text_field, id_field, source, part)
        return
    if name.endswith(TEXT_SUFFIXES + COMPRESSED_TEXT_SUFFIXES):
        yield from read_text_file(path, source, split_pattern, chunk_chars)
        return
    if name.endswith(".json"):
        yield from read_json_array(path, text_field, id_field, source)
        return
    yield from read_jsonl(path, text_field, id_field, source, part)
