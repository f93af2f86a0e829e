"""JSON lines, plain or gz/zst-compressed: one record a line."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path

from marinlm.data.readers.base import Document, Rejected, _clip, _from_record, _open_lines, _stream_error
from marinlm.data.readers.parts import _jsonl_range_lines
from marinlm.utils.io import json_error, strip_bom


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


def read_jsonl(
    path: Path, text_field: str, id_field: str | None, source: str, part: dict | None = None
) -> Iterator[Document | Rejected]:
    """The records of a .jsonl(.gz/.zst) file, or of one `part` of it (parts.input_parts)."""
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
